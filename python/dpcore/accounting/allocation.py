"""Rényi DP of random allocation (k of t steps) and balls-in-bins sampling with Gaussian noise.

**The mechanism.** In one allocation round of t steps every record takes part in exactly k of
them, a uniformly random k-subset chosen independently per record (random allocation, Feldman &
Shenfeld 2025, "Privacy Amplification by Random Allocation", arXiv:2502.08202). k = 1 is one
epoch of balls-in-bins sampling: every record is thrown into one of t batches (Chua et al. 2025,
"Balls-and-Bins Sampling for DP-SGD", arXiv:2412.16802). Each step runs the Gaussian mechanism
with noise multiplier σ. The neighbouring relation is add-or-remove one record.

**Dominating pair, k = 1** (Chua et al. 2025, the pair (P_B, Q_B) of balls-and-bins;
Feldman & Shenfeld 2025, who also treat steps chosen adaptively): with e_i the i-th unit vector
of ℝ^t,

    P = (1/t) Σ_i N(e_i, σ² I_t),    Q = N(0, σ² I_t).

Writing Z ~ N(0, I_t) for the noise in units of σ and X_i = exp(Z_i/σ − κ), κ = 1/(2σ²), the
likelihood ratio is P/Q = S = (1/t) Σ_i X_i (the X_i are i.i.d. log-normal with mean 1). The
RDP of the round is the larger of the two directions (add-or-remove covers both):

* **remove**, D_α(P‖Q) = log E_Q[S^α] / (α − 1). For integer α the multinomial expansion gives
  (Feldman & Shenfeld 2025, Corollary 6.2, there as a sum over the partitions of α)

      E_Q[S^α] = t^{−α} Σ_{k_1+…+k_t=α} α!/Π k_i! · exp(κ Σ_i k_i(k_i − 1))
               = α! t^{−α} [x^α] g(x)^t,     g(x) = Σ_{j≥0} e^{κ j(j−1)} x^j / j!,

  since E[X^j] = e^{κ j(j−1)} (g is the moment series of X). All integer orders up to the
  largest come from one pass of positive recursions (:func:`_remove_log_moments`, see
  Numerics). The value never exceeds the Gaussian mechanism's α/(2σ²) (joint convexity), and
  the smaller of the two is returned.
* **add**, D_α(Q‖P) = log E_Q[S^{−(α−1)}] / (α − 1). Two upper bounds, the smaller is used:
  (i) by AM-GM, S ≥ (Π X_i)^{1/t} = exp(W/σ − κ) with W = mean of the Z_i ~ N(0, 1/t), so
  log(Q/P) is pointwise at most the privacy loss of a Gaussian mechanism with noise σ√t plus
  the constant (1 − 1/t)/(2σ²), and D_α(Q‖P) ≤ α/(2tσ²) + (1 − 1/t)/(2σ²), with equality at
  t = 1; (ii) numerically, from S^{−r} = Γ(r)^{−1} ∫_0^∞ u^{r−1} e^{−uS} du:

      E_Q[S^{−r}] = Γ(r)^{−1} ∫_0^∞ u^{r−1} φ(u/t)^t du,    φ(s) = E[e^{−sX}]

  (φ the Laplace transform of the log-normal), by trapezoidal rules in log space
  (:func:`_add_log_moments_numeric`), for σ ≥ 0.25 and r/(tσ²) ≤ 64 (elsewhere (i) alone).
  The constant of (i) is paid once per round, not once per run: the pointwise bound holds
  round by round, so R rounds give ε ≤ ε_Gauss(σ√(t/R), δ) + R(1 − 1/t)/(2σ²). (A single
  constant for the whole run, as in the ``allocation_epsilon_direct_add`` of the authors'
  package random-allocation 1.0.5, falls below the true ε after many rounds: at σ = 1,
  t = 10 the add-direction loss has mean KL(Q‖P) ≈ 0.074 > 1/(2tσ²) = 0.05 per round; see
  ``test_am_gm_bound_is_paid_per_round``.)

**Real orders.** (α − 1)·D_α is, in either direction, the logarithm of a moment-generating
function of the privacy loss, hence convex in α and 0 at α = 1; so the chord between the
neighbouring integers (between 1 and 2 below 2) bounds it from above (as in Wang, Balle &
Kasiviswanathan 2019, Corollary 10, for the same use).

**k > 1.** A uniformly random k-subset of the t steps is produced by splitting the steps
uniformly at random into k blocks of sizes ⌊t/k⌋ or ⌈t/k⌉ (t mod k blocks of the larger size)
and picking one step uniformly in each block: the procedure commutes with every permutation of
the steps, so its output is uniform over k-subsets. Given the split, which is independent of
the data, one record's round is k one-of-m_j allocations on disjoint blocks of steps run
concurrently; Rényi DP composes concurrently (Lyu 2022, "Composition Theorems for Interactive
Differential Privacy", NeurIPS; Vadhan & Zhang 2023, "Concurrent Composition Theorems for
Differential Privacy", arXiv:2207.08335), so the round conditioned on the split is
(α, Σ_j ε_{m_j}(α))-RDP in each direction, and the mixture over splits is no worse, by the
quasi-convexity of Rényi divergence (∫P^α Q^{1−α} is jointly convex for α > 1). The authors'
package composes k copies of one-of-⌊t/k⌋, which assumes that the RDP decreases in m; the
exact block sizes need no such assumption.

**Numerics.** Everything runs in log space (E_Q[S^α] spans e^{±10⁵} at small σ and large α).
The remove direction uses no subtraction at all: the cumulants of X are all positive
(Kreweras' recurrence, :func:`_log_cumulants`), those of S are κ_k(X)·t^{1−k}, and the moments
follow from the cumulants by a recursion with positive terms. The floating-point error of each
step is bounded and carried, and the bound is added, so every remove value is an upper bound.
The add direction's quadrature follows the standard of the Rust quadrature of the Poisson
accountant (``rust/accounting/quad.rs``): the trapezoidal rule converges geometrically on
these analytic integrands, the difference between steps h and h/2 is added as its error, and
the tails beyond the cut are bounded analytically and added; an order whose check fails keeps
bound (i).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Tuple

import numpy as np

from .._validate import count as _count, real as _real
from ..events import BallsInBinsSampledEvent, DiscreteGaussianEvent
from .base import UnsupportedEventError

__all__ = ["rdp_random_allocation", "check_allocation_event", "DIRECTIONS"]

#: The ``direction`` values of :func:`rdp_random_allocation`: both (the add-or-remove RDP), or
#: one direction of the neighbouring relation.
DIRECTIONS = ("both", "remove", "add")

_EPS = float(np.finfo(np.float64).eps)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
# Below this noise multiplier the add direction keeps the AM-GM bound (i) only (valid, if
# looser: every order then costs nats per round in either direction), as the quadrature of
# the log-normal's Laplace transform would need thousands of nodes per point.
_MIN_SIGMA_NUMERIC = 0.25
# The numeric add bound (ii) is computed for r = α − 1 with r·v_t ≤ this, v_t = 1/(tσ²);
# beyond, bound (i) exceeds 32 nats and is dominated by its Gaussian part r·v_t/2, which is
# also the leading term of the truth at large r (Laplace's method), so (i) loses little.
_MAX_RVT_NUMERIC = 64.0
# Lattice step of the outer quadrature in v = log s (the coarse rule uses twice this).
_OUTER_STEP = 1.0 / 64.0
# Tails are cut where they are below e^{-40} of the integral (and then bounded and added).
_TAIL = 40.0
# Largest integer order computed exactly (remove) or numerically (add): the accountant's
# default grid ends at 1024. Larger orders get the closed-form bounds.
_MAX_EXACT_ORDER = 1024


# ============================================================================= public API


def rdp_random_allocation(
    num_steps: int, num_selected: int, noise_multiplier: float, orders: Any, direction: str = "both"
) -> np.ndarray:
    """RDP ε(α) of one random-allocation round: every record in ``num_selected`` (k) of
    ``num_steps`` (t) Gaussian steps with noise multiplier ``noise_multiplier`` (σ), a
    uniformly random k-subset per record; add-or-remove-one adjacency. Balls-in-bins with b
    batches is ``rdp_random_allocation(b, 1, σ, orders)``.

    ``direction``: ``"both"`` (default: the RDP of the add-or-remove relation, the larger of the
    two directions at each order), ``"remove"`` (D_α(P‖Q), P the mixture; exact at integer
    orders, Feldman & Shenfeld 2025, Corollary 6.2) or ``"add"`` (D_α(Q‖P); the smaller of the
    AM-GM bound and the numerical integral). See the module docstring for the dominating pair
    (Chua et al. 2025; Feldman & Shenfeld 2025), the reduction of k > 1 to blocks of one-of-m
    (concurrent composition, Lyu 2022, and quasi-convexity), and the chords between integer
    orders (convexity of (α − 1)D_α).

    Every value is an upper bound (rounded up); an order whose bound cannot be computed is
    +inf (and so is never the best order of a conversion). Returns a float64 array shaped like
    ``orders`` (all > 1; inf gives inf). σ = inf gives zeros. ValueError for t < 1, k outside
    [1, t], σ ≤ 0 or NaN, an unknown direction; TypeError for non-integer counts or a
    non-numeric σ.
    """
    t = _count("num_steps", num_steps, 1)
    k = _count("num_selected", num_selected, 1)
    if k > t:
        raise ValueError(f"num_selected must be <= num_steps={t}, got {k}")
    sigma = _real("noise_multiplier", noise_multiplier)
    if not sigma > 0:
        raise ValueError(f"noise_multiplier must be > 0, got {sigma}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    try:
        a = np.asarray(orders, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError("orders must be a real number or a sequence of real numbers") from None
    flat = a.ravel()
    if np.isnan(flat).any() or not (flat > 1).all():
        raise ValueError("orders must all be > 1")
    if flat.size == 0:
        return np.zeros(a.shape)
    if math.isinf(sigma):
        return np.where(np.isinf(flat), np.inf, 0.0).reshape(a.shape)
    # Blocks: t mod k of size ⌈t/k⌉, the others of size ⌊t/k⌋ (module docstring).
    q, rem = divmod(t, k)
    blocks = [(m, c) for m, c in ((q, k - rem), (q + 1, rem)) if c > 0]
    out = np.zeros(flat.shape)
    for d in ("remove", "add"):
        if direction not in (d, "both"):
            continue
        total = np.zeros(flat.shape)
        for m, c in blocks:
            total += c * _one_of_t(sigma, m, flat, d)
        out = np.maximum(out, total)
    # The block sums add at most len(blocks) roundings.
    out = np.nextafter(out * (1.0 + 4.0 * _EPS), np.inf)
    return out.reshape(a.shape)


def check_allocation_event(event: Any, neighboring: str) -> Any:
    """The :class:`~dpcore.events.RandomAllocationSampledEvent` of a random-allocation or
    balls-in-bins event, once it is one this module analyses under ``neighboring``; raises
    :class:`~dpcore.accounting.UnsupportedEventError` otherwise (the accountant's message)."""
    ra = event.as_random_allocation() if isinstance(event, BallsInBinsSampledEvent) else event
    if neighboring != "add_or_remove":
        raise UnsupportedEventError(
            f"RdpAccountant cannot analyse {type(event).__name__} under neighboring={neighboring!r}: random "
            "allocation and balls-in-bins are analysed under 'add_or_remove' only (RdpAccountant())"
        )
    if isinstance(ra.event, DiscreteGaussianEvent):
        raise UnsupportedEventError(
            f"RdpAccountant cannot analyse {type(event).__name__} with the discrete Gaussian: the analysis of "
            "random allocation used here is that of the continuous Gaussian mechanism (its dominating pair); "
            "the discrete Gaussian is not analysed under random allocation"
        )
    return ra


# ============================================================================= one-of-t


def _one_of_t(sigma: float, t: int, orders: np.ndarray, direction: str) -> np.ndarray:
    """Upper bounds on D_α of one one-of-t round in ``direction`` at each of ``orders``."""
    finite = orders[np.isfinite(orders)]
    ints: set = set()
    for a in finite.tolist():
        lo = math.floor(a)
        ints.update((lo, math.ceil(a)))
    ints.discard(1)
    kappa = 0.5 / (sigma * sigma)
    # Integer orders beyond _MAX_EXACT_ORDER keep the closed-form bounds only (the recursions
    # are O(n²) in time and memory).
    exact = tuple(sorted(n for n in ints if n <= _MAX_EXACT_ORDER))
    cum = {n: math.inf for n in ints}
    if exact and direction == "remove":
        k_all = _remove_log_moments(sigma, t, exact[-1])
        cum.update((n, float(k_all[n])) for n in exact)
    elif exact:
        cum.update(zip(exact, _add_log_moments(sigma, t, exact).tolist()))
    cum[1] = 0.0
    out = np.empty(orders.shape)
    for i, a in enumerate(orders.tolist()):
        if math.isinf(a):
            out[i] = math.inf
            continue
        lo, hi = math.floor(a), math.ceil(a)
        if lo == hi:
            c = cum[lo]
        else:
            th = a - lo
            c = (1.0 - th) * cum[lo] + th * cum[hi]
            c = c * (1.0 + 4.0 * _EPS) if c > 0 else c
        # Closed-form bounds that hold at every real order: the Gaussian mechanism's
        # α(α − 1)/(2σ²) for remove (joint convexity), the AM-GM bound (i) for add.
        if direction == "remove":
            closed = kappa * a * (a - 1.0)
        else:
            r = a - 1.0
            closed = r * kappa + r * r * kappa / t
        closed = closed * (1.0 + 4.0 * _EPS)
        out[i] = max(min(c, closed), 0.0) / (a - 1.0)
    return np.nextafter(out * (1.0 + 2.0 * _EPS), np.inf)


# ============================================================================= remove direction


def _lse(terms: np.ndarray, errs: np.ndarray) -> Tuple[float, float]:
    """(log Σ exp(terms), bound on its absolute error), for terms that each carry at most
    ``errs[i]`` of absolute error (inputs' errors plus the rounding made forming them).

    The log-sum-exp is 1-Lipschitz in the max-norm and, to first order, moves by the mean of
    the terms' errors weighted by their shares of the sum (terms far below the largest cost
    nothing); the weights at a perturbed point differ by at most e^{±2·max err}, hence the
    factor. Subtracting the maximum, exp, the n − 1 additions, log and the final addition add
    at most ε(|m| + 2n + |out| + 4) (doubled for safety)."""
    m = float(terms.max())
    if m == -math.inf:
        return -math.inf, 0.0
    e = np.exp(terms - m)
    s = float(e.sum())
    out = m + math.log(s)
    errs = np.where(e > 0, errs, 0.0)
    emax = float(errs.max())
    werr = float(e @ errs) / s
    prop = min(emax, werr * math.exp(2.0 * emax)) if emax < 1.0 else emax
    return out, prop + _EPS * (2.0 * abs(m) + 4.0 * terms.size + 2.0 * abs(out) + 8.0)


def _positive_recursion(vec: np.ndarray, vec_err: np.ndarray, init: np.ndarray, tree: bool) -> Tuple[np.ndarray, np.ndarray]:
    """Values and absolute error bounds of the log-space recursions with positive terms

        tree=False:  y_m = log Σ_{i=0}^{m−1} C(m−1, i) · e^{vec[i+1] + y_{m−1−i}}          (moments)
        tree=True:   y_m = log Σ_{i=0}^{m−2} C(m−2, i) · e^{vec[i+1] + y_{1+i} + y_{m−1−i}}  (Kreweras)

    for m ≥ len(init) (the first values are exact); ``vec_err`` bounds the errors of ``vec``.
    The error of y_m is the mean of its terms' errors (binomial's, vec's, the inputs', and 2ε
    times the sum of the magnitudes added) weighted by the terms' shares of the sum, times
    e^{2·max term error} for the weights' own perturbation (see :func:`_lse`), plus
    ε(2|max| + 4m + 2|y_m| + 8) for the log-sum-exp itself."""
    N = vec.size
    lbin, ebin2 = _log_binomials(N)
    vec_e2 = vec_err + 2.0 * _EPS * np.where(np.isfinite(vec), np.abs(vec), 0.0)
    y = np.full(N, -np.inf)
    err = np.zeros(N)
    y[: init.size] = init
    ay = np.zeros(N)  # |y|, 0 where −inf
    ay[: init.size] = np.where(np.isfinite(init), np.abs(init), 0.0)
    emax_run = 0.0
    for m in range(init.size, N):
        if tree:
            row, n_t = m - 2, m - 1
            inp = y[1:m] + y[m - 1 : 0 : -1]
            inp_e = err[1:m] + err[m - 1 : 0 : -1] + 2.0 * _EPS * (ay[1:m] + ay[m - 1 : 0 : -1])
        else:
            row, n_t = m - 1, m
            inp = y[m - 1 :: -1]
            inp_e = err[m - 1 :: -1] + 2.0 * _EPS * ay[m - 1 :: -1]
        terms = lbin[row, :n_t] + vec[1 : n_t + 1] + inp
        mx = float(terms.max())
        if mx == -math.inf:
            continue
        w = np.exp(terms - mx)
        tot = float(w.sum())
        y[m] = mx + math.log(tot)
        te = ebin2[row, :n_t] + vec_e2[1 : n_t + 1] + inp_e
        emax_run = max(emax_run, float(te.max()))
        werr = float(w @ te) / tot
        prop = werr * math.exp(2.0 * emax_run) if emax_run < 1.0 else max(werr, emax_run)
        err[m] = prop + _EPS * (2.0 * abs(mx) + 4.0 * n_t + 2.0 * abs(y[m]) + 8.0)
        ay[m] = abs(y[m])
    return y, err


@functools.lru_cache(maxsize=4)
def _log_binomials(N: int) -> Tuple[np.ndarray, np.ndarray]:
    """log C(n, k) for 0 ≤ k ≤ n < N (−inf above the diagonal), and bounds on their absolute
    errors plus the rounding of adding them to a term (three log-gammas, two subtractions,
    and 2ε·|log C|)."""
    from scipy import special  # here, not at import: `import dpcore` stays fast

    lg = special.gammaln(np.arange(N, dtype=np.float64) + 1.0)
    n = np.arange(N)[:, None]
    k = np.arange(N)[None, :]
    ok = k <= n
    nk = np.where(ok, n - k, 0)
    lb = np.where(ok, lg[n] - lg[k] - lg[nk], -np.inf)
    err = np.where(ok, 6.0 * _EPS * (lg[n] + lg[k] + lg[nk] + 1.0), 0.0)
    lb.setflags(write=False)
    err.setflags(write=False)
    return lb, err


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(e^x − 1) for x > 0, without overflow."""
    x = np.asarray(x, dtype=np.float64)
    big = x > 30.0
    with np.errstate(over="ignore"):
        return np.where(big, x + np.log1p(-np.exp(-np.where(big, x, 30.0))), np.log(np.expm1(np.where(big, 1.0, x))))


@functools.lru_cache(maxsize=64)
def _log_cumulants(sigma: float, n_max: int) -> Tuple[np.ndarray, np.ndarray]:
    """log κ_n, n = 0..n_max (κ_0 unused), of X = exp(Z/σ − κ), and bounds on their absolute
    errors.

    E[X^n] = q^{n(n−1)/2} with q = e^{1/σ²}, and q^{C(n,2)} = Σ_G (q − 1)^{e(G)} over all
    graphs G on n labelled vertices; by the exponential formula the cumulants are the same sum
    over connected graphs, κ_n = (q − 1)^{n−1} I_n(q), where I_n is the inversion enumerator
    of labelled trees (Mallows & Riordan 1968, "The inversion enumerator for labeled trees",
    Bull. AMS 74). Kreweras' recurrence (1980, "Une famille de polynômes ayant plusieurs
    propriétés énumeratives", Period. Math. Hungar. 11)

        I_1 = 1,   I_{n+1}(q) = Σ_{i=0}^{n−1} C(n−1, i) [i+1]_q I_{i+1}(q) I_{n−i}(q),

    with [m]_q = 1 + q + … + q^{m−1}, has only positive terms: no cancellation, unlike the
    moment–cumulant inversion, which loses all digits when σ is large (X is then close to 1).
    (So the log-normal's cumulants are all positive.)"""
    N = n_max + 1
    a = 1.0 / (sigma * sigma)
    j = np.arange(N, dtype=np.float64)
    l_qm1 = float(_log_expm1(np.array(a)))
    with np.errstate(divide="ignore"):
        lq = np.where(j >= 1, _log_expm1(np.maximum(j, 1.0) * a) - l_qm1, -np.inf)  # log [j]_q
    eq = 8.0 * _EPS * (j * a + abs(l_qm1) + np.where(np.isfinite(lq), np.abs(lq), 0.0) + 2.0)
    li, ei = _positive_recursion(lq, eq, np.array([-np.inf, 0.0])[: min(N, 2)], tree=True)
    with np.errstate(invalid="ignore"):
        lk = np.where(j >= 1, (j - 1.0) * l_qm1 + li, -np.inf)
    ek = ei + 4.0 * _EPS * ((j + 1.0) * (abs(l_qm1) + 1.0) + np.where(np.isfinite(lk), np.abs(lk), 0.0))
    lk.setflags(write=False)
    ek.setflags(write=False)
    return lk, ek


@functools.lru_cache(maxsize=256)
def _remove_log_moments(sigma: float, t: int, n_max: int) -> np.ndarray:
    """Upper bounds K[n] ≥ log E_Q[S^n] = (n − 1)·D_n(P‖Q), n = 0..n_max, one-of-t round.

    E_Q[S^n] = n! t^{−n} [x^n] g(x)^t (module docstring), computed as the moments of S, the
    mean of t i.i.d. copies of X, from its cumulants κ_k(S) = κ_k(X)·t^{1−k}
    (:func:`_log_cumulants`) by the moment recursion E[S^n] = Σ_{k=1}^{n} C(n−1, k−1)
    κ_k(S) E[S^{n−k}], all terms positive. Never above e^{κ n(n−1)} (Gaussian mechanism)."""
    N = n_max + 1
    kappa = 0.5 / (sigma * sigma)
    n = np.arange(N, dtype=np.float64)
    gauss = kappa * n * (n - 1.0) * (1.0 + 4.0 * _EPS)
    if t == 1 or not math.isfinite(kappa * N * N * 4.0):
        gauss.setflags(write=False)
        return gauss
    lk, ek = _log_cumulants(sigma, n_max)
    log_t = math.log(t)
    with np.errstate(invalid="ignore"):
        lc = np.where(n >= 1, lk - (n - 1.0) * log_t, -np.inf)
    ec = ek + 4.0 * _EPS * ((n + 1.0) * log_t + np.where(np.isfinite(lc), np.abs(lc), 0.0) + 1.0)
    # E_Q[S^0] = E_Q[S] = 1.
    lb, eb = _positive_recursion(lc, ec, np.zeros(min(N, 2)), tree=False)
    k = lb + eb
    k = k + _EPS * (np.abs(k) + 1.0)
    out = np.maximum(np.minimum(k, gauss), 0.0)
    out[:2] = 0.0
    out.setflags(write=False)
    return out


# ============================================================================= add direction


def _log1mexp_lower(lx: np.ndarray) -> np.ndarray:
    """Lower bound (to rounding) on log(1 − e^{−x}) from lx = log x."""
    x = np.exp(lx)
    out = np.empty_like(lx)
    small = lx < -20.0
    mid = ~small & (x < math.log(2.0))
    big = ~small & ~mid
    # (1 − e^{−x})/x ≥ 1 − x/2
    out[small] = lx[small] + np.log1p(-0.5 * x[small])
    out[mid] = np.log(-np.expm1(-x[mid]))
    out[big] = np.log1p(-np.exp(-x[big]))
    return out


def _trapezoid_log(ell: np.ndarray, h: float) -> Tuple[np.ndarray, np.ndarray]:
    """Rows of log-integrand values on a lattice of step h/2 (odd length): log of the fine
    (step h/2) and coarse (step h, even nodes) trapezoidal sums."""
    def lse(x: np.ndarray) -> np.ndarray:
        m = x.max(axis=1)
        safe = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            return safe + np.log(np.exp(x - safe[:, None]).sum(axis=1))

    return lse(ell) + math.log(h / 2.0), lse(ell[:, ::2]) + math.log(h)


def _log_phi_upper(sigma: float, log_s: np.ndarray) -> np.ndarray:
    """Upper bounds on log φ(s), φ(s) = E[exp(−s X)], X = exp(Z/σ − κ), Z ~ N(0, 1), at s =
    exp(log_s). Where the quadrature does not pass its convergence check the trivial bound
    φ ≤ 1 (log 0) is returned.

    Small s (≤ 1/2): m = 1 − φ = E[1 − e^{−sX}] is integrated (full relative accuracy of
    log φ = log1p(−m) near 0), and its lower bound is used. Larger s: φ itself, upper bound.
    Both integrands are log-concave in z with curvature ≥ 1 (the Gaussian's −z²/2 plus a
    concave term), so ±10.5 around the mode holds all but e^{−55} of the mass (dropped for m,
    where dropping is conservative, added for φ via the exponential tail bound f(z₁)/|z₁ − z*|).
    The trapezoidal rule converges geometrically (the integrands are analytic in the strip
    |Im z| < πσ/2; Trefethen & Weideman 2014, Thm 5.1); the difference between step h and h/2
    is added as the error, as in the Rust quadrature of the Poisson accountant.
    """
    kappa = 0.5 / (sigma * sigma)
    out = np.zeros(log_s.shape)
    small = log_s <= math.log(0.5)
    for mask, is_m in ((small, True), (~small, False)):
        idx = np.nonzero(mask)[0]
        for start in range(0, idx.size, 256):
            sel = idx[start : start + 256]
            out[sel] = _log_phi_chunk(sigma, kappa, log_s[sel], is_m)
    return out


def _log_phi_chunk(sigma: float, kappa: float, ls: np.ndarray, is_m: bool) -> np.ndarray:
    # Mode of the log-integrand by bisection on its (decreasing) derivative.
    if is_m:
        lo_z, hi_z = np.zeros_like(ls), np.full_like(ls, 1.0 / sigma)

        def deriv(z: np.ndarray) -> np.ndarray:
            x = np.exp(ls + z / sigma - kappa)
            with np.errstate(over="ignore"):
                ratio = np.where(x < 1e-8, 1.0 - 0.5 * x, x / np.expm1(np.minimum(x, 700.0)))
            return -z + ratio / sigma

    else:
        big_l = ls - 2.0 * math.log(sigma) - kappa
        lo_z, hi_z = -sigma * (np.maximum(big_l, 0.0) + 1.0), np.zeros_like(ls)

        def deriv(z: np.ndarray) -> np.ndarray:
            with np.errstate(over="ignore"):
                return -z - np.exp(ls + z / sigma - kappa) / sigma

    for _ in range(60):
        mid = 0.5 * (lo_z + hi_z)
        up = deriv(mid) > 0
        lo_z = np.where(up, mid, lo_z)
        hi_z = np.where(up, hi_z, mid)
    zc = 0.5 * (lo_z + hi_z)
    # Curvature at the mode: 1 + (x/σ²)·|d/dx of the concave part|, at most 1 + x/σ².
    xc = np.exp(np.minimum(ls + zc / sigma - kappa, 700.0))
    curv = 1.0 + float(np.max(xc if not is_m else 0.5 * xc)) / (sigma * sigma)
    h = min(0.2 * sigma, 0.5 / math.sqrt(curv), 0.5)  # coarse step
    half = int(math.ceil(10.5 / (h / 2.0)))
    offs = (np.arange(-half, half + 1) * (h / 2.0))[None, :]
    z = zc[:, None] + offs
    lx = ls[:, None] + z / sigma - kappa
    base = -0.5 * z * z - _LOG_SQRT_2PI
    if is_m:
        ell = base + _log1mexp_lower(lx)
    else:
        with np.errstate(over="ignore"):
            ell = base - np.exp(np.minimum(lx, 700.0))
    fine, coarse = _trapezoid_log(ell, h)
    nodes = ell.shape[1]
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.exp(coarse - fine) - 1.0)  # relative difference of the two rules
    rounding = _EPS * (4.0 * float(np.abs(ell[np.isfinite(ell)]).max(initial=0.0)) + 2.0 * nodes + 16.0)
    ok = np.isfinite(fine) & (diff <= 1e-11)
    if is_m:
        # Lower bound on m: fine rule minus its error estimate and rounding (tails dropped).
        rel = diff + rounding
        m_lo = np.exp(fine) * np.maximum(1.0 - rel, 0.0)
        res = np.log1p(-np.minimum(m_lo, 1.0))
        # log1p rounding, upward.
        res = res + _EPS * (2.0 * np.abs(res) + 2.0)
        res = np.minimum(res, 0.0)
    else:
        # Upper bound on φ: fine rule plus its error, rounding and both tails. At the cut,
        # z₁ = zc ± 10.5 (bisection has converged to ~1e-15), the log-integrand's slope has
        # magnitude ≥ 10.5 − |bisection error| ≥ 10, so each tail ≤ f(z₁)/10.
        tails = np.logaddexp(ell[:, 0], ell[:, -1]) - math.log(10.0)
        res = np.logaddexp(fine + np.log1p(diff + rounding), tails)
        res = res + _EPS * (2.0 * np.abs(res) + 2.0)
        res = np.minimum(res, 0.0)
    return np.where(ok, res, 0.0)


def _log_gamma_q_upper(r: float, x: float) -> float:
    """Upper bound on log Q(r, x) (regularised upper incomplete gamma) for x > r − 1 ≥ 0:
    Γ(r, x) ≤ x^{r−1} e^{−x} / (1 − (r − 1)/x), from y^{r−1} ≤ x^{r−1} e^{(r−1)(y−x)/x}."""
    return (r - 1.0) * math.log(x) - x - math.lgamma(r) - math.log1p(-(r - 1.0) / x)


def _add_tail_limits(r: float, kappa: float, vt: float, log_t: float) -> Tuple[float, float, float, float]:
    """(v_lo, v_hi, log of the lower-tail bound, log of the upper-tail bound), tails relative to
    Γ(r), for the outer integral ∫ exp(r(v + log t)) φ(e^v)^t dv of E[S^{−r}]·Γ(r).

    Lower tail (φ ≤ 1): ∫_{−∞}^{v_lo} e^{r(v + log t)} dv = e^{r(v_lo + log t)}/r.
    Upper tail (u = t e^v ≥ u_M): by S ≥ G = (Π X_i)^{1/t} (AM-GM), the tail is at most
    Γ(r)·E[G^{−r} Q(r, u_M G)] ≤ Γ(r)·B_r·[Φ(−z_c) + Q(r, u_M c)] with log G ~ N(−κ, v_t),
    B_r = E[G^{−r}] = exp(rκ + r²v_t/2) and log c = −κ − r v_t − z_c √v_t (split on G < c).
    Both are cut at e^{−40} below 1 ≤ E[S^{−r}] (Jensen)."""
    lgr = math.lgamma(r)
    v_lo = (lgr - _TAIL + math.log(r)) / r - log_t
    log_lo = r * (v_lo + log_t) - math.log(r) - lgr
    log_b = r * kappa + 0.5 * r * r * vt
    target = log_b + _TAIL
    z_c = math.sqrt(2.0 * target)
    log_c = -kappa - r * vt - z_c * math.sqrt(vt)
    x = max(2.0 * r, r + 1.0)
    while _log_gamma_q_upper(r, x) > -target:
        x *= 1.25
    v_hi = math.log(x) - log_c - log_t
    from scipy import special

    log_phi_tail = float(special.log_ndtr(-z_c)) + 1e-12
    log_hi = log_b + float(np.logaddexp(log_phi_tail, _log_gamma_q_upper(r, x)))
    return v_lo, v_hi, log_lo, log_hi


def _add_log_moments_numeric(sigma: float, t: int, rs: Tuple[int, ...]) -> np.ndarray:
    """Upper bounds on log E_Q[S^{−r}] for the integers r in ``rs`` by quadrature (bound (ii)
    of the module docstring); +inf where the quadrature's own check fails.

    E[S^{−r}]·Γ(r) = ∫ exp(F_r(v)) dv, F_r(v) = r(v + log t) + t·log φ(e^v) (u = t e^v), on
    the lattice v ∈ (1/64)ℤ: the fine rule (step 1/64) plus its difference from the coarse
    one (step 1/32), plus both tails (:func:`_add_tail_limits`). An error ε_φ in log φ moves
    F by t·ε_φ; log φ is used through its upper bound, so F is too."""
    kappa = 0.5 / (sigma * sigma)
    vt = 1.0 / (t * sigma * sigma)
    log_t = math.log(t)
    limits = [_add_tail_limits(float(r), kappa, vt, log_t) for r in rs]
    h = _OUTER_STEP
    k_lo = int(math.floor(min(l[0] for l in limits) / h))
    k_hi = int(math.ceil(max(l[1] for l in limits) / h))
    k = np.arange(k_lo, k_hi + 1)
    v = k * h
    # Below s_T the quadratic Taylor bound e^{−y} ≤ 1 − y + y²/2 gives φ(s) ≤ 1 − s + s²E[X²]/2
    # (E[X²] = e^{1/σ²}), within t·s³E[X³]/6 ≤ 1e-11 of the truth in t·log φ.
    log_s_taylor = (math.log(6e-11) - log_t - 3.0 / (sigma * sigma)) / 3.0
    taylor = v <= log_s_taylor
    log_phi = np.empty(v.shape)
    s_t = np.exp(v[taylor])
    log_phi[taylor] = np.log1p(-s_t + 0.5 * s_t * s_t * math.exp(1.0 / (sigma * sigma)))
    log_phi[taylor] += _EPS * (np.abs(log_phi[taylor]) * 4.0 + 4.0 * s_t)
    log_phi[~taylor] = _log_phi_upper(sigma, v[~taylor])
    t_log_phi = t * log_phi
    out = np.empty(len(rs))
    for i, (r, (v_lo, v_hi, log_lo, log_hi)) in enumerate(zip(rs, limits)):
        sel = (v >= v_lo) & (v <= v_hi)
        a = r * (v[sel] + log_t)
        b = t_log_phi[sel]
        F = a + b
        errs = 2.0 * _EPS * (np.abs(a) + np.abs(b) + np.abs(F) + 1.0)
        even = (k[sel] % 2) == 0
        if F.size < 3 or not even.any():
            out[i] = math.inf
            continue
        fine, e_f = _lse(F, errs)
        coarse, _ = _lse(F[even], errs[even])
        if not math.isfinite(fine) or not math.isfinite(coarse):
            out[i] = math.inf
            continue
        fine += math.log(h)
        coarse += math.log(2.0 * h)
        diff = abs(math.expm1(coarse - fine))
        if not diff <= 1e-6:
            out[i] = math.inf
            continue
        lgr = math.lgamma(r)
        body = fine + e_f - lgr + math.log1p(diff)
        total = float(np.logaddexp(body, np.logaddexp(log_lo, log_hi)))
        out[i] = total + _EPS * (4.0 * (abs(total) + abs(body) + lgr) + 16.0)
    return out


@functools.lru_cache(maxsize=256)
def _add_log_moments(sigma: float, t: int, orders: Tuple[int, ...]) -> np.ndarray:
    """Upper bounds on log E_P[(Q/P)^α] = (α − 1)·D_α(Q‖P) at the integer ``orders`` ≥ 2: the
    smaller of the AM-GM bound (i), (α − 1)²/(2tσ²) + (α − 1)/(2σ²), and the quadrature (ii)."""
    kappa = 0.5 / (sigma * sigma)
    r = np.asarray(orders, dtype=np.float64) - 1.0
    pointwise = (r * kappa + r * r * kappa / t) * (1.0 + 4.0 * _EPS)
    out = pointwise.copy()
    if t > 1 and sigma >= _MIN_SIGMA_NUMERIC and math.isfinite(kappa):
        vt = 1.0 / (t * sigma * sigma)
        want = tuple(int(x) for x in r if x * vt <= _MAX_RVT_NUMERIC)
        if want:
            num = dict(zip(want, _add_log_moments_numeric(sigma, t, want).tolist()))
            for i, x in enumerate(r.tolist()):
                if int(x) in num:
                    out[i] = min(out[i], num[int(x)])
    out.setflags(write=False)
    return out
