"""``BatchMemoryManager`` as in ``opacus.utils.batch_memory_manager``.

dpcore's DP loaders cut a logical batch into physical batches themselves
(``max_physical_batch_size``): ``optimizer.step()`` after each physical batch clips and holds its
records, and releases (noise, ledger, update) only after the last one of the logical batch
(``loader.logical_batch_complete``). The manager sets that size on the loader for the ``with``
block and restores it after.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterator, Optional


class _PhysicalBatches:
    """The loader seen through the manager: iterates physical batches."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

    def __len__(self) -> int:
        n = len(self._loader)
        m = getattr(self._loader, "max_physical_batch_size", None)
        e = getattr(self._loader, "expected_batch_size", None)
        if m is None or not e:
            return n
        return n * max(1, math.ceil(e / m))  # the expected count (Poisson batches vary)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._loader, item)


class BatchMemoryManager:
    """``with BatchMemoryManager(data_loader=, max_physical_batch_size=, optimizer=) as loader``:
    physical batches of at most ``max_physical_batch_size`` records; call ``optimizer.step()``
    after every one, as with Opacus (it releases at the end of each logical batch only)."""

    def __init__(self, *, data_loader: Any, max_physical_batch_size: int, optimizer: Any) -> None:
        if int(max_physical_batch_size) < 1:
            raise ValueError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.data_loader = data_loader
        self.max_physical_batch_size = int(max_physical_batch_size)
        self.optimizer = optimizer
        self._saved: Optional[Any] = None
        self._set = False

    def __enter__(self) -> Any:
        loader = self.data_loader
        if not hasattr(loader, "max_physical_batch_size"):
            # dpcore's shuffled loader (poisson_sampling=False): each of its batches is one recorded
            # sample released by one step, so it is not cut; it is used as it is.
            warnings.warn(
                "BatchMemoryManager: this loader's batches are not cut into physical batches (dpcore cuts sampled "
                "batches only, poisson_sampling=True); the loader is used as it is",
                UserWarning, stacklevel=2,
            )
            return loader
        if not getattr(loader, "logical_batch_complete", True):
            raise RuntimeError("BatchMemoryManager entered in the middle of a logical batch")
        self._saved = loader.max_physical_batch_size
        loader.max_physical_batch_size = self.max_physical_batch_size
        self._set = True
        return _PhysicalBatches(loader)

    def __exit__(self, *exc: Any) -> None:
        if self._set:
            self.data_loader.max_physical_batch_size = self._saved
            self._set = False
