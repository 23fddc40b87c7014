"""Sampling without replacement: b of the n records, uniformly (replace-one adjacency, n public;
``SampledWithoutReplacementEvent(n, b, ·)`` per step)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import _core
from .._validate import count as _count
from ..mechanism import _seed
from ._base import Sampler, derive, ledger_of, register_sampler

_STEP_PATH = 0xF1C5  # derive_seed path of a seeded FixedSizeSampler's steps


def fixed_size_sample(n: int, b: int, *, seed: Optional[int] = None, ledger: Any = None) -> np.ndarray:
    """Sorted indices (int64) of b records drawn uniformly without replacement from n.

    With ``ledger``, records a ``fixed_size_without_replacement`` sampling event (n, b, q = b/n).
    """
    led = ledger_of(ledger)
    n, b = _count("n", n), _count("b", b)
    s = _seed(seed)
    if led is not None and n == 0:
        raise ValueError("n must be >= 1 to record a sample in a ledger")
    idx = _core.fixed_size_sample(n, b, s).astype(np.int64, copy=False)
    if led is not None:
        led.record_sample(n, None, "fixed_size_without_replacement", sample_size=b, seeded=s is not None)
    return idx


@register_sampler
class FixedSizeSampler(Sampler):
    """b records uniformly without replacement at every step (:func:`fixed_size_sample`, keyed
    from the OS at every step). Analysed under replace-one adjacency only (Balle et al. 2018,
    "Privacy amplification by subsampling", Table 1): the batch size b and n are public."""

    name = "fixed_size_without_replacement"
    report_text = (
        "b records drawn uniformly without replacement at each step",
        "sampling without replacement (replace-one relation)",
        "SampledWithoutReplacementEvent per step (RDP)",
    )
    relations = ("replace_one",)
    default_relation = "replace_one"
    default_accountant = "rdp"
    guarantee = "amplification by sampling b of n without replacement (replace-one)"
    selectable = False
    planned = False

    def __init__(self, population_size: int, sample_size: int, *, seed: Optional[int] = None, ledger: Any = None) -> None:
        n = _count("population_size", population_size, 1)
        b = _count("sample_size", sample_size, 1)
        if b > n:
            raise ValueError(f"sample_size {b} is larger than the population ({n} records)")
        self._b = b
        self._q = b / n
        self._setup(n, max(1, round(n / b)), seed, ledger)

    def _indices(self, t: int) -> np.ndarray:
        return _core.fixed_size_sample(self._n, self._b, derive(self._seed, _STEP_PATH, t)).astype(np.int64, copy=False)

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        ledger.record_sample(self._n, None, self.policy, sample_size=self._b, seeded=self.seeded)

    def _config(self) -> dict:
        return {"population_size": self._n, "sample_size": self._b}

    @classmethod
    def step_event(cls, sample, z, neighboring, gaussian, acc):  # type: ignore[no-untyped-def]
        if neighboring == "zero_out":  # the zeroed record is in the sample with probability b/n
            return acc.PoissonSampledEvent(sample.sampling_probability, gaussian(z))
        zs = z * (0.5 if neighboring == "replace_one" else 1.0)
        return acc.SampledWithoutReplacementEvent(sample.population_size, sample.sample_size, gaussian(zs))
