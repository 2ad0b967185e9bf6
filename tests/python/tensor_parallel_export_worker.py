"""One rank of test_tensor_parallel.py's export runs: export_weights() of an
EMA over tensor-parallel DTensors (Shard(d > 0): parallelize_module's
RowwiseParallel, distribute_tensor with Shard(1) and Shard(2)), on CPU/Gloo.
The file rank 0 writes is read with safetensors and checked against
full_state_dict() (bit for bit), a float64 EMA of full_tensor()
(dtensor_checks.Checker's reference) and a strict load_state_dict into
the same model unsharded. The models and the training step are
tensor_parallel_worker's. Started by rank_launch.launch; rank_worker.py
says how and what it reports."""
import os

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import rank_worker
import shardema
import tensor_parallel_worker as tp
from dtensor_checks import STEPS, Checker, module_tensors
from fsdp2_worker import Float64Ema, close, schedule, versatil_averaged


def read_export(ema, path, dtype=torch.float32):
    """export_weights(path) on every rank; the file as rank 0 reads it."""
    ema.export_weights(path, dtype=dtype)
    dist.barrier()
    return safetensors.torch.load_file(path)


def check_export(got, full, reference, where):
    assert sorted(got) == sorted(full), f"{where}: {sorted(got)} != {sorted(full)}"
    for name, value in got.items():
        assert value.shape == full[name].shape, f"{where}: '{name}' {value.shape}"
        assert torch.equal(value, full[name]), f"{where}: '{name}' differs from full_state_dict()"
        close(value, reference.ema[name], f"{where}: '{name}' against the float64 EMA")


def tp_export(rank, world, out):
    """tensor_parallel_worker.tp_model (RowwiseParallel's Shard(1) weight, a
    (2, 5, 3) Shard(1) parameter whose pieces are strided in the full tensor,
    a (3, 1) one whose rank-1 piece is empty) trained as in tp_train:
    export_weights() in float32 and bfloat16 equals full_state_dict() and
    the float64 EMA, and loads strictly into tp_model unsharded. Once
    refused with "cannot hold this split"."""
    mesh = init_device_mesh("cpu", (world,))
    model = tp.tp_model(20, mesh)
    tensors = module_tensors(model)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    check = Checker(ema, reference, tensors, rank, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(1, STEPS + 1):
        tp.tp_step(model, optimizer, ema, step)
        reference.update(step)
    full = check("trained")
    got = read_export(ema, os.path.join(out, "tp.safetensors"))
    check_export(got, full, reference, "float32 export")
    plain = tp.tp_model(21, None)
    plain.load_state_dict(got, strict=True)
    for name, value in module_tensors(plain).items():
        assert torch.equal(value.detach(), got[name]), f"'{name}' after load_state_dict"
    got16 = read_export(ema, os.path.join(out, "tp16.safetensors"), torch.bfloat16)
    for name, value in got16.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, full[name].bfloat16()), name


BIG_SHAPE = (64, 4, 4096)  # 4 MiB in float32; 2 MiB per rank at W = 2


def big_model(seed, mesh, placement):
    """One 4 MiB weight split by `placement` and a plain bias every rank
    holds whole."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.big = nn.Parameter(distribute_tensor(torch.randn(*BIG_SHAPE), mesh, [placement]))
    model.bias = nn.Parameter(torch.randn(16))
    return model


def peak_bytes(call):
    """The most host memory held at once by the allocations made while
    `call` runs (torch's profiler sees every CPU tensor the engine allocates
    and frees on this thread, the gather's buffers among them)."""
    import warnings
    from torch.profiler import ProfilerActivity, profile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
    live = peak = 0
    # Self memory only: an op's own counts its children's allocations too.
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage),
                        key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def trained_big(seed, mesh, placement):
    model = big_model(seed, mesh, placement)
    tensors = module_tensors(model)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    for step in range(1, STEPS + 1):
        ema.fence()
        with torch.no_grad():
            for t in tensors.values():
                local = t.to_local() if isinstance(t, DTensor) else t
                local.mul_(0.9).add_(0.01 * step)
        ema.update()
        reference.update(step)
    ema.wait()
    return ema, reference


def tp_export_memory(rank, world, out):
    """The export streams one tensor at a time. Against the export of the
    same weight under FSDP2's Shard(0) (which appends each gathered piece as
    it comes), the Shard(2) one holds at most, at once: on rank 0 the weight
    assembled whole (one full tensor, 4 MiB), the reordered copy of its own
    piece and one 1 MiB run of rows being written; on rank 1 the reordered
    copy of its own piece only, never a full tensor. The file holds the
    EMA."""
    mesh = init_device_mesh("cpu", (world,))
    full_bytes = 4 * BIG_SHAPE[0] * BIG_SHAPE[1] * BIG_SHAPE[2]
    piece_bytes = -(-full_bytes // world)
    peaks = {}
    for kind, placement in (("rows", Shard(0)), ("tp", Shard(2))):
        ema, reference = trained_big(22, mesh, placement)
        full = ema.full_state_dict(rank0_only=False)
        path = os.path.join(out, f"big_{kind}.safetensors")
        peaks[kind] = peak_bytes(lambda: ema.export_weights(path))
        dist.barrier()
        check_export(safetensors.torch.load_file(path), full, reference, f"{kind} export")
    extra = peaks["tp"] - peaks["rows"]
    slack = 64 << 10
    allowed = piece_bytes + slack + ((full_bytes + (1 << 20)) if rank == 0 else 0)
    assert extra <= allowed, f"rank {rank}: the Shard(2) export held {extra} bytes more " \
        f"than the Shard(0) one ({peaks}), more than {allowed}"


def hsdp_tp_model(seed, mesh):
    """On a 2-D (replicate, shard) mesh: a (4, 7) parameter split along dim 1
    over the shard dimension (tensor parallelism's Shard(1), replicated over
    the other), a (5, 3) Shard(0) one and a plain buffer."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.cols = nn.Parameter(distribute_tensor(torch.randn(4, 7), mesh, [Replicate(), Shard(1)]))
    model.rows = nn.Parameter(distribute_tensor(torch.randn(5, 3), mesh, [Replicate(), Shard(0)]))
    model.register_buffer("stat", torch.randn(6))
    return model


def tp_hsdp_export(rank, world, out):
    """HSDP over tensor parallelism (2 x 2): only the first replica writes
    (global rank 0's), the other waits for it; the file equals
    full_state_dict() and the float64 EMA."""
    base = os.path.dirname(out)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = hsdp_tp_model(23, mesh)
    tensors = module_tensors(model)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    for step in range(1, STEPS + 1):
        ema.fence()
        with torch.no_grad():  # the same values on both replicas
            for t in tensors.values():
                local = t.to_local() if isinstance(t, DTensor) else t
                local.mul_(0.8).add_(0.05 * step)
        ema.update()
        reference.update(step)
    ema.wait()
    full = ema.full_state_dict(rank0_only=False)
    for name in tensors:
        close(full[name], reference.ema[name], f"full '{name}'")
    path = os.path.join(base, "tp_hsdp.safetensors")
    ema.export_weights(path)
    dist.barrier()
    check_export(safetensors.torch.load_file(path), full, reference, "HSDP export")


SCENARIOS = {"tp_export": tp_export, "tp_export_memory": tp_export_memory,
             "tp_hsdp_export": tp_hsdp_export}

if __name__ == "__main__":
    rank_worker.main(SCENARIOS)
