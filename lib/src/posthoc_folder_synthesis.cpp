#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
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

// Each split names a tensor of the layout whose rows are FSDP2's (the
// pieces torch.chunk gives along the split dim) and a dim it has.
void checkSplitDims(const shard::ShardLayout& layout,
                    const std::map<std::string, int64_t>& splitDims, const std::string& path) {
  for (const auto& [name, dim] : splitDims) {
    const shard::ShardSpec* spec = nullptr;
    for (const shard::ShardSpec& s : layout.specs) {
      if (s.name == name) spec = &s;
    }
    TORCH_CHECK_VALUE(spec != nullptr, "synthesize: ", path, " records a split of tensor '", name,
                      "' (shardema.split_dims), which its layout does not hold");
    TORCH_CHECK_VALUE(spec->kind == shard::LayoutKind::kFsdp2 &&
                          dim < static_cast<int64_t>(spec->globalShape.size()),
                      "synthesize: ", path, " records tensor '", name, "' as split along dim ", dim,
                      " but its layout entry is ", shard::layoutKindName(spec->kind), " of ",
                      spec->globalShape.size(),
                      " dims; a split piece is fsdp2 rows of a tensor with more dims than that");
  }
}

// A tensor-parallel tensor (split along dim d > 0): rank r's file holds its
// piece in its own layout, [outer, c_r, inner] with outer the product of
// the dims before d and inner of those after it. The tensor's own order
// runs over the ranks inside each outer index, so each round synthesizes
// a few outer indices of every rank (one contiguous range per rank) and
// interleaves them: about `roundElements` of synthesized values (and their
// interleaved copy) in memory at once, at least one outer index.
void appendSplitSynthesized(const std::vector<WeightedReaders>& ranks, const shard::ShardSpec& spec,
                            int64_t splitDim, at::ScalarType type, int64_t roundElements,
                            c10::ScalarType outType, std::vector<double>& scratch,
                            TensorFileWriter& writer) {
  if (spec.numel() == 0) return;
  const std::vector<int64_t> shape = detail::splitTensorShape(spec, splitDim);
  int64_t outer = 1;
  for (int64_t d = 0; d < splitDim; ++d) outer *= shape[d];
  const int64_t inner = spec.numel() / (outer * shape[splitDim]);
  const int64_t outerPerRound = std::max<int64_t>(1, roundElements / (shape[splitDim] * inner));
  for (int64_t o = 0; o < outer; o += outerPerRound) {
    const int64_t n = std::min(outerPerRound, outer - o);
    std::vector<at::Tensor> parts;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const int64_t width = spec.rangeOf(static_cast<int64_t>(r)).size() / (outer * inner);
      if (width == 0) continue;
      at::Tensor part = at::empty({n * width * inner},
                                  at::TensorOptions().dtype(isFloating(type) ? outType : type));
      int64_t filled = 0;
      detail::synthesizeRange(ranks[r], spec.name, type, o * width * inner, n * width * inner,
                              roundElements, isFloating(type) ? outType : type, scratch,
                              [&](const at::Tensor& piece) {
                                part.narrow(0, filled, piece.numel()).copy_(piece);
                                filled += piece.numel();
                              });
      parts.push_back(part.view({n, width, inner}));
    }
    writer.append(at::cat(parts, 1).view({-1}));
  }
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
      TORCH_CHECK_VALUE(entry.info.splitDims == folder.perRank.front().front().info.splitDims,
                        "synthesize: mixed layouts: ", entry.path,
                        " records other tensor-parallel splits (shardema.split_dims) than ",
                        folder.perRank.front().front().path);
    }
  }
  const shard::ShardLayout layout = shard::ShardLayout::fromJson(layoutJson);
  TORCH_CHECK_VALUE(layout.worldSize() == folder.worldSize, "synthesize: the layout in ",
                    folder.perRank.front().front().path, " is for ", layout.worldSize(),
                    " ranks but the folder has ", folder.worldSize);
  const std::map<std::string, int64_t>& splitDims = folder.perRank.front().front().info.splitDims;
  checkSplitDims(layout, splitDims, folder.perRank.front().front().path);
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
    const auto split = splitDims.find(spec.name);
    outEntries.push_back(
        {spec.name, isFloating(type) ? options.outputDtype : type,
         detail::splitTensorShape(spec, split == splitDims.end() ? 0 : split->second)});
  }
  TensorFileWriter writer(outPath, outEntries,
                          detail::synthesizedMetadata(solve, options.normalize));
  const int64_t round = std::max<int64_t>(1, options.bufferBytes / 8);
  std::vector<double> scratch;
  for (size_t t = 0; t < layout.specs.size(); ++t) {
    const shard::ShardSpec& spec = layout.specs[t];
    const auto split = splitDims.find(spec.name);
    if (split != splitDims.end()) {
      appendSplitSynthesized(ranks, spec, split->second, types[t], round, options.outputDtype,
                             scratch, writer);
      continue;
    }
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
