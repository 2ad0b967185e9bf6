"""ema_bench.py's table: the rows it measured as markdown (ema_bench.md) and
JSON (ema_bench.json) under the output folder, each written to a temporary
file and renamed, and the issue's targets read off them."""
import json
import math
import os

# An fp32 EMA of the same weights differs from the float64 one by a few fp32
# roundings per step; the check also needs the reference to have moved far
# beyond that, or it could not tell a right EMA from a stale one.
FP32_TOLERANCE = 1e-6
MIN_MOVED = 100 * FP32_TOLERANCE

COLUMNS = ["EMA", "where it lives (dtype)", "step ms (median)", "x no EMA", "peak device GiB",
           "steady device GiB", "EMA on device MiB", "D2H GB/s", "x plain pinned copy",
           "EMA alone ms", "overlap ratio", "max abs EMA - float64 (reference moved)"]


def fmt(value, spec=".3g"):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def fp32_ema(row):
    return "float32" in row["where"]


def check_of(row):
    """'ok' / 'FAILED' for an fp32 EMA, 'bf16 EMA' (reported, not judged) or '-'."""
    if row["error"] is None:
        return "-"
    if not fp32_ema(row):
        return "not judged: not float32"
    good = row["error"] <= FP32_TOLERANCE and row["moved"] >= MIN_MOVED
    return "ok" if good else "FAILED"


def derived(context, rows):
    """Each row with the columns that need another row (no EMA, the plain copy)."""
    base = next((r for r in rows if r["method"] == "none"), None)
    out = []
    for row in rows:
        r = dict(row)
        if base is not None and row is not base:
            r["ratio"] = row["step_ms"] / base["step_ms"]
            if "steady_bytes" in row:
                r["ema_device_bytes"] = row["steady_bytes"] - base["steady_bytes"]
            if row.get("alone_ms"):
                r["overlap"] = row["step_ms"] / max(base["step_ms"], row["alone_ms"])
        if row.get("d2h_seconds"):
            r["d2h_gbps"] = row["d2h_bytes"] / row["d2h_seconds"] / 1e9
            if context.get("plain_gbps"):
                r["x_plain"] = r["d2h_gbps"] / context["plain_gbps"]
        r["check"] = check_of(row)
        out.append(r)
    return out


def scaled(value, unit):
    return None if value is None else value / unit


def table_line(r):
    gib, mib = 1024.0 ** 3, 1024.0 ** 2
    error = "-" if r["error"] is None else f"{r['error']:.2g} ({r['moved']:.2g}) {r['check']}"
    cells = [r["method"], r["where"], fmt(r["step_ms"]), fmt(r.get("ratio"), ".3f"),
             fmt(scaled(r.get("peak_bytes"), gib)), fmt(scaled(r.get("steady_bytes"), gib)),
             fmt(scaled(r.get("ema_device_bytes"), mib)), fmt(r.get("d2h_gbps")),
             fmt(r.get("x_plain"), ".2f"), fmt(r.get("alone_ms")), fmt(r.get("overlap"), ".2f"),
             error]
    return "| " + " | ".join(cells) + " |"


def targets(rows):
    """The issue's targets for shardema, one line each ('-' where not measured)."""
    by = {r["method"]: r for r in rows}
    ours = by.get("shardema")
    if ours is None or "ratio" not in ours:
        return ["targets: not read (shardema or the no-EMA run missing)"]
    lines = [f"- adds {100 * (ours['ratio'] - 1):.2f} % to the step (target <= 2 %): "
             f"{'met' if ours['ratio'] <= 1.02 else 'missed'}"]
    if "ema_device_bytes" in ours:
        mib = ours["ema_device_bytes"] / 2**20
        lines.append(f"- keeps {mib:.1f} MiB on the device beyond no EMA (target 0): "
                     f"{'met' if ours['ema_device_bytes'] <= 0 else 'missed'}")
    if "x_plain" in ours:
        lines.append(f"- D2H at {ours['x_plain']:.2f} of a plain pinned copy (target >= 0.9): "
                     f"{'met' if ours['x_plain'] >= 0.9 else 'missed'}")
    for peer in ("torchtitan-style offload", "NeMo-style CPU copy + thread"):
        if peer in by:
            faster = ours["step_ms"] < by[peer]["step_ms"]
            lines.append(f"- step {ours['step_ms']:.1f} ms vs {peer} {by[peer]['step_ms']:.1f} ms "
                         f"(target: faster): {'met' if faster else 'missed'}")
    return lines


def write_atomic(path, text):
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def write_report(folder, context, rows):
    """Writes ema_bench.md and ema_bench.json; returns whether every fp32
    EMA matched its float64 reference."""
    full = derived(context, rows)
    s = context["shape"]
    lines = [f"{context['card']}, torch {context['torch']}, {context['date']}: a "
             f"{context['parameters'] / 1e9:.3g} B parameter {context['dtype']} transformer "
             f"(width {s['width']}, {s['layers']} layers, {s['batch']} x {s['seq']} tokens per "
             f"step), {s['steps']} timed steps after {s['warmup']}, AdamW, decay "
             f"{context['decay']}. Plain pinned device-to-host copy of the "
             f"{context['dtype']} weights: {fmt(context.get('plain_gbps'))} GB/s.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += [table_line(r) for r in full]
    lines += ["", "shardema against the targets of issue 34:"] + targets(full)
    write_atomic(os.path.join(folder, "ema_bench.md"), "\n".join(lines) + "\n")
    write_atomic(os.path.join(folder, "ema_bench.json"),
                 json.dumps(dict(context=context, rows=full), indent=1, default=str) + "\n")
    return all(r["check"] != "FAILED" for r in full)
