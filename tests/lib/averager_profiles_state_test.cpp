// The resume state of an Averager of several profiles (state(), save,
// loadState): every profile's EMA and last decay round-trip bit for bit, a
// resumed run continues as the uninterrupted one, each profile follows its
// float64 recomputation, and a state of another number of profiles or
// other schedules is refused naming them, the EMA left as it was.
#include <ATen/ops/rand.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/averager.h"
#include "shardema/core/file_metadata.h"
#include "shardema/core/tensor_file.h"

namespace shardema {
namespace {

// Three kinds of schedule, mixed: what EMA(schedules=[...]) builds.
std::vector<DecaySchedule> mixedSchedules() {
  ConstantScheduleOptions constant;
  constant.decay = 0.9;
  WarmupScheduleOptions warmup;
  warmup.power = 0.75;
  warmup.maxValue = 0.999;
  PowerScheduleOptions power;
  power.sigmaRel = 0.1;
  return {DecaySchedule::constant(constant), DecaySchedule::warmup(warmup),
          DecaySchedule::powerFunction(power)};
}

AveragerOptions optionsOf(const std::vector<DecaySchedule>& schedules,
                          EmaStorage storage = EmaStorage::kPinnedHost) {
  AveragerOptions options;
  options.storage = storage;
  options.schedule = schedules.front();
  options.moreSchedules.assign(schedules.begin() + 1, schedules.end());
  return options;
}

// The weights at step k: values that encode the step and the index.
void setWeights(at::Tensor& w, int64_t k) {
  float* data = w.data_ptr<float>();
  for (int64_t i = 0; i < w.numel(); ++i) {
    data[i] = static_cast<float>(std::sin(0.3 * static_cast<double>(k) + 0.01 * i));
  }
}

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

TEST(AveragerProfilesStateTest, ProfileTensorNamesRoundTrip) {
  EXPECT_EQ(profileTensorName("a.b", 0), "a.b");
  EXPECT_EQ(profileTensorName("a.b", 3), "shardema.profile_3/a.b");
  std::string name;
  EXPECT_EQ(profileOfStoredName("shardema.profile_3/a.b", &name), 3);
  EXPECT_EQ(name, "a.b");
  EXPECT_EQ(profileOfStoredName("a.b", &name), 0);
  EXPECT_EQ(name, "a.b");
  EXPECT_EQ(profileOfStoredName("shardema.profile_x/a", &name), -1);
  EXPECT_EQ(profileOfStoredName("shardema.profile_0/a", &name), -1);
  at::Tensor t = at::zeros({2});
  EXPECT_THROW(Averager({{"shardema.profile_1/a", t, TrackRole::kAverage}}), c10::ValueError);
}

// Each profile against a float64 EMA of the same weights, then the state
// into a fresh Averager: the same bytes, and both go on identically.
TEST(AveragerProfilesStateTest, EveryProfileResumesBitExact) {
  const std::vector<DecaySchedule> schedules = mixedSchedules();
  for (EmaStorage storage : {EmaStorage::kPinnedHost, EmaStorage::kDevice}) {
    at::Tensor w = at::zeros({7, 3});
    at::Tensor count = at::zeros({1}, at::kLong);
    const std::vector<TrackedTensor> tracked = {{"w", w, TrackRole::kAverage},
                                                {"count", count, TrackRole::kCopy}};
    setWeights(w, 0);
    Averager run(tracked, optionsOf(schedules, storage));
    std::vector<std::vector<double>> reference(schedules.size());
    for (auto& r : reference) r.assign(w.data_ptr<float>(), w.data_ptr<float>() + w.numel());
    for (int64_t step = 1; step <= 12; ++step) {
      run.wait();  // the C++ rule: the sources change only after the update read them
      setWeights(w, step);
      count.fill_(step);
      run.update(step);
      for (size_t p = 0; p < schedules.size(); ++p) {
        // The first due update copies (copyOnFirstUpdate, the default).
        const double decay = step == 1 ? 0.0 : schedules[p].decayAt(step);
        for (int64_t i = 0; i < w.numel(); ++i) {
          reference[p][i] = decay * reference[p][i] + (1 - decay) * w.data_ptr<float>()[i];
        }
      }
    }
    run.wait();
    for (int p = 0; p < run.numProfiles(); ++p) {
      const at::Tensor ema = run.ema("w", p).contiguous();
      for (int64_t i = 0; i < ema.numel(); ++i) {
        ASSERT_NEAR(ema.data_ptr<float>()[i], reference[p][i], 2e-6) << "profile " << p;
      }
    }
    const TensorFile state = run.state();
    // Profile 0 under the plain names, the averaged tensor of the others
    // under the profile prefix, the copy once.
    std::vector<std::string> names;
    for (const auto& entry : state.tensors) names.push_back(entry.first);
    EXPECT_EQ(names, (std::vector<std::string>{"w", "count", "shardema.profile_1/w",
                                               "shardema.profile_2/w"}));
    const nlohmann::json profiles = nlohmann::json::parse(state.metadata.at("shardema.profiles"));
    ASSERT_EQ(profiles.size(), 3u);

    at::Tensor w2 = w.clone();
    at::Tensor count2 = count.clone();
    Averager resumed({{"w", w2, TrackRole::kAverage}, {"count", count2, TrackRole::kCopy}},
                     optionsOf(schedules, storage));
    const std::string path =
        (std::filesystem::temp_directory_path() / "averager_profiles_state.safetensors").string();
    run.save(path);
    resumed.load(path);
    std::filesystem::remove(path);
    for (int p = 0; p < 3; ++p) {
      EXPECT_TRUE(sameBytes(run.ema("w", p), resumed.ema("w", p))) << "profile " << p;
      EXPECT_EQ(run.lastDecay(p), resumed.lastDecay(p));
    }
    for (int64_t step = 13; step <= 20; ++step) {
      run.wait();
      resumed.wait();
      setWeights(w, step);
      setWeights(w2, step);
      run.update(step);
      resumed.update(step);
    }
    run.wait();
    resumed.wait();
    for (int p = 0; p < 3; ++p) {
      EXPECT_TRUE(sameBytes(run.ema("w", p), resumed.ema("w", p))) << "profile " << p;
    }
    // copyTo writes the profile asked for.
    resumed.copyTo(2);
    EXPECT_TRUE(sameBytes(w2, resumed.ema("w", 2)));
    EXPECT_THROW(resumed.copyTo(3), c10::IndexError);
  }
}

TEST(AveragerProfilesStateTest, AnotherNumberOfProfilesOrScheduleIsRefused) {
  const std::vector<DecaySchedule> schedules = mixedSchedules();
  at::Tensor w = at::rand({5});
  Averager three({{"w", w, TrackRole::kAverage}}, optionsOf(schedules));
  three.update(1);
  three.fence();
  three.update(2);
  const TensorFile state = three.state();

  at::Tensor w2 = at::rand({5});
  Averager two({{"w", w2, TrackRole::kAverage}}, optionsOf({schedules[0], schedules[1]}));
  const at::Tensor before = two.ema("w", 1).clone();
  try {
    two.loadState(state);
    FAIL() << "a state of 3 profiles loaded into 2";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("holds 3 profiles but this Averager keeps 2"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(sameBytes(before, two.ema("w", 1)));  // nothing loaded
  // Non-strict: the profiles both have.
  two.loadState(state, LoadStrictness::kNonStrict);
  EXPECT_TRUE(sameBytes(three.ema("w", 1), two.ema("w", 1)));

  Averager one({{"w", w2, TrackRole::kAverage}}, optionsOf({schedules[0]}));
  EXPECT_THROW(one.loadState(state), c10::ValueError);
  EXPECT_THROW(three.loadState(one.state()), c10::ValueError);

  Averager other({{"w", w2, TrackRole::kAverage}},
                 optionsOf({schedules[0], schedules[2], schedules[1]}));
  try {
    other.loadState(state);
    FAIL() << "other schedules loaded";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("profile 1 was saved with schedule"), std::string::npos)
        << e.what();
  }
}

TEST(AveragerProfilesStateTest, EditedProfilesAreRefused) {
  const std::vector<DecaySchedule> schedules = mixedSchedules();
  at::Tensor w = at::rand({5});
  Averager averager({{"w", w, TrackRole::kAverage}}, optionsOf(schedules));
  averager.update(1);
  averager.wait();
  TensorFile state = averager.state();
  // Another valid schedule for profile 2: only the digest can tell.
  nlohmann::json profiles = nlohmann::json::parse(state.metadata.at("shardema.profiles"));
  profiles[2]["schedule"] = nlohmann::json::parse(schedules[0].toJson());
  TensorFile edited = state;
  edited.metadata["shardema.profiles"] = profiles.dump();
  EXPECT_THROW(checkAveragerStateMetadata(edited.metadata, "test"), c10::ValueError);
  // Garbled, and an entry 0 that disagrees with shardema.schedule.
  edited.metadata["shardema.profiles"] = "[1]";
  EXPECT_THROW(checkAveragerStateMetadata(edited.metadata, "test"), c10::ValueError);
  profiles = nlohmann::json::parse(state.metadata.at("shardema.profiles"));
  profiles[0]["last_decay"] = "0.5";
  edited.metadata = state.metadata;
  edited.metadata.erase(detail::kStateChecksumKey);
  edited.metadata["shardema.profiles"] = profiles.dump();
  EXPECT_THROW(checkAveragerStateMetadata(edited.metadata, "test"), c10::ValueError);
  // A profile tensor the metadata does not record.
  edited = state;
  edited.metadata.erase("shardema.profiles");
  edited.metadata.erase(detail::kStateChecksumKey);
  EXPECT_THROW(averager.loadState(edited), c10::ValueError);
  // One profile state keeps the format of before: no profiles key.
  Averager single({{"w", w, TrackRole::kAverage}}, optionsOf({schedules[0]}));
  EXPECT_EQ(single.state().metadata.count("shardema.profiles"), 0u);
}

}  // namespace
}  // namespace shardema
