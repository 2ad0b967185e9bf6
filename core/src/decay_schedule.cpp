#include "shardema/core/decay_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "shardema/core/file_metadata.h"
#include "shardema/core/power_function.h"
#include "step_check.h"

namespace shardema {
namespace {

using nlohmann::json;

void checkUnit(const char* api, const char* name, double value) {
  TORCH_CHECK_VALUE(value >= 0.0 && value <= 1.0, api, ": ", name, " (", value,
                    ") must lie in [0, 1]");
}

void checkPositive(const char* api, const char* name, double value) {
  TORCH_CHECK_VALUE(std::isfinite(value) && value > 0.0, api, ": ", name, " (", value,
                    ") must be finite and > 0");
}

void checkUpdateEvery(const char* api, int64_t updateEvery) {
  TORCH_CHECK_VALUE(updateEvery >= 1, api, ": update_every (", updateEvery,
                    ") must be >= 1 (1 updates on every step)");
}

using detail::checkStep;

const char* conventionName(BetaConvention convention) {
  return convention == BetaConvention::kEdm2 ? "edm2" : "nitrous";
}

// 17 significant digits always round-trip a double through strtod, which is
// what nlohmann's parser uses; nlohmann's own dump would pick the shortest
// form, which is exact too, but the metadata format is fixed to %.17g.
std::string formatDouble(double value) { return detail::formatDecimal17(value); }

// Appends "name":value pairs to one flat JSON object (all our fields are
// scalars and our names need no escaping).
class FlatJsonWriter {
 public:
  explicit FlatJsonWriter(const char* kind) { text_ = std::string("{\"kind\":\"") + kind + "\""; }
  void add(const char* name, double value) { raw(name, formatDouble(value)); }
  void add(const char* name, int64_t value) { raw(name, std::to_string(value)); }
  void add(const char* name, bool value) { raw(name, value ? "true" : "false"); }
  void add(const char* name, const char* value) { raw(name, std::string("\"") + value + "\""); }
  std::string finish() const { return text_ + "}"; }

 private:
  void raw(const char* name, const std::string& value) {
    text_ += std::string(",\"") + name + "\":" + value;
  }
  std::string text_;
};

// Reads the fields of one JSON object by name, remembering which were read
// so that misspelt or foreign fields are rejected rather than ignored.
class FieldReader {
 public:
  explicit FieldReader(const json& object) : object_(object) {}

  bool has(const char* name) const { return object_.contains(name); }

  const json& field(const char* name) {
    TORCH_CHECK_VALUE(has(name), "DecaySchedule::fromJson: field \"", name, "\" is missing");
    used_.insert(name);
    return object_.at(name);
  }

  double number(const char* name) {
    const json& value = field(name);
    TORCH_CHECK_VALUE(value.is_number(), "DecaySchedule::fromJson: field \"", name,
                      "\" must be a number, got ", value.dump());
    return value.get<double>();
  }

  int64_t integer(const char* name) {
    const json& value = field(name);
    const bool fits = value.is_number_integer() &&
                      !(value.is_number_unsigned() &&
                        value.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()));
    TORCH_CHECK_VALUE(fits, "DecaySchedule::fromJson: field \"", name,
                      "\" must be an int64 integer, got ", value.dump());
    return value.get<int64_t>();
  }

  bool boolean(const char* name) {
    const json& value = field(name);
    TORCH_CHECK_VALUE(value.is_boolean(), "DecaySchedule::fromJson: field \"", name,
                      "\" must be true or false, got ", value.dump());
    return value.get<bool>();
  }

  std::string string(const char* name) {
    const json& value = field(name);
    TORCH_CHECK_VALUE(value.is_string(), "DecaySchedule::fromJson: field \"", name,
                      "\" must be a string, got ", value.dump());
    return value.get<std::string>();
  }

  void checkAllUsed() const {
    for (const auto& item : object_.items()) {
      TORCH_CHECK_VALUE(used_.count(item.key()) != 0, "DecaySchedule::fromJson: unknown field \"",
                        item.key(), "\"");
    }
  }

 private:
  const json& object_;
  std::set<std::string> used_;
};

DecaySchedule warmupFromJson(FieldReader& reader) {
  WarmupScheduleOptions options;
  options.invGamma = reader.number("inv_gamma");
  options.power = reader.number("power");
  options.minValue = reader.number("min_value");
  options.maxValue = reader.number("max_value");
  options.updateAfterStep = reader.integer("update_after_step");
  options.updateEvery = reader.integer("update_every");
  return DecaySchedule::warmup(options);
}

DecaySchedule powerFromJson(FieldReader& reader) {
  PowerScheduleOptions options;
  TORCH_CHECK_VALUE(reader.has("sigma_rel") != reader.has("gamma"),
                    "DecaySchedule::fromJson: a power schedule needs exactly one of the fields "
                    "\"sigma_rel\" and \"gamma\"");
  if (reader.has("gamma")) {
    options.gamma = reader.number("gamma");
    TORCH_CHECK_VALUE(options.gamma != 0.0, "DecaySchedule::fromJson: field \"gamma\" must be > 0");
  } else {
    options.sigmaRel = reader.number("sigma_rel");
  }
  const std::string convention = reader.string("convention");
  TORCH_CHECK_VALUE(convention == "nitrous" || convention == "edm2",
                    "DecaySchedule::fromJson: field \"convention\" must be \"nitrous\" or "
                    "\"edm2\", got \"",
                    convention, "\"");
  options.convention = convention == "edm2" ? BetaConvention::kEdm2 : BetaConvention::kNitrous;
  options.updateEvery = reader.integer("update_every");
  options.stepSizeCorrection = reader.boolean("step_size_correction");
  return DecaySchedule::powerFunction(options);
}

}  // namespace

DecaySchedule DecaySchedule::constant(const ConstantScheduleOptions& options) {
  constexpr const char* kApi = "DecaySchedule::constant";
  checkUnit(kApi, "decay", options.decay);
  checkUpdateEvery(kApi, options.updateEvery);
  DecaySchedule schedule;
  schedule.kind_ = ScheduleKind::kConstant;
  schedule.constant_ = options;
  return schedule;
}

DecaySchedule DecaySchedule::warmup(const WarmupScheduleOptions& options) {
  constexpr const char* kApi = "DecaySchedule::warmup";
  checkPositive(kApi, "inv_gamma", options.invGamma);
  checkPositive(kApi, "power", options.power);
  checkUnit(kApi, "min_value", options.minValue);
  checkUnit(kApi, "max_value", options.maxValue);
  TORCH_CHECK_VALUE(options.minValue <= options.maxValue, kApi, ": min_value (", options.minValue,
                    ") must not exceed max_value (", options.maxValue, ")");
  TORCH_CHECK_VALUE(options.updateAfterStep >= 0, kApi, ": update_after_step (",
                    options.updateAfterStep, ") must be >= 0");
  checkUpdateEvery(kApi, options.updateEvery);
  DecaySchedule schedule;
  schedule.kind_ = ScheduleKind::kWarmup;
  schedule.warmup_ = options;
  return schedule;
}

DecaySchedule DecaySchedule::powerFunction(const PowerScheduleOptions& options) {
  constexpr const char* kApi = "DecaySchedule::powerFunction";
  checkUpdateEvery(kApi, options.updateEvery);
  DecaySchedule schedule;
  schedule.kind_ = ScheduleKind::kPower;
  schedule.power_ = options;
  if (options.gamma == 0.0) {
    TORCH_CHECK_VALUE(options.sigmaRel > 0.0 && options.sigmaRel < kMaxSigmaRel, kApi,
                      ": sigma_rel (", options.sigmaRel, ") must lie in (0, ", kMaxSigmaRel,
                      "); larger values have no power profile");
    schedule.gamma_ = sigmaRelToGamma(options.sigmaRel);
    schedule.sigmaRel_ = options.sigmaRel;
  } else {
    TORCH_CHECK_VALUE(std::isfinite(options.gamma) && options.gamma > 0.0, kApi, ": gamma (",
                      options.gamma, ") must be finite and > 0, or 0 to derive it from sigma_rel");
    schedule.gamma_ = options.gamma;
    schedule.sigmaRel_ = gammaToSigmaRel(options.gamma);
  }
  return schedule;
}

double DecaySchedule::decayAt(int64_t n) const {
  checkStep("DecaySchedule::decayAt", n);
  switch (kind_) {
    case ScheduleKind::kConstant:
      return constant_.decay;
    case ScheduleKind::kWarmup: {
      // n - updateAfterStep - 1 cannot overflow: n >= 1 and updateAfterStep >= 0.
      const int64_t e = n - warmup_.updateAfterStep - 1;
      if (e <= 0)
        return 0.0;  // min_value deliberately not applied here (docs/spec/reference_semantics.md
                     // section 1)
      const double value =
          1.0 - std::pow(1.0 + static_cast<double>(e) / warmup_.invGamma, -warmup_.power);
      return std::clamp(value, warmup_.minValue, warmup_.maxValue);
    }
    case ScheduleKind::kPower:
      return power_.stepSizeCorrection
                 ? correctedPowerFunctionBeta(gamma_, n, power_.updateEvery, power_.convention)
                 : powerFunctionBeta(gamma_, n, power_.convention);
  }
  TORCH_INTERNAL_ASSERT(false, "DecaySchedule::decayAt: unknown kind");
  return 0.0;
}

bool DecaySchedule::isDueAt(int64_t n) const {
  checkStep("DecaySchedule::isDueAt", n);
  return (n - 1) % updateEvery() == 0;
}

int64_t DecaySchedule::updateEvery() const {
  switch (kind_) {
    case ScheduleKind::kConstant:
      return constant_.updateEvery;
    case ScheduleKind::kWarmup:
      return warmup_.updateEvery;
    case ScheduleKind::kPower:
      return power_.updateEvery;
  }
  return 1;
}

double DecaySchedule::gamma() const {
  TORCH_CHECK_VALUE(kind_ == ScheduleKind::kPower,
                    "DecaySchedule::gamma: only power schedules have a gamma; this one is ",
                    scheduleKindName(kind_));
  return gamma_;
}

double DecaySchedule::sigmaRel() const {
  TORCH_CHECK_VALUE(kind_ == ScheduleKind::kPower,
                    "DecaySchedule::sigmaRel: only power schedules have a sigma_rel; this one is ",
                    scheduleKindName(kind_));
  return sigmaRel_;
}

std::string DecaySchedule::toJson() const {
  FlatJsonWriter writer(scheduleKindName(kind_));
  switch (kind_) {
    case ScheduleKind::kConstant:
      writer.add("decay", constant_.decay);
      writer.add("update_every", constant_.updateEvery);
      break;
    case ScheduleKind::kWarmup:
      writer.add("inv_gamma", warmup_.invGamma);
      writer.add("power", warmup_.power);
      writer.add("min_value", warmup_.minValue);
      writer.add("max_value", warmup_.maxValue);
      writer.add("update_after_step", warmup_.updateAfterStep);
      writer.add("update_every", warmup_.updateEvery);
      break;
    case ScheduleKind::kPower:
      // Only the option that defines the profile: the other one is ignored by
      // powerFunction(), so writing it would make equal schedules compare unequal.
      if (power_.gamma == 0.0) {
        writer.add("sigma_rel", power_.sigmaRel);
      } else {
        writer.add("gamma", power_.gamma);
      }
      writer.add("convention", conventionName(power_.convention));
      writer.add("update_every", power_.updateEvery);
      writer.add("step_size_correction", power_.stepSizeCorrection);
      break;
  }
  return writer.finish();
}

DecaySchedule DecaySchedule::fromJson(const std::string& text) {
  const json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(!parsed.is_discarded() && parsed.is_object(),
                    "DecaySchedule::fromJson: expected a JSON object, got '", text, "'");
  FieldReader reader(parsed);
  const std::string kind = reader.string("kind");
  DecaySchedule schedule;
  if (kind == "constant") {
    ConstantScheduleOptions options;
    options.decay = reader.number("decay");
    options.updateEvery = reader.integer("update_every");
    schedule = constant(options);
  } else if (kind == "warmup") {
    schedule = warmupFromJson(reader);
  } else if (kind == "power") {
    schedule = powerFromJson(reader);
  } else {
    TORCH_CHECK_VALUE(false, "DecaySchedule::fromJson: field \"kind\" must be \"constant\", ",
                      "\"warmup\" or \"power\", got \"", kind, "\"");
  }
  reader.checkAllUsed();
  return schedule;
}

std::string DecaySchedule::describe() const {
  char buffer[256];
  switch (kind_) {
    case ScheduleKind::kConstant:
      std::snprintf(buffer, sizeof(buffer), "constant(decay=%.10g, update_every=%lld)",
                    constant_.decay, static_cast<long long>(constant_.updateEvery));
      break;
    case ScheduleKind::kWarmup:
      std::snprintf(buffer, sizeof(buffer),
                    "warmup(inv_gamma=%.10g, power=%.10g, min_value=%.10g, max_value=%.10g, "
                    "update_after_step=%lld, update_every=%lld)",
                    warmup_.invGamma, warmup_.power, warmup_.minValue, warmup_.maxValue,
                    static_cast<long long>(warmup_.updateAfterStep),
                    static_cast<long long>(warmup_.updateEvery));
      break;
    case ScheduleKind::kPower:
      std::snprintf(buffer, sizeof(buffer),
                    "power(sigma_rel=%.10g, gamma=%.10g, convention=%s, update_every=%lld, "
                    "step_size_correction=%s)",
                    sigmaRel_, gamma_, conventionName(power_.convention),
                    static_cast<long long>(power_.updateEvery),
                    power_.stepSizeCorrection ? "true" : "false");
      break;
  }
  return buffer;
}

const char* scheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kConstant:
      return "constant";
    case ScheduleKind::kWarmup:
      return "warmup";
    case ScheduleKind::kPower:
      return "power";
  }
  return "unknown";
}

}  // namespace shardema
