#pragma once
// Post-hoc EMA snapshot files (DESIGN.md section 5): one power-function profile
// at one step, `{folder}/{i}.{step}.safetensors`, or per rank
// `{folder}/rank_{r:05d}/{i}.{step}.safetensors` in sharded layout.
// Core only: no threads, no communication.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardema {

/// What a snapshot file says about itself (its metadata).
struct SnapshotInfo {
  /// Index of the EMA profile in the averager's profile list, >= 0.
  int64_t profileIndex = 0;
  /// Training step the snapshot was taken at, >= 1.
  int64_t step = 0;
  /// The profile's sigma_rel; must agree with gamma (gammaToSigmaRel).
  double sigmaRel = 0;
  /// The profile's power-function exponent, > 0 and finite.
  double gamma = 0;
  /// -1: full-copy layout (one file holds every tensor). >= 0: this
  /// rank's shard of a sharded snapshot.
  int64_t rank = -1;
  /// Sharded only: number of ranks (>= 1, > rank); 0 for full-copy layout.
  int64_t worldSize = 0;
  /// Sharded only: JSON text describing the shard layout (non-empty);
  /// stored and compared verbatim, not interpreted here.
  std::string layoutJson;
  /// Sharded only: the tensors whose data in this file is tensor
  /// parallelism's piece along dim d > 0 (torch.chunk's, in its own layout:
  /// a DTensor's to_local() under Shard(d)), by name. The layout's spec of
  /// such a tensor describes it with dim d moved first, whose rows of this
  /// rank hold the same elements in another order. Every other tensor's
  /// data is its spec's rows. Metadata shardema.split_dims, a JSON object
  /// {"name": d} written only when non-empty; each d >= 1.
  std::map<std::string, int64_t> splitDims;

  bool sharded() const { return rank >= 0; }
};

/// "{i}.{step}.safetensors", step not zero-padded (ema-pytorch's naming).
std::string snapshotFileName(int64_t profileIndex, int64_t step);

/// "rank_00003": the sharded layout's per-rank subfolder.
std::string rankFolderName(int64_t rank);

/// Parses "{i}.{step}.safetensors" strictly: both parts plain decimal digits
/// (no sign, no spaces, no leading zeros except "0" itself, no int64
/// overflow). Returns false and leaves the outputs untouched for any other
/// name. Outputs may be nullptr.
bool parseSnapshotFileName(const std::string& fileName, int64_t* profileIndex, int64_t* step);

/// The metadata written into a snapshot: shardema.format, shardema.kind =
/// posthoc_snapshot, shardema.sigma_rel and shardema.gamma (%.17g, so they
/// read back bit-exactly), shardema.step, shardema.profile_index; sharded
/// info adds shardema.rank, shardema.world_size, shardema.layout and, when
/// it has any, shardema.split_dims. Does not
/// validate `info` (writeSnapshot does).
std::map<std::string, std::string> snapshotMetadata(const SnapshotInfo& info);

/// Validates `info` (c10::ValueError naming the field), converts floating
/// tensors to contiguous float32 on the CPU (integer and bool tensors keep
/// their dtype) and writes them in the given order with snapshotMetadata,
/// crash-safely (writeTensorFile). The caller picks `path`; it should end in
/// snapshotFileName(info.profileIndex, info.step) or readSnapshotInfo will
/// refuse it. Blocks.
void writeSnapshot(const std::string& path,
                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                   const SnapshotInfo& info);

/// Reads only the header of a snapshot file and parses its metadata
/// strictly; c10::ValueError naming the file (and the key) when the file is
/// not a valid snapshot, a key is missing or garbled, or the file's name
/// disagrees with its step or profile index. Blocks.
SnapshotInfo readSnapshotInfo(const std::string& path);

/// One snapshot file found by scanSnapshotFolder.
struct SnapshotEntry {
  std::string path;
  SnapshotInfo info;
};

/// The snapshots of one folder.
struct SnapshotFolder {
  /// Whether the folder uses sharded (rank_NNNNN) layout.
  bool sharded = false;
  /// Sharded: the world size every file agrees on; 0 for full-copy layout.
  int64_t worldSize = 0;
  /// Full-copy layout: every snapshot, sorted by (step, profileIndex).
  std::vector<SnapshotEntry> snapshots;
  /// Sharded: index = rank; each sorted by (step, profileIndex), and all
  /// ranks hold the same (profileIndex, step) set.
  std::vector<std::vector<SnapshotEntry>> perRank;
};

/// Finds and validates the snapshots of `dir` (reading headers only).
/// Full-copy layout: every top-level "*.safetensors" must be a snapshot name;
/// other files and "*.tmp" leftovers of interrupted writes are ignored.
/// Sharded layout: rank_NNNNN subfolders for every rank 0..W-1, each file
/// naming its folder's rank and one world size, one layout per rank, and the
/// same (profileIndex, step) set on every rank. Also refused: a missing
/// folder, both layouts at once, two profiles with the same gamma at one
/// step, no snapshots. c10::ValueError naming the folder or file. Blocks.
SnapshotFolder scanSnapshotFolder(const std::string& dir);

/// The snapshots of one rank of a sharded folder, `{dir}/rank_{r:05d}/`,
/// sorted by (step, profileIndex), validated like scanSnapshotFolder does
/// per rank (every file names `rank`, one world size, one layout, distinct
/// gammas per step) but without looking at the other ranks' folders: what
/// a rank reads on its own when it synthesizes its shards. Empty when the
/// rank folder does not exist or holds no snapshot yet. Blocks.
std::vector<SnapshotEntry> scanRankSnapshots(const std::string& dir, int64_t rank);

}  // namespace shardema
