"""ε and calibration for the sampler a run actually uses; concern (c) of McMahan et al. 2018.

Amplification by sampling is a property of the sampler, not of the batch size: accounting a
shuffled or capped run as if it were Poisson sampled misstates its privacy (Chua et al. 2024,
"How Private are DP-SGD Implementations?", arXiv 2403.17673; an audit measured the gap at up
to 4×). Each sampler here is accounted by its own event and the analysis that fits it:

=====================  ==========================================  ======================  ==========
``sampler``            what a step uses                            event (per ...)         accountant
=====================  ==========================================  ======================  ==========
``poisson``            each record with probability q              PoissonSampledEvent     PLD
                                                                   (step)
``truncated_poisson``  Poisson, capped at ``max_batch_size`` B     TruncatedPoisson-       PLD
                       records (a random B of them when more)      SampledEvent (step)
``balls_in_bins``      each record in one of the epoch's b = 1/q   BallsInBinsSampled-     RDP
                       batches, uniformly                          Event (epoch)
``random_allocation``  each record in k of every t = k/q steps,    RandomAllocation-       RDP
                       uniformly                                   SampledEvent (round)
``shuffle``            a shuffled epoch cut into batches           GaussianEvent (step):   PLD
                                                                   no amplification
=====================  ==========================================  ======================  ==========

* Truncated Poisson: the PLD of dp_accounting 0.6 (a mixture of the Poisson-subsampled
  Gaussian and, with the probability that the cap binds, a replace-one one; arXiv 2508.15089),
  implemented in :class:`~dpcore.accounting.PldAccountant`.
* Balls-in-bins (Chua et al. 2025, arXiv 2412.16802) is random allocation of 1 step out of b
  (Feldman & Shenfeld 2025, arXiv 2502.08202); both are accounted by the certified Rényi bound
  of :mod:`dpcore.accounting.allocation` (no certified PLD of them is implemented: Chua et al.
  give only Monte Carlo estimates, which are not upper bounds). A round cut short is counted
  as a whole round.
* Shuffling gets no amplification: a shuffled epoch is not a random sample, and its known
  analyses are either loose or not certified (McMahan et al. 2018, §5; Chua et al. 2024).

``accountant=None`` picks the tightest certified accountant for the sampler (the last column).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ..events import (
    BallsInBinsSampledEvent,
    Event,
    GaussianEvent,
    PoissonSampledEvent,
    RandomAllocationSampledEvent,
    SelfComposedEvent,
    TruncatedPoissonSampledEvent,
)
from .._validate import count as _count, probability, real as _real
from .base import check_accountant, check_delta, make_accountant

#: The samplers accounted here, by the name every ``sampler=`` argument takes.
SAMPLERS = ("poisson", "truncated_poisson", "balls_in_bins", "random_allocation", "shuffle")
#: The tightest certified accountant of each sampler.
DEFAULT_ACCOUNTANTS = {
    "poisson": "pld",
    "truncated_poisson": "pld",
    "balls_in_bins": "rdp",
    "random_allocation": "rdp",
    "shuffle": "pld",
}
#: What each sampler guarantees, in a sentence (the report and the README use these).
GUARANTEES = {
    "poisson": "amplification by Poisson subsampling at rate q (PLD, tight)",
    "truncated_poisson": "Poisson amplification, slightly weakened where the cap binds (PLD)",
    "balls_in_bins": "amplification close to Poisson at q = 1/b, certified by a Rényi bound",
    "random_allocation": "amplification close to Poisson at q = k/t, certified by a Rényi bound",
    "shuffle": "none: every step is a full Gaussian query on the data set",
}


def check_sampler(sampler: Any) -> str:
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
    return sampler


def default_accountant(sampler: str, accountant: Optional[str] = None) -> str:
    """``accountant`` if given (checked), else the tightest certified one for ``sampler``."""
    check_sampler(sampler)
    if accountant is None:
        return DEFAULT_ACCOUNTANTS[sampler]
    return check_accountant(accountant)


def steps_per_round(sampler: str, sampling_probability: float, num_selected: int = 1) -> int:
    """The steps of one round of an allocation sampler: b = 1/q batches of a balls-in-bins
    epoch, t = k/q steps of a random-allocation round. ValueError when that is not a whole
    number (to 1e-9): the rate of these samplers is k/t exactly."""
    q = probability("sampling_probability", sampling_probability)
    k = _count("num_selected", num_selected, 1)
    if sampler == "balls_in_bins" and k != 1:
        raise ValueError("balls_in_bins puts every record in one batch per epoch: num_selected must be 1")
    if not q > 0:
        raise ValueError(f"sampling_probability must be > 0 for {sampler}, got {q}")
    t = round(k / q)
    if t < k or abs(t * q - k) > 1e-9 * k:
        raise ValueError(
            f"{sampler}: sampling_probability must be num_selected/steps_per_round exactly "
            f"(got q = {q!r}, num_selected = {k}: k/q = {k / q!r} is not a whole number of steps)"
        )
    return t


def sampler_event(
    sampler: str,
    noise_multiplier: float,
    steps: int,
    *,
    sampling_probability: float,
    population_size: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    num_selected: int = 1,
) -> Event:
    """The accountant event of ``steps`` steps of ``sampler`` with the Gaussian mechanism at
    ``noise_multiplier`` (see the module's table). ``population_size`` and ``max_batch_size``
    are required by (and only by) ``truncated_poisson``; ``num_selected`` is the k of
    ``random_allocation``. Allocation samplers are counted in whole rounds: ⌈steps/t⌉."""
    check_sampler(sampler)
    z = _real("noise_multiplier", noise_multiplier)
    if not z >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {z}")
    s = _count("steps", steps)
    q = probability("sampling_probability", sampling_probability)
    if sampler == "truncated_poisson":
        if population_size is None or max_batch_size is None:
            raise ValueError("truncated_poisson needs population_size and max_batch_size")
    elif max_batch_size is not None:
        raise ValueError(f"max_batch_size is the cap of truncated_poisson; {sampler} has none")
    if sampler != "random_allocation" and num_selected != 1:
        raise ValueError(f"num_selected is the k of random_allocation; {sampler} takes none")
    g = GaussianEvent(z)
    if sampler == "poisson":
        return SelfComposedEvent(PoissonSampledEvent(q, g), s)
    if sampler == "truncated_poisson":
        return SelfComposedEvent(TruncatedPoissonSampledEvent(q, max_batch_size, population_size, g), s)
    if sampler == "shuffle":
        return SelfComposedEvent(g, s)
    t = steps_per_round(sampler, q, num_selected)
    rounds = -(-s // t)
    if sampler == "balls_in_bins":
        return SelfComposedEvent(BallsInBinsSampledEvent(t, g), rounds)
    return SelfComposedEvent(RandomAllocationSampledEvent(t, num_selected, g), rounds)


def sampler_epsilon(
    sampler: str,
    noise_multiplier: float,
    steps: int,
    delta: float,
    *,
    sampling_probability: float,
    population_size: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    num_selected: int = 1,
    accountant: Optional[str] = None,
) -> float:
    """ε at ``delta`` of ``steps`` steps of ``sampler`` (:func:`sampler_event`), under
    ``accountant`` (None: the tightest certified one for the sampler)."""
    acct = default_accountant(sampler, accountant)
    d = check_delta(delta)
    ev = sampler_event(
        sampler, noise_multiplier, steps, sampling_probability=sampling_probability,
        population_size=population_size, max_batch_size=max_batch_size, num_selected=num_selected,
    )
    return make_accountant(acct).compose(ev).get_epsilon(d)


def calibrate_sampler_noise(
    target_epsilon: float,
    target_delta: float,
    sampler: str,
    steps: int,
    *,
    sampling_probability: float,
    population_size: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    num_selected: int = 1,
    accountant: Optional[str] = None,
    rel: float = 1e-5,
) -> float:
    """Smallest noise multiplier z (to ``rel`` relative, on the safe side) such that
    :func:`sampler_epsilon` ≤ ``target_epsilon``. ε falls as z grows for every sampler here,
    so a bisection on log z finds the boundary; the returned z is verified to meet the target."""
    e = _real("target_epsilon", target_epsilon)
    if not e > 0:
        raise ValueError(f"target_epsilon must be > 0, got {e}")
    d = check_delta(target_delta)
    acct = default_accountant(sampler, accountant)
    kw = dict(
        sampling_probability=sampling_probability, population_size=population_size,
        max_batch_size=max_batch_size, num_selected=num_selected,
    )
    sampler_event(sampler, 1.0, steps, **kw)  # validates everything before the search

    def eps(z: float) -> float:
        return make_accountant(acct).compose(sampler_event(sampler, z, steps, **kw)).get_epsilon(d)

    if _count("steps", steps) == 0:
        return 0.0
    hi = 1.0
    while eps(hi) > e:
        hi *= 2.0
        if hi > 1e8:
            raise ValueError(f"no noise multiplier up to 1e8 reaches ε = {e:g} at δ = {d:g}")
    lo = hi / 2.0
    while eps(lo) <= e:
        hi, lo = lo, lo / 2.0
        if lo < 1e-8:
            return hi
    # ε(lo) > e ≥ ε(hi): bisect on log z, keeping hi on the safe side.
    while hi / lo - 1.0 > rel:
        mid = math.sqrt(lo * hi)
        if eps(mid) <= e:
            hi = mid
        else:
            lo = mid
    return hi


def calibrate_sampler_steps(
    target_epsilon: float,
    target_delta: float,
    sampler: str,
    noise_multiplier: float,
    *,
    sampling_probability: float,
    population_size: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    num_selected: int = 1,
    accountant: Optional[str] = None,
    max_steps: int = 1 << 40,
) -> int:
    """Largest number of steps (0 if none fits) with :func:`sampler_epsilon` ≤
    ``target_epsilon``. For the allocation samplers the answer is a whole number of rounds
    (their ε is that of whole rounds)."""
    e = _real("target_epsilon", target_epsilon)
    if not e > 0:
        raise ValueError(f"target_epsilon must be > 0, got {e}")
    d = check_delta(target_delta)
    acct = default_accountant(sampler, accountant)
    kw = dict(
        sampling_probability=sampling_probability, population_size=population_size,
        max_batch_size=max_batch_size, num_selected=num_selected,
    )
    sampler_event(sampler, noise_multiplier, 1, **kw)
    unit = steps_per_round(sampler, sampling_probability, num_selected) if sampler in ("balls_in_bins", "random_allocation") else 1

    def ok(units: int) -> bool:
        ev = sampler_event(sampler, noise_multiplier, units * unit, **kw)
        return make_accountant(acct).compose(ev).get_epsilon(d) <= e

    if not ok(1):
        return 0
    good, bad = 1, 2
    cap = max(1, max_steps // unit)
    while ok(bad):
        good = bad
        if bad >= cap:
            return cap * unit
        bad = min(bad * 2, cap)
    while bad - good > 1:
        mid = good + (bad - good) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good * unit
