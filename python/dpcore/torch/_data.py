"""Poisson-sampled batches for DP-SGD from dpcore's ChaCha20 sampler (Abadi et al. 2016, "lots";
McMahan et al. 2018, §5).

Every logical batch is one Poisson sample: each record joins independently with probability q,
drawn by :func:`dpcore.poisson_sample` and recorded in the ledger (the sampling the
subsampled-Gaussian accountant assumes). Batches vary in size and may be empty; an empty batch is
still yielded (with zero rows), because skipping it would reveal that no record was sampled.
With ``max_physical_batch_size`` a logical batch is cut into micro-batches that the optimizer
accumulates (virtual batches): noise and the ledger's release come once per logical batch.

Under ``torch.distributed`` (see :mod:`dpcore.torch._distributed`) rank r of W samples only the
records i with i mod W = r, at the same rate q, from its own generator: the union over the ranks
is one Poisson sample of the whole dataset, recorded once as (N, q).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from ..ledger import PrivacyLedger
from ..queries.base import derive_seed
from ..sampling import poisson_sample
from ._distributed import current_communicator, resolve_ledger

__all__ = ["DPDataLoader"]


class DPDataLoader:
    """Iterates over ``steps`` Poisson samples of ``dataset`` at rate ``sampling_probability``
    (q; ``sample_rate=`` is its deprecated Opacus-era alias).

    * ``ledger``: the :class:`dpcore.PrivacyLedger` that records each sample (policy ``poisson``),
      or its path (under ``torch.distributed``, the same path on every rank: rank 0 opens it).
    * ``steps``: logical batches per pass (default round(1/q), one expected epoch).
    * ``max_physical_batch_size``: cut a logical batch into micro-batches of at most this size;
      :attr:`logical_batch_complete` is True after the last micro-batch of a logical batch.
    * ``collate_fn``: for map-style datasets other than :class:`TensorDataset` (default
      :func:`torch.utils.data.default_collate`).
    * ``seed``: tests and reproductions only — a seeded sample is predictable, gives no
      amplification in truth, and is marked ``seeded`` in the ledger (each rank derives its own).

    Under ``torch.distributed`` (initialised, world size W > 1) the loader yields this rank's
    part of each sample: about q·N/W records (``last_indices`` are indices into the dataset).
    """

    def __init__(
        self,
        dataset: Dataset,
        sampling_probability: Optional[float] = None,
        *,
        ledger: Any,
        steps: Optional[int] = None,
        max_physical_batch_size: Optional[int] = None,
        collate_fn: Optional[Callable[[Any], Any]] = None,
        seed: Optional[int] = None,
        sample_rate: Optional[float] = None,
    ) -> None:
        from .._names import renamed

        q = renamed("sampling_probability", sampling_probability, "sample_rate", sample_rate)
        if ledger is None:
            raise TypeError("DPDataLoader needs a ledger (a dpcore.PrivacyLedger or a path)")
        if isinstance(q, bool) or not isinstance(q, numbers.Real):
            raise TypeError(f"sampling_probability must be a real number, got {type(q).__name__}")
        if not 0.0 < float(q) <= 1.0:
            raise ValueError(f"sampling_probability must be in (0, 1], got {q}")
        self.dataset = dataset
        self.n = len(dataset)  # type: ignore[arg-type]
        if self.n < 1:
            raise ValueError("dataset is empty")
        self.sampling_probability = float(q)
        self.steps = max(1, round(1.0 / self.sampling_probability)) if steps is None else int(steps)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if max_physical_batch_size is not None and int(max_physical_batch_size) < 1:
            raise ValueError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.max_physical_batch_size = None if max_physical_batch_size is None else int(max_physical_batch_size)
        self.collate_fn = collate_fn or default_collate
        self._comm = current_communicator()
        self.rank, self.world_size = (0, 1) if self._comm is None else (self._comm.rank, self._comm.world_size)
        # Validated above first, so that bad arguments fail on every rank before the collective.
        self.ledger = resolve_ledger(ledger, self._comm)
        self.seed = seed
        self.logical_batch_complete = True
        self.samples_drawn = 0
        self.last_indices: Optional[np.ndarray] = None
        self._draws = 0

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, ledger: PrivacyLedger, **kw: Any) -> "DPDataLoader":
        """The Poisson version of a DataLoader: q = batch_size / len(dataset) (its collate_fn kept)."""
        ds = data_loader.dataset
        bs = data_loader.batch_size
        if bs is None:
            raise ValueError("data_loader has no batch_size; give sampling_probability to DPDataLoader directly")
        kw.setdefault("collate_fn", data_loader.collate_fn)
        return cls(ds, min(1.0, bs / len(ds)), ledger=ledger, **kw)  # type: ignore[arg-type]

    @property
    def sample_rate(self) -> float:
        """Deprecated name of :attr:`sampling_probability`."""
        return self.sampling_probability

    @property
    def expected_batch_size(self) -> float:
        """q·n: the denominator of the fixed-denominator average (McMahan et al. 2018, §3)."""
        return self.sampling_probability * self.n

    def __len__(self) -> int:
        return self.steps

    def _fetch(self, idx: np.ndarray) -> Any:
        if isinstance(self.dataset, TensorDataset):
            t = torch.from_numpy(idx)
            return tuple(x[t] for x in self.dataset.tensors)
        if len(idx) == 0:
            # an empty batch with the right trailing shapes: collate one record, keep zero rows
            one = self.collate_fn([self.dataset[0]])
            return _take_none(one)
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def _sample(self) -> np.ndarray:
        """This rank's part of the next Poisson sample (all of it in one process)."""
        r, w = self.rank, self.world_size
        if w == 1:
            seed = derive_seed(self.seed, self._draws)
            self._draws += 1
            return poisson_sample(self.n, self.sampling_probability, seed=seed, ledger=self.ledger)
        seed = derive_seed(self.seed, self._draws, r)  # a test seed: still one stream per rank
        self._draws += 1
        shard = max(0, (self.n - r + w - 1) // w)  # records r, r + w, r + 2w, ...
        local = poisson_sample(shard, self.sampling_probability, seed=seed)
        # Every rank records the whole sample (N, q); only rank 0's ledger is a file.
        self.ledger.record_sample(self.n, self.sampling_probability, "poisson", seeded=seed is not None)
        return r + w * local

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.steps):
            idx = self._sample()
            self.samples_drawn += 1
            m = self.max_physical_batch_size
            chunks = [idx] if m is None or len(idx) <= m else [idx[i : i + m] for i in range(0, len(idx), m)]
            for k, c in enumerate(chunks):
                self.logical_batch_complete = k == len(chunks) - 1
                self.last_indices = c
                yield self._fetch(c)
            self.logical_batch_complete = True


def _take_none(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _take_none(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take_none(v) for v in batch)
    return batch
