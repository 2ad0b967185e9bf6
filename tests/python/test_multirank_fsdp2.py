"""shardema.EMA over torch's real FSDP2 (fully_shard), HSDP, DDP and
DTensors on CPU/Gloo, W = 2, 3 and 4 processes. Every rank checks its EMA
against a float64 EMA of the full tensors it recomputes itself
(fsdp2_worker.py); here: that each scenario ran and passed on every rank,
and what needs several ranks' results (replicas agree, who wrote files).
One launch per world size runs several scenarios."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import shardema

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_launch import assert_passed, launched_once  # noqa: E402

runs = launched_once("fsdp2_worker.py", [(2, ["fully_shard", "partly_sharded", "ddp",
                                              "replicated_dtensor", "batchnorm_buffers",
                                              "ddp_batchnorm"]),
                                         (3, ["fully_shard"]), (4, ["hsdp"])], timeout=150)


@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_ema_equals_float64_reference(runs, world):
    # nested fully_shard (reshard after forward or not), uneven and empty
    # shards, bf16 compute at W = 2, frozen and unfrozen at step 3
    assert_passed(runs(world), "fully_shard")


def test_model_partly_under_fully_shard(runs):
    assert_passed(runs(2), "partly_sharded")


def test_ddp_ema_equals_float64_reference(runs):
    assert_passed(runs(2), "ddp")


def test_replicate_dtensor_beside_shard0(runs):
    assert_passed(runs(2), "replicated_dtensor")


def test_hsdp_replicas_agree_and_only_replica_0_writes(runs):
    out = assert_passed(runs(4), "hsdp")
    results = [torch.load(out / f"hsdp{r}.pt") for r in range(4)]
    # global rank = replica * 2 + shard rank: 0 and 2 are the shard groups' rank 0
    assert [r["replica"] for r in results] == [0, 0, 1, 1]
    for r in range(1, 4):
        for name, value in results[0]["full"].items():
            assert torch.equal(results[r]["full"][name], value), (r, name)
    assert results[1]["rank0"] == {} and results[3]["rank0"] == {}
    assert (out / "export_replica0.safetensors").exists()
    assert (out / "ckpt_replica0" / "manifest.json").exists()
    assert not (out / "export_replica1.safetensors").exists()
    assert not (out / "ckpt_replica1").exists()
    exported = shardema.read_tensor_file(str(out / "export_replica0.safetensors"))["tensors"]
    assert sorted(exported) == sorted(results[0]["full"])
    for name, value in results[0]["full"].items():
        assert torch.equal(exported[name], value), name


@pytest.mark.parametrize("policy", ["versatil", "ema_pytorch"])
@pytest.mark.parametrize("scenario,tag", [("batchnorm_buffers", "bn"), ("ddp_batchnorm", "ddp_bn")])
def test_batchnorm_buffers_each_rank_its_own_rank_0s_for_the_job(runs, scenario, tag, policy,
                                                                 tmp_path):
    """fsdp2_worker.batchnorm_buffers (FSDP2) and ddp_batchnorm (DDP)
    checked each rank's EMA of its own buffers, and that the W = 2 files and
    resumes hold rank 0's. Here one process with no process group loads
    them: the per-rank checkpoint resharded to one rank (`shardema export
    --world-size 1`), the DCP checkpoint, and the offline export; each gives
    rank 0's EMA."""
    import torch.distributed.checkpoint as dcp
    from fsdp2_worker import batchnorm_model
    out = assert_passed(runs(2), scenario)
    saved = torch.load(out / f"{tag}_{policy}.pt")
    schedule = shardema.DecaySchedule.warmup(power=0.75)

    def check(ema, what):
        assert ema.step == saved["step"], what
        got = ema.full_state_dict()
        assert sorted(got) == sorted(saved["full"]), what
        for name, value in saved["full"].items():
            assert torch.equal(got[name], value), f"{what}: '{name}'"

    shardema_cli = os.environ.get("SHARDEMA_CLI")
    if shardema_cli:
        subprocess.run([shardema_cli, "export", "--checkpoint", str(out / f"{tag}_ckpt_{policy}"),
                        "--world-size", "1", "--out", str(tmp_path / "w1")], check=True,
                       capture_output=True, timeout=60)
        ema = shardema.EMA(batchnorm_model(), schedule=schedule, policy=policy)
        ema.load_checkpoint(str(tmp_path / "w1"))
        check(ema, "the checkpoint resharded to one rank")
        subprocess.run([shardema_cli, "export", "--checkpoint", str(out / f"{tag}_ckpt_{policy}"),
                        "--out", str(tmp_path / "offline.safetensors")], check=True,
                       capture_output=True, timeout=60)
        exported = shardema.read_tensor_file(str(tmp_path / "offline.safetensors"))["tensors"]
        assert sorted(exported) == sorted(saved["full"])
        for name, value in saved["full"].items():
            assert torch.equal(exported[name], value), f"offline export: '{name}'"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        ema = shardema.EMA(batchnorm_model(), schedule=schedule, policy=policy)
        state = {"ema": ema.state_dict()}
        dcp.load(state, checkpoint_id=out / f"{tag}_dcp_{policy}")
        ema.load_state_dict(state["ema"])
    check(ema, "the DCP checkpoint")
