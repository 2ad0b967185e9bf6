"""EMA.state_dict() through torch.distributed.checkpoint: saved beside an
FSDP2 model and its optimizer on W ranks, loaded on another world size
(2 -> 3 -> 2, 2 -> 1, and 2 -> one process with no process group; the
engine's own checkpoint too, once resharded to one rank) with no conversion
step, the EMA exactly as saved,
then one more step checked against a float64 recomputation; a checkpoint
without an EMA cold-starts it; the EMA stays fp32 for a bf16 model."""
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardema

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dcp_worker as worker  # noqa: E402
import rank_launch  # noqa: E402


def launch(scenario, world, out, checkpoint=None, timeout=150):
    """Runs `scenario` on `world` ranks; fails the test on a hang or an
    error, else returns what rank 0 saved."""
    ranks = rank_launch.launch("dcp_worker.py", scenario, world, out, timeout=timeout,
                               args=[checkpoint] if checkpoint else [])
    assert ranks.codes == [0] * world, ranks.errors
    return torch.load(os.path.join(out, "saved.pt" if scenario == "save" else "loaded.pt"))


def warmup_decay(step):
    """DecaySchedule.warmup()'s decay, written out: 1 - (1 + e) ** -0.75
    with e = step - 1, 0 while e <= 0, at most 0.9999."""
    e = step - 1
    return 0.0 if e <= 0 else min(1 - (1 + e) ** -0.75, 0.9999)


def assert_same(got, expected):
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert torch.equal(got[name], expected[name]), name


def assert_resumed(saved, run):
    """`run` loaded the EMA exactly as saved and then folded one step in as
    the float64 recomputation from its weights says; the EMAs of the model
    without FSDP changed layout (replicated <-> rank 0) and are as saved."""
    saved_ema, saved_step = saved["ema"], saved["step"]
    assert_same(run["plain"][0], saved["plain"][0])
    assert_same(run["plain"][1], saved["plain"][1])
    assert run["loaded_step"] == saved_step
    assert_same(run["loaded"], saved_ema)
    assert run["step"] == saved_step + 1
    decay = warmup_decay(run["step"])
    for name, ema in run["ema"].items():
        weight = run["weights"][name]
        if not ema.is_floating_point():
            assert torch.equal(ema, weight), name
            continue
        assert ema.dtype == torch.float32, name
        w = weight.double()
        expected = w if name.startswith(worker.COPIED_PREFIX) else \
            decay * saved_ema[name].double() + (1 - decay) * w
        torch.testing.assert_close(ema.double(), expected, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    out = tmp_path_factory.mktemp("w2")
    return out, launch("save", 2, out)


def test_the_checkpoint_holds_fp32_ema_rows_beside_bf16_weights(saved_at_2):
    out, saved = saved_at_2
    entries = dcp.FileSystemReader(str(out / "ckpt")).read_metadata().state_dict_metadata
    assert entries["model.0.weight"].properties.dtype == torch.bfloat16
    assert entries["ema.weights.0.weight"].properties.dtype == torch.float32
    # Each rank wrote its own rows: nothing was gathered to save.
    assert [c.sizes for c in entries["ema.weights.0.weight"].chunks] == \
        [torch.Size([3, 4]), torch.Size([2, 4])]
    assert entries["ema.progress.step"] is not None
    assert saved["step"] == worker.STEPS
    # The replicated EMA wrote its rows per rank, the rank-0 one all from rank 0.
    assert len(entries["plain_0.weights.0.weight"].chunks) == 2
    assert len(entries["plain_1.weights.0.weight"].chunks) == 1
    assert_same(saved["plain"][0], saved["plain"][1])
    assert all(t.dtype == torch.float32 for n, t in saved["ema"].items() if t.is_floating_point())
    assert not any(k.startswith("ema.") for k in
                   dcp.FileSystemReader(str(out / "model_only")).read_metadata()
                   .state_dict_metadata)


def test_2_to_3_to_2_resumes_and_cold_starts_without_an_ema(saved_at_2, tmp_path):
    out, saved = saved_at_2
    at_3 = launch("cold", 3, tmp_path / "w3", out / "ckpt")
    assert_resumed(saved, at_3)
    # Without EMALoadPlanner a checkpoint without the EMA is refused, naming it.
    assert "Missing key in checkpoint state_dict: ema." in at_3["refused"]
    # With it: the loaded weights (the saved model's), step 0, one warning.
    assert at_3["cold_warnings"] and len(at_3["cold_warnings"]) == 1
    assert at_3["cold_step"] == 0
    assert_same(at_3["cold_weights"], saved["weights"])
    expected = {n: w.float() if w.is_floating_point() else w for n, w in saved["weights"].items()}
    assert_same(at_3["cold_ema"], expected)
    back_at_2 = launch("load", 2, tmp_path / "w2", tmp_path / "w3" / "ckpt")
    assert_resumed(at_3, back_at_2)


def test_2_to_1_resumes(saved_at_2, tmp_path):
    out, saved = saved_at_2
    assert_resumed(saved, launch("load", 1, tmp_path, out / "ckpt"))


# --- W = 2 FSDP2 to one process with no process group --------------------------

def assert_is_the_w2_ema(ema, saved):
    """`ema` holds exactly the EMA the W = 2 FSDP2 run gathered with
    full_state_dict(), at its step."""
    assert ema.step == saved["step"]
    assert_same(ema.full_state_dict(), saved["ema"])


def test_one_process_without_a_process_group_loads_the_w2_dcp_checkpoint(saved_at_2):
    """dcp.load with no process group at all (DCP reads every rank's rows
    in one process) into the EMA of the same model, not sharded; the EMA
    as a Stateful in DCP's dict and its state_dict() both."""
    import torch.distributed as dist
    out, saved = saved_at_2
    assert not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        ema = shardema.EMA(worker.plain_model(7), policy="versatil")
        state = {"ema": ema.state_dict()}
        dcp.load(state, checkpoint_id=out / "ckpt")
        ema.load_state_dict(state["ema"])
        assert_is_the_w2_ema(ema, saved)
        stateful = shardema.EMA(worker.plain_model(8), policy="versatil")
        dcp.load({"ema": stateful}, checkpoint_id=out / "ckpt")
        assert_is_the_w2_ema(stateful, saved)
    assert ema.layout == "single" and not dist.is_initialized()


def test_one_process_loads_the_w2_checkpoint_resharded_to_one_rank(saved_at_2, tmp_path):
    """save_checkpoint() on 2 FSDP2 ranks; the refusal of a one-process load
    says `shardema export --world-size 1`; what that writes loads. Once
    refused again: "laid out as fsdp2 in the checkpoint but replicated
    here"."""
    out, saved = saved_at_2
    shardema_cli = os.environ.get("SHARDEMA_CLI")
    if not shardema_cli:
        pytest.skip("SHARDEMA_CLI is not set: the build has no shardema CLI (tools off)")
    ema = shardema.EMA(worker.plain_model(7), policy="versatil")
    with pytest.raises(ValueError, match="--world-size 1"):
        ema.load_checkpoint(str(out / "engine"))
    assert ema.step == 0
    subprocess.run([shardema_cli, "export", "--checkpoint", str(out / "engine"), "--world-size",
                    "1", "--out", str(tmp_path / "w1")], check=True, capture_output=True,
                   timeout=60)
    ema.load_checkpoint(str(tmp_path / "w1"))
    assert_is_the_w2_ema(ema, saved)


# --- one process: plain tensors, the same structure -----------------------------

def bf16_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4).to(torch.bfloat16), torch.nn.BatchNorm1d(4))


def trained(model, steps=3):
    ema = shardema.EMA(model)
    for step in range(1, steps + 1):
        ema.fence()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.cos(torch.arange(p.numel(), dtype=torch.float64) * step)
                       .reshape(p.shape).to(p.dtype))
        ema.update()
    ema.wait()
    return ema


def test_one_process_state_dict_is_fp32_full_tensors_and_plain_progress():
    model = bf16_model()
    ema = trained(model)
    state = ema.state_dict()
    assert set(state) == {"weights", "progress"}
    weights, progress = state["weights"], state["progress"]
    assert_same(weights, ema.full_state_dict())  # full tensors, fp32 where averaged
    assert weights["0.weight"].dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    assert weights["1.num_batches_tracked"].dtype == torch.int64
    assert progress["step"] == 3 and progress["initialized"] is True
    assert progress["last_decay"] == ema.last_decay
    assert shardema.DecaySchedule.from_json(progress["schedule"]) == shardema.DecaySchedule.warmup()
    # Fresh tensors: DCP loads into them; the EMA changes only through load_state_dict.
    weights["0.weight"].fill_(7.0)
    assert not torch.equal(ema.full_state_dict()["0.weight"], weights["0.weight"])


def test_state_dict_is_the_ema_at_the_call_in_fresh_copies():
    """What docs/python.md says of dcp.async_save rests on this: updates
    after state_dict() do not change its tensors (the update in flight is
    finished first), and writing into them does not change the EMA (test
    below: fresh copies both ways)."""
    model = bf16_model()
    ema = trained(model)
    ema.fence()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update()  # in flight while state_dict() runs
    state = ema.state_dict()
    at_the_call = ema.full_state_dict()
    assert_same(state["weights"], at_the_call)
    kept = {name: t.clone() for name, t in state["weights"].items()}
    for step in range(3):
        ema.fence()
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ema.update()
    ema.wait()
    assert not torch.equal(ema.full_state_dict()["0.weight"], kept["0.weight"])
    assert_same(state["weights"], kept)
    assert state["progress"]["step"] == 4


def test_one_process_dcp_round_trip_and_cold_start(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model = bf16_model()
        ema = trained(model)
        dcp.save({"model": model.state_dict(), "ema": ema.state_dict()},
                 checkpoint_id=tmp_path / "a")
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "b")
        other_model = bf16_model(seed=1)
        other = shardema.EMA(other_model)
        dcp.load({"model": other_model.state_dict(), "ema": other}, checkpoint_id=tmp_path / "a")
        assert other.step == 3 and other.last_decay == ema.last_decay
        assert_same(other.full_state_dict(), ema.full_state_dict())
        cold_model = bf16_model(seed=2)
        cold = trained(cold_model, steps=2)
        state = {"model": cold_model.state_dict(), "ema": cold.state_dict()}
        with pytest.warns(UserWarning, match="holds no EMA") as caught:
            dcp.load(state, checkpoint_id=tmp_path / "b", planner=shardema.EMALoadPlanner())
            cold.load_state_dict(state["ema"])
    assert len([w for w in caught if "holds no EMA" in str(w.message)]) == 1
    assert cold.step == 0
    expected = {n: t.float() if t.is_floating_point() else t for n, t in model.state_dict().items()}
    assert_same(cold.full_state_dict(), expected)


def test_an_older_state_dict_still_loads():
    """What state_dict() returned before DCP support (this rank's pieces and
    the engine's metadata), e.g. in a torch.save file: same world only."""
    ema = trained(bf16_model())
    older = ema._engine.state_dict()
    assert set(older) == {"tensors", "metadata"}
    other = shardema.EMA(bf16_model(seed=1))
    other.load_state_dict(older)
    assert other.step == 3
    assert_same(other.full_state_dict(), ema.full_state_dict())


@pytest.mark.parametrize("change, message", [
    (lambda s: s["weights"].pop("0.bias"), "tensor '0.bias' is tracked here but not in the state"),
    (lambda s: s["weights"].update(extra=torch.zeros(1)),
     "tensor 'extra' is in the state but not tracked here"),
    (lambda s: s["weights"].update({"0.weight": torch.zeros(3, 4)}),
     r"tensor '0.weight' has shape \(3, 4\) in the state but \(4, 3\) here"),
    (lambda s: s["progress"].update(format="other/9"), "format 'other/9'"),
    (lambda s: s["progress"].update(step="3"), "progress 'step' is '3', expected int"),
    (lambda s: s.pop("progress"), r"got the keys \['weights'\]"),
], ids=["missing", "unexpected", "shape", "format", "step type", "no progress"])
def test_a_state_that_does_not_fit_is_refused_naming_what(change, message):
    ema = trained(bf16_model())
    before = ema.full_state_dict()
    state = ema.state_dict()
    change(state)
    with pytest.raises(ValueError, match=message):
        ema.load_state_dict(state)
    assert_same(ema.full_state_dict(), before)
    assert ema.step == 3


def test_the_decay_formula_here_is_the_schedule():
    """warmup_decay() above is the reference of the resumed step: it must be
    the default schedule's, or the comparisons would test nothing."""
    schedule = shardema.DecaySchedule.warmup()
    for step in (1, 2, 4, 5, 40):
        assert math.isclose(warmup_decay(step), schedule.decay_at(step), rel_tol=1e-15)
