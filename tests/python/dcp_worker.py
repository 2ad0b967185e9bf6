"""One rank of test_dcp.py's runs: an FSDP2 model (fully_shard on CPU over
Gloo) with its optimizer and shardema.EMA, saved and loaded through
torch.distributed.checkpoint. Started by rank_launch.launch (rank_worker.py
says how and what it reports), CHECKPOINT its one extra argument:

save: 3 steps, then `OUT/ckpt` (model, optimizer, EMA; async_save),
      `OUT/model_only` (no EMA) and the EMA's own per-rank checkpoint
      `OUT/engine` (save_checkpoint). Rank 0 writes OUT/saved.pt.
load: a fresh model and EMA load CHECKPOINT, take one more step and save
      `OUT/ckpt` again. Rank 0 writes OUT/loaded.pt.
cold: as load, then a fresh model and EMA load CHECKPOINT/../model_only."""
import functools
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import rank_worker
import shardema

STEPS = 3
# The BatchNorm at index 3: versatil copies its parameters and buffers.
COPIED_PREFIX = "3."


class ToFloat(torch.nn.Module):
    def forward(self, x):
        return x.float()


def plain_model(seed):
    """A bf16 layer and fp32 ones, with row counts that split unevenly over
    2 and 3 ranks (5 rows: 3+2, 2+2+1; 2 rows: 1+1+0) and a 0-dim buffer;
    not sharded (what one process without a process group builds)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5).to(torch.bfloat16), ToFloat(),
                               torch.nn.Linear(5, 2), torch.nn.BatchNorm1d(2))


def make_model(seed, world):
    """plain_model(seed) under FSDP2 over `world` ranks, and its optimizer."""
    model = plain_model(seed)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)  # FSDP2 all-gathers one dtype per group
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer


def plain_emas(seed, layouts):
    """A model without FSDP (the same on every rank, as under DDP) and an
    EMA of it for each of `layouts` ("replicated": each rank its rows;
    "rank0": rank 0 all of it)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(2))
    return model, [shardema.EMA(model, layout=layout, policy="versatil") for layout in layouts]


def plain_step(model, emas, step):
    for ema in emas:
        ema.fence()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.sin(torch.arange(p.numel(), dtype=torch.float32) * step).view(p.shape))
    for ema in emas:
        ema.update()
        ema.wait()


def train_step(model, optimizer, ema, step):
    inputs = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
    model(inputs.to(torch.bfloat16)).square().mean().backward()
    ema.fence()
    optimizer.step()
    optimizer.zero_grad()
    ema.update()


def full_weights(model):
    """Every rank calls it (full_tensor() is a collective)."""
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in model.state_dict().items()}


def save_all(model, optimizer, ema, folder, with_ema=True, plain=()):
    """With the EMA: dcp.async_save on a group of its own, as docs/python.md
    says (its thread runs DCP's collectives)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if with_ema:
        state["ema"] = ema.state_dict()
        state.update((f"plain_{i}", e.state_dict()) for i, e in enumerate(plain))
        dcp.async_save(state, checkpoint_id=folder, process_group=checkpoint_group()).result()
    else:
        dcp.save(state, checkpoint_id=folder)


_GROUPS = []


def checkpoint_group():
    """async_save's own group, made once (every rank makes it)."""
    if not _GROUPS:
        _GROUPS.append(dist.new_group(backend="gloo"))
    return _GROUPS[0]


def load_all(model, optimizer, ema, folder, planner=None):
    """The EMA's state is loaded after the model's, so that a checkpoint
    without one cold-starts it from the loaded weights."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "ema": ema.state_dict()}
    dcp.load(state, checkpoint_id=folder, planner=planner)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    ema.load_state_dict(state["ema"])


def run(scenario, rank, world, out, checkpoint=None):
    result = {}
    if scenario == "save":
        model, optimizer = make_model(0, world)
        ema = shardema.EMA(model, policy="versatil")
        for step in range(1, STEPS + 1):
            train_step(model, optimizer, ema, step)
        plain, emas = plain_emas(3, ["replicated", "rank0"])
        for step in range(1, STEPS + 1):
            plain_step(plain, emas, step)
        result["plain"] = [e.full_state_dict() for e in emas]
        save_all(model, optimizer, ema, os.path.join(out, "ckpt"), plain=emas)
        save_all(model, optimizer, ema, os.path.join(out, "model_only"), with_ema=False)
        ema.save_checkpoint(os.path.join(out, "engine"))
        result.update(ema=ema.full_state_dict(), step=ema.step, weights=full_weights(model))
    else:
        model, optimizer = make_model(1, world)
        ema = shardema.EMA(model, policy="versatil")
        # The EMA itself in DCP's state dict: DCP calls its state_dict() and,
        # once loaded, its load_state_dict() (torch's Stateful protocol).
        model_state, optim_state = get_state_dict(model, optimizer)
        # The replicated EMA's state into a rank-0 one and the other way round.
        _, emas = plain_emas(4, ["rank0", "replicated"])
        state = {"model": model_state, "optim": optim_state, "ema": ema,
                 "plain_0": emas[0], "plain_1": emas[1]}
        dcp.load(state, checkpoint_id=checkpoint)
        result["plain"] = [e.full_state_dict() for e in emas]
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        result.update(loaded=ema.full_state_dict(), loaded_step=ema.step)
        train_step(model, optimizer, ema, ema.step + 1)
        weights = full_weights(model)
        ema.wait()
        result.update(weights=weights, ema=ema.full_state_dict(), step=ema.step)
        save_all(model, optimizer, ema, os.path.join(out, "ckpt"), plain=emas)
    if scenario == "cold":
        model, optimizer = make_model(2, world)
        ema = shardema.EMA(model, policy="versatil")
        model_only = os.path.join(os.path.dirname(checkpoint), "model_only")
        try:
            load_all(model, optimizer, ema, model_only)
            result["refused"] = None
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            result["refused"] = str(error)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_all(model, optimizer, ema, model_only, planner=shardema.EMALoadPlanner())
        result["cold_warnings"] = [str(w.message) for w in caught
                                   if "holds no EMA" in str(w.message)]
        result.update(cold_weights=full_weights(model), cold_ema=ema.full_state_dict(),
                      cold_step=ema.step)
    if rank == 0:
        torch.save(result, os.path.join(out, "saved.pt" if scenario == "save" else "loaded.pt"))


SCENARIOS = {name: functools.partial(run, name) for name in ("save", "load", "cold")}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS, group_timeout=None)
