// The power-function profiles an Averager tracks, against the tracked EMAs
// and snapshots of the reference post-hoc runs (ema-pytorch PostHocEMA and
// nitrous-ema PostHocEMA, tests/data/posthoc_ema_run.json).
#include <ATen/ops/empty.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/averager.h"
#include "shardema/core/power_function.h"
#include "shardema/core/update_kernels.h"
#include "support/same_bytes.h"

namespace shardema {
namespace {

using nlohmann::json;

constexpr double kGoldenTolerance = 1e-6;

struct RunSettings {
  int64_t updateEvery;
  bool stepSizeCorrection;
};

// What each golden run was configured with (its description in the file).
const std::map<std::string, RunSettings>& runSettings() {
  static const std::map<std::string, RunSettings> settings = {
      {"lucid_fp32", {1, false}},        {"lucid_default_fp16", {1, false}},
      {"nitrous_u1_nocorr", {1, false}}, {"nitrous_u1_corr_mmaudio", {1, true}},
      {"nitrous_u5_corr", {5, true}},    {"lucid_u5_fp32", {5, false}},
  };
  return settings;
}

// theta_k[i] = sin(0.1 k (i+1)) + 0.01 k (i+1), float64 rounded to float32.
void setTheta(at::Tensor& theta, int64_t k) {
  float* data = theta.data_ptr<float>();
  for (int64_t i = 0; i < theta.numel(); ++i) {
    const double x = static_cast<double>(k) * static_cast<double>(i + 1);
    data[i] = static_cast<float>(std::sin(0.1 * x) + 0.01 * x);
  }
}

// Nearest float16 of x, via c10's converter (what torch's .to(float16) does).
double toHalf(float x) { return static_cast<float>(c10::Half(x)); }

TEST(PostHocProfileGoldenTest, ProfilesMatchTheReferenceRuns) {
  std::ifstream in(std::string(SHARDEMA_TEST_DATA_DIR) + "/posthoc_ema_run.json");
  ASSERT_TRUE(in.good()) << "missing tests/data/posthoc_ema_run.json";
  const json golden = json::parse(in);
  const double sigmaRels[2] = {0.05, 0.1};
  int snapshotsChecked = 0;
  for (const auto& run : golden.at("runs")) {
    const std::string name = run.at("run");
    const RunSettings settings = runSettings().at(name);
    at::Tensor theta = at::empty({4}, at::kFloat);
    setTheta(theta, 0);
    std::vector<std::unique_ptr<Averager>> profiles;
    for (double sigma : sigmaRels) {
      PowerScheduleOptions power;
      power.sigmaRel = sigma;
      power.updateEvery = settings.updateEvery;
      power.stepSizeCorrection = settings.stepSizeCorrection;
      AveragerOptions options;
      options.schedule = DecaySchedule::powerFunction(power);
      profiles.push_back(std::make_unique<Averager>(
          std::vector<TrackedTensor>{{"theta", theta, TrackRole::kAverage}}, options));
    }
    // Snapshots listed in the file, by name "{i}.{t}.pt".
    std::map<std::string, const json*> listed;
    for (const auto& snapshot : run.at("snapshots")) listed[snapshot.at("file")] = &snapshot;
    for (int64_t k = 1; k <= 100; ++k) {
      setTheta(theta, k);
      for (auto& profile : profiles) {
        profile->update(k);
        profile->wait();  // theta is rewritten in place next iteration
      }
      if (k % 10 != 0) continue;
      for (size_t i = 0; i < profiles.size(); ++i) {
        const std::string file = std::to_string(i) + "." + std::to_string(k) + ".pt";
        const auto found = listed.find(file);
        if (found == listed.end()) continue;
        const json& contents = found->second->at("contents").at("ema_model.theta");
        const bool half = contents.at("dtype") == "torch.float16";
        const auto expected = contents.at("values").get<std::vector<double>>();
        const at::Tensor ema = profiles[i]->ema("theta");
        for (size_t e = 0; e < expected.size(); ++e) {
          const float ours = ema.data_ptr<float>()[e];
          // fp16 snapshots: the reference rounded its fp32 EMA to half;
          // ours may land one half-ulp step away on a rounding boundary.
          const double tolerance =
              half ? std::ldexp(std::fabs(expected[e]), -10) : kGoldenTolerance;
          EXPECT_NEAR(half ? toHalf(ours) : ours, expected[e], tolerance)
              << name << " " << file << " element " << e;
        }
        ++snapshotsChecked;
      }
    }
    for (const auto& tracked : run.at("tracked_ema_at_end")) {
      const size_t index = tracked.at("index").get<size_t>();
      EXPECT_NEAR(profiles[index]->schedule().gamma(), tracked.at("gamma").get<double>(), 1e-9);
      const auto expected = tracked.at("theta").get<std::vector<double>>();
      const at::Tensor ema = profiles[index]->ema("theta");
      for (size_t e = 0; e < expected.size(); ++e) {
        EXPECT_NEAR(ema.data_ptr<float>()[e], expected[e], kGoldenTolerance)
            << name << " profile " << index << " element " << e;
      }
    }
  }
  // lucid_fp32 lists all 20 snapshots, the five other runs their first two.
  EXPECT_EQ(snapshotsChecked, 20 + 5 * 2);
}

AveragerOptions profileOptions(const std::vector<double>& sigmaRels, const RunSettings& settings,
                               EmaStorage storage) {
  AveragerOptions options;
  options.storage = storage;
  for (size_t p = 0; p < sigmaRels.size(); ++p) {
    PowerScheduleOptions power;
    power.sigmaRel = sigmaRels[p];
    power.updateEvery = settings.updateEvery;
    power.stepSizeCorrection = settings.stepSizeCorrection;
    const DecaySchedule schedule = DecaySchedule::powerFunction(power);
    if (p == 0) {
      options.schedule = schedule;
    } else {
      options.moreSchedules.push_back(schedule);
    }
  }
  return options;
}

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && testing::sameBytes(a.data_ptr(), b.data_ptr(), a.nbytes());
}

// Three profiles of bf16 and fp32 weights plus a copied buffer, in one
// Averager (one staged pass per update), against one Averager per profile:
// bit for bit, on both storages, and from a resume halfway.
TEST(PostHocProfileGoldenTest, OnePassProfilesEqualOneAveragerPerProfile) {
  const std::vector<double> sigmas = {0.05, 0.1, 0.2};
  for (const auto& [name, settings] : runSettings()) {
    at::Tensor w = at::rand({37, 5}, at::kFloat);
    at::Tensor h = at::rand({300}, at::kFloat).to(at::kBFloat16);
    at::Tensor count = at::zeros({1}, at::kLong);
    const auto tracked = [&] {
      return std::vector<TrackedTensor>{{"w", w, TrackRole::kAverage},
                                        {"h", h, TrackRole::kAverage},
                                        {"count", count, TrackRole::kCopy}};
    };
    AveragerOptions small = profileOptions(sigmas, settings, EmaStorage::kPinnedHost);
    small.offload.chunkBytes = 256;  // many chunks, pieces cut inside tensors
    Averager host(tracked(), small);
    Averager device(tracked(), profileOptions(sigmas, settings, EmaStorage::kDevice));
    std::vector<std::unique_ptr<Averager>> singles;
    for (double sigma : sigmas) {
      singles.push_back(std::make_unique<Averager>(
          tracked(), profileOptions({sigma}, settings, EmaStorage::kPinnedHost)));
    }
    std::unique_ptr<Averager> resumed;
    for (int64_t k = 1; k <= 60; ++k) {
      w.copy_(at::rand({37, 5}));
      h.copy_(at::rand({300}).to(at::kBFloat16));
      count.fill_(k);
      host.update(k);
      device.update(k);
      for (auto& single : singles) single->update(k);
      if (resumed) resumed->update(k);
      host.wait();
      for (auto& single : singles) single->wait();
      if (resumed) resumed->wait();
      if (k == 30) {
        // Resume from "snapshots" of every profile at step 30.
        resumed = std::make_unique<Averager>(tracked(), small);
        for (int p = 0; p < host.numProfiles(); ++p) {
          std::vector<std::pair<std::string, at::Tensor>> values;
          for (const auto& [tensorName, value] : host.emaTensors(p)) {
            values.emplace_back(tensorName, value.clone());
          }
          resumed->loadEmaValues(values, LoadStrictness::kStrict, p);
        }
        resumed->restoreProgress(30, true);
      }
    }
    ASSERT_EQ(host.numProfiles(), 3);
    for (int p = 0; p < 3; ++p) {
      EXPECT_EQ(host.lastDecay(p), singles[p]->lastDecay()) << name << " profile " << p;
      for (const char* tensor : {"w", "h", "count"}) {
        const at::Tensor& expected = singles[p]->ema(tensor);
        EXPECT_TRUE(sameBytes(host.ema(tensor, p), expected)) << name << " " << tensor << p;
        EXPECT_TRUE(sameBytes(device.ema(tensor, p), expected)) << name << " " << tensor << p;
        EXPECT_TRUE(sameBytes(resumed->ema(tensor, p), expected)) << name << " " << tensor << p;
      }
    }
    // Copies are shared, and the sources were staged once per update.
    EXPECT_EQ(host.ema("count", 2).data_ptr(), host.ema("count", 0).data_ptr());
    EXPECT_EQ(host.offloadStats().sourceBytes, singles[0]->offloadStats().sourceBytes);
  }
}

TEST(PostHocProfileGoldenTest, ProfileMisuseIsRefused) {
  at::Tensor w = at::rand({4});
  AveragerOptions options = profileOptions({0.05, 0.1}, {1, true}, EmaStorage::kPinnedHost);
  Averager averager({{"w", w, TrackRole::kAverage}}, options);
  EXPECT_THROW(averager.ema("w", 2), c10::IndexError);
  EXPECT_THROW(averager.emaTensors(-1), c10::IndexError);
  EXPECT_THROW(averager.copyTo(2), c10::IndexError);
  // state() holds both profiles (averager_profiles_state_test.cpp).
  EXPECT_EQ(averager.state().tensors.size(), 2u);
  EXPECT_THROW(averager.restoreProgress(-1, true), c10::ValueError);
  AveragerOptions mismatched = profileOptions({0.05, 0.1}, {1, true}, EmaStorage::kPinnedHost);
  PowerScheduleOptions every2;
  every2.updateEvery = 2;
  mismatched.moreSchedules = {DecaySchedule::powerFunction(every2)};
  EXPECT_THROW(Averager({{"w", w, TrackRole::kAverage}}, mismatched), c10::ValueError);
  AveragerOptions tooMany = options;
  tooMany.moreSchedules.assign(kMaxProfiles, options.moreSchedules.front());
  EXPECT_THROW(Averager({{"w", w, TrackRole::kAverage}}, tooMany), c10::ValueError);
}

}  // namespace
}  // namespace shardema
