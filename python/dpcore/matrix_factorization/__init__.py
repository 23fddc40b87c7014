"""Correlated noise by matrix factorization: DP-FTRL-style mechanisms for fixed-batch pipelines.

Where DP-SGD needs Poisson sampling for its amplification, a matrix-factorization (MF)
mechanism needs only a bound on how often and how far apart a record takes part
(:class:`Participation`), and adds noise correlated across steps: step t adds (C⁻¹z)_t for a
strategy C (:class:`BandedStrategy`, :class:`BLTStrategy`). See Choquette-Choo et al. 2022
(arXiv 2211.06530), 2023 (arXiv 2306.08153), Kalinin & Lampert 2024 (arXiv 2405.13763), and
McMahan et al. 2024 (arXiv 2408.08868); the survey of Ponomareva et al. 2023, §4.1.3.
"""

from ._optimize import (
    banded_sqrt,
    default_bands,
    expected_loss,
    optimize,
    optimize_banded,
    optimize_blt,
    rmse,
    workload_coefficients,
)
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
    "banded_sqrt",
    "default_bands",
    "workload_coefficients",
    "expected_loss",
    "rmse",
    "optimize_banded",
    "optimize_blt",
    "optimize",
]

# Accounting (ε and calibration at the effective noise multiplier; the ledger's declarations).
from ._accounting import (  # noqa: E402
    StreamDeclaration,
    accountant_event,
    calibrate_noise_multiplier,
    epsilon,
    noise_multiplier_for,
    stddev_for,
)

__all__ += [
    "StreamDeclaration",
    "stddev_for",
    "noise_multiplier_for",
    "accountant_event",
    "epsilon",
    "calibrate_noise_multiplier",
]


# The framework adapters' choice of strategy for ``noise_mechanism=`` (dpcore.torch, dpcore.tensorflow).
NOISE_MECHANISMS = ("independent", "banded", "blt")


def strategy_for(
    mechanism: str, participation: Participation, steps: int, strategy: "ToeplitzStrategy | None" = None, *,
    momentum: float = 0.0,
) -> ToeplitzStrategy:
    """The strategy of a training run with ``noise_mechanism=mechanism`` over ``steps`` planned
    steps under ``participation``: ``strategy`` checked against the mechanism, or optimised
    (:func:`optimize`). ``"independent"`` is C = I (DP-SGD; only :data:`IDENTITY` may be
    given); ``"banded"`` a :class:`BandedStrategy` (default :func:`default_bands` bands);
    ``"blt"`` a :class:`BLTStrategy` (:data:`DEFAULT_BUFFERS` buffers), refused with cyclic Poisson sampling, as is a
    banded strategy with more bands than ``min_separation`` there (amplified banded MF,
    Choquette-Choo et al. 2023). ``momentum``: the optimizer's heavy-ball β, which changes the
    workload the strategy is optimised for (the noise reaches the parameters through the
    momentum filter; Denisov et al. 2022)."""
    if mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS}, got {mechanism!r}")
    if not isinstance(participation, Participation):
        raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
    if strategy is not None and not isinstance(strategy, (BandedStrategy, BLTStrategy)):
        raise TypeError(f"strategy must be a BandedStrategy or BLTStrategy, got {type(strategy).__name__}")
    poisson = participation.kind == CYCLIC_POISSON
    if mechanism == "independent":
        if strategy is not None and strategy != IDENTITY:
            raise ValueError(
                f"noise_mechanism='independent' is C = I (BandedStrategy([1.0])); got strategy {strategy!r}: give "
                "noise_mechanism='banded' or 'blt' for correlated noise"
            )
        return IDENTITY
    if mechanism == "blt":
        if poisson:
            raise ValueError(
                "noise_mechanism='blt' with cyclic Poisson sampling: amplified matrix factorization needs a banded "
                "strategy with at most b bands (Choquette-Choo et al. 2023); use noise_mechanism='banded'"
            )
        if strategy is None:
            return optimize(steps, participation, kind="blt", momentum=momentum)
        if not isinstance(strategy, BLTStrategy):
            raise ValueError(f"noise_mechanism='blt' but strategy is a {type(strategy).__name__}")
        return strategy
    if strategy is None:
        strategy = optimize(steps, participation, kind="banded", momentum=momentum)
    elif not isinstance(strategy, BandedStrategy):
        raise ValueError(f"noise_mechanism='banded' but strategy is a {type(strategy).__name__}")
    if poisson and strategy.bands > participation.min_separation:
        raise ValueError(
            f"cyclic Poisson sampling with {participation.min_separation} groups needs a banded strategy with at most "
            f"that many bands; this one has {strategy.bands} (amplified banded MF, Choquette-Choo et al. 2023)"
        )
    return strategy


__all__ += ["NOISE_MECHANISMS", "strategy_for"]
