"""SIGKILL during EMA.save_checkpoint (issue 23): 20 processes save into
their checkpoint folder after every step and are killed at random moments;
every folder then loads, into a fresh EMA, a completed save: the step is
the last one reported saved or the one in flight, and the values are the
float64 EMA of that step recomputed here."""
import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import time

import torch

import shardema
from conftest import python_for_workers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import save_kill_worker as worker  # noqa: E402

KILLS = 20
AT_ONCE = 4


def reference_ema(base, step):
    ema = {k: v.double().clone() for k, v in base.items()}
    for s in range(1, step + 1):
        for k in ema:
            w = worker.weights_at(base[k].double(), s)
            ema[k] = w if s == 1 else ema[k] * worker.DECAY + w * (1 - worker.DECAY)
    return ema


def kill_one_while_saving(folder, rng):
    proc = subprocess.Popen([python_for_workers(), os.path.join(HERE, "save_kill_worker.py"),
                             str(folder)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    first = proc.stdout.readline()  # one save completed
    assert first.strip() == "1", f"the worker did not save: {first!r}"
    time.sleep(rng.uniform(0.0, 0.4))
    proc.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate(timeout=60)
    return [1] + [int(line) for line in rest.split()]


def test_every_folder_loads_a_completed_save_after_sigkill(tmp_path):
    rng = random.Random(23)
    model = worker.make_model()
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    outcomes = []
    for batch in range(0, KILLS, AT_ONCE):
        folders = [tmp_path / f"ckpt{i}" for i in range(batch, batch + AT_ONCE)]
        with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
            saved = list(pool.map(lambda f: kill_one_while_saving(f, rng), folders))
        outcomes += zip(folders, saved)
    landed_in_a_write = 0
    for folder, saved in outcomes:
        landed_in_a_write += any(name.endswith(".tmp") for name in os.listdir(folder))
        ema = shardema.EMA(worker.make_model(), shardema.DecaySchedule.constant(worker.DECAY))
        ema.load_checkpoint(str(folder))
        # The save in flight may have committed its manifest before the kill.
        assert ema.step in (saved[-1], saved[-1] + 1), (folder, ema.step, saved[-1])
        expected = reference_ema(base, ema.step)
        for name, value in ema.full_state_dict().items():
            torch.testing.assert_close(value.double(), expected[name], rtol=0, atol=1e-5)
    print(f"{landed_in_a_write} of {KILLS} kills left a .tmp (landed in a write)")
