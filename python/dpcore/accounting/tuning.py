"""The privacy cost of hyperparameter tuning: Papernot & Steinke 2022, "Hyperparameter Tuning with
Renyi Differential Privacy" (ICLR 2022, arXiv:2110.03620).

A tuning procedure runs a training run Q (hyperparameters drawn at random, independently of the
data, then a DP training run) K times and releases only the best run's output. If K is fixed,
the best of K runs can cost up to K runs' privacy; if K is *random*, drawn independently of the
data from a suitable distribution and kept secret, it costs little more than one run:

* truncated negative binomial D_{η,γ} (their Definition 1; η = 0 logarithmic, η = 1
  geometric): P[K = k] = (1 − γ)^k / (γ^{−η} − 1) · Π_{ℓ=0}^{k−1} (ℓ + η)/(ℓ + 1) for k ≥ 1
  (η = 0: (1 − γ)^k / (k·log(1/γ))), i.e. a negative binomial NB(η, γ) conditioned on K ≥ 1,
  with E[K] = η(1/γ − 1)/(1 − γ^η) (η = 0: (1/γ − 1)/log(1/γ); η = 1: 1/γ). Their Theorem 2:
  if Q is (λ, ε)- and (λ̂, ε̂)-RDP, the tuned release is (λ, ε')-RDP with
  ε' = ε + (1 + η)(1 − 1/λ̂)ε̂ + (1 + η)·log(1/γ)/λ̂ + log(E[K])/(λ − 1).
* Poisson(μ) (their §3.1, K = 0 releases nothing): Theorem 6: if Q is (λ, ε)-RDP and
  (ε̂, δ̂)-DP with ε̂ = log(1 + 1/(λ − 1)), the tuned release is (λ, ε')-RDP with
  ε' = ε + μ·δ̂ + log(μ)/(λ − 1).

:func:`rdp_repeat_and_select` applies them on a grid of orders (λ̂ and the (ε̂, δ̂) conversion
range over the grid), then uses that Rényi divergence is non-decreasing in the order (van Erven
& Harremoës 2014, Theorem 3): ε'(λ) ≤ min over λ' ≥ λ of ε'(λ'). dp_accounting 0.6 implements the
same bounds (``RepeatAndSelectDpEvent``); its values are the test oracle.

:func:`draw_num_runs` draws K from ChaCha20 keyed from the operating system, by exact
algorithms (no approximation beyond double-precision arithmetic). The guarantee needs K drawn
*before* the runs, independently of the data, and not disclosed: an adversary who learns K faces
the fixed-K procedure, which Theorems 2 and 6 do not bound.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Optional, Tuple

import numpy as np

from .._validate import real as _real
from .base import make_accountant

__all__ = [
    "POISSON",
    "check_distribution",
    "distribution_name",
    "truncated_negative_binomial_mean",
    "truncated_negative_binomial_log_inverse_gamma",
    "rdp_repeat_and_select",
    "repeat_and_select_rdp",
    "num_runs_pmf",
    "draw_num_runs",
]

#: ``shape`` of the Poisson distribution of K (Papernot & Steinke 2022, §3.1).
POISSON = math.inf

# Drawing K needs work proportional to E[K]; a tuning study with more expected runs than this
# is not one that anyone runs, and a typo (1e9 for 1e2) should not hang the process.
MAX_DRAW_MEAN = 1e6

# Relative error, in units of the computed value, that the E[K] formula may carry (a few ulps of
# expm1/log and one division), with room to spare: the bisection's decisions are made outside
# this margin, so that the γ it returns is on the safe side of the exact one.
_MEAN_MARGIN = 1e-13


def check_distribution(mean: Any, shape: Any) -> Tuple[float, float]:
    """(mean, shape) as floats, checked as :class:`dpcore.events.RepeatAndSelectEvent` checks them:
    1 ≤ mean < ∞ (the expected number of runs) and shape ≥ 0 (inf: Poisson)."""
    m = _real("mean", mean)
    s = _real("shape", shape)
    if not (m >= 1 and math.isfinite(m)):
        raise ValueError(f"mean (the expected number of runs) must be finite and >= 1, got {m}")
    if not s >= 0:
        raise ValueError(f"shape must be >= 0 (0: logarithmic, 1: geometric, inf: Poisson), got {s}")
    return m, s


def distribution_name(shape: float) -> str:
    """The name of the distribution of K for ``shape``."""
    if math.isinf(shape):
        return "Poisson"
    if shape == 0:
        return "logarithmic (truncated negative binomial, η = 0)"
    if shape == 1:
        return "geometric (truncated negative binomial, η = 1)"
    return f"truncated negative binomial (η = {shape:g})"


# ----------------------------------------------------------------------------- D_{η,γ}


def truncated_negative_binomial_mean(log_inv_gamma: float, shape: float) -> float:
    """E[K] for K ~ D_{η,γ} (Papernot & Steinke 2022, Definition 1 and the mean stated after it),
    parametrised by L = log(1/γ) ≥ 0 for accuracy: E[K] = η·expm1(L)/(−expm1(−ηL)) (η > 0),
    expm1(L)/L (η = 0, the logarithmic distribution), 1 at L = 0 (γ = 1: K = 1). A few ulps of
    relative error; inf when it overflows."""
    L = float(log_inv_gamma)
    if L == 0.0:
        return 1.0
    if L > 700.0:
        return math.inf
    if shape == 0:
        return math.expm1(L) / L
    den = -math.expm1(-shape * L)
    return shape * math.expm1(L) / den


def truncated_negative_binomial_log_inverse_gamma(mean: float, shape: float, *, side: str = "account") -> float:
    """L = log(1/γ) of the D_{η,γ} with E[K] = ``mean``, on the safe side of the exact value L*.

    ``side="account"``: L ≥ L* (γ not overstated). The bound of Theorem 2 grows with L, and with
    E[K], which is ``mean`` itself there: a larger L only loosens it. ``side="draw"``: L ≤ L* (so
    the distribution drawn from has E[K] ≤ ``mean`` and γ at least the accounted one; Theorem 2
    for it is then below the bound computed with ``mean`` and the accounted L).

    Geometric (η = 1): L* = log(mean), rounded outward. Otherwise bisection on L (E[K] increases
    with L), deciding only where the computed E[K] is clear of ``mean`` by more than its
    rounding error, to a relative width of 1e-12.
    """
    mean, shape = check_distribution(mean, shape)
    if math.isinf(shape):
        raise ValueError("the Poisson distribution (shape = inf) has no γ")
    if side not in ("account", "draw"):
        raise ValueError(f"side must be 'account' or 'draw', got {side!r}")
    up = side == "account"
    if mean == 1.0:
        return 0.0  # γ = 1: K = 1 always, exactly
    if shape == 1.0:
        L = math.log(mean)
        for _ in range(2):  # log is correct to within an ulp
            L = math.nextafter(L, math.inf if up else 0.0)
        return max(L, 0.0)

    def clearly_above(L: float) -> bool:  # E[K](L) ≥ mean certainly, so L ≥ L*
        return truncated_negative_binomial_mean(L, shape) >= mean * (1.0 + _MEAN_MARGIN)

    def clearly_below(L: float) -> bool:  # E[K](L) ≤ mean certainly, so L ≤ L*
        return truncated_negative_binomial_mean(L, shape) <= mean * (1.0 - _MEAN_MARGIN)

    hi = 1.0
    while not clearly_above(hi):
        hi *= 2.0
    # Invariant, side "account": hi ≥ L* (E[K] clearly above the target at hi). Side "draw":
    # lo ≤ L* (clearly below, or 0). A midpoint within rounding of the target moves the other end.
    lo = 0.0
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        if (clearly_above(mid)) if up else (not clearly_below(mid)):
            hi = mid
        else:
            lo = mid
    return hi if up else lo


def _gamma_of(L: float) -> Tuple[float, float]:
    """(γ, 1 − γ) for γ = e^{−L}, the complement without cancellation."""
    return math.exp(-L), -math.expm1(-L)


# ----------------------------------------------------------------------------- the RDP bound


def _check_curve(orders: Any, rdp: Any) -> Tuple[np.ndarray, np.ndarray]:
    o = np.asarray(orders, dtype=np.float64).ravel()
    r = np.asarray(rdp, dtype=np.float64).ravel()
    if o.size == 0:
        raise ValueError("orders must hold at least one order")
    if o.shape != r.shape:
        raise ValueError(f"orders and rdp must have the same length, got {o.size} and {r.size}")
    if np.isnan(o).any() or not (o > 1).all():
        raise ValueError("orders must all be > 1")
    if np.isnan(r).any() or (r < 0).any():
        raise ValueError("rdp values must be >= 0 (inf allowed)")
    return o, r


def _log_delta_grid(o: np.ndarray, r: np.ndarray, eps_hat: float) -> float:
    """log δ̂ at ε̂ from the RDP curve (o, r), rounded up: the smallest over the grid of
    (a) log δ = (α − 1)(r − ε̂ + log(1 − 1/α)) − log α (Canonne, Kamath & Steinke 2020,
    Proposition 12) and (b) log √(1 − e^{−r}) (δ(ε̂) ≤ δ(0) = TV ≤ √(1 − e^{−KL}),
    Bretagnolle–Huber, and KL ≤ D_α for α > 1), capped at 0 (δ ≤ 1)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        fin = np.isfinite(r)
        a = np.where(fin, (o - 1.0) * (r - eps_hat + np.log1p(-1.0 / o)) - np.log(o), np.inf)
        # Float error of (a): a few ulps of each of its terms' magnitudes.
        a = a + 1e-12 * (1.0 + (o - 1.0) * (np.abs(r) + eps_hat + np.abs(np.log1p(-1.0 / o))) + np.log(o))
        # 1 − e^{−r} through expm1: for a tiny r, log1p(−exp(−r)) would round to log(0).
        b = np.where(fin, 0.5 * np.log(-np.expm1(-r)), 0.0)
        b = np.where(r == 0, -np.inf, b + 1e-12)
    best = float(np.nanmin(np.minimum(a, b)))
    return min(best, 0.0)


def rdp_repeat_and_select(orders: Any, rdp: Any, mean: float, shape: float) -> np.ndarray:
    """RDP of the best of K runs of a mechanism whose RDP is ``rdp`` at ``orders``, K drawn from
    the distribution of ``mean`` and ``shape`` (Papernot & Steinke 2022, arXiv:2110.03620).

    ``shape`` finite: D_{η,γ} with η = ``shape`` and E[K] = ``mean``; Theorem 2, with λ̂ ranging
    over the grid: ε'(λ) = ε(λ) + log(E[K])/(λ − 1) + (1 + η)·min_λ̂ [(1 − 1/λ̂)ε(λ̂) + log(1/γ)/λ̂].
    γ comes from :func:`truncated_negative_binomial_log_inverse_gamma` on the safe side.
    ``shape = inf``: K ~ Poisson(``mean``); Theorem 6: ε'(λ) = ε(λ) + μ·δ̂(λ) + log(μ)/(λ − 1),
    δ̂(λ) the (ε̂, δ̂)-DP of one run at ε̂ = log(1 + 1/(λ − 1)) from its RDP curve (CKS 2020,
    Proposition 12, and the KL bound), rounded up.
    Then monotonicity in the order: ε'(λ) ← min over grid orders λ' ≥ λ of ε'(λ').

    Returns a float64 array in the order of ``orders`` (each > 1), rounded up. An infinite run
    curve gives an infinite result where the theorems do.
    """
    o, r = _check_curve(orders, rdp)
    mean, shape = check_distribution(mean, shape)
    log_mean = math.log(mean)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if math.isinf(shape):
            out = np.empty_like(o)
            for i, (lam, eps) in enumerate(zip(o.tolist(), r.tolist())):
                eps_hat = math.log1p(1.0 / (lam - 1.0)) if math.isfinite(lam) else 0.0
                delta_hat = math.exp(_log_delta_grid(o, r, eps_hat))
                tail = log_mean / (lam - 1.0) if math.isfinite(lam) else 0.0
                out[i] = eps + mean * delta_hat + tail
        else:
            L = truncated_negative_binomial_log_inverse_gamma(mean, shape, side="account")
            inv = np.where(np.isinf(o), 0.0, 1.0 / o)
            hat = np.where(np.isinf(r), np.inf, (1.0 - inv) * r + L * inv)
            c = (1.0 + shape) * float(np.min(hat))
            tail = np.where(np.isinf(o), 0.0, log_mean / (o - 1.0))
            out = r + c + tail
    # Monotonicity in λ: a reverse running minimum over the orders sorted ascending.
    idx = np.argsort(o, kind="stable")
    mono = np.minimum.accumulate(out[idx][::-1])[::-1]
    res = np.empty_like(out)
    res[idx] = mono
    # Sums and products of a few non-negative terms, each within a few ulps: round up.
    return np.nextafter(res * (1.0 + 1e-12), np.inf)


def repeat_and_select_rdp(event: Any, orders: Any, neighboring: str = "add_or_remove") -> np.ndarray:
    """The RDP curve of a :class:`dpcore.events.RepeatAndSelectEvent` at ``orders``: the inner
    event's curve from a fresh :class:`~dpcore.accounting.RdpAccountant` (same orders, same
    neighbouring relation; any event it supports, tuned events included), transformed by
    :func:`rdp_repeat_and_select`. Raises what that accountant raises for an unsupported inner
    event."""
    # By name, not by import: the RDP accountant imports this module to analyse these events.
    sub = make_accountant("rdp", neighboring, orders=orders)
    sub.compose(event.event)
    return rdp_repeat_and_select(sub.orders, sub.rdp, event.mean, event.shape)


# ----------------------------------------------------------------------------- the distribution of K


def num_runs_pmf(mean: float, shape: float, max_runs: int) -> np.ndarray:
    """P[K = k] for k = 0 … ``max_runs`` under the distribution :func:`draw_num_runs` draws from
    (for D_{η,γ}, the γ of ``side="draw"``; P[K = 0] = 0 there). For tests and for planning."""
    mean, shape = check_distribution(mean, shape)
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 0:
        raise ValueError(f"max_runs must be an int >= 0, got {max_runs!r}")
    k = np.arange(max_runs + 1, dtype=np.float64)
    lg = np.vectorize(math.lgamma, otypes=[np.float64])
    if math.isinf(shape):
        return np.exp(-mean + k * math.log(mean) - lg(k + 1.0))
    L = truncated_negative_binomial_log_inverse_gamma(mean, shape, side="draw")
    out = np.zeros(max_runs + 1)
    if L == 0.0:
        if max_runs >= 1:
            out[1] = 1.0
        return out
    _, one_minus = _gamma_of(L)
    kk = k[1:]
    if shape == 0:
        logp = kk * math.log(one_minus) - np.log(kk) - math.log(L)
    else:
        logp = kk * math.log(one_minus) + lg(kk + shape) - math.lgamma(shape) - lg(kk + 1.0) - math.log(math.expm1(shape * L))
    out[1:] = np.exp(logp)
    return out


class _ChaChaSource:
    """Exponential and uniform variates from ChaCha20 Gaussians (:func:`dpcore.mechanism.gaussian_noise`,
    keyed from the OS on every chunk unless a test seed is given): E = (Z₁² + Z₂²)/2 is exactly
    Exp(1) (χ²₂/2), and e^{−E} is exactly uniform on (0, 1]."""

    def __init__(self, seed: Optional[int]) -> None:
        self._seed = seed
        self._chunk = 0
        self._z = np.empty(0)
        self._pos = 0

    def _refill(self, n: int) -> None:
        from ..mechanism import gaussian_noise

        seed = None
        if self._seed is not None:
            # One derived key per chunk, so that a test seed gives a reproducible sequence.
            h = hashlib.blake2b(f"dpcore.num_runs:{self._seed}:{self._chunk}".encode(), digest_size=8).digest()
            seed = int.from_bytes(h, "little")
        self._chunk += 1
        self._z = gaussian_noise(max(256, 2 * n), 1.0, dtype=np.float64, seed=seed, parallel=False)
        self._pos = 0

    def normals(self, n: int) -> np.ndarray:
        if self._pos + n > self._z.size:
            self._refill(n)
        out = self._z[self._pos : self._pos + n]
        self._pos += n
        return out

    def exponentials(self, n: int) -> np.ndarray:
        z = self.normals(2 * n)
        return 0.5 * (z[0::2] ** 2 + z[1::2] ** 2)

    def exponential(self) -> float:
        return float(self.exponentials(1)[0])

    def uniform(self) -> float:
        return math.exp(-self.exponential())

    def bernoulli(self, p: float) -> bool:
        """True with probability p: e^{−E} < p ⇔ E > log(1/p)."""
        if p >= 1.0:
            return True
        return p > 0.0 and self.exponential() > -math.log(p)

    def failures(self, log_inv_fail: float) -> int:
        """Geometric failures before a success, P[G ≥ k] = e^{−k·c} with c = ``log_inv_fail`` =
        log(1/(1 − γ)): G = ⌊E/c⌋."""
        if math.isinf(log_inv_fail):
            return 0
        return int(math.floor(self.exponential() / log_inv_fail))

    def poisson(self, mu: float) -> int:
        """Poisson(μ): the arrivals by time μ of a unit-rate process (exponential spacings)."""
        k, t = 0, 0.0
        while True:
            n = int(min(max(64.0, 1.25 * (mu - t) + 64.0), 1 << 16))
            s = t + np.cumsum(self.exponentials(n))
            inside = int(np.searchsorted(s, mu, side="right"))
            k += inside
            if inside < n:
                return k
            t = float(s[-1])

    def gamma(self, a: float) -> float:
        """Gamma(a, 1) (Marsaglia & Tsang 2000, exact rejection; a < 1 through
        Gamma(a + 1)·U^{1/a})."""
        if a < 1.0:
            return self.gamma(a + 1.0) * math.exp(-self.exponential() / a)
        d = a - 1.0 / 3.0
        c = 1.0 / math.sqrt(9.0 * d)
        while True:
            x = float(self.normals(1)[0])
            v = 1.0 + c * x
            if v <= 0.0:
                continue
            v = v * v * v
            if -self.exponential() < 0.5 * x * x + d - d * v + d * math.log(v):
                return d * v


# Non-integer η draws NB(η, γ) by rejection of K = 0; beyond this many expected tries (a mean
# very close to 1 with a small η) drawing is refused rather than left to spin.
_MAX_EXPECTED_TRIES = 1e5


def draw_num_runs(mean: float, shape: float, *, seed: Optional[int] = None) -> int:
    """Draws the number of runs K of a tuning study (Papernot & Steinke 2022), from ChaCha20
    keyed from the operating system.

    ``shape = inf``: K ~ Poisson(``mean``) (K may be 0: then no run is made and nothing is
    released). Finite ``shape`` = η: K ~ D_{η,γ} with E[K] ≤ ``mean`` (γ from
    :func:`truncated_negative_binomial_log_inverse_gamma`, ``side="draw"``):

    * η = 0 (logarithmic): the mixture of geometric distributions on {1, 2, …} with failure
      probability q = 1 − γ^V, V uniform (Kemp 1981; P[K = k] = ∫₀¹ (1 − q)q^{k−1} dV =
      (1 − γ)^k / (k·log(1/γ))).
    * η a positive integer: NB(η, γ) is a sum of η geometric failure counts G_i; conditioned on
      the sum being ≥ 1, the first non-zero G_J has P[J = j] ∝ γ^{j−1} (j ≤ η), G_J is 1 + a
      geometric (memorylessness), the later ones unconditioned. No rejection.
    * other η > 0: NB(η, γ) as Poisson(Λ), Λ ~ Gamma(η, (1 − γ)/γ), drawn until K ≥ 1.

    ``seed`` is **for tests only**: a K drawn from a known seed is known, and the guarantee of
    Theorems 2 and 6 relies on K being random and secret. K must be drawn before any run and
    not changed afterwards (:meth:`dpcore.study.Study.create` records it).
    """
    from ..mechanism import _seed as _check_seed

    mean, shape = check_distribution(mean, shape)
    seed = _check_seed(seed)
    if mean > MAX_DRAW_MEAN:
        raise ValueError(f"mean = {mean:g} expected runs is more than draw_num_runs supports ({MAX_DRAW_MEAN:g})")
    src = _ChaChaSource(seed)
    if math.isinf(shape):
        return src.poisson(mean)
    L = truncated_negative_binomial_log_inverse_gamma(mean, shape, side="draw")
    if L == 0.0:
        return 1
    gamma, one_minus = _gamma_of(L)
    c = -math.log(one_minus)  # log(1/(1 − γ)): the scale of a geometric failure count
    if shape == 0:
        q = -math.expm1(-L * src.uniform())  # 1 − γ^V
        return 1 + (0 if q <= 0.0 else src.failures(-math.log(q)))
    if shape == int(shape) and shape <= 1e4:
        eta = int(shape)
        j = eta
        for i in range(1, eta):
            # P[J = i | J ≥ i] = (1 − γ)/(1 − γ^{η−i+1})
            if src.bernoulli(one_minus / -math.expm1(-L * (eta - i + 1))):
                j = i
                break
        return 1 + src.failures(c) + sum(src.failures(c) for _ in range(eta - j))
    accept = -math.expm1(-shape * L)  # P[NB ≥ 1] = 1 − γ^η
    if 1.0 / accept > _MAX_EXPECTED_TRIES:
        raise ValueError(
            f"drawing K with shape {shape:g} and mean {mean:g} would need about {1.0 / accept:.3g} tries; use "
            "an integer shape (0, 1, 2, …) or a larger mean"
        )
    scale = one_minus / gamma
    while True:
        k = src.poisson(src.gamma(shape) * scale)
        if k >= 1:
            return k
