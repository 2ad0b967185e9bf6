"""One rank of test_fsdp1.py: a tiny model under torch's real FSDP1
(FullyShardedDataParallel, nested units, uneven sizes, a BatchNorm) on
CPU/Gloo, trained a few SGD steps with shardema.EMA built from the model.
After every update the rank recomputes, in float64, the EMA of the full
parameters (summon_full_params) and of the elements its own local flat
shard holds, and compares them with full_state_dict() and local_ema().

Scenarios: orig_params (use_orig_params=True: the original parameters
are 1-D views of the local shard, possibly empty), orig_params_bf16 (the
same under MixedPrecision(param_dtype=bfloat16)), flat_params
(use_orig_params=False: one FlatParameter per unit), swap and refusals.
Started by rank_launch.launch; rank_worker.py says how and what it
reports (a scenario that fails ends the launch, so swap, which fails until
EMA.swap frees FSDP1's gathered root, runs last)."""
import functools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import shardema
import rank_worker

STEPS = 4
POWER = 0.75
WRAPPED = "_fsdp_wrapped_module."


def decay_at(step):
    """The warmup schedule's decay written out (VersatIL's formula)."""
    e = step - 1
    return 0.0 if e <= 0 else min(1.0 - (1.0 + e) ** -POWER, 0.9999)


def clean(name):
    return name.replace(WRAPPED, "")


def model_of(use_orig_params, bf16=False):
    """7x5 + 5 in the root unit, then a nested unit (5x3 + 3 and a
    BatchNorm's 3 + 3 and buffers): sizes that split unevenly over 2 and 3
    ranks, so some ranks hold empty pieces of some parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3)))
    # bf16: FSDP1 gathers and computes in bf16; the shards, which the EMA
    # follows, stay float32.
    mixed = MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    return FSDP(model, use_orig_params=use_orig_params, device_id=torch.device("cpu"),
                auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), mixed_precision=mixed)


def unwrapped_model(weights):
    """model_of's model without FSDP1, holding `weights`, in eval mode."""
    model = nn.Sequential(nn.Linear(7, 5), nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3)))
    model.load_state_dict({n: t.to(torch.float32) if t.is_floating_point() else t
                           for n, t in weights.items()})
    return model.eval()


def batch_norm_prefixes(model):
    """Where the BatchNorm's parameters are, by clean name ("1.1."); a
    BatchNorm FSDP1 wraps on its own unit (mixed precision does) sits at
    "..._fsdp_wrapped_module"."""
    return tuple(clean(p + ".") for p, m in model.named_modules()
                 if isinstance(m, nn.BatchNorm1d))


def full_tensors(model, rank0_buffers=True):
    """Every parameter (gathered) and buffer in float64 (integers as they
    are), by the names of the unwrapped model. The buffers differ across
    ranks (each rank's batches move its BatchNorm's running stats; FSDP1
    does not sync them): rank 0's, as in FSDP1's full state dict, unless
    rank0_buffers is False (this rank's own)."""
    with FSDP.summon_full_params(model, writeback=False):
        items = list(model.named_parameters()) + list(model.named_buffers())
        out = {clean(n): t.detach().clone() for n, t in items}
    if rank0_buffers:
        for name, _ in model.named_buffers():
            dist.broadcast(out[clean(name)], src=0)
    return {n: t.double() if t.is_floating_point() else t for n, t in out.items()}


def local_pieces(model, use_orig_params, rank):
    """The elements of each parameter in this rank's local flat shard, as
    FSDP1 holds them: with use_orig_params the original parameter itself (a
    1-D view of the shard outside forward); without, the range torch records
    for it in the unit's FlatParameter. Buffers: this rank's rows."""
    out = {}
    if use_orig_params:
        for name, p in model.named_parameters():
            assert p.dim() == 1, f"'{name}' is not a 1-D view of the local shard: {p.shape}"
            out[clean(name)] = p.detach().clone()
    else:
        for path, unit in model.named_modules():
            if not isinstance(unit, FSDP):
                continue
            flat = unit._handle.flat_param
            prefix = clean(path + "." if path else "")
            for fqn, info in zip(flat._fqns, flat._shard_param_infos):
                piece = flat.detach()[info.offset_in_shard:info.offset_in_shard +
                                      info.numel_in_shard] if info.in_shard else flat[:0]
                out[prefix + fqn] = piece.detach().clone()
    for name, b in model.named_buffers():  # rank 0 keeps their EMA whole
        whole = b.detach().reshape(-1).clone()
        out[clean(name)] = whole if rank == 0 else whole[:0]
    return {n: t.double() if t.is_floating_point() else t for n, t in out.items()}


class Float64Ema:
    """The versatil EMA in float64: a copy at the first update and for what
    is not averaged (buffers, BatchNorm's parameters), else the lerp."""

    def __init__(self, bn_prefixes):
        self.bn_prefixes, self.ema = bn_prefixes, {}

    def update(self, step, tensors):
        decay = decay_at(step)
        for name, value in tensors.items():
            averaged = value.is_floating_point() and "running_" not in name and \
                not name.startswith(self.bn_prefixes)
            if name in self.ema and averaged:
                value = decay * self.ema[name] + (1.0 - decay) * value
            self.ema[name] = value


def close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


def check(ema, full_ref, local_ref, where):
    ema.wait()
    full = ema.full_state_dict(rank0_only=False)
    assert sorted(full) == sorted(full_ref.ema), f"{where}: names {sorted(full)}"
    for name, want in full_ref.ema.items():
        close(full[name], want, f"{where}: full '{name}'")
    local = ema.local_ema()
    assert sorted(local) == sorted(local_ref.ema), f"{where}: local names {sorted(local)}"
    for name, want in local_ref.ema.items():
        close(local[name], want, f"{where}: local '{name}' on rank {ema.rank}")
    return full


def scenario(use_orig_params, rank, world, out, bf16=False):
    model = model_of(use_orig_params, bf16)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.warmup(power=POWER), policy="versatil")
    assert (ema.layout, ema.rank, ema.world_size) == ("fsdp1", rank, world), \
        (ema.layout, ema.rank, ema.world_size)
    pieces = local_pieces(model, use_orig_params, rank)
    sizes = [pieces[n].numel() for n in sorted(pieces)]
    if world > 1 and rank == 0:  # rank 0 holds none of the nested unit's tail
        assert 0 in sizes, f"no empty piece on rank {rank}: {dict(zip(sorted(pieces), sizes))}"
    bn = batch_norm_prefixes(model)
    full_ref, local_ref = Float64Ema(bn), Float64Ema(bn)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).float().square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        full_ref.update(step, full_tensors(model))
        local_ref.update(step, local_pieces(model, use_orig_params, rank))
        check(ema, full_ref, local_ref, f"step {step}")
    # A checkpoint round trip on the same ranks restores this rank's pieces.
    folder = os.path.join(out, f"ckpt_{'orig' if use_orig_params else 'flat'}")
    ema.save_checkpoint(folder)
    again = shardema.EMA(model, schedule=shardema.DecaySchedule.warmup(power=POWER), policy="versatil")
    again.load_checkpoint(folder)
    assert again.step == STEPS
    for name, value in ema.local_ema().items():
        assert torch.equal(again.local_ema()[name], value), f"checkpoint: '{name}'"


def swap(rank, world, out):
    """swap() under both kinds of FSDP1 model, after two steps: inside it a
    gather (summon_full_params) and an evaluation forward see the EMA; after
    it the raw weights are back, in the shards and in what the next forward
    gathers (FSDP1 keeps the root unit's gathered copy after a forward
    without backward, and reuses it)."""
    for use_orig_params in (True, False):
        model = model_of(use_orig_params)
        ema = shardema.EMA(model, schedule=shardema.DecaySchedule.warmup(power=POWER), policy="versatil")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        for step in range(1, 3):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).square().mean().backward()
            ema.fence()
            optimizer.step()
            optimizer.zero_grad()
            ema.update()
        ema.wait()
        full = ema.full_state_dict(rank0_only=False)
        where = f"use_orig_params={use_orig_params}"
        raw = full_tensors(model, rank0_buffers=False)
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(7))
        model.eval()
        with torch.no_grad():
            model(x)  # leaves the root's gathered copy, of the raw weights
        with ema.swap(model):
            # every rank: the EMA, rank 0's for the buffers
            for name, value in full_tensors(model, rank0_buffers=False).items():
                close(value, full[name].to(value.dtype), f"{where}: swapped '{name}'")
            with torch.no_grad():
                swapped_out = model(x)
        for name, value in full_tensors(model, rank0_buffers=False).items():
            assert torch.equal(value, raw[name]), f"{where}: '{name}' not restored after swap()"
        with torch.no_grad():
            after_out = model(x)
        for weights, got, what in ((full, swapped_out, "inside"), (raw, after_out, "after")):
            reference = unwrapped_model(weights)
            with torch.no_grad():
                torch.testing.assert_close(got, reference(x), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{where}: forward {what} swap(): {m}")


def refusals(rank, world, out):
    """What shardema.EMA cannot follow under FSDP1 is an error naming it, not
    a wrong EMA: the module inside an FSDP1 root (its parameters are 1-D
    pieces of flat shards) and a layout other than "auto"."""
    model = model_of(True)
    for build, says in ((lambda: shardema.EMA(model.module), "'0.weight' belongs to an FSDP1 unit"),
                        (lambda: shardema.EMA(model, layout="replicated"),
                         "layout='replicated' but the model holds FSDP1 units")):
        try:
            build()
        except ValueError as error:
            assert says in str(error), f"the error says {error}"
        else:
            raise AssertionError(f"no ValueError saying {says!r}")
    # A rank's EMA here is a range of a flattened parameter, which neither a
    # DTensor nor a model sharded like this one can hold: refused by name.
    ema = shardema.EMA(model)
    for api, call in (("state_dict", ema.state_dict), ("load_state_dict",
                                                      lambda: ema.load_state_dict({})),
                      ("module", ema.module), ("copy_from", ema.copy_from)):
        try:
            call()
        except ValueError as error:
            assert f"EMA.{api} is not supported for an FSDP1 model" in str(error), str(error)
        else:
            raise AssertionError(f"EMA.{api} under FSDP1 raised nothing")


SCENARIOS = {"orig_params": functools.partial(scenario, True),
             "flat_params": functools.partial(scenario, False),
             "orig_params_bf16": functools.partial(scenario, True, bf16=True), "swap": swap,
             "refusals": refusals}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS)
