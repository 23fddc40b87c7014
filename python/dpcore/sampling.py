"""Record sampling from ChaCha20 (McMahan et al. 2018, §5; Abadi et al. 2016, "lots").

The sampling probability feeds privacy amplification in the accountant, so the sample must come
from a cryptographically secure generator: both samplers are keyed from the OS on every call.
``seed`` is for tests and reproductions only; a seeded sample is predictable and gives no
amplification in truth.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import numpy as np

from . import _core
from .mechanism import _real, _seed


def _count(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if not 0 <= v < (1 << 63):
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


def poisson_sample(n: int, q: float, *, seed: Optional[int] = None) -> np.ndarray:
    """Sorted indices (int64) of a Poisson sample: each of the n records joins with probability q.

    Drawn with geometric skips between selected indices (expected O(q·n) work). The sample may
    be empty. This is the sampling that the subsampled-Gaussian accountant assumes.
    """
    q = _real("q", q)
    return _core.poisson_sample(_count("n", n), q, _seed(seed)).astype(np.int64, copy=False)


def fixed_size_sample(n: int, b: int, *, seed: Optional[int] = None) -> np.ndarray:
    """Sorted indices (int64) of b records drawn uniformly without replacement from n."""
    return _core.fixed_size_sample(_count("n", n), _count("b", b), _seed(seed)).astype(np.int64, copy=False)
