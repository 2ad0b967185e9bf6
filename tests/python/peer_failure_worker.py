"""One rank of test_peer_failure.py: rank 1 dies (kill) or stops (SIGSTOP)
before a collective of the EMA; rank 0 runs it, records how long it took to
raise and to leave the process group, then exits the normal way (interpreter
shutdown included), so the test sees whether the job can end at once.

Usage: peer_failure_worker.py MODE OP RANK PORT OUT_DIR"""
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

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


def main():
    mode, op, rank, port, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5]
    # The torch group keeps its default 30-minute timeout: the EMA's own
    # must be what ends the wait, and leaving the group must not wait for it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(minutes=30))
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
    # A normal return: the interpreter's shutdown is part of what is timed.


if __name__ == "__main__":
    main()
