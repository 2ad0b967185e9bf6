#include "synthesize_command.h"

#include <cstdio>
#include <string>

#include "export_command.h"
#include "flag_parser.h"
#include "flagged_command.h"
#include "shardema/synthesis.h"

namespace shardema::cli {
namespace {

std::string fixed(double value, const char* format) {
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

SnapshotSynthesisOptions optionsFromFlags(const ParsedFlags& flags) {
  if (!flags.has("snapshots")) throw UsageError("--snapshots DIR is required");
  if (!flags.has("sigma-rel")) throw UsageError("--sigma-rel S is required");
  if (!flags.has("out")) throw UsageError("--out FILE is required");
  SnapshotSynthesisOptions options;
  options.sigmaRel = flags.number("sigma-rel");
  if (!(options.sigmaRel > 0.0 && options.sigmaRel < 0.2887)) {
    throw UsageError("--sigma-rel must lie in (0, 0.2887) (got " + flags.text("sigma-rel") + ")");
  }
  if (flags.has("step")) {
    options.step = flags.integer("step");
    if (options.step < 1) {
      throw UsageError("--step must be >= 1 (got " + flags.text("step") + ")");
    }
  }
  options.normalize = flags.boolean("normalize");
  if (flags.has("dtype")) options.outputDtype = parseDtype(flags.text("dtype"));
  return options;
}

int runParsed(const ParsedFlags& flags, std::ostream& out) {
  const SnapshotSynthesisOptions options = optionsFromFlags(flags);
  const std::string& dir = flags.text("snapshots");
  const std::string& target = flags.text("out");
  const FolderSynthesisReport report = synthesizeSnapshotFolder(dir, target, options);
  const SynthesisWeights& solve = report.weights;
  out << "snapshot weights for sigma_rel " << options.sigmaRel << " at step " << solve.targetStep
      << (options.normalize ? " (normalized)" : " (raw solve)") << ":\n";
  for (size_t i = 0; i < report.files.size(); ++i) {
    out << "  " << fixed(solve.weights[i], "%+.9e") << "  " << report.files[i]
        << (solve.used[i] ? "" : "  (after the target step: left out)") << '\n';
  }
  out << "sum of weights " << fixed(solve.sum, "%.9f") << ", condition number "
      << fixed(solve.conditionNumber, "%.3e")
      << (solve.badlyConditioned ? " (badly conditioned: weights may be inaccurate)" : "") << '\n';
  out << "synthesized " << dir << " to " << target << ": " << report.tensors << " tensors, "
      << (report.sharded ? "merged from " + std::to_string(report.worldSize) + " ranks"
                         : std::string("rank-0 full copy"))
      << ", " << (flags.has("dtype") ? flags.text("dtype") : "f32") << '\n';
  return 0;
}

}  // namespace

void printSynthesizeUsage(std::ostream& out) {
  out << "usage: shardema synthesize --snapshots DIR --sigma-rel S --out FILE\n"
         "                          [--step T] [--normalize] [--dtype f32|bf16|f16]\n\n"
         "Post-hoc EMA (Karras et al., Algorithm 3): solves, in float64, for the mix of the\n"
         "power-function snapshots in DIR that best matches the EMA profile of sigma_rel S at\n"
         "step T, prints each snapshot's weight and writes the mixed weights as one deployable\n"
         "safetensors file. DIR is a rank-0 full-copy folder ({i}.{step}.safetensors) or a\n"
         "sharded one (rank_NNNNN/ folders), which is synthesized per rank and merged.\n\n"
         "  --snapshots DIR    snapshot folder written by PostHocCallback\n"
         "  --sigma-rel S      target relative EMA length, in (0, 0.2887)\n"
         "  --step T           target step (default: the newest snapshot); later ones are left "
         "out\n"
         "  --normalize        scale the weights to sum to 1 (edm2); default: the raw solve\n"
         "  --dtype D          f32 (default), bf16 or f16 for floating tensors\n"
         "  --out FILE         deployable weights, replaced only once complete\n";
}

int runSynthesizeCommand(const std::vector<std::string>& args, std::ostream& out) {
  return runFlaggedCommand({{"help", FlagArity::kNone},
                            {"snapshots", FlagArity::kValue},
                            {"sigma-rel", FlagArity::kValue},
                            {"step", FlagArity::kValue},
                            {"normalize", FlagArity::kOptionalBool},
                            {"dtype", FlagArity::kValue},
                            {"out", FlagArity::kValue}},
                           args, out, printSynthesizeUsage, runParsed);
}

}  // namespace shardema::cli
