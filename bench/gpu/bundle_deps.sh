#!/usr/bin/env bash
# Packs the build dependencies that a bare GPU machine lacks (GoogleTest,
# nlohmann-json, Boost headers, xxhash) from this Debian machine's -dev
# packages into DEST/deps.tar.gz, in the /usr layout their CMake configs
# expect, for bench/gpu/run.sh to unpack there (about 20 MB).
#   bash bench/gpu/bundle_deps.sh [DEST]   (default: <repo>/.gpu-deps)
# DEST should be git-ignored, e.g. echo /.gpu-deps/ >> .git/info/exclude.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$repo/.gpu-deps}
arch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
lib=usr/lib/$arch
paths=(
  usr/include/boost "$lib/cmake/Boost-1.74.0" "$lib/cmake/boost_headers-1.74.0"
  "$lib/cmake/BoostDetectToolset-1.74.0.cmake"
  usr/include/nlohmann usr/share/cmake/nlohmann_json
  usr/include/gtest usr/include/gmock "$lib/cmake/GTest"
  "$lib/libgtest.a" "$lib/libgtest_main.a" "$lib/libgmock.a" "$lib/libgmock_main.a"
  usr/include/xxhash.h "$lib/libxxhash.a"
)
for p in "${paths[@]}"; do
  [[ -e /$p ]] || { echo "bundle_deps.sh: /$p is missing (run scripts/install_deps.sh)" >&2; exit 1; }
done
mkdir -p "$dest"
tar -C / -czf "$dest/deps.tar.gz" "${paths[@]}"
echo "bundle_deps.sh: wrote $dest/deps.tar.gz ($(du -h "$dest/deps.tar.gz" | cut -f1))"
