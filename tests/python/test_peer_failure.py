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
SLACK = 2.0  # process scheduling on a loaded 2-core CI machine


@pytest.mark.parametrize("op", ["save_checkpoint", "load_checkpoint", "swap", "full_state_dict"])
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_the_survivor_raises_in_time_and_exits_at_once(mode, op, tmp_path):
    # Only rank 0 is waited for: rank 1 is gone or stopped for good.
    ranks = rank_launch.launch("peer_failure_worker.py", mode, 2, tmp_path, args=[op],
                               timeout=120, wait_for=[0])
    assert ranks.codes[0] == 0, f"rank 0 exited with {ranks.codes[0]}: {ranks.errors.get(0)}"
    report = json.loads((tmp_path / "rank0.json").read_text())
    error = report["error"]
    assert error is not None, "the collective returned although rank 1 was gone"
    assert error.startswith("RuntimeError") or error.startswith("ValueError"), error
    assert not BACKTRACE.search(error) and "\n" not in error, error
    assert "rank" in error, error
    assert report["raised_after"] <= report["timeout"] + SLACK, report
    if mode == "stop":
        # A stopped peer keeps its sockets open: only the timeout can end it.
        assert report["raised_after"] >= report["timeout"] * 0.9, report
    assert report["destroy_seconds"] < SLACK, report
    # The interpreter's shutdown (Gloo threads, the EMA's pool) ends at once too.
    assert ranks.exited_at[0] - report["reported_at"] < SLACK, (ranks.exited_at, report)
