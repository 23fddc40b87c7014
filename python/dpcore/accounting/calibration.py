"""Calibration of a DP-SGD run to a target (ε, δ), under the PLD accountant (default) or RDP.

Each function searches for the boundary where ε, computed as in
:func:`dpcore.accounting.epsilon` with the same accountant, meets the target: under RDP in Rust
(bracketing, then the Illinois variant of regula falsi on log ε; Mironov, Talwar, Zhang 2019
§3; Canonne, Kamath, Steinke 2020 Prop. 12); under PLD here, starting from the RDP answer
(PLD's ε is smaller, so the RDP value is a verified bracket end) and refining with the same
Illinois iteration over Rust evaluations of the PLD ε (Doroshenko et al. 2022). The result
never exceeds the target under the accountant used (it is verified by evaluating ε at the
returned value) and lies within 1e-6 relative of the boundary (PLD: 1e-5); for steps, it is the
largest integer that fits.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

from .. import _core
from .._validate import count as _count, probability, real as _real
from ._params import check_delta, check_orders
from .base import DEFAULT_ACCOUNTANT, check_accountant


def _pld_eps(q: float, z: float, steps: int, delta: float) -> float:
    return _core.pld_epsilon_bounds([(q, z, float(steps))], delta, None, False)[1]


def _illinois(f, xb: float, fb: float, xg: float, fg: float, rel: float) -> float:
    """Narrows [bad, good] on a log scale (f > 0 bad, f <= 0 good) to ``rel``; returns good."""
    side = 0
    for _ in range(100):
        if abs(xg - xb) <= rel:
            break
        x = 0.5 * (xb + xg)
        if math.isfinite(fb) and math.isfinite(fg) and fb != fg:
            sx = (xb * fg - xg * fb) / (fg - fb)
            lo, hi = min(xb, xg), max(xb, xg)
            if lo + 1e-3 * (hi - lo) < sx < hi - 1e-3 * (hi - lo):
                x = sx
        fx = f(x)
        if fx > 0:
            xb, fb = x, fx
            if side == -1:
                fg *= 0.5
            side = -1
        else:
            xg, fg = x, fx
            if side == 1:
                fb *= 0.5
            side = 1
    return xg


def _pld_boundary(
    eps_at: Callable[[float], float],
    x0: float,
    target: float,
    toward_safety: int,
    log_cap: float = math.inf,
) -> float:
    """The x on the safe side (ε ≤ ``target``) of the PLD boundary ε(x) = target, to 1e-5
    relative. From ``x0`` (the RDP answer, nearly always safe under the tighter PLD) it steps
    toward safety until safe, brackets the boundary by steps of 0.7 in log x the other way, narrows
    it by the Illinois method and verifies the result, nudging it two ulps toward safety at most
    eight times. ``toward_safety`` is +1 when ε falls as x grows (the noise multiplier), −1 when it
    rises (the sampling probability); ``log_cap`` bounds log x from above."""
    lt = math.log(target)

    def g(lx: float) -> float:
        return math.log(max(eps_at(math.exp(lx)), 1e-300)) - lt

    lg = math.log(x0)
    fg = g(lg)
    while fg > 0:
        lg += 0.05 * toward_safety
        fg = g(lg)
    lb = min(lg - 0.7 * toward_safety, log_cap)
    fb = g(lb)
    while fb <= 0:
        lg, fg = lb, fb
        lb = min(lb - 0.7 * toward_safety, log_cap)
        if lb < -40:
            return math.exp(lg)
        fb = g(lb)
    x = min(math.exp(_illinois(g, lb, fb, lg, fg, 1e-5)), math.exp(log_cap))
    away = math.inf if toward_safety > 0 else 0.0
    for _ in range(8):
        if eps_at(x) <= target:
            return x
        x = math.nextafter(math.nextafter(x, away), away)
    raise RuntimeError("calibration failed to verify the target (please report)")


def _no_orders(accountant: str, orders) -> None:
    if accountant == "pld" and orders is not None:
        raise ValueError("orders are an RDP setting; pass accountant='rdp' to use them")


#: The largest target ε a calibration accepts. Beyond it the guarantee says nothing (e^ε ≥
#: e^10000), and the search would spend minutes on ever coarser grids: a target of inf or 1e300
#: is refused at once with this limit named.
MAX_TARGET_EPSILON = 1e4


def _target(eps: float, delta: float, accountant: str, orders) -> Tuple[float, float]:
    """The checked (ε, δ) target of a calibration, once its accountant and orders are valid."""
    check_accountant(accountant)
    _no_orders(accountant, orders)
    e = _real("target_epsilon", eps)
    if not e > 0:
        raise ValueError(f"target_epsilon must be > 0, got {e}")
    if not e <= MAX_TARGET_EPSILON:
        raise ValueError(
            f"target_epsilon must be at most {MAX_TARGET_EPSILON:g} (a larger ε guarantees nothing), got {e}"
        )
    return e, check_delta(delta, "target_delta")


def _q(q: float) -> float:
    return probability("sampling_probability", q)


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
    *,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> float:
    """Smallest noise multiplier z (to 1e-6 relative under RDP, 1e-5 under PLD, rounded up)
    such that ``steps`` Poisson-subsampled Gaussian steps have ε ≤ ``target_epsilon`` at
    ``target_delta`` under ``accountant`` ("pld": Doroshenko et al. 2022; "rdp": MTZ 2019 §3
    with CKS 2020 Prop. 12). ``sampling_probability = 0`` samples no record (ε = 0 at any noise):
    0.0 under every accountant. A target above :data:`MAX_TARGET_EPSILON` (inf included) is a
    ValueError."""
    e, d = _target(target_epsilon, target_delta, accountant, orders)
    q, t = _q(sampling_probability), _steps(steps)
    z_rdp = _core.calibrate_noise_multiplier(e, d, q, float(t), check_orders(orders).tolist())
    if accountant == "rdp" or q == 0.0:
        return z_rdp
    # z_rdp meets the target under PLD too (PLD is tighter); the search steps up if
    # discretisation says not.
    return _pld_boundary(lambda z: _pld_eps(q, z, t, d), z_rdp, e, toward_safety=1)


def calibrate_sampling_probability(
    target_epsilon: float,
    target_delta: float,
    noise_multiplier: float,
    steps: int,
    orders: Optional[Sequence[float]] = None,
    *,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> float:
    """Largest sampling probability q (to 1e-6 relative under RDP, 1e-5 under PLD, rounded
    down; 1.0 if every q fits) with ε ≤ ``target_epsilon`` under ``accountant``."""
    e, d = _target(target_epsilon, target_delta, accountant, orders)
    z, t = _z(noise_multiplier), _steps(steps)
    q_rdp = _core.calibrate_sampling_probability(e, d, z, float(t), check_orders(orders).tolist())
    if accountant == "rdp":
        return q_rdp
    if _pld_eps(1.0, z, t, d) <= e:
        return 1.0
    if q_rdp == 0.0:
        return 0.0
    return _pld_boundary(lambda q: _pld_eps(min(q, 1.0), z, t, d), q_rdp, e, toward_safety=-1, log_cap=0.0)


def calibrate_steps(
    target_epsilon: float,
    target_delta: float,
    sampling_probability: float,
    noise_multiplier: float,
    orders: Optional[Sequence[float]] = None,
    *,
    accountant: str = DEFAULT_ACCOUNTANT,
) -> int:
    """Largest number of steps (0 if none fits; searched up to 2^53) with ε ≤
    ``target_epsilon`` under ``accountant`` (RDP: MTZ 2019 §3, Mironov 2017 Prop. 1, CKS 2020
    Prop. 12; PLD: Doroshenko et al. 2022)."""
    e, d = _target(target_epsilon, target_delta, accountant, orders)
    q, z = _q(sampling_probability), _z(noise_multiplier)
    s_rdp = int(_core.calibrate_steps(e, d, q, z, check_orders(orders).tolist()))
    if accountant == "rdp":
        return s_rdp
    ok = lambda s: _pld_eps(q, z, s, d) <= e  # noqa: E731
    good = max(s_rdp, 1)
    while good > 1 and not ok(good):
        good //= 2
    if not ok(good):
        return 0
    bad = good * 2
    cap = 1 << 53
    while ok(bad):
        good = bad
        if bad >= cap:
            return cap
        bad = min(bad * 2, cap)
    while bad - good > 1:
        mid = good + (bad - good) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good
