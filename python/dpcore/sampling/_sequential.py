"""Batches in a fixed order (a ``DataLoader(shuffle=False)``): the same cut every epoch. Told apart
from :mod:`shuffled batches <._shuffle>` because adding or removing a record shifts every later
batch by one record: under add-or-remove every step is a swap (2C); zero-out and replace-one as
shuffled batches."""

from __future__ import annotations

import numpy as np

from ._base import register_sampler
from ._shuffle import ShuffleSampler


@register_sampler
class SequentialSampler(ShuffleSampler):
    """Batches of ``batch_size`` consecutive records, in order, every epoch (⌈n/b⌉ steps)."""

    name = "sequential"
    report_text = (
        "batches of the records in a fixed order",
        "none",
        "GaussianEvent per epoch (zero-out: C) or per step (add-or-remove: 2C, a record shifts every later batch)",
    )
    guarantee = "none by sampling: one Gaussian query per epoch (zero-out), 2C per step (add-or-remove)"
    reshuffled = False
    selectable = False

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.arange(self._n, dtype=np.int64)
