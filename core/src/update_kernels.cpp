#include "shardema/core/update_kernels.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

// The element loops (lerpRange, copyRange) are kernel_variants.cpp's; this
// file runs a range of spans laid end to end and several profiles of one
// source in one pass. It starts no threads (see update_kernels.h).

namespace shardema {
namespace {

// Where the source of a span starts `offset` elements in.
const void* sourceAt(const void* src, SourceType type, int64_t offset) {
  return static_cast<const char*>(src) + offset * static_cast<int64_t>(sourceTypeSize(type));
}

// Applies one op to `count` elements starting `offset` elements into a span.
void applyPart(const UpdateSpan& span, int64_t offset, int64_t count, float weight) {
  float* ema = span.ema + offset;
  const void* src = sourceAt(span.src, span.type, offset);
  if (span.op == UpdateOp::kLerp) {
    lerpRange(ema, src, span.type, count, weight);
  } else {
    copyRange(ema, src, span.type, count);
  }
}

// part(span, offset, count) for the pieces of every span within
// [begin, end) of the spans laid end to end.
template <typename Span, typename Part>
void applyGlobalRange(const std::vector<Span>& spans, const std::vector<int64_t>& starts,
                      int64_t begin, int64_t end, const Part& part) {
  // Last span starting at or before `begin`; zero-size spans share a start
  // and are stepped over by the loop.
  auto it = std::upper_bound(starts.begin(), starts.end(), begin);
  size_t s = static_cast<size_t>(it - starts.begin()) - 1;
  for (; s < spans.size() && starts[s] < end; ++s) {
    const int64_t from = std::max(begin, starts[s]);
    const int64_t to = std::min(end, starts[s] + spans[s].count);
    if (to > from) {
      part(spans[s], from - starts[s], to - from);
    }
  }
}

// The body of updateSpans and updateSpansMulti: checks the counts and ops
// (kSkip and kCopyRaw are run above the kernels: the Averager drops skipped
// tensors, the pipeline memcpys raw copies), then runs part on the elements
// [begin, end) of the spans laid end to end. One body for both so the
// single- and multi-profile paths split alike.
template <typename Span, typename Part>
void applyRange(const char* who, const std::vector<Span>& spans, int64_t begin, int64_t end,
                const Part& part) {
  TORCH_CHECK_VALUE(begin >= 0, "shardema::", who, ": begin must be >= 0, got ", begin);
  std::vector<int64_t> starts;
  starts.reserve(spans.size());
  int64_t total = 0;
  for (const Span& span : spans) {
    TORCH_CHECK_VALUE(span.count >= 0, "shardema::", who, ": span count must be >= 0, got ",
                      span.count);
    TORCH_CHECK_VALUE(span.op == UpdateOp::kLerp || span.op == UpdateOp::kCopy, "shardema::", who,
                      ": the kernels run kLerp and kCopy only");
    starts.push_back(total);
    total += span.count;
  }
  end = std::min(end, total);
  if (begin >= end) return;
  applyGlobalRange(spans, starts, begin, end, part);
}

template <typename Span>
int64_t sumOfCounts(const std::vector<Span>& spans) {
  int64_t total = 0;
  for (const Span& span : spans) total += span.count;
  return total;
}

// Source elements converted per block by the multi-profile kernels: 8 KiB
// of floats stays in L1 while every profile's EMA streams past it, so the
// source is read from memory once; larger blocks would spill to L2 for no
// gain, smaller ones would add loop overhead per profile.
constexpr int64_t kMultiBlock = 2048;

void checkNumEmas(const char* who, int numEmas) {
  TORCH_CHECK_VALUE(numEmas >= 1 && numEmas <= kMaxProfiles, "shardema::", who,
                    ": numEmas must be in [1, ", kMaxProfiles, "], got ", numEmas);
}

// The block [begin, begin + n) of src as floats: f32 is used in place (it is
// already float, and the block stays cached across profiles); bf16/fp16 are
// converted once into `buffer` by copyRange, whose conversion is exactly the
// one lerpRange applies, so the lerp below rounds as lerpRange does.
const float* blockAsFloat(const void* src, SourceType type, int64_t begin, int64_t n,
                          float* buffer) {
  if (type == SourceType::kFloat32) {
    return static_cast<const float*>(src) + begin;
  }
  copyRange(buffer, sourceAt(src, type, begin), type, n);
  return buffer;
}

void applyMultiPart(const MultiUpdateSpan& span, const float* weights, int64_t offset,
                    int64_t count) {
  float* emas[kMaxProfiles];
  const int numEmas = static_cast<int>(span.emas.size());
  for (int p = 0; p < numEmas; ++p) {
    emas[p] = span.emas[static_cast<size_t>(p)] + offset;
  }
  const void* src = sourceAt(span.src, span.type, offset);
  if (span.op == UpdateOp::kLerp) {
    lerpRangeMulti(emas, weights, numEmas, src, span.type, count);
  } else {
    copyRangeMulti(emas, numEmas, src, span.type, count);
  }
}

}  // namespace

int sourceTypeSize(SourceType type) { return type == SourceType::kFloat32 ? 4 : 2; }

int64_t totalElements(const std::vector<UpdateSpan>& spans) { return sumOfCounts(spans); }
int64_t totalElements(const std::vector<MultiUpdateSpan>& spans) { return sumOfCounts(spans); }

void updateSpans(const std::vector<UpdateSpan>& spans, float weight, int64_t begin, int64_t end) {
  applyRange("updateSpans", spans, begin, end,
                [weight](const UpdateSpan& span, int64_t offset, int64_t count) {
                  applyPart(span, offset, count, weight);
                });
}

void lerpRangeMulti(float* const* emas, const float* weights, int numEmas, const void* src,
                    SourceType type, int64_t count) {
  checkNumEmas("lerpRangeMulti", numEmas);
  if (numEmas == 1) {
    // Nothing to share: the direct loop skips the staging buffer, which
    // for a 16-bit source would be an extra pass through L1.
    lerpRange(emas[0], src, type, count, weights[0]);
    return;
  }
  alignas(64) float buffer[kMultiBlock];
  for (int64_t begin = 0; begin < count; begin += kMultiBlock) {
    const int64_t n = std::min(kMultiBlock, count - begin);
    const float* x = blockAsFloat(src, type, begin, n, buffer);
    // lerpRange of an f32 source: the same sub, mul, add as the 16-bit
    // sources' loops after their exact widening, so every profile matches
    // its single-profile update bit for bit.
    for (int p = 0; p < numEmas; ++p) {
      lerpRange(emas[p] + begin, x, SourceType::kFloat32, n, weights[p]);
    }
  }
}

void copyRangeMulti(float* const* emas, int numEmas, const void* src, SourceType type,
                    int64_t count) {
  checkNumEmas("copyRangeMulti", numEmas);
  if (numEmas == 1) {
    // Nothing to share: one copyRange (a single memcpy for f32) instead of
    // a call per block.
    copyRange(emas[0], src, type, count);
    return;
  }
  for (int64_t begin = 0; begin < count; begin += kMultiBlock) {
    const int64_t n = std::min(kMultiBlock, count - begin);
    // Convert into the first profile, then copy that block (still in L1) to
    // the others: the source is read once and converted once.
    copyRange(emas[0] + begin, sourceAt(src, type, begin), type, n);
    for (int p = 1; p < numEmas; ++p) {
      std::memcpy(emas[p] + begin, emas[0] + begin, static_cast<size_t>(n) * sizeof(float));
    }
  }
}

void updateSpansMulti(const std::vector<MultiUpdateSpan>& spans, const std::vector<float>& weights,
                      int64_t begin, int64_t end) {
  const int numEmas = static_cast<int>(std::min<size_t>(weights.size(), kMaxProfiles + 1));
  TORCH_CHECK_VALUE(numEmas >= 1 && numEmas <= kMaxProfiles,
                    "shardema::updateSpansMulti: weights.size() must be in [1, ", kMaxProfiles,
                    "], got ", weights.size());
  for (size_t s = 0; s < spans.size(); ++s) {
    TORCH_CHECK_VALUE(spans[s].emas.size() == weights.size(), "shardema::updateSpansMulti: span ",
                      s, " has emas.size() ", spans[s].emas.size(), " but weights.size() is ",
                      weights.size());
  }
  applyRange("updateSpansMulti", spans, begin, end,
                [&weights](const MultiUpdateSpan& span, int64_t offset, int64_t count) {
                  applyMultiPart(span, weights.data(), offset, count);
                });
}

}  // namespace shardema
