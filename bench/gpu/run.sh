#!/usr/bin/env bash
# The one-call GPU check for a machine with a CUDA device and torch 2.x:
#   1. builds this repository against that torch's LibTorch (Torch_DIR from
#      torch.utils.cmake_prefix_path) with the CUDA engine;
#   2. runs the offload and concurrency test suites; the CUDA-engine tests
#      must run there, not skip;
#   3. runs gpu_check: the pinned-host EMA allocates no device memory
#      (cudaMemGetInfo before/after), pinned D2H/H2D GB/s through the engine
#      beside plain cudaMemcpy;
#   4. builds the Python package in the same tree (shardema._C beside its
#      .py files; SHARDEMA_GPU_PIP=1 pip installs it instead, a second build)
#      and runs its pytest suites (the FSDP2 and Lightning blocks of docs/python.md included:
#      a real fully_shard model on CPU over Gloo, 2 processes, and
#      EMACallback in a Lightning Trainer), then bench/gpu/python_check.py
#      (the CUDA copy engine under shardema.EMA, fully_shard on the GPU).
#      SHARDEMA_GPU_PYTHON=0 skips it.
# Usage: bash bench/gpu/run.sh        (a few minutes; exit 0 = all passed)
# A bare machine without GoogleTest/nlohmann-json/Boost/xxhash: first run
# bench/gpu/bundle_deps.sh on a Debian machine with scripts/install_deps.sh
# done, and bring <repo>/.gpu-deps along (or set SHARDEMA_GPU_DEPS to a
# folder holding deps.tar.gz). Logs: build/gpu/logs, and $OUT/gpu_logs.tar.gz when OUT is set.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
build=${SHARDEMA_GPU_BUILD:-$repo/build/gpu}
# $OUT brings back 8 files at most: the logs travel as one archive, renewed
# at each step so that a run cut short still brings back what it did.
logs=$build/logs
archive=${OUT:+$OUT/gpu_logs.tar.gz}
python=${PYTHON:-python3}
mkdir -p "$build" "$logs"
failures=()
save_logs() { [[ -n "$archive" ]] && tar -C "$logs" -czf "$archive" . 2>/dev/null; return 0; }
step() { save_logs; echo; echo "== $*"; }
fail() { echo "FAILED: $*"; failures+=("$*"); }

step "environment"
"$python" -c 'import sys, sysconfig; print(sys.version.split()[0], sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY"), sysconfig.get_paths()["include"])' || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
torch_info=$(timeout 120 "$python" -c 'import torch
print(torch.utils.cmake_prefix_path)
print(torch.__version__, torch.version.cuda, torch.cuda.is_available())') || {
  echo "run.sh: $python cannot import torch"; exit 2; }
torch_prefix=$(sed -n 1p <<<"$torch_info")
echo "torch $(sed -n 2p <<<"$torch_info") (version, CUDA, device available); prefix $torch_prefix"

# The toolkit the way FindCUDAToolkit looks for it: nvcc need not be on PATH.
cuda_root=${CUDAToolkit_ROOT:-${CUDA_PATH:-}}
if [[ -z "$cuda_root" ]]; then
  if command -v nvcc >/dev/null; then
    cuda_root=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    cuda_root=/usr/local/cuda
  fi
fi
[[ -x "$cuda_root/bin/nvcc" ]] || { echo "run.sh: no CUDA toolkit found (set CUDAToolkit_ROOT)"; exit 2; }
echo "CUDA toolkit $cuda_root ($("$cuda_root/bin/nvcc" --version | tail -1))"

prefix_path="$torch_prefix"
deps=${SHARDEMA_GPU_DEPS:-$repo/.gpu-deps}
if [[ -f "$deps/deps.tar.gz" ]]; then
  mkdir -p "$build/deps" && tar -C "$build/deps" -xzf "$deps/deps.tar.gz"
  prefix_path="$build/deps/usr;$prefix_path"
  echo "dependencies from $deps/deps.tar.gz"
fi

step "configure"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# The compute capability of device 0 (9.0 on an H200), for torch's CUDA flags.
arch=$(timeout 60 "$python" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}.{n}")' 2>/dev/null || echo 9.0)
timeout 300 cmake -S "$repo/bench/gpu" -B "$build/tree" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix_path" \
  -DTorch_DIR="$torch_prefix/Torch" -DPython3_EXECUTABLE="$(command -v "$python")" \
  -DCUDAToolkit_ROOT="$cuda_root" \
  -DCMAKE_CUDA_COMPILER="$cuda_root/bin/nvcc" -DCMAKE_CUDA_ARCHITECTURES="${arch/./}" \
  -DTORCH_CUDA_ARCH_LIST="$arch" >"$logs/configure.log" 2>&1 || {
  tail -40 "$logs/configure.log"; echo "run.sh: configure failed"; exit 1; }
grep -E "^-- shardema" "$logs/configure.log"
grep -q "CUDA LibTorch found" "$logs/configure.log" || fail "configure: the CUDA LibTorch was not detected"

step "build"
targets=(offload_tests concurrency_suites gpu_check)
[[ "${SHARDEMA_GPU_PYTHON:-1}" == 1 && "${SHARDEMA_GPU_PIP:-0}" != 1 ]] && targets+=(shardema_python)
timeout 600 cmake --build "$build/tree" -j "$(nproc)" --target "${targets[@]}" \
  >"$logs/build.log" 2>&1 || { grep -E "error|Error" "$logs/build.log" | head -30; echo "run.sh: build failed"; exit 1; }
echo "built"
tests=$build/tree/shardema/tests

step "a C++ exception into Python (crashed on the first H200 run)"
# The first run (2026-12-04, g++ 13.3 from /opt/gcc, Python 3.12) died with
# SIGSEGV on every C++ exception that reached Python. One throwing call,
# with and without the device, the module's C++ runtime, and a backtrace.
throwing='import torch, shardema
try:
    shardema.DecaySchedule.constant(1.5)
except ValueError as e:
    print("caught:", str(e)[:80])'
module=$(ls "$build"/tree/python/shardema/_C*.so 2>/dev/null | head -1)
if [[ -n "$module" ]]; then
  (cd "$build/tree/python" && timeout 60 "$python" -c "$throwing"; echo "rc $?") 2>&1 | tail -2
  (cd "$build/tree/python" && CUDA_VISIBLE_DEVICES= timeout 60 "$python" -c "$throwing"; echo "rc $? without a device") 2>&1 | tail -2
  ldd "$module" | grep -E "stdc\+\+|gcc_s|libpython" | tee "$logs/module_ldd.log"
  if command -v cuda-gdb >/dev/null; then
    (cd "$build/tree/python" && timeout 120 cuda-gdb -batch -ex run -ex bt --args "$python" -c "$throwing") \
      >"$logs/throw_backtrace.log" 2>&1
    grep -E "^#[0-9]+ " "$logs/throw_backtrace.log" | head -25
  fi
fi
step "CUDA engine tests (must run, not skip)"
timeout 120 "$tests/offload_tests" --gtest_filter='CudaCopyEngineTest.*' >"$logs/cuda_tests.log" 2>&1 ||
  fail "CudaCopyEngineTest"
grep -E "^\[ +(OK|SKIPPED|FAILED) +\]" "$logs/cuda_tests.log"
# Only the no-device test may skip where there is a device.
ran=$(grep -cE "^\[ +OK \] CudaCopyEngineTest\." "$logs/cuda_tests.log")
skipped=$(grep -E "^\[  SKIPPED \] CudaCopyEngineTest\.[A-Za-z]+ \(" "$logs/cuda_tests.log" |
  grep -vc ConstructionFailsCleanlyWithoutDevice)
((skipped == 0 && ran >= 4)) || fail "CUDA-engine tests: $ran ran, $skipped skipped on a GPU machine"
step "gpu_check"
timeout 180 "$build/tree/gpu_check" 2>&1 | tee "$logs/gpu_check.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || fail "gpu_check"

if [[ "${SHARDEMA_GPU_PYTHON:-1}" == 1 ]]; then
  pythonpath=$build/tree/python
  if [[ "${SHARDEMA_GPU_PIP:-0}" == 1 ]]; then
    step "python package (pip install --no-build-isolation)"
    CMAKE_PREFIX_PATH="$prefix_path" CUDAToolkit_ROOT="$cuda_root" timeout 480 \
      "$python" -m pip install --no-build-isolation --no-deps --no-index -v "$repo" \
      >"$logs/pip_install.log" 2>&1 || fail "pip install"
    tail -2 "$logs/pip_install.log"
    pythonpath=
  fi
  export PYTHONPATH=$pythonpath${PYTHONPATH:+:$PYTHONPATH}
  step "python_check (CUDA engine and fully_shard on the GPU)"
  (cd "$logs" && timeout 180 "$python" "$repo/bench/gpu/python_check.py") 2>&1 |
    tee "$logs/python_check.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || fail "python_check"
fi

step "offload_tests"
timeout 150 "$tests/offload_tests" --gtest_brief=1 >"$logs/offload_tests.log" 2>&1 || fail "offload_tests"
tail -3 "$logs/offload_tests.log"
for suite in offload_concurrency_tests lib_concurrency_tests; do
  step "$suite"
  timeout 120 "$tests/$suite" --gtest_brief=1 >"$logs/$suite.log" 2>&1 || fail "$suite"
  tail -3 "$logs/$suite.log"
done


if [[ "${SHARDEMA_GPU_PYTHON:-1}" == 1 ]]; then
  if "$python" -c "import pytest" 2>/dev/null; then
    step "python tests"
    xdist=(); "$python" -c "import xdist" 2>/dev/null && xdist=(-n 4)
    (cd "$repo/tests/python" && timeout "${SHARDEMA_GPU_PYTEST_TIMEOUT:-240}" "$python" -m pytest -q -rs \
      -p no:cacheprovider "${xdist[@]}" . \
      >"$logs/python_tests.log" 2>&1) || fail "python tests"
    grep -E "passed|failed|SKIPPED" "$logs/python_tests.log" | tail -8
  else
    echo "no pytest in $python: Python tests not run"
  fi
fi

save_logs
echo
if ((${#failures[@]})); then
  echo "GPU CHECK FAILED: ${failures[*]} (logs in ${archive:-$logs})"
  exit 1
fi
echo "GPU CHECK PASSED (logs in ${archive:-$logs})"
