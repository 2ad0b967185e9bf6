"""The rank side of rank_launch.py: a worker's failure goes to the test as
a file (error{rank}.txt, or error{rank}_{scenario}.txt), and the rank ends
at once with os._exit, so no interpreter shutdown (process group and EMA
destructors after a failed collective) can hang or mask it."""
import contextlib
import os
import sys
import traceback
from typing import Iterator, Optional


@contextlib.contextmanager
def errors_reported(rank: int, out: str, scenario: Optional[str] = None) -> Iterator[None]:
    try:
        yield
    except BaseException as error:  # reported to the test through the file
        name = f"error{rank}.txt" if scenario is None else f"error{rank}_{scenario}.txt"
        label = "" if scenario is None else f"{scenario}: "
        with open(os.path.join(out, name), "w") as f:
            f.write(f"{label}{type(error).__name__}: {error}\n{traceback.format_exc()}")
        sys.stdout.flush()
        os._exit(3)
