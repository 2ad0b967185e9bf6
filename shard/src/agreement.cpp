#include "shardema/shard/agreement.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "shardema/shard/communicator.h"

namespace shardema {
namespace shard {
namespace {

// Longest part of a rank's message that travels to the others: bounds the
// second exchange whatever a caller's localError holds.
constexpr uint64_t kMaxErrorBytes = 4096;

at::Tensor newBytes(int64_t size) {
  return at::empty({size}, at::TensorOptions().dtype(at::kByte));
}

// Every rank calls this when some rank's error length is non-zero (all
// know from the first exchange): one all-gather of the messages, padded to
// the longest, then the same error on every rank.
[[noreturn]] void failTogether(Communicator& comm, const AgreementRequest& request,
                               const std::vector<uint64_t>& errorBytes) {
  const int64_t worldSize = comm.worldSize();
  const auto width = static_cast<int64_t>(*std::max_element(errorBytes.begin(), errorBytes.end()));
  at::Tensor mine = newBytes(width);
  mine.zero_();
  std::memcpy(mine.data_ptr(), request.localError.data(),
              std::min(request.localError.size(), static_cast<size_t>(width)));
  at::Tensor all = newBytes(width * worldSize);
  comm.allGather(mine, all, request.api + " errors");
  const auto* text = static_cast<const char*>(all.data_ptr());
  std::ostringstream message;
  message << request.api << ": " << request.consequence << " (seen on rank " << comm.rank() << ")";
  for (int64_t r = 0; r < worldSize; ++r) {
    const auto bytes = static_cast<size_t>(errorBytes[static_cast<size_t>(r)]);
    if (bytes > 0) message << "; rank " << r << ": " << std::string(text + r * width, bytes);
  }
  if (request.failureIsValueError) TORCH_CHECK_VALUE(false, message.str());
  TORCH_CHECK(false, message.str());
}

}  // namespace

int64_t Agreement::firstRankDifferingFromRankZero(size_t index) const {
  for (size_t r = 1; r < words.size(); ++r) {
    if (words[r].at(index) != words[0].at(index)) return static_cast<int64_t>(r);
  }
  return -1;
}

Agreement agreeAcrossRanks(Communicator& comm, const AgreementRequest& request) {
  const int64_t worldSize = comm.worldSize();
  // Word 0 of each rank's block is its error length; the caller's follow.
  const size_t stride = request.words.size() + 1;
  std::vector<uint64_t> mine(stride);
  mine[0] = std::min(static_cast<uint64_t>(request.localError.size()), kMaxErrorBytes);
  std::copy(request.words.begin(), request.words.end(), mine.begin() + 1);
  const auto blockBytes = static_cast<int64_t>(stride * sizeof(uint64_t));
  at::Tensor input = newBytes(blockBytes);
  std::memcpy(input.data_ptr(), mine.data(), static_cast<size_t>(blockBytes));
  at::Tensor all = newBytes(blockBytes * worldSize);
  comm.allGather(input, all, request.api + " agreement");
  const auto* gathered = static_cast<const uint64_t*>(all.data_ptr());
  Agreement agreement;
  std::vector<uint64_t> errorBytes;
  bool anyFailed = false;
  for (int64_t r = 0; r < worldSize; ++r) {
    const uint64_t* block = gathered + stride * static_cast<size_t>(r);
    errorBytes.push_back(block[0]);
    anyFailed = anyFailed || block[0] != 0;
    agreement.words.emplace_back(block + 1, block + stride);
  }
  if (anyFailed) failTogether(comm, request, errorBytes);
  return agreement;
}

}  // namespace shard
}  // namespace shardema
