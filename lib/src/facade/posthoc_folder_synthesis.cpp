#include "shardema/posthoc_folder_synthesis.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardema/posthoc_snapshot.h"
#include "shardema/shard/shard_layout.h"
#include "shardema/tensor_file_reader.h"
#include "shardema/tensor_file_writer.h"

namespace shardema {
namespace {

std::string decimal17(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

bool isFloating(at::ScalarType type) { return at::isFloatingType(type); }

// The snapshots of one rank (or of the whole folder) that the solve uses,
// opened once, with their weights.
struct WeightedReaders {
  std::vector<std::unique_ptr<TensorFileReader>> readers;
  std::vector<double> weights;
  // Index of the newest snapshot used: integer/bool copies come from it.
  size_t newest = 0;
};

WeightedReaders openUsed(const std::vector<SnapshotEntry>& entries, const SynthesisWeights& solve) {
  WeightedReaders out;
  int64_t newestStep = -1;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (!solve.used[i]) continue;
    out.readers.push_back(std::make_unique<TensorFileReader>(entries[i].path));
    out.weights.push_back(solve.weights[i]);
    if (entries[i].info.step >= newestStep) {
      newestStep = entries[i].info.step;
      out.newest = out.readers.size() - 1;
    }
  }
  return out;
}

// Every used snapshot must hold `name` with `numel` elements of one dtype
// (float32 for averaged tensors, as writeSnapshot stores them).
at::ScalarType checkTensor(const WeightedReaders& used, const std::string& name, int64_t numel) {
  const TensorFileReader& first = *used.readers.front();
  TORCH_CHECK_VALUE(first.contains(name), "synthesize: snapshot ", first.path(),
                    " has no tensor '", name, "'");
  const at::ScalarType type = first.scalarType(name);
  for (const auto& reader : used.readers) {
    TORCH_CHECK_VALUE(reader->contains(name), "synthesize: snapshot ", reader->path(),
                      " has no tensor '", name, "' (the other snapshots do)");
    TORCH_CHECK_VALUE(reader->entry(name).numel() == numel, "synthesize: tensor '", name,
                      "' has ", reader->entry(name).numel(), " elements in ", reader->path(),
                      " but ", numel, " are expected");
    TORCH_CHECK_VALUE(reader->scalarType(name) == type, "synthesize: tensor '", name,
                      "' has dtype ", reader->scalarType(name), " in ", reader->path(), " but ",
                      type, " in ", first.path());
    TORCH_CHECK_VALUE(!isFloating(type) || type == at::kFloat, "synthesize: tensor '", name,
                      "' in ", reader->path(), " is ", type,
                      "; snapshots store averaged tensors as float32");
  }
  return type;
}

// Appends elements [begin, begin + count) of `name` as synthesized from
// `used`: the weighted float64 sum for floating tensors, the newest
// snapshot's bytes for copies. `scratch` holds the accumulators.
void appendSynthesized(const WeightedReaders& used, const std::string& name, at::ScalarType type,
                       int64_t begin, int64_t count, int64_t roundElements,
                       c10::ScalarType outType, std::vector<double>& scratch,
                       TensorFileWriter& writer) {
  for (int64_t offset = 0; offset < count; offset += roundElements) {
    const int64_t n = std::min(roundElements, count - offset);
    if (!isFloating(type)) {
      writer.append(used.readers[used.newest]->readRange(name, begin + offset, n));
      continue;
    }
    scratch.assign(static_cast<size_t>(n), 0.0);
    for (size_t i = 0; i < used.readers.size(); ++i) {
      const at::Tensor x = used.readers[i]->readRange(name, begin + offset, n);
      const float* data = x.data_ptr<float>();
      const double w = used.weights[i];
      for (int64_t e = 0; e < n; ++e) scratch[e] += w * static_cast<double>(data[e]);
    }
    writer.append(at::from_blob(scratch.data(), {n}, at::kDouble).to(outType));
  }
}

std::map<std::string, std::string> deployableMetadata(const SynthesisWeights& solve,
                                                      bool normalize) {
  return {{"shardema.kind", "deployable_weights"},
          {"shardema.sigma_rel", decimal17(solve.targetSigmaRel)},
          {"shardema.gamma", decimal17(solve.targetGamma)},
          {"shardema.step", std::to_string(solve.targetStep)},
          {"shardema.synthesis", normalize ? "normalized" : "raw"}};
}

void checkOptions(const FolderSynthesisOptions& options) {
  TORCH_CHECK_VALUE(options.dtype == at::kFloat || options.dtype == at::kBFloat16 ||
                        options.dtype == at::kHalf,
                    "synthesize: dtype must be float32, bfloat16 or float16 (got ",
                    options.dtype, ")");
  TORCH_CHECK_VALUE(options.bufferBytes >= 64, "synthesize: bufferBytes (", options.bufferBytes,
                    ") must be >= 64");
}

SynthesisWeights solveFor(const std::vector<SnapshotEntry>& entries,
                          const FolderSynthesisOptions& options) {
  std::vector<SnapshotProfile> profiles;
  for (const SnapshotEntry& entry : entries) profiles.push_back({entry.info.step, entry.info.gamma});
  SynthesisOptions solveOptions;
  solveOptions.normalize = options.normalize;
  return solveSynthesisWeights(profiles, options.sigmaRel, options.step, solveOptions);
}

void synthesizeFull(const std::vector<SnapshotEntry>& entries, const SynthesisWeights& solve,
                    const std::string& outPath, const FolderSynthesisOptions& options,
                    FolderSynthesisReport& report) {
  const WeightedReaders used = openUsed(entries, solve);
  const TensorFileReader& newest = *used.readers[used.newest];
  std::vector<TensorFileEntry> outEntries;
  std::vector<at::ScalarType> types;
  for (const TensorEntry& entry : newest.header().tensors) {
    const at::ScalarType type = checkTensor(used, entry.name, entry.numel());
    types.push_back(type);
    outEntries.push_back({entry.name, isFloating(type) ? options.dtype : type, entry.shape});
  }
  for (const auto& reader : used.readers) {
    TORCH_CHECK_VALUE(reader->header().tensors.size() == outEntries.size(), "synthesize: ",
                      reader->path(), " holds ", reader->header().tensors.size(),
                      " tensors but ", newest.path(), " holds ", outEntries.size());
  }
  TensorFileWriter writer(outPath, outEntries, deployableMetadata(solve, options.normalize));
  const int64_t round = std::max<int64_t>(1, options.bufferBytes / 8);
  std::vector<double> scratch;
  for (size_t t = 0; t < outEntries.size(); ++t) {
    const int64_t numel = newest.header().tensors[t].numel();
    appendSynthesized(used, outEntries[t].name, types[t], 0, numel, round, options.dtype, scratch,
                      writer);
  }
  writer.commit();
  report.tensors = static_cast<int64_t>(outEntries.size());
}

// Rank r's file holds its range of each tensor as 1-D data under the global
// name; ranges tile the tensor in rank order, so writing rank 0's piece,
// then rank 1's, ... streams the full tensor row-major.
void synthesizeSharded(const SnapshotFolder& folder, const SynthesisWeights& solve,
                       const std::string& outPath, const FolderSynthesisOptions& options,
                       FolderSynthesisReport& report) {
  const std::string& layoutJson = folder.perRank.front().front().info.layoutJson;
  const std::vector<SnapshotEntry>& rankZero = folder.perRank.front();
  for (const auto& rankEntries : folder.perRank) {
    TORCH_CHECK_VALUE(rankEntries.size() == rankZero.size(), "synthesize: rank folders of ",
                      "one snapshot folder hold different numbers of snapshots");
    for (size_t i = 0; i < rankEntries.size(); ++i) {
      const SnapshotInfo& info = rankEntries[i].info;
      TORCH_CHECK_VALUE(info.step == rankZero[i].info.step && info.gamma == rankZero[i].info.gamma,
                        "synthesize: ", rankEntries[i].path, " (step ", info.step, ", gamma ",
                        info.gamma, ") does not match rank 0's ", rankZero[i].path);
    }
    for (const SnapshotEntry& entry : rankEntries) {
      TORCH_CHECK_VALUE(entry.info.layoutJson == layoutJson, "synthesize: mixed layouts: ",
                        entry.path, " records another shard layout than ",
                        folder.perRank.front().front().path);
    }
  }
  const shard::ShardLayout layout = shard::ShardLayout::fromJson(layoutJson);
  TORCH_CHECK_VALUE(layout.worldSize() == folder.worldSize, "synthesize: the layout in ",
                    folder.perRank.front().front().path, " is for ", layout.worldSize(),
                    " ranks but the folder has ", folder.worldSize);
  std::vector<WeightedReaders> ranks;
  for (const auto& rankEntries : folder.perRank) ranks.push_back(openUsed(rankEntries, solve));
  std::vector<TensorFileEntry> outEntries;
  std::vector<at::ScalarType> types;
  for (const shard::ShardSpec& spec : layout.specs) {
    at::ScalarType type = at::kFloat;
    bool seen = false;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const int64_t size = spec.rangeOf(static_cast<int64_t>(r)).size();
      if (size == 0) continue;
      const at::ScalarType rankType = checkTensor(ranks[r], spec.name, size);
      TORCH_CHECK_VALUE(!seen || rankType == type, "synthesize: tensor '", spec.name,
                        "' has different dtypes on different ranks");
      type = rankType;
      seen = true;
    }
    types.push_back(type);
    outEntries.push_back({spec.name, isFloating(type) ? options.dtype : type, spec.globalShape});
  }
  TensorFileWriter writer(outPath, outEntries, deployableMetadata(solve, options.normalize));
  const int64_t round = std::max<int64_t>(1, options.bufferBytes / 8);
  std::vector<double> scratch;
  for (size_t t = 0; t < layout.specs.size(); ++t) {
    const shard::ShardSpec& spec = layout.specs[t];
    for (size_t r = 0; r < ranks.size(); ++r) {
      const int64_t size = spec.rangeOf(static_cast<int64_t>(r)).size();
      if (size == 0) continue;
      appendSynthesized(ranks[r], spec.name, types[t], 0, size, round, options.dtype, scratch,
                        writer);
    }
  }
  writer.commit();
  report.tensors = static_cast<int64_t>(layout.specs.size());
}

}  // namespace

FolderSynthesisReport synthesizeSnapshotFolder(const std::string& dir, const std::string& outPath,
                                               const FolderSynthesisOptions& options) {
  checkOptions(options);
  const SnapshotFolder folder = scanSnapshotFolder(dir);
  FolderSynthesisReport report;
  report.sharded = folder.sharded;
  report.worldSize = folder.sharded ? folder.worldSize : 1;
  const std::vector<SnapshotEntry>& entries =
      folder.sharded ? folder.perRank.front() : folder.snapshots;
  report.weights = solveFor(entries, options);
  for (const SnapshotEntry& entry : entries) report.files.push_back(entry.path);
  if (folder.sharded) {
    synthesizeSharded(folder, report.weights, outPath, options, report);
  } else {
    synthesizeFull(entries, report.weights, outPath, options, report);
  }
  return report;
}

}  // namespace shardema
