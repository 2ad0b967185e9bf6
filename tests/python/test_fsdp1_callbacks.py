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
from rank_launch import launch  # noqa: E402

pytest.importorskip("lightning")

WORLD = 2
SCENARIOS = ["ema_orig_policy", "ema_flat_all", "posthoc_orig", "posthoc_flat", "refusals"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(folder, exit codes, errors) of the one launch of every scenario."""
    out = tmp_path_factory.mktemp("fsdp1_callbacks")
    codes, errors = launch("fsdp1_callback_worker.py", ",".join(SCENARIOS), WORLD, out,
                           timeout=240)
    return out, codes, errors


def passed(run, scenario):
    out, codes, errors = run
    missing = [r for r in range(WORLD) if not (out / f"done{r}_{scenario}").exists()]
    said = {r: text.splitlines()[0] + "\n" + "\n".join(text.splitlines()[-6:])
            for r, text in errors.items()}
    assert not missing, f"{scenario} did not pass on ranks {missing} (exit codes {codes}): {said}"


@pytest.mark.parametrize("scenario", ["ema_orig_policy", "ema_flat_all"])
def test_ema_callback_under_an_fsdp1_root(run, scenario):
    # ema_orig_policy: use_orig_params=True, attribute="policy" (the head
    # left out: raw in validation, not in the EMA); ema_flat_all:
    # use_orig_params=False, the whole LightningModule
    passed(run, scenario)


@pytest.mark.parametrize("scenario", ["posthoc_orig", "posthoc_flat"])
def test_posthoc_callback_under_an_fsdp1_root(run, scenario):
    passed(run, scenario)


def test_what_cannot_work_under_fsdp1_is_refused_by_name(run):
    # a sharded FSDP1 state dict, layout="rank0", an attribute that is not
    # a submodule
    passed(run, "refusals")
