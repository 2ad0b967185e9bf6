"""The three decay schedules. Each returns a ``shardema.DecaySchedule``
whose ``decay_at(step)`` is the C++ formula (1-based optimizer steps)."""
from typing import Optional

from . import _C


def WarmupSchedule(inv_gamma: float = 1.0, power: float = 0.75, min_value: float = 0.0,
                   max_value: float = 0.9999, update_after_step: int = 0,
                   update_every: int = 1) -> "_C.DecaySchedule":
    """Warmup ("inverse decay") schedule, VersatIL's and ema-pytorch's:
    decay = clamp(1 - (1 + e / inv_gamma) ** -power, min_value, max_value) with
    e = step - update_after_step - 1, and 0 while e <= 0."""
    return _C.warmup_schedule(inv_gamma=inv_gamma, power=power, min_value=min_value,
                              max_value=max_value, update_after_step=update_after_step,
                              update_every=update_every)


def ConstantSchedule(decay: float, update_every: int = 1) -> "_C.DecaySchedule":
    """The same decay at every step."""
    return _C.constant_schedule(decay=decay, update_every=update_every)


def PowerSchedule(sigma_rel: Optional[float] = None, gamma: Optional[float] = None,
                  convention: str = "nitrous", update_every: int = 1,
                  step_size_correction: bool = False) -> "_C.DecaySchedule":
    """Karras et al.'s power-function EMA, given by exactly one of sigma_rel
    or gamma. convention: "nitrous" (ema-pytorch; the first update copies) or
    "edm2" (the paper's beta(n) = (1 - 1/n) ** (gamma + 1))."""
    if (sigma_rel is None) == (gamma is None):
        raise ValueError("PowerSchedule: give exactly one of sigma_rel and gamma")
    if gamma is not None and not gamma > 0:
        raise ValueError(f"PowerSchedule: gamma must be > 0, got {gamma}")
    return _C.power_schedule(sigma_rel=0.05 if sigma_rel is None else float(sigma_rel),
                             gamma=0.0 if gamma is None else float(gamma),
                             convention=convention, update_every=update_every,
                             step_size_correction=step_size_correction)
