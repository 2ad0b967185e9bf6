#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "shardema/synthesis.h"
#include "weighted_snapshots.h"

namespace shardema {

SynthesizedTensors synthesizeSnapshots(const std::vector<SnapshotEntry>& entries,
                                       const SnapshotSynthesisOptions& options) {
  detail::checkSynthesisOptions(options);
  SynthesizedTensors out;
  out.weights = detail::solveFor(entries, options);
  const detail::WeightedReaders used = detail::openUsed(entries, out.weights);
  const TensorFileReader& newest = *used.readers[used.newest];
  const int64_t round = std::max<int64_t>(1, options.bufferBytes / 8);
  std::vector<double> scratch;
  for (const TensorEntry& entry : newest.header().tensors) {
    const int64_t numel = entry.numel();
    const at::ScalarType type = detail::checkTensor(used, entry.name, numel);
    const at::ScalarType outType = at::isFloatingType(type) ? options.outputDtype : type;
    at::Tensor result = at::empty({numel}, at::TensorOptions().dtype(outType));
    int64_t filled = 0;
    detail::synthesizeRange(used, entry.name, type, 0, numel, round, outType, scratch,
                            [&](const at::Tensor& piece) {
                              result.narrow(0, filled, piece.numel()).copy_(piece);
                              filled += piece.numel();
                            });
    out.tensors.emplace_back(entry.name, result.view(entry.shape));
  }
  for (const auto& reader : used.readers) {
    TORCH_CHECK_VALUE(reader->header().tensors.size() == out.tensors.size(),
                      "synthesize: ", reader->path(), " holds ", reader->header().tensors.size(),
                      " tensors but ", newest.path(), " holds ", out.tensors.size());
  }
  return out;
}

}  // namespace shardema
