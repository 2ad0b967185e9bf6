"""EMACallback's checkpoints (VersatIL's lifecycle): on_save_checkpoint puts
the EMA in the checkpoint's state_dict and keeps the raw weights under
RAW_STATE_KEY (and the float32 EMA where the state_dict's dtype narrows
it); on_load_checkpoint puts the raw weights back into the model and
queues the EMA for on_fit_start. One file, DCP's distributed checkpoints
(each rank its rows) and FSDPStrategy's full state dicts. A base class of
EMACallback (_ema_callback.py)."""
from typing import Any, Dict, Optional, Tuple

import torch

from . import _C
from ._fsdp1 import fsdp1_full_tensors, fsdp1_load_full, fsdp1_non_persistent, fsdp1_root, \
    refuse_fsdp1_sharded_state
from ._lightning import submodule
from ._model import is_dtensor

def full_to_rows(value: torch.Tensor, like: Any) -> Any:
    """This rank's DTensor of a full tensor, sharded as `like` (a full
    checkpoint of a sharded model: every rank holds the whole file)."""
    from torch.distributed.tensor import distribute_tensor
    value = value.to(device=like.to_local().device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def raw_differences(raw: Dict[str, Any], names: Dict[str, str],
                     tracked: Dict[str, Any]) -> str:
    """Every way the checkpoint's raw weights (`raw`, by checkpoint key)
    differ from the model's tracked tensors (`names`: key -> tracked name),
    in one line; empty when they match. Full shapes: a DTensor's is the
    global one."""
    missing = sorted(set(names) - set(raw))
    unexpected = sorted(set(raw) - set(names))
    shapes, dtypes = [], []
    for key in sorted(set(raw) & set(names)):
        value, like = raw[key], tracked[names[key]]
        if tuple(value.shape) != tuple(like.shape):
            shapes.append(f"'{key}' {tuple(value.shape)} in the checkpoint, "
                          f"{tuple(like.shape)} in the model")
        if value.dtype != like.dtype:
            dtypes.append(f"'{key}' {value.dtype} in the checkpoint, {like.dtype} in the model")
    if not (missing or unexpected or shapes or dtypes):
        return ""
    parts = [f"missing {missing}, unexpected {unexpected}"]
    if shapes:
        parts.append("shape differs: " + "; ".join(shapes))
    if dtypes:
        parts.append("dtype differs: " + "; ".join(dtypes))
    return ", ".join(parts)


def ema_values_saved(names: Dict[str, str], kept: Dict[str, Any],
                      state: Optional[Dict[str, Any]], current: Dict[str, Any]
                      ) -> Dict[str, Any]:
    """The EMA a checkpoint holds, by EMA name (`names`: checkpoint key ->
    name): its float32 copy, else the state_dict's entry, else what the
    strategy loaded from the state_dict into the model (`current`, by
    name), cloned before the raw weights go into the model."""
    out: Dict[str, Any] = {}
    with torch.no_grad():
        for key, name in names.items():
            if key in kept:
                value = kept[key]
            elif state is not None and key in state:
                value = state[key]
            else:
                value = current[name]
            out[name] = value.clone()
    return out



class CheckpointHooks:
    """The checkpoint half of EMACallback (see EMACallback)."""

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        if self.ema is None:
            return
        if self.ema.swapped:
            raise RuntimeError("EMACallback.on_save_checkpoint: the EMA is swapped in for "
                               "validation; save outside validation so the raw weights are kept")
        state = checkpoint.setdefault("state_dict", {})
        prefix = self._prefix(pl_module)
        if self._root is not None:
            # FSDPStrategy(state_dict_type="full"): rank 0 holds the full
            # state dict, the other ranks an empty one; the EMA's names are
            # its keys.
            refuse_fsdp1_sharded_state("EMACallback.on_save_checkpoint", state,
                                        self._root_saved)
            tracked = {name: False for name in self._root_saved}
            keys = {name: name for name in tracked}
        else:
            tracked = {name: is_dtensor(tensor)
                       for name, tensor in self._tracked(self._target(pl_module)).items()}
            keys = {name: prefix + name for name in tracked}
        # Lightning's ModelParallelStrategy hands every rank a state dict of
        # DTensors when it saves a distributed (DCP) checkpoint, and rank 0
        # alone plain full tensors when it saves one file
        # (save_distributed_checkpoint=False); the other ranks get nothing.
        distributed = any(is_dtensor(state.get(keys[name]))
                          for name, sharded in tracked.items() if sharded)
        # What needs the full EMA: plain entries. In a distributed checkpoint
        # DTensor entries take this rank's rows (the EMA is never assembled
        # on one rank) and only replicated buffers are gathered; a one-file
        # checkpoint of a sharded model is written by rank 0, so only rank 0
        # receives. Decided from the model, so every rank enters the gather.
        gather = [name for name, sharded in tracked.items() if not (distributed and sharded)]
        rank0_only = (not distributed and any(tracked.values())) or self._root is not None
        profile = self.profile
        full = self.ema.full_state_dict(rank0_only=rank0_only, names=gather, profile=profile) \
            if gather else {}
        # A DTensor entry's EMA in its to_local() shape: this rank's rows of
        # a Shard(0) one, the whole of a Replicate() one (gathered, so every
        # rank asks for the same names).
        held = self.ema.ema_tensors([name for name, sharded in tracked.items() if sharded],
                                    profile=profile) if distributed else {}
        # The substitution itself is the C++ callback's (substituteEma): on
        # this rank's part of each entry (a DTensor's to_local()) and the EMA
        # by checkpoint key; it substitutes the entries that have both (a
        # rank that does not write the model has no full EMA), clones the raw
        # values (state_dict() entries alias the live parameters, which
        # async checkpoint IO would save a step later) and keeps the float32
        # EMA where the entry's dtype narrows it.
        placed: Dict[str, Any] = {}  # the DTensor entries, by key
        slots, emas = [], []
        for name, key in keys.items():
            if key not in state:
                continue
            value = state[key]
            if is_dtensor(value):
                placed[key] = value
                slots.append((key, value.to_local()))
            else:
                slots.append((key, value))
            ema = (held if is_dtensor(value) else full).get(name)
            if ema is not None:
                emas.append((key, ema))
        raw_kept = list(checkpoint.get(self.RAW_STATE_KEY) or ()) + \
            [key[len(self.RAW_STATE_KEY) + 1:] for key in state
             if key.startswith(f"{self.RAW_STATE_KEY}.")]
        # adopt_ema: ema_tensors() and full_state_dict() are fresh copies,
        # taken as they are rather than copied again.
        written, taken, narrowed = _C.substitute_ema(slots, emas, raw_kept, adopt_ema=True)

        def placed_like(key: str, local: torch.Tensor) -> Any:
            # A DTensor entry's result: this rank's part, with the entry's
            # mesh, placements, global shape and stride (uneven shards).
            like = placed.get(key)
            if like is None:
                return local
            from torch.distributed.tensor import DTensor
            return DTensor.from_local(local.to(like.to_local().device), like.device_mesh,
                                      like.placements, run_check=False, shape=like.shape,
                                      stride=like.stride())

        raw = {key: placed_like(key, value) for key, value in taken}
        kept = {key: placed_like(key, value) for key, value in narrowed}
        state.update({key: placed_like(key, value) for key, value in written if key in raw})
        if distributed:
            # Lightning saves the state_dict with DCP, each rank its rows,
            # and every other entry of the checkpoint from rank 0 alone:
            # the raw rows of the other ranks must travel in the state_dict.
            state.update({f"{self.RAW_STATE_KEY}.{key}": value for key, value in raw.items()})
            state.update({f"{self.EMA_FLOAT32_KEY}.{key}": value for key, value in kept.items()})
        else:
            checkpoint[self.RAW_STATE_KEY] = raw
            if kept:
                checkpoint[self.EMA_FLOAT32_KEY] = kept
        checkpoint[self.STATE_KEY] = {
            "started": self._started,
            "raw_in_state_dict": list(raw) if distributed else [],
            "float32_in_state_dict": list(kept) if distributed else [],
            # Which profile the state_dict holds, and every profile's
            # schedule: a resume into other profiles is refused by name.
            "profile": profile,
            "schedules": [s.to_json() for s in self._schedules],
        }
        if len(self._schedules) > 1:
            # One process or DDP (_refuse_sharded_profiles): every rank
            # holds the names of `gather` in full.
            checkpoint[self.EMA_PROFILES_KEY] = {
                str(p): {keys[n]: v for n, v in self.ema.full_state_dict(
                    rank0_only=rank0_only, names=gather, profile=p).items()}
                for p in range(len(self._schedules)) if p != profile}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        record = checkpoint.get(self.STATE_KEY) or {}
        raw = checkpoint.get(self.RAW_STATE_KEY)
        if not record and not raw:
            return
        root = self._root if self._root is not None else fsdp1_root(trainer, pl_module)
        if root is not None:
            self._load_fsdp1(root, pl_module, checkpoint, record, raw)
            return
        target = self._target(pl_module)
        prefix = self._prefix(pl_module)
        tracked = self._tracked(target)
        names = {prefix + name: name for name in tracked}
        # ModelParallelStrategy loads the state_dict into the model itself and
        # hands this hook the rest of the checkpoint, without "state_dict".
        state = checkpoint.get("state_dict")
        kept = checkpoint.get(self.EMA_FLOAT32_KEY) or {}
        if record.get("raw_in_state_dict"):
            raw, kept = self._entries_of_distributed(trainer, tracked, record, state, prefix)
        raw = raw or {}
        self._refuse_foreign_raw(raw_differences(raw, names, tracked))
        # The EMA: its float32 copy, else the state_dict's entry, else what
        # Lightning loaded from the state_dict into the model before this
        # hook. Read before the raw weights go into the model.
        ema_values = ema_values_saved(names, kept, state, tracked)
        profiles = self._saved_profiles(record, checkpoint, names)
        self._load_raw(target, tracked, {names[key]: value for key, value in raw.items()})
        self._resume_profiles = profiles
        self._resume_with(pl_module, record, ema_values)

    def _saved_profiles(self, record: Dict[str, Any], checkpoint: Dict[str, Any],
                        names: Dict[str, str]) -> Dict[int, Dict[str, Any]]:
        """The checkpoint's other profiles by index, by tracked name; a
        ValueError naming both when it was saved with other schedules or
        showed another profile (nothing loaded yet)."""
        here = [s.to_json() for s in self._schedules]
        saved = record.get("schedules")
        if saved is None:  # saved before profiles: one, of this schedule or not
            saved = here[:1] if len(here) == 1 else [None]
        # One profile on both sides: as before profiles, the schedule may
        # change on a resume (the callback's own arguments say it).
        same = len(saved) == len(here) == 1 or saved == here
        if not same or record.get("profile", 0) != self.profile:
            raise ValueError(f"EMACallback.on_load_checkpoint: the checkpoint holds {len(saved)} "
                             f"EMA profile{'s' if len(saved) != 1 else ''} (profile "
                             f"{record.get('profile', 0)} in its state_dict) but this callback "
                             f"keeps {len(here)} (profile {self.profile} shown); build it with "
                             "the schedules and profile it was saved with; nothing was loaded")
        stored = checkpoint.get(self.EMA_PROFILES_KEY) or {}
        return {int(p): {names.get(k, k): v for k, v in values.items()}
                for p, values in stored.items()}

    def _refuse_foreign_raw(self, differences: str) -> None:
        if differences:
            raise ValueError(
                f"EMACallback.on_load_checkpoint: the checkpoint's raw weights "
                f"({self.RAW_STATE_KEY}) are not those of this model"
                f"{f' attribute {self.attribute!r}' if self.attribute else ''}: "
                f"{differences}; nothing was loaded")

    def _resume_with(self, pl_module: Any, record: Dict[str, Any],
                     ema_values: Dict[str, Any]) -> None:
        """The EMA of a resume: loaded now, or at on_fit_start when it does
        not exist yet."""
        self._started = bool(record.get("started", True))
        if self.ema is None:
            self._resume_ema_state = ema_values
            return
        # Strategies that restore after setup (ModelParallelStrategy,
        # FSDPStrategy) load after on_fit_start: the EMA exists, and is
        # rebuilt when it would copy at its first update but the average
        # had started.
        if self.copy_on_first_update and self._started:
            self.ema = self._build(pl_module)
        self._load_ema(ema_values)

    def _load_fsdp1(self, root: torch.nn.Module, pl_module: Any, checkpoint: Dict[str, Any],
                    record: Dict[str, Any], raw: Optional[Dict[str, Any]]) -> None:
        """on_load_checkpoint under FSDPStrategy's FSDP1 root: the strategy
        has loaded the full checkpoint on every rank and put its state_dict
        (the EMA, by on_save_checkpoint) into the model; the raw weights go
        back into the model and the EMA takes what the model held.
        Collective (the full parameters are gathered and written back)."""
        submodule("EMACallback", pl_module, self.attribute)
        kept_names, _ = self._fsdp1_saved(root)
        transient = fsdp1_non_persistent(root)
        saved = [n for n in kept_names if n not in transient]
        names = {name: name for name in saved}
        current = fsdp1_full_tensors(root, saved)
        raw = raw or {}
        self._refuse_foreign_raw(raw_differences(raw, names, current))
        state = checkpoint.get("state_dict")
        kept = checkpoint.get(self.EMA_FLOAT32_KEY) or {}
        ema_values = ema_values_saved(names, kept, state, current)
        fsdp1_load_full(root, raw)
        self._resume_with(pl_module, record, ema_values)

    def _entries_of_distributed(self, trainer: Any, tracked: Dict[str, Any],
                                record: Dict[str, Any], state: Optional[Dict[str, Any]],
                                prefix: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """The raw weights and float32 EMA that on_save_checkpoint put in a
        distributed checkpoint's state_dict: from the dict when it is there,
        else read (DCP, each rank its rows) from trainer.ckpt_path."""
        wanted = {f"{self.RAW_STATE_KEY}.{key}": ("raw", key)
                  for key in record["raw_in_state_dict"]}
        wanted.update({f"{self.EMA_FLOAT32_KEY}.{key}": ("kept", key)
                       for key in record.get("float32_in_state_dict", [])})
        if state is None or not all(k in state for k in wanted):
            path = getattr(trainer, "ckpt_path", None)
            if not path:
                raise ValueError("EMACallback.on_load_checkpoint: the raw weights are in the "
                                 "distributed checkpoint's state_dict, which is not in the dict "
                                 "handed to this hook, and trainer.ckpt_path does not say where "
                                 "the checkpoint is")
            from torch.distributed.checkpoint import load as load_distributed
            state = {}
            for entry, (kind, key) in wanted.items():
                like = tracked.get(key[len(prefix):])
                if like is None:
                    raise ValueError(f"EMACallback.on_load_checkpoint: the checkpoint holds "
                                     f"'{entry}' but the model has no '{key[len(prefix):]}'")
                state[entry] = torch.empty_like(like, dtype=torch.float32 if kind == "kept"
                                                else like.dtype)
            load_distributed({"state_dict": state}, checkpoint_id=path)
        raw = {key: state[entry] for entry, (kind, key) in wanted.items() if kind == "raw"}
        kept = {key: state[entry] for entry, (kind, key) in wanted.items() if kind == "kept"}
        return raw, kept

    def _load_raw(self, target: torch.nn.Module, tracked: Dict[str, Any],
                  values: Dict[str, Any]) -> None:
        for name, value in values.items():
            if is_dtensor(tracked[name]) and not is_dtensor(value):
                values[name] = full_to_rows(value, tracked[name])
        result = target.load_state_dict(values, strict=False)
        if result is not None and result.unexpected_keys:
            raise ValueError("EMACallback.on_load_checkpoint: the model did not take the raw "
                             f"weights {sorted(result.unexpected_keys)}")

    def _load_ema(self, values: Dict[str, Any]) -> None:
        """The EMA from a checkpoint's values: DTensors hold this rank's
        rows, plain tensors the full EMA; every tensor must be taken."""
        assert self.ema is not None
        try:
            # Not strict: the EMA also tracks non-persistent buffers, which
            # no checkpoint holds; they keep the EMA built from the model.
            self.ema.load_ema_values(values, strict=False, profile=self.profile)
            for p, more in self._resume_profiles.items():
                self.ema.load_ema_values(more, strict=False, profile=p)
            self._resume_profiles = {}
        except ValueError as error:
            raise ValueError(f"EMACallback: the checkpoint's EMA does not match the tracked "
                             f"tensors: {error}") from None

