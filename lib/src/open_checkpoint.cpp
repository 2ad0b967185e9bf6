// Opening a per-rank checkpoint for the offline tools: every rank file
// checked against the manifest and against rank 0's profiles and roles,
// then every tensor's own checksum, before any tool reports the checkpoint
// sound or writes a byte from it.
#include "open_checkpoint.h"

#include <c10/util/Exception.h>

#include <unordered_map>

#include "sharded_internal.h"
#include "shardema/core/file_metadata.h"
#include "shardema/detail/rank_manifest.h"

namespace shardema::detail {
namespace {

void checkRankTensor(const TensorFileReader& reader, const std::string& stored,
                     const shard::ShardSpec& spec, int64_t rank) {
  TORCH_CHECK_VALUE(reader.contains(stored), reader.path(), ": tensor '", stored,
                    "' of the layout is missing");
  const TensorEntry& entry = reader.entry(stored);
  TORCH_CHECK_VALUE(entry.shape.size() == 1 && entry.numel() == spec.rangeOf(rank).size(),
                    reader.path(), ": tensor '", stored, "' must be 1-D with ",
                    spec.rangeOf(rank).size(), " elements (rank ", rank, "'s range), found ",
                    entry.numel());
}

// Profiles beyond 0 hold every averaged tensor (by its saved role) again
// under profileTensorName, and nothing else: what loadCheckpoint reads
// (readRankTensors). Returns, per spec, whether it is averaged.
std::vector<bool> checkProfileTensors(const TensorFileReader& reader,
                                      const shard::ShardLayout& layout, int64_t rank,
                                      const AveragerStateInfo& info) {
  const int profiles = static_cast<int>(info.profiles.size());
  std::unordered_map<std::string, size_t> specIndex;
  std::vector<bool> averaged;
  for (size_t i = 0; i < layout.specs.size(); ++i) {
    const shard::ShardSpec& spec = layout.specs[i];
    specIndex.emplace(spec.name, i);
    const auto role = info.roles.find(spec.name);
    TORCH_CHECK_VALUE(profiles == 1 || role != info.roles.end(), reader.path(), ": ", kRolesKey,
                      " gives tensor '", spec.name, "' no role, which a checkpoint of ", profiles,
                      " profiles needs (an averaged tensor is stored once per profile)");
    averaged.push_back(role == info.roles.end() || isAveragingRole(role->second));
    if (profiles == 1 || !averaged.back()) continue;
    for (int p = 1; p < profiles; ++p) {
      const std::string stored = profileTensorName(spec.name, p);
      checkRankTensor(reader, stored, spec, rank);
      TORCH_CHECK_VALUE(reader.scalarType(stored) == reader.scalarType(spec.name), reader.path(),
                        ": tensor '", stored, "' is stored as ", reader.scalarType(stored),
                        " but profile 0's '", spec.name, "' as ", reader.scalarType(spec.name));
    }
  }
  for (const std::string& stored : reader.names()) {
    std::string name;
    const int profile = profileOfStoredName(stored, &name);
    if (profile <= 0) continue;  // profile 0's names: checkRankFile
    const auto spec = specIndex.find(name);
    TORCH_CHECK_VALUE(profile < profiles && spec != specIndex.end() && averaged[spec->second],
                      reader.path(), ": tensor '", stored,
                      "' is not in the checkpoint's layout (or of a profile the file does not "
                      "record)");
  }
  return averaged;
}

struct RankFileState {
  AveragerStateInfo info;
  std::vector<bool> averaged;
};

RankFileState checkRankFile(const TensorFileReader& reader, const RankManifest& manifest,
                            int64_t rank) {
  const shard::ShardLayout& layout = manifest.layout;
  std::unordered_map<std::string, size_t> names;
  for (size_t i = 0; i < layout.specs.size(); ++i) names.emplace(layout.specs[i].name, i);
  for (const std::string& stored : reader.names()) {
    std::string name;
    if (profileOfStoredName(stored, &name) > 0) continue;  // checkProfileTensors
    TORCH_CHECK_VALUE(names.count(stored), reader.path(), ": tensor '", stored,
                      "' is not in the checkpoint's layout");
  }
  for (const shard::ShardSpec& spec : layout.specs) checkRankTensor(reader, spec.name, spec, rank);
  checkRankMetadata(reader.path(), reader.header().metadata, rank, manifest.worldSize(),
                    layout.fingerprint(), manifest.step);
  // What loadCheckpoint's Averager::loadState would refuse; a reshard would
  // otherwise copy rank 0's metadata into every new file under fresh checksums.
  RankFileState state;
  try {
    state.info = checkAveragerStateMetadata(reader.header().metadata, "Averager state");
  } catch (const c10::ValueError& error) {
    TORCH_CHECK_VALUE(false, reader.path(), ": ", error.what_without_backtrace());
  }
  state.averaged = checkProfileTensors(reader, layout, rank, state.info);
  return state;
}

std::string profilesText(const std::map<std::string, std::string>& metadata) {
  const auto it = metadata.find(kProfilesKey);
  return it == metadata.end() ? std::string("absent") : it->second;
}

// Every rank saved one Averager state: a rank whose profiles or roles
// differ from rank 0's would be exported or resharded under rank 0's.
void checkAgreesWithRankZero(const TensorFileReader& reader, const RankFileState& state,
                             const TensorFileReader& rankZero, const RankFileState& zero) {
  const auto& metadata = reader.header().metadata;
  const auto& zeroMetadata = rankZero.header().metadata;
  TORCH_CHECK_VALUE(profilesText(metadata) == profilesText(zeroMetadata), reader.path(), ": ",
                    kProfilesKey, " is '", profilesText(metadata), "' but '",
                    profilesText(zeroMetadata), "' in ", rankZero.path());
  TORCH_CHECK_VALUE(state.info.profiles.size() == 1 || state.averaged == zero.averaged,
                    reader.path(), ": ", kRolesKey, " differs from ", rankZero.path(),
                    "'s in which tensors are averaged");
}

}  // namespace

std::string OpenCheckpoint::storedName(size_t spec, int profile) const {
  const std::string& name = manifest.layout.specs.at(spec).name;
  return averaged.at(spec) ? profileTensorName(name, profile) : name;
}

// The manifest's XXH64 only says a file is the one it names: a rank file
// rewritten together with its manifest record passes it. Every tensor's own
// checksum (the check loadCheckpoint makes through TensorFileReader::read)
// is verified too, in pieces of bufferBytes, so corrupted data is never
// re-signed into a clean-looking export or reshard.
OpenCheckpoint openCheckpoint(const std::string& dir, int64_t bufferBytes) {
  OpenCheckpoint checkpoint{verifyRankFiles(dir), {}, {}, {}, {}};
  const RankManifest& manifest = checkpoint.manifest;
  RankFileState zero;
  for (const RankFileRecord& record : manifest.files) {
    checkpoint.readers.emplace_back(joinPath(dir, record.name));
    const RankFileState state = checkRankFile(checkpoint.readers.back(), manifest, record.rank);
    if (record.rank == 0) {
      zero = state;
    } else {
      checkAgreesWithRankZero(checkpoint.readers.back(), state, checkpoint.readers.front(), zero);
    }
  }
  checkpoint.profiles = zero.info.profiles;
  checkpoint.averaged = zero.averaged;
  for (const shard::ShardSpec& spec : manifest.layout.specs) {
    const c10::ScalarType dtype = checkpoint.readers.front().scalarType(spec.name);
    for (const TensorFileReader& reader : checkpoint.readers) {
      TORCH_CHECK_VALUE(reader.scalarType(spec.name) == dtype, reader.path(), ": tensor '",
                        spec.name, "' is stored as ", reader.scalarType(spec.name), " but as ",
                        dtype, " in ", checkpoint.readers.front().path());
    }
    checkpoint.dtypes.push_back(dtype);
  }
  for (const TensorFileReader& reader : checkpoint.readers) reader.verifyChecksums(bufferBytes);
  return checkpoint;
}

}  // namespace shardema::detail
