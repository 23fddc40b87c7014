"""Correlated noise by matrix factorization: DP-FTRL-style mechanisms for fixed-batch pipelines.

Where DP-SGD needs Poisson sampling for its amplification, a matrix-factorization (MF)
mechanism needs only a bound on how often and how far apart a record takes part
(:class:`Participation`), and adds noise correlated across steps: step t adds (C⁻¹z)_t for a
strategy C (:class:`BandedStrategy`, :class:`BLTStrategy`). See Choquette-Choo et al. 2022
(arXiv 2211.06530), 2023 (arXiv 2306.08153), Kalinin & Lampert 2024 (arXiv 2405.13763), and
McMahan et al. 2024 (arXiv 2408.08868); the survey of Ponomareva et al. 2023, §4.1.3.
"""

from ._participation import CYCLIC, CYCLIC_POISSON, Participation
from ._strategies import (
    IDENTITY,
    BandedStrategy,
    BLTStrategy,
    ToeplitzStrategy,
    brute_force_sensitivity,
    strategy_from_dict,
)

__all__ = [
    "Participation",
    "CYCLIC",
    "CYCLIC_POISSON",
    "ToeplitzStrategy",
    "BandedStrategy",
    "BLTStrategy",
    "IDENTITY",
    "strategy_from_dict",
    "brute_force_sensitivity",
]
