// shardema demo, the main job: trains a small MLP with noisy SGD on W local
// ranks (processes it starts itself, one c10d group over loopback Gloo),
// averaging the gradients through the communicator as DDP would. Every rank
// keeps only its FSDP2 rows of a warmup EMA (ShardedAverager) and of the
// post-hoc EMA profiles (PostHocCallback, sharded layout), in host
// memory. After training it gathers the EMAs, sweeps sigma_rel by synthesis
// from the per-rank snapshots, prints the held-out loss of each beside the
// raw weights, draws the sweep as an SVG and writes deployable files.
#include <c10/util/Exception.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "data_parallel.h"
#include "demo_options.h"
#include "demo_ranks.h"
#include "demo_report.h"
#include "demo_task.h"
#include "flag_parser.h"
#include "posthoc_sweep.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/module_tracking.h"
#include "shardema/posthoc_callback.h"
#include "shardema/shard/communicator.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"
#include "sweep_svg.h"

namespace {

namespace demo = shardema::demo;
using shardema::shard::Communicator;

shardema::PostHocCallbackOptions posthocOptions(const demo::DemoOptions& o) {
  shardema::PostHocCallbackOptions options;  // sigmaRels {0.05, 0.1}
  options.layout = shardema::PostHocLayout::kSharded;
  options.checkpointFolder = o.out + "/posthoc";
  options.checkpointEvery =
      o.snapshotEvery > 0 ? o.snapshotEvery : std::max<int64_t>(1, o.steps / 10);
  options.outputFolder = o.out;
  return options;
}

// This rank's EMAs over its FSDP2 rows of the replicated model.
struct RankEmas {
  shardema::ShardedAverager warmup;
  shardema::PostHocCallback posthoc;
};

// The loop with the hooks where a trainer calls them: fence both EMAs
// before the weights change, average the gradients, step, sync buffers,
// then fold the new weights in. Returns the optimizer steps done.
int64_t train(const demo::DemoOptions& o, Communicator& comm, demo::RegressionTask& task,
              demo::Student& model, RankEmas& emas) {
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(o.lr));
  const bool tty = comm.rank() == 0 && isatty(STDOUT_FILENO);
  const int64_t batches = o.steps * o.accumulate;
  const int64_t every = std::max<int64_t>(1, o.steps / (tty ? 100 : 10));
  const int64_t rows = o.batch / o.worldSize;
  int64_t globalStep = 0;
  double runningLoss = 0;
  double windowLoss = 0;
  for (int64_t b = 0; b < batches; ++b) {
    // Every rank draws the same global batch and trains on its own rows.
    const auto [x, y] = task.trainBatch(b, o.batch);
    torch::Tensor loss = torch::mse_loss(model->forward(x.narrow(0, comm.rank() * rows, rows)),
                                         y.narrow(0, comm.rank() * rows, rows));
    (loss / o.accumulate).backward();
    windowLoss += loss.item<double>() / o.accumulate;
    const bool last = b == batches - 1;
    if ((b + 1) % o.accumulate == 0 || last) {
      emas.warmup.fence();
      emas.posthoc.onBeforeOptimizerStep();
      const double meanLoss = demo::averageGradients(comm, *model, windowLoss);
      optimizer.step();
      optimizer.zero_grad();
      demo::broadcastBuffers(comm, *model);
      ++globalStep;
      emas.warmup.update(globalStep);
      runningLoss = globalStep == 1 ? meanLoss : 0.95 * runningLoss + 0.05 * meanLoss;
      windowLoss = 0;
      if (comm.rank() == 0 && (globalStep % every == 0 || last)) {
        demo::printProgress(tty, globalStep, o.steps, runningLoss,
                            emas.warmup.averager().lastDecay());
      }
    }
    emas.posthoc.onTrainBatchEnd(globalStep, b, o.accumulate, last);
  }
  emas.warmup.wait();
  emas.posthoc.wait();
  return globalStep;
}

// Host bytes of an averager's storage: floating tensors once per profile,
// copies (integer buffers) once, shared by the profiles.
int64_t emaBytes(const shardema::ShardedAverager& averager) {
  const int64_t profiles = averager.averager().numProfiles();
  int64_t bytes = 0;
  for (const at::Tensor& piece : averager.localEma()) {
    bytes += piece.nbytes() * (piece.is_floating_point() ? profiles : 1);
  }
  return bytes;
}

int64_t fullCopyBytes(const shardema::ShardedAverager& averager) {
  const int64_t profiles = averager.averager().numProfiles();
  int64_t bytes = 0;
  for (const shardema::shard::ShardSpec& spec : averager.layout().specs) {
    const bool floating = at::isFloatingType(spec.dtype);
    bytes += spec.numel() * (floating ? 4 * profiles : c10::elementSize(spec.dtype));
  }
  return bytes;
}

// Every rank's EMA bytes, gathered on rank 0 into the report.
void reportMemory(Communicator& comm, const RankEmas& emas, demo::RunReport& report) {
  at::Tensor mine = at::empty({2}, at::kLong);
  mine[0] = emaBytes(emas.warmup);
  mine[1] = emaBytes(emas.posthoc.averager());
  at::Tensor all = at::empty({2 * comm.worldSize()}, at::kLong);
  comm.allGather(mine, all, "memory report");
  for (int64_t r = 0; r < comm.worldSize(); ++r) {
    report.memory.push_back({all[2 * r].item<int64_t>(), all[2 * r + 1].item<int64_t>()});
  }
  report.fullWarmupEmaBytes = fullCopyBytes(emas.warmup);
  report.fullPosthocEmaBytes = fullCopyBytes(emas.posthoc.averager());
}

// Held-out loss of the gathered warmup EMA (rank 0), its deployable file,
// and the resumable checkpoint: raw weights + post-hoc calls from rank 0,
// the sharded EMA state from every rank.
void evaluateAndSave(const demo::DemoOptions& o, Communicator& comm, demo::Student& model,
                     const demo::RegressionTask& task, RankEmas& emas, demo::RunReport& report) {
  const auto full = emas.warmup.fullStateDict(comm);
  if (comm.rank() == 0) {
    report.rawLoss = demo::heldOutLoss(model, task);
    demo::Student scratch(task.inputs(), o.width);
    shardema::loadIntoModule(*scratch, full);
    report.emaLoss = demo::heldOutLoss(scratch, task);
    report.emaDecay = emas.warmup.averager().lastDecay();
  }
  report.emaWeightsPath = o.out + "/ema_weights.safetensors";
  emas.warmup.exportWeights(comm, report.emaWeightsPath);
  shardema::saveCheckpoint(comm, o.out + "/checkpoint/ema", emas.warmup);
  if (comm.rank() == 0) {
    shardema::TrainingCheckpoint checkpoint = shardema::TrainingCheckpoint::capture(*model);
    checkpoint.rawWeights = checkpoint.weights;
    emas.posthoc.onSaveCheckpoint(checkpoint);
    checkpoint.metadata["global_step"] = std::to_string(report.optimizerSteps);
    report.checkpointPath = o.out + "/checkpoint";
    checkpoint.save(report.checkpointPath + "/raw.safetensors");
  }
}

std::string sweepSubtitle(const demo::DemoOptions& o, const shardema::PostHocCallbackOptions& p) {
  std::string profiles;
  char text[256];
  for (const double sigmaRel : p.sigmaRels) {
    std::snprintf(text, sizeof(text), "%s%g", profiles.empty() ? "" : ", ", sigmaRel);
    profiles += text;
  }
  std::snprintf(text, sizeof(text),
                "%lld steps on %lld ranks, seed %lld, label noise %g; snapshots of sigma_rel %s "
                "every %lld steps",
                static_cast<long long>(o.steps), static_cast<long long>(o.worldSize),
                static_cast<long long>(o.seed), o.noise, profiles.c_str(),
                static_cast<long long>(p.checkpointEvery));
  return text;
}

void sweepAndDraw(const demo::DemoOptions& o, Communicator& comm, const demo::Student& model,
                  const demo::RegressionTask& task, const RankEmas& emas, demo::RunReport& report) {
  const auto start = std::chrono::steady_clock::now();
  report.sweep = demo::sweepSigmaRel(comm, emas.posthoc.averager().layout(), o.out + "/posthoc",
                                     o.sigmaGrid, model, task);
  report.sweepSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.snapshotsPerRank =
      static_cast<int64_t>(shardema::scanRankSnapshots(o.out + "/posthoc", comm.rank()).size());
  if (comm.rank() != 0) return;
  demo::SweepPicture picture;
  picture.subtitle = sweepSubtitle(o, emas.posthoc.options());
  picture.rows = report.sweep;
  picture.rawLoss = report.rawLoss;
  picture.warmupEmaLoss = report.emaLoss;
  report.svgPath = o.out + "/posthoc_sweep.svg";
  demo::writeSweepSvg(report.svgPath, picture);
}

int runRank(const demo::DemoOptions& o, Communicator& comm) {
  at::set_num_threads(1);
  demo::TaskOptions taskOptions;
  taskOptions.width = o.width;
  taskOptions.labelNoise = o.noise;
  taskOptions.seed = static_cast<uint64_t>(o.seed);
  demo::RegressionTask task(taskOptions);
  torch::manual_seed(o.seed + 1);  // the same initial model on every rank
  demo::Student model(task.inputs(), o.width);

  // Snapshots of an earlier run would join this run's synthesis.
  if (comm.rank() == 0) demo::removeStaleSnapshots(o.out + "/posthoc");
  comm.barrier("stale snapshots removed");
  const auto tracked = shardema::trackModule(*model);
  RankEmas emas{
      shardema::ShardedAverager(
          comm.rank(), comm.worldSize(),
          shardema::shardsFromFullTensors(tracked, shardema::shard::LayoutKind::kFsdp2, comm.rank(),
                                          comm.worldSize())),
      shardema::PostHocCallback(posthocOptions(o), {comm.rank(), comm.worldSize(), &comm})};
  emas.posthoc.onFitStart(*model);

  demo::RunReport report;
  report.worldSize = comm.worldSize();
  const auto start = std::chrono::steady_clock::now();
  report.optimizerSteps = train(o, comm, task, model, emas);
  report.trainSeconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.heldOutSamples = task.heldOutInputs().size(0);
  // The final snapshot first, so the checkpoint below lands on a snapshot
  // step and can be resumed from.
  report.posthocWeightsPath = emas.posthoc.onTrainEnd();
  evaluateAndSave(o, comm, model, task, emas, report);
  report.deployableSigmaRel = emas.posthoc.options().defaultOutputSigma;
  report.snapshotFolder = o.out + "/posthoc";
  sweepAndDraw(o, comm, model, task, emas, report);
  reportMemory(comm, emas, report);
  if (comm.rank() == 0) demo::printReport(report);
  return 0;
}

// The message of `e` without c10's backtrace, up to its first line break.
std::string firstLine(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  const std::string text = error ? error->what_without_backtrace() : e.what();
  return text.substr(0, text.find('\n'));
}

}  // namespace

int main(int argc, char** argv) {
  demo::DemoOptions options;
  try {
    options = demo::parseDemoOptions(argc, argv);
  } catch (const shardema::cli::UsageError& e) {
    std::fprintf(stderr, "ema_demo: %s\n", e.what());
    return 2;
  }
  std::optional<demo::LocalRanks> ranks;
  try {
    std::filesystem::create_directories(options.out);
    ranks.emplace(demo::LocalRanks::start(static_cast<int>(options.worldSize),
                                          std::vector<std::string>(argv, argv + argc),
                                          options.out));
    int status = 0;
    {
      shardema::shard::CommunicatorOptions commOptions;
      commOptions.timeout = std::chrono::seconds(60);
      commOptions.glooHostname = "127.0.0.1";
      Communicator comm = Communicator::fromEnvironment(commOptions);
      status = runRank(options, comm);
    }
    if (ranks->rank() == 0) {
      const std::string failure = ranks->waitForChildren(std::chrono::seconds(60));
      if (!failure.empty()) {
        std::fprintf(stderr, "ema_demo: %s\n", failure.c_str());
        return 1;
      }
    }
    return status;
  } catch (const std::exception& e) {
    // A child's stderr is its log: the whole error, backtrace included.
    if (!ranks || ranks->rank() != 0) {
      std::fprintf(stderr, "ema_demo: %s\n", e.what());
      return 1;
    }
    // Rank 0 talks to a person: one line. The backtrace goes to rank0.log,
    // and a rank that died (usually the cause) is named instead of the
    // collective that noticed it.
    const std::string log = options.out + "/rank0.log";
    if (FILE* file = std::fopen(log.c_str(), "w")) {
      std::fprintf(file, "ema_demo: %s\n", e.what());
      std::fclose(file);
    }
    const std::string failure = ranks->waitForChildren(std::chrono::seconds(5));
    if (!failure.empty()) {
      std::fprintf(stderr, "ema_demo: %s (rank 0 then failed; see %s)\n", failure.c_str(),
                   log.c_str());
    } else {
      std::fprintf(stderr, "ema_demo: %s (details: %s)\n", firstLine(e).c_str(), log.c_str());
    }
    return 1;
  }
}
