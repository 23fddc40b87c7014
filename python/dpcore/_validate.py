"""The parameter checks every module uses: one message per kind of mistake, and booleans never
taken for numbers. At the bottom of the package: it imports nothing from dpcore."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, List, Tuple, TypeVar

T = TypeVar("T")

INT_LIMIT = 1 << 63


def real(name: str, v: Any) -> float:
    """``v`` as a float; TypeError unless it is a real number (bool is not)."""
    if type(v) is float:  # the common case, without the slower ABC check
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    return float(v)


def finite(name: str, v: Any) -> float:
    x = real(name, v)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def positive(name: str, v: Any, *, allow_zero: bool = False) -> float:
    """A finite real > 0 (≥ 0 with ``allow_zero``)."""
    x = real(name, v)
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, got {x}")
    return x


def probability(name: str, v: Any) -> float:
    """A real in [0, 1] (NaN is not)."""
    x = real(name, v)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {x}")
    return x


def nonnegative(name: str, v: Any) -> float:
    return positive(name, v, allow_zero=True)


def integer(name: str, v: Any) -> int:
    """``v`` as an int; TypeError unless it is an integral number (bool is not)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return int(v)


def count(name: str, v: Any, lo: int = 0) -> int:
    """An int in [lo, 2**63)."""
    n = integer(name, v)
    if n < lo:
        raise ValueError(f"{name} must be >= {lo}, got {n}")
    if n >= INT_LIMIT:
        raise ValueError(f"{name} must be < 2**63, got {n}")
    return n


def parts(value: Any, what: str, convert: Callable[[Any, int], T]) -> Tuple[List[T], type]:
    """The parts of an array-or-sequence argument, each through ``convert(part, index)``, and the
    container type to give results back in (list or tuple, or numpy's ndarray for one array)."""
    if isinstance(value, (list, tuple)):
        if len(value) == 0:
            raise ValueError(f"{what} is an empty sequence; give one array per record part")
        kind: type = type(value) if type(value) in (list, tuple) else list
        return [convert(v, k) for k, v in enumerate(value)], kind
    import numpy as np  # only here: the rest of this module needs nothing but the standard library

    return [convert(value, 0)], np.ndarray
