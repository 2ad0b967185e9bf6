"""The process test_save_kills.py kills: an EMA saved into one checkpoint
folder after every step, as fast as it goes, printing each step whose
save_checkpoint() returned.

Usage: save_kill_worker.py FOLDER"""
import sys

import torch

import shardema

DECAY = 0.5
DELTA = 1e-3


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(1024, 1024)


def weights_at(base, step):
    """The training: every weight moves by DELTA * step at step `step`."""
    return base + DELTA * step


def main():
    folder = sys.argv[1]
    model = make_model()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    ema = shardema.EMA(model, shardema.DecaySchedule.constant(DECAY))
    step = 0
    while True:
        step += 1
        ema.fence()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights_at(base[name], step))
        ema.update(step)
        ema.save_checkpoint(folder)
        print(step, flush=True)


if __name__ == "__main__":
    main()
