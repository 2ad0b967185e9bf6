#include "schedule_command.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <utility>

#include "flag_parser.h"

namespace shardema::cli {
namespace {

// Flags of each kind; the option names in library messages are these with
// '-' replaced by '_', which is how a ValueError is mapped back to its flag.
const std::vector<std::string> kWarmupFlags = {
    "inv-gamma", "power", "min-value", "max-value", "update-after-step", "update-every"};
const std::vector<std::string> kPowerFlags = {"sigma-rel", "gamma", "convention", "update-every",
                                              "step-size-correction"};
const std::vector<std::string> kConstantFlags = {"decay", "update-every"};

std::vector<FlagSpec> scheduleFlagSpecs() {
  std::vector<FlagSpec> specs = {{"help", FlagArity::kNone},
                                 {"kind", FlagArity::kValue},
                                 {"steps", FlagArity::kValue},
                                 {"reach", FlagArity::kValue},
                                 {"step-size-correction", FlagArity::kOptionalBool}};
  for (const auto* list : {&kWarmupFlags, &kPowerFlags, &kConstantFlags}) {
    for (const std::string& name : *list) {
      const bool known = std::any_of(specs.begin(), specs.end(),
                                     [&](const FlagSpec& spec) { return spec.name == name; });
      if (!known) specs.push_back({name, FlagArity::kValue});
    }
  }
  return specs;
}

bool contains(const std::vector<std::string>& list, const std::string& name) {
  return std::find(list.begin(), list.end(), name) != list.end();
}

std::string joinFlags(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "--" : ", --") + name;
  return text;
}

// Each flag of another kind is an error rather than silently ignored.
void checkFlagsApply(const ParsedFlags& flags, const std::string& kind,
                     const std::vector<std::string>& allowed) {
  for (const std::string& name : flags.names()) {
    const bool scheduleFlag = contains(kWarmupFlags, name) || contains(kPowerFlags, name) ||
                              contains(kConstantFlags, name);
    if (scheduleFlag && !contains(allowed, name)) {
      throw UsageError("--" + name + " does not apply to --kind " + kind + " (it takes " +
                       joinFlags(allowed) + ")");
    }
  }
}

DecaySchedule warmupFromFlags(const ParsedFlags& flags) {
  WarmupScheduleOptions options;
  if (flags.has("inv-gamma")) options.invGamma = flags.number("inv-gamma");
  if (flags.has("power")) options.power = flags.number("power");
  if (flags.has("min-value")) options.minValue = flags.number("min-value");
  if (flags.has("max-value")) options.maxValue = flags.number("max-value");
  if (flags.has("update-after-step")) options.updateAfterStep = flags.integer("update-after-step");
  if (flags.has("update-every")) options.updateEvery = flags.integer("update-every");
  return DecaySchedule::warmup(options);
}

DecaySchedule powerFromFlags(const ParsedFlags& flags) {
  PowerScheduleOptions options;
  if (flags.has("sigma-rel") && flags.has("gamma")) {
    throw UsageError("--sigma-rel and --gamma both define the profile; give only one");
  }
  if (flags.has("sigma-rel")) options.sigmaRel = flags.number("sigma-rel");
  if (flags.has("gamma")) {
    options.gamma = flags.number("gamma");
    // 0 means "derive from sigma_rel" inside the library, never a gamma.
    if (options.gamma == 0.0) throw UsageError("--gamma (0) must be > 0");
  }
  if (flags.has("convention")) {
    const std::string& convention = flags.text("convention");
    if (convention != "nitrous" && convention != "edm2") {
      throw UsageError("--convention must be nitrous or edm2 (got '" + convention + "')");
    }
    options.convention = convention == "edm2" ? BetaConvention::kEdm2 : BetaConvention::kNitrous;
  }
  if (flags.has("update-every")) options.updateEvery = flags.integer("update-every");
  options.stepSizeCorrection = flags.boolean("step-size-correction");
  return DecaySchedule::powerFunction(options);
}

DecaySchedule constantFromFlags(const ParsedFlags& flags) {
  ConstantScheduleOptions options;
  if (flags.has("decay")) options.decay = flags.number("decay");
  if (flags.has("update-every")) options.updateEvery = flags.integer("update-every");
  return DecaySchedule::constant(options);
}

bool isWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// The flag whose option name (snake_case) occurs first, as a whole word, in a
// library message such as "DecaySchedule::warmup: min_value (0.9) must ...".
std::string flagNamedIn(const std::string& message, const std::vector<std::string>& flags) {
  std::string best;
  size_t bestAt = std::string::npos;
  for (const std::string& flag : flags) {
    std::string option = flag;
    std::replace(option.begin(), option.end(), '-', '_');
    for (size_t at = message.find(option); at != std::string::npos;
         at = message.find(option, at + 1)) {
      const size_t end = at + option.size();
      const bool whole = (at == 0 || !isWordChar(message[at - 1])) &&
                         (end == message.size() || !isWordChar(message[end]));
      if (whole && at < bestAt) {
        best = flag;
        bestAt = at;
      }
      if (whole) break;
    }
  }
  return best;
}

DecaySchedule scheduleFromFlags(const ParsedFlags& flags) {
  if (!flags.has("kind")) throw UsageError("--kind is required (warmup, power or constant)");
  const std::string& kind = flags.text("kind");
  const std::vector<std::string>* allowed = kind == "warmup"     ? &kWarmupFlags
                                            : kind == "power"    ? &kPowerFlags
                                            : kind == "constant" ? &kConstantFlags
                                                                 : nullptr;
  if (allowed == nullptr) {
    throw UsageError("--kind must be warmup, power or constant (got '" + kind + "')");
  }
  checkFlagsApply(flags, kind, *allowed);
  try {
    if (kind == "warmup") return warmupFromFlags(flags);
    if (kind == "power") return powerFromFlags(flags);
    return constantFromFlags(flags);
  } catch (const c10::ValueError& error) {
    const std::string message = error.what_without_backtrace();
    const std::string flag = flagNamedIn(message, *allowed);
    throw UsageError(flag.empty() ? message : "--" + flag + ": " + message);
  }
}

struct StepRange {
  int64_t first = 1;
  int64_t last = 1;
  int64_t stride = 1;
};

// One item of --steps: N, A-B or A-B:S (1 <= A <= B, S >= 1).
StepRange parseStepItem(const std::string& item) {
  StepRange range;
  const size_t colon = item.find(':');
  const std::string span = item.substr(0, colon);
  if (colon != std::string::npos) range.stride = parseInteger("steps", item.substr(colon + 1));
  const size_t dash = span.find('-', 1);
  range.first = parseInteger("steps", span.substr(0, dash));
  range.last =
      dash == std::string::npos ? range.first : parseInteger("steps", span.substr(dash + 1));
  const bool strideWithoutRange = colon != std::string::npos && dash == std::string::npos;
  if (range.first < 1 || range.last < range.first || range.stride < 1 || strideWithoutRange) {
    throw UsageError("--steps: '" + item +
                     "' must be N, A-B or A-B:STRIDE with 1 <= N, 1 <= A <= B, STRIDE >= 1");
  }
  return range;
}

std::vector<StepRange> parseSteps(const std::string& list) {
  std::vector<StepRange> ranges;
  for (const std::string& item : splitList("steps", list, ','))
    ranges.push_back(parseStepItem(item));
  return ranges;
}

// (text as given, value): the text is echoed so "reach 0.999 ..." reads back as typed.
std::vector<std::pair<std::string, double>> parseTargets(const std::string& list) {
  std::vector<std::pair<std::string, double>> targets;
  for (const std::string& item : splitList("reach", list, ',')) {
    const double target = parseNumber("reach", item);
    if (target < 0.0 || target > 1.0) {
      throw UsageError("--reach: target " + item + " must lie in [0, 1]");
    }
    targets.emplace_back(item, target);
  }
  return targets;
}

void printSteps(const DecaySchedule& schedule, const std::vector<StepRange>& ranges,
                std::ostream& out) {
  char line[64];
  for (const StepRange& range : ranges) {
    for (int64_t n = range.first;; n += range.stride) {
      std::snprintf(line, sizeof(line), "%lld %.17g\n", static_cast<long long>(n),
                    schedule.decayAt(n));
      out << line;
      if (range.last - n < range.stride) break;  // also keeps n + stride from overflowing
    }
  }
}

void printReach(const DecaySchedule& schedule,
                const std::vector<std::pair<std::string, double>>& targets, std::ostream& out) {
  for (const auto& [text, target] : targets) {
    const std::optional<int64_t> n = firstStepReaching(schedule, target);
    out << "reach " << text << ' ' << (n ? std::to_string(*n) : std::string("never")) << '\n';
  }
}

}  // namespace

void printScheduleUsage(std::ostream& out) {
  out << R"(usage: shardema schedule --kind warmup|power|constant [options] --steps LIST | --reach LIST

Prints the EMA decay of a schedule at 1-based optimizer steps n (the first
optimizer step is n = 1), one line "n value" per step with 17 significant digits,
then one line "reach TARGET N" (or "reach TARGET never") per --reach target: the
first step N <= 2^62 with decay(N) >= TARGET. decay(n) is defined for every n;
--update-every only says which steps update, it does not change the value.

  --steps LIST    comma separated steps and ranges: 5, 1-10 (inclusive), 100-1000:100
                  (every 100th step from 100); every step >= 1
  --reach LIST    comma separated targets in [0, 1], e.g. 0.999,0.9999 (printed as given)

--kind warmup: e = max(0, n - update_after_step - 1); 0 if e <= 0, else
  clamp(1 - (1 + e/inv_gamma)^-power, min_value, max_value)
  --inv-gamma X (1)  --power X (0.75)  --min-value X (0)  --max-value X (0.9999)
  --update-after-step N (0)  --update-every N (1)
--kind power: Karras power-function EMA, beta = (1 - 1/(n+1))^(gamma+1) (nitrous)
  or (1 - 1/n)^(gamma+1) (edm2)
  --sigma-rel X (0.05) | --gamma X   --convention nitrous|edm2 (nitrous)
  --update-every N (1)  --step-size-correction [true|false] (false): nitrous'
  [beta(n) beta(n + update_every)]^(update_every/2)
--kind constant:
  --decay X (0.9999)  --update-every N (1)

Errors print one line naming the flag and exit with status 2.
)";
}

std::optional<int64_t> firstStepReaching(const DecaySchedule& schedule, double target) {
  // Valid because decayAt is non-decreasing in n for every kind: constant is
  // flat; warmup is a clamp of an increasing function of e, and its 0 before
  // e > 0 is <= min_value; the power betas are exp of (gamma+1) log1p(-1/m)
  // with m increasing in n, and the corrected one is a product of two such.
  int64_t below = 0;  // decayAt(below) < target; 0 stands for "before step 1"
  int64_t atOrAbove = 1;
  while (schedule.decayAt(atOrAbove) < target) {
    if (atOrAbove == kReachCap) return std::nullopt;
    below = atOrAbove;
    atOrAbove = std::min(atOrAbove * 2, kReachCap);
  }
  while (atOrAbove - below > 1) {
    const int64_t middle = below + (atOrAbove - below) / 2;
    (schedule.decayAt(middle) >= target ? atOrAbove : below) = middle;
  }
  return atOrAbove;
}

int runScheduleCommand(const std::vector<std::string>& args, std::ostream& out) {
  // --help wins over any other mistake on the line, as users expect.
  if (std::find(args.begin(), args.end(), "--help") != args.end()) {
    printScheduleUsage(out);
    return 0;
  }
  const ParsedFlags flags = parseFlags(scheduleFlagSpecs(), args);
  const DecaySchedule schedule = scheduleFromFlags(flags);
  if (!flags.has("steps") && !flags.has("reach")) {
    throw UsageError("nothing to print: give --steps LIST and/or --reach LIST");
  }
  // Both lists are parsed before anything is printed, so a bad --reach does
  // not leave half an output behind.
  const std::vector<StepRange> steps =
      flags.has("steps") ? parseSteps(flags.text("steps")) : std::vector<StepRange>{};
  const auto targets = flags.has("reach") ? parseTargets(flags.text("reach"))
                                          : std::vector<std::pair<std::string, double>>{};
  printSteps(schedule, steps, out);
  printReach(schedule, targets, out);
  return 0;
}

}  // namespace shardema::cli
