"""One rank of the multi-process tests (test_multirank.py starts W of them
over Gloo on loopback). Usage: multirank_worker.py SCENARIO RANK WORLD PORT OUT"""
import os
import sys
import traceback

import torch
import torch.distributed as dist

import shardema

STEPS = 5


def make_model():
    torch.manual_seed(0)
    # Shapes with row counts that do not divide by 2 or 3: uneven chunks and
    # empty trailing ranks.
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 1),
                               torch.nn.BatchNorm1d(1))


def train_step(model, step):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.cos(torch.arange(p.numel(), dtype=torch.float64) * 0.3 * (step + i))
                   .reshape(p.shape).to(p.dtype))


def schedule():
    return shardema.WarmupSchedule(power=0.75)


def local_rows(tensor, rank, world):
    """FSDP2's rows of `rank`: torch.chunk on dim 0 (trailing ranks may get
    none); a 0-dim tensor belongs to rank 0."""
    if tensor.dim() == 0:
        return tensor.clone() if rank == 0 else tensor.reshape(-1)[:0].clone()
    chunks = tensor.chunk(world, dim=0)
    return chunks[rank].clone() if rank < len(chunks) else tensor[:0].clone()


def fsdp2_rows(model, rank, world):
    """What fully_shard leaves on a rank: its rows of every tensor, as
    separate tensors, with their specs."""
    # The roles shardema.EMA gives a whole model (versatil policy), so the
    # two runs are comparable; the rows are not parameters, so "average if
    # trainable" is decided here, as EMA does for DTensors.
    from shardema._model import module_tensors
    roles = {t.name: t.role for t in module_tensors(model, "versatil")}
    shards, locals_ = [], {}
    for name, tensor in model.state_dict().items():
        rows = local_rows(tensor, rank, world)
        spec = shardema.layout_spec(name, list(tensor.shape), tensor.dtype, "fsdp2", world)
        role = roles[name].replace("average_if_trainable", "average")
        shards.append((rows, spec, role))
        locals_[name] = rows
    return shards, locals_


def copy_rows(model, locals_, rank, world):
    for name, tensor in model.state_dict().items():
        locals_[name].copy_(local_rows(tensor, rank, world))


def train_rows(ema, model, locals_, rank, world, out):
    """STEPS steps of the whole model, each rank's rows copied into its
    local shards (what the sharded optimizer would write), then this rank's
    results saved for the test."""
    for step in range(1, STEPS + 1):
        ema.fence()
        train_step(model, step)
        copy_rows(model, locals_, rank, world)
        ema.update()
    ema.wait()
    torch.save({"local": ema.local_state(), "full": ema.full_state_dict()},
               os.path.join(out, f"rank{rank}.pt"))


def run(scenario, rank, world, out):
    model = make_model()
    if scenario == "replicated":
        ema = shardema.EMA(model, schedule=schedule(), timeout=60)
        assert ema.layout == "replicated" and ema.world_size == world
        for step in range(1, STEPS + 1):
            ema.fence()
            train_step(model, step)
            ema.update()
        ema.wait()
        result = {"local": ema.local_state(), "full_all": ema.full_state_dict(rank0_only=False),
                  "full_rank0": ema.full_state_dict()}
        ema.export(os.path.join(out, "export.safetensors"))
        with ema.swap(model):
            result["swapped"] = {k: v.clone() for k, v in model.state_dict().items()}
        result["after_swap"] = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    elif scenario in ("rows", "rows_save"):
        shards, locals_ = fsdp2_rows(model, rank, world)
        ema = shardema.EMA.from_local_shards(shards, schedule=schedule(), timeout=60)
        train_rows(ema, model, locals_, rank, world, out)
        if scenario == "rows_save":
            ema.save(os.path.join(out, "ckpt"))
    elif scenario == "dtensor":
        # FSDP2 as EMA's auto layout sees it: Shard(0) DTensor parameters on
        # a 1-D mesh whose group is the job's (stand-ins: torch 1.13 has no
        # DTensor), and plain buffers.
        from dtensor_standin import Mesh, StandInDTensor
        mesh = Mesh(group=dist.distributed_c10d._get_default_group())
        _, locals_ = fsdp2_rows(model, rank, world)
        sharded = make_model()  # what fully_shard(model) holds on this rank
        for module_name, module in sharded.named_modules():
            for name, tensor in list(module._parameters.items()):
                full_name = f"{module_name}.{name}" if module_name else name
                module._parameters[name] = StandInDTensor(locals_[full_name], tensor.shape,
                                                          mesh=mesh)
        ema = shardema.EMA(sharded, schedule=schedule(), policy="versatil", timeout=60)
        assert ema.layout == "fsdp2"
        train_rows(ema, model, locals_, rank, world, out)
    elif scenario == "rows_load":
        shards, _ = fsdp2_rows(model, rank, world)
        ema = shardema.EMA.from_local_shards(shards, schedule=schedule(), timeout=60)
        ema.load(os.environ["SHARDEMA_TEST_CHECKPOINT"])
    elif scenario == "rank_raises":
        ema = shardema.EMA(model, schedule=schedule(), timeout=20)
        if rank == 1:
            raise RuntimeError("rank 1 fails before the collective")
        ema.save(os.path.join(out, "ckpt"))
    else:
        raise ValueError(scenario)


def main():
    scenario, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        run(scenario, rank, world, out)
    except BaseException as error:  # reported to the test through the file
        with open(os.path.join(out, f"error{rank}.txt"), "w") as f:
            f.write(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        os._exit(3)
    os._exit(0)


if __name__ == "__main__":
    main()
