#include "shardema/core/decay_schedule.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardema/core/power_function.h"
#include "support/value_error.h"

namespace shardema {
namespace {

using nlohmann::json;

// The golden warmup decays were computed by ema-pytorch in float32 (the step
// buffer becomes a float32 tensor), whose rounding differs from our float64
// evaluation by up to ~5e-8; 1e-7 absolute covers that and nothing more. The
// file's float64 diffusers re-implementation is compared much tighter.
constexpr double kGoldenTolerance = 1e-7;

json loadGolden(const std::string& name) {
  std::ifstream in(std::string(SHARDEMA_TEST_DATA_DIR) + "/" + name);
  EXPECT_TRUE(in.good()) << "missing tests/data/" << name;
  return json::parse(in);
}

WarmupScheduleOptions warmupOptions(double invGamma, double power, double minValue, double maxValue,
                                    int64_t updateAfterStep) {
  WarmupScheduleOptions options;
  options.invGamma = invGamma;
  options.power = power;
  options.minValue = minValue;
  options.maxValue = maxValue;
  options.updateAfterStep = updateAfterStep;
  return options;
}

PowerScheduleOptions powerOptions(double sigmaRel, BetaConvention convention, int64_t every,
                                  bool corrected) {
  PowerScheduleOptions options;
  options.sigmaRel = sigmaRel;
  options.convention = convention;
  options.updateEvery = every;
  options.stepSizeCorrection = corrected;
  return options;
}

// The golden step_buffer_values are our 1-based n: ema-pytorch increments its
// step buffer before computing the decay. Value 0 never reaches the formula.
TEST(DecayScheduleTest, WarmupMatchesGolden) {
  const json golden = loadGolden("warmup_decay_schedule.json");
  ASSERT_EQ(golden["cases"].size(), 5u);
  for (const json& item : golden["cases"]) {
    const json& settings = item["settings"];
    const DecaySchedule schedule = DecaySchedule::warmup(
        warmupOptions(settings["inv_gamma"].get<double>(), settings["power"].get<double>(),
                      settings["min_value"].get<double>(), settings["beta"].get<double>(),
                      settings["update_after_step"].get<int64_t>()));
    const auto steps = item["step_buffer_values"].get<std::vector<int64_t>>();
    const auto decay = item["decay"].get<std::vector<double>>();
    const auto diffusers = item["diffusers_get_decay_same_argument"].get<std::vector<double>>();
    const std::string name = settings["name"].get<std::string>();
    for (size_t i = 0; i < steps.size(); ++i) {
      if (steps[i] == 0) {
        EXPECT_EQ(decay[i], 0.0) << name;
        continue;
      }
      const double ours = schedule.decayAt(steps[i]);
      EXPECT_NEAR(ours, decay[i], kGoldenTolerance) << name << " n " << steps[i];
      EXPECT_NEAR(ours, diffusers[i], 1e-15) << name << " n " << steps[i] << " (float64 ref)";
    }
  }
}

TEST(DecayScheduleTest, WarmupIsZeroUntilAveragingStartsEvenWithMinValue) {
  const DecaySchedule schedule = DecaySchedule::warmup(warmupOptions(10.0, 1.0, 0.5, 0.99, 5));
  for (int64_t n = 1; n <= 6; ++n) EXPECT_EQ(schedule.decayAt(n), 0.0) << n;
  EXPECT_EQ(schedule.decayAt(7), 0.5) << "e = 1: 1 - 1/1.1 clamped up to min_value";
  EXPECT_NEAR(schedule.decayAt(17), 1.0 - 1.0 / 2.1, 1e-16) << "e = 11";
  EXPECT_EQ(schedule.decayAt(100000), 0.99);
}

TEST(DecayScheduleTest, WarmupDefaultsFollowVersatil) {
  const WarmupScheduleOptions defaults;
  EXPECT_EQ(defaults.power, 0.75);
  EXPECT_EQ(defaults.invGamma, 1.0);
  EXPECT_EQ(defaults.minValue, 0.0);
  EXPECT_EQ(defaults.maxValue, 0.9999);
  EXPECT_EQ(defaults.updateAfterStep, 0);
  EXPECT_EQ(defaults.updateEvery, 1);
  const DecaySchedule schedule = DecaySchedule::warmup();
  EXPECT_EQ(schedule.kind(), ScheduleKind::kWarmup);
  EXPECT_EQ(schedule.decayAt(1), 0.0);
  EXPECT_NEAR(schedule.decayAt(2), 1.0 - std::pow(2.0, -0.75), 1e-16);
  EXPECT_EQ(schedule.decayAt(int64_t(1) << 40), 0.9999);
}

TEST(DecayScheduleTest, PowerMatchesGoldenThroughTheSchedule) {
  const json golden = loadGolden("karras_gamma_beta.json");
  for (const auto& item : golden["betas"].items()) {
    const json& profile = item.value();
    const double sigma = profile["sigma_rel"].get<double>();
    const auto check = [&](const char* key, int64_t every, bool corrected) {
      const DecaySchedule schedule = DecaySchedule::powerFunction(
          powerOptions(sigma, BetaConvention::kNitrous, every, corrected));
      const auto calls = profile[key]["update_calls"].get<std::vector<int64_t>>();
      const auto betas = profile[key]["beta"].get<std::vector<double>>();
      for (size_t i = 0; i < calls.size(); ++i) {
        const int64_t n = calls[i] + 1;  // nitrous call c is our step n = c + 1
        EXPECT_TRUE(schedule.isDueAt(n)) << key << " n " << n;
        EXPECT_NEAR(schedule.decayAt(n), betas[i], kGoldenTolerance) << key << " n " << n;
      }
    };
    check("nitrous_beta_update_every1_correctionFalse", 1, false);
    check("nitrous_beta_update_every1_correctionTrue", 1, true);
    check("nitrous_beta_update_every10_correctionFalse", 10, false);
    check("nitrous_beta_update_every10_correctionTrue", 10, true);
    const DecaySchedule edm2 =
        DecaySchedule::powerFunction(powerOptions(sigma, BetaConvention::kEdm2, 1, false));
    const json& reference = profile["edm2_power_function_beta_t_next_n_delta_1"];
    const auto ns = reference["n"].get<std::vector<int64_t>>();
    const auto betas = reference["beta"].get<std::vector<double>>();
    for (size_t i = 0; i < ns.size(); ++i) {
      EXPECT_NEAR(edm2.decayAt(ns[i]), betas[i], kGoldenTolerance) << "edm2 n " << ns[i];
    }
  }
}

TEST(DecayScheduleTest, PowerResolvesGammaAndSigmaRel) {
  const DecaySchedule bySigma = DecaySchedule::powerFunction();
  EXPECT_EQ(bySigma.kind(), ScheduleKind::kPower);
  EXPECT_EQ(bySigma.sigmaRel(), 0.05);
  EXPECT_EQ(bySigma.gamma(), sigmaRelToGamma(0.05));
  PowerScheduleOptions options;
  options.gamma = 6.937203937601809;
  options.sigmaRel = 0.2;  // ignored: gamma defines the profile
  const DecaySchedule byGamma = DecaySchedule::powerFunction(options);
  EXPECT_EQ(byGamma.gamma(), options.gamma);
  EXPECT_NEAR(byGamma.sigmaRel(), 0.1, 1e-15);
  EXPECT_EQ(byGamma.decayAt(9), powerFunctionBeta(options.gamma, 9, BetaConvention::kNitrous));
}

TEST(DecayScheduleTest, ConstantIsConstant) {
  ConstantScheduleOptions options;
  options.decay = 0.995;
  const DecaySchedule schedule = DecaySchedule::constant(options);
  for (int64_t n : {int64_t(1), int64_t(2), int64_t(1000), std::numeric_limits<int64_t>::max()}) {
    EXPECT_EQ(schedule.decayAt(n), 0.995);
  }
  EXPECT_EQ(DecaySchedule::constant().decayAt(3), 0.9999);
}

TEST(DecayScheduleTest, IsDueAtCountsOptimizerStepsFromOne) {
  ConstantScheduleOptions options;
  options.updateEvery = 10;
  const DecaySchedule every10 = DecaySchedule::constant(options);
  EXPECT_EQ(every10.updateEvery(), 10);
  for (int64_t n = 1; n <= 45; ++n) EXPECT_EQ(every10.isDueAt(n), n % 10 == 1) << n;
  const DecaySchedule every1 = DecaySchedule::warmup();
  for (int64_t n = 1; n <= 5; ++n) EXPECT_TRUE(every1.isDueAt(n));
  EXPECT_VALUE_ERROR(every10.isDueAt(0), "n (0)");
}

std::vector<DecaySchedule> schedulesOfEveryKind() {
  std::vector<DecaySchedule> schedules = {
      DecaySchedule::constant(), DecaySchedule::warmup(),
      DecaySchedule::warmup(warmupOptions(10.0, 1.0, 0.5, 0.99, 5)),
      DecaySchedule::warmup(warmupOptions(2.0, 0.5, 0.1, 1.0, 1)),
      DecaySchedule::warmup(warmupOptions(1.0, 2.0 / 3.0, 0.0, 0.9999, 100))};
  for (BetaConvention convention : {BetaConvention::kNitrous, BetaConvention::kEdm2}) {
    for (bool corrected : {false, true}) {
      for (int64_t every : {1, 10, 1000}) {
        for (double sigma : {0.01, 0.05, 0.28}) {
          schedules.push_back(
              DecaySchedule::powerFunction(powerOptions(sigma, convention, every, corrected)));
        }
      }
    }
  }
  return schedules;
}

// The CLI's --reach binary search depends on this.
TEST(DecayScheduleTest, EveryKindIsNonDecreasingAndInUnitInterval) {
  for (const DecaySchedule& schedule : schedulesOfEveryKind()) {
    double previous = 0.0;
    const auto visit = [&](int64_t n) {
      const double value = schedule.decayAt(n);
      ASSERT_GE(value, previous) << schedule.describe() << " n " << n;
      ASSERT_LE(value, 1.0) << schedule.describe() << " n " << n;
      previous = value;
    };
    for (int64_t n = 1; n <= 5000; ++n) visit(n);
    for (int64_t n = 5001; n < (int64_t(1) << 62); n += n / 7) visit(n);
    visit(int64_t(1) << 62);
  }
}

TEST(DecayScheduleTest, RejectsBadWarmupOptions) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto warmup = [](WarmupScheduleOptions options) { DecaySchedule::warmup(options); };
  for (double bad : {0.0, -1.0, nan, std::numeric_limits<double>::infinity()}) {
    EXPECT_VALUE_ERROR(warmup(warmupOptions(bad, 0.75, 0.0, 0.9999, 0)), "inv_gamma");
    EXPECT_VALUE_ERROR(warmup(warmupOptions(1.0, bad, 0.0, 0.9999, 0)), "power");
  }
  for (double bad : {-0.1, 1.1, nan}) {
    EXPECT_VALUE_ERROR(warmup(warmupOptions(1.0, 0.75, bad, 0.9999, 0)), "min_value");
    EXPECT_VALUE_ERROR(warmup(warmupOptions(1.0, 0.75, 0.0, bad, 0)), "max_value");
  }
  EXPECT_VALUE_ERROR(warmup(warmupOptions(1.0, 0.75, 0.9, 0.5, 0)),
                     "DecaySchedule::warmup: min_value (0.9) must not exceed max_value (0.5)");
  EXPECT_VALUE_ERROR(warmup(warmupOptions(1.0, 0.75, 0.0, 0.9999, -1)), "update_after_step");
  WarmupScheduleOptions options;
  options.updateEvery = 0;
  EXPECT_VALUE_ERROR(warmup(options), "update_every");
}

TEST(DecayScheduleTest, RejectsBadConstantAndPowerOptions) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double bad : {-0.1, 1.5, nan}) {
    ConstantScheduleOptions options;
    options.decay = bad;
    EXPECT_VALUE_ERROR(DecaySchedule::constant(options), "decay");
  }
  ConstantScheduleOptions constant;
  constant.updateEvery = -2;
  EXPECT_VALUE_ERROR(DecaySchedule::constant(constant), "update_every");
  for (double bad : {0.0, -0.05, kMaxSigmaRel, 0.3, nan}) {
    EXPECT_VALUE_ERROR(
        DecaySchedule::powerFunction(powerOptions(bad, BetaConvention::kNitrous, 1, false)),
        "sigma_rel");
  }
  for (double bad : {-1.0, nan, std::numeric_limits<double>::infinity()}) {
    PowerScheduleOptions options;
    options.gamma = bad;
    EXPECT_VALUE_ERROR(DecaySchedule::powerFunction(options), "gamma");
  }
  EXPECT_VALUE_ERROR(
      DecaySchedule::powerFunction(powerOptions(0.1, BetaConvention::kNitrous, 0, true)),
      "update_every");
}

TEST(DecayScheduleTest, RejectsStepsBelowOneAndPowerAccessorsOnOtherKinds) {
  for (const DecaySchedule& schedule : schedulesOfEveryKind()) {
    EXPECT_VALUE_ERROR(schedule.decayAt(0), "n (0)");
    EXPECT_VALUE_ERROR(schedule.decayAt(-7), "n (-7)");
  }
  EXPECT_VALUE_ERROR(DecaySchedule::warmup().gamma(), "gamma");
  EXPECT_VALUE_ERROR(DecaySchedule::constant().sigmaRel(), "sigma_rel");
}

TEST(DecayScheduleTest, JsonRoundTripIsExact) {
  std::vector<DecaySchedule> schedules = schedulesOfEveryKind();
  schedules.push_back(DecaySchedule::warmup(
      warmupOptions(1.0 / 3.0, 2.0 / 3.0, 0.1 + 1e-17, 0.9999999999999999, int64_t(1) << 40)));
  PowerScheduleOptions byGamma;
  byGamma.gamma = std::nextafter(7.0, 8.0);
  schedules.push_back(DecaySchedule::powerFunction(byGamma));
  schedules.push_back(
      DecaySchedule::powerFunction(powerOptions(0.1 / 3.0, BetaConvention::kEdm2, 7, true)));
  for (const DecaySchedule& schedule : schedules) {
    const std::string text = schedule.toJson();
    const DecaySchedule back = DecaySchedule::fromJson(text);
    EXPECT_EQ(back, schedule) << text;
    EXPECT_EQ(back.toJson(), text);
    EXPECT_EQ(back.kind(), schedule.kind());
    EXPECT_EQ(back.updateEvery(), schedule.updateEvery());
    for (int64_t n : {1, 2, 3, 17, 1000, 123456789}) {
      EXPECT_EQ(back.decayAt(n), schedule.decayAt(n)) << text << " n " << n;  // bitwise
    }
    if (schedule.kind() == ScheduleKind::kPower) {
      EXPECT_EQ(back.gamma(), schedule.gamma());
    }
  }
  EXPECT_EQ(schedules.back().toJson(), DecaySchedule::fromJson(schedules.back().toJson()).toJson());
  EXPECT_NE(DecaySchedule::warmup(), DecaySchedule::constant());
}

TEST(DecayScheduleTest, JsonFieldsAreSnakeCaseWithSeventeenDigits) {
  EXPECT_EQ(DecaySchedule::warmup().toJson(),
            "{\"kind\":\"warmup\",\"inv_gamma\":1,\"power\":0.75,\"min_value\":0,"
            "\"max_value\":0.99990000000000001,\"update_after_step\":0,\"update_every\":1}");
  EXPECT_EQ(DecaySchedule::constant().toJson(),
            "{\"kind\":\"constant\",\"decay\":0.99990000000000001,\"update_every\":1}");
  EXPECT_EQ(
      DecaySchedule::powerFunction(powerOptions(0.1, BetaConvention::kEdm2, 10, true)).toJson(),
      "{\"kind\":\"power\",\"sigma_rel\":0.10000000000000001,\"convention\":\"edm2\","
      "\"update_every\":10,\"step_size_correction\":true}");
  // Fields may come in any order and with whitespace.
  const DecaySchedule parsed =
      DecaySchedule::fromJson(R"({ "update_every": 1, "decay": 0.5, "kind": "constant" })");
  EXPECT_EQ(parsed.decayAt(4), 0.5);
}

TEST(DecayScheduleTest, FromJsonRejectsBadInputNamingTheField) {
  const auto parse = [](const std::string& text) { DecaySchedule::fromJson(text); };
  EXPECT_VALUE_ERROR(parse("not json"), "JSON object");
  EXPECT_VALUE_ERROR(parse("[1, 2]"), "JSON object");
  EXPECT_VALUE_ERROR(parse(R"({"decay":0.5,"update_every":1})"), "\"kind\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"linear"})"), "\"kind\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"constant","update_every":1})"), "\"decay\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"constant","decay":"0.5","update_every":1})"), "\"decay\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"constant","decay":0.5,"update_every":1.5})"),
                     "\"update_every\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"constant","decay":0.5,"update_every":1,"decai":1})"),
                     "\"decai\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"constant","decay":1.5,"update_every":1})"), "decay");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"warmup","inv_gamma":1,"power":0.75,"min_value":0.9,)"
                           R"("max_value":0.5,"update_after_step":0,"update_every":1})"),
                     "min_value");
  const std::string powerTail =
      R"("convention":"nitrous","update_every":1,"step_size_correction":false})";
  EXPECT_VALUE_ERROR(parse(R"({"kind":"power","sigma_rel":0.1,"gamma":7,)" + powerTail),
                     "\"sigma_rel\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"power",)" + powerTail), "\"gamma\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"power","gamma":0,)" + powerTail), "\"gamma\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"power","gamma":-2,)" + powerTail), "gamma");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"power","sigma_rel":0.1,"convention":"karras",)"
                           R"("update_every":1,"step_size_correction":false})"),
                     "\"convention\"");
  EXPECT_VALUE_ERROR(parse(R"({"kind":"power","sigma_rel":0.1,"convention":"edm2",)"
                           R"("update_every":1,"step_size_correction":1})"),
                     "\"step_size_correction\"");
}

TEST(DecayScheduleTest, DescribeNamesKindAndOptions) {
  const std::string warmup = DecaySchedule::warmup().describe();
  EXPECT_NE(warmup.find("warmup("), std::string::npos) << warmup;
  EXPECT_NE(warmup.find("power=0.75"), std::string::npos) << warmup;
  const std::string power =
      DecaySchedule::powerFunction(powerOptions(0.1, BetaConvention::kEdm2, 1, true)).describe();
  EXPECT_NE(power.find("sigma_rel=0.1"), std::string::npos) << power;
  EXPECT_NE(power.find("gamma=6.9372039"), std::string::npos) << power;
  EXPECT_NE(power.find("convention=edm2"), std::string::npos) << power;
  EXPECT_NE(DecaySchedule::constant().describe().find("constant(decay=0.9999"), std::string::npos);
}

}  // namespace
}  // namespace shardema
