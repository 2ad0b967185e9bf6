"""float64 references of the post-hoc EMA (Karras et al.), computed from
the raw weights alone: each power-function profile as nitrous updates it,
and the least-squares synthesis of any sigma_rel over snapshots of them
(Algorithm 3). test_lightning_posthoc.py and the multi-rank post-hoc
workers (posthoc_parallel_worker.py) check shardema against them."""
import math
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np
import torch


def gamma_of(sigma_rel: float) -> float:
    """The power-function exponent of a relative width: the largest root of
    (g + 2)^2 (g + 3) = sigma_rel^-2 (g + 1) (Karras et al., Eq. 123)."""
    q = sigma_rel ** -2
    roots = np.roots([1.0, 7.0, 16.0 - q, 12.0 - q])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-9))


def profile_decay(gamma: float, n: int, correction: bool = True) -> float:
    """nitrous' beta at call n, (1 - 1/(n + 1))^(gamma + 1); with its step
    size correction for an update every call, the geometric mean of the
    betas of n and n + 1."""
    def beta(m):
        return (1.0 - 1.0 / (m + 1.0)) ** (gamma + 1.0)
    return math.sqrt(beta(n) * beta(n + 1)) if correction else beta(n)


def power_profiles(trace: Sequence[Tuple[int, Dict[str, torch.Tensor]]], sigma_rel: float,
                   names: Iterable[str], correction: bool = True
                   ) -> Dict[int, Dict[str, torch.Tensor]]:
    """{step: {name: float64 EMA}}: the first call copies the weights, call
    n >= 2 lerps with profile_decay(n); the trace holds the weights after
    each optimizer step (trace[0]: before the first, left out)."""
    names = list(names)
    gamma = gamma_of(sigma_rel)
    ema, out = None, {}
    for step, weights in trace[1:]:
        if ema is None:
            ema = {k: weights[k].double().clone() for k in names}
        else:
            d = profile_decay(gamma, step, correction)
            ema = {k: ema[k] * d + weights[k].double() * (1.0 - d) for k in names}
        out[step] = ema
    return out


def p_dot_p(t_a: float, g_a: float, t_b: float, g_b: float) -> float:
    """Inner product of two power-function EMA profiles (Algorithm 3)."""
    exponent = g_b if t_a < t_b else -g_a
    return ((g_a + 1) * (g_b + 1) * (t_a / t_b) ** exponent) / ((g_a + g_b + 1) * max(t_a, t_b))


def synthesis_of(profiles: Dict[float, Dict[int, Dict[str, torch.Tensor]]], steps: Iterable[int],
                 sigma_rel: float, at: int, names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """float64 least-squares synthesis of `sigma_rel` at step `at` from the
    snapshots at `steps` of the profiles {sigma_rel: power_profiles(...)}."""
    basis: List = [(t, gamma_of(s), profiles[s][t]) for t in steps for s in sorted(profiles)]
    a = torch.tensor([[p_dot_p(ti, gi, tj, gj) for tj, gj, _ in basis] for ti, gi, _ in basis],
                     dtype=torch.float64)
    b = torch.tensor([p_dot_p(ti, gi, at, gamma_of(sigma_rel)) for ti, gi, _ in basis],
                     dtype=torch.float64)
    weights = torch.linalg.solve(a, b)
    return {k: sum(w * values[k] for w, (_, _, values) in zip(weights.tolist(), basis))
            for k in names}
