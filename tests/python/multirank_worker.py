"""One rank of the multi-process tests (test_multirank.py starts W of them
over Gloo on loopback with rank_launch.launch; rank_worker.py says how and
what it reports)."""
import functools
import os

import torch

import rank_worker
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
    return shardema.DecaySchedule.warmup(power=0.75)


def local_rows(tensor, rank, world):
    """FSDP2's rows of `rank`: torch.chunk on dim 0 (trailing ranks may get
    none); a 0-dim tensor belongs to rank 0."""
    if tensor.dim() == 0:
        return tensor.clone() if rank == 0 else tensor.reshape(-1)[:0].clone()
    chunks = tensor.chunk(world, dim=0)
    return chunks[rank].clone() if rank < len(chunks) else tensor[:0].clone()


def fsdp2_rows(model, rank, world):
    """Rows like fully_shard's, cut by hand for EMA.from_local_shards: this
    rank's rows of every tensor, as separate tensors, with their specs."""
    # The roles shardema.EMA gives a whole model (its default policy,
    # ema_pytorch's), so the two runs are comparable; the rows are not parameters (nothing says
    # whether they are trainable), so "average if trainable" is "average".
    from shardema._model import module_tensors
    roles = {t.name: t.role for t in module_tensors(model, "ema_pytorch")}
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
    torch.save({"local": ema.local_ema(), "full": ema.full_state_dict()},
               os.path.join(out, f"rank{rank}.pt"))


def sharded_model(world, zero=False):
    """make_model() under torch's fully_shard on a 1-D mesh of the job:
    Shard(0) DTensor parameters (1-row tensors leave ranks 1.. empty) and
    plain buffers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    if zero:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def train_sharded(model, step, rank, world):
    """train_step on the full tensors, each rank adding its rows of the same
    increments to its local shards: what the single process does,
    elementwise."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            step_full = torch.cos(torch.arange(p.numel(), dtype=torch.float64) * 0.3 *
                                  (step + i)).reshape(p.shape).to(p.dtype)
            p.to_local().add_(local_rows(step_full, rank, world))


def dtensor_checkpoint(rank, world):
    """EMACallback over an FSDP2 model: the checkpoint (the model's sharded
    state dict) holds the EMA as DTensors of this rank's rows (only the
    replicated buffers are gathered), the raw weights under RAW_STATE_KEY,
    and a resume restores both."""
    from types import SimpleNamespace
    from torch.distributed.tensor import DTensor
    from shardema.callbacks import EMACallback
    sharded = sharded_model(world)
    trainer = SimpleNamespace(global_step=0, accumulate_grad_batches=1, is_last_batch=False)
    callback = EMACallback(power=0.75)
    callback.on_fit_start(trainer, sharded)
    for step in range(1, STEPS + 1):
        callback.on_before_optimizer_step(trainer, sharded, None)
        train_sharded(sharded, step, rank, world)
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, sharded, None, None, 0)
    ema = callback.ema
    ema.wait()
    expected = ema.local_ema()
    buffers = [n for n, _ in sharded.named_buffers()]
    full_buffers = ema.full_state_dict(rank0_only=False, names=buffers)
    gathered = []
    gather = ema.full_state_dict
    ema.full_state_dict = lambda **kw: gathered.append(list(kw.get("names") or ())) or gather(**kw)
    checkpoint = {"state_dict": sharded.state_dict()}
    callback.on_save_checkpoint(trainer, sharded, checkpoint)
    assert gathered == [buffers], f"gathered {gathered}, expected only the buffers {buffers}"
    state = checkpoint["state_dict"]
    # A sharded (DCP) checkpoint keeps each rank's raw rows in the state
    # dict, under RAW_STATE_KEY as a prefix.
    raw_prefix = EMACallback.RAW_STATE_KEY + "."
    raw = {k[len(raw_prefix):]: v for k, v in state.items() if k.startswith(raw_prefix)}
    assert sorted(raw) == sorted(expected), sorted(raw)
    for name, param in sharded.named_parameters():
        assert isinstance(state[name], DTensor), name
        rows = state[name].to_local()
        assert torch.equal(rows, expected[name].view(rows.shape).to(rows.dtype)), name
        assert torch.equal(raw[name].to_local(), param.to_local()), name
    for name in buffers:
        assert torch.equal(state[name], full_buffers[name].to(state[name].dtype)), name

    # Resume into a fresh model of zeros: the module gets the raw weights,
    # the EMA its own.
    resumed = sharded_model(world, zero=True)
    callback2 = EMACallback(power=0.75)
    callback2.on_load_checkpoint(trainer, resumed, checkpoint)
    callback2.on_fit_start(trainer, resumed)
    for name, param in resumed.named_parameters():
        assert torch.equal(param.to_local(), raw[name].to_local()), name
    got = callback2.ema.local_ema()
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


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
        result = {"local": ema.local_ema(), "full_all": ema.full_state_dict(rank0_only=False),
                  "full_rank0": ema.full_state_dict()}
        ema.export_weights(os.path.join(out, "export.safetensors"))
        with ema.swap(model):
            result["swapped"] = {k: v.clone() for k, v in model.state_dict().items()}
        result["after_swap"] = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    elif scenario in ("rows", "rows_save"):
        shards, locals_ = fsdp2_rows(model, rank, world)
        ema = shardema.EMA.from_local_shards(shards, schedule=schedule(), timeout=60)
        train_rows(ema, model, locals_, rank, world, out)
        if scenario == "rows_save":
            ema.save_checkpoint(os.path.join(out, "ckpt"))
    elif scenario == "dtensor":
        # FSDP2 as EMA's auto layout sees it: torch's fully_shard on a 1-D
        # mesh of the job's ranks.
        sharded = sharded_model(world)
        ema = shardema.EMA(sharded, schedule=schedule(), timeout=60)
        assert ema.layout == "fsdp2"
        for step in range(1, STEPS + 1):
            ema.fence()
            train_sharded(sharded, step, rank, world)
            ema.update()
        ema.wait()
        torch.save({"local": ema.local_ema(), "full": ema.full_state_dict()},
                   os.path.join(out, f"rank{rank}.pt"))
    elif scenario == "rows_load":
        shards, _ = fsdp2_rows(model, rank, world)
        ema = shardema.EMA.from_local_shards(shards, schedule=schedule(), timeout=60)
        ema.load_checkpoint(os.environ["SHARDEMA_TEST_CHECKPOINT"])
    elif scenario == "swap_rank_raises":
        # A replicated swap gathers every rank's rows; rank 1 never joins,
        # so rank 0's gather times out after it has already written its own
        # rows into the model: the model must come back as it was.
        ema = shardema.EMA(model, schedule=schedule(), timeout=5)
        for step in range(1, 4):
            ema.fence()
            train_step(model, step)
            ema.update()
        ema.wait()
        if rank == 1:
            raise RuntimeError("rank 1 fails before the swap")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        error = None
        try:
            with ema.swap(model):
                pass
        except RuntimeError as e:
            error = str(e)
        torch.save({"before": before, "after": model.state_dict(), "error": error},
                   os.path.join(out, f"rank{rank}.pt"))
    elif scenario == "dtensor_checkpoint":
        dtensor_checkpoint(rank, world)
    elif scenario == "rank_raises":
        ema = shardema.EMA(model, schedule=schedule(), timeout=20)
        if rank == 1:
            raise RuntimeError("rank 1 fails before the collective")
        ema.save_checkpoint(os.path.join(out, "ckpt"))
    else:
        raise ValueError(scenario)


SCENARIOS = {name: functools.partial(run, name)
             for name in ("replicated", "rows", "rows_save", "dtensor", "rows_load",
                          "swap_rank_raises", "dtensor_checkpoint", "rank_raises")}


if __name__ == "__main__":
    # swap_rank_raises: rank 1 raises alone, rank 0 goes on without it.
    rank_worker.main(SCENARIOS, group_timeout=None, out_of_step={"swap_rank_raises"})
