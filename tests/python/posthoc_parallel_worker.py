"""One rank of test_posthoc_parallel.py: the sharded post-hoc EMA under
HSDP (fully_shard on a 2 x 2 (replicate, shard) mesh, W = 4) and under
tensor parallelism (parallelize_module's ColwiseParallel / RowwiseParallel
and Shard(1) parameters, W = 2), on CPU/Gloo.

Each scenario drives DDPPostHocEMACallback's hooks as a Trainer would
(snapshots every 3 steps, a checkpoint between two snapshot steps, a
validation swap, the end of training) with weights set by hand at each
step, so every rank knows the full weights of every step: each snapshot
file, the offline synthesis of any sigma_rel, what validation swaps in and
the deployable weights are checked against a float64 recomputation of the
power-function profiles over the full tensors (posthoc_reference.py). A
resume from the checkpoint, in a copy of the folder as it stood then, must
write the same files bit for bit. The *_golden scenarios run
shardema.PostHocEMA over the reference run of tests/data/posthoc_ema_run.json
(ema-pytorch's and nitrous' numbers) split over the ranks. Started by
rank_launch.launch; rank_worker.py says how and what it reports."""
import json
import os
import shutil
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import posthoc_reference as ref
import rank_worker
import shardema
from dtensor_checks import piece_of
from shardema.callbacks import DDPPostHocEMACallback
from tensor_parallel_worker import tp_model

SIGMA_RELS = (0.05, 0.1)
EVERY = 3
STEPS = 8
SAVED_AT = 4  # between the snapshots of steps 3 and 6
SNAPSHOT_STEPS = (3, 6, 8)  # and 8: the final one at train end
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")


def full_weights(model, k):
    """The full value of every parameter at step k (k = 0: as built)."""
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        n = p.numel()
        grid = torch.arange(n, dtype=torch.float64).reshape(p.shape)
        out[name] = (torch.sin(0.37 * k + 1.3 * i + 0.11 * grid) * (1.0 + 0.1 * k)).float()
    return out


def set_weights(model, k, shard_rank, shard_world):
    """Each rank writes its piece of full_weights(k) into what it holds."""
    with torch.no_grad():
        for name, value in full_weights(model, k).items():
            p = dict(model.named_parameters())[name]
            if isinstance(p, DTensor) and p.placements[-1].is_shard():
                p.to_local().copy_(piece_of(value, p, shard_rank, shard_world))
            elif isinstance(p, DTensor):  # Replicate(): the whole on every rank
                p.to_local().copy_(value)
            else:
                p.copy_(value)


def gathered(model):
    """The full tensors the model holds (DTensors gathered: collective)."""
    with torch.no_grad():
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())
                for n, p in model.named_parameters()}


def close(actual, expected, what):
    torch.testing.assert_close(actual.double().reshape(expected.shape), expected, rtol=1e-5,
                               atol=1e-6, msg=what)


def train(model, callback, trainer, steps, shard_rank, shard_world, on_step=None):
    for k in steps:
        callback.on_before_optimizer_step(trainer, model, None)
        set_weights(model, k, shard_rank, shard_world)
        trainer.global_step = k
        callback.on_train_batch_end(trainer, model, None, None, 0)
        if on_step is not None:
            on_step(k)


def snapshot_files(folder):
    """{relative path: tensors} of the snapshots (resume/ left out)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in ("resume", "superseded")]
        for f in files:
            if f.endswith(".safetensors"):
                path = os.path.join(root, f)
                found[os.path.relpath(path, folder)] = shardema.read_tensor_file(path)["tensors"]
    return found


def lifecycle(make_model, shard_rank, shard_world, first_replica, base):
    """The callback's lifecycle over make_model() (see the module's
    docstring); `first_replica`: this rank writes the files."""
    folder, resumed_folder = os.path.join(base, "snapshots"), os.path.join(base, "resumed")
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    trace = [(k, full_weights(model, k)) for k in range(STEPS + 1)]
    profiles = {s: ref.power_profiles(trace, s, names) for s in SIGMA_RELS}

    def synthesis(sigma, steps, at):
        return ref.synthesis_of(profiles, steps, sigma, at, names)

    trainer = SimpleNamespace(global_step=0, accumulate_grad_batches=1, is_last_batch=False,
                              default_root_dir=base)
    callback = DDPPostHocEMACallback(sigma_rels=SIGMA_RELS, checkpoint_every=EVERY,
                                     checkpoint_folder=folder, layout="sharded",
                                     default_output_sigma=0.05)
    callback.on_fit_start(trainer, model)
    assert callback._engine.holds_ema == first_replica
    assert (callback._engine.rank, callback._engine.world_size) == (shard_rank, shard_world)
    saved = {}

    def after(k):
        if k == SAVED_AT:
            callback.on_save_checkpoint(trainer, model, saved)
            dist.barrier()  # every holder's resume files written
            if first_replica:  # the folder as a run that stopped here left it
                mine = f"rank_{shard_rank:05d}"
                shutil.copytree(os.path.join(folder, mine), os.path.join(resumed_folder, mine))
        if k == 7:
            # Validation: the synthesis of 0.05 at the newest snapshot (6),
            # swapped into every replica; the raw weights come back after.
            assert callback._engine.calls == 7
            callback.on_validation_start(trainer, model)
            want = synthesis(0.05, (3, 6), 6)
            for name, value in gathered(model).items():
                close(value, want[name], f"validation '{name}'")
            callback.on_validation_end(trainer, model)
            for name, value in gathered(model).items():
                assert torch.equal(value, trace[7][1][name]), f"raw '{name}' after validation"
    train(model, callback, trainer, range(1, STEPS + 1), shard_rank, shard_world, after)
    callback.on_train_end(trainer, model)
    dist.barrier()  # every file written

    # The files: one rank folder per shard rank, from the first replica;
    # each holds exactly this rank's piece of each float64 profile.
    files = snapshot_files(folder)
    expected = sorted(os.path.join(f"rank_{r:05d}", f"{i}.{t}.safetensors")
                      for r in range(shard_world) for i in range(len(SIGMA_RELS))
                      for t in SNAPSHOT_STEPS)
    assert sorted(files) == expected, sorted(files)
    live = dict(model.named_parameters())
    for i, sigma in enumerate(SIGMA_RELS):
        for t in SNAPSHOT_STEPS:
            tensors = files[os.path.join(f"rank_{shard_rank:05d}", f"{i}.{t}.safetensors")]
            assert sorted(tensors) == sorted(names)
            for name in names:
                want = piece_of(profiles[sigma][t][name], live[name], shard_rank, shard_world)
                close(tensors[name], want.reshape(-1), f"profile {sigma} step {t} '{name}'")

    # Any sigma_rel, offline, in the tensors' own shapes; the deployable
    # weights of the end of training (on global rank 0 only).
    for sigma in (0.05, 0.07, 0.2):
        got = shardema.synthesize_snapshot_folder(folder, sigma)
        want = synthesis(sigma, SNAPSHOT_STEPS, STEPS)
        assert sorted(got) == sorted(names)
        for name in names:
            assert got[name].shape == want[name].shape, (name, got[name].shape)
            close(got[name], want[name], f"synthesized {sigma} '{name}'")
    deployable = callback.output_path
    assert (deployable is not None) == (dist.get_rank() == 0), deployable
    if deployable is not None:
        written = shardema.read_tensor_file(deployable)["tensors"]
        want = synthesis(0.05, SNAPSHOT_STEPS, STEPS)
        for name in names:
            assert written[name].shape == want[name].shape, name
            close(written[name], want[name], f"deployable '{name}'")

    # The resume from step 4 in the folder as it stood then: the same files.
    model = make_model()
    set_weights(model, SAVED_AT, shard_rank, shard_world)
    resumed = DDPPostHocEMACallback(sigma_rels=SIGMA_RELS, checkpoint_every=EVERY,
                                    checkpoint_folder=resumed_folder, layout="sharded",
                                    default_output_sigma=0.05)
    resumed.on_load_checkpoint(trainer, model, saved)
    trainer.global_step = SAVED_AT
    resumed.on_fit_start(trainer, model)
    assert resumed.calls == SAVED_AT
    train(model, resumed, trainer, range(SAVED_AT + 1, STEPS + 1), shard_rank, shard_world)
    resumed.on_train_end(trainer, model)
    dist.barrier()
    again = snapshot_files(resumed_folder)
    assert sorted(again) == sorted(files)
    for path, tensors in files.items():
        for name in names:
            assert torch.equal(again[path][name], tensors[name]), f"resumed {path} '{name}'"


def hsdp_net(mesh):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def posthoc_hsdp(rank, world, out):
    """2 x 2 HSDP: the shard group's two ranks keep the profiles on the
    first replica (global ranks 0 and 1), which alone writes rank_00000 and
    rank_00001; the second replica keeps none and takes the validation
    swap's values from it."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica, shard_rank = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    lifecycle(lambda: hsdp_net(mesh), shard_rank, 2, replica == 0, out)


def posthoc_tp(rank, world, out):
    """Tensor parallelism on a 1-D mesh: Shard(0) and Shard(1) pieces (one
    strided, one empty on rank 1), Replicate() and plain parameters."""
    mesh = init_device_mesh("cpu", (world,))
    lifecycle(lambda: tp_model(0, mesh), rank, world, True, out)


def golden_run(model, theta, place, folder):
    """ema-pytorch's and nitrous' reference run (posthoc_ema_run.json,
    nitrous_u1_corr_mmaudio: every call, step size correction), theta
    placed by `place` (the full 4 values -> this rank's piece)."""
    with open(os.path.join(DATA, "posthoc_ema_run.json")) as f:
        run = next(r for r in json.load(f)["runs"] if r["run"] == "nitrous_u1_corr_mmaudio")
    ema = shardema.PostHocEMA(model, sigma_rels=SIGMA_RELS, checkpoint_every_num_steps=10,
                              checkpoint_folder=folder, layout="sharded",
                              step_size_correction=True)
    for k in range(1, 101):
        ema.fence()
        i = torch.arange(4, dtype=torch.float64)
        value = (torch.sin(0.1 * k * (i + 1)) + 0.01 * k * (i + 1)).float()
        with torch.no_grad():
            theta.to_local().copy_(place(value))
        ema.update()
    ema.wait()
    dist.barrier()  # every rank's snapshots written
    for key, expected in run["synthesized"].items():
        got = ema.synthesize(expected["target_sigma_rel"], step=expected["target_step"])
        for ours, want in zip(got["theta"].reshape(-1).tolist(), expected["synthesized_theta"]):
            assert abs(ours - want) <= 1e-6, (key, ours, want)


class Vec(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(shape))


def posthoc_hsdp_golden(rank, world, out):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Vec((4,))
    fully_shard(model, mesh=mesh)
    shard_rank = mesh.get_local_rank("shard")
    golden_run(model, model.theta, lambda v: v.chunk(2)[shard_rank],
               os.path.join(out, "golden_hsdp"))


def posthoc_tp_golden(rank, world, out):
    mesh = init_device_mesh("cpu", (world,))
    model = Vec((1, 4))
    model.theta = nn.Parameter(distribute_tensor(torch.zeros(1, 4), mesh, [Shard(1)]))
    golden_run(model, model.theta, lambda v: v.reshape(1, 4).chunk(world, dim=1)[rank],
               os.path.join(out, "golden_tp"))


if __name__ == "__main__":
    rank_worker.main({"posthoc_hsdp": posthoc_hsdp, "posthoc_tp": posthoc_tp,
                      "posthoc_hsdp_golden": posthoc_hsdp_golden,
                      "posthoc_tp_golden": posthoc_tp_golden})
