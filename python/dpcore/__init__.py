"""dpcore: differentially private aggregation for iterative training, with a Rust core.

The design follows McMahan et al. 2018, "A General Approach to Adding Differential Privacy to
Iterative Training Procedures", and keeps its three concerns apart:

* (a) training code asks for sums or averages of per-record vectors;
* (b) the privacy mechanism clips each record and adds Gaussian noise (:mod:`dpcore.mechanism`),
  composed into a tree of DP queries (:mod:`dpcore.queries`) and driven by
  :class:`PrivateAggregator`;
* (c) a privacy ledger (:mod:`dpcore.ledger`) records what happened, and an accountant turns it
  into (ε, δ).

Noise and sampling come from ChaCha20 keyed from the operating system on every call. The ``seed``
arguments exist for tests and reproductions only and void the privacy guarantee.
"""

from . import accounting
from ._core import __version__
from .aggregator import PrivateAggregator
from .ledger import PrivacyLedger
from .mechanism import (
    DiscreteGaussianParams,
    clip_noise,
    clip_sum,
    discrete_gaussian_params,
    gaussian_noise,
    record_norms,
)
from .queries import (
    CountQuery,
    GaussianAverageQuery,
    GaussianSumQuery,
    JointClipQuery,
    MicrobatchQuery,
    NestedQuery,
    NoPrivacyQuery,
    QuantileAdaptiveClipQuery,
    effective_noise_multiplier,
)
from .sampling import fixed_size_sample, poisson_sample, truncated_poisson_sample
from ._threads import limit_blas_spin

__all__ = [
    "__version__",
    "accounting",
    "clip_noise",
    "discrete_gaussian_params",
    "DiscreteGaussianParams",
    "clip_sum",
    "record_norms",
    "gaussian_noise",
    "limit_blas_spin",
    "poisson_sample",
    "truncated_poisson_sample",
    "fixed_size_sample",
    "PrivateAggregator",
    "PrivacyLedger",
    "GaussianSumQuery",
    "GaussianAverageQuery",
    "NestedQuery",
    "JointClipQuery",
    "NoPrivacyQuery",
    "QuantileAdaptiveClipQuery",
    "MicrobatchQuery",
    "CountQuery",
    "effective_noise_multiplier",
]
