#!/usr/bin/env python3
"""One C++ exception of one kind into Python, for bench/gpu/run.sh, which
runs each kind in its own process (a crash then fails one line, not the
run): the kinds the bindings map (python/src/errors.cpp), one thrown inside
ATen from a binding, and one thrown on a worker thread and rethrown by
wait(). Prints "ok KIND: Type: message" and exits 0 when the expected
Python type arrives with a one-line message; anything else exits 1. A
process killed by a signal never prints.

    throw_kinds.py --list     the kinds, one a line
    throw_kinds.py KIND
"""
import sys
import time

import torch

import shardema


def value():
    shardema.DecaySchedule.constant(1.5)


def type_():
    shardema.EMA({"x": torch.zeros(2, dtype=torch.complex64)})  # Averager's TORCH_CHECK_TYPE


def index():
    shardema.EMA(torch.nn.Linear(2, 2))._engine.ema("weight", 5)  # Averager's TORCH_CHECK_INDEX


def runtime():
    ema = shardema.EMA(torch.nn.Linear(2, 2))
    ema.update()
    ema.update()  # no fence() between: c10::Error from Averager::update


def aten():
    # c10::NotImplementedError thrown inside ATen (copy out of a meta tensor).
    ema = shardema.EMA(torch.nn.Linear(2, 2))
    ema._engine.load_local_values([("weight", torch.zeros(4, device="meta")),
                                   ("bias", torch.zeros(2))])


def worker():
    # The chunk math of step 2 is held at the failpoint gate; the source is
    # written meanwhile, so the worker that runs the chunk refuses it and
    # captures the error; wait() rethrows it (exception_ptr across threads).
    w = torch.nn.Parameter(torch.zeros(1 << 16))
    ema = shardema.EMA({"w": w}, schedule=shardema.DecaySchedule.constant(0.5), chunk_mib=0.05)
    ema.update()
    ema.fence()
    gate = shardema._C._ChunkGate(step=2, timeout_seconds=20)
    ema.update()
    gate.await_arrival(20)
    with torch.no_grad():
        w.add_(1.0)
    gate.open()
    time.sleep(0.5)  # the workers' checks run before wait()'s own
    try:
        ema.wait()
    finally:
        gate.close()


KINDS = {
    "value": (value, ValueError),
    "type": (type_, TypeError),
    "index": (index, IndexError),
    "runtime": (runtime, RuntimeError),
    "aten": (aten, NotImplementedError),
    "worker": (worker, RuntimeError),
}


def main(argv):
    if argv == ["--list"]:
        print("\n".join(KINDS))
        return 0
    if len(argv) != 1 or argv[0] not in KINDS:
        print(f"usage: throw_kinds.py --list | {'|'.join(KINDS)}")
        return 2
    kind = argv[0]
    run, expected = KINDS[kind]
    try:
        run()
    except Exception as error:  # what arrived is the result, whatever it is
        message = str(error)
        good = type(error) is expected and message and "\n" not in message
        print(f"{'ok' if good else 'WRONG'} {kind}: {type(error).__name__}: {message[:160]}")
        return 0 if good else 1
    print(f"WRONG {kind}: nothing was raised")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
