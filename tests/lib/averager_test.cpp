#include "shardema/averager.h"

#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/tensor_file.h"
#include "support/temp_dir.h"
#include "support/value_error.h"

namespace shardema {
namespace {

// Independent of DecaySchedule: the warmup formula of docs/spec/reference_semantics.md section 7.
double warmupDecay(int64_t n, double power, double maxValue) {
  const double e = std::max<double>(0.0, static_cast<double>(n) - 1.0);
  if (e <= 0) return 0.0;
  return std::min(maxValue, std::max(0.0, 1.0 - std::pow(1.0 + e, -power)));
}

// Source values that change every step in a way that encodes index and step.
void setSource(at::Tensor& source, int64_t step) {
  std::vector<float> values(source.numel());
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<float>(std::sin(0.37 * step * (i + 1)) + 0.01 * step);
  }
  at::Tensor fp32 = at::zeros({source.numel()}, at::kFloat);
  std::copy(values.begin(), values.end(), fp32.data_ptr<float>());
  source.copy_(fp32.view(source.sizes()));
}

std::vector<double> toDoubles(const at::Tensor& t) {
  at::Tensor f = t.to(at::kDouble).contiguous();
  return std::vector<double>(f.data_ptr<double>(), f.data_ptr<double>() + f.numel());
}

// Updates `averager` at steps 1..steps with setSource's values (fencing
// before each change) and returns the float64 EMA of the same values with
// the default warmup schedule: the first update copies.
std::vector<double> updateAgainstWarmupReference(Averager& averager, at::Tensor& source,
                                                 int64_t steps) {
  std::vector<double> reference;
  for (int64_t n = 1; n <= steps; ++n) {
    setSource(source, n);
    EXPECT_TRUE(averager.update(n));
    averager.fence();  // before the source changes
    const std::vector<double> x = toDoubles(source);
    if (n == 1) {
      reference = x;
      continue;
    }
    const double w = 1.0 - warmupDecay(n, 0.75, 0.9999);
    for (size_t i = 0; i < x.size(); ++i) reference[i] += w * (x[i] - reference[i]);
  }
  return reference;
}

TEST(AveragerTest, FirstUpdateCopiesThenLerpsLikeFloat64Reference) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor source = at::zeros({3, 5}, at::TensorOptions().dtype(dtype));
    setSource(source, 0);
    Averager averager({{"w", source, TrackRole::kAverage}});
    const std::vector<double> reference = updateAgainstWarmupReference(averager, source, 12);
    const std::vector<double> got = toDoubles(averager.ema("w"));
    ASSERT_EQ(averager.ema("w").scalar_type(), at::kFloat);
    // Twelve fp32 lerps of values of magnitude <= 1.2: a few ulps each.
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], reference[i], 2e-6) << i;
    EXPECT_DOUBLE_EQ(averager.lastDecay(), warmupDecay(12, 0.75, 0.9999));
  }
}

TEST(AveragerTest, CopyRolesFollowTheSourceAndCopyOnceKeepsTheStart) {
  at::Tensor copied = at::zeros({4}, at::kLong);
  at::Tensor once = at::zeros({2}, at::kFloat);
  setSource(once, 0);
  const at::Tensor start = once.clone();
  Averager averager({{"copied", copied, TrackRole::kCopy}, {"once", once, TrackRole::kCopyOnce}});
  for (int64_t n = 1; n <= 3; ++n) {
    copied.fill_(7 * n);
    setSource(once, n);
    averager.update(n);
    averager.fence();
  }
  EXPECT_EQ(averager.ema("copied").scalar_type(), at::kLong) << "copies keep the source dtype";
  EXPECT_TRUE(at::equal(averager.ema("copied"), copied));
  EXPECT_TRUE(at::equal(averager.ema("once"), start));
}

TEST(AveragerTest, ZeroDecayIsAnExactCopyEvenAfterAveraging) {
  // update_after_step 5: steps 1..6 have decay 0, so each must reproduce the
  // source bit for bit (ema + 1 * (x - ema) can be an ulp off).
  WarmupScheduleOptions warmup;
  warmup.updateAfterStep = 5;
  at::Tensor source = at::rand({1000}, at::kFloat);
  AveragerOptions options;
  options.schedule = DecaySchedule::warmup(warmup);
  options.copyOnFirstUpdate = false;
  Averager averager({{"w", source, TrackRole::kAverage}}, options);
  for (int64_t n = 1; n <= 6; ++n) {
    source.mul_(1.7).add_(1e-3);
    averager.update(n);
    EXPECT_EQ(averager.lastDecay(), 0.0);
    EXPECT_TRUE(at::equal(averager.ema("w"), source)) << "step " << n;
  }
  source.add_(1.0);
  averager.update(7);
  EXPECT_GT(averager.lastDecay(), 0.0);
  EXPECT_FALSE(at::equal(averager.ema("w"), source));
}

TEST(AveragerTest, SkipsStepsThatAreNotDue) {
  ConstantScheduleOptions constant;
  constant.decay = 0.5;
  constant.updateEvery = 3;
  at::Tensor source = at::zeros({1}, at::kFloat);
  AveragerOptions options;
  options.schedule = DecaySchedule::constant(constant);
  Averager averager({{"w", source, TrackRole::kAverage}}, options);
  std::vector<int64_t> applied;
  for (int64_t n = 1; n <= 7; ++n) {
    source.fill_(static_cast<double>(n));
    if (averager.update(n)) applied.push_back(n);
    averager.fence();
  }
  EXPECT_EQ(applied, (std::vector<int64_t>{1, 4, 7}));
  // copy 1, then 0.5 * 1 + 0.5 * 4 = 2.5, then 0.5 * 2.5 + 0.5 * 7 = 4.75
  EXPECT_EQ(averager.ema("w").item<float>(), 4.75f);
  EXPECT_EQ(averager.step(), 7);
}

TEST(AveragerTest, RejectsStepsThatDoNotIncrease) {
  Averager averager({{"w", at::zeros({2}), TrackRole::kAverage}});
  averager.update(3);
  try {
    averager.update(3);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("step must increase"), std::string::npos) << e.what();
  }
  EXPECT_THROW(averager.update(2), c10::ValueError);
}

TEST(AveragerTest, RejectsBadTrackedTensors) {
  const at::Tensor t = at::zeros({2});
  EXPECT_THROW(Averager({{"", t, TrackRole::kAverage}}), c10::ValueError);
  EXPECT_THROW(Averager({{"a", t, TrackRole::kAverage}, {"a", t, TrackRole::kCopy}}),
               c10::ValueError);
  EXPECT_THROW(Averager({{"a", at::Tensor(), TrackRole::kAverage}}), c10::ValueError);
  try {
    Averager({{"steps", at::zeros({2}, at::kLong), TrackRole::kAverage}});
    FAIL() << "an integer tensor cannot be averaged";
  } catch (const c10::TypeError& e) {
    EXPECT_NE(std::string(e.what()).find("steps"), std::string::npos) << e.what();
  }
}

TEST(AveragerTest, CopyEmaToSourcesConvertsToTheSourceDtype) {
  at::Tensor source = at::zeros({8}, at::kBFloat16);
  Averager averager({{"w", source, TrackRole::kAverage}});
  source.fill_(1.0);
  averager.update(1);
  averager.fence();
  source.fill_(3.0);
  averager.update(2);  // decay(2) = 1 - 2^-0.75
  const float expected = static_cast<float>(1.0 + std::pow(2.0, -0.75) * 2.0);
  averager.copyTo();
  EXPECT_EQ(source.scalar_type(), at::kBFloat16);
  EXPECT_FLOAT_EQ(source[0].item<float>(), static_cast<float>(c10::BFloat16(expected)));
}

TEST(AveragerTest, SavedStateResumesBitIdentically) {
  testing::TempDir dir;
  at::Tensor a = at::zeros({33}, at::kFloat);
  at::Tensor b = at::zeros({5, 2}, at::kHalf);
  auto make = [&] {
    return Averager({{"a", a, TrackRole::kAverage}, {"b", b, TrackRole::kAverage}});
  };
  Averager straight = make();
  Averager first = make();
  for (int64_t n = 1; n <= 20; ++n) {
    setSource(a, n);
    setSource(b, n);
    straight.update(n);
    straight.fence();
    if (n <= 10) first.update(n);
    first.fence();
    if (n == 10) first.save(dir.file("state.safetensors"));
    if (n == 10) {
      Averager resumed = make();
      resumed.load(dir.file("state.safetensors"));
      EXPECT_EQ(resumed.step(), 10);
      EXPECT_TRUE(resumed.initialized());
      EXPECT_EQ(resumed.lastDecay(), first.lastDecay());
      first = std::move(resumed);
    }
    if (n > 10) first.update(n);
    first.fence();
  }
  EXPECT_TRUE(at::equal(first.ema("a"), straight.ema("a")));
  EXPECT_TRUE(at::equal(first.ema("b"), straight.ema("b")));
}

TEST(AveragerTest, StrictLoadNamesMissingAndUnexpectedTensorsAndChangesNothing) {
  Averager averager(
      {{"a", at::ones({2}), TrackRole::kAverage}, {"b", at::ones({3}), TrackRole::kAverage}});
  const std::vector<std::pair<std::string, at::Tensor>> values = {{"a", at::zeros({2})},
                                                                  {"c", at::zeros({1})}};
  try {
    averager.loadEmaValues(values, LoadStrictness::kStrict);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(averager.ema("a")[0].item<float>(), 1.0f) << "a failed load writes nothing";
  const LoadReport report = averager.loadEmaValues(values, LoadStrictness::kNonStrict);
  EXPECT_EQ(report.missing, std::vector<std::string>{"b"});
  EXPECT_EQ(report.unexpected, std::vector<std::string>{"c"});
  EXPECT_EQ(averager.ema("a")[0].item<float>(), 0.0f);
  EXPECT_THROW(averager.loadEmaValues({{"a", at::zeros({3})}}, LoadStrictness::kNonStrict),
               c10::ValueError);
}

TEST(AveragerTest, StrictLoadRejectsAnotherSchedule) {
  testing::TempDir dir;
  Averager saved({{"a", at::ones({2}), TrackRole::kAverage}});
  saved.update(1);
  saved.save(dir.file("s.safetensors"));
  AveragerOptions options;
  options.schedule = DecaySchedule::constant();
  Averager other({{"a", at::ones({2}), TrackRole::kAverage}}, options);
  EXPECT_THROW(other.load(dir.file("s.safetensors")), c10::ValueError);
  other.load(dir.file("s.safetensors"), LoadStrictness::kNonStrict);
  EXPECT_EQ(other.step(), 1);
  EXPECT_EQ(other.schedule().kind(), ScheduleKind::kConstant) << "non-strict keeps ours";
}

// A negative step or a last decay that is NaN or outside [0, 1] was once
// loaded as it stood; the error names the file and the key.
TEST(AveragerTest, LoadRefusesOutOfRangeProgressNamingFileAndKey) {
  testing::TempDir dir;
  Averager saved({{"a", at::ones({2}), TrackRole::kAverage}});
  saved.update(1);
  saved.fence();
  const std::string path = dir.file("s.safetensors");
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"shardema.step", "-3"},
                                                        {"shardema.step", "2x"},
                                                        {"shardema.last_decay", "nan"},
                                                        {"shardema.last_decay", "1.5"},
                                                        {"shardema.last_decay", "-0.25"}}) {
    SCOPED_TRACE(key + "=" + value);
    TensorFile file = saved.state();
    file.metadata[key] = value;
    writeTensorFile(path, file);
    Averager fresh({{"a", at::zeros({2}), TrackRole::kAverage}});
    EXPECT_VALUE_ERROR(fresh.load(path), path + ": Averager::loadState: " + key);
    EXPECT_EQ(fresh.step(), 0) << "a refused load changed the step";
  }
}

TEST(AveragerTest, StrictLoadRejectsAnotherRole) {
  testing::TempDir dir;
  Averager saved({{"a", at::ones({2}), TrackRole::kAverage}});
  saved.save(dir.file("s.safetensors"));
  Averager copying({{"a", at::ones({2}), TrackRole::kCopy}});
  try {
    copying.load(dir.file("s.safetensors"));
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'a' was saved with role average"), std::string::npos)
        << e.what();
  }
  copying.load(dir.file("s.safetensors"), LoadStrictness::kNonStrict);
}

TEST(AveragerTest, AFailedUpdateChangesNothingAndCanBeRetried) {
  at::Tensor good = at::zeros({2});
  at::Tensor copied = at::zeros({2});
  at::Tensor turnsDouble = at::zeros({2});
  Averager averager({{"good", good, TrackRole::kAverage},
                     {"copied", copied, TrackRole::kCopy},
                     {"bad", turnsDouble, TrackRole::kAverage}});
  averager.update(1);
  averager.fence();
  good.fill_(4.0);
  copied.fill_(9.0);
  turnsDouble.set_data(at::zeros({2}, at::kDouble));  // as module->to(kDouble) does
  EXPECT_THROW(averager.update(2), c10::TypeError);
  EXPECT_EQ(averager.step(), 1);
  EXPECT_EQ(averager.ema("good")[0].item<float>(), 0.0f) << "nothing written";
  EXPECT_EQ(averager.ema("copied")[0].item<float>(), 0.0f) << "nothing written";
  turnsDouble.set_data(at::zeros({2}));
  EXPECT_TRUE(averager.update(2));
  EXPECT_EQ(averager.ema("copied")[0].item<float>(), 9.0f);
}

TEST(AveragerTest, UnknownNameIsAnIndexError) {
  Averager averager({{"a", at::ones({2}), TrackRole::kAverage}});
  EXPECT_THROW(averager.ema("nope"), c10::IndexError);
}

// Both storages follow the float64 reference; kDevice keeps the EMA on
// the source's device (the CPU here) and needs no fence.
TEST(AveragerTest, BothStoragesFollowTheFloat64Reference) {
  for (EmaStorage storage : {EmaStorage::kPinnedHost, EmaStorage::kDevice}) {
    at::Tensor source = at::zeros({70}, at::kBFloat16);
    AveragerOptions options;
    options.storage = storage;
    options.offload.chunkBytes = 64;
    Averager averager({{"w", source, TrackRole::kAverage}}, options);
    EXPECT_EQ(averager.storage(), storage);
    const std::vector<double> reference = updateAgainstWarmupReference(averager, source, 8);
    const std::vector<double> got = toDoubles(averager.ema("w"));
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], reference[i], 2e-6) << i;
    // A host source is read in place: no staging on either storage.
    EXPECT_EQ(averager.offloadStats().stagingBytes, 0);
  }
}

// A copy kept as an integer takes only its own dtype: an f32 value would be
// truncated into it without a word. Floating values still convert (a bf16
// file into an fp32 EMA).
TEST(AveragerTest, LoadRefusesAFloatValueForAnIntegerCopy) {
  testing::TempDir dir;
  Averager averager({{"w", at::ones({2}), TrackRole::kAverage},
                     {"count", at::zeros({1}, at::kLong), TrackRole::kCopy}});
  EXPECT_THROW(averager.loadEmaValues({{"count", at::full({1}, 2.5f)}}, LoadStrictness::kNonStrict),
               c10::TypeError);
  EXPECT_THROW(
      averager.loadEmaValues({{"w", at::ones({2}, at::kLong)}}, LoadStrictness::kNonStrict),
      c10::TypeError);
  averager.loadEmaValues({{"w", at::full({2}, 0.5, at::kBFloat16)}}, LoadStrictness::kNonStrict);
  EXPECT_EQ(averager.ema("w")[0].item<float>(), 0.5f);
  TensorFile file = averager.state();
  file.tensors[1].second = at::full({1}, 7.0f);  // the f32 file of the issue
  writeTensorFile(dir.file("f32.safetensors"), file);
  try {
    averager.load(dir.file("f32.safetensors"));
    FAIL() << "expected an error";
  } catch (const c10::TypeError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find(dir.file("f32.safetensors")), std::string::npos) << message;
    EXPECT_NE(message.find("tensor 'count' is Float but is kept here as Long"), std::string::npos)
        << message;
  }
  EXPECT_EQ(averager.ema("count")[0].item<int64_t>(), 0) << "a refused load writes nothing";
}

// What load() finds wrong in a file's metadata names the file and the key.
TEST(AveragerTest, LoadMetadataErrorsNameTheFileAndTheKey) {
  testing::TempDir dir;
  Averager averager({{"w", at::ones({2}), TrackRole::kAverage}});
  for (const char* key : {"shardema.step", "shardema.last_decay"}) {
    TensorFile file = averager.state();
    file.metadata[key] = "x1";
    const std::string path = dir.file(std::string(key) + ".safetensors");
    writeTensorFile(path, file);
    try {
      averager.load(path);
      FAIL() << "expected an error for " << key;
    } catch (const c10::ValueError& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_EQ(message.find(path + ": "), 0u) << message;
      EXPECT_NE(message.find(std::string("metadata key '") + key + "' is 'x1'"), std::string::npos)
          << message;
    }
  }
}

}  // namespace
}  // namespace shardema
