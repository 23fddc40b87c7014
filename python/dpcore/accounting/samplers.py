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
``shuffle``            a fresh permutation every epoch, cut into   GaussianEvent (epoch    PLD
                       batches of b (the last one short)           or step, by relation)
``sequential``         the records in a fixed order, cut into      GaussianEvent (epoch    PLD
                       batches of b (a DataLoader without          or step, by relation)
                       shuffle)
``cyclic``             one permutation cut once into ⌊n/b⌋ fixed   GaussianEvent (per      PLD
                       batches (the rest dropped), batch t mod     participation)
                       ⌊n/b⌋ at step t
=====================  ==========================================  ======================  ==========

* Truncated Poisson: a mixture of the Poisson-subsampled Gaussian and, with the probability
  that the cap binds, a second pair, taken in its add-or-remove form (dp_accounting 0.6 takes the
  replace-one form, looser; the add-or-remove pair was checked valid by exhaustive enumeration of
  small cases: ``rust/accounting/pld/truncated.rs``; arXiv 2508.15089), implemented in
  :class:`~dpcore.accounting.PldAccountant`.
* Balls-in-bins (Chua et al. 2025, arXiv 2412.16802) is random allocation of 1 step out of b
  (Feldman & Shenfeld 2025, arXiv 2502.08202); both are accounted by the certified Rényi bound
  of :mod:`dpcore.accounting.allocation` (no certified PLD of them is implemented: Chua et al.
  give only Monte Carlo estimates, which are not upper bounds). A round cut short is counted
  as a whole round.
* Shuffled, fixed-order and fixed batches get no amplification by sampling (a shuffled epoch is
  not a random sample; McMahan et al. 2018, §5; Chua et al. 2024): each record is in one batch
  per epoch (per cycle of fixed batches), so the epoch is one Gaussian query of the record's
  sensitivity there, which depends on the neighbouring relation (below).

**Neighbouring relations** (:data:`NEIGHBORING`). ``add_or_remove``: the datasets differ by one
record, added or removed (n changes). ``zero_out``: one record is replaced by one that
contributes nothing (zero gradient); n is the same and public. ``replace_one``: one record is
replaced by any other. Every sampler states which it supports (:data:`RELATIONS`); asking for
another is refused with the reason. With clip norm C, noise z·C, k steps an epoch and E epochs
begun (P participations of fixed batches):

* ``shuffle``: zero-out, C once per epoch: E Gaussians of noise multiplier z. Add-or-remove:
  couple the two permutations by inserting the added record at a uniformly random position and
  moving the record it displaces to the short last batch: one batch changes by a swap (≤ 2C)
  and another by one record (≤ C), √5·C per epoch, E Gaussians of z/√5, when the loader
  reshuffles and k ≥ 5; otherwise every step is bounded by a swap, 2C: k·E Gaussians of z/2.
  Replace-one: 2C once per epoch, E Gaussians of z/2.
* ``sequential``: zero-out as shuffle. Add-or-remove: removing the first record shifts every
  later batch by one record, a swap per batch: every step a Gaussian of z/2. Replace-one as
  shuffle.
* ``cyclic``: zero-out, P Gaussians of z (C at each of the record's participations).
  Add-or-remove (the same coupling as shuffle; the displaced record goes to the dropped rest):
  one batch changes by a swap at each of its participations, P Gaussians of z/2. Replace-one
  likewise.
* Poisson, truncated Poisson and the allocation samplers: add-or-remove as in the table, and
  zero-out by the same events (a zero record contributes nothing wherever it is sampled; for
  truncated Poisson it still takes its place under the cap, so the record is in the batch with
  probability at most q: the Poisson-subsampled Gaussian). Replace-one is not analysed for them
  here (refused).

In the shuffled, fixed-order and fixed-batch statements the number of steps per epoch (⌈n/b⌉ or
⌊n/b⌋) is treated as public: it depends on n, which add-or-remove changes.
``accountant=None`` picks the tightest certified accountant for the sampler (the last column).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from ..events import (
    Event,
    GaussianEvent,
    SelfComposedEvent,
)
from .._validate import count as _count, real as _real
from .base import check_accountant, check_delta, make_accountant

from ..sampling import NEIGHBORING, registered_samplers, sampler_class, steps_per_round  # noqa: F401 (re-exported)


# The tables of earlier releases, now views of the sampler registry (:mod:`dpcore.sampling`):
# each sampler class declares its own relations, default relation, accountant and guarantee.
# Computed when read, so that a sampler registered later appears in them.
_TABLES = {
    "RELATIONS": "relations",
    "DEFAULT_RELATION": "default_relation",
    "DEFAULT_ACCOUNTANTS": "default_accountant",
    "GUARANTEES": "guarantee",
}


def __getattr__(name: str) -> Any:
    if name == "SAMPLERS":  # the samplers a front end's sampler= may name
        return registered_samplers(selectable=True)
    if name == "ACCOUNTED_SAMPLERS":  # every batch schedule a run can be planned and accounted with
        return registered_samplers(planned=True)
    if name in _TABLES:
        return {n: getattr(sampler_class(n), _TABLES[name]) for n in registered_samplers(planned=True)}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_sampler(sampler: Any) -> str:
    accounted = registered_samplers(planned=True)
    if sampler not in accounted:
        raise ValueError(f"sampler must be one of {', '.join(accounted)}; got {sampler!r}")
    return sampler


def check_relation(sampler: str, neighboring: Any) -> str:
    """``neighboring`` if ``sampler``'s guarantee holds under it; ValueError with the reason
    otherwise."""
    if neighboring not in NEIGHBORING:
        raise ValueError(f"neighboring must be one of {', '.join(NEIGHBORING)}, got {neighboring!r}")
    return sampler_class(check_sampler(sampler)).check_relation(neighboring)


def analysis_relation(neighboring: str) -> str:
    """The relation the accountants analyse an event of ``neighboring`` under: zero-out
    events are the add-or-remove pair's (a zeroed record contributes exactly what a removed
    one does), so they go to the accountants as ``add_or_remove``."""
    return "replace_one" if neighboring == "replace_one" else "add_or_remove"


def epoch_steps(sampler: str, sampling_probability: float, steps_per_epoch: Optional[int] = None) -> int:
    """k: the steps of one epoch of ``shuffle`` or ``sequential`` (⌈n/b⌉ = ⌈1/q⌉ by default)
    or of one cycle of ``cyclic`` fixed batches (⌊n/b⌋ = ⌊1/q⌋), or the given ``steps_per_epoch``."""
    return sampler_class(sampler).epoch_length(sampling_probability, steps_per_epoch=steps_per_epoch)


def epoch_event(sampler: str, noise_multiplier: float, steps: int, epochs: int, steps_in_epoch: int,
                neighboring: str) -> Event:
    """The event of ``steps`` released steps over ``epochs`` epochs begun (cycles, for
    ``cyclic``) of ``steps_in_epoch`` steps each, with Gaussian noise ``noise_multiplier``
    relative to the clip norm, under ``neighboring`` (the module docs give the bounds)."""
    check_relation(sampler, neighboring)
    if sampler == "cyclic":
        z = noise_multiplier
        return SelfComposedEvent(GaussianEvent(z if neighboring == "zero_out" else z / 2.0), epochs)
    return sampler_class(sampler)._epochs_event(noise_multiplier, steps, epochs, steps_in_epoch, neighboring)


def default_accountant(sampler: str, accountant: Optional[str] = None) -> str:
    """``accountant`` if given (checked), else the tightest certified one for ``sampler``."""
    check_sampler(sampler)
    if accountant is None:
        return sampler_class(sampler).default_accountant
    return check_accountant(accountant)





def sampler_event(
    sampler: str,
    noise_multiplier: float,
    steps: int,
    *,
    sampling_probability: float,
    population_size: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    num_selected: int = 1,
    neighboring: Optional[str] = None,
    steps_per_epoch: Optional[int] = None,
) -> Event:
    """The accountant event of ``steps`` steps of ``sampler`` with the Gaussian mechanism at
    ``noise_multiplier`` (see the module's table), under ``neighboring`` (None: the sampler's
    :data:`DEFAULT_RELATION`). ``population_size`` and ``max_batch_size`` are required by (and
    only by) ``truncated_poisson``; ``num_selected`` is the k of ``random_allocation``.
    Allocation samplers are counted in whole rounds: ⌈steps/t⌉; shuffled and fixed-order
    loaders in epochs begun, ⌈steps/k⌉ with k = ``steps_per_epoch`` (default ⌈1/q⌉), fixed
    batches in participations, ⌈steps/k⌉ with k = ⌊1/q⌋ batches."""
    cls = sampler_class(check_sampler(sampler))
    return cls.event(
        noise_multiplier, steps, sampling_probability=sampling_probability, population_size=population_size,
        neighboring=neighboring, steps_per_epoch=steps_per_epoch, max_batch_size=max_batch_size,
        num_selected=num_selected,
    )


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
    neighboring: Optional[str] = None,
    steps_per_epoch: Optional[int] = None,
) -> float:
    """ε at ``delta`` of ``steps`` steps of ``sampler`` (:func:`sampler_event`) under
    ``neighboring`` (None: the sampler's :data:`DEFAULT_RELATION`), by ``accountant`` (None:
    the tightest certified one for the sampler)."""
    acct = default_accountant(sampler, accountant)
    d = check_delta(delta)
    rel = sampler_class(check_sampler(sampler)).default_relation if neighboring is None else neighboring
    ev = sampler_event(
        sampler, noise_multiplier, steps, sampling_probability=sampling_probability,
        population_size=population_size, max_batch_size=max_batch_size, num_selected=num_selected,
        neighboring=rel, steps_per_epoch=steps_per_epoch,
    )
    return make_accountant(acct, analysis_relation(rel)).compose(ev).get_epsilon(d)


def calibrate_noise_for(
    event_at: Callable[[float], Event],
    target_epsilon: float,
    target_delta: float,
    accountant: str,
    *,
    start: Optional[float] = None,
    rel: float = 1e-5,
    neighboring: str = "add_or_remove",
) -> float:
    """The smallest noise multiplier z, to ``rel`` relative and from above, such that the event
    ``event_at(z)`` is (``target_epsilon``, ``target_delta``)-DP under ``accountant`` (analysing
    under ``neighboring``: ``"add_or_remove"`` or ``"replace_one"``); ε must
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
        eps = make_accountant(accountant, neighboring).compose(event_at(math.exp(lz) * (1.0 - 1e-12))).get_epsilon(d)
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
    neighboring: Optional[str] = None,
    steps_per_epoch: Optional[int] = None,
) -> float:
    """Smallest noise multiplier z (to ``rel`` relative, from above) such that
    :func:`sampler_epsilon` ≤ ``target_epsilon`` under ``neighboring`` (None: the sampler's
    default relation) (:func:`calibrate_noise_for`)."""
    acct = default_accountant(sampler, accountant)
    nb = sampler_class(check_sampler(sampler)).default_relation if neighboring is None else neighboring
    kw = dict(
        sampling_probability=sampling_probability, population_size=population_size,
        max_batch_size=max_batch_size, num_selected=num_selected, neighboring=nb,
        steps_per_epoch=steps_per_epoch,
    )
    sampler_event(sampler, 1.0, steps, **kw)  # validates everything before the search
    if _count("steps", steps) == 0:
        return 0.0
    start = poisson_start(target_epsilon, target_delta, sampling_probability, steps)
    return calibrate_noise_for(
        lambda z: sampler_event(sampler, z, steps, **kw), target_epsilon, target_delta, acct, start=start, rel=rel,
        neighboring=analysis_relation(nb),
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
    neighboring: Optional[str] = None,
    steps_per_epoch: Optional[int] = None,
) -> int:
    """Largest number of steps (0 if none fits) with :func:`sampler_epsilon` ≤
    ``target_epsilon`` under ``neighboring`` (None: the sampler's default relation). For the
    allocation samplers the answer is a whole number of rounds (their ε is that of whole
    rounds)."""
    e = _real("target_epsilon", target_epsilon)
    if not e > 0:
        raise ValueError(f"target_epsilon must be > 0, got {e}")
    d = check_delta(target_delta)
    acct = default_accountant(sampler, accountant)
    nb = sampler_class(check_sampler(sampler)).default_relation if neighboring is None else neighboring
    kw = dict(
        sampling_probability=sampling_probability, population_size=population_size,
        max_batch_size=max_batch_size, num_selected=num_selected, neighboring=nb,
        steps_per_epoch=steps_per_epoch,
    )
    sampler_event(sampler, noise_multiplier, 1, **kw)
    cls = sampler_class(sampler)
    unit = cls.epoch_length(sampling_probability, num_selected=num_selected) if cls.rounds == "allocation" else 1

    def ok(units: int) -> bool:
        ev = sampler_event(sampler, noise_multiplier, units * unit, **kw)
        return make_accountant(acct, analysis_relation(nb)).compose(ev).get_epsilon(d) <= e

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
