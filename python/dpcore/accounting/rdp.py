"""Rényi-DP accountant for (sub)sampled Gaussian steps; concern (c) of McMahan et al. 2018.

The math runs in Rust (``rust/accounting``):

* Poisson-subsampled Gaussian, add-or-remove-one adjacency: ε(α) = log A_α / (α − 1) with
  A_α = E_{x∼N(0,z²)}[((1 − q) + q·exp((2x − 1)/(2z²)))^α] (Mironov, Talwar, Zhang 2019,
  arXiv:1908.10530, §3 eq. (3)); exact binomial sums at integer α (§3.2), numerical
  integration at real α (the integral itself, not the §3.3 series), rounded up.
* Sampling without replacement, replace-one adjacency: Wang, Balle, Kasiviswanathan 2019
  (arXiv:1808.00087), Theorem 9 with the Gaussian refinement of Theorem 27, exact at integer α
  and interpolated on the convex cumulant (Corollary 10) between them.
* Poisson-subsampled *discrete* Gaussian (``DiscreteGaussianEvent``): its base curve is the
  Gaussian's α/(2z²) (Canonne, Kamath & Steinke 2020, Theorem 14), but the sampled Gaussian's
  exact formula above relies on the continuous density, so the general Poisson-subsampling
  bound of Zhu & Wang 2019 ("Poisson Subsampled Rényi Differential Privacy", ICML, Theorem 6),
  valid for any mechanism with that curve, is used at integer α, together with the
  unamplified curve (whichever is smaller); real α take the chord of the convex cumulant
  (α − 1)ε(α) between integers (Wang, Balle & Kasiviswanathan 2019, Corollary 10).
* Random allocation of k of t steps and balls-in-bins (``RandomAllocationSampledEvent``,
  ``BallsInBinsSampledEvent``), add-or-remove-one adjacency: whole rounds, exact at integer α
  in the remove direction (Feldman & Shenfeld 2025, arXiv:2502.08202, Corollary 6.2), bounded
  in the add direction; see :mod:`dpcore.accounting.allocation`. ε then comes from the grid.
* Composition adds RDP (Mironov 2017, arXiv:1702.07476, Proposition 1).
* RDP → (ε, δ): ε = r + log1p(−1/α) − (log δ + log α)/(α − 1) (Canonne, Kamath, Steinke 2020,
  arXiv:2004.00010, Proposition 12; Balle et al. 2020, arXiv:1905.09982, Theorem 21), minimised
  over the grid of orders and then continuously between the neighbours of the best one; the
  result is never above the grid minimum.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from ..events import ComposedEvent, DiscreteGaussianEvent, Event, GaussianEvent, NonPrivateEvent
from ..events import PoissonSampledEvent, SampledWithoutReplacementEvent, SelfComposedEvent
from ..events import RepeatAndSelectEvent
from ..events import BallsInBinsSampledEvent, MixtureOfGaussiansEvent, RandomAllocationSampledEvent
from .._validate import count as _count, probability, real as _real
from ._params import DEFAULT_ORDERS, NEIGHBORING, check_delta, check_epsilon, check_orders, gaussian_noise_multiplier
from .allocation import check_allocation_event, rdp_random_allocation
from .base import PrivacyAccountant, UnsupportedEventError, check_accountant, register_accountant
from .tuning import repeat_and_select_rdp

__all__ = [
    "DEFAULT_ORDERS",
    "NEIGHBORING",
    "OrderRangeWarning",
    "RdpAccountant",
    "epsilon",
    "epsilon_from_rdp",
    "rdp_poisson_subsampled_discrete_gaussian",
    "rdp_poisson_subsampled_gaussian",
]


class OrderRangeWarning(UserWarning):
    """The best order is at an end of the grid and continuous search could not move it: a
    wider grid may give a smaller ε."""


def _warn_edge(at_edge: bool, order: float, orders: np.ndarray) -> None:
    if at_edge:
        warnings.warn(
            f"the best RDP order {order:g} is at the end of the grid [{orders[0]:g}, {orders[-1]:g}] and "
            "continuous search could not move it inside; extend `orders` for a possibly smaller epsilon",
            OrderRangeWarning,
            stacklevel=3,
        )


def _step_params(sampling_probability: Any, noise_multiplier: Any) -> Tuple[float, float]:
    """(q, z) of one sampled step, validated: q in [0, 1], z >= 0."""
    q = probability("sampling_probability", sampling_probability)
    z = _real("noise_multiplier", noise_multiplier)
    if not z >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {z}")
    return q, z


def rdp_poisson_subsampled_gaussian(sampling_probability: float, noise_multiplier: float, orders: Any) -> np.ndarray:
    """RDP ε(α) of one step of the Poisson-subsampled Gaussian mechanism at each order.

    Mironov, Talwar, Zhang 2019 (arXiv:1908.10530), §3 eq. (3): ε(α) = log A_α / (α − 1),
    A_α = E_{x∼N(0,z²)}[((1 − q) + q e^{(2x−1)/(2z²)})^α]. Integer α: exact binomial sum (§3.2);
    real α: numerical integration with its error bound added. q = 0 gives 0; z = 0 or α = ∞
    gives ∞; q = 1 gives α/(2z²) (the Gaussian mechanism, Mironov 2017 Prop. 7).

    Returns a float64 array shaped like ``orders`` (which must all be > 1).
    """
    q, z = _step_params(sampling_probability, noise_multiplier)
    a = np.asarray(orders, dtype=np.float64)
    flat = a.ravel()
    if flat.size == 0:
        return np.zeros(a.shape)
    if np.isnan(flat).any() or not (flat > 1).all():
        raise ValueError("orders must all be > 1")
    out = _core.rdp_poisson_subsampled_gaussian(q, z, flat.tolist())
    return np.asarray(out).reshape(a.shape)


def _zhu_wang_integer(q: float, z: float, alpha: int) -> float:
    """Zhu & Wang 2019, Theorem 6, at integer α ≥ 2 for a base curve ε(ℓ) = ℓ/(2z²):
    ε(α) ≤ log[(1−q)^{α−1}(αq − q + 1) + C(α,2)q²(1−q)^{α−2}e^{ε(2)}
    + 3 Σ_{ℓ=3}^{α} C(α,ℓ)(1−q)^{α−ℓ}q^ℓ e^{(ℓ−1)ε(ℓ)}] / (α − 1), computed in log space."""
    base = alpha / (2.0 * z * z)
    if q >= 1.0:
        return base
    lq, l1q = math.log(q), math.log1p(-q)
    ell = np.arange(2, alpha + 1, dtype=np.float64)
    logc = math.lgamma(alpha + 1) - np.array([math.lgamma(k + 1) + math.lgamma(alpha - k + 1) for k in ell])
    terms = logc + ell * lq + (alpha - ell) * l1q + (ell - 1) * ell / (2.0 * z * z)
    terms[1:] += math.log(3.0)
    first = (alpha - 1) * l1q + math.log1p((alpha - 1) * q)
    allt = np.concatenate(([first], terms))
    m = allt.max()
    bound = (m + math.log(np.exp(allt - m).sum())) / (alpha - 1)
    return min(base, bound)


def rdp_poisson_subsampled_discrete_gaussian(sampling_probability: float, noise_multiplier: float, orders: Any) -> np.ndarray:
    """RDP ε(α) of one Poisson-subsampled discrete Gaussian step at each order (an upper bound).

    Zhu & Wang 2019, Theorem 6 (general Poisson subsampling) on the base curve α/(2z²) of the
    discrete Gaussian (Canonne, Kamath & Steinke 2020, Theorem 14), or that base curve if
    smaller; real orders interpolate the cumulant (α − 1)ε(α) linearly between integers, which
    bounds it from above because it is convex (Wang, Balle & Kasiviswanathan 2019, Corollary
    10). Rounded up by a relative 10⁻⁹ for the float error of the log-sum.
    """
    q, z = _step_params(sampling_probability, noise_multiplier)
    a = np.asarray(orders, dtype=np.float64)
    flat = a.ravel()
    if np.isnan(flat).any() or not (flat > 1).all():
        raise ValueError("orders must all be > 1")
    if q == 0:
        return np.zeros(a.shape)
    if z == 0:
        return np.full(a.shape, np.inf)
    cache: Dict[int, float] = {1: 0.0}

    def cumulant(k: int) -> float:
        if k not in cache:
            cache[k] = (k - 1) * _zhu_wang_integer(q, z, k)
        return cache[k]

    out = np.empty(flat.shape)
    for i, alpha in enumerate(flat):
        if math.isinf(alpha):
            out[i] = math.inf
            continue
        lo = int(math.floor(alpha))
        if lo == alpha:
            k = cumulant(lo)
        else:
            t = alpha - lo
            k = (1 - t) * cumulant(lo) + t * cumulant(lo + 1)
        out[i] = k / (alpha - 1)
    return np.nextafter(out * (1 + 1e-9), np.inf).reshape(a.shape)


class _Tally:
    """What composing an event adds to an :class:`RdpAccountant`: step counts by group."""

    __slots__ = ("poisson", "wor", "discrete", "tuned", "allocation", "non_private")

    def __init__(self) -> None:
        self.poisson: Dict[Tuple[float, float], int] = {}
        self.wor: Dict[Tuple[float, float], int] = {}
        self.discrete: Dict[Tuple[float, float], int] = {}
        self.tuned: Dict[Event, int] = {}
        self.allocation: Dict[Tuple[int, int, float], int] = {}
        self.non_private = False


def _add(into: dict, key: Any, count: int) -> None:
    into[key] = into.get(key, 0) + count


@register_accountant("rdp")
class RdpAccountant(PrivacyAccountant):
    """Rényi-DP accountant (see the module docstring for the papers and equations).

    ``neighboring``: ``"add_or_remove"`` (Poisson sampling, Gaussian steps) or ``"replace_one"``
    (sampling without replacement, Gaussian steps). Identical events are grouped, so composing
    10⁶ steps drawn from a few distinct (q, z) costs one RDP evaluation per distinct pair.
    """

    def __init__(self, orders: Optional[Sequence[float]] = None, neighboring: str = "add_or_remove") -> None:
        super().__init__(neighboring)
        self._orders = check_orders(orders)
        self._poisson: Dict[Tuple[float, float], int] = {}
        self._wor: Dict[Tuple[float, float], int] = {}
        self._discrete: Dict[Tuple[float, float], int] = {}
        self._non_private = False
        self._group_rdp: Dict[Tuple[str, float, float], np.ndarray] = {}
        # Hyperparameter tuning events (Papernot & Steinke 2022), by count: see `rdp`.
        self._tuned: Dict[Event, int] = {}
        # Random allocation / balls-in-bins rounds by (t, k, z): see `rdp`.
        self._allocation: Dict[Tuple[int, int, float], int] = {}

    @property
    def orders(self) -> np.ndarray:
        return self._orders.copy()

    def _tally(self, event: Event, count: int) -> _Tally:
        t = _Tally()
        self._walk(event, count, t)
        return t

    def _record(self, t: _Tally) -> None:
        for mine, new in ((self._poisson, t.poisson), (self._discrete, t.discrete), (self._wor, t.wor),
                          (self._tuned, t.tuned), (self._allocation, t.allocation)):
            for k, c in new.items():
                _add(mine, k, c)
        self._non_private |= t.non_private

    def _walk(self, e: Event, count: int, t: _Tally) -> None:
        if count == 0:
            return
        if isinstance(e, SelfComposedEvent):
            self._walk(e.event, count * e.count, t)
        elif isinstance(e, ComposedEvent):
            # Group repeated sub-events first: 10⁶ identical entries cost one dict update.
            tally: Dict[Event, int] = {}
            for sub in e.events:
                tally[sub] = tally.get(sub, 0) + 1
            for sub, c in tally.items():
                self._walk(sub, count * c, t)
        elif isinstance(e, NonPrivateEvent):
            t.non_private = True
        elif isinstance(e, GaussianEvent):
            _add(t.poisson, (1.0, e.noise_multiplier), count)
        elif isinstance(e, DiscreteGaussianEvent) or (
            isinstance(e, PoissonSampledEvent) and isinstance(e.event, DiscreteGaussianEvent)
        ):
            if self._neighboring != "add_or_remove":
                raise UnsupportedEventError(
                    f"RdpAccountant analyses the discrete Gaussian under neighboring='add_or_remove' only, got {e!r}"
                )
            q, inner = (e.sampling_probability, e.event) if isinstance(e, PoissonSampledEvent) else (1.0, e)
            if inner.noise_multiplier == 0:
                t.non_private = True
            else:
                _add(t.discrete, (q, inner.noise_multiplier), count)
        elif isinstance(e, PoissonSampledEvent):
            why = "Poisson sampling is analysed under 'add_or_remove' (RdpAccountant() or PldAccountant())"
            self._tally_sampled(e, "add_or_remove", why, e.sampling_probability, t.poisson, count, t)
        elif isinstance(e, SampledWithoutReplacementEvent):
            why = "sampling without replacement is analysed under RdpAccountant(neighboring='replace_one')"
            self._tally_sampled(e, "replace_one", why, e.sample_size / e.source_size, t.wor, count, t)
        elif isinstance(e, RepeatAndSelectEvent):
            # Hyperparameter tuning: the inner run's curve, transformed by Papernot & Steinke
            # 2022 (dpcore.accounting.tuning), is added in `rdp`. The inner event is walked here
            # so that one this accountant cannot analyse is refused now.
            RdpAccountant(self._orders, self._neighboring)._tally(e.event, 1)
            _add(t.tuned, e, count)
        elif isinstance(e, (RandomAllocationSampledEvent, BallsInBinsSampledEvent)):
            # Whole rounds of random allocation (balls-in-bins: k = 1), their RDP from
            # dpcore.accounting.allocation, added in `rdp`.
            ra = check_allocation_event(e, self._neighboring)
            z = self._inner_noise(ra.event, type(e).__name__, t)
            if z == 0:
                t.non_private = True
            elif z is not None:
                _add(t.allocation, (ra.num_steps, ra.num_selected, z), count)
        elif isinstance(e, MixtureOfGaussiansEvent):
            raise UnsupportedEventError(
                "RdpAccountant cannot analyse MixtureOfGaussiansEvent (example-level sampling with a user-level "
                "guarantee): no certified Rényi bound of the mixture-of-Gaussians mechanism is implemented; use "
                "PldAccountant (accountant='pld'), which accounts it tightly"
            )
        else:
            raise UnsupportedEventError(f"RdpAccountant cannot analyse {type(e).__name__} events")

    def _tally_sampled(self, e: Any, relation: str, why: str, q: float, into: dict, count: int, t: _Tally) -> None:
        """Counts a sampled Gaussian step into ``into`` under key (q, z), once its neighbouring
        relation is the one its analysis needs. (A Poisson-sampled discrete Gaussian never gets
        here: it has its own branch.)"""
        if self._neighboring != relation:
            raise UnsupportedEventError(
                f"RdpAccountant cannot analyse {e!r} under neighboring={self._neighboring!r}: {why}"
            )
        if isinstance(e.event, DiscreteGaussianEvent):
            raise UnsupportedEventError(
                "RdpAccountant cannot analyse the discrete Gaussian on samples drawn without replacement (the "
                "analysis used there is specific to the continuous Gaussian); use Poisson sampling"
            )
        z = self._inner_noise(e.event, type(e).__name__, t)
        if z is not None:
            _add(into, (q, z), count)

    @staticmethod
    def _inner_noise(inner: Event, outer: str, t: _Tally) -> Optional[float]:
        if isinstance(inner, NonPrivateEvent):
            t.non_private = True
            return None
        z = gaussian_noise_multiplier(inner)
        if z is None:
            raise TypeError(f"the event inside {outer} must be Gaussian (possibly composed Gaussians)")
        if math.isinf(z):
            return None  # nothing released
        return z

    # -- results -------------------------------------------------------------------------

    def _groups(self) -> Tuple[List[Tuple[float, float, float]], List[Tuple[float, float, float]]]:
        p = [(q, z, float(c)) for (q, z), c in self._poisson.items() if c > 0]
        w = [(g, z, float(c)) for (g, z), c in self._wor.items() if c > 0]
        return p, w

    @property
    def rdp(self) -> np.ndarray:
        """Total RDP at each of :attr:`orders` (rounded up)."""
        if self._non_private:
            return np.full(self._orders.shape, np.inf)
        missing_p = [k for k in self._poisson if ("p",) + k not in self._group_rdp]
        missing_w = [k for k in self._wor if ("w",) + k not in self._group_rdp]
        if missing_p or missing_w:
            n = self._orders.size
            flat = np.asarray(
                _core.rdp_per_group(
                    [(q, z, 1.0) for q, z in missing_p], [(g, z, 1.0) for g, z in missing_w], self._orders.tolist()
                )
            ).reshape(-1, n)
            for i, k in enumerate(missing_p):
                self._group_rdp[("p",) + k] = flat[i]
            for i, k in enumerate(missing_w):
                self._group_rdp[("w",) + k] = flat[len(missing_p) + i]
        for k in self._discrete:
            if ("d",) + k not in self._group_rdp:
                self._group_rdp[("d",) + k] = rdp_poisson_subsampled_discrete_gaussian(k[0], k[1], self._orders)
        total = np.zeros(self._orders.shape)
        groups = (
            [(("p",) + k, c) for k, c in self._poisson.items()]
            + [(("w",) + k, c) for k, c in self._wor.items()]
            + [(("d",) + k, c) for k, c in self._discrete.items()]
        )
        if self._allocation:
            for k in self._allocation:
                if ("a",) + k not in self._group_rdp:
                    self._group_rdp[("a",) + k] = rdp_random_allocation(k[0], k[1], k[2], self._orders)
            groups += [(("a",) + k, c) for k, c in self._allocation.items()]
        if self._tuned:
            for e in self._tuned:
                if ("t", e) not in self._group_rdp:
                    self._group_rdp[("t", e)] = repeat_and_select_rdp(e, self._orders, self._neighboring)
            groups += [(("t", e), c) for e, c in self._tuned.items()]
        for key, c in groups:
            r = self._group_rdp[key]
            total += np.where(r == 0, 0.0, c * r)
        # Round the float sums up (each addition may round down by half an ulp).
        return np.nextafter(total * (1 + 4 * (len(groups) + 1) * np.finfo(float).eps), np.inf) if groups else total

    def get_epsilon_and_order(self, delta: float) -> Tuple[float, float]:
        """(ε, α) for target δ: the smallest ε over the grid and over the real orders between
        the best grid order's neighbours (CKS 2020 Prop. 12), and the order achieving it.
        ε = inf when no finite guarantee exists (e.g. δ = 0 or a non-private event)."""
        delta = check_delta(delta, allow_zero=True)
        p, w = self._groups()
        if any(c > 0 for c in self._discrete.values()) or self._tuned or self._allocation:
            # The continuous search between orders knows only the continuous analyses: with
            # discrete groups, tuning or random allocation, the minimum over the grid (still
            # an upper bound).
            return epsilon_from_rdp(self._orders, self.rdp, delta)
        eps, order, at_edge = _core.epsilon_composition(
            p, w, self._non_private, self._orders.tolist(), delta, self.rdp.tolist()
        )
        _warn_edge(at_edge, order, self._orders)
        return eps, order

    def get_epsilon(self, delta: float) -> float:
        """ε for target δ; see :meth:`get_epsilon_and_order`."""
        return self.get_epsilon_and_order(delta)[0]

    def get_delta_and_order(self, epsilon: float) -> Tuple[float, float]:
        """(δ, α) for target ε: log δ = (α − 1)(r − ε + log1p(−1/α)) − log α (CKS 2020 Prop. 12),
        together with the KL bound δ ≤ √(1 − e^{−r}), minimised like ε."""
        eps = check_epsilon(epsilon)
        p, w = self._groups()
        if any(c > 0 for c in self._discrete.values()) or self._tuned or self._allocation:
            return _delta_from_rdp_grid(self._orders, self.rdp, eps)
        d, order, at_edge = _core.delta_composition(p, w, self._non_private, self._orders.tolist(), eps, self.rdp.tolist())
        _warn_edge(at_edge, order, self._orders)
        return d, order

    def get_delta(self, epsilon: float) -> float:
        """δ for target ε; see :meth:`get_delta_and_order`."""
        return self.get_delta_and_order(epsilon)[0]


def epsilon(
    sampling_probability: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    orders: Optional[Sequence[float]] = None,
    *,
    accountant: str = "pld",
) -> float:
    """ε after ``steps`` Poisson-subsampled Gaussian steps, for target δ, under ``accountant``.

    ``"pld"`` (default): the certified upper bound of :class:`dpcore.accounting.PldAccountant`
    (Doroshenko et al. 2022, connect the dots; FFT composition). ``"rdp"``: RDP by Mironov, Talwar, Zhang 2019 §3 (exact sums / quadrature), composed over steps
    (Mironov 2017 Prop. 1), converted with CKS 2020 Prop. 12 over ``orders`` (default
    :data:`DEFAULT_ORDERS`) and continuously between them.

    No step, ``sampling_probability = 0`` or ``noise_multiplier = inf`` give ε = 0 under every
    accountant; ``noise_multiplier = 0`` with q > 0 gives ε = inf.
    """
    q, z = _step_params(sampling_probability, noise_multiplier)
    s = _count("steps", steps)
    d = check_delta(delta, allow_zero=accountant == "rdp")
    check_accountant(accountant)
    if accountant == "pld" and orders is not None:
        raise ValueError("orders are an RDP setting; pass accountant='rdp' to use them")
    o = None if accountant == "pld" else check_orders(orders)
    # No step, an empty sample (q = 0) or infinite noise releases nothing about any record:
    # ε = 0 under every accountant (as PldAccountant and RdpAccountant compose such events).
    if s == 0 or q == 0 or math.isinf(z):
        return 0.0
    if accountant == "pld":
        return _core.pld_epsilon_bounds([(q, z, float(s))], d, None, False)[1]
    eps, order, at_edge = _core.epsilon_composition([(q, z, float(s))], [], False, o.tolist(), d)
    _warn_edge(at_edge, order, o)
    return eps


def _delta_from_rdp_grid(orders: np.ndarray, rdp: np.ndarray, eps: float) -> Tuple[float, float]:
    """(δ, α) from RDP on a grid: min over α of exp((α − 1)(r − ε + log1p(−1/α)) − log α)
    (CKS 2020, Prop. 12), capped at 1."""
    best, order = 1.0, float(orders[0])
    for a, r in zip(orders.tolist(), rdp.tolist()):
        if not math.isfinite(r):
            continue
        log_d = (a - 1) * (r - eps + math.log1p(-1 / a)) - math.log(a)
        d = math.exp(min(log_d, 0.0))
        if d < best:
            best, order = d, a
    return best, order


def epsilon_from_rdp(orders: Sequence[float], rdp: Sequence[float], delta: float) -> Tuple[float, float]:
    """(ε, α) from RDP values on a grid alone (no continuous search): min over the grid of
    r + log1p(−1/α) − (log δ + log α)/(α − 1) (CKS 2020 Prop. 12) and the KL bound."""
    o = np.asarray(orders, dtype=np.float64).ravel()
    r = np.asarray(rdp, dtype=np.float64).ravel()
    if o.shape != r.shape:
        raise ValueError("orders and rdp must have the same length")
    if o.size == 0 or np.isnan(o).any() or not (o > 1).all():
        raise ValueError("orders must all be > 1")
    d = check_delta(delta, allow_zero=True)
    return _core.epsilon_from_rdp(o.tolist(), r.tolist(), d)
