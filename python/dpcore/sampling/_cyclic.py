"""Cyclic samplers for matrix-factorization (correlated-noise) mechanisms: fixed batches
(``cyclic``) and cyclic Poisson sampling (``cyclic_poisson``)."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from .. import _core
from .._validate import count as _count, probability as _probability
from ..mechanism import _seed
from ._base import Sampler, derive, os_key, register_sampler

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


def _permutation(n: int, key: int) -> np.ndarray:
    """The permutation of range(n) keyed by ``key``: the stable argsort of n ChaCha20 normals
    (ties have probability ~2⁻⁵³ per pair and are broken by index, deterministically)."""
    from ..mechanism import gaussian_noise

    keys = gaussian_noise((n,), 1.0, dtype=np.float64, seed=key)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


class _CyclicBase(Sampler):
    """A partition of range(n) cut once from a keyed permutation, visited cyclically. No
    amplification by sampling: the matrix-factorization stream's sensitivity covers every
    participation pattern (:mod:`dpcore.ledger._events`)."""

    amplified = False
    selectable = False
    relations = ("add_or_remove", "zero_out", "replace_one")
    default_relation = "zero_out"

    @classmethod
    def step_event(cls, sample, z, neighboring, gaussian, acc):  # type: ignore[no-untyped-def]
        # a step alone: C under zero-out, a swap (2C) otherwise
        return gaussian(z if neighboring == "zero_out" else z / 2.0)

    def __init__(self, n: int, cycle_length: int, seed: Optional[int], ledger: Any) -> None:
        self._setup(n, cycle_length, seed, ledger)
        self._b = cycle_length
        self._key = os_key() if self._seed is None else int(derive(self._seed, _PERMUTATION_PATH))  # type: ignore[arg-type]
        self._perm = _permutation(n, self._key)
        self._perm.setflags(write=False)

    # -- what the sampler is -------------------------------------------------------------

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
        raise NotImplementedError(f"{type(self).__name__} must implement _bounds(g), the slice of group g")

    # -- checkpoints --------------------------------------------------------------------------

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


@register_sampler
class CyclicSampler(_CyclicBase):
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

    name = "cyclic"
    report_text = (
        "fixed batches cut once, visited cyclically (matrix-factorization streams)",
        "none (the stream's sensitivity covers the participations)",
        "per matrix-factorization stream",
    )
    guarantee = "none by sampling: one Gaussian query per participation (zero-out), 2C per participation (add-or-remove)"

    @classmethod
    def epoch_length(cls, sampling_probability: float, *, steps_per_epoch: Optional[int] = None, **options: Any) -> int:
        """⌊n/b⌋ = ⌊1/q⌋ fixed batches (the rest dropped), or the given ``steps_per_epoch``."""
        if steps_per_epoch is not None:
            return _count("steps_per_epoch", steps_per_epoch, 1)
        q = _probability("sampling_probability", sampling_probability)
        if not q > 0:
            raise ValueError(f"sampling_probability must be > 0 for cyclic, got {q}")
        return max(1, math.floor(1.0 / q + 1e-9))  # 1e-9: q = b/n given as a float

    @classmethod
    def _planned_event(cls, z, steps, q, n, neighboring, steps_per_epoch, **options):  # type: ignore[no-untyped-def]
        # P participations: C at each under zero-out; under add-or-remove the insertion
        # coupling changes one batch by a swap at each of its participations (2C); replace-one 2C
        from ..events import GaussianEvent, SelfComposedEvent

        k = cls.epoch_length(q, steps_per_epoch=steps_per_epoch)
        return SelfComposedEvent(GaussianEvent(z if neighboring == "zero_out" else z / 2.0), -(-steps // k))

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
        from ..matrix_factorization._participation import Participation

        return Participation.cyclic(self._b)

    def _bounds(self, g: int) -> "tuple[int, int]":
        return g * self._bs, (g + 1) * self._bs

    def _indices(self, t: int) -> np.ndarray:
        return self.members(t % self._b)

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        ledger.record_sample(self._n, self.sampling_probability, self.policy, sample_size=self._bs, seeded=self.seeded)

    def _config(self) -> dict:
        return {"population_size": self._n, "batch_size": self._bs}

    def __repr__(self) -> str:
        return f"CyclicSampler(population_size={self._n}, batch_size={self._bs}, batches={self._b}, position={self._position})"


@register_sampler
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

    name = "cyclic_poisson"
    report_text = (
        "groups cut once, each record of the step's group with probability p",
        "Poisson subsampling within the group",
        "per matrix-factorization stream",
    )
    guarantee = "amplification by Poisson sampling within the group of the step (accounted per matrix-factorization stream)"
    planned = False

    def __init__(
        self, population_size: int, cycle_length: int, sampling_probability: float, *, seed: Optional[int] = None,
        ledger: Any = None,
    ) -> None:
        n = _count("population_size", population_size, 1)
        b = _count("cycle_length", cycle_length, 1)
        if b > n:
            raise ValueError(f"cycle_length {b} is larger than the population ({n} records): a group would be empty")
        p = _probability("sampling_probability", sampling_probability)
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
        from ..matrix_factorization._participation import Participation

        return Participation.cyclic_poisson(self._b, self._p)

    def _bounds(self, g: int) -> "tuple[int, int]":
        q, r = divmod(self._n, self._b)  # the first r groups hold one record more
        lo = g * q + min(g, r)
        return lo, lo + q + (1 if g < r else 0)

    def _indices(self, t: int) -> np.ndarray:
        lo, hi = self._bounds(t % self._b)
        seed = derive(self._seed, _POISSON_PATH, t)
        pick = _core.poisson_sample(hi - lo, self._p, seed).astype(np.int64, copy=False)
        return np.sort(self._perm[lo:hi][pick])

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        ledger.record_sample(self._n, self._p, self.policy, seeded=self.seeded)

    def _config(self) -> dict:
        return {"population_size": self._n, "cycle_length": self._b, "sampling_probability": self._p}

    def __repr__(self) -> str:
        return (
            f"CyclicPoissonSampler(population_size={self._n}, cycle_length={self._b}, "
            f"sampling_probability={self._p}, position={self._position})"
        )
