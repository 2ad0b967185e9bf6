"""One rank of test_callback_dtensors.py: EMACallback over a module with a
Replicate() DTensor (each rank holds the whole tensor) beside a Shard(0)
one, on CPU/Gloo, driven through the hooks in Lightning's order by a
stand-in trainer. The rank recomputes the EMA in float64 from
full_tensor() and checks what the callback puts where a DTensor's EMA is
read or written: a distributed checkpoint's entries (each a DTensor whose
to_local() is this rank's part: the whole for Replicate), the resume from
them, the validation swap, EMA.module(into=...) and EMA.copy_from().

Started by rank_launch.launch; rank_worker.py says how and what it reports."""
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import rank_worker
from shardema.callbacks import EMACallback

STEPS = 3
DECAY = 0.75


class Trainer:
    """The attributes the callback reads."""

    def __init__(self):
        self.global_step = 0
        self.accumulate_grad_batches = 1
        self.is_last_batch = False


class Net(nn.Module):
    """A Replicate() parameter of 3 rows (2 + 1 rows of the EMA on 2 ranks)
    and a Shard(0) one, on the same 1-D mesh."""

    def __init__(self, mesh):
        super().__init__()
        self.whole = nn.Parameter(distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh,
                                                    [Replicate()]))
        self.rows = nn.Parameter(distribute_tensor(torch.arange(5.0), mesh, [Shard(0)]))


def full(t):
    with torch.no_grad():
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double()


def close(got, want, what):
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


def train(net, callback, trainer, reference):
    """STEPS optimizer steps, the same on every rank (a replicated step);
    the float64 EMA lerps with the constant decay (VersatIL's callback
    starts from the weights at fit start)."""
    for _ in range(STEPS):
        callback.on_before_optimizer_step(trainer, net, None)
        trainer.global_step += 1
        step = trainer.global_step
        with torch.no_grad():
            net.whole.to_local().mul_(0.5).add_(float(step))
            net.rows.to_local().add_(torch.cos(torch.full_like(net.rows.to_local(), step)))
        callback.on_train_batch_end(trainer, net, None, None, step - 1)
        for name, t in net.named_parameters():
            reference[name] = DECAY * reference[name] + (1 - DECAY) * full(t)


def replicate(rank, world, out):
    import shardema
    mesh = init_device_mesh("cpu", (world,))
    net, trainer = Net(mesh), Trainer()
    callback = EMACallback(schedule=shardema.DecaySchedule.constant(DECAY))
    callback.on_fit_start(trainer, net)
    reference = {name: full(t) for name, t in net.named_parameters()}
    train(net, callback, trainer, reference)
    raw = {name: full(t) for name, t in net.named_parameters()}

    # A distributed checkpoint (ModelParallelStrategy): DTensor entries.
    checkpoint = {"state_dict": {k: v.detach().clone() for k, v in net.state_dict().items()}}
    callback.on_save_checkpoint(trainer, net, checkpoint)
    state = checkpoint["state_dict"]
    for name, want in reference.items():
        entry = state[name]
        assert isinstance(entry, DTensor), f"'{name}': {type(entry).__name__}"
        assert entry.placements == getattr(net, name).placements, f"'{name}' placements"
        close(entry.full_tensor(), want, f"checkpoint '{name}'")
        mine = want if name == "whole" else want.chunk(world)[rank]
        close(entry.to_local(), mine, f"checkpoint '{name}' on rank {rank}")
        close(state[f"{EMACallback.RAW_STATE_KEY}.{name}"].full_tensor(), raw[name],
              f"raw '{name}'")

    # Validation sees the EMA; training goes on with the raw weights.
    callback.on_validation_start(trainer, net)
    for name, want in reference.items():
        close(full(getattr(net, name)), want, f"validation '{name}'")
    callback.on_validation_end(trainer, net)
    for name, want in raw.items():
        assert torch.equal(full(getattr(net, name)), want), f"'{name}' after validation"

    # EMA.module(into=): a module of the same structure takes the EMA.
    view = callback.ema.module(into=Net(mesh))
    for name, want in reference.items():
        close(full(getattr(view, name)), want, f"module(into=) '{name}'")

    # Resume: Lightning loads the (EMA) state dict into the model, then the
    # hook puts the raw weights back and the EMA into the new callback.
    net2, trainer2 = Net(mesh), Trainer()
    net2.load_state_dict({k: v for k, v in state.items() if "." not in k})
    resumed = EMACallback(schedule=shardema.DecaySchedule.constant(DECAY))
    resumed.on_load_checkpoint(trainer2, net2, checkpoint)
    resumed.on_fit_start(trainer2, net2)
    for name, want in raw.items():
        assert torch.equal(full(getattr(net2, name)), want), f"resumed raw '{name}'"
    got = resumed.ema.full_state_dict(rank0_only=False)
    for name, want in reference.items():
        close(got[name], want, f"resumed EMA '{name}'")

    # EMA.copy_from(): the EMA becomes the weights, the whole of each.
    resumed.ema.copy_from()
    got = resumed.ema.full_state_dict(rank0_only=False)
    for name, want in raw.items():
        assert torch.equal(got[name].double(), want), f"copy_from '{name}'"


SCENARIOS = {"replicate": replicate}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS)
