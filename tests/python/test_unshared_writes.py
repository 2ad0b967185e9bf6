"""An EMA built before torch.distributed.init_process_group is each
process's own (layout "single"). Saved or exported on every rank to the
same path, the ranks' files overwrote each other (a rename failing on one
rank, a checkpoint folder left with a manifest naming a missing file):
rank 0 writes it, the other ranks get a ValueError saying why, and the
checkpoint rank 0 wrote loads."""
import os
import sys

import torch

import shardema

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import rank_launch  # noqa: E402


def test_only_rank_0_writes_an_ema_built_before_the_group(tmp_path):
    ranks = rank_launch.launch("unshared_write_worker.py", "write_on_every_rank", 2, tmp_path,
                               timeout=120, torchrun=True)
    rank_launch.assert_passed(ranks, "write_on_every_rank")
    mine, other = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert mine == {"save_checkpoint": "written", "export_weights": "written"}, mine
    for api in ("save_checkpoint", "export_weights"):
        assert other[api].startswith(f"shardema.EMA.{api}: this EMA was built before "
                                     "torch.distributed.init_process_group"), other[api]
        assert "rank 1 of 2" in other[api] and f"{api}() on rank 0 only" in other[api]
    loaded = shardema.EMA(torch.nn.Linear(4, 4), decay=0.9)
    loaded.load_checkpoint(str(tmp_path / "ckpt"))
    assert loaded.step == 1
    assert os.path.exists(tmp_path / "ema.safetensors")
