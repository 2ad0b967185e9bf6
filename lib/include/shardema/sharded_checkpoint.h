#pragma once
// Sharded checkpoints: the per-rank EMA state of a ShardedAverager as a
// folder (DESIGN.md section 5), and the offline tools over such folders.
//
//   save      saveCheckpoint(comm, dir, averager)   every rank, collectively
//   load      loadCheckpoint(dir, averager)         each rank its own file
//   inspect   inspectCheckpoint(dir)                check everything, load nothing
//   export    exportCheckpoint(dir, file)           one deployable file of full tensors
//   reshard   reshardCheckpoint(dir, newDir, W)     the same checkpoint for W ranks
//   profiles  checkpointSchedules(dir)              one schedule per EMA profile
//
// The folder holds one safetensors file per rank, named uniquely per save
// (rank_{r:05d}.step_{step}.{saveId:016x}.safetensors), so a failed or
// crashed save leaves the previous checkpoint complete and loadable; each
// holds that rank's EMA pieces (the elements of its ShardSpec ranges: a
// per-rank tensor in rank 0's file alone, whole, empty in the others) as
// 1-D tensors under their global names plus
// the Averager state metadata and shardema.rank / world_size /
// layout_fingerprint. manifest.json, written last, names the files with
// their sizes and XXH64 checksums: a folder without a valid manifest holds
// no checkpoint. The offline tools read in pieces of at most bufferBytes,
// so their memory does not grow with the model, and never communicate.
// File-level pieces (rank file names, the manifest file) are in
// detail/rank_manifest.h.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "shardema/core/decay_schedule.h"
#include "shardema/shard/shard_layout.h"

namespace shardema {

/// File name of the manifest inside a checkpoint folder (what tells a
/// per-rank checkpoint folder apart from other folders).
constexpr const char* kManifestFileName = "manifest.json";

namespace shard {
class Communicator;
}  // namespace shard
// Declared only: the manifest parser (and its fuzz target) needs no ATen.
class ShardedAverager;

/// One rank's committed file as the manifest records it.
struct RankFileRecord {
  int64_t rank = 0;
  /// File name inside the folder.
  std::string name;
  /// Bytes and XXH64 (seed 0) of the whole file.
  uint64_t size = 0;
  uint64_t checksum = 0;
};

/// What manifest.json says: the checkpoint's step, schedule, layout and
/// files. Example of its JSON:
///   {"format":1,"kind":"sharded_averager_state","step":1200,
///    "schedule":{...DecaySchedule::toJson()...},"world_size":2,
///    "layout":{...ShardLayout::toJson()...},"layout_fingerprint":"0123...",
///    "files":[{"rank":0,"name":"rank_00000.step_1200.0123456789abcdef.safetensors",
///              "size":4096,"xxh64":"89abcdef01234567"}, ...]}
struct RankManifest {
  int64_t step = 0;
  /// The schedule the ranks' Averagers use (no default constructor exists).
  DecaySchedule schedule = DecaySchedule::warmup();
  shard::ShardLayout layout;
  /// One per rank, in rank order (size = layout.worldSize()).
  std::vector<RankFileRecord> files;
  /// The other names of tied tensors (LocalShard::aliases), by the layout
  /// name they alias: exportCheckpoint writes the tensor under each too.
  /// In the JSON as "aliases": {"emb.weight": ["head.weight"]}, written only
  /// when there are some (a manifest without the key has none).
  std::map<std::string, std::vector<std::string>> aliases;
  /// The layout tensors no state_dict key holds (LocalShard::persistent
  /// false, e.g. a rotary inv_freq): loads restore them, exportCheckpoint
  /// leaves them out. In the JSON as "non_persistent": ["rope.inv_freq"],
  /// written only when there are some.
  std::set<std::string> nonPersistent;

  int64_t worldSize() const { return static_cast<int64_t>(files.size()); }

  /// The JSON text above (layout fingerprint included).
  std::string toJson() const;
  /// Parses and validates toJson() output: format 1, kind, types, a layout
  /// whose fingerprint matches the recorded one, integers in range (step and
  /// sizes of at most INT64_MAX), one file per rank with a rank file name of
  /// that rank, aliases of layout tensors that name nothing else
  /// (checkTensorAliases), non-persistent names of layout tensors.
  /// c10::ValueError "<source>: <what is wrong>".
  static RankManifest fromJson(const std::string& text, const std::string& source = "manifest");
};

/// Checks tied tensors' other names against `layout`: each key a tensor of
/// it, each alias a non-empty name that is no tensor's and no other
/// alias's. c10::ValueError "<source>: ..." naming the name.
void checkTensorAliases(const shard::ShardLayout& layout,
                        const std::map<std::string, std::vector<std::string>>& aliases,
                        const std::string& source);

// --- save and load ---

/// Collective (every rank calls it): rank 0 creates the folder and picks
/// this save's file names, every rank writes its file, rank 0 writes the
/// manifest (replacing an old one atomically) and then removes rank files
/// the new manifest does not name; every rank returns once the checkpoint
/// exists. If any rank fails (any exception, including a communicator /
/// averager mismatch or rank 0's folder creation), no manifest is written,
/// an old checkpoint stays as it was, and every rank promptly throws
/// c10::Error naming the failed ranks. Blocks (bounded by the
/// communicator's timeout only when a rank never calls or dies).
void saveCheckpoint(shard::Communicator& comm, const std::string& dir,
                    const ShardedAverager& averager);

/// The same for a job whose ranks all live in this process (tests, a
/// single-process tool): averagers[r] must be rank r, all with one layout
/// and one step (c10::ValueError otherwise). A failure before the manifest's
/// rename leaves an old checkpoint as it was. Blocks.
void saveCheckpoint(const std::string& dir, const std::vector<const ShardedAverager*>& averagers);

/// Loads this rank's state: the manifest must exist and have this
/// averager's world size and layout, or a layout that gives every rank the
/// same elements of every tensor (any layout at world size 1, where the one
/// rank holds everything: a checkpoint resharded to 1 rank loads into a
/// single process; FSDP2 and replicated, which split alike, at any);
/// c10::ValueError naming both layouts and pointing to `shardema export
/// --world-size` / reshardCheckpoint otherwise; this rank's file must have
/// the recorded size and checksum, metadata naming this rank, world size,
/// layout and the manifest's step, and exactly the layout's tensors with
/// this rank's sizes; its step and last decay must be in range. Errors name
/// the file (and tensor or key). A kPerRank tensor comes from rank 0's file
/// on every rank (rank 0's copy is the checkpoint's; each of its tensors
/// read is checked against its own checksum, and its metadata must name
/// rank 0 of the manifest). Then Averager::loadState (strict). A
/// failed load changes nothing.
void loadCheckpoint(const std::string& dir, ShardedAverager& averager);

// --- offline tools (no communication) ---

/// Checks a checkpoint completely without loading it: the manifest; every
/// rank file's size and XXH64; every rank file's metadata (shardema.rank,
/// world_size, layout_fingerprint and step agree with the manifest, the
/// Averager state's keys pass checkAveragerStateMetadata of averager.h) and
/// tensors (exactly the layout's, 1-D of the rank's size, one dtype per
/// tensor across ranks; with several EMA profiles, each further profile's
/// copy of every averaged tensor (by the saved shardema.roles) and nothing
/// else, and shardema.profiles and the averaged tensors the same on every
/// rank as on rank 0); then every tensor's data against its own checksum
/// (shardema.xxh64, the check loadCheckpoint makes; one streaming read of
/// every file), which a file rewritten together with its manifest record
/// still fails. Returns the manifest. c10::ValueError naming the file and
/// the tensor or key. This is what export and reshard check first, before
/// they write anything.
RankManifest inspectCheckpoint(const std::string& dir);

struct ExportOptions {
  /// dtype of floating tensors in the output: float32 (default), bfloat16
  /// or float16. Integer/bool tensors (copied buffers) keep theirs.
  c10::ScalarType outputDtype = c10::ScalarType::Float;
  /// Bound on the elements' bytes read per piece (source dtype); memory use
  /// is about twice this. Default 8 MiB. Larger: fewer, larger reads and
  /// appends (faster on storage with high per-call cost); costs about twice
  /// that in host memory. Smaller saves memory and costs calls.
  int64_t bufferBytes = int64_t{8} << 20;
  /// exportCheckpoint only. Unset (default): one file. Set (>= 1): the
  /// output is a folder in Hugging Face's layout, files of at most this
  /// many bytes of tensor data (ShardedAverager::exportWeights says how).
  /// Smaller files upload and load in parallel; a tensor larger than the
  /// limit still gets a file of its own.
  std::optional<int64_t> maxShardBytes;
  /// exportCheckpoint only: the EMA profile written (an Averager of
  /// moreSchedules, Python's EMA(schedules=[...]) / beta=[...], keeps
  /// several; checkpointSchedules lists them): its tensors (copies are shared
  /// by every profile) and its schedule in shardema.schedule, what
  /// ShardedAverager::exportWeights(..., profile) writes. Default 0.
  /// c10::IndexError naming it and the count when the checkpoint has no
  /// such profile. Reshards keep every profile.
  int profile = 0;
};

/// One schedule per EMA profile of the checkpoint in `dir`, profile 0
/// first (Python's EMA.schedules; one for an Averager without
/// moreSchedules), from rank 0's file (shardema.profiles). Reads the
/// manifest and rank 0's header only (inspectCheckpoint checks that every
/// rank agrees); c10::ValueError naming the file when they do not read.
std::vector<DecaySchedule> checkpointSchedules(const std::string& dir);

/// What an offline tool wrote.
struct ExportSummary {
  int64_t step = 0;
  int64_t tensors = 0;
  uint64_t bytes = 0;
  /// Files written: 1 for one file, the set's size with maxShardBytes (a
  /// reshard: the rank files).
  int64_t files = 1;
};

/// Merges an inspected checkpoint into one deployable safetensors file of
/// full tensors (global names and shapes, layout order), streaming tensor by
/// tensor, each tensor with aliases (RankManifest::aliases) again under
/// each, read again from the rank files. Metadata: format=pt,
/// shardema.kind=deployable_weights, shardema.step,
/// shardema.schedule, shardema.source_world_size. The checkpoint is
/// checked as inspectCheckpoint does (tensor checksums included) before
/// `outFile` is opened: a failed check writes nothing. Crash-safe: on any
/// error an existing `outFile` is left byte-identical (with
/// options.maxShardBytes `outFile` is a folder, and its old set of files
/// is left as it was). Blocks.
ExportSummary exportCheckpoint(const std::string& dir, const std::string& outFile,
                               ExportOptions options = {});

/// Writes a checkpoint for `target` (same tensors, names, shapes, dtypes
/// and order as the source layout, any world size; every EMA profile) into `outDir` (created
/// if missing; must not be or lie inside `dir`): for each new rank, the
/// elements of its ranges read from the old ranks' files, once the source
/// passed inspectCheckpoint's checks (nothing is written otherwise). An old
/// checkpoint in `outDir` stays valid until the new manifest replaces it; on
/// failure the files this call wrote are removed (and `outDir`, if this call
/// created it and left it empty). Loading it on target.worldSize() ranks
/// gives what a gather of the source followed by a scatter would.
/// options.outputDtype is ignored (states keep their dtypes). Blocks.
ExportSummary reshardCheckpoint(const std::string& dir, const std::string& outDir,
                                const shard::ShardLayout& target, ExportOptions options = {});
/// The largest newWorldSize reshardCheckpoint accepts for the checkpoint in
/// `dir`: its largest tensor's element count (at least 1). Reads the
/// manifest only; c10::ValueError when `dir` holds no valid one.
int64_t maxReshardWorldSize(const std::string& dir);
/// reshardCheckpoint to shard::relayout(source layout, newWorldSize).
/// newWorldSize must be in [1, the largest tensor's element count]
/// (c10::ValueError): a larger job would leave ranks without a single
/// element of any sharded tensor, and is almost surely a typo that would
/// write that many files.
ExportSummary reshardCheckpoint(const std::string& dir, const std::string& outDir,
                                int64_t newWorldSize, ExportOptions options = {});

}  // namespace shardema
