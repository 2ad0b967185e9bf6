#include "shardema/core/tensor_file_writer.h"

#include <c10/util/Exception.h>

#include <utility>

#include "shardema/core/atomic_file.h"
#include "shardema/core/checksum.h"
#include "shardema/core/safetensors_header.h"
#include "shardema/core/tensor_checksums.h"
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
  header_ = headerEntries(path_, entries_);
  // The checksums are ours to compute: one a caller passes on (metadata of
  // a file read back) is replaced, never trusted.
  metadata_ = detail::metadataWithFormat(path_, metadata);
  std::vector<std::string> names;
  for (const TensorFileEntry& entry : entries_) names.push_back(entry.name);
  metadata_[detail::kTensorChecksumsKey] = detail::placeholderTensorChecksums(names);
  const std::string bytes = buildSafetensorsHeader(header_, metadata_, path_);
  headerSize_ = bytes.size();
  for (const TensorEntry& entry : header_) {
    numels_.push_back(entry.numel());
    digests_.emplace_back(entry.dtype, entry.shape);
  }
  fileSize_ = bytes.size() + (header_.empty() ? 0 : header_.back().end);
  file_ = std::make_unique<AtomicFileWriter>(path_);
  file_->write(bytes.data(), bytes.size());
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
  TORCH_CHECK(file_ != nullptr && !finished_, path_,
              ": TensorFileWriter::append after finish or commit");
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
  digests_[current_].update(piece.data_ptr(), piece.nbytes());
  writtenInCurrent_ += piece.numel();
  skipCompleteEntries();
}

std::string TensorFileWriter::currentTensor() const {
  return current_ < entries_.size() ? entries_[current_].name : std::string();
}

int64_t TensorFileWriter::remainingInCurrent() const {
  return current_ < entries_.size() ? numels_[current_] - writtenInCurrent_ : 0;
}

void TensorFileWriter::finish() {
  TORCH_CHECK(file_ != nullptr && !finished_, path_,
              ": TensorFileWriter::finish called twice, after commit or a move");
  TORCH_CHECK_VALUE(current_ == entries_.size(), path_, ": TensorFileWriter::commit: tensor '",
                    currentTensor(), "' has ", writtenInCurrent_, " of its ", numels_[current_],
                    " elements");
  TORCH_INTERNAL_ASSERT(file_->size() == fileSize_, path_, ": wrote ", file_->size(),
                        " bytes, expected ", fileSize_);
  std::vector<std::pair<std::string, uint64_t>> digests;
  for (size_t i = 0; i < entries_.size(); ++i) {
    digests.emplace_back(entries_[i].name, digests_[i].digest());
  }
  metadata_[detail::kTensorChecksumsKey] = detail::formatTensorChecksums(digests);
  // Same names, same fixed-width digests: the final header has the
  // placeholder's length, so it overwrites it in place.
  const std::string bytes = buildSafetensorsHeader(header_, metadata_, path_);
  TORCH_INTERNAL_ASSERT(bytes.size() == headerSize_, path_, ": the completed header is ",
                        bytes.size(), " bytes, its placeholder ", headerSize_);
  file_->overwrite(0, bytes.data(), bytes.size());
  file_->finish();
  finished_ = true;
}

void TensorFileWriter::commit() {
  TORCH_CHECK(file_ != nullptr && !committed_, path_,
              ": TensorFileWriter::commit called twice or after a move");
  if (!finished_) finish();
  file_->commit();
  committed_ = true;
}

uint64_t TensorFileWriter::checksum() const {
  TORCH_CHECK(committed_, path_, ": TensorFileWriter::checksum before commit");
  // The header was completed after the data, so the whole-file digest
  // needs the file read back once (from the page cache, just written).
  if (!checksum_) checksum_ = fileChecksum(path_);
  return *checksum_;
}

}  // namespace shardema
