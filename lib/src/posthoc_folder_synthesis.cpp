#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardema/core/file_metadata.h"
#include "shardema/core/output_path.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/core/tensor_file_writer.h"
#include "shardema/shard/shard_layout.h"
#include "shardema/synthesis.h"
#include "weighted_snapshots.h"

namespace shardema {
namespace {

using detail::checkTensor;
using detail::openUsed;
using detail::WeightedReaders;

bool isFloating(at::ScalarType type) { return at::isFloatingType(type); }

// Appends the synthesized range to the output file.
void appendSynthesized(const WeightedReaders& used, const std::string& name, at::ScalarType type,
                       int64_t begin, int64_t count, int64_t roundElements, c10::ScalarType outType,
                       std::vector<double>& scratch, TensorFileWriter& writer) {
  detail::synthesizeRange(used, name, type, begin, count, roundElements, outType, scratch,
                          [&](const at::Tensor& piece) { writer.append(piece); });
}

void synthesizeFull(const std::vector<SnapshotEntry>& entries, const SynthesisWeights& solve,
                    const std::string& outPath, const SnapshotSynthesisOptions& options,
                    FolderSynthesisReport& report) {
  const WeightedReaders used = openUsed(entries, solve);
  const TensorFileReader& newest = *used.readers[used.newest];
  std::vector<TensorFileEntry> outEntries;
  std::vector<at::ScalarType> types;
  for (const TensorEntry& entry : newest.header().tensors) {
    const at::ScalarType type = checkTensor(used, entry.name, entry.numel());
    types.push_back(type);
    outEntries.push_back({entry.name, isFloating(type) ? options.outputDtype : type, entry.shape});
  }
  for (const auto& reader : used.readers) {
    TORCH_CHECK_VALUE(reader->header().tensors.size() == outEntries.size(),
                      "synthesize: ", reader->path(), " holds ", reader->header().tensors.size(),
                      " tensors but ", newest.path(), " holds ", outEntries.size());
  }
  TensorFileWriter writer(outPath, outEntries,
                          detail::synthesizedMetadata(solve, options.normalize));
  const int64_t round = std::max<int64_t>(1, options.bufferBytes / 8);
  std::vector<double> scratch;
  for (size_t t = 0; t < outEntries.size(); ++t) {
    const int64_t numel = newest.header().tensors[t].numel();
    appendSynthesized(used, outEntries[t].name, types[t], 0, numel, round, options.outputDtype,
                      scratch, writer);
  }
  writer.commit();
  report.tensors = static_cast<int64_t>(outEntries.size());
}

// Rank r's file holds its range of each tensor as 1-D data under the global
// name; ranges tile the tensor in rank order, so writing rank 0's piece,
// then rank 1's, ... streams the full tensor row-major.
void synthesizeSharded(const SnapshotFolder& folder, const SynthesisWeights& solve,
                       const std::string& outPath, const SnapshotSynthesisOptions& options,
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
      TORCH_CHECK_VALUE(entry.info.layoutJson == layoutJson,
                        "synthesize: mixed layouts: ", entry.path,
                        " records another shard layout than ", folder.perRank.front().front().path);
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
    outEntries.push_back(
        {spec.name, isFloating(type) ? options.outputDtype : type, spec.globalShape});
  }
  TensorFileWriter writer(outPath, outEntries,
                          detail::synthesizedMetadata(solve, options.normalize));
  const int64_t round = std::max<int64_t>(1, options.bufferBytes / 8);
  std::vector<double> scratch;
  for (size_t t = 0; t < layout.specs.size(); ++t) {
    const shard::ShardSpec& spec = layout.specs[t];
    for (size_t r = 0; r < ranks.size(); ++r) {
      const int64_t size = spec.rangeOf(static_cast<int64_t>(r)).size();
      if (size == 0) continue;
      appendSynthesized(ranks[r], spec.name, types[t], 0, size, round, options.outputDtype, scratch,
                        writer);
    }
  }
  writer.commit();
  report.tensors = static_cast<int64_t>(layout.specs.size());
}

}  // namespace

FolderSynthesisReport synthesizeSnapshotFolder(const std::string& dir, const std::string& outPath,
                                               const SnapshotSynthesisOptions& options) {
  detail::checkSynthesisOptions(options);
  detail::refuseOutputOverInput("synthesizeSnapshotFolder", outPath, {dir});
  const SnapshotFolder folder = scanSnapshotFolder(dir);
  FolderSynthesisReport report;
  report.sharded = folder.sharded;
  report.worldSize = folder.sharded ? folder.worldSize : 1;
  const std::vector<SnapshotEntry>& entries =
      folder.sharded ? folder.perRank.front() : folder.snapshots;
  report.weights = detail::solveFor(entries, options);
  for (const SnapshotEntry& entry : entries) report.files.push_back(entry.path);
  if (folder.sharded) {
    synthesizeSharded(folder, report.weights, outPath, options, report);
  } else {
    synthesizeFull(entries, report.weights, outPath, options, report);
  }
  return report;
}

}  // namespace shardema
