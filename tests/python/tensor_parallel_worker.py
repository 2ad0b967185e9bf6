"""One rank of test_tensor_parallel.py: shardema.EMA over tensor-parallel
DTensors (parallelize_module's ColwiseParallel / RowwiseParallel, and
distribute_tensor with Shard(1)) and over HSDP (hsdp_scenarios.py), on
CPU/Gloo, with DCP saves loaded back at other world sizes. Every rank
checks the EMA against a float64 EMA of the full tensors (full_tensor())
it recomputes itself (fsdp2_worker.Float64Ema, dtensor_checks.Checker).
Checkpoints and results go to the parent of OUT, shared by the launches of
one test module. Started by rank_launch.launch; rank_worker.py says how
and what it reports."""
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import rank_worker
import shardema
from dtensor_checks import STEPS, Checker, module_tensors, piece_of
from fsdp2_worker import Float64Ema, close, decay_at, full_value, inputs, schedule, \
    versatil_averaged
from hsdp_scenarios import GROUP_TIMEOUT, hsdp_buffers, hsdp_dcp, hsdp_load_fsdp2, \
    hsdp_missing_writer, hsdp_slow_writer


def tp_model(seed, mesh):
    """Linear(4, 6) column-parallel (Shard(0) weight and bias), Linear(6, 3)
    row-parallel (Shard(1) weight, Replicate() bias), a plain LayerNorm
    (the same on every rank), and two parameters the forward does not use,
    stepped by hand: a (2, 5, 3) Shard(1) one (3 + 2 columns, so each
    rank's piece is strided in the full tensor) and a (3, 1) Shard(1) one
    (rank 1's piece is empty). With mesh=None: the same model, plain."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.LayerNorm(3))
    inner = torch.randn(2, 5, 3)
    narrow = torch.randn(3, 1)
    if mesh is None:
        model.register_parameter("inner", nn.Parameter(inner))
        model.register_parameter("narrow", nn.Parameter(narrow))
        return model
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model.register_parameter("inner", nn.Parameter(distribute_tensor(inner, mesh, [Shard(1)])))
    model.register_parameter("narrow", nn.Parameter(distribute_tensor(narrow, mesh, [Shard(1)])))
    return model


def tp_step(model, optimizer, ema, step):
    """One SGD step on inputs equal on every rank (tensor parallelism's
    replicated input), the unused parameters moved by hand, each rank its
    own piece."""
    model(inputs(4, 100 * step)).square().mean().backward()
    ema.fence()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for p in (model.inner, model.narrow):
            local = p.to_local()
            local.mul_(0.8).add_(torch.cos(torch.arange(local.numel(), dtype=torch.float32)
                                           * step + dist.get_rank()).reshape(local.shape))
    ema.update()


def refused_everywhere(ema, folder):
    """The engine's per-rank files cannot hold a Shard(1) piece: each call
    that writes or reads them names the parameter and points to DCP (and
    to export_weights(), which writes full tensors:
    tensor_parallel_export_worker.py)."""
    calls = {"save_checkpoint": lambda: ema.save_checkpoint(os.path.join(folder, "ckpt")),
             "load_checkpoint": lambda: ema.load_checkpoint(os.path.join(folder, "ckpt"))}
    for api, call in calls.items():
        try:
            call()
        except ValueError as error:
            text = str(error)
            named = all(f"'{n}'" in text for n in ("inner", "narrow", "2.weight"))
            assert api in text and named and "Shard(dim=1)" in text and \
                "state_dict()" in text and "torch.distributed.checkpoint" in text, text
        else:
            raise AssertionError(f"{api} wrote engine files of a Shard(1) parameter")
    assert not os.path.exists(os.path.join(folder, "ckpt"))


def tp_train(rank, world, out):
    """parallelize_module on a 1-D mesh: update, local_ema, full_state_dict,
    swap and copy_to against the float64 EMA; the engine's files refused;
    a DCP save (state_dict() keeps each parameter's placements, fp32) read
    back by a fresh EMA at the same world size. test_tensor_parallel.py
    reads it at W = 1."""
    base = os.path.dirname(out)
    mesh = init_device_mesh("cpu", (world,))
    model = tp_model(0, mesh)
    tensors = module_tensors(model)
    assert tensors["2.weight"].placements == (Shard(1),), tensors["2.weight"].placements
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    assert (ema.layout, ema.rank, ema.world_size) == ("fsdp2", rank, world)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    check = Checker(ema, reference, tensors, rank, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(1, STEPS + 1):
        tp_step(model, optimizer, ema, step)
        reference.update(step)
        assert abs(ema.last_decay - decay_at(step)) < 1e-12
        full = check(f"step {step}")
    only = ema.full_state_dict(rank0_only=False, names=["inner", "3.bias"])
    assert sorted(only) == ["3.bias", "inner"] and torch.equal(only["inner"], full["inner"])

    raw = {n: full_value(t) for n, t in tensors.items()}
    with ema.swap(model):
        for name, t in tensors.items():
            assert torch.equal(full_value(t), full[name].double()), f"swapped '{name}'"
    for name, t in tensors.items():
        assert torch.equal(full_value(t), raw[name]), f"'{name}' after swap"

    refused_everywhere(ema, out)

    state = ema.state_dict()
    local = ema.local_ema()
    for name, t in tensors.items():
        saved = state["weights"][name]
        assert saved.dtype == torch.float32, (name, saved.dtype)
        assert isinstance(saved, DTensor) and tuple(saved.shape) == tuple(t.shape), name
        if isinstance(t, DTensor):
            assert saved.device_mesh == t.device_mesh, name
        if isinstance(t, DTensor) and t.placements[-1].is_shard():  # the parameter's own
            assert saved.placements == t.placements, (name, saved.placements)
        else:  # held whole (Replicate(), LayerNorm's): the rows this rank averages
            assert saved.placements == (Shard(0),), (name, saved.placements)
        assert torch.equal(saved.to_local().reshape(-1), local[name]), name
    dcp.save({"model": model.state_dict(), "ema": state},
             checkpoint_id=os.path.join(base, "tp_dcp"))
    if rank == 0:
        torch.save({"full": full, "step": ema.step}, os.path.join(base, "tp_saved.pt"))

    # A fresh EMA of another model, the same split, loads it back exactly.
    other = shardema.EMA(tp_model(5, mesh), policy="versatil", timeout=60)
    loaded = {"ema": other.state_dict()}
    dcp.load(loaded, checkpoint_id=os.path.join(base, "tp_dcp"))
    other.load_state_dict(loaded["ema"])
    assert other.step == STEPS
    for name, value in other.local_ema().items():
        assert torch.equal(value, local[name]), f"'{name}' loaded at W = {world}"

    # module(into=): another model split the same way takes the EMA
    view = module_tensors(ema.module(into=tp_model(6, mesh)))
    for name, value in full.items():
        assert torch.equal(full_value(view[name]), value.double()), f"module(into=) '{name}'"

    ema.copy_to(model)
    for name, t in tensors.items():
        assert torch.equal(full_value(t), full[name].double()), f"'{name}' after copy_to"


def tp_load_one(rank, world, out):
    """W = 1: the W = 2 Shard(1) checkpoint, resharded by DCP, into the EMA
    of the plain model and into that of the same model on a one-rank
    tensor-parallel mesh: exactly the EMA saved."""
    base = os.path.dirname(out)
    saved = torch.load(os.path.join(base, "tp_saved.pt"))
    for mesh in (None, init_device_mesh("cpu", (1,))):
        ema = shardema.EMA(tp_model(7, mesh), policy="versatil", timeout=60)
        state = {"ema": ema.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(base, "tp_dcp"))
        ema.load_state_dict(state["ema"])
        assert ema.step == saved["step"]
        full = ema.full_state_dict()
        assert sorted(full) == sorted(saved["full"])
        for name, value in saved["full"].items():
            assert torch.equal(full[name], value), f"'{name}' at W = 1 (mesh {mesh})"


def full_values(tensors, seed):
    """A float64 full tensor for every tracked name, unlike the model's
    weights (a load that changed nothing would not pass), equal on every
    rank: what each rank reads from a checkpoint file holding the whole."""
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(tuple(t.shape), generator=generator, dtype=torch.float64)
            for n, t in tensors.items()}


def tp_load_full(rank, world, out):
    """load_ema_values() of plain full tensors (an exported safetensors
    file, a one-file Lightning checkpoint) into the EMA of a model with
    Shard(1) parameters, 'inner' with 5 columns over 2 ranks: each rank
    keeps torch.chunk's piece (what to_local() holds), as a load of
    DTensors of the same values does; the EMA assembled is the full tensor
    given. No communication: rank 1 does not take part in a third load."""
    mesh = init_device_mesh("cpu", (world,))
    model = tp_model(8, mesh)
    tensors = module_tensors(model)
    assert tensors["inner"].shape[1] % world != 0 and tensors["inner"].placements == (Shard(1),)
    given = full_values(tensors, 11)
    ema = shardema.EMA(model, policy="versatil", timeout=60)
    ema.load_ema_values(given)
    by_dtensor = shardema.EMA(tp_model(9, mesh), policy="versatil", timeout=60)
    by_dtensor.load_ema_values({n: distribute_tensor(v, mesh, tensors[n].placements)
                                if isinstance(tensors[n], DTensor) else v
                                for n, v in given.items()})
    mine, theirs = ema.ema_tensors(), by_dtensor.ema_tensors()
    full = ema.full_state_dict(rank0_only=False)
    for name, t in tensors.items():
        want = given[name].float()
        held = piece_of(want, t, rank, world) \
            if isinstance(t, DTensor) and t.placements[-1].is_shard() else want
        assert tuple(mine[name].shape) == tuple(t.to_local().shape if isinstance(t, DTensor)
                                                else t.shape), (name, mine[name].shape)
        assert torch.equal(mine[name], held), f"'{name}': rank {rank}'s EMA of the full tensor"
        assert torch.equal(mine[name], theirs[name]), f"'{name}': full and DTensor loads differ"
        assert torch.equal(full[name], want), f"'{name}': full_state_dict after the load"

    lone = shardema.EMA(tp_model(10, mesh), policy="versatil", timeout=60)
    if rank == 0:
        lone.load_ema_values(given)
        assert torch.equal(lone.ema_tensors(["inner"])["inner"], mine["inner"])
    dist.barrier()

    # The transposed shape is neither the piece nor the whole: refused,
    # naming the parameter and both shapes it takes, and nothing loaded.
    before = ema.local_ema()
    try:
        ema.load_ema_values({"2.weight": torch.zeros(6, 3), "inner": given["inner"]},
                            strict=False)
    except ValueError as error:
        text = str(error)
        piece = tuple(tensors["2.weight"].to_local().shape)
        assert "'2.weight' (6, 3)" in text and f"{piece} (this rank's part)" in text and \
            "(3, 6) (the whole)" in text and "'inner'" not in text, text
    else:
        raise AssertionError("a (6, 3) tensor was taken for '2.weight' (3, 6)")
    for name, value in ema.local_ema().items():
        assert torch.equal(value, before[name]), f"'{name}' changed by a refused load"


def tp_callback_one_file(rank, world, out):
    """EMACallback's one-file checkpoint of a tensor-parallel model (what
    Lightning's ModelParallelStrategy writes with
    save_distributed_checkpoint=False: rank 0's state_dict holds plain full
    tensors, and every rank reads the whole file at resume) loads back into
    a fresh model and callback: the EMA and the raw weights saved."""
    from shardema.callbacks import EMACallback
    base = os.path.dirname(out)
    mesh = init_device_mesh("cpu", (world,))
    model = tp_model(12, mesh)
    saver = EMACallback()
    saver.on_fit_start(None, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(1, STEPS + 1):
        tp_step(model, optimizer, saver.ema, step)
    saver.ema.wait()
    ema_saved = saver.ema.full_state_dict(rank0_only=False)
    raw = {n: full_value(t).float() for n, t in module_tensors(model).items()}
    assert any(not torch.equal(raw[n], ema_saved[n]) for n in raw)
    checkpoint = {"state_dict": dict(raw) if rank == 0 else {}}
    saver.on_save_checkpoint(None, model, checkpoint)
    path = os.path.join(base, "tp_one_file.ckpt")
    if rank == 0:
        torch.save(checkpoint, path)
    dist.barrier()

    fresh = tp_model(13, mesh)
    loader = EMACallback()
    loader.on_fit_start(None, fresh)
    loader.on_load_checkpoint(None, fresh, torch.load(path, weights_only=False))
    loaded = loader.ema.full_state_dict(rank0_only=False)
    for name, t in module_tensors(fresh).items():
        assert torch.equal(loaded[name], ema_saved[name]), f"'{name}': EMA after the resume"
        assert torch.equal(full_value(t).float(), raw[name]), f"'{name}': raw after the resume"


def profiled_allocations(call):
    """The sizes in bytes of the host allocations made while `call` runs
    (torch's profiler sees every CPU tensor the C++ engine allocates on
    this thread, the gathered ones among them)."""
    import warnings
    from torch.profiler import ProfilerActivity, profile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
    return [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]


def whole_gather_only(rank, world, out):
    """swap() and copy_to() of a model whose big weight is sharded
    (Shard(0), 1 MiB whole) beside tensors every rank holds whole (a
    Replicate() one of 3001 elements, a plain buffer): they gather only the
    whole ones, so no allocation reaches the big weight's full size, and
    they write the EMA, checked against a float64 EMA."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(14)
    model = nn.Module()
    model.big = nn.Parameter(distribute_tensor(torch.randn(2048, 128), mesh, [Shard(0)]))
    model.whole = nn.Parameter(distribute_tensor(torch.randn(3001), mesh, [Replicate()]))
    model.register_buffer("plain", torch.randn(7, 11))
    big_bytes, whole_bytes = 2048 * 128 * 4, 3001 * 4
    tensors = module_tensors(model)
    ema = shardema.EMA(model, schedule=schedule(), policy="versatil", timeout=60)
    reference = Float64Ema(lambda: tensors, lambda: versatil_averaged(model))
    for step in range(1, STEPS + 1):
        ema.fence()
        with torch.no_grad():
            for t in tensors.values():
                local = t.to_local() if isinstance(t, DTensor) else t
                local.mul_(0.7).add_(0.1 * step)
        ema.update()
        reference.update(step)
    ema.wait()
    raw = {n: full_value(t) for n, t in tensors.items()}

    sizes = profiled_allocations(ema.swap_in)
    try:
        assert max(sizes) < big_bytes, f"swap_in allocated {max(sizes)} bytes on rank {rank}"
        for name, t in tensors.items():
            close(full_value(t), reference.ema[name], f"swapped '{name}'")
    finally:
        ema.swap_out()
    for name, t in tensors.items():
        assert torch.equal(full_value(t), raw[name]), f"'{name}' after swap"

    sizes = profiled_allocations(ema.copy_to)
    assert whole_bytes in sizes, f"the gather of 'whole' was not seen: {sorted(sizes)[-5:]}"
    assert max(sizes) < big_bytes, f"copy_to allocated {max(sizes)} bytes on rank {rank}"
    for name, t in tensors.items():
        close(full_value(t), reference.ema[name], f"'{name}' after copy_to")


SCENARIOS = {"tp_train": tp_train, "tp_load_one": tp_load_one, "hsdp_dcp": hsdp_dcp,
             "hsdp_load_fsdp2": hsdp_load_fsdp2, "hsdp_missing_writer": hsdp_missing_writer,
             "tp_load_full": tp_load_full, "tp_callback_one_file": tp_callback_one_file,
             "whole_gather_only": whole_gather_only, "hsdp_slow_writer": hsdp_slow_writer,
             "hsdp_buffers": hsdp_buffers}


if __name__ == "__main__":
    # hsdp_missing_writer leaves the group out of step (a collective abandoned).
    rank_worker.main(SCENARIOS, group_timeout=GROUP_TIMEOUT, out_of_step={"hsdp_missing_writer"})
