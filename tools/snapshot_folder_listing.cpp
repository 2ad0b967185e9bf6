#include "snapshot_folder_listing.h"

#include <sys/stat.h>

#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "flag_parser.h"
#include "shardema/core/checksum.h"
#include "shardema/core/file_metadata.h"
#include "shardema/core/posthoc_snapshot.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/shard/shard_layout.h"

namespace shardema::cli {
namespace {

std::string shapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::string numberText(double value) {
  std::ostringstream text;
  text.precision(17);
  text << value;
  return text.str();
}

// Rank 0's snapshots for a sharded folder (every rank has the same set).
const std::vector<SnapshotEntry>& firstRank(const SnapshotFolder& folder) {
  return folder.sharded ? folder.perRank.front() : folder.snapshots;
}

struct Profile {
  double sigmaRel = 0;
  double gamma = 0;
  std::vector<int64_t> steps;
};

std::map<int64_t, Profile> profilesOf(const SnapshotFolder& folder) {
  std::map<int64_t, Profile> profiles;
  for (const SnapshotEntry& entry : firstRank(folder)) {
    Profile& profile = profiles[entry.info.profileIndex];
    profile.sigmaRel = entry.info.sigmaRel;
    profile.gamma = entry.info.gamma;
    profile.steps.push_back(entry.info.step);
  }
  return profiles;
}

std::string summary(const std::string& dir, const SnapshotFolder& folder) {
  std::set<int64_t> steps;
  for (const SnapshotEntry& entry : firstRank(folder)) steps.insert(entry.info.step);
  std::string sigmas;
  for (const auto& [index, profile] : profilesOf(folder)) {
    sigmas += (sigmas.empty() ? "" : ", ") + numberText(profile.sigmaRel);
  }
  return "post-hoc snapshot folder " + dir + " (" +
         (folder.sharded ? "sharded over " + std::to_string(folder.worldSize) + " ranks"
                         : std::string("rank-0 full copy")) +
         ", " + std::to_string(firstRank(folder).size()) + " snapshots of sigma_rel " + sigmas +
         ", steps " + std::to_string(*steps.begin()) + "-" + std::to_string(*steps.rbegin()) + ")";
}

// Every tensor's checksum, and the same tensors as the rank's first
// snapshot: what the synthesis refuses, found here first.
void checkRankFiles(const std::vector<SnapshotEntry>& entries, std::ostream& out) {
  std::vector<TensorEntry> first;
  for (const SnapshotEntry& entry : entries) {
    const TensorFileReader reader(entry.path);
    reader.verifyChecksums();
    const std::vector<TensorEntry>& tensors = reader.header().tensors;
    if (&entry == &entries.front()) first = tensors;
    if (tensors.size() != first.size()) {
      throw UsageError(entry.path + ": holds " + std::to_string(tensors.size()) +
                       " tensors but " + entries.front().path + " " +
                       std::to_string(first.size()));
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].name != first[i].name || tensors[i].dtype != first[i].dtype ||
          tensors[i].shape != first[i].shape) {
        throw UsageError(entry.path + ": tensor '" + tensors[i].name + "' " +
                         fileDTypeName(tensors[i].dtype) + ' ' + shapeText(tensors[i].shape) +
                         " differs from " + entries.front().path + "'s '" + first[i].name + "' " +
                         fileDTypeName(first[i].dtype) + ' ' + shapeText(first[i].shape));
      }
    }
    struct stat info {};
    ::stat(entry.path.c_str(), &info);
    out << "  snapshot " << entry.path << ' ' << tensors.size() << " tensors, " << info.st_size
        << " bytes, xxh64 " << checksumHex(fileChecksum(entry.path)) << " ok\n";
  }
}

void printTensors(const SnapshotFolder& folder, std::ostream& out) {
  const SnapshotEntry& newest = firstRank(folder).back();
  if (folder.sharded) {
    for (const shard::ShardSpec& spec : shard::ShardLayout::fromJson(newest.info.layoutJson).specs) {
      out << "  tensor " << spec.name << ' ' << c10::toString(spec.dtype) << ' '
          << shapeText(spec.globalShape) << '\n';
    }
    return;
  }
  const TensorFileReader reader(newest.path);
  for (const TensorEntry& entry : reader.header().tensors) {
    out << "  tensor " << entry.name << ' ' << fileDTypeName(entry.dtype) << ' '
        << shapeText(entry.shape) << '\n';
  }
}

}  // namespace

void printSnapshotFolder(const std::string& dir, std::ostream& out) {
  const SnapshotFolder folder = scanSnapshotFolder(dir);
  out << summary(dir, folder) << '\n';
  for (const auto& [index, profile] : profilesOf(folder)) {
    out << "  profile " << index << " sigma_rel " << numberText(profile.sigmaRel) << " gamma "
        << numberText(profile.gamma) << " steps";
    for (const int64_t step : profile.steps) out << ' ' << step;
    out << '\n';
  }
  if (folder.sharded) {
    for (const std::vector<SnapshotEntry>& rank : folder.perRank) checkRankFiles(rank, out);
  } else {
    checkRankFiles(folder.snapshots, out);
  }
  printTensors(folder, out);
}

std::string describeSnapshotFolder(const std::string& dir) {
  return summary(dir, scanSnapshotFolder(dir));
}

}  // namespace shardema::cli
