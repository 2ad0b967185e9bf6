"""Two processes on Gloo, one of which dies (SIGKILL-like exit) or stops
(SIGSTOP) before a collective of the EMA (issue 23): the survivor raises
within the EMA's timeout with one line naming the collective, leaves the
process group at once although the torch group's own timeout is 30
minutes, and its process ends normally."""
import json
import re

import pytest

import rank_launch

BACKTRACE = re.compile(r"Exception raised from|frame #\d")
# What the bounds below are for: a survivor that waits for the dead or
# stopped peer, which only the torch group's timeout (30 minutes) would end.
# They are not speed targets. On a busy 2-core machine (load 16: two
# spinning processes beside other jobs) the survivor left the group in
# 0.02 s but took up to 10.4 s to leave the interpreter (torch, Gloo and
# the EMA torn down while other processes held both cores; the 2 s bound
# this test had failed 8 of 8 cases there), and at load 8.5 raised 0.13 s
# past the EMA's timeout. Each bound is ten times the worst seen or more,
# and still 15 times shorter than the group's timeout; LAUNCH, the wait
# for the whole run (start-up, the EMA's timeout, both bounds), ends a
# survivor that hangs longer.
RAISE_SLACK = 30.0  # past the EMA's timeout, before the op raised
LEAVE_BOUND = 120.0  # each of: del ema + destroy_process_group(); the interpreter's exit
LAUNCH = 400.0


@pytest.mark.parametrize("op", ["save_checkpoint", "load_checkpoint", "swap", "full_state_dict"])
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_the_survivor_raises_in_time_and_exits_at_once(mode, op, tmp_path):
    # Only rank 0 is waited for: rank 1 is gone or stopped for good.
    ranks = rank_launch.launch("peer_failure_worker.py", mode, 2, tmp_path, args=[op],
                               timeout=LAUNCH, wait_for=[0])
    assert ranks.codes[0] == 0, f"rank 0 exited with {ranks.codes[0]}: {ranks.errors.get(0)}"
    report = json.loads((tmp_path / "rank0.json").read_text())
    error = report["error"]
    assert error is not None, "the collective returned although rank 1 was gone"
    assert error.startswith("RuntimeError") or error.startswith("ValueError"), error
    assert not BACKTRACE.search(error) and "\n" not in error, error
    assert "rank" in error, error
    assert report["raised_after"] <= report["timeout"] + RAISE_SLACK, report
    if mode == "stop":
        # A stopped peer keeps its sockets open: only the timeout can end it.
        assert report["raised_after"] >= report["timeout"] * 0.9, report
    assert report["destroy_seconds"] < LEAVE_BOUND, report
    # The interpreter's shutdown (Gloo threads, the EMA's pool) ends at once too.
    assert ranks.exited_at[0] - report["reported_at"] < LEAVE_BOUND, (ranks.exited_at, report)
