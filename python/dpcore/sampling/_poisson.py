"""Poisson sampling (Abadi et al. 2016, "lots"; McMahan et al. 2018, §5): each record joins each
step independently with probability q. The sampling the subsampled-Gaussian accountant assumes
(``PoissonSampledEvent(q, ·)`` per step; PLD, tight)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import _core
from .._validate import count as _count, probability as _probability
from ..mechanism import _real, _seed
from ._base import Sampler, composed, derive, ledger_of, register_sampler

_STEP_PATH = 0x9016  # derive_seed path of a seeded PoissonSampler's steps


def poisson_sample(n: int, q: float, *, seed: Optional[int] = None, ledger: Any = None) -> np.ndarray:
    """Sorted indices (int64) of a Poisson sample: each of the n records joins with probability q.

    Drawn with geometric skips between selected indices (expected O(q·n) work). The sample may
    be empty. This is the sampling that the subsampled-Gaussian accountant assumes. With
    ``ledger``, records a ``poisson`` sampling event (n, q).
    """
    led = ledger_of(ledger)
    q = _real("q", q)
    n = _count("n", n)
    s = _seed(seed)
    if led is not None and n == 0:
        raise ValueError("n must be >= 1 to record a sample in a ledger")
    idx = _core.poisson_sample(n, q, s).astype(np.int64, copy=False)
    if led is not None:
        led.record_sample(n, q, "poisson", seeded=s is not None)
    return idx


def poisson_accountant_event(sampling_probability: float, noise_multiplier: float, steps: int) -> Any:
    """The accountant event of ``steps`` steps of :func:`poisson_sample` at q =
    ``sampling_probability``, each releasing a Gaussian of noise multiplier z:
    ``SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), steps)`` (``NonPrivateEvent``
    for z = 0), as the ledger records such a run (:meth:`dpcore.ledger.PrivacyLedger.to_event`)."""
    from ..events import PoissonSampledEvent

    q = _probability("sampling_probability", sampling_probability)
    return composed(lambda g: PoissonSampledEvent(q, g), noise_multiplier, _count("steps", steps))


@register_sampler
class PoissonSampler(Sampler):
    """Poisson sampling step after step: each step is :func:`poisson_sample` (n, q), keyed from
    the OS at every step (``seed`` for tests only: step t's sample derives from (seed, t)). An
    epoch is round(1/q) steps. The torch, Keras and HF loaders draw Poisson batches themselves
    with the same core sampler; this class is the numpy-side draw and the registry entry."""

    name = "poisson"
    report_text = (
        "each record in each step independently with probability q",
        "Poisson subsampling",
        "PoissonSampledEvent per step (PLD)",
    )
    guarantee = "amplification by Poisson subsampling at rate q (PLD, tight)"
    drawn = False

    def __init__(self, population_size: int, sampling_probability: float, *, seed: Optional[int] = None,
                 ledger: Any = None) -> None:
        n = _count("population_size", population_size, 1)
        self._q = _probability("sampling_probability", sampling_probability)
        if self._q == 0.0:
            raise ValueError("sampling_probability must be > 0 (no record would ever be sampled)")
        self._setup(n, max(1, round(1.0 / self._q)), seed, ledger)

    def _indices(self, t: int) -> np.ndarray:
        return _core.poisson_sample(self._n, self._q, derive(self._seed, _STEP_PATH, t)).astype(np.int64, copy=False)

    @classmethod
    def _planned_event(cls, z, steps, q, n, neighboring, steps_per_epoch, **options):  # type: ignore[no-untyped-def]
        from ..events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent

        return SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), steps)

    @classmethod
    def step_event(cls, sample, z, neighboring, gaussian, acc):  # type: ignore[no-untyped-def]
        # zero-out: the zeroed record is in the sample with probability q and contributes what a
        # removed one would
        return acc.PoissonSampledEvent(sample.sampling_probability, gaussian(z * (0.5 if neighboring == "replace_one" else 1.0)))
