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
        return EMA(self._target(pl_module), schedule=self._schedule, policy="versatil",
                   storage=self._storage, layout=self._layout, process_group=self._process_group,
                   copy_on_first_update=self.copy_on_first_update and not self._started)

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
        rank0_only = not distributed and any(tracked.values())
        full = self.ema.full_state_dict(rank0_only=rank0_only, names=gather) if gather else {}
        # A DTensor entry's EMA in its to_local() shape: this rank's rows of
        # a Shard(0) one, the whole of a Replicate() one (gathered, so every
        # rank asks for the same names).
        held = self.ema.ema_tensors([name for name, sharded in tracked.items() if sharded]) \
            if distributed else {}
        raw: Dict[str, Any] = {}
        kept: Dict[str, Any] = {}
        for name, key in keys.items():
            if key not in state or not (is_dtensor(state[key]) or name in full):
                continue  # a rank that does not write the model
            value = state[key]
            # The raw entry aliases the live parameter (state_dict() views):
            # clone it, or async checkpoint IO would save the weights of a
            # later step.
            raw[key] = value.clone()
            if is_dtensor(value):
                rows = held[name]
                ema = value.clone()  # same mesh and placements, own storage
                with torch.no_grad():
                    ema.to_local().copy_(rows.view(ema.to_local().shape))
                    if rows.dtype != value.dtype:
                        exact = value.to(rows.dtype)
                        exact.to_local().copy_(rows.view(exact.to_local().shape))
                        kept[key] = exact
            else:
                ema = full[name].to(dtype=value.dtype)  # the gathered EMA is ours to keep
                if full[name].dtype != value.dtype:
                    kept[key] = full[name]
            state[key] = ema
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
        differences = _raw_differences(raw, names, tracked)
        if differences:
            raise ValueError(
                f"EMACallback.on_load_checkpoint: the checkpoint's raw weights "
                f"({self.RAW_STATE_KEY}) are not those of this model"
                f"{f' attribute {self.attribute!r}' if self.attribute else ''}: "
                f"{differences}; nothing was loaded")
        # The EMA: its float32 copy, else the state_dict's entry, else what
        # Lightning loaded from the state_dict into the model before this
        # hook. Read before the raw weights go into the model.
        ema_values: Dict[str, Any] = {}
        with torch.no_grad():
            for key, name in names.items():
                if key in kept:
                    value = kept[key]
                elif state is not None and key in state:
                    value = state[key]
                else:
                    value = tracked[name]
                ema_values[name] = value.clone()
        self._load_raw(target, tracked, {names[key]: value for key, value in raw.items()})
        self._started = bool(record.get("started", True))
        if self.ema is None:
            self._resume_ema_state = ema_values
            return
        # Strategies that restore after setup (ModelParallelStrategy) load
        # after on_fit_start: the EMA exists, and is rebuilt when it would
        # copy at its first update but the average had started.
        if self.copy_on_first_update and self._started:
            self.ema = self._build(pl_module)
        self._load_ema(ema_values)

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
    subfolder, so a resume from it goes on exactly as the run would have."""

    STATE_KEY = "shardema_posthoc"

    def __init__(self, *, sigma_rels: Sequence[float] = (0.05, 0.1), update_every: int = 1,
                 checkpoint_every: int = 5000, checkpoint_folder: Optional[str] = None,
                 start_iter: int = 0, default_output_sigma: float = 0.05,
                 step_size_correction: bool = True, layout: str = "rank0",
                 process_group: Any = None, output_dtype: torch.dtype = torch.float32,
                 attribute: Optional[str] = None) -> None:
        super().__init__()
        self.attribute = attribute
        self.sigma_rels = tuple(float(s) for s in sigma_rels)
        self.update_every = max(1, int(update_every))
        self.checkpoint_every = max(1, int(checkpoint_every))
        self.checkpoint_folder = checkpoint_folder
        self.start_iter = int(start_iter)
        self.default_output_sigma = float(default_output_sigma)
        self.step_size_correction = bool(step_size_correction)
        self.layout = layout
        self.output_path: Optional[str] = None
        self._process_group = process_group
        self._output_dtype = output_dtype
        self._engine: Any = None
        self._queued_state: Optional[Dict[str, str]] = None

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

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
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
            _reshard(pl_module)
            self._engine.on_validation_start()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            self._engine.on_validation_end()
            _reshard(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._engine is not None:
            self._engine.on_validation_end()
            _reshard(pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            path = self._engine.on_train_end()
            self.output_path = path or None
