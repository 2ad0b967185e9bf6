"""The post-hoc EMA over a model under fully_shard, in one process (a
1-rank Gloo group): PostHocEMA with layout="sharded" gives what it gives
for the same model unsharded, under HSDP too; what the sharded snapshots
cannot hold (the rank-0 layout, a 3-D mesh) is refused naming the tensor;
and DDPPostHocEMACallback's attribute= names a submodule. The multi-process
runs are in test_lightning_posthoc.py and test_posthoc_parallel.py."""
import os
from types import SimpleNamespace

import pytest
import torch

import shardema
from shardema.callbacks import DDPPostHocEMACallback


def model(mesh_shape=None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        names = ("replicate", "shard")[-len(mesh_shape):]  # HSDP wants names
        fully_shard(net, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    return net


def run(net, folder, layout):
    ema = shardema.PostHocEMA(net, sigma_rels=(0.05, 0.1), checkpoint_every_num_steps=3,
                              checkpoint_folder=folder, layout=layout)
    for k in range(1, 8):
        ema.fence()
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.sin(0.3 * k + i + torch.arange(local.numel()))
                            .reshape(local.shape))
        ema.update()
    ema.wait()
    return ema


def test_fully_shard_with_the_sharded_layout_equals_the_plain_model(one_rank_group, tmp_path):
    plain = run(model(), str(tmp_path / "plain"), "rank0")
    sharded = run(model((1,)), str(tmp_path / "sharded"), "sharded")
    assert os.path.isdir(tmp_path / "sharded" / "rank_00000")
    for step in (3, 6):
        want = plain.synthesize(0.07, step=step)
        got = sharded.synthesize(0.07, step=step)
        assert sorted(got) == sorted(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


def test_fully_shard_with_the_rank0_layout_is_refused(one_rank_group, tmp_path):
    with pytest.raises(ValueError, match=r"'0\.weight' is a DTensor.*layout='sharded'"):
        shardema.PostHocEMA(model((1,)), checkpoint_folder=str(tmp_path / "s"))


def test_hsdp_with_one_replica_equals_the_plain_model(one_rank_group, tmp_path):
    """A 1 x 1 (replicate, shard) mesh: the one replica is the first, keeps
    the profiles and writes them (test_posthoc_parallel.py runs 2 x 2)."""
    plain = run(model(), str(tmp_path / "plain"), "rank0")
    hsdp = run(model((1, 1)), str(tmp_path / "hsdp"), "sharded")
    want, got = plain.synthesize(0.07), hsdp.synthesize(0.07)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


def test_a_three_dimensional_mesh_is_refused_in_one_line(one_rank_group, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (1, 1, 1))
    net = torch.nn.Linear(2, 2)
    net.weight = torch.nn.Parameter(distribute_tensor(net.weight.detach(), mesh,
                                                      [Shard(0), Shard(0), Shard(0)]))
    with pytest.raises(ValueError, match=r"^'weight': a 3-D device mesh is not supported"):
        shardema.PostHocEMA(net, layout="sharded", checkpoint_folder=str(tmp_path / "s"))


def test_attribute_names_the_submodule(tmp_path):
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = model()
            self.critic = torch.nn.Linear(2, 1)

    trainer = SimpleNamespace(default_root_dir=str(tmp_path), global_step=0,
                              accumulate_grad_batches=1, is_last_batch=False)
    callback = DDPPostHocEMACallback(checkpoint_every=1, attribute="policy",
                                     checkpoint_folder=str(tmp_path / "s"))
    holder = Holder()
    callback.on_fit_start(trainer, holder)
    trainer.global_step = 1
    callback.on_train_batch_end(trainer, holder, None, None, 0)
    callback._engine.wait()
    written = shardema.read_tensor_file(str(tmp_path / "s" / "0.1.safetensors"))["tensors"]
    assert sorted(written) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert torch.equal(written["0.weight"], holder.policy[0].weight.detach())
    with pytest.raises(ValueError, match="attribute 'critic_head'"):
        DDPPostHocEMACallback(attribute="critic_head",
                              checkpoint_folder=str(tmp_path / "t")).on_fit_start(trainer, holder)
