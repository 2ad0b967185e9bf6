#pragma once
// Shared by the kernel tests: random sources of each type with their float
// values converted by c10 (not by the code under test), random EMAs, and
// the error bound of one float32 lerp.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "shardema/core/update_kernels.h"

namespace shardema::testing {

// Every source type the kernels take.
inline constexpr SourceType kSourceTypes[] = {SourceType::kFloat32, SourceType::kBFloat16,
                                              SourceType::kFloat16};

inline uint32_t bitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// A source buffer of one type plus the float value of every element, the
// latter converted by c10 (not by the code under test).
struct Source {
  SourceType type;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  std::vector<float> asFloat;
  const void* data() const {
    return type == SourceType::kFloat32 ? (const void*)f32.data() : u16.data();
  }
};

// Values spread over magnitudes 2^-10..2^10 and both signs, so the
// tolerance is exercised relative to the operands, not near one scale.
inline float randomValue(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-10, 10);
  return std::ldexp(mantissa(rng), exponent(rng));
}

inline Source makeSource(SourceType type, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Source s{type, {}, {}, {}};
  s.asFloat.resize(n);
  if (type == SourceType::kFloat32) {
    s.f32.resize(n);
  } else {
    s.u16.resize(n);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = randomValue(rng);
    if (type == SourceType::kFloat32) {
      s.f32[i] = s.asFloat[i] = v;
    } else if (type == SourceType::kBFloat16) {
      const c10::BFloat16 b(v);
      s.u16[i] = b.x;
      s.asFloat[i] = static_cast<float>(b);
    } else {
      const c10::Half h(v);
      s.u16[i] = h.x;
      s.asFloat[i] = static_cast<float>(h);
    }
  }
  return s;
}

inline std::vector<float> makeEma(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> ema(n);
  for (float& v : ema) {
    v = randomValue(rng);
  }
  return ema;
}

// Bound on one fp32 evaluation of e + w*(x - e) against the exact value,
// with u = 2^-24 and M = max(|e|, |x|): (x - e) is rounded once (error
// <= u*|x - e| <= 2uM, scaled by w), w*d once (<= u*w*2M), the sum once
// (<= u*M since the exact lerp lies between e and x). Total (1 + 4w)*u*M,
// which is 1 to 2.5 ulp(M) (u*M lies in [ulp/2, ulp)): about 1 ulp for the
// usual small w. The 1e-6 slack covers the second-order terms.
inline double lerpTolerance(double e, double x, double w) {
  return (1.0 + 4.0 * w) * std::ldexp(1.0, -24) * std::max(std::fabs(e), std::fabs(x)) *
         (1.0 + 1e-6);
}

// The shape of span `index` of a random mixed set: every 7th one empty,
// the rest under `maxCount` elements, of a random type, one in four a
// copy. Draws count, type and op from `rng` in that order.
struct SpanShape {
  int64_t count;
  SourceType type;
  UpdateOp op;
};

inline SpanShape randomSpanShape(std::mt19937_64& rng, int index, int64_t maxCount) {
  SpanShape shape;
  shape.count = index % 7 == 0 ? 0 : static_cast<int64_t>(rng() % maxCount);
  shape.type = kSourceTypes[rng() % 3];
  shape.op = rng() % 4 == 0 ? UpdateOp::kCopy : UpdateOp::kLerp;
  return shape;
}

}  // namespace shardema::testing
