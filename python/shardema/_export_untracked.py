"""export_weights(include_untracked=True): the model's own values of what
the EMA leaves out (frozen parameters under trainable_only=True, buffers,
ignore_names), written into the exported file beside the EMA, so that the
file loads strict into the plain model. The EMA's writer stays as it is:
rank 0 adds these to the file it wrote (temp file, fsync, rename)."""
import json
import os
from typing import Dict, List, Optional, Set

import torch

from ._model import module_tensors
from ._plan import is_dtensor

#: The metadata key listing the names taken from the model, not the EMA.
FROM_MODEL_KEY = "shardema.from_model"


def untracked_values(model: torch.nn.Module, ema_names: Set[str], dtype: torch.dtype,
                     keep: bool) -> Dict[str, torch.Tensor]:
    """Every state_dict key of `model` that `ema_names` (the EMA's names and
    aliases) lacks, with its current value as a CPU tensor of its own
    (floating ones as `dtype`), on the ranks where `keep`. Collective for a
    DTensor (full_tensor(), in module order, the same on every rank)."""
    out: Dict[str, torch.Tensor] = {}
    for t in module_tensors(model, "ema_pytorch"):
        names = [n for n in [t.name] + list(t.aliases) if n not in ema_names]
        if not t.persistent or not names:
            continue
        with torch.no_grad():
            value = t.tensor.full_tensor() if is_dtensor(t.tensor) else t.tensor
            value = value.detach().to("cpu")
            if value.dtype.is_floating_point:
                value = value.to(dtype)
        if keep:
            for name in names:  # safetensors refuses two names over one storage
                out[name] = value.clone().contiguous()
    return out


def add_to_export(path: str, values: Dict[str, torch.Tensor]) -> None:
    """Rewrites the export at `path` with `values` added (names it already
    holds are an error: the EMA's own stay), its metadata kept, and the
    added names listed under FROM_MODEL_KEY."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    tensors: Dict[str, torch.Tensor] = {}
    with safe_open(path, framework="pt") as exported:
        metadata: Optional[Dict[str, str]] = exported.metadata()
        for name in exported.keys():
            tensors[name] = exported.get_tensor(name)
    clash: List[str] = [n for n in values if n in tensors]
    if clash:
        raise ValueError(f"shardema.EMA.export_weights: {clash[:5]} are both in the EMA and "
                         "taken from the model")
    tensors.update(values)
    metadata = dict(metadata or {})
    metadata[FROM_MODEL_KEY] = json.dumps(sorted(values))
    temporary = f"{path}.tmp-untracked-{os.getpid()}"
    try:
        save_file(tensors, temporary, metadata=metadata)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
