// saveCheckpoint over a Communicator: every rank writes its file,
// rank 0 writes the manifest last. Three agreements (shard/agreement.h)
// make every rank return or fail together: before anything is written,
// after the rank files, after the manifest.
#include <c10/util/Exception.h>

#include <sstream>

#include "sharded_internal.h"
#include "shardema/core/checksum.h"
#include "shardema/detail/rank_manifest.h"
#include "shardema/shard/agreement.h"
#include "shardema/shard/communicator.h"
#include "shardema/sharded_averager.h"
#include "shardema/sharded_checkpoint.h"

namespace shardema {
namespace {

constexpr const char* kSaveApi = "saveCheckpoint";

// What each rank reports after writing its file, in this order.
enum RecordWord : size_t { kSize, kChecksum, kStep, kFingerprint, kRecordWords };

shard::AgreementRequest requestFor(const std::string& dir) {
  shard::AgreementRequest request;
  request.api = kSaveApi;
  request.consequence = "no checkpoint was written at " + dir;
  return request;
}

// Before anything is written: every rank checks its call, rank 0 creates
// the folder and picks this save's id. Returns the id on every rank, or
// every rank throws naming the ranks that failed.
uint64_t prepareSave(shard::Communicator& comm, const std::string& dir,
                     const ShardedAverager& averager) {
  shard::AgreementRequest request = requestFor(dir);
  try {
    TORCH_CHECK_VALUE(comm.rank() == averager.rank() && comm.worldSize() == averager.worldSize(),
                      kSaveApi, ": communicator is rank ", comm.rank(), " of ", comm.worldSize(),
                      " but the averager is rank ", averager.rank(), " of ", averager.worldSize());
    if (comm.rank() == 0) detail::ensureDirectory(dir, kSaveApi);
  } catch (...) {
    request.localError = detail::currentErrorMessage();
  }
  request.words = {comm.rank() == 0 ? newSaveId() : 0};
  return shard::agreeAcrossRanks(comm, request).words[0][0];
}

// Every rank writes its file and learns every rank's record.
shard::Agreement writeRankFiles(shard::Communicator& comm, const std::string& dir,
                                const ShardedAverager& averager, uint64_t saveId) {
  shard::AgreementRequest request = requestFor(dir);
  request.words.assign(kRecordWords, 0);
  try {
    const RankFileRecord record =
        writeRankFile(dir, averager, rankFileName(comm.rank(), averager.step(), saveId));
    request.words[kSize] = record.size;
    request.words[kChecksum] = record.checksum;
    request.words[kStep] = static_cast<uint64_t>(averager.step());
    request.words[kFingerprint] = parseChecksumHex(averager.layout().fingerprint());
  } catch (...) {
    // Any exception: keep taking part, so the others learn of it instead
    // of timing out.
    request.localError = "could not write its file: " + detail::currentErrorMessage();
  }
  return shard::agreeAcrossRanks(comm, request);
}

// The same verdict on every rank: all files are of one job at one step.
void checkSameStepAndLayout(const std::string& dir, const shard::Agreement& records) {
  const int64_t stepDiffers = records.firstRankDifferingFromRankZero(kStep);
  const int64_t layoutDiffers = records.firstRankDifferingFromRankZero(kFingerprint);
  const int64_t r = stepDiffers >= 0 && (layoutDiffers < 0 || stepDiffers < layoutDiffers)
                        ? stepDiffers
                        : layoutDiffers;
  if (r < 0) return;
  const std::vector<uint64_t>& theirs = records.words[static_cast<size_t>(r)];
  const std::vector<uint64_t>& rankZero = records.words[0];
  TORCH_CHECK(false, kSaveApi, ": no checkpoint was written at ", dir, ": rank ", r, " is at step ",
              static_cast<int64_t>(theirs[kStep]), " with layout fingerprint ",
              checksumHex(theirs[kFingerprint]), " but rank 0 at step ",
              static_cast<int64_t>(rankZero[kStep]), " with ", checksumHex(rankZero[kFingerprint]));
}

}  // namespace

void saveCheckpoint(shard::Communicator& comm, const std::string& dir,
                    const ShardedAverager& averager) {
  const uint64_t saveId = prepareSave(comm, dir, averager);
  const shard::Agreement records = writeRankFiles(comm, dir, averager, saveId);
  checkSameStepAndLayout(dir, records);
  // Rank 0 writes the manifest last and tells everyone whether it could.
  shard::AgreementRequest commit = requestFor(dir);
  RankManifest manifest;
  if (comm.rank() == 0) {
    try {
      manifest = manifestFor(averager);
      for (int64_t r = 0; r < comm.worldSize(); ++r) {
        const std::vector<uint64_t>& record = records.words[static_cast<size_t>(r)];
        manifest.files.push_back(
            RankFileRecord{r, rankFileName(r, static_cast<int64_t>(record[kStep]), saveId),
                           record[kSize], record[kChecksum]});
      }
      writeManifest(dir, manifest);
    } catch (...) {
      commit.localError = "could not write the manifest: " + detail::currentErrorMessage();
    }
  }
  shard::agreeAcrossRanks(comm, commit);
  // Committed: files of earlier or failed saves are garbage now.
  if (comm.rank() == 0) removeUnreferencedRankFiles(dir, manifest);
}

}  // namespace shardema
