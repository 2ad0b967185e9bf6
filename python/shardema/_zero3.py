"""shardema.EMA over DeepSpeed ZeRO stage 3 (deepspeed.initialize with
"zero_optimization": {"stage": 3}).

ZeRO-3 keeps each parameter flattened and padded to a multiple of the
world size W; rank r holds the P = ceil(numel / W) elements [r*P, (r+1)*P)
in `param.ds_tensor` (its partition; the last ranks' may be padding only),
while `param.data` is empty outside a forward. `param.ds_shape` and
`param.ds_numel` describe the full tensor. Each rank keeps the EMA of the
real elements of its partitions: one piece per parameter, a view into its
ds_tensor, described as a range of the flattened tensor (the C++ "fsdp1"
kind, which FSDP1's flat shards use too), under the parameter's name in
the module given (a plain model's state_dict key). So checkpoints,
export_weights() (gathered streaming) and swap() work as under FSDP1.
Buffers (ZeRO-3 does not partition them) and parameters without a
partition are whole on every rank; their EMA is rank 0's, as DeepSpeed's
consolidated 16-bit weights hold rank 0's buffers.

ZeRO-3 keeps some parameters gathered between forwards (those under
stage3_param_persistence_threshold, and any left by an evaluation
forward); a swap releases them (release_gathered) so the next forward
gathers them again from the partitions, which hold the EMA inside swap()
and the raw weights after it."""
from typing import Any, List, NamedTuple, Optional

import torch

from . import _C
from ._plan import Plan, Tracked, _is_floating, check_dense, checked_group, own_tensors, \
    watched_of
from ._shards import LocalShard, ShardSpec


class Partition(NamedTuple):
    """Tracked.piece of a ZeRO-3 parameter: this rank's LocalShard of it (a
    view into its ds_tensor) and the group it is partitioned over."""
    shard: Any
    group: Any


def is_zero3_parameter(p: Any) -> bool:
    """A parameter DeepSpeed ZeRO-3 partitioned (zero.Init or
    deepspeed.initialize with stage 3): it carries ds_tensor and ds_shape."""
    return getattr(p, "ds_tensor", None) is not None and hasattr(p, "ds_shape")


def _partition_piece(name: str, p: Any, role: str) -> Partition:
    """This rank's real elements of p's partition, as a LocalShard whose
    spec gives every rank's range of the flattened tensor. ValueError
    naming the parameter for a partition laid out otherwise."""
    import torch.distributed as dist
    group = getattr(p, "ds_process_group", None)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    numel, shape = int(p.ds_numel), [int(d) for d in p.ds_shape]
    partition = p.ds_tensor
    per_rank = int(getattr(partition, "ds_numel", partition.numel()))
    if per_rank != -(-numel // world) or partition.numel() != per_rank:
        raise ValueError(f"ZeRO-3 parameter '{name}' ({numel} elements over {world} ranks) has a "
                         f"partition of {partition.numel()} elements (ds_numel {per_rank}); "
                         f"shardema follows partitions of ceil(numel / world) = "
                         f"{-(-numel // world)} in memory (not offloaded to NVMe, not ZeRO++'s "
                         "secondary partitions)")
    ranges = [(min(r * per_rank, numel), min((r + 1) * per_rank, numel)) for r in range(world)]
    begin, end = ranges[rank]
    spec = ShardSpec(name, shape, partition.dtype, "fsdp1", ranges)
    # An empty piece (this rank holds padding only) still names the spec.
    local = partition.data.view(-1)[:end - begin]
    return Partition(LocalShard(local, spec, role, False), group)


def zero3_tensors(module: torch.nn.Module, policy: str) -> Optional[List[Tracked]]:
    """What shardema.EMA tracks of a ZeRO-3 model, in state_dict order: a
    Tracked per partitioned parameter (its `piece` a Partition), then as
    they come the tensors outside them (buffers, parameters without a
    partition), a tied tensor once with its other names as aliases; None
    when no parameter is partitioned."""
    if not any(is_zero3_parameter(p) for p in module.parameters()):
        return None
    batch_norm = torch.nn.modules.batchnorm._BatchNorm
    seen = {}
    out: List[Tracked] = []
    for prefix, mod in module.named_modules(remove_duplicate=False):
        in_bn = isinstance(mod, batch_norm)
        for key, tensor, is_buffer, container, persistent in own_tensors(mod):
            name = f"{prefix}.{key}" if prefix else key
            if id(tensor) in seen:
                if persistent:
                    seen[id(tensor)].aliases.append(name)
                continue
            if not is_buffer and is_zero3_parameter(tensor):
                role = _C.role_for(policy, False, _is_floating(tensor.ds_tensor),
                                   bool(tensor.requires_grad), in_bn)
                tracked = Tracked(name, tensor, role, False,
                                  piece=_partition_piece(name, tensor, role))
            else:
                check_dense(name, tensor)
                role = _C.role_for(policy, is_buffer, _is_floating(tensor),
                                   bool(tensor.requires_grad), in_bn)
                tracked = Tracked(name, tensor, role, is_buffer, container, key,
                                  persistent=persistent)
            out.append(tracked)
            seen[id(tensor)] = tracked
    return out


def plan_zero3(tracked: List[Tracked], layout: str, process_group: Any) -> Plan:
    """This rank's pieces of the partitions; the tensors outside them (rank
    0 keeps their EMA whole)."""
    import torch.distributed as dist
    if layout != "auto":
        raise ValueError(f"layout='{layout}' but the model's parameters are partitioned by "
                         "DeepSpeed ZeRO-3; use layout='auto'")
    group = checked_group(process_group)
    pieces = [t for t in tracked if isinstance(t.piece, Partition)]
    ranks = dist.get_process_group_ranks(pieces[0].piece.group or dist.group.WORLD)
    for t in pieces[1:]:
        theirs = dist.get_process_group_ranks(t.piece.group or dist.group.WORLD)
        if theirs != ranks:
            raise ValueError(f"ZeRO-3 parameter '{t.name}' is partitioned over ranks {theirs}, "
                             f"'{pieces[0].name}' over {ranks}; shardema.EMA follows one process "
                             "group")
    if group is not None and dist.get_process_group_ranks(group) != ranks:
        raise ValueError(f"process_group: the ZeRO-3 parameters are partitioned over ranks "
                         f"{ranks}; the EMA's group must be theirs")
    group = pieces[0].piece.group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shards, whole, owners = [], [], []
    for t in tracked:
        if isinstance(t.piece, Partition):
            piece = t.piece.shard
            shards.append(LocalShard(piece.local, piece.spec, t.role, False, aliases=t.aliases))
            # `t.tensor`, the parameter, decides "average_if_trainable".
            owners.append((None, None, t.tensor))
            continue
        if not t.tensor.is_contiguous():
            raise ValueError(f"'{t.name}': the tensor is not contiguous; shardema tracks "
                             "contiguous parameters and buffers")
        shard = _C.shards_from_full_tensors([(t.name, t.tensor)], [t.role], [t.is_buffer],
                                            "rank0", rank, world)[0]
        shard.aliases = t.aliases
        shards.append(shard)
        if world > 1:
            whole.append((t.name, t.tensor))
        owners.append((t.tensor, "rank0", t.tensor))
    plan = Plan("zero3", group, shards, whole, owners, watched_of(tracked))
    plan.aliases = {alias: t.name for t in tracked for alias in t.aliases}
    return plan


def release_gathered(module: Any) -> None:
    """Frees the full copies ZeRO-3 keeps of gathered parameters between
    forwards (persistent ones, and those an evaluation forward left), as
    deepspeed.zero.GatheredParameters does on exit: the partitions are
    untouched, and the next forward gathers them again. So a forward inside
    swap() sees the EMA, and one after it the raw weights. No
    communication."""
    if not isinstance(module, torch.nn.Module):
        return
    partitioned = [p for p in module.parameters() if is_zero3_parameter(p)]
    if not partitioned:  # DeepSpeed is not imported for other models
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    gathered = [p for p in partitioned if p.ds_status == ZeroParamStatus.AVAILABLE
                and not getattr(p, "ds_active_sub_modules", None)]
    if gathered:
        gathered[0].partition(param_list=gathered, has_been_updated=False)
