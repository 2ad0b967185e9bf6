"""export_weights(include_untracked=True): the model's own values of what
the EMA leaves out (frozen parameters under trainable_only=True, buffers,
ignore_names), handed to the engine's writer, which writes them on the root
among the EMA's tensors, into one file or a split folder, and lists their
names in the metadata under "shardema.from_model"."""
from typing import List, Set, Tuple

import torch

from ._model import module_tensors
from ._plan import is_dtensor

#: The metadata key listing the names taken from the model, not the EMA.
FROM_MODEL_KEY = "shardema.from_model"


def untracked_tensors(model: torch.nn.Module, tracked: Set[str], aliases: Set[str],
                      keep: bool) -> List[Tuple[str, torch.Tensor, str]]:
    """(name, value, before) of every state_dict key of `model` that the
    EMA (its `tracked` names and their `aliases`) lacks, on the ranks where
    `keep` (empty elsewhere), in state_dict() order: `before` is the EMA
    tensor it precedes there ("" after the last), so the export holds the
    model's keys in its order (a tied tensor's other names right after its
    first, as the EMA's are). A plain tensor is handed as it is (the writer
    copies it a piece at a time); a DTensor's full_tensor() is a collective
    every rank makes, in module order, and the keeping rank holds it in
    host memory until the write."""
    out: List[Tuple[str, torch.Tensor, str]] = []
    waiting: List[Tuple[str, torch.Tensor]] = []
    ema_names = tracked | aliases
    for t in module_tensors(model, "ema_pytorch"):
        if t.name in tracked and t.persistent:  # non-persistent ones are in no export
            out += [(name, value, t.name) for name, value in waiting]
            waiting = []
        names = [n for n in [t.name] + list(t.aliases) if n not in ema_names]
        if not t.persistent or not names:
            continue
        with torch.no_grad():
            value = t.tensor.detach()
            if is_dtensor(value):
                value = value.full_tensor()
                value = value.to("cpu") if keep else None
        if keep:
            waiting += [(name, value) for name in names]
    return out + [(name, value, "") for name, value in waiting]
