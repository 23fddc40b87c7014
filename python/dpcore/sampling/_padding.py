"""Physical batches of one sample, padded to a fixed size: static shapes for compiled steps.

A sampled batch (Poisson above all) varies in size from step to step. A framework that compiles
the step or plans its kernels per shape (cuDNN, XLA, ``torch.compile``, CUDA graphs) then plans
every new size afresh. Padding each physical batch to one fixed size, with a mask of the real
records, gives every step the same shape: the padded rows run through the model like any other
and get clip factor 0 in the release, so they add exactly nothing; they never enter the
denominator (fixed by the sampler) and never change what the ledger records (the sample, which
the sampler records when it draws it). A sample larger than the size is split into several
padded physical batches, never cut (a cap on the sample is the truncated Poisson sampler's, and
is accounted as such).

Framework-neutral (numpy indices): the torch loaders and the Keras front end take their physical
batches from here.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

__all__ = ["physical_chunks", "padded_size"]


def padded_size(n: int, multiple: int) -> int:
    """``n`` records rounded up to a multiple of ``multiple`` (at least one multiple): the
    bucket a physical batch of ``n`` records is padded to where the size is not fixed."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return max(multiple, -(-int(n) // multiple) * multiple)


def physical_chunks(idx: np.ndarray, size: int, *, fill: int = 0, at_least: int = 1) -> List[Tuple[np.ndarray, int]]:
    """The padded physical batches of one sample ``idx``: (indices, number of real records) each.

    The sample is cut into consecutive chunks of at most ``size`` records, and every chunk holds
    exactly ``size`` indices, its real records first and then ``fill`` (any valid index: the
    padded rows' contributions are masked out); an empty sample gives one chunk of padding only.
    ``at_least``: at least this many chunks (ranks that must run as many passes; the extra ones
    all padding)."""
    idx = np.asarray(idx, dtype=np.int64).reshape(-1)
    size = int(size)
    if size < 1:
        raise ValueError(f"the physical batch size must be >= 1, got {size}")
    out: List[Tuple[np.ndarray, int]] = []
    for j in range(max(at_least, 1, -(-len(idx) // size))):
        real = idx[j * size : (j + 1) * size]
        chunk = np.full(size, fill, dtype=np.int64)
        chunk[: len(real)] = real
        out.append((chunk, len(real)))
    return out
