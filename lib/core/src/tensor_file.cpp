#include "shardema/tensor_file.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "shardema/detail/atomic_file.h"
#include "tensor_file_io.h"

// Tensor bytes go between memory and the file as they are: the format is
// little-endian, so is every host we build for; a big-endian port would
// need byte swapping here.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "shardema's tensor files assume a little-endian host");

namespace shardema {
namespace {

using detail::InputFile;

at::Tensor readEntry(const InputFile& file, const SafetensorsHeader& header,
                     const TensorEntry& entry, const std::string& path) {
  at::Tensor tensor =
      at::empty(entry.shape, at::TensorOptions().dtype(detail::toScalarType(entry.dtype)));
  TORCH_INTERNAL_ASSERT(tensor.nbytes() == entry.byteSize(), "size mismatch for ", entry.name);
  if (entry.byteSize() > 0) {
    file.readAt(tensor.data_ptr(), entry.byteSize(), header.dataOffset + entry.begin,
                "tensor '" + entry.name + "'");
  }
  if (entry.dtype == FileDType::kBool) {
    detail::checkBoolBytes(static_cast<const uint8_t*>(tensor.data_ptr()),
                           static_cast<size_t>(tensor.numel()), 0, path, entry.name);
  }
  return tensor;
}

// Everything that can be refused is refused here, before the temp file
// exists.
std::vector<TensorEntry> entriesToWrite(const std::string& path, const TensorFile& file) {
  std::vector<TensorEntry> entries;
  entries.reserve(file.tensors.size());
  for (const auto& [name, tensor] : file.tensors) {
    TORCH_CHECK_VALUE(tensor.defined(), path, ": tensor '", name, "' is undefined");
    TORCH_CHECK_TYPE(tensor.layout() == at::kStrided, path, ": tensor '", name, "' has layout ",
                     tensor.layout(), "; only dense (strided) tensors can be written");
    TensorEntry entry;
    entry.name = name;
    entry.dtype = detail::toFileDType(tensor.scalar_type(), path, name);
    entry.shape = tensor.sizes().vec();
    entries.push_back(std::move(entry));
  }
  return entries;
}

// A dense row-major host copy, made only when the tensor is not one already.
at::Tensor hostBytes(const at::Tensor& tensor, const std::string& path, const std::string& name) {
  try {
    at::Tensor host = tensor.is_cpu() ? tensor : tensor.cpu();
    if (host.is_neg()) host = host.resolve_neg();
    return host.contiguous();
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, path, ": cannot copy tensor '", name, "' to host memory: ", error.msg());
  }
  return at::Tensor();  // not reached: the check above always throws
}

}  // namespace

const at::Tensor& TensorFile::at(const std::string& name) const {
  auto found = std::find_if(tensors.begin(), tensors.end(),
                            [&](const auto& item) { return item.first == name; });
  TORCH_CHECK_INDEX(found != tensors.end(), "TensorFile: no tensor named '", name, "' among ",
                    tensors.size(), " tensors");
  return found->second;
}

bool TensorFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(),
                     [&](const auto& item) { return item.first == name; });
}

void writeTensorFile(const std::string& path, const TensorFile& file) {
  std::vector<TensorEntry> entries = entriesToWrite(path, file);
  const std::string header =
      buildSafetensorsHeader(entries, detail::metadataWithFormat(path, file.metadata), path);

  AtomicFileWriter writer(path);
  writer.write(header.data(), header.size());
  // One host copy alive at a time: memory stays at one tensor's size.
  for (size_t i = 0; i < entries.size(); ++i) {
    const at::Tensor host = hostBytes(file.tensors[i].second, path, entries[i].name);
    TORCH_INTERNAL_ASSERT(host.nbytes() == entries[i].byteSize(), "size mismatch for ",
                          entries[i].name);
    if (host.nbytes() > 0) writer.write(host.data_ptr(), host.nbytes());
  }
  TORCH_INTERNAL_ASSERT(writer.size() ==
                        header.size() + (entries.empty() ? 0 : entries.back().end));
  writer.commit();
}

TensorFile readTensorFile(const std::string& path) {
  InputFile input(path);
  const SafetensorsHeader header = input.readHeader();
  TensorFile file;
  file.metadata = header.metadata;
  file.tensors.reserve(header.tensors.size());
  for (const TensorEntry& entry : header.tensors) {
    file.tensors.emplace_back(entry.name, readEntry(input, header, entry, path));
  }
  return file;
}

SafetensorsHeader readTensorFileHeader(const std::string& path) {
  return InputFile(path).readHeader();
}

}  // namespace shardema
