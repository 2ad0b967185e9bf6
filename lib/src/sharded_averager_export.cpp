// ShardedAverager::exportWeights (streaming gather into a deployable file) and
// the export helpers the offline tools share.
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <unordered_map>

#include "deployable_writer.h"
#include "sharded_internal.h"
#include "shardema/shard/communicator.h"
#include "shardema/sharded_averager.h"

namespace shardema {

namespace {

using detail::DeployableWriter;
using detail::ExportedTensor;

const ExportedTensor& exportedTensor(const std::vector<ExportedTensor>& tensors, size_t i) {
  static const ExportedTensor kPlain;
  return tensors.empty() ? kPlain : tensors[i];
}

// The tensor's own shape: the spec's, with dim 0 moved back to splitDim.
std::vector<int64_t> heldShape(const shard::ShardSpec& spec, int64_t splitDim) {
  std::vector<int64_t> shape = spec.globalShape;
  if (splitDim > 0) {
    const int64_t rows = shape.front();
    shape.erase(shape.begin());
    shape.insert(shape.begin() + splitDim, rows);
  }
  return shape;
}

// The untracked tensors by where they go: [i] before layout.specs[i], the
// last after every spec, each in the order given. A `before` naming no
// spec, or an undefined value: c10::ValueError naming the tensor.
using UntrackedPlaces = std::vector<std::vector<const UntrackedTensor*>>;

UntrackedPlaces placeUntracked(const shard::ShardLayout& layout,
                               const std::vector<UntrackedTensor>& untracked, const char* api) {
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < layout.specs.size(); ++i) index[layout.specs[i].name] = i;
  UntrackedPlaces places(layout.specs.size() + 1);
  for (const UntrackedTensor& tensor : untracked) {
    TORCH_CHECK_VALUE(tensor.value.defined(), api, ": the model's tensor '", tensor.name,
                      "' has no value");
    size_t place = layout.specs.size();
    if (!tensor.before.empty()) {
      const auto found = index.find(tensor.before);
      TORCH_CHECK_VALUE(found != index.end(), api, ": the model's tensor '", tensor.name,
                        "' is to go before '", tensor.before, "', which the export does not hold");
      place = found->second;
    }
    places[place].push_back(&tensor);
  }
  return places;
}

// Each tensor under its name, then under each of its aliases; the
// untracked ones where `places` puts them.
std::vector<TensorFileEntry> deployableEntries(const shard::ShardLayout& layout,
                                               const std::vector<at::Tensor>& pieces,
                                               c10::ScalarType dtype,
                                               const std::vector<ExportedTensor>& tensors,
                                               const UntrackedPlaces& places) {
  std::vector<TensorFileEntry> entries;
  auto addUntracked = [&](size_t place) {
    for (const UntrackedTensor* tensor : places[place]) {
      entries.push_back({tensor->name, detail::exportedDtype(tensor->value.scalar_type(), dtype),
                         tensor->value.sizes().vec()});
    }
  };
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    addUntracked(i);
    const shard::ShardSpec& spec = layout.specs[i];
    const ExportedTensor& tensor = exportedTensor(tensors, i);
    const c10::ScalarType type = detail::exportedDtype(pieces[i].scalar_type(), dtype);
    const std::vector<int64_t> shape = heldShape(spec, tensor.splitDim);
    entries.push_back({spec.name, type, shape});
    for (const std::string& alias : tensor.aliases) entries.push_back({alias, type, shape});
  }
  addUntracked(layout.specs.size());
  return entries;
}

// Bytes of a moved-back tensor's rows appended per call: its view is
// strided, and a contiguous copy of all of it would be a second full tensor
// on the root. 1 MiB writes are far above a file's per-call cost.
constexpr int64_t kReorderBytes = int64_t{1} << 20;

// The root's side of the gather: appends each piece as it arrives, except
// for a tensor written under more than one name, which it assembles whole
// first (one full tensor at a time) and then appends once per name; the
// untracked tensors placed before a spec go in before its first piece,
// the rest at finish().
class DeployableSink {
 public:
  DeployableSink(DeployableWriter& writer, const shard::ShardLayout& layout,
                 const std::vector<ExportedTensor>& tensors, c10::ScalarType dtype,
                 const UntrackedPlaces& places, int64_t bufferBytes)
      : writer_(writer), tensors_(tensors), dtype_(dtype), places_(places),
        bufferBytes_(bufferBytes) {
    for (size_t i = 0; i < layout.specs.size(); ++i) index_[layout.specs[i].name] = i;
  }

  void operator()(const shard::ShardSpec& spec, int64_t offset, const at::Tensor& piece) {
    const size_t i = index_.at(spec.name);
    if (offset == 0) appendUntracked(i);
    const ExportedTensor& tensor = exportedTensor(tensors_, i);
    if (tensor.aliases.empty() && tensor.splitDim == 0) {
      append(piece);
      return;
    }
    if (offset == 0) whole_ = at::empty({spec.numel()}, piece.options());
    whole_.narrow(0, offset, piece.numel()).copy_(piece);
    if (offset + piece.numel() < spec.numel()) return;
    for (size_t n = 0; n <= tensor.aliases.size(); ++n) {
      if (tensor.splitDim == 0 || whole_.numel() == 0) {
        append(whole_);
      } else {
        appendMovedBack(whole_.view(spec.globalShape).movedim(0, tensor.splitDim));
      }
    }
    whole_ = at::Tensor();
  }

  /// The untracked tensors after the last spec (and any a spec that never
  /// arrived would have led: none, as every spec arrives).
  void finish() { appendUntracked(places_.size() - 1); }

 private:
  void append(const at::Tensor& piece) {
    writer_.append(piece.to(detail::exportedDtype(piece.scalar_type(), dtype_)));
  }

  // Those placed up to `place`, each copied to host memory and converted a
  // bounded piece at a time: on the root beside the model's own tensor,
  // at most bufferBytes more.
  void appendUntracked(size_t place) {
    for (; nextPlace_ <= place; ++nextPlace_) {
      for (const UntrackedTensor* tensor : places_[nextPlace_]) {
        const at::Tensor flat = tensor->value.detach().reshape({-1});
        const c10::ScalarType type = detail::exportedDtype(flat.scalar_type(), dtype_);
        const int64_t step = detail::elementsPerPiece(bufferBytes_, flat.scalar_type());
        for (int64_t at = 0; at < flat.numel(); at += step) {
          writer_.append(flat.narrow(0, at, std::min(step, flat.numel() - at))
                             .to(at::kCPU, type)
                             .contiguous());
        }
      }
    }
  }

  void appendMovedBack(const at::Tensor& held) {
    const int64_t rows = held.size(0);
    const int64_t rowBytes = held.numel() / rows * static_cast<int64_t>(held.element_size());
    const int64_t step = std::max<int64_t>(1, kReorderBytes / std::max<int64_t>(rowBytes, 1));
    for (int64_t row = 0; row < rows; row += step) {
      append(held.narrow(0, row, std::min(step, rows - row)).contiguous().view({-1}));
    }
  }

  DeployableWriter& writer_;
  const std::vector<ExportedTensor>& tensors_;
  c10::ScalarType dtype_;
  const UntrackedPlaces& places_;
  int64_t bufferBytes_;
  size_t nextPlace_ = 0;  // places_ before it are written
  std::unordered_map<std::string, size_t> index_;
  at::Tensor whole_;  // the tensor being assembled
};

// The root opens the file (or the folder's plan) first (when its own
// pieces are there), placing the untracked tensors (`places`), and tells
// the others whether it could, so a bad path or tensor fails every rank at
// once instead of after a gather timeout. Word: 1 open,
// 0 open failed, 2 the root's own pieces failed (the gather then reports it).
std::unique_ptr<DeployableWriter> openOnRoot(shard::Communicator& comm, const std::string& path,
                                             const shard::ShardLayout& layout,
                                             const std::vector<at::Tensor>& pieces,
                                             c10::ScalarType dtype,
                                             const std::map<std::string, std::string>& metadata,
                                             const shard::GatherOptions& options, const char* api,
                                             const std::vector<ExportedTensor>& tensors,
                                             std::optional<int64_t> maxShardBytes,
                                             const std::vector<UntrackedTensor>& untracked,
                                             UntrackedPlaces& places) {
  std::unique_ptr<DeployableWriter> writer;
  std::exception_ptr failure;
  at::Tensor ok = at::ones({1}, at::kInt);
  if (comm.rank() == options.root && !options.localError.empty()) {
    ok.fill_(2);
  } else if (comm.rank() == options.root) {
    try {
      // A folder is checked as the place of its files.
      detail::checkExportDestination(
          maxShardBytes ? detail::joinPath(path, kModelWeightsFileName) : path, api);
      places = placeUntracked(layout, untracked, api);  // the root's alone
      writer = std::make_unique<DeployableWriter>(
          path, deployableEntries(layout, pieces, dtype, tensors, places), metadata,
          maxShardBytes, api);
    } catch (...) {
      failure = std::current_exception();
      ok.fill_(0);
    }
  }
  comm.broadcast(ok, options.root, "exportWeights open " + path);
  if (failure) std::rethrow_exception(failure);
  TORCH_CHECK(ok.item<int>() != 0, api, ": rank ", options.root, " could not create ", path,
              "; nothing was exported");
  return writer;
}

// After the gather: the root's append/commit outcome, so no rank returns
// as if the export had succeeded when the root's file was not written.
void agreeOnCommit(shard::Communicator& comm, const std::string& path, int64_t root,
                   std::exception_ptr failure, const char* api) {
  at::Tensor ok = at::zeros({1}, at::kInt);
  ok.fill_(failure ? 0 : 1);
  comm.broadcast(ok, root, "exportWeights commit " + path);
  if (failure) std::rethrow_exception(failure);
  TORCH_CHECK(ok.item<int>() == 1, api, ": rank ", root, " could not write ", path,
              "; nothing was exported");
}

}  // namespace

void detail::exportPieces(shard::Communicator& comm, const std::string& path,
                          const shard::ShardLayout& layout, const std::vector<at::Tensor>& pieces,
                          c10::ScalarType dtype, const std::map<std::string, std::string>& metadata,
                          shard::GatherOptions options, const char* api,
                          const std::vector<ExportedTensor>& tensors,
                          std::optional<int64_t> maxShardBytes,
                          const std::vector<UntrackedTensor>& untracked) {
  TORCH_INTERNAL_ASSERT(tensors.empty() || tensors.size() == layout.specs.size());
  UntrackedPlaces places(layout.specs.size() + 1);
  std::unique_ptr<DeployableWriter> writer = openOnRoot(
      comm, path, layout, pieces, dtype, metadata, options, api, tensors, maxShardBytes,
      untracked, places);
  std::exception_ptr sinkFailure;
  std::unique_ptr<DeployableSink> sink;
  if (writer) {
    sink = std::make_unique<DeployableSink>(*writer, layout, tensors, dtype, places,
                                            options.bufferBytes);
  }
  try {
    shard::gatherStreaming(
        comm, layout, pieces,
        [&](const shard::ShardSpec& spec, int64_t offset, const at::Tensor& piece) {
          try {
            (*sink)(spec, offset, piece);
          } catch (...) {
            sinkFailure = std::current_exception();
            throw;
          }
        },
        options);
  } catch (...) {
    // Only the sink's own failure leaves the other ranks unaware.
    if (!sinkFailure) throw;
  }
  if (writer && !sinkFailure) {
    try {
      sink->finish();
      writer->commit();
    } catch (...) {
      sinkFailure = std::current_exception();
    }
  }
  agreeOnCommit(comm, path, options.root, sinkFailure, api);
}

void ShardedAverager::exportWeights(shard::Communicator& comm, const std::string& path,
                                    c10::ScalarType outputDtype, shard::GatherOptions options,
                                    std::optional<int64_t> maxShardBytes, int profile,
                                    const std::vector<UntrackedTensor>& untracked) const {
  constexpr const char* kExportApi = "ShardedAverager::exportWeights";
  detail::checkExportDtype(outputDtype, kExportApi);
  TORCH_CHECK_VALUE(!maxShardBytes || *maxShardBytes >= 1, kExportApi,
                    ": maxShardBytes must be >= 1, got ", maxShardBytes.value_or(0));
  TORCH_CHECK_VALUE(options.root >= 0 && options.root < comm.worldSize(), kExportApi,
                    ": options.root must name one rank in [0, ", comm.worldSize(), "), got ",
                    options.root);
  TORCH_CHECK_VALUE(comm.worldSize() == worldSize_ && comm.rank() == rank_, kExportApi,
                    ": communicator is rank ", comm.rank(), " of ", comm.worldSize(),
                    " but this averager is rank ", rank_, " of ", worldSize_);
  // A profile that does not exist: c10::IndexError on every rank (each
  // asks for the same one) before anything moves.
  std::map<std::string, std::string> metadata =
      detail::exportedMetadata(averager_.step(), averager_.schedule(profile), worldSize_);
  if (!untracked.empty()) {
    std::set<std::string> names;  // sorted: one spelling for the same names
    for (const UntrackedTensor& tensor : untracked) names.insert(tensor.name);
    metadata[detail::kFromModelKey] = nlohmann::json(names).dump();
  }
  std::vector<at::Tensor> pieces;
  try {
    pieces = piecesInSpecOrder(profile);
  } catch (...) {
    // A background failure: join the gather's checks with it (see gather.h).
    options.localError = detail::currentErrorMessage();
  }
  // The persistent tensors only: a deployable file holds the keys of the
  // model's state_dict(), which a strict load takes without leftovers.
  shard::ShardLayout exported;
  std::vector<at::Tensor> exportedPieces;
  std::vector<ExportedTensor> tensors;
  for (size_t i = 0; i < shards_.size(); ++i) {
    if (!shards_[i].persistent) continue;
    exported.specs.push_back(layout_.specs[i]);
    if (!pieces.empty()) exportedPieces.push_back(pieces[i]);
    tensors.push_back({shards_[i].aliases, shards_[i].splitDim});
  }
  detail::exportPieces(comm, path, exported, exportedPieces, outputDtype, metadata, options,
                       kExportApi, tensors, maxShardBytes, untracked);
}

}  // namespace shardema
