"""What every accountant reads from its caller, checked in one place: δ, ε, the Rényi orders, and
the noise multiplier of an event made of Gaussian mechanisms only.

The accountants (:mod:`.rdp`, :mod:`.pld`), the calibrations and the samplers' accounting share
these; this module imports no accountant, so that any of them can import it without an import
circle.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Optional, Tuple

import numpy as np

from .. import _core
from ..events import ComposedEvent, Event, GaussianEvent, SelfComposedEvent

__all__ = [
    "DEFAULT_ORDERS",
    "NEIGHBORING",
    "check_delta",
    "check_epsilon",
    "check_orders",
    "gaussian_noise_multiplier",
]

#: dp_accounting's default orders: 1.1 … 10.9 by 0.1, 11 … 63, 128, 256, 512, 1024.
DEFAULT_ORDERS: Tuple[float, ...] = tuple(_core.default_rdp_orders())
#: The neighbouring relations an accountant states its guarantee for.
NEIGHBORING = ("add_or_remove", "replace_one")


def check_delta(delta: Any, name: str = "delta", *, allow_zero: bool = False) -> float:
    """δ as a float; ValueError unless 0 < δ < 1, or 0 ≤ δ < 1 with ``allow_zero`` (TypeError
    for a non-number; NaN is refused).

    δ = 1 is refused everywhere: every mechanism is (0, 1)-DP, so a question at δ = 1 is a
    mistake rather than a query. δ = 0 asks for pure DP; the Rényi conversions answer it exactly
    (ε = ∞, or 0 when nothing was released: CKS 2020 Prop. 12 at log δ = −∞), so they pass
    ``allow_zero``; the PLD computation in the core is defined for 0 < δ < 1 only."""
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(delta).__name__}")
    d = float(delta)
    if allow_zero:
        if not 0.0 <= d < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {d}")
    elif not 0.0 < d < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {d}")
    return d


def check_epsilon(epsilon: Any, name: str = "epsilon") -> float:
    """ε as a float; ValueError for ε < 0 or NaN (inf is allowed: δ = 0 there)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(epsilon).__name__}")
    e = float(epsilon)
    if math.isnan(e) or e < 0:
        raise ValueError(f"{name} must be >= 0, got {e}")
    return e


def check_orders(orders: Optional[Iterable[float]]) -> np.ndarray:
    """The Rényi orders as a sorted float64 array without repeats (None: :data:`DEFAULT_ORDERS`);
    ValueError unless there is at least one and all are > 1, TypeError for non-numbers."""
    if orders is None:
        return np.asarray(DEFAULT_ORDERS, dtype=np.float64)
    try:
        arr = np.asarray(list(orders) if not isinstance(orders, np.ndarray) else orders, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError("orders must be a sequence of real numbers") from None
    arr = np.atleast_1d(arr).ravel()
    if arr.size == 0:
        raise ValueError("orders must hold at least one order")
    if np.isnan(arr).any() or not (arr > 1).all():
        raise ValueError(f"orders must all be > 1, got min {np.nanmin(arr) if arr.size else arr}")
    return np.unique(arr)


def gaussian_noise_multiplier(event: Event) -> Optional[float]:
    """Noise multiplier of a Gaussian-only event run on one batch (Gaussians composed on the
    same data combine as 1/z² = Σ count/z_i², Mironov 2017 Prop. 1 + 7); None if it is not
    purely Gaussian. inf when it releases nothing (no Gaussian, or none run)."""
    if isinstance(event, GaussianEvent):
        return event.noise_multiplier
    inv = 0.0
    if isinstance(event, SelfComposedEvent):
        z = gaussian_noise_multiplier(event.event)
        if z is None:
            return None
        return math.inf if event.count == 0 else (z / math.sqrt(event.count))
    if isinstance(event, ComposedEvent):
        for e in event.events:
            z = gaussian_noise_multiplier(e)
            if z is None:
                return None
            if z == 0:
                return 0.0
            inv += 1.0 / (z * z)
        return math.inf if inv == 0 else 1.0 / math.sqrt(inv)
    return None
