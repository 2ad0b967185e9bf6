#pragma once
// A small module with every kind of tensor the tracking policies tell apart:
// trainable, frozen, BatchNorm parameters, float and integer buffers.
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

namespace shardema::testing {

struct TestNetImpl : torch::nn::Module {
  TestNetImpl() {
    frozen = register_parameter("frozen", torch::ones({3}), /*requires_grad=*/false);
    scale = register_buffer("scale", torch::full({1}, 0.5));
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2(torch::relu(bn(fc1(x)))) * scale + frozen.sum();
  }
  torch::Tensor frozen, scale;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(TestNet);

/// state_dict order of TestNet: own parameters, own buffers, then children.
inline std::vector<std::string> testNetNames() {
  return {"frozen",          "scale",          "fc1.weight",
          "fc1.bias",        "bn.weight",      "bn.bias",
          "bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
          "fc2.weight",      "fc2.bias"};
}

}  // namespace shardema::testing
