"""Writes to the weights, the loops users bring: nothing a write does fails
the EMA, and the EMA is the one of the values the model held at each
update() call, checked against the real ema_pytorch.EMA run on the same
model, or a float64 EMA computed here.

- the ema-pytorch loop, optimizer.step() then ema.update() with no fence():
  torch's global optimizer step pre-hook fences every EMA first;
- update() before optimizer.step();
- a write after update() and before the next step (weight clipping, as
  LightningModule.on_train_batch_end does after the callbacks): the first
  due update is read before update() returns, and a tensor seen written so
  is read inside update() from then on, with one warning;
- a write that surely overlaps a background read (the chunk gate holds the
  read): warned as "may mix", the EMA goes on;
- FSDP2: writes go through the DTensor parameters, whose local tensors'
  version counters never move; they are seen all the same."""
import threading
import warnings

import ema_pytorch
import pytest
import torch

import shardema
from rank_launch import free_port
from shardema import _C

DECAY = 0.9


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train_step(model, optimizer, step):
    torch.manual_seed(1000 + step)
    loss = model(torch.randn(16, 8)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def clip(model, bound=0.05):
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-bound, bound)


class Float64Ema:
    """The first fold copies, later ones lerp with weight 1 - DECAY."""

    def __init__(self):
        self.value = None

    def fold(self, model):
        now = {n: t.detach().double().clone() for n, t in model.state_dict().items()}
        self.value = now if self.value is None else \
            {n: self.value[n] * DECAY + now[n] * (1 - DECAY) for n in now}

    def max_difference(self, ema):
        got = ema.full_state_dict()
        return max((got[n].double() - v).abs().max().item() for n, v in self.value.items())


def ours(model):
    return shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY),
                        policy="ema_pytorch")


def shardema_warnings(record):
    return [str(w.message) for w in record if "written in place" in str(w.message)]


@pytest.mark.parametrize("order", ["step_then_update", "update_then_step"])
def test_the_ema_pytorch_loop_needs_no_fence(order):
    model, twin = mlp(), mlp()
    theirs = ema_pytorch.EMA(twin, beta=0.99, update_after_step=2, update_every=1,
                             power=2 / 3, inv_gamma=1.0, allow_different_devices=True)
    schedule = shardema.DecaySchedule.warmup(inv_gamma=1.0, power=2 / 3, max_value=0.99,
                                             update_after_step=2)
    ema = shardema.EMA(model, schedule=schedule, policy="ema_pytorch")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(1, 31):
            if order == "update_then_step" and step > 1:
                ema.update()
                theirs.update()
            train_step(model, optimizer, step)
            train_step(twin, twin_optimizer, step)
            if order == "step_then_update":
                ema.update()
                theirs.update()
    want = theirs.ema_model.state_dict()
    got = ema.full_state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=2e-6, atol=1e-7, msg=name)
    assert not shardema_warnings(record), "the optimizer's writes are fenced, not promoted"
    assert ema.offload_stats()["updates"] > 0


def test_clipping_after_the_update_is_exact_from_the_first_step():
    model = mlp()
    ema = ours(model)
    reference = Float64Ema()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # The chunks of the first update are held for 0.3 s: a read left to the
    # background would see the clipping below; update() must wait instead.
    gate = _C._ChunkGate(1, 30.0)
    threading.Timer(0.3, gate.open).start()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(1, 21):
            train_step(model, optimizer, step)
            ema.update()
            reference.fold(model)
            clip(model)  # LightningModule.on_train_batch_end, after the callbacks
    gate.close()
    assert not gate.timed_out
    assert reference.max_difference(ema) < 1e-6
    written = shardema_warnings(record)
    assert len(written) == 1, written
    assert "from now on update() reads them before it returns" in written[0]
    assert "may mix" not in written[0]


def test_a_write_during_the_background_read_warns_and_nothing_fails():
    model = mlp()
    ema = ours(model)
    ema.update()  # step 1: read inside update()
    ema.fence()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    gate = _C._ChunkGate(2, 30.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ema.update()
        assert gate.await_arrival(30.0), "the background read of step 2 started"
        with torch.no_grad():
            model[0].weight.add_(5.0)  # while the read is held
        gate.open()
        ema.fence()
    gate.close()
    written = shardema_warnings(record)
    assert len(written) == 1 and "The EMA of step 2 may mix the values of '0.weight'" in \
        written[0], written
    # Nothing failed, and from step 3 on 0.weight is read inside update().
    before = ema.full_state_dict()["0.weight"].double()
    now = model[0].weight.detach().double().clone()
    ema.update()
    with torch.no_grad():
        model[0].weight.mul_(-3.0)
    ema.wait()
    want = before * DECAY + now * (1 - DECAY)
    torch.testing.assert_close(ema.full_state_dict()["0.weight"].double(), want, rtol=1e-6,
                               atol=1e-6)


@pytest.fixture
def one_rank_fsdp2():
    import torch.distributed as dist
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_writes_through_the_dtensor_are_seen(one_rank_fsdp2):
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    fully_shard(model)
    ema = ours(model)
    reference = Float64Ema()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def full_values():
        return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double()
                for n, t in model.state_dict().items()}

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(1, 11):
            train_step(model, optimizer, step)
            ema.update()
            now = full_values()
            reference.value = now if reference.value is None else \
                {n: reference.value[n] * DECAY + now[n] * (1 - DECAY) for n in now}
            clip(model)
    assert reference.max_difference(ema) < 1e-6
    written = shardema_warnings(record)
    assert len(written) == 1 and "'0.weight'" in written[0], written
