#pragma once
// A deterministic noisy-regression training loop driving an EmaCallback the
// way a Lightning trainer would (accumulation, last-batch flush).
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <vector>

#include "shardema/ema_callback.h"
#include "support/test_net.h"

namespace shardema::testing {

struct LoopShape {
  int64_t batchesPerEpoch = 5;
  int64_t accumulate = 2;
  int64_t batchSize = 16;
};

/// Inputs and targets of batch `batch` of epoch `epoch`: values are a pure
/// function of (epoch, batch, row, column), so every run sees the same data.
inline std::pair<torch::Tensor, torch::Tensor> batchData(int64_t epoch, int64_t batch,
                                                         int64_t rows) {
  torch::Tensor x = torch::empty({rows, 4});
  torch::Tensor y = torch::empty({rows, 1});
  for (int64_t r = 0; r < rows; ++r) {
    double target = 0;
    for (int64_t c = 0; c < 4; ++c) {
      const double v = std::sin(0.7 * (epoch * 131 + batch * 17 + r * 5 + c));
      x[r][c] = v;
      target += (c + 1) * v;
    }
    y[r][0] = target + 0.1 * std::cos(3.1 * (epoch * 7 + batch * 3 + r));
  }
  return {x, y};
}

/// Trains one epoch; returns the optimizer steps taken. `globalStep` counts
/// optimizer steps across epochs (Lightning's global_step).
inline std::vector<int64_t> trainEpoch(TestNet& net, torch::optim::SGD& optimizer,
                                       EmaCallback& callback, int64_t epoch, int64_t& globalStep,
                                       const LoopShape& shape = {}) {
  std::vector<int64_t> updatedAfterBatch;
  net->train();
  for (int64_t b = 0; b < shape.batchesPerEpoch; ++b) {
    const auto [x, y] = batchData(epoch, b, shape.batchSize);
    torch::Tensor loss = torch::nn::functional::mse_loss(net->forward(x), y) / shape.accumulate;
    loss.backward();
    const bool isLast = b == shape.batchesPerEpoch - 1;
    if ((b + 1) % shape.accumulate == 0 || isLast) {
      callback.onBeforeOptimizerStep();  // the last update must have read the weights
      optimizer.step();
      optimizer.zero_grad();
      ++globalStep;
    }
    if (callback.onTrainBatchEnd(globalStep, b, shape.accumulate, isLast)) {
      updatedAfterBatch.push_back(b);
    }
  }
  return updatedAfterBatch;
}

/// A model initialised from `seed`, its plain SGD optimizer (no state to
/// carry across a resume) and an EmaCallback, with the global step counter.
struct TrainingRun {
  explicit TrainingRun(uint64_t seed)
      : net(seededNet(seed)), sgd(net->parameters(), torch::optim::SGDOptions(0.05)) {}
  /// onFitStart on the model; separate so a test can load a checkpoint first.
  void fitStart() { callback.onFitStart(*net); }
  /// fitStart, then epochs 0 .. epochs - 1 of the default shape.
  void fit(int64_t epochs) {
    fitStart();
    for (int64_t e = 0; e < epochs; ++e) epoch(e);
  }
  std::vector<int64_t> epoch(int64_t index, const LoopShape& shape = {}) {
    return trainEpoch(net, sgd, callback, index, globalStep, shape);
  }

  TestNet net;
  torch::optim::SGD sgd;
  EmaCallback callback;
  int64_t globalStep = 0;

 private:
  static TestNet seededNet(uint64_t seed) {
    torch::manual_seed(seed);
    return TestNet();
  }
};

}  // namespace shardema::testing
