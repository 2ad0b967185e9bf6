"""What shardema.EMA tracks of a model: its tensors with their roles, and
how they are split over ranks (the layout). Pure bookkeeping over
PyTorch's public attributes; the roles come from the C++ policy."""
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch

from . import _C
from ._shards import LocalShard, layout_spec

_LAYOUTS = ("auto", "replicated", "rank0", "fsdp2")


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


def unwrap(model: Any) -> Any:
    """The module inside DDP (and DataParallel), so names have no 'module.'."""
    inner = getattr(model, "module", None)
    if isinstance(model, torch.nn.Module) and isinstance(inner, torch.nn.Module) and \
            type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
        return inner
    return model


def _is_floating(t: Any) -> bool:
    return bool(t.dtype.is_floating_point) or bool(getattr(t.dtype, "is_complex", False))


def module_tensors(module: torch.nn.Module, policy: str) -> List[Tracked]:
    """Parameters and buffers in state_dict order (each module's own
    parameters, its buffers, then its children), shared tensors once, with
    the role `policy` gives each."""
    batch_norm = torch.nn.modules.batchnorm._BatchNorm
    seen = set()
    out: List[Tracked] = []
    for prefix, mod in module.named_modules():
        in_bn = isinstance(mod, batch_norm)
        own = [(n, t, False, mod._parameters) for n, t in mod._parameters.items()] + \
              [(n, t, True, mod._buffers) for n, t in mod._buffers.items()]
        for name, tensor, is_buffer, container in own:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            role = _C.role_for(policy, is_buffer, _is_floating(tensor),
                               bool(tensor.requires_grad), in_bn)
            check_dense(f"{prefix}.{name}" if prefix else name, tensor)
            out.append(Tracked(f"{prefix}.{name}" if prefix else name, tensor, role, is_buffer,
                               container, name))
    return out


def named_tensors(items: Iterable[Tuple[str, Any]], policy: str) -> List[Tracked]:
    """(name, tensor) pairs: nn.Parameters are parameters, anything else a buffer."""
    out = []
    for index, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"model_or_named_tensors[{index}]: expected a (name, tensor) pair")
        name, tensor = item
        check_dense(name, tensor)
        is_buffer = not isinstance(tensor, torch.nn.Parameter) and not is_dtensor(tensor)
        role = _C.role_for(policy, is_buffer, _is_floating(tensor),
                           bool(getattr(tensor, "requires_grad", False)), False)
        out.append(Tracked(name, tensor, role, is_buffer))
    return out


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


def _default_group() -> Optional[Any]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return None


def _rank_and_size(group: Any) -> Tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist
    return dist.get_rank(group), dist.get_world_size(group)


def dtensor_split(name: str, t: Any) -> str:
    """How DTensor `t` is split over the last dimension of its mesh, the one
    shardema's collectives run over: "fsdp2" (Shard(0): torch.chunk's rows,
    as fully_shard leaves them; on a 2-D mesh, HSDP, the first dimension
    replicates them) or "replicated" (Replicate() on every dimension: each
    rank holds the whole tensor, and keeps the EMA of its rows of it, as
    under DDP). ValueError naming the tensor otherwise."""
    mesh = t.device_mesh
    placements = tuple(t.placements)
    if mesh.ndim > 2:
        raise ValueError(f"'{name}': a {mesh.ndim}-D device mesh is not supported; shardema.EMA "
                         "follows FSDP2 on a 1-D mesh and HSDP on a 2-D one (or use "
                         "EMA.from_local_shards)")
    if all(p.is_replicate() for p in placements):
        return "replicated"
    if placements[-1].is_shard(0) and all(p.is_replicate() for p in placements[:-1]):
        return "fsdp2"
    raise ValueError(f"'{name}': placements {placements} on a {mesh.ndim}-D mesh are not "
                     "supported; shardema.EMA follows Shard(0) (FSDP2, or HSDP's (Replicate(), "
                     "Shard(0))) and Replicate(). Another split (tensor parallelism's Shard(1), "
                     "a shard of a shard) gives a rank pieces that are not one range of the "
                     "flattened tensor")


def _fsdp2_local(name: str, t: Any) -> torch.Tensor:
    """The local tensor of DTensor `t` (validated by dtensor_split)."""
    dtensor_split(name, t)
    local = getattr(t, "_local_tensor", None)
    if local is None:
        with torch.no_grad():
            local = t.to_local()
    return local


def plan_layout(tracked: List[Tracked], layout: str, process_group: Any) -> Plan:
    """This rank's local shards (and the whole tensors a swap writes into
    after a gather) for `layout`; ValueError naming the tensor for what is
    not supported."""
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got '{layout}'")
    checked_group(process_group)
    dtensors = [t for t in tracked if is_dtensor(t.tensor)]
    if dtensors or layout == "fsdp2":
        return _plan_fsdp2(tracked, dtensors, layout, process_group)
    group = process_group if process_group is not None else _default_group()
    if layout in ("replicated", "rank0") and group is None:
        raise RuntimeError(f"layout='{layout}' needs an initialised torch.distributed group "
                           "(dist.init_process_group) or process_group=...; without one, use "
                           "layout='auto' for a single process")
    kind = "rank0" if layout == "rank0" else "replicated"
    rank, world = _rank_and_size(group)
    for t in tracked:
        if not t.tensor.is_contiguous():
            raise ValueError(f"'{t.name}': the tensor is not contiguous; shardema tracks "
                             "contiguous parameters and buffers")
    shards = _C.shards_from_full_tensors([(t.name, t.tensor) for t in tracked],
                                         [t.role for t in tracked],
                                         [t.is_buffer for t in tracked], kind, rank, world)
    whole = [(t.name, t.tensor) for t in tracked] if world > 1 else []
    name = "single" if group is None else kind
    owners = [(t.tensor, kind, t.tensor) for t in tracked]
    return Plan(name, group, shards, whole, owners, watched_of(tracked))


def _mesh_groups(mesh: Any) -> Tuple[Any, Any]:
    """(the group of the mesh's last dimension, the one the collectives run
    over; the group of its first dimension when it has two (HSDP's
    replicas), else None)."""
    if mesh.ndim == 1:
        return mesh.get_group(), None
    return mesh.get_group(mesh.ndim - 1), mesh.get_group(0)


def _plan_fsdp2(tracked: List[Tracked], dtensors: List[Tracked], layout: str,
                process_group: Any) -> Plan:
    if layout not in ("auto", "fsdp2"):
        raise ValueError(f"layout='{layout}' but '{dtensors[0].name}' is a DTensor (FSDP2); "
                         "use layout='auto' or 'fsdp2'")
    if not dtensors:
        raise ValueError("layout='fsdp2' needs DTensor parameters (fully_shard); for another "
                         "split use EMA.from_local_shards")
    splits = {id(t): dtensor_split(t.name, t.tensor) for t in dtensors}
    mesh = dtensors[0].tensor.device_mesh
    if process_group is None and any(t.tensor.device_mesh != mesh for t in dtensors):
        raise ValueError("the DTensor parameters live on more than one device mesh; pass "
                         "process_group= for the group they share")
    group, replicas = _mesh_groups(mesh)
    if process_group is not None:
        group = process_group
    rank, world = _rank_and_size(group)
    shards, whole, owners = [], [], []
    for t in tracked:
        if is_dtensor(t.tensor):
            local = _fsdp2_local(t.name, t.tensor)
        else:
            # A buffer, or a parameter outside fully_shard (a model partly
            # under it): the same on every rank of the group, as under DDP.
            local = t.tensor
            if not local.is_contiguous():
                raise ValueError(f"'{t.name}': the tensor is not contiguous; shardema tracks "
                                 "contiguous parameters and buffers")
        if is_dtensor(t.tensor) and splits[id(t)] == "fsdp2":
            spec = layout_spec(t.name, list(t.tensor.shape), local.dtype, "fsdp2", world)
            shards.append(LocalShard(local, spec, t.role, t.is_buffer))
            # requires_grad is the DTensor's: the engine asks it at each update.
            owners.append((None, None, t.tensor))
            continue
        # Whole on every rank (a plain tensor, a Replicate() DTensor's local):
        # each rank keeps the EMA of its rows; a swap gathers them into it.
        shards += _C.shards_from_full_tensors([(t.name, local)], [t.role], [t.is_buffer],
                                              "replicated", rank, world)
        if world > 1:
            whole.append((t.name, local))
        # A DTensor's local cannot be followed when replaced (FSDP2 swaps it
        # itself); a plain tensor is, as under DDP.
        owners.append((None, None, t.tensor) if is_dtensor(t.tensor)
                      else (t.tensor, "replicated", t.tensor))
    return Plan("fsdp2", group, shards, whole, owners, watched_of(tracked), replicas)


def write_on_first_replica(replicas: Any, write: Callable[[], None]) -> None:
    """Runs `write` (a collective of the shard group that writes files:
    save_checkpoint, export_weights) on the first replica only, the mesh's
    first index of its replicate dimension (global rank 0's under
    init_device_mesh). HSDP's replicas hold the same EMA: one set of files,
    not one per replica racing for the same names. The other replicas wait
    for their peer on the first replica and raise its error, so the call
    returns on every rank once the files are complete or failed."""
    if replicas is None:
        write()
        return
    import torch.distributed as dist
    failure: List[Optional[str]] = [None]
    raised: Optional[BaseException] = None
    if dist.get_rank(replicas) == 0:
        try:
            write()
        except Exception as error:  # every replica learns it below
            raised = error
            failure[0] = f"{type(error).__name__}: {error}"
    dist.broadcast_object_list(failure, src=dist.get_global_rank(replicas, 0), group=replicas)
    if raised is not None:
        raise raised
    if failure[0] is not None:
        raise RuntimeError(f"the first HSDP replica, which writes the files, failed: {failure[0]}")
