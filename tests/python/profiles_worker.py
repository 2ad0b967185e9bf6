"""One rank of test_ema_profiles_multirank.py: an EMA of three profiles of
a fully_shard model (FSDP2, W ranks over Gloo) beside one EMA object per
profile on the same model. Each profile's gathered EMA equals its own
object's bit for bit and a float64 recomputation from the full weights;
export_weights(profile=), save_checkpoint/load_checkpoint and a DCP
state_dict carry every profile into a new EMA, which continues bit for
bit; a checkpoint of other schedules is refused on every rank, the EMA
left as it was. rank_worker.py says how the ranks report."""
import functools
import os

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import multirank_worker as base
import rank_worker
import shardema

STEPS = 6


def schedules():
    return [shardema.DecaySchedule.constant(0.8),
            shardema.DecaySchedule.warmup(power=0.75, max_value=0.99),
            shardema.DecaySchedule.power_function(sigma_rel=0.1)]


def same(a, b, what):
    assert list(a) == list(b), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name}"


def every_profile(ema):
    return [ema.full_state_dict(rank0_only=False, profile=p) for p in range(len(ema.schedules))]


def run(scenario, rank, world, out):
    model = base.sharded_model(world)
    ema = shardema.EMA(model, schedules=schedules())
    alone = [shardema.EMA(model, schedules=[s]) for s in schedules()]
    full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).double()
            for n, t in model.state_dict().items() if t.is_floating_point()}
    expected = [None] * 3
    for step in range(1, STEPS + 1):
        base.train_sharded(model, step, rank, world)
        for one in [ema, *alone]:
            one.update(step)
        weights = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).double()
                   for n, t in model.state_dict().items() if t.is_floating_point()}
        for p, s in enumerate(schedules()):
            d = 0.0 if step == 1 else s.decay_at(step)  # the first update copies
            expected[p] = {n: d * (expected[p] or full)[n] + (1 - d) * w
                           for n, w in weights.items()}
    gathered = every_profile(ema)
    for p in range(3):
        same(gathered[p], alone[p].full_state_dict(rank0_only=False), f"profile {p}")
        for name, value in expected[p].items():
            torch.testing.assert_close(gathered[p][name].double(), value, rtol=0, atol=2e-6)
    path = os.path.join(out, "p2.safetensors")
    ema.export_weights(path, profile=2)
    if rank == 0:
        same(load_file(path), gathered[2], "export of profile 2")

    ema.save_checkpoint(os.path.join(out, "ckpt"))
    dcp.save({"ema": ema.state_dict()}, checkpoint_id=os.path.join(out, "dcp"))
    twins = {}
    for how in ("checkpoint", "dcp"):
        twin_model = base.sharded_model(world)
        twin = shardema.EMA(twin_model, schedules=schedules())
        if how == "checkpoint":
            twin.load_checkpoint(os.path.join(out, "ckpt"))
        else:
            dcp.load({"ema": twin}, checkpoint_id=os.path.join(out, "dcp"),
                     planner=shardema.EMALoadPlanner())
        for p, value in enumerate(every_profile(twin)):
            same(value, gathered[p], f"{how} profile {p}")
        with torch.no_grad():  # the weights of the save
            for mine, theirs in zip(twin_model.parameters(), model.parameters()):
                mine.to_local().copy_(theirs.to_local())
        twins[how] = (twin_model, twin)
    # Each goes on as the run that saved it.
    for one_model, one in [(model, ema), *twins.values()]:
        base.train_sharded(one_model, STEPS + 1, rank, world)
        one.update(STEPS + 1)
    for how, (_, twin) in twins.items():
        for p, (a, b) in enumerate(zip(every_profile(ema), every_profile(twin))):
            same(a, b, f"{how}, resumed profile {p}")

    other = shardema.EMA(base.sharded_model(world), schedules=schedules()[:2])
    before = every_profile(other)
    try:
        other.load_checkpoint(os.path.join(out, "ckpt"))
    except ValueError as error:
        assert "holds 3 profiles but this Averager keeps 2" in str(error) or \
            "3 profiles" in str(error), error
    else:
        raise AssertionError("a checkpoint of 3 profiles loaded into 2")
    for p, value in enumerate(every_profile(other)):
        same(value, before[p], f"refused load, profile {p}")


SCENARIOS = {name: functools.partial(run, name) for name in ("fsdp2",)}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS, group_timeout=None)
