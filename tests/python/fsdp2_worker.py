"""One rank of test_multirank_fsdp2.py: a tiny model under torch's real
FSDP2 (fully_shard), HSDP, DDP or hand-made DTensors on CPU/Gloo, trained a
few SGD steps with shardema.EMA. After every update the rank recomputes the
EMA itself in float64 from the full tensors (full_tensor()), with the roles
decided at that update, and compares shardema's full and local views with
it. Several scenarios run one after the other in one launch, since starting
processes is the slow part.

Started by rank_launch.launch; rank_worker.py says how and what it reports."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardema
import rank_worker

STEPS = 4
POWER = 0.75


def schedule():
    return shardema.DecaySchedule.warmup(power=POWER)


def decay_at(step):
    """The warmup schedule's decay written out here (VersatIL's formula):
    0 at the first update, then 1 - (1 + e)^-power with e = step - 1, at
    most 0.9999."""
    e = step - 1
    return 0.0 if e <= 0 else min(1.0 - (1.0 + e) ** -POWER, 0.9999)


def full_value(tensor):
    """The whole tensor, gathered for a DTensor; float64 if floating."""
    with torch.no_grad():
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()
    return whole.double() if whole.is_floating_point() else whole


def rows_of(value, rank, world):
    """The rows rank `rank` of `world` holds: torch.chunk on dim 0 (FSDP2's
    split, which shardema also uses for replicated tensors); trailing ranks
    may get none, and a 0-dim tensor is rank 0's."""
    if value.dim() == 0:
        return value.reshape(1) if rank == 0 else value.reshape(1)[:0]
    chunks = value.chunk(world, dim=0)
    return chunks[rank] if rank < len(chunks) else value[:0]


def module_tensors(module):
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


def versatil_averaged(module):
    """What the versatil policy averages at this moment: parameters that
    require grad outside BatchNorm (buffers, BatchNorm's parameters and
    frozen parameters are copied)."""
    out = set()
    for prefix, child in module.named_modules():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            continue
        for name, p in child.named_parameters(recurse=False):
            if p.requires_grad:
                out.add(f"{prefix}.{name}" if prefix else name)
    return out


class Float64Ema:
    """The EMA of the full tensors in float64: a copy at the first update
    and for the tensors not averaged at an update, else the lerp with the
    schedule's decay; the tensors named in `once` keep their value of
    when the EMA was built (ema_pytorch's integer buffers: copy_once)."""

    def __init__(self, tensors, averaged, once=()):
        self.tensors, self.averaged = tensors, averaged
        self.once = set(once)
        self.ema = {n: full_value(t) for n, t in tensors().items() if n in self.once}

    def update(self, step):
        decay, averaged = decay_at(step), self.averaged()
        for name, tensor in self.tensors().items():
            if name in self.ema and name in self.once:
                continue
            value = full_value(tensor)
            if name in self.ema and name in averaged:
                value = decay * self.ema[name] + (1.0 - decay) * value
            self.ema[name] = value


def close(got, want, what):
    torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


class Checker:
    """Compares shardema's EMA with the float64 one: the full tensors on
    every rank, and this rank's local pieces with the reference's rows this
    rank holds (`shard_rank` of `shard_world` along dim 0), or the whole of
    the tensors named in `own` (buffers: each rank keeps its own)."""

    def __init__(self, ema, reference, shard_rank, shard_world, own=()):
        self.ema, self.reference = ema, reference
        self.shard_rank, self.shard_world = shard_rank, shard_world
        self.own = set(own)

    def __call__(self, where):
        self.ema.wait()
        full = self.ema.full_state_dict(rank0_only=False)
        want = self.reference.ema
        assert sorted(full) == sorted(want), f"{where}: names {sorted(full)} != {sorted(want)}"
        local = self.ema.local_ema()
        assert sorted(local) == sorted(want), f"{where}: local names {sorted(local)}"
        for name, value in want.items():
            assert full[name].shape == value.shape, f"{where}: '{name}' {full[name].shape}"
            close(full[name], value, f"{where}: full '{name}'")
            rows = value.reshape(-1) if name in self.own else \
                rows_of(value, self.shard_rank, self.shard_world).reshape(-1)
            close(local[name], rows, f"{where}: local '{name}' of rank {self.shard_rank}")
        return full


def check_split(tensors, shard_rank, shard_world):
    """The rows Checker expects are the rows the DTensors really hold:
    to_local() is torch.chunk's piece (Shard(0)) or the whole (Replicate)."""
    for name, t in tensors.items():
        if not isinstance(t, DTensor):
            continue
        whole = full_value(t)
        sharded = any(p.is_shard() for p in t.placements)
        want = rows_of(whole, shard_rank, shard_world) if sharded else whole
        assert torch.equal(full_value(t.to_local()), want), f"'{name}': to_local() is not {want}"


def inputs(features, seed):
    return torch.randn(4, features, generator=torch.Generator().manual_seed(seed))


def train(model, ema, reference, check, features, rank_seed=0, before_step=None):
    """STEPS SGD steps, the EMA fenced before each optimizer step and
    updated after it, checked after every update."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(1, STEPS + 1):
        if before_step:
            before_step(step)
        model(inputs(features, 100 * step + rank_seed)).float().square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        reference.update(step)
        assert abs(ema.last_decay - decay_at(step)) < 1e-12, (step, ema.last_decay)
        check(f"step {step}")
    return optimizer


def check_swap(ema, model, tensors, full, where):
    """Inside swap() the model's (full) tensors are the EMA's."""
    with ema.swap(model):
        for name, t in tensors.items():
            got = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            assert torch.equal(got, full[name].to(got.dtype)), f"{where}: swapped '{name}'"


def fully_shard_model(rank, world, out):
    """Nested fully_shard (reshard_after_forward False and True), rows that
    do not divide by W, a one-row parameter (empty shards on the other
    ranks), a BatchNorm (its buffers equal here, each rank keeping its own
    whole); at W = 2 bfloat16 compute
    (MixedPrecisionPolicy): the EMA follows the fp32 sharded parameters. A
    submodule frozen when the EMA is built is unfrozen at step 3, and
    another frozen then: versatil decides at each update."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 7), nn.Linear(7, 1), nn.Linear(1, 5), nn.BatchNorm1d(5))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if world == 2 else None,
                                  reduce_dtype=torch.float32, output_dtype=torch.float32)
    fully_shard(model[0], mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    # fp32: FSDP2 cannot unfreeze a bf16 group frozen at its first forward
    # (the bf16 gradient meets the fp32 parameter)
    fully_shard(model[2], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    model[2].requires_grad_(False)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    assert (ema.layout, ema.rank, ema.world_size) == ("fsdp2", rank, world), ema.layout
    tensors = module_tensors(model)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32
               for p in model.parameters())
    check_split(tensors, rank, world)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    # The same inputs on every rank: the BatchNorm's buffers are equal here
    # (batchnorm_buffers has them differ); each rank keeps them whole.
    check = Checker(ema, reference, rank, world, own=dict(model.named_buffers()))

    def refreeze(step):
        if step == 3:
            model[2].requires_grad_(True)
            model[0].requires_grad_(False)
    train(model, ema, reference, check, 3, before_step=refreeze)
    check_swap(ema, model, tensors, check("end"), "fully_shard")


def partly_sharded(rank, world, out):
    """fully_shard on the first layer only: the second layer's parameters
    stay plain, the same on every rank (same inputs), replicated rows."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 7), nn.Linear(7, 3))
    fully_shard(model[0], mesh=mesh)
    assert not isinstance(model[1].weight, DTensor)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    assert ema.layout == "fsdp2", ema.layout
    tensors = module_tensors(model)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    check = Checker(ema, reference, rank, world)
    train(model, ema, reference, check, 3)
    check_swap(ema, model, tensors, check("end"), "partly sharded")


def ddp_model(rank, world, out):
    """DistributedDataParallel, each rank its own inputs: layout replicated."""
    torch.manual_seed(2)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1)))
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    assert ema.layout == "replicated", ema.layout
    tensors = module_tensors(model.module)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model.module))
    check = Checker(ema, reference, rank, world)
    train(model, ema, reference, check, 3, rank_seed=rank)


def replicated_dtensor(rank, world, out):
    """A Replicate() DTensor (each rank holds the whole) beside a Shard(0)
    one on a 1-D mesh, as named tensors, stepped by hand."""
    mesh = init_device_mesh("cpu", (world,))
    whole = nn.Parameter(distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Replicate()]))
    rows = nn.Parameter(distribute_tensor(torch.arange(5.0), mesh, [Shard(0)]))
    tensors = {"whole": whole, "rows": rows}
    check_split(tensors, rank, world)
    ema = shardema.EMA(list(tensors.items()), schedule=schedule(), policy="versatil", timeout=60)
    assert ema.layout == "fsdp2", ema.layout
    reference = Float64Ema(lambda: tensors, lambda: set(tensors))
    check = Checker(ema, reference, rank, world)
    for step in range(1, STEPS + 1):
        ema.fence()
        with torch.no_grad():  # the same on every rank: a replicated step
            whole.to_local().mul_(0.5).add_(float(step))
            rows.to_local().add_(torch.cos(torch.full_like(rows.to_local(), float(step))))
        ema.update()
        reference.update(step)
        check(f"step {step}")
    check_swap(ema, None, tensors, check("end"), "replicated DTensor")


def hsdp_model(rank, world, out):
    """HSDP on a 2 x 2 mesh: (Replicate(), Shard(0)). Each rank keeps the
    EMA of its shard; gathers run over the shard dimension; only the
    replica holding global rank 0 writes files (each replica is given its
    own path here, so a second writer would show)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_rank, replica = mesh.get_local_rank("shard"), mesh.get_local_rank("replicate")
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    assert (ema.layout, ema.rank, ema.world_size) == ("fsdp2", shard_rank, 2), \
        (ema.layout, ema.rank, ema.world_size)
    tensors = module_tensors(model)
    check_split(tensors, shard_rank, 2)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    check = Checker(ema, reference, shard_rank, 2)
    optimizer = train(model, ema, reference, check, 3, rank_seed=rank)
    result = {"full": check("end"), "rank0": ema.full_state_dict(), "replica": replica}
    ema.export_weights(os.path.join(out, f"export_replica{replica}.safetensors"))
    ema.save_checkpoint(os.path.join(out, f"ckpt_replica{replica}"))
    saved = ema.local_ema()
    # One more step changes the EMA; loading what replica 0 wrote (every
    # replica reads the same files) brings it back.
    model(inputs(3, rank)).square().mean().backward()
    ema.fence()
    optimizer.step()
    ema.update()
    ema.wait()
    assert any(not torch.equal(v, saved[k]) for k, v in ema.local_ema().items())
    ema.load_checkpoint(os.path.join(out, "ckpt_replica0"))
    for name, value in ema.local_ema().items():
        assert torch.equal(value, saved[name]), f"'{name}' after load_checkpoint"
    torch.save(result, os.path.join(out, f"hsdp{rank}.pt"))


def batchnorm_model():
    """What batchnorm_buffers shards; one process builds it too (the test's
    loads at W = 1)."""
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def rank0s(values):
    """Rank 0's `values` (a dict of tensors) on every rank."""
    box = [values if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_batchnorm_ema(ema, reference, buffers, where):
    """This rank's EMA of each buffer is its own float64 EMA (ema_tensors(),
    local_ema(): the whole); everything that stands for the job
    (full_state_dict()) holds rank 0's buffers and the parameters' EMA.
    Returns the full EMA."""
    ema.wait()
    mine, local = ema.ema_tensors(list(buffers)), ema.local_ema()
    for name in buffers:
        close(mine[name], reference.ema[name], f"{where}: this rank's EMA of '{name}'")
        close(local[name], reference.ema[name].reshape(-1), f"{where}: local '{name}'")
    full, first = ema.full_state_dict(rank0_only=False), rank0s(reference.ema)
    assert sorted(full) == sorted(reference.ema), where
    for name, value in first.items():
        close(full[name], value, f"{where}: full '{name}' (rank 0's)")
    return full


def same_values(got, want, where):
    assert sorted(got) == sorted(want), where
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{where}: '{name}'"


def batchnorm_buffers(rank, world, out):
    """A BatchNorm under FSDP2, each rank its own inputs: the ranks' running
    statistics differ (FSDP2 never makes them equal). Two EMAs: versatil
    (buffers copied) and ema_pytorch (buffers averaged). Each rank keeps the
    EMA of its own buffers, and swaps its own in; full_state_dict,
    export_weights, save_checkpoint and the DCP state dict hold rank 0's; a
    resume at W = 2 from either gives every rank rank 0's. Rank 0 writes
    what the test loads at W = 1 (bn_{policy}.pt)."""
    mesh = init_device_mesh("cpu", (world,))
    model = batchnorm_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    run_batchnorm(rank, out, model, model, "bn")


def ddp_batchnorm(rank, world, out):
    """batchnorm_buffers under DDP (layout replicated): DDP broadcasts rank
    0's buffers before each forward, which then makes each rank's its own
    again; the parameters' EMA is split in rows, the buffers' kept whole."""
    model = nn.parallel.DistributedDataParallel(batchnorm_model())
    run_batchnorm(rank, out, model, model.module, "ddp_bn")


def run_batchnorm(rank, out, model, inner, tag):
    """batchnorm_buffers' steps and checks for `model` (`inner`: the module
    holding the tensors); files named after `tag`."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    tensors = module_tensors(inner)
    buffers = dict(inner.named_buffers())
    assert not any(isinstance(b, DTensor) for b in buffers.values())
    floating = {n for n, t in tensors.items() if t.is_floating_point()}
    emas = {p: shardema.EMA(model, schedule=schedule(), policy=p, timeout=60)
            for p in ("versatil", "ema_pytorch")}
    assert {e.layout for e in emas.values()} == {"fsdp2" if tag == "bn" else "replicated"}
    references = {"versatil": Float64Ema(lambda: tensors, lambda: versatil_averaged(inner)),
                  "ema_pytorch": Float64Ema(lambda: tensors, lambda: floating,
                                            once=set(tensors) - floating)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)

    def step_all(step):
        x = inputs(3, 100 * step + rank) * (1.0 + rank) + 2.0 * rank
        model(x).square().mean().backward()
        for ema in emas.values():
            ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        for ema in emas.values():
            ema.update()

    full = {}
    for step in range(1, STEPS + 1):
        step_all(step)
        for policy, ema in emas.items():
            references[policy].update(step)
            full[policy] = check_batchnorm_ema(ema, references[policy], buffers,
                                               f"{policy} step {step}")
    # What the test stands on: the ranks' statistics differ.
    gap = references["versatil"].ema["1.running_mean"] - \
        rank0s(references["versatil"].ema)["1.running_mean"]
    assert rank == 0 or gap.abs().max() > 0.1, gap
    for policy, ema in emas.items():
        mine = ema.ema_tensors(list(buffers))
        with ema.swap(model):  # each rank swaps its own in, no gather
            for name, b in buffers.items():
                assert torch.equal(b, mine[name].to(b.dtype)), f"{policy}: swapped '{name}'"
        for name, b in buffers.items():
            assert torch.equal(full_value(b), references["versatil"].ema[name]), name
        export = os.path.join(out, f"{tag}_{policy}.safetensors")
        ema.export_weights(export)
        ema.save_checkpoint(os.path.join(out, f"{tag}_ckpt_{policy}"))
        dcp.save({"ema": ema.state_dict()}, checkpoint_id=os.path.join(out, f"{tag}_dcp_{policy}"))
        if rank == 0:
            same_values({n: v for n, v in load_file(export).items()}, full[policy],
                        f"{policy}: export_weights")
            torch.save({"full": full[policy], "step": ema.step},
                       os.path.join(out, f"{tag}_{policy}.pt"))
    step_all(STEPS + 1)  # every EMA moves on; each load below brings rank 0's back
    for policy, ema in emas.items():
        ema.wait()
        assert not torch.equal(ema.full_state_dict(rank0_only=False)["0.weight"],
                               full[policy]["0.weight"])
        ema.load_checkpoint(os.path.join(out, f"{tag}_ckpt_{policy}"))
        same_values(ema.full_state_dict(rank0_only=False), full[policy], f"{policy}: reloaded")
        same_values(ema.ema_tensors(list(buffers)), {n: full[policy][n] for n in buffers},
                    f"{policy}: this rank's buffers after load_checkpoint (rank 0's)")
        ema.update()  # away from the saved EMA again, then DCP back to it
        ema.wait()
        state = {"ema": ema.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(out, f"{tag}_dcp_{policy}"))
        ema.load_state_dict(state["ema"])
        same_values(ema.full_state_dict(rank0_only=False), full[policy], f"{policy}: DCP")
        same_values(ema.ema_tensors(list(buffers)), {n: full[policy][n] for n in buffers},
                    f"{policy}: this rank's buffers after the DCP load (rank 0's)")


SCENARIOS = {"fully_shard": fully_shard_model, "partly_sharded": partly_sharded,
             "ddp": ddp_model, "replicated_dtensor": replicated_dtensor, "hsdp": hsdp_model,
             "batchnorm_buffers": batchnorm_buffers, "ddp_batchnorm": ddp_batchnorm}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS)
