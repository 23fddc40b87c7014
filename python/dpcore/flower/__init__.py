"""dpcore on Flower (``pip install dpcore[flower]``): user-level differential privacy for
federated learning on Flower's simulation and deployment engines (issue 41).

* :class:`DifferentialPrivacy` wraps any strategy of Flower's Message API
  (``flwr.serverapp.strategy``): client sampling by ChaCha20 through dpcore's samplers, clipping
  (server or client side, flat or per layer, adaptive), Gaussian, discrete Gaussian or
  correlated (banded/BLT DP-FTRL) noise, the fixed denominator, a durable ledger whose report
  states user-level (ε, δ), and ε in Flower's metrics every round.
* :func:`clipping_mod` is the client mod of ``clipping_mode="client"``.

McMahan et al. 2018 (DP-FedAvg; the survey's Algorithm 2, Ponomareva et al. 2023).
"""

try:
    import flwr  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError("dpcore.flower needs Flower 1.42 or later: pip install 'dpcore[flower]'") from e

from ._mod import clip_update, clipping_mod
from ._strategy import (
    CLIPPING_MODES,
    CONFIG_CLIP,
    CONFIG_CLIPPING,
    METRIC_CLIP,
    METRIC_DELTA,
    METRIC_EPSILON,
    METRIC_RELEASES,
    METRIC_SAMPLED,
    SAMPLERS,
    DifferentialPrivacy,
)

__all__ = ["DifferentialPrivacy", "clipping_mod", "clip_update", "CLIPPING_MODES", "SAMPLERS", "CONFIG_CLIP",
           "CONFIG_CLIPPING", "METRIC_EPSILON", "METRIC_DELTA", "METRIC_RELEASES", "METRIC_CLIP", "METRIC_SAMPLED"]
