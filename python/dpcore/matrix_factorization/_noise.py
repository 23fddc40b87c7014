"""The streaming correlated noise of a matrix-factorization mechanism (the hot path, in Rust).

Step t of the mechanism adds w_t = (C⁻¹z)_t, z_t ~ N(0, I) fresh from ChaCha20 (keyed from the
OS at every step; a seed is for tests only). The core solves C·w = z one row at a time from a
state of ``strategy.num_buffers`` values per coordinate (the last bands − 1 noise vectors of a
banded C, or the buffers of a BLT; McMahan et al. 2024, arXiv 2408.08868, §2), so memory is
(buffers + 1)·d values of the output dtype, never n·d.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from .. import _core
from .._validate import count, nonnegative, positive
from ._strategies import BandedStrategy, BLTStrategy, ToeplitzStrategy, strategy_from_dict

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _seed(seed: Any) -> Optional[int]:
    from ..mechanism import _seed as check  # the package's one seed check

    return check(seed)


class CorrelatedNoise:
    """The generator of w_t = (C⁻¹z)_t for one vector of ``size`` values.

    :meth:`next` returns step t's release ``(sum + stddev·w_t) / denominator`` (or
    ``stddev·w_t``) and advances the state; the state is checkpointed with :meth:`state_dict`.
    With ``BandedStrategy([1.0])`` (C = I) the output is exactly :func:`dpcore.gaussian_noise`
    of the same key: DP-SGD's independent noise.
    """

    def __init__(self, strategy: ToeplitzStrategy, size: int, dtype: Any = np.float32) -> None:
        if not isinstance(strategy, (BandedStrategy, BLTStrategy)):
            raise TypeError(f"strategy must be a BandedStrategy or BLTStrategy, got {type(strategy).__name__}")
        dt = np.dtype(dtype)
        if dt not in _DTYPES:
            raise TypeError(f"dtype must be float32 or float64, got {dt}")
        self._strategy = strategy
        self._size = count("size", size, 0)
        self._dtype = dt
        self._state = np.zeros(self._size * strategy.num_buffers, dt)
        self._step = 0
        if isinstance(strategy, BandedStrategy):
            self._args = ("banded", strategy.band_coefficients.tolist(), [], [])
        else:
            self._args = ("blt", [], strategy.theta.tolist(), strategy.omega.tolist())

    @property
    def strategy(self) -> ToeplitzStrategy:
        return self._strategy

    @property
    def size(self) -> int:
        return self._size

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def step(self) -> int:
        """The next step to be drawn (steps drawn so far)."""
        return self._step

    @property
    def state_nbytes(self) -> int:
        """Bytes of noise state held (the buffers), size·num_buffers values."""
        return int(self._state.nbytes)

    def next(
        self,
        stddev: float = 1.0,
        *,
        sum: Optional[np.ndarray] = None,
        denominator: float = 1.0,
        seed: Optional[int] = None,
        parallel: bool = True,
    ) -> np.ndarray:
        """``(sum + stddev·w_t) / denominator`` for the current step t (flat, in the state's
        dtype), then t ← t + 1. On any error the state and t are unchanged. ``seed``: tests only,
        and a different one per step (the same seed twice repeats z)."""
        sd = nonnegative("stddev", stddev)
        den = positive("denominator", denominator)
        s = None
        if sum is not None:
            s = np.ascontiguousarray(sum, dtype=np.float64).ravel()
            if s.size != self._size:
                raise ValueError(f"sum has {s.size} values, the noise has {self._size}")
            if not np.all(np.isfinite(s)):
                raise ValueError("sum holds a NaN or infinite value")
        kind, c, th, om = self._args
        out = _core.mf_noise(kind, c, th, om, self._state, self._size, self._step, sd, s, den, _seed(seed), parallel)
        self._step += 1
        return out

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """What resuming needs: the strategy, size, dtype, step and a copy of the buffers."""
        return {
            "strategy": self._strategy.to_dict(),
            "size": self._size,
            "dtype": self._dtype.name,
            "step": self._step,
            "state": self._state.copy(),
        }

    @classmethod
    def from_state_dict(cls, d: Dict[str, Any]) -> "CorrelatedNoise":
        try:
            g = cls(strategy_from_dict(d["strategy"]), d["size"], d["dtype"])
            step = count("step", d["step"], 0)
            st = np.asarray(d["state"])
        except KeyError as e:
            raise ValueError(f"not a CorrelatedNoise state: missing {e}") from None
        if st.dtype != g._dtype or st.shape != g._state.shape:
            raise ValueError(
                f"state has dtype {st.dtype} and shape {st.shape}; expected {g._dtype} and {g._state.shape}"
            )
        if not np.all(np.isfinite(st)):
            raise ValueError("state holds a NaN or infinite value")
        g._state[...] = st
        g._step = step
        return g

    def __repr__(self) -> str:
        return f"CorrelatedNoise({self._strategy!r}, size={self._size}, dtype={self._dtype.name}, step={self._step})"


