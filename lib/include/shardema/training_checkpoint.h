#pragma once
// TrainingCheckpoint: what a trainer saves to resume, in one safetensors
// file. `weights` are what a deployment loads (with an EmaCallback: the
// EMA); `rawWeights` are the online weights, kept so training resumes from
// them with optimizer state that belongs to them.
#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "shardema/module_tracking.h"

namespace shardema {

/// Prefix of the raw weights inside the file. Deployment code that loads a
/// checkpoint as a state dict drops the names that start with it.
constexpr const char* kRawWeightsPrefix = "raw_weights/";

struct TrainingCheckpoint {
  /// Deployable weights under the module's names.
  NamedTensors weights;
  /// Raw (online) weights under the module's names (no prefix here).
  NamedTensors rawWeights;
  /// Free-form trainer state (e.g. "global_step"). Keys starting with
  /// "shardema." are reserved for the library.
  std::map<std::string, std::string> metadata;

  /// weights = clones of every parameter and buffer of `module`.
  static TrainingCheckpoint capture(const torch::nn::Module& module);

  /// Crash-safe write (temp file, fsync, rename). Blocks.
  void save(const std::string& path) const;
  /// Reads and validates a file written by save(); c10::ValueError naming
  /// the file otherwise.
  static TrainingCheckpoint load(const std::string& path);
};

}  // namespace shardema
