#include "inspect_command.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "flag_parser.h"
#include "folder_kind.h"
#include "shardema/averager.h"
#include "shardema/core/checksum.h"
#include "shardema/core/file_metadata.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/sharded_checkpoint.h"
#include "snapshot_folder_listing.h"

namespace shardema::cli {
namespace {

std::string shapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Kinds of file shardema writes (docs/files.md); a rank file of a
// checkpoint folder is an averager_state too.
bool isKnownKind(const std::string& kind) {
  for (const char* known : {detail::kAveragerStateKind, detail::kDeployableKind,
                            detail::kPostHocSnapshotKind, detail::kTrainingCheckpointKind}) {
    if (kind == known) return true;
  }
  return false;
}

// Whether a file is checked as an Averager state: its kind says so, or it
// carries shardema.last_decay / shardema.initialized, which only an Averager
// state has, under another kind or none (an edited kind). A training
// checkpoint is left alone: its trainer may add keys of its own.
bool claimsAveragerState(const std::map<std::string, std::string>& metadata,
                         const std::string& kind) {
  if (kind == detail::kAveragerStateKind) return true;
  return kind != detail::kTrainingCheckpointKind &&
         (metadata.count(detail::kLastDecayKey) || metadata.count(detail::kInitializedKey));
}

// An Averager state gets the checks Averager::load makes of its metadata
// (checkAveragerStateMetadata), so inspect passes no state that loading
// refuses; an unknown kind is an edited or foreign file. Other files
// without shardema.kind come from other tools and have nothing to check.
void checkKindMetadata(const TensorFileReader& reader) {
  const auto& metadata = reader.header().metadata;
  const auto found = metadata.find(detail::kKindKey);
  const std::string kind = found == metadata.end() ? "" : found->second;
  if (claimsAveragerState(metadata, kind)) {
    try {
      checkAveragerStateMetadata(metadata, "Averager state");
    } catch (const c10::Error& error) {
      throw UsageError(reader.path() + ": " + error.what_without_backtrace());
    }
    return;
  }
  if (found != metadata.end() && !isKnownKind(kind)) {
    throw UsageError(reader.path() + ": " + detail::kKindKey + " is '" + kind +
                     "', not a kind shardema writes");
  }
}

void printFile(const std::string& path, std::ostream& out) {
  const TensorFileReader reader(path);
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    throw UsageError(path + ": cannot stat (" + std::strerror(errno) + ")");
  }
  reader.verifyChecksums();
  checkKindMetadata(reader);
  out << "file " << path << ": " << reader.header().tensors.size() << " tensors, " << info.st_size
      << " bytes, xxh64 " << checksumHex(fileChecksum(path)) << ", tensor checksums "
      << (reader.hasChecksums() ? "ok" : "absent (not written by shardema)") << '\n';
  for (const auto& [key, value] : reader.header().metadata) {
    out << "  metadata " << key << " = " << value << '\n';
  }
  for (const TensorEntry& entry : reader.header().tensors) {
    out << "  tensor " << entry.name << ' ' << fileDTypeName(entry.dtype) << ' '
        << shapeText(entry.shape) << '\n';
  }
}

void printCheckpoint(const std::string& dir, std::ostream& out) {
  const RankManifest manifest = inspectCheckpoint(dir);
  out << "checkpoint " << dir << ": step " << manifest.step << ", world size "
      << manifest.worldSize() << ", " << manifest.layout.specs.size() << " tensors, layout "
      << manifest.layout.describe() << '\n';
  out << "  schedule " << manifest.schedule.describe() << '\n';
  const std::vector<DecaySchedule> schedules = checkpointSchedules(dir);
  if (schedules.size() > 1) {
    // EMA(schedules=[...]): `export --profile P` writes profile P's weights.
    out << "  " << schedules.size() << " EMA profiles (export --profile P):\n";
    for (size_t p = 0; p < schedules.size(); ++p) {
      out << "  profile " << p << " schedule " << schedules[p].describe() << '\n';
    }
  }
  for (const RankFileRecord& record : manifest.files) {
    out << "  rank " << record.rank << ' ' << record.name << ' ' << record.size << " bytes, xxh64 "
        << checksumHex(record.checksum) << " ok\n";
  }
  for (const shard::ShardSpec& spec : manifest.layout.specs) {
    out << "  tensor " << spec.name << ' ' << shard::layoutKindName(spec.kind) << ' '
        << c10::toString(spec.dtype) << ' ' << shapeText(spec.globalShape) << " ranges";
    for (const shard::ElementRange& range : spec.ranges) {
      out << " [" << range.begin << ", " << range.end << ")";
    }
    const auto aliases = manifest.aliases.find(spec.name);
    if (aliases != manifest.aliases.end()) {
      out << " also";
      for (const std::string& alias : aliases->second) out << ' ' << alias;
    }
    if (manifest.nonPersistent.count(spec.name)) out << " non-persistent (not exported)";
    out << '\n';
  }
}

int inspect(const std::string& path, std::ostream& out) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    // Say what stat found: a symlink loop or a folder we may not enter is
    // not a missing path.
    const int error = errno;
    throw UsageError(path + ": " +
                     (error == ENOENT ? std::string("no such file or folder")
                      : error == ELOOP
                          ? std::string("a loop of symbolic links (") + std::strerror(error) + ")"
                          : std::string("cannot stat (") + std::strerror(error) + ")"));
  }
  if (S_ISDIR(info.st_mode)) {
    switch (folderKind(path)) {
      case FolderKind::kDcpCheckpoint:
        throw UsageError(dcpFolderRefusal(path));
      case FolderKind::kPostHocSnapshots:
        printSnapshotFolder(path, out);
        break;
      case FolderKind::kRankCheckpoint:
      case FolderKind::kUnknown:
        printCheckpoint(path, out);
        break;
    }
  } else {
    printFile(path, out);
  }
  return 0;
}

}  // namespace

void printInspectUsage(std::ostream& out) {
  out << "usage: shardema inspect FILE|DIR\n\n"
         "Validates a safetensors file (header, sizes, every tensor's checksum, and for an\n"
         "Averager state the metadata Averager::load checks) and lists its metadata and\n"
         "tensors with its XXH64; or validates a per-rank checkpoint folder: the manifest,\n"
         "every rank file's size, XXH64, metadata and tensors against it, every tensor's\n"
         "checksum, and lists the layout and its EMA profiles; or a post-hoc snapshot\n"
         "folder as synthesize reads it, listing its profiles, steps, files and tensors;\n"
         "or, from the Python package's shardema, the EMA of a torch.distributed.checkpoint\n"
         "(DCP) folder.\n";
}

int runInspectCommand(const std::vector<std::string>& args, std::ostream& out) {
  std::vector<std::string> paths;
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      printInspectUsage(out);
      return 0;
    }
    if (arg.rfind("--", 0) == 0)
      throw UsageError("unknown flag " + arg + " (inspect takes a path)");
    paths.push_back(arg);
  }
  if (paths.size() != 1) {
    throw UsageError("takes exactly one FILE or DIR, got " + std::to_string(paths.size()));
  }
  try {
    return inspect(paths.front(), out);
  } catch (const c10::Error& error) {
    throw UsageError(error.what_without_backtrace());
  }
}

}  // namespace shardema::cli
