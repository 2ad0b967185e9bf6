"""shardema.EMA over W = 1, 2, 3 processes on Gloo (loopback), each started
here with a timeout: a replicated (DDP) model, FSDP2-style local rows and
torch's fully_shard.
The union of the ranks' EMAs equals the single-process EMA bit for bit."""
import os
import sys
import time

import pytest
import torch

import shardema

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import multirank_worker as worker  # noqa: E402
import rank_launch  # noqa: E402


def launch(scenario, world, out, timeout=120, env=None):
    """Starts `world` ranks of multirank_worker.py; their exit codes and error texts."""
    ranks = rank_launch.launch("multirank_worker.py", scenario, world, out, timeout=timeout,
                               env=env)
    return ranks.codes, ranks.errors


def single_process_ema():
    model = worker.make_model()
    ema = shardema.EMA(model, schedule=worker.schedule())
    for step in range(1, worker.STEPS + 1):
        ema.fence()
        worker.train_step(model, step)
        ema.update()
    ema.wait()
    return ema.full_state_dict()


def assert_union_is(full, locals_by_rank, world):
    """The ranks' pieces, in rank order, are the full EMA; except a buffer
    that every rank keeps whole (its own: the ranks' are equal here), as
    shardema.EMA does of a model's buffers (from_local_shards: as given)."""
    buffers = {name for name, _ in worker.make_model().named_buffers()}
    for name, tensor in full.items():
        whole = all(local[name].numel() == tensor.numel() for local in locals_by_rank)
        if name in buffers and whole:
            for r in range(world):
                assert torch.equal(locals_by_rank[r][name].reshape(-1), tensor.reshape(-1)), \
                    (r, name)
            continue
        pieces = [locals_by_rank[r][name].reshape(-1) for r in range(world)]
        assert torch.equal(torch.cat(pieces), tensor.reshape(-1)), name


def run_and_compare(scenario, world, tmp_path):
    """Runs `scenario` on `world` ranks, checks that the union of their EMAs
    is the single-process EMA bit for bit; returns (expected, per-rank results)."""
    codes, errors = launch(scenario, world, tmp_path)
    assert codes == [0] * world, errors
    expected = single_process_ema()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert_union_is(expected, [r["local"] for r in results], world)
    return expected, results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_replicated_model_union_equals_single_process(world, tmp_path):
    expected, results = run_and_compare("replicated", world, tmp_path)
    exported = shardema.read_tensor_file(str(tmp_path / "export.safetensors"))["tensors"]
    for r, result in enumerate(results):
        for name, tensor in expected.items():
            assert torch.equal(result["full_all"][name], tensor), (r, name)
            # the swap put the gathered EMA into every rank's whole model
            assert torch.equal(result["swapped"][name].to(tensor.dtype), tensor), (r, name)
        assert (result["full_rank0"] == {}) == (r != 0)
    assert list(exported) == list(expected)
    assert all(torch.equal(exported[k], results[0]["full_rank0"][k]) for k in expected)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_rows_union_equals_single_process(world, tmp_path):
    expected, results = run_and_compare("rows", world, tmp_path)
    assert all(torch.equal(results[0]["full"][k], v) for k, v in expected.items())


@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_model_union_equals_single_process(world, tmp_path):
    # torch's fully_shard: parameters fsdp2 rows, whose union is the full
    # EMA bit for bit; buffers whole on every rank (each its own).
    expected, results = run_and_compare("dtensor", world, tmp_path)
    assert all(torch.equal(results[0]["full"][k], v) for k, v in expected.items())


def test_checkpoint_of_three_ranks_on_two_points_to_reshard(tmp_path):
    codes, errors = launch("rows_save", 3, tmp_path)
    assert codes == [0] * 3, errors
    load_dir = tmp_path / "load"
    load_dir.mkdir()
    codes, errors = launch("rows_load", 2, load_dir,
                           env={"SHARDEMA_TEST_CHECKPOINT": str(tmp_path / "ckpt")})
    assert codes == [3, 3]
    for r in (0, 1):
        assert errors[r].startswith("ValueError"), errors[r]
        assert "reshard" in errors[r], errors[r]


def test_rank_that_raises_before_a_collective_fails_the_others_in_time(tmp_path):
    start = time.monotonic()
    codes, errors = launch("rank_raises", 3, tmp_path, timeout=90)
    assert codes == [3, 3, 3], errors
    assert "rank 1 fails" in errors[1]
    for r in (0, 2):
        assert errors[r].startswith("RuntimeError"), errors[r]
    assert time.monotonic() - start < 90
    assert not os.path.exists(tmp_path / "ckpt" / "manifest.json")


def test_a_swap_whose_gather_fails_leaves_the_model_as_it_was(tmp_path):
    codes, errors = launch("swap_rank_raises", 2, tmp_path, timeout=60)
    assert codes[1] == 3 and "rank 1 fails" in errors[1], errors
    assert codes[0] == 0, errors
    result = torch.load(tmp_path / "rank0.pt")
    assert result["error"] is not None, "the gather without rank 1 should have failed"
    for name, value in result["before"].items():
        assert torch.equal(result["after"][name], value), name


@pytest.mark.parametrize("world", [2, 3])
def test_emacallback_checkpoint_of_an_fsdp2_model_keeps_the_ema_sharded(world, tmp_path):
    # torch's fully_shard and its sharded state dict; the checks are in the worker.
    codes, errors = launch("dtensor_checkpoint", world, tmp_path)
    assert codes == [0] * world, errors
