#include "data_parallel.h"

#include <torch/torch.h>

#include <vector>

namespace shardema::demo {

double averageGradients(shard::Communicator& comm, torch::nn::Module& module, double localLoss) {
  std::vector<torch::Tensor> grads;
  for (const torch::Tensor& p : module.parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad().reshape({-1}));
  }
  grads.push_back(torch::full({1}, localLoss, torch::kFloat));
  torch::Tensor flat = torch::cat(grads);
  comm.allReduceSum(flat, "gradients");
  flat.div_(static_cast<double>(comm.worldSize()));
  int64_t offset = 0;
  torch::NoGradGuard noGrad;
  for (const torch::Tensor& p : module.parameters()) {
    if (!p.grad().defined()) continue;
    const int64_t n = p.grad().numel();
    p.grad().copy_(flat.narrow(0, offset, n).view(p.grad().sizes()));
    offset += n;
  }
  return flat[offset].item<double>();
}

void broadcastBuffers(shard::Communicator& comm, torch::nn::Module& module) {
  std::vector<torch::Tensor> buffers;
  for (const torch::Tensor& b : module.buffers()) {
    if (b.is_floating_point()) buffers.push_back(b);
  }
  if (buffers.empty() || comm.worldSize() == 1) return;
  std::vector<torch::Tensor> flatParts;
  for (const torch::Tensor& b : buffers) flatParts.push_back(b.reshape({-1}).to(torch::kFloat));
  torch::Tensor flat = torch::cat(flatParts);
  comm.broadcast(flat, 0, "buffers");
  int64_t offset = 0;
  torch::NoGradGuard noGrad;
  for (torch::Tensor& b : buffers) {
    b.copy_(flat.narrow(0, offset, b.numel()).view(b.sizes()));
    offset += b.numel();
  }
}

}  // namespace shardema::demo
