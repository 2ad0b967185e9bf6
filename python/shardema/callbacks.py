"""The two reference callbacks as drop-ins, over shardema's engine.

EMACallback: VersatIL's Lightning EMACallback (a warmup EMA updated on
optimizer steps only, checkpoints that hold the EMA with the raw weights
kept for resume, the validation swap). DDPPostHocEMACallback: FastVideo's
DDPPostHocEMACallback (nitrous post-hoc EMA on rank 0 under DDP), with a
sharded layout. Both subclass Lightning's Callback when Lightning is
importable and work with any trainer object that carries the attributes
they read (global_step, accumulate_grad_batches, is_last_batch).
"""
import os
from typing import Any, Dict, Optional, Sequence

import torch

from . import _C
from ._ema import EMA
from ._model import _default_group, is_dtensor, unwrap
from ._posthoc import start_engine

try:  # pragma: no cover - depends on what is installed
    from lightning.pytorch import Callback as _Callback
except ImportError:  # pragma: no cover
    try:
        from pytorch_lightning import Callback as _Callback
    except ImportError:
        _Callback = object


def _optimizer_stepped(trainer: Any, batch_idx: int) -> bool:
    # An optimizer step ends every accumulation window, and Lightning also
    # steps on the epoch's last batch when the window is cut short there.
    window_done = (batch_idx + 1) % int(trainer.accumulate_grad_batches) == 0
    return window_done or bool(trainer.is_last_batch)


class EMACallback(_Callback):
    """Warmup EMA of the LightningModule (or of its `attribute`, e.g.
    "policy"), in pinned host memory, sharded as the module is."""

    #: Where on_save_checkpoint keeps the raw (online) weights.
    RAW_STATE_KEY = "raw_policy_state_dict"

    def __init__(self, power: float = 0.75, update_after_step: int = 0, inv_gamma: float = 1.0,
                 min_value: float = 0.0, max_value: float = 0.9999,
                 attribute: Optional[str] = None, *, storage: str = "pinned_host",
                 layout: str = "auto", process_group: Any = None) -> None:
        super().__init__()
        self.power = power
        self.update_after_step = update_after_step
        self.inv_gamma = inv_gamma
        self.min_value = min_value
        self.max_value = max_value
        self.attribute = attribute
        self.decay = 0.0
        self.ema: Optional[EMA] = None
        self._storage = storage
        self._layout = layout
        self._process_group = process_group
        self._resume_ema_state: Optional[Dict[str, torch.Tensor]] = None
        # Validates the options now, as the seed's constructor stores them.
        self._schedule = _C.DecaySchedule.warmup(inv_gamma=inv_gamma, power=power, min_value=min_value,
                                        max_value=max_value, update_after_step=update_after_step)

    def _target(self, pl_module: Any) -> torch.nn.Module:
        return getattr(pl_module, self.attribute) if self.attribute else pl_module

    def _prefix(self) -> str:
        return f"{self.attribute}." if self.attribute else ""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # The seed deep-copies the module here; that copy is the start of the
        # average, and every optimizer step lerps with the scheduled decay.
        self.ema = EMA(self._target(pl_module), schedule=self._schedule, policy="versatil",
                       storage=self._storage, layout=self._layout,
                       process_group=self._process_group, copy_on_first_update=False)
        if self._resume_ema_state is not None:
            # What on_save_checkpoint wrote: DTensors hold this rank's rows,
            # plain tensors the full EMA.
            resume = self._resume_ema_state.items()
            self.ema._engine.load_local_values(
                [(name, value.to_local()) for name, value in resume if is_dtensor(value)])
            self.ema._engine.load_full_values(
                [(name, value) for name, value in resume if not is_dtensor(value)])
            self._resume_ema_state = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.ema is not None:
            self.ema.fence()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.ema is None or not _optimizer_stepped(trainer, batch_idx):
            return
        self.ema.update(int(trainer.global_step))
        self.decay = self.ema.last_decay
        if trainer.global_step % 100 == 0 and hasattr(pl_module, "log"):
            pl_module.log("ema_decay", self.decay, on_step=True, on_epoch=False)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        if self.ema is None:
            return
        if self.ema._engine.swapped:
            raise RuntimeError("EMACallback.on_save_checkpoint: the EMA is swapped in for "
                               "validation; save outside validation so the raw weights are kept")
        state = checkpoint["state_dict"]
        prefix = self._prefix()
        keys = {name: prefix + name for name in self.ema._engine.names() if prefix + name in state}
        # A sharded state dict (FSDP2 under Lightning's ModelParallelStrategy)
        # holds DTensors: their EMA is this rank's own rows, no communication.
        # Plain entries (a DDP model, FSDP2's replicated buffers) need the
        # full EMA: only those are gathered, so a sharded model's EMA is never
        # assembled on one rank. Every rank has the same keys, so all agree
        # on whether to gather.
        whole = [name for name, key in keys.items() if not is_dtensor(state[key])]
        full = self.ema.full_state_dict(rank0_only=False, names=whole) if whole else {}
        raw: Dict[str, torch.Tensor] = {}
        for name, key in keys.items():
            value = state[key]
            # The raw entry aliases the live parameter (state_dict() views):
            # clone it, or async checkpoint IO would save the weights of a
            # later step.
            raw[key] = value.clone()
            if is_dtensor(value):
                ema = value.clone()  # same mesh and placements, own storage
                with torch.no_grad():
                    ema.to_local().copy_(self.ema._engine.ema(name).view(ema.to_local().shape))
                state[key] = ema
            else:
                # The gathered EMA is a fresh tensor of this dict's own: no
                # copy beyond the cast.
                state[key] = full[name].to(dtype=value.dtype)
        checkpoint[self.RAW_STATE_KEY] = raw

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        raw = checkpoint.get(self.RAW_STATE_KEY)
        if not raw:
            return
        prefix = self._prefix()
        state = checkpoint["state_dict"]
        self._resume_ema_state = {
            key[len(prefix):]: state[key].clone() for key in raw if key in state
        }
        self._target(pl_module).load_state_dict(
            {key[len(prefix):]: value for key, value in raw.items()}, strict=False)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.ema is not None and not self.ema._engine.swapped:
            self.ema._engine.swap_in()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.ema is not None:
            self.ema._engine.swap_out()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning skips on_validation_end when validation raises.
        if self.ema is not None:
            self.ema._engine.swap_out()


class DDPPostHocEMACallback(_Callback):
    """Post-hoc EMA with FastVideo's signature and defaults: rank 0 keeps
    one full EMA per sigma_rel (layout="rank0"), or every rank its rows
    (layout="sharded"); snapshots every checkpoint_every optimizer steps;
    default_output_sigma synthesized for validation and at the end of
    training (its path in `output_path` on rank 0)."""

    STATE_KEY = "shardema_posthoc"

    def __init__(self, *, sigma_rels: Sequence[float] = (0.05, 0.1), update_every: int = 1,
                 checkpoint_every: int = 5000, checkpoint_folder: Optional[str] = None,
                 start_iter: int = 0, default_output_sigma: float = 0.05,
                 step_size_correction: bool = True, layout: str = "rank0",
                 process_group: Any = None, output_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
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

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        group = self._process_group if self._process_group is not None else _default_group()
        self._engine = start_engine(
            unwrap(pl_module), sigma_rels=self.sigma_rels, update_every=self.update_every,
            checkpoint_every=self.checkpoint_every, folder=self._folder(trainer),
            start_iter=self.start_iter, default_sigma=self.default_output_sigma,
            step_size_correction=self.step_size_correction, layout=self.layout,
            policy="ema_pytorch", output_dtype=self._output_dtype, group=group, seconds=300.0)
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
            self._engine.on_validation_start()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            self._engine.on_validation_end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._engine is not None:
            self._engine.on_validation_end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            path = self._engine.on_train_end()
            self.output_path = path or None
