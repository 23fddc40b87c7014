"""Privacy events: an immutable description of what a training run did, to be accounted.

The vocabulary mirrors Google's ``dp_accounting`` (``GaussianDpEvent``, ``PoissonSampledDpEvent``
...) so that ledgers translate one to one (see :mod:`dpcore.accounting.interop`). Events are
frozen dataclasses: hashable (the accountant groups identical events by hash) and
round-tripping through JSON with :meth:`Event.to_dict` / :func:`event_from_dict`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterable, Tuple, Type


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


_REGISTRY: Dict[str, Type["Event"]] = {}


class Event:
    """Base class of all events."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        _REGISTRY[cls.__name__] = cls

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable dict; :func:`event_from_dict` inverts it."""
        out: Dict[str, Any] = {"type": type(self).__name__}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, Event):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = [e.to_dict() for e in v]
            out[f.name] = v
        return out

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "Event":
        return event_from_dict(d)


def event_from_dict(d: Dict[str, Any]) -> Event:
    """Rebuilds an event from :meth:`Event.to_dict`'s output (e.g. after ``json.loads``)."""
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError("expected a dict with a 'type' key, as produced by Event.to_dict()")
    cls = _REGISTRY.get(d["type"])
    if cls is None:
        raise ValueError(f"unknown event type {d['type']!r}")
    kw = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in d:
            raise ValueError(f"{d['type']}: missing field {f.name!r}")
        v = d[f.name]
        if f.name == "event":
            v = event_from_dict(v)
        elif f.name == "events":
            v = tuple(event_from_dict(e) for e in v)
        kw[f.name] = v
    return cls(**kw)


@dataclass(frozen=True)
class GaussianEvent(Event):
    """The Gaussian mechanism with noise standard deviation ``noise_multiplier`` × sensitivity."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        z = _real("noise_multiplier", self.noise_multiplier)
        if not z >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {z}")
        object.__setattr__(self, "noise_multiplier", z)


@dataclass(frozen=True)
class PoissonSampledEvent(Event):
    """``event`` run on a Poisson sample: each record included independently with probability
    ``sampling_probability`` (add-or-remove-one adjacency)."""

    sampling_probability: float
    event: Event

    def __post_init__(self) -> None:
        q = _real("sampling_probability", self.sampling_probability)
        if not 0 <= q <= 1:
            raise ValueError(f"sampling_probability must be in [0, 1], got {q}")
        if not isinstance(self.event, Event):
            raise TypeError(f"event must be an Event, got {type(self.event).__name__}")
        object.__setattr__(self, "sampling_probability", q)


@dataclass(frozen=True)
class SampledWithoutReplacementEvent(Event):
    """``event`` run on ``sample_size`` records drawn uniformly without replacement from
    ``source_size`` (replace-one adjacency: the data set size is public)."""

    source_size: int
    sample_size: int
    event: Event

    def __post_init__(self) -> None:
        n = _int("source_size", self.source_size)
        m = _int("sample_size", self.sample_size)
        if n < 1:
            raise ValueError(f"source_size must be >= 1, got {n}")
        if not 0 <= m <= n:
            raise ValueError(f"sample_size must be in [0, source_size={n}], got {m}")
        if not isinstance(self.event, Event):
            raise TypeError(f"event must be an Event, got {type(self.event).__name__}")
        object.__setattr__(self, "source_size", n)
        object.__setattr__(self, "sample_size", m)


@dataclass(frozen=True)
class SelfComposedEvent(Event):
    """``event`` repeated ``count`` times."""

    event: Event
    count: int

    def __post_init__(self) -> None:
        c = _int("count", self.count)
        if c < 0:
            raise ValueError(f"count must be >= 0, got {c}")
        if not isinstance(self.event, Event):
            raise TypeError(f"event must be an Event, got {type(self.event).__name__}")
        object.__setattr__(self, "count", c)


@dataclass(frozen=True)
class ComposedEvent(Event):
    """The events in sequence (any iterable is stored as a tuple)."""

    events: Tuple[Event, ...]

    def __post_init__(self) -> None:
        evs = tuple(self.events) if isinstance(self.events, Iterable) else None
        if evs is None:
            raise TypeError("events must be an iterable of Event")
        for e in evs:
            if not isinstance(e, Event):
                raise TypeError(f"events must hold Event instances, got {type(e).__name__}")
        object.__setattr__(self, "events", evs)


@dataclass(frozen=True)
class NonPrivateEvent(Event):
    """Data were released without a privacy guarantee: ε becomes infinite."""


__all__ = [
    "Event",
    "GaussianEvent",
    "PoissonSampledEvent",
    "SampledWithoutReplacementEvent",
    "SelfComposedEvent",
    "ComposedEvent",
    "NonPrivateEvent",
    "event_from_dict",
]
