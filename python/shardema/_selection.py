"""Which tensors shardema.EMA leaves out or copies instead of averaging, by
name: ema-pytorch's ignore_names, ignore_startswith_names and
param_or_buffer_names_no_ema, checked against the names the EMA tracks so
that a misspelt name is an error instead of a tensor silently averaged."""
from typing import Iterable, List, Tuple

from ._model import Tracked


def _as_names(value: Iterable[str], argument: str) -> List[str]:
    if isinstance(value, str):  # a lone string would be read as its letters
        raise TypeError(f"{argument} must be a collection of names, got the string {value!r}")
    names = list(value)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{argument}: expected names (str), got {type(name).__name__}")
    return names


def _names(t: Tracked) -> List[str]:
    """Every state_dict key of a tracked tensor: its name and its aliases."""
    return [t.name] + list(t.aliases)


def select(tracked: List[Tracked], ignore_names: Iterable[str], ignore_prefixes: Iterable[str],
           copy_names: Iterable[str]) -> List[Tracked]:
    """`tracked` less the ignored names and the names under an ignored
    prefix, with the role "copy" for copy_names. A tied tensor is one tensor
    under several state_dict keys: naming any of them (or a prefix of any)
    selects it, under all of them. A name or prefix that matches no tracked
    tensor, or a tensor both ignored and copied, is a ValueError naming it."""
    ignored = _as_names(ignore_names, "ignore_names")
    prefixes = _as_names(ignore_prefixes, "ignore_prefixes")
    copied = _as_names(copy_names, "copy_names")
    if not (ignored or prefixes or copied):
        return tracked
    known = [n for t in tracked for n in _names(t)]
    for argument, names in (("ignore_names", ignored), ("copy_names", copied)):
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"{argument}: {unknown} name no tracked tensor (the names are the "
                             f"model's state_dict keys, e.g. {known[:3]})")
    for prefix in prefixes:
        if not any(n.startswith(prefix) for n in known):
            raise ValueError(f"ignore_prefixes: no tracked tensor's name starts with {prefix!r} "
                             f"(the names are the model's state_dict keys, e.g. {known[:3]})")

    def left_out(t: Tracked) -> bool:
        return any(n in ignored or any(n.startswith(p) for p in prefixes) for n in _names(t))

    def is_copied(t: Tracked) -> bool:
        return any(n in copied for n in _names(t))

    both = [t.name + (f" (also {', '.join(t.aliases)})" if t.aliases else "")
            for t in tracked if is_copied(t) and left_out(t)]
    if both:
        raise ValueError(f"{both} are both left out (ignore_names / ignore_prefixes) and in "
                         "copy_names; say one")
    kept = [t for t in tracked if not left_out(t)]
    if not kept:
        raise ValueError("ignore_names / ignore_prefixes leave no tensor to average")
    for t in kept:
        if is_copied(t):
            t.role = "copy"
    return kept


def keep_trainable(tracked: List[Tracked], kept_before: Iterable[str] = ()) -> \
        Tuple[List[Tracked], List[Tuple[dict, str, str]]]:
    """trainable_only=True: (the parameters that require grad, or that were
    kept when the EMA was built (`kept_before`, so a plan made again after a
    module was replaced keeps the same tensors); the (container, key, name)
    of each frozen parameter left out, which the engine's model watch checks
    before every update, swap and copy: one that requires grad later is
    refused by name, since the EMA holds nothing of it).

    Buffers are left out: they are not trained (BatchNorm's statistics
    follow the data, rotary caches and position ids are constants), so the
    model's own values stand beside the EMA of the trainable weights, as in
    diffusers' EMAModel over model.parameters()."""
    before = set(kept_before)
    kept, frozen = [], []
    for t in tracked:
        if t.piece is not None:
            from ._zero3 import Partition
            model = "a DeepSpeed ZeRO-3 model" if isinstance(t.piece, Partition) else \
                "an FSDP1 model (FullyShardedDataParallel)"
            raise ValueError(f"shardema.EMA: trainable_only=True is not supported for {model} "
                             f"('{t.name}' is a range of a flattened parameter); leave the frozen "
                             "parameters out by name with ignore_names= / ignore_prefixes=")
        if t.is_buffer:
            continue
        if bool(t.tensor.requires_grad) or t.name in before:
            kept.append(t)
        elif t.container is not None:
            frozen.append((t.container, t.key, t.name))
    if not kept:
        raise ValueError("trainable_only=True: no parameter of the model requires grad (and "
                         "none is left after ignore_names / ignore_prefixes); unfreeze the "
                         "ones to average before building the EMA")
    return kept, frozen


def refuse_unfrozen(frozen: List[Tuple[dict, str, str]], api: str) -> None:
    """The check the EMA's model watch makes of `frozen` (keep_trainable's
    left-out parameters), for the engines without one (the post-hoc EMA):
    a ValueError naming those that require grad now."""
    unfrozen = [name for container, key, name in frozen
                if getattr(container.get(key), "requires_grad", False)]
    if unfrozen:
        raise ValueError(f"{api}: {unfrozen[:5]} require grad now, but trainable_only=True left "
                         "them out while they were frozen, so the post-hoc EMA holds nothing "
                         "of them; freeze them again, or start a new run without "
                         "trainable_only")
