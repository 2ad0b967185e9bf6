"""shardema.EMALoadPlanner: DCP's DefaultLoadPlanner for checkpoints that
hold an EMA state dict (_dcp.py) or lack one: an EMA the checkpoint lacks
is emptied, so its load_state_dict() cold-starts it, a progress entry an
older save lacks (state_dict_names) is left out of the load, and an EMA of
another number of profiles than the checkpoint's is refused before DCP
reads anything."""
import functools
from typing import Any, List, Tuple

from ._dcp_progress import FORMAT, STATE_DICT_NAMES


@functools.lru_cache(maxsize=None)
def planner_class() -> type:
    # Made on first use: torch.distributed.checkpoint takes most of a
    # second to import, which `import shardema` should not pay.
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class EMALoadPlanner(DefaultLoadPlanner):
        """DCP's DefaultLoadPlanner, except that an EMA state dict
        (EMA.state_dict(), or the EMA itself) whose entries the checkpoint
        lacks is emptied instead of refused: its load_state_dict() then
        cold-starts the EMA from the loaded weights, with a warning; and
        its progress's state_dict_names, which saves before it lack, is
        not asked of them. Every other key stays required (unless
        allow_partial_load=True)."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            if metadata is not None:
                for path, ema_state in _ema_states(state_dict):
                    key = ".".join(path + ("progress", "format"))
                    if key not in metadata.state_dict_metadata:
                        ema_state.clear()
                        continue
                    names = ".".join(path + ("progress", STATE_DICT_NAMES))
                    if names not in metadata.state_dict_metadata:
                        # An older save: nothing to load there, and
                        # load_state_dict() does not need it.
                        ema_state["progress"].pop(STATE_DICT_NAMES, None)
                    _check_saved_profiles(path, ema_state, metadata.state_dict_metadata)
            super().set_up_planner(state_dict, metadata, is_coordinator)

    EMALoadPlanner.__module__ = "shardema"
    return EMALoadPlanner


def _check_saved_profiles(path: Tuple[str, ...], ema_state: dict, saved: Any) -> None:
    """A checkpoint of another number of profiles than the EMA loading it:
    a ValueError naming both, before DCP reads anything (it would refuse
    the keys one lacks, and silently skip the ones the other lacks)."""
    def count(keys: Any) -> int:
        prefix = ".".join(path + ("profile_weights",)) + "."
        return 1 + len({k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)})
    here = 1 + len(ema_state.get("profile_weights", {}))
    there = count(saved)
    if here != there:
        raise ValueError(f"shardema.EMA.load_state_dict: the checkpoint's EMA at "
                         f"'{'.'.join(path)}' holds {there} profile{'s' if there != 1 else ''} "
                         f"but this EMA keeps {here} (schedules); build it with the schedules "
                         "it was saved with")


def _ema_states(state: Any, path: Tuple[str, ...] = ()) -> List[Tuple[Tuple[str, ...], dict]]:
    """(path, dict) of every EMA state dict nested in `state`."""
    found: List[Tuple[Tuple[str, ...], dict]] = []
    if not isinstance(state, dict):
        return found
    progress = state.get("progress")
    if isinstance(progress, dict) and progress.get("format") == FORMAT:
        return [(path, state)]
    for key, value in state.items():
        found += _ema_states(value, path + (str(key),))
    return found
