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

    __slots__ = ("shape", "global_shape", "split")

    def __init__(self, shape: Tuple[int, ...], global_shape: Tuple[int, ...], split: bool):
        self.shape = shape  # of what this rank holds (a DTensor's to_local())
        self.global_shape = global_shape
        # The rank holds the whole tensor but keeps the EMA of its rows only.
        self.split = split


def held_of(plan: Plan) -> Dict[str, Held]:
    """Every tracked name, in the engine's order, as this rank holds it."""
    whole = {name: tuple(tensor.shape) for name, tensor in plan.whole}
    out: Dict[str, Held] = {}
    for shard in plan.shards:
        name = shard.spec.name
        if name in whole:
            out[name] = Held(whole[name], whole[name], True)
        else:
            out[name] = Held(tuple(shard.local.shape), tuple(shard.spec.global_shape), False)
    return out


def ema_tensors(ema: Any, held: Dict[str, Held],
                names: Optional[Sequence[str]]) -> Dict[str, torch.Tensor]:
    chosen = list(held) if names is None else [str(n) for n in names]
    unknown = [n for n in chosen if n not in held]
    if unknown:
        raise ValueError(f"EMA.ema_tensors: {unknown} are not tracked by this EMA")
    gathered = [n for n in chosen if held[n].split]
    # Every rank asks for the same names: the gather's collectives match.
    full = ema.full_state_dict(rank0_only=False, names=gathered) if gathered else {}
    return {n: full[n].reshape(held[n].shape) if held[n].split else
            ema._engine.ema(n).reshape(held[n].shape) for n in chosen}


def load_ema_values(ema: Any, held: Dict[str, Held], values: Mapping[str, Any],
                    strict: bool) -> None:
    """Sorts `values` into this rank's pieces and full tensors, checking
    every one before the engine takes any: one ValueError lists every name
    that does not fit."""
    tensor_parallel = getattr(ema, "_tensor_parallel", None) or {}
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
        elif not h.split and not is_dtensor(value) and shape == h.global_shape and \
                name not in tensor_parallel:
            full.append((name, piece))  # a full tensor of a sharded one: this rank's rows
        else:
            wanted = f"{h.shape}"
            if not h.split and h.shape != h.global_shape:
                wanted += f" (this rank's part) or {h.global_shape} (the whole)"
            given = f"{shape} (its to_local())" if is_dtensor(value) else f"{shape}"
            wrong.append(f"'{name}' {given}, the EMA here {wanted}")
    if unexpected or missing or wrong:
        raise ValueError("EMA.load_ema_values: the values do not fit the tracked tensors; "
                         f"missing {missing}, unexpected {unexpected}, shapes: "
                         f"{'; '.join(wrong) if wrong else 'all fit'}. Nothing was loaded")
    if local:
        ema._engine.load_local_values([(n, t.detach()) for n, t in local])
    if full:
        ema._engine.load_full_values([(n, t.detach()) for n, t in full])
