#!/usr/bin/env bash
# Installs the built tree into a temp prefix, runs the installed CLI with no
# LD_LIBRARY_PATH (it finds LibTorch through its RUNPATH), then builds
# tests/install/consumer against the prefix with find_package(shardema) and
# runs it. ctest passes on the consumer's last line, so every check before
# it stops the script on failure.
#   run_install_test.sh <shardema build dir>
set -euo pipefail
build=${1:?usage: run_install_test.sh <build dir>}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$here/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer" >/dev/null
test -x "$work/prefix/bin/shardema" || { echo "shardema CLI not installed"; exit 1; }
help=$(env -u LD_LIBRARY_PATH "$work/prefix/bin/shardema" --help 2>&1) ||
  { echo "the installed shardema --help failed: $help"; exit 1; }
[[ "$help" == usage:* ]] || { echo "the installed shardema --help printed: $help"; exit 1; }
echo "installed CLI starts: ${help%%$'\n'*}"
env -u LD_LIBRARY_PATH "$work/consumer/consumer"
