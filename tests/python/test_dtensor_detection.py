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
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(decay))
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


@pytest.mark.parametrize("placement, mesh_shape, message", [
    (Shard(1), (1,), "placement"),
    (Replicate(), (1,), "placement"),
    (Shard(0), (1, 1), "HSDP"),
])
def test_unsupported_dtensor_layouts_name_the_parameter(one_rank_group, placement, mesh_shape,
                                                        message):
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = (placement,) * len(mesh_shape)
    p = dtensor(torch.ones(2, 2), placements, mesh)
    with pytest.raises(ValueError, match=message) as error:
        shardema.EMA([("layer.weight", p)])
    assert "layer.weight" in str(error.value)


def test_plain_parameter_beside_dtensors_is_refused(one_rank_group):
    d = dtensor(torch.ones(2, 2))
    plain = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="plain") as error:
        shardema.EMA([("sharded", d), ("plain", plain)])
    assert "'plain'" in str(error.value)


def test_dtensors_on_two_meshes_need_a_process_group(one_rank_group):
    a = dtensor(torch.ones(2, 2), mesh=DeviceMesh("cpu", [0], mesh_dim_names=("a",)))
    b = dtensor(torch.ones(2, 2), mesh=DeviceMesh("cpu", [0], mesh_dim_names=("b",)))
    with pytest.raises(ValueError, match="process_group"):
        shardema.EMA([("a", a), ("b", b)])


def test_dtensors_with_another_layout_are_refused(one_rank_group):
    d = dtensor(torch.ones(2, 2))
    with pytest.raises(ValueError, match="DTensor"):
        shardema.EMA([("w", d)], layout="replicated")
