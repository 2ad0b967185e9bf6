"""Layout detection of DTensor (FSDP2) parameters, with torch's real
DTensors (distribute_tensor, fully_shard) on a one-rank Gloo group in this
process; the many-rank runs are in test_multirank.py."""
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardema


def dtensor(full, placements=(Shard(0),), mesh=None):
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (1,))
    return torch.nn.Parameter(distribute_tensor(full, mesh, list(placements)))


def test_shard0_dtensors_on_one_rank_are_fsdp2(one_rank_group):
    w = dtensor(torch.arange(12, dtype=torch.float32).reshape(4, 3))
    b = dtensor(torch.zeros(4), mesh=w.device_mesh)
    ema = shardema.EMA([("w", w), ("b", b)], schedule=shardema.DecaySchedule.constant(0.5))
    assert ema.layout == "fsdp2" and ema.world_size == 1
    with torch.no_grad():
        w.add_(2.0)  # the live local shard changes (an optimizer step)
    ema.update()
    ema.wait()
    full = ema.full_state_dict()
    # the first update copies (copy_on_first_update), so the EMA is the new value
    assert torch.equal(full["w"], w.full_tensor())
    assert full["w"].shape == (4, 3)


def test_a_fully_shard_model_is_fsdp2_and_its_ema_follows_full_tensor(one_rank_group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    decay = 0.9
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(decay), policy="versatil")
    assert ema.layout == "fsdp2"
    reference = {n: p.full_tensor().double() for n, p in model.named_parameters()}
    for step in range(1, 6):
        model(torch.randn(3, 4)).square().mean().backward()
        ema.fence()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        for n, p in model.named_parameters():
            reference[n] = p.full_tensor().double() if step == 1 else \
                decay * reference[n] + (1 - decay) * p.full_tensor().double()
    full = ema.full_state_dict()
    for n, want in reference.items():
        torch.testing.assert_close(full[n].double(), want, rtol=1e-6, atol=1e-7)


def test_a_buffer_beside_dtensor_parameters_is_replicated(one_rank_group):
    w = dtensor(torch.ones(2, 2))
    running = torch.full((2,), 5.0)
    ema = shardema.EMA([("w", w), ("running", running)])
    assert ema.layout == "fsdp2"
    assert torch.equal(ema.full_state_dict()["running"], running)


@pytest.mark.parametrize("placements, mesh_shape", [
    ((Replicate(),), (1,)),                 # each rank holds the whole tensor
    ((Replicate(), Shard(0)), (1, 1)),      # HSDP
    ((Replicate(), Replicate()), (1, 1)),
    ((Shard(1),), (1,)),                    # tensor parallelism's column split
    ((Replicate(), Shard(1)), (1, 1)),
])
def test_supported_dtensor_layouts_follow_the_tensor(one_rank_group, placements, mesh_shape):
    p = dtensor(torch.arange(6.0).reshape(3, 2), placements, init_device_mesh("cpu", mesh_shape))
    ema = shardema.EMA([("w", p)], schedule=shardema.DecaySchedule.constant(0.5))
    assert ema.layout == "fsdp2"
    with torch.no_grad():
        p.to_local().mul_(3.0)
    ema.update()
    assert torch.equal(ema.full_state_dict()["w"], p.full_tensor())


@pytest.mark.parametrize("placements, mesh_shape, message", [
    ((Shard(0), Shard(0)), (1, 1), r"Shard\(dim=0\), Shard\(dim=0\)"),
    ((Shard(0), Replicate()), (1, 1), r"Shard\(dim=0\), Replicate"),
    ((Replicate(), Replicate(), Shard(0)), (1, 1, 1), "3-D"),
])
def test_unsupported_dtensor_layouts_name_the_parameter_and_placement(one_rank_group, placements,
                                                                      mesh_shape, message):
    p = dtensor(torch.ones(2, 2), placements, init_device_mesh("cpu", mesh_shape))
    with pytest.raises(ValueError, match=message) as error:
        shardema.EMA([("layer.weight", p)])
    assert "'layer.weight'" in str(error.value)


def test_plain_parameter_beside_dtensors_is_replicated(one_rank_group):
    # a model partly under fully_shard: the plain parameter is the same on
    # every rank, so it is tracked as DDP's are (test_multirank_fsdp2.py
    # checks it on two ranks)
    d = dtensor(torch.ones(2, 2))
    plain = torch.nn.Parameter(torch.ones(3))
    ema = shardema.EMA([("sharded", d), ("plain", plain)],
                       schedule=shardema.DecaySchedule.constant(0.5))
    assert ema.layout == "fsdp2"
    ema.update()
    ema.fence()
    with torch.no_grad():
        plain.add_(2.0)
    ema.update()
    assert torch.equal(ema.full_state_dict()["plain"], torch.full((3,), 2.0))


def test_dtensors_on_two_meshes_need_a_process_group(one_rank_group):
    a = dtensor(torch.ones(2, 2), mesh=DeviceMesh("cpu", [0], mesh_dim_names=("a",)))
    b = dtensor(torch.ones(2, 2), mesh=DeviceMesh("cpu", [0], mesh_dim_names=("b",)))
    with pytest.raises(ValueError, match="process_group"):
        shardema.EMA([("a", a), ("b", b)])


def test_dtensors_with_another_layout_are_refused(one_rank_group):
    d = dtensor(torch.ones(2, 2))
    with pytest.raises(ValueError, match="DTensor"):
        shardema.EMA([("w", d)], layout="replicated")


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fully_shard"])
def test_frozen_or_not_is_decided_at_each_update(one_rank_group, sharded):
    # versatil: a frozen parameter is copied, a trainable one averaged, as
    # requires_grad is at that update, not when the EMA was built.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    if sharded:
        fully_shard(model)
    model[1].requires_grad_(False)
    decay = 0.5
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(decay), policy="versatil")

    def full(p):
        return (p.full_tensor() if sharded else p.detach()).double()
    reference = {n: full(p) for n, p in model.named_parameters()}
    ema.update()
    for step in (2, 3, 4):
        if step == 3:  # swap which layer is frozen
            model[1].requires_grad_(True)
            model[0].requires_grad_(False)
        ema.fence()
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if sharded else p).add_(0.25 * step)
        ema.update()
        for n, p in model.named_parameters():
            reference[n] = decay * reference[n] + (1 - decay) * full(p) if p.requires_grad \
                else full(p)
        got = ema.full_state_dict()
        for n, want in reference.items():
            torch.testing.assert_close(got[n].double(), want, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"step {step}, '{n}': {m}")
