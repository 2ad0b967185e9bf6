// Per-rank EMA state files of a ShardedAverager: writing one rank's file,
// saving all ranks of an in-process job (saveCheckpoint), and loading one
// rank's state (loadCheckpoint).
#include "shardema/sharded_checkpoint.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <system_error>
#include <unordered_map>

#include "sharded_internal.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/core/tensor_file_writer.h"
#include "shardema/detail/rank_manifest.h"
#include "shardema/sharded_averager.h"

namespace shardema {

namespace {

constexpr const char* kLoadApi = "loadCheckpoint";

// The tensors alone (names, order, shapes, dtypes), not how ranks split
// them: what resharding keeps.
shard::ShardLayout tensorsOnly(shard::ShardLayout layout) {
  for (shard::ShardSpec& spec : layout.specs) {
    spec.kind = shard::LayoutKind::kFsdp2;
    spec.ranges.clear();
  }
  return layout;
}

// Whether every rank holds the same elements of every tensor under both
// layouts, whatever they are called: at world size 1 every layout holds all
// of each tensor on the one rank (an FSDP2 checkpoint resharded to 1 rank is
// a single process's), and the replicated layout splits its EMA as FSDP2's
// rows. The rank files hold exactly those elements, so either loads.
bool sameElementsPerRank(const shard::ShardLayout& a, const shard::ShardLayout& b) {
  if (a.specs.size() != b.specs.size()) return false;
  for (size_t i = 0; i < a.specs.size(); ++i) {
    if (a.specs[i].ranges != b.specs[i].ranges) return false;
  }
  return true;
}

// Another world size can be resharded; another set of tensors (a load into
// another model) cannot, and the message names the first tensor that
// differs instead of comparing fingerprints.
void checkSameJob(const ShardedAverager& averager, const RankManifest& manifest,
                  const std::string& dir) {
  const shard::ShardLayout& here = averager.layout();
  if (manifest.layout.fingerprint() == here.fingerprint()) return;
  const std::string tensors =
      shard::layoutDifference(tensorsOnly(manifest.layout), tensorsOnly(here));
  const int64_t w = here.worldSize();
  TORCH_CHECK_VALUE(tensors.empty(), kLoadApi, ": the checkpoint at ", dir,
                    " is not of this model: ", tensors);
  if (manifest.worldSize() == w && sameElementsPerRank(manifest.layout, here)) return;
  TORCH_CHECK_VALUE(manifest.worldSize() == w, kLoadApi, ": the checkpoint at ", dir,
                    " was saved with layout ", manifest.layout.describe(),
                    " but this job has layout ", here.describe(),
                    "; reshard it first: shardema export --checkpoint ", dir, " --world-size ", w,
                    " --out NEW_DIR (reshardCheckpoint), then load NEW_DIR");
  TORCH_CHECK_VALUE(false, kLoadApi, ": the checkpoint at ", dir, " splits the tensors otherwise: ",
                    shard::layoutDifference(manifest.layout, here));
}

// `name` in `reader` must be `count` elements of `dtype` (the dtypes our EMA
// storage has: a silent conversion on load would hide a file written by
// something else).
void checkStored(const TensorFileReader& reader, const std::string& name, int64_t count,
                 c10::ScalarType dtype, int64_t rank) {
  const std::string& path = reader.path();
  TORCH_CHECK_VALUE(reader.contains(name), path, ": tensor '", name, "' of the layout is missing");
  TORCH_CHECK_VALUE(reader.entry(name).numel() == count, path, ": tensor '", name, "' has ",
                    reader.entry(name).numel(), " elements, rank ", rank, " owns ", count);
  TORCH_CHECK_VALUE(reader.scalarType(name) == dtype, path, ": tensor '", name, "' is stored as ",
                    reader.scalarType(name), " but the EMA keeps ", dtype);
}

// The rank file must hold exactly the layout's tensors with this rank's
// sizes. A per-rank tensor is loaded from rank 0's file (`rankZero`, set on
// the other ranks when the layout has one), as rank 0's copy stands for it:
// every rank resumes with rank 0's, as DDP's next forward would make the
// buffers themselves.
// Profiles beyond 0 (`profiles` saved, those this Averager keeps) hold
// the averaged tensors only; loadState then refuses another number of
// profiles or another schedule, naming them.
TensorFile readRankTensors(const TensorFileReader& reader, const TensorFileReader* rankZero,
                           const ShardedAverager& averager, int profiles) {
  const int64_t rank = averager.rank();
  TensorFile file;
  const int read = std::min(profiles, averager.averager().numProfiles());
  for (int p = 0; p < read; ++p) {
    for (const shard::ShardSpec& spec : averager.layout().specs) {
      if (p > 0 && !isAveragingRole(averager.averager().role(spec.name))) continue;
      const std::string stored = profileTensorName(spec.name, p);
      // The EMA's dtype and shape without waiting: a failed Averager is
      // loaded into too (that is how it recovers).
      const auto [emaDtype, emaShape] = averager.averager().emaDtypeAndShape(spec.name);
      checkStored(reader, stored, spec.rangeOf(rank).size(), emaDtype, rank);
      const TensorFileReader* source = &reader;
      if (spec.kind == shard::LayoutKind::kPerRank && rank != 0) {
        TORCH_INTERNAL_ASSERT(rankZero != nullptr);
        source = rankZero;
        checkStored(*source, stored, spec.numel(), emaDtype, 0);
      }
      // read() checks the tensor's own checksum (the only check of rank 0's
      // file made here: see openRankZero).
      file.tensors.emplace_back(stored, source->read(stored).reshape(emaShape));
    }
  }
  file.metadata = reader.header().metadata;
  return file;
}

// Rank 0's file, on another rank whose layout has per-rank tensors (null
// otherwise). Its tensors are read one by one, each against its own
// checksum, which our files always carry (required here), instead of
// hashing all of rank 0's file on every rank; its metadata must name rank
// 0 of this checkpoint.
std::unique_ptr<TensorFileReader> openRankZero(const std::string& dir, const RankManifest& manifest,
                                               const ShardedAverager& averager) {
  bool perRank = false;
  for (const shard::ShardSpec& spec : averager.layout().specs) {
    perRank = perRank || spec.kind == shard::LayoutKind::kPerRank;
  }
  if (!perRank || averager.rank() == 0) return nullptr;
  auto reader = std::make_unique<TensorFileReader>(detail::joinPath(dir, manifest.files[0].name));
  TORCH_CHECK_VALUE(reader->hasChecksums(), reader->path(),
                    ": rank 0's file carries no tensor checksums (shardema.xxh64), which a load "
                    "of its per_rank tensors on rank ",
                    averager.rank(), " checks");
  detail::checkRankMetadata(reader->path(), reader->header().metadata, 0, manifest.worldSize(),
                            manifest.layout.fingerprint(), manifest.step);
  return reader;
}

// `profiles`: as the file's metadata records them (shardema.profiles).
void checkNoUnknownTensors(const TensorFileReader& reader, const shard::ShardLayout& layout,
                           int profiles) {
  for (const std::string& stored : reader.names()) {
    std::string name;
    const int profile = profileOfStoredName(stored, &name);
    bool known = profile >= 0 && profile < profiles;
    if (known) {
      known = false;
      for (const shard::ShardSpec& spec : layout.specs) known = known || spec.name == name;
    }
    TORCH_CHECK_VALUE(known, reader.path(), ": tensor '", stored,
                      "' is not in the checkpoint's layout",
                      profile != 0 ? " (or of a profile the file does not record)" : "");
  }
}

}  // namespace

RankFileRecord writeRankFile(const std::string& dir, const ShardedAverager& averager) {
  return writeRankFile(dir, averager, rankFileName(averager.rank(), averager.step(), newSaveId()));
}

RankFileRecord writeRankFile(const std::string& dir, const ShardedAverager& averager,
                             const std::string& name) {
  TORCH_CHECK_VALUE(isRankFileName(name, averager.rank()), "writeRankFile: '", name,
                    "' is not a rank file name of rank ", averager.rank());
  for (const LocalShard& shard : averager.shards()) {
    // The file would call rows of dim 0 what is a piece along another dim.
    TORCH_CHECK_VALUE(shard.splitDim == 0, "writeRankFile: tensor '", shard.spec.name,
                      "' is split along dim ", shard.splitDim,
                      " (LocalShard::splitDim); a per-rank checkpoint describes each rank's part "
                      "as rows of dim 0 and cannot hold it");
  }
  detail::ensureDirectory(dir, "writeRankFile");
  const TensorFile state = averager.averager().state();
  // Each tensor's range of this rank (rangeOf): a per-rank tensor is in
  // rank 0's file alone, as rank 0's copy stands for it. Every profile's
  // tensor (profileTensorName) is cut as its tensor's spec says.
  const shard::ShardLayout& layout = averager.layout();
  std::unordered_map<std::string, size_t> specIndex;
  for (size_t i = 0; i < layout.specs.size(); ++i) specIndex.emplace(layout.specs[i].name, i);
  std::vector<const shard::ShardSpec*> specOf;
  std::vector<TensorFileEntry> entries;
  for (const auto& [stored, ema] : state.tensors) {
    std::string tensorName;
    TORCH_INTERNAL_ASSERT(profileOfStoredName(stored, &tensorName) >= 0);
    const shard::ShardSpec& spec = layout.specs.at(specIndex.at(tensorName));
    specOf.push_back(&spec);
    entries.push_back({stored, ema.scalar_type(), {spec.rangeOf(averager.rank()).size()}});
  }
  TensorFileWriter writer(detail::joinPath(dir, name), std::move(entries),
                          detail::rankMetadata(state.metadata, averager.rank(), averager.layout()));
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    const at::Tensor& ema = state.tensors[i].second;
    const at::Tensor flat = (ema.is_cpu() ? ema : ema.to(c10::Device(c10::kCPU))).reshape({-1});
    writer.append(detail::rangeOfHeld(*specOf[i], averager.rank(), flat).contiguous());
  }
  writer.commit();
  return RankFileRecord{averager.rank(), name, writer.fileSize(), writer.checksum()};
}

RankManifest manifestFor(const ShardedAverager& averager) {
  RankManifest manifest;
  manifest.step = averager.step();
  manifest.schedule = averager.averager().schedule();
  manifest.layout = averager.layout();
  manifest.aliases = averager.aliases();
  manifest.nonPersistent = averager.nonPersistent();
  return manifest;
}

void saveCheckpoint(const std::string& dir, const std::vector<const ShardedAverager*>& averagers) {
  constexpr const char* kApi = "saveCheckpoint";
  TORCH_CHECK_VALUE(!averagers.empty(), kApi, ": no averagers given");
  const std::string fingerprint = averagers.front()->layout().fingerprint();
  for (size_t r = 0; r < averagers.size(); ++r) {
    const ShardedAverager& a = *averagers[r];
    TORCH_CHECK_VALUE(a.rank() == static_cast<int64_t>(r) &&
                          a.worldSize() == static_cast<int64_t>(averagers.size()) &&
                          a.layout().fingerprint() == fingerprint &&
                          a.step() == averagers.front()->step(),
                      kApi, ": averagers[", r, "] is rank ", a.rank(), " of ", a.worldSize(),
                      " at step ", a.step(), " with layout ", a.layout().describe(),
                      "; expected rank ", r, " of ", averagers.size(), " of one job and one step");
  }
  detail::ensureDirectory(dir, kApi);
  // New names for this save; the old manifest and its files stay until the
  // rename of the new manifest commits it.
  const uint64_t saveId = newSaveId();
  RankManifest manifest = manifestFor(*averagers.front());
  for (const ShardedAverager* a : averagers) {
    manifest.files.push_back(
        writeRankFile(dir, *a, rankFileName(a->rank(), manifest.step, saveId)));
  }
  writeManifest(dir, manifest);
  removeUnreferencedRankFiles(dir, manifest);
}

void loadCheckpoint(const std::string& dir, ShardedAverager& averager) {
  const RankManifest manifest = readManifest(dir);
  checkSameJob(averager, manifest, dir);
  const RankFileRecord& record = manifest.files.at(static_cast<size_t>(averager.rank()));
  // The checksum is verified by path and the file then opened again. Safe
  // against shardema's own saves: they never rewrite a file a committed
  // manifest names (each save writes new names) and delete only files the
  // newest manifest does not name; only an outside writer could swap it.
  verifyRankFile(dir, record);
  const TensorFileReader reader(detail::joinPath(dir, record.name));
  detail::checkRankMetadata(reader.path(), reader.header().metadata, averager.rank(),
                            manifest.worldSize(), manifest.layout.fingerprint(), manifest.step);
  // Before any tensor is read, in the words inspect and export use for the
  // same file (loadState makes the same check again).
  AveragerStateInfo saved;
  try {
    saved = checkAveragerStateMetadata(reader.header().metadata, "Averager state");
  } catch (const c10::ValueError& error) {
    TORCH_CHECK_VALUE(false, reader.path(), ": ", error.what_without_backtrace());
  }
  const int profiles = static_cast<int>(saved.profiles.size());
  checkNoUnknownTensors(reader, averager.layout(), profiles);
  const std::unique_ptr<TensorFileReader> rankZero = openRankZero(dir, manifest, averager);
  const TensorFile state = readRankTensors(reader, rankZero.get(), averager, profiles);
  try {
    averager.averager().loadState(state, LoadStrictness::kStrict);
  } catch (const c10::ValueError& error) {
    // loadState sees tensors, not files: name the file its complaint is about.
    TORCH_CHECK_VALUE(false, reader.path(), ": ", error.what_without_backtrace());
    throw;  // not reached
  }
}

}  // namespace shardema
