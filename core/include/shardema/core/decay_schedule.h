#pragma once
// DecaySchedule: the EMA decay beta as a pure function of the optimizer step.
//
// Step convention (docs/spec/reference_semantics.md section 7): n is the 1-based number of
// optimizer steps taken, i.e. Lightning's global_step after the step, or the number of
// Averager::update() calls so far including this one. Every formula is
// evaluated in float64.
#include <cstdint>
#include <map>
#include <string>

namespace shardema {

enum class ScheduleKind { kConstant, kWarmup, kPower };

/// "constant", "warmup" or "power": the names toJson() writes.
const char* scheduleKindName(ScheduleKind kind);

/// Which off-by-one of the power-function beta to use (docs/spec/reference_semantics.md section 2).
enum class BetaConvention {
  /// ema-pytorch / nitrous (the default): beta(n) = (1 - 1/(n+1))^(gamma+1);
  /// the first update of an Averager is a copy.
  kNitrous,
  /// NVlabs/edm2 (paper Eq. 127): beta(n) = (1 - 1/n)^(gamma+1), so beta(1) = 0.
  kEdm2,
};

struct ConstantScheduleOptions {
  /// The decay used at every step. Must lie in [0, 1]. Default 0.9999.
  double decay = 0.9999;
  /// Update only on steps n with (n - 1) % updateEvery == 0. Default 1.
  int64_t updateEvery = 1;
};

/// Warmup ("inverse decay") schedule, docs/spec/reference_semantics.md section 7:
/// e = max(0, n - updateAfterStep - 1); decay = 0 when e <= 0, otherwise
/// clamp(1 - (1 + e / invGamma)^(-power), minValue, maxValue).
/// Defaults follow the VersatIL callback.
struct WarmupScheduleOptions {
  /// Inverse multiplicative factor of the warmup; > 0. Default 1.
  double invGamma = 1.0;
  /// Warmup exponent; > 0. 2/3 suits runs of a million steps or more,
  /// 3/4 (default) shorter runs.
  double power = 0.75;
  /// Lower clamp of the decay once e > 0; in [0, 1]. Default 0.
  double minValue = 0.0;
  /// Upper clamp (ema-pytorch's `beta`); in [minValue, 1]. Default 0.9999.
  double maxValue = 0.9999;
  /// Steps before averaging starts (they copy); >= 0. Default 0.
  int64_t updateAfterStep = 0;
  /// Update only on steps n with (n - 1) % updateEvery == 0. Default 1.
  int64_t updateEvery = 1;
};

/// Karras power-function EMA (paper Algorithm 2), given by sigmaRel or gamma.
struct PowerScheduleOptions {
  /// Relative standard deviation of the averaging profile, in
  /// (0, kMaxSigmaRel = 0.28867...). Used (and validated) only when
  /// gamma == 0. Default 0.05.
  double sigmaRel = 0.05;
  /// Profile exponent. 0 (default) derives it from sigmaRel; any other value
  /// must be finite and > 0, is used as is, and sigmaRel is derived from it.
  double gamma = 0.0;
  /// Off-by-one convention; default nitrous (see BetaConvention).
  BetaConvention convention = BetaConvention::kNitrous;
  /// Update only on steps n with (n - 1) % updateEvery == 0. Default 1.
  int64_t updateEvery = 1;
  /// nitrous step_size_correction: beta = [b(n) * b(n + u)]^(u/2) with b the
  /// plain beta and u = updateEvery. Note it differs from the plain beta even
  /// for u = 1. Default false (the PostHoc callback turns it on).
  bool stepSizeCorrection = false;
};

/// An immutable, copyable schedule. Construction validates every field and
/// throws c10::ValueError naming the offending option.
class DecaySchedule {
 public:
  static DecaySchedule constant(const ConstantScheduleOptions& options = {});
  static DecaySchedule warmup(const WarmupScheduleOptions& options = {});
  static DecaySchedule powerFunction(const PowerScheduleOptions& options = {});

  ScheduleKind kind() const { return kind_; }
  /// Decay at 1-based step n (n >= 1, else c10::ValueError). Pure, float64,
  /// defined for every n (due or not) and non-decreasing in n for all kinds.
  double decayAt(int64_t n) const;
  /// Whether step n performs an update: (n - 1) % updateEvery == 0; n >= 1.
  bool isDueAt(int64_t n) const;
  int64_t updateEvery() const;
  /// Power schedule only (c10::ValueError otherwise): the profile exponent
  /// and sigma_rel actually used.
  double gamma() const;
  double sigmaRel() const;

  const ConstantScheduleOptions& constantOptions() const { return constant_; }
  const WarmupScheduleOptions& warmupOptions() const { return warmup_; }
  const PowerScheduleOptions& powerOptions() const { return power_; }

  /// One-line JSON object naming the kind and every option, doubles with 17
  /// significant digits (%.17g), e.g. {"kind":"warmup","inv_gamma":1,...}.
  /// Fields: constant: decay, update_every; warmup: inv_gamma, power,
  /// min_value, max_value, update_after_step, update_every; power: sigma_rel
  /// or gamma (whichever defines the profile), convention ("nitrous"|"edm2"),
  /// update_every, step_size_correction. Stored in checkpoint metadata;
  /// fromJson(toJson()) reproduces the schedule exactly.
  std::string toJson() const;
  /// Parses toJson() output. Every field of the kind is required and unknown
  /// fields are rejected; c10::ValueError naming the field on bad input, and
  /// the factories' validation applies.
  static DecaySchedule fromJson(const std::string& json);
  /// Short human description, e.g. "warmup(inv_gamma=1, power=0.75, ...)".
  std::string describe() const;

  bool operator==(const DecaySchedule& other) const { return toJson() == other.toJson(); }
  bool operator!=(const DecaySchedule& other) const { return !(*this == other); }

 private:
  DecaySchedule() = default;
  ScheduleKind kind_ = ScheduleKind::kConstant;
  ConstantScheduleOptions constant_;
  WarmupScheduleOptions warmup_;
  PowerScheduleOptions power_;
  double gamma_ = 0.0;     // resolved exponent (power only)
  double sigmaRel_ = 0.0;  // resolved sigma_rel (power only)
};

}  // namespace shardema
