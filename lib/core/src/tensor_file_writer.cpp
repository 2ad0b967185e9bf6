#include "shardema/detail/tensor_file_writer.h"

#include <c10/util/Exception.h>

#include <utility>

#include "shardema/detail/atomic_file.h"
#include "shardema/detail/checksum.h"
#include "shardema/detail/safetensors_header.h"
#include "tensor_file_io.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "shardema's tensor files assume a little-endian host");

namespace shardema {
namespace {

// buildSafetensorsHeader checks names and shapes; the dtype check (a
// TypeError) comes first, before any file exists.
std::vector<TensorEntry> headerEntries(const std::string& path,
                                       const std::vector<TensorFileEntry>& entries) {
  std::vector<TensorEntry> out;
  out.reserve(entries.size());
  for (const TensorFileEntry& entry : entries) {
    TensorEntry header;
    header.name = entry.name;
    header.dtype = detail::toFileDType(entry.dtype, path, entry.name);
    header.shape = entry.shape;
    out.push_back(std::move(header));
  }
  return out;
}

}  // namespace

TensorFileWriter::TensorFileWriter(const std::string& path, std::vector<TensorFileEntry> entries,
                                   const std::map<std::string, std::string>& metadata)
    : path_(path), entries_(std::move(entries)) {
  std::vector<TensorEntry> header = headerEntries(path_, entries_);
  const std::string bytes =
      buildSafetensorsHeader(header, detail::metadataWithFormat(path_, metadata), path_);
  for (const TensorEntry& entry : header) numels_.push_back(entry.numel());
  fileSize_ = bytes.size() + (header.empty() ? 0 : header.back().end);
  hash_ = std::make_unique<Xxh64>();
  file_ = std::make_unique<AtomicFileWriter>(path_);
  file_->write(bytes.data(), bytes.size());
  hash_->update(bytes.data(), bytes.size());
  skipCompleteEntries();
}

TensorFileWriter::~TensorFileWriter() = default;
TensorFileWriter::TensorFileWriter(TensorFileWriter&&) noexcept = default;
TensorFileWriter& TensorFileWriter::operator=(TensorFileWriter&&) noexcept = default;

void TensorFileWriter::skipCompleteEntries() {
  while (current_ < entries_.size() && writtenInCurrent_ == numels_[current_]) {
    ++current_;
    writtenInCurrent_ = 0;
  }
}

void TensorFileWriter::append(const at::Tensor& piece) {
  TORCH_CHECK(file_ != nullptr && !committed_, path_, ": TensorFileWriter::append after commit");
  TORCH_CHECK_VALUE(piece.defined(), path_, ": TensorFileWriter::append: undefined piece");
  if (piece.numel() == 0) return;
  TORCH_CHECK_VALUE(current_ < entries_.size(), path_,
                    ": TensorFileWriter::append: every tensor is complete, but a piece of ",
                    piece.numel(), " elements was given");
  const TensorFileEntry& entry = entries_[current_];
  TORCH_CHECK_VALUE(piece.scalar_type() == entry.dtype, path_, ": tensor '", entry.name, "' is ",
                    entry.dtype, ", got a piece of ", piece.scalar_type());
  TORCH_CHECK_VALUE(piece.is_cpu() && piece.layout() == at::kStrided && piece.is_contiguous() &&
                        !piece.is_neg() && !piece.is_conj(),
                    path_, ": tensor '", entry.name,
                    "': pieces must be dense contiguous CPU tensors (call .contiguous() / .cpu())");
  const int64_t remaining = numels_[current_] - writtenInCurrent_;
  TORCH_CHECK_VALUE(piece.numel() <= remaining, path_, ": tensor '", entry.name, "' lacks ",
                    remaining, " of its ", numels_[current_], " elements, got a piece of ",
                    piece.numel(), " (pieces never span two tensors)");
  file_->write(piece.data_ptr(), piece.nbytes());
  hash_->update(piece.data_ptr(), piece.nbytes());
  writtenInCurrent_ += piece.numel();
  skipCompleteEntries();
}

std::string TensorFileWriter::currentTensor() const {
  return current_ < entries_.size() ? entries_[current_].name : std::string();
}

int64_t TensorFileWriter::remainingInCurrent() const {
  return current_ < entries_.size() ? numels_[current_] - writtenInCurrent_ : 0;
}

void TensorFileWriter::commit() {
  TORCH_CHECK(file_ != nullptr && !committed_, path_,
              ": TensorFileWriter::commit called twice or after a move");
  TORCH_CHECK_VALUE(current_ == entries_.size(), path_, ": TensorFileWriter::commit: tensor '",
                    currentTensor(), "' has ", writtenInCurrent_, " of its ", numels_[current_],
                    " elements");
  TORCH_INTERNAL_ASSERT(file_->size() == fileSize_, path_, ": wrote ", file_->size(),
                        " bytes, expected ", fileSize_);
  file_->commit();
  checksum_ = hash_->digest();
  committed_ = true;
}

uint64_t TensorFileWriter::checksum() const {
  TORCH_CHECK(committed_, path_, ": TensorFileWriter::checksum before commit");
  return checksum_;
}

}  // namespace shardema
