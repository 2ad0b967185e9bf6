#pragma once
// What the README's code fragments use without declaring: a small model
// with a BatchNorm, an SGD optimizer over it, a one-rank communicator (the
// environment a launcher would set), loop counters, a validate() and a
// checkpoint. Each generated test runs its block in a fresh current folder,
// since the fragments write relative paths.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "shardema/averager.h"
#include "shardema/core/decay_schedule.h"
#include "shardema/shard/communicator.h"
#include "shardema/training_checkpoint.h"
#include "support/temp_dir.h"

namespace shardema::readme {

struct SnippetNet : torch::nn::Module {
  SnippetNet() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    norm = register_module("norm", torch::nn::BatchNorm1d(3));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};

class SnippetContext {
 public:
  SnippetContext()
      : previous_(std::filesystem::current_path()),
        model(std::make_shared<SnippetNet>()),
        optimizer(model->parameters(), torch::optim::SGDOptions(0.1)) {
    std::filesystem::current_path(folder_.path());
    // A one-rank job, as torchrun would describe it, on a free port.
    const int port = shard::Communicator::freeLoopbackPort();
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    checkpoint = TrainingCheckpoint::capture(*model);
    // The fragments run after a first optimizer step.
    for (auto& p : model->parameters()) p.mutable_grad() = torch::ones_like(p);
  }
  ~SnippetContext() { std::filesystem::current_path(previous_); }

  /// The job's communicator, made on first use (a fragment that makes its
  /// own from the environment must not find the port taken).
  shard::Communicator& communicator() {
    if (!comm_) {
      shard::CommunicatorOptions options;
      options.glooHostname = "127.0.0.1";
      comm_ = std::make_unique<shard::Communicator>(shard::Communicator::fromEnvironment(options));
    }
    return *comm_;
  }

 private:
  testing::TempDir folder_;
  std::filesystem::path previous_;

 public:
  std::shared_ptr<SnippetNet> model;
  torch::optim::SGD optimizer;
  TrainingCheckpoint checkpoint;

 private:
  std::unique_ptr<shard::Communicator> comm_;
};

}  // namespace shardema::readme

// Declares the names the fragments use, bound to `context`'s members;
// the _WITH_COMM form also binds `comm` (for fragments that use one
// without making it).
#define SHARDEMA_README_SNIPPET_NAMES_WITH_COMM(context) \
  auto& comm = (context).communicator();                 \
  (void)comm;                                            \
  SHARDEMA_README_SNIPPET_NAMES(context)
#define SHARDEMA_README_SNIPPET_NAMES(context)                                               \
  auto& model = (context).model;                                                             \
  auto& optimizer = (context).optimizer;                                                     \
  auto& checkpoint = (context).checkpoint;                                                   \
  const int64_t n = 1, globalStep = 1, batchIdx = 0, accumulateGradBatches = 1;              \
  const bool isLastBatch = true;                                                             \
  auto validate = [](torch::nn::Module& m) {                                                 \
    m.eval();                                                                                \
    m.train();                                                                               \
  };                                                                                         \
  auto schedule = shardema::DecaySchedule::warmup();                                         \
  shardema::AveragerOptions options;                                                         \
  (void)model, (void)optimizer, (void)checkpoint, (void)n, (void)globalStep, (void)batchIdx, \
      (void)accumulateGradBatches, (void)isLastBatch, (void)validate, (void)schedule,        \
      (void)options
