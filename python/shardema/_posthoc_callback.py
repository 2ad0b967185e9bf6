"""DDPPostHocEMACallback: FastVideo's DDPPostHocEMACallback as a drop-in
(nitrous post-hoc EMA on rank 0 under DDP), with a sharded layout, over the
C++ PostHocCallback (shardema._C.PostHoc)."""
import os
from typing import Any, Dict, Optional, Sequence

import torch

from . import _C
from ._fsdp1 import fsdp1_root, reshard_fsdp1
from ._lightning import CALLBACK_BASES, refuse_two_validation_swaps, reshard, submodule
from ._model import module_tensors, unwrap
from ._posthoc import start_engine
from ._selection import keep_trainable, refuse_unfrozen

class DDPPostHocEMACallback(*CALLBACK_BASES):  # type: ignore[misc]
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
    synthesizes what the longer run does. validate_with_ema (default True):
    validation runs with the synthesized EMA swapped in; beside another
    EMA callback on the same module, give all but one False. trainable_only
    (default False): the profiles of the parameters that require grad at
    fit start only (LoRA adapters), as shardema.EMA's; one of the others
    that requires grad later is a ValueError naming it at the next step.
    Every argument
    is checked here:
    a one-line ValueError (out of range: sigma_rel outside (0,
    1/sqrt(12)), a count below 1) or TypeError naming it."""

    STATE_KEY = "shardema_posthoc"

    def __init__(self, *, sigma_rels: Sequence[float] = (0.05, 0.1), update_every: int = 1,
                 checkpoint_every: int = 5000, checkpoint_folder: Optional[str] = None,
                 start_iter: int = 0, default_output_sigma: float = 0.05,
                 step_size_correction: bool = True, layout: str = "rank0",
                 process_group: Any = None, output_dtype: torch.dtype = torch.float32,
                 attribute: Optional[str] = None, validate_with_ema: bool = True,
                 trainable_only: bool = False) -> None:
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
        self.validate_with_ema = checked_bool(api, "validate_with_ema", validate_with_ema)
        self.trainable_only = checked_bool(api, "trainable_only", trainable_only)
        self._frozen: list = []  # trainable_only: the parameters left out
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
        return unwrap(target)  # a compiled attribute: its module, plain names

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
        submodule("DDPPostHocEMACallback", pl_module, self.attribute)
        from ._model import plan_layout
        from ._shards import LocalShard, ShardSpec
        prefix = f"{self.attribute}." if self.attribute else ""
        tracked = [t for t in module_tensors(self._root, "ema_pytorch")
                   if t.name.startswith(prefix)]
        if self.trainable_only:
            keep_trainable(tracked)  # refuses FSDP1 by name
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

    def _validation_target(self, pl_module: Any) -> Optional[torch.nn.Module]:
        """The module validation sees the synthesized EMA in (None: no swap)."""
        return self._target(pl_module) if self.validate_with_ema else None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._root = fsdp1_root(trainer, pl_module)
        refuse_two_validation_swaps(trainer, pl_module, self)
        if self._root is not None:
            self._engine = self._start_fsdp1(trainer, pl_module)
            if self._queued_state is not None:
                self._engine.on_load_checkpoint(self._queued_state)
                self._queued_state = None
            return
        self._engine, self._frozen = start_engine(
            self._target(pl_module), sigma_rels=self.sigma_rels, update_every=self.update_every,
            checkpoint_every=self.checkpoint_every, folder=self._folder(trainer),
            start_iter=self.start_iter, default_sigma=self.default_output_sigma,
            step_size_correction=self.step_size_correction, layout=self.layout,
            policy="ema_pytorch", output_dtype=self._output_dtype,
            process_group=self._process_group, seconds=300.0,
            trainable_only=self.trainable_only)
        if self._queued_state is not None:
            self._engine.on_load_checkpoint(self._queued_state)
            self._queued_state = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._engine is not None:
            self._engine.on_before_optimizer_step()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._engine is not None:
            refuse_unfrozen(self._frozen, "DDPPostHocEMACallback")
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
        if self._engine is not None and self.validate_with_ema:
            # FSDP1: the root's gathered FlatParameter, which a forward
            # without backward leaves and the next forward reuses, is freed
            # around the swap (into the flat shards), as EMA.swap_in does.
            reshard(pl_module)
            reshard_fsdp1(self._root)
            self._engine.on_validation_start()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            self._engine.on_validation_end()
            reshard(pl_module)
            reshard_fsdp1(self._root)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._engine is not None:
            self._engine.on_validation_end()
            reshard(pl_module)
            reshard_fsdp1(self._root)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._engine is not None:
            path = self._engine.on_train_end()
            self.output_path = path or None

