#!/usr/bin/env bash
# The one GPU call (issue 34): at most 8 minutes on a machine with a CUDA
# device and torch 2.x, archiving under $OUT what it learns as it goes.
#   1. fingerprint, before anything can throw ($OUT/fingerprint.txt): the
#      compiler (CXX, else /usr/bin/g++, else g++ on PATH) and g++ -v, the
#      realpath and kind of its libstdc++; nvidia-smi; sys.version and
#      sysconfig's CC; the LD_*, TORCH_*, CUDA_* environment; the libraries
#      mapped after `import torch`. Stops with one line (exit 4) when the
#      compiler's libstdc++ is newer than the one the process loads.
#   2. builds this repository against that torch's LibTorch with the CUDA
#      engine (build/gpu/tree; SHARDEMA_GPU_TREE=DIR builds the targets in an
#      already configured tree instead), then fingerprints the module:
#      readelf -d, -lW and -V of _C and the libraries mapped after
#      `import torch; import shardema`.
#   3. each kind of C++ exception into Python in its own process
#      (throw_kinds.py), plain, with TORCH_SHOW_CPP_STACKTRACES=1, and one
#      without a device; a kind that kills its process gets a cuda-gdb
#      backtrace.
#   4. with a device: the CUDA-engine tests (must run, not skip), then
#      ema_bench.py, the benchmark against the peers: a tiny run, then the
#      1.3 B model ($OUT/ema_bench.md, .json).
#   5. the error-boundary suite (tests/python/test_error_boundary.py, when
#      present), and the gtest suites offload_tests, offload_concurrency_tests
#      and lib_concurrency_tests in full (no --gtest_brief: a crash names its
#      test).
#   6. with a device: gpu_check, python_check.py, the Python tests. Without:
#      ema_bench.py --tiny on the CPU, then one line naming the GPU-only
#      steps not run, exit 3.
# Every step has a time cap and is skipped, with a line, when what is left
# of the budget (SHARDEMA_GPU_BUDGET_S, default 450 s) cannot hold it.
# Exit: 0 every step ran and passed; 1 a step failed; 2 the machine lacks
# what the build needs; 3 no CUDA device (the steps before it ran and
# passed); 4 the libstdc++ stop. A bare machine without GoogleTest/nlohmann-json/Boost/
# xxhash: run bench/gpu/bundle_deps.sh where scripts/install_deps.sh ran and
# bring <repo>/.gpu-deps (or SHARDEMA_GPU_DEPS, a folder with deps.tar.gz).
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
here=$repo/bench/gpu
build=${SHARDEMA_GPU_BUILD:-$repo/build/gpu}
logs=$build/logs
out=${OUT:-}
python=${PYTHON:-python3}
budget=${SHARDEMA_GPU_BUDGET_S:-450}
mkdir -p "$build" "$logs"
failures=()
begun=$SECONDS

# $OUT brings back 8 files at most: the logs travel as one archive, renewed
# at each step, so that a run cut short still brings back what it did.
save() {
  [[ -n "$out" ]] || return 0
  tar -C "$logs" -czf "$out/gpu_logs.tar.gz" . 2>/dev/null
  for f in fingerprint.txt ema_bench.md ema_bench.json; do
    [[ -f "$logs/$f" ]] && cp "$logs/$f" "$out/$f"
  done
  return 0
}
step() { save; echo; echo "== $* ($((SECONDS - begun)) s)"; }
fail() { echo "FAILED: $*"; failures+=("$*"); }
left() { echo $((budget - (SECONDS - begun))); }
# cap SECONDS [NEED]: the timeout of the next step: SECONDS, or what is left
# of the budget; empty (and a line) when less than NEED (default 20) is left.
cap() {
  local want=$1 need=${2:-20} rest
  rest=$(left)
  if ((rest < need)); then echo "skipped: ${rest} s of the budget left" >&2; return 1; fi
  echo $((want < rest ? want : rest))
}
record() { tee -a "$logs/fingerprint.txt"; }

step "fingerprint"
: >"$logs/fingerprint.txt"
if [[ -n "${CXX:-}" ]]; then
  cxx=$(command -v "$CXX" || echo "$CXX")
elif [[ -x /usr/bin/g++ ]]; then
  cxx=/usr/bin/g++
else
  cxx=$(command -v g++ || command -v c++ || echo g++)
fi
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); host: $(uname -a)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: no nvidia-smi"
  fi
  echo "compiler: $cxx (CXX=${CXX:-unset})"
  "$cxx" -v 2>&1 | sed 's/^/  /'
} | record >/dev/null
timeout 120 "$python" "$here/fingerprint.py" toolchain "$cxx" >>"$logs/fingerprint.txt" 2>&1 ||
  { tail -5 "$logs/fingerprint.txt"; echo "run.sh: $python cannot import torch"; save; exit 2; }
grep -E "^(compiler|sys.version|torch |process libstdc|gpu:)" "$logs/fingerprint.txt"
save
timeout 120 "$python" "$here/fingerprint.py" libstdcxx "$cxx" | record
((PIPESTATUS[0] == 4)) && { save; exit 4; }
has_gpu=$(timeout 60 "$python" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

step "build"
tree=${SHARDEMA_GPU_TREE:-}
if [[ -z "$tree" ]]; then
  tree=$build/tree
  # The toolkit the way FindCUDAToolkit looks for it: nvcc need not be on PATH.
  cuda_root=${CUDAToolkit_ROOT:-${CUDA_PATH:-}}
  if [[ -z "$cuda_root" ]]; then
    if command -v nvcc >/dev/null; then
      cuda_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
      cuda_root=/usr/local/cuda
    fi
  fi
  [[ -x "$cuda_root/bin/nvcc" ]] || { echo "run.sh: no CUDA toolkit found (set CUDAToolkit_ROOT)"; save; exit 2; }
  torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  prefix_path="$torch_prefix"
  deps=${SHARDEMA_GPU_DEPS:-$repo/.gpu-deps}
  if [[ -f "$deps/deps.tar.gz" ]]; then
    mkdir -p "$build/deps" && tar -C "$build/deps" -xzf "$deps/deps.tar.gz"
    prefix_path="$build/deps/usr;$prefix_path"
  fi
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  # The compute capability of device 0 (9.0 on an H100 or H200), for torch's CUDA flags.
  arch=$(timeout 60 "$python" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}.{n}")' 2>/dev/null || echo 9.0)
  t=$(cap 120 60) || { save; exit 1; }
  timeout "$t" cmake -S "$here" -B "$tree" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CUDA_HOST_COMPILER="$cxx" \
    -DCMAKE_PREFIX_PATH="$prefix_path" -DTorch_DIR="$torch_prefix/Torch" \
    -DPython3_EXECUTABLE="$(command -v "$python")" -DCUDAToolkit_ROOT="$cuda_root" \
    -DCMAKE_CUDA_COMPILER="$cuda_root/bin/nvcc" -DCMAKE_CUDA_ARCHITECTURES="${arch/./}" \
    -DTORCH_CUDA_ARCH_LIST="$arch" >"$logs/configure.log" 2>&1 || {
    tail -30 "$logs/configure.log"; echo "run.sh: configure failed"; save; exit 1; }
  grep -E "^-- shardema" "$logs/configure.log"
  grep -q "CUDA LibTorch found" "$logs/configure.log" || fail "configure: the CUDA LibTorch was not detected"
fi
targets=(offload_tests offload_concurrency_tests lib_concurrency_tests shardema_python)
[[ -z "${SHARDEMA_GPU_TREE:-}" ]] && targets+=(gpu_check)
t=$(cap 300 60) || { save; exit 1; }
timeout "$t" cmake --build "$tree" -j "$(nproc)" --target "${targets[@]}" >"$logs/build.log" 2>&1 ||
  { grep -E "error|Error" "$logs/build.log" | head -30; echo "run.sh: build failed or took over ${t} s"; save; exit 1; }
tests=$(dirname "$(find "$tree" -name offload_tests -type f -perm -u+x | head -1)")
export PYTHONPATH=$tree/python${PYTHONPATH:+:$PYTHONPATH}
module=$(ls "$tree"/python/shardema/_C*.so 2>/dev/null | head -1)
echo "built; tests in $tests, module $module"

step "the module's fingerprint"
for flag in -d -lW -V; do
  { echo "readelf $flag $module"; readelf $flag "$module" 2>&1; } >"$logs/readelf${flag}.txt"
done
{ echo "readelf -d $module:"; grep -E "NEEDED|RPATH|RUNPATH|SONAME" "$logs/readelf-d.txt"
  echo "dynamic symbols: $(readelf -W --dyn-syms "$module" | grep -c ' GLOBAL ')"; } | record
timeout 120 "$python" "$here/fingerprint.py" module >>"$logs/fingerprint.txt" 2>&1 ||
  fail "import torch; import shardema"
grep -E "^shardema from" "$logs/fingerprint.txt"
save

step "each kind of C++ exception into Python, each in its own process"
# One process per kind and variant, all at once; a signal shows as rc >= 128.
kinds=$("$python" "$here/throw_kinds.py" --list)
pids=()
for kind in $kinds; do
  for variant in plain stacktraces; do
    env_=(); [[ $variant == stacktraces ]] && env_=(TORCH_SHOW_CPP_STACKTRACES=1)
    (env "${env_[@]}" timeout 90 "$python" "$here/throw_kinds.py" "$kind" >"$logs/throw_${kind}_$variant.log" 2>&1
     echo "rc $?" >>"$logs/throw_${kind}_$variant.log") &
    pids+=($!)
  done
done
(CUDA_VISIBLE_DEVICES= timeout 90 "$python" "$here/throw_kinds.py" value >"$logs/throw_value_nodevice.log" 2>&1
 echo "rc $?" >>"$logs/throw_value_nodevice.log") &
wait "${pids[@]}" $!
crashed=""
for log in "$logs"/throw_*.log; do
  name=$(basename "$log" .log)
  rc=$(sed -n 's/^rc //p' "$log" | tail -1)
  line=$(grep -E "^(ok|WRONG) " "$log" | tail -1)
  echo "$name: rc $rc ${line:-(nothing printed)}"
  if [[ "$rc" != 0 ]]; then
    fail "$name"
    ((rc >= 128)) && crashed=${crashed:-${name#throw_}}
  fi
done
if [[ -n "$crashed" ]] && command -v cuda-gdb >/dev/null && t=$(cap 60 30); then
  kind=${crashed%_*}
  timeout "$t" cuda-gdb -batch -ex run -ex bt --args "$python" "$here/throw_kinds.py" "$kind" \
    >"$logs/throw_backtrace.log" 2>&1
  grep -E "^#[0-9]+ " "$logs/throw_backtrace.log" | head -25
fi

if ((has_gpu)); then
  step "CUDA engine tests (must run, not skip)"
  t=$(cap 90) && {
    timeout "$t" "$tests/offload_tests" --gtest_filter='CudaCopyEngineTest.*' >"$logs/cuda_tests.log" 2>&1 ||
      fail "CudaCopyEngineTest"
    grep -E "^\[ +(OK|SKIPPED|FAILED) +\]" "$logs/cuda_tests.log"
    ran=$(grep -cE "^\[ +OK \] CudaCopyEngineTest\." "$logs/cuda_tests.log")
    skipped=$(grep -E "^\[  SKIPPED \] CudaCopyEngineTest\.[A-Za-z]+ \(" "$logs/cuda_tests.log" |
      grep -vc ConstructionFailsCleanlyWithoutDevice)
    ((skipped == 0 && ran >= 4)) || fail "CUDA-engine tests: $ran ran, $skipped skipped on a GPU machine"
  }
  step "ema_bench: the tiny model on the GPU, then the 1.3 B model"
  t=$(cap 90 45) && {
    timeout "$t" "$python" -u "$here/ema_bench.py" --tiny --out "$logs/tiny" >"$logs/ema_bench_tiny.log" 2>&1 ||
      fail "ema_bench --tiny on the GPU"
    grep -E "^\| |^- " "$logs/tiny/ema_bench.md" 2>/dev/null
  }
  t=$(cap 240 90) && {
    timeout "$t" "$python" -u "$here/ema_bench.py" --out "$logs" --budget-seconds $((t - 30)) \
      >"$logs/ema_bench.log" 2>&1 || fail "ema_bench"
    grep -E "^ema_bench:" "$logs/ema_bench.log" | tail -3
    cat "$logs/ema_bench.md" 2>/dev/null
  }
fi

step "error-boundary suite"
boundary=$repo/tests/python/test_error_boundary.py
if [[ ! -f "$boundary" ]]; then
  echo "not present ($boundary): skipped"
elif t=$(cap 120 30); then
  xdist=(); "$python" -c "import xdist" 2>/dev/null && xdist=(-n 8)
  (cd "$repo/tests/python" && timeout "$t" "$python" -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" \
    "$boundary" >"$logs/error_boundary.log" 2>&1) || fail "error-boundary suite"
  grep -E "passed|failed|FAILED|SKIPPED|error" "$logs/error_boundary.log" | tail -12
fi

for suite in offload_tests offload_concurrency_tests lib_concurrency_tests; do
  step "$suite"
  t=$(cap 120 30) || continue
  timeout "$t" "$tests/$suite" >"$logs/$suite.log" 2>&1 || {
    fail "$suite"
    # The test a crash or a hang stopped in: its RUN line without an OK.
    last_run=$(grep -E "^\[ RUN +\]" "$logs/$suite.log" | tail -1 | sed 's/.*\] //')
    grep -qE "^\[ +(OK|FAILED|SKIPPED) +\] ${last_run} " "$logs/$suite.log" || echo "stopped inside: $last_run"
  }
  grep -E "^\[  (PASSED|FAILED) |^\[==========\]" "$logs/$suite.log" | tail -6
done

if ((!has_gpu)); then
  step "ema_bench --tiny on the CPU (the benchmark's machinery; its timings mean nothing)"
  t=$(cap 120 30) && {
    timeout "$t" "$python" -u "$here/ema_bench.py" --tiny --out "$logs" >"$logs/ema_bench.log" 2>&1 ||
      fail "ema_bench --tiny"
    grep -E "^\| " "$logs/ema_bench.md" 2>/dev/null | head -8
  }
  save
  echo
  echo "run.sh: STOP: no CUDA device here (torch.cuda.is_available() is False): the GPU-only" \
    "steps (CUDA engine tests, ema_bench on the GPU, gpu_check, python_check) were not run;" \
    "${#failures[@]} failure(s) before them${failures[*]:+: ${failures[*]}}"
  ((${#failures[@]})) && exit 1
  exit 3
fi

step "gpu_check"
gpu_check=$(find "$tree" -name gpu_check -type f -perm -u+x | head -1)
if [[ -z "$gpu_check" ]]; then
  echo "gpu_check was not built in $tree: skipped"
elif t=$(cap 120); then
  timeout "$t" "$gpu_check" 2>&1 | tee "$logs/gpu_check.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || fail "gpu_check"
fi

step "python_check (CUDA engine and fully_shard on the GPU)"
t=$(cap 120 30) && {
  (cd "$logs" && timeout "$t" "$python" "$here/python_check.py") 2>&1 | tee "$logs/python_check.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || fail "python_check"
}

step "python tests"
if ! "$python" -c "import pytest" 2>/dev/null; then
  echo "no pytest in $python: not run"
elif t=$(cap 300 90); then
  xdist=(); "$python" -c "import xdist" 2>/dev/null && xdist=(-n 8)
  (cd "$repo/tests/python" && timeout "$t" "$python" -m pytest -q -rs -p no:cacheprovider \
    "${xdist[@]}" . >"$logs/python_tests.log" 2>&1) || fail "python tests (or out of time: ${t} s)"
  grep -E "passed|failed|SKIPPED" "$logs/python_tests.log" | tail -8
fi

save
echo
if ((${#failures[@]})); then
  echo "GPU CHECK FAILED: ${failures[*]} ($((SECONDS - begun)) s; logs in ${out:-$logs})"
  exit 1
fi
echo "GPU CHECK PASSED ($((SECONDS - begun)) s; logs in ${out:-$logs})"
