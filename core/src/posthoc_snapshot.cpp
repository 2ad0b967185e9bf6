// Post-hoc snapshot files: names, metadata (shardema.split_dims's JSON
// included), writes, and the strict scan of a folder. Just over the ~400-
// line guideline: what a file says and what a folder holds are checked by
// the same rules, kept together.
#include "shardema/core/posthoc_snapshot.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "shardema/core/file_metadata.h"
#include "shardema/core/file_system.h"
#include "shardema/core/power_function.h"
#include "shardema/core/tensor_file.h"

namespace shardema {
namespace {

constexpr const char* kSuffix = ".safetensors";
constexpr const char* kRankPrefix = "rank_";
using detail::formatDecimal17;
using detail::kGammaKey;
using detail::kKindKey;
using detail::kLayoutKey;
using detail::kProfileIndexKey;
using detail::kRankKey;
using detail::kSigmaRelKey;
using detail::kSplitDimsKey;
using detail::kStepKey;
using detail::kWorldSizeKey;
constexpr const char* kKind = detail::kPostHocSnapshotKind;

bool endsWith(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Leading zeros are refused so that a name maps back to one (i, step).
bool parseDigits(const std::string& text, int64_t* value) {
  return detail::parseDecimalDigits(text, value);
}

const std::string& requireKey(const std::map<std::string, std::string>& metadata,
                              const std::string& path, const char* key) {
  auto found = metadata.find(key);
  TORCH_CHECK_VALUE(found != metadata.end(), path, ": posthoc snapshot metadata lacks ", key,
                    "; the file was not written by writeSnapshot");
  return found->second;
}

int64_t parseIntKey(const std::map<std::string, std::string>& metadata, const std::string& path,
                    const char* key) {
  const std::string& text = requireKey(metadata, path, key);
  int64_t value = 0;
  TORCH_CHECK_VALUE(parseDigits(text, &value), path, ": metadata ", key,
                    " must be a non-negative decimal integer, got \"", text, "\"");
  return value;
}

double parseDoubleKey(const std::map<std::string, std::string>& metadata, const std::string& path,
                      const char* key) {
  const std::string& text = requireKey(metadata, path, key);
  double value = 0.0;
  TORCH_CHECK_VALUE(detail::parseFiniteDecimal(text, &value), path, ": metadata ", key,
                    " must be a finite decimal number, got \"", text, "\"");
  return value;
}

void validateInfo(const SnapshotInfo& info, const std::string& path) {
  TORCH_CHECK_VALUE(info.step >= 1, "writeSnapshot(", path, "): step must be >= 1, got ",
                    info.step);
  TORCH_CHECK_VALUE(info.profileIndex >= 0, "writeSnapshot(", path,
                    "): profileIndex must be >= 0, got ", info.profileIndex);
  TORCH_CHECK_VALUE(std::isfinite(info.gamma) && info.gamma > 0, "writeSnapshot(", path,
                    "): gamma must be finite and > 0, got ", info.gamma);
  const double expected = gammaToSigmaRel(info.gamma);
  TORCH_CHECK_VALUE(std::abs(expected - info.sigmaRel) <= 1e-9 * expected, "writeSnapshot(", path,
                    "): sigmaRel ", formatDecimal17(info.sigmaRel), " disagrees with gamma ",
                    formatDecimal17(info.gamma), " (gammaToSigmaRel gives ",
                    formatDecimal17(expected), "); pass both from one profile");
  if (info.rank < 0) {
    TORCH_CHECK_VALUE(info.rank == -1, "writeSnapshot(", path,
                      "): rank must be -1 (full-copy layout) or >= 0, got ", info.rank);
    TORCH_CHECK_VALUE(info.worldSize == 0 && info.layoutJson.empty() && info.splitDims.empty(),
                      "writeSnapshot(", path,
                      "): a full-copy snapshot (rank -1) must have worldSize 0, an empty "
                      "layoutJson and no splitDims, got worldSize ",
                      info.worldSize);
  } else {
    TORCH_CHECK_VALUE(info.worldSize >= 1 && info.rank < info.worldSize, "writeSnapshot(", path,
                      "): a sharded snapshot needs 0 <= rank < worldSize, got rank ", info.rank,
                      " and worldSize ", info.worldSize);
    TORCH_CHECK_VALUE(!info.layoutJson.empty(), "writeSnapshot(", path,
                      "): a sharded snapshot (rank ", info.rank, ") needs a non-empty layoutJson");
  }
  for (const auto& [name, dim] : info.splitDims) {
    TORCH_CHECK_VALUE(dim >= 1, "writeSnapshot(", path, "): splitDims of tensor '", name,
                      "' must be >= 1, got ", dim);
  }
}

// {"name": d, ...}: the JSON of SnapshotInfo::splitDims (names in order).
std::string splitDimsJson(const std::map<std::string, int64_t>& splitDims) {
  nlohmann::ordered_json object = nlohmann::ordered_json::object();
  for (const auto& [name, dim] : splitDims) object[name] = dim;
  try {
    return object.dump();
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK_VALUE(false,
                      "writeSnapshot: a split tensor's name is not valid UTF-8: ", error.what());
  }
}

std::map<std::string, int64_t> parseSplitDims(const std::string& text, const std::string& path) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK_VALUE(false, path, ": metadata ", kSplitDimsKey,
                      " is not valid JSON: ", error.what());
  }
  TORCH_CHECK_VALUE(object.is_object() && !object.empty(), path, ": metadata ", kSplitDimsKey,
                    " must be a non-empty JSON object {\"tensor name\": dim}, got ", text);
  std::map<std::string, int64_t> out;
  for (const auto& item : object.items()) {
    const bool valid = item.value().is_number_integer() && item.value().get<int64_t>() >= 1;
    TORCH_CHECK_VALUE(valid, path, ": metadata ", kSplitDimsKey, " gives tensor '", item.key(),
                      "' the dim ", item.value().dump(), "; a split dim is an integer >= 1");
    out[item.key()] = item.value().get<int64_t>();
  }
  return out;
}

// "rank_NNNNN" exactly as rankFolderName spells it; other folders are not ours.
bool parseRankFolderName(const std::string& name, int64_t* rank) {
  if (name.rfind(kRankPrefix, 0) != 0) return false;
  const std::string digits = name.substr(std::string(kRankPrefix).size());
  const size_t first = digits.find_first_not_of('0');
  const std::string trimmed = first == std::string::npos ? "0" : digits.substr(first);
  int64_t value = 0;
  if (!parseDigits(trimmed, &value) || rankFolderName(value) != name) return false;
  *rank = value;
  return true;
}

bool entryBefore(const SnapshotEntry& a, const SnapshotEntry& b) {
  return std::tie(a.info.step, a.info.profileIndex) < std::tie(b.info.step, b.info.profileIndex);
}

// The entries of `folder`, sorted; a folder that cannot be read is an error.
std::vector<std::string> folderNames(const std::string& folder) {
  std::string error;
  std::vector<std::string> names = detail::directoryNames(folder, &error);
  TORCH_CHECK_VALUE(error.empty(), folder, ": cannot read the snapshot folder: ", error);
  return names;
}

std::string joinedPath(const std::string& folder, const std::string& name) {
  return folder.empty() || folder.back() == '/' ? folder + name : folder + "/" + name;
}

// Reads every "*.safetensors" directly in `folder`, sorted; "*.tmp" and other
// files are left alone (an interrupted write leaves only a .tmp behind).
std::vector<SnapshotEntry> readSnapshotsIn(const std::string& folder) {
  std::vector<SnapshotEntry> entries;
  for (const std::string& name : folderNames(folder)) {
    const std::string path = joinedPath(folder, name);
    if (!endsWith(name, kSuffix) || !detail::isRegularFile(path)) continue;
    TORCH_CHECK_VALUE(parseSnapshotFileName(name, nullptr, nullptr), path,
                      ": not a snapshot name; expected {profile_index}.{step}.safetensors; move "
                      "other safetensors files out of the snapshot folder");
    entries.push_back({path, readSnapshotInfo(path)});
  }
  std::sort(entries.begin(), entries.end(), entryBefore);
  return entries;
}

// Two profiles with one gamma at one step make the synthesis matrix
// singular, so the folder is refused rather than the solve failing later.
void checkDistinctGammas(const std::vector<SnapshotEntry>& entries, const std::string& dir) {
  std::set<std::pair<int64_t, double>> seen;
  for (const SnapshotEntry& entry : entries) {
    TORCH_CHECK_VALUE(seen.emplace(entry.info.step, entry.info.gamma).second, dir,
                      ": duplicate (step, gamma) = (", entry.info.step, ", ",
                      formatDecimal17(entry.info.gamma), ") at ", entry.path,
                      "; two profiles share one gamma");
  }
}

void checkFull(const std::vector<SnapshotEntry>& entries, const std::string& dir) {
  for (const SnapshotEntry& entry : entries) {
    TORCH_CHECK_VALUE(!entry.info.sharded(), entry.path, ": a sharded snapshot (rank ",
                      entry.info.rank, ") at the top of ", dir,
                      "; sharded files belong in rank_NNNNN subfolders");
  }
  checkDistinctGammas(entries, dir);
}

// One rank folder's files: each names that rank, one world size (shared
// with the other ranks' through *worldSize, 0 until the first), one layout,
// distinct gammas per step.
void checkRankEntries(const std::vector<SnapshotEntry>& entries, int64_t rank,
                      const std::string& rankDir, const std::string& dir, int64_t* worldSize) {
  for (const SnapshotEntry& entry : entries) {
    TORCH_CHECK_VALUE(entry.info.rank == rank, entry.path, ": metadata says rank ", entry.info.rank,
                      " but the folder is ", rankFolderName(rank));
    if (*worldSize == 0) *worldSize = entry.info.worldSize;
    TORCH_CHECK_VALUE(entry.info.worldSize == *worldSize, entry.path, ": world size ",
                      entry.info.worldSize, " but other files in ", dir, " say ", *worldSize,
                      "; the folder mixes runs");
    TORCH_CHECK_VALUE(entry.info.layoutJson == entries.front().info.layoutJson, entry.path,
                      ": mixed layouts in ", rankDir,
                      ": its shardema.layout differs "
                      "from that of ",
                      entries.front().path);
    TORCH_CHECK_VALUE(entry.info.splitDims == entries.front().info.splitDims, entry.path,
                      ": mixed layouts in ", rankDir, ": its ", kSplitDimsKey,
                      " differs from that of ", entries.front().path);
  }
  checkDistinctGammas(entries, rankDir);
}

std::vector<std::vector<SnapshotEntry>> readRanks(const std::map<int64_t, std::string>& rankDirs,
                                                  const std::string& dir, int64_t* worldSize) {
  std::vector<std::vector<SnapshotEntry>> perRank;
  for (const auto& [rank, rankDir] : rankDirs) {
    std::vector<SnapshotEntry> entries = readSnapshotsIn(rankDir);
    TORCH_CHECK_VALUE(!entries.empty(), rankDir, ": no snapshots in this rank folder");
    checkRankEntries(entries, rank, rankDir, dir, worldSize);
    perRank.push_back(std::move(entries));
  }
  return perRank;
}

void checkRankSet(const std::map<int64_t, std::string>& rankDirs,
                  const std::vector<std::vector<SnapshotEntry>>& perRank, int64_t worldSize,
                  const std::string& dir) {
  for (int64_t rank = 0; rank < worldSize; ++rank) {
    TORCH_CHECK_VALUE(rankDirs.count(rank) == 1, dir, ": missing ", rankFolderName(rank),
                      " of world size ", worldSize);
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(rankDirs.size()) == worldSize, dir, ": ", rankDirs.size(),
                    " rank folders but the files say world size ", worldSize);
  for (size_t rank = 1; rank < perRank.size(); ++rank) {
    bool same = perRank[rank].size() == perRank[0].size();
    for (size_t k = 0; same && k < perRank[0].size(); ++k) {
      same = perRank[rank][k].info.step == perRank[0][k].info.step &&
             perRank[rank][k].info.profileIndex == perRank[0][k].info.profileIndex;
    }
    TORCH_CHECK_VALUE(same, dir, ": ", rankFolderName(rank), " holds a different set of ",
                      "(profile_index, step) snapshots than rank_00000; a rank's write was lost "
                      "or the folder mixes runs");
  }
}

}  // namespace

std::string snapshotFileName(int64_t profileIndex, int64_t step) {
  return std::to_string(profileIndex) + "." + std::to_string(step) + kSuffix;
}

std::string rankFolderName(int64_t rank) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%s%05" PRId64, kRankPrefix, rank);
  return buffer;
}

bool parseSnapshotFileName(const std::string& fileName, int64_t* profileIndex, int64_t* step) {
  if (!endsWith(fileName, kSuffix)) return false;
  const std::string stem = fileName.substr(0, fileName.size() - std::string(kSuffix).size());
  const size_t dot = stem.find('.');
  if (dot == std::string::npos) return false;
  int64_t index = 0;
  int64_t parsedStep = 0;
  if (!parseDigits(stem.substr(0, dot), &index) ||
      !parseDigits(stem.substr(dot + 1), &parsedStep)) {
    return false;
  }
  if (profileIndex) *profileIndex = index;
  if (step) *step = parsedStep;
  return true;
}

std::map<std::string, std::string> snapshotMetadata(const SnapshotInfo& info) {
  std::map<std::string, std::string> metadata{
      {kFormatKey, kFormatVersion},
      {kKindKey, kKind},
      {kSigmaRelKey, formatDecimal17(info.sigmaRel)},
      {kGammaKey, formatDecimal17(info.gamma)},
      {kStepKey, std::to_string(info.step)},
      {kProfileIndexKey, std::to_string(info.profileIndex)},
  };
  if (info.sharded()) {
    metadata[kRankKey] = std::to_string(info.rank);
    metadata[kWorldSizeKey] = std::to_string(info.worldSize);
    metadata[kLayoutKey] = info.layoutJson;
    if (!info.splitDims.empty()) metadata[kSplitDimsKey] = splitDimsJson(info.splitDims);
  }
  return metadata;
}

void writeSnapshot(const std::string& path,
                   const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                   const SnapshotInfo& info) {
  validateInfo(info, path);
  TensorFile file;
  file.tensors.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK_VALUE(tensor.defined(), "writeSnapshot(", path, "): tensor '", name,
                      "' is undefined");
    // Snapshots are float32 by contract (DESIGN.md section 5) whatever the
    // training dtype; integer buffers such as counters are not averaged and
    // keep their dtype.
    file.tensors.emplace_back(name, at::isFloatingType(tensor.scalar_type())
                                        ? tensor.to(at::kCPU, at::kFloat).contiguous()
                                        : tensor);
  }
  file.metadata = snapshotMetadata(info);
  writeTensorFile(path, file);
}

SnapshotInfo readSnapshotInfo(const std::string& path) {
  const SafetensorsHeader header = readTensorFileHeader(path);
  const std::map<std::string, std::string>& metadata = header.metadata;
  const std::string& kind = requireKey(metadata, path, kKindKey);
  TORCH_CHECK_VALUE(kind == kKind, path, ": metadata ", kKindKey, " is \"", kind, "\", expected \"",
                    kKind, "\"; this is not a posthoc snapshot");
  SnapshotInfo info;
  info.profileIndex = parseIntKey(metadata, path, kProfileIndexKey);
  info.step = parseIntKey(metadata, path, kStepKey);
  TORCH_CHECK_VALUE(info.step >= 1, path, ": metadata ", kStepKey, " must be >= 1, got 0");
  info.sigmaRel = parseDoubleKey(metadata, path, kSigmaRelKey);
  info.gamma = parseDoubleKey(metadata, path, kGammaKey);
  TORCH_CHECK_VALUE(info.gamma > 0, path, ": metadata ", kGammaKey, " must be > 0, got ",
                    metadata.at(kGammaKey));
  const double expected = gammaToSigmaRel(info.gamma);
  TORCH_CHECK_VALUE(std::abs(expected - info.sigmaRel) <= 1e-9 * expected, path, ": metadata ",
                    kSigmaRelKey, " ", metadata.at(kSigmaRelKey), " disagrees with ", kGammaKey,
                    " ", metadata.at(kGammaKey));
  const bool sharded =
      metadata.count(kRankKey) || metadata.count(kWorldSizeKey) || metadata.count(kLayoutKey);
  if (sharded) {
    info.rank = parseIntKey(metadata, path, kRankKey);
    info.worldSize = parseIntKey(metadata, path, kWorldSizeKey);
    info.layoutJson = requireKey(metadata, path, kLayoutKey);
    TORCH_CHECK_VALUE(info.rank < info.worldSize, path, ": metadata ", kRankKey, " ", info.rank,
                      " must be below ", kWorldSizeKey, " ", info.worldSize);
    TORCH_CHECK_VALUE(!info.layoutJson.empty(), path, ": metadata ", kLayoutKey, " is empty");
    const auto split = metadata.find(kSplitDimsKey);
    if (split != metadata.end()) info.splitDims = parseSplitDims(split->second, path);
  } else {
    TORCH_CHECK_VALUE(metadata.count(kSplitDimsKey) == 0, path, ": metadata ", kSplitDimsKey,
                      " in a full-copy snapshot (it describes sharded files only)");
  }
  const std::string name = detail::fileName(path);
  int64_t nameIndex = 0;
  int64_t nameStep = 0;
  TORCH_CHECK_VALUE(parseSnapshotFileName(name, &nameIndex, &nameStep), path,
                    ": not a snapshot name; expected {profile_index}.{step}.safetensors");
  TORCH_CHECK_VALUE(nameStep == info.step, path, ": metadata says step ", info.step,
                    " but the name says ", nameStep, "; the file was renamed");
  TORCH_CHECK_VALUE(nameIndex == info.profileIndex, path, ": metadata says profile index ",
                    info.profileIndex, " but the name says ", nameIndex, "; the file was renamed");
  return info;
}

SnapshotFolder scanSnapshotFolder(const std::string& dir) {
  TORCH_CHECK_VALUE(detail::isDirectory(dir), dir,
                    ": snapshot folder does not exist or is not a folder");
  std::map<int64_t, std::string> rankDirs;
  for (const std::string& name : folderNames(dir)) {
    int64_t rank = 0;
    if (parseRankFolderName(name, &rank) && detail::isDirectory(joinedPath(dir, name))) {
      rankDirs.emplace(rank, joinedPath(dir, name));
    }
  }
  SnapshotFolder folder;
  folder.snapshots = readSnapshotsIn(dir);
  if (rankDirs.empty()) {
    TORCH_CHECK_VALUE(!folder.snapshots.empty(), dir,
                      ": no posthoc snapshots ({profile_index}.{step}.safetensors) found");
    checkFull(folder.snapshots, dir);
    return folder;
  }
  TORCH_CHECK_VALUE(folder.snapshots.empty(), dir, ": mixed layouts: both top-level snapshots (",
                    folder.snapshots.front().path,
                    ") and rank_NNNNN folders; keep one layout "
                    "per folder");
  folder.sharded = true;
  folder.perRank = readRanks(rankDirs, dir, &folder.worldSize);
  checkRankSet(rankDirs, folder.perRank, folder.worldSize, dir);
  return folder;
}

std::vector<SnapshotEntry> scanRankSnapshots(const std::string& dir, int64_t rank) {
  TORCH_CHECK_VALUE(rank >= 0, "scanRankSnapshots(", dir, "): rank must be >= 0, got ", rank);
  const std::string rankDir = joinedPath(dir, rankFolderName(rank));
  if (!detail::isDirectory(rankDir)) return {};
  // One read of the headers; an empty folder (no snapshot yet) is no error.
  std::vector<SnapshotEntry> entries = readSnapshotsIn(rankDir);
  int64_t worldSize = 0;
  checkRankEntries(entries, rank, rankDir, dir, &worldSize);
  return entries;
}

}  // namespace shardema
