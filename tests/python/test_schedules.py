"""The schedules from Python against the reference implementations' numbers
(tests/data, computed by ema-pytorch, diffusers and edm2)."""
import math

import pytest

import shardema
from conftest import golden


def test_warmup_matches_ema_pytorch_and_diffusers():
    data = golden("warmup_decay_schedule.json")
    assert len(data["cases"]) == 5
    for case in data["cases"]:
        s = case["settings"]
        schedule = shardema.DecaySchedule.warmup(inv_gamma=s["inv_gamma"], power=s["power"],
                                                 min_value=s["min_value"], max_value=s["beta"],
                                                 update_after_step=s["update_after_step"])
        for step, decay, diffusers in zip(case["step_buffer_values"], case["decay"],
                                          case["diffusers_get_decay_same_argument"]):
            if step == 0:
                continue  # ema-pytorch's buffer before the first update
            # ema-pytorch computes in float32; diffusers' formula in float64.
            assert schedule.decay_at(step) == pytest.approx(decay, rel=2e-6, abs=1e-7), s["name"]
            assert schedule.decay_at(step) == pytest.approx(diffusers, rel=1e-12, abs=1e-15)


def test_power_schedule_matches_karras_betas():
    data = golden("karras_gamma_beta.json")
    for key, entry in data["betas"].items():
        schedule = shardema.DecaySchedule.power_function(sigma_rel=entry["sigma_rel"])
        assert schedule.gamma == pytest.approx(entry["gamma"], rel=1e-12)
        betas = entry["ema_pytorch_beta_per_update_call"]
        assert len(betas) >= 10
        for call, beta in enumerate(betas):
            # update call c (0-based) is our 1-based step c + 1
            assert schedule.decay_at(call + 1) == pytest.approx(beta, rel=1e-12), key


def test_power_schedule_by_gamma_and_edm2():
    by_gamma = shardema.DecaySchedule.power_function(gamma=6.94)
    assert by_gamma.gamma == 6.94
    edm2 = shardema.DecaySchedule.power_function(gamma=6.94, convention="edm2")
    for n in (1, 2, 10, 1000):
        assert edm2.decay_at(n) == pytest.approx((1 - 1 / n) ** 7.94, abs=1e-15)
        assert by_gamma.decay_at(n) == pytest.approx((1 - 1 / (n + 1)) ** 7.94, rel=1e-14)


def test_constant_schedule_and_update_every():
    schedule = shardema.DecaySchedule.constant(0.9, update_every=3)
    assert [schedule.is_due_at(n) for n in range(1, 8)] == [True, False, False, True, False,
                                                             False, True]
    assert schedule.decay_at(5) == 0.9
    assert shardema.DecaySchedule.from_json(schedule.to_json()) == schedule
    assert schedule.kind == "constant"
    assert shardema.DecaySchedule.warmup().kind == "warmup"
    assert shardema.DecaySchedule.power_function(sigma_rel=0.1).kind == "power"


@pytest.mark.parametrize("make, message", [
    (lambda: shardema.DecaySchedule.warmup(power=-1.0), "power"),
    (lambda: shardema.DecaySchedule.constant(1.5), "decay"),
    (lambda: shardema.DecaySchedule.power_function(sigma_rel=0.5), "sigma"),
    (lambda: shardema.DecaySchedule.power_function(), "exactly one"),
    (lambda: shardema.DecaySchedule.power_function(gamma=0.0), "gamma"),
    (lambda: shardema.DecaySchedule.power_function(sigma_rel=0.1, convention="karras"),
     "convention"),
])
def test_bad_schedule_options_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_decay_at_step_zero_is_a_value_error():
    with pytest.raises(ValueError):
        shardema.DecaySchedule.warmup().decay_at(0)
    assert math.isfinite(shardema.DecaySchedule.warmup().decay_at(1))
