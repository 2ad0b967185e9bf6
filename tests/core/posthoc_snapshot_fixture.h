#pragma once
// Shared by the snapshot tests: consistent SnapshotInfos, tensors whose
// values encode profile and step, and writers of good and hand-broken files.
#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/posthoc_snapshot.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"
#include "support/temp_dir.h"

namespace shardema::snapshot_test {

namespace fs = std::filesystem;

using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

// A consistent full-copy info: sigmaRel recomputed from gamma so that
// the pair agrees to the last bit.
inline SnapshotInfo fullInfo(int64_t profileIndex, int64_t step, double sigmaRel) {
  SnapshotInfo info;
  info.profileIndex = profileIndex;
  info.step = step;
  info.gamma = sigmaRelToGamma(sigmaRel);
  info.sigmaRel = gammaToSigmaRel(info.gamma);
  return info;
}

inline SnapshotInfo shardInfo(int64_t profileIndex, int64_t step, double sigmaRel, int64_t rank,
                              int64_t worldSize,
                              const std::string& layout = "{\"kind\":\"flat\"}") {
  SnapshotInfo info = fullInfo(profileIndex, step, sigmaRel);
  info.rank = rank;
  info.worldSize = worldSize;
  info.layoutJson = layout;
  return info;
}

// Values encode profile and step so a mixed-up file shows itself.
inline Tensors someTensors(const SnapshotInfo& info) {
  const double base = 1000.0 * info.profileIndex + info.step;
  return {{"layer.weight", at::arange(6, at::kDouble).add(base).reshape({2, 3})},
          {"layer.bias", at::full({3}, base + 0.5, at::kFloat)}};
}

inline void writeIn(const std::string& folder, const SnapshotInfo& info) {
  fs::create_directories(folder);
  writeSnapshot(folder + "/" + snapshotFileName(info.profileIndex, info.step), someTensors(info),
                info);
}

// Writes a file named like a snapshot with hand-made (possibly broken) metadata.
inline std::string writeRawSnapshot(const testing::TempDir& dir, const std::string& name,
                                    std::map<std::string, std::string> metadata) {
  TensorFile file;
  file.tensors.emplace_back("w", at::zeros({2}, at::kFloat));
  file.metadata = std::move(metadata);
  writeTensorFile(dir.file(name), file);
  return dir.file(name);
}

}  // namespace shardema::snapshot_test
