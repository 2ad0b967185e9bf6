#!/usr/bin/env bash
# Installs what is missing, builds Release with the benchmarks, runs every
# benchmark program and writes one report of every figure beside its limit:
# <out>/report.md (docs/performance.md) and <out>/report.json,
# plus each program's Google Benchmark JSON and console log.
#
#   scripts/bench.sh [--quick] [--out DIR]
#
#   --quick    smaller sizes, short --benchmark_min_time: about 2-3 minutes,
#              to test the script and report; its figures mean little.
#              Same as SHARDEMA_BENCH_QUICK=1.
#   --out DIR  where results go (default out/bench; SHARDEMA_BENCH_OUT).
# SHARDEMA_BENCH_BUILD: build directory (default build/release, shared with
# test.sh and demo.sh; point it elsewhere to build beside someone else).
# The full run takes about 10-15 minutes on the 2-core VM. Run it on a quiet
# machine: every row pairs ours with its limit, but a neighbour's burst
# still moves both.
source "$(dirname "$0")/common.sh"

# What the report prints as the command to reproduce it.
command_line="scripts/bench.sh${*:+ $*}"
[[ "${SHARDEMA_BENCH_QUICK:-0}" == 1 ]] && command_line="SHARDEMA_BENCH_QUICK=1 $command_line"

quick=${SHARDEMA_BENCH_QUICK:-0}
out=${SHARDEMA_BENCH_OUT:-$repo_root/out/bench}
while [[ $# -gt 0 ]]; do
  case $1 in
    --quick) quick=1 ;;
    --out) out=${2:?--out needs a directory}; shift ;;
    --out=*) out=${1#--out=} ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "bench.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
build=${SHARDEMA_BENCH_BUILD:-$repo_root/build/release}
programs=(update_bench offload_bench gather_bench posthoc_bench soak_bench)

bash "$repo_root/scripts/install_deps.sh"
# Only the benchmark option: the other options keep what the shared build
# directory already has (test.sh turns tests on there; turning them off
# here would make the next test.sh reconfigure and rebuild).
configure "$build" -DSHARDEMA_BUILD_BENCHMARKS=ON
cmake --build "$build" -j "$jobs" --target "${programs[@]}"

# Per program: the size flags and how many repetitions (the report takes
# their median). gather_bench repeats nothing: each row already is the
# median of several timed all-gather/gather pairs.
declare -A sizes repetitions
if [[ "$quick" == 1 ]]; then
  min_time=0.02
  # update: 16 Mi, where the 1000-tensor layout's tensors (8-25 Ki
  # elements) stay under ATen's parallel grain size, so the ATen peers run
  # serially. From 64 Mi on they open 2000 OpenMP regions per pass, and on a
  # 2-core machine busy with other work each can stall for a time slice
  # (seen: 20 s per pass instead of 0.1 s): fine for a full run on a quiet
  # machine, not for a quick check on a busy one.
  sizes=([update_bench]=--update_elements=$((16 << 20))
         [offload_bench]="--offload_elements=$((32 << 20)) --offload_overlap_rounds=3"
         [gather_bench]=--gather_max_kib=$((16 << 10))
         [posthoc_bench]=--posthoc_elements=$((4 << 20))
         [soak_bench]=--soak_cycles=5000)
  repetitions=([update_bench]=1 [offload_bench]=1 [gather_bench]=1 [posthoc_bench]=3
               [soak_bench]=1)
else
  min_time=0.5  # Google Benchmark's default, spelled out for the record
  sizes=([update_bench]="" [offload_bench]="" [gather_bench]="" [posthoc_bench]="" [soak_bench]="")
  # soak_bench: one run of 100k cycles (about 2-3 minutes); its table (RSS
  # at start and end, us per tensor against ATen's) is printed, not charted.
  repetitions=([update_bench]=3 [offload_bench]=3 [gather_bench]=1 [posthoc_bench]=3
               [soak_bench]=1)
fi

mkdir -p "$out"
# Stale results of an earlier run must not end up in this report.
for name in "${programs[@]}"; do rm -f "$out/$name.json" "$out/$name.log"; done
rm -f "$out/report.md" "$out/report.json"

# A program that fails does not stop the others: the report lists it as not
# run, and the script still exits non-zero.
failed=()
for name in "${programs[@]}"; do
  echo "bench.sh: $name (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  start=$SECONDS
  # JSON to the file, the readable table to the console and the log.
  # shellcheck disable=SC2086  # sizes holds zero or more separate flags
  if ! "$build/bench/$name" ${sizes[$name]} \
      --benchmark_min_time="$min_time" \
      --benchmark_repetitions="${repetitions[$name]}" \
      --benchmark_display_aggregates_only=true \
      --benchmark_out_format=json --benchmark_out="$out/$name.json" 2>&1 | tee "$out/$name.log"; then
    failed+=("$name")
    rm -f "$out/$name.json"  # cut short: its JSON may be incomplete
  fi
  echo "bench.sh: $name took $((SECONDS - start)) s"
done

# The Python layer, when the build has the package (bench/python_bench.py).
if grep -q "^Python3_EXECUTABLE:" "$build/CMakeCache.txt" 2>/dev/null &&
    cmake --build "$build" -j "$jobs" --target shardema_python >/dev/null 2>&1; then
  python=$(sed -n 's/^Python3_EXECUTABLE:[A-Z]*=//p' "$build/CMakeCache.txt")
  python_flags=()
  [[ "$quick" == 1 ]] && python_flags=(--elements $((16 << 20)) --repeats 3)
  rm -f "$out/python_bench.json"
  echo "bench.sh: python_bench (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  if ! PYTHONPATH="$build/python" "$python" "$repo_root/bench/python_bench.py" "${python_flags[@]}" \
      --json "$out/python_bench.json" 2>&1 | tee "$out/python_bench.log"; then
    failed+=(python_bench)
  fi
fi

report_flags=(--command "$command_line" --build "$build")
[[ "$quick" == 1 ]] && report_flags+=(--quick)
/usr/bin/python3 "$repo_root/scripts/bench_report.py" "$out" "${report_flags[@]}"
echo "bench.sh: wrote $out/report.md and $out/report.json"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "bench.sh: failed: ${failed[*]} (see $out/<name>.log)" >&2
  exit 1
fi
