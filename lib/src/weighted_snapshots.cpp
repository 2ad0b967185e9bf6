#include "weighted_snapshots.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "shardema/core/file_metadata.h"

namespace shardema {
namespace detail {

WeightedReaders openUsed(const std::vector<SnapshotEntry>& entries, const SynthesisWeights& solve) {
  WeightedReaders out;
  int64_t newestStep = -1;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!solve.used[i]) continue;
    out.readers.push_back(std::make_unique<TensorFileReader>(entries[i].path));
    // Synthesis reads in ranges, which cannot be checked piece by piece: one
    // streaming pass first (from the page cache on the second read).
    out.readers.back()->verifyChecksums();
    out.weights.push_back(solve.weights[i]);
    if (entries[i].info.step >= newestStep) {
      newestStep = entries[i].info.step;
      out.newest = out.readers.size() - 1;
    }
  }
  return out;
}

at::ScalarType checkTensor(const WeightedReaders& used, const std::string& name, int64_t numel) {
  const TensorFileReader& first = *used.readers.front();
  TORCH_CHECK_VALUE(first.contains(name), "synthesize: snapshot ", first.path(), " has no tensor '",
                    name, "'");
  const at::ScalarType type = first.scalarType(name);
  for (const auto& reader : used.readers) {
    TORCH_CHECK_VALUE(reader->contains(name), "synthesize: snapshot ", reader->path(),
                      " has no tensor '", name, "' (the other snapshots do)");
    TORCH_CHECK_VALUE(reader->entry(name).numel() == numel, "synthesize: tensor '", name, "' has ",
                      reader->entry(name).numel(), " elements in ", reader->path(), " but ", numel,
                      " are expected");
    TORCH_CHECK_VALUE(reader->scalarType(name) == type, "synthesize: tensor '", name,
                      "' has dtype ", reader->scalarType(name), " in ", reader->path(), " but ",
                      type, " in ", first.path());
    TORCH_CHECK_VALUE(!at::isFloatingType(type) || type == at::kFloat, "synthesize: tensor '", name,
                      "' in ", reader->path(), " is ", type,
                      "; snapshots store averaged tensors as float32");
  }
  return type;
}

SynthesisWeights solveFor(const std::vector<SnapshotEntry>& entries,
                          const SnapshotSynthesisOptions& options) {
  std::vector<SnapshotProfile> profiles;
  for (const SnapshotEntry& entry : entries)
    profiles.push_back({entry.info.step, entry.info.gamma});
  SynthesisOptions solveOptions;
  solveOptions.normalize = options.normalize;
  return solveSynthesisWeights(profiles, options.sigmaRel, options.step, solveOptions);
}

void checkSynthesisOptions(const SnapshotSynthesisOptions& options) {
  TORCH_CHECK_VALUE(options.outputDtype == at::kFloat || options.outputDtype == at::kBFloat16 ||
                        options.outputDtype == at::kHalf,
                    "synthesize: outputDtype must be float32, bfloat16 or float16 (got ",
                    options.outputDtype, ")");
  TORCH_CHECK_VALUE(options.bufferBytes >= 64, "synthesize: bufferBytes (", options.bufferBytes,
                    ") must be >= 64");
}

void synthesizeRange(const WeightedReaders& used, const std::string& name, at::ScalarType type,
                     int64_t begin, int64_t count, int64_t roundElements, c10::ScalarType outType,
                     std::vector<double>& scratch, const PieceConsumer& consume) {
  for (int64_t offset = 0; offset < count; offset += roundElements) {
    const int64_t n = std::min(roundElements, count - offset);
    if (!at::isFloatingType(type)) {
      consume(used.readers[used.newest]->readRange(name, begin + offset, n));
      continue;
    }
    scratch.assign(static_cast<size_t>(n), 0.0);
    for (size_t i = 0; i < used.readers.size(); ++i) {
      const at::Tensor x = used.readers[i]->readRange(name, begin + offset, n);
      const float* data = x.data_ptr<float>();
      const double w = used.weights[i];
      for (int64_t e = 0; e < n; ++e) scratch[e] += w * static_cast<double>(data[e]);
    }
    consume(at::from_blob(scratch.data(), {n}, at::kDouble).to(outType));
  }
}

std::vector<int64_t> splitTensorShape(const shard::ShardSpec& spec, int64_t splitDim) {
  std::vector<int64_t> shape = spec.globalShape;
  if (splitDim > 0) {
    const int64_t rows = shape.front();
    shape.erase(shape.begin());
    shape.insert(shape.begin() + splitDim, rows);
  }
  return shape;
}

std::map<std::string, std::string> synthesizedMetadata(const SynthesisWeights& solve,
                                                       bool normalize) {
  DeployableInfo info;
  info.step = solve.targetStep;
  info.synthesized =
      DeployableInfo::Synthesized{solve.targetSigmaRel, solve.targetGamma, normalize};
  return deployableMetadata(info);
}

}  // namespace detail
}  // namespace shardema
