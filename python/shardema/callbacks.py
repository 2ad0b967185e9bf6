"""The two reference callbacks as drop-ins, over shardema's engine.

EMACallback: VersatIL's Lightning EMACallback (a warmup EMA updated on
optimizer steps only, checkpoints that hold the EMA with the raw weights
kept for resume, the validation swap). DDPPostHocEMACallback: FastVideo's
DDPPostHocEMACallback (nitrous post-hoc EMA on rank 0 under DDP), with a
sharded layout. Both are Callbacks of `lightning` and of
`pytorch_lightning` at once (each installed one), so either Trainer takes
them; without Lightning they work with any trainer object that carries the
attributes they read (global_step, accumulate_grad_batches, is_last_batch).
"""
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _C
from ._ema import EMA
from ._fsdp1 import reshard_fsdp1
from ._model import is_dtensor, module_tensors, unwrap
from ._posthoc import start_engine


def _callback_bases() -> Tuple[type, ...]:
    # `lightning` (lightning.pytorch) and `pytorch_lightning` are separate
    # packages with separate Callback classes, and each Trainer expects its
    # own (pytorch_lightning's takes callbacks=cb only for its Callback).
    # Both are plain classes with the same no-op hooks, so one class can
    # subclass both and serve either Trainer.
    bases: List[type] = []
    try:
        from lightning.pytorch import Callback
        bases.append(Callback)
    except ImportError:
        pass
    try:
        from pytorch_lightning import Callback as PytorchLightningCallback
        bases.append(PytorchLightningCallback)
    except ImportError:
        pass
    return tuple(bases) or (object,)


_CALLBACK_BASES = _callback_bases()


def _optimizer_stepped(trainer: Any, batch_idx: int) -> bool:
    """The C++ callbacks' rule (optimizerStepped, ema_callback.h): the end of
    an accumulation window, or the epoch's last batch."""
    return _C.optimizer_stepped(int(batch_idx), int(trainer.accumulate_grad_batches),
                                bool(trainer.is_last_batch))


def _reshard(module: Any) -> None:
    """Drops the gathered parameters of the FSDP2 modules in `module`. The
    root of an FSDP2 model keeps its parameters gathered after a forward
    (for the backward), and a forward reuses gathered parameters as they
    are: after a swap wrote into the sharded rows, they would still hold the
    values of before. Local, no communication."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    if isinstance(module, torch.nn.Module):
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def _fsdp1_root(trainer: Any, pl_module: Any) -> Any:
    """The FSDP1 root (FullyShardedDataParallel) that Lightning's
    FSDPStrategy wraps `pl_module` in (trainer.strategy.model), or None.
    ValueError when the root is there but does not wrap `pl_module`
    itself: the names of the state dict (Lightning's keys) are then not the
    LightningModule's."""
    root = getattr(getattr(trainer, "strategy", None), "model", None)
    if root is None or root is pl_module or not isinstance(root, torch.nn.Module):
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without torch.distributed
        return None
    if not isinstance(root, FullyShardedDataParallel):
        return None
    if getattr(root, "module", None) is not pl_module:
        raise ValueError("trainer.strategy.model is an FSDP1 root (FullyShardedDataParallel) "
                         f"that does not wrap the LightningModule ({type(pl_module).__name__}) "
                         "directly; the callbacks follow FSDPStrategy's root around the "
                         "LightningModule")
    return root


def _submodule(owner: str, pl_module: Any, attribute: Optional[str]) -> torch.nn.Module:
    """pl_module's `attribute`, or pl_module itself; ValueError naming the
    attribute when it is not an nn.Module."""
    if not attribute:
        return pl_module
    target = getattr(pl_module, attribute, None)
    if not isinstance(target, torch.nn.Module):
        raise ValueError(f"{owner}: attribute {attribute!r} of {type(pl_module).__name__} is not "
                         f"an nn.Module (got {type(target).__name__})")
    return target


def _fsdp1_names(root: torch.nn.Module, policy: str, prefix: str) -> Tuple[List[str], List[str]]:
    """(the names under `prefix`, the others) of what shardema.EMA tracks of
    FSDP1 root `root`: FSDP1's clean names, which are Lightning's
    state_dict keys (the root wraps the LightningModule)."""
    names = [t.name for t in module_tensors(root, policy)]
    return [n for n in names if n.startswith(prefix)], \
        [n for n in names if not n.startswith(prefix)]


def _fsdp1_non_persistent(root: torch.nn.Module) -> set:
    """The clean names of root's non-persistent buffers (in no state dict)."""
    from ._fsdp1 import clean_name
    return {clean_name(f"{prefix}.{b}" if prefix else b) for prefix, m in root.named_modules()
            for b in getattr(m, "_non_persistent_buffers_set", ())}


def _fsdp1_full_tensors(root: torch.nn.Module, names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The full values of `names` in FSDP1 root `root` (parameters gathered,
    buffers this rank's), fresh copies on every rank. Collective."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from ._fsdp1 import clean_name
    wanted = set(names)
    out: Dict[str, torch.Tensor] = {}
    with FullyShardedDataParallel.summon_full_params(root, writeback=False):
        for name, tensor in list(root.named_parameters()) + list(root.named_buffers()):
            name = clean_name(name)
            if name in wanted and name not in out:
                out[name] = tensor.detach().clone()
    return out


def _fsdp1_load_full(root: torch.nn.Module, values: Dict[str, torch.Tensor]) -> None:
    """Writes full tensors (by clean name) into FSDP1 root `root`: each rank
    keeps its part of the parameters (summon_full_params writes back into
    the flat shards), the buffers whole. Every rank passes the same values.
    Collective."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from ._fsdp1 import clean_name
    with torch.no_grad(), FullyShardedDataParallel.summon_full_params(root, writeback=True):
        for name, tensor in list(root.named_parameters()) + list(root.named_buffers()):
            value = values.get(clean_name(name))
            if value is not None:
                tensor.copy_(value)


def _refuse_fsdp1_sharded_state(api: str, state: Dict[str, Any], keys: Sequence[str]) -> None:
    """ValueError for a sharded FSDP1 state dict (FSDPStrategy(
    state_dict_type="sharded")): its entries are FSDP1's row chunks of each
    parameter, while each rank's EMA is a range of a flattened shard, so
    neither this rank's EMA nor the full one can be put in them."""
    for key in keys:
        value = state.get(key)
        if value is None:
            continue
        if is_dtensor(value) or type(value).__name__ == "ShardedTensor":
            raise ValueError(f"{api}: '{key}' is a {type(value).__name__}: the FSDP1 state dict is "
                             "sharded (FSDPStrategy(state_dict_type='sharded')), which the EMA "
                             "cannot fill (each rank keeps a range of a flattened parameter, "
                             "not FSDP1's row chunks). Use FSDPStrategy(state_dict_type='full')")


def _full_to_rows(value: torch.Tensor, like: Any) -> Any:
    """This rank's DTensor of a full tensor, sharded as `like` (a full
    checkpoint of a sharded model: every rank holds the whole file)."""
    from torch.distributed.tensor import distribute_tensor
    value = value.to(device=like.to_local().device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def _raw_differences(raw: Dict[str, Any], names: Dict[str, str],
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


def _ema_values_saved(names: Dict[str, str], kept: Dict[str, Any],
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


class EMACallback(*_CALLBACK_BASES):  # type: ignore[misc]
    """Warmup EMA of the LightningModule (or of its `attribute`, e.g.
    "policy"), in pinned host memory, sharded as the module is.

    schedule: another DecaySchedule (e.g. DecaySchedule.constant(0.999,
    update_every=2)) instead of the warmup that power, inv_gamma, min_value
    and max_value describe (give one or the other). update_after_step: the
    average starts after this optimizer step; in the warmup it is the
    schedule's own (decay 0, the weights copied, up to step
    update_after_step + 1), with another schedule the steps up to it are
    skipped. copy_on_first_update: the first due update copies the weights
    (Lightning's EMAWeightAveraging, ema-pytorch) instead of averaging with
    the weights at fit start (VersatIL, the default)."""

    #: Where the raw (online) weights are kept: a key of the checkpoint; in a
    #: distributed (DCP) checkpoint, a prefix of its state_dict keys, so
    #: each rank's rows are saved.
    RAW_STATE_KEY = "raw_policy_state_dict"
    #: The EMA as kept (float32) where state_dict's copy was narrowed to the
    #: model's dtype (bf16 and fp16 models), so a resume loses nothing; a
    #: key or a state_dict prefix as RAW_STATE_KEY.
    EMA_FLOAT32_KEY = "ema_state_dict_float32"
    #: The callback's own record: whether the average had started, and
    #: which state_dict entries of a distributed checkpoint are its own.
    STATE_KEY = "shardema_ema"

    _WARMUP_DEFAULTS = {"power": 0.75, "inv_gamma": 1.0, "min_value": 0.0, "max_value": 0.9999}

    def __init__(self, power: float = 0.75, update_after_step: int = 0, inv_gamma: float = 1.0,
                 min_value: float = 0.0, max_value: float = 0.9999,
                 attribute: Optional[str] = None, *, schedule: Optional["_C.DecaySchedule"] = None,
                 copy_on_first_update: bool = False, storage: str = "pinned_host",
                 layout: str = "auto", process_group: Any = None) -> None:
        super().__init__()
        self.power = power
        self.update_after_step = update_after_step
        self.inv_gamma = inv_gamma
        self.min_value = min_value
        self.max_value = max_value
        self.attribute = attribute
        self.copy_on_first_update = bool(copy_on_first_update)
        self.decay = 0.0
        self.ema: Optional[EMA] = None
        self._storage = storage
        self._layout = layout
        self._process_group = process_group
        self._resume_ema_state: Optional[Dict[str, Any]] = None
        # FSDPStrategy's FSDP1 root around the LightningModule (on_fit_start),
        # which the EMA is built over, and the names (Lightning's keys) of
        # what it averages that a state dict holds; None without FSDP1.
        self._root: Any = None
        self._root_saved: List[str] = []
        # Whether a due update has been folded in: a resumed average has
        # started, so its first update after the resume must not copy.
        self._started = False
        self._own_schedule = schedule is not None
        if schedule is None:
            # Validates the options now, as the seed's constructor stores them.
            self._schedule = _C.DecaySchedule.warmup(
                inv_gamma=inv_gamma, power=power, min_value=min_value, max_value=max_value,
                update_after_step=update_after_step)
        else:
            if not isinstance(schedule, _C.DecaySchedule):
                raise TypeError("EMACallback: schedule must be a shardema.DecaySchedule, got "
                                f"{type(schedule).__name__}")
            given = {k: v for k, v in (("power", power), ("inv_gamma", inv_gamma),
                                       ("min_value", min_value), ("max_value", max_value))
                     if v != self._WARMUP_DEFAULTS[k]}
            if given:
                raise ValueError(f"EMACallback: {sorted(given)} shape the warmup schedule; with "
                                 "schedule= give none of them")
            if int(update_after_step) < 0:
                raise ValueError("EMACallback: update_after_step must be >= 0, got "
                                 f"{update_after_step}")
            self._schedule = schedule

    def _target(self, pl_module: Any) -> torch.nn.Module:
        return getattr(pl_module, self.attribute) if self.attribute else pl_module

    def _prefix(self) -> str:
        return f"{self.attribute}." if self.attribute else ""

    def _build(self, pl_module: Any) -> EMA:
        if self._root is not None:
            return self._build_fsdp1()
        return EMA(self._target(pl_module), schedule=self._schedule, policy="versatil",
                   storage=self._storage, layout=self._layout, process_group=self._process_group,
                   copy_on_first_update=self.copy_on_first_update and not self._started)

    def _fsdp1_saved(self, root: torch.nn.Module) -> Tuple[List[str], List[str]]:
        """(the names the EMA averages under FSDP1 root `root`: its clean
        names under the attribute's prefix, Lightning's keys; the names it
        leaves out). ValueError when the attribute holds nothing tracked."""
        kept, others = _fsdp1_names(root, "versatil", self._prefix())
        if not kept:
            raise ValueError(f"EMACallback: attribute {self.attribute!r} holds no parameter or "
                             "buffer of the FSDP1 model")
        return kept, others

    def _build_fsdp1(self) -> EMA:
        # shardema.EMA takes an FSDP1 model at its root only (the module
        # inside it holds 1-D pieces of flat shards), so the EMA is built
        # over the root and, with attribute=, leaves the rest out by name:
        # under the root the names are FSDP1's clean ones, Lightning's keys.
        kept, others = self._fsdp1_saved(self._root)
        transient = _fsdp1_non_persistent(self._root)
        self._root_saved = [n for n in kept if n not in transient]
        return EMA(self._root, schedule=self._schedule, policy="versatil", storage=self._storage,
                   layout=self._layout, process_group=self._process_group,
                   copy_on_first_update=self.copy_on_first_update and not self._started,
                   ignore_names=others)

    def _tracked(self, target: torch.nn.Module) -> Dict[str, Any]:
        """The tracked tensors a state dict of `target` holds (not the
        non-persistent buffers; tied weights once, under their first name),
        by name. Read from the modules, not from state_dict() (FSDP2
        reshards in it), and the same on every rank, so the ranks agree on
        every collective of a save."""
        transient = {f"{prefix}.{b}" if prefix else b for prefix, m in target.named_modules()
                     for b in getattr(m, "_non_persistent_buffers_set", ())}
        return {t.name: t.tensor for t in module_tensors(target, "versatil")
                if t.name not in transient}

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # The seed deep-copies the module here; that copy is the start of the
        # average, and every optimizer step lerps with the scheduled decay.
        self._root = _fsdp1_root(trainer, pl_module)
        if self._root is not None:
            _submodule("EMACallback", pl_module, self.attribute)
        self.ema = self._build(pl_module)
        if self._resume_ema_state is not None:
            self._load_ema(self._resume_ema_state)
            self._resume_ema_state = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.ema is not None:
            self.ema.fence()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.ema is None or not _optimizer_stepped(trainer, batch_idx):
            return
        step = int(trainer.global_step)
        if self._own_schedule and step <= int(self.update_after_step):
            return
        if self.ema.update(step):
            self._started = True
        self.decay = self.ema.last_decay
        if trainer.global_step % 100 == 0 and hasattr(pl_module, "log"):
            pl_module.log("ema_decay", self.decay, on_step=True, on_epoch=False)

    # --- checkpoints ------------------------------------------------------
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        if self.ema is None:
            return
        if self.ema.swapped:
            raise RuntimeError("EMACallback.on_save_checkpoint: the EMA is swapped in for "
                               "validation; save outside validation so the raw weights are kept")
        state = checkpoint.setdefault("state_dict", {})
        prefix = self._prefix()
        if self._root is not None:
            # FSDPStrategy(state_dict_type="full"): rank 0 holds the full
            # state dict, the other ranks an empty one; the EMA's names are
            # its keys.
            _refuse_fsdp1_sharded_state("EMACallback.on_save_checkpoint", state,
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
        full = self.ema.full_state_dict(rank0_only=rank0_only, names=gather) if gather else {}
        # A DTensor entry's EMA in its to_local() shape: this rank's rows of
        # a Shard(0) one, the whole of a Replicate() one (gathered, so every
        # rank asks for the same names).
        held = self.ema.ema_tensors([name for name, sharded in tracked.items() if sharded]) \
            if distributed else {}
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
        }

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        record = checkpoint.get(self.STATE_KEY) or {}
        raw = checkpoint.get(self.RAW_STATE_KEY)
        if not record and not raw:
            return
        root = self._root if self._root is not None else _fsdp1_root(trainer, pl_module)
        if root is not None:
            self._load_fsdp1(root, pl_module, checkpoint, record, raw)
            return
        target = self._target(pl_module)
        prefix = self._prefix()
        tracked = self._tracked(target)
        names = {prefix + name: name for name in tracked}
        # ModelParallelStrategy loads the state_dict into the model itself and
        # hands this hook the rest of the checkpoint, without "state_dict".
        state = checkpoint.get("state_dict")
        kept = checkpoint.get(self.EMA_FLOAT32_KEY) or {}
        if record.get("raw_in_state_dict"):
            raw, kept = self._entries_of_distributed(trainer, tracked, record, state)
        raw = raw or {}
        self._refuse_foreign_raw(_raw_differences(raw, names, tracked))
        # The EMA: its float32 copy, else the state_dict's entry, else what
        # Lightning loaded from the state_dict into the model before this
        # hook. Read before the raw weights go into the model.
        ema_values = _ema_values_saved(names, kept, state, tracked)
        self._load_raw(target, tracked, {names[key]: value for key, value in raw.items()})
        self._resume_with(pl_module, record, ema_values)

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
        _submodule("EMACallback", pl_module, self.attribute)
        kept_names, _ = self._fsdp1_saved(root)
        transient = _fsdp1_non_persistent(root)
        saved = [n for n in kept_names if n not in transient]
        names = {name: name for name in saved}
        current = _fsdp1_full_tensors(root, saved)
        raw = raw or {}
        self._refuse_foreign_raw(_raw_differences(raw, names, current))
        state = checkpoint.get("state_dict")
        kept = checkpoint.get(self.EMA_FLOAT32_KEY) or {}
        ema_values = _ema_values_saved(names, kept, state, current)
        _fsdp1_load_full(root, raw)
        self._resume_with(pl_module, record, ema_values)

    def _entries_of_distributed(self, trainer: Any, tracked: Dict[str, Any],
                                record: Dict[str, Any], state: Optional[Dict[str, Any]]
                                ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
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
            prefix = self._prefix()
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
                values[name] = _full_to_rows(value, tracked[name])
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
            self.ema.load_ema_values(values, strict=False)
        except ValueError as error:
            raise ValueError(f"EMACallback: the checkpoint's EMA does not match the tracked "
                             f"tensors: {error}") from None

    # --- validation -------------------------------------------------------
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # swap_in() reshards the averaged module; an FSDP2 root above it
        # (the LightningModule, with attribute=) is resharded here.
        if self.ema is not None and not self.ema.swapped:
            _reshard(pl_module)
            self.ema.swap_in()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.ema is not None:
            self.ema.swap_out()
            _reshard(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips on_validation_end when validation raises.
        if self.ema is not None:
            self.ema.swap_out()
            _reshard(pl_module)


class DDPPostHocEMACallback(*_CALLBACK_BASES):  # type: ignore[misc]
    """Post-hoc EMA with FastVideo's signature and defaults: rank 0 keeps
    one full EMA per sigma_rel (layout="rank0"), or every rank its rows
    (layout="sharded"); snapshots every checkpoint_every optimizer steps;
    default_output_sigma synthesized for validation and at the end of
    training (its path in `output_path` on rank 0). attribute: average
    that submodule of the LightningModule (e.g. "policy"), as EMACallback's
    attribute; snapshot names are then the submodule's own. A model under
    fully_shard (ModelParallelStrategy) needs layout="sharded": each rank
    keeps the profiles of its rows. A checkpoint saved between snapshot
    steps writes each rank's profiles to its snapshot folder's resume/
    subfolder, so a resume from it goes on exactly as the run would have;
    a resume also sets aside (moves, never deletes) the snapshots the
    uninterrupted run would not hold, so extending a finished run
    synthesizes what the longer run does. Every argument is checked here:
    a one-line ValueError (out of range: sigma_rel outside (0,
    1/sqrt(12)), a count below 1) or TypeError naming it."""

    STATE_KEY = "shardema_posthoc"

    def __init__(self, *, sigma_rels: Sequence[float] = (0.05, 0.1), update_every: int = 1,
                 checkpoint_every: int = 5000, checkpoint_folder: Optional[str] = None,
                 start_iter: int = 0, default_output_sigma: float = 0.05,
                 step_size_correction: bool = True, layout: str = "rank0",
                 process_group: Any = None, output_dtype: torch.dtype = torch.float32,
                 attribute: Optional[str] = None) -> None:
        super().__init__()
        # Every argument is checked here, naming it (the seed clamps
        # update_every and checkpoint_every to 1; a 0 is refused instead).
        from ._posthoc import (checked_bool, checked_choice, checked_folder, checked_group_of,
                               checked_int, checked_output_dtype, checked_sigma,
                               checked_sigma_rels)
        api = "DDPPostHocEMACallback"
        if attribute is not None and not isinstance(attribute, str):
            raise TypeError(f"{api}: attribute must be the name of a submodule (a str) or "
                            f"None, got {type(attribute).__name__} {attribute!r}")
        if attribute == "":
            raise ValueError(f"{api}: attribute must be the name of a submodule (a str) or "
                             "None, got ''")
        self.attribute = attribute
        self.sigma_rels = checked_sigma_rels(api, "sigma_rels", sigma_rels)
        self.update_every = checked_int(api, "update_every", update_every, 1)
        self.checkpoint_every = checked_int(api, "checkpoint_every", checkpoint_every, 1)
        self.checkpoint_folder = (None if checkpoint_folder is None else
                                  checked_folder(api, "checkpoint_folder", checkpoint_folder))
        self.start_iter = checked_int(api, "start_iter", start_iter, 0)
        self.default_output_sigma = checked_sigma(api, "default_output_sigma",
                                                  default_output_sigma)
        self.step_size_correction = checked_bool(api, "step_size_correction",
                                                 step_size_correction)
        self.layout = checked_choice(api, "layout", layout, ("rank0", "sharded"))
        self.output_path: Optional[str] = None
        self._process_group = checked_group_of(api, process_group)
        self._output_dtype = checked_output_dtype(api, "output_dtype", output_dtype)
        self._engine: Any = None
        self._queued_state: Optional[Dict[str, str]] = None
        # FSDPStrategy's FSDP1 root around the LightningModule, or None.
        self._root: Any = None

    def _folder(self, trainer: Any) -> str:
        if self.checkpoint_folder is not None:
            return str(self.checkpoint_folder)
        root = getattr(trainer, "default_root_dir", None) or os.getcwd()
        return os.path.join(str(root), "posthoc_ema")

    def _target(self, pl_module: Any) -> torch.nn.Module:
        module = unwrap(pl_module)
        if not self.attribute:
            return module
        target = getattr(module, self.attribute, None)
        if not isinstance(target, torch.nn.Module):
            raise ValueError(f"DDPPostHocEMACallback: attribute {self.attribute!r} of "
                             f"{type(module).__name__} is not an nn.Module (got "
                             f"{type(target).__name__})")
        return target

    def _start_fsdp1(self, trainer: Any, pl_module: Any) -> Any:
        """The post-hoc engine over FSDP1 root self._root: each rank keeps
        the profiles of its pieces of the flat shards (the sharded layout),
        named as the submodule's own (the attribute's prefix dropped), as
        without FSDP1."""
        if self.layout != "sharded":
            raise ValueError(f"DDPPostHocEMACallback: layout={self.layout!r} keeps full EMAs on "
                             "rank 0, but the LightningModule is inside an FSDP1 root "
                             "(FSDPStrategy): each rank holds only its pieces of the flat "
                             "shards. Use layout='sharded'")
        _submodule("DDPPostHocEMACallback", pl_module, self.attribute)
        from ._model import plan_layout
        from ._shards import LocalShard, ShardSpec
        prefix = f"{self.attribute}." if self.attribute else ""
        tracked = [t for t in module_tensors(self._root, "ema_pytorch")
                   if t.name.startswith(prefix)]
        outside = [t.name for t in tracked if t.piece is None]
        if outside:
            # FSDP1 leaves buffers (and ignored modules' parameters) whole
            # and unequal on every rank; the sharded snapshots hold pieces
            # of tensors the ranks share, which these are not.
            raise ValueError(f"DDPPostHocEMACallback: '{outside[0]}' is not in an FSDP1 "
                             "FlatParameter (a buffer or an ignored module's parameter); under "
                             "FSDP1 the post-hoc EMA follows the flat shards only (average a "
                             "submodule without them with attribute=)")
        if not tracked:
            raise ValueError(f"DDPPostHocEMACallback: attribute {self.attribute!r} holds no "
                             "parameter of the FSDP1 model")
        for t in tracked:
            t.name = t.name[len(prefix):]
            piece, path, unit = t.piece
            spec = piece.spec
            renamed = ShardSpec(spec.name[len(prefix):], list(spec.global_shape), spec.dtype,
                                spec.kind, list(spec.ranges))
            t.piece = (LocalShard(piece.local, renamed, piece.role, piece.changes_in_forward),
                       path, unit)
        plan = plan_layout(tracked, "auto", self._process_group)  # FSDP1 pieces: plan_fsdp1
        engine = _C.PostHoc(
            list(self.sigma_rels), self.update_every, self.checkpoint_every, self._folder(trainer),
            self.start_iter, self.default_output_sigma, self.step_size_correction, "sharded",
            "ema_pytorch", "", "shardema_ema_final", self._output_dtype, plan.group, 300.0)
        engine.on_fit_start(plan.shards, [])
        return engine

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._root = _fsdp1_root(trainer, pl_module)
        if self._root is not None:
            self._engine = self._start_fsdp1(trainer, pl_module)
            if self._queued_state is not None:
                self._engine.on_load_checkpoint(self._queued_state)
                self._queued_state = None
            return
        self._engine = start_engine(
            self._target(pl_module), sigma_rels=self.sigma_rels, update_every=self.update_every,
            checkpoint_every=self.checkpoint_every, folder=self._folder(trainer),
            start_iter=self.start_iter, default_sigma=self.default_output_sigma,
            step_size_correction=self.step_size_correction, layout=self.layout,
            policy="ema_pytorch", output_dtype=self._output_dtype,
            process_group=self._process_group, seconds=300.0)
        if self._queued_state is not None:
            self._engine.on_load_checkpoint(self._queued_state)
            self._queued_state = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._engine is not None:
            self._engine.on_before_optimizer_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._engine is not None:
            self._engine.on_train_batch_end(int(trainer.global_step), int(batch_idx),
                                            int(trainer.accumulate_grad_batches),
                                            bool(trainer.is_last_batch))

    @property
    def calls(self) -> int:
        """Counted optimizer steps."""
        return 0 if self._engine is None else self._engine.calls

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        if self._engine is not None:
            checkpoint[self.STATE_KEY] = dict(self._engine.on_save_checkpoint())

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        state = checkpoint.get(self.STATE_KEY)
        if state is None:
            return
        if self._engine is None:
            self._queued_state = dict(state)
        else:
            self._engine.on_load_checkpoint(dict(state))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            # FSDP1: the root's gathered FlatParameter, which a forward
            # without backward leaves and the next forward reuses, is freed
            # around the swap (into the flat shards), as EMA.swap_in does.
            _reshard(pl_module)
            reshard_fsdp1(self._root)
            self._engine.on_validation_start()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            self._engine.on_validation_end()
            _reshard(pl_module)
            reshard_fsdp1(self._root)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._engine is not None:
            self._engine.on_validation_end()
            _reshard(pl_module)
            reshard_fsdp1(self._root)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            path = self._engine.on_train_end()
            self.output_path = path or None
