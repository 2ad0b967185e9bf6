"""One rank of test_ema_pytorch_names.py's multi-process test: EMA.module()
and EMA.copy_from() on a DDP model and on a real fully_shard (FSDP2) model,
Gloo on loopback. Each check asserts here; started by rank_launch.launch,
rank_worker.py says how and what it reports."""

import torch
from torch.distributed.fsdp import fully_shard

import rank_worker
import shardema

STEPS = 4
DECAY = 0.75


def make_model():
    torch.manual_seed(0)
    # 7 and 5 rows: uneven splits over 2 ranks.
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.BatchNorm1d(7),
                               torch.nn.Linear(7, 5))


def train(model, ema, x):
    """STEPS SGD steps, the same on every rank (same data, same seed)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema.attach(optimizer)
    for _ in range(STEPS):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    ema.detach()
    ema.wait()


def state_of(model):
    """A clone of every tensor, the local rows of a DTensor."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in model.state_dict().items()}


def assert_same(a, b, what):
    assert list(a) == list(b), (what, list(a), list(b))
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


def check_ddp(rank, world):
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY))
    assert ema.layout == "replicated"
    train(model, ema, torch.randn(8, 6, generator=torch.Generator().manual_seed(1)))
    raw = state_of(model.module)
    view = ema.module(device="cpu")  # collective: rows gathered on every rank
    assert_same(state_of(model.module), raw, "DDP model touched by module()")
    full = ema.full_state_dict(rank0_only=False)
    got = view.state_dict()
    for name, value in full.items():
        assert torch.equal(got[name], value.to(got[name].dtype)), name
    with ema.swap(model):
        swapped = state_of(model.module)
    assert_same(state_of(view), swapped, "DDP view against swap")
    assert not any(p.requires_grad for p in view.parameters())

    ema.copy_from(model)  # each rank its rows: no collective
    rows = ema.local_ema()
    # Buffers: each rank keeps its own whole (DDP leaves the ranks' unequal).
    buffers = {name for name, _ in model.module.named_buffers()}
    for name, tensor in raw.items():
        kind = "per_rank" if name in buffers else "replicated"
        spec = shardema.layout_spec(name, list(tensor.shape), tensor.dtype, kind, world)
        begin, end = spec.ranges[rank] if kind == "replicated" else (0, tensor.numel())
        assert torch.equal(rows[name], tensor.reshape(-1)[begin:end].to(rows[name].dtype)), name


def sharded_model():
    """model[0] in its own FSDP2 group; the BatchNorm and the last Linear in
    the root's group, which FSDP2 leaves unsharded after a forward."""
    model = make_model()
    fully_shard(model[0])
    fully_shard(model)
    return model


def plain_with(values):
    """The same model, not sharded, holding full `values`."""
    model = make_model()
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in values.items()})
    return model.eval()


def full_raw(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def check_fsdp2(rank, world):
    model = sharded_model()
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(DECAY))
    assert ema.layout == "fsdp2"
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    train(model, ema, x)
    raw = state_of(model)
    raw_model = plain_with(full_raw(model))
    ema_model = plain_with(ema.full_state_dict(rank0_only=False))
    model.eval()
    with torch.no_grad():
        before = model(x)  # leaves the root's parameters unsharded
        torch.testing.assert_close(before, raw_model(x), rtol=1e-6, atol=1e-6)
        with ema.swap(model):
            inside = model(x)
        after = model(x)
    # The forward inside swap() sees the EMA of every parameter, the root's
    # too, and the one after it the raw weights again.
    torch.testing.assert_close(inside, ema_model(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(after, raw_model(x), rtol=1e-6, atol=1e-6)

    try:
        ema.module()
        raise AssertionError("module() of an FSDP2 model without into= did not raise")
    except ValueError as error:
        assert "into=" in str(error) and "0.weight" in str(error), str(error)
    into = sharded_model().eval()
    for _ in range(2):  # the second time into's root is unsharded by the forward
        view = ema.module(into=into)
        assert view is into
        mine = ema.local_ema()  # this rank's rows only: what each rank wrote
        for name, param in view.named_parameters():
            local = param.to_local()
            assert torch.equal(local.reshape(-1), mine[name].to(local.dtype)), name
        with torch.no_grad():
            torch.testing.assert_close(view(x), ema_model(x), rtol=1e-6, atol=1e-6)
    assert_same(state_of(model), raw, "FSDP2 model touched by module()")

    model.train()
    ema.copy_from()
    mine = ema.local_ema()
    for name, param in model.named_parameters():
        assert torch.equal(mine[name], param.to_local().reshape(-1).float()), name


SCENARIOS = {"ddp": lambda rank, world, out: check_ddp(rank, world),
             "fsdp2": lambda rank, world, out: check_fsdp2(rank, world)}


if __name__ == "__main__":
    rank_worker.main(SCENARIOS, group_timeout=None)
