#pragma once
// A per-rank checkpoint folder opened for the offline tools (inspect,
// export, reshard of sharded_checkpoint_tools.cpp): the manifest, every
// rank file checked against it, and the EMA profiles the files hold
// (not installed).
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shardema/averager.h"
#include "shardema/core/tensor_file_reader.h"
#include "shardema/sharded_checkpoint.h"

namespace shardema::detail {

/// A verified checkpoint with every rank's file open and checked against
/// the layout: exactly its tensors (each profile's), each 1-D of the rank's
/// size, one dtype per tensor across ranks, the manifest's step, the same
/// profiles and roles on every rank.
struct OpenCheckpoint {
  RankManifest manifest;
  std::vector<TensorFileReader> readers;
  /// Per layout spec: the stored dtype (every profile's, every rank's).
  std::vector<c10::ScalarType> dtypes;
  /// Every profile, profile 0 first (rank 0's metadata; every rank's agrees).
  std::vector<AveragerStateInfo::Profile> profiles;
  /// Per layout spec: whether it is averaged (saved role), so that profiles
  /// beyond 0 hold it again under profileTensorName; a copy is stored once.
  std::vector<bool> averaged;

  int numProfiles() const { return static_cast<int>(profiles.size()); }
  /// The name spec `spec` of `profile` is stored under in the rank files.
  std::string storedName(size_t spec, int profile) const;
};

/// Opens and checks the checkpoint in `dir` (verifyRankFiles, each rank
/// file's tensors and metadata, then every tensor's own checksum, read in
/// pieces of `bufferBytes`). c10::ValueError naming the file and tensor or key.
OpenCheckpoint openCheckpoint(const std::string& dir, int64_t bufferBytes);

}  // namespace shardema::detail
