#include "plan_command.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "flag_parser.h"
#include "shardema/core/node_plan.h"

namespace shardema::cli {
namespace {

// The flags that set one NodePlanInputs field each; planNode's messages name
// the field in snake_case, which is the flag with '_' for '-'.
const std::vector<std::string> kNumberFlags = {
    "pcie-gbps",      "host-memory-gbps", "core-gbps",           "step-seconds",
    "tokens-per-gpu", "gpu-tflops",       "update-call-seconds", "node-ram-gib"};
const std::vector<std::string> kIntegerFlags = {"gpus-per-node", "source-bytes", "profiles",
                                                "staging-bytes-per-rank"};

std::vector<FlagSpec> planFlagSpecs() {
  std::vector<FlagSpec> specs = {{"help", FlagArity::kNone},
                                 {"parameters", FlagArity::kValue},
                                 {"ranks", FlagArity::kValue},
                                 {"update-every", FlagArity::kValue}};
  for (const auto* list : {&kNumberFlags, &kIntegerFlags}) {
    for (const std::string& name : *list) specs.push_back({name, FlagArity::kValue});
  }
  return specs;
}

std::string snakeOf(std::string flag) {
  std::replace(flag.begin(), flag.end(), '-', '_');
  return flag;
}

// "7e9" or "405000000000": a whole number in [1, 2^50], kept as typed for the table.
std::vector<std::pair<std::string, int64_t>> parseParameters(const std::string& list) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const std::string& item : splitList("parameters", list, ',')) {
    const double value = parseNumber("parameters", item);
    if (!(value >= 1.0 && value <= std::ldexp(1.0, 50) && std::floor(value) == value)) {
      throw UsageError("--parameters: '" + item + "' must be a whole number in [1, 2^50]");
    }
    out.emplace_back(item, static_cast<int64_t>(value));
  }
  return out;
}

std::vector<int64_t> parsePositiveIntegers(const std::string& flag, const std::string& list) {
  std::vector<int64_t> out;
  for (const std::string& item : splitList(flag, list, ',')) {
    const int64_t value = parseInteger(flag, item);
    if (value < 1) throw UsageError("--" + flag + ": '" + item + "' must be >= 1");
    out.push_back(value);
  }
  return out;
}

NodePlanInputs inputsFromFlags(const ParsedFlags& flags) {
  NodePlanInputs in;
  const std::vector<std::pair<std::string, double*>> numbers = {
      {"pcie-gbps", &in.pcieGbps},
      {"host-memory-gbps", &in.hostMemoryGbps},
      {"core-gbps", &in.coreGbps},
      {"step-seconds", &in.stepSeconds},
      {"tokens-per-gpu", &in.tokensPerGpu},
      {"gpu-tflops", &in.gpuTflops},
      {"update-call-seconds", &in.updateCallSeconds},
      {"node-ram-gib", &in.nodeRamGib}};
  for (const auto& [flag, field] : numbers) {
    if (flags.has(flag)) *field = flags.number(flag);
  }
  const std::vector<std::pair<std::string, int64_t*>> integers = {
      {"gpus-per-node", &in.gpusPerNode},
      {"source-bytes", &in.sourceBytes},
      {"profiles", &in.profiles},
      {"staging-bytes-per-rank", &in.stagingBytesPerRank}};
  for (const auto& [flag, field] : integers) {
    if (flags.has(flag)) *field = flags.integer(flag);
  }
  return in;
}

// planNode's ValueError in the flag's terms: "planNode: pcie_gbps (0) must
// be > 0" becomes "--pcie-gbps (0) must be > 0".
NodePlan planWithFlagNames(const NodePlanInputs& in) {
  try {
    return planNode(in);
  } catch (const c10::ValueError& error) {
    const std::string message = error.what_without_backtrace();
    for (const auto* list : {&kNumberFlags, &kIntegerFlags}) {
      for (const std::string& flag : *list) {
        const std::string field = ": " + snakeOf(flag) + " (";
        const size_t at = message.find(field);
        if (at != std::string::npos) {
          throw UsageError("--" + flag + message.substr(at + field.size() - 2));
        }
      }
    }
    throw UsageError(message);
  }
}

std::string format(const char* spec, double value) {
  char text[64];
  std::snprintf(text, sizeof text, spec, value);
  return text;
}

// 875000000 -> "875 M": three significant digits and an SI prefix.
std::string si(double value) {
  const char* prefixes[] = {"", " k", " M", " G", " T", " P"};
  int i = 0;
  while (std::fabs(value) >= 999.5 && i < 5) {
    value /= 1000.0;
    ++i;
  }
  return format("%.3g", value) + prefixes[i];
}

// Three significant digits, without an exponent for the large ones: 1120, 4.38, 0.0163.
std::string figure(double value) {
  return std::fabs(value) >= 999.5 ? format("%.0f", value) : format("%.3g", value);
}

std::string percent(double fraction) { return figure(100.0 * fraction) + " %"; }

// 33554432 -> "32 MiB".
std::string mebibytes(int64_t bytes) {
  return figure(static_cast<double>(bytes) / 1048576.0) + " MiB";
}

void printInputs(const NodePlanInputs& in, std::ostream& out) {
  out << "inputs: " << in.gpusPerNode << " GPUs per node; " << in.sourceBytes << "-byte sources; "
      << in.profiles << " float32 profile" << (in.profiles > 1 ? "s" : "") << "; PCIe "
      << format("%g", in.pcieGbps) << " GB/s per GPU; host memory "
      << format("%g", in.hostMemoryGbps) << " GB/s per node; one core " << format("%g", in.coreGbps)
      << " GB/s; step "
      << (in.stepSeconds > 0 ? format("%g", in.stepSeconds) + " s"
                             : "6 x parameters x " + format("%g", in.tokensPerGpu) +
                                   " tokens per GPU at " + format("%g", in.gpuTflops) + " TFLOP/s")
      << "; staging " << mebibytes(in.stagingBytesPerRank) << " per rank; update() "
      << format("%g", in.updateCallSeconds * 1e3) << " ms; node RAM " << format("%g", in.nodeRamGib)
      << " GiB\n\n";
}

void printHeader(const std::vector<int64_t>& updateEvery, std::ostream& out) {
  out << "| parameters | ranks | elements per rank | PCIe GB per node | PCIe ms | host memory GB "
         "per node | host memory ms | host RAM GiB per node | of node RAM | cores needed | "
         "step s | EMA ms";
  for (int64_t every : updateEvery) out << " | overhead, update_every " << every;
  out << " |\n|";
  for (size_t i = 0; i < 12 + updateEvery.size(); ++i) out << " --- |";
  out << '\n';
}

void printRow(const std::string& parameters, const NodePlan& plan,
              const std::vector<int64_t>& updateEvery, std::ostream& out) {
  out << "| " << parameters << " | " << plan.inputs.ranks << " | "
      << si(static_cast<double>(plan.elementsPerRank)) << " | "
      << figure(static_cast<double>(plan.pcieBytes) / 1e9) << " | "
      << figure(plan.pcieSeconds * 1e3) << " | "
      << figure(static_cast<double>(plan.hostMemoryBytes) / 1e9) << " | "
      << figure(plan.hostMemorySeconds * 1e3) << " | "
      << figure(static_cast<double>(plan.hostRamBytes) / 1073741824.0) << " | "
      << format("%.2f", plan.ramFraction) << " | " << plan.coresNeeded << " | "
      << figure(plan.stepSeconds) << " | " << figure(plan.emaSeconds * 1e3);
  for (int64_t every : updateEvery) out << " | " << percent(plan.overheadFraction(every));
  out << " |\n";
}

int runParsed(const ParsedFlags& flags, std::ostream& out) {
  if (!flags.has("parameters")) {
    throw UsageError("--parameters LIST is required (e.g. 7e9,70e9,405e9)");
  }
  const auto parameters = parseParameters(flags.text("parameters"));
  const std::vector<int64_t> ranks = flags.has("ranks")
                                         ? parsePositiveIntegers("ranks", flags.text("ranks"))
                                         : std::vector<int64_t>{NodePlanInputs{}.ranks};
  const std::vector<int64_t> updateEvery =
      flags.has("update-every") ? parsePositiveIntegers("update-every", flags.text("update-every"))
                                : std::vector<int64_t>{1, 10};
  const NodePlanInputs base = inputsFromFlags(flags);
  // Every plan is made before anything is printed, so a bad flag leaves no
  // half table behind.
  std::vector<std::pair<std::string, NodePlan>> rows;
  for (const auto& [text, count] : parameters) {
    for (int64_t worldSize : ranks) {
      NodePlanInputs in = base;
      in.parameters = count;
      in.ranks = worldSize;
      rows.emplace_back(text, planWithFlagNames(in));
    }
  }
  printInputs(base, out);
  printHeader(updateEvery, out);
  for (const auto& [text, plan] : rows) printRow(text, plan, updateEvery, out);
  return 0;
}

}  // namespace

void printPlanUsage(std::ostream& out) {
  out << R"(usage: shardema plan --parameters LIST [--ranks LIST] [options]

What keeping the EMA in pinned host memory costs one node of an FSDP job,
per update, on paper (docs/performance.md, "At scale, on paper"): a markdown
table with one row per model size and world size. Each rank holds 1/ranks of
the model; a node runs --gpus-per-node of the ranks. Per update it copies
each rank's source bytes over its PCIe link, moves (2 x source bytes + 8 x
profiles) per element through the node's host memory, and needs cores for
(source bytes + 8 x profiles) per element; the copies and the math overlap
the next step, which they stall only by what they take beyond it.

  --parameters LIST    model sizes, comma separated: 7e9,70e9,405e9 (required)
  --ranks LIST         FSDP world sizes, comma separated (8)
  --gpus-per-node N    (8)
  --source-bytes N     bytes per element of the weights read: 4 (float32, as
                       FSDP2's sharded params under bf16 mixed precision) or
                       2 (bf16, fp16) (4)
  --profiles N         float32 EMA profiles: 1 (one EMA), 2 (post-hoc) (1)
  --pcie-gbps X        device-to-host GB/s of one GPU's link, all copying (50)
  --host-memory-gbps X the node's host memory GB/s, all sockets (400)
  --core-gbps X        the update kernel's GB/s on one core (46.8)
  --step-seconds X     the training step; 0 derives it from the next two (0)
  --tokens-per-gpu X   tokens per GPU per step (8192)
  --gpu-tflops X       achieved TFLOP/s per GPU (400)
  --staging-bytes-per-rank N   pinned staging per rank (33554432)
  --update-call-seconds X      update()'s time on the training thread (0.0014)
  --node-ram-gib X     host memory of a node, for "of node RAM" (2048)
  --update-every LIST  overhead columns for these update intervals (1,10)

Where each default comes from: shardema/core/node_plan.h and
docs/performance.md. Errors print one line naming the flag and exit with
status 2.
)";
}

int runPlanCommand(const std::vector<std::string>& args, std::ostream& out) {
  if (std::find(args.begin(), args.end(), "--help") != args.end()) {
    printPlanUsage(out);
    return 0;
  }
  return runParsed(parseFlags(planFlagSpecs(), args), out);
}

}  // namespace shardema::cli
