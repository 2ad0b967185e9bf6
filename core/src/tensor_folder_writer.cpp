#include "shardema/core/tensor_folder_writer.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "shardema/core/atomic_file.h"
#include "shardema/core/file_system.h"
#include "tensor_file_io.h"

namespace shardema {
namespace {

// The file names' counters have five digits (transformers' and
// huggingface_hub's pattern, and their cleanup regex).
constexpr size_t kMostFiles = 99999;

std::string joined(const std::string& folder, const std::string& name) {
  return folder.empty() || folder.back() == '/' ? folder + name : folder + "/" + name;
}

uint64_t entryBytes(const TensorFileEntry& entry) {
  int64_t numel = 1;
  for (int64_t dim : entry.shape) numel *= dim;
  return static_cast<uint64_t>(numel) * c10::elementSize(entry.dtype);
}

int64_t entryNumel(const TensorFileEntry& entry) {
  int64_t numel = 1;
  for (int64_t dim : entry.shape) numel *= dim;
  return numel;
}

// "model-NNNNN-of-NNNNN.safetensors": a file of some export's set, which
// one of another count would leave behind (transformers removes them too).
bool isSetFileName(const std::string& name) {
  constexpr const char* kPattern = "model-#####-of-#####.safetensors";
  const std::string pattern = kPattern;
  if (name.size() != pattern.size()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const bool digit = name[i] >= '0' && name[i] <= '9';
    if (pattern[i] == '#' ? !digit : name[i] != pattern[i]) return false;
  }
  return true;
}

void removeRegularFile(const std::string& path) {
  if (detail::isRegularFile(path)) {
    TORCH_CHECK(detail::removePath(path), path, ": cannot remove the previous export's file");
  }
}

// The header checks TensorFileWriter makes when it opens a file, made for
// every file before any is written, so bad input writes nothing.
void checkFileHeader(const std::string& path, const std::vector<TensorFileEntry>& entries,
                     const std::vector<size_t>& chosen,
                     const std::map<std::string, std::string>& metadata) {
  std::vector<TensorEntry> header;
  for (size_t i : chosen) {
    TensorEntry entry;
    entry.name = entries[i].name;
    entry.dtype = detail::toFileDType(entries[i].dtype, path, entries[i].name);
    entry.shape = entries[i].shape;
    header.push_back(std::move(entry));
  }
  buildSafetensorsHeader(header, detail::metadataWithFormat(path, metadata), path);
}

}  // namespace

std::vector<std::vector<size_t>> splitTensorFiles(const std::vector<TensorFileEntry>& entries,
                                                  int64_t maxFileBytes) {
  TORCH_CHECK_VALUE(maxFileBytes >= 1, "splitTensorFiles: maxFileBytes must be >= 1, got ",
                    maxFileBytes);
  const auto limit = static_cast<uint64_t>(maxFileBytes);
  std::vector<std::vector<size_t>> files;
  std::vector<size_t> current;
  uint64_t currentBytes = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const uint64_t bytes = entryBytes(entries[i]);
    if (bytes > limit) {
      files.push_back({i});
      continue;
    }
    if (currentBytes + bytes > limit) {
      files.push_back(std::move(current));
      current.clear();
      currentBytes = 0;
    }
    current.push_back(i);
    currentBytes += bytes;
  }
  if (!current.empty() || files.empty()) files.push_back(std::move(current));
  return files;
}

std::string tensorFolderFileName(size_t index, size_t count) {
  if (count == 1) return kModelWeightsFileName;
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

TensorFolderWriter::TensorFolderWriter(std::string folder, std::vector<TensorFileEntry> entries,
                                       std::map<std::string, std::string> metadata,
                                       int64_t maxFileBytes)
    : folder_(std::move(folder)), entries_(std::move(entries)), metadata_(std::move(metadata)) {
  TORCH_CHECK_VALUE(!folder_.empty(), "TensorFolderWriter: empty folder name");
  TORCH_CHECK_VALUE(!detail::pathExists(folder_) || detail::isDirectory(folder_), folder_,
                    " exists and is not a folder; a split export writes a folder of files");
  const std::vector<std::vector<size_t>> split = splitTensorFiles(entries_, maxFileBytes);
  TORCH_CHECK_VALUE(split.size() <= kMostFiles, folder_, ": ", split.size(),
                    " files of at most ", maxFileBytes, " bytes would be needed, more than the ",
                    kMostFiles, " the file names can count; choose a larger size");
  std::set<std::string> names;
  fileOf_.resize(entries_.size());
  for (size_t f = 0; f < split.size(); ++f) {
    PlannedFile file;
    file.name = tensorFolderFileName(f, split.size());
    file.entries = split[f];
    checkFileHeader(joined(folder_, file.name), entries_, file.entries, metadata_);
    for (size_t i : file.entries) {
      fileOf_[i] = f;
      TORCH_CHECK_VALUE(names.insert(entries_[i].name).second, folder_, ": tensor '",
                        entries_[i].name, "' is given twice");
    }
    lastEntry_.push_back(file.entries.empty() ? 0 : file.entries.back());
    files_.push_back(std::move(file));
  }
  for (const TensorFileEntry& entry : entries_) {
    numels_.push_back(entryNumel(entry));
    totalTensorBytes_ += entryBytes(entry);
  }
  std::string error;
  TORCH_CHECK(detail::createDirectories(folder_, &error), folder_,
              ": cannot create the folder (", error, ")");
  skipCompleteEntries();
}

TensorFolderWriter::~TensorFolderWriter() = default;

TensorFileWriter& TensorFolderWriter::writerOf(size_t entry) {
  PlannedFile& file = files_[fileOf_[entry]];
  if (!file.writer) {
    std::vector<TensorFileEntry> chosen;
    for (size_t i : file.entries) chosen.push_back(entries_[i]);
    file.writer = std::make_unique<TensorFileWriter>(joined(folder_, file.name), std::move(chosen),
                                                     metadata_);
  }
  return *file.writer;
}

// A file is created when its first tensor is reached (an empty one too: it
// has a header) and finished when its last one is complete, so only the
// file being filled and one larger than the limit are open at a time.
void TensorFolderWriter::skipCompleteEntries() {
  while (current_ < entries_.size() && writtenInCurrent_ == numels_[current_]) {
    TensorFileWriter& writer = writerOf(current_);
    if (lastEntry_[fileOf_[current_]] == current_) writer.finish();
    ++current_;
    writtenInCurrent_ = 0;
  }
}

void TensorFolderWriter::append(const at::Tensor& piece) {
  TORCH_CHECK(!committed_, folder_, ": TensorFolderWriter::append after commit");
  TORCH_CHECK_VALUE(piece.defined(), folder_, ": TensorFolderWriter::append: undefined piece");
  if (piece.numel() == 0) return;
  TORCH_CHECK_VALUE(current_ < entries_.size(), folder_,
                    ": TensorFolderWriter::append: every tensor is complete, but a piece of ",
                    piece.numel(), " elements was given");
  // The file's writer checks the piece (dtype, layout, size) before it
  // writes anything.
  writerOf(current_).append(piece);
  writtenInCurrent_ += piece.numel();
  skipCompleteEntries();
}

std::vector<std::string> TensorFolderWriter::fileNames() const {
  std::vector<std::string> names;
  for (const PlannedFile& file : files_) names.push_back(file.name);
  return names;
}

std::string TensorFolderWriter::indexJson() const {
  nlohmann::json weightMap = nlohmann::json::object();
  for (size_t i = 0; i < entries_.size(); ++i) {
    weightMap[entries_[i].name] = files_[fileOf_[i]].name;
  }
  nlohmann::json index = {{"metadata", {{"total_size", totalTensorBytes_}}},
                          {"weight_map", weightMap}};
  // transformers' own spelling: two-space indent, sorted keys (nlohmann's
  // objects are sorted), a final newline.
  return index.dump(2) + "\n";
}

void TensorFolderWriter::commit() {
  TORCH_CHECK(!committed_, folder_, ": TensorFolderWriter::commit called twice");
  TORCH_CHECK_VALUE(current_ == entries_.size(), folder_,
                    ": TensorFolderWriter::commit: tensor '",
                    current_ < entries_.size() ? entries_[current_].name : std::string(),
                    "' has ", writtenInCurrent_, " of its ",
                    current_ < entries_.size() ? numels_[current_] : 0, " elements");
  // Only a set without tensors has a file never reached.
  for (PlannedFile& file : files_) {
    if (!file.writer) {
      file.writer = std::make_unique<TensorFileWriter>(joined(folder_, file.name),
                                                       std::vector<TensorFileEntry>{}, metadata_);
      file.writer->finish();
    }
  }
  publish();
  committed_ = true;
}

void TensorFolderWriter::publish() {
  const bool split = files_.size() > 1;
  // Nothing that says "complete" may stand beside the set while it is
  // renamed in: an old index naming files of the same count, or an old
  // model.safetensors, which loaders take before an index.
  removeRegularFile(joined(folder_, kModelIndexFileName));
  if (split) removeRegularFile(joined(folder_, kModelWeightsFileName));
  syncFolder(folder_);
  for (PlannedFile& file : files_) {
    file.writer->commit();
    totalFileBytes_ += file.writer->fileSize();
  }
  if (split) {
    const std::string index = indexJson();
    writeFileAtomically(joined(folder_, kModelIndexFileName), index.data(), index.size());
  }
  const std::vector<std::string> ours = fileNames();
  const std::set<std::string> kept(ours.begin(), ours.end());
  bool removed = false;
  for (const std::string& name : detail::directoryNames(folder_, nullptr)) {
    if (isSetFileName(name) && kept.count(name) == 0) {
      // Best effort: a stale file no index names misleads no loader.
      removed = detail::removePath(joined(folder_, name)) || removed;
    }
  }
  if (removed) syncFolder(folder_);
}

}  // namespace shardema
