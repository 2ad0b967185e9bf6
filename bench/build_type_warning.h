#pragma once
// Benchmarks of a debug or assertion build describe nothing a user runs:
// say so on stderr and record the build type in the benchmark context.
// SHARDEMA_BUILD_TYPE is defined by bench/CMakeLists.txt.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <string>

namespace shardema::bench {

inline void warnIfUnoptimised(const char* program) {
  const std::string type = SHARDEMA_BUILD_TYPE;
  bool optimised = type == "Release" || type == "RelWithDebInfo" || type == "MinSizeRel";
#ifndef NDEBUG
  optimised = false;
#endif
  benchmark::AddCustomContext("shardema_build_type", type.empty() ? "<none>" : type);
  if (!optimised) {
    std::fprintf(stderr,
                 "WARNING: %s built as '%s' (assertions on or unoptimised): the numbers below do "
                 "not describe a Release build\n",
                 program, type.c_str());
  }
}

}  // namespace shardema::bench
