"""One rank of test_peer_failure.py: rank 1 dies (kill) or stops (SIGSTOP)
before a collective of the EMA; rank 0 runs it, records how long it took to
raise and to leave the process group, then exits the normal way (interpreter
shutdown included), so the test sees whether the job can end at once.
Started by rank_launch.launch as scenario MODE (kill or stop) with OP its
extra argument; rank_worker.py says how and what it reports."""
import functools
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import rank_worker
import shardema

EMA_TIMEOUT = 3.0


def run_op(op, ema, model, out):
    if op == "save_checkpoint":
        ema.save_checkpoint(os.path.join(out, "ckpt"))
    elif op == "load_checkpoint":
        ema.load_checkpoint(os.path.join(out, "good"))
    elif op == "swap":
        with ema.swap(model):
            pass
    elif op == "full_state_dict":
        ema.full_state_dict()
    else:
        raise ValueError(op)


def survive(mode, rank, world, out, op):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    ema = shardema.EMA(model, shardema.DecaySchedule.constant(0.5), timeout=EMA_TIMEOUT)
    ema.update()
    ema.wait()
    ema.save_checkpoint(os.path.join(out, "good"))
    if rank == 1:
        if mode == "kill":
            os._exit(9)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    report = {"timeout": EMA_TIMEOUT}
    start = time.monotonic()
    try:
        run_op(op, ema, model, out)
        report["error"] = None
    except Exception as error:  # what the user sees
        report["error"] = f"{type(error).__name__}: {error}"
    report["raised_after"] = time.monotonic() - start
    left = time.monotonic()
    del ema
    dist.destroy_process_group()
    report["destroy_seconds"] = time.monotonic() - left
    report["reported_at"] = time.time()  # wall clock: the test compares it with the exit
    with open(os.path.join(out, "rank0.json"), "w") as f:
        json.dump(report, f)


SCENARIOS = {mode: functools.partial(survive, mode) for mode in ("kill", "stop")}


if __name__ == "__main__":
    # The torch group keeps its default 30-minute timeout: the EMA's own
    # must be what ends the wait, and leaving the group must not wait for
    # it. The ranks part on purpose (out of step); a normal return: the
    # interpreter's shutdown is part of what is timed.
    rank_worker.main(SCENARIOS, group_timeout=30 * 60, out_of_step=set(SCENARIOS),
                     exit_normally=True)
