"""What shardema.EMA tracks of a model: its tensors with their roles, and
how they are split over ranks (the layout). Pure bookkeeping over
PyTorch's public attributes; the roles come from the C++ policy."""
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Tuple

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
    # "rank0"), for the engine to follow a replaced tensor; (None, None)
    # where it cannot (DTensors, local shards).
    owners: List[Tuple[Any, Optional[str]]] = field(default_factory=list)
    # (container, key, tensor, shard index) of tensors held by a module.
    watched: List[Tuple[dict, str, Any, int]] = field(default_factory=list)


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


def _fsdp2_local(name: str, t: Any) -> torch.Tensor:
    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"'{name}': a {mesh.ndim}-D device mesh (HSDP) is not supported yet; "
                         "only FSDP2 on a 1-D mesh, or EMA.from_local_shards")
    placements = tuple(t.placements)
    if len(placements) != 1 or not (placements[0].is_shard() and placements[0].dim == 0):
        raise ValueError(f"'{name}': placement {placements} is not supported; shardema.EMA "
                         "detects FSDP2's Shard(0) only (use EMA.from_local_shards otherwise)")
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
    owners = [(t.tensor, kind) for t in tracked]
    return Plan(name, group, shards, whole, owners, watched_of(tracked))


def _plan_fsdp2(tracked: List[Tracked], dtensors: List[Tracked], layout: str,
                process_group: Any) -> Plan:
    if layout not in ("auto", "fsdp2"):
        raise ValueError(f"layout='{layout}' but '{dtensors[0].name}' is a DTensor (FSDP2); "
                         "use layout='auto' or 'fsdp2'")
    if not dtensors:
        raise ValueError("layout='fsdp2' needs DTensor parameters (fully_shard); for another "
                         "split use EMA.from_local_shards")
    plain_params = [t for t in tracked if not t.is_buffer and not is_dtensor(t.tensor)]
    if plain_params:
        raise ValueError(f"'{plain_params[0].name}' is a plain parameter while "
                         f"'{dtensors[0].name}' is a DTensor: a model partly under fully_shard is "
                         "not supported (shard every parameter, or use EMA.from_local_shards)")
    locals_ = {id(t): _fsdp2_local(t.name, t.tensor) for t in dtensors}
    mesh = dtensors[0].tensor.device_mesh
    group = process_group
    if group is None:
        group = mesh.get_group()
    if process_group is None and any(t.tensor.device_mesh != mesh for t in dtensors):
        raise ValueError("the DTensor parameters live on more than one device mesh; pass "
                         "process_group= for the group they share")
    rank, world = _rank_and_size(group)
    shards, whole, owners = [], [], []
    for t in tracked:
        owners.append((None, None) if is_dtensor(t.tensor) else (t.tensor, "replicated"))
        if is_dtensor(t.tensor):
            local = locals_[id(t)]
            spec = layout_spec(t.name, list(t.tensor.shape), local.dtype, "fsdp2", world)
            # requires_grad is the DTensor's, not its local tensor's, so the
            # engine cannot ask it at each update: decided here, once.
            role = t.role
            if role == "average_if_trainable":
                role = "average" if t.tensor.requires_grad else "copy"
            shards.append(LocalShard(local, spec, role, t.is_buffer))
        else:  # a buffer, the same on every rank: replicated
            if not t.tensor.is_contiguous():
                raise ValueError(f"'{t.name}': the buffer is not contiguous")
            shards += _C.shards_from_full_tensors([(t.name, t.tensor)], [t.role], [True],
                                                  "replicated", rank, world)
            if world > 1:
                whole.append((t.name, t.tensor))
    return Plan("fsdp2", group, shards, whole, owners, watched_of(tracked))
