"""The HSDP scenarios of tensor_parallel_worker.py (one launch runs them
beside the tensor-parallel ones): shardema.EMA under fully_shard on a 2-D
(replicate, shard) mesh, its state_dict through DCP, loaded back at 2 x 2
and under plain FSDP2, and save_checkpoint / export_weights with a writer
replica that never comes or is slower than the EMA's timeout."""
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardema
from dtensor_checks import STEPS, Checker, module_tensors
from fsdp2_worker import Float64Ema, inputs, schedule, versatil_averaged

# Seconds the process group waits in a collective: far more than the EMA's
# timeout in hsdp_missing_writer, so that the EMA's is the one seen.
GROUP_TIMEOUT = 60


def hsdp_model(seed, mesh):
    """fully_shard on a 2-D (replicate, shard) mesh, or a 1-D one (FSDP2);
    the BatchNorm's buffers are plain tensors (a 0-dim one among them)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2), nn.BatchNorm1d(2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def hsdp_dcp(rank, world, out):
    """HSDP (2 x 2): state_dict() holds fp32 DTensors on the 2-D mesh with
    the parameters' placements (the buffers: plain tensors, rank 0's);
    DCP stores each chunk once, not once per replica; loading it
    back at W = 4 restores the EMA exactly. test_tensor_parallel.py reads it
    at W = 2 under plain FSDP2."""
    base = os.path.dirname(out)
    folder = os.path.join(base, "hsdp_dcp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_rank = mesh.get_local_rank("shard")
    model = hsdp_model(3, mesh)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    tensors = module_tensors(model)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    check = Checker(ema, reference, tensors, shard_rank, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(1, STEPS + 1):
        # the same inputs everywhere: BatchNorm's buffers equal on replicas
        model(inputs(3, 100 * step)).square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        reference.update(step)
        full = check(f"step {step}")

    state = ema.state_dict()
    for name, value in state["weights"].items():
        t = tensors[name]
        if not isinstance(t, (DTensor, nn.Parameter)):  # a buffer: rank 0's, plain
            assert not isinstance(value, DTensor), name
            continue
        assert isinstance(value, DTensor) and value.device_mesh == mesh, name
        assert value.dtype == torch.float32, (name, value.dtype)
        placements = t.placements if isinstance(t, DTensor) else (Replicate(), Shard(0))
        assert value.placements == tuple(placements), (name, value.placements)
    saved_local = ema.local_ema()
    dcp.save({"model": model.state_dict(), "ema": state}, checkpoint_id=folder)
    if rank == 0:
        torch.save({"full": full, "step": ema.step}, os.path.join(base, "hsdp_saved.pt"))
        chunks = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        # 5 rows over 2 shard ranks: 2 chunks, each stored once
        assert len(chunks["ema.weights.0.weight"].chunks) == 2, chunks["ema.weights.0.weight"]

    model(inputs(3, 999)).square().mean().backward()  # the EMA moves on
    ema.fence()
    optimizer.step()
    ema.update()
    ema.wait()
    assert any(not torch.equal(v, saved_local[k]) for k, v in ema.local_ema().items())
    loaded = {"ema": ema.state_dict()}
    dcp.load(loaded, checkpoint_id=folder)
    ema.load_state_dict(loaded["ema"])
    assert ema.step == STEPS
    for name, value in ema.local_ema().items():
        assert torch.equal(value, saved_local[name]), f"'{name}' loaded back at 2 x 2"


def hsdp_load_fsdp2(rank, world, out):
    """W = 2: the 2 x 2 HSDP checkpoint into plain FSDP2 (a 1-D mesh of 2)."""
    base = os.path.dirname(out)
    saved = torch.load(os.path.join(base, "hsdp_saved.pt"))
    ema = shardema.EMA(hsdp_model(4, init_device_mesh("cpu", (world,))), policy="versatil",
                       timeout=60)
    state = {"ema": ema.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(base, "hsdp_dcp"))
    ema.load_state_dict(state["ema"])
    assert ema.step == saved["step"]
    full = ema.full_state_dict(rank0_only=False)
    for name, value in saved["full"].items():
        assert torch.equal(full[name], value), f"'{name}' at W = {world}"


def hsdp_buffers(rank, world, out):
    """HSDP (2 x 2), each rank its own inputs: the four ranks' BatchNorm
    statistics differ. Each rank keeps the EMA of its own; what stands for
    the job is global rank 0's: the DCP state dict on every rank (each
    replica's shard group gathers its own rank 0's, the first replica's
    wins), and a load of the files the first replica wrote."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = hsdp_model(8, mesh)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    buffers = dict(model.named_buffers())
    for step in range(1, STEPS + 1):
        (model(inputs(3, 100 * step + rank) * (1.0 + rank) + rank)).square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    mine = ema.ema_tensors(list(buffers))
    for name, b in buffers.items():  # versatil copies buffers: its own
        assert torch.equal(mine[name], b.float() if b.is_floating_point() else b), name
    box = [mine if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    first = box[0]
    assert rank == 0 or not torch.equal(mine["2.running_mean"], first["2.running_mean"])
    weights = ema.state_dict()["weights"]
    for name in buffers:
        assert torch.equal(weights[name], first[name]), f"state_dict '{name}' on rank {rank}"
    folder = os.path.join(os.path.dirname(out), "hsdp_buffers_ckpt")
    ema.save_checkpoint(folder)
    ema.load_checkpoint(folder)
    loaded = ema.ema_tensors(list(buffers))
    for name in buffers:
        assert torch.equal(loaded[name], first[name]), f"loaded '{name}' on rank {rank}"


def hsdp_missing_writer(rank, world, out):
    """HSDP, EMA timeout 2 s, the process group's 60 s: the first replica
    (global ranks 0 and 1), which writes the files, never calls
    save_checkpoint. The other replica's ranks fail within the EMA's
    timeout, naming it, instead of the group's. The writers wait until the
    waiters have reported, so no rank leaves while a peer still waits."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ema = shardema.EMA(hsdp_model(6, mesh), policy="versatil", timeout=2.0)
    replica = mesh.get_local_rank("replicate")
    flags = [os.path.join(out, f"waited{r}") for r in (2, 3)]
    if replica == 0:
        deadline = time.monotonic() + GROUP_TIMEOUT
        while not all(os.path.exists(f) for f in flags):
            assert time.monotonic() < deadline, "the waiting replica never reported"
            time.sleep(0.05)
        return
    start = time.monotonic()
    try:
        ema.save_checkpoint(os.path.join(out, "never_written"))
    except RuntimeError as error:
        took = time.monotonic() - start
        text = str(error)
        # its writer: the first replica's rank at the same shard coordinate
        assert "EMA's timeout" in text and f"global rank {rank - 2}" in text, text
        # the EMA's 2 s, not the group's 60 s (and well under it: no hang)
        assert 1.5 <= took < 15, f"failed after {took:.1f} s: {text}"
    else:
        raise AssertionError("save_checkpoint returned without its writer")
    finally:
        open(flags[rank - 2], "w").close()


class SlowEngine:
    """The engine of `ema` with its file writes `delay` s late, as a large
    export is (its collectives and disk): everything else passes through."""

    def __init__(self, engine, delay):
        self._engine, self._delay = engine, delay

    def __getattr__(self, name):
        method = getattr(self._engine, name)
        if name not in ("export_weights", "save_checkpoint"):
            return method

        def late(*args):
            time.sleep(self._delay)
            return method(*args)
        return late


def hsdp_slow_writer(rank, world, out):
    """HSDP (2 x 2), EMA timeout 1 s: the first replica takes 3 s to write
    the files, three times the timeout. The waiting replica hears from it
    while it writes and returns once the files are complete, not after
    1 s with an error; the file holds the EMA. A writer that fails after
    2.5 s fails every replica with its error, naming the path."""
    base = os.path.dirname(out)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica = mesh.get_local_rank("replicate")
    model = hsdp_model(7, mesh)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(1, STEPS + 1):
        model(inputs(3, 100 * step + 7)).square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    ema.wait()
    full = ema.full_state_dict(rank0_only=False)
    if replica == 0:
        ema._engine = SlowEngine(ema._engine, 3.0)
    path = os.path.join(base, "hsdp_slow.safetensors")
    start = time.monotonic()
    ema.export_weights(path)
    took = time.monotonic() - start
    assert took >= 3.0, f"export_weights returned after {took:.1f} s, before its writer wrote"
    written = shardema.read_tensor_file(path)["tensors"]
    assert sorted(written) == sorted(full), sorted(written)
    for name, value in full.items():
        assert torch.equal(written[name], value), f"'{name}' in the exported file"

    if replica == 0:
        ema._engine = SlowEngine(ema._engine._engine, 2.5)
    not_a_folder = os.path.join(base, "hsdp_slow.safetensors")  # a file, not a folder
    start = time.monotonic()
    try:
        ema.export_weights(os.path.join(not_a_folder, "weights.safetensors"))
    except Exception as error:  # the writer's own error, or the waiters' report of it
        took = time.monotonic() - start
        text = str(error)
        assert "weights.safetensors" in text, text
        if replica != 0:
            assert isinstance(error, RuntimeError) and "first HSDP replica" in text and \
                "failed" in text, text
        assert took >= 2.5, f"failed after {took:.1f} s: {text}"
    else:
        raise AssertionError("an export into a file's path returned without an error")
