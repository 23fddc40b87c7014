"""Translation to and from Google's ``dp_accounting`` events (only if it is installed)."""

from __future__ import annotations

from typing import Any

from .events import ComposedEvent, Event, GaussianEvent, NonPrivateEvent, PoissonSampledEvent
from .events import SampledWithoutReplacementEvent, SelfComposedEvent, TruncatedPoissonSampledEvent
from .events import RepeatAndSelectEvent
from .events import BallsInBinsSampledEvent, RandomAllocationSampledEvent


def _dpa() -> Any:
    try:
        import dp_accounting
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("interop needs the dp-accounting package: pip install dp-accounting") from e
    return dp_accounting


def to_dp_accounting(event: Event) -> Any:
    """The equivalent ``dp_accounting.DpEvent``."""
    dpa = _dpa()
    if isinstance(event, GaussianEvent):
        return dpa.GaussianDpEvent(event.noise_multiplier)
    if isinstance(event, PoissonSampledEvent):
        return dpa.PoissonSampledDpEvent(event.sampling_probability, to_dp_accounting(event.event))
    if isinstance(event, SampledWithoutReplacementEvent):
        return dpa.SampledWithoutReplacementDpEvent(event.source_size, event.sample_size, to_dp_accounting(event.event))
    if isinstance(event, SelfComposedEvent):
        return dpa.SelfComposedDpEvent(to_dp_accounting(event.event), event.count)
    if isinstance(event, ComposedEvent):
        return dpa.ComposedDpEvent([to_dp_accounting(e) for e in event.events])
    if isinstance(event, NonPrivateEvent):
        return dpa.NonPrivateDpEvent()
    if isinstance(event, TruncatedPoissonSampledEvent):
        if not isinstance(event.event, GaussianEvent):
            raise TypeError("dp_accounting's truncated event holds a Gaussian; the inner event must be GaussianEvent")
        return dpa.TruncatedSubsampledGaussianDpEvent(
            event.population_size, event.sampling_probability, event.max_batch_size, event.event.noise_multiplier
        )
    if isinstance(event, (RandomAllocationSampledEvent, BallsInBinsSampledEvent)):
        raise TypeError(
            f"cannot translate {type(event).__name__}: dp_accounting has no event for random allocation "
            "(balls-in-bins) sampling; account it with dpcore.accounting.RdpAccountant"
        )
    if isinstance(event, RepeatAndSelectEvent):
        return dpa.dp_event.RepeatAndSelectDpEvent(to_dp_accounting(event.event), event.mean, event.shape)
    raise TypeError(f"cannot translate {type(event).__name__}")


def from_dp_accounting(event: Any) -> Event:
    """The equivalent dpcore event; ``NoOpDpEvent`` becomes an empty :class:`ComposedEvent`.
    Other event kinds (Laplace, tree aggregation, …) raise TypeError."""
    dpa = _dpa()
    if isinstance(event, dpa.GaussianDpEvent):
        return GaussianEvent(event.noise_multiplier)
    if isinstance(event, dpa.PoissonSampledDpEvent):
        return PoissonSampledEvent(event.sampling_probability, from_dp_accounting(event.event))
    if isinstance(event, dpa.SampledWithoutReplacementDpEvent):
        return SampledWithoutReplacementEvent(event.source_dataset_size, event.sample_size, from_dp_accounting(event.event))
    if isinstance(event, dpa.SelfComposedDpEvent):
        return SelfComposedEvent(from_dp_accounting(event.event), event.count)
    if isinstance(event, dpa.ComposedDpEvent):
        return ComposedEvent(tuple(from_dp_accounting(e) for e in event.events))
    if isinstance(event, dpa.NonPrivateDpEvent):
        return NonPrivateEvent()
    if isinstance(event, dpa.NoOpDpEvent):
        return ComposedEvent(())
    if isinstance(event, dpa.TruncatedSubsampledGaussianDpEvent):
        return TruncatedPoissonSampledEvent(
            event.sampling_probability, event.truncated_batch_size, event.dataset_size, GaussianEvent(event.noise_multiplier)
        )
    if isinstance(event, dpa.dp_event.RepeatAndSelectDpEvent):
        return RepeatAndSelectEvent(from_dp_accounting(event.event), event.mean, event.shape)
    raise TypeError(f"cannot translate {type(event).__name__}")
