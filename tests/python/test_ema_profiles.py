"""Several EMAs of one model from one read of its weights (EMA(schedules=
[...]), beta=[...], decay=[...]): each profile against the real
ema-pytorch (one EMA object per beta, in the same test) and a float64
recomputation; every read API's profile=; the state (state_dict, DCP,
save_checkpoint) of every profile round-trips and resumes bit for bit, and
a state of another number of profiles or other schedules is refused
naming them, the EMA left as it was."""
import copy
import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

import shardema
from shardema import DecaySchedule

ema_pytorch = pytest.importorskip("ema_pytorch")

# Small enough that the warmup (1 - (1 + e)^(-2/3)) passes them within the
# run: each profile its own EMA.
BETAS = [0.5, 0.7, 0.9]


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5),
                               torch.nn.Linear(5, 3))


def train(model, emas, steps, seed=1):
    """SGD steps on `model`, each followed by update() of every EMA given
    (shardema's or ema-pytorch's)."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for ema in emas:
            ema.update()


def mixed():
    return [DecaySchedule.constant(0.9), DecaySchedule.warmup(power=0.75, max_value=0.999),
            DecaySchedule.power_function(sigma_rel=0.1)]


def float64_emas(model, schedules, steps, seed=1):
    """Each schedule's EMA of the same run, in float64: the first update
    copies, then ema = d * ema + (1 - d) * w with d the schedule's decay."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    emas = [None] * len(schedules)
    for step in range(1, steps + 1):
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        weights = {n: t.detach().double() for n, t in model.state_dict().items()
                   if t.is_floating_point()}
        for p, schedule in enumerate(schedules):
            if emas[p] is None:
                emas[p] = dict(weights)
                continue
            d = schedule.decay_at(step)
            emas[p] = {n: d * emas[p][n] + (1 - d) * w for n, w in weights.items()}
    return emas


def test_beta_list_matches_one_ema_pytorch_per_beta_and_float64():
    model = small_model()
    ours = shardema.EMA(model, beta=BETAS, update_after_step=2, update_every=1)
    theirs = [ema_pytorch.EMA(model, beta=b, update_after_step=2, update_every=1,
                              allow_different_devices=True) for b in BETAS]
    reference_model = copy.deepcopy(model)
    train(model, [ours, *theirs], steps=20)
    expected = float64_emas(reference_model, ours.schedules, 20)
    assert len(ours.schedules) == 3
    for p, their in enumerate(theirs):
        got = ours.full_state_dict(profile=p)
        assert ours.get_current_decay(profile=p) == pytest.approx(their.get_current_decay(),
                                                                  abs=1e-6)
        for name, tensor in their.ema_model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            torch.testing.assert_close(got[name], tensor.float(), rtol=0, atol=2e-6,
                                       msg=f"{name} profile {p}")
            torch.testing.assert_close(got[name].double(), expected[p][name], rtol=0, atol=2e-6)
    # The profiles are different EMAs.
    assert not torch.equal(ours.full_state_dict(profile=0)["0.weight"],
                           ours.full_state_dict(profile=2)["0.weight"])


def test_every_read_api_takes_the_profile():
    model = small_model()
    ema = shardema.EMA(model, schedules=mixed())
    reference_model = copy.deepcopy(model)
    train(model, [ema], steps=9)
    expected = float64_emas(reference_model, mixed(), 9)
    raw = {n: t.clone() for n, t in model.state_dict().items()}
    for p in range(3):
        full = ema.full_state_dict(profile=p)
        for name, value in expected[p].items():
            torch.testing.assert_close(full[name].double(), value, rtol=0, atol=2e-6)
        tensors = ema.ema_tensors(profile=p)
        assert all(torch.equal(tensors[n], full[n]) for n in full)
        local = ema.local_ema(profile=p)
        assert all(torch.equal(local[n], full[n].reshape(-1)) for n in full)
        with ema.swap(profile=p):
            inside = {n: t.clone() for n, t in model.state_dict().items()}
        for name in full:
            assert torch.equal(inside[name], full[name].to(inside[name].dtype)), name
            assert torch.equal(model.state_dict()[name], raw[name])  # raw weights back
        view = ema.module(profile=p)
        assert all(torch.equal(view.state_dict()[n], inside[n]) for n in full)
        assert ema.get_current_decay(profile=p) == mixed()[p].decay_at(9)
    ema.swap_in(profile=1)
    assert torch.equal(model[0].weight, ema.full_state_dict(profile=1)["0.weight"])
    ema.swap_out()
    ema.copy_to(profile=2)
    full = ema.full_state_dict(profile=2)
    assert all(torch.equal(model.state_dict()[n], full[n]) for n in full if
               model.state_dict()[n].is_floating_point())


def test_export_weights_writes_the_profile_asked_for(tmp_path):
    model = small_model()
    ema = shardema.EMA(model, decay=[0.5, 0.95])
    train(model, [ema], steps=5)
    for p in range(2):
        path = tmp_path / f"p{p}.safetensors"
        ema.export_weights(path, profile=p)
        written = load_file(str(path))
        full = ema.full_state_dict(profile=p)
        assert all(torch.equal(written[n], full[n]) for n in full)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "p1.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["shardema.schedule"])["decay"] == 0.95


@pytest.mark.parametrize("bad, kind", [(2, IndexError), (-1, IndexError), (True, TypeError),
                                       ("1", TypeError), (1.0, TypeError)])
def test_a_bad_profile_names_profile_and_the_count(bad, kind):
    model = small_model()
    ema = shardema.EMA(model, beta=[0.9, 0.99])
    ema.update()
    # Each message names the call the user made (swap(), not the swap_in() inside it).
    for api, call in (("full_state_dict", lambda: ema.full_state_dict(profile=bad)),
                      ("swap", lambda: ema.swap(profile=bad).__enter__()),
                      ("swap_in", lambda: ema.swap_in(profile=bad)),
                      ("copy_to", lambda: ema.copy_to(profile=bad)),
                      ("module", lambda: ema.module(profile=bad)),
                      ("ema_tensors", lambda: ema.ema_tensors(profile=bad)),
                      ("get_current_decay", lambda: ema.get_current_decay(bad)),
                      ("export_weights", lambda: ema.export_weights("/nonexistent/x",
                                                                    profile=bad))):
        with pytest.raises(kind, match=f"^shardema.EMA.{api}: profile") as caught:
            call()
        if kind is IndexError:
            assert "keeps 2 profiles" in str(caught.value)
    assert not ema.swapped
    ema.update()  # still usable


@pytest.mark.parametrize("kwargs, kind, message", [
    (dict(schedule=DecaySchedule.constant(0.9), schedules=[DecaySchedule.constant(0.9)]),
     ValueError, "schedules= and schedule"),
    (dict(beta=0.9, schedules=[DecaySchedule.constant(0.9)]), ValueError, "schedules= and beta"),
    (dict(schedules=DecaySchedule.constant(0.9)), TypeError, "list of DecaySchedule"),
    (dict(schedules=[DecaySchedule.constant(0.9), 0.99]), TypeError, r"schedules\[1\]"),
    (dict(schedules=[]), ValueError, "no profile"),
    (dict(beta=[]), ValueError, "no profile"),
    (dict(beta=[0.9, 1.5]), ValueError, "beta"),
    (dict(power=[0.5, 0.7]), TypeError, "only beta="),
    (dict(schedules=[DecaySchedule.constant(0.9),
                     DecaySchedule.constant(0.9, update_every=2)]), ValueError, "update_every"),
    (dict(schedules=[DecaySchedule.constant(0.9)] * 17), ValueError, "at most 16"),
    (dict(more_schedules=[DecaySchedule.constant(0.9)]), TypeError, "more_schedules"),
])
def test_bad_profile_arguments_are_refused_by_name(kwargs, kind, message):
    with pytest.raises(kind, match=message):
        shardema.EMA(small_model(), **kwargs)


def assert_same_profiles(a, b, count):
    for p in range(count):
        fa, fb = a.full_state_dict(profile=p), b.full_state_dict(profile=p)
        assert list(fa) == list(fb)
        assert all(torch.equal(fa[n], fb[n]) for n in fa), p


def resumed_pair(restore):
    """An EMA of 3 profiles trained 6 steps and then 4 more, and one built
    anew, restored by `restore(saved_ema, new_ema)` after 6 steps and
    trained the same 4: both as returned, the same run."""
    model = small_model()
    ema = shardema.EMA(model, schedules=mixed())
    train(model, [ema], steps=6)
    twin_model = copy.deepcopy(model)
    twin = shardema.EMA(twin_model, schedules=mixed())
    restore(ema, twin)
    assert twin.step == ema.step
    assert_same_profiles(ema, twin, 3)
    train(model, [ema], steps=4, seed=5)
    train(twin_model, [twin], steps=4, seed=5)
    return ema, twin


def test_state_dict_resumes_every_profile_bit_exact(tmp_path):
    def restore(ema, twin):
        torch.save(ema.state_dict(), tmp_path / "ema.pt")
        twin.load_state_dict(torch.load(tmp_path / "ema.pt"))
    ema, twin = resumed_pair(restore)
    assert_same_profiles(ema, twin, 3)
    assert set(ema.state_dict()) == {"weights", "profile_weights", "progress"}


def test_checkpoint_resumes_every_profile_bit_exact(tmp_path):
    def restore(ema, twin):
        ema.save_checkpoint(tmp_path / "ckpt")
        twin.load_checkpoint(tmp_path / "ckpt")
    ema, twin = resumed_pair(restore)
    assert_same_profiles(ema, twin, 3)


def test_dcp_resumes_every_profile_bit_exact(tmp_path):
    def restore(ema, twin):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"ema": ema.state_dict()}, checkpoint_id=tmp_path / "dcp")
            dcp.load({"ema": twin}, checkpoint_id=tmp_path / "dcp",
                     planner=shardema.EMALoadPlanner())
    ema, twin = resumed_pair(restore)
    assert_same_profiles(ema, twin, 3)


def test_copies_and_pickles_keep_every_profile():
    model = small_model()
    ema = shardema.EMA(model, beta=[0.9, 0.99])
    train(model, [ema], steps=4)
    twin = copy.deepcopy(ema)
    assert len(twin.schedules) == 2
    assert_same_profiles(ema, twin, 2)


def test_another_number_of_profiles_or_schedules_is_refused(tmp_path):
    model = small_model()
    ema = shardema.EMA(model, schedules=mixed())
    train(model, [ema], steps=3)
    ema.save_checkpoint(tmp_path / "ckpt")
    state = ema.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"ema": state}, checkpoint_id=tmp_path / "dcp")
    others = {"two": mixed()[:2], "reordered": [mixed()[0], mixed()[2], mixed()[1]],
              "one": mixed()[:1]}
    for what, schedules in others.items():
        other = shardema.EMA(small_model(seed=3), schedules=schedules)
        other.update()
        before = [other.full_state_dict(profile=p) for p in range(len(schedules))]
        message = "profile 1 was saved with schedule" if what == "reordered" else \
            "holds 3 profiles"
        with pytest.raises(ValueError, match=message):
            other.load_checkpoint(tmp_path / "ckpt")
        with pytest.raises(ValueError, match=message if what == "reordered" else "3 profile"):
            other.load_state_dict(state)
        # DCP wraps what its planner raises (EMALoadPlanner refuses the count
        # before reading); the EMA's own load refuses other schedules.
        with pytest.raises((ValueError, CheckpointException),
                           match="3 profile" if what != "reordered" else message):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                target = {"ema": other.state_dict()}
                dcp.load(target, checkpoint_id=tmp_path / "dcp",
                         planner=shardema.EMALoadPlanner())
                other.load_state_dict(target["ema"])
        for p in range(len(schedules)):  # nothing loaded
            after = other.full_state_dict(profile=p)
            assert all(torch.equal(after[n], before[p][n]) for n in after)
        other.update()


def test_a_one_profile_ema_is_unchanged():
    model = small_model()
    ema = shardema.EMA(model, beta=0.99)
    train(model, [ema], steps=3)
    assert len(ema.schedules) == 1
    assert set(ema.state_dict()) == {"weights", "progress"}
    assert "profiles" not in ema.state_dict()["progress"]
