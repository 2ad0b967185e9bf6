"""EMA.ema_tensors() and EMA.load_ema_values(): the EMA of each tracked
tensor in the shape this rank holds the tensor in, and back.

What a rank holds of a tensor and what it keeps the EMA of are not always
the same: a Shard(0) DTensor's to_local() is its rows, and the EMA keeps
exactly those; a Replicate() DTensor's to_local(), and a plain tensor under
DDP, is the whole tensor, of which the EMA keeps only this rank's rows
(gathered when the whole is asked for). This module is the one place that
knows which is which, so the callbacks, EMA.module() and a caller building
a checkpoint of DTensors get one answer."""
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ._model import Plan, is_dtensor


class Held:
    """How this rank holds one tracked tensor."""

    __slots__ = ("shape", "global_shape", "split", "parameter")

    def __init__(self, shape: Tuple[int, ...], global_shape: Tuple[int, ...], split: bool,
                 parameter: Any = None):
        self.shape = shape  # of what this rank holds (a DTensor's to_local())
        self.global_shape = global_shape
        # The rank holds the whole tensor but keeps the EMA of its rows only.
        self.split = split
        # A Shard(d > 0) DTensor (tensor parallelism): its placements cut the
        # whole into this rank's piece.
        self.parameter = parameter


def held_of(plan: Plan) -> Dict[str, Held]:
    """Every tracked name, in the engine's order, as this rank holds it."""
    whole = {name: tuple(tensor.shape) for name, tensor in plan.whole}
    out: Dict[str, Held] = {}
    for shard in plan.shards:
        name = shard.spec.name
        if name in whole:
            out[name] = Held(whole[name], whole[name], True)
        else:
            # A Shard(d > 0) spec has dim d moved first (tensor_parallel_spec):
            # the whole a caller holds is the parameter's own shape.
            parameter = plan.tensor_parallel.get(name)
            global_shape = tuple(parameter.shape) if parameter is not None \
                else tuple(shard.spec.global_shape)
            out[name] = Held(tuple(shard.local.shape), global_shape, False, parameter)
    return out


def _tensor_parallel_piece(full: torch.Tensor, parameter: Any) -> torch.Tensor:
    """This rank's piece of the whole of tensor-parallel `parameter`, cut by
    torch's own split of its placements (uneven ones included), from the
    copy every rank holds: no communication (src_data_rank=None)."""
    from torch.distributed.tensor import distribute_tensor
    placed = distribute_tensor(full.detach(), parameter.device_mesh, tuple(parameter.placements),
                               src_data_rank=None)
    # distribute_tensor moved the whole to the mesh's device; the piece
    # goes back beside the value given, so the engine copies it as before.
    return placed.to_local().to(full.device)


def ema_tensors(engine: Any, held: Dict[str, Held], names: Optional[Sequence[str]],
                profile: int = 0) -> Dict[str, torch.Tensor]:
    """The EMA of `profile` of `names` (else all) in the shape this rank
    holds each tensor, from `engine` (shardema._C.Ema); gathers the split
    ones."""
    chosen = list(held) if names is None else [str(n) for n in names]
    unknown = [n for n in chosen if n not in held]
    if unknown:
        raise ValueError(f"shardema.EMA.ema_tensors: {unknown} are not tracked by this EMA")
    gathered = [n for n in chosen if held[n].split]
    # Every rank asks for the same names: the gather's collectives match.
    full = dict(engine.full_state_dict(False, gathered, profile)) if gathered else {}
    return {n: full[n].reshape(held[n].shape) if held[n].split else
            engine.ema(n, profile).reshape(held[n].shape) for n in chosen}


def load_ema_values(engine: Any, held: Dict[str, Held], values: Mapping[str, Any],
                    strict: bool, aliases: Mapping[str, str], profile: int = 0) -> None:
    """Sorts `values` into this rank's pieces and full tensors, checking
    every one before the engine takes any: one ValueError lists every name
    that does not fit. A tied tensor's other names (what an export and the
    model's state_dict() hold beside its own) stand for it: ignored when its
    own name is given too."""
    if aliases:
        values = {aliases.get(n, n): v for n, v in values.items()
                  if n not in aliases or aliases[n] not in values}
    unexpected = sorted(n for n in values if n not in held)
    missing = sorted(n for n in held if n not in values) if strict else []
    wrong: List[str] = []
    local: List[Tuple[str, torch.Tensor]] = []
    full: List[Tuple[str, torch.Tensor]] = []
    for name, value in values.items():
        h = held.get(name)
        if h is None:
            continue
        piece = value.to_local() if is_dtensor(value) else value
        if not isinstance(piece, torch.Tensor):
            wrong.append(f"'{name}' is a {type(value).__name__}, not a tensor")
            continue
        shape = tuple(piece.shape)
        if h.split and shape == h.shape:
            full.append((name, piece))  # the whole; each rank keeps its rows
        elif not h.split and shape == h.shape:
            local.append((name, piece))
        elif not h.split and not is_dtensor(value) and shape == h.global_shape:
            if h.parameter is not None:  # the whole of a Shard(d > 0) one: this rank's piece
                local.append((name, _tensor_parallel_piece(piece, h.parameter)))
            else:
                full.append((name, piece))  # a full tensor of a sharded one: this rank's rows
        else:
            wanted = f"{h.shape}"
            if not h.split and h.shape != h.global_shape:
                wanted += f" (this rank's part) or {h.global_shape} (the whole)"
            given = f"{shape} (its to_local())" if is_dtensor(value) else f"{shape}"
            wrong.append(f"'{name}' {given}, the EMA here {wanted}")
    if unexpected or missing or wrong:
        raise ValueError("shardema.EMA.load_ema_values: the values do not fit the tracked tensors; "
                         f"missing {missing}, unexpected {unexpected}, shapes: "
                         f"{'; '.join(wrong) if wrong else 'all fit'}. Nothing was loaded")
    if local:
        engine.load_local_values([(n, t.detach()) for n, t in local], profile)
    if full:
        engine.load_full_values([(n, t.detach()) for n, t in full], profile)
