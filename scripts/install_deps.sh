#!/usr/bin/env bash
# Installs the Debian 12 packages shardema builds, tests and runs with.
# Idempotent and quiet when everything is already there.
set -euo pipefail

packages=(
  build-essential cmake git
  libtorch-dev libgloo-dev          # LibTorch 1.13 (CPU) with c10d; Gloo headers
  libboost-dev                      # Boost.Asio (header-only)
  nlohmann-json3-dev                # safetensors headers
  libxxhash-dev xxhash              # checksums in manifests (xxhsum: test reference)
  libgtest-dev libbenchmark-dev     # tests and benchmarks
  python3-torch python3-numpy       # interop tests (Debian's /usr/bin/python3)
  python3-xxhash                    # the tests' check of per-tensor checksums
  pybind11-dev python3-dev          # the Python package (shardema._C)
  python3-pytest                    # its tests
  clang libclang-rt-14-dev          # libFuzzer run in CI
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "install_deps: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install_deps: run as root (or install sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
