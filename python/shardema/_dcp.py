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

The progress (step, decay, schedule, roles; the tensors' state_dict names
where some are tied or non-persistent) is plain values, equal on every
rank (_dcp_progress.py). How each tensor is placed on this rank:
_dcp_layout.py. DCP loads in place into the state dict it is given:
state_dict() returns fresh tensors of this EMA's pieces (fp32 where
averaged), and load_state_dict() copies what was loaded into them back
into the engine.
"""
import warnings
from typing import Any, Dict, List, Optional

import torch

from . import _C
from ._dcp_layout import Layout, Piece, contiguous_stride, layout_of, model_sources
from ._dcp_progress import PROFILES, progress_metadata, progress_of
from ._model import is_dtensor


def state_dict(ema: Any, engine: Any) -> Dict[str, Any]:
    """{"weights": {name: DTensor or tensor}, "progress": {...}} (and
    "profile_weights" with several profiles): fresh tensors (DCP may load
    into them), nothing shared with the engine."""
    raw = engine.state_dict()  # clones of this rank's pieces, every profile
    layout = layout_of(ema, engine, raw)
    out: Dict[str, Any] = {"weights": _placed(ema, layout, raw["tensors"], 0, list(layout.pieces))}
    if layout.profiles:
        out["profile_weights"] = {str(p): _placed(ema, layout, raw["tensors"], p, names)
                                  for p, names in sorted(layout.profiles.items())}
    out["progress"] = progress_of(raw["metadata"], ema._state_dict_names)
    return out


def _placed(ema: Any, layout: "Layout", tensors: Dict[str, torch.Tensor], profile: int,
            names: List[str]) -> Dict[str, Any]:
    """Profile `profile`'s `names` from the engine's `tensors`, each as a
    DTensor or a plain tensor as its Piece says."""
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
                                               stride=contiguous_stride(piece.global_shape))
        elif piece.owner == "whole" or layout.rank == 0:
            weights[name] = rank0s.get(name, local).reshape(piece.global_shape)
    return weights


def _local_piece(name: str, value: Any, piece: Piece, layout: Layout) -> torch.Tensor:
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


def _cut(value: torch.Tensor, piece: Piece) -> torch.Tensor:
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


def _pieces_of(values: Dict[str, Any], layout: Layout,
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
    metadata = progress_metadata(state["progress"])
    weights = state["weights"]
    more = state.get("profile_weights", {})
    for what, value in (("weights", weights), ("profile_weights", more)):
        if not isinstance(value, dict):
            raise TypeError(f"shardema.EMA.load_state_dict: '{what}' is a "
                            f"{type(value).__name__}, not a dict")
    layout = layout_of(ema, engine)
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


def _check_profile_count(layout: Layout, metadata: Dict[str, str], more: Dict[str, Any]) -> None:
    """The state's profiles are this EMA's in number (the engine then
    compares their schedules): a ValueError naming both counts."""
    import json
    try:
        saved = len(json.loads(metadata[PROFILES[1]])) if PROFILES[1] in metadata else 1
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
    layout = layout_of(ema, engine)
    sources = model_sources(ema)
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
