#include "shardema/core/tensor_file_reader.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "shardema/core/tensor_checksums.h"
#include "tensor_file_io.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "shardema's tensor files assume a little-endian host");

namespace shardema {
namespace {

// Checked before any allocation, so a huge count is a ValueError, not a
// failed allocation.
void checkRange(const std::string& path, const TensorEntry& entry, int64_t begin, int64_t count) {
  const int64_t numel = entry.numel();
  TORCH_CHECK_VALUE(count >= 0, path, ": tensor '", entry.name, "': negative count ", count);
  TORCH_CHECK_VALUE(begin >= 0 && begin <= numel && count <= numel - begin, path, ": tensor '",
                    entry.name, "' has ", numel, " elements; range [", begin, ", ", begin, " + ",
                    count, ") is outside it");
}

}  // namespace

TensorFileReader::TensorFileReader(const std::string& path)
    : path_(path), file_(std::make_unique<detail::InputFile>(path)) {
  header_ = file_->readHeader();
  // A malformed checksum key, or one listing other tensors, is refused at
  // open like any other header problem.
  checksums_ = std::make_shared<const detail::TensorChecksums>(header_.metadata, names(), path_);
}

TensorFileReader::~TensorFileReader() = default;
TensorFileReader::TensorFileReader(TensorFileReader&& other) noexcept = default;
TensorFileReader& TensorFileReader::operator=(TensorFileReader&& other) noexcept = default;

std::vector<std::string> TensorFileReader::names() const {
  std::vector<std::string> out;
  out.reserve(header_.tensors.size());
  for (const TensorEntry& entry : header_.tensors) out.push_back(entry.name);
  return out;
}

bool TensorFileReader::contains(const std::string& name) const {
  return header_.find(name) != nullptr;
}

const TensorEntry& TensorFileReader::entry(const std::string& name) const {
  const TensorEntry* found = header_.find(name);
  TORCH_CHECK_INDEX(found != nullptr, path_, ": no tensor named '", name, "' among ",
                    header_.tensors.size(), " tensors");
  return *found;
}

at::ScalarType TensorFileReader::scalarType(const std::string& name) const {
  return detail::toScalarType(entry(name).dtype);
}

at::Tensor TensorFileReader::readRange(const std::string& name, int64_t beginElement,
                                       int64_t count) const {
  const TensorEntry& found = entry(name);
  checkRange(path_, found, beginElement, count);
  at::Tensor out = at::empty({count}, at::TensorOptions().dtype(detail::toScalarType(found.dtype)));
  readRangeInto(name, beginElement, out);
  return out;
}

void TensorFileReader::readRangeInto(const std::string& name, int64_t beginElement,
                                     const at::Tensor& out) const {
  TORCH_CHECK(file_ != nullptr, "TensorFileReader: used after a move");
  const TensorEntry& found = entry(name);
  TORCH_CHECK_VALUE(out.defined(), path_, ": tensor '", name, "': undefined output tensor");
  const int64_t count = out.numel();
  checkRange(path_, found, beginElement, count);
  const at::ScalarType type = detail::toScalarType(found.dtype);
  TORCH_CHECK_VALUE(out.scalar_type() == type && out.is_cpu() && out.is_contiguous() &&
                        out.layout() == at::kStrided,
                    path_, ": tensor '", name, "': the output must be a contiguous CPU ", type,
                    " tensor, got ", out.scalar_type(), out.is_cpu() ? "" : " (not CPU)",
                    out.is_contiguous() ? "" : " (not contiguous)");
  if (count == 0) return;
  const uint64_t elementBytes = static_cast<uint64_t>(fileDTypeSize(found.dtype));
  const uint64_t offset =
      header_.dataOffset + found.begin + static_cast<uint64_t>(beginElement) * elementBytes;
  file_->readAt(out.data_ptr(), out.nbytes(), offset, "tensor '" + name + "'");
  if (found.dtype == FileDType::kBool) {
    detail::checkBoolBytes(static_cast<const uint8_t*>(out.data_ptr()), static_cast<size_t>(count),
                           beginElement, path_, name);
  }
}

at::Tensor TensorFileReader::read(const std::string& name) const {
  const TensorEntry& found = entry(name);
  at::Tensor out =
      at::empty(found.shape, at::TensorOptions().dtype(detail::toScalarType(found.dtype)));
  readRangeInto(name, 0, out);
  if (checksums_->present()) {
    detail::TensorDigest digest(found.dtype, found.shape);
    digest.update(out.data_ptr(), out.nbytes());
    checksums_->check(name, digest.digest());
  }
  return out;
}

bool TensorFileReader::hasChecksums() const { return checksums_->present(); }

void TensorFileReader::verifyChecksums(int64_t bufferBytes) const {
  TORCH_CHECK(file_ != nullptr, "TensorFileReader: used after a move");
  if (!checksums_->present()) return;
  TORCH_CHECK_VALUE(bufferBytes > 0, path_, ": verifyChecksums: bufferBytes must be > 0");
  std::vector<char> buffer(static_cast<size_t>(std::min<uint64_t>(
      static_cast<uint64_t>(bufferBytes), std::max<uint64_t>(header_.dataSize, 1))));
  for (const TensorEntry& entry : header_.tensors) {
    detail::TensorDigest digest(entry.dtype, entry.shape);
    for (uint64_t done = 0; done < entry.byteSize();) {
      const uint64_t size = std::min<uint64_t>(buffer.size(), entry.byteSize() - done);
      file_->readAt(buffer.data(), size, header_.dataOffset + entry.begin + done,
                    "tensor '" + entry.name + "'");
      digest.update(buffer.data(), size);
      done += size;
    }
    checksums_->check(entry.name, digest.digest());
  }
}

}  // namespace shardema
