#pragma once
// Gather and scatter of sharded tensors over a Communicator (c10d). Every
// rank of the communicator must call the same function with the same
// layout; each call is a fixed sequence of collectives, so a rank that
// fails or dies makes the others fail within the communicator's timeout.
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
  /// model size. Default 64 MiB; smaller saves memory, costs latency.
  int64_t bufferBytes = int64_t{64} << 20;
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
/// of layout.specs[i] (numel = its range's size, any shape, contiguous CPU);
/// all ranks' locals[i] have one dtype, which the pieces keep. The sink runs
/// on the calling thread, only on receiving ranks. Blocks. c10::ValueError
/// for locals that do not match the layout (before any communication);
/// c10::Error naming the operation, tensor and rank when a collective fails
/// or times out.
void gatherStreaming(Communicator& comm, const ShardLayout& layout,
                     const std::vector<at::Tensor>& locals, const PieceSink& sink,
                     GatherOptions options = {});

/// gatherStreaming into full tensors of the global shapes (layout order) on
/// the receiving rank(s); an empty vector on the others.
std::vector<std::pair<std::string, at::Tensor>> gatherFull(Communicator& comm,
                                                           const ShardLayout& layout,
                                                           const std::vector<at::Tensor>& locals,
                                                           GatherOptions options = {});

/// The inverse: `full` (layout order, global shapes; needed on `root` only,
/// ignored elsewhere) is cut into every rank's range; returns this rank's
/// pieces as 1-D tensors of full's dtypes, layout order. Blocks. Bounded
/// like gatherStreaming (bufferBytes per round).
std::vector<at::Tensor> scatterFull(Communicator& comm, const ShardLayout& layout,
                                    const std::vector<at::Tensor>& full, int64_t root = 0,
                                    GatherOptions options = {});

}  // namespace shard
}  // namespace shardema
