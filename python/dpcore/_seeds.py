"""Seeds for the seeded (test-only) paths: one independent seed per part of a call.

Below every loader, sampler and query, which all derive their parts' seeds here; it imports only
the seed check of :mod:`dpcore.mechanism`. A seeded result carries no privacy guarantee: noise
drawn from a known seed can be recomputed and subtracted.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .mechanism import _seed

__all__ = ["derive_seed"]


def derive_seed(seed: Optional[int], *path: int) -> Optional[int]:
    """An independent seed for one part of a seeded call (tests only); None stays None so that
    unseeded calls keep drawing fresh keys from the OS."""
    s = _seed(seed)
    if s is None:
        return None
    st = np.random.SeedSequence([s, *path]).generate_state(2, np.uint32)
    return int(st[0]) | (int(st[1]) << 32)
