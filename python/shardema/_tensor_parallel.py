"""The full EMA of a model with tensor-parallel DTensors (Shard(d), d > 0).

The engine keeps each rank's to_local() piece of such a tensor and averages
it like any other, but its gathers assemble rows of dim 0, which these
pieces are not (_model.tensor_parallel_spec). Here a piece becomes a
DTensor again, with the parameter's mesh and placements, and torch's own
collective (full_tensor()) assembles it: one tensor at a time, so a rank
holds one full tensor beside its EMA at most."""
from typing import Any, Dict, List, Optional

import torch


def full_tensor(engine: Any, name: str, parameter: Any) -> torch.Tensor:
    """The full EMA of tensor-parallel `parameter` on every rank (collective
    over its mesh), as a host tensor in the EMA's dtype."""
    from torch.distributed.tensor import DTensor
    piece = engine.ema(name)  # this rank's EMA, in to_local()'s shape
    # from_local moves the piece to the mesh's device when it differs (a GPU
    # model's EMA in pinned host memory): its collectives need it there.
    placed = DTensor.from_local(piece, parameter.device_mesh, tuple(parameter.placements),
                                run_check=False, shape=parameter.shape,
                                stride=parameter.stride())
    return placed.full_tensor().cpu()


def full_state_dict(ema: Any, tensor_parallel: Dict[str, Any], rank0_only: bool,
                    names: Optional[List[str]]) -> Dict[str, torch.Tensor]:
    """EMA.full_state_dict() when some tensors are tensor-parallel: those
    through DTensor collectives, the others through the engine's gather,
    one name at a time and in the same order on every rank (each is a
    collective)."""
    engine = ema._engine
    out: Dict[str, torch.Tensor] = {}
    for name in engine.names() if names is None else names:
        if name in tensor_parallel:
            value = full_tensor(engine, name, tensor_parallel[name])
            if not rank0_only or ema.rank == 0:
                out[name] = value
        else:
            out.update(engine.full_state_dict(rank0_only, [name]))
    return out
