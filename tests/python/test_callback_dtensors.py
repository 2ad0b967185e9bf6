"""EMACallback over a Replicate() DTensor beside a Shard(0) one on 2
processes (callback_dtensor_worker.py): each rank checks, against a
float64 EMA it recomputes from full_tensor(), the checkpoint's DTensor
entries, the resume from them, the validation swap and EMA.module(into=).
A Replicate() DTensor's to_local() is the whole tensor, of which the EMA
keeps only this rank's rows."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_launch import assert_passed, launch  # noqa: E402


def test_replicate_dtensor_checkpoint_resume_swap_and_module(tmp_path):
    assert_passed(launch("callback_dtensor_worker.py", "replicate", 2, tmp_path, timeout=90),
                  "replicate")
