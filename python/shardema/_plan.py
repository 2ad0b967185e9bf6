"""What a plan of shardema.EMA is made of: the tracked tensors (Tracked)
and how this rank holds them (Plan), with the checks every planner
(_model.py for plain, DDP and DTensor models, _fsdp1.py for FSDP1,
_zero3.py for DeepSpeed ZeRO-3) makes
of a tensor. Below both planners, so neither imports the other's module
for these."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch


@dataclass
class Tracked:
    name: str
    tensor: Any  # a torch.Tensor, or a DTensor
    role: str
    is_buffer: bool
    # The module's _parameters or _buffers dict holding it, and its key
    # there: update() checks the tensor is still the one held (None: named
    # tensors, nothing to watch).
    container: Optional[dict] = None
    key: Optional[str] = None
    # FSDP1: (this rank's LocalShard of the member, unit path, unit), a view
    # into the FlatParameter's local shard (_fsdp1.py); ZeRO-3: a
    # _zero3.Partition. `tensor` is then the parameter whose requires_grad
    # decides the role at each update.
    piece: Any = None
    # The tensor's other state_dict keys: a tied weight (head.weight =
    # emb.weight) is tracked once, under its first name, and exported under
    # every one.
    aliases: List[str] = field(default_factory=list)
    # (container, key) of each alias, in the same order: an untied weight
    # (a new head.weight) is a changed model (_model_watch.py).
    alias_slots: List[Tuple[dict, str]] = field(default_factory=list)
    # False for a buffer registered with persistent=False (a rotary
    # inv_freq): tracked and swapped, but no state_dict() key holds it, so
    # full_state_dict() and exports leave it out (LocalShard.persistent).
    persistent: bool = True


class Own(NamedTuple):
    """One of a module's own tensors, as state_dict() walks them."""
    key: str
    tensor: Any
    is_buffer: bool
    container: dict  # the module's _parameters or _buffers
    persistent: bool


def own_tensors(mod: torch.nn.Module) -> List[Own]:
    """A module's own parameters, then its buffers (state_dict order), the
    None entries left out. Every planner walks a module with this."""
    non_persistent = getattr(mod, "_non_persistent_buffers_set", ())
    return [Own(k, t, False, mod._parameters, True) for k, t in mod._parameters.items()
            if t is not None] + \
           [Own(k, t, True, mod._buffers, k not in non_persistent)
            for k, t in mod._buffers.items() if t is not None]



@dataclass
class Plan:
    layout: str
    group: Any  # a ProcessGroup, or None for one process
    shards: List[Any] = field(default_factory=list)
    whole: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    # Per shard: the tensor it was cut from and the cut ("replicated",
    # "rank0"), for the engine to follow a replaced tensor ((None, None)
    # where it cannot: DTensors, local shards), and the tensor whose
    # requires_grad decides "average_if_trainable" at each update (the
    # parameter, a DTensor one too).
    owners: List[Tuple[Any, Optional[str], Any]] = field(default_factory=list)
    # (container, key, tensor, shard index) of tensors held by a module.
    watched: List[Tuple[dict, str, Any, int]] = field(default_factory=list)
    # HSDP: the group of the ranks holding the same shards as this one (the
    # mesh's replicate dimension). Only the replica holding global rank 0
    # writes files; None: no replicas.
    replicas: Any = None
    # Tensor parallelism: the DTensors split along a dim other than 0
    # (Shard(d > 0)), by name. Each rank keeps the EMA of its to_local() as
    # laid out there; the engine's files, which describe rows of dim 0,
    # cannot hold them (see refuse_tensor_parallel).
    tensor_parallel: Dict[str, Any] = field(default_factory=dict)
    # Tied tensors' other names, each to the name the tensor is tracked under.
    aliases: Dict[str, str] = field(default_factory=dict)
    # (container, key, tensor, shard index) of each alias held by a module.
    alias_slots: List[Tuple[dict, str, Any, int]] = field(default_factory=list)
    # trainable_only=True: (container, key, name) of each frozen parameter
    # left out, which must not require grad later (_selection.keep_trainable).
    frozen: List[Tuple[dict, str, str]] = field(default_factory=list)



def _is_floating(t: Any) -> bool:
    return bool(t.dtype.is_floating_point) or bool(getattr(t.dtype, "is_complex", False))



def check_dense(name: str, t: Any) -> None:
    """ValueError naming the tensor for what has no dense storage to average
    (sparse, quantized, nested layouts)."""
    if is_dtensor(t):
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"'{name}': expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"'{name}' has layout {t.layout}; only dense (strided) tensors can be "
                         "tracked (densify it with to_dense(), or leave it out)")



def alias_slots_of(tracked: List[Tracked]) -> List[Tuple[dict, str, Any, int]]:
    """Where each tied tensor's other names are held, as watched_of's."""
    return [(container, key, t.tensor, i) for i, t in enumerate(tracked)
            for container, key in t.alias_slots if not is_dtensor(t.tensor)]


def watched_of(tracked: List[Tracked]) -> List[Tuple[dict, str, Any, int]]:
    """What update() checks is still held by the module: plain tensors of a
    module (a DTensor's module swaps them itself, FSDP2's unsharded
    parameters)."""
    return [(t.container, t.key, t.tensor, i) for i, t in enumerate(tracked)
            if t.container is not None and not is_dtensor(t.tensor)]



def is_dtensor(t: Any) -> bool:
    """A DTensor, by the public attributes we read (to_local, placements,
    device_mesh): torch's DTensor and any tensor subclass that behaves
    like one."""
    return all(hasattr(t, a) for a in ("to_local", "placements", "device_mesh"))



def checked_group(group: Any) -> Any:
    """`group` itself when it is None or a torch.distributed ProcessGroup;
    a TypeError saying what is wanted otherwise (before torch's own calls
    would give a less direct one)."""
    import torch.distributed as dist
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError("process_group must be a torch.distributed ProcessGroup (e.g. "
                        f"dist.new_group() or the default group), got {type(group).__name__}")
    return group
