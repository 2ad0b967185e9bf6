"""The rank side of rank_launch.py: the one entry of every multi-rank
worker script, which ends in `rank_worker.main(SCENARIOS)`. A rank is
started as

    WORKER.py SCENARIO[,SCENARIO...] RANK WORLD PORT OUT [ARG...]

joins the default process group over Gloo on 127.0.0.1:PORT (unless the
scenario's framework starts it itself from torchrun's environment, which
the launcher then sets: Lightning), and runs each named scenario as
SCENARIOS[name](rank, world, out, *args). Each scenario is reported to the
test through files in OUT, the launcher's only channel from the ranks:
done{rank}_{name} when it passed, error{rank}_{name}.txt (what was raised,
its message, the traceback) when it raised. A rank whose scenario raised
ends at once with os._exit(3), so no interpreter shutdown (process group
and EMA destructors after a failed collective) can hang or mask it; the
later scenarios of the launch do not run.

Between scenarios the ranks meet (a barrier), so each starts in step and
no rank leaves while a peer still reads from it; a scenario after which
the group is out of step on purpose (a collective abandoned, a rank that
raised alone or killed itself) is named in `out_of_step`. A rank that
passed everything ends with os._exit(0), unless `exit_normally`: then it
returns, and the interpreter's own shutdown is part of what the test sees
(test_peer_failure.py, test_clean_exit.py)."""
import contextlib
import datetime
import os
import sys
import traceback
from typing import Callable, Dict, Iterable, Iterator, Optional

#: What a rank whose scenario raised exits with.
FAILED = 3


@contextlib.contextmanager
def errors_reported(rank: int, out: str, scenario: str) -> Iterator[None]:
    """Whatever the block raises goes to error{rank}_{scenario}.txt, then
    the process ends with FAILED."""
    try:
        yield
    except BaseException as error:  # reported to the test through the file
        with open(os.path.join(out, f"error{rank}_{scenario}.txt"), "w") as f:
            f.write(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAILED)


def main(scenarios: Dict[str, Callable[..., None]], *, group_timeout: Optional[float] = 60,
         start_group: bool = True, out_of_step: Iterable[str] = (),
         exit_normally: bool = False) -> None:
    """Runs the scenarios named in sys.argv (see the module's docstring).
    `group_timeout`: the default group's timeout in seconds (None: torch's
    own, 30 minutes); `start_group=False`: the scenarios' framework starts
    the group (Lightning)."""
    names, rank, world, port, out = sys.argv[1].split(","), int(sys.argv[2]), \
        int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    args = sys.argv[6:]
    unknown = [name for name in names if name not in scenarios]
    with errors_reported(rank, out, names[0]):
        if unknown:
            raise ValueError(f"{os.path.basename(sys.argv[0])} has no scenario "
                             f"{', '.join(unknown)}; it has {', '.join(scenarios)}")
    import torch.distributed as dist
    if start_group:
        timeout = {} if group_timeout is None else \
            {"timeout": datetime.timedelta(seconds=group_timeout)}
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, **timeout)
    for name in names:
        with errors_reported(rank, out, name):
            scenarios[name](rank, world, out, *args)
            if name not in out_of_step and dist.is_initialized():
                dist.barrier()
        open(os.path.join(out, f"done{rank}_{name}"), "w").close()
    sys.stdout.flush()
    sys.stderr.flush()
    if not exit_normally:
        os._exit(0)
