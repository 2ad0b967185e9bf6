"""shardema.EMA over FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel).

FSDP1 lays each unit's parameters end to end in one FlatParameter and keeps
rank r's slice [r*S, (r+1)*S) of it (its local shard); with
use_orig_params=True the original parameters are 1-D views of that slice
(possibly empty), with False the module holds the FlatParameter alone.
Each rank keeps the EMA of exactly the elements of its local shards: one
piece per member, a view into the local shard (FlatParamLayout's kFsdp1
specs, under the member's clean name, "0.weight" as in FSDP1's full state
dict). FSDP1 has no public description of its layout; shardema lays the
members out itself and checks the result against the FlatParameter's
own record (_shard_param_infos), so a torch that lays them out otherwise
is an error here, not a wrong EMA. Buffers (FSDP1 does not shard them) and
parameters outside every unit (ignored modules) are whole on every rank
but not kept equal by FSDP1; their EMA is rank 0's, as FSDP1's full state
dict holds rank 0's values."""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _C
from ._plan import Plan, Tracked, _is_floating, check_dense, checked_group, is_dtensor, \
    own_tensors, watched_of
from ._shards import FlatParamLayout, LocalShard, ShardSpec

# FSDP1 inserts these module names; the full state dict's keys have none.
_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for wrapper in _WRAPPER_NAMES:
        name = name.replace(wrapper, "")
    return name


def fsdp1_units(module: torch.nn.Module) -> List[Tuple[str, Any]]:
    """(module path, FSDP1 unit) of every FullyShardedDataParallel in
    `module`, outermost first; empty without FSDP1."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without torch.distributed
        return []
    return [(path, mod) for path, mod in module.named_modules()
            if isinstance(mod, FullyShardedDataParallel)]


def _checked_handle(path: str, unit: Any) -> Any:
    """The unit's FlatParamHandle (None: a unit without parameters);
    ValueError naming the unit for a sharding this EMA cannot follow."""
    handle = getattr(unit, "_handle", None)
    if handle is None:
        return None
    strategy = handle._sharding_strategy.name
    if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise ValueError(f"FSDP1 unit '{path or '<root>'}' uses ShardingStrategy {strategy}; "
                         "shardema.EMA follows FULL_SHARD and SHARD_GRAD_OP (use DDP for "
                         "NO_SHARD; for HYBRID_SHARD build the EMA with EMA.from_local_shards over "
                         "the shard group)")
    return handle


def _local_shard(flat: torch.Tensor) -> torch.Tensor:
    """The rank's slice of the FlatParameter: its _local_shard, which the
    FlatParameter's data points back to whenever FSDP1 reshards (the
    optimizer steps it in place), so the EMA's views stay valid across
    forwards."""
    local = getattr(flat, "_local_shard", None)
    return flat.data if local is None else local


def _member_pieces(path: str, handle: Any, rank: int,
                   world: int) -> List[Tuple["_C.LocalShard", int]]:
    """(this rank's piece of the member, named by its full clean name; the
    member's index) for each member of the unit's FlatParameter, checked
    against FSDP1's own record of where each lies."""
    flat = handle.flat_param
    local = _local_shard(flat)
    prefix = clean_name(path + "." if path else "")
    members = [(prefix + clean_name(fqn), list(shape))
               for fqn, shape in zip(flat._fqns, flat._shapes)]
    # FSDP1 aligns members (use_orig_params) for the dtype it gathers and
    # computes in, MixedPrecision's param_dtype; the shard keeps the
    # parameters' dtype. Lay out in the first, view and describe the second.
    align = getattr(handle, "_fwd_bwd_param_dtype", None) or local.dtype
    layout = FlatParamLayout(members, align, world, use_orig_params=bool(handle._use_orig_params))
    where = f"FSDP1 unit '{path or '<root>'}'"
    if layout.shard_numel != local.numel():
        raise ValueError(f"{where}: its local flat shard has {local.numel()} elements, shardema's "
                         f"layout of its members gives {layout.shard_numel}; this torch lays "
                         "FSDP1 out otherwise (build the EMA with EMA.from_local_shards)")
    probe = torch.empty(layout.shard_numel, dtype=align)
    at = {s.spec.name: (s.local.storage_offset(), s.local.numel())
          for s in layout.shards_from_flat_param(probe, rank)}
    specs = layout.specs()
    out = []
    for index, ((name, shape), info) in enumerate(zip(members, flat._shard_param_infos)):
        offset, numel = at.get(name, (0, 0))
        begin = specs[index].ranges[rank][0]
        theirs = (info.numel_in_shard, info.offset_in_shard, info.intra_param_start_idx) \
            if info.in_shard else (0, None, None)
        ours = (numel, offset, begin) if numel else (0, None, None)
        if ours != theirs:
            raise ValueError(f"{where}: parameter '{name}' lies at (numel, offset in shard, first "
                             f"element) {theirs} of rank {rank}'s flat shard, shardema's layout "
                             f"says {ours}; this torch lays FSDP1 out otherwise (build the EMA "
                             "with EMA.from_local_shards)")
        spec = ShardSpec(name, shape, local.dtype, "fsdp1", specs[index].ranges)
        # An empty piece (the member lies wholly on other ranks) is a view
        # of nothing, so the spec still names it on this rank.
        piece = LocalShard(local[offset:offset + numel], spec, "average", False)
        out.append((piece, index))
    return out


def _refuse_outside_unit(module: torch.nn.Module, skip: Any = ()) -> None:
    """ValueError naming the first parameter of `module` (less those of the
    units inside it, `skip` by id) that an FSDP1 unit outside it manages:
    the module inside FullyShardedDataParallel(module) holds (with
    use_orig_params=True) 1-D views of its rank's flat shard, which would
    otherwise be averaged as if they were whole tensors."""
    for name, p in module.named_parameters():
        if id(p) not in skip and getattr(p, "_fsdp_flattened", False):
            raise ValueError(f"'{name}' belongs to an FSDP1 unit (FullyShardedDataParallel) that "
                             "wraps this module from outside; its tensor here is this rank's "
                             f"piece of a flat shard ({tuple(p.shape)}). Build the EMA from the "
                             "FullyShardedDataParallel model itself")


def fsdp1_tensors(module: torch.nn.Module, policy: str) -> Optional[List[Tracked]]:
    """What shardema.EMA tracks of a model holding FSDP1 units: a Tracked
    per member of each FlatParameter (its `piece` this rank's view of it),
    then the tensors outside every FlatParameter (buffers, ignored
    modules' parameters), by clean name; None without FSDP1."""
    units = fsdp1_units(module)
    if not units:
        _refuse_outside_unit(module)
        return None
    batch_norm = torch.nn.modules.batchnorm._BatchNorm
    out: List[Tracked] = []
    in_flat = set()
    for path, unit in units:
        handle = _checked_handle(path, unit)
        if handle is None:
            continue
        flat = handle.flat_param
        in_flat.add(id(flat))
        rank, world = unit.rank, unit.world_size
        originals = list(getattr(flat, "_params", None) or [])
        for piece, index in _member_pieces(path, handle, rank, world):
            # With use_orig_params=True each original parameter keeps its own
            # requires_grad (read at every update); with False they share
            # the FlatParameter's.
            decider = originals[index] if index < len(originals) else flat
            in_flat.add(id(decider))
            # FSDP's own name of the member: module paths keep their wrappers
            # (activation checkpointing's) there.
            owner_path = flat._fqns[index].rpartition(".")[0]
            owner = unit.module.get_submodule(owner_path) if owner_path else unit.module
            role = _C.role_for(policy, False, _is_floating(piece.local),
                               bool(decider.requires_grad), isinstance(owner, batch_norm))
            out.append(Tracked(piece.spec.name, decider, role, False, piece=(piece, path, unit),
                               aliases=_shared_names(path, flat, flat._fqns[index])))
    _refuse_outside_unit(module, skip=in_flat)
    seen = set(in_flat)
    for path, mod in module.named_modules():
        in_bn = isinstance(mod, batch_norm)
        for key, tensor, is_buffer, container, persistent in own_tensors(mod):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = clean_name(f"{path}.{key}" if path else key)
            check_dense(name, tensor)
            role = _C.role_for(policy, is_buffer, _is_floating(tensor),
                               bool(tensor.requires_grad), in_bn)
            out.append(Tracked(name, tensor, role, is_buffer, container, key,
                               persistent=persistent))
    return out


def _shared_names(path: str, flat: Any, fqn: str) -> List[str]:
    """The other clean names of member `fqn` of a FlatParameter: a tied
    weight (GPT-2's lm_head.weight is transformer.wte.weight) is one member,
    and FSDP1 records its other names in _shared_param_infos. The EMA keeps
    it once and gives it under every name, as for a model without FSDP1
    (export_weights(), full_state_dict(): the keys of state_dict())."""
    prefix = clean_name(path + "." if path else "")

    def joined(module_name: str, param_name: str) -> str:
        return f"{module_name}.{param_name}" if module_name else param_name
    return [prefix + clean_name(joined(info.module_name, info.param_name))
            for info in getattr(flat, "_shared_param_infos", None) or ()
            if joined(info.prim_module_name, info.prim_param_name) == fqn]


def _group_of(units: List[Tuple[str, Any]]) -> Any:
    """The process group every FSDP1 unit shards over; ValueError naming
    a unit on another group."""
    import torch.distributed as dist
    first_path, first = units[0]
    group = first.process_group
    ranks = dist.get_process_group_ranks(group)
    for path, unit in units[1:]:
        if dist.get_process_group_ranks(unit.process_group) != ranks:
            raise ValueError(f"FSDP1 unit '{path}' shards over ranks "
                             f"{dist.get_process_group_ranks(unit.process_group)}, unit "
                             f"'{first_path or '<root>'}' over {ranks}; shardema.EMA follows one "
                             "process group")
    return group


def plan_fsdp1(tracked: List[Tracked], layout: str, process_group: Any) -> Plan:
    """This rank's pieces of the FlatParameters' members; the tensors
    outside them (rank 0 keeps their EMA whole)."""
    import torch.distributed as dist
    if layout not in ("auto", "fsdp1"):
        raise ValueError(f"layout='{layout}' but the model holds FSDP1 units "
                         "(FullyShardedDataParallel); use layout='auto'")
    group = checked_group(process_group)
    units = list({id(t.piece[2]): (t.piece[1], t.piece[2]) for t in tracked
                  if t.piece is not None}.values())
    units_group = _group_of(units)
    if group is not None and dist.get_process_group_ranks(group) != \
            dist.get_process_group_ranks(units_group):
        raise ValueError("process_group: the FSDP1 units shard over ranks "
                         f"{dist.get_process_group_ranks(units_group)}; the EMA's group must be "
                         "theirs")
    group = units_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shards, whole, owners = [], [], []
    for t in tracked:
        if t.piece is not None:
            piece = t.piece[0]
            shards.append(LocalShard(piece.local, piece.spec, t.role, False, aliases=t.aliases))
            owners.append((None, None, t.tensor))
            continue
        if not t.tensor.is_contiguous():
            raise ValueError(f"'{t.name}': the tensor is not contiguous; shardema tracks "
                             "contiguous parameters and buffers")
        # FSDP1 keeps these equal on no rank (buffers change in each rank's
        # forward, ignored modules' gradients are not reduced); its full
        # state dict holds rank 0's, and so does the EMA: rank 0 averages
        # them whole, and swap() gives every rank rank 0's EMA.
        shards += _C.shards_from_full_tensors([(t.name, t.tensor)], [t.role], [t.is_buffer],
                                              "rank0", rank, world)
        if world > 1:
            whole.append((t.name, t.tensor))
        owners.append((t.tensor, "rank0", t.tensor))
    return Plan("fsdp1", group, shards, whole, owners, watched_of(tracked))


def reshard_fsdp1(module: Any) -> None:
    """Frees the gathered (unsharded) FlatParameter that FSDP1 keeps for its
    root unit after a forward without a backward (evaluation): FSDP1 does
    not free the root's after forward, and its next forward reuses that
    gathered copy instead of gathering the shards again. Without this, a
    forward inside swap() would leave the EMA in that copy, and the
    training step after validation would run the root's layers on the EMA
    weights; one before swap() would not see the EMA there. The shards
    themselves are untouched. No communication."""
    if not isinstance(module, torch.nn.Module):
        return
    for _, unit in fsdp1_units(module):
        handle = getattr(unit, "_handle", None)
        if handle is None or not handle.uses_sharded_strategy:
            continue
        # needs_unshard() is False while a gathered copy is still allocated.
        if not handle.needs_unshard():
            handle.reshard(True)
            handle.post_reshard()


# --- the Lightning callbacks under FSDPStrategy (an FSDP1 root) ----------------

def fsdp1_root(trainer: Any, pl_module: Any) -> Any:
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


def fsdp1_names(names: Sequence[str], prefix: str) -> Tuple[List[str], List[str]]:
    """(the names under `prefix`, the others) of `names`, what shardema.EMA
    tracks of an FSDP1 root: FSDP1's clean names, which are Lightning's
    state_dict keys (the root wraps the LightningModule)."""
    return [n for n in names if n.startswith(prefix)], \
        [n for n in names if not n.startswith(prefix)]


def fsdp1_non_persistent(root: torch.nn.Module) -> set:
    """The clean names of root's non-persistent buffers (in no state dict)."""
    from ._fsdp1 import clean_name
    return {clean_name(f"{prefix}.{b}" if prefix else b) for prefix, m in root.named_modules()
            for b in getattr(m, "_non_persistent_buffers_set", ())}


def fsdp1_full_tensors(root: torch.nn.Module, names: Sequence[str]) -> Dict[str, torch.Tensor]:
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


def fsdp1_load_full(root: torch.nn.Module, values: Dict[str, torch.Tensor]) -> None:
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


def refuse_fsdp1_sharded_state(api: str, state: Dict[str, Any], keys: Sequence[str]) -> None:
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

