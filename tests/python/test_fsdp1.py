"""shardema.EMA over torch's real FSDP1 (FullyShardedDataParallel) on
CPU/Gloo, W = 2 and 3, with use_orig_params True and False: each rank keeps
the EMA of exactly the elements of its local flat shards, checked after
every update against a float64 EMA the rank recomputes from the full
parameters (summon_full_params) and from what its own shard holds
(fsdp1_worker.py). Lightning refuses its FSDP1 strategy on CPU (asserted
below), so the callbacks under it are run with a stand-in Trainer in
test_fsdp1_callbacks.py. One launch per world size runs every scenario."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_launch import assert_passed, launched_once  # noqa: E402

runs = launched_once("fsdp1_worker.py", [(2, ["orig_params", "flat_params", "refusals", "swap"]),
                                         (3, ["orig_params_bf16", "flat_params"])], timeout=120)


@pytest.mark.parametrize("world, scenario", [(2, "orig_params"), (3, "orig_params_bf16")])
def test_use_orig_params_ema_equals_float64_reference(runs, world, scenario):
    # nested units, uneven splits, empty pieces on rank 0, a BatchNorm
    # (copied; its buffers rank 0's), a save_checkpoint/load_checkpoint round
    # trip; at W = 3 MixedPrecision(param_dtype=bfloat16), which aligns the
    # members for bf16 and puts the BatchNorm in a unit of its own
    assert_passed(runs(world), scenario)


@pytest.mark.parametrize("world", [2, 3])
def test_flat_params_ema_equals_float64_reference(runs, world):
    assert_passed(runs(world), "flat_params")


def test_module_inside_an_fsdp1_root_and_other_layouts_are_refused(runs):
    assert_passed(runs(2), "refusals")


def test_swap_puts_the_raw_weights_back_in_what_fsdp1_gathers(runs):
    assert_passed(runs(2), "swap")


def test_lightning_and_fabric_refuse_fsdp1_on_cpu():
    """Lightning 2.6 refuses its FSDP1 strategy without a GPU, in the Trainer
    and in Fabric alike, so test_fsdp1_callbacks.py runs the callbacks under
    real FSDP1 with a stand-in Trainer (Lightning's forward redirection,
    state dict configuration and loader), not FSDPStrategy's own loop. If a
    Lightning lets it run on CPU, this fails: then run the callbacks under
    the real Trainer too, as test_lightning.py does for ModelParallelStrategy."""
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from lightning.pytorch.strategies import FSDPStrategy
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=FSDPStrategy(), logger=False)
    with pytest.raises(ValueError, match="FSDP is only available on GPU"):
        Fabric(accelerator="cpu", devices=2, strategy="fsdp")
