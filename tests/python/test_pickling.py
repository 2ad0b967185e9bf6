"""Pickling and deep copies: what Lightning's ddp_spawn does to the
callbacks (it pickles them, with the module, to send them to the processes
it spawns), and what users do to an EMA (copy.deepcopy of a module that
holds one, pickle for multiprocessing).

- DecaySchedule: pickle, copy and deepcopy through its JSON form, equal
  after the round trip and giving the same decay at every step.
- EMACallback and DDPPostHocEMACallback before fit: pickle and deepcopy
  give an equal, independent callback.
- A real Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu") fit
  with each callback (spawn_worker.py): the EMA against a float64 EMA of
  the raw weights recorded after every optimizer step.
- shardema.EMA: deepcopy gives an independent EMA over a deep copy of its
  model, with equal EMA values and progress; pickle carries the same,
  with the model pickled beside it; under a process group a TypeError
  naming it (the EMA belongs to its ranks)."""
import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import spawn_worker as worker  # noqa: E402
from conftest import python_for_workers  # noqa: E402
from test_lightning_posthoc import reference_profiles  # noqa: E402

import shardema  # noqa: E402
from shardema.callbacks import DDPPostHocEMACallback, EMACallback  # noqa: E402

PARAMS = ("inp.weight", "inp.bias", "out.weight", "out.bias")
BUFFERS = ("offset", "updates")

# --- DecaySchedule -------------------------------------------------------------
SCHEDULES = [
    shardema.DecaySchedule.warmup(inv_gamma=3.0, power=2 / 3, min_value=0.1, max_value=0.999,
                                  update_after_step=7, update_every=3),
    shardema.DecaySchedule.constant(1 - 1 / 3, update_every=2),
    shardema.DecaySchedule.power_function(sigma_rel=0.1, update_every=4,
                                          step_size_correction=True),
    shardema.DecaySchedule.power_function(gamma=6.94, convention="edm2"),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.kind)
@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_decay_schedule_round_trips(schedule, how):
    protocols = range(pickle.HIGHEST_PROTOCOL + 1)
    copies = ([pickle.loads(pickle.dumps(schedule, protocol=p)) for p in protocols]
              if how == "pickle" else [getattr(copy, how)(schedule)])
    for other in copies:
        assert type(other) is shardema.DecaySchedule
        assert other is not schedule
        assert other == schedule and not other != schedule
        assert repr(other) == repr(schedule)
        assert other.update_every == schedule.update_every
        # The same function of the step, bit for bit (float64 compares exactly).
        for step in range(1, 200):
            assert other.decay_at(step) == schedule.decay_at(step), step
            assert other.is_due_at(step) == schedule.is_due_at(step), step


def test_a_decay_schedule_inside_a_container_pickles():
    payload = {"schedules": SCHEDULES, "same": SCHEDULES[0]}
    back = pickle.loads(pickle.dumps(payload))
    assert back["schedules"] == SCHEDULES
    assert back["same"] == SCHEDULES[0]


# --- the callbacks before fit --------------------------------------------------
def _callbacks(tmp_path):
    return [
        EMACallback(power=2 / 3, update_after_step=3, attribute="policy"),
        EMACallback(schedule=shardema.DecaySchedule.constant(0.99, update_every=2),
                    copy_on_first_update=True),
        DDPPostHocEMACallback(sigma_rels=(0.05, 0.2), checkpoint_every=7,
                              checkpoint_folder=str(tmp_path / "posthoc"), attribute="policy"),
    ]


def _public_state(callback):
    """What a callback was configured with: its attributes, schedules by
    value (a DecaySchedule compares by value)."""
    return {k: v for k, v in vars(callback).items()}


@pytest.mark.parametrize("index", [0, 1, 2], ids=["ema", "ema_schedule", "posthoc"])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_callbacks_copy_before_fit(tmp_path, index, how):
    callback = _callbacks(tmp_path)[index]
    other = pickle.loads(pickle.dumps(callback)) if how == "pickle" else copy.deepcopy(callback)
    assert type(other) is type(callback) and other is not callback
    mine, theirs = _public_state(callback), _public_state(other)
    assert sorted(mine) == sorted(theirs)
    for key, value in mine.items():
        assert theirs[key] == value, key
    # Independent: changing the copy leaves the original alone.
    other.attribute = "elsewhere"
    assert callback.attribute != "elsewhere"


# --- ddp_spawn ----------------------------------------------------------------
def _spawn_fit(kind, out):
    result = subprocess.run([python_for_workers(), os.path.join(HERE, "spawn_worker.py"), kind,
                             str(out)], capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(out / f"{kind}.rank{r}.pt", weights_only=False)
             for r in range(worker.WORLD)]
    steps = worker.EPOCHS * worker.BATCHES_PER_EPOCH
    for rank in ranks:
        assert rank["global_step"] == steps
        assert [s for s, _ in rank["trace"]] == list(range(steps + 1))
    # DDP: every rank trained the same weights.
    for (_, a), (_, b) in zip(ranks[0]["trace"], ranks[1]["trace"]):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    return ranks


def _warmup_decay(step):
    """EMACallback's default warmup (power 0.75, inv_gamma 1, max 0.9999)."""
    e = step - 1
    return 0.0 if e <= 0 else min(0.9999, 1 - (1 + e) ** -0.75)


def test_ema_callback_under_ddp_spawn(tmp_path):
    ranks = _spawn_fit("ema", tmp_path)
    trace = ranks[0]["trace"]
    # float64: from the weights at fit start, parameters lerped at every
    # optimizer step with the warmup decay, buffers copied.
    expected = {k: v.double() for k, v in trace[0][1].items()}
    for step, weights in trace[1:]:
        d = _warmup_decay(step)
        for k, w in weights.items():
            expected[k] = expected[k] * d + w.double() * (1 - d) if k in PARAMS else w.double()
    for rank in ranks:
        assert sorted(rank["ema"]) == sorted(PARAMS + BUFFERS)
        for k, want in expected.items():
            torch.testing.assert_close(rank["ema"][k].double(), want, rtol=1e-5, atol=1e-6,
                                       msg=k)
    # Not the raw weights: the average really lags them.
    assert not torch.allclose(ranks[0]["ema"]["out.weight"], trace[-1][1]["out.weight"])


def test_posthoc_callback_under_ddp_spawn(tmp_path):
    ranks = _spawn_fit("posthoc", tmp_path)
    steps = worker.EPOCHS * worker.BATCHES_PER_EPOCH
    assert [rank["calls"] for rank in ranks] == [steps] * worker.WORLD
    folder = ranks[0]["folder"]
    expected_files = sorted(f"{i}.{t}.safetensors" for i in range(len(worker.SIGMA_RELS))
                            for t in range(worker.CHECKPOINT_EVERY, steps + 1,
                                           worker.CHECKPOINT_EVERY))
    assert sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) == expected_files
    trace = ranks[0]["trace"]
    for i, sigma in enumerate(worker.SIGMA_RELS):
        profiles = reference_profiles(trace, sigma)  # float64, first call copies
        for t in range(worker.CHECKPOINT_EVERY, steps + 1, worker.CHECKPOINT_EVERY):
            got = shardema.read_tensor_file(os.path.join(folder, f"{i}.{t}.safetensors"))
            assert sorted(got["tensors"]) == sorted(PARAMS + BUFFERS)
            for k, want in profiles[t].items():
                torch.testing.assert_close(got["tensors"][k].double().reshape(want.shape), want,
                                           rtol=1e-5, atol=1e-6, msg=f"{sigma} step {t} '{k}'")


# --- shardema.EMA -------------------------------------------------------------
def _trained_ema():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    ema = shardema.EMA(model, schedule=shardema.DecaySchedule.warmup(power=0.8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.randn(6, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
    ema.wait()
    return model, ema


def _values(ema):
    return {k: v.detach().clone() for k, v in ema.ema_tensors().items()}


def _assert_same_ema(a, b):
    va, vb = _values(a), _values(b)
    assert sorted(va) == sorted(vb)
    for k in va:
        assert torch.equal(va[k], vb[k]), k
    assert a.step == b.step
    assert a.last_decay == b.last_decay
    assert a.schedule == b.schedule


def _perturb(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _assert_tracks(ema, model, other_ema):
    """`ema` follows `model` (not the original's), and `other_ema` stays."""
    before = _values(other_ema)
    _perturb(model, 100.0)
    ema.update()
    ema.wait()
    moved = _values(ema)
    name = next(k for k in moved if k.endswith("weight"))
    assert moved[name].min() > 1.0, "the copy's EMA follows its own model"
    after = _values(other_ema)
    for k in before:
        assert torch.equal(before[k], after[k]), f"the original moved: '{k}'"


def test_deepcopy_of_an_ema_is_independent_over_a_copy_of_its_model():
    model, ema = _trained_ema()
    other = copy.deepcopy(ema)
    assert other is not ema
    _assert_same_ema(other, ema)
    # Its model is a copy: changing the original model does not reach it,
    # and the copy's updates do not reach the original EMA.
    _assert_tracks(ema, model, other)


def test_deepcopy_of_model_and_ema_together_keeps_them_paired():
    model, ema = _trained_ema()
    model2, ema2 = copy.deepcopy((model, ema))
    assert model2 is not model
    _assert_same_ema(ema2, ema)
    _assert_tracks(ema2, model2, ema)


def test_pickle_of_model_and_ema_restores_them_paired():
    model, ema = _trained_ema()
    model2, ema2 = pickle.loads(pickle.dumps((model, ema)))
    assert model2 is not model
    _assert_same_ema(ema2, ema)
    # Progress travels: the same weights make the same next update.
    _perturb(model, 0.5)
    _perturb(model2, 0.5)
    ema.update()
    ema2.update()
    ema.wait()
    ema2.wait()
    _assert_same_ema(ema2, ema)
    _assert_tracks(ema2, model2, ema)


def test_copying_inside_a_swap_is_refused_and_the_raw_weights_come_back():
    # Inside swap() the model holds the EMA; a copy of (model, ema) taken
    # there would keep the EMA as its raw weights with no way back.
    model, ema = _trained_ema()
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swap(model):
        for copier in (copy.deepcopy, lambda x: pickle.dumps(x)):
            with pytest.raises(TypeError, match="inside swap"):
                copier((model, ema))
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw[k]), k
    _assert_same_ema(copy.deepcopy(ema), ema)  # after the swap, copies work


def test_pickling_an_ema_under_a_process_group_is_refused_by_name(one_rank_group):
    model = torch.nn.Linear(4, 4)
    ema = shardema.EMA(model, layout="replicated")
    with pytest.raises(TypeError, match="process group"):
        pickle.dumps(ema)
