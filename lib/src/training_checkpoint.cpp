#include "shardema/training_checkpoint.h"

#include <c10/util/Exception.h>

#include "shardema/core/file_metadata.h"
#include "shardema/core/tensor_file.h"

namespace shardema {
namespace {

using detail::kKindKey;
constexpr const char* kCheckpointKind = detail::kTrainingCheckpointKind;

bool startsWith(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

TrainingCheckpoint TrainingCheckpoint::capture(const torch::nn::Module& module) {
  TrainingCheckpoint checkpoint;
  checkpoint.weights = cloneModuleTensors(module);
  return checkpoint;
}

void TrainingCheckpoint::save(const std::string& path) const {
  TensorFile file;
  file.tensors = weights;
  for (const auto& [name, tensor] : rawWeights) {
    file.tensors.emplace_back(kRawWeightsPrefix + name, tensor);
  }
  for (const auto& [name, tensor] : float32Ema) {
    file.tensors.emplace_back(kFloat32EmaPrefix + name, tensor);
  }
  for (const auto& [key, value] : metadata) {
    TORCH_CHECK_VALUE(!startsWith(key, kKindKey), "TrainingCheckpoint::save: metadata key '", key,
                      "' is reserved");
    file.metadata[key] = value;
  }
  file.metadata[kKindKey] = kCheckpointKind;
  writeTensorFile(path, file);
}

TrainingCheckpoint TrainingCheckpoint::load(const std::string& path) {
  TensorFile file = readTensorFile(path);
  const auto kind = file.metadata.find(kKindKey);
  TORCH_CHECK_VALUE(kind != file.metadata.end() && kind->second == kCheckpointKind, path,
                    ": not a shardema training checkpoint (", kKindKey, " is '",
                    kind == file.metadata.end() ? std::string("absent") : kind->second, "')");
  TrainingCheckpoint checkpoint;
  const std::string rawPrefix = kRawWeightsPrefix;
  const std::string float32Prefix = kFloat32EmaPrefix;
  for (auto& [name, tensor] : file.tensors) {
    if (startsWith(name, rawPrefix)) {
      checkpoint.rawWeights.emplace_back(name.substr(rawPrefix.size()), std::move(tensor));
    } else if (startsWith(name, float32Prefix)) {
      checkpoint.float32Ema.emplace_back(name.substr(float32Prefix.size()), std::move(tensor));
    } else {
      checkpoint.weights.emplace_back(std::move(name), std::move(tensor));
    }
  }
  file.metadata.erase(kKindKey);
  checkpoint.metadata = std::move(file.metadata);
  return checkpoint;
}

}  // namespace shardema
