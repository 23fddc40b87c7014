"""DP queries: concern (b) of McMahan et al. 2018, a configurable tree of privacy mechanisms.

Lifecycle (see :class:`DPQuery`): ``initial_global_state`` → ``derive_sample_params`` →
``initial_sample_state(template)`` → ``accumulate_records`` (one Rust call per batch; a
:class:`NestedQuery` clips all its Gaussian groups in that one call) → ``merge_sample_states`` → ``get_noised_result`` returning ``(result, global_state, event)``;
the event holds the privacy tuples (S_g, σ̃_g) that the ledger records (§6).

Queries: :class:`GaussianSumQuery`, :class:`GaussianAverageQuery`, :class:`JointClipQuery` (§2),
:class:`NestedQuery` (groups with separate clipping, §2–§3), :class:`CountQuery` (metrics),
:class:`NoPrivacyQuery`, :class:`QuantileAdaptiveClipQuery` (Andrew et al. 2021),
:class:`MicrobatchQuery` (survey §5.6), :class:`MatrixFactorizationQuery` (correlated noise,
Choquette-Choo et al. 2022). Strategies of §4 live in :mod:`.strategies`.
"""

from .adaptive import QuantileAdaptiveClipQuery
from .base import DPQuery, SumState
from ..events import (
    ComposedQueryEvent,
    NonPrivateQueryEvent,
    SumQueryEvent,
    compose_query_events,
    effective_noise_multiplier,
)
from .gaussian import (
    CountQuery,
    GaussianAverageQuery,
    GaussianGlobalState,
    GaussianSumQuery,
    JointClipQuery,
    NoPrivacyQuery,
    ReleasePlan,
)
from .microbatch import MicrobatchQuery, scale_sensitivity
from .nested import NestedQuery
from .strategies import (
    dimension_weighted_clip_norms,
    dimensionality_adjusted_noise,
    flat_clip_norm,
    per_layer_clip_norms,
    proportional_noise,
)

__all__ = [
    "DPQuery",
    "SumState",
    "GaussianSumQuery",
    "GaussianAverageQuery",
    "GaussianGlobalState",
    "JointClipQuery",
    "CountQuery",
    "NoPrivacyQuery",
    "ReleasePlan",
    "NestedQuery",
    "QuantileAdaptiveClipQuery",
    "MicrobatchQuery",
    "MatrixFactorizationQuery",
    "MatrixFactorizationGlobalState",
    "scale_sensitivity",
    "SumQueryEvent",
    "ComposedQueryEvent",
    "NonPrivateQueryEvent",
    "compose_query_events",
    "effective_noise_multiplier",
    "flat_clip_norm",
    "per_layer_clip_norms",
    "dimension_weighted_clip_norms",
    "proportional_noise",
    "dimensionality_adjusted_noise",
]


def __getattr__(name: str) -> object:
    # The correlated-noise query pulls in the strategies and their optimiser: loaded on first
    # use, so that `import dpcore` stays fast for everyone else.
    if name in ("MatrixFactorizationQuery", "MatrixFactorizationGlobalState"):
        from . import matrix_factorization

        return getattr(matrix_factorization, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
