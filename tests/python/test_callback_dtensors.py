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
from rank_launch import launch  # noqa: E402


def test_replicate_dtensor_checkpoint_resume_swap_and_module(tmp_path):
    world = 2
    codes, errors = launch("callback_dtensor_worker.py", "replicate", world, tmp_path,
                           timeout=90)
    said = {r: "\n".join(text.splitlines()[:1] + text.splitlines()[-4:])
            for r, text in errors.items()}
    missing = [r for r in range(world) if not (tmp_path / f"done{r}").exists()]
    assert not missing and not errors, f"ranks {missing} failed (exit codes {codes}): {said}"
