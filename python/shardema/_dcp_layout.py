"""How each EMA tensor appears in EMA.state_dict() on this rank (_dcp.py):
as a DTensor placed as its parameter is ("placed"), a plain full tensor on
every rank ("whole") or on rank 0 only ("rank0"), worked out once per EMA
from the engine's state and the model's tensors, with the meshes the
DTensors need (see _dcp.py for the rules)."""
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _C
from ._dcp_progress import ENGINE_PROGRESS_KEYS, PROFILES
from ._model import _fsdp2_local, dtensor_split, is_dtensor, module_tensors


@dataclass
class Piece:
    """How one EMA tensor appears on this rank."""
    owner: str  # "placed", "whole" or "rank0"
    global_shape: Tuple[int, ...]
    local_shape: Tuple[int, ...]  # of the engine's piece on this rank
    local_dtype: torch.dtype
    # "placed": the DTensor's mesh, placements and local shape (to_local()'s;
    # the engine's piece has the same elements in the same order)
    mesh: Any = None
    placements: Tuple[Any, ...] = ()
    placed_shape: Tuple[int, ...] = ()


@dataclass
class Layout:
    """What a state dict of this EMA looks like on this rank: fixed for the
    EMA's life (its tensors, split and schedule never change)."""
    pieces: Dict[str, Piece] = field(default_factory=dict)
    identity: Dict[str, str] = field(default_factory=dict)  # engine metadata, not progress
    own_schedule_and_roles: Dict[str, str] = field(default_factory=dict)
    # Profile p > 0: the names it holds (the averaged ones).
    profiles: Dict[int, List[str]] = field(default_factory=dict)
    rank: int = 0
    world: int = 1


LAYOUTS: "weakref.WeakKeyDictionary[Any, Layout]" = weakref.WeakKeyDictionary()


def row_range(rows: int, rank: int, world: int) -> Tuple[int, int]:
    """torch.chunk's rows of `rank` (FSDP2's and the engine's split)."""
    chunk = -(-rows // world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _checked_mesh(mesh: Any, layout: "Layout", device_type: str) -> Any:
    """`mesh` as the EMA's DTensors need it: its last dimension this EMA's
    ranks in order (the first dimension of a 2-D mesh: HSDP's replicas), on
    the device the EMA is on (a DTensor moves its local tensor to its
    mesh's device, and the EMA of a GPU model stays in host memory; DCP
    reads only the mesh's coordinates)."""
    last = mesh.ndim - 1
    coordinate = list(mesh.get_coordinate() or ())
    if mesh.size(last) != layout.world or coordinate[last:] != [layout.rank]:
        raise ValueError(f"shardema.EMA.state_dict: the last dimension of the mesh {mesh} does "
                         f"not list this EMA's {layout.world} ranks in order (rank "
                         f"{layout.rank} here); a DCP state dict needs the EMA's group to be "
                         "that dimension's")
    if mesh.device_type == device_type:
        return mesh
    from torch.distributed.device_mesh import DeviceMesh
    if mesh.ndim == 1:
        return DeviceMesh.from_group(mesh.get_group(), device_type)
    return DeviceMesh.from_group([mesh.get_group(d) for d in range(mesh.ndim)], device_type,
                                 mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)


def _default_group_mesh(ema: Any, device_type: str) -> Any:
    """A 1-D mesh of the default group: a replicated EMA's group unless it
    was given another, which a DCP state dict cannot map (DCP's ranks are
    the default group's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    if not (dist.is_available() and dist.is_initialized()) or \
            dist.get_world_size() != ema.world_size or dist.get_rank() != ema.rank:
        raise ValueError(f"shardema.EMA.state_dict: this {ema.layout} EMA's group (rank "
                         f"{ema.rank} of {ema.world_size}) is not the default group; a DCP "
                         "state dict maps the default group's ranks only (use "
                         "save_checkpoint() for another group)")
    return DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), device_type)


def model_sources(ema: Any) -> Dict[str, Any]:
    """The model's tensors by the EMA's names (empty: built from tensors)."""
    if ema._model is None:
        return {}
    return {t.name: t.tensor for t in module_tensors(ema._model, "versatil")}


def layout_of(ema: Any, engine: Any, raw: Optional[Dict[str, Any]] = None) -> Layout:
    """This EMA's Layout, worked out once from the engine's state (`raw`,
    or one taken here) and the model's tensors."""
    known = LAYOUTS.get(ema)
    if known is not None:
        return known
    if raw is None:
        # The structure alone (no values, no wait): a failed EMA answers too,
        # so that a load can restore it.
        raw = engine.state_template()
    out = Layout(rank=ema.rank, world=ema.world_size)
    sources = model_sources(ema)
    if out.world > 1 and not sources:
        raise ValueError("shardema.EMA.state_dict: a DCP state dict needs the model's tensors "
                         f"(their full shapes and meshes), and this EMA on {out.world} ranks "
                         "was built from local shards or named tensors; use save_checkpoint() "
                         "and load_checkpoint() (same world size), or build the EMA from the "
                         "model")
    # The state's checksum of its keys (shardema.state_xxh64) is left out
    # with the progress it covers: a load gives other progress.
    out.identity = {k: v for k, v in raw["metadata"].items() if k not in ENGINE_PROGRESS_KEYS}
    out.own_schedule_and_roles = {key: raw["metadata"][key]
                                  for key in ("shardema.schedule", "shardema.roles")}
    if PROFILES[1] in raw["metadata"]:
        # A cold start's: every profile's schedule, none decayed yet.
        import json
        profiles = json.loads(raw["metadata"][PROFILES[1]])
        for entry in profiles:
            entry["last_decay"] = "0"
        out.own_schedule_and_roles[PROFILES[1]] = json.dumps(profiles, separators=(",", ":"))
    dtensors = [t for t in sources.values() if is_dtensor(t)]
    meshes: Dict[int, Any] = {}
    # What the planner keeps per rank (_model.py): the module's plain buffers.
    per_rank = {t.name for t in module_tensors(ema._model, "versatil")
                if t.is_buffer and not is_dtensor(t.tensor)} \
        if out.world > 1 and ema.layout in ("replicated", "fsdp2") else set()

    def rows_mesh(source: Any, device_type: str) -> Any:
        # FSDP2: the parameters' mesh, for their buffers too; DDP: the group's.
        mesh = source.device_mesh if is_dtensor(source) else \
            dtensors[0].device_mesh if dtensors else None
        if id(mesh) not in meshes:
            meshes[id(mesh)] = _checked_mesh(mesh, out, device_type) if mesh is not None \
                else _default_group_mesh(ema, device_type)
        return meshes[id(mesh)]

    from torch.distributed.tensor import Replicate, Shard
    for stored in raw["tensors"]:
        profile, name = _C.profile_of_stored_name(stored)
        if profile != 0:  # the same tensor again, placed as profile 0's
            out.profiles.setdefault(profile, []).append(name)
    for name, local in raw["tensors"].items():
        if _C.profile_of_stored_name(name)[0] != 0:
            continue
        source = sources.get(name)
        shape = tuple(source.shape) if source is not None else tuple(local.shape)
        piece = Piece("whole", shape, tuple(local.shape), local.dtype)
        placed = source is not None and is_dtensor(source) or out.world > 1
        if name in per_rank:
            pass  # "whole": each rank's own; state_dict() gives rank 0's
        elif placed and (ema.layout == "rank0" or not shape):
            piece.owner = "rank0"  # a 0-dim tensor: rank 0 keeps it
        elif placed:
            piece.owner = "placed"
            piece.mesh = rows_mesh(source, local.device.type)
            split = dtensor_split(name, source) if is_dtensor(source) else "replicated"
            if split == "replicated":
                # every rank holds it whole and averages its rows
                begin, end = row_range(shape[0], out.rank, out.world)
                piece.placements = (Replicate(),) * (piece.mesh.ndim - 1) + (Shard(0),)
                piece.placed_shape = (end - begin,) + shape[1:]
            else:
                piece.placements = tuple(source.placements)
                piece.placed_shape = tuple(_fsdp2_local(name, source).shape)
        out.pieces[name] = piece
    LAYOUTS[ema] = out
    return out
