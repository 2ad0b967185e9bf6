#pragma once
// TrainingCheckpoint: what a trainer saves to resume, in one safetensors
// file. `weights` are what a deployment loads (with an EmaCallback: the
// EMA, at the model's dtypes); `rawWeights` are the online weights, kept so
// training resumes from them with optimizer state that belongs to them;
// `float32Ema` is the EMA as averaged where `weights` holds it narrowed (a
// bf16 model's), so a resume loses nothing.
#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "shardema/module_tracking.h"

namespace shardema {

/// Prefix of the raw weights inside the file. Deployment code that loads a
/// checkpoint as a state dict drops the names that start with it.
constexpr const char* kRawWeightsPrefix = "raw_weights/";
/// Prefix of the float32 EMA kept beside narrowed weights; dropped the same
/// way. Files written before it existed have none and load as before.
constexpr const char* kFloat32EmaPrefix = "float32_ema/";

struct TrainingCheckpoint {
  /// Deployable weights under the module's names.
  NamedTensors weights;
  /// Raw (online) weights under the module's names (no prefix here).
  NamedTensors rawWeights;
  /// The float32 EMA of the `weights` entries that hold it at a narrower
  /// dtype, under the module's names (no prefix here); empty for a float32
  /// model and without an EMA.
  NamedTensors float32Ema;
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
