#pragma once
// DeployableWriter: where an export's deployable weights go, streamed
// tensor by tensor: one safetensors file (TensorFileWriter), or, given a
// file size limit, a folder in Hugging Face's layout (TensorFolderWriter:
// model-00001-of-0000N.safetensors files and model.safetensors.index.json,
// or one model.safetensors). One object for the exports that write either
// (ShardedAverager::exportWeights, exportCheckpoint). Not installed.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardema/core/tensor_file_writer.h"
#include "shardema/core/tensor_folder_writer.h"

namespace shardema::detail {

class DeployableWriter {
 public:
  /// `path`: the file, or with `maxFileBytes` the folder (created if
  /// missing). A folder path that ends in ".safetensors" is refused
  /// (c10::ValueError naming it and `api`): it is almost surely a file name
  /// given to a split export. Crash-safe as each writer is. Blocks.
  DeployableWriter(const std::string& path, std::vector<TensorFileEntry> entries,
                   const std::map<std::string, std::string>& metadata,
                   std::optional<int64_t> maxFileBytes, const char* api);
  ~DeployableWriter();
  DeployableWriter(const DeployableWriter&) = delete;
  DeployableWriter& operator=(const DeployableWriter&) = delete;

  /// The next elements of the current tensor (TensorFileWriter::append).
  void append(const at::Tensor& piece);
  /// Publishes the file or the folder's set. Once only.
  void commit();
  /// Bytes written (all files, headers included); after commit().
  uint64_t bytes() const;
  /// Files written: 1, or the folder's set.
  int64_t files() const;

 private:
  std::unique_ptr<TensorFileWriter> file_;
  std::unique_ptr<TensorFolderWriter> folder_;
};

}  // namespace shardema::detail
