"""Poisson-sampled batches for ``model.fit`` from dpcore's ChaCha20 sampler (Abadi et al. 2016,
"lots"; McMahan et al. 2018, §5).

:class:`PoissonBatches` is a ``keras.utils.PyDataset``: batch ``i`` of an epoch is a fresh
Poisson sample (each of the n records joins independently with probability q, drawn by
:func:`dpcore.poisson_sample`), so batches vary in size and may be empty; an empty batch is
still yielded, because skipping it would reveal that no record was sampled.

The source does not write to the ledger itself. Keras reads batches ahead of training (it peeks
at the first batches to infer shapes, and prefetches), so a sample drawn here may be released
later or never; the DP train step of :class:`dpcore.tensorflow.DPModel` records the sampling event
(n, q, ``poisson``) right before the release it belongs to. A sample that is drawn but never
released costs no privacy.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from .._attrs import readonly
from .._validate import real as _real
from ..queries.base import derive_seed
from ..sampling import poisson_sample

__all__ = ["PoissonBatches", "CyclicBatches"]


def _leading(name: str, tree: Any) -> int:
    leaves = tf.nest.flatten(tree)
    if not leaves:
        raise ValueError(f"{name} holds no array")
    sizes = set()
    for a in leaves:
        if np.ndim(a) < 1:
            raise ValueError(f"{name}: every array needs a leading record axis, got shape {np.shape(a)}")
        sizes.add(int(np.shape(a)[0]))
    if len(sizes) != 1:
        raise ValueError(f"{name}: arrays disagree on the number of records: {sorted(sizes)}")
    return sizes.pop()


def _records(x: Any, y: Any, sample_weight: Any) -> Any:
    """(x, y, sample_weight) as numpy nests with one leading record axis, and the record count."""
    x = tf.nest.map_structure(np.asarray, x)
    y = None if y is None else tf.nest.map_structure(np.asarray, y)
    sw = None if sample_weight is None else tf.nest.map_structure(np.asarray, sample_weight)
    n = _leading("x", x)
    for name, part in (("y", y), ("sample_weight", sw)):
        if part is not None and _leading(name, part) != n:
            raise ValueError(f"{name} has {_leading(name, part)} records but x has {n}")
    if n < 1:
        raise ValueError("x holds no record")
    return x, y, sw, n


class PoissonBatches(tf.keras.utils.PyDataset):
    """``steps`` Poisson samples per epoch of ``(x, y[, sample_weight])`` at rate q.

    * ``x``, ``y``, ``sample_weight``: arrays (or dicts/lists of arrays) with n records each.
    * ``sampling_probability`` q, or ``expected_batch_size`` q·n.
    * ``steps``: batches per epoch (default round(1/q): one expected pass over the data).
    * ``seed``: tests only — a seeded sample is predictable, gives no amplification in truth,
      and is marked ``seeded`` in the ledger. Batch i then always gets the sample of
      ``derive_seed(seed, i)``, in every epoch: Keras reads batches ahead and calls the epoch
      hooks around its prefetching, so nothing else would make a seeded run reproducible.
    * ``workers``, ``use_multiprocessing``, ``max_queue_size``: as for any ``PyDataset``.
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        sampling_probability: Optional[float] = None,
        expected_batch_size: Optional[float] = None,
        steps: Optional[int] = None,
        seed: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._x, self._y, self._sw, n = _records(x, y, sample_weight)
        if (sampling_probability is None) == (expected_batch_size is None):
            raise ValueError("give exactly one of sampling_probability and expected_batch_size")
        if sampling_probability is None:
            q = _real("expected_batch_size", expected_batch_size) / n
        else:
            q = _real("sampling_probability", sampling_probability)
        if not 0.0 < q <= 1.0:
            raise ValueError(f"the sampling probability must be in (0, 1], got {q}")
        if steps is None:
            steps = max(1, round(1.0 / q))
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        self._n, self._q, self._steps, self._seed = n, q, int(steps), seed
        derive_seed(seed, 0)  # validates the seed now rather than on the first batch

    population_size = readonly[int]("_n", "n, the number of examples sampled from.")
    sampling_probability = readonly[float]("_q", "q, each example's inclusion probability per batch.")

    @property
    def expected_batch_size(self) -> float:
        """q·n: the denominator of the fixed-denominator average (McMahan et al. 2018, §3)."""
        return self._q * self._n

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    def __len__(self) -> int:
        return self._steps

    def indices(self, index: int) -> np.ndarray:
        """The record indices of batch ``index``: a fresh Poisson sample on every call (seeded:
        the one sample that batch ``index`` always gets)."""
        if not 0 <= index < self._steps:
            raise IndexError(f"batch {index} out of range for {self._steps} steps")
        return poisson_sample(self._n, self._q, seed=derive_seed(self._seed, index))

    def __getitem__(self, index: int) -> Any:
        idx = self.indices(index)
        take = lambda a: a[idx]  # noqa: E731
        out = [tf.nest.map_structure(take, self._x)]
        if self._y is not None or self._sw is not None:
            out.append(None if self._y is None else tf.nest.map_structure(take, self._y))
        if self._sw is not None:
            out.append(tf.nest.map_structure(take, self._sw))
        return tuple(out)


class CyclicBatches(tf.keras.utils.PyDataset):
    """Cyclic batches of ``(x, y[, sample_weight])`` for matrix-factorization noise
    (``DPModel(noise_mechanism=...)``): batch i of every epoch is batch (group) i of a partition
    cut once from a ChaCha20 shuffle (:class:`dpcore.sampling.CyclicBatches`; keyed from the
    OS, ``seed`` for tests only).

    * ``batch_size``: b = n // batch_size fixed batches of exactly ``batch_size`` records; the
      n mod batch_size records left over are never trained on (:attr:`dropped`).
    * ``participation``: a cyclic Poisson :class:`~dpcore.matrix_factorization.Participation`
      (b groups, probability p) instead: batch i samples group i (each record with probability
      p, fresh from the OS at every call; seeded: the same sample for batch i in every epoch).

    Like :class:`PoissonBatches` it writes nothing to the ledger: the DP train step records each
    sample right before its release. Every epoch must run all b batches in order (``fit``
    refuses ``steps_per_epoch`` other than b), so that release t trains on batch t mod b.
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        batch_size: Optional[int] = None,
        participation: Any = None,
        seed: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        from ..matrix_factorization._participation import Participation
        from ..sampling import CyclicBatches as _Fixed, CyclicPoissonSampler

        super().__init__(**kwargs)
        self._x, self._y, self._sw, n = _records(x, y, sample_weight)
        if participation is not None and not isinstance(participation, Participation):
            raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
        if participation is not None and participation.kind == "cyclic_poisson":
            if batch_size is not None:
                raise ValueError("batch_size has no role with cyclic Poisson sampling (the expected batch is p·n/b)")
            self._sampler: Any = CyclicPoissonSampler(
                n, participation.min_separation, participation.sampling_probability, seed=seed  # type: ignore[arg-type]
            )
        else:
            if batch_size is None:
                if participation is None:
                    raise TypeError("CyclicBatches needs batch_size (fixed batches) or a cyclic Poisson participation")
                batch_size = n // participation.min_separation if participation.min_separation <= n else n + 1
            self._sampler = _Fixed(n, batch_size, seed=seed)
            if participation is not None and participation.min_separation != self._sampler.steps_per_epoch:
                raise ValueError(
                    f"participation declares {participation.min_separation} batches per epoch, but {n} records in "
                    f"batches of {batch_size} make {self._sampler.steps_per_epoch}"
                )
        self._seed = seed

    @property
    def sampler(self) -> Any:
        """The :mod:`dpcore.sampling` sampler holding the partition."""
        return self._sampler

    @property
    def population_size(self) -> int:
        return self._sampler.population_size

    @property
    def participation(self) -> Any:
        return self._sampler.participation

    @property
    def policy(self) -> str:
        return self._sampler.kind

    @property
    def batch_size(self) -> Optional[int]:
        return getattr(self._sampler, "batch_size", None)

    @property
    def sampling_probability(self) -> float:
        return self._sampler.sampling_probability

    @property
    def expected_batch_size(self) -> float:
        return self._sampler.expected_batch_size

    @property
    def dropped(self) -> int:
        return int(getattr(self._sampler, "dropped", 0))

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    def __len__(self) -> int:
        return self._sampler.steps_per_epoch

    def indices(self, index: int) -> np.ndarray:
        """The record indices of batch ``index`` (group ``index`` of the partition)."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for {len(self)} batches")
        return self._sampler._indices(index)

    def __getitem__(self, index: int) -> Any:
        idx = self.indices(index)
        take = lambda a: a[idx]  # noqa: E731
        out = [tf.nest.map_structure(take, self._x)]
        if self._y is not None or self._sw is not None:
            out.append(None if self._y is None else tf.nest.map_structure(take, self._y))
        if self._sw is not None:
            out.append(tf.nest.map_structure(take, self._sw))
        return tuple(out)
