#!/usr/bin/env bash
# Builds the safetensors header fuzzer (tests/fuzz/) with clang's libFuzzer,
# ASan and UBSan in build-fuzz/, then fuzzes for SECONDS (default 60).
# Usage: scripts/fuzz.sh [SECONDS]
# Exit status is nonzero if the build fails or the fuzzer finds a crash;
# the crashing input is left in build-fuzz/artifacts/. Copy it into
# tests/data/fuzz_regressions/ once fixed so fuzz_regression_test replays it.
set -euo pipefail

seconds="${1:-60}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${root}/build-fuzz"
cxx="${CXX_FUZZ:-$(command -v clang++-14 || command -v clang++)}"

cmake -S "${root}/tests/fuzz" -B "${build}" -DCMAKE_CXX_COMPILER="${cxx}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "${build}" -j2

# Fuzz into a scratch copy of the seed corpus: new inputs the fuzzer keeps
# stay out of the source tree.
corpus="${build}/corpus"
mkdir -p "${corpus}" "${build}/artifacts"
cp -n "${root}/tests/fuzz/corpus/"* "${corpus}/"

# -rss_limit_mb: the parser may legitimately hold a header of up to 100 MiB
# plus its DOM; more than 2 GiB is a bug worth reporting.
"${build}/safetensors_header_fuzz" "${corpus}" \
  -dict="${root}/tests/fuzz/safetensors.dict" \
  -max_total_time="${seconds}" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="${build}/artifacts/" -print_final_stats=1
