#!/usr/bin/env bash
# Installs what is missing, builds Release with tests and runs every test.
source "$(dirname "$0")/common.sh"
bash "$repo_root/scripts/install_deps.sh"
build="$repo_root/build/release"
configure "$build" -DSHARDEMA_BUILD_TESTS=ON -DSHARDEMA_BUILD_BENCHMARKS=ON -DSHARDEMA_BUILD_EXAMPLES=ON
cmake --build "$build" -j "$jobs"
cd "$build"
ctest -j "$jobs" --output-on-failure
