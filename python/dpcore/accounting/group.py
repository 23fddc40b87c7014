"""Group privacy: a guarantee for k records from a guarantee for one, as a cross-check.

A mechanism that is (ε, δ′)-DP for neighbouring data sets differing in one record is
(k·ε, k·e^{(k−1)ε}·δ′)-DP for data sets differing in k records (Vadhan 2017, "The Complexity of
Differential Privacy", Lemma 2.2; the pure-DP form is Dwork & Roth 2014, Theorem 2.2): chain the
k neighbours between the two data sets. A user who holds at most k examples is such a group, so
an example-level guarantee converts into a user-level one. The conversion is generic and loose:
for example-level sampling with a user-level guarantee dpcore accounts the user exactly as a
mixture of Gaussians (:class:`~dpcore.events.MixtureOfGaussiansEvent`, tighter by far); this
module gives the group-privacy value to compare against (it must come out looser).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Tuple, Union

from .._validate import count as _count, real as _real
from ..events import Event
from ._params import check_delta

__all__ = ["group_privacy_epsilon"]

ExampleGuarantee = Union[Event, Callable[[float], float], Tuple[float, float]]


def _example_curve(example: Any, accountant: str) -> Callable[[float], float]:
    """δ′ ↦ ε(δ′) of the example-level guarantee."""
    if isinstance(example, Event):
        from .base import make_accountant

        acct = make_accountant(accountant).compose(example)
        return acct.get_epsilon
    if callable(example):
        return example
    raise TypeError(
        "example must be an Event (the example-level run), a function delta -> epsilon, or an (epsilon, delta) pair, "
        f"got {type(example).__name__}"
    )


def group_privacy_epsilon(example: ExampleGuarantee, group_size: int, delta: float, *, accountant: str = "pld") -> float:
    """ε at ``delta`` for a group of ``group_size`` = k records by group privacy: from an
    example-level (ε, δ′), the group is (k·ε, k·e^{(k−1)ε}·δ′)-DP (Vadhan 2017, Lemma 2.2).

    ``example`` is the example-level guarantee: an :class:`~dpcore.events.Event` (the run at
    example level, accounted by ``accountant``), a function δ′ ↦ ε(δ′), or one pair (ε, δ′).
    Given a curve, δ′ is searched (on a grid of log δ′ down to about 1e-300, then by bisection
    next to the best point)
    for the smallest k·ε(δ′) whose group δ = k·e^{(k−1)ε(δ′)}·δ′ is at most ``delta``; every value
    returned was evaluated and meets ``delta``. Given a pair, k·ε is returned when its group δ
    meets ``delta``, else ∞ (the conversion certifies nothing at ``delta``). The result is an
    upper bound whenever the example-level ε is one. k = 1 returns the example-level ε at δ."""
    k = _count("group_size", group_size, 1)
    d = check_delta(delta)
    if isinstance(example, tuple):
        if len(example) != 2:
            raise ValueError(f"an (epsilon, delta) pair has two values, got {len(example)}")
        eps = _real("epsilon", example[0])
        dp = check_delta(example[1], "delta of the pair", allow_zero=True)
        if not eps >= 0:
            raise ValueError(f"epsilon must be >= 0, got {eps}")
        if math.isinf(eps):
            return math.inf
        return k * eps if _group_log_delta(k, eps, dp) <= math.log(d) else math.inf
    curve = _example_curve(example, accountant)
    if k == 1:
        return curve(d)
    log_d = math.log(d)

    def value(log_dp: float) -> Tuple[float, bool]:
        eps = curve(math.exp(log_dp))
        ok = math.isfinite(eps) and _group_log_delta(k, eps, math.exp(log_dp)) <= log_d
        return k * eps, ok

    # δ′ ≤ δ/k is necessary (e^{(k−1)ε} ≥ 1): depths below log(δ/k), dense near it, down to
    # δ′ ≈ 1e-300 (deeper δ′ only grows ε)
    top = log_d - math.log(k)
    depths = [0.0] + [0.25 * 1.5 ** i for i in range(20) if 0.25 * 1.5 ** i < 690 + top] + [max(690.0 + top, 0.0)]
    grid = [top - depth for depth in depths]
    # the scan's points are independent: evaluated in threads (the core's accountants release the GIL)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(grid))) as pool:
        values = list(pool.map(value, grid))
    results = [(g, ok) for g, (_, ok) in zip(grid, values)]
    best, best_at = math.inf, None
    for g, (v, ok) in zip(grid, values):
        if ok and v < best:
            best, best_at = v, g
    if best_at is None:
        return math.inf
    # the boundary between the best feasible point and the infeasible one just above it
    above = [g for g, ok in results if g > best_at and not ok]
    if above:
        good, bad = best_at, min(above)
        for _ in range(16):
            mid = 0.5 * (good + bad)
            v, ok = value(mid)
            if ok:
                good = mid
                best = min(best, v)
            else:
                bad = mid
    return best


def _group_log_delta(k: int, eps: float, delta_one: float) -> float:
    """log(k·e^{(k−1)ε}·δ′) (−∞ for δ′ = 0)."""
    if delta_one == 0:
        return -math.inf
    return math.log(k) + (k - 1) * eps + math.log(delta_one)
