"""python_bench.py's profile rows: one shardema.EMA of k profiles
(EMA(schedules=[...]), each update reading the weights once) for k = 1, 2,
4, beside k separate shardema.EMA objects of the same model (each reading
the weights again), and beside the traffic limit of reading the weights
once plus k EMAs.

The traffic of k profiles: the parameter read once (4 B fp32, 2 B bf16)
plus k fp32 EMAs read and written (8 B each), per element. The limit is
that traffic at the memory rate the STREAM-style kernels of
python_bench.limit_kernels reach in the same rounds (the faster of the two,
as python_bench's other rows); "of limit" is the limit's time over the
measured one ('!' above 1: the limit kernel ran slower than the memory
system, as python_bench marks its other rows). k separate EMAs move k times the parameter read, which the
one-read row saves."""
from typing import Callable, Dict, List

import torch

PROFILE_COUNTS = (1, 2, 4)
DECAYS = (0.999, 0.9999, 0.99, 0.9)  # one per profile, any distinct values


def _schedules(k: int) -> list:
    import shardema
    return [shardema.DecaySchedule.constant(d) for d in DECAYS[:k]]


def bench_profiles(model_of: Callable[[], torch.nn.Module], elements: int, source_bytes: int,
                   repeats: int, limits: Dict[str, tuple],
                   medians_of: Callable[[list, int], Dict[str, float]]) -> List[dict]:
    """Rows for k = PROFILE_COUNTS: one EMA of k profiles, k EMA objects,
    timed in the same interleaved rounds as the limit kernels."""
    import shardema
    model = model_of()
    step = [0]
    methods = []
    for k in PROFILE_COUNTS:
        one = shardema.EMA(model, schedules=_schedules(k))

        def one_read(ema=one):
            step[0] += 1
            ema.update(step[0])
            ema.wait()
        methods.append((f"shardema.EMA, {k} profile{'s' if k > 1 else ''} (one read)", k,
                        one_read))
        if k == 1:
            continue
        separate = [shardema.EMA(model, schedules=[s]) for s in _schedules(k)]

        def k_objects(emas=separate):
            step[0] += 1
            for ema in emas:
                ema.update(step[0])
            for ema in emas:
                ema.wait()
        methods.append((f"{k} shardema.EMA objects (k reads)", k, k_objects))
    medians = medians_of([(name, fn) for name, (fn, _) in limits.items()] +
                         [(name, fn) for name, _, fn in methods], repeats)
    rate = max(per * elements / medians[name] / 1e9 for name, (_, per) in limits.items())
    one_profile = medians[methods[0][0]]
    rows = []
    for name, k, _ in methods:
        seconds = medians[name]
        moved = (source_bytes + 8 * k) * elements  # one read, k EMAs read and written
        limit_seconds = moved / (rate * 1e9)
        rows.append({"method": name, "profiles": k, "ms": seconds * 1e3,
                     "limit_ms": limit_seconds * 1e3, "fraction_of_limit": limit_seconds / seconds,
                     "x_one_profile": seconds / one_profile, "limit_gb_s": rate})
    separate = {r["profiles"]: r["ms"] for r in rows if "objects" in r["method"]}
    for r in rows:
        if "one read" in r["method"] and r["profiles"] in separate:
            r["x_vs_separate"] = separate[r["profiles"]] / r["ms"]
    return rows


def print_profile_rows(dtype: str, rows: List[dict]) -> None:
    print(f"  profiles ({dtype} parameters; limit = one read of the weights + k fp32 EMAs at "
          f"{rows[0]['limit_gb_s']:.2f} GB/s):")
    print(f"  {'method':<44}{'ms':>9}{'limit ms':>10}{'of limit':>10}{'x 1 profile':>12}"
          f"{'separate/one':>14}")
    for r in rows:
        versus = f"{r['x_vs_separate']:.2f}" if "x_vs_separate" in r else ""
        over = "!" if r["fraction_of_limit"] > 1.0 else " "
        print(f"  {r['method']:<44}{r['ms']:>9.2f}{r['limit_ms']:>10.2f}"
              f"{r['fraction_of_limit']:>9.2f}{over}{r['x_one_profile']:>12.2f}{versus:>14}")
