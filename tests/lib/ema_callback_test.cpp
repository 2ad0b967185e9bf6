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
using testing::TrainingRun;

// VersatIL warmup defaults, written out independently of DecaySchedule.
double versatilDecay(int64_t globalStep) {
  const double e = std::max<double>(0.0, globalStep - 1.0);
  return e <= 0 ? 0.0 : std::min(0.9999, 1.0 - std::pow(1.0 + e, -0.75));
}

TEST(EmaCallbackTest, UpdatesOnlyWhenTheOptimizerStepped) {
  TrainingRun run(0);
  run.fitStart();
  EmaCallback& callback = run.callback;
  LoopShape shape;
  shape.batchesPerEpoch = 10;
  shape.accumulate = 4;
  const auto updated = run.epoch(0, shape);
  EXPECT_EQ(updated, (std::vector<int64_t>{3, 7, 9}));
  EXPECT_EQ(callback.averager().step(), 3);
  EXPECT_DOUBLE_EQ(callback.decay(), versatilDecay(3));
}

// The one optimizer-step rule, written out case by case: the end of each
// window of `accumulate` batches, and the last batch of the epoch whatever
// window it ends.
TEST(EmaCallbackTest, OptimizerSteppedAtWindowEndsAndTheEpochsLastBatch) {
  struct Case {
    int64_t batchIdx, accumulate;
    bool isLast, stepped;
  };
  const Case cases[] = {{0, 1, false, true},  {0, 3, false, false}, {1, 3, false, false},
                        {2, 3, false, true},  {5, 3, false, true},  {6, 3, true, true},
                        {6, 3, false, false}, {3, 4, true, true},   {0, 4, true, true}};
  for (const Case& c : cases) {
    EXPECT_EQ(optimizerStepped(c.batchIdx, c.accumulate, c.isLast), c.stepped)
        << "batch " << c.batchIdx << ", accumulate " << c.accumulate << ", last " << c.isLast;
  }
  EXPECT_THROW(optimizerStepped(0, 0, false), c10::ValueError);
  EXPECT_THROW(optimizerStepped(-1, 1, true), c10::ValueError);
}

TEST(EmaCallbackTest, AveragesTrainableWeightsAndCopiesTheRest) {
  TrainingRun run(1);
  run.fitStart();
  TestNet& net = run.net;
  EmaCallback& callback = run.callback;
  // float64 shadow of fc2.weight updated with the reference formula.
  torch::Tensor reference = net->fc2->weight.detach().to(torch::kDouble).clone();
  int64_t changes = 0;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    LoopShape shape;
    shape.accumulate = 1;
    for (int64_t b = 0; b < shape.batchesPerEpoch; ++b) {
      LoopShape one = shape;
      one.batchesPerEpoch = 1;
      {
        // The frozen parameter and the float buffer move too, so "copied"
        // is told apart from "averaged" (which would lag behind).
        callback.onBeforeOptimizerStep();  // the sources change next
        torch::NoGradGuard noGrad;
        net->frozen.fill_(static_cast<double>(++changes));
        net->scale.fill_(0.5 + 0.01 * changes);
      }
      run.epoch(epoch * 10 + b, one);
      const double d = versatilDecay(run.globalStep);
      reference = d * reference + (1 - d) * net->fc2->weight.detach().to(torch::kDouble);
    }
  }
  const Averager& ema = callback.averager();
  EXPECT_TRUE(torch::allclose(ema.ema("fc2.weight").to(torch::kDouble), reference, 0, 1e-6));
  EXPECT_FALSE(ema.ema("fc2.weight").equal(net->fc2->weight));
  EXPECT_TRUE(ema.ema("frozen").equal(net->frozen));
  EXPECT_EQ(ema.ema("frozen")[0].item<float>(), static_cast<float>(changes));
  EXPECT_TRUE(ema.ema("scale").equal(net->scale));
  EXPECT_TRUE(ema.ema("bn.running_mean").equal(net->bn->running_mean));
  EXPECT_TRUE(ema.ema("bn.weight").equal(net->bn->weight));
  EXPECT_TRUE(ema.ema("bn.num_batches_tracked").equal(net->bn->num_batches_tracked));
}

TEST(EmaCallbackTest, CheckpointWeightsAreTheEmaAndRawWeightsAreKept) {
  TrainingRun run(2);
  run.fit(1);
  TestNet& net = run.net;
  EmaCallback& callback = run.callback;
  TrainingCheckpoint checkpoint = TrainingCheckpoint::capture(*net);
  callback.onSaveCheckpoint(checkpoint);
  ASSERT_EQ(checkpoint.rawWeights.size(), testing::testNetNames().size());
  for (const auto& [name, tensor] : checkpoint.weights) {
    EXPECT_TRUE(tensor.equal(callback.averager().ema(name))) << name;
  }
  // Independently of the averager: trained weights differ from the raw ones,
  // copied statistics do not.
  auto find = [](const NamedTensors& tensors, const std::string& name) {
    for (const auto& t : tensors)
      if (t.first == name) return t.second;
    return at::Tensor();
  };
  EXPECT_FALSE(find(checkpoint.weights, "fc2.weight").equal(net->fc2->weight));
  EXPECT_TRUE(find(checkpoint.rawWeights, "fc2.weight").equal(net->fc2->weight));
  EXPECT_TRUE(find(checkpoint.weights, "bn.running_mean").equal(net->bn->running_mean));
  EXPECT_THROW(callback.onSaveCheckpoint(checkpoint), c10::ValueError)
      << "twice into one checkpoint";
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
  TrainingRun straight(3);
  straight.fitStart();
  for (int64_t epoch = 0; epoch < 3; ++epoch) straight.epoch(epoch);

  TrainingRun first(3);
  first.fitStart();
  first.epoch(0);
  TrainingCheckpoint saved = TrainingCheckpoint::capture(*first.net);
  first.callback.onSaveCheckpoint(saved);
  saved.metadata["global_step"] = std::to_string(first.globalStep);
  saved.save(dir.file("ckpt.safetensors"));

  TrainingRun resumed(99);
  const TrainingCheckpoint loaded = TrainingCheckpoint::load(dir.file("ckpt.safetensors"));
  resumed.callback.onLoadCheckpoint(*resumed.net, loaded);
  resumed.fitStart();
  resumed.globalStep = std::stoll(loaded.metadata.at("global_step"));
  EXPECT_EQ(resumed.callback.averager().step(), resumed.globalStep);
  for (int64_t epoch = 1; epoch < 3; ++epoch) resumed.epoch(epoch);
  EXPECT_EQ(resumed.globalStep, straight.globalStep);
  const NamedTensors a = moduleTensors(*straight.net);
  const NamedTensors b = moduleTensors(*resumed.net);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(a[i].second.equal(b[i].second)) << "raw " << a[i].first;
    EXPECT_TRUE(straight.callback.averager()
                    .ema(a[i].first)
                    .equal(resumed.callback.averager().ema(a[i].first)))
        << "ema " << a[i].first;
  }
}

// A bf16 model: every weight and buffer at optimizer step `step` is a pure
// function of (step, tensor, element), so two runs see the same values.
void setBf16Weights(TestNet& net, int64_t step) {
  torch::NoGradGuard noGrad;
  int64_t index = 0;
  for (auto& [name, tensor] : moduleTensors(*net)) {
    ++index;
    if (!tensor.is_floating_point()) {
      tensor.fill_(step);
      continue;
    }
    const at::Tensor values =
        torch::sin(torch::arange(tensor.numel(), torch::kDouble) * 0.37 + 1.3 * step + index);
    tensor.copy_(values.reshape(tensor.sizes()));
  }
}

void bf16Steps(TestNet& net, EmaCallback& callback, int64_t from, int64_t to) {
  for (int64_t step = from; step <= to; ++step) {
    callback.onBeforeOptimizerStep();
    setBf16Weights(net, step);
    ASSERT_TRUE(callback.onTrainBatchEnd(step, 0, 1, true));
  }
}

TestNet bf16Net(uint64_t seed) {
  torch::manual_seed(seed);
  TestNet net;
  net->to(torch::kBFloat16);
  return net;
}

// A checkpoint of a bf16 model holds the EMA at bf16 (what deploys) and
// the float32 EMA aside; a resume loads the float32 one and continues bit
// for bit like an uninterrupted run.
TEST(EmaCallbackTest, ABf16ModelsCheckpointKeepsItsDtypeAndResumesBitExact) {
  testing::TempDir dir;
  TestNet straight = bf16Net(21);
  EmaCallback straightCallback;
  straightCallback.onFitStart(*straight);
  bf16Steps(straight, straightCallback, 1, 6);

  TestNet first = bf16Net(21);
  EmaCallback firstCallback;
  firstCallback.onFitStart(*first);
  bf16Steps(first, firstCallback, 1, 3);
  TrainingCheckpoint saved = TrainingCheckpoint::capture(*first);
  firstCallback.onSaveCheckpoint(saved);
  std::vector<std::string> kept;
  for (const auto& [name, tensor] : saved.weights) {
    const at::Tensor& ema = firstCallback.averager().ema(name);
    if (tensor.is_floating_point()) {
      EXPECT_EQ(tensor.scalar_type(), torch::kBFloat16) << name << ": the model's dtype";
    }
    EXPECT_TRUE(tensor.equal(ema.to(tensor.scalar_type()))) << name;
  }
  for (const auto& [name, tensor] : saved.float32Ema) {
    kept.push_back(name);
    EXPECT_TRUE(tensor.equal(firstCallback.averager().ema(name))) << name;
  }
  // The parameters, which the EMA keeps in float32 (the frozen one too);
  // the buffers (BatchNorm's) it keeps at their own dtype, and they lose
  // nothing in the checkpoint.
  EXPECT_EQ(kept, (std::vector<std::string>{"frozen", "fc1.weight", "fc1.bias", "fc2.weight",
                                            "fc2.bias"}));
  const at::Tensor fp32 = firstCallback.averager().ema("fc2.weight");
  ASSERT_FALSE(fp32.equal(fp32.to(torch::kBFloat16).to(torch::kFloat)))
      << "the EMA must be off the bf16 grid, or a resume from bf16 would pass too";
  saved.save(dir.file("bf16.safetensors"));

  TestNet resumed = bf16Net(99);
  EmaCallback resumedCallback;
  resumedCallback.onLoadCheckpoint(*resumed, TrainingCheckpoint::load(dir.file("bf16.safetensors")));
  resumedCallback.onFitStart(*resumed);
  bf16Steps(resumed, resumedCallback, 4, 6);
  for (const auto& [name, ema] : straightCallback.averager().emaTensors()) {
    EXPECT_TRUE(ema.equal(resumedCallback.averager().ema(name))) << "ema " << name;
  }
  const NamedTensors a = moduleTensors(*straight);
  const NamedTensors b = moduleTensors(*resumed);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(a[i].second.equal(b[i].second)) << "raw " << a[i].first;
  }
}

TEST(EmaCallbackTest, ValidationSwapsTheEmaInAndRawBackEvenWhenItThrows) {
  TrainingRun run(4);
  run.fit(2);
  TestNet& net = run.net;
  EmaCallback& callback = run.callback;
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

// VersatIL asks requires_grad at every update: a layer frozen mid-training
// is copied from then on, and averaged again once unfrozen.
TEST(EmaCallbackTest, FreezingAndUnfreezingChangesTreatmentAtTheNextUpdate) {
  TrainingRun run(6);
  run.fit(1);
  TestNet& net = run.net;
  net->fc1->weight.requires_grad_(false);
  run.callback.onBeforeOptimizerStep();  // fc1.weight changes next
  {
    torch::NoGradGuard noGrad;
    net->fc1->weight.add_(1.0);
  }
  run.epoch(1);
  EXPECT_TRUE(run.callback.averager().ema("fc1.weight").equal(net->fc1->weight)) << "copied";
  net->fc1->weight.requires_grad_(true);
  const at::Tensor before = run.callback.averager().ema("fc1.weight").clone();
  run.callback.onBeforeOptimizerStep();
  {
    torch::NoGradGuard noGrad;
    net->fc1->weight.add_(1.0);
  }
  run.epoch(2);
  const double d = run.callback.decay();
  EXPECT_GT(d, 0.0);
  EXPECT_FALSE(run.callback.averager().ema("fc1.weight").equal(net->fc1->weight)) << "averaged";
  EXPECT_FALSE(run.callback.averager().ema("fc1.weight").equal(before)) << "and it moved";
}

TEST(EmaCallbackTest, AGlobalStepThatDidNotAdvanceIsSkipped) {
  TrainingRun run(7);
  run.fitStart();
  EXPECT_TRUE(run.callback.onTrainBatchEnd(5, 0, 1, false));
  EXPECT_FALSE(run.callback.onTrainBatchEnd(5, 1, 1, false));
  EXPECT_FALSE(run.callback.onTrainBatchEnd(3, 2, 1, false));
  EXPECT_EQ(run.callback.averager().step(), 5);
}

TEST(EmaCallbackTest, LoggerGetsTheDecayEveryHundredSteps) {
  torch::manual_seed(5);
  TestNet net;
  EmaCallback callback;
  std::vector<std::pair<int64_t, double>> logged;
  callback.setDecayLogger([&](int64_t step, double decay) { logged.emplace_back(step, decay); });
  callback.onFitStart(*net);
  for (int64_t step = 1; step <= 250; ++step) {
    callback.onBeforeOptimizerStep();
    callback.onTrainBatchEnd(step, step - 1, 1, false);
  }
  ASSERT_EQ(logged.size(), 2u);
  EXPECT_EQ(logged[0].first, 100);
  EXPECT_DOUBLE_EQ(logged[0].second, versatilDecay(100));
  EXPECT_EQ(logged[1].first, 200);
}

TEST(EmaCallbackTest, HooksBeforeFitStartAndBadArguments) {
  TestNet net;
  EmaCallback callback;
  EXPECT_THROW(callback.onTrainBatchEnd(1, 0, 1, false), c10::Error) << "no EMA yet: a loop bug";
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

// The asynchronous default with the fence deferred to onBeforeOptimizerStep
// (called before the forward: BatchNorm's running statistics change there)
// gives the same EMA, bit for bit, as the synchronous on-device storage.
TEST(EmaCallbackTest, DeferredFencePinnedHostEqualsDeviceStorage) {
  auto train = [](EmaCallbackOptions options) {
    torch::manual_seed(11);
    TestNet net;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05));
    EmaCallback callback(options);
    callback.onFitStart(*net);
    int64_t globalStep = 0;
    for (int64_t b = 0; b < 12; ++b) {
      callback.onBeforeOptimizerStep();
      const auto [x, y] = testing::batchData(0, b, 16);
      torch::nn::functional::mse_loss(net->forward(x), y).backward();
      sgd.step();
      sgd.zero_grad();
      ++globalStep;
      EXPECT_TRUE(callback.onTrainBatchEnd(globalStep, b, 1, b == 11));
    }
    callback.wait();
    NamedTensors out;
    for (const auto& [name, ema] : callback.averager().emaTensors()) {
      out.emplace_back(name, ema.clone());
    }
    return out;
  };
  EmaCallbackOptions pinned;
  ASSERT_FALSE(pinned.offload.fenceInUpdate) << "the asynchronous update is the default";
  pinned.offload.chunkBytes = 64;  // many chunks even for this small net
  EmaCallbackOptions device;
  device.storage = EmaStorage::kDevice;
  const NamedTensors a = train(pinned);
  const NamedTensors b = train(device);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(a[i].second.equal(b[i].second)) << a[i].first;
  }
}

}  // namespace
}  // namespace shardema
