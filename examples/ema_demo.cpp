// shardema demo: trains a small MLP with noisy SGD, keeps a warmup EMA of its
// weights with the EmaCallback, and shows what the average buys on held-out
// data. Writes the EMA as a deployable safetensors file plus a resumable
// training checkpoint.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>

#include "demo_task.h"
#include "flag_parser.h"
#include "shardema/ema_callback.h"
#include "shardema/tensor_file.h"

namespace {

using shardema::cli::FlagArity;
using shardema::cli::FlagSpec;

struct DemoOptions {
  int64_t steps = 1500;
  int64_t width = 64;
  int64_t batch = 32;
  int64_t accumulate = 1;
  double lr = 0.1;
  double noise = 1.0;
  int64_t seed = 0;
  std::string out = "out/demo";
};

const char* kUsage =
    "usage: ema_demo [--steps N] [--width N] [--batch N] [--accumulate N] [--lr X]\n"
    "                [--noise X] [--seed N] [--out DIR]\n"
    "Trains a small MLP on a noisy synthetic regression task with shardema's\n"
    "warmup EMA and compares held-out loss of the raw and the EMA weights.\n";

DemoOptions parseOptions(int argc, char** argv) {
  const std::vector<FlagSpec> specs = {{"steps"},      {"width"}, {"batch"},
                                       {"accumulate"}, {"lr"},    {"noise"},
                                       {"seed"},       {"out"},   {"help", FlagArity::kNone}};
  const auto flags =
      shardema::cli::parseFlags(specs, std::vector<std::string>(argv + 1, argv + argc));
  if (flags.boolean("help")) {
    std::cout << kUsage;
    std::exit(0);
  }
  DemoOptions o;
  auto positive = [&](const char* name, int64_t& field) {
    if (!flags.has(name)) return;
    field = flags.integer(name);
    if (field < 1) throw shardema::cli::UsageError(std::string("--") + name + " must be >= 1");
  };
  positive("steps", o.steps);
  positive("width", o.width);
  positive("batch", o.batch);
  positive("accumulate", o.accumulate);
  if (flags.has("lr")) o.lr = flags.number("lr");
  if (flags.has("noise")) o.noise = flags.number("noise");
  if (flags.has("seed")) o.seed = flags.integer("seed");
  if (flags.has("out")) o.out = flags.text("out");
  if (o.lr <= 0) throw shardema::cli::UsageError("--lr must be > 0");
  if (o.noise < 0) throw shardema::cli::UsageError("--noise must be >= 0");
  return o;
}

// One progress line, redrawn in place on a terminal, printed plainly otherwise.
void progress(bool tty, int64_t step, int64_t total, double loss, double decay) {
  if (tty) {
    const int width = 30;
    const int filled = static_cast<int>(width * step / total);
    std::printf("\r[%-*s] step %lld/%lld  loss %.4f  ema decay %.5f", width,
                std::string(filled, '#').c_str(), static_cast<long long>(step),
                static_cast<long long>(total), loss, decay);
    if (step == total) std::printf("\n");
    std::fflush(stdout);
  } else {
    std::printf("step %lld/%lld loss %.4f ema_decay %.5f\n", static_cast<long long>(step),
                static_cast<long long>(total), loss, decay);
  }
}

int run(const DemoOptions& o) {
  namespace demo = shardema::demo;
  at::set_num_threads(1);
  demo::TaskOptions taskOptions;
  taskOptions.width = o.width;
  taskOptions.labelNoise = o.noise;
  taskOptions.seed = static_cast<uint64_t>(o.seed);
  demo::RegressionTask task(taskOptions);
  torch::manual_seed(o.seed + 1);
  demo::Student model(task.inputs(), o.width);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(o.lr));

  shardema::EmaCallback ema;
  ema.onFitStart(*model);
  const bool tty = isatty(STDOUT_FILENO);
  const int64_t batches = o.steps * o.accumulate;
  const int64_t every = std::max<int64_t>(1, o.steps / (tty ? 100 : 10));
  int64_t globalStep = 0;
  double runningLoss = 0;
  for (int64_t b = 0; b < batches; ++b) {
    const auto [x, y] = task.trainBatch(b, o.batch);
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    (loss / o.accumulate).backward();
    runningLoss = b == 0 ? loss.item<double>() : 0.95 * runningLoss + 0.05 * loss.item<double>();
    const bool last = b == batches - 1;
    if ((b + 1) % o.accumulate == 0 || last) {
      ema.onBeforeOptimizerStep();  // the last EMA update must have read the weights
      optimizer.step();
      optimizer.zero_grad();
      ++globalStep;
    }
    if (ema.onTrainBatchEnd(globalStep, b, o.accumulate, last) &&
        (globalStep % every == 0 || last)) {
      progress(tty, globalStep, o.steps, runningLoss, ema.decay());
    }
  }

  const double rawLoss = demo::heldOutLoss(model, task);
  double emaLoss = 0;
  {
    shardema::EmaValidationScope swap(ema);
    emaLoss = demo::heldOutLoss(model, task);
  }
  std::filesystem::create_directories(o.out);
  shardema::TensorFile deployable;
  deployable.tensors = ema.averager().emaTensors();
  deployable.metadata["shardema.kind"] = "deployable_weights";
  deployable.metadata["shardema.step"] = std::to_string(globalStep);
  deployable.metadata["shardema.schedule"] = ema.averager().schedule().toJson();
  const std::string weightsPath = o.out + "/ema_weights.safetensors";
  shardema::writeTensorFile(weightsPath, deployable);
  shardema::TrainingCheckpoint checkpoint = shardema::TrainingCheckpoint::capture(*model);
  ema.onSaveCheckpoint(checkpoint);
  checkpoint.metadata["global_step"] = std::to_string(globalStep);
  const std::string checkpointPath = o.out + "/checkpoint.safetensors";
  checkpoint.save(checkpointPath);

  std::printf("\nheld-out MSE after %lld optimizer steps (clean targets, %lld samples)\n",
              static_cast<long long>(globalStep),
              static_cast<long long>(task.heldOutInputs().size(0)));
  std::printf("  raw weights  %.5f\n", rawLoss);
  std::printf("  EMA weights  %.5f   (%+.1f%% vs raw, final decay %.5f)\n", emaLoss,
              100.0 * (emaLoss - rawLoss) / rawLoss, ema.decay());
  std::printf("deployable EMA weights: %s\n", weightsPath.c_str());
  std::printf("training checkpoint (EMA weights + raw weights for resume): %s\n",
              checkpointPath.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  DemoOptions options;
  try {
    options = parseOptions(argc, argv);
  } catch (const shardema::cli::UsageError& e) {
    std::fprintf(stderr, "ema_demo: %s\n", e.what());
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ema_demo: %s\n", e.what());
    return 1;
  }
}
