"""What shardema.EMA watches of the model it was built from, as the lists
the engine's C loop checks before every update, swap and copy
(python/src/model_watch.h): the slots holding each tracked tensor, the
module tree on the way to them, the sizes of every module's dicts, and the
parameters whose requires_grad decides averaging. And the planner's answer
when that structure changed (replan): the same tensors under new modules
are followed; anything added, removed or untied is refused by name. The
reads that answer for the model (exports, checkpoints, state_dict) run the
same check first (the engine's check_model)."""
from typing import Any, Callable, List, Sequence, Tuple

import torch

from ._plan import Plan, is_dtensor

Watch = Tuple[list, list, list, list]  # slots, edges, counted, deciders


def watch_of(model: Any, plan: Plan, names: Sequence[str]) -> Watch:
    """The lists for the engine (shardema._C.Ema's slots, edges, counted,
    deciders). `names`: the engine's shard names, in order. An EMA of named
    tensors or local shards (`model` None) watches only its deciders."""
    slots = [(container, key, tensor, names[index], False)
             for container, key, tensor, index in plan.watched]
    slots += [(container, key, tensor, names[index], True)
              for container, key, tensor, index in plan.alias_slots]
    deciders = [(owner[2], index) for index, owner in enumerate(plan.owners)
                if len(owner) > 2 and owner[2] is not None]
    edges: List[tuple] = []
    counted: List[dict] = []
    if isinstance(model, torch.nn.Module):
        for _, module in model.named_modules(remove_duplicate=False):
            edges += [(module._modules, key, child) for key, child in module._modules.items()]
            # The children dict itself: Sequential.__delitem__ rebuilds
            # _modules, after which the old one, still watched, would look
            # unchanged forever. (One lookup per module per update; torch
            # rebuilds no module's _parameters or _buffers dict.)
            own = vars(module)
            if isinstance(own.get("_modules"), dict):
                edges.append((own, "_modules", own["_modules"]))
            counted += [module._parameters, module._buffers, module._modules]
    return slots, edges, counted, deciders


def replan(model: torch.nn.Module, plan_again: Callable[[], Plan], names: Sequence[str],
           layout: str) -> Tuple[list, list, list, list, list, list]:
    """After the module structure changed: plan the model again
    (`plan_again`, the constructor's own selection and policy) and compare
    with the engine's `names`. The same names: the watch of the new
    structure, and every tracked (name, tensor) for the engine to follow
    where its tensor is new, and the frozen parameters left out
    (trainable_only=True). Otherwise a ValueError naming what was added,
    removed or untied."""
    plan = plan_again()
    now = [shard.spec.name for shard in plan.shards]
    added = [n for n in now if n not in set(names)]
    removed = [n for n in names if n not in set(now)]
    if added or removed:
        parts = []
        if added:
            parts.append(f"{_listed(added)} added")
        if removed:
            parts.append(f"{_listed(removed)} removed (or now tied to another tensor)")
        raise ValueError(f"shardema.EMA: the model changed after the EMA was built: "
                         f"{'; '.join(parts)}. The EMA follows tensors replaced by ones of the "
                         "same shape; for another set of tensors build a new EMA (or leave "
                         "new ones out with ignore_names=)")
    if layout in ("fsdp1", "zero3", "local_shards"):
        raise ValueError(f"shardema.EMA: the model changed after the EMA was built; an "
                         f"EMA of layout '{layout}' cannot follow its modules: build a new EMA")
    order = {name: index for index, name in enumerate(names)}
    plan.watched = [(c, k, t, order[now[i]]) for c, k, t, i in plan.watched]
    plan.alias_slots = [(c, k, t, order[now[i]]) for c, k, t, i in plan.alias_slots]
    owners: List[Any] = [None] * len(names)
    for i, owner in enumerate(plan.owners):
        owners[order[now[i]]] = owner
    plan.owners = owners
    slots, edges, counted, deciders = watch_of(model, plan, names)
    followed = [(slot[3], slot[2]) for slot in slots if not slot[4] and not is_dtensor(slot[2])]
    return slots, edges, counted, deciders, followed, plan.frozen


def _listed(names: List[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
