#!/usr/bin/env bash
# Installs the built tree into a temp prefix, builds tests/install/consumer
# against it with find_package(shardema) and runs it.
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
"$work/consumer/consumer"
