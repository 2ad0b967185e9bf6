#pragma once
// The files of a sharded checkpoint (DESIGN.md section 5), for the library and
// tools: rank file names, one rank's file, manifest.json. Users call the
// save / load / inspect / export / reshard functions of
// sharded_checkpoint.h instead.
//
// manifest.json is written last, after every rank's file is committed, so a
// folder without a valid manifest holds no checkpoint.
#include <cstdint>
#include <string>
#include <vector>

#include "shardema/sharded_checkpoint.h"

namespace shardema {

/// shardema.kind of the manifest and of every rank file.
constexpr const char* kShardedStateKind = "sharded_averager_state";

/// "rank_{rank:05d}.safetensors": the name of older checkpoints (still
/// accepted by fromJson).
std::string rankFileName(int64_t rank);

/// "rank_{rank:05d}.step_{step}.{saveId:016x}.safetensors": the name a save
/// writes. Unique per save, so a save never overwrites a file that the
/// committed manifest references: until the new manifest replaces the old
/// one (an atomic rename), the old checkpoint stays complete.
std::string rankFileName(int64_t rank, int64_t step, uint64_t saveId);

/// A fresh random save id for rankFileName.
uint64_t newSaveId();

/// True when `name` is a plain file name (no '/', no "..") of the form
/// rank_{rank:05d}.safetensors or rank_{rank:05d}.<anything>.safetensors.
bool isRankFileName(const std::string& name, int64_t rank);

/// After `manifest` is committed in `dir`: removes the rank_*.safetensors
/// files (and leftover rank_*.tmp files) it does not reference, which
/// earlier or failed saves left. Best effort: errors are ignored.
void removeUnreferencedRankFiles(const std::string& dir, const RankManifest& manifest);

/// Writes this rank's file into `dir` (created if missing) crash-safely and
/// returns its record for the manifest. Waits for an update in flight.
/// Does not touch the manifest (see writeManifest / saveCheckpoint). The
/// name is rankFileName(rank, step, newSaveId()).
RankFileRecord writeRankFile(const std::string& dir, const ShardedAverager& averager);
/// As above, as dir/`name` (isRankFileName(name, rank), c10::ValueError
/// otherwise).
RankFileRecord writeRankFile(const std::string& dir, const ShardedAverager& averager,
                             const std::string& name);

/// Everything rank 0 needs for the manifest except the file records.
RankManifest manifestFor(const ShardedAverager& averager);

/// Writes `manifest` to dir/manifest.json crash-safely (tmp, fsync, rename,
/// fsync the folder). Call only after every rank file is committed.
void writeManifest(const std::string& dir, const RankManifest& manifest);

/// Reads dir/manifest.json. A missing manifest is c10::ValueError "no valid
/// checkpoint at DIR: manifest.json missing"; a corrupt one names the file.
RankManifest readManifest(const std::string& dir);

/// Checks that dir/<record.name> exists with the recorded size and XXH64
/// (reads the whole file in bounded chunks). c10::ValueError naming the
/// file, the expected and the found value.
void verifyRankFile(const std::string& dir, const RankFileRecord& record);

/// The largest world size reshardCheckpoint accepts for a checkpoint of
/// `layout`: the largest tensor's element count (at least 1).
int64_t maxReshardWorldSize(const shard::ShardLayout& layout);

/// readManifest + verifyRankFile for every rank: complete, intact files
/// (their contents are checked by inspectCheckpoint).
RankManifest verifyRankFiles(const std::string& dir);

}  // namespace shardema
