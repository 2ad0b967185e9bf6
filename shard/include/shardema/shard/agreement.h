#pragma once
// Agreement across ranks: "agree, or every rank fails together". Each rank
// contributes a few words (what it did, what it found) and its own verdict
// (ok, or why not); every rank gets back every rank's words, or every rank
// throws the same error naming each failed rank and its reason. A rank
// whose own step failed must still call this, so the others learn of it at
// once instead of waiting out the communicator's timeout in a collective
// that rank skipped.
#include <cstdint>
#include <string>
#include <vector>

namespace shardema {
namespace shard {

class Communicator;

/// What one rank brings to agreeAcrossRanks.
struct AgreementRequest {
  /// Names the caller in errors and in the communicator's tags, e.g.
  /// "saveCheckpoint".
  std::string api;
  /// What a failure means for every rank, said in every rank's error, e.g.
  /// "no checkpoint was written".
  std::string consequence;
  /// This rank's words. Every rank passes the same number of them (a
  /// mismatch is an error of the caller and fails inside the collective).
  std::vector<uint64_t> words;
  /// "" when this rank is fine; otherwise why not. Only the first 4096
  /// bytes travel to the other ranks.
  std::string localError;
  /// The type every rank throws when some rank failed: true c10::ValueError
  /// (the failures are bad input, e.g. a call's checks), false c10::Error
  /// (they are the environment's, e.g. a write that failed).
  bool failureIsValueError = false;
};

/// Every rank's words, as every rank sees them after agreeAcrossRanks.
struct Agreement {
  /// words[r] holds rank r's words; the same on every rank.
  std::vector<std::vector<uint64_t>> words;

  /// The lowest rank whose word `index` differs from rank 0's, or -1 when
  /// every rank has rank 0's. The same answer on every rank.
  int64_t firstRankDifferingFromRankZero(size_t index) const;
};

/// Collective: every rank of `comm` calls it with its own request, on the
/// rank's one communicator thread. Blocks for one all-gather of
/// (words + 1) x 8 bytes per rank, and when any rank's localError is
/// non-empty a second one of the messages (padded to the longest); each
/// bounded by the communicator's timeout. Returns every rank's words when
/// no rank failed. Otherwise every rank, the failed ones included, throws
/// one error (see failureIsValueError) that reads
/// "<api>: <consequence> (seen on rank <me>); rank <r>: <its localError>"
/// for each failed rank in rank order, the first failed rank first; the
/// communicator stays usable. c10::Error naming the tag when the exchange
/// itself fails (a rank that never calls, or dies, or a broken
/// communicator).
Agreement agreeAcrossRanks(Communicator& comm, const AgreementRequest& request);

}  // namespace shard
}  // namespace shardema
