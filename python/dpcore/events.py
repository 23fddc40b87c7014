"""The event vocabulary of dpcore: what a run released, for the ledger and the accountants.

This module is the bottom layer of the package: it imports nothing from dpcore, so that queries,
ledger and accountants can all depend on it without depending on each other. It holds two kinds
of events.

**Sum-query events** (McMahan et al. 2018, "A General Approach to Adding Differential Privacy to
Iterative Training Procedures", §2 and §6). A Gaussian sum query over one group of vectors is
fully described, for privacy, by its privacy tuple (S_g, σ̃_g): the L2 bound of one record's
contribution to the sum and the stddev of the noise added to the sum (§1 and §2 of the paper).
The queries return these events from ``get_noised_result`` (:class:`SumQueryEvent`,
:class:`ComposedQueryEvent`, :class:`NonPrivateQueryEvent`); the ledger stores them and converts
each sample's tuples into one Gaussian event with noise multiplier
z = (Σ_g (S_g/σ̃_g)²)^(−1/2), Eq. (1) (:func:`effective_noise_multiplier`).

**Accountant events** (:class:`Event` and its subclasses). The vocabulary mirrors Google's
``dp_accounting`` (``GaussianDpEvent``, ``PoissonSampledDpEvent``, ...) so that ledgers
translate one to one (see :mod:`dpcore.accounting.interop`). They describe a whole run in terms
an accountant can analyse: Gaussian steps, the sampling that amplifies them, and composition.
They are hashable (the accountant groups identical events by hash) and round-trip through JSON
with :meth:`Event.to_dict` / :func:`event_from_dict`.

A sum-query event of mechanism ``"matrix_factorization"`` is one step of a correlated-noise
stream (DP-FTRL): it names its stream and carries the stream's declaration (strategy,
participation schema, planned steps), and the ledger accounts the stream's steps together
rather than by Eq. (1) (:mod:`dpcore.ledger._events`).

Both kinds are frozen dataclasses, validated on construction, so that nothing a query or a
caller does later can change what was recorded.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterable, Optional, Tuple, Type

from ._validate import count as _count, finite as _finite, integer as _int, probability as _probability, real as _real

#: The sum-query events (McMahan et al. 2018, §6), re-exported by :mod:`dpcore.queries.events`.
QUERY_EVENTS = (
    "SumQueryEvent", "NonPrivateQueryEvent", "ComposedQueryEvent", "QueryEvent", "compose_query_events",
    "effective_noise_multiplier",
)
#: The accountant events (dp_accounting's vocabulary), re-exported by :mod:`dpcore.accounting`.
ACCOUNTANT_EVENTS = (
    "Event", "GaussianEvent", "DiscreteGaussianEvent", "PoissonSampledEvent", "SampledWithoutReplacementEvent",
    "TruncatedPoissonSampledEvent", "BallsInBinsSampledEvent", "RandomAllocationSampledEvent", "RepeatAndSelectEvent",
    "MixtureOfGaussiansEvent", "example_level_sampling_event", "SelfComposedEvent", "ComposedEvent", "NonPrivateEvent",
    "event_from_dict",
)
__all__ = [*QUERY_EVENTS, *ACCOUNTANT_EVENTS]


# ============================================================================= sum-query events

#: The noise distributions a sum query may add.
MECHANISMS = ("gaussian", "discrete_gaussian", "matrix_factorization")
#: The mechanism of a matrix-factorization (correlated noise) query: one step of a stream.
MATRIX_FACTORIZATION = "matrix_factorization"

# A stream id: printable ASCII without spaces (a uuid's hex, say), at most 200 characters.
_STREAM_ID = re.compile(r"[!-~]{1,200}")


def check_stream_id(stream: Any) -> str:
    """``stream`` if it is a valid stream id (printable ASCII without spaces, 1 to 200
    characters, e.g. ``uuid.uuid4().hex``); TypeError or ValueError otherwise."""
    if not isinstance(stream, str):
        raise TypeError(f"stream must be a str (one id per matrix-factorization query run), got {type(stream).__name__}")
    if not _STREAM_ID.fullmatch(stream):
        raise ValueError(f"stream must be 1 to 200 printable ASCII characters without spaces, got {stream!r}")
    return stream


def check_declaration_shape(declaration: Any) -> Dict[str, Any]:
    """The parsed ``declaration`` of a matrix-factorization query, checked for its shape only:
    a JSON object ``{"strategy": {...}, "participation": {...}, "steps": n}``. The ledger
    rebuilds the strategy and the participation schema from it and checks them fully
    (:mod:`dpcore.matrix_factorization`); this module imports nothing that could."""
    if not isinstance(declaration, str):
        raise TypeError(f"declaration must be a JSON str, got {type(declaration).__name__}")
    try:
        d = json.loads(declaration, parse_constant=_no_constant)
    except ValueError as e:
        raise ValueError(f"declaration is not valid JSON: {e}") from None
    if not isinstance(d, dict) or set(d) != {"strategy", "participation", "steps"}:
        raise ValueError(
            'declaration must be a JSON object with exactly the keys "strategy", "participation" and "steps", '
            f"got {declaration[:200]!r}"
        )
    for k in ("strategy", "participation"):
        if not isinstance(d[k], dict) or not isinstance(d[k].get("kind"), str):
            raise ValueError(f"declaration: {k} must be an object with a \"kind\", got {d[k]!r}")
    steps = d["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"declaration: steps must be an int >= 1, got {steps!r}")
    return d


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid value")


@functools.lru_cache(maxsize=64)
def _checked_declaration(declaration: str) -> None:
    """:func:`check_declaration_shape`, remembered: every step of a stream carries the same text
    (an exception is not remembered)."""
    check_declaration_shape(declaration)


def is_matrix_factorization(t: Any) -> bool:
    """Whether the privacy tuple ``t`` is one step of a matrix-factorization stream."""
    return getattr(t, "mechanism", "gaussian") == MATRIX_FACTORIZATION


def is_discrete(privacy_tuples: Iterable[Any]) -> bool:
    """Whether any of these :class:`SumQueryEvent` used the discrete Gaussian: the release is
    then accounted as a discrete Gaussian mechanism (whose Rényi bound also covers continuous
    Gaussian groups composed with it on the same sample)."""
    return any(getattr(t, "mechanism", "gaussian") == "discrete_gaussian" for t in privacy_tuples)



@dataclass(frozen=True)
class SumQueryEvent:
    """One Gaussian sum query with privacy tuple (S_g, σ̃_g) (McMahan et al. 2018, §2, §6).

    ``l2_norm_clip`` is S_g, the L2 bound of one record's contribution (its sensitivity under
    add-or-remove-one neighbouring); ``stddev`` is σ̃_g, the stddev of the noise added to the sum
    (before any division by a denominator). ``stddev == 0`` is a release without privacy.

    ``mechanism`` is ``"gaussian"`` or ``"discrete_gaussian"`` (Canonne, Kamath & Steinke 2020:
    records rounded onto a grid, integer noise N_ℤ(0, σ̃²) in grid units); for the latter S_g is
    the sensitivity after rounding, and the accountants use the discrete Gaussian's analysis.

    ``"matrix_factorization"``: one step of a correlated-noise stream (DP-FTRL; Choquette-Choo et
    al. 2022, arXiv 2211.06530): the noise added at step t is σ̃·(C⁻¹z)_t, so that the steps of
    a stream are not independent Gaussian queries and are accounted together. Such an event
    names its ``stream`` (one id per query run, e.g. a uuid's hex) and carries its
    ``declaration``: the canonical JSON text of ``{"strategy": strategy.to_dict(),
    "participation": participation.to_dict(), "steps": n}`` (n the planned steps), from which
    the ledger's accountant rebuilds the strategy and recomputes the sensitivity. Both are
    required for that mechanism and forbidden for the others; here the declaration's shape is
    checked, the ledger checks the rest before recording it.
    """

    l2_norm_clip: float
    stddev: float
    mechanism: str = "gaussian"
    stream: Optional[str] = None
    declaration: Optional[str] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {', '.join(MECHANISMS)}; got {self.mechanism!r}")
        if self.mechanism == MATRIX_FACTORIZATION:
            if self.stream is None or self.declaration is None:
                raise ValueError(
                    "a matrix_factorization sum query needs its stream id and its declaration "
                    "(strategy, participation and planned steps)"
                )
            check_stream_id(self.stream)
            if not isinstance(self.declaration, str):
                raise TypeError(f"declaration must be a JSON str, got {type(self.declaration).__name__}")
            _checked_declaration(self.declaration)
        elif self.stream is not None or self.declaration is not None:
            raise ValueError(
                f"stream and declaration belong to matrix_factorization sum queries, not to {self.mechanism!r} ones"
            )
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


# ============================================================================= accountant events




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
                v = [e.to_dict() if isinstance(e, Event) else e for e in v]
            out[f.name] = v
        return out

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "Event":
        return event_from_dict(d)


#: Fields renamed since events were first serialised: (type, field) -> the old key, still read.
_OLD_KEYS = {("TruncatedPoissonSampledEvent", "max_batch_size"): "max_sample_size"}


def event_from_dict(d: Dict[str, Any]) -> Event:
    """Rebuilds an event from :meth:`Event.to_dict`'s output (e.g. after ``json.loads``)."""
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError("expected a dict with a 'type' key, as produced by Event.to_dict()")
    cls = _REGISTRY.get(d["type"])
    if cls is None:
        raise ValueError(f"unknown event type {d['type']!r}")
    kw = {}
    for f in fields(cls):  # type: ignore[arg-type]
        old = _OLD_KEYS.get((d["type"], f.name))
        if f.name not in d and old in d:  # written before the field was renamed
            d = {**d, f.name: d[old]}
        if f.name not in d:
            raise ValueError(f"{d['type']}: missing field {f.name!r}")
        v = d[f.name]
        if f.name == "event":
            v = event_from_dict(v)
        elif f.name == "events":
            v = tuple(event_from_dict(e) for e in v)
        kw[f.name] = v
    return cls(**kw)


def _set_noise_multiplier(event: Any) -> None:
    z = _real("noise_multiplier", event.noise_multiplier)
    if not z >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {z}")
    object.__setattr__(event, "noise_multiplier", z)


@dataclass(frozen=True)
class GaussianEvent(Event):
    """The Gaussian mechanism with noise standard deviation ``noise_multiplier`` × sensitivity."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        _set_noise_multiplier(self)


@dataclass(frozen=True)
class DiscreteGaussianEvent(Event):
    """The discrete Gaussian mechanism (Canonne, Kamath & Steinke 2020) on an integer-valued
    query: noise N_ℤ(0, σ²) per coordinate with σ = ``noise_multiplier`` × the query's L2
    sensitivity after rounding. It satisfies the Rényi bound ε(α) = α/(2z²) of the continuous
    Gaussian (CKS 2020, Theorem 14), but its privacy loss distribution is not the continuous
    one: accountants analyse it through RDP only (:class:`dpcore.accounting.RdpAccountant`)."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        _set_noise_multiplier(self)


def _settle(wrapper: Any, **values: Any) -> None:
    """Checks that a wrapping event's ``event`` is an Event, then stores its validated fields
    (frozen dataclasses: through object.__setattr__)."""
    if not isinstance(wrapper.event, Event):
        raise TypeError(f"event must be an Event, got {type(wrapper.event).__name__}")
    for name, value in values.items():
        object.__setattr__(wrapper, name, value)


@dataclass(frozen=True)
class PoissonSampledEvent(Event):
    """``event`` run on a Poisson sample: each record included independently with probability
    ``sampling_probability`` (add-or-remove-one adjacency)."""

    sampling_probability: float
    event: Event

    def __post_init__(self) -> None:
        _settle(self, sampling_probability=_probability("sampling_probability", self.sampling_probability))


@dataclass(frozen=True)
class SampledWithoutReplacementEvent(Event):
    """``event`` run on ``sample_size`` records drawn uniformly without replacement from
    ``source_size`` (replace-one adjacency: the data set size is public)."""

    source_size: int
    sample_size: int
    event: Event

    def __post_init__(self) -> None:
        n = _count("source_size", self.source_size, 1)
        m = _int("sample_size", self.sample_size)
        if not 0 <= m <= n:
            raise ValueError(f"sample_size must be in [0, source_size={n}], got {m}")
        _settle(self, source_size=n, sample_size=m)


@dataclass(frozen=True)
class TruncatedPoissonSampledEvent(Event):
    """``event`` run on a Poisson sample that is capped at ``max_batch_size`` records.

    Each of ``population_size`` records is included independently with probability
    ``sampling_probability``; when more than ``max_batch_size`` are drawn, a uniformly random
    subset of ``max_batch_size`` of them is kept. The cap bounds the batch (and so the memory)
    of a step. This is the idea of ``dp_accounting``'s ``TruncatedSubsampledGaussianDpEvent``
    (dataset_size, sampling_probability, truncated_batch_size, noise_multiplier; see
    arXiv:2508.15089), with the mechanism run on the sample kept as an inner ``event`` as in
    :class:`PoissonSampledEvent`. The population size is part of the event because the
    probability of hitting the cap depends on it.
    """

    sampling_probability: float
    max_batch_size: int
    population_size: int
    event: Event

    def __post_init__(self) -> None:
        q = _probability("sampling_probability", self.sampling_probability)
        b = _count("max_batch_size", self.max_batch_size, 1)
        n = _count("population_size", self.population_size, 1)
        if b > n:
            raise ValueError(f"max_batch_size must be <= population_size={n}, got {b}")
        _settle(self, sampling_probability=q, max_batch_size=b, population_size=n)
        object.__setattr__(self, "population_size", n)

    @property
    def max_sample_size(self) -> int:
        """Deprecated: the cap is called ``max_batch_size`` everywhere now."""
        import warnings

        warnings.warn("TruncatedPoissonSampledEvent.max_sample_size is deprecated; it is called max_batch_size now",
                      DeprecationWarning, stacklevel=2)
        return self.max_batch_size


@dataclass(frozen=True)
class RandomAllocationSampledEvent(Event):
    """``event`` run at each of ``num_steps`` steps, where every record takes part in exactly
    ``num_selected`` of them, a uniformly random ``num_selected``-subset of the steps chosen
    independently for each record (random allocation, Feldman & Shenfeld 2025,
    arXiv:2502.08202). Unlike :class:`PoissonSampledEvent`, one such event covers all
    ``num_steps`` steps of an allocation round: a run of R rounds is
    ``SelfComposedEvent(RandomAllocationSampledEvent(t, k, e), R)``. A round cut short (a
    prefix of its steps released) is covered by the whole round's event (post-processing).

    ``event`` is the mechanism of one step (a :class:`GaussianEvent`); the batches have no
    fixed size (a record's steps are chosen without regard to the others').
    """

    num_steps: int
    num_selected: int
    event: Event

    def __post_init__(self) -> None:
        t = _count("num_steps", self.num_steps, 1)
        k = _count("num_selected", self.num_selected, 1)
        if k > t:
            raise ValueError(f"num_selected must be <= num_steps={t}, got {k}")
        _settle(self, num_steps=t, num_selected=k)


@dataclass(frozen=True)
class BallsInBinsSampledEvent(Event):
    """One epoch of balls-in-bins sampling (Chua et al. 2025, "Balls-and-Bins Sampling for
    DP-SGD", arXiv:2412.16802): every record is thrown into one of ``num_batches`` batches,
    uniformly and independently, and ``event`` runs once on each batch. It covers the epoch's
    ``num_batches`` steps, and is random allocation of one step out of ``num_batches``
    (:class:`RandomAllocationSampledEvent` with ``num_selected=1``), which is how the
    accountants analyse it."""

    num_batches: int
    event: Event

    def __post_init__(self) -> None:
        _settle(self, num_batches=_count("num_batches", self.num_batches, 1))

    def as_random_allocation(self) -> RandomAllocationSampledEvent:
        return RandomAllocationSampledEvent(self.num_batches, 1, self.event)


@dataclass(frozen=True)
class RepeatAndSelectEvent(Event):
    """Hyperparameter tuning: ``event`` (one training run) repeated a random number K of times,
    only the best run's output released (Papernot & Steinke 2022, "Hyperparameter Tuning with
    Renyi Differential Privacy", arXiv:2110.03620). K is drawn, independently of the data,
    from the distribution of the given ``mean`` (E[K] >= 1) and ``shape``: the truncated
    negative binomial D_{η,γ} of their Definition 1 with η = ``shape`` (0: logarithmic,
    1: geometric), or Poisson for ``shape = inf`` (their §3.1). As dp_accounting's
    ``RepeatAndSelectDpEvent`` (event, mean, shape)."""

    event: Event
    mean: float
    shape: float

    def __post_init__(self) -> None:
        mean = _real("mean", self.mean)
        shape = _real("shape", self.shape)
        if not (mean >= 1 and math.isfinite(mean)):
            raise ValueError(f"mean (the expected number of runs) must be finite and >= 1, got {mean}")
        if not shape >= 0:
            raise ValueError(f"shape must be >= 0 (inf: Poisson), got {shape}")
        _settle(self, mean=mean, shape=shape)


def _reals(name: str, values: Any) -> Tuple[float, ...]:
    """``values`` as a non-empty tuple of finite floats (a str or a mapping is not a sequence of them)."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    out = tuple(_finite(f"{name}[{i}]", v) for i, v in enumerate(values))
    if not out:
        raise ValueError(f"{name} must hold at least one value")
    return out


@dataclass(frozen=True)
class MixtureOfGaussiansEvent(Event):
    """The mixture-of-Gaussians mechanism (Ganesh 2024, "Tight Group-Level DP Guarantees for
    DP-SGD with Sampling via Mixture of Gaussians Mechanisms", arXiv:2401.10294): one step whose
    sum query moves by ``sensitivities[k]`` (in units of the clip norm C) with probability
    ``probabilities[k]``, with Gaussian noise of standard deviation ``noise_multiplier``·C. Under
    add-or-remove its dominating pair is, with z the noise multiplier,

        P = Σ_k p_k·N(s_k, z²)  against  Q = N(0, z²),

    in both directions (P against Q, and Q against P): the shape of dp_accounting's
    ``MixtureOfGaussiansDpEvent(standard_deviation, sensitivities, sampling_probs)``, with the
    standard deviation given relative to C as everywhere in dpcore.

    It is the step of example-level sampling with a user-level guarantee (ELS; Charles et al.
    2024, "Fine-Tuning Large Language Models with User-Level Differential Privacy",
    arXiv:2407.07737): a user holds at most K examples, each Poisson-sampled at rate q and
    clipped to C, so removing the user moves the sum by at most k·C with probability
    Binom(K, q)(k), and the worst case puts the k contributions in one direction (Ganesh 2024);
    :func:`example_level_sampling_event` builds it. Poisson sampling of one record is the
    mixture with sensitivities (0, 1) and probabilities (1 − q, q), and the accountant analyses
    such a mixture exactly as the :class:`PoissonSampledEvent` it is.

    ``sensitivities`` are finite and ≥ 0; ``probabilities`` are in [0, 1], as many, and sum to 1
    (within 1e-9; the accountant divides them by their sum). Analysed by
    :class:`~dpcore.accounting.PldAccountant` under add-or-remove only (no Rényi bound of it is
    implemented).
    """

    noise_multiplier: float
    sensitivities: Tuple[float, ...]
    probabilities: Tuple[float, ...]

    def __post_init__(self) -> None:
        _set_noise_multiplier(self)
        s = _reals("sensitivities", self.sensitivities)
        p = _reals("probabilities", self.probabilities)
        if len(s) != len(p):
            raise ValueError(f"sensitivities and probabilities must have the same length, got {len(s)} and {len(p)}")
        if any(v < 0 for v in s):
            raise ValueError(f"sensitivities must be >= 0, got {min(s)}")
        if any(not 0.0 <= v <= 1.0 for v in p):
            raise ValueError(f"probabilities must be in [0, 1], got {[v for v in p if not 0.0 <= v <= 1.0][0]}")
        total = math.fsum(p)
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"probabilities must sum to 1, got {total!r}")
        object.__setattr__(self, "sensitivities", s)
        object.__setattr__(self, "probabilities", p)


def _binomial_pmf(k: int, q: float) -> Tuple[float, ...]:
    """Binom(k, q)(j) for j = 0..k, each from its logarithm (no overflow of the binomial
    coefficient; q = 0 and q = 1 exactly)."""
    if q == 0.0:
        return (1.0,) + (0.0,) * k
    if q == 1.0:
        return (0.0,) * k + (1.0,)
    lq, l1q = math.log(q), math.log1p(-q)
    lgk = math.lgamma(k + 1)
    p = [math.exp(lgk - math.lgamma(j + 1) - math.lgamma(k - j + 1) + j * lq + (k - j) * l1q) for j in range(k + 1)]
    total = math.fsum(p)  # 1 up to the rounding of lgamma (~1e-13 at K = 1000)
    return tuple(v / total for v in p)


def example_level_sampling_event(sampling_probability: float, noise_multiplier: float,
                                 max_examples_per_user: int) -> Event:
    """One step of example-level sampling accounted for a user (ELS; Charles et al. 2024,
    arXiv:2407.07737): every user's data bounded to at most K = ``max_examples_per_user``
    examples, examples Poisson-sampled at ``sampling_probability`` q, each clipped to C, Gaussian
    noise ``noise_multiplier``·C on the sum. Removing a user removes up to K examples, each in the
    batch independently with probability q: the :class:`MixtureOfGaussiansEvent` with
    sensitivities 0, 1, ..., K and probabilities Binom(K, q)(k) = C(K, k)·q^k·(1 − q)^(K−k)
    (Ganesh 2024, arXiv:2401.10294). K = 1 is example-level accounting: ``PoissonSampledEvent(q, GaussianEvent(z))``,
    returned as such (so that its ε is the example-level ε exactly)."""
    q = _probability("sampling_probability", sampling_probability)
    k = _count("max_examples_per_user", max_examples_per_user, 1)
    if k == 1:
        return PoissonSampledEvent(q, GaussianEvent(noise_multiplier))
    return MixtureOfGaussiansEvent(noise_multiplier, tuple(float(j) for j in range(k + 1)), _binomial_pmf(k, q))


@dataclass(frozen=True)
class SelfComposedEvent(Event):
    """``event`` repeated ``count`` times."""

    event: Event
    count: int

    def __post_init__(self) -> None:
        c = _int("count", self.count)
        if c < 0:
            raise ValueError(f"count must be >= 0, got {c}")
        _settle(self, count=c)


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
