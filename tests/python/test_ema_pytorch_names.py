"""What ema-pytorch users reach for, in shardema.EMA, run beside
ema_pytorch.EMA itself: get_current_decay, ignore_names / copy_names,
copy_from (copy_params_from_model_to_ema), module() (ema_model), and the
README's table of the two sets of names."""
import inspect
import pathlib
import re

import ema_pytorch
import pytest
import torch

import shardema
import rank_launch

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3),
                               torch.nn.Linear(3, 2)).to(dtype)


def nudge(model, step):
    """A training step's change of every weight, the same for both EMAs."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.7 + step + i)
                   .reshape(p.shape).to(p.dtype))


def side_by_side(settings, **ours):
    """ema_pytorch.EMA and shardema.EMA with the same warmup settings, over
    the same model; ema-pytorch's EMA keeps its own deep copy."""
    model = make_model()
    theirs = ema_pytorch.EMA(model, **settings)
    schedule = shardema.DecaySchedule.warmup(
        inv_gamma=settings["inv_gamma"], power=settings["power"], max_value=settings["beta"],
        update_after_step=settings["update_after_step"], update_every=settings["update_every"])
    return model, theirs, shardema.EMA(model, schedule=schedule, policy="ema_pytorch", **ours)


def their_state(theirs):
    return {k: v.detach().clone() for k, v in theirs.ema_model.state_dict().items()}


SETTINGS = [
    dict(beta=0.99, power=2 / 3, inv_gamma=1.0, update_after_step=3, update_every=1),
    dict(beta=0.9, power=0.75, inv_gamma=2.0, update_after_step=0, update_every=3),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["every_step", "every_3"])
def test_get_current_decay_and_the_ema_match_ema_pytorch(settings):
    model, theirs, ours = side_by_side(settings)
    # The decay ema-pytorch averages with inside each update() call.
    used = []
    original = theirs.get_current_decay
    theirs.get_current_decay = lambda: used.append(original()) or used[-1]
    assert ours.get_current_decay() == original() == 0.0
    for step in range(1, 13):
        next_decay = ours.schedule.decay_at(ours.step + 1)
        due = ours.schedule.is_due_at(ours.step + 1)
        calls = len(used)
        ours.fence()
        nudge(model, step)
        theirs.update()
        assert ours.update() is due
        if len(used) > calls:  # ema-pytorch averaged: the decay we said the next update uses
            assert next_decay == pytest.approx(used[-1], rel=2e-6, abs=1e-7), step
        assert ours.get_current_decay() == pytest.approx(original(), rel=2e-6, abs=1e-7), step
    ours.wait()
    assert ours.step == 12 and len(used) >= 2
    want = their_state(theirs)
    got = ours.full_state_dict()
    assert list(got) == list(want)
    for name in want:  # ema-pytorch averages in float32, so do we
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_ignore_names_prefixes_and_copy_names_as_ema_pytorch():
    settings = dict(beta=0.9, power=1.0, inv_gamma=1.0, update_after_step=0, update_every=1)
    model, theirs, ours = side_by_side(settings, ignore_names=["2.bias"],
                                       ignore_prefixes=["3."], copy_names=["0.bias"])
    theirs.ignore_names = {"2.bias"}
    theirs.ignore_startswith_names = {"3."}
    theirs.param_or_buffer_names_no_ema = {"0.bias"}
    for step in range(1, 6):
        ours.fence()
        nudge(model, step)
        theirs.update()
        ours.update()
    ours.wait()
    got, want = ours.full_state_dict(), their_state(theirs)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    # Left out: not in the EMA at all (ema-pytorch keeps its first copy of them).
    assert list(got) == ["0.weight", "0.bias", "2.weight"]
    assert torch.equal(got["0.bias"], live["0.bias"]) and torch.equal(want["0.bias"],
                                                                      live["0.bias"])
    torch.testing.assert_close(got["0.weight"], want["0.weight"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["2.weight"], want["2.weight"], rtol=1e-5, atol=1e-6)
    assert not torch.equal(got["0.weight"], live["0.weight"])  # averaged
    # swap() and module() leave the names left out at the model's own values.
    view = ours.module()
    with ours.swap(model):
        inside = model.state_dict()
        assert torch.equal(inside["0.weight"], got["0.weight"])  # the EMA swapped in
        for name in ("2.bias", "3.weight", "3.bias"):
            assert torch.equal(inside[name], live[name])
            assert torch.equal(view.state_dict()[name], live[name])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ignore_names=["2.bais"]), ValueError, r"ignore_names: \['2.bais'\]"),
    (dict(copy_names=["nope"]), ValueError, r"copy_names: \['nope'\]"),
    (dict(ignore_prefixes=["4."]), ValueError, r"'4.'"),
    (dict(ignore_names="0.weight"), TypeError, "collection of names"),
    (dict(ignore_names=["0.bias"], copy_names=["0.bias"]), ValueError, "both"),
    (dict(ignore_prefixes=[""]), ValueError, "no tensor"),
])
def test_a_name_that_matches_nothing_is_an_error_naming_it(kwargs, error, match):
    with pytest.raises(error, match=match):
        shardema.EMA(make_model(), **kwargs)


def test_copy_from_is_ema_pytorchs_copy_params_from_model_to_ema():
    settings = dict(beta=0.9, power=1.0, inv_gamma=1.0, update_after_step=0, update_every=1)
    model, theirs, ours = side_by_side(settings)
    for step in range(1, 4):
        ours.fence()
        nudge(model, step)
        theirs.update()
        ours.update()
    ours.fence()
    nudge(model, 4)
    theirs.copy_params_from_model_to_ema()
    ours.copy_from(model)
    assert ours.step == 3  # the schedule goes on
    got, live = ours.full_state_dict(), model.state_dict()
    assert all(torch.equal(got[k], live[k]) for k in live)
    before = {k: v.double() for k, v in live.items()}
    nudge(model, 5)
    theirs.update()
    ours.update()
    decay = ours.schedule.decay_at(4)
    got, want = ours.full_state_dict(), their_state(theirs)
    for name, value in model.state_dict().items():
        reference = decay * before[name] + (1 - decay) * value.double()
        torch.testing.assert_close(got[name].double(), reference, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_copy_from_is_refused_inside_swap_and_with_several_profiles():
    model = make_model()
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.5))
    ema.update()
    with ema.swap(model):
        with pytest.raises(RuntimeError, match="swap"):
            ema.copy_from()
    with pytest.raises(ValueError, match="another model"):
        ema.copy_from(make_model())
    profiles = shardema.EMA(make_model(), schedules=[shardema.DecaySchedule.constant(0.5),
                                                     shardema.DecaySchedule.constant(0.9)])
    with pytest.raises(ValueError, match="keeps 2 profiles"):
        profiles.copy_from()


def test_copy_from_named_tensors_reads_the_tensors_given():
    w = torch.nn.Parameter(torch.ones(3))
    ema = shardema.EMA({"w": w}, schedule=shardema.DecaySchedule.constant(0.5))
    ema.update()
    ema.fence()
    with torch.no_grad():
        w.fill_(7.0)
    ema.copy_from()
    assert torch.equal(ema.full_state_dict()["w"], torch.full((3,), 7.0))


def test_module_is_the_swapped_model_without_touching_it():
    model = make_model(torch.bfloat16)
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.constant(0.8))
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    for step in range(1, 5):
        model(x).square().mean().backward()  # grads the copy must not duplicate
        ema.fence()
        nudge(model, step)
        ema.update()
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    view = ema.module(device="cpu")
    assert view is not model
    assert all(torch.equal(raw[k], v) for k, v in model.state_dict().items())  # untouched
    full = ema.full_state_dict()
    for name, value in view.state_dict().items():
        assert value.dtype == torch.bfloat16  # the model's dtype
        assert torch.equal(value, full[name].to(torch.bfloat16)), name
    assert all(p.grad is None and not p.requires_grad for p in view.parameters())
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad(), ema.swap(model):
        assert torch.equal(view(x), model(x))

    snapshot = {k: v.clone() for k, v in view.state_dict().items()}
    ema.fence()
    nudge(model, 9)
    ema.update()
    assert all(torch.equal(snapshot[k], v) for k, v in view.state_dict().items())  # a snapshot
    into = make_model(torch.bfloat16)
    assert ema.module(into=into) is into
    full = ema.full_state_dict()
    assert all(torch.equal(v, full[k].to(v.dtype)) for k, v in into.state_dict().items())


def test_module_refuses_what_it_cannot_build():
    model = make_model()
    ema = shardema.EMA(model)
    with pytest.raises(TypeError, match="not both"):
        ema.module(device="cpu", into=make_model())
    with pytest.raises(ValueError, match="same structure"):
        ema.module(into=torch.nn.Linear(4, 6))
    with pytest.raises(ValueError, match="named tensors"):
        shardema.EMA({"w": torch.nn.Parameter(torch.ones(2))}).module()


def test_module_and_copy_from_under_ddp_and_fully_shard_on_two_ranks(tmp_path):
    """view_worker.py: DDP (rows gathered) and real FSDP2 (into=, local rows)."""
    ranks = rank_launch.launch("view_worker.py", ["ddp", "fsdp2"], 2, tmp_path, timeout=180)
    assert ranks.codes == [0, 0], ranks.errors


def readme_table():
    """The rows of the README's table of ema-pytorch names: (theirs, ours)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Coming from ema-pytorch"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append((cells[0], cells[1]))
    return rows


def test_the_readme_table_names_what_exists_on_both_sides():
    rows = readme_table()
    assert len(rows) >= 10
    keywords = set(inspect.signature(ema_pytorch.EMA.__init__).parameters)
    ours_keywords = set(inspect.signature(shardema.EMA.__init__).parameters)
    for theirs, ours in rows:
        for name in re.findall(r"`(?:ema\.)?([a-z_]+)", theirs):
            assert hasattr(ema_pytorch.EMA, name) or name in keywords or \
                name in ("ema_model", "step"), f"ema-pytorch has no {name}"
        for name in re.findall(r"`(?:ema\.)?([a-z_]+)", ours):
            assert hasattr(shardema.EMA, name) or name in ours_keywords or \
                hasattr(shardema.DecaySchedule, name), f"shardema.EMA has no {name}"
