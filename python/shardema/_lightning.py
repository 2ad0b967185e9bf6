"""What shardema's Lightning callbacks share: their base classes (the
Callback of `lightning` and of `pytorch_lightning` at once), the
optimizer-step rule, resharding FSDP2 modules around a swap, and the
`attribute=` submodule. Without Lightning the callbacks work with any
trainer object that carries the attributes they read (global_step,
accumulate_grad_batches, is_last_batch)."""
from typing import Any, List, Optional, Tuple

import torch

from . import _C

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


CALLBACK_BASES = _callback_bases()


def optimizer_stepped(trainer: Any, batch_idx: int) -> bool:
    """The C++ callbacks' rule (optimizerStepped, ema_callback.h): the end of
    an accumulation window, or the epoch's last batch."""
    return _C.optimizer_stepped(int(batch_idx), int(trainer.accumulate_grad_batches),
                                bool(trainer.is_last_batch))


def reshard(module: Any) -> None:
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


def refuse_two_validation_swaps(trainer: Any, pl_module: Any, me: Any) -> None:
    """ValueError when another shardema callback of `trainer` swaps its EMA
    into the module `me` swaps into for validation, or a part of it, or a
    module holding it: one validation sees one EMA, and swaps do not nest
    (weight_swap.h). Each callback says what it swaps into with
    _validation_target(pl_module): a module, or None when it does not."""
    mine = me._validation_target(pl_module)
    if mine is None:
        return
    for other in getattr(trainer, "callbacks", None) or ():
        target = getattr(other, "_validation_target", None)
        if other is me or not callable(target):
            continue
        theirs = target(pl_module)
        if theirs is None:
            continue
        if any(m is theirs for m in mine.modules()) or any(m is mine for m in theirs.modules()):
            raise ValueError(f"{type(me).__name__} and {type(other).__name__} both swap their EMA "
                             "into the model for validation, and one validation sees one EMA: "
                             "pass validate_with_ema=False to all but one of them (or give them "
                             "disjoint attribute= submodules)")


def submodule(owner: str, pl_module: Any, attribute: Optional[str]) -> torch.nn.Module:
    """pl_module's `attribute`, or pl_module itself; ValueError naming the
    attribute when it is not an nn.Module."""
    if not attribute:
        return pl_module
    target = getattr(pl_module, attribute, None)
    if not isinstance(target, torch.nn.Module):
        raise ValueError(f"{owner}: attribute {attribute!r} of {type(pl_module).__name__} is not "
                         f"an nn.Module (got {type(target).__name__})")
    return target

