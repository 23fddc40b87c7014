"""The streaming correlated noise of a matrix-factorization mechanism (the hot path, in Rust).

Step t of the mechanism adds w_t = (C⁻¹z)_t, z_t ~ N(0, I) fresh from ChaCha20 (keyed from the
OS at every step; a seed is for tests only). The core solves C·w = z one row at a time from a
state of ``strategy.num_buffers`` values per coordinate (the last bands − 1 noise vectors of a
banded C, or the buffers of a BLT; McMahan et al. 2024, arXiv 2408.08868, §2), so memory is
(buffers + 1)·d values of the output dtype, never n·d.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

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
        # (step, w) drawn by draw() and not yet committed: noise drawn ahead, which a commit
        # turns into the step's release; dropped (never used) by next(), a load or a redraw.
        self._drawn: Optional[Tuple[int, np.ndarray]] = None
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
        fresh: Optional[np.ndarray] = None,
        parallel: bool = True,
    ) -> np.ndarray:
        """``(sum + stddev·w_t) / denominator`` for the current step t (flat, in the state's
        dtype), then t ← t + 1. On any error the state and t are unchanged. ``seed``: tests only,
        and a different one per step (the same seed twice repeats z).

        ``fresh``: step t's standard normal z, drawn ahead (:func:`dpcore.gaussian_noise` with
        stddev 1 in the state's dtype, e.g. on a worker thread while the step's sum is formed);
        the core then only runs the recursion. It must be fresh noise used for this step only."""
        sd = nonnegative("stddev", stddev)
        den = positive("denominator", denominator)
        s = None
        if sum is not None:
            s = np.ascontiguousarray(sum, dtype=np.float64).ravel()
            if s.size != self._size:
                raise ValueError(f"sum has {s.size} values, the noise has {self._size}")
            if not np.all(np.isfinite(s)):
                raise ValueError("sum holds a NaN or infinite value")
        z = self._fresh(fresh, seed)
        kind, c, th, om = self._args
        out = _core.mf_noise(kind, c, th, om, self._state, self._size, self._step, sd, s, den, _seed(seed), z, parallel)
        self._step += 1
        self._drawn = None
        return out

    def draw(self, *, seed: Optional[int] = None, fresh: Optional[np.ndarray] = None, parallel: bool = True) -> np.ndarray:
        """The current step's unit noise w_t = (C⁻¹z)_t (flat, read-only), WITHOUT advancing
        the state: :meth:`commit` advances it once the release that uses w_t is recorded. The
        two halves let w_t be computed ahead of its release (it depends on no data) while the
        state only ever holds released steps. A later draw before the commit replaces this one
        (whose noise is then never used). The caller must not modify w before the commit."""
        z = self._fresh(fresh, seed)
        kind, c, th, om = self._args
        w = _core.mf_unit_noise(kind, c, th, om, self._state, self._size, self._step, _seed(seed), z, parallel)
        self._drawn = (self._step, w)
        return w

    def commit(self, *, draw_next: bool = False, seed: Optional[int] = None, parallel: bool = True) -> Optional[np.ndarray]:
        """Advances the state past the current step with the w of :meth:`draw`. With
        ``draw_next``, also draws the next step's w in the same pass over the state (as
        :meth:`draw` would, ``seed`` for tests only) and returns it."""
        if self._drawn is None or self._drawn[0] != self._step:
            raise ValueError(f"step {self._step} of the correlated noise was not drawn: call draw() first")
        kind, c, th, om = self._args
        w = self._drawn[1]
        if not draw_next:
            _core.mf_advance(kind, c, th, om, self._state, self._size, self._step, w, parallel)
            self._step += 1
            self._drawn = None
            return None
        nxt = _core.mf_advance_and_draw(kind, c, th, om, self._state, self._size, self._step, w, _seed(seed), parallel)
        self._step += 1
        self._drawn = (self._step, nxt)
        return nxt

    @property
    def drawn(self) -> bool:
        """Whether the current step's w was drawn (and not yet committed)."""
        return self._drawn is not None and self._drawn[0] == self._step

    def _fresh(self, fresh: Optional[np.ndarray], seed: Any) -> Optional[np.ndarray]:
        if fresh is None:
            return None
        if seed is not None:
            raise ValueError("give seed or fresh, not both (fresh noise carries its own randomness)")
        z = np.ascontiguousarray(fresh).ravel()
        if z.dtype != self._dtype or z.size != self._size:
            raise ValueError(f"fresh must hold {self._size} values of {self._dtype}, got {z.size} of {z.dtype}")
        return z

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """What resuming needs: the strategy, size, dtype, step and a copy of the buffers (of the
        released steps only: a draw not committed is noise drawn ahead, never saved)."""
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


