"""The test side of multi-process tests: W processes started on one free
loopback port, each with its own output file, waited for with a deadline
that fails the test instead of hanging, and what each rank said in the
user's terms. launch() starts a worker script (rank_worker.py is their
side); run_ranks() starts any command (a documentation block as a user
would run it under torchrun). launched_once() and assert_passed() are the
fixture and the check of tests whose ranks check themselves."""
import glob
import os
import pathlib
import random
import signal
import socket
import subprocess
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Union

import pytest

from conftest import python_for_workers

HERE = os.path.dirname(os.path.abspath(__file__))
#: How much of a rank's output an error or a hang quotes.
OUTPUT_TAIL = 3000


class Ranks(NamedTuple):
    """What the ranks of one launch left: their folder, exit codes, the
    wall-clock times (time.time()) at which each was seen to end, and
    {rank: what went wrong} for every rank that wrote an error file or
    ended with another code than 0 without one (its output's end)."""
    out: pathlib.Path
    codes: List[int]
    exited_at: List[float]
    errors: Dict[int, str]


def free_port() -> int:
    """A loopback port free now, drawn at random below the kernel's
    ephemeral range: a port the kernel picks (a bind to port 0) comes from
    that range, where any outgoing connection (the Gloo pairs of tests
    running beside this one) may take it as its local end before the ranks
    bind it, failing their rendezvous with EADDRINUSE. Below it, only an
    explicit bind takes a port. As Communicator::freeLoopbackPort picks."""
    high = _ephemeral_low() - 1
    low = max(1025, high - 12000)
    draw = random.SystemRandom()  # not the seeded module state: parallel tests differ
    for _ in range(64):
        port = draw.randint(low, high)
        with socket.socket() as s:  # no SO_REUSEADDR: TIME_WAIT counts as taken
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        if 1024 < low <= high:
            return low
    except (OSError, ValueError):
        pass
    return 32768


def torchrun_environment(rank: int, world: int, port: int) -> Dict[str, str]:
    """What torchrun sets for one rank on one node (and one intra-op thread
    per rank, as torchrun does when it starts several)."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")


def launch(worker: str, scenarios: Union[str, Sequence[str]], world: int, out, *,
           args: Sequence = (), timeout: float = 120, **options) -> Ranks:
    """Runs `worker SCENARIO[,SCENARIO...] RANK WORLD PORT OUT [ARG...]` on
    `world` ranks (rank_worker.py) and returns what they left. The options
    are run_ranks'. With several scenarios, each error says which one."""
    names = [scenarios] if isinstance(scenarios, str) else list(scenarios)
    out = pathlib.Path(out)

    def command(rank: int, port: int) -> List[str]:
        return [python_for_workers(), os.path.join(HERE, worker), ",".join(names), str(rank),
                str(world), str(port), str(out), *map(str, args)]
    return run_ranks(command, world, out, timeout=timeout, labelled=len(names) > 1,
                     what=f"{worker} {','.join(names)}", **options)


def run_ranks(command: Callable[[int, int], List[str]], world: int, out, *, timeout: float,
              env: Optional[Dict[str, str]] = None, torchrun: bool = False,
              grace: Optional[float] = None, wait_for: Optional[Sequence[int]] = None,
              cwd=None, labelled: bool = False, what: str = "the ranks") -> Ranks:
    """Starts command(rank, port) for every rank, its output (stdout and
    stderr) in OUT/output{rank}.txt, and waits for the ranks in `wait_for`
    (all of them by default) until `timeout` s have passed, then fails the
    test with what the ranks said. `torchrun`: each rank gets torchrun's
    environment. `grace`: once a rank failed, the others get that long
    before they are ended (for ranks that would otherwise wait in a
    collective for the failed one until the group's timeout). Ranks still
    running when the waited ones are done are ended (a stopped one is
    continued first)."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        environment = dict(os.environ, **(env or {}))
        if torchrun:
            environment.update(torchrun_environment(rank, world, port))
        with open(out / f"output{rank}.txt", "w") as output:
            procs.append(subprocess.Popen(command(rank, port), env=environment, cwd=cwd,
                                          stdout=output, stderr=subprocess.STDOUT))
    exited_at = _wait(procs, range(world) if wait_for is None else wait_for, timeout, grace)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()
    codes = [p.returncode for p in procs]
    errors = _errors(out, world, codes, labelled)
    if any(exited_at[r] is None for r in (range(world) if wait_for is None else wait_for)):
        pytest.fail(f"{what} on {world} ranks hung past {timeout} s; errors: {errors}; "
                    f"output: {_outputs(out, world)}")
    return Ranks(out, codes, exited_at, errors)


def _wait(procs, waited, timeout, grace) -> List[Optional[float]]:
    """The time each rank was seen to end (None: still running) once the
    waited ranks have ended, the timeout has passed or the grace after a
    failure has."""
    deadline = time.monotonic() + timeout
    exited_at: List[Optional[float]] = [None] * len(procs)
    failed_at = None
    while True:
        for r, p in enumerate(procs):
            if exited_at[r] is None and p.poll() is not None:
                exited_at[r] = time.time()
                if p.returncode != 0 and failed_at is None:
                    failed_at = time.monotonic()
        now = time.monotonic()
        if all(exited_at[r] is not None for r in waited) or now > deadline or \
                (grace is not None and failed_at is not None and now > failed_at + grace):
            return exited_at
        time.sleep(0.02)


def _errors(out: pathlib.Path, world: int, codes: List[int], labelled: bool) -> Dict[int, str]:
    """{rank: its error files' texts (each named by its scenario when the
    launch ran several), or its exit code and output's end}."""
    errors = {}
    for r in range(world):
        texts = []
        for path in sorted(glob.glob(str(out / f"error{r}_*.txt"))):
            scenario = os.path.basename(path)[len(f"error{r}_"):-len(".txt")]
            text = pathlib.Path(path).read_text()
            texts.append(f"{scenario}: {text}" if labelled else text)
        if texts:
            errors[r] = "\n".join(texts)
        elif codes[r] != 0:
            errors[r] = f"exit {codes[r]}; output: {_output(out, r)}"
    return errors


def _output(out: pathlib.Path, rank: int) -> str:
    path = out / f"output{rank}.txt"
    return path.read_text(errors="replace")[-OUTPUT_TAIL:] if path.exists() else ""


def _outputs(out: pathlib.Path, world: int) -> Dict[int, str]:
    return {r: _output(out, r) for r in range(world)}


def launched_once(worker: str, runs: Sequence, *, timeout: float, in_order: bool = False,
                  name: str = "runs"):
    """A module-scoped fixture `name`: world -> Ranks, where `runs` lists
    (world, [scenario, ...]) and each launch runs once, when first asked
    for, in its own folder w{world} of one shared one. `in_order`: asking
    for a launch runs every launch listed before it first (a later one
    reads an earlier one's files, through the shared folder)."""
    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory):
        base = tmp_path_factory.mktemp(os.path.splitext(worker)[0])
        done: Dict[int, Ranks] = {}

        def run(world: int) -> Ranks:
            listed = [w for w, _ in runs]
            for each, scenarios in runs[:listed.index(world) + 1] if in_order else \
                    [runs[listed.index(world)]]:
                if each not in done:
                    done[each] = launch(worker, scenarios, each, base / f"w{each}",
                                        timeout=timeout)
            return done[world]
        return run
    return fixture


def assert_passed(ranks: Ranks, scenario: str) -> pathlib.Path:
    """Fails the test unless every rank passed `scenario` (its done marker,
    no error), quoting what each failed rank said: its first line, which
    names the scenario and the error, and its traceback's end. Returns the
    launch's folder."""
    world = len(ranks.codes)
    missing = [r for r in range(world) if not (ranks.out / f"done{r}_{scenario}").exists()]
    said = {r: "\n".join(text.splitlines()[:1] + text.splitlines()[-6:])
            for r, text in ranks.errors.items()}
    assert not missing, \
        f"{scenario} did not pass on ranks {missing} (exit codes {ranks.codes}): {said}"
    return ranks.out
