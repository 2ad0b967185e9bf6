"""The post-hoc constructors check every argument when it is given:
DDPPostHocEMACallback(...) and PostHocEMA(...) refuse a value out of range
with a one-line ValueError and a wrong type with a one-line TypeError, each
naming the Python parameter (never pybind11's multi-line "incompatible
function arguments", never a C++ field name), at construction rather than
at fit start; and they take what users pass (numpy integers, paths,
timedeltas).

The sigma_rel limit is checked against the relation itself
(docs/spec/reference_semantics.md section 2): sigma_rel(gamma) =
sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3))) falls from its value at
gamma = 0, sqrt(1/12) (a uniform average), as gamma grows, and the
engine's profiles have gamma > 0."""
import math
import pathlib
import re
from datetime import timedelta

import numpy as np
import pytest
import torch

import shardema
from shardema.callbacks import DDPPostHocEMACallback


def sigma_of(gamma):
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


LIMIT = sigma_of(0.0)  # 1/sqrt(12), correctly rounded
# Over every power function (gamma > -1) the relation peaks higher, at
# gamma = (sqrt(5) - 3) / 2: phi^(-5/2); 0.5 is past even that.
PEAK = ((1 + math.sqrt(5)) / 2) ** -2.5


def test_the_limit_is_the_relation_at_gamma_zero_and_the_peak_is_higher():
    assert LIMIT == math.sqrt(1 / 12) == 0.28867513459481287
    assert shardema._C.max_sigma_rel == LIMIT
    assert all(sigma_of(g) < LIMIT for g in (1e-9, 0.5, 7.0, 1e6))
    assert sigma_of((math.sqrt(5) - 3) / 2) == pytest.approx(PEAK, rel=1e-15)
    assert all(sigma_of(g) <= PEAK for g in np.linspace(-0.999, 3.0, 4001))


def one_line(error):
    text = str(error.value)
    assert "\n" not in text and "incompatible function arguments" not in text, text
    return text


def callback(**kwargs):
    return DDPPostHocEMACallback(**kwargs)


SIGMA_MESSAGE = (r"sigma_rels\[{i}\] must lie in \(0, 1/sqrt\(12\) = 0\.28867513459481287\), "
                 r"the sigma_rel of power-function EMAs with gamma > 0, got {value}")


@pytest.mark.parametrize("bad", [0.5, PEAK, math.nextafter(LIMIT, 1.0), 0.0, -0.05,
                                 float("nan"), float("inf")])
def test_a_sigma_rel_no_profile_has_is_refused_naming_it_and_the_limit(bad):
    with pytest.raises(ValueError) as error:
        callback(sigma_rels=(0.05, bad))
    assert one_line(error).startswith("DDPPostHocEMACallback: ")
    assert re.search(SIGMA_MESSAGE.format(i=1, value=re.escape(repr(bad))), str(error.value))
    with pytest.raises(ValueError, match=r"^DDPPostHocEMACallback: default_output_sigma must lie "
                                         r"in \(0, 1/sqrt\(12\)"):
        callback(default_output_sigma=bad)
    with pytest.raises(ValueError, match=r"^PostHocEMA: sigma_rels\[1\] must lie in \(0, "):
        shardema.PostHocEMA(torch.nn.Linear(2, 2), sigma_rels=(0.05, bad))


def test_the_reported_single_sigma_is_refused_by_its_value():
    with pytest.raises(ValueError, match=r"sigma_rels\[0\] must lie in .* got 0\.5$"):
        callback(sigma_rels=(0.5,))


def test_values_inside_the_range_are_taken(tmp_path):
    below = math.nextafter(LIMIT, 0.0)
    made = callback(sigma_rels=(np.float64(0.05), 1e-6, below), default_output_sigma=below,
                    update_every=np.int64(2), checkpoint_every=np.int32(3),
                    checkpoint_folder=pathlib.Path(tmp_path), start_iter=0,
                    output_dtype=torch.bfloat16, layout="sharded", attribute="policy")
    assert made.sigma_rels == (0.05, 1e-6, below)
    assert (made.update_every, made.checkpoint_every) == (2, 3)
    assert type(made.update_every) is int and made.checkpoint_folder == str(tmp_path)
    ema = shardema.PostHocEMA(torch.nn.Linear(2, 2), sigma_rels=[0.05, below],
                              checkpoint_folder=pathlib.Path(tmp_path / "p"),
                              timeout=timedelta(seconds=30), output_dtype=torch.float16)
    assert ema.sigma_rels == (0.05, below)


# (keyword arguments, exception, the message from its start)
CALLBACK_REFUSALS = [
    (dict(checkpoint_every=0), ValueError, "checkpoint_every must be >= 1, got 0"),
    (dict(update_every=0), ValueError, "update_every must be >= 1, got 0"),
    (dict(update_every=-3), ValueError, "update_every must be >= 1, got -3"),
    (dict(start_iter=-1), ValueError, "start_iter must be >= 0, got -1"),
    (dict(update_every="2"), TypeError, "update_every must be an int, got str '2'"),
    (dict(checkpoint_every=2.5), TypeError, "checkpoint_every must be an int, got float 2.5"),
    (dict(checkpoint_every=True), TypeError, "checkpoint_every must be an int, got bool True"),
    (dict(start_iter=None), TypeError, "start_iter must be an int, got NoneType None"),
    (dict(sigma_rels="0.05"), TypeError, "sigma_rels must be a sequence of numbers, got str"),
    (dict(sigma_rels=0.05), TypeError, "sigma_rels must be a sequence of numbers, got float"),
    (dict(sigma_rels=(0.05, "0.1")), TypeError, "sigma_rels[1] must be a number, got str '0.1'"),
    (dict(sigma_rels=(0.05,)), ValueError, "sigma_rels needs at least 2 values"),
    (dict(sigma_rels=(0.05, 0.1, 0.05)), ValueError, "sigma_rels lists 0.05 twice"),
    (dict(sigma_rels=[0.01 * (i + 1) for i in range(17)]), ValueError,
     "sigma_rels holds 17 values; at most 16 profiles"),
    (dict(default_output_sigma="0.05"), TypeError,
     "default_output_sigma must be a number, got str"),
    (dict(step_size_correction=1), TypeError,
     "step_size_correction must be True or False, got int 1"),
    (dict(layout="everywhere"), ValueError,
     "layout must be 'rank0' or 'sharded', got 'everywhere'"),
    (dict(layout=0), TypeError, "layout must be 'rank0' or 'sharded', got int 0"),
    (dict(checkpoint_folder=""), ValueError, "checkpoint_folder must name a folder"),
    (dict(checkpoint_folder=5), TypeError, "checkpoint_folder must be a path"),
    (dict(output_dtype="float32"), TypeError, "output_dtype must be a torch.dtype, got str"),
    (dict(output_dtype=torch.float64), ValueError,
     "output_dtype must be torch.float32, torch.bfloat16 or torch.float16, got torch.float64"),
    (dict(process_group="world"), TypeError, "process_group must be a torch.distributed"),
    (dict(attribute=3), TypeError, "attribute must be the name of a submodule"),
    (dict(attribute=""), ValueError, "attribute must be the name of a submodule"),
]


@pytest.mark.parametrize("kwargs, kind, message", CALLBACK_REFUSALS,
                         ids=[str(k) for k, _, _ in CALLBACK_REFUSALS])
def test_callback_arguments_are_checked_when_given(kwargs, kind, message):
    with pytest.raises(kind) as error:
        callback(**kwargs)
    assert error.type is kind
    assert one_line(error).startswith(f"DDPPostHocEMACallback: {message}")


POSTHOC_REFUSALS = [
    (dict(checkpoint_every_num_steps=0), ValueError,
     "checkpoint_every_num_steps must be >= 1, got 0"),
    (dict(update_every=0), ValueError, "update_every must be >= 1, got 0"),
    (dict(update_every=2.5), TypeError, "update_every must be an int, got float 2.5"),
    (dict(sigma_rels=(0.05, 0.5)), ValueError, "sigma_rels[1] must lie in (0, 1/sqrt(12)"),
    (dict(step_size_correction="yes"), TypeError, "step_size_correction must be True or False"),
    (dict(layout="rank1"), ValueError, "layout must be 'rank0' or 'sharded', got 'rank1'"),
    (dict(policy="timm"), ValueError, "policy must be 'ema_pytorch' or 'versatil', got 'timm'"),
    (dict(checkpoint_folder=None), TypeError, "checkpoint_folder must be a path"),
    (dict(output_dtype=torch.int64), ValueError, "output_dtype must be torch.float32"),
    (dict(process_group=1), TypeError, "process_group must be a torch.distributed"),
    (dict(timeout=0), ValueError, "timeout must be a positive, finite time, got 0"),
    (dict(timeout=float("inf")), ValueError, "timeout must be a positive, finite time"),
    (dict(timeout="30"), TypeError, "timeout must be seconds (a number) or a datetime.timedelta"),
]


@pytest.mark.parametrize("kwargs, kind, message", POSTHOC_REFUSALS,
                         ids=[str(k) for k, _, _ in POSTHOC_REFUSALS])
def test_posthoc_ema_arguments_are_checked_when_given(kwargs, kind, message, tmp_path):
    arguments = {"checkpoint_folder": str(tmp_path / "snapshots"), **kwargs}
    with pytest.raises(kind) as error:
        shardema.PostHocEMA(torch.nn.Linear(2, 2), **arguments)
    assert error.type is kind
    assert one_line(error).startswith(f"PostHocEMA: {message}")
    assert not (tmp_path / "snapshots").exists()  # refused before anything was made
