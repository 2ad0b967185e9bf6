#!/usr/bin/env bash
# Installs what shardema builds, tests and runs with, and is quiet when all of
# it is already there:
#   1. Debian 12 packages: compilers, CMake, GoogleTest, Google Benchmark,
#      Boost, nlohmann-json, xxhash, Python's venv and headers, clang for the
#      fuzzers (as root, or through sudo);
#   2. one Python virtual environment, .venv/ in the repository root (or the
#      folder SHARDEMA_VENV names), holding exactly requirements.lock: the
#      pinned torch, whose LibTorch every C++ target is built against, and the
#      test partners. The first install downloads about 5 GB (torch and its
#      CUDA runtime wheels) and shows pip's progress; pip's cache
#      (~/.cache/pip) makes a later one a local copy. A venv whose recorded
#      lock matches requirements.lock is reused as it is.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

packages=(
  build-essential cmake git
  libboost-dev                      # Boost.Asio (header-only)
  nlohmann-json3-dev                # safetensors headers
  libxxhash-dev xxhash              # checksums in manifests (xxhsum: test reference)
  libgtest-dev libbenchmark-dev     # tests and benchmarks
  python3 python3-venv              # the venv below
  python3-dev libpython3-dev        # the extension's headers; libpython for C++ programs
                                    # that create a Gloo group (shard/src/gloo_backend.cpp)
  clang libclang-rt-14-dev          # libFuzzer run in CI
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "install_deps: installing ${missing[*]}"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || {
      echo "install_deps: run as root (or install sudo) to install: ${missing[*]}" >&2; exit 1; }
    sudo_cmd=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The venv is made from Debian's python3 (not a pyenv or conda one first on
# PATH): its libpython is the shared library C++ programs embed, and it is
# the interpreter a user of this Debian machine has.
venv=${SHARDEMA_VENV:-$repo_root/.venv}
lock=$repo_root/requirements.lock
want=$(sha256sum "$lock" | cut -d' ' -f1)
marker=$venv/.shardema-requirements.sha256
if [[ -x "$venv/bin/python" && -f "$marker" && "$(cat "$marker")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$venv/bin/python" ]]; then
  echo "install_deps: creating the Python environment $venv"
  /usr/bin/python3 -m venv "$venv"
fi
echo "install_deps: installing requirements.lock into $venv (torch $(sed -n 's/^torch==//p' "$lock"):" \
     "about 5 GB the first time, from pip's cache after that)"
# --progress-bar on: a fresh machine spends minutes here, and should say so.
"$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar on -r "$lock"
echo "$want" >"$marker"
