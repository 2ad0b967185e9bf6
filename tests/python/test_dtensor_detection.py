"""Layout detection of DTensor (FSDP2) parameters with a stand-in that has
exactly the attributes shardema reads (see dtensor_standin.py); the real
DTensor is exercised by bench/gpu/run.sh where torch 2.x is."""
import pytest
import torch

import shardema
from dtensor_standin import Mesh, Replicate, Shard, StandInDTensor


def test_shard0_dtensors_on_one_rank_are_fsdp2():
    local = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    bias = torch.zeros(4)
    mesh = Mesh()
    ema = shardema.EMA([("w", StandInDTensor(local, (4, 3), mesh=mesh)),
                        ("b", StandInDTensor(bias, (4,), mesh=mesh))],
                       schedule=shardema.ConstantSchedule(0.5))
    assert ema.layout == "fsdp2" and ema.world_size == 1
    local.add_(2.0)  # the live local shard changes (an optimizer step)
    ema.update()
    ema.wait()
    full = ema.full_state_dict()
    # first update copies (copy_on_first_update), so the EMA is the new value
    assert torch.equal(full["w"], local)
    assert full["w"].shape == (4, 3)


def test_a_buffer_beside_dtensor_parameters_is_replicated():
    w = StandInDTensor(torch.ones(2, 2), (2, 2))
    running = torch.full((2,), 5.0)
    ema = shardema.EMA([("w", w), ("running", running)])
    assert ema.layout == "fsdp2"
    assert torch.equal(ema.full_state_dict()["running"], running)


@pytest.mark.parametrize("placement, mesh, message", [
    (Shard(1), Mesh(), "placement"),
    (Replicate(), Mesh(), "placement"),
    (Shard(0), Mesh(ndim=2), "HSDP"),
])
def test_unsupported_dtensor_layouts_name_the_parameter(placement, mesh, message):
    p = StandInDTensor(torch.ones(2, 2), (2, 2), placements=(placement,), mesh=mesh)
    with pytest.raises(ValueError, match=message) as error:
        shardema.EMA([("layer.weight", p)])
    assert "layer.weight" in str(error.value)


def test_plain_parameter_beside_dtensors_is_refused():
    d = StandInDTensor(torch.ones(2, 2), (2, 2))
    plain = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="plain") as error:
        shardema.EMA([("sharded", d), ("plain", plain)])
    assert "'plain'" in str(error.value)


def test_dtensors_on_two_meshes_need_a_process_group():
    a = StandInDTensor(torch.ones(2, 2), (2, 2))
    b = StandInDTensor(torch.ones(2, 2), (2, 2))
    with pytest.raises(ValueError, match="process_group"):
        shardema.EMA([("a", a), ("b", b)])


def test_dtensors_with_another_layout_are_refused():
    d = StandInDTensor(torch.ones(2, 2), (2, 2))
    with pytest.raises(ValueError, match="DTensor"):
        shardema.EMA([("w", d)], layout="replicated")
