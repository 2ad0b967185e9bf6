"""python_bench.py's trainable-only rows: shardema.EMA of a LoRA-style model
(issue 33: 8.5 M parameters, 131 k of them trainable) keeping everything
against EMA(model, trainable_only=True).

The model: LAYERS frozen bf16 Linear(WIDTH, WIDTH) bases with fp32 LoRA
adapters of rank RANK beside each (A: RANK x WIDTH, B: WIDTH x RANK), the
way peft lays them out. Each row gives the full update (update() + wait()),
the host memory of the EMA values (4 B per tracked element), the traffic
the update moves (read each tracked parameter in its dtype, read and write
its fp32 EMA) as GB/s and as a fraction of the limit python_bench.py
measures in the same rounds (its STREAM-style kernels, sized like the
everything EMA's elements)."""
import torch

import shardema

LAYERS, WIDTH, RANK = 8, 1024, 8


class LoraLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(WIDTH, WIDTH).to(torch.bfloat16).requires_grad_(False)
        self.lora_A = torch.nn.Parameter(torch.randn(RANK, WIDTH) * 0.01)
        self.lora_B = torch.nn.Parameter(torch.zeros(WIDTH, RANK))


def lora_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[LoraLinear() for _ in range(LAYERS)])


def moved_bytes(ema, model):
    """Bytes one update moves: each tracked parameter read in its dtype, its
    fp32 EMA read and written."""
    params = dict(model.named_parameters())
    kept = ema.local_ema()
    return sum(params[n].numel() * (params[n].element_size() + 8) for n in kept)


def bench_trainable(repeats, limit_kernels, interleaved_medians):
    """Rows for the two EMAs, and the limit (GB/s) of the same rounds."""
    model = lora_model()
    emas = {"shardema.EMA, everything": shardema.EMA(model, decay=0.999),
            "shardema.EMA, trainable_only=True": shardema.EMA(model, decay=0.999,
                                                               trainable_only=True)}
    step = [0]

    def timed(ema):
        def run():
            step[0] += 1
            ema.update(step[0])
            ema.wait()
        return run
    total = sum(p.numel() for p in model.parameters())
    limits = limit_kernels(total)
    medians = interleaved_medians([(n, fn) for n, (fn, _) in limits.items()] +
                                  [(n, timed(e)) for n, e in emas.items()], repeats)
    limit = max(per * total / medians.pop(n) / 1e9 for n, (_, per) in limits.items())
    rows = []
    for name, ema in emas.items():
        seconds = medians[name]
        kept = ema.local_ema()
        rate = moved_bytes(ema, model) / seconds / 1e9
        rows.append({"method": name, "ms": seconds * 1e3,
                     "tracked_elements": sum(t.numel() for t in kept.values()),
                     "host_mib": sum(t.numel() * t.element_size() for t in kept.values())
                     / (1 << 20),
                     "gb_s": rate, "limit_gb_s": limit, "fraction_of_limit": rate / limit})
    rows[1]["speedup_vs_everything"] = rows[0]["ms"] / rows[1]["ms"]
    return {"parameters": total, "trainable": sum(p.numel() for p in model.parameters()
                                                  if p.requires_grad), "rows": rows}


def print_trainable(result):
    print(f"  trainable only: {result['parameters'] / 1e6:.2f} M parameters (bf16 bases), "
          f"{result['trainable'] / 1e3:.0f} k trainable (fp32 LoRA adapters), "
          f"limit {result['rows'][0]['limit_gb_s']:.2f} GB/s")
    print(f"  {'method':<36}{'ms':>8}{'host MiB':>10}{'GB/s':>7}{'of limit':>10}{'x all':>7}")
    for r in result["rows"]:
        over = "!" if r["fraction_of_limit"] > 1.0 else " "
        print(f"  {r['method']:<36}{r['ms']:>8.2f}{r['host_mib']:>10.2f}{r['gb_s']:>7.2f}"
              f"{r['fraction_of_limit']:>9.2f}{over}{r.get('speedup_vs_everything', 1.0):>7.2f}")
