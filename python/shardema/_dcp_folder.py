"""The EMA in a torch.distributed.checkpoint (DCP) folder, for the `shardema`
command line (_cli.py).

DCP's format is torch's (a pickled .metadata plus .distcp data files), so
torch's own reader reads it, in one process, into full tensors: the EMA that
EMA.state_dict() put under some key ("ema" in the docs: entries
"ema.weights.<name>" and "ema.progress.<field>", and with several profiles
"ema.profile_weights.<p>.<name>"). The engine then takes it
as EMA.load_state_dict() would, which checks the progress (schedule, roles,
step) and every tensor, and writes it as a one-rank per-rank checkpoint,
which the CLI's own export and inspect read (tools/): each command lives
once, in C++.

What it costs: the EMA is held in memory twice (the tensors DCP read and
the engine's copy) and written once more to a temporary folder; torch's
reader unpickles .metadata and the progress values, so read only
checkpoints you trust, as with torch.distributed.checkpoint itself.
"""
import json
import os
import warnings
from typing import Any, Dict, List, Tuple

import torch

from ._dcp_progress import FORMAT, PROGRESS, STATE_DICT_NAMES, read_state_dict_names

# The progress fields EMA.state_dict() writes (and "format"); an older one
# lacks STATE_DICT_NAMES, as does one with no tied or non-persistent tensor.
_FIELDS = ("format",) + tuple(PROGRESS)


class FolderError(ValueError):
    """A DCP folder the CLI cannot read: one line naming the file."""


def is_dcp_folder(path: str) -> bool:
    """Whether `path` is a folder DCP wrote (or began to): its .metadata,
    which DCP writes last, or .distcp data files."""
    if not os.path.isdir(path):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return ".metadata" in names or any(n.endswith(".distcp") for n in names)


def _quiet_load(state: Dict[str, Any], reader: Any, folder: str, what: str) -> None:
    """dcp.load in this process; any failure a FolderError naming `what`
    and the cause (DCP wraps it in a CheckpointException, a BaseException
    whose text is a traceback)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with warnings.catch_warnings():
            # DCP says it loads in a single process, which is what we ask for.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:
        causes = list(getattr(error, "failures", {}).values())
        cause = causes[0][0] if causes and isinstance(causes[0], tuple) else \
            causes[0] if causes else error
        text = str(cause).strip().splitlines()
        raise FolderError(f"{folder}: {what} do not read ({type(cause).__name__}"
                          f"{': ' + text[0] if text else ''})") from None


class DcpEma:
    """The one shardema EMA of a DCP folder: its key, progress and tensors'
    shapes, read on construction; values on demand."""

    def __init__(self, folder: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        self.folder = folder
        metadata_path = os.path.join(folder, ".metadata")
        if not os.path.isfile(metadata_path):
            raise FolderError(f"{metadata_path}: missing: not a complete torch.distributed."
                              "checkpoint (DCP) save (DCP writes it last)")
        self._reader = FileSystemReader(folder)
        try:
            entries = self._reader.read_metadata().state_dict_metadata
        except Exception as error:  # a truncated or foreign pickle: anything
            raise FolderError(f"{metadata_path}: not DCP metadata torch reads "
                              f"({type(error).__name__}: {error})") from None
        self.key = self._ema_key(entries, metadata_path)
        prefix = self.key + "." if self.key else ""
        self.progress = self._read_progress(prefix, entries, metadata_path)
        weights = prefix + "weights."
        self.tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        for key, entry in entries.items():
            if key.startswith(weights):
                if not isinstance(entry, TensorStorageMetadata):
                    raise FolderError(f"{metadata_path}: '{key}' is not a tensor")
                self.tensors[key[len(weights):]] = (tuple(entry.size), entry.properties.dtype)
        # EMA(schedules=[...]): each further profile's averaged tensors,
        # "<key>.profile_weights.<p>.<name>" (_dcp.py).
        more = prefix + "profile_weights."
        self.profile_tensors: Dict[str, Dict[str, Tuple[Tuple[int, ...], torch.dtype]]] = {}
        for key, entry in entries.items():
            if key.startswith(more):
                if not isinstance(entry, TensorStorageMetadata):
                    raise FolderError(f"{metadata_path}: '{key}' is not a tensor")
                profile, _, name = key[len(more):].partition(".")
                self.profile_tensors.setdefault(profile, {})[name] = \
                    (tuple(entry.size), entry.properties.dtype)
        roles = self.roles()
        for name in sorted(set(roles) ^ set(self.tensors)):
            where = "the progress's roles" if name in roles else f"'{weights}{name}'"
            raise FolderError(f"{metadata_path}: tensor '{name}' is in {where} only, not in both "
                              "(an EMA's entries of another save, or a partial one)")
        try:
            #: Each tensor's other state_dict names (tied weights), and the
            #: names no state_dict key holds (non-persistent buffers): none
            #: for an older save, whose export keeps every tensor under its name.
            self.aliases, self.non_persistent = read_state_dict_names(
                self.progress.get(STATE_DICT_NAMES), set(self.tensors), metadata_path)
        except ValueError as error:
            raise FolderError(str(error)) from None

    @staticmethod
    def _ema_key(entries: Dict[str, Any], metadata_path: str) -> str:
        """The key the EMA's state sits under ("" for a top-level one)."""
        suffix = "progress.format"
        keys = sorted(k[:-len(suffix)].rstrip(".") for k in entries
                      if k == suffix or k.endswith("." + suffix))
        if not keys:
            tops = sorted({k.split(".", 1)[0] for k in entries})
            raise FolderError(f"{metadata_path}: holds no shardema EMA (no '<key>.progress.format' "
                              f"entry; its top-level keys: {', '.join(tops[:8]) or 'none'})")
        if len(keys) > 1:
            raise FolderError(f"{metadata_path}: holds {len(keys)} EMA states (under "
                              f"{', '.join(repr(k) for k in keys)}); the CLI reads a folder with "
                              "one (load the one you want with EMA.load_state_dict and "
                              "save_checkpoint it)")
        return keys[0]

    def _read_progress(self, prefix: str, entries: Dict[str, Any],
                       metadata_path: str) -> Dict[str, Any]:
        several = f"{prefix}progress.profiles" in entries  # EMA(schedules=[...])
        keys = {field: f"{prefix}progress.{field}"
                for field in _FIELDS + (("profiles",) if several else ())}
        missing = [key for key in keys.values() if key not in entries]
        if missing:
            raise FolderError(f"{metadata_path}: the EMA's '{missing[0]}' is missing")
        if f"{prefix}progress.{STATE_DICT_NAMES}" in entries:
            keys[STATE_DICT_NAMES] = f"{prefix}progress.{STATE_DICT_NAMES}"
        state: Dict[str, Any] = {key: None for key in keys.values()}
        _quiet_load(state, self._reader, self.folder, "its EMA's progress values")
        progress = {field: state[key] for field, key in keys.items()}
        if progress["format"] != FORMAT:
            raise FolderError(f"{metadata_path}: '{keys['format']}' is {progress['format']!r}, "
                              f"not {FORMAT!r}")
        return progress

    def roles(self) -> Dict[str, str]:
        try:
            roles = json.loads(self.progress["roles"])
        except (TypeError, ValueError):
            roles = None
        if not isinstance(roles, dict) or not all(isinstance(v, str) for v in roles.values()):
            raise FolderError(f"{self.folder}: the EMA's progress.roles is not a JSON object of "
                              f"roles: {str(self.progress['roles'])[:80]!r}")
        return roles

    def values(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
        """Every EMA tensor, full, read through torch's reader: profile 0's
        by name, and each further profile's by profile and name."""
        prefix = self.key + "." if self.key else ""
        wanted = {f"{prefix}weights.{name}": ("", name, spec) for name, spec in self.tensors.items()}
        for p, tensors in self.profile_tensors.items():
            wanted.update({f"{prefix}profile_weights.{p}.{name}": (p, name, spec)
                           for name, spec in tensors.items()})
        state = {key: torch.empty(shape, dtype=dtype)
                 for key, (_, _, (shape, dtype)) in wanted.items()}
        _quiet_load(state, self._reader, self.folder, "its EMA's tensors")
        weights: Dict[str, torch.Tensor] = {}
        more: Dict[str, Dict[str, torch.Tensor]] = {}
        for key, (p, name, _) in wanted.items():
            (more.setdefault(p, {}) if p else weights)[name] = state[key]
        return weights, more

    def engine_checked(self) -> Any:
        """An EMA of one process holding this one, loaded through
        EMA.load_state_dict(): the engine's checks of the progress and of
        every tensor. Its schedule is the saved one."""
        from . import _C
        from ._ema import EMA
        try:
            schedule = _C.DecaySchedule.from_json(str(self.progress["schedule"]))
        except Exception as error:
            raise FolderError(f"{self.folder}: the EMA's progress.schedule does not read "
                              f"({error})") from None
        schedules = [schedule]
        if "profiles" in self.progress:
            try:
                schedules = [_C.DecaySchedule.from_json(json.dumps(entry["schedule"]))
                             for entry in json.loads(str(self.progress["profiles"]))]
            except Exception as error:
                raise FolderError(f"{self.folder}: the EMA's progress.profiles does not read "
                                  f"({error})") from None
        values, more = self.values()
        roles = self.roles()
        # FSDP2 rows of one rank, i.e. everything: what export --world-size
        # then splits as FSDP2 does (which DDP's replicated layout matches).
        # The aliases and non-persistent marks go into the checkpoint's
        # manifest, so its export holds the model's state_dict() keys.
        try:
            shards: List[Any] = [
                _C.LocalShard(v.detach().reshape(-1),
                              _C.layout_spec(name, list(v.shape), v.dtype, "fsdp2", 1),
                              roles[name], aliases=self.aliases.get(name, []),
                              persistent=name not in self.non_persistent)
                for name, v in values.items()]
            ema = EMA.from_local_shards(shards, schedules=schedules)
            # Each tensor as this EMA holds it: its one rank's flat piece.
            pieces = {name: shard.local for name, shard in zip(values, shards)}
            state = {"weights": pieces, "progress": dict(self.progress)}
            if more:
                state["profile_weights"] = {
                    p: {name: v.detach().reshape(-1) for name, v in tensors.items()}
                    for p, tensors in more.items()}
            ema.load_state_dict(state)
        except (ValueError, TypeError, RuntimeError) as error:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise FolderError(f"{self.folder}: its EMA does not load: {message}") from None
        return ema
