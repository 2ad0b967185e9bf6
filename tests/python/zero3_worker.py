"""One rank of test_zero3.py: a tiny model under a real DeepSpeed ZeRO-3
engine (deepspeed.initialize, stage 3, its CPU accelerator over Gloo),
trained a few AdamW steps with shardema.EMA built from engine.module.
After every update the rank gathers the full parameters
(deepspeed.zero.GatheredParameters) and rank 0's buffers, recomputes their
EMA in float64, and compares it with full_state_dict() and with what
local_ema() holds of its own partitions.

Scenarios: reference (the EMA, a save_checkpoint / load_checkpoint round
trip, export_weights loaded strict into the plain model), swap (forwards
inside and after swap() see the EMA and the raw weights, persistent
parameters included), refusals. Started by rank_launch.launch;
rank_worker.py says how and what it reports."""
import copy
import os
import pickle

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import rank_worker  # noqa: E402
import shardema  # noqa: E402

STEPS = 4
DECAY = 0.9


def plain_model():
    """Sizes that split unevenly over 2 ranks (35 = 18 + 17 elements, a
    5-element bias 3 + 2), a 1-element parameter (rank 1's partition is
    padding only) and a BatchNorm, whose buffers ZeRO-3 does not partition."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    # (1,), not 0-dim: DeepSpeed's engine cannot broadcast a 0-dim parameter.
    model.register_parameter("scale", nn.Parameter(torch.tensor([1.5])))
    return model


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = plain_model()

    def forward(self, x):
        return self.body(x) * self.body.scale


def engine_of(rank):
    import deepspeed
    # What torchrun sets and DeepSpeed asks for; the group is rank_worker's.
    os.environ["LOCAL_RANK"] = str(rank)
    model = Scaled()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True,
              # Parameters of at most 5 elements stay gathered between
              # forwards (persistent); the others are gathered per forward.
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 5}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      dist_init_required=False)
    return engine


def train_step(engine, rank, step):
    torch.manual_seed(100 * step + rank)  # each rank its own batch
    x, y = torch.randn(4, 7), torch.randn(4, 3)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()


def gathered(engine, own_buffers=False):
    """The full parameters (every rank) and rank 0's buffers (this rank's
    own: `own_buffers`), float64."""
    import deepspeed
    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        out = {n: p.detach().to(torch.float64).clone() for n, p in module.named_parameters()}
    for n, b in module.named_buffers():
        b = b.detach().clone()
        if not own_buffers:
            dist.broadcast(b, 0)
        out[n] = b.to(torch.float64) if b.is_floating_point() else b
    return out


def fold(reference, full):
    """ema = w at the first update (copy), then DECAY * ema + (1 - DECAY) *
    w; integer buffers (num_batches_tracked) keep the value the EMA was
    built with (policy "ema_pytorch" copies them once), which `reference`
    holds before the first update."""
    out = {}
    for n, w in full.items():
        if not w.is_floating_point():
            out[n] = reference[n]
        elif reference[n] is None:
            out[n] = w
        else:
            out[n] = DECAY * reference[n] + (1 - DECAY) * w
    return out


def close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    error = (got.to(torch.float64) - want.to(torch.float64)).abs().max().item() \
        if got.numel() else 0.0
    assert error <= 1e-6, f"{what}: off by {error}"


def check(ema, engine, reference, rank, world, where):
    full = ema.full_state_dict(rank0_only=False)
    assert sorted(full) == sorted(reference), f"{where}: names {sorted(full)}"
    for n, want in reference.items():
        close(full[n], want, f"{where}: full '{n}'")
    local = ema.local_ema()
    for n, p in engine.module.named_parameters():
        per_rank = -(-p.ds_numel // world)
        begin, end = min(rank * per_rank, p.ds_numel), min((rank + 1) * per_rank, p.ds_numel)
        close(local[n], reference[n].flatten()[begin:end], f"{where}: rank {rank}'s '{n}'")


def train_with_ema(rank, world):
    engine = engine_of(rank)
    ema = shardema.EMA(engine.module, decay=DECAY, update_after_step=0, update_every=1)
    assert ema.layout == "zero3", ema.layout
    # Floating tensors: None until the first update copies them.
    reference = {n: None if t.is_floating_point() else t for n, t in gathered(engine).items()}
    for step in range(1, STEPS + 1):
        train_step(engine, rank, step)
        ema.update()
        reference = fold(reference, gathered(engine))
        check(ema, engine, reference, rank, world, f"step {step}")
    return engine, ema, reference


def reference(rank, world, out):
    engine, ema, expected = train_with_ema(rank, world)
    # The engine itself names the same tensors (DeepSpeedEngine unwrapped).
    assert shardema.EMA(engine).full_state_dict(rank0_only=False).keys() == expected.keys()
    folder = os.path.join(out, "checkpoint")
    ema.save_checkpoint(folder)
    for step in range(STEPS + 1, STEPS + 3):
        train_step(engine, rank, step)
        ema.update()
    ema.load_checkpoint(folder)
    assert ema.step == STEPS, ema.step
    check(ema, engine, expected, rank, world, "after load_checkpoint")
    path = os.path.join(out, "ema.safetensors")
    ema.export_weights(path)
    if rank == 0:
        from safetensors.torch import load_file
        exported = load_file(path)
        model = Scaled()
        model.load_state_dict(exported, strict=True)  # a plain model's names
        for n, want in expected.items():
            close(exported[n], want, f"exported '{n}'")


def swap(rank, world, out):
    engine, ema, expected = train_with_ema(rank, world)
    # Each rank's BatchNorm statistics are its own (swap() puts rank 0's EMA
    # of them in every rank, and each rank's own back).
    raw = gathered(engine, own_buffers=True)
    module = engine.module
    persistent = [n for n, p in module.named_parameters() if p.ds_persist]
    assert persistent and len(persistent) < len(raw), persistent
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(7))

    def plain_output(weights):
        model = Scaled()
        model.load_state_dict({n: t.to(torch.float32) if t.is_floating_point() else t
                               for n, t in weights.items()})
        return model.eval()(x)

    module.eval()
    with torch.no_grad():
        module(x)  # an evaluation forward first: it leaves gathered copies
        with ema.swap(module):
            close(module(x), plain_output(expected), "a forward inside swap()")
            # every rank's buffers too: rank 0's EMA of them
            inside = gathered(engine, own_buffers=True)
            for n in expected:
                close(inside[n], expected[n], f"gathered '{n}' inside swap()")
        close(module(x), plain_output(raw), "a forward after swap()")
    after = gathered(engine, own_buffers=True)
    for n in raw:
        close(after[n], raw[n], f"gathered '{n}' after swap()")
    module.train()
    train_step(engine, rank, STEPS + 1)  # training goes on from the raw weights
    ema.update()
    check(ema, engine, fold(expected, gathered(engine)), rank, world, "an update after swap()")


def refusals(rank, world, out):
    engine = engine_of(rank)
    ema = shardema.EMA(engine.module)
    for api, call in (("module", lambda: ema.module()), ("copy_from", lambda: ema.copy_from()),
                      ("state_dict", lambda: ema.state_dict())):
        try:
            call()
        except ValueError as error:
            assert f"EMA.{api} is not supported for a DeepSpeed ZeRO-3 model" in str(error), \
                str(error)
        else:
            raise AssertionError(f"EMA.{api} was not refused")
    # A copy is refused; its advice must work here, where state_dict() does not.
    for what, call in (("deepcopy", lambda: copy.deepcopy(ema)),
                       ("pickle", lambda: pickle.dumps(ema))):
        try:
            call()
        except TypeError as error:
            assert "use save_checkpoint() (or export_weights() for the weights alone)" in \
                str(error) and "state_dict" not in str(error), str(error)
        else:
            raise AssertionError(f"{what} of a ZeRO-3 EMA was not refused")
    try:
        shardema.PostHocEMA(engine.module, checkpoint_folder=os.path.join(out, "posthoc"))
    except ValueError as error:
        assert "'body.scale' is partitioned by DeepSpeed ZeRO-3" in str(error), str(error)
    else:
        raise AssertionError("PostHocEMA over ZeRO-3 partitions was not refused")
    try:
        shardema.EMA(engine.module, layout="replicated")
    except ValueError as error:
        assert "partitioned by DeepSpeed ZeRO-3; use layout='auto'" in str(error), str(error)
    else:
        raise AssertionError("layout='replicated' was not refused")


if __name__ == "__main__":
    rank_worker.main({"reference": reference, "swap": swap, "refusals": refusals})
