// at::Tensor front of the update kernels: results against ATen's own
// float64 arithmetic and dtype conversions, and every validation error.
#include "shardema/core/tensor_update.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "shardema/offload/parallel_update.h"
#include "shardema/offload/worker_pool.h"

namespace shardema {
namespace {

const at::ScalarType kDtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};

// Runs f and checks it throws E whose message contains every substring.
template <typename E, typename F>
void expectError(F f, const std::vector<std::string>& substrings) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one mentioning " << substrings.front();
  } catch (const E& e) {
    const std::string what = e.what();
    for (const std::string& s : substrings) {
      EXPECT_NE(what.find(s), std::string::npos) << "'" << s << "' not in: " << what;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

at::Tensor randomTensor(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn({n}) * 4.0;
}

TEST(TensorUpdateTest, SourceTypeOf) {
  EXPECT_EQ(sourceTypeOf(at::zeros({1}), "x"), SourceType::kFloat32);
  EXPECT_EQ(sourceTypeOf(at::zeros({1}, at::kBFloat16), "x"), SourceType::kBFloat16);
  EXPECT_EQ(sourceTypeOf(at::zeros({1}, at::kHalf), "x"), SourceType::kFloat16);
  expectError<c10::TypeError>([] { sourceTypeOf(at::zeros({1}, at::kInt), "layer.w"); },
                              {"'layer.w'", "float32, bfloat16 or float16", "Int"});
}

// Same tolerance argument as update_kernels_test.cpp: one fp32 lerp is
// within (1 + 4w) * 2^-24 * max(|ema|, |x|) of the exact value.
TEST(TensorUpdateTest, LerpMatchesFloat64Reference) {
  for (at::ScalarType dtype : kDtypes) {
    for (int64_t n : {0, 1, 7, 4097, 10000000}) {
      const at::Tensor source = randomTensor(n, 10 + n).to(dtype);
      const at::Tensor before = randomTensor(n, 20 + n);
      const double w = 0.001;
      at::Tensor ema = before.clone();
      lerpInto(ema, source, w);
      const at::Tensor e = before.to(at::kDouble), x = source.to(at::kDouble);
      const at::Tensor exact = e + w * (x - e);
      const at::Tensor tol = (1.0 + 4.0 * w) * std::ldexp(1.0, -24) * at::max(e.abs(), x.abs());
      const at::Tensor err = (ema.to(at::kDouble) - exact).abs();
      EXPECT_TRUE(err.le(tol * (1.0 + 1e-6)).all().item<bool>())
          << dtype << " n " << n << " worst excess " << (err - tol).max().item<double>();
    }
  }
}

TEST(TensorUpdateTest, CopyMatchesAtenConversion) {
  for (at::ScalarType dtype : kDtypes) {
    for (int64_t n : {0, 1, 7, 4097, 10000000}) {
      const at::Tensor source = randomTensor(n, 30 + n).to(dtype);
      at::Tensor ema = at::full({n}, -3.0f);
      copyInto(ema, source);
      EXPECT_TRUE(at::equal(ema, source.to(at::kFloat))) << dtype << " n " << n;
    }
  }
}

TEST(TensorUpdateTest, SpecialValuesConvertExactly) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> values = {inf, -inf, nan, -0.0f, 0.0f, 1e-6f, -3e-7f, 1e-40f, 65504.0f};
  const at::Tensor f32 = at::tensor(values);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const at::Tensor source = f32.to(dtype);
    at::Tensor ema = at::zeros({static_cast<int64_t>(values.size())});
    copyInto(ema, source);
    const at::Tensor expected = source.to(at::kFloat);  // ATen's conversion as reference
    // Bit view: NaN == NaN and -0 != +0 here, unlike float comparison.
    EXPECT_TRUE(at::equal(ema.view(at::kInt), expected.view(at::kInt))) << dtype;
    EXPECT_TRUE(std::signbit(ema[3].item<float>())) << dtype << ": -0 lost its sign";
    EXPECT_TRUE(std::isnan(ema[2].item<float>()));
  }
}

TEST(TensorUpdateTest, ResultIndependentOfPoolSize) {
  std::vector<at::Tensor> sources, initial;
  for (int i = 0; i < 300; ++i) {
    const int64_t n = (i * 7919) % 20000;
    sources.push_back(randomTensor(n, 100 + i).to(kDtypes[i % 3]));
    initial.push_back(randomTensor(n, 1000 + i));
  }
  std::vector<at::Tensor> reference;
  for (int threads : {-1, 0, 1, 3}) {
    std::unique_ptr<offload::WorkerPool> pool =
        threads < 0 ? nullptr : std::make_unique<offload::WorkerPool>(threads);
    std::vector<TensorUpdate> updates;
    for (size_t i = 0; i < sources.size(); ++i) {
      updates.push_back({initial[i].clone(), sources[i],
                         i % 5 == 0 ? UpdateOp::kCopy : UpdateOp::kLerp, "t" + std::to_string(i)});
    }
    if (pool) {
      offload::updateOnPool(*pool, spansOf(updates, 0.25), 0.25f);
    } else {
      applyTensorUpdates(updates, 0.25);
    }
    for (size_t i = 0; i < updates.size(); ++i) {
      if (threads < 0) {
        reference.push_back(updates[i].ema);
      } else {
        ASSERT_TRUE(at::equal(updates[i].ema.view(at::kInt), reference[i].view(at::kInt)))
            << "threads " << threads << " tensor " << i;
      }
    }
  }
}

TEST(TensorUpdateTest, NonContiguousSourceSaysPassContiguous) {
  const at::Tensor ema = at::zeros({4, 3});
  const at::Tensor source = at::ones({3, 4}).t();
  expectError<c10::ValueError>(
      [&] {
        applyTensorUpdates({{ema, source, UpdateOp::kLerp, "block.0.w"}}, 0.5);
      },
      {"shardema::applyTensorUpdates", "source of 'block.0.w'", "not contiguous", ".contiguous()"});
  EXPECT_NO_THROW(lerpInto(ema, source.contiguous(), 0.5));
  EXPECT_TRUE(at::equal(ema, at::full({4, 3}, 0.5f)));
}

TEST(TensorUpdateTest, RejectsBadDtypes) {
  const at::Tensor f32 = at::zeros({5});
  expectError<c10::TypeError>([&] { lerpInto(at::zeros({5}, at::kDouble), f32, 0.5); },
                              {"shardema::lerpInto", "ema must be float32", "Double"});
  expectError<c10::TypeError>([&] { lerpInto(at::zeros({5}, at::kBFloat16), f32, 0.5); },
                              {"ema must be float32", "BFloat16"});
  expectError<c10::TypeError>(
      [&] {
        applyTensorUpdates({{f32, at::zeros({5}, at::kLong), UpdateOp::kLerp, "emb"}}, 0.5);
      },
      {"source of 'emb'", "float32, bfloat16 or float16", "Long"});
}

TEST(TensorUpdateTest, RejectsBadShapesDevicesLayouts) {
  const at::Tensor f32 = at::zeros({2, 3});
  expectError<c10::ValueError>(
      [&] {
        applyTensorUpdates({{f32, at::zeros({3, 2}), UpdateOp::kLerp, "fc"}}, 0.5);
      },
      {"shape mismatch", "ema of 'fc'", "[2, 3]", "[3, 2]"});
  expectError<c10::ValueError>([&] { copyInto(f32, at::zeros({6})); }, {"shape mismatch"});
  const at::Tensor meta = at::empty({2, 3}, at::TensorOptions().device(at::kMeta));
  expectError<c10::ValueError>([&] { lerpInto(meta, f32, 0.5); },
                               {"ema must be on the CPU", "meta"});
  expectError<c10::ValueError>([&] { lerpInto(f32, meta, 0.5); }, {"source must be on the CPU"});
  expectError<c10::ValueError>([&] { lerpInto(f32, f32.to_sparse(), 0.5); },
                               {"source must be a dense"});
  expectError<c10::ValueError>(
      [&] {
        lerpInto(at::zeros({3, 2}).t(), f32, 0.5);
      },
      {"ema must be contiguous"});
  expectError<c10::ValueError>([&] { lerpInto(f32, at::Tensor(), 0.5); },
                               {"source is an undefined tensor"});
}

TEST(TensorUpdateTest, RejectsOverlappingMemory) {
  const at::Tensor big = at::zeros({10});
  expectError<c10::ValueError>([&] { lerpInto(big.slice(0, 0, 6), big.slice(0, 4, 10), 0.5); },
                               {"ema and its source overlap"});
  expectError<c10::ValueError>(
      [&] {
        applyTensorUpdates({{big.slice(0, 0, 5), at::ones({5}), UpdateOp::kLerp, "a"},
                            {big.slice(0, 3, 8), at::ones({5}), UpdateOp::kLerp, "b"}},
                           0.5);
      },
      {"ema of 'b' overlaps ema of 'a'"});
  // Touching but disjoint is fine.
  EXPECT_NO_THROW(applyTensorUpdates({{big.slice(0, 0, 5), at::ones({5}), UpdateOp::kLerp, "a"},
                                      {big.slice(0, 5, 10), at::ones({5}), UpdateOp::kCopy, "b"}},
                                     0.5));
  EXPECT_TRUE(at::equal(big.slice(0, 5, 10), at::ones({5})));
}

TEST(TensorUpdateTest, RejectsWeightOutsideUnitInterval) {
  const at::Tensor ema = at::zeros({3}), source = at::ones({3});
  for (double w : {-0.01, 1.01, std::numeric_limits<double>::quiet_NaN()}) {
    expectError<c10::ValueError>([&] { lerpInto(ema, source, w); }, {"weight", "[0, 1]"});
  }
  EXPECT_TRUE(at::equal(ema, at::zeros({3})));
  lerpInto(ema, source, 1.0);
  EXPECT_TRUE(at::equal(ema, source));
}

TEST(TensorUpdateTest, ValidatesAllBeforeTouchingAny) {
  const at::Tensor first = at::zeros({4});
  std::vector<TensorUpdate> updates = {
      {first, at::ones({4}), UpdateOp::kLerp, "ok"},
      {at::zeros({4}), at::ones({5}), UpdateOp::kLerp, "bad"},
  };
  expectError<c10::ValueError>([&] { applyTensorUpdates(updates, 0.5); }, {"'bad'"});
  EXPECT_TRUE(at::equal(first, at::zeros({4}))) << "the valid entry was updated before the error";
}

TEST(TensorUpdateTest, CheckTensorUpdateAcceptsValidPairs) {
  for (at::ScalarType dtype : kDtypes) {
    EXPECT_NO_THROW(
        checkTensorUpdate({at::zeros({2, 2}), at::zeros({2, 2}, dtype), UpdateOp::kCopy, "x"}));
  }
  expectError<c10::ValueError>(
      [] {
        checkTensorUpdate({at::zeros({2}), at::zeros({3}), UpdateOp::kCopy, "x"});
      },
      {"shardema::checkTensorUpdate", "shape mismatch"});
}

}  // namespace
}  // namespace shardema
