#include "shardema/core/tensor_file.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "shardema/core/tensor_checksums.h"
#include "shardema/core/tensor_file_writer.h"
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
                     const TensorEntry& entry, const std::string& path,
                     const detail::TensorChecksums& checksums) {
  at::Tensor tensor =
      at::empty(entry.shape, at::TensorOptions().dtype(detail::toScalarType(entry.dtype)));
  TORCH_INTERNAL_ASSERT(tensor.nbytes() == entry.byteSize(), "size mismatch for ", entry.name);
  if (entry.byteSize() > 0) {
    file.readAt(tensor.data_ptr(), entry.byteSize(), header.dataOffset + entry.begin,
                "tensor '" + entry.name + "'");
  }
  if (checksums.present()) {
    detail::TensorDigest digest(entry.dtype, entry.shape);
    digest.update(tensor.data_ptr(), tensor.nbytes());
    checksums.check(entry.name, digest.digest());
  }
  if (entry.dtype == FileDType::kBool) {
    detail::checkBoolBytes(static_cast<const uint8_t*>(tensor.data_ptr()),
                           static_cast<size_t>(tensor.numel()), 0, path, entry.name);
  }
  return tensor;
}

std::vector<std::string> tensorNames(const SafetensorsHeader& header) {
  std::vector<std::string> names;
  for (const TensorEntry& entry : header.tensors) names.push_back(entry.name);
  return names;
}

// Undefined and non-strided tensors are refused here; TensorFileWriter
// refuses the rest (dtypes, names), all before the temp file exists.
std::vector<TensorFileEntry> entriesToWrite(const std::string& path, const TensorFile& file) {
  std::vector<TensorFileEntry> entries;
  entries.reserve(file.tensors.size());
  for (const auto& [name, tensor] : file.tensors) {
    TORCH_CHECK_VALUE(tensor.defined(), path, ": tensor '", name, "' is undefined");
    TORCH_CHECK_TYPE(tensor.layout() == at::kStrided, path, ": tensor '", name, "' has layout ",
                     tensor.layout(), "; only dense (strided) tensors can be written");
    TensorFileEntry entry;
    entry.name = name;
    entry.dtype = tensor.scalar_type();
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
  std::vector<TensorFileEntry> entries = entriesToWrite(path, file);
  TensorFileWriter writer(path, std::move(entries), file.metadata);
  // One host copy alive at a time: memory stays at one tensor's size.
  for (const auto& [name, tensor] : file.tensors) writer.append(hostBytes(tensor, path, name));
  writer.commit();
}

TensorFile readTensorFile(const std::string& path) {
  InputFile input(path);
  const SafetensorsHeader header = input.readHeader();
  const detail::TensorChecksums checksums(header.metadata, tensorNames(header), path);
  TensorFile file;
  file.metadata = header.metadata;
  file.tensors.reserve(header.tensors.size());
  for (const TensorEntry& entry : header.tensors) {
    file.tensors.emplace_back(entry.name, readEntry(input, header, entry, path, checksums));
  }
  return file;
}

SafetensorsHeader readTensorFileHeader(const std::string& path) {
  return InputFile(path).readHeader();
}

}  // namespace shardema
