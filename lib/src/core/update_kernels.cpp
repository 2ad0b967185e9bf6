#include "shardema/update_kernels.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "shardema/worker_pool.h"

// Built with -O3 -ffp-contract=off (lib/CMakeLists.txt): the loops below are
// written so GCC vectorises them at the SSE2 baseline, and no a*b+c may be
// fused, so a vector body and its scalar tail round alike and the result of
// updateSpans does not depend on where the work was cut.

namespace shardema {
namespace {

inline float bitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t floatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

struct LoadF32 {
  float operator()(float x) const { return x; }
};

// bf16 is the top half of an fp32: widening is exact, NaN payloads included.
struct LoadBF16 {
  float operator()(uint16_t h) const { return bitsToFloat(static_cast<uint32_t>(h) << 16); }
};

// IEEE half -> float without branches so the loop vectorises (selects become
// compare + and/andnot/or). Normal numbers and inf/nan are pure integer
// rebiasing; subnormal halves (m * 2^-24) are normal floats, made exactly by
// (2^-14 + m*2^-24) - 2^-14, which is also correct under FTZ/DAZ. Signalling
// NaNs come out quiet with their payload, as F16C's vcvtph2ps does.
struct LoadF16 {
  // All-ones when cond holds: written as masks, not ?:, because GCC would
  // otherwise keep a branch and leave the loop scalar.
  static uint32_t maskIf(bool cond) { return 0u - static_cast<uint32_t>(cond); }

  float operator()(uint16_t h) const {
    const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    const uint32_t magnitude = (static_cast<uint32_t>(h) & 0x7fffu) << 13;
    const uint32_t exponent = magnitude & 0x0f800000u;
    const uint32_t normal = magnitude + (112u << 23);  // bias 15 -> 127
    const uint32_t quiet = maskIf((magnitude & 0x007fe000u) != 0) & 0x00400000u;
    const uint32_t infNan = (magnitude + (224u << 23)) | quiet;  // exponent 31 -> 255
    const float kTwoPowMinus14 = bitsToFloat(113u << 23);
    const uint32_t subnormal = floatToBits(bitsToFloat(magnitude + (113u << 23)) - kTwoPowMinus14);
    const uint32_t isSubnormal = maskIf(exponent == 0);
    const uint32_t isInfNan = maskIf(exponent == 0x0f800000u);
    const uint32_t bits =
        (subnormal & isSubnormal) | (infNan & isInfNan) | (normal & ~(isSubnormal | isInfNan));
    return bitsToFloat(bits | sign);
  }
};

// ema + w*(x - ema): the header's formula, so w = 0 keeps ema and w = 1
// gives x up to one rounding of (x - ema) + ema.
template <typename Source, typename Load>
void lerpLoop(float* __restrict ema, const Source* __restrict src, int64_t count, float weight,
              Load load) {
  for (int64_t i = 0; i < count; ++i) {
    const float e = ema[i];
    ema[i] = e + weight * (load(src[i]) - e);
  }
}

template <typename Source, typename Load>
void copyLoop(float* __restrict ema, const Source* __restrict src, int64_t count, Load load) {
  for (int64_t i = 0; i < count; ++i) {
    ema[i] = load(src[i]);
  }
}

// Applies one op to `count` elements starting `offset` elements into a span.
void applyPart(const UpdateSpan& span, int64_t offset, int64_t count, float weight) {
  float* ema = span.ema + offset;
  const char* src =
      static_cast<const char*>(span.src) + offset * static_cast<int64_t>(sourceTypeSize(span.type));
  if (span.op == UpdateOp::kLerp) {
    lerpRange(ema, src, span.type, count, weight);
  } else {
    copyRange(ema, src, span.type, count);
  }
}

// Piece p of `pieces` covers [boundary(p), boundary(p + 1)) of the spans laid
// end to end; sizes differ by at most one element.
int64_t pieceBoundary(int64_t p, int64_t pieces, int64_t total) {
  return (total / pieces) * p + std::min(p, total % pieces);
}

void applyGlobalRange(const std::vector<UpdateSpan>& spans, const std::vector<int64_t>& starts,
                      int64_t begin, int64_t end, float weight) {
  // Last span starting at or before `begin`; zero-size spans share a start
  // and are stepped over by the loop.
  auto it = std::upper_bound(starts.begin(), starts.end(), begin);
  size_t s = static_cast<size_t>(it - starts.begin()) - 1;
  for (; s < spans.size() && starts[s] < end; ++s) {
    const int64_t from = std::max(begin, starts[s]);
    const int64_t to = std::min(end, starts[s] + spans[s].count);
    if (to > from) {
      applyPart(spans[s], from - starts[s], to - from, weight);
    }
  }
}

// A few pieces per thread so a thread slowed by a neighbour process hands
// work to the others; more would only add scheduling overhead.
constexpr int64_t kPiecesPerThread = 4;

}  // namespace

int sourceTypeSize(SourceType type) { return type == SourceType::kFloat32 ? 4 : 2; }

void lerpRange(float* ema, const void* src, SourceType type, int64_t count, float weight) {
  switch (type) {
    case SourceType::kFloat32:
      lerpLoop(ema, static_cast<const float*>(src), count, weight, LoadF32{});
      break;
    case SourceType::kBFloat16:
      lerpLoop(ema, static_cast<const uint16_t*>(src), count, weight, LoadBF16{});
      break;
    case SourceType::kFloat16:
      lerpLoop(ema, static_cast<const uint16_t*>(src), count, weight, LoadF16{});
      break;
  }
}

void copyRange(float* ema, const void* src, SourceType type, int64_t count) {
  switch (type) {
    case SourceType::kFloat32:
      if (count > 0) {
        std::memcpy(ema, src, static_cast<size_t>(count) * sizeof(float));
      }
      break;
    case SourceType::kBFloat16:
      copyLoop(ema, static_cast<const uint16_t*>(src), count, LoadBF16{});
      break;
    case SourceType::kFloat16:
      copyLoop(ema, static_cast<const uint16_t*>(src), count, LoadF16{});
      break;
  }
}

void updateSpans(const std::vector<UpdateSpan>& spans, float weight, WorkerPool* pool,
                 int64_t minGrain) {
  TORCH_CHECK_VALUE(minGrain >= 1, "shardema::updateSpans: minGrain must be >= 1, got ", minGrain);
  std::vector<int64_t> starts;
  starts.reserve(spans.size());
  int64_t total = 0;
  for (const UpdateSpan& span : spans) {
    TORCH_CHECK_VALUE(span.count >= 0, "shardema::updateSpans: span count must be >= 0, got ",
                      span.count);
    starts.push_back(total);
    total += span.count;
  }
  if (total == 0) {
    return;
  }
  const int64_t threads = pool == nullptr ? 1 : pool->size() + 1;
  const int64_t pieces =
      threads == 1 ? 1 : std::clamp<int64_t>(total / minGrain, 1, threads * kPiecesPerThread);
  if (pieces == 1) {
    applyGlobalRange(spans, starts, 0, total, weight);
    return;
  }
  pool->parallelFor(pieces, [&](int64_t p) {
    applyGlobalRange(spans, starts, pieceBoundary(p, pieces, total),
                     pieceBoundary(p + 1, pieces, total), weight);
  });
}

}  // namespace shardema
