"""What shardema.EMA tracks of a model: its tensors with their roles, and
how they are split over ranks (the layout). Pure bookkeeping over
PyTorch's public attributes; the roles come from the C++ policy."""
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from . import _C
from ._plan import Plan, Tracked, _is_floating, alias_slots_of, check_dense, checked_group, \
    is_dtensor, own_tensors, watched_of
from ._shards import LocalShard, layout_spec

LAYOUTS = ("auto", "replicated", "rank0", "fsdp2")


def unwrap(model: Any) -> Any:
    """The module inside DDP (and DataParallel, DeepSpeed's engine) and torch.compile's
    OptimizedModule, in any nesting, so names have neither 'module.' nor
    '_orig_mod.': an EMA built on the compiled module or on the eager one
    tracks the same tensors under the same names, and takes either."""
    return _unwrapped(model)[0]


def wrapper_prefix(model: Any) -> str:
    """The state_dict key prefix of what unwrap() strips ('_orig_mod.' for a
    compiled module, 'module.' for DDP, in nesting order): a LightningModule
    holding `self.net = torch.compile(net)` saves `net._orig_mod.*` keys."""
    return _unwrapped(model)[1]


def _unwrapped(model: Any) -> Tuple[Any, str]:
    prefix = ""
    while isinstance(model, torch.nn.Module):
        wrapper = type(model).__name__
        if wrapper in ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine"):
            key = "module"
        elif wrapper == "OptimizedModule":  # torch._dynamo.eval_frame.OptimizedModule
            key = "_orig_mod"
        else:
            break
        inner = getattr(model, key, None)
        if not isinstance(inner, torch.nn.Module):
            break
        model, prefix = inner, f"{prefix}{key}."
    return model, prefix


def module_tensors(module: torch.nn.Module, policy: str) -> List[Tracked]:
    """Parameters and buffers in state_dict order (each module's own
    parameters, its buffers, then its children), with the role `policy`
    gives each. A tensor held under several keys (tied weights, a module
    used twice) is tracked once, under its first, with the others as its
    aliases. A model holding FSDP1 units: their FlatParameters' members by
    clean name (_fsdp1.py); a ZeRO-3 model: its parameters' partitions
    (_zero3.py)."""
    from ._fsdp1 import fsdp1_tensors
    from ._zero3 import zero3_tensors
    zero3 = zero3_tensors(module, policy)
    if zero3 is not None:
        return zero3
    fsdp1 = fsdp1_tensors(module, policy)
    if fsdp1 is not None:
        return fsdp1
    batch_norm = torch.nn.modules.batchnorm._BatchNorm
    seen: Dict[int, Tracked] = {}
    out: List[Tracked] = []
    # remove_duplicate=False: state_dict() lists a module held twice under
    # both paths, so its tensors are aliases under the second.
    for prefix, mod in module.named_modules(remove_duplicate=False):
        in_bn = isinstance(mod, batch_norm)
        for name, tensor, is_buffer, container, persistent in own_tensors(mod):
            if id(tensor) in seen:
                if persistent:
                    seen[id(tensor)].aliases.append(f"{prefix}.{name}" if prefix else name)
                    seen[id(tensor)].alias_slots.append((container, name))
                continue
            role = _C.role_for(policy, is_buffer, _is_floating(tensor),
                               bool(tensor.requires_grad), in_bn)
            check_dense(f"{prefix}.{name}" if prefix else name, tensor)
            out.append(Tracked(f"{prefix}.{name}" if prefix else name, tensor, role, is_buffer,
                               container, name, persistent=persistent))
            seen[id(tensor)] = out[-1]
    return out


def aliases_of(tracked: List[Tracked]) -> Dict[str, str]:
    """Each tied tensor's other names, to the name it is tracked under."""
    return {alias: t.name for t in tracked for alias in t.aliases}


def named_tensors(items: Iterable[Tuple[str, Any]], policy: str) -> List[Tracked]:
    """(name, tensor) pairs: nn.Parameters are parameters, anything else a buffer."""
    out = []
    for index, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            # diffusers' EMAModel(model.parameters()): the EMA needs names
            # (and the module tree, to follow and swap) that bare tensors lack.
            raise TypeError("shardema.EMA: got a tensor without a name (model.parameters()?); "
                            "pass the nn.Module itself, EMA(model), or (name, tensor) pairs "
                            "such as model.named_parameters()")
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"shardema.EMA: model_or_named_tensors[{index}]: expected a (name, "
                            f"tensor) pair, got {type(item).__name__}")
        name, tensor = item
        check_dense(name, tensor)
        is_buffer = not isinstance(tensor, torch.nn.Parameter) and not is_dtensor(tensor)
        role = _C.role_for(policy, is_buffer, _is_floating(tensor),
                           bool(getattr(tensor, "requires_grad", False)), False)
        out.append(Tracked(name, tensor, role, is_buffer))
    return out


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
    shardema's collectives run over (on a 2-D mesh the first dimension must
    replicate: HSDP's replicas):
    - "fsdp2": Shard(0), torch.chunk's rows (fully_shard, ColwiseParallel);
    - "tensor_parallel": Shard(d) with d > 0 (RowwiseParallel's weight,
      distribute_tensor(..., [Shard(1)])): each rank keeps the EMA of its
      to_local() as it is laid out;
    - "replicated": Replicate() on every dimension: each rank holds the
      whole tensor and keeps the EMA of its rows of it, as under DDP.
    ValueError naming the tensor and its placements otherwise."""
    mesh = t.device_mesh
    placements = tuple(t.placements)
    if mesh.ndim > 2:
        raise ValueError(f"'{name}': a {mesh.ndim}-D device mesh is not supported; shardema.EMA "
                         "follows a 1-D mesh (FSDP2, tensor parallelism) and a 2-D one whose "
                         "first dimension replicates (HSDP) (or use EMA.from_local_shards)")
    if all(p.is_replicate() for p in placements):
        return "replicated"
    last = placements[-1]
    # _StridedShard (FSDP2 over tensor parallelism) is a Shard too, with a
    # split factor: its pieces are not torch.chunk's.
    plain_shard = last.is_shard() and getattr(last, "split_factor", 1) == 1
    if plain_shard and all(p.is_replicate() for p in placements[:-1]) and t.dim() > 0:
        return "fsdp2" if last.dim % t.dim() == 0 else "tensor_parallel"
    raise ValueError(f"'{name}': placements {placements} on a {mesh.ndim}-D mesh are not "
                     "supported; shardema.EMA follows Shard(d) on the mesh's last dimension "
                     "(FSDP2's Shard(0), tensor parallelism's Shard(1), ...) with Replicate() "
                     "on the first one (HSDP), and Replicate(). Another split (a shard of a "
                     "shard, a sharded first dimension) is not one torch.chunk piece per rank "
                     "of the collectives' group")


def _fsdp2_local(name: str, t: Any) -> torch.Tensor:
    """The local tensor of DTensor `t` (validated by dtensor_split)."""
    split = dtensor_split(name, t)
    local = getattr(t, "_local_tensor", None)
    if local is None:
        with torch.no_grad():
            local = t.to_local()
    if split == "tensor_parallel" and not local.is_contiguous():
        # The engine reads and writes the piece as one flat run of memory.
        raise ValueError(f"'{name}': its local tensor (placements {tuple(t.placements)}) is not "
                         "contiguous; shardema tracks contiguous pieces")
    return local


def split_dim(t: Any) -> int:
    """d of a Shard(d) DTensor's last placement."""
    return tuple(t.placements)[-1].dim % t.dim()


def tensor_parallel_spec(name: str, t: Any, local: torch.Tensor, world: int) -> Any:
    """The engine's spec of this rank's Shard(d) piece, d > 0: the dim-0 rows
    of the tensor with dim d moved first. torch.chunk along d gives each rank
    the same elements as those rows, in to_local()'s order: the engine keeps
    the piece as it is (average, copy, swap) and its gathers move dim d
    first and back (LocalShard split_dim)."""
    shape = list(t.shape)
    dim = split_dim(t)
    moved = [shape[dim]] + shape[:dim] + shape[dim + 1:]
    return layout_spec(name, moved, local.dtype, "fsdp2", world)


def refuse_tensor_parallel(tensor_parallel: Dict[str, Any], api: str) -> None:
    """ValueError naming the Shard(d > 0) tensors, for `api` (a call that
    writes or reads the engine's sharded files, whose ShardSpec describes
    each rank's part as rows of dim 0)."""
    if not tensor_parallel:
        return
    name, t = next(iter(tensor_parallel.items()))
    others = [repr(n) for n in tensor_parallel][1:]
    also = f" (also {', '.join(others[:5])}{' ...' if len(others) > 5 else ''})" if others else ""
    raise ValueError(f"shardema.EMA.{api}: '{name}' has placements {tuple(t.placements)}{also} "
                     "(tensor parallelism): shardema's sharded files describe each rank's "
                     "part as rows of dim 0 and cannot hold this split. Save the EMA with "
                     "torch.distributed.checkpoint instead, dcp.save({'ema': "
                     "ema.state_dict(), ...}) (it reshards at load), or write it whole with "
                     "export_weights()")


def plan_layout(tracked: List[Tracked], layout: str, process_group: Any, *,
                buffers: str = "per_rank") -> Plan:
    """This rank's local shards (and the whole tensors a swap writes into
    after a gather) for `layout`; ValueError naming the tensor for what is
    not supported. `buffers`: the kind of a model's plain buffers under DDP
    and FSDP2, which the ranks do not keep equal: "per_rank" (each rank its
    own whole, rank 0's for the job), or "replicated" (rows, for the
    post-hoc snapshots, which hold each rank's rows)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got '{layout}'")
    checked_group(process_group)
    from ._zero3 import Partition, plan_zero3
    if any(isinstance(t.piece, Partition) for t in tracked):
        return _marked_persistence(plan_zero3(tracked, layout, process_group), tracked)
    if any(t.piece is not None for t in tracked):
        from ._fsdp1 import plan_fsdp1
        return _marked_persistence(plan_fsdp1(tracked, layout, process_group), tracked)
    dtensors = [t for t in tracked if is_dtensor(t.tensor)]
    if dtensors or layout == "fsdp2":
        plan = _plan_fsdp2(tracked, dtensors, layout, process_group, buffers)
    else:
        plan = _plan_plain(tracked, layout, process_group, buffers)
    plan.alias_slots = alias_slots_of(tracked)
    return _marked_persistence(plan, tracked)


def _marked_persistence(plan: Plan, tracked: List[Tracked]) -> Plan:
    """The plan's shards of non-persistent buffers marked so (LocalShard.persistent)."""
    non_persistent = {t.name for t in tracked if not t.persistent}
    for shard in plan.shards:
        if shard.spec.name in non_persistent:
            shard.persistent = False
    return plan


def _plan_plain(tracked: List[Tracked], layout: str, process_group: Any,
                buffers: str) -> Plan:
    """One process, DDP (replicated) or rank0: plain tensors."""
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
    # Buffers (BatchNorm statistics) differ between DDP's ranks after each
    # forward: each rank keeps its own whole (the C++ "per_rank" kind, rank
    # 0's standing for the job), the parameters each rank's rows. One
    # process too, so its files reshard into a DDP job's layout.
    kinds = [(buffers if t.is_buffer else kind) if kind == "replicated" else kind
             for t in tracked]
    shards = [_C.shards_from_full_tensors([(t.name, t.tensor)], [t.role], [t.is_buffer], k,
                                          rank, world)[0] for t, k in zip(tracked, kinds)]
    for shard, t in zip(shards, tracked):
        shard.aliases = t.aliases
    # The tensors a swap gathers into: those of which each rank keeps rows.
    whole = [(t.name, t.tensor) for t, k in zip(tracked, kinds) if k == "replicated"] \
        if world > 1 else []
    name = "single" if group is None else kind
    owners = [(t.tensor, k, t.tensor) for t, k in zip(tracked, kinds)]
    return Plan(name, group, shards, whole, owners, watched_of(tracked),
                aliases=aliases_of(tracked))


def _mesh_groups(mesh: Any) -> Tuple[Any, Any]:
    """(the group of the mesh's last dimension, the one the collectives run
    over; the group of its first dimension when it has two (HSDP's
    replicas), else None)."""
    if mesh.ndim == 1:
        return mesh.get_group(), None
    return mesh.get_group(mesh.ndim - 1), mesh.get_group(0)


def _plan_fsdp2(tracked: List[Tracked], dtensors: List[Tracked], layout: str,
                process_group: Any, buffers: str = "per_rank") -> Plan:
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
    tensor_parallel: Dict[str, Any] = {}
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
        if is_dtensor(t.tensor) and splits[id(t)] in ("fsdp2", "tensor_parallel"):
            if splits[id(t)] == "fsdp2":
                spec = layout_spec(t.name, list(t.tensor.shape), local.dtype, "fsdp2", world)
                shards.append(LocalShard(local, spec, t.role, t.is_buffer, aliases=t.aliases))
            else:
                spec = tensor_parallel_spec(t.name, t.tensor, local, world)
                tensor_parallel[t.name] = t.tensor
                shards.append(LocalShard(local, spec, t.role, t.is_buffer, aliases=t.aliases,
                                         split_dim=split_dim(t.tensor)))
            # requires_grad is the DTensor's: the engine asks it at each update.
            owners.append((None, None, t.tensor))
            continue
        # Whole on every rank (a plain tensor, a Replicate() DTensor's local).
        # A buffer (FSDP2 never makes the ranks' equal): each rank keeps its
        # own ("per_rank"). What the ranks hold equal: each rank keeps the
        # EMA of its rows, and a swap gathers them into it.
        kind = buffers if t.is_buffer and not is_dtensor(t.tensor) else "replicated"
        shards += _C.shards_from_full_tensors([(t.name, local)], [t.role], [t.is_buffer],
                                              kind, rank, world)
        shards[-1].aliases = t.aliases
        if world > 1 and kind == "replicated":
            whole.append((t.name, local))
        # A DTensor's local cannot be followed when replaced (FSDP2 swaps it
        # itself); a plain tensor is, as under DDP.
        owners.append((None, None, t.tensor) if is_dtensor(t.tensor)
                      else (t.tensor, kind, t.tensor))
    return Plan("fsdp2", group, shards, whole, owners, watched_of(tracked), replicas,
                tensor_parallel, aliases_of(tracked))
