"""Calibration of a DP-SGD run to a target (ε, δ) under RDP accounting.

Each function searches (in Rust: bracketing, then the Illinois variant of regula falsi on
log ε) for the boundary where ε, computed as in :func:`dpcore.accounting.epsilon`
(Mironov, Talwar, Zhang 2019 §3; Canonne, Kamath, Steinke 2020 Prop. 12), meets the target.
The result never exceeds the target (it is verified by evaluating ε at the returned value) and
lies within 1e-6 relative of the boundary; for steps, it is the largest integer that fits.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .. import _core
from .rdp import _count, _orders, _real


def _target(eps: float, delta: float):
    e = _real("target_epsilon", eps)
    d = _real("target_delta", delta)
    if not e > 0:
        raise ValueError(f"target_epsilon must be > 0, got {e}")
    if not 0 < d < 1:
        raise ValueError(f"target_delta must be in (0, 1), got {d}")
    return e, d


def _q(q: float) -> float:
    q = _real("sampling_probability", q)
    if not 0 <= q <= 1:
        raise ValueError(f"sampling_probability must be in [0, 1], got {q}")
    return q


def _z(z: float) -> float:
    z = _real("noise_multiplier", z)
    if not z >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {z}")
    return z


def _steps(s: int) -> int:
    s = _count("steps", s)
    if s < 1:
        raise ValueError(f"steps must be >= 1, got {s}")
    return s


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sampling_probability: float,
    steps: int,
    orders: Optional[Sequence[float]] = None,
) -> float:
    """Smallest noise multiplier z (to 1e-6 relative, rounded up) such that ``steps``
    Poisson-subsampled Gaussian steps have ε ≤ ``target_epsilon`` at ``target_delta``
    (RDP: MTZ 2019 §3; conversion: CKS 2020 Prop. 12)."""
    e, d = _target(target_epsilon, target_delta)
    return _core.calibrate_noise_multiplier(e, d, _q(sampling_probability), float(_steps(steps)), _orders(orders).tolist())


def calibrate_sampling_probability(
    target_epsilon: float,
    target_delta: float,
    noise_multiplier: float,
    steps: int,
    orders: Optional[Sequence[float]] = None,
) -> float:
    """Largest sampling probability q (to 1e-6 relative, rounded down; 1.0 if every q fits)
    with ε ≤ ``target_epsilon`` (RDP: MTZ 2019 §3; conversion: CKS 2020 Prop. 12)."""
    e, d = _target(target_epsilon, target_delta)
    return _core.calibrate_sampling_probability(e, d, _z(noise_multiplier), float(_steps(steps)), _orders(orders).tolist())


def calibrate_steps(
    target_epsilon: float,
    target_delta: float,
    sampling_probability: float,
    noise_multiplier: float,
    orders: Optional[Sequence[float]] = None,
) -> int:
    """Largest number of steps (0 if none fits; searched up to 2^53) with ε ≤
    ``target_epsilon`` (RDP: MTZ 2019 §3, composed by Mironov 2017 Prop. 1; conversion: CKS
    2020 Prop. 12)."""
    e, d = _target(target_epsilon, target_delta)
    return int(_core.calibrate_steps(e, d, _q(sampling_probability), _z(noise_multiplier), _orders(orders).tolist()))
