"""shardema.callbacks.EMACallback in real Lightning 2.6 Trainers on CPU:
the default strategy (in this process, with lightning and with
pytorch_lightning), DDP on 2 processes and ModelParallelStrategy (FSDP2) on
2 processes, both over Gloo (lightning_worker.py). Each covers gradient
accumulation (2, with a partial window at each epoch's end), a resume from
a checkpoint that must end bit for bit where the uninterrupted run ends
(raw weights and EMA), validation on the EMA with training going on on the
raw weights (checked inside the steps, and against a run without the swap),
and fit then test. The EMA is checked against a float64 recomputation from
the raw weights recorded after every optimizer step, and against
Lightning's own EMAWeightAveraging under DDP."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import lightning_worker as worker  # noqa: E402
import rank_launch  # noqa: E402

PARAMS = ("inp.weight", "inp.bias", "out.weight", "out.bias")
BUFFERS = ("offset", "updates")
WORLD = 2


def warmup_decay(step):
    """VersatIL's default warmup (power 0.75, inv_gamma 1, max 0.9999)."""
    e = step - 1
    return 0.0 if e <= 0 else min(0.9999, 1 - (1 + e) ** -0.75)


def reference_ema(trace, decay, due=lambda step: True, copy_first=False):
    """float64 EMA of the recorded raw weights: from the weights at fit start
    (or a copy at the first due step), parameters lerped at every due
    optimizer step, buffers copied."""
    ema = {k: v.double() for k, v in trace[0][1].items()}
    started = not copy_first
    for step, weights in trace[1:]:
        if not due(step):
            continue
        d = decay(step) if started else 0.0
        started = True
        for k, w in weights.items():
            ema[k] = ema[k] * d + w.double() * (1 - d) if k in PARAMS else w.double()
    return ema


def assert_same(a, b, what):
    assert list(a) == list(b), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: '{k}' differs"


def check_ema_runs(results, steps=worker.EPOCHS * worker.STEPS_PER_EPOCH):
    """The checks of lightning_worker.ema_runs' A, C, D (per rank)."""
    for name in ("A", "C", "D"):
        assert results[name]["problems"] == [], (name, results[name]["problems"])
    a, c, d = results["A"], results["C"], results["D"]
    assert [s for s, _ in a["trace"]] == list(range(steps + 1))  # optimizer steps only
    assert a["global_step"] == c["global_step"] == steps
    expected = reference_ema(a["trace"], warmup_decay)
    assert sorted(a["ema"]) == sorted(PARAMS + BUFFERS)
    for k, v in expected.items():
        torch.testing.assert_close(a["ema"][k].double(), v, rtol=1e-5, atol=1e-6, msg=k)
    assert_same(c["raw"], a["raw"], "resumed raw weights")
    assert_same(c["ema"], a["ema"], "resumed EMA")
    assert_same(d["raw"], a["raw"], "raw weights of the run without the swap")
    assert_same(d["ema"], a["ema"], "EMA of the run without the swap")


def load_results(out, names, world):
    """{name: [rank 0's result, rank 1's, ...]} after checking every rank
    holds the same full tensors."""
    out_by_name = {}
    for name in names:
        ranks = [torch.load(os.path.join(out, f"{name}.rank{r}.pt"), weights_only=False)
                 for r in range(world)]
        for r in range(1, world):
            assert_same(ranks[r]["raw"], ranks[0]["raw"], f"{name}: rank {r}'s raw weights")
            if ranks[0]["ema"] is not None:
                assert_same(ranks[r]["ema"], ranks[0]["ema"], f"{name}: rank {r}'s EMA")
        out_by_name[name] = ranks
    return out_by_name


def launch(scenario, out):
    """Both ranks of `scenario`, created outside Lightning as torchrun does;
    a rank that fails ends the other after a grace period, so a test fails
    instead of hanging. Returns {rank: error text}."""
    return rank_launch.launch("lightning_worker.py", scenario, WORLD, out, timeout=120,
                              torchrun=True, grace=15).errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_device_lightning(tmp_path, dtype):
    L = worker.framework("lightning")
    worker.ema_runs(L, str(tmp_path), dtype=dtype)
    results = {k: v[0] for k, v in load_results(str(tmp_path), "ACD", 1).items()}
    check_ema_runs(results)
    # The checkpoint is deployment-ready: its state_dict holds the EMA of
    # step 4 in the model's dtype.
    saved = torch.load(worker.checkpoint_of_epoch(str(tmp_path), "A", 1), weights_only=False)
    at_4 = reference_ema(results["A"]["trace"][:5], warmup_decay)
    for k in PARAMS:
        torch.testing.assert_close(saved["state_dict"]["policy." + k], at_4[k].to(dtype),
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)
        assert not torch.equal(saved["state_dict"]["policy." + k], results["A"]["trace"][4][1][k])


def test_single_device_pytorch_lightning(tmp_path):
    """A pytorch_lightning user: the callback is a pytorch_lightning Callback
    too, and its Trainer takes it alone (callbacks=EMACallback(...))."""
    import pytorch_lightning
    from shardema.callbacks import DDPPostHocEMACallback, EMACallback
    assert isinstance(EMACallback(), pytorch_lightning.Callback)
    assert isinstance(DDPPostHocEMACallback(), pytorch_lightning.Callback)
    L = worker.framework("pytorch_lightning")
    out = str(tmp_path)
    worker.fit(L, "A", out, callback=EMACallback(attribute="policy"), checkpoints=True)
    worker.fit(L, "C", out, callback=EMACallback(attribute="policy"), pass_one_callback=True,
               resume=worker.checkpoint_of_epoch(out, "A", 1), test=True)
    results = {k: v[0] for k, v in load_results(out, "AC", 1).items()}
    assert results["A"]["problems"] == [] and results["C"]["problems"] == []
    assert_same(results["C"]["raw"], results["A"]["raw"], "resumed raw weights")
    assert_same(results["C"]["ema"], results["A"]["ema"], "resumed EMA")


def test_ddp_two_processes_and_lightning_ema_weight_averaging(tmp_path):
    errors = launch("ddp", tmp_path)
    assert errors == {}, errors
    results = load_results(str(tmp_path), "ACDE", WORLD)
    check_ema_runs({k: v[0] for k, v in results.items()})
    # Lightning's EMAWeightAveraging(decay=0.9, update_every_n_steps=2,
    # update_starting_at_step=1) in the same run copied its average into the
    # model at train end; ours: DecaySchedule.constant(0.9, update_every=2),
    # update_after_step=1, copy_on_first_update=True.
    e = results["E"][0]
    assert [s for s, _ in e["trace"]] == list(range(9))
    due = lambda step: step > 1 and (step - 1) % 2 == 0  # noqa: E731 - steps 3, 5, 7
    expected = reference_ema(e["trace"], lambda step: 0.9, due=due, copy_first=True)
    for k in PARAMS:
        torch.testing.assert_close(e["ema"][k], e["raw"][k], rtol=1e-6, atol=1e-7, msg=k)
        torch.testing.assert_close(e["ema"][k].double(), expected[k], rtol=1e-6, atol=1e-7, msg=k)
        assert not torch.equal(e["ema"][k], e["trace"][-1][1][k])  # not the raw weights


def test_model_parallel_fsdp2_two_processes(tmp_path):
    """FSDP2 with bf16 weights; Lightning saves distributed (DCP)
    checkpoints, each rank its rows."""
    errors = launch("model_parallel", tmp_path)
    assert errors == {}, errors
    results = load_results(str(tmp_path), "ACD", WORLD)
    for r in range(WORLD):
        check_ema_runs({k: v[r] for k, v in results.items()})
    # The raw rows of both ranks and the float32 EMA are in the DCP-saved
    # state_dict; meta.pt, which rank 0 alone writes, holds no tensor of ours.
    from torch.distributed.checkpoint import FileSystemReader
    from shardema.callbacks import EMACallback
    saved = worker.checkpoint_of_epoch(str(tmp_path), "A", 1)
    entries = FileSystemReader(saved).read_metadata().state_dict_metadata
    for prefix in (EMACallback.RAW_STATE_KEY, EMACallback.EMA_FLOAT32_KEY):
        for k in PARAMS:
            chunks = entries[f"state_dict.{prefix}.policy.{k}"].chunks
            assert sorted(c.offsets[0] for c in chunks) == [0, 3 if k.startswith("inp") else 2]
    meta = torch.load(os.path.join(saved, "meta.pt"), weights_only=False)
    assert EMACallback.RAW_STATE_KEY not in meta and EMACallback.EMA_FLOAT32_KEY not in meta
    # Lightning's EMAWeightAveraging beside ours on the same FSDP2 model.
    outcome = torch.load(tmp_path / "F_outcome.rank0.pt")
    assert outcome["error"] is not None and "does not support deepcopy" in outcome["error"], outcome


def test_model_parallel_fsdp2_full_checkpoint(tmp_path):
    """save_distributed_checkpoint=False: rank 0 writes one file holding the
    full tensors; the other ranks' state dicts are empty."""
    errors = launch("model_parallel_full_save", tmp_path)
    assert errors == {}, errors
    results = load_results(str(tmp_path), "ACD", WORLD)
    for r in range(WORLD):
        check_ema_runs({k: v[r] for k, v in results.items()})
