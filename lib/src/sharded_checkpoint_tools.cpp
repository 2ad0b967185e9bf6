// Offline tools over a per-rank checkpoint folder: merge into deployable
// weights, reshard to another layout. Streaming: every read is a
// TensorFileReader::readRangeInto of at most bufferBytes into one reused
// buffer, every write a TensorFileWriter::append, so memory stays at about
// twice the buffer whatever the model size. The data is read twice: once to
// verify every tensor's checksum before anything is written, once to copy.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "deployable_writer.h"
#include "open_checkpoint.h"
#include "sharded_internal.h"
#include "shardema/averager.h"
#include "shardema/core/file_system.h"
#include "shardema/core/output_path.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/core/tensor_file_writer.h"
#include "shardema/detail/rank_manifest.h"
#include "shardema/sharded_checkpoint.h"

namespace shardema {
namespace {

using detail::OpenCheckpoint;
using detail::openCheckpoint;

// Appends elements [begin, begin + count) of `name` in `reader` to `writer`
// in pieces of at most buffer.numel(), converted to `dtype`.
// Writer: a rank file's TensorFileWriter, or an export's DeployableWriter.
template <typename Writer>
void copyRange(const TensorFileReader& reader, const std::string& name, int64_t begin,
               int64_t count, const at::Tensor& buffer, c10::ScalarType dtype, Writer& writer) {
  for (int64_t done = 0; done < count;) {
    const int64_t n = std::min(buffer.numel(), count - done);
    const at::Tensor piece = buffer.narrow(0, 0, n);
    reader.readRangeInto(name, begin + done, piece);
    writer.append(piece.scalar_type() == dtype ? piece : piece.to(dtype));
    done += n;
  }
}

at::Tensor pieceBuffer(int64_t maxElements, c10::ScalarType stored, const ExportOptions& options) {
  const int64_t perPiece = detail::elementsPerPiece(options.bufferBytes, stored);
  return at::empty({std::min(perPiece, maxElements)}, at::TensorOptions().dtype(stored));
}

void checkSameTensors(const shard::ShardLayout& source, const shard::ShardLayout& target) {
  TORCH_CHECK_VALUE(source.specs.size() == target.specs.size(), "reshardCheckpoint: the target ",
                    "layout has ", target.specs.size(), " tensors, the checkpoint ",
                    source.specs.size());
  for (size_t i = 0; i < source.specs.size(); ++i) {
    const shard::ShardSpec& a = source.specs[i];
    const shard::ShardSpec& b = target.specs[i];
    TORCH_CHECK_VALUE(a.name == b.name && a.globalShape == b.globalShape && a.dtype == b.dtype,
                      "reshardCheckpoint: target tensor ", i, " '", b.name,
                      "' differs in name, shape or dtype from the checkpoint's '", a.name, "'");
  }
}

RankFileRecord writeReshardedRank(const OpenCheckpoint& source, const shard::ShardLayout& target,
                                  int64_t rank, const std::string& outDir, uint64_t saveId,
                                  const ExportOptions& options) {
  const shard::ShardLayout& layout = source.manifest.layout;
  // Every profile's tensors, in the order Averager::state() writes them:
  // profile 0's, then each further profile's averaged ones.
  std::vector<std::pair<size_t, std::string>> stored;  // (spec, stored name)
  for (int p = 0; p < source.numProfiles(); ++p) {
    for (size_t i = 0; i < target.specs.size(); ++i) {
      if (p == 0 || source.averaged[i]) stored.emplace_back(i, source.storedName(i, p));
    }
  }
  std::vector<TensorFileEntry> entries;
  for (const auto& [i, storedName] : stored) {
    entries.push_back({storedName, source.dtypes[i], {target.specs[i].rangeOf(rank).size()}});
  }
  const std::string name = rankFileName(rank, source.manifest.step, saveId);
  TensorFileWriter writer(
      detail::joinPath(outDir, name), std::move(entries),
      detail::rankMetadata(source.readers.front().header().metadata, rank, target));
  for (const auto& [i, storedName] : stored) {
    const shard::ElementRange wanted = target.specs[i].rangeOf(rank);
    const at::Tensor buffer = pieceBuffer(wanted.size(), source.dtypes[i], options);
    for (int64_t q = 0; q < layout.worldSize(); ++q) {
      const shard::ElementRange old = layout.specs[i].rangeOf(q);
      const shard::ElementRange overlap = shard::intersect(wanted, old);
      if (overlap.empty()) continue;
      copyRange(source.readers[q], storedName, overlap.begin - old.begin, overlap.size(), buffer,
                source.dtypes[i], writer);
    }
  }
  writer.commit();
  return RankFileRecord{rank, name, writer.fileSize(), writer.checksum()};
}

// After a failed reshard: the rank files this call committed (the one in
// progress removed its own ".tmp"), and the folder if this call created it
// and it is now empty. An old checkpoint there is untouched: its files have
// other names. Best effort, like removeUnreferencedRankFiles.
void removeWrittenFiles(const std::string& outDir, const std::vector<RankFileRecord>& written,
                        bool createdOutDir) {
  for (const RankFileRecord& record : written) {
    detail::removePath(detail::joinPath(outDir, record.name));
  }
  if (createdOutDir) detail::removePath(outDir);  // only if empty
}

}  // namespace

int64_t maxReshardWorldSize(const shard::ShardLayout& layout) {
  int64_t largest = 1;
  for (const shard::ShardSpec& spec : layout.specs) largest = std::max(largest, spec.numel());
  return largest;
}

int64_t maxReshardWorldSize(const std::string& dir) {
  return maxReshardWorldSize(readManifest(dir).layout);
}

RankManifest inspectCheckpoint(const std::string& dir) {
  return openCheckpoint(dir, ExportOptions{}.bufferBytes).manifest;
}

std::vector<DecaySchedule> checkpointSchedules(const std::string& dir) {
  const RankManifest manifest = readManifest(dir);
  const TensorFileReader reader(detail::joinPath(dir, manifest.files.front().name));
  AveragerStateInfo info;
  try {
    info = checkAveragerStateMetadata(reader.header().metadata, "Averager state");
  } catch (const c10::ValueError& error) {
    TORCH_CHECK_VALUE(false, reader.path(), ": ", error.what_without_backtrace());
  }
  std::vector<DecaySchedule> schedules;
  for (const AveragerStateInfo::Profile& profile : info.profiles) {
    schedules.push_back(profile.schedule);
  }
  return schedules;
}

ExportSummary exportCheckpoint(const std::string& dir, const std::string& outFile,
                               ExportOptions options) {
  detail::checkExportDtype(options.outputDtype, "exportCheckpoint");
  TORCH_CHECK_VALUE(options.bufferBytes > 0, "exportCheckpoint: bufferBytes must be > 0, got ",
                    options.bufferBytes);
  TORCH_CHECK_VALUE(!options.maxShardBytes || *options.maxShardBytes >= 1,
                    "exportCheckpoint: maxShardBytes must be >= 1, got ",
                    options.maxShardBytes.value_or(0));
  TORCH_CHECK_INDEX(options.profile >= 0, "exportCheckpoint: profile ", options.profile,
                    " does not exist (profiles are numbered from 0)");
  detail::refuseOutputOverInput("exportCheckpoint", outFile, {dir});
  const OpenCheckpoint source = openCheckpoint(dir, options.bufferBytes);
  const int count = source.numProfiles();
  TORCH_CHECK_INDEX(options.profile < count, "exportCheckpoint: profile ", options.profile,
                    " does not exist; the checkpoint at ", dir, " holds ", count, " profile",
                    count == 1 ? " (0)" : "s (0 to " + std::to_string(count - 1) + ")");
  const shard::ShardLayout& layout = source.manifest.layout;
  // Each tensor under its name and then its aliases (a tied weight's other
  // state_dict keys), each copy read again from the rank files; not the
  // non-persistent ones, which no state_dict key holds.
  std::vector<TensorFileEntry> entries;
  std::vector<size_t> specOf;
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const shard::ShardSpec& spec = layout.specs[i];
    if (source.manifest.nonPersistent.count(spec.name)) continue;
    const auto aliases = source.manifest.aliases.find(spec.name);
    std::vector<std::string> names = {spec.name};
    if (aliases != source.manifest.aliases.end()) {
      names.insert(names.end(), aliases->second.begin(), aliases->second.end());
    }
    for (const std::string& name : names) {
      entries.push_back(
          {name, detail::exportedDtype(source.dtypes[i], options.outputDtype), spec.globalShape});
      specOf.push_back(i);
    }
  }
  detail::DeployableWriter writer(
      outFile, entries,
      detail::exportedMetadata(source.manifest.step, source.profiles[options.profile].schedule,
                               source.manifest.worldSize()),
      options.maxShardBytes, "exportCheckpoint");
  for (size_t e = 0; e < entries.size(); ++e) {
    const shard::ShardSpec& spec = layout.specs[specOf[e]];
    int64_t largest = 0;
    for (const shard::ElementRange& range : spec.ranges) largest = std::max(largest, range.size());
    const at::Tensor buffer = pieceBuffer(largest, source.dtypes[specOf[e]], options);
    for (int64_t r = 0; r < spec.worldSize(); ++r) {
      copyRange(source.readers[r], source.storedName(specOf[e], options.profile), 0,
                spec.rangeOf(r).size(), buffer, entries[e].dtype, writer);
    }
  }
  writer.commit();
  return ExportSummary{source.manifest.step, static_cast<int64_t>(entries.size()), writer.bytes(),
                       writer.files()};
}

ExportSummary reshardCheckpoint(const std::string& dir, const std::string& outDir,
                                const shard::ShardLayout& target, ExportOptions options) {
  constexpr const char* kApi = "reshardCheckpoint";
  TORCH_CHECK_VALUE(options.bufferBytes > 0, kApi, ": bufferBytes must be > 0, got ",
                    options.bufferBytes);
  target.check();
  TORCH_CHECK_VALUE(target.worldSize() >= 1, kApi, ": the target layout has no ranks");
  detail::refuseOutputOverInput(kApi, outDir, {dir});
  const OpenCheckpoint source = openCheckpoint(dir, options.bufferBytes);
  checkSameTensors(source.manifest.layout, target);
  const bool createdOutDir = !detail::pathExists(outDir);
  detail::ensureDirectory(outDir, kApi);
  const uint64_t saveId = newSaveId();
  RankManifest manifest = source.manifest;
  manifest.layout = target;
  manifest.files.clear();
  uint64_t bytes = 0;
  try {
    for (int64_t rank = 0; rank < target.worldSize(); ++rank) {
      manifest.files.push_back(writeReshardedRank(source, target, rank, outDir, saveId, options));
      bytes += manifest.files.back().size;
    }
    writeManifest(outDir, manifest);
  } catch (...) {
    removeWrittenFiles(outDir, manifest.files, createdOutDir);
    throw;
  }
  removeUnreferencedRankFiles(outDir, manifest);
  return ExportSummary{manifest.step, static_cast<int64_t>(target.specs.size()), bytes,
                       target.worldSize()};
}

ExportSummary reshardCheckpoint(const std::string& dir, const std::string& outDir,
                                int64_t newWorldSize, ExportOptions options) {
  const RankManifest manifest = readManifest(dir);
  const int64_t largest = maxReshardWorldSize(manifest.layout);
  TORCH_CHECK_VALUE(newWorldSize >= 1 && newWorldSize <= largest,
                    "reshardCheckpoint: newWorldSize must be in [1, ", largest,
                    "] (the largest tensor's element count in ", dir, "), got ", newWorldSize);
  return reshardCheckpoint(dir, outDir, shard::relayout(manifest.layout, newWorldSize), options);
}

}  // namespace shardema
