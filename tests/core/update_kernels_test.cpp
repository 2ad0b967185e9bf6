// Raw update kernels against independent references: a float64
// recomputation for the lerp, c10::BFloat16 / c10::Half for the conversions
// (every one of the 65536 bit patterns), and the serial result for any split.
#include "shardema/core/update_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/kernel_test_data.h"
#include "shardema/offload/parallel_update.h"
#include "shardema/offload/worker_pool.h"
#include "support/same_bytes.h"

namespace shardema::testing {
namespace {

const int64_t kSizes[] = {0, 1, 7, 4097, 10000000};

TEST(UpdateKernelsTest, SourceTypeSize) {
  EXPECT_EQ(sourceTypeSize(SourceType::kFloat32), 4);
  EXPECT_EQ(sourceTypeSize(SourceType::kBFloat16), 2);
  EXPECT_EQ(sourceTypeSize(SourceType::kFloat16), 2);
}

TEST(UpdateKernelsTest, LerpMatchesFloat64Reference) {
  for (SourceType type : kSourceTypes) {
    for (int64_t n : kSizes) {
      const Source src = makeSource(type, n, 1000 + n);
      const std::vector<float> before = makeEma(n, 2000 + n);
      for (float w : {0.0f, 0.001f, 0.5f, 1.0f}) {
        std::vector<float> ema = before;
        // Poison past the end: the kernel must stop at count.
        ema.push_back(123.0f);
        lerpRange(ema.data(), src.data(), type, n, w);
        ASSERT_EQ(ema[n], 123.0f);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double e = before[i], x = src.asFloat[i];
          const double exact = e + double(w) * (x - e);
          if (!(std::fabs(ema[i] - exact) <= lerpTolerance(e, x, w))) {
            if (++bad <= 3) {
              ADD_FAILURE() << "type " << int(type) << " n " << n << " w " << w << " i " << i
                            << ": got " << ema[i] << " expected " << exact;
            }
          }
        }
        EXPECT_EQ(bad, 0);
        if (w == 0.0f) {
          EXPECT_TRUE(testing::sameBytes(ema.data(), before.data(), n * sizeof(float)));
        }
      }
    }
  }
}

// The header fixes the fp32 formula exactly; volatile keeps this TU from
// contracting it into an FMA whatever its flags.
TEST(UpdateKernelsTest, LerpIsTheDocumentedFloat32Formula) {
  const int64_t n = 4097;
  for (SourceType type : kSourceTypes) {
    const Source src = makeSource(type, n, 7);
    std::vector<float> ema = makeEma(n, 8);
    const std::vector<float> before = ema;
    const float w = 0.0123f;
    lerpRange(ema.data(), src.data(), type, n, w);
    for (int64_t i = 0; i < n; ++i) {
      volatile float d = src.asFloat[i] - before[i];
      volatile float m = w * d;
      const float expected = before[i] + m;
      ASSERT_EQ(bitsOf(ema[i]), bitsOf(expected)) << "type " << int(type) << " i " << i;
    }
  }
}

// kSkip and kCopyRaw are run above the kernels; a span carrying one is
// refused, not taken for a copy, and the EMA is left as it was.
TEST(UpdateKernelsTest, SkipAndRawCopySpansAreRefused) {
  float ema[4] = {1, 2, 3, 4};
  const float src[4] = {9, 9, 9, 9};
  for (UpdateOp op : {UpdateOp::kSkip, UpdateOp::kCopyRaw}) {
    const std::vector<UpdateSpan> spans = {{ema, src, SourceType::kFloat32, 4, op}};
    EXPECT_THROW(updateSpans(spans, 0.5f), c10::ValueError);
    MultiUpdateSpan multi;
    multi.emas = {ema};
    multi.src = src;
    multi.count = 4;
    multi.op = op;
    EXPECT_THROW(updateSpansMulti({multi}, {0.5f}), c10::ValueError);
  }
  EXPECT_EQ(ema[0], 1.0f);
  EXPECT_EQ(ema[3], 4.0f);
}

TEST(UpdateKernelsTest, CopyConvertsExactly) {
  for (SourceType type : kSourceTypes) {
    for (int64_t n : kSizes) {
      const Source src = makeSource(type, n, 3000 + n);
      std::vector<float> ema(n + 1, -5.0f);
      copyRange(ema.data(), src.data(), type, n);
      EXPECT_TRUE(testing::sameBytes(ema.data(), src.asFloat.data(), n * sizeof(float)))
          << "type " << int(type) << " n " << n;
      EXPECT_EQ(ema[n], -5.0f);
    }
  }
}

// Every 16-bit pattern (normals, subnormals, +-0, +-inf, every NaN) against
// c10's converters, bit for bit; then lerp on the same values.
void checkAllPatterns(SourceType type) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < all.size(); ++i) {
    all[i] = static_cast<uint16_t>(i);
  }
  std::vector<float> reference(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    reference[i] = type == SourceType::kBFloat16
                       ? static_cast<float>(c10::BFloat16(all[i], c10::BFloat16::from_bits()))
                       : static_cast<float>(c10::Half(all[i], c10::Half::from_bits()));
  }
  std::vector<float> copied(all.size());
  copyRange(copied.data(), all.data(), type, static_cast<int64_t>(all.size()));
  // One element per call: forces the scalar software conversion even where
  // the bulk of a long call takes a hardware (F16C) path.
  std::vector<float> single(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    copyRange(&single[i], &all[i], type, 1);
  }
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(bitsOf(copied[i]), bitsOf(reference[i])) << "pattern 0x" << std::hex << i;
    ASSERT_EQ(bitsOf(single[i]), bitsOf(reference[i])) << "pattern 0x" << std::hex << i;
  }
  std::vector<float> ema(all.size(), 0.75f), emaSingle(all.size(), 0.75f);
  const float w = 0.25f;
  lerpRange(ema.data(), all.data(), type, static_cast<int64_t>(all.size()), w);
  for (size_t i = 0; i < all.size(); ++i) {
    lerpRange(&emaSingle[i], &all[i], type, 1, w);
  }
  for (size_t i = 0; i < all.size(); ++i) {
    const float expected = 0.75f + w * (reference[i] - 0.75f);
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(ema[i]) && std::isnan(emaSingle[i])) << "pattern 0x" << std::hex << i;
    } else {
      ASSERT_EQ(bitsOf(ema[i]), bitsOf(expected)) << "pattern 0x" << std::hex << i;
      ASSERT_EQ(bitsOf(emaSingle[i]), bitsOf(expected)) << "pattern 0x" << std::hex << i;
    }
  }
}

TEST(UpdateKernelsTest, BFloat16AllBitPatterns) { checkAllPatterns(SourceType::kBFloat16); }

TEST(UpdateKernelsTest, Float16AllBitPatterns) { checkAllPatterns(SourceType::kFloat16); }

// IEEE 754 binary16 decoded from its definition, independent of c10 and of
// the kernel's bit tricks. NaNs: quiet, payload kept (what F16C produces).
uint32_t halfBitsToFloatBitsByDefinition(uint16_t h) {
  const bool negative = (h & 0x8000) != 0;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  float value;
  if (exponent == 31) {
    if (mantissa != 0) {
      return (negative ? 0x80000000u : 0u) | 0x7fc00000u | (uint32_t(mantissa) << 13);
    }
    value = std::numeric_limits<float>::infinity();
  } else if (exponent == 0) {
    value = std::ldexp(float(mantissa), -24);
  } else {
    value = std::ldexp(1.0f + float(mantissa) / 1024.0f, exponent - 15);
  }
  return bitsOf(negative ? -value : value);
}

TEST(UpdateKernelsTest, Float16MatchesTheDefinition) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < all.size(); ++i) {
    all[i] = static_cast<uint16_t>(i);
  }
  std::vector<float> copied(all.size());
  copyRange(copied.data(), all.data(), SourceType::kFloat16, static_cast<int64_t>(all.size()));
  for (uint32_t i = 0; i < all.size(); ++i) {
    float single;
    copyRange(&single, &all[i], SourceType::kFloat16, 1);
    ASSERT_EQ(bitsOf(copied[i]), halfBitsToFloatBitsByDefinition(all[i])) << std::hex << i;
    ASSERT_EQ(bitsOf(single), halfBitsToFloatBitsByDefinition(all[i])) << std::hex << i;
  }
}

// Hand-written expectations, independent of c10, for the values that
// conversions get wrong most often.
TEST(UpdateKernelsTest, SpecialValuesByHand) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<uint16_t> half = {0x0001, 0x03ff, 0x0400, 0x8000,
                                      0x7c00, 0xfc00, 0x3c00, 0x7bff};
  const std::vector<float> halfExpected = {std::ldexp(1.0f, -24),
                                           std::ldexp(1023.0f, -24),
                                           std::ldexp(1.0f, -14),
                                           -0.0f,
                                           inf,
                                           -inf,
                                           1.0f,
                                           65504.0f};
  std::vector<float> out(half.size());
  copyRange(out.data(), half.data(), SourceType::kFloat16, static_cast<int64_t>(half.size()));
  for (size_t i = 0; i < half.size(); ++i) {
    EXPECT_EQ(bitsOf(out[i]), bitsOf(halfExpected[i])) << "half 0x" << std::hex << half[i];
  }
  const std::vector<uint16_t> bf = {0x0001, 0x8000, 0x7f80, 0xff80, 0x3f80, 0x0080};
  const std::vector<float> bfExpected = {std::ldexp(1.0f, -133), -0.0f, inf, -inf, 1.0f,
                                         std::ldexp(1.0f, -126)};
  out.resize(bf.size());
  copyRange(out.data(), bf.data(), SourceType::kBFloat16, static_cast<int64_t>(bf.size()));
  for (size_t i = 0; i < bf.size(); ++i) {
    EXPECT_EQ(bitsOf(out[i]), bitsOf(bfExpected[i])) << "bf16 0x" << std::hex << bf[i];
  }
  // NaNs: quiet (7e00) and signalling (7d00) halves both become quiet NaNs
  // with the payload kept, like F16C; bf16 widening keeps the bits.
  const std::vector<uint16_t> nans = {0x7e00, 0x7d00, 0xfe01};
  out.resize(nans.size());
  copyRange(out.data(), nans.data(), SourceType::kFloat16, 3);
  EXPECT_EQ(bitsOf(out[0]), 0x7fc00000u);
  EXPECT_EQ(bitsOf(out[1]), 0x7fe00000u);
  EXPECT_EQ(bitsOf(out[2]), 0xffc02000u);
  copyRange(out.data(), nans.data(), SourceType::kBFloat16, 3);
  EXPECT_EQ(bitsOf(out[1]), 0x7d000000u);
}

// Many spans of mixed type, op and size (zeros included), laid out in
// separate buffers; returns the EMAs after one updateSpans.
struct SpanSet {
  std::vector<Source> sources;
  std::vector<std::vector<float>> emas;
  std::vector<UpdateSpan> spans;
};

SpanSet makeSpanSet(uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  SpanSet set;
  set.sources.reserve(count);
  set.emas.reserve(count);
  for (int i = 0; i < count; ++i) {
    const SpanShape shape = randomSpanShape(rng, i, 5000);
    set.sources.push_back(makeSource(shape.type, shape.count, seed + i));
    set.emas.push_back(makeEma(shape.count, seed + 100000 + i));
    set.spans.push_back(
        {set.emas.back().data(), set.sources.back().data(), shape.type, shape.count, shape.op});
  }
  return set;
}

TEST(UpdateKernelsTest, UpdateSpansMatchesPerSpanKernels) {
  SpanSet set = makeSpanSet(11, 60);
  SpanSet expected = makeSpanSet(11, 60);
  updateSpans(set.spans, 0.3f);
  for (const UpdateSpan& s : expected.spans) {
    if (s.op == UpdateOp::kLerp) {
      lerpRange(s.ema, s.src, s.type, s.count, 0.3f);
    } else {
      copyRange(s.ema, s.src, s.type, s.count);
    }
  }
  EXPECT_EQ(set.emas, expected.emas);
}

TEST(UpdateKernelsTest, ResultIndependentOfThreadsAndGrain) {
  SpanSet serial = makeSpanSet(21, 200);
  updateSpans(serial.spans, 0.01f);
  for (int threads : {0, 1, 3}) {
    offload::WorkerPool pool(threads);
    for (int64_t grain : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{1} << 15}) {
      SpanSet split = makeSpanSet(21, 200);
      offload::updateOnPool(pool, split.spans, 0.01f, grain);
      // Bitwise, NaN-safe: vectors of float compare with ==, but the data
      // has no NaNs, so == is bit equality up to the sign of zero; memcmp
      // closes that gap.
      for (size_t i = 0; i < split.emas.size(); ++i) {
        ASSERT_TRUE(testing::sameBytes(split.emas[i].data(), serial.emas[i].data(),
                                       split.emas[i].size() * sizeof(float)))
            << "threads " << threads << " grain " << grain << " span " << i;
      }
    }
  }
}

// Threads handed disjoint ranges of the spans laid end to end share one
// call's work; any cut gives the serial result bit for bit.
TEST(UpdateKernelsTest, RangesOfTheSpansAddUpToTheWholeUpdate) {
  SpanSet serial = makeSpanSet(31, 80);
  updateSpans(serial.spans, 0.01f);
  const int64_t total = totalElements(serial.spans);
  for (int64_t cuts : {int64_t{2}, int64_t{3}, int64_t{17}}) {
    SpanSet split = makeSpanSet(31, 80);
    // Ranges beyond the end are clipped: the last one says kAllElements.
    for (int64_t c = 0; c < cuts; ++c) {
      updateSpans(split.spans, 0.01f, total * c / cuts,
                  c + 1 == cuts ? kAllElements : total * (c + 1) / cuts);
    }
    for (size_t i = 0; i < split.emas.size(); ++i) {
      ASSERT_TRUE(testing::sameBytes(split.emas[i].data(), serial.emas[i].data(),
                                     split.emas[i].size() * sizeof(float)))
          << cuts << " cuts, span " << i;
    }
  }
}

TEST(UpdateKernelsTest, UpdateSpansEmptyInputs) {
  updateSpans({}, 0.5f);
  std::vector<UpdateSpan> zeros(5);  // null pointers, count 0: never touched
  offload::WorkerPool pool(2);
  offload::updateOnPool(pool, zeros, 0.5f, 1);
}

TEST(UpdateKernelsTest, UpdateSpansRejectsBadArguments) {
  std::vector<UpdateSpan> spans(1);
  EXPECT_THROW(updateSpans(spans, 0.5f, -1), c10::ValueError);
  offload::WorkerPool pool(1);
  EXPECT_THROW(offload::updateOnPool(pool, spans, 0.5f, 0), c10::ValueError);
  spans[0].count = -1;
  EXPECT_THROW(updateSpans(spans, 0.5f), c10::ValueError);
}

}  // namespace
}  // namespace shardema::testing
