// Each KernelVariant this CPU has against the float64 reference (the error
// bound of one fp32 lerp) and against the baseline bit for bit, at every
// length around the vector widths and unroll steps and at misaligned
// starts, for every source type; every 16-bit pattern (NaN, Inf,
// subnormals) through each; the choice of the active variant.
#include "shardema/core/kernel_variant.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernel_test_data.h"

namespace shardema {
namespace {

using testing::bitsOf;
using testing::kSourceTypes;
using testing::lerpTolerance;
using testing::makeEma;
using testing::makeSource;

// Lengths across the 8- and 16-wide vectors and their 4x unrolled steps.
const int64_t kLengths[] = {0,  1,  7,  8,  9,  15,  16,  17,   31,
                            32, 33, 63, 64, 65, 127, 129, 1000, 4099};

const void* offsetSource(const testing::Source& s, int64_t offset) {
  return s.type == SourceType::kFloat32 ? static_cast<const void*>(s.f32.data() + offset)
                                        : static_cast<const void*>(s.u16.data() + offset);
}

TEST(KernelVariantTest, EveryVariantMatchesFloat64AndTheBaselineBitForBit) {
  const float w = 0.37f;
  for (KernelVariant variant : availableKernelVariants()) {
    for (SourceType type : kSourceTypes) {
      for (int64_t n : kLengths) {
        // Offsets of one and three elements: starts that no vector width divides.
        for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{3}}) {
          const testing::Source src = makeSource(type, n + offset, 11 + n);
          const std::vector<float> start = makeEma(n + offset, 29 + n);
          std::vector<float> mine = start, baseline = start;
          lerpRangeWith(variant, mine.data() + offset, offsetSource(src, offset), type, n, w);
          lerpRangeWith(KernelVariant::kBaseline, baseline.data() + offset,
                        offsetSource(src, offset), type, n, w);
          const std::string where = std::string(kernelVariantName(variant)) + " type " +
                                    std::to_string(static_cast<int>(type)) + " n " +
                                    std::to_string(n) + " offset " + std::to_string(offset);
          for (int64_t i = 0; i < offset; ++i)
            ASSERT_EQ(bitsOf(mine[i]), bitsOf(start[i])) << where;
          for (int64_t i = offset; i < n + offset; ++i) {
            const double e = start[i], x = src.asFloat[i];
            const double exact = e + static_cast<double>(w) * (x - e);
            ASSERT_LE(std::fabs(mine[i] - exact), lerpTolerance(e, x, w)) << where << " i " << i;
            ASSERT_EQ(bitsOf(mine[i]), bitsOf(baseline[i])) << where << " i " << i;
          }
          std::vector<float> copied(n + offset, -1.0f);
          copyRangeWith(variant, copied.data() + offset, offsetSource(src, offset), type, n);
          for (int64_t i = offset; i < n + offset; ++i) {
            ASSERT_EQ(bitsOf(copied[i]), bitsOf(src.asFloat[i])) << where << " copy i " << i;
          }
        }
      }
    }
  }
}

// Every 16-bit pattern through each variant, converted by c10 for the
// reference: NaN payloads, Inf, subnormal halves, negative zero.
TEST(KernelVariantTest, EverySixteenBitPatternWidensExactlyInEveryVariant) {
  std::vector<uint16_t> all(1 << 16);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  const int64_t n = static_cast<int64_t>(all.size());
  for (KernelVariant variant : availableKernelVariants()) {
    for (SourceType type : {SourceType::kBFloat16, SourceType::kFloat16}) {
      std::vector<float> copied(all.size());
      copyRangeWith(variant, copied.data(), all.data(), type, n);
      std::vector<float> ema(all.size(), 0.75f), baseline(all.size(), 0.75f);
      lerpRangeWith(variant, ema.data(), all.data(), type, n, 0.25f);
      lerpRangeWith(KernelVariant::kBaseline, baseline.data(), all.data(), type, n, 0.25f);
      for (size_t i = 0; i < all.size(); ++i) {
        const float expected =
            type == SourceType::kBFloat16
                ? static_cast<float>(c10::BFloat16(all[i], c10::BFloat16::from_bits()))
                : static_cast<float>(c10::Half(all[i], c10::Half::from_bits()));
        ASSERT_EQ(bitsOf(copied[i]), bitsOf(expected))
            << kernelVariantName(variant) << " pattern 0x" << std::hex << i;
        ASSERT_EQ(bitsOf(ema[i]), bitsOf(baseline[i]))
            << kernelVariantName(variant) << " pattern 0x" << std::hex << i;
      }
    }
  }
}

TEST(KernelVariantTest, TheActiveVariantIsAvx2WhereAvailableOrTheOneNamed) {
  const std::vector<KernelVariant> available = availableKernelVariants();
  ASSERT_FALSE(available.empty());
  EXPECT_EQ(available.front(), KernelVariant::kBaseline);
  const char* named = std::getenv("SHARDEMA_KERNEL");
  if (named != nullptr && *named != '\0') {
    EXPECT_STREQ(kernelVariantName(activeKernelVariant()), named);
  } else {
    EXPECT_EQ(activeKernelVariant(), kernelVariantAvailable(KernelVariant::kAvx2)
                                         ? KernelVariant::kAvx2
                                         : KernelVariant::kBaseline);
  }
#if defined(__x86_64__)
  // x86-64 builds carry both explicit variants; which run depends on the CPU.
  const bool avx2 = __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("f16c") != 0;
  EXPECT_EQ(kernelVariantAvailable(KernelVariant::kAvx2), avx2);
  EXPECT_EQ(kernelVariantAvailable(KernelVariant::kAvx512), __builtin_cpu_supports("avx512f") != 0);
#endif
  for (KernelVariant v : {KernelVariant::kAvx2, KernelVariant::kAvx512}) {
    if (kernelVariantAvailable(v)) continue;
    float ema = 0.0f, src = 1.0f;
    EXPECT_THROW(lerpRangeWith(v, &ema, &src, SourceType::kFloat32, 1, 0.5f), c10::ValueError);
  }
}

}  // namespace
}  // namespace shardema
