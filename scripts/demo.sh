#!/usr/bin/env bash
# Installs what is missing, builds Release and runs the demo training.
# Extra arguments go to the demo (try --help).
source "$(dirname "$0")/common.sh"
bash "$repo_root/scripts/install_deps.sh"
build="$repo_root/build/release"
configure "$build" -DSHARDEMA_BUILD_EXAMPLES=ON
cmake --build "$build" -j "$jobs" --target ema_demo
"$build/examples/ema_demo" --out "${SHARDEMA_DEMO_OUT:-$repo_root/out/demo}" "$@"
