#!/usr/bin/env bash
# Builds and runs the tests under sanitizers.
#   scripts/sanitize.sh address,undefined   every test suite but the
#                                           layering and docs checks
#   scripts/sanitize.sh thread              the suites labelled concurrency
source "$(dirname "$0")/common.sh"
kind=${1:?usage: sanitize.sh address,undefined|thread}
bash "$repo_root/scripts/install_deps.sh"
build="$repo_root/build/sanitize-${kind//,/-}"
# -O1 -g1: what the sanitizers' docs recommend, with line tables enough for
# their reports; against -O2 -g it halves the compile time of a LibTorch TU
# (30 s -> 17 s measured here), which is most of CI.
configure "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDEMA_SANITIZE="$kind" \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DSHARDEMA_BUILD_BENCHMARKS=OFF -DSHARDEMA_BUILD_EXAMPLES=OFF -DSHARDEMA_INSTALL=OFF \
  -DSHARDEMA_BUILD_PYTHON=OFF
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# LibTorch keeps process-lifetime allocations LeakSanitizer would report.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
if [[ "$kind" == thread ]]; then
  cmake --build "$build" -j "$jobs" --target concurrency_suites
  cd "$build" && ctest -j "$jobs" -L concurrency --output-on-failure
else
  cmake --build "$build" -j "$jobs"
  # layering and docs check includes and paths, the same in every build:
  # the Release stage runs them; here they would only recompile probes.
  cd "$build" && ctest -j "$jobs" --output-on-failure -LE '^(layering|docs)$'
fi
