// The multi-profile kernels (post-hoc EMA: k profiles of one source in
// one pass) against k single-profile passes, bit for bit, and a float64
// recomputation.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/kernel_test_data.h"
#include "shardema/core/update_kernels.h"
#include "shardema/offload/parallel_update.h"
#include "shardema/offload/worker_pool.h"
#include "support/same_bytes.h"

namespace shardema::testing {
namespace {

// --- Several profiles in one pass -----------------------------------------

const int kProfileCounts[] = {1, 2, 3, 5, 16};
// 0, 1, odd tails, exactly and just past the kernel's 2048-element block,
// and several blocks with a ragged end.
const int64_t kMultiSizes[] = {0, 1, 7, 2047, 2048, 2049, 4097, 100003};

// k distinct weights in (0, 1], 1 included, so every profile differs.
std::vector<float> profileWeights(int k) {
  std::vector<float> w(k);
  for (int p = 0; p < k; ++p) {
    w[p] = p + 1 == k ? 1.0f : std::ldexp(1.0f, -(p + 1)) * (1.0f + 0.1f * p);
  }
  return w;
}

std::vector<float*> pointersTo(std::vector<std::vector<float>>& emas) {
  std::vector<float*> out;
  for (std::vector<float>& e : emas) {
    out.push_back(e.data());
  }
  return out;
}

TEST(UpdateKernelsMultiTest, LerpMultiMatchesSeparatePassesBitwise) {
  for (SourceType type : kSourceTypes) {
    for (int64_t n : kMultiSizes) {
      const Source src = makeSource(type, n, 5000 + n);
      for (int k : kProfileCounts) {
        const std::vector<float> w = profileWeights(k);
        std::vector<std::vector<float>> before, multi, separate;
        for (int p = 0; p < k; ++p) {
          before.push_back(makeEma(n, 6000 + 31 * n + p));
          before.back().push_back(-77.0f);  // poison past the end
        }
        multi = separate = before;
        std::vector<float*> ptrs = pointersTo(multi);
        lerpRangeMulti(ptrs.data(), w.data(), k, src.data(), type, n);
        for (int p = 0; p < k; ++p) {
          lerpRange(separate[p].data(), src.data(), type, n, w[p]);
        }
        for (int p = 0; p < k; ++p) {
          ASSERT_TRUE(testing::sameBytes(multi[p].data(), separate[p].data(), n * sizeof(float)))
              << "type " << int(type) << " n " << n << " k " << k << " profile " << p;
          ASSERT_EQ(multi[p][n], -77.0f) << "wrote past count: k " << k << " profile " << p;
          int64_t bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            const double e = before[p][i], x = src.asFloat[i];
            const double exact = e + double(w[p]) * (x - e);
            // The bound the single-profile test uses, which is at most
            // 2.5 ulp of the operands; additionally within 1e-6 relative.
            const double err = std::fabs(multi[p][i] - exact);
            if (!(err <= lerpTolerance(e, x, w[p]) &&
                  err <= 1e-6 * std::max(std::fabs(e), std::fabs(x)))) {
              if (++bad <= 3) {
                ADD_FAILURE() << "type " << int(type) << " n " << n << " k " << k << " p " << p
                              << " i " << i << ": got " << multi[p][i] << " expected " << exact;
              }
            }
          }
          EXPECT_EQ(bad, 0);
        }
      }
    }
  }
}

TEST(UpdateKernelsMultiTest, CopyMultiMatchesCopyRange) {
  for (SourceType type : kSourceTypes) {
    for (int64_t n : kMultiSizes) {
      const Source src = makeSource(type, n, 7000 + n);
      std::vector<float> single(n);
      copyRange(single.data(), src.data(), type, n);
      for (int k : kProfileCounts) {
        std::vector<std::vector<float>> emas(k, std::vector<float>(n + 1, -3.0f));
        std::vector<float*> ptrs = pointersTo(emas);
        copyRangeMulti(ptrs.data(), k, src.data(), type, n);
        for (int p = 0; p < k; ++p) {
          ASSERT_TRUE(testing::sameBytes(emas[p].data(), single.data(), n * sizeof(float)))
              << "type " << int(type) << " n " << n << " k " << k << " profile " << p;
          ASSERT_EQ(emas[p][n], -3.0f);
        }
      }
    }
  }
}

// Spans of mixed type, op and size with k profiles each, in their own buffers.
struct MultiSpanSet {
  std::vector<Source> sources;
  std::vector<std::vector<std::vector<float>>> emas;  // [span][profile]
  std::vector<MultiUpdateSpan> spans;
};

MultiSpanSet makeMultiSpanSet(uint64_t seed, int count, int k) {
  std::mt19937_64 rng(seed);
  MultiSpanSet set;
  set.sources.reserve(count);
  set.emas.reserve(count);
  for (int i = 0; i < count; ++i) {
    const SpanShape shape = randomSpanShape(rng, i, 9000);
    set.sources.push_back(makeSource(shape.type, shape.count, seed + i));
    set.emas.emplace_back();
    for (int p = 0; p < k; ++p) {
      set.emas.back().push_back(makeEma(shape.count, seed + 100000 + 50 * i + p));
    }
    MultiUpdateSpan span;
    span.emas = pointersTo(set.emas.back());
    span.src = set.sources.back().data();
    span.type = shape.type;
    span.count = shape.count;
    span.op = shape.op;
    set.spans.push_back(span);
  }
  return set;
}

TEST(UpdateKernelsMultiTest, UpdateSpansMultiMatchesSingleProfileSpans) {
  for (int k : {1, 3, 16}) {
    const std::vector<float> w = profileWeights(k);
    MultiSpanSet multi = makeMultiSpanSet(41, 40, k);
    MultiSpanSet separate = makeMultiSpanSet(41, 40, k);
    updateSpansMulti(multi.spans, w);
    for (int p = 0; p < k; ++p) {
      std::vector<UpdateSpan> single;
      for (const MultiUpdateSpan& m : separate.spans) {
        single.push_back({m.emas[p], m.src, m.type, m.count, m.op});
      }
      updateSpans(single, w[p]);
    }
    EXPECT_EQ(multi.emas, separate.emas) << "k " << k;
  }
}

TEST(UpdateKernelsMultiTest, UpdateSpansMultiIndependentOfThreadsAndGrain) {
  const int k = 5;
  const std::vector<float> w = profileWeights(k);
  MultiSpanSet serial = makeMultiSpanSet(51, 120, k);
  updateSpansMulti(serial.spans, w);
  offload::WorkerPool pool(2);
  for (int64_t grain : {int64_t{1}, int64_t{7}, int64_t{3000}, int64_t{1} << 15}) {
    MultiSpanSet split = makeMultiSpanSet(51, 120, k);
    offload::updateOnPool(pool, split.spans, w, grain);
    for (size_t s = 0; s < split.emas.size(); ++s) {
      for (int p = 0; p < k; ++p) {
        ASSERT_TRUE(testing::sameBytes(split.emas[s][p].data(), serial.emas[s][p].data(),
                                       split.emas[s][p].size() * sizeof(float)))
            << "grain " << grain << " span " << s << " profile " << p;
      }
    }
  }
}

TEST(UpdateKernelsMultiTest, MultiRejectsBadArguments) {
  std::vector<float> ema(4, 0.0f), src(4, 1.0f);
  std::vector<float*> ptrs(kMaxProfiles + 1, ema.data());
  std::vector<float> w(kMaxProfiles + 1, 0.5f);
  for (int bad : {0, kMaxProfiles + 1}) {
    EXPECT_THROW(lerpRangeMulti(ptrs.data(), w.data(), bad, src.data(), SourceType::kFloat32, 4),
                 c10::ValueError);
    EXPECT_THROW(copyRangeMulti(ptrs.data(), bad, src.data(), SourceType::kFloat32, 4),
                 c10::ValueError);
  }
  try {
    lerpRangeMulti(ptrs.data(), w.data(), 17, src.data(), SourceType::kFloat32, 4);
    ADD_FAILURE() << "no throw";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("numEmas"), std::string::npos) << e.what();
  }
  std::vector<float> ema2(4, 0.0f);
  MultiUpdateSpan span;
  span.emas = {ema.data(), ema2.data()};
  span.src = src.data();
  span.count = 4;
  EXPECT_THROW(updateSpansMulti({span}, {0.5f}), c10::ValueError);
  EXPECT_THROW(updateSpansMulti({span}, {0.5f, 0.25f, 0.125f}), c10::ValueError);
  EXPECT_THROW(updateSpansMulti({}, {}), c10::ValueError);
  EXPECT_THROW(updateSpansMulti({span}, std::vector<float>(kMaxProfiles + 1, 0.5f)),
               c10::ValueError);
  EXPECT_THROW(updateSpansMulti({span}, {0.5f, 0.25f}, -1), c10::ValueError);
  span.count = -1;
  EXPECT_THROW(updateSpansMulti({span}, {0.5f, 0.25f}), c10::ValueError);
  span.count = 4;
  updateSpansMulti({span}, {0.5f, 0.25f});  // the valid call goes through
  EXPECT_EQ(ema[0], 0.5f);
  EXPECT_EQ(ema2[0], 0.25f);
}

}  // namespace
}  // namespace shardema::testing
