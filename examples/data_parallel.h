#pragma once
// What DDP does between backward and the optimizer step, written out with
// shardema's c10d communicator: average the gradients over the ranks (one
// flat all-reduce) and keep the buffers in step by broadcasting rank 0's
// (DDP's broadcast_buffers), so every rank holds the same replicated model.
#include <torch/nn/module.h>

#include "shardema/shard/communicator.h"

namespace shardema::demo {

/// Sums every parameter's gradient and `localLoss` over the ranks in one
/// all-reduce, divides by the world size and writes the gradients back.
/// Returns the mean loss over the ranks. Collective.
double averageGradients(shard::Communicator& comm, torch::nn::Module& module, double localLoss);

/// Rank 0's floating buffers (BatchNorm running statistics) replace every
/// other rank's, in one broadcast. Collective.
void broadcastBuffers(shard::Communicator& comm, torch::nn::Module& module);

}  // namespace shardema::demo
