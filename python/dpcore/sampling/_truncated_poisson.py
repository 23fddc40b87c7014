"""Truncated Poisson sampling: a Poisson sample at q capped at B records (a uniformly random B of
them when more are drawn), accounted per step by ``TruncatedPoissonSampledEvent(q, B, n, ·)``
(the add-or-remove pair checked by enumeration in ``rust/accounting/pld/truncated.rs``;
arXiv 2508.15089)."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from .. import _core
from .._validate import count as _count, probability as _probability
from ..mechanism import _seed
from ._base import Sampler, composed, derive, ledger_of, register_sampler

# ============================================================================ truncated Poisson
#
# A Poisson sample capped at B records bounds a step's memory. When the Poisson sample holds
# more than B records, a uniformly random B of them are kept: a fixed-size sample (ChaCha20) of
# the sample's positions. The accountant analyses exactly this (TruncatedPoissonSampledEvent):
# the cap makes a record's inclusion depend on how many others were drawn.

_TRUNCATED_CUT_PATH = 0x7C47  # derive_seed path of the cut of a seeded truncated Poisson sample
_TRUNCATED_STEP_PATH = 0x7C48  # derive_seed path of a seeded TruncatedPoissonSampler's steps


def _truncated_poisson(n: int, q: float, cap: int, seed: Optional[int]) -> np.ndarray:
    """Poisson(n, q) from ``seed`` (the OS when None), cut to a uniform ``cap`` of its records
    when larger (the cut keyed from the OS too, or derived from ``seed``)."""
    idx = _core.poisson_sample(n, q, seed).astype(np.int64, copy=False)
    if idx.size > cap:
        keep = _core.fixed_size_sample(idx.size, cap, derive(seed, _TRUNCATED_CUT_PATH)).astype(np.int64, copy=False)
        idx = idx[keep]  # keep is sorted: so is idx
    return idx


def _truncated_args(n: Any, q: Any, cap: Any, names: "tuple[str, str, str]") -> "tuple[int, float, int]":
    n = _count(names[0], n, 1)
    q = _probability(names[1], q)
    cap = _count(names[2], cap, 1)
    if cap > n:
        raise ValueError(
            f"{names[2]} {cap} is larger than the population ({n} records): the cap would never bind; "
            f"give at most {n} (or use poisson_sample)"
        )
    return n, q, cap


def truncated_poisson_sample(
    n: int, q: float, max_batch_size: int, *, seed: Optional[int] = None, ledger: Any = None
) -> np.ndarray:
    """Sorted indices (int64) of a truncated Poisson sample: each of the n records joins with
    probability q (:func:`poisson_sample`), and when more than ``max_batch_size`` = B joined, a
    uniformly random B of them are kept (:func:`fixed_size_sample` of the sample's positions).
    The batch size is min(Bin(n, q), B); a record is included with probability
    q·E[min(1, B/(1 + Bin(n−1, q)))].

    Both draws are keyed from the OS (``seed``, for tests only, gives the same Poisson sample as
    ``poisson_sample(n, q, seed=seed)``, then a cut derived from it). With ``ledger``, records a
    ``truncated_poisson`` sampling event (n, q, ``sample_size`` = B), which the accountant reads
    as ``TruncatedPoissonSampledEvent(q, B, n, ·)``.
    """
    led = ledger_of(ledger)
    n, q, cap = _truncated_args(n, q, max_batch_size, ("n", "q", "max_batch_size"))
    s = _seed(seed)
    idx = _truncated_poisson(n, q, cap, s)
    if led is not None:
        led.record_sample(n, q, "truncated_poisson", sample_size=cap, seeded=s is not None)
    return idx


def _expected_truncated(n: int, q: float, cap: int) -> float:
    """E[min(Bin(n, q), cap)], summed over the binomial's bulk (mean ± 40 sd: the tails left out
    weigh less than e⁻⁸⁰⁰)."""
    if q == 1.0:
        return float(cap)
    mean, sd = n * q, math.sqrt(n * q * (1.0 - q))
    lo, hi = max(0, int(mean - 40 * sd) - 40), min(n, int(mean + 40 * sd) + 40)
    if lo >= cap:
        return float(cap)
    if hi <= cap:
        return mean
    ln_n1, ln_q, ln_1q = math.lgamma(n + 1), math.log(q), math.log1p(-q)
    total = 0.0
    for j in range(lo, hi + 1):
        lp = ln_n1 - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * ln_q + (n - j) * ln_1q
        total += math.exp(lp) * min(j, cap)
    return total


@register_sampler
class TruncatedPoissonSampler(Sampler):
    """Truncated Poisson sampling step after step: each step is
    :func:`truncated_poisson_sample` (n, q, cap B), keyed from the OS at every step.

    It has no rounds: a step is a sample of its own, and the accountant reads one
    ``TruncatedPoissonSampledEvent(q, B, n, ·)`` per step (the cap, and so the event, needs n).
    An "epoch" is ``len(self)`` = round(1/q) steps (each record then takes part about once), for
    loaders that iterate by epochs. With ``ledger``, :meth:`draw` records a
    ``"truncated_poisson"`` sample. ``seed`` is for tests only (the ledger marks its samples
    ``seeded``): step t's sample then derives from (seed, t).
    """

    name = "truncated_poisson"
    report_text = (
        "Poisson sampling at q, capped at b records (a uniformly random b of them when more are drawn)",
        "Poisson subsampling, weakened where the cap binds",
        "TruncatedPoissonSampledEvent per step (PLD)",
    )
    guarantee = "Poisson amplification, slightly weakened where the cap binds (PLD)"
    options = {"max_batch_size": None}

    def __init__(
        self, population_size: int, sampling_probability: float, max_batch_size: int, *, seed: Optional[int] = None,
        ledger: Any = None,
    ) -> None:
        n, q, cap = _truncated_args(
            population_size, sampling_probability, max_batch_size, ("population_size", "sampling_probability", "max_batch_size")
        )
        if q == 0.0:
            raise ValueError("sampling_probability must be > 0 (no record would ever be sampled)")
        self._q, self._cap = q, cap
        self._setup(n, max(1, int(round(1.0 / q))), seed, ledger)
        self._expected: Optional[float] = None

    @property
    def sampling_probability(self) -> float:
        """q, the Poisson rate (a record's inclusion rate is lower where the cap binds)."""
        return self._q

    @property
    def max_batch_size(self) -> int:
        """B, the cap on a step's batch."""
        return self._cap

    @property
    def expected_batch_size(self) -> float:
        """E[min(Bin(n, q), B)], the mean batch (at most q·n)."""
        if self._expected is None:
            self._expected = _expected_truncated(self._n, self._q, self._cap)
        return self._expected

    def _indices(self, t: int) -> np.ndarray:
        return _truncated_poisson(self._n, self._q, self._cap, derive(self._seed, _TRUNCATED_STEP_PATH, t))

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        ledger.record_sample(self._n, self._q, self.policy, sample_size=self._cap, seeded=self.seeded)

    def accountant_event(self, noise_multiplier: float, steps: int) -> Any:
        """The event of ``steps`` steps of this sampler, each releasing a Gaussian of noise
        multiplier z: ``SelfComposedEvent(TruncatedPoissonSampledEvent(q, B, n,
        GaussianEvent(z)), steps)`` (``NonPrivateEvent`` for z = 0), as the ledger records them."""
        from ..events import TruncatedPoissonSampledEvent

        return composed(
            lambda g: TruncatedPoissonSampledEvent(self._q, self._cap, self._n, g), noise_multiplier, _count("steps", steps)
        )

    def _config(self) -> dict:
        return {"population_size": self._n, "sampling_probability": self._q, "max_batch_size": self._cap}

    @classmethod
    def _planned_event(cls, z, steps, q, n, neighboring, steps_per_epoch, max_batch_size=None):  # type: ignore[no-untyped-def]
        from ..events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent, TruncatedPoissonSampledEvent

        if n is None or max_batch_size is None:
            raise ValueError("truncated_poisson needs population_size and max_batch_size")
        g = GaussianEvent(z)
        if neighboring == "zero_out":  # the record is in the batch with probability at most q
            return SelfComposedEvent(PoissonSampledEvent(q, g), steps)
        return SelfComposedEvent(TruncatedPoissonSampledEvent(q, max_batch_size, n, g), steps)

    @classmethod
    def step_event(cls, sample, z, neighboring, gaussian, acc):  # type: ignore[no-untyped-def]
        if neighboring == "zero_out":  # still takes its place under the cap: in the batch w.p. at most q
            return acc.PoissonSampledEvent(sample.sampling_probability, gaussian(z))
        zs = z * (0.5 if neighboring == "replace_one" else 1.0)
        return acc.TruncatedPoissonSampledEvent(sample.sampling_probability, sample.sample_size,
                                                sample.population_size, gaussian(zs))

    @classmethod
    def for_batch_size(cls, population_size: int, batch_size: float, *, seed: Optional[int] = None,
                       ledger: Any = None, max_batch_size: Any = None, **options: Any) -> "TruncatedPoissonSampler":
        """q = min(1, bs/n), B = ``max_batch_size`` (B ≥ n never binds: recorded as n, the same
        mechanism)."""
        n = _count("population_size", population_size, 1)
        cap = _count("max_batch_size", max_batch_size, 1)
        return cls(n, min(1.0, float(batch_size) / n), min(cap, n), seed=seed, ledger=ledger)
