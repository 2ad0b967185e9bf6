#include "deployable_writer.h"

#include <c10/util/Exception.h>

#include <utility>

namespace shardema::detail {
namespace {

bool endsWith(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

DeployableWriter::DeployableWriter(const std::string& path, std::vector<TensorFileEntry> entries,
                                   const std::map<std::string, std::string>& metadata,
                                   std::optional<int64_t> maxFileBytes, const char* api) {
  if (!maxFileBytes) {
    file_ = std::make_unique<TensorFileWriter>(path, std::move(entries), metadata);
    return;
  }
  std::string folder = path;  // "out.safetensors/" is refused too
  while (folder.size() > 1 && folder.back() == '/') folder.pop_back();
  TORCH_CHECK_VALUE(!endsWith(folder, ".safetensors"), api, ": a split export writes a folder (",
                    kModelIndexFileName, " and its files), but ", path,
                    " names a .safetensors file; give a folder");
  folder_ = std::make_unique<TensorFolderWriter>(path, std::move(entries), metadata, *maxFileBytes);
}

DeployableWriter::~DeployableWriter() = default;

void DeployableWriter::append(const at::Tensor& piece) {
  if (file_) {
    file_->append(piece);
  } else {
    folder_->append(piece);
  }
}

void DeployableWriter::commit() {
  if (file_) {
    file_->commit();
  } else {
    folder_->commit();
  }
}

uint64_t DeployableWriter::bytes() const {
  return file_ ? file_->fileSize() : folder_->totalFileBytes();
}

int64_t DeployableWriter::files() const {
  return file_ ? 1 : static_cast<int64_t>(folder_->fileNames().size());
}

}  // namespace shardema::detail
