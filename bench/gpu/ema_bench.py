#!/usr/bin/env python3
"""The GPU benchmark the mission is judged by (issue 34, item 5): one GPU
trains a bf16 decoder-only transformer of about 1.3 B parameters for 30
steps, once with each EMA of ema_bench_peers.py (none; timm's fp32
_foreach_lerp_ on the GPU; torchtitan's pinned-host offload; NeMo's host
copy and thread; shardema), and writes one markdown table (and the same rows
as JSON) under --out:

  - step time: the median of the timed steps, each from one step's start
    event to the next one's on the training stream (CUDA events), so a
    host that blocks (a fence, a join) and leaves the GPU idle counts;
  - the ratio to no EMA; peak and steady device memory (the caching
    allocator's), and what the EMA keeps on the device beyond no EMA;
  - D2H GB/s: the device-to-host bytes of one update over the span of its
    copies (torch.profiler's gpu_memcpy events, first start to last end),
    beside a plain pinned cudaMemcpyAsync (Tensor.copy_) of the same bytes;
  - EMA alone: one update, with no training, from its call until complete;
    overlap ratio = step with the EMA / max(step without, EMA alone): 1.0
    is perfect overlap (offload_bench's definition);
  - max |EMA - float64|: each EMA at 4096 sampled elements of three
    weights against a float64 EMA of the same weights kept beside the loop.

    ema_bench.py [--out DIR]          the GPU run (bench/gpu/run.sh calls it)
    ema_bench.py --tiny [--out DIR]   a tiny model, on the CPU without a GPU:
                                      the end-to-end check CI runs
Exit status: 0 when every fp32 EMA matched its float64 reference, else 1.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ema_bench_peers as peers  # noqa: E402
from ema_bench_model import Transformer, parameter_count  # noqa: E402
from ema_bench_report import write_report  # noqa: E402

FULL = dict(width=2048, layers=24, heads=16, vocab=32000, seq=2048, batch=8, steps=30, warmup=5)
TINY = dict(width=64, layers=2, heads=4, vocab=256, seq=32, batch=2, steps=6, warmup=2)
SAMPLES = 4096


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the CPU check)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=".", help="folder for ema_bench.md and .json")
    parser.add_argument("--methods", default=",".join(m.name for m in peers.ALL),
                        help="comma separated method names to run, in order")
    parser.add_argument("--budget-seconds", type=float, default=300.0,
                        help="skip the methods that would not finish within this")
    for key, value in FULL.items():
        parser.add_argument(f"--{key}", type=int, default=None, help=f"(full: {value})")
    args = parser.parse_args(argv)
    shape = dict(TINY if args.tiny else FULL)
    for key in FULL:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    args.shape = shape
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.torch_dtype = getattr(torch, args.dtype)
    return args


class Clock:
    """Step starts on the training stream (CUDA events), or host time on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self):
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


class Reference:
    """A float64 EMA of SAMPLES elements of three weights, kept on the weights'
    device from their values after every optimizer step."""

    def __init__(self, model):
        named = dict(model.named_parameters())
        self.names = [n for n in ("embed.weight", "blocks.0.mlp_in.weight", "head.weight")
                      if n in named]
        self.params = [named[n] for n in self.names]
        self.index = [torch.linspace(0, p.numel() - 1, min(SAMPLES, p.numel()),
                                     device=p.device).long() for p in self.params]
        self.start = [self._sample(i) for i in range(len(self.params))]
        self.ema = [s.clone() for s in self.start]

    def _sample(self, i):
        return self.params[i].detach().reshape(-1)[self.index[i]].double()

    def step(self):
        for i, ema in enumerate(self.ema):
            ema.mul_(peers.DECAY).add_(self._sample(i), alpha=1 - peers.DECAY)

    def check(self, method):
        """(max |EMA - float64| over the samples, how far the reference moved)."""
        worst, moved = 0.0, 0.0
        for i, name in enumerate(self.names):
            ema = method.ema_of(name)
            if ema is None:
                return None, None
            got = ema.reshape(-1)[self.index[i].cpu()]
            worst = max(worst, (got - self.ema[i].cpu()).abs().max().item())
            moved = max(moved, (self.ema[i] - self.start[i]).abs().max().item())
        return worst, moved


def batches(shape, device):
    generator = torch.Generator(device="cpu").manual_seed(1)
    count = shape["warmup"] + shape["steps"]
    tokens = torch.randint(0, shape["vocab"], (count, shape["batch"], shape["seq"] + 1),
                           generator=generator)
    return tokens.to(device)


def build(args):
    torch.manual_seed(0)
    s = args.shape
    model = Transformer(s["vocab"], s["width"], s["layers"], s["heads"], s["seq"], args.device)
    model = model.to(dtype=args.torch_dtype)
    fused = args.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    return model, optimizer


def train_step(model, optimizer, method, tokens, step):
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             tokens[:, 1:].reshape(-1))
    loss.backward()
    method.before_step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.update(step)


def measure_alone(method, step, device):
    """Host ms of one update from its call to complete(), with no training."""
    peers.cuda_sync(device)
    start = time.perf_counter()
    method.update(step)
    method.complete()
    peers.cuda_sync(device)
    return (time.perf_counter() - start) * 1e3


def memcpy_span(method, step, device, expected_bytes):
    """(bytes, seconds) of one update's device-to-host copies, first start to
    last end, from torch.profiler's gpu_memcpy events (their "bytes", or
    expected_bytes where the trace gives none); None where there are none
    or the profiler cannot see them."""
    if device.type != "cuda" or not method.d2h:
        return None
    from torch.profiler import ProfilerActivity, profile
    with tempfile.TemporaryDirectory() as folder:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            method.update(step)
            method.complete()
            torch.cuda.synchronize()
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return d2h_span(events, expected_bytes)


def d2h_span(events, expected_bytes):
    """(bytes, seconds) of a chrome trace's device-to-host copies: kineto
    names each "Memcpy DtoH (Device -> Pinned)" (category gpu_memcpy, or
    Memcpy in older kineto) with args.bytes; None when there is none."""
    copies = [e for e in events
              if e.get("ph") == "X" and str(e.get("name", "")).startswith("Memcpy DtoH")]
    if not copies:
        return None
    begin = min(e["ts"] for e in copies)
    end = max(e["ts"] + e.get("dur", 0) for e in copies)
    moved = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
    return moved or expected_bytes, (end - begin) * 1e-6


def plain_pinned_copy(nbytes, device):
    """GB/s of one plain pinned device-to-host copy of nbytes (median of 3)."""
    if device.type != "cuda":
        return None
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(4):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source, non_blocking=True)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    del source, target
    return nbytes / statistics.median(times[1:]) / 1e9


def timed_steps(model, optimizer, method, reference, tokens, args):
    """The warmup, then the timed steps: (the step count, each step's ms)."""
    step = 0
    for _ in range(args.shape["warmup"]):
        step += 1
        train_step(model, optimizer, method, tokens[step - 1], step)
        reference.step()
    method.complete()
    peers.cuda_sync(args.device)
    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    clock = Clock(args.device)
    for _ in range(args.shape["steps"]):
        clock.mark()
        step += 1
        train_step(model, optimizer, method, tokens[step - 1], step)
        reference.step()
    clock.mark()
    steps_ms = clock.intervals_ms()
    method.complete()
    peers.cuda_sync(args.device)
    return step, steps_ms


def run_method(cls, args, tokens, source_bytes):
    device = args.device
    model, optimizer = build(args)
    reference = Reference(model)
    method = cls(model)
    step, steps_ms = timed_steps(model, optimizer, method, reference, tokens, args)
    row = dict(method=method.name, where=method.where, step_ms=statistics.median(steps_ms))
    if device.type == "cuda":
        row.update(peak_bytes=torch.cuda.max_memory_allocated(device),
                   steady_bytes=torch.cuda.memory_allocated(device))
    # Checked before the updates alone below move the EMA on.
    row["error"], row["moved"] = reference.check(method)
    row["alone_ms"] = statistics.median(measure_alone(method, step + i, device)
                                        for i in (1, 2, 3)) if method.name != "none" else None
    try:
        span = memcpy_span(method, step + 4, device, source_bytes)
    except Exception as error:  # the profiler is a measuring aid, not the benchmark
        print(f"ema_bench: {method.name}: no profiler trace ({error})", flush=True)
        span = None
    if span is not None:
        row["d2h_bytes"], row["d2h_seconds"] = span
    if getattr(method, "last_copy_pinned", None) is not None:
        row["where"] += " (pinned by ATen)" if method.last_copy_pinned else " (pageable)"
    method.close()
    del method, optimizer, model, reference
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    wanted = [name.strip() for name in args.methods.split(",") if name.strip()]
    by_name = {m.name: m for m in peers.ALL}
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        print(f"ema_bench: unknown --methods {unknown}; known: {list(by_name)}")
        return 2
    s = args.shape
    probe = Transformer(s["vocab"], s["width"], s["layers"], s["heads"], s["seq"], "meta")
    params = parameter_count(probe)
    source_bytes = params * torch.empty(0, dtype=args.torch_dtype).element_size()
    context = dict(device=str(args.device), dtype=args.dtype, shape=s, parameters=params,
                   torch=torch.__version__, decay=peers.DECAY,
                   card=torch.cuda.get_device_name(args.device) if args.device.type == "cuda"
                   else "CPU (the tiny end-to-end check; timings mean nothing)",
                   plain_gbps=plain_pinned_copy(source_bytes, args.device),
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"ema_bench: {params / 1e9:.3g} B parameters, {args.dtype}, {context['card']}",
          flush=True)
    tokens = batches(s, args.device)
    rows, started, slowest = [], time.monotonic(), 0.0
    for name in wanted:
        elapsed = time.monotonic() - started
        if rows and elapsed + 1.5 * slowest > args.budget_seconds:
            print(f"ema_bench: {name} skipped: {elapsed:.0f} s spent of the "
                  f"{args.budget_seconds:.0f} s budget", flush=True)
            continue
        began = time.monotonic()
        rows.append(run_method(by_name[name], args, tokens, source_bytes))
        slowest = max(slowest, time.monotonic() - began)
        print(f"ema_bench: {name}: {rows[-1]['step_ms']:.1f} ms per step", flush=True)
        write_report(args.out, context, rows)  # a run cut short keeps what it measured
    ok = write_report(args.out, context, rows)
    print(open(os.path.join(args.out, "ema_bench.md")).read(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
