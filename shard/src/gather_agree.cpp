#include "gather_agree.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "gather_plan.h"

namespace shardema {
namespace shard {
namespace detail {
namespace {

// Header words, in order.
enum Word : int64_t { kLayout, kErrorBytes, kRoot, kBuffer, kExtra, kWords };

// Longest part of a rank's message that travels to the others: bounds the
// second exchange whatever a caller's localError holds.
constexpr int64_t kMaxErrorBytes = 4096;

uint64_t layoutHash(const ShardLayout& layout) {
  try {
    return agreementHash(layout);
  } catch (const c10::Error&) {
    return 0;  // a shape that cannot be counted: layout.check() reports it
  }
}

// Every rank calls this when some rank's error length is non-zero (all
// know from the header): one all-gather of the messages, padded to the
// longest, then one ValueError naming each failed rank and its reason.
[[noreturn]] void failTogether(const char* api, Communicator& comm, const uint64_t* words,
                               const std::string& localError) {
  const int64_t worldSize = comm.worldSize();
  int64_t width = 0;
  for (int64_t r = 0; r < worldSize; ++r) {
    width = std::max(width, static_cast<int64_t>(words[kWords * r + kErrorBytes]));
  }
  at::Tensor mine = newBytes(width);
  mine.zero_();
  std::memcpy(mine.data_ptr(), localError.data(),
              std::min(localError.size(), static_cast<size_t>(width)));
  at::Tensor all = newBytes(width * worldSize);
  comm.allGather(mine, all, std::string(api) + " errors");
  const auto* text = static_cast<const char*>(all.data_ptr());
  std::ostringstream message;
  message << api << ": no data was moved because a rank failed before the exchange (seen on rank "
          << comm.rank() << ")";
  for (int64_t r = 0; r < worldSize; ++r) {
    const auto bytes = static_cast<size_t>(words[kWords * r + kErrorBytes]);
    if (bytes > 0) {
      message << "; rank " << r << ": " << std::string(text + r * width, bytes);
    }
  }
  TORCH_CHECK_VALUE(false, message.str());
}

// Root and bufferBytes decide the collectives of every round: ranks that
// differ would pair different operations or sizes.
void checkSameCall(const char* api, const Communicator& comm, const uint64_t* words) {
  const uint64_t* own = words + kWords * comm.rank();
  for (int64_t r = 0; r < comm.worldSize(); ++r) {
    const uint64_t* other = words + kWords * r;
    TORCH_CHECK_VALUE(other[kRoot] == own[kRoot], api, ": root is ",
                      static_cast<int64_t>(own[kRoot]), " on rank ", comm.rank(), " but ",
                      static_cast<int64_t>(other[kRoot]), " on rank ", r,
                      "; every rank must pass the same root");
    TORCH_CHECK_VALUE(other[kBuffer] == own[kBuffer], api, ": options.bufferBytes is ",
                      static_cast<int64_t>(own[kBuffer]), " on rank ", comm.rank(), " but ",
                      static_cast<int64_t>(other[kBuffer]), " on rank ", r,
                      "; every rank must pass the same bufferBytes (it decides the rounds)");
  }
}

}  // namespace

std::string checkCall(const char* api, const Communicator& comm, const ShardLayout& layout,
                      int64_t root, bool rootMayBeAll, int64_t bufferBytes) {
  try {
    TORCH_CHECK_VALUE(layout.specs.empty() || layout.worldSize() == comm.worldSize(), api,
                      ": the layout is for ", layout.worldSize(),
                      " ranks but the communicator has ", comm.worldSize(), " (", layout.describe(),
                      ")");
    TORCH_CHECK_VALUE((rootMayBeAll && root == -1) || (root >= 0 && root < comm.worldSize()), api,
                      ": root must be ", rootMayBeAll ? "-1 (every rank) or " : "", "in [0, ",
                      comm.worldSize(), "), got ", root);
    TORCH_CHECK_VALUE(bufferBytes >= 1, api, ": options.bufferBytes must be >= 1, got ",
                      bufferBytes);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return {};
}

bool agree(const char* api, Communicator& comm, const ShardLayout& layout,
           const std::string& localError, const CallWords& call) {
  const int64_t worldSize = comm.worldSize();
  uint64_t header[kWords] = {};
  header[kLayout] = layoutHash(layout);
  header[kErrorBytes] =
      std::min(static_cast<uint64_t>(localError.size()), uint64_t{kMaxErrorBytes});
  header[kRoot] = static_cast<uint64_t>(call.root);
  header[kBuffer] = static_cast<uint64_t>(call.bufferBytes);
  header[kExtra] = call.extra;
  at::Tensor mine = newBytes(kWords * 8);
  std::memcpy(mine.data_ptr(), header, sizeof header);
  at::Tensor all = newBytes(kWords * 8 * worldSize);
  comm.allGather(mine, all, std::string(api) + " header");
  const auto* words = static_cast<const uint64_t*>(all.data_ptr());
  for (int64_t r = 0; r < worldSize; ++r) {
    if (words[kWords * r + kErrorBytes] != 0) {
      failTogether(api, comm, words, localError);
    }
  }
  checkSameCall(api, comm, words);
  bool extraDiffers = false;
  for (int64_t r = 0; r < worldSize; ++r) {
    TORCH_CHECK_VALUE(words[kWords * r + kLayout] == header[kLayout], api, ": rank ", r,
                      " and rank ", comm.rank(),
                      " were called with different layouts (this rank's: ", layout.describe(),
                      "); every rank must pass the same layout");
    extraDiffers = extraDiffers || words[kWords * r + kExtra] != header[kExtra];
  }
  return extraDiffers;
}

at::Tensor bytesView(const at::Tensor& tensor) {
  at::Tensor flat = tensor.reshape({-1});
  return flat.scalar_type() == at::kByte ? flat : flat.view(at::kByte);
}

at::Tensor newBytes(int64_t size) {
  return at::empty({size}, at::TensorOptions().dtype(at::kByte));
}

std::string roundTag(const char* api, const ShardLayout& layout, const Round& round) {
  std::ostringstream tag;
  const Segment& first = round.segments.front();
  tag << api << " '" << layout.specs[static_cast<size_t>(first.tensor)].name << "' elements ["
      << first.begin << ", " << first.end << ")";
  if (round.segments.size() > 1) {
    tag << " and " << round.segments.size() - 1 << " more tensor(s)";
  }
  return tag.str();
}

}  // namespace detail
}  // namespace shard
}  // namespace shardema
