"""Record sampling from ChaCha20 (McMahan et al. 2018, §5; Abadi et al. 2016, "lots").

The sampling probability feeds privacy amplification in the accountant, so the sample must come
from a cryptographically secure generator: both samplers are keyed from the OS on every call.
``seed`` is for tests and reproductions only; a seeded sample is predictable and gives no
amplification in truth.

Given ``ledger=`` (a :class:`dpcore.ledger.PrivacyLedger`), a sampler records the sampling event
with the policy it actually used (§6); the entry becomes durable with the sample's first release.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _core
from .mechanism import _real, _seed
from ._validate import count as _count



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
