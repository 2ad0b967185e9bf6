"""Which tensors shardema.EMA leaves out or copies instead of averaging, by
name: ema-pytorch's ignore_names, ignore_startswith_names and
param_or_buffer_names_no_ema, checked against the names the EMA tracks so
that a misspelt name is an error instead of a tensor silently averaged."""
from typing import Iterable, List

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
