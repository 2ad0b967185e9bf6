#!/usr/bin/env bash
# Builds the fuzz targets (tests/fuzz/: the safetensors header parser and
# the manifest parser) with clang's libFuzzer, ASan and UBSan in build-fuzz/,
# then fuzzes each in turn.
# Usage: scripts/fuzz.sh [SECONDS]   each target SECONDS / 2 (default 60 in
#                                    all: CI's short run)
#        scripts/fuzz.sh --long      each target 5 minutes and at least
#                                    1 M executions (more time if needed)
# Exit status is nonzero if the build fails or a fuzzer finds a crash; the
# crashing input is left in build-fuzz/artifacts/. Copy it into
# tests/data/fuzz_regressions/ (header) or tests/data/fuzz_regressions/manifest/
# (manifest) once fixed, so the regression tests replay it in every build.
set -euo pipefail

long=0
seconds=60
case "${1:-}" in
  --long) long=1 ;;
  "") ;;
  *) seconds="$1" ;;
esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${root}/build-fuzz"
cxx="${CXX_FUZZ:-$(command -v clang++-14 || command -v clang++)}"

bash "${root}/scripts/install_deps.sh"
venv=${SHARDEMA_VENV:-$root/.venv}
torch_dir=$("${venv}/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) ||
  { echo "fuzz.sh: ${venv}/bin/python cannot import torch (run scripts/install_deps.sh)" >&2; exit 1; }
cmake -S "${root}/tests/fuzz" -B "${build}" -DCMAKE_CXX_COMPILER="${cxx}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDEMA_TORCH_PACKAGE_DIR="${torch_dir}" >/dev/null
cmake --build "${build}" -j2

# fuzz TARGET SEED_DIR DICT: into a scratch copy of the seed corpus (new
# inputs the fuzzer keeps stay out of the source tree). -rss_limit_mb: a
# parser may legitimately hold a header of up to 100 MiB (a manifest of up
# to 64 MiB) plus its DOM; more than 2 GiB is a bug worth reporting.
fuzz() {
  local target=$1 seeds=$2 dict=$3 corpus="${build}/corpus_$1"
  mkdir -p "${corpus}" "${build}/artifacts"
  cp -n "${seeds}/"* "${corpus}/"
  local budget=(-max_total_time="$((seconds / 2))")
  if [[ "$long" == 1 ]]; then
    # 5 minutes, then on (up to an hour) until 1 M executions are done.
    budget=(-max_total_time=300)
  fi
  "${build}/${target}" "${corpus}" -dict="${dict}" "${budget[@]}" -max_len=65536 -timeout=10 \
    -rss_limit_mb=2048 -artifact_prefix="${build}/artifacts/${target}-" -print_final_stats=1 \
    2>&1 | tee "${build}/${target}.log"
  local runs
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "${build}/${target}.log" | tail -1)
  echo "fuzz.sh: ${target}: ${runs:-?} executions"
  if [[ "$long" == 1 && "${runs:-0}" -lt 1000000 ]]; then
    "${build}/${target}" "${corpus}" -dict="${dict}" -runs=$((1000000 - runs)) -max_len=65536 \
      -timeout=10 -rss_limit_mb=2048 -artifact_prefix="${build}/artifacts/${target}-" \
      -print_final_stats=1
  fi
}

fuzz safetensors_header_fuzz "${root}/tests/fuzz/corpus" "${root}/tests/fuzz/safetensors.dict"
fuzz manifest_fuzz "${root}/tests/fuzz/manifest_corpus" "${root}/tests/fuzz/manifest.dict"
