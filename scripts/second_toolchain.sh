#!/usr/bin/env bash
# The second toolchain (a CI stage): shardema._C built by another compiler,
# Debian's clang 14 on the same libstdc++ and the same torch, and only the
# module (the libraries under it, no tests, tools or benchmarks); then the
# error-boundary suite and the module's linkage checks run on it
# (tests/python/test_error_boundary.py, test_module_linkage.py).
#
# Why clang: the GPU machine once built the module with a compiler nobody
# fingerprinted and every C++ error crashed there. clang emits its own
# exception tables and calls into libstdc++ / libgcc_s through its own code
# paths, yet shares pybind11's ABI key with torch's GCC build (the key names
# the C++ library, not the compiler), so the module loads beside torch as
# it does from GCC. It is installed with the fuzzers' packages
# (scripts/install_deps.sh).
# About 3.5 minutes of CPU to build; the suite about 1.5 minutes on 2 cores.
source "$(dirname "$0")/common.sh"
bash "$repo_root/scripts/install_deps.sh"
venv=${SHARDEMA_VENV:-$repo_root/.venv}
cxx=$(command -v clang++-14 || command -v clang++) ||
  { echo "second_toolchain: no clang++ (scripts/install_deps.sh installs clang)" >&2; exit 1; }
build="$repo_root/build/second-toolchain"
configure "$build" -DCMAKE_CXX_COMPILER="$cxx" -DSHARDEMA_BUILD_PYTHON=ON \
  -DSHARDEMA_BUILD_TESTS=OFF -DSHARDEMA_BUILD_BENCHMARKS=OFF -DSHARDEMA_BUILD_EXAMPLES=OFF \
  -DSHARDEMA_BUILD_TOOLS=OFF -DSHARDEMA_INSTALL=OFF
cmake --build "$build" -j "$jobs" --target shardema_python
module=$(ls "$build"/python/shardema/_C.*.so)
# The module's own objects say which compiler made them (.comment).
readelf -p .comment "$module" | grep -qF "$("$cxx" --version | head -1)" ||
  { echo "second_toolchain: $module was not built by clang ($cxx)" >&2; exit 1; }
echo "second_toolchain: $(basename "$module") built by $("$cxx" --version | head -1)"
cd "$repo_root/tests/python"
PYTHONPATH="$build/python" SHARDEMA_TEST_PYTHON="$venv/bin/python" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider test_error_boundary.py test_module_linkage.py
