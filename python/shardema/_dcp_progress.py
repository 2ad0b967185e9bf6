"""The "progress" entries of EMA.state_dict() (_dcp.py): plain values,
equal on every rank, that DCP stores beside the EMA's tensors.

- "format": FORMAT, which says the dict is a shardema EMA's;
- "step", "initialized", "last_decay", "schedule", "roles": the engine's
  progress metadata (shardema.step, ...), each as its Python type;
- "profiles": with several profiles (EMA(schedules=[...])), the engine's
  shardema.profiles;
- "state_dict_names": how the EMA's tensors are the model's state_dict()
  keys, for a reader without the model (`shardema export` of a DCP
  folder, _dcp_folder.py): a JSON object {"aliases": {name: [other names]}
  (tied weights), "non_persistent": [names no state_dict key holds]},
  each part present only when not empty, and the entry only when one is.
  A state without it (a model with neither, or an older save) is one
  whose tensors are each one persistent key. Loads do not need it; DCP
  requires every entry the dict it loads into holds, so
  shardema.EMALoadPlanner drops it from that dict where the checkpoint
  lacks it (an older save of a tied model).

This module turns them into the engine's metadata and back, and reads
"state_dict_names" for the CLI.
"""
import json
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

FORMAT = "shardema.EMA/1"

# The engine's metadata keys of the progress, and the type each has here.
PROGRESS = {
    "step": ("shardema.step", int),
    "initialized": ("shardema.initialized", bool),
    "last_decay": ("shardema.last_decay", float),
    "schedule": ("shardema.schedule", str),
    "roles": ("shardema.roles", str),
}
# ...and the one an EMA of several profiles adds.
PROFILES = ("profiles", "shardema.profiles")
# The entry of the tensors' state_dict names.
STATE_DICT_NAMES = "state_dict_names"
#: The engine's metadata keys the progress holds (with the checksum that
#: covers them): what a load gives, not what identifies the EMA.
ENGINE_PROGRESS_KEYS = {key for key, _ in PROGRESS.values()} | {"shardema.state_xxh64",
                                                                PROFILES[1]}


def progress_of(metadata: Mapping[str, str],
                names: Mapping[str, Tuple[List[str], bool]]) -> Dict[str, Any]:
    """The progress entries of the engine's `metadata`, and of `names`
    (each tracked tensor's aliases and whether a state_dict key holds it)."""
    progress: Dict[str, Any] = {"format": FORMAT}
    for field_name, (key, kind) in PROGRESS.items():
        text = metadata[key]
        progress[field_name] = (text == "true") if kind is bool else kind(text)
    if PROFILES[1] in metadata:
        progress[PROFILES[0]] = metadata[PROFILES[1]]
    aliases = {name: list(others) for name, (others, _) in names.items() if others}
    transient = sorted(name for name, (_, persistent) in names.items() if not persistent)
    if aliases or transient:
        entry: Dict[str, Any] = {}
        if aliases:
            entry["aliases"] = aliases
        if transient:
            entry["non_persistent"] = transient
        progress[STATE_DICT_NAMES] = json.dumps(entry, sort_keys=True, separators=(",", ":"))
    return progress


def progress_metadata(progress: Any) -> Dict[str, str]:
    """The engine's metadata for `progress`, each field checked (a
    ValueError naming it)."""
    if not isinstance(progress, dict) or progress.get("format") != FORMAT:
        found = progress.get("format") if isinstance(progress, dict) else type(progress).__name__
        raise ValueError(f"shardema.EMA.load_state_dict: 'progress' is not a shardema EMA's "
                         f"(format {found!r}, expected {FORMAT!r})")
    out = {}
    for field_name, (key, kind) in PROGRESS.items():
        value = progress.get(field_name)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool)) or \
            (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"shardema.EMA.load_state_dict: progress '{field_name}' is "
                             f"{value!r}, expected {kind.__name__}")
        out[key] = ("true" if value else "false") if kind is bool else \
            repr(float(value)) if kind is float else str(value)
    if PROFILES[0] in progress:
        value = progress[PROFILES[0]]
        if not isinstance(value, str):
            raise ValueError(f"shardema.EMA.load_state_dict: progress 'profiles' is {value!r}, "
                             "expected str")
        out[PROFILES[1]] = value
    return out


def read_state_dict_names(text: Optional[Any], tensors: Set[str],
                          where: str) -> Tuple[Dict[str, List[str]], Set[str]]:
    """(aliases by tensor, non-persistent names) of a "state_dict_names"
    entry (None: absent, an older save: none of either), each name checked
    against `tensors`; a ValueError starting with `where` otherwise."""
    if text is None:
        return {}, set()
    try:
        entry = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        entry = None
    if not isinstance(entry, dict) or set(entry) - {"aliases", "non_persistent"}:
        raise ValueError(f"{where}: progress.{STATE_DICT_NAMES} is not the JSON object "
                         f"state_dict() writes: {str(text)[:80]!r}")
    aliases = entry.get("aliases", {})
    transient = entry.get("non_persistent", [])
    if not isinstance(aliases, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in aliases.values()):
        raise ValueError(f"{where}: progress.{STATE_DICT_NAMES}'s aliases are not lists of "
                         "names by tensor")
    if not isinstance(transient, list) or not all(isinstance(n, str) for n in transient):
        raise ValueError(f"{where}: progress.{STATE_DICT_NAMES}'s non_persistent is not a list "
                         "of names")
    for name in list(aliases) + transient:
        if name not in tensors:
            raise ValueError(f"{where}: progress.{STATE_DICT_NAMES} names '{name}', which is no "
                             "tensor of the EMA")
    return aliases, set(transient)
