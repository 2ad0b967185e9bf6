#!/usr/bin/python3
"""Turns the Google Benchmark JSON files that scripts/bench.sh writes into one
Markdown report (docs/performance.md) and the same rows as JSON.

    bench_report.py OUTDIR [--command CMD] [--build DIR] [--quick]

Reads OUTDIR/{update,offload,gather,posthoc}_bench.json, writes
OUTDIR/report.md and OUTDIR/report.json. Standard library only (Debian's
/usr/bin/python3, no pip). Where a program ran repetitions, every figure is
the median Google Benchmark computed over them, and "cv" (its coefficient
of variation) says how much the repetitions disagreed.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys

PROGRAMS = ["update_bench", "offload_bench", "gather_bench", "posthoc_bench"]


# ---------------------------------------------------------------- reading

def load_rows(path):
    """One row per benchmark instance: its median aggregate where
    repetitions exist, else its only iteration row. Returns (context, rows)."""
    with open(path) as f:
        data = json.load(f)
    by_run, order = {}, []
    for b in data.get("benchmarks", []):
        run = b.get("run_name", b["name"])
        if run not in by_run:
            order.append(run)
            by_run[run] = {}
        kind = b.get("aggregate_name") if b.get("run_type") == "aggregate" else "iteration"
        by_run[run].setdefault(kind, b)  # first iteration row if several
    rows = []
    for run in order:
        kinds = by_run[run]
        row = dict(kinds.get("median") or kinds["iteration"])
        row["cv"] = kinds.get("cv", {})  # per-counter coefficient of variation
        row.update(parse_name(run))
        rows.append(row)
    return data.get("context", {}), rows


def parse_name(run_name):
    """'ours/f32/one/threads:2/manual_time' -> path ['ours','f32','one'] and
    args {'threads': 2}; Google Benchmark's own suffixes are dropped."""
    path, args = [], {}
    for part in run_name.split("/"):
        if part in ("manual_time", "real_time") or part.startswith("iterations:"):
            continue
        if ":" in part:
            key, value = part.split(":", 1)
            args[key] = int(value) if re.fullmatch(r"-?\d+", value) else value
        else:
            path.append(part)
    return {"path": path, "args": args}


# ---------------------------------------------------------------- formatting

def size_text(n, unit=""):
    """1048576 -> '1 Mi' (elements) or '1 MiB' (bytes): powers of 1024."""
    for factor, suffix in ((1 << 30, "Gi"), (1 << 20, "Mi"), (1 << 10, "Ki")):
        if n >= factor:
            value = n / factor
            return f"{value:.3g} {suffix}{unit}"
    return f"{n} {unit}".strip()


def number(value, digits=3):
    """3 significant digits, trailing zeros kept so columns read alike."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:#.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def fraction(value):
    return "-" if value is None else f"{value:.2f}"


def with_cv(row, counter):
    """'26.4 ±3%' when repetitions measured a spread, else '26.4'."""
    value = row.get(counter)
    cv = row["cv"].get(counter)
    text = number(value)
    if value is not None and cv:
        text += f" ±{cv * 100:.0f}%"
    return text


def markdown_table(columns, rows):
    """columns: (header, function of a row -> text)."""
    if not rows:
        return "(no rows: filtered out or not run)"
    lines = ["| " + " | ".join(h for h, _ in columns) + " |",
             "| " + " | ".join("---" for _ in columns) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(f(row) for _, f in columns) + " |")
    return "\n".join(lines)


def plain(row, keys):
    """The JSON form of a row: its name, arguments and chosen counters."""
    out = {"benchmark": "/".join(row["path"]), **row["args"]}
    for k in keys:
        if k in row:
            out[k] = row[k]
            if k in row["cv"]:
                out[k + "_cv"] = row["cv"][k]
    return out


# ---------------------------------------------------------------- sections
# Each returns (markdown, {table name: JSON rows}).

def update_section(rows):
    limit_rows = {r["args"]["threads"]: r for r in rows if r["path"][0] == "limit_add_inplace"}
    ours = [r for r in rows if r["path"][0] == "ours"]
    sweep = [r for r in rows if r["path"][0] == "ours_size"]
    variants = [r for r in rows if r["path"][0] == "kernel"]
    main_columns = [
        ("source, layout", lambda r: f"{r['path'][1]}, {r['path'][2]}"),
        ("threads", lambda r: str(r["args"]["threads"])),
        ("ours GB/s", lambda r: with_cv(r, "GBps")),
        ("limit GB/s (paired)", lambda r: number(r.get("limit_GBps"))),
        ("fraction of limit", lambda r: fraction(r.get("frac_of_limit"))),
        ("limit row GB/s", lambda r: number(limit_rows.get(r["args"]["threads"], {}).get("GBps"))),
        ("x `_foreach`", lambda r: number(r.get("x_foreach"), 3)),
        ("x `lerp_` loop", lambda r: number(r.get("x_lerp_loop"), 3)),
    ]
    sweep_columns = [
        ("source", lambda r: r["path"][1]),
        ("elements", lambda r: size_text(r["args"]["elements"])),
        ("threads", lambda r: str(r["args"]["threads"])),
        ("ours GB/s", lambda r: with_cv(r, "GBps")),
        ("limit GB/s (paired)", lambda r: number(r.get("limit_GBps"))),
        ("fraction of limit", lambda r: fraction(r.get("frac_of_limit"))),
    ]
    md = ["### CPU update (`update_bench`)", "",
          "Fused EMA update vs the host bandwidth limit: an in-place `a += b` over the "
          "same fp32 arrays, split the same way, run right before each of our passes "
          "(paired) and once as its own row. Bytes counted: 12 per element for an fp32 "
          "source, 10 for bf16/fp16. `x _foreach` / `x lerp_ loop`: ours over ATen's "
          "peers at the same thread count.", "",
          markdown_table(main_columns, ours), "",
          "Scaling with model size (one tensor, prefix of the arena):", "",
          markdown_table(sweep_columns, sweep)]
    if variants:
        variant_columns = [
            ("kernel", lambda r: r["path"][1]),
            ("source", lambda r: r["path"][2]),
            ("threads", lambda r: str(r["args"]["threads"])),
            ("GB/s", lambda r: with_cv(r, "GBps")),
            ("limit GB/s (paired)", lambda r: number(r.get("limit_GBps"))),
            ("fraction of limit", lambda r: fraction(r.get("frac_of_limit"))),
        ]
        md += ["", "Each kernel variant this CPU has, alone over the arena, split over the "
               "pool as the update path splits it, each pass paired with a limit pass "
               "(the update path picks one at run time; the rows above use it):", "",
               markdown_table(variant_columns, variants)]
    counters = ["GBps", "limit_GBps", "frac_of_limit", "frac_vs_limit_row", "x_foreach",
                "x_lerp_loop"]
    return "\n".join(md), {
        "update": [plain(r, counters) for r in ours],
        "update_limit_rows": [plain(r, ["GBps"]) for r in limit_rows.values()],
        "update_size_sweep": [plain(r, counters) for r in sweep],
        "update_kernel_variants": [plain(r, counters) for r in variants]}


def offload_section(rows):
    def key(r):
        return (r["path"][1], r["args"]["elements"])
    overlap = {key(r): r for r in rows if r["path"][0] == "overlap"}
    pipeline = [r for r in rows if r["path"][0] == "pipeline"]
    direct = {key(r): r for r in rows if r["path"][0] == "direct"}
    sweep = [r for r in rows if r["path"][0] == "sweep"]
    small = [r for r in rows if r["path"][0] == "small"]
    averager = [r for r in rows if r["path"][0] == "averager"]
    bytes_per_element = {"f32": 4, "bf16": 2}

    def ov(r, counter, digits=3):
        return number(overlap.get(key(r), {}).get(counter), digits)

    def traffic(r):
        return f"{number(r.get('traffic_limit_GBps'))} ({number(r.get('traffic_bytes_per_element'))} B)"
    staged_columns = [
        ("source", lambda r: r["path"][1]),
        ("elements", lambda r: size_text(r["args"]["elements"])),
        ("source bytes", lambda r: size_text(
            r["args"]["elements"] * bytes_per_element.get(r["path"][1], 4), "B")),
        ("staged GB/s", lambda r: with_cv(r, "GBps")),
        ("copy GB/s", lambda r: number(r.get("copy_GBps"))),
        ("update GB/s", lambda r: number(r.get("update_GBps"))),
        ("fraction of min(copy, update)", lambda r: fraction(r.get("frac_of_min_limit"))),
        ("in-place GB/s", lambda r: number(r.get("inplace_GBps"))),
        ("traffic limit GB/s (bytes/element)", traffic),
        ("fraction of traffic limit", lambda r: fraction(r.get("frac_of_traffic_limit"))),
        ("overlap ratio median (best)", lambda r: f"{ov(r, 'ratio_median')} ({ov(r, 'ratio_best')})"),
        ("step / EMA ms", lambda r: f"{ov(r, 'step_ms')} / {ov(r, 'ema_ms')}"),
    ]
    direct_rows = [direct[key(r)] for r in pipeline if key(r) in direct]
    staged_by_key = {key(r): r for r in pipeline}

    def x_staged(r):
        s = staged_by_key.get(key(r), {}).get("GBps")
        return number(r["GBps"] / s) if s else "-"
    direct_columns = [
        ("source", lambda r: r["path"][1]),
        ("elements", lambda r: size_text(r["args"]["elements"])),
        ("direct GB/s", lambda r: with_cv(r, "GBps")),
        ("update GB/s (paired)", lambda r: number(r.get("update_GBps"))),
        ("fraction of update", lambda r: fraction(r.get("frac_of_update"))),
        ("waiter's share of chunks", lambda r: fraction(r.get("waiter_share"))),
        ("traffic limit GB/s (bytes/element)", traffic),
        ("fraction of traffic limit", lambda r: fraction(r.get("frac_of_traffic_limit"))),
        ("x staged", x_staged),
    ]
    sweep_columns = [
        ("chunkBytes", lambda r: size_text(r["args"]["chunk_MiB"] << 20, "B")),
        ("slots", lambda r: str(r["args"]["slots"])),
        ("staged GB/s", lambda r: with_cv(r, "GBps")),
        ("traffic limit GB/s", lambda r: number(r.get("traffic_limit_GBps"))),
        ("fraction of traffic limit", lambda r: fraction(r.get("frac_of_traffic_limit"))),
    ]
    averager_columns = [
        ("source", lambda r: r["path"][1]),
        ("elements", lambda r: size_text(r["args"]["elements"])),
        ("threads", lambda r: str(int(r["threads"])) if "threads" in r else "-"),
        ("update() + wait() GB/s", lambda r: with_cv(r, "GBps")),
        ("kernel alone GB/s (paired)", lambda r: number(r.get("kernel_GBps"))),
        ("fraction of kernel", lambda r: fraction(r.get("frac_of_kernel"))),
    ]
    small_columns = [
        ("path", lambda r: r["path"][1]),
        ("us per tensor", lambda r: with_cv(r, "us_per_tensor")),
        ("us per update", lambda r: number(r.get("us_per_update"))),
    ]
    sweep_size = size_text(sweep[0]["args"]["elements"]) if sweep else "-"
    staging = "-"
    if pipeline and pipeline[0].get("chunk_bytes"):
        staging = f"{pipeline[0].get('slots', 2):.0f} x " + size_text(
            int(pipeline[0]["chunk_bytes"]), "B")
    md = ["### Offload pipeline (`offload_bench`)", "",
          "Host sources (16 tensors) through the pipeline's two paths, host copy engine, "
          f"one math worker, {staging} staging (the defaults). Staged: the engine copies each chunk into staging and the "
          "worker folds it in (the path device sources take; the copy is a memcpy here, "
          "a DMA with a GPU). Direct: the worker reads the host sources in place (the "
          "default for host sources). GB/s of source bytes. Limits measured in the same "
          "run: the engine's copy alone, the one-thread CPU update alone, and the traffic "
          "limit: every byte the path moves (per element: 20 staged / 12 direct for f32, "
          "14 / 10 for bf16) at the rate one thread gets from an in-place `a += b` "
          "(in-place GB/s, 12 bytes per element counted). Overlap ratio (staged path) = "
          "wall(step + EMA) / max(step alone, EMA alone), training step pinned to one CPU "
          "and the EMA's threads to the other; 1.0 is perfect overlap, 2.0 none, target "
          "1.1. At the smallest sizes fixed costs (thread wake-ups) dominate every figure.",
          "", "Staged path:", "", markdown_table(staged_columns, pipeline), "",
          "Direct path (target: fraction of update >= 0.9). Each pass is paired with a "
          "pass of the one-thread update alone on the pool's worker, in alternating "
          "order, so both see the same load. The thread waiting in wait() runs the "
          "chunks the worker has not started, so two threads share the math here: the "
          "waiter's share says how much, and a fraction near 2 is both threads at the "
          "one-thread rate. Updates smaller than 4 chunks per thread are cut finer (down "
          "to 64 KiB) so the waiter gets a share.", "",
          markdown_table(direct_columns, direct_rows), "",
          "What a user's `update()` + `wait()` costs over the kernel alone (target: "
          "fraction of kernel >= 0.9): an Averager over the same 16 host tensors (direct "
          "path, the shared pool's size on this machine), each update paired with a pass "
          "of the kernel alone over the same sources and the Averager's own EMA, split "
          "over the same threads (`offload::updateOnPool`), in alternating order. "
          "Fraction = kernel time / update time.", "",
          markdown_table(averager_columns, averager), "",
          f"Staging sweep (staged path, f32, {sweep_size} elements): what the default "
          "chunkBytes is chosen from.", "", markdown_table(sweep_columns, sweep), "",
          "Fixed cost per tensor: 1000 f32 tensors of 16 elements, submit + wait "
          "(`averager`: Averager::update + wait). Target < 0.5 us per tensor.", "",
          markdown_table(small_columns, small), "",
          "What a 2-vCPU VM can and cannot show. Here the staged path's copy is a memcpy "
          "on the second vCPU: it adds 8 bytes of traffic per f32 element (4 per bf16) on "
          "the same memory system the math uses, and takes the core the training step "
          "would use. With a GPU the copy is a DMA: it crosses PCIe into pinned memory "
          "without a CPU thread, and the host bus carries only the DMA's write and the "
          "math (the DMA's read is device memory), so the staged path's limit is the "
          "math's 12 bytes per element, as the direct path's is here. Two caveats from "
          "this VM: one thread does not saturate its memory (two threads of `a += b` get "
          "about twice one thread's rate, see `update_bench`), so a traffic fraction "
          "above 1 means the copy thread added bandwidth rather than sharing it; and a "
          "VM's last-level cache is shared with other guests and often misreported (see "
          "the L3 in the header), so the staging sweep shows fixed costs per chunk more "
          "than the cache effect a dedicated server (or DDIO's share of its cache, where "
          "a DMA lands) would. The overlap row runs the staged path with the copy on the "
          "EMA's core; with a DMA engine the EMA's core does only the math."]
    overlap_counters = ["ratio_median", "ratio_best", "step_ms", "ema_ms", "wall_ms",
                        "step_overlapped_ms", "fence_wait_ms", "pinned"]
    limit_counters = ["inplace_GBps", "traffic_bytes_per_element", "traffic_limit_GBps",
                      "frac_of_traffic_limit"]

    def json_row(r):
        out = plain(r, ["GBps", "copy_GBps", "update_GBps", "limit_GBps", "frac_of_min_limit",
                        "staging_bytes", "device_bytes"] + limit_counters)
        o = overlap.get(key(r))
        for k in overlap_counters:
            if o is not None and k in o:
                out["overlap_" + k] = o[k]
        return out
    return "\n".join(md), {
        "offload": [json_row(r) for r in pipeline],
        "offload_direct": [plain(r, ["GBps", "update_GBps", "frac_of_update", "waiter_share"]
                                 + limit_counters)
                           for r in direct_rows],
        "offload_averager": [plain(r, ["GBps", "kernel_GBps", "frac_of_kernel", "threads"])
                             for r in averager],
        "offload_staging_sweep": [plain(r, ["GBps", "staging_bytes"] + limit_counters)
                                  for r in sweep],
        "offload_small_tensors": [plain(r, ["us_per_tensor", "us_per_update"]) for r in small]}


GATHER_OPS = {"GatherFullToAll": "gatherFull to all", "GatherStreamingToAll":
              "gatherStreaming to all", "GatherFullToRoot": "gatherFull to rank 0"}


def gather_section(rows):
    rows = sorted(rows, key=lambda r: (list(GATHER_OPS).index(r["path"][0]) if r["path"][0] in
                                       GATHER_OPS else 9, r["args"]["tensors"],
                                       r["args"]["ranks"], r["args"]["KiB"]))
    sizes = sorted({r["args"]["KiB"] for r in rows})
    cell = {(r["path"][0], r["args"]["tensors"], r["args"]["ranks"], r["args"]["KiB"]): r
            for r in rows}
    pivot_rows = sorted({k[:3] for k in cell}, key=lambda k: (list(GATHER_OPS).index(k[0])
                                                             if k[0] in GATHER_OPS else 9, *k[1:]))

    def frac(k, kib):
        r = cell.get((*k, kib))
        return fraction(r.get("frac_of_allgather")) if r else "-"
    pivot_columns = [("operation", lambda k: GATHER_OPS.get(k[0], k[0])),
                     ("tensors", lambda k: str(k[1])), ("W", lambda k: str(k[2]))] + [
        (size_text(kib << 10, "B"), lambda k, kib=kib: frac(k, kib)) for kib in sizes]
    columns = [
        ("operation", lambda r: GATHER_OPS.get(r["path"][0], r["path"][0])),
        ("tensors", lambda r: str(r["args"]["tensors"])),
        ("W", lambda r: str(r["args"]["ranks"])),
        ("bytes", lambda r: size_text(r["args"]["KiB"] << 10, "B")),
        ("algbw GB/s", lambda r: number(r.get("algbw_GBps"))),
        ("busbw GB/s", lambda r: number(r.get("busbw_GBps"))),
        ("plain all-gather busbw GB/s", lambda r: number(r.get("plain_busbw_GBps"))),
        ("fraction of plain", lambda r: fraction(r.get("frac_of_allgather"))),
    ]
    md = ["### Gather (`gather_bench`)", "",
          "Ranks as threads over Gloo on loopback. busbw = algbw x (W - 1) / W "
          "(nccl-tests); the limit is a plain c10d all-gather of the same bytes timed in "
          "the same iterations; each row is the median of its timed pairs. Target: "
          "fraction >= 0.8. W = 1 moves nothing between ranks (busbw 0 by the formula): "
          "its fraction is the ratio of algbw, i.e. our fixed cost over a local copy.", "",
          "Fraction of the plain all-gather, by world size W and model bytes:", "",
          markdown_table(pivot_columns, pivot_rows), "",
          "<details><summary>Every gather row</summary>", "",
          markdown_table(columns, rows), "", "</details>"]
    return "\n".join(md), {"gather": [plain(r, ["algbw_GBps", "busbw_GBps", "plain_busbw_GBps",
                                                "frac_of_allgather"]) for r in rows]}


def posthoc_section(rows, context):
    main = [r for r in rows if r["path"][0] in ("one_pass", "k_passes")]
    main.sort(key=lambda r: (r["path"][1], r["args"]["k"], r["path"][0] != "one_pass"))
    sweep = [r for r in rows if r["path"][0] == "one_pass_size"]
    elements = int(context.get("elements_per_profile", "0") or 0)
    columns = [
        ("source", lambda r: r["path"][1]),
        ("k", lambda r: str(r["args"]["k"])),
        ("method", lambda r: {"one_pass": "one pass", "k_passes": "k passes",
                              "one_pass_size": "one pass"}[r["path"][0]]),
        ("elements", lambda r: size_text(r["args"].get("n", elements))),
        ("bytes/element (model)", lambda r: number(r.get("bytes_per_elem_model"))),
        ("ns/element", lambda r: with_cv(r, "ns_per_elem")),
        ("GB/s", lambda r: number(r.get("GBps"))),
        ("limit GB/s (paired)", lambda r: number(r.get("limit_GBps"))),
        ("fraction of limit", lambda r: fraction(r.get("frac_of_limit"))),
        ("x k passes", lambda r: number(r.get("speedup_vs_k_passes"), 3)),
    ]
    md = ["### Post-hoc EMA profiles (`posthoc_bench`)", "",
          "k profiles of the same weights updated in one pass (`updateSpansMulti`, source "
          "read once) or in k `updateSpans` passes. Bytes per element as one pass moves "
          "them: source + 8k (read and write each fp32 EMA); ns/element is per source "
          "element for all k profiles. Limit: paired in-place `a += b`, 12 B/element. "
          "`x k passes`: time of k passes over time of one pass, same iteration.", "",
          markdown_table(columns, main), "", "Scaling with model size:", "",
          markdown_table(columns, sweep)]
    counters = ["bytes_per_elem_model", "ns_per_elem", "GBps", "limit_GBps", "frac_of_limit",
                "speedup_vs_k_passes"]
    def json_row(r):  # main rows name no size: it is the program's setting
        return {**plain(r, counters), "elements": r["args"].get("n", elements)}
    return "\n".join(md), {"posthoc": [json_row(r) for r in main],
                           "posthoc_size_sweep": [json_row(r) for r in sweep]}


def python_section(path):
    """bench/python_bench.py's rows: shardema.EMA from Python beside the
    EMAs a PyTorch user would pick instead, each beside the limit."""
    with open(path) as f:
        data = json.load(f)
    columns = [("dtype", lambda r: r["dtype"]), ("method", lambda r: r["method"]),
               ("full update ms", lambda r: number(r["ms"])),
               ("update() returns ms", lambda r: number(r["returns_ms"])),
               ("GB/s", lambda r: number(r["gb_s"])),
               ("of limit", lambda r: fraction(r["fraction_of_limit"])),
               ("x fastest peer", lambda r: number(r["speedup_vs_fastest_peer"], 2)),
               ("x fastest fp32-EMA peer",
                lambda r: number(r["speedup_vs_fastest_fp32_peer"], 2)),
               ("extra GiB", lambda r: number(r["extra_gib"], 3)),
               ("where (EMA dtype)", lambda r: f"{r['where']} ({r['ema_dtype']})")]
    limits = "; ".join(f"{dtype} rounds: " + ", ".join(f"{name} {number(rate)} GB/s"
                                                      for name, rate in rates.items())
                       for dtype, rates in data["limits"].items())
    md = ["### From Python (`bench/python_bench.py`)", "",
          f"{data['tensors']} tensors of mixed sizes, {size_text(data['elements'])} elements, "
          f"torch {data['torch']}. Limit: the faster STREAM-style kernel on all cores "
          f"({limits}). Every method, the limits included, runs once per round in rotating "
          "order; medians of the rounds. \"update() returns\" is what the training loop "
          "waits for; the full update adds wait(). GB/s counts the bytes each method moves "
          "(its EMA in its own dtype: a bf16 EMA of bf16 parameters moves 6 B/element, an "
          "fp32 one 10). The W=2 FSDP2 rows run two processes "
          "over Gloo, each on its shards; extra GiB is per rank there. Targets: update() "
          "under 0.5 ms; a full update 4x the fastest peer for bf16 and 2x for fp32, at 0.85 "
          "to 1.0 of the limit.", "", markdown_table(columns, data["rows"])]
    returns = data.get("update_returns_ms")
    if returns:
        md += ["", f"shardema `update()` returns for {data['tensors']} tensors of a 1 Mi element "
               f"fp32 model in {number(returns['warm'], 3)} ms with warm caches and "
               f"{number(returns['cold'], 3)} ms after a 256 MiB stream between updates. "
               "update() walks every tracked tensor's metadata, so its cost is a few cache "
               "misses per tensor: the rounds above, where other methods' passes (and the "
               "EMA's own over 64 Mi elements) evict that metadata, show the cold figure."]
    if data.get("profiles"):
        md += ["", profiles_section(data)]
    return "\n".join(md), {"python": data["rows"], "python_update_returns_ms": returns,
                           "python_profiles": data.get("profiles")}


def profiles_section(data):
    """python_bench_profiles.py's rows: one EMA of k profiles beside k EMA
    objects and the traffic limit of one read plus k EMAs."""
    columns = [("parameters", lambda r: r["dtype"]), ("method", lambda r: r["method"]),
               ("ms", lambda r: number(r["ms"])), ("limit ms", lambda r: number(r["limit_ms"])),
               ("of limit", lambda r: fraction(r["fraction_of_limit"])),
               ("x 1 profile", lambda r: number(r["x_one_profile"], 2)),
               ("separate / one", lambda r: number(r["x_vs_separate"], 2)
                if "x_vs_separate" in r else "")]
    rows = [dict(r, dtype=dtype) for dtype, found in data["profiles"].items() for r in found]
    return "\n".join([
        "#### Several EMAs from one read (`python_bench_profiles.py`)", "",
        "One `EMA(model, schedules=[...])` of k profiles (one read of the weights per update) "
        "beside k separate `EMA` objects of the same model, in the same rounds as the limit "
        "kernels. Limit: one read of the weights plus k fp32 EMAs read and written, (source + "
        "8k) B/element, at the faster limit kernel's rate; \"separate / one\": k objects' time "
        "over one EMA of k profiles.", "", markdown_table(columns, rows)])


# ---------------------------------------------------------------- machine

def machine(build_dir):
    info = {"cpus": len(os.sched_getaffinity(0)), "cpu_model": "unknown",
            "memory_gib": None, "os": platform.platform(), "compiler": None}
    try:
        with open("/proc/cpuinfo") as f:
            models = re.findall(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        info["cpu_model"] = models[0] if models else "unknown"
        with open("/proc/meminfo") as f:
            kib = int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1))
        info["memory_gib"] = round(kib / (1 << 20), 1)
        with open("/etc/os-release") as f:
            pretty = re.search(r'^PRETTY_NAME="?([^"\n]+)', f.read(), re.M)
        info["os"] = pretty.group(1) if pretty else info["os"]
    except OSError:
        pass
    cache = os.path.join(build_dir or "", "CMakeCache.txt")
    if build_dir and os.path.exists(cache):
        with open(cache) as f:
            found = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.+)$", f.read(), re.M)
        if found:
            try:
                version = subprocess.run([found.group(1), "--version"], capture_output=True,
                                         text=True, timeout=10).stdout.splitlines()
                info["compiler"] = version[0] if version else found.group(1)
            except (OSError, subprocess.SubprocessError):
                info["compiler"] = found.group(1)
    return info


def l3_text(context):
    sizes = [c["size"] for c in context.get("caches", []) if c.get("level") == 3]
    return size_text(max(sizes), "B") if sizes else "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--command", default="scripts/bench.sh")
    parser.add_argument("--build", help="build directory (compiler in the report)")
    parser.add_argument("--quick", action="store_true", help="mark the report as a quick run")
    args = parser.parse_args()

    contexts, sections, tables, missing = {}, [], {}, []
    for name in PROGRAMS:
        path = os.path.join(args.outdir, name + ".json")
        if not os.path.exists(path):
            missing.append(name)
            continue
        try:
            context, rows = load_rows(path)
        except (ValueError, KeyError) as error:  # cut short or not Google Benchmark's
            print(f"bench_report: skipping {path}: {error}", file=sys.stderr)
            missing.append(name)
            continue
        contexts[name] = context
        if name == "update_bench":
            md, t = update_section(rows)
        elif name == "offload_bench":
            md, t = offload_section(rows)
        elif name == "gather_bench":
            md, t = gather_section(rows)
        else:
            md, t = posthoc_section(rows, context)
        sections.append(md)
        tables.update(t)
    if not contexts:
        sys.exit(f"bench_report: no benchmark JSON in {args.outdir}")
    python_json = os.path.join(args.outdir, "python_bench.json")
    if os.path.exists(python_json):  # bench/python_bench.py: not Google Benchmark's format
        md, t = python_section(python_json)
        sections.append(md)
        tables.update(t)

    first = contexts[next(iter(contexts))]
    date = first.get("date") or datetime.datetime.now(datetime.timezone.utc).isoformat()
    try:
        when = datetime.datetime.fromisoformat(date).astimezone(datetime.timezone.utc)
        when_text = when.strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        when_text = date
    m = machine(args.build)
    loads = {n: c.get("load_avg", [None])[0] for n, c in contexts.items()}
    header = ["## Performance", "",
              f"Measured {when_text} on {m['cpus']} CPUs of "
              f"\"{m['cpu_model']}\" (L3 {l3_text(first)}), {m['memory_gib']} GiB memory, "
              f"{m['os']}" + (f", {m['compiler']}" if m['compiler'] else "") + ".", "",
              f"Reproduce: `{args.command}`", "",
              "Load average (1 min) when each program started: " +
              ", ".join(f"{n} {number(v, 2)}" for n, v in loads.items()) +
              ". Each figure sits beside its limit measured in the same run; on a shared "
              "machine read the fractions, not the absolute rates."]
    if args.quick:
        header += ["", "**Quick mode**: smaller sizes and short runs, to test the script; "
                   "the figures are not representative."]
    if missing:
        header += ["", "Not run or failed (see its .log): " + ", ".join(missing) + "."]
    report = "\n\n".join(["\n".join(header)] + sections) + "\n"
    with open(os.path.join(args.outdir, "report.md"), "w") as f:
        f.write(report)
    meta = {"date": date, "command": args.command, "quick": args.quick, "machine": m,
            "l3": l3_text(first), "load_avg_at_start": loads, "missing": missing,
            "contexts": contexts}
    with open(os.path.join(args.outdir, "report.json"), "w") as f:
        json.dump({"meta": meta, "tables": tables}, f, indent=1)


if __name__ == "__main__":
    main()
