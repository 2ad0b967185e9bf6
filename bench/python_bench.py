#!/usr/bin/env python3
"""The Python layer's cost against what a Python user would write instead.

    python_bench.py [--elements N] [--tensors T] [--repeats R] [--json PATH]

1000 tensors of mixed sizes (log-uniform, N elements in all; default 64 Mi),
fp32 and bf16 parameters, an fp32 EMA. For shardema.EMA (pinned host, the
background pipeline) it times what update() costs the training loop (the
call returning) and a full update (update + wait). The peers, timed the
same way on the same tensors:
  - ema-pytorch's way: a per-tensor lerp_ (p.float() for bf16);
  - torch._foreach_lerp_ over fp32 lists (torch >= 2; on 1.13 its form
    _foreach_mul_ + _foreach_add_);
  - torch.optim.swa_utils.get_ema_multi_avg_fn (torch >= 2.1).
Every row prints GB/s (the bytes an fp32 EMA update must move: read the
source, read and write the EMA) and that rate over the host's in-place
bandwidth (a.add_(b) on fp32, 12 bytes per element) measured in the same
rounds. Figures are medians of R rounds after one warm-up; each round runs
every method once (the in-place limit too), in rotating order, so ours, the
peers and the limit see the same load.
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

import shardema


def sizes_for(total, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    logs = torch.rand(count, generator=g, dtype=torch.float64) * math.log(4096) + math.log(256)
    raw = torch.exp(logs)
    scaled = (raw / raw.sum() * total).floor().clamp(min=1).long()
    scaled[0] += total - int(scaled.sum())
    return [int(s) for s in scaled]


def interleaved_medians(methods, repeats):
    """{name: median seconds} of each (name, fn), after one warm-up each, timed
    in rounds: every round runs every method once, the order rotating, so
    all see the same load. This VM's memory rate drifts by 2x within a
    minute; timing the methods one after another would compare the drift."""
    for _, fn in methods:
        fn()
    times = {name: [] for name, _ in methods}
    for r in range(repeats):
        for name, fn in methods[r % len(methods):] + methods[:r % len(methods)]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_dtype(dtype, sizes, repeats):
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]
    elements = sum(sizes)
    source_bytes = 2 if dtype == torch.bfloat16 else 4
    moved = (source_bytes + 8) * elements  # read source, read + write fp32 EMA

    # The host's in-place bandwidth (a.add_(b) on fp32, 12 bytes per
    # element), timed in the same rounds as the rest.
    a = torch.ones(elements)
    b = torch.ones(elements)

    def inplace():
        a.add_(b)

    ema = shardema.EMA([(f"t{i}", p) for i, p in enumerate(params)],
                       schedule=shardema.DecaySchedule.constant(0.999), policy="ema_pytorch")
    returns = []

    def ours():
        ema.fence()
        start = time.perf_counter()
        ema.update()
        returns.append(time.perf_counter() - start)
        ema.wait()

    emas = [p.detach().float().clone() for p in params]
    weight = 1 - 0.999

    def per_tensor_lerp():
        with torch.no_grad():
            for e, p in zip(emas, params):
                e.lerp_(p if p.dtype == torch.float32 else p.float(), weight)

    def sources():
        return [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in params]

    methods = [("in-place a.add_(b)", inplace), ("shardema.EMA update+wait", ours),
               ("per-tensor lerp_ (ema-pytorch)", per_tensor_lerp)]
    if hasattr(torch, "_foreach_lerp_"):
        def foreach():
            with torch.no_grad():
                torch._foreach_lerp_(emas, sources(), weight)
        methods.append(("torch._foreach_lerp_", foreach))
    else:
        def foreach():
            with torch.no_grad():
                torch._foreach_mul_(emas, 0.999)
                torch._foreach_add_(emas, sources(), alpha=weight)
        methods.append(("_foreach_mul_+_foreach_add_ (1.13)", foreach))
    swa = getattr(torch.optim.swa_utils, "get_ema_multi_avg_fn", None)
    if swa is not None:
        fn = swa(0.999)
        steps = torch.tensor(1)

        def swa_update():
            with torch.no_grad():
                fn(emas, sources(), steps)
        methods.append(("swa_utils get_ema_multi_avg_fn", swa_update))

    medians = interleaved_medians(methods, repeats)
    bw = 12 * elements / medians.pop("in-place a.add_(b)") / 1e9
    rows = []
    for name, seconds in medians.items():
        gbs = moved / seconds / 1e9
        rows.append({"dtype": str(dtype).replace("torch.", ""), "method": name,
                     "ms": seconds * 1e3,
                     "returns_ms": statistics.median(returns[1:]) * 1e3 if name.startswith(
                         "shardema") else None,
                     "gb_s": gbs, "fraction_of_inplace": gbs / bw, "inplace_gb_s": bw})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=64 << 20)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    sizes = sizes_for(args.elements, args.tensors)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += bench_dtype(dtype, sizes, args.repeats)
    bw = {r["dtype"]: r["inplace_gb_s"] for r in rows}
    print(f"python_bench: torch {torch.__version__}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, {args.tensors} tensors, {args.elements / (1 << 20):.0f} Mi "
          f"elements; in-place bandwidth (a.add_(b), fp32) in the float32 rounds "
          f"{bw['float32']:.2f} GB/s, in the bfloat16 rounds {bw['bfloat16']:.2f} GB/s")
    print(f"{'dtype':<9}{'method':<38}{'ms':>9}{'returns ms':>12}{'GB/s':>8}{'of limit':>10}"
          f"{'speedup':>9}")
    for dtype in ("float32", "bfloat16"):
        mine = [r for r in rows if r["dtype"] == dtype]
        peers = [r for r in mine if not r["method"].startswith("shardema")]
        fastest = min(r["ms"] for r in peers)
        for r in mine:
            r["speedup_vs_fastest_peer"] = fastest / r["ms"]
            returns = "" if r["returns_ms"] is None else f"{r['returns_ms']:.3f}"
            print(f"{dtype:<9}{r['method']:<38}{r['ms']:>9.2f}{returns:>12}{r['gb_s']:>8.2f}"
                  f"{r['fraction_of_inplace']:>10.2f}{r['speedup_vs_fastest_peer']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "elements": args.elements,
                       "tensors": args.tensors, "inplace_gb_s": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
