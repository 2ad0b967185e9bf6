#!/usr/bin/env bash
# DemoTest.DeadPeerIsOneLineNamingIt: a 3-rank demo whose rank 2 is killed
# (SIGKILL) mid-training. Rank 0 must print one line of its own that names
# rank 2 and its signal before rank 1 (which only lost its peer), and exit 1.
# Usage: dead_peer_test.sh EMA_DEMO OUT_DIR
set -u
demo=$1 out=$2
rm -rf "$out" && mkdir -p "$out"
"$demo" --world-size 3 --batch 30 --steps 1000000 --out "$out" >"$out/stdout" 2>"$out/stderr" &
parent=$!
rank2=""
for _ in $(seq 600); do  # up to 60 s: rank 2 started and training
  for child in $(pgrep -P "$parent"); do
    if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx SHARDEMA_DEMO_RANK=2; then
      rank2=$child
    fi
  done
  [[ -n "$rank2" && -s "$out/rank2.log" ]] && break
  kill -0 "$parent" 2>/dev/null || break
  sleep 0.1
done
[[ -n "$rank2" ]] || { echo "rank 2 never started"; cat "$out/stderr"; kill -9 "$parent" 2>/dev/null; exit 1; }
sleep 2
kill -9 "$rank2"
wait "$parent"
status=$?
echo "exit=$status"
# Lines of its own (the library may add a warning, e.g. "no usable CUDA device").
echo "ema_demo lines=$(grep -c "^ema_demo:" "$out/stderr")"
cat "$out/stderr"
