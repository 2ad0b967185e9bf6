#include "demo_task.h"

#include <ATen/CPUGeneratorImpl.h>

namespace shardema::demo {

RegressionTask::RegressionTask(const TaskOptions& options) : options_(options) {
  torch::manual_seed(options.seed);
  w1_ = torch::randn({options.inputs, 32}) / std::sqrt(static_cast<double>(options.inputs));
  w2_ = torch::randn({32, 1}) / std::sqrt(32.0);
  heldOutX_ = torch::randn({4096, options.inputs});
  heldOutY_ = teacher(heldOutX_);
}

torch::Tensor RegressionTask::teacher(const torch::Tensor& x) const {
  return torch::tanh(x.matmul(w1_)).matmul(w2_) * 2.0;
}

std::pair<torch::Tensor, torch::Tensor> RegressionTask::trainBatch(int64_t index, int64_t size) {
  // A private generator per batch keeps the data independent of how many
  // random numbers the model or optimizer drew.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed * 1000003 + index + 1);
  torch::Tensor x = at::randn({size, options_.inputs}, generator);
  torch::Tensor noise = at::randn({size, 1}, generator) * options_.labelNoise;
  return {x, teacher(x) + noise};
}

StudentImpl::StudentImpl(int64_t inputs, int64_t width) {
  fc1 = register_module("fc1", torch::nn::Linear(inputs, width));
  norm = register_module("norm", torch::nn::BatchNorm1d(width));
  fc2 = register_module("fc2", torch::nn::Linear(width, width));
  head = register_module("head", torch::nn::Linear(width, 1));
}

torch::Tensor StudentImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = torch::relu(norm(fc1(x)));
  return head(torch::relu(fc2(h)));
}

double heldOutLoss(Student& model, const RegressionTask& task) {
  torch::NoGradGuard noGrad;
  model->eval();
  const double loss =
      torch::mse_loss(model->forward(task.heldOutInputs()), task.heldOutTargets()).item<double>();
  model->train();
  return loss;
}

}  // namespace shardema::demo
