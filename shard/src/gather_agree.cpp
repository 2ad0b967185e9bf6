#include "gather_agree.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "gather_plan.h"
#include "shardema/shard/agreement.h"

namespace shardema {
namespace shard {
namespace detail {
namespace {

// Header words, in order (agreeAcrossRanks adds the error length).
enum Word : size_t { kLayout, kRoot, kBuffer, kExtra, kWords };

uint64_t layoutHash(const ShardLayout& layout) {
  try {
    return agreementHash(layout);
  } catch (const c10::Error&) {
    return 0;  // a shape that cannot be counted: layout.check() reports it
  }
}

// Root and bufferBytes decide the collectives of every round: ranks that
// differ would pair different operations or sizes.
void checkSameCall(const char* api, const Communicator& comm, const Agreement& agreement) {
  const std::vector<uint64_t>& own = agreement.words[static_cast<size_t>(comm.rank())];
  for (int64_t r = 0; r < comm.worldSize(); ++r) {
    const std::vector<uint64_t>& other = agreement.words[static_cast<size_t>(r)];
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
  AgreementRequest request;
  request.api = api;
  request.consequence = "no data was moved because a rank failed before the exchange";
  request.words.resize(kWords);
  request.words[kLayout] = layoutHash(layout);
  request.words[kRoot] = static_cast<uint64_t>(call.root);
  request.words[kBuffer] = static_cast<uint64_t>(call.bufferBytes);
  request.words[kExtra] = call.extra;
  request.localError = localError;
  request.failureIsValueError = true;
  const Agreement agreement = agreeAcrossRanks(comm, request);
  checkSameCall(api, comm, agreement);
  bool extraDiffers = false;
  for (int64_t r = 0; r < comm.worldSize(); ++r) {
    const std::vector<uint64_t>& other = agreement.words[static_cast<size_t>(r)];
    TORCH_CHECK_VALUE(other[kLayout] == request.words[kLayout], api, ": rank ", r, " and rank ",
                      comm.rank(), " were called with different layouts (this rank's: ",
                      layout.describe(), "); every rank must pass the same layout");
    extraDiffers = extraDiffers || other[kExtra] != call.extra;
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
