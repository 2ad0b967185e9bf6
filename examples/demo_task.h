#pragma once
// The demo's synthetic task: a fixed random "teacher" MLP makes the targets,
// training labels carry heavy noise, held-out labels are clean. Noisy SGD
// then wanders around the optimum, which is what an EMA smooths out.
#include <torch/torch.h>

#include <cstdint>

namespace shardema::demo {

struct TaskOptions {
  int64_t inputs = 16;
  int64_t width = 64;
  double labelNoise = 0.5;
  uint64_t seed = 0;
};

class RegressionTask {
 public:
  explicit RegressionTask(const TaskOptions& options);
  /// A training batch: inputs and noisy targets, deterministic in `index`.
  std::pair<torch::Tensor, torch::Tensor> trainBatch(int64_t index, int64_t size);
  /// The held-out set: inputs and clean targets.
  const torch::Tensor& heldOutInputs() const { return heldOutX_; }
  const torch::Tensor& heldOutTargets() const { return heldOutY_; }
  int64_t inputs() const { return options_.inputs; }

 private:
  torch::Tensor teacher(const torch::Tensor& x) const;
  TaskOptions options_;
  torch::Tensor w1_, w2_;
  torch::Tensor heldOutX_, heldOutY_;
};

/// The student: inputs -> width -> width -> 1 with a BatchNorm, so the demo
/// exercises both averaged parameters and copied statistics.
struct StudentImpl : torch::nn::Module {
  StudentImpl(int64_t inputs, int64_t width);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Student);

/// Mean squared error of `model` on the held-out set, in eval mode.
double heldOutLoss(Student& model, const RegressionTask& task);

}  // namespace shardema::demo
