"""Record sampling from ChaCha20 (McMahan et al. 2018, §5; Abadi et al. 2016, "lots").

The sampling probability feeds privacy amplification in the accountant, so the sample must come
from a cryptographically secure generator: every sampler is keyed from the OS on every call (a
step, for the sampler classes). ``seed`` is for tests and reproductions only; a seeded sample is
predictable and gives no amplification in truth (the ledger marks it ``seeded`` and the
accountant warns).

Given ``ledger=`` (a :class:`dpcore.ledger.PrivacyLedger`), a sampler records the sampling event
with the policy it actually used (§6); the entry becomes durable with the sample's first release.
The accountant then analyses the sampling that was run, not another one:

========================  =======================  ==================================================  ==========================================
sampler                   ledger policy            what the accountant assumes                         event
========================  =======================  ==================================================  ==========================================
poisson_sample            ``poisson``              each record in each step independently with         ``PoissonSampledEvent(q, ·)`` per step
                                                   probability q
TruncatedPoissonSampler   ``truncated_poisson``    Poisson at q, then, when more than B records were   ``TruncatedPoissonSampledEvent(q, B, n,
                                                   drawn, a uniformly random B of them (one such       ·)`` per step
                                                   step: truncated_poisson_sample)
fixed_size_sample         ``fixed_size_without_    b of the n records uniformly without replacement    ``SampledWithoutReplacementEvent(n, b,
                          replacement``            (replace-one: n is public)                          ·)`` per step
RandomAllocationSampler   ``random_allocation``    every record in exactly k of each round's t steps,  ``RandomAllocationSampledEvent(t, k, ·)``
                                                   a uniformly random k-subset, independently of the   per round (Feldman & Shenfeld 2025,
                                                   other records                                       arXiv 2502.08202)
BallsInBinsSampler        ``balls_in_bins``        every record in exactly one of each epoch's b       ``BallsInBinsSampledEvent(b, ·)`` per
                                                   steps, uniformly and independently                  epoch (Chua et al. 2025, arXiv 2412.16802)
CyclicBatches             ``cyclic``               fixed batches cut once, batch t mod b: no           accounted per matrix-factorization stream
                                                   amplification
CyclicPoissonSampler      ``cyclic_poisson``       group t mod b of a partition cut once, each of its  accounted per matrix-factorization stream
                                                   records with probability p
========================  =======================  ==================================================  ==========================================

Each sampler class has :meth:`accountant_event`: the event of its next ``steps`` steps with a
Gaussian of a given noise multiplier, for calibrating the noise before a run
(:func:`poisson_accountant_event` for :func:`poisson_sample`).
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from . import _core
from .mechanism import _real, _seed
from ._validate import count as _count, probability as _probability



def _ledger(ledger: Any) -> Any:
    if ledger is None:
        return None
    from .ledger import PrivacyLedger

    if not isinstance(ledger, PrivacyLedger):
        raise TypeError(f"ledger must be a dpcore.ledger.PrivacyLedger or None, got {type(ledger).__name__}")
    return ledger


def poisson_sample(n: int, q: float, *, seed: Optional[int] = None, ledger: Any = None) -> np.ndarray:
    """Sorted indices (int64) of a Poisson sample: each of the n records joins with probability q.

    Drawn with geometric skips between selected indices (expected O(q·n) work). The sample may
    be empty. This is the sampling that the subsampled-Gaussian accountant assumes. With
    ``ledger``, records a ``poisson`` sampling event (n, q).
    """
    led = _ledger(ledger)
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
    from .events import PoissonSampledEvent

    q = _probability("sampling_probability", sampling_probability)
    return _composed(lambda g: PoissonSampledEvent(q, g), noise_multiplier, _count("steps", steps))


def _composed(wrap: Any, noise_multiplier: Any, count: int) -> Any:
    """``SelfComposedEvent(wrap(GaussianEvent(z)), count)``, or ``NonPrivateEvent`` for z = 0
    (as the ledger turns a non-private release)."""
    from .events import GaussianEvent, NonPrivateEvent, SelfComposedEvent

    z = _real("noise_multiplier", noise_multiplier)
    if not z >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {z}")
    if z == 0.0 and count > 0:
        return NonPrivateEvent()
    return SelfComposedEvent(wrap(GaussianEvent(z)), count)


def fixed_size_sample(n: int, b: int, *, seed: Optional[int] = None, ledger: Any = None) -> np.ndarray:
    """Sorted indices (int64) of b records drawn uniformly without replacement from n.

    With ``ledger``, records a ``fixed_size_without_replacement`` sampling event (n, b, q = b/n).
    """
    led = _ledger(ledger)
    n, b = _count("n", n), _count("b", b)
    s = _seed(seed)
    if led is not None and n == 0:
        raise ValueError("n must be >= 1 to record a sample in a ledger")
    idx = _core.fixed_size_sample(n, b, s).astype(np.int64, copy=False)
    if led is not None:
        led.record_sample(n, None, "fixed_size_without_replacement", sample_size=b, seeded=s is not None)
    return idx


# ============================================================================ cyclic samplers
#
# Matrix-factorization (correlated-noise) mechanisms need no random sampling; their sensitivity is
# taken over every participation pattern that a fixed, cyclic order allows (Choquette-Choo et al.
# 2022, arXiv 2211.06530, §2; amplified banded MF, Choquette-Choo et al. 2023, arXiv 2306.08153).
# The partition is cut once, from a ChaCha20 permutation. Which partition it is does not enter the
# guarantee (any data-independent partition gives the same sensitivity), so its 64-bit key is kept
# in the sampler's state: a resumed run re-derives the same permutation and continues the same
# cyclic order, which the sensitivity argument needs (a record's participations exactly b steps
# apart). The per-step Poisson draws of cyclic Poisson sampling, which the amplification does
# rest on, are keyed from the OS at every step (a test seed aside) and never stored.

_PERMUTATION_PATH = 0xC1C1  # derive_seed path of a seeded sampler's permutation key
_POISSON_PATH = 0x9015  # derive_seed path of a seeded sampler's per-step Poisson draws


def _os_key() -> int:
    import os

    return int.from_bytes(os.urandom(8), "little")


def _derive(seed: Optional[int], *path: int) -> Optional[int]:
    from .queries.base import derive_seed

    return derive_seed(seed, *path)


def _permutation(n: int, key: int) -> np.ndarray:
    """The permutation of range(n) keyed by ``key``: the stable argsort of n ChaCha20 normals
    (ties have probability ~2⁻⁵³ per pair and are broken by index, deterministically)."""
    from .mechanism import gaussian_noise

    keys = gaussian_noise((n,), 1.0, dtype=np.float64, seed=key)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


class _CyclicBase:
    """A partition of range(n) cut once from a keyed permutation, visited cyclically."""

    kind = ""

    def __init__(self, n: int, cycle_length: int, seed: Optional[int], ledger: Any) -> None:
        self._ledger = _ledger(ledger)
        self._seed = _seed(seed)
        self._n = n
        self._b = cycle_length
        self._key = _os_key() if self._seed is None else int(_derive(self._seed, _PERMUTATION_PATH))  # type: ignore[arg-type]
        self._perm = _permutation(n, self._key)
        self._perm.setflags(write=False)
        self._position = 0

    # -- what the sampler is -------------------------------------------------------------

    @property
    def population_size(self) -> int:
        return self._n

    @property
    def steps_per_epoch(self) -> int:
        """b: the number of batches (groups) of the partition, the cycle length."""
        return self._b

    @property
    def position(self) -> int:
        """The next step t (steps drawn so far, from the start of the run)."""
        return self._position

    @property
    def epoch(self) -> int:
        return self._position // self._b

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    @property
    def ledger(self) -> Any:
        return self._ledger

    @property
    def permutation(self) -> np.ndarray:
        """The permutation the partition was cut from (read-only)."""
        return self._perm

    def members(self, group: int) -> np.ndarray:
        """The records of batch (group) ``group`` of the partition, sorted (int64)."""
        g = _count("group", group)
        if g >= self._b:
            raise ValueError(f"group must be < {self._b}, got {g}")
        lo, hi = self._bounds(g)
        return np.sort(self._perm[lo:hi])

    def groups(self) -> np.ndarray:
        """The batch (group) of every record: an int64 array of n values in [0, b), −1 for a
        record left out of the partition (fixed batches drop the n − b·batch_size rest)."""
        out = np.full(self._n, -1, np.int64)
        for g in range(self._b):
            lo, hi = self._bounds(g)
            out[self._perm[lo:hi]] = g
        return out

    def _bounds(self, g: int) -> "tuple[int, int]":
        raise NotImplementedError

    # -- drawing ----------------------------------------------------------------------------

    def draw(self) -> np.ndarray:
        """The sorted record indices (int64) of step t = :attr:`position`, recorded in the ledger
        (when one was given); then t ← t + 1."""
        idx = self._indices(self._position)
        if self._ledger is not None:
            self._record(self._ledger, idx)
        self._position += 1
        return idx

    def __iter__(self) -> Any:
        """The rest of the current epoch: steps :attr:`position` … up to the next multiple of b
        (a full epoch when a new one begins). Each is drawn (and recorded) as it is yielded."""
        end = (self._position // self._b + 1) * self._b
        while self._position < end:
            yield self.draw()

    def __len__(self) -> int:
        return self._b

    def _indices(self, t: int) -> np.ndarray:
        raise NotImplementedError

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        raise NotImplementedError

    # -- checkpoints --------------------------------------------------------------------------

    def _config(self) -> dict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The sampler's configuration, the key of its permutation and its position (plain
        Python values). A sampler built with the same configuration and loaded with this state
        continues the same cyclic order from the same step."""
        return {"kind": self.kind, **self._config(), "key": int(self._key), "position": int(self._position),
                "seeded": self._seed is not None}

    def check_state_dict(self, state: Any) -> None:
        """Raises ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            got = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not the state of a {self.kind!r} sampler (kind {got!r})")
        for k, v in self._config().items():
            if state.get(k) != v:
                raise ValueError(
                    f"the sampler state has {k}={state.get(k)!r}, this sampler {k}={v!r}: a resumed run must cut the "
                    "same partition (the sensitivity of the correlated noise depends on it)"
                )
        for k in ("key", "position"):
            v = state.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"sampler state: {k} must be a non-negative int, got {v!r}")
        _seed(state["key"])  # in [0, 2**64)

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`: the same permutation (re-derived from its key) and
        position. A seeded sampler's later Poisson draws (cyclic Poisson) derive from this
        sampler's own test seed and the step."""
        self.check_state_dict(state)
        key = int(state["key"])
        if key != self._key:
            perm = _permutation(self._n, key)
            perm.setflags(write=False)
            self._key, self._perm = key, perm
        self._position = int(state["position"])


class CyclicBatches(_CyclicBase):
    """Fixed batches visited cyclically, for matrix-factorization mechanisms (the ``"cyclic"``
    participation schema, :class:`dpcore.matrix_factorization.Participation`).

    The n records are shuffled once with a ChaCha20 permutation (keyed from the OS; ``seed`` for
    tests only) and cut into b = n // batch_size batches of exactly ``batch_size`` records; the
    n − b·batch_size records left over are dropped from training altogether (:attr:`dropped`),
    so that every batch, and every record's participations, are alike. Step t uses batch t mod
    b: each record takes part exactly once per epoch, exactly b steps apart.

    With ``ledger``, :meth:`draw` records a ``"cyclic"`` sample (population n, ``sample_size``
    = batch_size, sampling probability batch_size/n for information: fixed batches get no
    amplification, the mechanism's own sensitivity covers every participation pattern).
    """

    kind = "cyclic"

    def __init__(self, population_size: int, batch_size: int, *, seed: Optional[int] = None, ledger: Any = None) -> None:
        n = _count("population_size", population_size, 1)
        bs = _count("batch_size", batch_size, 1)
        if bs > n:
            raise ValueError(f"batch_size {bs} is larger than the population ({n} records): not even one fixed batch")
        self._bs = bs
        super().__init__(n, n // bs, seed, ledger)

    @property
    def batch_size(self) -> int:
        return self._bs

    @property
    def dropped(self) -> int:
        """Records left out of every batch (n − b·batch_size, fewer than batch_size)."""
        return self._n - self._b * self._bs

    @property
    def sampling_probability(self) -> float:
        """batch_size/n, as recorded (fixed batches are not amplified)."""
        return self._bs / self._n

    @property
    def expected_batch_size(self) -> float:
        return float(self._bs)

    @property
    def participation(self) -> Any:
        """The :class:`~dpcore.matrix_factorization.Participation` of this order: cyclic with
        min_separation b."""
        from .matrix_factorization._participation import Participation

        return Participation.cyclic(self._b)

    def _bounds(self, g: int) -> "tuple[int, int]":
        return g * self._bs, (g + 1) * self._bs

    def _indices(self, t: int) -> np.ndarray:
        return self.members(t % self._b)

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        ledger.record_sample(self._n, self.sampling_probability, "cyclic", sample_size=self._bs, seeded=self.seeded)

    def _config(self) -> dict:
        return {"population_size": self._n, "batch_size": self._bs}

    def __repr__(self) -> str:
        return f"CyclicBatches(population_size={self._n}, batch_size={self._bs}, batches={self._b}, position={self._position})"


class CyclicPoissonSampler(_CyclicBase):
    """Cyclic Poisson sampling, for amplified banded matrix factorization (the
    ``"cyclic_poisson"`` participation schema; Choquette-Choo et al. 2023, arXiv 2306.08153).

    The n records are shuffled once with a ChaCha20 permutation (keyed from the OS; ``seed`` for
    tests only) and cut into b = ``cycle_length`` groups of near-equal size (⌊n/b⌋ or ⌈n/b⌉
    records; none dropped). Step t samples group t mod b: each of its records is included
    independently with probability p (:func:`poisson_sample`, keyed from the OS at every step).
    A record can thus only take part at steps ≡ its group (mod b). The expected batch is
    p·n/b records; a batch may be empty.

    With ``ledger``, :meth:`draw` records a ``"cyclic_poisson"`` sample (population n, sampling
    probability p).
    """

    kind = "cyclic_poisson"

    def __init__(
        self, population_size: int, cycle_length: int, sampling_probability: float, *, seed: Optional[int] = None,
        ledger: Any = None,
    ) -> None:
        from ._validate import probability

        n = _count("population_size", population_size, 1)
        b = _count("cycle_length", cycle_length, 1)
        if b > n:
            raise ValueError(f"cycle_length {b} is larger than the population ({n} records): a group would be empty")
        p = probability("sampling_probability", sampling_probability)
        if p == 0.0:
            raise ValueError("sampling_probability must be > 0 (no record would ever be sampled)")
        self._p = p
        super().__init__(n, b, seed, ledger)

    @property
    def sampling_probability(self) -> float:
        return self._p

    @property
    def expected_batch_size(self) -> float:
        """p·n/b: the fixed denominator of an average over one step's sample."""
        return self._p * self._n / self._b

    @property
    def participation(self) -> Any:
        """Cyclic Poisson with min_separation b and sampling probability p."""
        from .matrix_factorization._participation import Participation

        return Participation.cyclic_poisson(self._b, self._p)

    def _bounds(self, g: int) -> "tuple[int, int]":
        q, r = divmod(self._n, self._b)  # the first r groups hold one record more
        lo = g * q + min(g, r)
        return lo, lo + q + (1 if g < r else 0)

    def _indices(self, t: int) -> np.ndarray:
        lo, hi = self._bounds(t % self._b)
        seed = _derive(self._seed, _POISSON_PATH, t)
        pick = _core.poisson_sample(hi - lo, self._p, seed).astype(np.int64, copy=False)
        return np.sort(self._perm[lo:hi][pick])

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        ledger.record_sample(self._n, self._p, "cyclic_poisson", seeded=self.seeded)

    def _config(self) -> dict:
        return {"population_size": self._n, "cycle_length": self._b, "sampling_probability": self._p}

    def __repr__(self) -> str:
        return (
            f"CyclicPoissonSampler(population_size={self._n}, cycle_length={self._b}, "
            f"sampling_probability={self._p}, position={self._position})"
        )


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
        keep = _core.fixed_size_sample(idx.size, cap, _derive(seed, _TRUNCATED_CUT_PATH)).astype(np.int64, copy=False)
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
    led = _ledger(ledger)
    n, q, cap = _truncated_args(n, q, max_batch_size, ("n", "q", "max_batch_size"))
    s = _seed(seed)
    idx = _truncated_poisson(n, q, cap, s)
    if led is not None:
        led.record_sample(n, q, "truncated_poisson", sample_size=cap, seeded=s is not None)
    return idx


def _expected_truncated(n: int, q: float, cap: int) -> float:
    """E[min(Bin(n, q), cap)], summed over the binomial's bulk (mean ± 40 sd: the tails left out
    weigh less than e⁻⁸⁰⁰)."""
    import math

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


class TruncatedPoissonSampler:
    """Truncated Poisson sampling step after step: each step is
    :func:`truncated_poisson_sample` (n, q, cap B), keyed from the OS at every step.

    It has no rounds: a step is a sample of its own, and the accountant reads one
    ``TruncatedPoissonSampledEvent(q, B, n, ·)`` per step (the cap, and so the event, needs n).
    An "epoch" is ``len(self)`` = round(1/q) steps (each record then takes part about once), for
    loaders that iterate by epochs. With ``ledger``, :meth:`draw` records a
    ``"truncated_poisson"`` sample. ``seed`` is for tests only (the ledger marks its samples
    ``seeded``): step t's sample then derives from (seed, t).
    """

    kind = "truncated_poisson"

    def __init__(
        self, population_size: int, sampling_probability: float, max_batch_size: int, *, seed: Optional[int] = None,
        ledger: Any = None,
    ) -> None:
        n, q, cap = _truncated_args(
            population_size, sampling_probability, max_batch_size, ("population_size", "sampling_probability", "max_batch_size")
        )
        if q == 0.0:
            raise ValueError("sampling_probability must be > 0 (no record would ever be sampled)")
        self._ledger = _ledger(ledger)
        self._seed = _seed(seed)
        self._n, self._q, self._cap = n, q, cap
        self._len = max(1, int(round(1.0 / q)))
        self._position = 0
        self._expected: Optional[float] = None

    # -- what the sampler is -------------------------------------------------------------

    @property
    def policy(self) -> str:
        """The ledger policy of its samples, ``"truncated_poisson"``."""
        return self.kind

    @property
    def population_size(self) -> int:
        return self._n

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

    @property
    def steps_per_epoch(self) -> int:
        """round(1/q): the steps after which each record took part about once."""
        return self._len

    @property
    def position(self) -> int:
        """The next step t (steps drawn so far, from the start of the run)."""
        return self._position

    @property
    def epoch(self) -> int:
        return self._position // self._len

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    @property
    def ledger(self) -> Any:
        return self._ledger

    # -- drawing ----------------------------------------------------------------------------

    def draw(self) -> np.ndarray:
        """The sorted record indices (int64) of the next step, recorded in the ledger (when one
        was given)."""
        seed = _derive(self._seed, _TRUNCATED_STEP_PATH, self._position)
        idx = _truncated_poisson(self._n, self._q, self._cap, seed)
        if self._ledger is not None:
            self._ledger.record_sample(self._n, self._q, self.kind, sample_size=self._cap, seeded=self.seeded)
        self._position += 1
        return idx

    def __iter__(self) -> Any:
        """The rest of the current epoch: steps :attr:`position` … up to the next multiple of
        ``len(self)`` (a full epoch when a new one begins)."""
        end = (self._position // self._len + 1) * self._len
        while self._position < end:
            yield self.draw()

    def __len__(self) -> int:
        return self._len

    def accountant_event(self, noise_multiplier: float, steps: int) -> Any:
        """The event of ``steps`` steps of this sampler, each releasing a Gaussian of noise
        multiplier z: ``SelfComposedEvent(TruncatedPoissonSampledEvent(q, B, n,
        GaussianEvent(z)), steps)`` (``NonPrivateEvent`` for z = 0), as the ledger records them."""
        from .events import TruncatedPoissonSampledEvent

        return _composed(
            lambda g: TruncatedPoissonSampledEvent(self._q, self._cap, self._n, g), noise_multiplier, _count("steps", steps)
        )

    # -- checkpoints --------------------------------------------------------------------------

    def _config(self) -> dict:
        return {"population_size": self._n, "sampling_probability": self._q, "max_batch_size": self._cap}

    def state_dict(self) -> dict:
        """The configuration and the position (plain Python values). There is no other state:
        every step is a fresh sample."""
        return {"kind": self.kind, **self._config(), "position": int(self._position), "seeded": self.seeded}

    def check_state_dict(self, state: Any) -> None:
        """Raises ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        _check_state(self.kind, self._config(), state, "the same sampling (the accountant reads the recorded one)")
        _state_int(state, "position", 0)

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`'s position (a seeded sampler then continues its stream)."""
        self.check_state_dict(state)
        self._position = int(state["position"])

    def __repr__(self) -> str:
        return (
            f"TruncatedPoissonSampler(population_size={self._n}, sampling_probability={self._q}, "
            f"max_batch_size={self._cap}, position={self._position})"
        )


def _check_state(kind: str, config: dict, state: Any, why: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not the state of a {kind!r} sampler (kind {got!r})")
    for k, v in config.items():
        if state.get(k) != v:
            raise ValueError(f"the sampler state has {k}={state.get(k)!r}, this sampler {k}={v!r}: a resumed run must use {why}")


def _state_int(state: dict, key: str, lo: int, hi: Optional[int] = None) -> int:
    v = state.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"sampler state: {key} must be {bound}, got {v!r}")
    return v


# ============================================================================ random allocation
#
# Random allocation (Feldman & Shenfeld 2025, arXiv 2502.08202): in each round of t steps every
# record takes part in exactly k steps, a uniformly random k-subset of the t, chosen
# independently of the other records; balls-in-bins (Chua et al. 2025, arXiv 2412.16802) is
# k = 1. The amplification rests on the round's assignment being secret, so it is drawn step by
# step and never stored (no state dict or checkpoint holds it):
#
# Sequential selection sampling. At step s of a round (s = 0 … t−1), a record that still has r
# steps to take part in joins with probability r/(t−s). For one record this yields a uniform
# r-subset of the remaining steps: by induction on t−s, the first remaining step is in a uniform
# r-subset of t−s steps with probability C(t−s−1, r−1)/C(t−s, r) = r/(t−s), and the rest is a
# uniform subset of the steps after it (of size r−1 if it joined, r if not). A record with
# r = t−s joins with probability 1, so every record ends the round with r = 0: exactly k steps.
# Records are independent because each one's joins are independent Bernoulli draws.
#
# The records with the same r are drawn together with the core's Poisson sampler (ChaCha20,
# keyed from the OS at every step and group; geometric skips: work ∝ the records drawn). Each
# group keeps an array of its records; a record leaving the group (its r decreased) stays in the
# array until the array is compacted, which happens when fewer than half are still members; a
# draw over the array then discards the stale entries it hits (each member is still joined with
# probability r/(t−s), independently). So a round costs O(n·k) work: n·k joins in all, each
# moving one record once, and compactions paid for by those moves.

_ALLOCATION_PATH = 0xA110  # derive_seed path of a seeded allocation sampler's draws


class _Round:
    """The assignment of one allocation round while it is being drawn: ``left[i]`` = the steps
    record i has still to take part in, ``members[r]`` = an array holding every record with
    ``left == r`` (and stale ones, with a smaller ``left``) in its first ``fill[r]`` entries."""

    __slots__ = ("left", "members", "fill", "live")

    def __init__(self, n: int, k: int) -> None:
        self.left = np.full(n, k, dtype=np.int32 if k < 2**31 else np.int64)
        self.members: List[Optional[np.ndarray]] = [None] * (k + 1)
        self.members[k] = np.arange(n, dtype=np.int64)
        self.fill = [0] * (k + 1)
        self.live = [0] * (k + 1)
        self.fill[k] = self.live[k] = n

    def step(self, s: int, t: int, key: Any) -> np.ndarray:
        """The records that take part in step s (sorted int64); ``key(r)`` is the ChaCha20 key
        of group r's draw (None: from the OS)."""
        joined = []
        for r in range(1, len(self.members)):
            if self.live[r] == 0:
                continue
            if r > t - s:  # cannot happen: a record with r = t−s joins with probability 1
                raise RuntimeError(f"random allocation: {self.live[r]} record(s) need {r} of the last {t - s} steps")
            group = self.members[r][: self.fill[r]]  # type: ignore[index]
            pos = _core.poisson_sample(group.size, r / (t - s), key(r)).astype(np.int64, copy=False)
            rec = group[pos]
            if self.fill[r] != self.live[r]:
                rec = rec[self.left[rec] == r]  # drop the stale entries drawn
            joined.append((r, rec))
        for r, rec in joined:  # after all groups are drawn: each record once per step
            self.left[rec] = r - 1
            self.live[r] -= rec.size
            if r > 1 and rec.size:
                self._push(r - 1, rec)
            if 2 * self.live[r] < self.fill[r]:
                self._compact(r)
        if not joined:
            return np.empty(0, np.int64)
        out = np.concatenate([rec for _, rec in joined]) if len(joined) > 1 else joined[0][1]
        out.sort()
        return out

    def _push(self, r: int, rec: np.ndarray) -> None:
        buf, f = self.members[r], self.fill[r]
        if buf is None or f + rec.size > buf.size:
            # A record enters group r at most once a round: n entries always suffice.
            grown = np.empty(min(self.left.size, max(64, 2 * (f + rec.size))), np.int64)
            if buf is not None:
                grown[:f] = buf[:f]
            self.members[r] = buf = grown
        buf[f : f + rec.size] = rec
        self.fill[r] = f + rec.size
        self.live[r] += rec.size

    def _compact(self, r: int) -> None:
        buf, f = self.members[r], self.fill[r]
        assert buf is not None
        keep = buf[:f][self.left[buf[:f]] == r]
        buf[: keep.size] = keep
        self.fill[r] = keep.size


class RandomAllocationSampler:
    """Random allocation (Feldman & Shenfeld 2025, "Privacy amplification by random allocation",
    arXiv 2502.08202): rounds of t = ``num_steps`` steps in which every record takes part in
    exactly k = ``num_selected`` steps, a uniformly random k-subset of the t, chosen
    independently of the other records.

    A step's batch holds about n·k/t records (Bin(n, k/t) each, the batches of a round summing
    to n·k); it may be empty. The round's assignment is drawn as the round goes (sequential
    selection sampling, keyed from the OS at every step: see the comment above this class), so
    the steps to come are not fixed before they are drawn.

    With ``ledger``, :meth:`draw` records a ``"random_allocation"`` sample naming its round (the
    ledger's :attr:`~dpcore.ledger.PrivacyLedger.next_round` when the round begins) and its step;
    the accountant reads each round as one ``RandomAllocationSampledEvent(t, k, ·)``, whether all
    its steps were released or only some. ``seed`` is for tests only (the ledger marks its
    samples ``seeded``).

    **Resuming.** The round's assignment is what the amplification rests on, so it is never
    stored: not in :meth:`state_dict`, not when the sampler is pickled. A sampler restored from a
    state dict (or unpickled) starts a *new* round at its next draw; the interrupted round's
    remaining steps are skipped (some records then took part in fewer than k of its steps), and
    the ledger accounts the interrupted round as a whole round anyway (post-processing).
    """

    kind = "random_allocation"

    def __init__(
        self, population_size: int, num_steps: int, num_selected: int = 1, *, seed: Optional[int] = None,
        ledger: Any = None,
    ) -> None:
        n = _count("population_size", population_size, 1)
        t = _count("num_steps", num_steps, 1)
        k = _count("num_selected", num_selected, 1)
        if k > t:
            raise ValueError(f"num_selected {k} is larger than num_steps {t}: a record cannot take part in more steps than a round has")
        self._init(n, t, k, seed, ledger)

    def _init(self, n: int, t: int, k: int, seed: Optional[int], ledger: Any) -> None:
        self._ledger = _ledger(ledger)
        self._seed = _seed(seed)
        self._n, self._t, self._k = n, t, k
        self._round = -1  # this sampler's count of rounds begun (seeds derive from it)
        self._ledger_round: Optional[int] = None  # the current round's index in the ledger
        self._position = 0
        self._state: Optional[_Round] = None

    # -- what the sampler is -------------------------------------------------------------

    @property
    def policy(self) -> str:
        """The ledger policy of its samples."""
        return self.kind

    @property
    def population_size(self) -> int:
        return self._n

    @property
    def num_steps(self) -> int:
        """t, the steps of a round."""
        return self._t

    @property
    def num_selected(self) -> int:
        """k, the steps of a round each record takes part in."""
        return self._k

    @property
    def sampling_probability(self) -> float:
        """k/t: the probability that a record takes part in a given step."""
        return self._k / self._t

    @property
    def expected_batch_size(self) -> float:
        """n·k/t: the mean batch (the fixed denominator of an average over one step's sample)."""
        return self._n * self._k / self._t

    @property
    def max_batch_size(self) -> None:
        """None: a batch may hold up to all n records."""
        return None

    @property
    def steps_per_epoch(self) -> int:
        """t: a round is an epoch (each record takes part k times)."""
        return self._t

    @property
    def position(self) -> int:
        """The step within the current round that the next draw makes (0: a new round)."""
        return 0 if self._state is None or self._position >= self._t else self._position

    @property
    def round(self) -> int:
        """This sampler's rounds begun, minus one: the current round's number (−1 before the
        first draw). A restored sampler continues the count; the ledger numbers rounds itself."""
        return self._round

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    @property
    def ledger(self) -> Any:
        return self._ledger

    # -- drawing ----------------------------------------------------------------------------

    def draw(self) -> np.ndarray:
        """The sorted record indices (int64) of the next step, recorded in the ledger (when one
        was given). After the last step of a round (or after a restore), a new round begins."""
        new = self._state is None or self._position >= self._t
        step = 0 if new else self._position
        if self._ledger is not None:
            # Recorded first: a sample the ledger refuses leaves the sampler as it was.
            ledger_round = self._ledger.next_round if new else self._ledger_round
            self._ledger.record_sample(
                self._n, self.sampling_probability, self.kind, seeded=self.seeded, round=ledger_round,
                step_in_round=step, round_steps=self._t, round_selected=self._k,
            )
            self._ledger_round = ledger_round
        if new:
            self._round += 1
            self._state = _Round(self._n, self._k)
        assert self._state is not None
        seed, rnd = self._seed, self._round
        idx = self._state.step(step, self._t, lambda r: _derive(seed, _ALLOCATION_PATH, rnd, step, r))
        self._position = step + 1
        if self._position >= self._t:
            self._state = None  # the round is over: its assignment is dropped
        return idx

    def __iter__(self) -> Any:
        """The rest of the current round: steps :attr:`position` … t−1 (a full round when a new
        one begins, ``len(self)`` steps). Each is drawn (and recorded) as it is yielded."""
        for _ in range(self._t - self.position):
            yield self.draw()

    def __len__(self) -> int:
        return self._t

    def _round_event(self, gaussian: Any) -> Any:
        from .events import RandomAllocationSampledEvent

        return RandomAllocationSampledEvent(self._t, self._k, gaussian)

    def accountant_event(self, noise_multiplier: float, steps: int) -> Any:
        """The event of ``steps`` steps of this sampler (from the start of a round), each
        releasing a Gaussian of noise multiplier z: ``SelfComposedEvent(
        RandomAllocationSampledEvent(t, k, GaussianEvent(z)), ⌈steps/t⌉)`` (``NonPrivateEvent``
        for z = 0). A round cut short is covered by a whole round's event, as the ledger
        accounts it."""
        steps = _count("steps", steps)
        return _composed(self._round_event, noise_multiplier, -(-steps // self._t))

    # -- checkpoints --------------------------------------------------------------------------

    def _config(self) -> dict:
        return {"population_size": self._n, "num_steps": self._t, "num_selected": self._k}

    def state_dict(self) -> dict:
        """The configuration, the round count and the position within the round (plain Python
        values); never the round's assignment. A sampler loaded with it starts a new round."""
        return {
            "kind": self.kind, **self._config(), "round": int(self._round), "position": int(self.position),
            "seeded": self.seeded,
        }

    def check_state_dict(self, state: Any) -> None:
        """Raises ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        _check_state(self.kind, self._config(), state, "the same allocation (the ledger's rounds depend on it)")
        _state_int(state, "round", -1)
        _state_int(state, "position", 0, self._t - 1)

    def load_state_dict(self, state: dict) -> None:
        """Restores the round count of :meth:`state_dict`. The interrupted round is not resumed
        (its assignment was never stored): the next draw starts a new round (see the class
        docstring). A seeded sampler's new round derives from its seed and the round count."""
        self.check_state_dict(state)
        self._round = int(state["round"])
        self._state, self._position, self._ledger_round = None, 0, None

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_state"], d["_position"], d["_ledger_round"] = None, 0, None  # never the round's assignment
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)

    def __repr__(self) -> str:
        return (
            f"RandomAllocationSampler(population_size={self._n}, num_steps={self._t}, num_selected={self._k}, "
            f"round={self._round}, position={self.position})"
        )


class BallsInBinsSampler(RandomAllocationSampler):
    """Balls-in-bins sampling (Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD", arXiv
    2412.16802): in each epoch of b = ``num_batches`` steps every record is thrown into one of the
    b batches, uniformly and independently. It is random allocation with k = 1 and t = b
    (:class:`RandomAllocationSampler`, same construction and the same resuming rule: a restored
    sampler starts a new epoch), recorded with its own policy ``"balls_in_bins"``; the accountant
    reads each epoch as one ``BallsInBinsSampledEvent(b, ·)``. A batch holds Bin(n, 1/b) records
    and the epoch's batch sizes are multinomial(n; 1/b, …, 1/b).
    """

    kind = "balls_in_bins"

    def __init__(self, population_size: int, num_batches: int, *, seed: Optional[int] = None, ledger: Any = None) -> None:
        n = _count("population_size", population_size, 1)
        b = _count("num_batches", num_batches, 1)
        self._init(n, b, 1, seed, ledger)

    @property
    def num_batches(self) -> int:
        """b, the batches (steps) of an epoch."""
        return self._t

    def _round_event(self, gaussian: Any) -> Any:
        from .events import BallsInBinsSampledEvent

        return BallsInBinsSampledEvent(self._t, gaussian)

    def accountant_event(self, noise_multiplier: float, steps: int) -> Any:
        """The event of ``steps`` steps (from the start of an epoch), each releasing a Gaussian of
        noise multiplier z: ``SelfComposedEvent(BallsInBinsSampledEvent(b, GaussianEvent(z)),
        ⌈steps/b⌉)`` (``NonPrivateEvent`` for z = 0). An epoch cut short is covered by a whole
        epoch's event, as the ledger accounts it."""
        return super().accountant_event(noise_multiplier, steps)

    def _config(self) -> dict:
        return {"population_size": self._n, "num_batches": self._t}

    def __repr__(self) -> str:
        return (
            f"BallsInBinsSampler(population_size={self._n}, num_batches={self._t}, round={self._round}, "
            f"position={self.position})"
        )
