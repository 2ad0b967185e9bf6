"""EMA.state_dict() for torch.distributed.checkpoint (DCP), and back.

The state is {"weights": {name: tensor}, "progress": {...}}: it sits beside
the model's and the optimizer's in one DCP state dict (say under "ema"),
and DCP reshards it when the world size changes, because each EMA tensor
says where its rows lie in the full tensor:

- a DTensor ("placed"): for a DTensor parameter, its own mesh and
  placements (FSDP2's Shard(0), HSDP's (Replicate(), Shard(0)) on a 2-D
  mesh, tensor parallelism's Shard(d)); for what every rank of the
  collectives' group holds whole (buffers, plain parameters beside
  DTensors, Replicate() DTensors, DDP's replicated layout), the rows each
  rank averages: Shard(0) over the mesh's last dimension (the group's),
  Replicate() over the first (HSDP's replicas). DCP writes a chunk that
  replicas share once (it dedupes equal chunks), so one copy is stored;
- a plain full tensor on every rank ("whole"): with one process, and for
  what each rank keeps whole as its own (a module's buffers under DDP and
  FSDP2, whose ranks' BatchNorm statistics differ), where the state holds
  rank 0's (gathered: state_dict() is then collective), so the one copy
  DCP writes is rank 0's and every rank loads it;
- a plain full tensor on rank 0 only ("rank0"): layout="rank0", and the
  0-dim tensors of the other layouts, which rank 0 keeps.

An EMA of several profiles (EMA(schedules=[...])) adds "profile_weights":
{"1": {name: tensor}, ...}, each profile's averaged tensors placed as
"weights" places them, and the progress its "profiles" (each profile's
schedule and last decay, the engine's shardema.profiles).

The progress (step, decay, schedule, roles) is plain values, equal on every
rank. DCP loads in place into the state dict it is given: state_dict()
returns fresh tensors of this EMA's pieces (fp32 where averaged), and
load_state_dict() copies what was loaded into them back into the engine.
"""
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _C
from ._model import _fsdp2_local, dtensor_split, is_dtensor, module_tensors

FORMAT = "shardema.EMA/1"

# The engine's metadata keys of the progress, and the type each has here.
_PROGRESS = {
    "step": ("shardema.step", int),
    "initialized": ("shardema.initialized", bool),
    "last_decay": ("shardema.last_decay", float),
    "schedule": ("shardema.schedule", str),
    "roles": ("shardema.roles", str),
}
# ...and the one an EMA of several profiles adds.
_PROFILES = ("profiles", "shardema.profiles")


@dataclass
class _Piece:
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
class _Layout:
    """What a state dict of this EMA looks like on this rank: fixed for the
    EMA's life (its tensors, split and schedule never change)."""
    pieces: Dict[str, _Piece] = field(default_factory=dict)
    identity: Dict[str, str] = field(default_factory=dict)  # engine metadata, not progress
    own_schedule_and_roles: Dict[str, str] = field(default_factory=dict)
    # Profile p > 0: the names it holds (the averaged ones).
    profiles: Dict[int, List[str]] = field(default_factory=dict)
    rank: int = 0
    world: int = 1


_LAYOUTS: "weakref.WeakKeyDictionary[Any, _Layout]" = weakref.WeakKeyDictionary()


def _row_range(rows: int, rank: int, world: int) -> Tuple[int, int]:
    """torch.chunk's rows of `rank` (FSDP2's and the engine's split)."""
    chunk = -(-rows // world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _checked_mesh(mesh: Any, layout: "_Layout", device_type: str) -> Any:
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


def _sources(ema: Any) -> Dict[str, Any]:
    """The model's tensors by the EMA's names (empty: built from tensors)."""
    if ema._model is None:
        return {}
    return {t.name: t.tensor for t in module_tensors(ema._model, "versatil")}


def _layout(ema: Any, engine: Any, raw: Optional[Dict[str, Any]] = None) -> _Layout:
    """This EMA's _Layout, worked out once from the engine's state (`raw`,
    or one taken here) and the model's tensors."""
    known = _LAYOUTS.get(ema)
    if known is not None:
        return known
    if raw is None:
        # The structure alone (no values, no wait): a failed EMA answers too,
        # so that a load can restore it.
        raw = engine.state_template()
    out = _Layout(rank=ema.rank, world=ema.world_size)
    sources = _sources(ema)
    if out.world > 1 and not sources:
        raise ValueError("shardema.EMA.state_dict: a DCP state dict needs the model's tensors "
                         f"(their full shapes and meshes), and this EMA on {out.world} ranks "
                         "was built from local shards or named tensors; use save_checkpoint() "
                         "and load_checkpoint() (same world size), or build the EMA from the "
                         "model")
    # The state's checksum of its keys (shardema.state_xxh64) is left out
    # with the progress it covers: a load gives other progress.
    progress_keys = {key for key, _ in _PROGRESS.values()} | {"shardema.state_xxh64",
                                                              _PROFILES[1]}
    out.identity = {k: v for k, v in raw["metadata"].items() if k not in progress_keys}
    out.own_schedule_and_roles = {key: raw["metadata"][key]
                                  for key in ("shardema.schedule", "shardema.roles")}
    if _PROFILES[1] in raw["metadata"]:
        # A cold start's: every profile's schedule, none decayed yet.
        import json
        profiles = json.loads(raw["metadata"][_PROFILES[1]])
        for entry in profiles:
            entry["last_decay"] = "0"
        out.own_schedule_and_roles[_PROFILES[1]] = json.dumps(profiles, separators=(",", ":"))
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
        piece = _Piece("whole", shape, tuple(local.shape), local.dtype)
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
                begin, end = _row_range(shape[0], out.rank, out.world)
                piece.placements = (Replicate(),) * (piece.mesh.ndim - 1) + (Shard(0),)
                piece.placed_shape = (end - begin,) + shape[1:]
            else:
                piece.placements = tuple(source.placements)
                piece.placed_shape = tuple(_fsdp2_local(name, source).shape)
        out.pieces[name] = piece
    _LAYOUTS[ema] = out
    return out


def state_dict(ema: Any, engine: Any) -> Dict[str, Any]:
    """{"weights": {name: DTensor or tensor}, "progress": {...}} (and
    "profile_weights" with several profiles): fresh tensors (DCP may load
    into them), nothing shared with the engine."""
    raw = engine.state_dict()  # clones of this rank's pieces, every profile
    layout = _layout(ema, engine, raw)
    out: Dict[str, Any] = {"weights": _placed(ema, layout, raw["tensors"], 0, list(layout.pieces))}
    if layout.profiles:
        out["profile_weights"] = {str(p): _placed(ema, layout, raw["tensors"], p, names)
                                  for p, names in sorted(layout.profiles.items())}
    metadata = raw["metadata"]
    progress: Dict[str, Any] = {"format": FORMAT}
    for field_name, (key, kind) in _PROGRESS.items():
        text = metadata[key]
        progress[field_name] = (text == "true") if kind is bool else kind(text)
    if _PROFILES[1] in metadata:
        progress[_PROFILES[0]] = metadata[_PROFILES[1]]
    out["progress"] = progress
    return out


def _placed(ema: Any, layout: "_Layout", tensors: Dict[str, torch.Tensor], profile: int,
            names: List[str]) -> Dict[str, Any]:
    """Profile `profile`'s `names` from the engine's `tensors`, each as a
    DTensor or a plain tensor as its _Piece says."""
    from torch.distributed.tensor import DTensor
    # Rank 0's of what each rank keeps as its own (the engine's gather takes
    # rank 0's): DCP writes one copy of a plain tensor that every rank holds,
    # from any rank.
    own = [n for n in names if layout.pieces[n].owner == "whole"] if layout.world > 1 else []
    rank0s = ema.full_state_dict(rank0_only=False, names=own, profile=profile) if own else {}
    replicas = getattr(ema, "_replicas", None)
    if rank0s and replicas is not None:
        # HSDP: each replica's shard group gathered its own rank 0's; the
        # first replica's (global rank 0's) is the job's, as in its files.
        import torch.distributed as dist
        for value in rank0s.values():
            dist.broadcast(value, src=dist.get_global_rank(replicas, 0), group=replicas)
    weights: Dict[str, Any] = {}
    for name in names:
        local = tensors[_C.profile_tensor_name(name, profile)]
        piece = layout.pieces[name]
        if piece.owner == "placed":
            weights[name] = DTensor.from_local(local.reshape(piece.placed_shape), piece.mesh,
                                               piece.placements, run_check=False,
                                               shape=torch.Size(piece.global_shape),
                                               stride=_contiguous_stride(piece.global_shape))
        elif piece.owner == "whole" or layout.rank == 0:
            weights[name] = rank0s.get(name, local).reshape(piece.global_shape)
    return weights


def _progress_metadata(progress: Any) -> Dict[str, str]:
    """The engine's metadata for `progress`, each field checked."""
    if not isinstance(progress, dict) or progress.get("format") != FORMAT:
        found = progress.get("format") if isinstance(progress, dict) else type(progress).__name__
        raise ValueError(f"shardema.EMA.load_state_dict: 'progress' is not a shardema EMA's "
                         f"(format {found!r}, expected {FORMAT!r})")
    out = {}
    for field_name, (key, kind) in _PROGRESS.items():
        value = progress.get(field_name)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool)) or \
            (kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"shardema.EMA.load_state_dict: progress '{field_name}' is "
                             f"{value!r}, expected {kind.__name__}")
        out[key] = ("true" if value else "false") if kind is bool else \
            repr(float(value)) if kind is float else str(value)
    if _PROFILES[0] in progress:
        value = progress[_PROFILES[0]]
        if not isinstance(value, str):
            raise ValueError(f"shardema.EMA.load_state_dict: progress 'profiles' is {value!r}, "
                             "expected str")
        out[_PROFILES[1]] = value
    return out


def _local_piece(name: str, value: Any, piece: _Piece, layout: _Layout) -> torch.Tensor:
    """This rank's piece of `value`: a DTensor placed as this EMA's piece
    (what state_dict() made, DCP loaded into it) gives its to_local(); any
    other tensor is taken whole (full_tensor() of another DTensor: a
    collective) and cut as this rank's piece is."""
    where = f"shardema.EMA.load_state_dict: tensor '{name}'"
    if is_dtensor(value):
        if tuple(value.shape) != piece.global_shape:
            raise ValueError(f"{where} has shape {tuple(value.shape)} in the state but "
                             f"{piece.global_shape} here")
        if piece.owner == "placed" and tuple(value.placements) == piece.placements and \
                tuple(value.device_mesh.shape) == tuple(piece.mesh.shape):
            return value.to_local()
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} is a {type(value).__name__}, not a tensor")
    if piece.owner == "whole":
        return value
    if tuple(value.shape) != piece.global_shape:
        raise ValueError(f"{where} has shape {tuple(value.shape)} in the state but "
                         f"{piece.global_shape} here")
    if piece.owner == "rank0":
        return value if layout.rank == 0 else value.reshape(-1)[:0]
    return _cut(value, piece)


def _cut(value: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """This rank's part of full tensor `value` under the piece's placements:
    torch.chunk along each sharded dim, as DTensor splits (trailing ranks
    may get none)."""
    coordinate = piece.mesh.get_coordinate()
    for mesh_dim, placement in enumerate(piece.placements):
        if not placement.is_shard():
            continue
        dim = placement.dim % value.dim()
        chunks = torch.chunk(value, piece.mesh.size(mesh_dim), dim=dim)
        index = coordinate[mesh_dim]
        value = chunks[index] if index < len(chunks) else value.narrow(dim, 0, 0)
    return value.contiguous()


def _pieces_of(values: Dict[str, Any], layout: _Layout,
               names: Optional[List[str]] = None, where: str = "") -> Dict[str, torch.Tensor]:
    """This rank's pieces of `values` (`names` of the layout, else all) in
    the engine's local shapes; a ValueError naming the first tensor that
    does not fit (`where`: which profile's)."""
    prefix = "shardema.EMA.load_state_dict: the state is not of this model: "
    chosen = {n: layout.pieces[n] for n in (layout.pieces if names is None else names)}
    for name, piece in chosen.items():
        if name not in values and (piece.owner != "rank0" or layout.rank == 0):
            raise ValueError(f"{prefix}tensor '{name}'{where} is tracked here but not in the "
                             "state")
    for name in values:
        if name not in chosen:
            raise ValueError(f"{prefix}tensor '{name}'{where} is in the state but not tracked "
                             "here")
    out = {}
    for name, piece in chosen.items():
        if name not in values:  # a rank-0 tensor on another rank: it holds none of it
            out[name] = torch.empty(piece.local_shape, dtype=piece.local_dtype)
            continue
        local = _local_piece(name, values[name], piece, layout)
        expected = 1
        for size in piece.local_shape:
            expected *= size
        if local.numel() != expected:
            raise ValueError(f"{prefix}tensor '{name}' has {local.numel()} elements on this rank "
                             f"in the state but {expected} here")
        if piece.owner == "whole" and tuple(local.shape) != piece.global_shape:
            raise ValueError(f"{prefix}tensor '{name}' has shape {tuple(local.shape)} in the "
                             f"state but {piece.global_shape} here")
        out[name] = local.detach().reshape(piece.local_shape)
    return out


def load_state_dict(ema: Any, engine: Any, state: Dict[str, Any]) -> None:
    """Adopts what state_dict() returned (after DCP loaded into it, or
    torch.load gave it back); {} cold-starts the EMA from the weights."""
    if not state:
        cold_start(ema, engine)
        return
    if set(state) - {"profile_weights"} != {"weights", "progress"}:
        raise ValueError("shardema.EMA.load_state_dict: expected what state_dict() returns, "
                         "{'weights': ..., 'progress': ...} (or an older one, {'tensors': ..., "
                         "'metadata': ...}), got the keys " + str(sorted(map(str, state))))
    metadata = _progress_metadata(state["progress"])
    weights = state["weights"]
    more = state.get("profile_weights", {})
    for what, value in (("weights", weights), ("profile_weights", more)):
        if not isinstance(value, dict):
            raise TypeError(f"shardema.EMA.load_state_dict: '{what}' is a "
                            f"{type(value).__name__}, not a dict")
    layout = _layout(ema, engine)
    _check_profile_count(layout, metadata, more)
    pieces = _pieces_of(weights, layout)
    for p, names in sorted(layout.profiles.items()):
        values = more[str(p)]
        if not isinstance(values, dict):
            raise TypeError(f"shardema.EMA.load_state_dict: 'profile_weights' '{p}' is a "
                            f"{type(values).__name__}, not a dict")
        for name, piece in _pieces_of(values, layout, names, f" (profile {p})").items():
            pieces[_C.profile_tensor_name(name, p)] = piece
    engine.load_state_dict({"tensors": pieces, "metadata": {**layout.identity, **metadata}})


def _check_profile_count(layout: _Layout, metadata: Dict[str, str], more: Dict[str, Any]) -> None:
    """The state's profiles are this EMA's in number (the engine then
    compares their schedules): a ValueError naming both counts."""
    import json
    try:
        saved = len(json.loads(metadata[_PROFILES[1]])) if _PROFILES[1] in metadata else 1
    except ValueError:
        raise ValueError("shardema.EMA.load_state_dict: progress 'profiles' is not the JSON "
                         "list state_dict() writes") from None
    here = 1 + len(layout.profiles)
    given = sorted(more, key=str)
    if saved != here or given != sorted(str(p) for p in layout.profiles):
        raise ValueError(f"shardema.EMA.load_state_dict: the state holds {saved} profile"
                         f"{'s' if saved != 1 else ''} (profile_weights {given}) but this EMA "
                         f"keeps {here} (schedules); build it with the schedules it was saved "
                         "with")


def cold_start(ema: Any, engine: Any) -> None:
    """The EMA restarts from the model's current weights (step 0), as if
    built now: what a checkpoint without an EMA resumes with. An EMA built
    from tensors, not a model, copies them at its next update instead."""
    layout = _layout(ema, engine)
    sources = _sources(ema)
    warnings.warn("shardema.EMA: the checkpoint holds no EMA; it starts again from the "
                  "model's weights at step 0", stacklevel=4)
    if sources:
        values = {name: sources[name] for name in layout.pieces}
        pieces = _pieces_of({n: v.detach() for n, v in values.items()}, layout)
        for p, names in layout.profiles.items():  # every profile starts from the weights
            pieces.update({_C.profile_tensor_name(n, p): pieces[n] for n in names})
        initialized = "true"
    else:
        pieces = dict(engine.state_dict()["tensors"])
        initialized = "false"
    restart = {"shardema.step": "0", "shardema.initialized": initialized,
               "shardema.last_decay": "0"}
    engine.load_state_dict({"tensors": pieces, "metadata": {
        **layout.identity, **layout.own_schedule_and_roles, **restart}})


def __getattr__(name: str) -> Any:
    if name == "EMALoadPlanner":  # made on first use (_dcp_planner.py)
        from ._dcp_planner import planner_class
        return planner_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
