"""Choosing a strategy C: the expected error of A·C⁻¹ at equal privacy, and its minimisers.

The mechanism adds σ·C⁻¹z to the gradient sums x, so a workload A (lower-triangular Toeplitz:
prefix sums, or the model iterates of SGD with momentum) sees the noise σ·A·C⁻¹z. At equal
privacy σ is proportional to sens(C), so the quantity to minimise is the loss of Choquette-Choo
et al. 2022 (arXiv 2211.06530: sens(C)²·‖B‖_F² with B = A·C⁻¹, for A = B·C as in their Eq. (1)),
here per step:

    loss(C) = sens(C, n, participation)² · ‖A·C⁻¹‖_F² / n,     rmse(C) = √loss(C),

per unit of noise multiplier and clip norm (McMahan et al. 2024, arXiv 2408.08868, use the
same RMSE to compare BLTs with banded and dense strategies). Everything is Toeplitz, so only
first columns are ever formed: B's is b = a ∗ ĉ (ĉ: C⁻¹'s first column), and
‖B‖_F² = Σ_k (n − k)·b_k². One loss costs O(n·bands) for a banded C and O(n·buffers) for a BLT.

The minimisers (:func:`optimize_banded`, :func:`optimize_blt`) use analytic gradients and
scipy's L-BFGS-B over parameterisations that keep every iterate inside the set where
:meth:`ToeplitzStrategy.sensitivity` is exact (coefficients non-negative and non-increasing).
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from .._validate import count, real
from ._participation import CYCLIC_POISSON, Participation
from ._strategies import IDENTITY, BandedStrategy, BLTStrategy, ToeplitzStrategy

# Above this many bands a banded optimisation is slow (O(n·bands) per evaluation) and the
# streaming generator keeps bands − 1 model-sized noise vectors; Choquette-Choo et al. 2023
# (arXiv 2306.08153) and McMahan et al. 2024 find the loss flat well before that.
_DEFAULT_MAX_BANDS = 64

# θ is kept at most 1 − 1/(_THETA_HEADROOM·n): a buffer that decays more slowly than that is
# constant over the n steps anyway, and θ must stay strictly below 1 (BLTStrategy's check).
_THETA_HEADROOM = 100.0


# ---------------------------------------------------------------------------------------------
# workload and loss
# ---------------------------------------------------------------------------------------------


#: Buffers of a BLT unless asked otherwise. Measured with benches/bench_mf.py (prefix sums,
#: RMSE relative to 4 buffers): 2 buffers are within 1% for n = 1000 at 1 to 10 epochs and for
#: n = 10⁴ at 10 epochs, 3.7% for n = 10⁴ in one epoch; 3 buffers within 0.4% everywhere
#: measured. The noise state and its per-step memory traffic grow with the buffers (a 2-core
#: CPU step of a 1M-parameter MLP: 1.02× DP-SGD's with 2 buffers, 1.18× with 3 or 4), so 2 is
#: the default; pass ``buffers=`` for very long single-epoch runs.
DEFAULT_BUFFERS = 2

def _momentum(momentum: Any) -> float:
    beta = real("momentum", momentum)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {beta}")
    return beta


def _participation(participation: Any) -> Participation:
    if not isinstance(participation, Participation):
        raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
    return participation


def workload_coefficients(n: int, momentum: float = 0.0) -> np.ndarray:
    """First column of the workload A (lower-triangular Toeplitz): a_k = Σ_{j≤k} β^j.

    β = 0 is the prefix-sum matrix (A = all-ones lower triangle) of DP-FTRL (Kairouz et al.
    2021; Choquette-Choo et al. 2022); β > 0 maps gradients to the iterates of SGD with
    heavy-ball momentum β, A = prefix-sum · (geometric filter), as in Denisov et al. 2022 and
    Kalinin & Lampert 2024 (arXiv 2405.13763, their momentum workload)."""
    n = count("n", n, 1)
    beta = _momentum(momentum)
    return np.cumsum(np.power(beta, np.arange(n, dtype=np.float64)))


def _apply_workload(chat: np.ndarray, beta: float) -> np.ndarray:
    """b = a ∗ ĉ, truncated to n, as two recursions instead of an O(n²) convolution."""
    from scipy.signal import lfilter

    y = chat if beta == 0.0 else lfilter([1.0], [1.0, -beta], chat)
    return np.cumsum(y)


def _apply_workload_adjoint(gb: np.ndarray, beta: float) -> np.ndarray:
    """Transpose of :func:`_apply_workload`: both maps are lower-triangular Toeplitz, so their
    transposes run the same recursions backwards in time."""
    from scipy.signal import lfilter

    g = np.cumsum(gb[::-1])
    if beta != 0.0:
        g = lfilter([1.0], [1.0, -beta], g)
    return g[::-1]


def _frobenius_weights(n: int) -> np.ndarray:
    # Entry k of B's first column appears on n − k rows of the Toeplitz B.
    return np.arange(n, 0, -1, dtype=np.float64)


def _sens_sq(c: np.ndarray, n: int, participation: Participation) -> Tuple[float, np.ndarray]:
    """sens(C)² and its gradient in c (length-n coefficients), in O(n).

    Cyclic: ‖Σ_{i<k} shift(c, i·b)‖² (the exact maximum for monotone coefficients;
    Choquette-Choo et al. 2022, Theorem 2; Kalinin & Lampert 2024, Theorem 2), the same value
    :meth:`ToeplitzStrategy.sensitivity` computes with k = ⌈n/b⌉. Writing c row-wise in rows
    of b, the shifted sum is a cumulative sum down the rows, and its adjoint a reversed one.
    Cyclic Poisson: ‖c‖², one participation at a time (Choquette-Choo et al. 2023, Theorem 4)."""
    if participation.kind == CYCLIC_POISSON or participation.participations(n) == 1:
        return float(c @ c), 2.0 * c
    b = participation.min_separation
    k = participation.participations(n)
    pad = np.zeros(k * b)
    pad[:n] = c
    v = np.cumsum(pad.reshape(k, b), axis=0).ravel()
    v[n:] = 0.0
    grad = 2.0 * np.cumsum(v.reshape(k, b)[::-1], axis=0)[::-1].ravel()[:n]
    return float(v @ v), grad


def _check_strategy(strategy: Any, participation: Participation) -> ToeplitzStrategy:
    if not isinstance(strategy, ToeplitzStrategy):
        raise TypeError(f"strategy must be a ToeplitzStrategy, got {type(strategy).__name__}")
    if participation.kind == CYCLIC_POISSON:
        strategy.check_cyclic_poisson(participation)
    return strategy


def expected_loss(
    strategy: ToeplitzStrategy, n: int, participation: Participation, *, momentum: float = 0.0
) -> float:
    """sens(C)²·‖A·C⁻¹‖_F²/n: the mean squared error per step of the workload A, per unit of
    noise multiplier and clip norm, at equal privacy (Choquette-Choo et al. 2022, arXiv
    2211.06530: the objective sens(C)²·‖B‖_F² of their optimisation, B = A·C⁻¹ from their
    Eq. (1); McMahan et al. 2024, arXiv 2408.08868, whose RMSE is its square root).

    sens is the exact cyclic sensitivity of :meth:`ToeplitzStrategy.sensitivity` (without its
    last-ulp rounding up), with k = ⌈n/b⌉ participations, what the accountant charges for n
    steps: ``max_participations`` never lowers it; for cyclic Poisson sampling it is the column norm, and the strategy
    must be usable there (banded, at most b bands). O(n·bands) or O(n·buffers)."""
    participation = _participation(participation)
    n = count("n", n, 1)
    beta = _momentum(momentum)
    strategy = _check_strategy(strategy, participation)
    b = _apply_workload(strategy.inverse_coefficients(n), beta)
    s, _ = _sens_sq(strategy.coefficients(n), n, participation)
    return s * float(_frobenius_weights(n) @ (b * b)) / n


def rmse(strategy: ToeplitzStrategy, n: int, participation: Participation, *, momentum: float = 0.0) -> float:
    """√:func:`expected_loss` = √(sens(C)²·‖A·C⁻¹‖_F²/n): the root-mean-squared error per step
    (McMahan et al. 2024, arXiv 2408.08868, RMSE; Choquette-Choo et al. 2022, arXiv 2211.06530)."""
    return math.sqrt(expected_loss(strategy, n, participation, momentum=momentum))


# ---------------------------------------------------------------------------------------------
# the objective in ĉ, shared by both optimisers
# ---------------------------------------------------------------------------------------------


def _frobenius_and_grad(chat: np.ndarray, beta: float) -> Tuple[float, np.ndarray]:
    """‖A·C⁻¹‖_F² and its gradient in ĉ (the reverse-mode pass of :func:`_apply_workload`)."""
    n = chat.size
    w = _frobenius_weights(n)
    b = _apply_workload(chat, beta)
    wb = w * b
    return float(wb @ b), _apply_workload_adjoint(2.0 * wb, beta)


def _log_loss_grad_c(
    c: np.ndarray,
    chat: np.ndarray,
    h: np.ndarray,
    n: int,
    participation: Participation,
    beta: float,
    correlate: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> Tuple[float, np.ndarray]:
    """log loss and its gradient in the coefficients c, given ĉ = 1/c and h = ĉ∗ĉ.

    Differentiating c∗ĉ = δ gives dĉ = −ĉ∗ĉ∗dc, so ∂F/∂c_j = −Σ_{k≥j} g_k·h_{k−j} for
    g = ∂F/∂ĉ (the gradient of the matrix-inverse, C⁻¹·dC·C⁻¹, restricted to Toeplitz C). The
    log keeps the two factors' gradients on one scale (‖B‖_F² grows like n², sens² like k)."""
    f, g = _frobenius_and_grad(chat, beta)
    s, ds = _sens_sq(c, n, participation)
    df = -correlate(g, h)
    return math.log(s) + math.log(f) - math.log(n), ds[: df.size] / s + df / f


# ---------------------------------------------------------------------------------------------
# banded
# ---------------------------------------------------------------------------------------------


def banded_sqrt(bands: int) -> BandedStrategy:
    """Kalinin & Lampert 2024's banded square root (BSR, arXiv 2405.13763): the first ``bands``
    Taylor coefficients of (1 − x)^(−1/2),

        r_0 = 1,  r_j = r_{j−1}·(2j − 1)/(2j)   (r_j = C(2j, j)/4^j),

    the first column of the square root of the prefix-sum matrix (Fichtenberger et al. 2023),
    cut to ``bands`` bands. Positive and non-increasing, so its sensitivity is exact; no
    optimisation. ``bands = 1`` is the identity (DP-SGD)."""
    m = count("bands", bands, 1)
    j = np.arange(1, m, dtype=np.float64)
    r = np.concatenate([[1.0], np.cumprod((2.0 * j - 1.0) / (2.0 * j))])
    return BandedStrategy(r.tolist())


def _correlate_head(m: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """(g ⋆ h)_j = Σ_{k≥j} g_k h_{k−j} for j < m only: m dot products, O(n·m)."""

    def corr(g: np.ndarray, h: np.ndarray) -> np.ndarray:
        n = g.size
        return np.array([g[j:] @ h[: n - j] for j in range(min(m, n))])

    return corr


def _ratios_to_coefficients(r: np.ndarray) -> np.ndarray:
    return np.concatenate([[1.0], np.cumprod(r)])


def _banded_objective(n: int, m: int, participation: Participation, beta: float):
    from scipy.signal import lfilter

    imp = np.zeros(n)
    imp[0] = 1.0
    corr = _correlate_head(m)

    def fun(r: np.ndarray) -> Tuple[float, np.ndarray]:
        cb = _ratios_to_coefficients(r)  # c_0 … c_{m−1}
        chat = lfilter([1.0], cb, imp)
        h = lfilter([1.0], cb, chat)
        c = np.zeros(n)
        c[: min(m, n)] = cb[: min(m, n)]
        val, gc = _log_loss_grad_c(c, chat, h, n, participation, beta, corr)
        gc_full = np.zeros(m)
        gc_full[: gc.size] = gc
        # c_j = Π_{i≤j} r_i: ∂/∂r_i = c_{i−1}·T_i with T_i = Σ_{j≥i} G_j Π_{i<l≤j} r_l, run
        # backwards so that no r_i = 0 is ever divided by.
        t = np.empty(m - 1)
        acc = 0.0
        for i in range(m - 1, 0, -1):
            acc = gc_full[i] + (r[i] * acc if i < m - 1 else 0.0)
            t[i - 1] = acc
        return val, cb[:-1] * t

    return fun


def _bounded_lbfgs(fun, x0: np.ndarray, bounds, max_iter: int) -> Tuple[np.ndarray, float]:
    from scipy.optimize import minimize

    res = minimize(
        fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
        # log-loss: ftol is a relative tolerance on log L's value, i.e. an absolute one on the
        # relative loss; 1e-12 stops well below any difference anyone would act on.
        options={"maxiter": int(max_iter), "ftol": 1e-12, "gtol": 1e-9, "maxcor": 20},
    )
    x = np.asarray(res.x, dtype=np.float64)
    return x, float(fun(x)[0])


def optimize_banded(
    n: int,
    bands: int,
    participation: Participation,
    *,
    momentum: float = 0.0,
    max_iter: int = 500,
) -> BandedStrategy:
    """The banded Toeplitz C with ``bands`` bands minimising :func:`expected_loss` (the
    Toeplitz-restricted banded MF of Choquette-Choo et al. 2023, arXiv 2306.08153: minimise
    sens(C)²·‖A·C⁻¹‖_F² over banded C; McKenna 2024, arXiv 2405.15913, for the Toeplitz form).

    Parameterised by ratios: c_0 = 1, c_j = c_{j−1}·r_j with r_j ∈ [0, 1] (box constraints of
    L-BFGS-B), so every iterate is non-negative and non-increasing and its sensitivity exact.
    Starts at :func:`banded_sqrt`, whose ratios are (2j − 1)/(2j); analytic gradient."""
    participation = _participation(participation)
    n = count("n", n, 1)
    m = count("bands", bands, 1)
    beta = _momentum(momentum)
    max_iter = count("max_iter", max_iter, 1)
    if participation.kind == CYCLIC_POISSON and m > participation.min_separation:
        raise ValueError(
            f"cyclic Poisson sampling with {participation.min_separation} groups needs at most that many bands, "
            f"got bands={m} (Choquette-Choo et al. 2023, amplified banded MF)"
        )
    # Bands beyond n never touch the n steps.
    m = min(m, n)
    if m == 1:
        return IDENTITY
    start = banded_sqrt(m).band_coefficients
    r0 = start[1:] / start[:-1]
    fun = _banded_objective(n, m, participation, beta)
    r, val = _bounded_lbfgs(fun, r0, [(0.0, 1.0)] * (m - 1), max_iter)
    if not val <= fun(r0)[0]:
        r = r0
    return BandedStrategy(_ratios_to_coefficients(np.clip(r, 0.0, 1.0)).tolist())


# ---------------------------------------------------------------------------------------------
# BLT
# ---------------------------------------------------------------------------------------------


def _blt_rational(theta: np.ndarray, omega: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """c(x) = P(x)/Q(x) with Q = Π(1 − θ_i x), P = Q + x·Σ_i ω_i Π_{j≠i}(1 − θ_j x)
    (McMahan et al. 2024, Eq. (3) summed as a geometric series); C⁻¹ = Q/P."""
    q = np.array([1.0])
    for t in theta:
        q = np.convolve(q, [1.0, -t])
    p = np.concatenate([q, [0.0]])
    for i, w in enumerate(omega):
        r = np.array([1.0])
        for j, t in enumerate(theta):
            if j != i:
                r = np.convolve(r, [1.0, -t])
        p[1 : 1 + r.size] += w * r
    return q, p


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


class _BLTParams:
    """θ_i = σ(u_i); ω = σ(s)·softmax(v): θ ∈ (0, 1), ω > 0 and Σω = σ(s) < 1 for every
    unconstrained value, so every iterate is a valid monotone BLT (McMahan et al. 2024, Eq. (3),
    with the conditions under which their min-sep sensitivity is exact)."""

    def __init__(self, d: int, n: int) -> None:
        self.d = d
        self.u_max = math.log(_THETA_HEADROOM * n)
        # Bounds keep exp() finite and θ, Σω strictly below 1 in float64.
        self.bounds = [(-30.0, self.u_max)] * d + [(-30.0, 30.0)] + [(-30.0, 30.0)] * d

    def unpack(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray, float, np.ndarray]:
        d = self.d
        theta = _sigmoid(x[:d])
        total = float(_sigmoid(x[d]))
        v = x[d + 1 :]
        e = np.exp(v - v.max())
        sm = e / e.sum()
        return theta, total * sm, total, sm

    def pack(self, theta: np.ndarray, omega: np.ndarray) -> np.ndarray:
        theta = np.clip(theta, 1e-12, _sigmoid(np.array(self.u_max)) - 1e-15)
        omega = np.maximum(omega, 1e-12)
        total = min(float(omega.sum()), 1.0 - 1e-9)
        v = np.log(omega / omega.sum())
        return np.concatenate([_logit(theta), [_logit(np.array(total))], v - v.max()])


def _blt_objective(n: int, d: int, participation: Participation, beta: float):
    from scipy.signal import lfilter

    params = _BLTParams(d, n)
    imp = np.zeros(n)
    imp[0] = 1.0

    def fun(x: np.ndarray) -> Tuple[float, np.ndarray]:
        theta, omega, total, sm = params.unpack(x)
        q, p = _blt_rational(theta, omega)
        chat = lfilter(q, p, imp)
        h = lfilter(q, p, chat)
        c = lfilter(p, q, imp)
        f, g = _frobenius_and_grad(chat, beta)
        s, ds = _sens_sq(c, n, participation)
        val = math.log(s) + math.log(f) - math.log(n)
        if not np.isfinite(val) or not np.all(np.isfinite(g)):
            return math.inf, np.zeros_like(x)
        # c_k = Σ ω_i θ_i^(k−1) (k ≥ 1): ∂c/∂ω_i has generating function x/(1 − θ_i x) and
        # ∂c/∂θ_i = ω_i·x²/(1 − θ_i x)². Pushing them through ∂F/∂c_j = −Σ_k g_k h_{k−j}
        # (see _log_loss_grad_c) gives −g·(h filtered by them): O(n) per buffer, where the
        # full correlation would cost an FFT and the powers θ^k an n×d table. The sens² part
        # Σ_j ∂S/∂c_j·θ^(j−1) is a polynomial in θ: Horner's rule is the same filter run over
        # the reversed gradient, read at its last sample.
        g_omega = np.zeros(d)
        g_theta = np.zeros(d)
        for i, t in enumerate(theta):
            geo, geo2 = [1.0, -t], [1.0, -2.0 * t, t * t]
            if n > 1:
                g_omega[i] = -(g @ lfilter([0.0, 1.0], geo, h)) / f + lfilter([1.0], geo, ds[:0:-1])[-1] / s
            if n > 2:
                g_theta[i] = omega[i] * (
                    -(g @ lfilter([0.0, 0.0, 1.0], geo2, h)) / f + lfilter([1.0], geo2, ds[:1:-1])[-1] / s
                )
        g_u = g_theta * theta * (1.0 - theta)
        g_s = float(g_omega @ sm) * total * (1.0 - total)
        g_v = total * sm * (g_omega - float(g_omega @ sm))
        return val, np.concatenate([g_u, [g_s], g_v])

    return fun, params


def _blt_starts(n: int, d: int, participation: Participation) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Initial (θ, ω): θ spread log-uniformly in 1 − θ over a few ranges of time scales, ω fitted
    by non-negative least squares to the square-root coefficients (which are completely
    monotone, hence close to a mixture of geometric decays c_k = Σ ω_i θ_i^(k−1), the form of
    McMahan et al. 2024, Eq. (3); they and
    Dvijotham et al. 2024 start from such rational approximations of (1 − x)^(−1/2))."""
    from scipy.optimize import nnls

    m = n if participation.kind == CYCLIC_POISSON else min(n, participation.min_separation)
    horizons = sorted({float(n), float(max(m, 2)), float(max(math.sqrt(n), 2.0))}, reverse=True)
    # Samples of k spread on a log scale: a fit on every k would be dominated by the long tail.
    ks = np.unique(np.round(np.geomspace(1, max(n - 1, 1), 64)).astype(np.int64))
    target = banded_sqrt(int(ks[-1]) + 1).band_coefficients[ks]
    starts = []
    for horizon in horizons:
        for lo in (0.5, 0.2):
            gaps = np.geomspace(lo, 1.0 / horizon, d) if d > 1 else np.array([math.sqrt(lo / horizon)])
            theta = 1.0 - gaps
            design = np.power(theta[None, :], (ks - 1)[:, None].astype(np.float64)) / target[:, None]
            omega, _ = nnls(design, np.ones(ks.size))
            if omega.sum() >= 1.0:
                omega = omega * (0.99 / omega.sum())
            if omega.sum() <= 0:
                omega = np.full(d, 0.5 / d)
            starts.append((theta, omega))
    return starts


def optimize_blt(
    n: int,
    participation: Participation,
    *,
    buffers: int = DEFAULT_BUFFERS,
    momentum: float = 0.0,
    max_iter: int = 300,
) -> BLTStrategy:
    """A BLT C (McMahan et al. 2024, arXiv 2408.08868, Eq. (3); Dvijotham et al. 2024) with
    ``buffers`` buffers minimising :func:`expected_loss` under cyclic (min-sep) participation,
    the objective of McMahan et al. 2024: sens(C)² by the min-sep formula (Kalinin & Lampert
    2024, Theorem 2) × ‖A·C⁻¹‖_F²/n.

    L-BFGS-B from several starts (:func:`_blt_starts`, best first, stopping once two runs
    reach the same loss to 1e-7 relative), keeping the best; analytic gradient through the
    rational form C⁻¹ = Q/P, O(n·buffers) per evaluation. BLTs are refused under cyclic
    Poisson sampling (amplified MF needs a banded strategy)."""
    participation = _participation(participation)
    n = count("n", n, 1)
    d = count("buffers", buffers, 1)
    beta = _momentum(momentum)
    max_iter = count("max_iter", max_iter, 1)
    if participation.kind == CYCLIC_POISSON:
        BLTStrategy([0.5], [0.5]).check_cyclic_poisson(participation)
    fun, params = _blt_objective(n, d, participation, beta)
    starts = [params.pack(theta, omega) for theta, omega in _blt_starts(n, d, participation)]
    scored = sorted(((fun(x0)[0], i) for i, x0 in enumerate(starts)))
    best_x, best_val = starts[scored[0][1]], scored[0][0]
    finals: List[float] = []
    for _, i in scored:
        x, val = _bounded_lbfgs(fun, starts[i], params.bounds, max_iter)
        if val < best_val:
            best_x, best_val = x, val
        finals.append(val)
        # The loss surface has few basins for a handful of buffers: once the two best runs agree
        # the rest (the worse starts) only cost time, which matters at n ~ 10⁵.
        top = sorted(finals)[:2]
        if len(top) == 2 and top[1] - top[0] < 1e-7:
            break
    theta, omega, _, _ = params.unpack(best_x)
    order = np.argsort(-theta)
    theta, omega = theta[order], omega[order]
    # σ(s) < 1 by the bounds, but the sum of d rounded products may land an ulp above.
    while math.fsum(omega.tolist()) > 1.0:
        omega = omega * (1.0 - 1e-15)
    return BLTStrategy(theta.tolist(), omega.tolist())


# ---------------------------------------------------------------------------------------------
# front door
# ---------------------------------------------------------------------------------------------


def default_bands(n: int, participation: Participation) -> int:
    """min(b, n, 64) bands for min-separation b.

    With bands ≤ b the columns one record touches do not overlap, so sens² = k·‖c‖² and the
    optimisation trades only error against one column's norm; beyond b the record's columns
    add up and the sensitivity grows with every band, which the optimum for multi-epoch
    training rarely pays for (Choquette-Choo et al. 2023, arXiv 2306.08153: banded C with
    bands ≤ b under b-min-sep). For cyclic Poisson sampling bands ≤ b is required
    (their Theorem 4). The cap of 64 bounds the streaming state (bands − 1 model-sized noise
    vectors) and the optimisation cost: each band adds O(n) per loss evaluation."""
    n = count("n", n, 1)
    participation = _participation(participation)
    return max(1, min(participation.min_separation, n, _DEFAULT_MAX_BANDS))


def optimize(
    n: int,
    participation: Participation,
    *,
    kind: str = "blt",
    bands: Optional[int] = None,
    buffers: Optional[int] = None,
    momentum: float = 0.0,
) -> ToeplitzStrategy:
    """A strategy for ``n`` steps under ``participation`` minimising :func:`expected_loss`
    (the loss sens(C)²·‖A·C⁻¹‖_F²/n of Choquette-Choo et al. 2022, arXiv 2211.06530, and
    McMahan et al. 2024, arXiv 2408.08868).

    ``kind="blt"`` (default; McMahan et al. 2024, Eq. (3)): ``buffers`` (default
    :data:`DEFAULT_BUFFERS` = 2, see there) — fixed
    batches only. ``kind="banded"`` (Choquette-Choo et al. 2023): ``bands`` (default
    :func:`default_bands`); required ≤ b for cyclic Poisson sampling; one band is the
    identity (DP-SGD)."""
    participation = _participation(participation)
    n = count("n", n, 1)
    if kind == "blt":
        if bands is not None:
            raise ValueError("bands applies to kind='banded', not 'blt'")
        return optimize_blt(n, participation, buffers=DEFAULT_BUFFERS if buffers is None else buffers, momentum=momentum)
    if kind == "banded":
        if buffers is not None:
            raise ValueError("buffers applies to kind='blt', not 'banded'")
        m = default_bands(n, participation) if bands is None else count("bands", bands, 1)
        if m == 1:
            return IDENTITY
        return optimize_banded(n, m, participation, momentum=momentum)
    raise ValueError(f"kind must be 'blt' or 'banded', got {kind!r}")


__all__ = [
    "banded_sqrt",
    "workload_coefficients",
    "expected_loss",
    "rmse",
    "optimize_banded",
    "optimize_blt",
    "optimize",
    "default_bands",
]
