#pragma once
// Steps are 1-based everywhere (the first optimizer step is n = 1): the one
// check and message the schedules and the power function share.
#include <c10/util/Exception.h>

#include <cstdint>

namespace shardema::detail {

inline void checkStep(const char* api, int64_t n) {
  TORCH_CHECK_VALUE(n >= 1, api, ": n (", n,
                    ") must be >= 1; steps are 1-based (the first optimizer step is n = 1)");
}

}  // namespace shardema::detail
