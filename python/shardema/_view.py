"""What EMA.module() and EMA.copy_from() do with a model: a module holding
the EMA weights, built beside the training model, and the model's weights
written into the EMA. Pure PyTorch bookkeeping; the values come from the
EMA (ema_tensors()) and the engine (load_full_values(), load_local_values())."""
import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._model import _fsdp2_local, is_dtensor, unwrap

# Under a layout whose rows are split over ranks, plain tensors are gathered
# in batches of at most this many float32 bytes, so that module() holds one
# batch of full tensors at a time beside the module it fills.
_GATHER_BATCH_BYTES = 64 << 20


def module_entries(module: torch.nn.Module) -> List[Tuple[str, Any]]:
    """(name, tensor) of every parameter and buffer, under the names and in
    the order shardema.EMA tracks them (_model.module_tensors): shared
    tensors once, under their first name."""
    seen, out = set(), []
    for prefix, mod in module.named_modules():
        for name, tensor in list(mod._parameters.items()) + list(mod._buffers.items()):
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            out.append((f"{prefix}.{name}" if prefix else name, tensor))
    return out


def reshard_fsdp(module: Any) -> None:
    """Registers the sharded parameters of every FSDP2 module in `module`
    again. FSDP2 leaves the root's parameters unsharded after a forward that
    no backward follows (evaluation), and the next forward then uses those
    full copies as they are: without this, a forward inside swap() would not
    see the EMA of the root's parameters, one after it would still see it,
    and module(into=) / copy_from() would meet plain tensors. FSDP1 keeps
    its root unit's gathered FlatParameter the same way (_fsdp1.py), ZeRO-3
    its persistent parameters gathered (_zero3.py)."""
    from ._fsdp1 import reshard_fsdp1
    from ._zero3 import release_gathered
    reshard_fsdp1(module)
    release_gathered(module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    if isinstance(module, torch.nn.Module):
        for mod in module.modules():
            if isinstance(mod, FSDPModule):
                mod.reshard()


def _local(name: str, t: Any) -> torch.Tensor:
    return _fsdp2_local(name, t) if is_dtensor(t) else t


def _blank_like(t: Any, device: Optional[torch.device]) -> torch.Tensor:
    """A tensor of t's shape and dtype on `device` (t's own if None), to be
    filled: what the deep copy holds instead of a copy of t (and of its
    .grad)."""
    blank = torch.empty(t.shape, dtype=t.dtype, device=t.device if device is None else device)
    return torch.nn.Parameter(blank, requires_grad=False) if isinstance(t, torch.nn.Parameter) \
        else blank


def materialize(ema: Any, model: torch.nn.Module, device: Any, into: Any,
                tracked: Sequence[str], profile: int = 0) -> torch.nn.Module:
    """EMA.module(): a deep copy of `model` on `device` (or `into`) holding
    what swap(profile=profile) would put in the model."""
    reshard_fsdp(model)  # its DTensors, not full copies left by an evaluation forward
    sources = module_entries(model)
    if into is None:
        dtensor = next((n for n, t in sources if is_dtensor(t)), None)
        if dtensor is not None:
            raise ValueError(f"shardema.EMA.module: '{dtensor}' is a DTensor (FSDP2), and "
                             f"torch refuses to "
                             "deep-copy a fully_shard model; build the same model, fully_shard it "
                             "the same way and pass it as EMA.module(into=...)")
        device = None if device is None else torch.device(device)
        memo: Dict[int, Any] = {id(t): _blank_like(t, device) for _, t in sources}
        view = copy.deepcopy(model, memo)
        targets = [(name, memo[id(t)], t) for name, t in sources]
    else:
        if device is not None:
            raise TypeError("shardema.EMA.module: give device= or into=, not both (into's "
                            "tensors stay "
                            "where they are)")
        view = unwrap(into)
        if not isinstance(view, torch.nn.Module):
            raise TypeError(f"shardema.EMA.module: into must be an nn.Module, got "
                            f"{type(into).__name__}")
        reshard_fsdp(view)
        theirs = dict(module_entries(view))
        missing = [name for name, _ in sources if name not in theirs]
        if missing:
            raise ValueError(f"shardema.EMA.module: into has no {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}; it must be a model of the "
                             "same structure as the one the EMA tracks")
        targets = [(name, theirs[name], t) for name, t in sources]
    _write(ema, targets, set(tracked), profile)
    return view


def _write(ema: Any, targets: List[Tuple[str, Any, Any]], tracked: set, profile: int) -> None:
    """Each target takes the EMA of its name in the shape it holds the
    tensor in (EMA.ema_tensors(): a DTensor's to_local(), the whole of a
    plain tensor, gathered where the ranks split it), or the model's own
    value for a name the EMA does not track."""
    batch: List[Tuple[str, torch.Tensor]] = []
    size = 0
    with torch.no_grad():
        for name, target, source in targets:
            local = _local(name, target)
            if name not in tracked:
                mine = _local(name, source)
                _check_size(name, local, mine)
                local.copy_(mine.reshape(local.shape))
                continue
            # Every rank walks the same names in the same order and sizes
            # the batches by the full tensors (a DTensor's numel() is its
            # global one): the gathers inside ema_tensors() match.
            if batch and size + 4 * source.numel() > _GATHER_BATCH_BYTES:
                _write_batch(ema, batch, profile)
                batch, size = [], 0
            batch.append((name, local))
            size += 4 * source.numel()
        if batch:
            _write_batch(ema, batch, profile)


def _write_batch(ema: Any, batch: List[Tuple[str, torch.Tensor]], profile: int) -> None:
    values = ema.ema_tensors([name for name, _ in batch], profile=profile)
    for name, target in batch:
        _check_size(name, target, values[name])
        target.copy_(values[name].reshape(target.shape))


def _check_size(name: str, target: torch.Tensor, value: torch.Tensor) -> None:
    if target.numel() != value.numel():
        raise ValueError(f"shardema.EMA.module: '{name}' has {target.numel()} elements on this "
                         f"rank in the "
                         f"module written into but {value.numel()} in the EMA; into= must be "
                         "sharded like the model")


def copy_model_into_ema(ema: Any, full: List[Tuple[str, Any]], local: List[Tuple[str, Any]],
                        tracked: Sequence[str]) -> None:
    """EMA.copy_from(): every tracked tensor's EMA becomes its current value,
    from `full` tensors or `local` pieces (what this rank holds, as a
    DTensor's to_local()), through EMA.load_ema_values(), which knows what
    this rank keeps of each. Tracked names given by neither are a
    ValueError naming them, before anything changes. No communication."""
    given = {n for n, _ in full} | {n for n, _ in local}
    absent = [n for n in tracked if n not in given]
    if absent:
        raise ValueError(f"shardema.EMA.copy_from: the model no longer holds {absent[:5]}, "
                         f"which the EMA "
                         "tracks")
    keep = set(tracked)
    ema.load_ema_values({n: t.detach() for n, t in full + local if n in keep})


def model_values(model: torch.nn.Module) -> Tuple[List[Tuple[str, Any]], List[Tuple[str, Any]]]:
    """The model's current tensors by name: (full tensors, DTensors' local rows)."""
    reshard_fsdp(model)
    entries = module_entries(model)
    return ([(n, t) for n, t in entries if not is_dtensor(t)],
            [(n, _local(n, t)) for n, t in entries if is_dtensor(t)])
