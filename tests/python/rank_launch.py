"""Starts the ranks of a multi-process test: W processes of a worker script
on Gloo over loopback, with a deadline that fails the test instead of
hanging, and the error files the ranks wrote (error{rank}*.txt)."""
import glob
import os
import socket
import subprocess
import time

import pytest

from conftest import python_for_workers

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, scenario, world, out, timeout=120, env=None):
    """Runs `worker SCENARIO RANK WORLD PORT OUT` on `world` ranks; returns
    their exit codes and {rank: the text of its error files}."""
    port = free_port()
    environment = dict(os.environ, **(env or {}))
    procs = [subprocess.Popen([python_for_workers(), os.path.join(HERE, worker), scenario, str(r),
                               str(world), str(port), str(out)], env=environment)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.wait()
            pytest.fail(f"{scenario} on {world} ranks hung past {timeout} s; errors: "
                        f"{errors_in(out, world)}")
    return codes, errors_in(out, world)


def errors_in(out, world):
    errors = {}
    for r in range(world):
        paths = sorted(glob.glob(os.path.join(out, f"error{r}*.txt")))
        texts = [open(path).read() for path in paths]
        if texts:
            errors[r] = "\n".join(texts)
    return errors
