"""Cyclic batches for matrix-factorization (correlated-noise) training.

A matrix-factorization (MF) mechanism (DP-FTRL, banded and BLT strategies; Choquette-Choo et al.
2022, arXiv 2211.06530; 2023, arXiv 2306.08153; McMahan et al. 2024, arXiv 2408.08868) needs no
random sampling, but its sensitivity holds only if the data pipeline follows the participation
schema it declares: the records are cut into b batches (groups) *once*, and step t uses batch
(group) t mod b, so one record's participations are exactly b steps apart. A loader that
reshuffles every epoch breaks that; these loaders cannot:

* :class:`CyclicDataLoader`: dpcore's own order, from :class:`dpcore.sampling.CyclicSampler`
  (fixed batches of ``batch_size`` from one ChaCha20 shuffle; ``n mod batch_size`` records
  dropped) or :class:`dpcore.sampling.CyclicPoissonSampler` (b groups, each record of group
  t mod b with probability p at step t). Its position and the key of its permutation are in
  its :meth:`~CyclicDataLoader.state_dict`, so a resumed run continues the same cycle.
* :class:`FixedOrderLoader`: the caller's own ``DataLoader`` kept as it is, accepted only when
  its order provably repeats every epoch (a ``SequentialSampler``, i.e. ``shuffle=False``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler, TensorDataset, default_collate

from ..matrix_factorization._participation import Participation
from ..sampling import CyclicPoissonSampler, CyclicSampler
from ._data import empty_batch, physical_batches
from ._distributed import current_communicator, resolve_ledger

__all__ = ["CyclicDataLoader", "FixedOrderLoader", "check_fixed_order"]


class CyclicDataLoader:
    """Cyclic batches of ``dataset`` for matrix-factorization training.

    * ``batch_size`` (fixed batches): b = n // batch_size batches of exactly ``batch_size``
      records, cut once from a ChaCha20 shuffle; the n − b·batch_size records left over are
      never trained on (:attr:`dropped`). Recorded as ``"cyclic"`` samples.
    * ``participation``: a :class:`~dpcore.matrix_factorization.Participation`. A ``cyclic``
      one fixes b (``batch_size`` = n // b when not given; a b that no batch size gives is
      refused); a ``cyclic_poisson`` one (b groups, probability p; no ``batch_size``) samples
      group t mod b at step t, recorded as ``"cyclic_poisson"`` samples.
    * ``ledger``, ``max_physical_batch_size``, ``collate_fn``, ``seed``: as for
      :class:`~dpcore.torch.DPDataLoader` (``seed`` for tests only).

    One ``for batch in loader`` yields the rest of the current epoch (b logical batches from a
    fresh start), continuing from :attr:`samples_drawn`: breaking out of a loop and starting
    another continues the cycle, it never restarts it. Every logical batch drawn must be
    released by the optimizer (a DPOptimizer refuses to release a later one otherwise: the noise
    stream and the cycle must stay aligned).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: Optional[int] = None,
        *,
        ledger: Any,
        participation: Optional[Participation] = None,
        max_physical_batch_size: Optional[int] = None,
        collate_fn: Optional[Callable[[Any], Any]] = None,
        seed: Optional[int] = None,
    ) -> None:
        if ledger is None:
            raise TypeError("CyclicDataLoader needs a ledger (a dpcore.PrivacyLedger or a path)")
        if current_communicator() is not None:
            raise NotImplementedError(
                "cyclic batches (matrix-factorization noise) are not supported under torch.distributed yet"
            )
        if isinstance(dataset, IterableDataset):
            raise TypeError("cyclic batches need a map-style dataset (len() and indexing), not an IterableDataset")
        n = len(dataset)  # type: ignore[arg-type]
        if n < 1:
            raise ValueError("dataset is empty")
        ledger = resolve_ledger(ledger, None)
        if participation is not None and not isinstance(participation, Participation):
            raise TypeError(f"participation must be a dpcore.matrix_factorization.Participation, got {type(participation).__name__}")
        if participation is None or participation.kind == "cyclic":
            if batch_size is None:
                if participation is None:
                    raise TypeError("CyclicDataLoader needs batch_size (fixed batches) or participation")
                b = participation.min_separation
                if b > n:
                    raise ValueError(f"participation has {b} batches per epoch but the dataset only {n} records")
                batch_size = n // b
            sampler: Any = CyclicSampler(n, batch_size, seed=seed, ledger=ledger)
            if participation is not None and participation.min_separation != sampler.steps_per_epoch:
                raise ValueError(
                    f"participation declares {participation.min_separation} fixed batches per epoch, but {n} records in "
                    f"batches of {sampler.batch_size} make {sampler.steps_per_epoch} (b = n // batch_size)"
                )
        else:
            if batch_size is not None:
                raise ValueError(
                    "batch_size has no role with cyclic Poisson sampling: the expected batch is p·n/b records "
                    "(participation's sampling_probability and min_separation)"
                )
            sampler = CyclicPoissonSampler(
                n, participation.min_separation, participation.sampling_probability, seed=seed, ledger=ledger  # type: ignore[arg-type]
            )
        if max_physical_batch_size is not None and int(max_physical_batch_size) < 1:
            raise ValueError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.dataset = dataset
        self.n = n
        self.sampler = sampler
        self.ledger = ledger
        self.seed = seed
        self.max_physical_batch_size = None if max_physical_batch_size is None else int(max_physical_batch_size)
        self.collate_fn = collate_fn or default_collate
        self.logical_batch_complete = True
        self.last_indices: Optional[np.ndarray] = None

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, ledger: Any, **kw: Any) -> "CyclicDataLoader":
        """The cyclic version of a DataLoader: fixed batches of its ``batch_size`` (unless a
        ``participation`` is given), its ``collate_fn`` kept."""
        kw.setdefault("collate_fn", data_loader.collate_fn)
        part = kw.get("participation")
        bs = None if part is not None and part.kind == "cyclic_poisson" else data_loader.batch_size
        if bs is None and part is None:
            raise ValueError("data_loader has no batch_size; give participation= (or batch_size) to CyclicDataLoader")
        return cls(data_loader.dataset, bs, ledger=ledger, **kw)

    # -- what the loader is -----------------------------------------------------------

    @property
    def participation(self) -> Participation:
        """The participation schema this loader follows (its min_separation b, and p for cyclic
        Poisson sampling)."""
        return self.sampler.participation

    @property
    def policy(self) -> str:
        return self.sampler.kind

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def batch_size(self) -> Optional[int]:
        return getattr(self.sampler, "batch_size", None)

    @property
    def dropped(self) -> int:
        """Records never trained on (fixed batches drop n mod batch_size; cyclic Poisson none)."""
        return int(getattr(self.sampler, "dropped", 0))

    @property
    def sampling_probability(self) -> float:
        return self.sampler.sampling_probability

    @property
    def expected_batch_size(self) -> float:
        """The fixed denominator of the average: batch_size, or p·n/b for cyclic Poisson."""
        return self.sampler.expected_batch_size

    @property
    def samples_drawn(self) -> int:
        """Logical batches drawn since the start of the run (the next step's index)."""
        return self.sampler.position

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch

    def _fetch(self, idx: np.ndarray) -> Any:
        if isinstance(self.dataset, TensorDataset):
            t = torch.from_numpy(idx)
            return tuple(x[t] for x in self.dataset.tensors)
        if len(idx) == 0:
            return empty_batch(self.collate_fn, self.dataset[0])
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        end = (s.position // s.steps_per_epoch + 1) * s.steps_per_epoch
        while s.position < end:
            idx = s.draw()  # recorded in the ledger; written with its release
            yield from physical_batches(self, idx)

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The sampler's state (configuration, permutation key, position) in plain Python values."""
        return {
            "kind": "CyclicDataLoader",
            "sampler": self.sampler.state_dict(),
            "samples_drawn": int(self.samples_drawn),
            "logical_batch_complete": bool(self.logical_batch_complete),
        }

    def check_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or state.get("kind") != "CyclicDataLoader":
            kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a CyclicDataLoader state (kind {kind!r})")
        if not state.get("logical_batch_complete", True):
            raise ValueError(
                "the CyclicDataLoader state was taken in the middle of a logical batch (micro-batches); take "
                "checkpoints at release boundaries"
            )
        if not self.logical_batch_complete:
            raise ValueError("this CyclicDataLoader is in the middle of a logical batch; restore a checkpoint before iterating")
        self.sampler.check_state_dict(state.get("sampler"))

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`: the same partition (re-derived from its key) and position;
        the next ``for batch in loader`` continues the interrupted epoch."""
        self.check_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.logical_batch_complete = True

    def __repr__(self) -> str:
        return f"CyclicDataLoader({self.sampler!r})"


def check_fixed_order(data_loader: DataLoader) -> None:
    """Raises ValueError unless ``data_loader`` yields the same batches in the same order every
    epoch (a map-style dataset read by a ``SequentialSampler`` in a ``BatchSampler``)."""
    if isinstance(data_loader.dataset, IterableDataset):
        raise ValueError(
            "keep_loader=True with an IterableDataset: dpcore cannot check that its batches repeat in the same order "
            "every epoch, which matrix-factorization noise needs; use a map-style dataset"
        )
    bs = data_loader.batch_sampler
    if data_loader.batch_size is None or not isinstance(bs, BatchSampler):
        raise ValueError(
            "keep_loader=True needs a DataLoader with a batch_size and the default BatchSampler, so that dpcore can check "
            "that it repeats the same batches every epoch"
        )
    sampler = bs.sampler
    if not isinstance(sampler, SequentialSampler):
        why = (
            "reshuffles every epoch (shuffle=True)"
            if isinstance(sampler, torch.utils.data.RandomSampler)
            else f"uses a {type(sampler).__name__}, whose order dpcore cannot check is the same every epoch"
        )
        raise ValueError(
            f"keep_loader=True: this DataLoader {why}. Matrix-factorization noise needs the same fixed batches in the same "
            "order every epoch (a record's participations b steps apart). Use shuffle=False over a dataset shuffled once, "
            "or leave keep_loader=False to let dpcore cut the fixed batches from one ChaCha20 shuffle"
        )


class FixedOrderLoader:
    """The caller's DataLoader, kept, when its order repeats every epoch (``shuffle=False``):
    b = ``len(data_loader)`` batches per epoch, each recorded as a ``"cyclic"`` sample of its own
    size (the last one may be shorter when ``drop_last=False``; it is still a fixed batch).

    The position is the batches drawn since the start of the run; a resumed iteration skips the
    batches of the current epoch done before the checkpoint (loaded and dropped, not recorded)."""

    def __init__(self, data_loader: DataLoader, ledger: Any) -> None:
        if current_communicator() is not None:
            raise NotImplementedError("keep_loader=True is not supported under torch.distributed")
        check_fixed_order(data_loader)
        self.data_loader, self.ledger = data_loader, resolve_ledger(ledger, None)
        self.n = len(data_loader.dataset)  # type: ignore[arg-type]
        if self.n < 1:
            raise ValueError("dataset is empty")
        self.batch_size = int(data_loader.batch_size)  # type: ignore[arg-type]
        self._sizes: List[int] = [len(b) for b in data_loader.batch_sampler]  # type: ignore[union-attr]
        if not self._sizes:
            raise ValueError("the DataLoader yields no batch")
        self.samples_drawn = 0
        self.logical_batch_complete = True

    @property
    def participation(self) -> Participation:
        return Participation.cyclic(len(self._sizes))

    @property
    def policy(self) -> str:
        return "cyclic"

    @property
    def steps_per_epoch(self) -> int:
        return len(self._sizes)

    @property
    def dropped(self) -> int:
        return self.n - sum(self._sizes)

    @property
    def sampling_probability(self) -> float:
        return self.batch_size / self.n

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[Any]:
        b = len(self._sizes)
        skip = self.samples_drawn % b
        for k, batch in enumerate(self.data_loader):
            if k < skip:
                continue  # done before the checkpoint
            if k >= b:
                raise RuntimeError("the DataLoader yielded more batches than its length: its order is not fixed")
            size = self._sizes[k]
            self.ledger.record_sample(self.n, size / self.n, "cyclic", sample_size=size)
            self.samples_drawn += 1
            yield batch

    def state_dict(self) -> Dict[str, Any]:
        return {
            "kind": "FixedOrderLoader",
            "samples_drawn": int(self.samples_drawn),
            "population_size": int(self.n),
            "batch_sizes": list(self._sizes),
            "logical_batch_complete": True,
        }

    def check_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or state.get("kind") != "FixedOrderLoader":
            kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not the state of a keep_loader=True loader (kind {kind!r})")
        v = state.get("samples_drawn")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"loader state: samples_drawn must be a non-negative int, got {v!r}")
        if state.get("population_size") != self.n or list(state.get("batch_sizes") or []) != self._sizes:
            raise ValueError("the loader state is for another dataset or batch size: a resumed run must use the same batches")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.samples_drawn = int(state["samples_drawn"])
