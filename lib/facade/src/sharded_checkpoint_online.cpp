// saveShardedCheckpoint over a Communicator: every rank writes its file,
// rank 0 collects the records and writes the manifest last.
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <sstream>

#include "sharded_internal.h"
#include "shardema/detail/checksum.h"
#include "shardema/shard/communicator.h"
#include "shardema/sharded_checkpoint.h"

namespace shardema {
namespace {

constexpr const char* kApi = "saveShardedCheckpoint";
// What each rank reports to rank 0: ok flag, file size, XXH64, step and the
// layout fingerprint (as raw 64-bit words).
constexpr int64_t kReportWords = 5;

int64_t asWord(uint64_t value) {
  int64_t word = 0;
  std::memcpy(&word, &value, sizeof(word));
  return word;
}

uint64_t fromWord(int64_t word) {
  uint64_t value = 0;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

// Rank 0: the manifest if every rank wrote the same job's file at the same
// step; otherwise the reason no checkpoint was written.
std::string writeManifestIfComplete(const std::string& dir, const ShardedAverager& averager,
                                    const at::Tensor& reports, uint64_t saveId,
                                    RankManifest& manifest) {
  const int64_t* words = reports.data_ptr<int64_t>();
  const int64_t worldSize = reports.numel() / kReportWords;
  manifest = manifestFor(averager);
  std::ostringstream failed;
  for (int64_t r = 0; r < worldSize; ++r) {
    const int64_t* report = words + r * kReportWords;
    if (report[0] != 1) {
      failed << " rank " << r << " could not write its file;";
    } else if (report[3] != manifest.step ||
               fromWord(report[4]) != parseChecksumHex(manifest.layout.fingerprint())) {
      failed << " rank " << r << " is at step " << report[3] << " with layout fingerprint "
             << checksumHex(fromWord(report[4])) << ";";
    }
    manifest.files.push_back(RankFileRecord{r, rankFileName(r, report[3], saveId),
                                            fromWord(report[1]), fromWord(report[2])});
  }
  if (!failed.str().empty()) return failed.str();
  try {
    writeManifest(dir, manifest);
  } catch (...) {
    return " rank 0 could not write the manifest: " + detail::currentErrorMessage();
  }
  return "";
}

// Before anything is written: every rank checks its call, rank 0 creates
// the folder and picks this save's id, and one broadcast tells every rank
// the id and whether rank 0 is ready. Returns the id; throws on every rank
// at once when rank 0 is not ready (a rank whose own check failed still
// joins every exchange, its error reaches the others via the reports).
uint64_t prepareSave(shard::Communicator& comm, const std::string& dir,
                     const ShardedAverager& averager, std::string& localError) {
  try {
    TORCH_CHECK_VALUE(comm.rank() == averager.rank() && comm.worldSize() == averager.worldSize(),
                      kApi, ": communicator is rank ", comm.rank(), " of ", comm.worldSize(),
                      " but the averager is rank ", averager.rank(), " of ", averager.worldSize());
    if (comm.rank() == 0) detail::ensureDirectory(dir, kApi);
  } catch (...) {
    localError = detail::currentErrorMessage();
  }
  at::Tensor header = at::zeros({2}, at::kLong);
  if (comm.rank() == 0) {
    header[0] = localError.empty() ? 1 : 0;
    header[1] = asWord(newSaveId());
  }
  comm.broadcast(header, 0, "saveShardedCheckpoint: prepare");
  TORCH_CHECK(comm.rank() != 0 || localError.empty(), kApi, ": rank 0 failed in ", dir, ": ",
              localError, "; no checkpoint was written");
  TORCH_CHECK(header[0].item<int64_t>() == 1, kApi, ": no checkpoint was written at ", dir,
              ": rank 0 failed before writing (its error names why)",
              localError.empty() ? "" : "; this rank also failed: ", localError);
  return fromWord(header[1].item<int64_t>());
}

}  // namespace

void saveShardedCheckpoint(shard::Communicator& comm, const std::string& dir,
                           const ShardedAverager& averager) {
  std::string localError;
  const uint64_t saveId = prepareSave(comm, dir, averager, localError);
  at::Tensor report = at::zeros({kReportWords}, at::kLong);
  if (localError.empty()) {
    try {
      const RankFileRecord record =
          writeRankFile(dir, averager, rankFileName(comm.rank(), averager.step(), saveId));
      int64_t* words = report.data_ptr<int64_t>();
      words[0] = 1;
      words[1] = asWord(record.size);
      words[2] = asWord(record.checksum);
      words[3] = averager.step();
      words[4] = asWord(parseChecksumHex(averager.layout().fingerprint()));
    } catch (...) {
      // Any exception: keep taking part, so the others learn of it instead
      // of timing out.
      localError = detail::currentErrorMessage();
    }
  }
  at::Tensor reports =
      comm.rank() == 0 ? at::zeros({kReportWords * comm.worldSize()}, at::kLong) : at::Tensor();
  comm.gather(report, reports, 0, "saveShardedCheckpoint: file records");
  // Rank 0 tells everyone the outcome and which ranks failed, so every
  // rank's error names them.
  at::Tensor outcome = at::zeros({comm.worldSize() + 1}, at::kLong);
  std::string failure;
  RankManifest manifest;
  if (comm.rank() == 0) {
    failure = writeManifestIfComplete(dir, averager, reports, saveId, manifest);
    outcome[0] = failure.empty() ? 1 : 0;
    for (int64_t r = 0; r < comm.worldSize(); ++r) {
      outcome[r + 1] = reports.data_ptr<int64_t>()[r * kReportWords];
    }
  }
  comm.broadcast(outcome, 0, "saveShardedCheckpoint: outcome");
  TORCH_CHECK(localError.empty(), kApi, ": rank ", comm.rank(), " could not write its file in ",
              dir, ": ", localError);
  if (outcome[0].item<int64_t>() == 1) {
    // Committed: files of earlier or failed saves are garbage now.
    if (comm.rank() == 0) removeUnreferencedRankFiles(dir, manifest);
    return;
  }
  std::ostringstream failed;
  for (int64_t r = 0; r < comm.worldSize(); ++r) {
    if (outcome[r + 1].item<int64_t>() != 1)
      failed << " rank " << r << " could not write its file;";
  }
  TORCH_CHECK(
      false, kApi, ": no checkpoint was written at ", dir, ":",
      failure.empty() ? failed.str() : failure,
      failed.str().empty() && failure.empty() ? " rank 0 could not write the manifest" : "");
}

}  // namespace shardema
