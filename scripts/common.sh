# Shared by the scripts: repository root, job count, a configure helper.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
jobs=${SHARDEMA_JOBS:-$(nproc)}

# configure <build-dir> [cmake args...]
configure() {
  local dir=$1; shift
  cmake -S "$repo_root" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
}
