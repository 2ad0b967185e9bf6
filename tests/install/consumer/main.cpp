// Uses the installed headers and libraries: one Averager update by hand.
#include <ATen/ops/full.h>

#include <cstdio>

#include "shardema/averager.h"

int main() {
  at::Tensor weight = at::full({4}, 1.0);
  shardema::ConstantScheduleOptions constant;
  constant.decay = 0.75;
  shardema::AveragerOptions options;
  options.schedule = shardema::DecaySchedule::constant(constant);
  shardema::Averager averager({{"weight", weight, shardema::TrackRole::kAverage}}, options);
  averager.update(1);  // copy: 1; returns at once
  averager.fence();    // the sources may change from here on
  weight.fill_(5.0);
  averager.update(2);  // 0.75 * 1 + 0.25 * 5 = 2
  std::printf("consumer ema %.3f\n", averager.ema("weight")[0].item<float>());
  return averager.ema("weight")[0].item<float>() == 2.0f ? 0 : 1;
}
