// agreeAcrossRanks: every rank sees every rank's words, or every rank fails
// together, promptly, naming each failed rank. Words encode rank and index
// (gloo's habit), so a misplaced word points at itself.
#include "shardema/shard/agreement.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "shardema/shard/communicator.h"
#include "support/thread_ranks.h"

namespace shardema::shard {
namespace {

using shardema::testing::runThreadRanks;

uint64_t wordOf(int64_t rank, size_t index) { return 1000 * static_cast<uint64_t>(rank) + index; }

AgreementRequest requestOf(int64_t rank, size_t numWords) {
  AgreementRequest request;
  request.api = "AgreementTest";
  request.consequence = "nothing happened";
  for (size_t i = 0; i < numWords; ++i) request.words.push_back(wordOf(rank, i));
  return request;
}

TEST(AgreementTest, EveryRankSeesEveryRanksWords) {
  for (int64_t world : {1, 2, 3}) {
    for (size_t numWords : {size_t{0}, size_t{1}, size_t{5}}) {
      runThreadRanks(world, [&](Communicator& comm) {
        const Agreement agreement = agreeAcrossRanks(comm, requestOf(comm.rank(), numWords));
        ASSERT_EQ(agreement.words.size(), static_cast<size_t>(world));
        for (int64_t r = 0; r < world; ++r) {
          ASSERT_EQ(agreement.words[r].size(), numWords);
          for (size_t i = 0; i < numWords; ++i) EXPECT_EQ(agreement.words[r][i], wordOf(r, i));
        }
      });
    }
  }
}

TEST(AgreementTest, FirstRankDifferingFromRankZero) {
  Agreement agreement;
  agreement.words = {{7, 1}, {7, 1}, {7, 2}, {8, 3}};
  EXPECT_EQ(agreement.firstRankDifferingFromRankZero(0), 3);
  EXPECT_EQ(agreement.firstRankDifferingFromRankZero(1), 2);
  agreement.words = {{5}};
  EXPECT_EQ(agreement.firstRankDifferingFromRankZero(0), -1);
}

// Ranks 1 and 2 of 4 fail; every rank must throw the same kind of error,
// naming both in rank order, well before the 20 s timeout, and the
// communicator must stay usable.
void expectEveryRankFailsTogether(bool failureIsValueError) {
  constexpr int64_t kWorld = 4;
  std::mutex mutex;
  std::vector<std::string> errors(kWorld);
  std::vector<bool> valueErrors(kWorld, false);
  runThreadRanks(kWorld, [&](Communicator& comm) {
    AgreementRequest request = requestOf(comm.rank(), 2);
    request.failureIsValueError = failureIsValueError;
    if (comm.rank() == 1) request.localError = "disk full";
    if (comm.rank() == 2) request.localError = std::string(5000, 'x');
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    bool valueError = false;
    try {
      agreeAcrossRanks(comm, request);
    } catch (const c10::ValueError& error) {
      message = error.what_without_backtrace();
      valueError = true;
    } catch (const c10::Error& error) {
      message = error.what_without_backtrace();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    EXPECT_FALSE(comm.broken());
    // Still usable: a second agreement succeeds.
    EXPECT_EQ(agreeAcrossRanks(comm, requestOf(comm.rank(), 1)).words.size(),
              static_cast<size_t>(kWorld));
    std::lock_guard<std::mutex> lock(mutex);
    errors[comm.rank()] = message;
    valueErrors[comm.rank()] = valueError;
  });
  for (int64_t r = 0; r < kWorld; ++r) {
    const std::string& message = errors[r];
    EXPECT_EQ(valueErrors[r], failureIsValueError) << message;
    EXPECT_EQ(message.rfind("AgreementTest: nothing happened (seen on rank " + std::to_string(r) +
                                ")",
                            0),
              0u)
        << message;
    const size_t first = message.find("; rank 1: disk full");
    const size_t second = message.find("; rank 2: " + std::string(4096, 'x'));
    EXPECT_NE(first, std::string::npos) << message;
    EXPECT_NE(second, std::string::npos) << message;
    EXPECT_LT(first, second) << "the first failed rank comes first: " << message;
    EXPECT_EQ(message.find(std::string(4097, 'x')), std::string::npos) << "4096 bytes travel";
    EXPECT_EQ(message.find("rank 0:"), std::string::npos) << message;
    EXPECT_EQ(message.find("rank 3:"), std::string::npos) << message;
  }
}

TEST(AgreementTest, AFailedRankFailsEveryRankTogether) {
  expectEveryRankFailsTogether(false);
  expectEveryRankFailsTogether(true);
}

}  // namespace
}  // namespace shardema::shard
