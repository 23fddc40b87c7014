"""Toeplitz strategies C of the matrix mechanism A = B·C, and their sensitivity.

The matrix-factorization mechanism (Denisov et al. 2022; Choquette-Choo et al. 2022, arXiv
2211.06530, Eq. (1)) releases B(C·x + z) for a workload A = B·C over the n steps' clipped
gradient sums x and Gaussian z; in training, step t adds the noise (C⁻¹z)_t to x_t. Both
strategies here are lower-triangular Toeplitz with first column c (c_0 = 1, so a step's fresh
noise enters with weight 1):

* :class:`BandedStrategy`: c_j = 0 for j ≥ bands (Choquette-Choo et al. 2023, arXiv 2306.08153;
  Kalinin & Lampert 2024, arXiv 2405.13763 for the banded square root). Step t's noise needs the
  last bands−1 noise vectors.
* :class:`BLTStrategy`: c_0 = 1, c_k = Σ_i ω_i θ_i^(k−1) for k ≥ 1, buffered linear Toeplitz
  (Dvijotham et al. 2024; McMahan et al. 2024, arXiv 2408.08868, Eq. (3)). Step t's noise needs
  one buffer per (θ_i, ω_i).

**Sensitivity** (Choquette-Choo et al. 2022, §2 and Theorem 2; McMahan et al. 2024, §3). With a
participation pattern π (the steps one record takes part in), the record moves C·x by at most
‖Σ_{t∈π} C[:, t]‖ per unit of clip norm. For coefficients that are non-negative and
non-increasing, (CᵀC)_{st} is non-negative and falls with both |s − t| and max(s, t); moving every
participation earlier and closer together therefore never lowers the sum, and the maximum over
patterns with at most k participations at least b apart is reached at π = {0, b, …, (k−1)b}:

    sens(C) = ‖Σ_{i<k} C[:, i·b]‖₂,   k = ⌈n/b⌉,

exact, not a bound. Both strategy classes enforce the monotone coefficients (banded: checked;
BLT: θ_i ∈ [0, 1), ω_i ≥ 0, Σω_i ≤ 1), so every sensitivity here is the exact maximum; the tests
check it against a brute-force maximum over all patterns for small n.

Pure math (numpy only): the ledger's accountant recomputes sensitivities from the recorded
strategy with these functions, never from a value a query reports.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Dict, Sequence

import numpy as np

from .._validate import count
from ._participation import CYCLIC_POISSON, Participation

# Relative slack added to computed sensitivities: the float64 sums and square root carry a few
# ulps of error per term, and a sensitivity must never be understated (a smaller one would
# understate ε).
_SENS_SLACK = 1e-12


class ToeplitzStrategy(abc.ABC):
    """A lower-triangular Toeplitz strategy matrix C with c_0 = 1 and coefficients c_k ≥ c_(k+1) ≥ 0."""

    kind: str = ""

    # -- subclasses ---------------------------------------------------------------------------

    @abc.abstractmethod
    def coefficients(self, n: int) -> np.ndarray:
        """c_0 … c_(n−1): the first column of C restricted to n steps (float64)."""

    @property
    @abc.abstractmethod
    def num_buffers(self) -> int:
        """Noise vectors of state the streaming generator keeps (bands − 1, or the BLT's buffers)."""

    @abc.abstractmethod
    def to_dict(self) -> Dict[str, Any]:
        """The strategy as JSON values (:func:`strategy_from_dict` inverts it)."""

    # -- shared ---------------------------------------------------------------------------------

    def matrix(self, n: int) -> np.ndarray:
        """The dense n×n matrix C (tests and small n only)."""
        c = self.coefficients(n)
        m = np.zeros((n, n))
        for j in range(n):
            m[j:, j] = c[: n - j]
        return m

    def inverse_coefficients(self, n: int) -> np.ndarray:
        """The first column of C⁻¹ (also lower-triangular Toeplitz): the impulse response of the
        noise recursion, by the power-series division 1/c(x) in O(n·nnz(c))."""
        from scipy.signal import lfilter

        n = count("n", n, 1)
        imp = np.zeros(n)
        imp[0] = 1.0
        return lfilter([1.0], self._denominator(n), imp)

    def _denominator(self, n: int) -> np.ndarray:
        return self.coefficients(n)

    def sensitivity(self, steps: int, participation: Participation) -> float:
        """max over the schema's participation patterns of ‖C·u_π‖₂ (per unit of clip norm) for
        the first ``steps`` steps: exact (see the module docstring), rounded up.

        For cyclic Poisson sampling the participations are accounted one by one (amplified
        banded MF, Choquette-Choo et al. 2023, Theorem 4): the value is then the largest column
        norm ‖C[:, 0]‖, and needs bands ≤ b so that the columns of one record are orthogonal."""
        if not isinstance(participation, Participation):
            raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
        n = count("steps", steps, 1)
        c = self.coefficients(n)
        b = participation.min_separation
        if participation.kind == CYCLIC_POISSON:
            self.check_cyclic_poisson(participation)
            return _up(math.sqrt(math.fsum(float(v) * float(v) for v in c)))
        k = participation.participations(n)
        v = np.zeros(n)
        for i in range(k):
            v[i * b :] += c[: n - i * b]
        # fsum of the squares: the norm to within an ulp or two; the slack covers the sums above.
        return _up(math.sqrt(math.fsum((v * v).tolist())) * (1.0 + k * _SENS_SLACK))

    def check_cyclic_poisson(self, participation: Participation) -> None:
        raise ValueError(
            f"{type(self).__name__} cannot be used with cyclic Poisson sampling: amplified MF needs a banded "
            "strategy with at most min_separation bands (Choquette-Choo et al. 2023)"
        )

    @abc.abstractmethod
    def describe(self) -> str:
        """One line naming the strategy, for reports."""

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.to_dict() == self.to_dict()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.to_dict().items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()!r})"


def _up(x: float) -> float:
    for _ in range(4):
        x = math.nextafter(x, math.inf)
    return x


def _floats(name: str, values: Any) -> np.ndarray:
    try:
        a = np.array(values, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a sequence of real numbers") from None
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite, got {a.tolist()}")
    return a


class BandedStrategy(ToeplitzStrategy):
    """Banded Toeplitz C: ``coefficients`` c_0 … c_(bands−1), normalised to c_0 = 1.

    The coefficients must be non-negative and non-increasing (what makes the sensitivity of
    :meth:`sensitivity` exact; every optimised and square-root banded strategy has them).
    ``BandedStrategy([1.0])`` is C = I: independent noise, i.e. DP-SGD.
    """

    kind = "banded"

    def __init__(self, coefficients: Sequence[float]) -> None:
        c = _floats("coefficients", coefficients)
        if c[0] <= 0:
            raise ValueError(f"coefficients[0] must be > 0, got {c[0]}")
        c = c / c[0]
        if np.any(c < 0) or np.any(np.diff(c) > 0):
            raise ValueError(
                "banded coefficients must be non-negative and non-increasing (the sensitivity is exact only "
                f"for those), got {c.tolist()}"
            )
        # Trailing zero bands cost state and change nothing.
        nz = np.flatnonzero(c)
        self._c = c[: int(nz[-1]) + 1].copy()
        self._c.setflags(write=False)

    @property
    def bands(self) -> int:
        return int(self._c.size)

    @property
    def num_buffers(self) -> int:
        return self.bands - 1

    @property
    def band_coefficients(self) -> np.ndarray:
        return self._c

    def coefficients(self, n: int) -> np.ndarray:
        n = count("n", n, 1)
        out = np.zeros(n)
        m = min(n, self.bands)
        out[:m] = self._c[:m]
        return out

    def _denominator(self, n: int) -> np.ndarray:
        return self._c

    def check_cyclic_poisson(self, participation: Participation) -> None:
        if self.bands > participation.min_separation:
            raise ValueError(
                f"cyclic Poisson sampling with {participation.min_separation} groups needs at most that many bands; "
                f"this strategy has {self.bands} (Choquette-Choo et al. 2023, amplified banded MF)"
            )

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "coefficients": [float(v) for v in self._c]}

    def describe(self) -> str:
        if self.bands == 1:
            return "independent noise (C = I, DP-SGD)"
        return f"banded Toeplitz, {self.bands} bands"


class BLTStrategy(ToeplitzStrategy):
    """Buffered linear Toeplitz C (McMahan et al. 2024, Eq. (3)): c_0 = 1 and
    c_k = Σ_i ω_i θ_i^(k−1) for k ≥ 1, with θ_i ∈ [0, 1), ω_i ≥ 0 and Σ_i ω_i ≤ 1, which make
    the coefficients non-negative and non-increasing."""

    kind = "blt"

    def __init__(self, theta: Sequence[float], omega: Sequence[float]) -> None:
        th, om = _floats("theta", theta), _floats("omega", omega)
        if th.shape != om.shape:
            raise ValueError(f"theta and omega must have the same length, got {th.size} and {om.size}")
        if np.any(th < 0) or np.any(th >= 1):
            raise ValueError(f"theta must lie in [0, 1), got {th.tolist()}")
        if np.any(om < 0):
            raise ValueError(f"omega must be >= 0, got {om.tolist()}")
        if math.fsum(om.tolist()) > 1.0:
            raise ValueError(
                f"sum(omega) must be <= 1 (c_1 <= c_0, which makes the sensitivity exact), got {math.fsum(om.tolist())}"
            )
        self._theta, self._omega = th.copy(), om.copy()
        self._theta.setflags(write=False)
        self._omega.setflags(write=False)

    @property
    def theta(self) -> np.ndarray:
        return self._theta

    @property
    def omega(self) -> np.ndarray:
        return self._omega

    @property
    def num_buffers(self) -> int:
        return int(self._theta.size)

    def coefficients(self, n: int) -> np.ndarray:
        n = count("n", n, 1)
        out = np.empty(n)
        out[0] = 1.0
        if n > 1:
            k = np.arange(n - 1, dtype=np.float64)
            out[1:] = (self._omega[None, :] * np.power(self._theta[None, :], k[:, None])).sum(axis=1)
        return out

    def inverse_coefficients(self, n: int) -> np.ndarray:
        # c(x) = P(x)/Q(x) with Q = Π(1 − θ_i x), P = Q + x·Σ_i ω_i Π_{j≠i}(1 − θ_j x); C⁻¹ = Q/P.
        from scipy.signal import lfilter

        n = count("n", n, 1)
        q = np.array([1.0])
        for t in self._theta:
            q = np.convolve(q, [1.0, -t])
        p = np.concatenate([q, [0.0]])
        for i, w in enumerate(self._omega):
            r = np.array([1.0])
            for j, t in enumerate(self._theta):
                if j != i:
                    r = np.convolve(r, [1.0, -t])
            p[1 : 1 + r.size] += w * r
        imp = np.zeros(n)
        imp[0] = 1.0
        return lfilter(q, p, imp)

    def check_cyclic_poisson(self, participation: Participation) -> None:
        super().check_cyclic_poisson(participation)

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "theta": [float(v) for v in self._theta], "omega": [float(v) for v in self._omega]}

    def describe(self) -> str:
        return f"buffered linear Toeplitz (BLT), {self.num_buffers} buffers"


#: C = I: independent Gaussian noise at every step (DP-SGD).
IDENTITY = BandedStrategy([1.0])


def strategy_from_dict(d: Dict[str, Any]) -> ToeplitzStrategy:
    """Rebuilds a strategy from :meth:`ToeplitzStrategy.to_dict` (e.g. a ledger's record)."""
    if not isinstance(d, dict):
        raise ValueError(f"not a strategy: {d!r}")
    kind = d.get("kind")
    if kind == "banded" and set(d) == {"kind", "coefficients"}:
        return BandedStrategy(d["coefficients"])
    if kind == "blt" and set(d) == {"kind", "theta", "omega"}:
        return BLTStrategy(d["theta"], d["omega"])
    raise ValueError(f"not a strategy: {d!r}")


def brute_force_sensitivity(strategy: ToeplitzStrategy, steps: int, participation: Participation) -> float:
    """max over every pattern of ≤ k participations at least b apart of ‖C·u_π‖ (tests, small n)."""
    import itertools

    n = count("steps", steps, 1)
    cm = strategy.matrix(n)
    b, k = participation.min_separation, participation.participations(n)
    best = 0.0
    for r in range(1, k + 1):
        for pat in itertools.combinations(range(n), r):
            if any(y - x < b for x, y in zip(pat, pat[1:])):
                continue
            best = max(best, float(np.linalg.norm(cm[:, list(pat)].sum(axis=1))))
    return best


__all__ = [
    "ToeplitzStrategy", "BandedStrategy", "BLTStrategy", "IDENTITY", "strategy_from_dict", "brute_force_sensitivity",
]
