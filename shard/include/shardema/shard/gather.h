#pragma once
// Gather and scatter of sharded tensors over a Communicator (c10d). Every
// rank of the communicator must call the same function with the same
// layout, root and bufferBytes; each call is a fixed sequence of
// collectives. A rank whose call or inputs are wrong (or that passes
// GatherOptions::localError) still joins the first exchange, so every rank
// fails at once with one c10::ValueError; only a rank that never calls, or
// dies, makes the others fail within the communicator's timeout.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "shardema/shard/shard_layout.h"

namespace shardema {
namespace shard {

class Communicator;

struct GatherOptions {
  /// Rank that receives the full tensors; -1: every rank does. Default 0.
  int64_t root = 0;
  /// Upper bound on the bytes one round moves into the receiving rank (all
  /// ranks' padded pieces together). A tensor larger than this is gathered
  /// in several rounds, so the receiver's memory stays bounded whatever the
  /// model size. Default 64 MiB. Larger: fewer rounds, so fewer collectives
  /// and their per-call latency; costs that much more memory on the
  /// receiving rank(s) (and in packing buffers on the senders). Every rank
  /// must pass the same value: it decides the rounds.
  int64_t bufferBytes = int64_t{64} << 20;
  /// Non-empty: this rank cannot take part (e.g. its own wait for the data
  /// failed), so it joins only the first exchange, moves no data and does
  /// not look at its locals / full tensors; every rank, this one included,
  /// then throws c10::ValueError naming "rank <r>: <localError>" (the first
  /// 4096 bytes) instead of the others waiting out the timeout. Default "":
  /// take part normally. The communicator stays usable.
  std::string localError;
};

/// One contiguous run of a full tensor: elements [elementOffset,
/// elementOffset + piece.numel()) of the flattened global tensor. `piece` is
/// a 1-D CPU tensor valid only during the call.
using PieceSink =
    std::function<void(const ShardSpec& spec, int64_t elementOffset, const at::Tensor& piece)>;

/// Streams every tensor of `layout`, in layout order, to the receiving
/// rank(s) in pieces of at most bufferBytes: for each tensor the pieces
/// arrive in increasing offset and cover [0, numel) exactly once (a tensor
/// with numel 0 gets one empty piece). locals[i] holds this rank's elements
/// of layout.specs[i] (numel = its range's size, any shape, contiguous CPU:
/// of a kPerRank tensor, rank 0 passes its whole copy and the others none,
/// so the receivers get rank 0's);
/// all ranks' locals[i] have one dtype, which the pieces keep. The sink runs
/// on the calling thread, only on receiving ranks. Blocks. c10::ValueError
/// on every rank, before any data moves, when some rank's locals do not
/// match the layout, its root or bufferBytes is invalid, its layout's world
/// size is not the communicator's, it passed options.localError (the
/// message names each such rank and its reason), or the ranks' layouts,
/// roots, bufferBytes or dtypes differ (naming the values); c10::Error
/// naming the operation, tensor and rank when a collective fails or times
/// out.
///
/// When the sink throws, it is not called again, but this rank still takes
/// part in the remaining rounds (their data is dropped) and then rethrows
/// the sink's exception: the other ranks finish normally instead of waiting
/// out the timeout, and the communicator stays usable. The other ranks are
/// not told; a caller that needs every rank to know must agree on success
/// itself afterwards (e.g. one small all-gather of a status).
///
/// Cost: one 40-byte all-gather of checks (layout, inputs, root,
/// bufferBytes, dtypes; one more of the messages when a rank failed), then
/// per round, to one root: one all-to-all; to every rank (root = -1): one
/// broadcast per owning rank, or one per piece where a rank's pieces
/// average >= 1 MiB (they then skip packing, and in gatherFull land
/// straight in the result). With Gloo these broadcasts beat one all-gather
/// of the same bytes (gather_bench, docs/performance.md).
void gatherStreaming(Communicator& comm, const ShardLayout& layout,
                     const std::vector<at::Tensor>& locals, const PieceSink& sink,
                     GatherOptions options = {});

/// gatherStreaming into full tensors of the global shapes (layout order) on
/// the receiving rank(s); an empty vector on the others. The results are
/// fresh tensors each call; beyond them, at most one round's buffer
/// (bufferBytes) is held.
std::vector<std::pair<std::string, at::Tensor>> gatherFull(Communicator& comm,
                                                           const ShardLayout& layout,
                                                           const std::vector<at::Tensor>& locals,
                                                           GatherOptions options = {});

/// The inverse: `full` (layout order, global shapes; needed on
/// options.root only, ignored elsewhere) is cut into every rank's range;
/// returns this rank's pieces as 1-D tensors of full's dtypes, layout
/// order: each ShardSpec::heldRange, so a kPerRank tensor comes whole to
/// every rank (one broadcast of it from rank 0 after the rounds). Blocks.
/// Bounded like gatherStreaming (bufferBytes per round; a kPerRank tensor
/// costs its size on every rank, as it does in the model).
/// options.root must name one rank (-1 is refused: one rank sends);
/// it, options.bufferBytes and options.localError are checked and agreed
/// on like gatherStreaming's.
std::vector<at::Tensor> scatterFull(Communicator& comm, const ShardLayout& layout,
                                    const std::vector<at::Tensor>& full,
                                    GatherOptions options = {});

}  // namespace shard
}  // namespace shardema
