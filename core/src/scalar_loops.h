#pragma once
// The portable element loops of the update kernels (KernelVariant::
// kBaseline, and every explicit variant's tail): written so GCC vectorises
// them at the build's baseline, and compiled with -ffp-contract=off
// (core/CMakeLists.txt) so that no a*b+c is fused and every variant rounds
// alike. Internal to core/src.
#include <cstdint>
#include <cstring>

namespace shardema::detail {

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

// ema + w*(x - ema): update_kernels.h's formula, so w = 0 keeps ema and
// w = 1 gives x up to one rounding of (x - ema) + ema.
template <typename Source, typename Load>
inline void lerpLoop(float* __restrict ema, const Source* __restrict src, int64_t count,
                     float weight, Load load) {
  for (int64_t i = 0; i < count; ++i) {
    const float e = ema[i];
    ema[i] = e + weight * (load(src[i]) - e);
  }
}

template <typename Source, typename Load>
inline void copyLoop(float* __restrict ema, const Source* __restrict src, int64_t count,
                     Load load) {
  for (int64_t i = 0; i < count; ++i) {
    ema[i] = load(src[i]);
  }
}

}  // namespace shardema::detail
