"""shardema.EMA over a real DeepSpeed ZeRO-3 engine (deepspeed.initialize,
stage 3) on its CPU accelerator over Gloo, W = 2: each rank keeps the EMA
of its parameters' partitions (ds_tensor), checked after every update
against a float64 EMA of the parameters gathered with
deepspeed.zero.GatheredParameters (zero3_worker.py). One launch runs every
scenario."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_launch import assert_passed, launched_once  # noqa: E402

pytest.importorskip("deepspeed")

# DeepSpeed compiles its CPU shared-memory collective op on first use
# (cached in ~/.cache/torch_extensions): the first launch takes longer.
runs = launched_once("zero3_worker.py", [(2, ["reference", "swap", "refusals"])], timeout=300)


def test_ema_of_partitions_equals_float64_ema_of_gathered_parameters(runs):
    # uneven partitions, a partition of padding only, rank 0's BatchNorm
    # buffers; save_checkpoint / load_checkpoint; export_weights loaded
    # strict into the plain model
    assert_passed(runs(2), "reference")


def test_swap_puts_the_ema_in_what_zero3_gathers_and_the_raw_weights_back(runs):
    # persistent parameters (kept gathered between forwards) included
    assert_passed(runs(2), "swap")


def test_what_a_partition_cannot_describe_is_refused(runs):
    # module(), copy_from(), the DCP state_dict(), PostHocEMA, another layout;
    # copies and pickles, advising what works here
    assert_passed(runs(2), "refusals")
