#pragma once
// RankManifest: the JSON file (manifest.json) that makes a folder of per-rank
// EMA state files a checkpoint (DESIGN section 5). It is written last, after
// every rank's file is committed, so a folder without a valid manifest holds
// no checkpoint. Example:
//   {"format":1,"kind":"sharded_averager_state","step":1200,
//    "schedule":{...DecaySchedule::toJson()...},"world_size":2,
//    "layout":{...ShardLayout::toJson()...},"layout_fingerprint":"0123...",
//    "files":[{"rank":0,"name":"rank_00000.step_1200.0123456789abcdef.safetensors","size":4096,
//              "xxh64":"89abcdef01234567"}, ...]}
#include <cstdint>
#include <string>
#include <vector>

#include "shardema/decay_schedule.h"
#include "shardema/shard/shard_layout.h"

namespace shardema {

/// File name of the manifest inside a checkpoint folder.
constexpr const char* kManifestFileName = "manifest.json";
/// shardema.kind of the manifest and of every rank file.
constexpr const char* kShardedStateKind = "sharded_averager_state";

struct RankManifest;

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

/// One rank's committed file as the manifest records it.
struct RankFileRecord {
  int64_t rank = 0;
  /// File name inside the folder (isRankFileName(name, rank)).
  std::string name;
  /// Bytes and XXH64 (seed 0) of the whole file.
  uint64_t size = 0;
  uint64_t checksum = 0;
};

struct RankManifest {
  int64_t step = 0;
  /// The schedule the ranks' Averagers use (no default constructor exists).
  DecaySchedule schedule = DecaySchedule::warmup();
  shard::ShardLayout layout;
  /// One per rank, in rank order (size = layout.worldSize()).
  std::vector<RankFileRecord> files;

  int64_t worldSize() const { return static_cast<int64_t>(files.size()); }

  /// The JSON text above (layout fingerprint included).
  std::string toJson() const;
  /// Parses and validates toJson() output: format 1, kind, types, a layout
  /// whose fingerprint matches the recorded one, integers in range (step and
  /// sizes of at most INT64_MAX), one file per rank with
  /// isRankFileName(name, rank). c10::ValueError "<source>: <what is wrong>".
  static RankManifest fromJson(const std::string& text, const std::string& source = "manifest");
};

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

/// readManifest + verifyRankFile for every rank: a complete, intact
/// checkpoint or c10::ValueError naming what is wrong.
RankManifest verifyCheckpoint(const std::string& dir);

}  // namespace shardema
