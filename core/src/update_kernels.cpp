#include "shardema/core/update_kernels.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "shardema/core/parallel_runner.h"

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

// IEEE half -> float without branches so the loop vectorises at SSE2.
// Normal halves, inf and nan: move exponent and mantissa into float position
// with the exponent raised by 224, then multiply by 2^-112 (net bias change
// 15 -> 127); the multiply is exact, keeps inf, and quiets a signalling NaN
// with its payload, as F16C's vcvtph2ps does. Subnormal halves (m * 2^-24)
// are normal floats: (0.5 + m*2^-24) - 0.5 is exact. No float here is ever
// subnormal, so FTZ/DAZ modes do not change the result.
struct LoadF16 {
  float operator()(uint16_t h) const {
    const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    const uint32_t magnitude = static_cast<uint32_t>(h) & 0x7fffu;
    const float kTwoPowMinus112 = bitsToFloat((127u - 112u) << 23);
    const float scaled = bitsToFloat((magnitude << 13) + (224u << 23)) * kTwoPowMinus112;
    const float subnormal = bitsToFloat(magnitude | (126u << 23)) - 0.5f;
    // All-ones for subnormal halves (and zero): a mask, not ?:, which GCC
    // would keep as a branch and leave the loop scalar.
    const uint32_t isSubnormal =
        0u - static_cast<uint32_t>(static_cast<int32_t>(magnitude) < 0x0400);
    const uint32_t bits =
        (floatToBits(subnormal) & isSubnormal) | (floatToBits(scaled) & ~isSubnormal);
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

#if defined(__x86_64__)
// fp16 is the one source whose conversion, done in software at the SSE2
// baseline, costs more than the memory traffic (update_bench's fp16 rows
// in docs/performance.md). CPUs with F16C (every x86-64 since about
// 2012) convert 8 halves in one instruction; we pick that clone at run time
// because CI may build for plain x86-64. The float math is the same sub,
// mul, add (no FMA: "fma" is not in the target), and vcvtph2ps converts
// exactly like LoadF16, so the result does not depend on which path ran.
__attribute__((target("avx,f16c"))) void lerpF16C(float* ema, const uint16_t* src, int64_t count,
                                                  float weight) {
  const __m256 w = _mm256_set1_ps(weight);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256 e = _mm256_loadu_ps(ema + i);
    _mm256_storeu_ps(ema + i, _mm256_add_ps(e, _mm256_mul_ps(w, _mm256_sub_ps(x, e))));
  }
  lerpLoop(ema + i, src + i, count - i, weight, LoadF16{});
}

__attribute__((target("avx,f16c"))) void copyF16C(float* ema, const uint16_t* src, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(ema + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  copyLoop(ema + i, src + i, count - i, LoadF16{});
}

bool haveF16C() {
  static const bool have = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return have;
}
#else
constexpr bool haveF16C() { return false; }
void lerpF16C(float*, const uint16_t*, int64_t, float) {}
void copyF16C(float*, const uint16_t*, int64_t) {}
#endif

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

// Piece p of `pieces` covers [boundary(p), boundary(p + 1)) of the spans laid
// end to end; sizes differ by at most one element.
int64_t pieceBoundary(int64_t p, int64_t pieces, int64_t total) {
  return (total / pieces) * p + std::min(p, total % pieces);
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

// A few pieces per thread so a thread slowed by a neighbour process hands
// work to the others; more would only add scheduling overhead.
constexpr int64_t kPiecesPerThread = 4;

// The body of updateSpans and updateSpansMulti: checks the counts and ops
// (kSkip and kCopyRaw are run above the kernels: the Averager drops skipped
// tensors, the pipeline memcpys raw copies), cuts the
// spans laid end to end into pieces of at least minGrain elements spread
// over the pool's threads and the caller, and runs part on each. One
// splitter for both so the single- and multi-profile paths balance alike.
template <typename Span, typename Part>
void splitOverPool(const char* who, const std::vector<Span>& spans, ParallelRunner* pool,
                   int64_t minGrain, const Part& part) {
  TORCH_CHECK_VALUE(minGrain >= 1, "shardema::", who, ": minGrain must be >= 1, got ", minGrain);
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
  if (total == 0) {
    return;
  }
  const int64_t threads = pool == nullptr ? 1 : pool->size() + 1;
  const int64_t pieces =
      threads == 1 ? 1 : std::clamp<int64_t>(total / minGrain, 1, threads * kPiecesPerThread);
  if (pieces == 1) {
    applyGlobalRange(spans, starts, 0, total, part);
    return;
  }
  pool->parallelFor(pieces, [&](int64_t p) {
    applyGlobalRange(spans, starts, pieceBoundary(p, pieces, total),
                     pieceBoundary(p + 1, pieces, total), part);
  });
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

void lerpRange(float* ema, const void* src, SourceType type, int64_t count, float weight) {
  switch (type) {
    case SourceType::kFloat32:
      lerpLoop(ema, static_cast<const float*>(src), count, weight, LoadF32{});
      break;
    case SourceType::kBFloat16:
      lerpLoop(ema, static_cast<const uint16_t*>(src), count, weight, LoadBF16{});
      break;
    case SourceType::kFloat16:
      if (haveF16C()) {
        lerpF16C(ema, static_cast<const uint16_t*>(src), count, weight);
      } else {
        lerpLoop(ema, static_cast<const uint16_t*>(src), count, weight, LoadF16{});
      }
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
      if (haveF16C()) {
        copyF16C(ema, static_cast<const uint16_t*>(src), count);
      } else {
        copyLoop(ema, static_cast<const uint16_t*>(src), count, LoadF16{});
      }
      break;
  }
}


void updateSpans(const std::vector<UpdateSpan>& spans, float weight, ParallelRunner* pool,
                 int64_t minGrain) {
  splitOverPool("updateSpans", spans, pool, minGrain,
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
    // The same loop lerpRange runs for an f32 source (LoadF32, same sub,
    // mul, add), so every profile matches its single-profile update bit for
    // bit, whichever of them vectorised.
    for (int p = 0; p < numEmas; ++p) {
      lerpLoop(emas[p] + begin, x, n, weights[p], LoadF32{});
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
                      ParallelRunner* pool, int64_t minGrain) {
  const int numEmas = static_cast<int>(std::min<size_t>(weights.size(), kMaxProfiles + 1));
  TORCH_CHECK_VALUE(numEmas >= 1 && numEmas <= kMaxProfiles,
                    "shardema::updateSpansMulti: weights.size() must be in [1, ", kMaxProfiles,
                    "], got ", weights.size());
  for (size_t s = 0; s < spans.size(); ++s) {
    TORCH_CHECK_VALUE(spans[s].emas.size() == weights.size(), "shardema::updateSpansMulti: span ",
                      s, " has emas.size() ", spans[s].emas.size(), " but weights.size() is ",
                      weights.size());
  }
  splitOverPool("updateSpansMulti", spans, pool, minGrain,
                [&weights](const MultiUpdateSpan& span, int64_t offset, int64_t count) {
                  applyMultiPart(span, weights.data(), offset, count);
                });
}

}  // namespace shardema
