# Shared by the scripts: repository root, job count, a configure helper.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
jobs=${SHARDEMA_JOBS:-$(nproc)}
# Builds through ccache (CMAKE_CXX_COMPILER_LAUNCHER=ccache) cache the files
# compiled with a precompiled header only with this sloppiness.
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}

# configure <build-dir> [cmake args...]
configure() {
  local dir=$1; shift
  cmake -S "$repo_root" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
}
