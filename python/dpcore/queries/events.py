"""What a query released, as privacy tuples: the sum-query events of McMahan et al. 2018, §6.

A Gaussian sum query over one group of vectors is fully described, for privacy, by its privacy
tuple (S_g, σ̃_g): the L2 bound of one record's contribution to the sum and the stddev of the
noise added to the sum (§1 and §2 of the paper). The queries return these events from
``get_noised_result``; the ledger stores them and converts each sample's tuples into one
Gaussian event with Eq. (1). The events are plain frozen dataclasses so that nothing a query does
later can change what was recorded.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Tuple


def _finite(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


@dataclass(frozen=True)
class SumQueryEvent:
    """One Gaussian sum query with privacy tuple (S_g, σ̃_g) (McMahan et al. 2018, §2, §6).

    ``l2_norm_clip`` is S_g, the L2 bound of one record's contribution (its sensitivity under
    add-or-remove-one neighbouring); ``stddev`` is σ̃_g, the stddev of the noise added to the sum
    (before any division by a denominator). ``stddev == 0`` is a release without privacy.
    """

    l2_norm_clip: float
    stddev: float

    def __post_init__(self) -> None:
        s = _finite("l2_norm_clip", self.l2_norm_clip)
        sd = _finite("stddev", self.stddev)
        if s <= 0:
            raise ValueError(f"l2_norm_clip must be > 0, got {s}")
        if sd < 0:
            raise ValueError(f"stddev must be >= 0, got {sd}")
        object.__setattr__(self, "l2_norm_clip", s)
        object.__setattr__(self, "stddev", sd)

    def privacy_tuples(self) -> Tuple["SumQueryEvent", ...]:
        return (self,)

    @property
    def is_private(self) -> bool:
        return self.stddev > 0


@dataclass(frozen=True)
class NonPrivateQueryEvent:
    """A release with no privacy guarantee (e.g. :class:`NoPrivacyQuery`): ε = ∞."""

    def privacy_tuples(self) -> Tuple[SumQueryEvent, ...]:
        return ()

    @property
    def is_private(self) -> bool:
        return False


@dataclass(frozen=True)
class ComposedQueryEvent:
    """Several queries released on the same sample (e.g. the groups of a :class:`NestedQuery`).

    For accounting they are one Gaussian sum query with the noise multiplier of Eq. (1).
    """

    events: Tuple[Any, ...]

    def __post_init__(self) -> None:
        evs = tuple(self.events)
        for e in evs:
            if not isinstance(e, (SumQueryEvent, NonPrivateQueryEvent, ComposedQueryEvent)):
                raise TypeError(f"ComposedQueryEvent holds query events, got {type(e).__name__}")
        object.__setattr__(self, "events", evs)

    def privacy_tuples(self) -> Tuple[SumQueryEvent, ...]:
        return tuple(t for e in self.events for t in e.privacy_tuples())

    @property
    def is_private(self) -> bool:
        return all(e.is_private for e in self.events)


QueryEvent = Any  # SumQueryEvent | NonPrivateQueryEvent | ComposedQueryEvent


def compose_query_events(events: Iterable[QueryEvent]) -> QueryEvent:
    """The composition of query events released on one sample; a single event is returned as is."""
    evs = tuple(events)
    return evs[0] if len(evs) == 1 else ComposedQueryEvent(evs)


def effective_noise_multiplier(privacy_tuples: Iterable[Any]) -> float:
    """z = (Σ_g (S_g/σ̃_g)²)^(−1/2): McMahan et al. 2018, Eq. (1) and §4.

    The groups' sum queries on one sample are together equivalent to a single Gaussian sum query
    with L2 bound S* = sqrt(Σ_g (S_g/σ̃_g)²) and noise stddev 1, i.e. noise multiplier z = 1/S*.
    ``privacy_tuples`` holds :class:`SumQueryEvent` objects or (S_g, σ̃_g) pairs. A group with
    σ̃_g = 0 makes the release non-private: z = 0. An empty collection is rejected (it has no
    meaning as a release).

    Rounded to the safe side: the returned z never exceeds the exact value (computed with scaled
    sums so that neither tiny nor huge ratios overflow).
    """
    ratios = []
    for t in privacy_tuples:
        if not isinstance(t, SumQueryEvent):
            try:
                s, sd = t
            except (TypeError, ValueError):
                raise TypeError(
                    f"privacy_tuples must hold SumQueryEvent or (l2_norm_clip, stddev) pairs, got {t!r}"
                ) from None
            t = SumQueryEvent(s, sd)
        if t.stddev == 0:
            return 0.0
        ratios.append(t.l2_norm_clip / t.stddev)
    if not ratios:
        raise ValueError("privacy_tuples is empty: there is no query to account")
    m = max(ratios)
    if math.isinf(m):
        return 0.0
    if m == 0.0:
        # Every S_g/σ̃_g underflowed: the true z exceeds 1/5e-324, so the largest float is
        # still below it (never overstated).
        return sys.float_info.max
    s_star = m * math.sqrt(math.fsum((r / m) ** 2 for r in ratios))
    z = 1.0 / s_star
    # fsum/sqrt/divide carry a few ulps of error; step down so that z is never overstated
    # (a larger z would understate ε).
    for _ in range(4):
        z = math.nextafter(z, 0.0)
    return z
