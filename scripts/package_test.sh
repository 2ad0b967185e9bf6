#!/usr/bin/env bash
# The Python package as a user installs it (a CI stage):
#   1. an sdist of this tree (python -m build, in the project's venv);
#   2. a fresh venv holding only the pinned torch (from pip's cache after
#      the first time), where pip builds a wheel from that sdist with build
#      isolation, as `pip install .` does, and installs it;
#   3. tests/install/python_smoke.py, run from outside the source tree:
#      import, a 2-process DDP update, export, save and load, a DCP save;
#   4. the `shardema` command pip installed, without LD_LIBRARY_PATH:
#      --version against shardema.__version__, inspect and export of the
#      smoke test's per-rank checkpoint and DCP checkpoint, whose exports
#      must equal the EMA's own export_weights file.
# Leaves nothing behind but pip's cache.
source "$(dirname "$0")/common.sh"
bash "$repo_root/scripts/install_deps.sh"
venv=${SHARDEMA_VENV:-$repo_root/.venv}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "package_test: sdist"
"$venv/bin/python" -m build --sdist --no-isolation --skip-dependency-check --outdir "$work/dist" "$repo_root" >"$work/sdist.log" 2>&1 ||
  { cat "$work/sdist.log"; exit 1; }
sdist=$(ls "$work"/dist/shardema-*.tar.gz)

echo "package_test: a fresh venv with torch $(sed -n 's/^torch==//p' "$repo_root/requirements.lock") only"
/usr/bin/python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --disable-pip-version-check -q \
  -c "$repo_root/requirements.lock" torch

echo "package_test: wheel from $(basename "$sdist") (pip's build isolation), installed"
CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$work/venv/bin/python" -m pip wheel --disable-pip-version-check \
  --no-deps -w "$work/wheels" "$sdist" >"$work/wheel.log" 2>&1 || { tail -40 "$work/wheel.log"; exit 1; }
"$work/venv/bin/python" -m pip install --disable-pip-version-check -q "$work"/wheels/shardema-*.whl

echo "package_test: smoke test from $work"
cp "$repo_root/tests/install/python_smoke.py" "$work/"
# torch warns that numpy is missing, which this venv lacks on purpose.
export PYTHONWARNINGS="ignore:Failed to initialize NumPy"
cd "$work" && "$work/venv/bin/python" python_smoke.py "$work/smoke"

echo "package_test: the installed shardema command"
command="$work/venv/bin/shardema"
[[ -x "$command" ]] || { echo "package_test: pip installed no $command"; exit 1; }
run() { env -u LD_LIBRARY_PATH "$command" "$@"; }
version=$(run --version)
expected="shardema $("$work/venv/bin/python" -c 'import shardema; print(shardema.__version__)')"
[[ "$version" == "$expected" ]] || { echo "package_test: '$version', expected '$expected'"; exit 1; }
echo "$version"
run inspect "$work/smoke/checkpoint"
run export --checkpoint "$work/smoke/checkpoint" --out "$work/smoke/from_checkpoint.safetensors"
run inspect "$work/smoke/dcp"
run export --checkpoint "$work/smoke/dcp" --out "$work/smoke/from_dcp.safetensors"
"$work/venv/bin/python" python_smoke.py --compare "$work/smoke"
