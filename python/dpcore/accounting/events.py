"""Privacy events: an immutable description of what a training run did, to be accounted.

Defined in :mod:`dpcore.events` (the one event vocabulary of the package, shared with the
queries and the ledger); re-exported here so that ``dpcore.accounting.events`` keeps working.
The vocabulary mirrors Google's ``dp_accounting`` (see :mod:`dpcore.accounting.interop`).
"""

from ..events import (
    ComposedEvent,
    DiscreteGaussianEvent,
    Event,
    GaussianEvent,
    NonPrivateEvent,
    PoissonSampledEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
    TruncatedPoissonSampledEvent,
    event_from_dict,
)

__all__ = [
    "Event",
    "GaussianEvent",
    "DiscreteGaussianEvent",
    "PoissonSampledEvent",
    "SampledWithoutReplacementEvent",
    "TruncatedPoissonSampledEvent",
    "SelfComposedEvent",
    "ComposedEvent",
    "NonPrivateEvent",
    "event_from_dict",
]
