#include "shardema/ema_callback.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

#include "shardema/module_tracking.h"
#include "support/temp_dir.h"
#include "support/training_loop.h"

namespace shardema {
namespace {

using testing::LoopShape;
using testing::TestNet;

// VersatIL warmup defaults, written out independently of DecaySchedule.
double versatilDecay(int64_t globalStep) {
  const double e = std::max<double>(0.0, globalStep - 1.0);
  return e <= 0 ? 0.0 : std::min(0.9999, 1.0 - std::pow(1.0 + e, -0.75));
}

torch::optim::SGD makeSgd(TestNet& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05));
}

TEST(EmaCallbackTest, UpdatesOnlyWhenTheOptimizerStepped) {
  torch::manual_seed(0);
  TestNet net;
  auto sgd = makeSgd(net);
  EmaCallback callback;
  callback.onFitStart(*net);
  int64_t globalStep = 0;
  LoopShape shape;
  shape.batchesPerEpoch = 10;
  shape.accumulate = 4;
  const auto updated = testing::trainEpoch(net, sgd, callback, 0, globalStep, shape);
  EXPECT_EQ(updated, (std::vector<int64_t>{3, 7, 9}));
  EXPECT_EQ(callback.averager().step(), 3);
  EXPECT_DOUBLE_EQ(callback.decay(), versatilDecay(3));
}

TEST(EmaCallbackTest, AveragesTrainableWeightsAndCopiesTheRest) {
  torch::manual_seed(1);
  TestNet net;
  auto sgd = makeSgd(net);
  EmaCallback callback;
  callback.onFitStart(*net);
  // float64 shadow of fc2.weight updated with the reference formula.
  torch::Tensor reference = net->fc2->weight.detach().to(torch::kDouble).clone();
  int64_t globalStep = 0;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    LoopShape shape;
    shape.accumulate = 1;
    for (int64_t b = 0; b < shape.batchesPerEpoch; ++b) {
      LoopShape one = shape;
      one.batchesPerEpoch = 1;
      testing::trainEpoch(net, sgd, callback, epoch * 10 + b, globalStep, one);
      const double d = versatilDecay(globalStep);
      reference = d * reference + (1 - d) * net->fc2->weight.detach().to(torch::kDouble);
    }
  }
  const Averager& ema = callback.averager();
  EXPECT_TRUE(torch::allclose(ema.ema("fc2.weight").to(torch::kDouble), reference, 0, 1e-6));
  EXPECT_FALSE(ema.ema("fc2.weight").equal(net->fc2->weight));
  EXPECT_TRUE(ema.ema("frozen").equal(net->frozen));
  EXPECT_TRUE(ema.ema("scale").equal(net->scale));
  EXPECT_TRUE(ema.ema("bn.running_mean").equal(net->bn->running_mean));
  EXPECT_TRUE(ema.ema("bn.weight").equal(net->bn->weight));
  EXPECT_TRUE(ema.ema("bn.num_batches_tracked").equal(net->bn->num_batches_tracked));
}

TEST(EmaCallbackTest, CheckpointWeightsAreTheEmaAndRawWeightsAreKept) {
  torch::manual_seed(2);
  TestNet net;
  auto sgd = makeSgd(net);
  EmaCallback callback;
  callback.onFitStart(*net);
  int64_t globalStep = 0;
  testing::trainEpoch(net, sgd, callback, 0, globalStep);
  TrainingCheckpoint checkpoint = TrainingCheckpoint::capture(*net);
  callback.onSaveCheckpoint(checkpoint);
  ASSERT_EQ(checkpoint.rawWeights.size(), testing::testNetNames().size());
  for (const auto& [name, tensor] : checkpoint.weights) {
    EXPECT_TRUE(tensor.equal(callback.averager().ema(name))) << name;
  }
  const NamedTensors live = moduleTensors(*net);
  for (size_t i = 0; i < live.size(); ++i) {
    EXPECT_EQ(checkpoint.rawWeights[i].first, live[i].first);
    EXPECT_TRUE(checkpoint.rawWeights[i].second.equal(live[i].second)) << live[i].first;
  }
}

// Interrupt after epoch 1, save to a file, resume into a differently
// initialised model: the rest of training must match an uninterrupted run
// bit for bit (plain SGD has no optimizer state to carry).
TEST(EmaCallbackTest, InterruptedAndResumedRunIsBitIdentical) {
  testing::TempDir dir;
  torch::manual_seed(3);
  TestNet straight;
  auto straightSgd = makeSgd(straight);
  EmaCallback straightEma;
  straightEma.onFitStart(*straight);
  int64_t straightStep = 0;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    testing::trainEpoch(straight, straightSgd, straightEma, epoch, straightStep);
  }

  torch::manual_seed(3);
  TestNet first;
  auto firstSgd = makeSgd(first);
  EmaCallback firstEma;
  firstEma.onFitStart(*first);
  int64_t step = 0;
  testing::trainEpoch(first, firstSgd, firstEma, 0, step);
  TrainingCheckpoint saved = TrainingCheckpoint::capture(*first);
  firstEma.onSaveCheckpoint(saved);
  saved.metadata["global_step"] = std::to_string(step);
  saved.save(dir.file("ckpt.safetensors"));

  torch::manual_seed(99);
  TestNet resumed;
  auto resumedSgd = makeSgd(resumed);
  EmaCallback resumedEma;
  const TrainingCheckpoint loaded = TrainingCheckpoint::load(dir.file("ckpt.safetensors"));
  resumedEma.onLoadCheckpoint(*resumed, loaded);
  resumedEma.onFitStart(*resumed);
  int64_t resumedStep = std::stoll(loaded.metadata.at("global_step"));
  EXPECT_EQ(resumedEma.averager().step(), resumedStep);
  for (int64_t epoch = 1; epoch < 3; ++epoch) {
    testing::trainEpoch(resumed, resumedSgd, resumedEma, epoch, resumedStep);
  }
  EXPECT_EQ(resumedStep, straightStep);
  const NamedTensors a = moduleTensors(*straight);
  const NamedTensors b = moduleTensors(*resumed);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(a[i].second.equal(b[i].second)) << "raw " << a[i].first;
    EXPECT_TRUE(straightEma.averager().ema(a[i].first).equal(resumedEma.averager().ema(a[i].first)))
        << "ema " << a[i].first;
  }
}

TEST(EmaCallbackTest, ValidationSwapsTheEmaInAndRawBackEvenWhenItThrows) {
  torch::manual_seed(4);
  TestNet net;
  auto sgd = makeSgd(net);
  EmaCallback callback;
  callback.onFitStart(*net);
  int64_t globalStep = 0;
  testing::trainEpoch(net, sgd, callback, 0, globalStep);
  testing::trainEpoch(net, sgd, callback, 1, globalStep);
  const NamedTensors raw = cloneModuleTensors(*net);
  try {
    EmaValidationScope scope(callback);
    EXPECT_TRUE(callback.emaSwappedIn());
    EXPECT_TRUE(net->fc1->weight.equal(callback.averager().ema("fc1.weight")));
    EXPECT_FALSE(net->fc1->weight.equal(raw[2].second));
    EXPECT_THROW(callback.onValidationStart(), c10::Error) << "no double swap";
    throw std::runtime_error("validation failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(callback.emaSwappedIn());
  const NamedTensors after = moduleTensors(*net);
  for (size_t i = 0; i < raw.size(); ++i) {
    EXPECT_TRUE(after[i].second.equal(raw[i].second)) << raw[i].first;
  }
}

TEST(EmaCallbackTest, LoggerGetsTheDecayEveryHundredSteps) {
  torch::manual_seed(5);
  TestNet net;
  EmaCallback callback;
  std::vector<std::pair<int64_t, double>> logged;
  callback.setDecayLogger([&](int64_t step, double decay) { logged.emplace_back(step, decay); });
  callback.onFitStart(*net);
  for (int64_t step = 1; step <= 250; ++step) callback.onTrainBatchEnd(step, step - 1, 1, false);
  ASSERT_EQ(logged.size(), 2u);
  EXPECT_EQ(logged[0].first, 100);
  EXPECT_DOUBLE_EQ(logged[0].second, versatilDecay(100));
  EXPECT_EQ(logged[1].first, 200);
}

TEST(EmaCallbackTest, HooksBeforeFitStartAndBadArguments) {
  TestNet net;
  EmaCallback callback;
  EXPECT_FALSE(callback.onTrainBatchEnd(1, 0, 1, false)) << "no EMA yet: nothing to do";
  EXPECT_THROW(callback.averager(), c10::Error);
  EXPECT_THROW(callback.onTrainBatchEnd(1, 0, 0, false), c10::ValueError);
  TrainingCheckpoint noRaw = TrainingCheckpoint::capture(*net);
  callback.onLoadCheckpoint(*net, noRaw);  // nothing to restore: a no-op
  callback.onFitStart(*net);
  EXPECT_EQ(callback.averager().step(), 0);
  EmaCallbackOptions bad;
  bad.schedule.power = 0;
  EXPECT_THROW(EmaCallback{bad}, c10::ValueError);
}

}  // namespace
}  // namespace shardema
