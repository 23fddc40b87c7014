"""Privacy loss distribution (PLD) accountant: the tightest certified ε; concern (c) of
McMahan et al. 2018.

The math runs in Rust (``rust/accounting/pld``):

* PLD of the Poisson-subsampled Gaussian in both directions of the add-or-remove relation
  (Zhu, Dong, Wang 2022, arXiv:2106.08567, Proposition 30); ε is the worse of the two.
* Pessimistic discretisation by "connect the dots" (Doroshenko, Ghazi, Kamath, Kumar,
  Manurangsi 2022, arXiv:2207.04380, Algorithm 1): every ε printed is an upper bound. The
  lower bound of :meth:`PldAccountant.get_epsilon_bounds` comes from its mirror image, a PLD
  whose privacy curve lies below the true one at every ε (the grid values lowered by the
  chords' largest gap, then their lower convex hull), recomputed on finer grids while it is
  more than 1% below the upper bound.
* Truncated Poisson sampling (:class:`~dpcore.events.TruncatedPoissonSampledEvent`: a Poisson
  sample capped at B records, the analysis of dp_accounting's
  ``TruncatedSubsampledGaussianDpEvent``, arXiv:2508.15089): each step is dominated by the
  mixture, with weights 1 − w and w, w = P[Bin(m, q) ≥ B] for the m records besides the one
  protected, of the Poisson-subsampled Gaussian pair (q, z) and the one at the conditional
  rate q' = P[Bin(m + 1, q) > B]·B/((m + 1)·w) with noise z/2 (when the cap is hit, the record
  replaces one: sensitivity 2). It is taken in the add-or-remove form (dp_accounting takes the
  replace-one form of the second pair, looser), for both m = n − 1 and m = n (the record in
  the data set of n, or added to it), with binomial tails in log space and the weight whose
  attribution is uncertain (which m, rounding) on the upper envelope of the two pairs' privacy
  curves, which dominates both. The lower bound is the Poisson pair at the
  rate at which the record is in the batch (a data set of zeros and the record). Full
  reasoning: ``rust/accounting/pld/truncated.rs``.
* Composition by FFT (Koskela, Jälkö, Honkela 2020, arXiv:1906.03049), T identical steps as a
  T-th power of the transform; mass cut from the window is bounded by Chernoff and moved to
  the +∞ atom. The transform's floating-point rounding is bounded (Higham 2002, Theorem 24.2,
  carried through the powers and products) and added to every atom, so that ε is an upper bound
  rounding included; the composition runs under an exponential tilt centred on the ε sought
  (the rounding then a relative error of the tail δ sums), split by the number of large losses
  where one tilt cannot serve both a narrow bulk and rare large losses (``rust/accounting/pld/
  compose.rs``, ``mod.rs``).
* ε(δ), δ(ε) from the hockey-stick divergence (Sommer, Meiser, Mohammadi 2019, Theorem 1).
* Without subsampling the composition is one Gaussian mechanism, and ε comes from the analytic
  formula (Balle & Wang 2018, arXiv:1805.06530, Theorem 8).
* Mixture-of-Gaussians steps (:class:`~dpcore.events.MixtureOfGaussiansEvent`: the pair
  P = Σ_k p_k·N(s_k, z²) against Q = N(0, z²) in both directions, Ganesh 2024, arXiv:2401.10294;
  the step of example-level sampling with a user-level guarantee, Charles et al. 2024,
  arXiv:2407.07737) are discretised by the same connect-the-dots construction and composed by
  FFT in numpy (:mod:`dpcore.accounting._mixture_pld`), together with every Poisson and Gaussian
  step composed beside them (each a mixture: (0, 1) with (1 − q, q)). A mixture that is a
  Poisson-subsampled Gaussian (two sensitivities, one of them 0) goes to the core as one, so its
  ε is the example-level one exactly. Truncated Poisson steps do not compose with mixtures here
  (refused).

Not supported, with a clear error: fixed-size sampling without replacement. The PLD of its
worst-case pair is not known to be sound under composition (Lebeda, Regehr, Kamath, Steinke
2024, arXiv:2405.20769), so it stays with :class:`~dpcore.accounting.RdpAccountant`
(``neighboring="replace_one"``, Wang, Balle, Kasiviswanathan 2019). Likewise Poisson and
truncated Poisson sampling under replace-one, which no accountant here analyses.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

from .. import _core
from ..events import ComposedEvent, Event, DiscreteGaussianEvent, GaussianEvent, NonPrivateEvent
from ..events import PoissonSampledEvent, SampledWithoutReplacementEvent, SelfComposedEvent, TruncatedPoissonSampledEvent
from ..events import RepeatAndSelectEvent
from ..events import BallsInBinsSampledEvent, MixtureOfGaussiansEvent, RandomAllocationSampledEvent
from ._params import check_delta, check_epsilon, gaussian_noise_multiplier
from .base import PrivacyAccountant, UnsupportedEventError, register_accountant


def _interval(v: Optional[float]) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"value_discretization_interval must be a number or None, got {type(v).__name__}")
    v = float(v)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"value_discretization_interval must be > 0, got {v}")
    return v


#: A mixture-of-Gaussians step as the accountant keys it: (z, sensitivities, weights), the
#: sensitivities distinct and increasing, the weights > 0 and summing to 1, some s > 0.
_Mixture = Tuple[float, Tuple[float, ...], Tuple[float, ...]]


class _Tally:
    """What composing an event adds to a :class:`PldAccountant`: step counts by group."""

    __slots__ = ("groups", "truncated", "mixtures", "non_private")

    def __init__(self) -> None:
        self.groups: Dict[Tuple[float, float], int] = {}
        self.truncated: Dict[Tuple[float, float, int, int], int] = {}
        self.mixtures: Dict[_Mixture, int] = {}
        self.non_private = False


def _down(x: float, ulps: int = 2) -> float:
    for _ in range(ulps):
        x = math.nextafter(x, 0.0)
    return x


@register_accountant("pld")
class PldAccountant(PrivacyAccountant):
    """PLD accountant (see the module docstring for the papers and equations).

    ``neighboring``: ``"add_or_remove"`` (Poisson-sampled and plain Gaussian steps) or
    ``"replace_one"`` (plain Gaussian steps only, the noise multiplier relative to the
    replace-one sensitivity, as in :class:`RdpAccountant`). ``value_discretization_interval``:
    the loss grid step Δ; None chooses it (1e-4, finer for small compositions, coarser where the
    grid would exceed 2²¹ atoms; at that cap ε stays an upper bound, only less tight).
    Identical steps are grouped: 10⁶ steps of a few distinct (q, z) cost one FFT power each.
    """

    def __init__(self, neighboring: str = "add_or_remove", value_discretization_interval: Optional[float] = None) -> None:
        super().__init__(neighboring)
        self._interval = _interval(value_discretization_interval)
        self._groups: Dict[Tuple[float, float], int] = {}
        # Truncated-Poisson steps by (q, z, max_batch_size, population_size).
        self._truncated: Dict[Tuple[float, float, int, int], int] = {}
        # Mixture-of-Gaussians steps by (z, sensitivities, weights).
        self._mixtures: Dict[_Mixture, int] = {}
        self._non_private = False

    @property
    def value_discretization_interval(self) -> Optional[float]:
        return self._interval

    # -- events ---------------------------------------------------------------------------

    def _tally(self, event: Event, count: int) -> _Tally:
        t = _Tally()
        self._walk(event, count, t, 0)
        if (t.mixtures or self._mixtures) and (t.truncated or self._truncated):
            raise UnsupportedEventError(
                "PldAccountant cannot compose truncated-Poisson steps with mixture-of-Gaussians steps (example-level "
                "sampling with a user-level guarantee): the mixtures are composed in numpy, the truncated-Poisson "
                "analysis only in the core; account them in separate runs"
            )
        return t

    def _record(self, t: _Tally) -> None:
        for k, c in t.groups.items():
            self._groups[k] = self._groups.get(k, 0) + c
        for k, c in t.truncated.items():
            self._truncated[k] = self._truncated.get(k, 0) + c
        for k, c in t.mixtures.items():
            self._mixtures[k] = self._mixtures.get(k, 0) + c
        self._non_private |= t.non_private

    def _walk(self, e: Event, count: int, t: _Tally, depth: int) -> None:
        """Tallies ``count`` runs of ``e`` into ``t``; raises :class:`UnsupportedEventError`
        naming the event and an accountant that can analyse it. Events run 0 times are still
        checked, so that what this accountant accepts does not depend on the counts."""
        if depth > 1000:
            raise UnsupportedEventError("event nests too deeply")
        if isinstance(e, SelfComposedEvent):
            self._walk(e.event, count * e.count, t, depth + 1)
        elif isinstance(e, ComposedEvent):
            tally: Dict[Event, int] = {}
            for sub in e.events:
                tally[sub] = tally.get(sub, 0) + 1
            for sub, c in tally.items():
                self._walk(sub, count * c, t, depth + 1)
        elif isinstance(e, NonPrivateEvent):
            t.non_private |= count > 0
        elif isinstance(e, GaussianEvent):
            if count:
                key = (1.0, e.noise_multiplier)
                t.groups[key] = t.groups.get(key, 0) + count
        elif isinstance(e, (RandomAllocationSampledEvent, BallsInBinsSampledEvent)):
            raise UnsupportedEventError(
                f"PldAccountant cannot analyse {type(e).__name__}: no certified PLD analysis of random allocation "
                "(balls-in-bins) is implemented; use RdpAccountant (neighboring='add_or_remove'), which bounds its "
                "Renyi DP (dpcore.accounting.allocation)"
            )
        elif isinstance(e, RepeatAndSelectEvent):
            raise UnsupportedEventError(
                f"PldAccountant cannot analyse {type(e).__name__} (hyperparameter tuning: the best of a random number "
                "of runs): its analysis (Papernot & Steinke 2022) is a Rényi DP bound; use RdpAccountant"
            )
        elif isinstance(e, DiscreteGaussianEvent) or isinstance(getattr(e, "event", None), DiscreteGaussianEvent):
            raise UnsupportedEventError(
                "PldAccountant cannot analyse the discrete Gaussian mechanism: its privacy loss distribution is not "
                "the continuous Gaussian's, and only its Rényi bound is established (Canonne, Kamath & Steinke 2020, "
                "Theorem 14); use RdpAccountant"
            )
        elif isinstance(e, SampledWithoutReplacementEvent):
            raise UnsupportedEventError(
                f"PldAccountant cannot analyse {e!r}: no PLD analysis of fixed-size sampling without replacement is "
                "known to be sound under composition; use RdpAccountant(neighboring='replace_one')"
            )
        elif isinstance(e, (PoissonSampledEvent, TruncatedPoissonSampledEvent)):
            self._walk_sampled(e, count, t)
        elif isinstance(e, MixtureOfGaussiansEvent):
            self._walk_mixture(e, count, t)
        else:
            raise UnsupportedEventError(f"PldAccountant cannot analyse {type(e).__name__}")

    def _walk_sampled(self, e: Any, count: int, t: _Tally) -> None:
        """A Poisson or truncated-Poisson step of Gaussians (or of a non-private release)."""
        outer = type(e).__name__
        truncated = isinstance(e, TruncatedPoissonSampledEvent)
        if isinstance(e.event, NonPrivateEvent):
            t.non_private |= count > 0 and e.sampling_probability > 0
            return
        z = gaussian_noise_multiplier(e.event)
        if z is None:
            raise UnsupportedEventError(f"PldAccountant: the event inside {outer} must be Gaussian, got {e.event!r}")
        # Poisson sampling at q = 1 takes every record: a plain Gaussian step, which replace-one
        # analyses too.
        if self.neighboring != "add_or_remove" and (truncated or e.sampling_probability < 1.0):
            what = "truncated Poisson sampling is" if truncated else "Poisson sampling is"
            who = "PldAccountant()" if truncated else "PldAccountant() or RdpAccountant()"
            raise UnsupportedEventError(
                f"PldAccountant cannot analyse {e!r} under neighboring='replace_one': {what} analysed under "
                f"'add_or_remove' ({who})"
            )
        if count == 0 or math.isinf(z):
            return
        if truncated:
            key = (e.sampling_probability, z, e.max_batch_size, e.population_size)
            t.truncated[key] = t.truncated.get(key, 0) + count
        else:
            t.groups[(e.sampling_probability, z)] = t.groups.get((e.sampling_probability, z), 0) + count

    def _walk_mixture(self, e: MixtureOfGaussiansEvent, count: int, t: _Tally) -> None:
        """A mixture-of-Gaussians step: its components merged by sensitivity (zero weights
        dropped, weights divided by their sum); a Poisson-subsampled or plain Gaussian in
        disguise goes to the core's groups (z/s rounded down: a smaller z never understates ε)."""
        if self.neighboring != "add_or_remove":
            raise UnsupportedEventError(
                f"PldAccountant cannot analyse {type(e).__name__} under neighboring={self.neighboring!r}: the "
                "mixture-of-Gaussians pair is analysed under 'add_or_remove' (PldAccountant())"
            )
        merged: Dict[float, float] = {}
        for sv, pv in zip(e.sensitivities, e.probabilities):
            if pv > 0:
                merged[sv] = merged.get(sv, 0.0) + pv
        total = math.fsum(merged.values())
        sens = tuple(sorted(merged))
        if not any(sv > 0 for sv in sens) or count == 0:
            return  # nothing of the record is ever released
        z = e.noise_multiplier
        if z == 0:
            t.non_private = True
            return
        if math.isinf(z):
            return
        weights = tuple(merged[sv] / total for sv in sens)
        positive = [sv for sv in sens if sv > 0]
        if len(positive) == 1:  # the Poisson-subsampled Gaussian (q = 1: the Gaussian) of noise z/s
            sv = positive[0]
            q = weights[-1]
            zs = z if sv == 1.0 else _down(z / sv)
            key = (1.0 if len(sens) == 1 else q, zs)
            t.groups[key] = t.groups.get(key, 0) + count
            return
        key3 = (z, sens, weights)
        t.mixtures[key3] = t.mixtures.get(key3, 0) + count

    def _kinds(self) -> list:
        """Every step as a mixture (the numpy path, :mod:`._mixture_pld`): Poisson groups as
        (0, 1) with (1 − q, q); the unsampled Gaussians merged into one (1/z² adds up; rounded
        down)."""
        from ._mixture_pld import Kind

        kinds = [Kind(z, s, w, c) for (z, s, w), c in self._mixtures.items() if c > 0]
        inv = 0.0
        for (q, z), c in self._groups.items():
            if c == 0 or q == 0 or math.isinf(z):
                continue
            if q == 1.0:
                inv += c / (z * z)
            else:
                kinds.append(Kind(z, (0.0, 1.0), (1.0 - q, q), c))
        if inv > 0:
            kinds.append(Kind(_down(1.0 / math.sqrt(inv), 4), (1.0,), (1.0,), 1))
        return kinds

    def _numpy_non_private(self) -> bool:
        """A Gaussian step without noise on a sample that can hold the record (the core's rule)."""
        return any(c > 0 and q > 0 and z == 0 for (q, z), c in self._groups.items())

    def _g(self):
        return [(q, z, float(c)) for (q, z), c in self._groups.items() if c > 0]

    def _t(self):
        return [(q, z, b, n, float(c)) for (q, z, b, n), c in self._truncated.items() if c > 0]

    # -- results ----------------------------------------------------------------------------

    def get_epsilon_bounds(self, delta: float) -> Tuple[float, float]:
        """(lower, upper): the true ε at ``delta`` lies between them. ``upper`` is certified
        (connect the dots) and is :meth:`get_epsilon`'s value; ``lower`` composes PLDs whose
        curves lie below the true ones (for truncated Poisson steps: the ε of a data set whose
        record is in the batch at the mechanism's rate, a lower bound on the worst case)."""
        d = check_delta(delta)
        if self._non_private:
            return math.inf, math.inf
        if self._mixtures:
            return self._mixture_epsilon(d, True)
        lo, up, _ = _core.pld_epsilon_bounds(self._g(), d, self._interval, True, self._t())
        return lo, up

    def get_epsilon(self, delta: float) -> float:
        """The smallest ε certified at ``delta`` (the upper bound)."""
        d = check_delta(delta)
        if self._non_private:
            return math.inf
        if self._mixtures:
            return self._mixture_epsilon(d, False)[1]
        return _core.pld_epsilon_bounds(self._g(), d, self._interval, False, self._t())[1]

    def get_delta_bounds(self, epsilon: float) -> Tuple[float, float]:
        """(lower, upper) bounds on the smallest δ at ``epsilon``."""
        e = check_epsilon(epsilon)
        if self._non_private:
            return 1.0, 1.0
        if math.isinf(e):
            return 0.0, 0.0
        if self._mixtures:
            return self._mixture_delta(e, True)
        lo, up, _ = _core.pld_delta_bounds(self._g(), e, self._interval, True, self._t())
        return lo, up

    def get_delta(self, epsilon: float) -> float:
        """The smallest δ certified at ``epsilon`` (the upper bound)."""
        e = check_epsilon(epsilon)
        if self._non_private:
            return 1.0
        if math.isinf(e):
            return 0.0
        if self._mixtures:
            return self._mixture_delta(e, False)[1]
        return _core.pld_delta_bounds(self._g(), e, self._interval, False, self._t())[1]

    def _mixture_epsilon(self, delta: float, lower: bool) -> Tuple[float, float]:
        from . import _mixture_pld

        if self._numpy_non_private():
            return math.inf, math.inf
        return _mixture_pld.epsilon_bounds(self._kinds(), delta, self._interval, lower)

    def _mixture_delta(self, epsilon: float, lower: bool) -> Tuple[float, float]:
        from . import _mixture_pld

        if self._numpy_non_private():
            return 1.0, 1.0
        return _mixture_pld.delta_bounds(self._kinds(), epsilon, self._interval, lower)
