// WeightSwap, the one swap of every lifecycle: raw values back in host
// memory, a second swap into the same memory (a view of it too) refused
// naming the holder, an Averager update reading swapped memory refused
// (the a.update() inside b.swap() of issue 32), checkModelWritable, and
// the destructor's restore.
#include "shardema/weight_swap.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "shardema/averager.h"

namespace shardema {
namespace {

std::string errorOf(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return std::string();
}

TEST(WeightSwapTest, WritesTheValuesAndPutsTheRawOnesBack) {
  at::Tensor w = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor counter = at::full({2}, 7, at::kLong);
  const at::Tensor rawW = w.clone();
  {
    WeightSwap swap({{"w", w}, {"n", counter}}, "test");
    swap.write({{"w", at::ones({12})}});  // flat values take the target's shape
    EXPECT_TRUE(at::equal(w, at::ones({3, 4})));
    EXPECT_TRUE(at::equal(counter, at::full({2}, 7, at::kLong))) << "not named: kept";
    EXPECT_NE(errorOf([&] { swap.write({{"w", at::ones({5})}}); })
                  .find("test: the EMA of 'w' has 5 elements but the model's tensor 12"),
              std::string::npos);
    swap.restore();
    EXPECT_TRUE(swap.restored());
    EXPECT_TRUE(at::equal(w, rawW));
    swap.restore();  // idempotent
  }
  EXPECT_FALSE(swappedInBy(w).has_value());
}

TEST(WeightSwapTest, TheDestructorPutsTheRawValuesBack) {
  at::Tensor w = at::arange(8, at::kFloat);
  const at::Tensor raw = w.clone();
  {
    WeightSwap swap({{"w", w}}, "test");
    swap.write({{"w", at::ones({8})}});
  }
  EXPECT_TRUE(at::equal(w, raw));
}

TEST(WeightSwapTest, ASecondSwapIntoTheSameMemoryIsRefusedNamingTheHolder) {
  at::Tensor w = at::arange(100, at::kFloat);
  WeightSwap first({{"w", w}}, "EmaCallback");
  // A row view of it (DDP's shard of the parameter): the same memory.
  const std::string message =
      errorOf([&] { WeightSwap second({{"rows", w.narrow(0, 50, 50)}}, "PostHocCallback"); });
  EXPECT_NE(message.find("PostHocCallback: cannot swap the EMA into 'rows': EmaCallback has its "
                         "EMA swapped into it (as 'w'); swaps do not nest"),
            std::string::npos)
      << message;
  // Disjoint memory is fine, and the refused swap registered nothing.
  at::Tensor other = at::zeros_like(w);
  { WeightSwap third({{"other", other}}, "PostHocCallback"); }
  first.restore();
  { WeightSwap fourth({{"rows", w.narrow(0, 50, 50)}}, "PostHocCallback"); }
}

TEST(WeightSwapTest, AnUpdateReadingSwappedMemoryIsRefusedAndTheAveragerGoesOn) {
  at::Tensor w = at::arange(64, at::kFloat);
  AveragerOptions options;
  options.offload.engine = offload::EngineChoice::kHost;
  Averager a({{"w", w, TrackRole::kAverage}}, options);
  a.update(1);
  a.wait();
  {
    WeightSwap swap({{"model.w", w}}, "shardema.EMA");  // b's swap into the same model
    swap.write({{"model.w", at::full({64}, -5.0f)}});
    const std::string message = errorOf([&] { a.update(2); });
    EXPECT_NE(message.find("Averager::update: tensor 'w' holds the EMA weights shardema.EMA "
                           "swapped in"),
              std::string::npos)
        << message;
    EXPECT_FALSE(a.failed());
    EXPECT_EQ(a.step(), 1) << "the refused step was not taken";
  }
  EXPECT_TRUE(a.update(2));
  a.wait();
  EXPECT_TRUE(at::equal(a.ema("w"), at::arange(64, at::kFloat))) << "never averaged -5";
}

TEST(WeightSwapTest, AWriteForGoodIsRefusedWhereASwapHoldsTheTensor) {
  at::Tensor w = at::arange(10, at::kFloat);
  EXPECT_NO_THROW(checkModelWritable({{"w", w}}, "copy_to"));
  WeightSwap swap({{"w", w}}, "EmaCallback");
  const std::string message = errorOf([&] { checkModelWritable({{"w", w}}, "copy_to"); });
  EXPECT_NE(message.find("copy_to: 'w' holds the EMA weights EmaCallback swapped in"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace shardema
