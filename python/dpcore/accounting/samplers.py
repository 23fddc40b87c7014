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
from typing import Any, Callable, Optional

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


def calibrate_noise_for(
    event_at: Callable[[float], Event],
    target_epsilon: float,
    target_delta: float,
    accountant: str,
    *,
    start: Optional[float] = None,
    rel: float = 1e-5,
) -> float:
    """The smallest noise multiplier z, to ``rel`` relative and from above, such that the event
    ``event_at(z)`` is (``target_epsilon``, ``target_delta``)-DP under ``accountant``; ε must
    fall as z grows (true of every sampled Gaussian here).

    From ``start`` (e.g. the Poisson calibration at the same rate: cheap and close) the search
    brackets the boundary between a z that misses the target and one that meets it, then
    narrows the bracket by the Illinois variant of regula falsi on (log z, log ε) until its ends
    are within ``rel``; the upper end is returned. Only a z whose ε was evaluated and met the
    target is returned. A ledger recovers z from the recorded (C, z·C) by Eq. (1) of McMahan et
    al. 2018 rounded down by a few ulps (:func:`dpcore.events.effective_noise_multiplier`), and
    the ε it then reports must meet the target too: each z is evaluated 1e-12 lower than itself,
    against the target lowered by 1e-9 relative (a PLD ε is not exactly monotone in z: its
    discretisation moves it by ~1e-11 relative between neighbouring floats)."""
    e = _real("target_epsilon", target_epsilon)
    if not (e > 0 and math.isfinite(e)):
        raise ValueError(f"target_epsilon must be finite and > 0, got {e}")
    d = check_delta(target_delta)
    check_accountant(accountant)
    log_e = math.log(e) + math.log1p(-1e-9)

    def f(lz: float) -> float:
        """log ε − log target at z = exp(lz): > 0 misses the target, ≤ 0 meets it (NaN misses)."""
        eps = make_accountant(accountant).compose(event_at(math.exp(lz) * (1.0 - 1e-12))).get_epsilon(d)
        return math.inf if not eps <= math.inf else (math.log(eps) - log_e if eps > 0 else -math.inf)

    lz, step = math.log(max(start if start and math.isfinite(start) else 1.0, 1e-3)), 0.1
    fz = f(lz)
    if fz > 0:  # misses: step up until it meets
        bad, fb = lz, fz
        while True:
            good = bad + step
            fg = f(good)
            if fg <= 0:
                break
            bad, fb, step = good, fg, 2 * step
            if good > math.log(1e6):
                raise ValueError(f"no noise multiplier up to 1e6 reaches ε = {e:g} at δ = {d:g}")
    else:  # meets: step down until it misses
        good, fg = lz, fz
        while True:
            bad = good - step
            fb = f(bad)
            if fb > 0:
                break
            good, fg, step = bad, fb, 2 * step
            if bad < math.log(1e-6):
                return math.exp(good)
    side = 0
    while good - bad > math.log1p(rel):
        x = 0.5 * (bad + good)
        if math.isfinite(fb) and math.isfinite(fg) and fb != fg:
            w = good - bad  # the secant's point, kept 1e-3·w inside the bracket
            x = min(max((bad * fg - good * fb) / (fg - fb), bad + 1e-3 * w), good - 1e-3 * w)
        fx = f(x)
        if fx > 0:
            bad, fb = x, fx
            if side == -1:
                fg *= 0.5
            side = -1
        else:
            good, fg = x, fx
            if side == 1:
                fb *= 0.5
            side = 1
    return math.exp(good)


def poisson_start(target_epsilon: float, target_delta: float, sampling_probability: float, steps: int) -> Optional[float]:
    """The RDP calibration of Poisson sampling at the same rate (in the core, cheap): where the
    other samplers' searches start."""
    from .calibration import calibrate_noise_multiplier

    try:
        return calibrate_noise_multiplier(target_epsilon, target_delta, sampling_probability, steps, accountant="rdp")
    except (ValueError, RuntimeError):
        return None


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
    """Smallest noise multiplier z (to ``rel`` relative, from above) such that
    :func:`sampler_epsilon` ≤ ``target_epsilon`` (:func:`calibrate_noise_for`)."""
    acct = default_accountant(sampler, accountant)
    kw = dict(
        sampling_probability=sampling_probability, population_size=population_size,
        max_batch_size=max_batch_size, num_selected=num_selected,
    )
    sampler_event(sampler, 1.0, steps, **kw)  # validates everything before the search
    if _count("steps", steps) == 0:
        return 0.0
    start = poisson_start(target_epsilon, target_delta, sampling_probability, steps)
    return calibrate_noise_for(
        lambda z: sampler_event(sampler, z, steps, **kw), target_epsilon, target_delta, acct, start=start, rel=rel
    )


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
