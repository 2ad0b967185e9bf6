#pragma once
// Per-rank EMA checkpoints of a ShardedAverager (DESIGN section 5) and the
// offline tools over them.
//
// A checkpoint is a folder: one safetensors file per rank,
// rank_{r:05d}.step_{step}.{saveId:016x}.safetensors (rank_manifest.h; names
// unique to each save, so a failed or crashed save leaves the previous
// checkpoint complete and loadable), holding that rank's EMA pieces as 1-D tensors
// under their global names (layout order, every tensor present, empty
// pieces included) plus the Averager state metadata (step, initialised
// flag, last decay, schedule, roles) and shardema.rank / world_size /
// layout_fingerprint; and manifest.json (rank_manifest.h), written last.
//
// The offline tools read rank files with TensorFileReader::readRange in
// pieces of at most bufferBytes, so their memory does not grow with the
// model, and never communicate.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "shardema/averager.h"
#include "shardema/detail/rank_manifest.h"
#include "shardema/shard/shard_layout.h"
#include "shardema/sharded_averager.h"

namespace shardema {

namespace shard {
class Communicator;
}  // namespace shard

// --- file level (no communication) ---

/// Writes this rank's file into `dir` (created if missing) crash-safely and
/// returns its record for the manifest. Waits for an update in flight.
/// Does not touch the manifest: see writeManifest / saveShardedCheckpoint.
/// The name is rankFileName(rank, step, newSaveId()).
RankFileRecord writeRankFile(const std::string& dir, const ShardedAverager& averager);
/// As above, as dir/`name` (isRankFileName(name, rank), c10::ValueError
/// otherwise).
RankFileRecord writeRankFile(const std::string& dir, const ShardedAverager& averager,
                             const std::string& name);

/// Everything rank 0 needs for the manifest except the file records.
RankManifest manifestFor(const ShardedAverager& averager);

/// Saves every rank of a job whose ranks live in this process (tests, a
/// single-process tool): writes each rank's file under this save's names,
/// then the manifest (its atomic rename replaces an old one), then removes
/// rank files the new manifest does not name (best effort). A failure
/// before the rename leaves an old checkpoint as it was. averagers[r] must be rank r, all with one
/// layout and one step (c10::ValueError otherwise). Blocks.
void saveShardedCheckpoint(const std::string& dir,
                           const std::vector<const ShardedAverager*>& averagers);

/// Loads this rank's state from a checkpoint folder: the manifest must
/// exist, have this averager's world size and layout (c10::ValueError naming
/// both layouts via ShardLayout::describe and pointing to `shardema export
/// --world-size` / reshardCheckpoint otherwise), and this rank's file must
/// have the recorded size and checksum and hold exactly the layout's tensors
/// with this rank's sizes (errors name the file and tensor). Then
/// Averager::loadState (strict). A failed load changes nothing.
void loadRankState(const std::string& dir, ShardedAverager& averager);

// --- online (collective: every rank calls it) ---

/// Rank 0 creates the folder and picks this save's file names, every rank
/// writes its file, the records are gathered to rank 0, which writes the
/// manifest (replacing an old one atomically) and then removes rank files
/// the new manifest does not name; every rank returns once the checkpoint
/// exists. If any rank fails (any exception, including a communicator /
/// averager mismatch or rank 0's folder creation), no manifest is written,
/// an old checkpoint stays as it was, and every rank promptly throws
/// c10::Error naming the failed ranks. Blocks (bounded by the
/// communicator's timeout only when a rank never calls or dies).
void saveShardedCheckpoint(shard::Communicator& comm, const std::string& dir,
                           const ShardedAverager& averager);

// --- offline tools ---

/// verifyCheckpoint plus every rank file opened and checked against the
/// layout (exactly its tensors, 1-D of the rank's size, one dtype per
/// tensor across ranks, the manifest's step): what the tools check before
/// they read. c10::ValueError naming the file and tensor.
RankManifest validateCheckpoint(const std::string& dir);

struct ExportOptions {
  /// dtype of floating tensors in the output: float32 (default), bfloat16
  /// or float16. Integer/bool tensors (copied buffers) keep theirs.
  c10::ScalarType outputDtype = c10::ScalarType::Float;
  /// Bound on the elements' bytes read per piece (source dtype); memory use
  /// is about twice this. Default 8 MiB. Larger: fewer, larger reads and
  /// appends (faster on storage with high per-call cost); costs about twice
  /// that in host memory. Smaller saves memory and costs calls.
  int64_t bufferBytes = int64_t{8} << 20;
};

/// What an offline tool wrote.
struct ExportSummary {
  int64_t step = 0;
  int64_t tensors = 0;
  uint64_t bytes = 0;
};

/// Merges a verified checkpoint into one deployable safetensors file of
/// full tensors (global names and shapes, layout order), streaming tensor by
/// tensor. Metadata: shardema.kind=deployable_weights, shardema.step,
/// shardema.schedule, shardema.source_world_size. Crash-safe: on any error
/// an existing `outFile` is left byte-identical. Blocks.
ExportSummary exportCheckpoint(const std::string& dir, const std::string& outFile,
                               ExportOptions options = {});

/// Writes a checkpoint for `target` (same tensors, names, shapes, dtypes
/// and order as the source layout, any world size) into `outDir` (created
/// if missing; must not be `dir`): for each new rank, the elements of its
/// ranges read from the old ranks' files that overlap them; then the
/// manifest (unique names as saveShardedCheckpoint; an old checkpoint in
/// `outDir` stays valid until the new manifest replaces it). Loading it on target.worldSize() ranks
/// with the target layout gives what a gather of the source followed by a scatter would.
/// options.outputDtype is ignored (states keep their dtypes). Blocks.
ExportSummary reshardCheckpoint(const std::string& dir, const std::string& outDir,
                                const shard::ShardLayout& target, ExportOptions options = {});
/// reshardCheckpoint to shard::relayout(source layout, newWorldSize).
ExportSummary reshardCheckpoint(const std::string& dir, const std::string& outDir,
                                int64_t newWorldSize, ExportOptions options = {});

}  // namespace shardema
