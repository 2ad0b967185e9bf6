#pragma once
// Helpers shared by the sharded_*.cpp files (not installed).
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shardema/core/decay_schedule.h"
#include "shardema/core/file_metadata.h"
#include "shardema/shard/gather.h"
#include "shardema/shard/shard_layout.h"
#include "shardema/sharded_averager.h"

namespace shardema {
namespace detail {

/// dir + "/" + name (no doubled slash).
std::string joinPath(const std::string& dir, const std::string& name);
/// create_directories; c10::Error naming `api` and the folder on failure.
void ensureDirectory(const std::string& dir, const char* api);
/// Refuses an export destination inside a checkpoint folder (one holding
/// manifest.json): writing there would replace the manifest or a rank file
/// and lose the checkpoint. c10::ValueError naming `api`, the path and the
/// folder.
void checkExportDestination(const std::string& path, const char* api);
/// The message of the exception in flight (call inside a catch): c10's
/// without backtrace, std::exception's what(), or "unknown exception".
std::string currentErrorMessage();
/// The same for a captured exception.
std::string errorMessage(const std::exception_ptr& error);
/// A rank file's metadata: the Averager state's plus shardema.rank,
/// shardema.world_size and shardema.layout_fingerprint.
std::map<std::string, std::string> rankMetadata(std::map<std::string, std::string> metadata,
                                                int64_t rank, const shard::ShardLayout& layout);

/// Checks that a rank file's metadata is the one `manifest` names for
/// `rank`: shardema.rank, shardema.world_size, shardema.layout_fingerprint
/// and shardema.step, each present and equal. c10::ValueError naming the
/// file, the key, what it holds and what the manifest records.
void checkRankMetadata(const std::string& path, const std::map<std::string, std::string>& metadata,
                       int64_t rank, int64_t worldSize, const std::string& layoutFingerprint,
                       int64_t step);

/// float32, bfloat16 or float16; c10::ValueError naming `api` otherwise.
void checkExportDtype(c10::ScalarType dtype, const char* api);

/// The dtype a stored tensor is written with when exporting as `dtype`:
/// floating tensors convert, integer/bool copies keep theirs.
c10::ScalarType exportedDtype(c10::ScalarType stored, c10::ScalarType dtype);

/// Metadata of an exported EMA's deployable weights file (DESIGN.md
/// section 5): detail::deployableMetadata with the schedule and world size it ran.
std::map<std::string, std::string> exportedMetadata(int64_t step, const DecaySchedule& schedule,
                                                    int64_t sourceWorldSize);

/// The part of `held` (1-D: `rank`'s local elements of `spec`, its
/// heldRange) that `rank` stands for in gathers and files (its rangeOf): a
/// view, all of it except under kPerRank, where rank 0's is all and the
/// others' is empty.
at::Tensor rangeOfHeld(const shard::ShardSpec& spec, int64_t rank, const at::Tensor& held);

/// Elements per piece for a buffer bound of `bufferBytes` (at least 1).
int64_t elementsPerPiece(int64_t bufferBytes, c10::ScalarType dtype);

/// How exportPieces writes one tensor of the layout beyond its spec.
struct ExportedTensor {
  /// Its other names (LocalShard::aliases): the tensor is written again
  /// under each, right after it, from one full copy the root holds while
  /// it writes them.
  std::vector<std::string> aliases;
  /// LocalShard::splitDim: > 0 when the pieces are in the order of the
  /// tensor with this dim moved first (the spec's shape); the root then
  /// assembles it whole and writes it in its own order and shape.
  int64_t splitDim = 0;
};

/// The collective behind ShardedAverager::exportWeights, for any pieces of
/// `layout` (this rank's, layout order, 1-D CPU): options.root opens `path`
/// first and tells every rank whether it could, the pieces are gathered
/// into it (floating ones written as `dtype`), and the root's commit
/// outcome is broadcast, so every rank returns or throws together. A
/// non-empty options.localError fails every rank before anything moves.
/// `api` names the caller in errors. `tensors`: one per spec, or empty for
/// none with aliases. `maxShardBytes`: `path` is a folder of files of at
/// most that many bytes in Hugging Face's layout (DeployableWriter).
/// `untracked`: whole tensors the root writes among the gathered ones
/// (ShardedAverager::exportWeights).
void exportPieces(shard::Communicator& comm, const std::string& path,
                  const shard::ShardLayout& layout, const std::vector<at::Tensor>& pieces,
                  c10::ScalarType dtype, const std::map<std::string, std::string>& metadata,
                  shard::GatherOptions options, const char* api,
                  const std::vector<ExportedTensor>& tensors = {},
                  std::optional<int64_t> maxShardBytes = std::nullopt,
                  const std::vector<UntrackedTensor>& untracked = {});

}  // namespace detail
}  // namespace shardema
