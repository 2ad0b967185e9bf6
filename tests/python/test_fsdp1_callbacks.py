"""EMACallback and DDPPostHocEMACallback over a LightningModule inside torch's
real FSDP1 root (FullyShardedDataParallel, as Lightning's FSDPStrategy
wraps it), on CPU/Gloo with W = 2, use_orig_params True and False.
Lightning refuses FSDPStrategy without a GPU (test_fsdp1.py asserts it), so
fsdp1_callback_worker.py plays the Trainer with Lightning's own forward
redirection, full-state-dict context and checkpoint loader: the EMA after
every optimizer step against a float64 EMA of the full parameters,
validation computing with the EMA, training going on with the raw weights,
a checkpoint in Lightning's keys resuming bit for bit. One launch runs
every scenario."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_launch import assert_passed, launched_once  # noqa: E402

pytest.importorskip("lightning")

WORLD = 2
runs = launched_once("fsdp1_callback_worker.py",
                     [(WORLD, ["ema_orig_policy", "ema_flat_all", "posthoc_orig", "posthoc_flat",
                               "refusals"])], timeout=240)


@pytest.mark.parametrize("scenario", ["ema_orig_policy", "ema_flat_all"])
def test_ema_callback_under_an_fsdp1_root(runs, scenario):
    # ema_orig_policy: use_orig_params=True, attribute="policy" (the head
    # left out: raw in validation, not in the EMA); ema_flat_all:
    # use_orig_params=False, the whole LightningModule
    assert_passed(runs(WORLD), scenario)


@pytest.mark.parametrize("scenario", ["posthoc_orig", "posthoc_flat"])
def test_posthoc_callback_under_an_fsdp1_root(runs, scenario):
    assert_passed(runs(WORLD), scenario)


def test_what_cannot_work_under_fsdp1_is_refused_by_name(runs):
    # a sharded FSDP1 state dict, layout="rank0", an attribute that is not
    # a submodule
    assert_passed(runs(WORLD), "refusals")
