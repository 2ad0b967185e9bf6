"""Ranks of test_unshared_writes.py: an EMA built before
init_process_group (each process's own, layout "single"), then the group
started (torchrun's environment) and the EMA written by every rank to the
same files, the mistake an ema-pytorch loop under DDP makes when it saves
on every rank. Rank 0 writes; the others are refused by name."""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import rank_worker  # noqa: E402

import shardema  # noqa: E402


def write_on_every_rank(rank, world, out):
    import torch.distributed as dist
    model = torch.nn.Linear(4, 4)
    ema = shardema.EMA(model, decay=0.9)  # before the group: this process's own
    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from the launcher
    assert ema.layout == "single"
    ema.update()
    outcome = {}
    for api, write in (("save_checkpoint", lambda: ema.save_checkpoint(os.path.join(out, "ckpt"))),
                       ("export_weights",
                        lambda: ema.export_weights(os.path.join(out, "ema.safetensors")))):
        try:
            write()
            outcome[api] = "written"
        except ValueError as e:
            outcome[api] = str(e)
    ema.update()  # the EMA goes on after a refusal
    ema.wait()
    torch.save(outcome, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    rank_worker.main({"write_on_every_rank": write_on_every_rank}, start_group=False)
