#pragma once
// TensorFolderWriter: writes tensors, piece by piece as TensorFileWriter
// does, into a folder laid out as Hugging Face's save_pretrained lays out a
// model's weights, so transformers' from_pretrained, huggingface_hub and
// safetensors read it: files of at most a chosen size,
// "model-00001-of-00003.safetensors", ..., and "model.safetensors.index.json"
// ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}); or one
// "model.safetensors" and no index when everything fits in one file. The
// tensors go into files as huggingface_hub's split_state_dict_into_shards
// puts them (its order and its rule for a tensor larger than the limit), so
// the same tensors give the same files.
//
// Crash-safe as a set: every file is written under "<name>.tmp" and only
// renamed once all of them are complete and fsynced; then the folder's old
// index (and an old "model.safetensors", which loaders would prefer to an
// index) is removed, the files renamed, and the index written last, so a
// folder never holds an index (or a lone model.safetensors) before every
// file it names is whole. A failure before commit() leaves the folder as it
// was. Files of an earlier export this one does not replace
// ("model-NNNNN-of-NNNNN.safetensors" of another count) are removed after
// the index. Nothing else in the folder is touched (a config.json stays).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardema/core/tensor_file_writer.h"

namespace shardema {

/// The file names of the layout (transformers' SAFE_WEIGHTS_NAME and
/// SAFE_WEIGHTS_INDEX_NAME).
constexpr const char* kModelWeightsFileName = "model.safetensors";
constexpr const char* kModelIndexFileName = "model.safetensors.index.json";

/// Which entries go into which file, in file order, for files of at most
/// `maxFileBytes` bytes of tensor data (headers not counted, as
/// huggingface_hub counts): entries in order fill the current file until the
/// next one would exceed the limit, which starts a new file; an entry larger
/// than the limit gets a file of its own, placed where it is met, and the
/// current file goes on after it. No entries: one empty file.
/// c10::ValueError when maxFileBytes < 1.
std::vector<std::vector<size_t>> splitTensorFiles(const std::vector<TensorFileEntry>& entries,
                                                  int64_t maxFileBytes);

/// "model.safetensors" for one file, else "model-{k:05d}-of-{n:05d}.safetensors"
/// (k from 1).
std::string tensorFolderFileName(size_t index, size_t count);

class TensorFolderWriter {
 public:
  /// Plans the files (splitTensorFiles), validates every entry as
  /// TensorFileWriter does and the names across files (unique), creates
  /// `folder` if missing, and refuses a `folder` that is a file
  /// (c10::ValueError naming it). The metadata goes into every file. Opens
  /// no file yet: each is created when its first tensor is reached, and
  /// finished (fsynced, closed, not renamed) when its last one is complete,
  /// so at most two are open at once. Blocks.
  TensorFolderWriter(std::string folder, std::vector<TensorFileEntry> entries,
                     std::map<std::string, std::string> metadata, int64_t maxFileBytes);
  /// Without commit(): every temp file is removed; the folder is as it was.
  ~TensorFolderWriter();
  TensorFolderWriter(const TensorFolderWriter&) = delete;
  TensorFolderWriter& operator=(const TensorFolderWriter&) = delete;

  /// As TensorFileWriter::append: the next elements of the current tensor
  /// (entries in the constructor's order), CPU, contiguous, of its dtype,
  /// never spanning two tensors. c10::ValueError naming the file and the
  /// tensor. Blocks.
  void append(const at::Tensor& piece);
  /// Checks every tensor is complete, then publishes the set (see the top
  /// of this file). Once only. Blocks.
  void commit();

  /// The files, in order (names inside the folder).
  std::vector<std::string> fileNames() const;
  /// Bytes of all files (headers included), once committed.
  uint64_t totalFileBytes() const { return totalFileBytes_; }
  /// Bytes of tensor data (the index's total_size).
  uint64_t totalTensorBytes() const { return totalTensorBytes_; }
  const std::string& folder() const { return folder_; }

 private:
  struct PlannedFile {
    std::string name;
    std::vector<size_t> entries;  // indices into entries_, in file order
    std::unique_ptr<TensorFileWriter> writer;
  };

  TensorFileWriter& writerOf(size_t entry);
  void skipCompleteEntries();
  void publish();
  std::string indexJson() const;

  std::string folder_;
  std::vector<TensorFileEntry> entries_;
  std::map<std::string, std::string> metadata_;
  std::vector<PlannedFile> files_;
  std::vector<size_t> fileOf_;     // entry -> file
  std::vector<size_t> lastEntry_;  // file -> its last entry
  std::vector<int64_t> numels_;
  size_t current_ = 0;
  int64_t writtenInCurrent_ = 0;
  uint64_t totalFileBytes_ = 0;
  uint64_t totalTensorBytes_ = 0;
  bool committed_ = false;
};

}  // namespace shardema
