"""Exact privacy curves of small adversarial pairs of data sets, for tests/test_relations_exact.py
(a helper module: not collected by pytest).

The releases: one noisy sum per step, y_t = Σ_{i in batch t} x_i + N(0, z²), records x_i in
[−1, 1] (clip C = 1). Given the permutation(s) of the loader, y is Gaussian with covariance z²·I
and a mean vector; unconditionally it is a finite mixture of such Gaussians. The adversarial
pairs used here have all records but one identical, so only the position of the distinguished
record matters, and one side of the pair (the data set without the record, or with the record
set to the others' value) is DETERMINISTIC: a single Gaussian, the reference N(m, z²I). The
other side is a mixture Σ_c w_c N(m + a_c, z²I) over where the record lands.

With the reference as base measure, the likelihood ratio of the mixture is

    R(x) = Σ_c w_c exp(<x, a_c>/z − |a_c|²/(2z²)),        x ~ N(0, I) under the reference,

and the two hockey-stick divergences (the two directions of the pair) are

    H_{e^ε}(mix || ref) = E_mix[(1 − e^{ε − L})_+],   L = log R,
    H_{e^ε}(ref || mix) = E_ref[(1 − e^{ε + L})_+].

So both curves are expectations over the distribution of the privacy loss L, under the
mixture and under the reference. This module computes those distributions on a lattice
{i·h} with CERTIFIED rounding: every value is rounded up (a pessimistic distribution, which
stochastically dominates the true loss) or down (an optimistic one, dominated by it), the masses
being exact Gaussian cell probabilities; L is built from Gaussian terms by log-sum-exp
(monotone and 1-Lipschitz, so rounding the inputs up rounds the output up), tails beyond
T standard deviations go to +∞ (pessimistic) or −∞ (optimistic). Composition over independent
epochs is convolution of the lattice distributions (exact on the lattice, up to the FFT's
rounding, ~1e-16 absolute per point). Hence every
δ(ε) below comes as a bracket [δ_lo, δ_hi] ∋ δ(ε), and ε(δ) as a bracket [ε_lo, ε_hi] ∋ ε(δ),
up to floating-point rounding (absolute errors of order 1e-13 in δ). No Monte Carlo.

A deterministic pair (fixed order) is a Gaussian mechanism with μ = |Δmean|/z and its curve is
analytic (Balle & Wang 2018, Thm 8), evaluated in log space so that ε ≈ 500 is fine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np
from scipy.optimize import brentq
from scipy.signal import fftconvolve
from scipy.special import log_ndtr, ndtr

TAIL_SD = 9.0  # Gaussian terms are discretized on mean ± TAIL_SD·sd; the rest goes to ±∞ (mass < 3e-19)


# ------------------------------------------------------------------------------ analytic Gaussian


def gaussian_delta(mu: float, eps: float) -> float:
    """δ(ε) of the Gaussian mechanism of sensitivity/σ = μ (both directions alike):
    Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), computed in log space."""
    if mu <= 0:
        return 0.0
    a = float(log_ndtr(-eps / mu + mu / 2))
    b = eps + float(log_ndtr(-eps / mu - mu / 2))
    if b >= a:
        return 0.0
    return math.exp(a) * -math.expm1(b - a)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for the Gaussian mechanism μ (bisection, 1e-12)."""
    if mu <= 0 or gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(mu, hi) > delta:
        hi *= 2
    f = lambda e: math.log(max(gaussian_delta(mu, e), 1e-300)) - math.log(delta)  # noqa: E731
    return brentq(f, 0.0, hi, xtol=1e-13, rtol=1e-14)


def mixture_1d_delta(w: float, mu: float, eps: float, direction: str) -> float:
    """Closed form of the 1-D pair Q = w·N(μ, 1) + (1 − w)·N(0, 1) vs P = N(0, 1):
    ``direction="mix"``: H_{e^ε}(Q||P); ``"ref"``: H_{e^ε}(P||Q). Used to check the engine."""
    c = math.exp(eps)
    if direction == "mix":
        # q/p = w e^{μx − μ²/2} + 1 − w ≥ e^ε  ⟺  x ≥ x*
        xs = (math.log((c - 1 + w) / w) + mu * mu / 2) / mu
        return w * float(ndtr(mu - xs)) + (1 - w - c) * float(ndtr(-xs))
    # p/q ≥ e^ε ⟺ w e^{μx − μ²/2} ≤ K = e^{−ε} − (1 − w)
    K = 1 / c - (1 - w)
    if K <= 0:
        return 0.0
    xd = (math.log(K / w) + mu * mu / 2) / mu
    return (1 - c * (1 - w)) * float(ndtr(xd)) - c * w * float(ndtr(xd - mu))


# ------------------------------------------------------------------------------ lattice distributions


@dataclass
class Lat:
    """A distribution on the lattice {i·h}: mass p[k] at (off + k)·h, and ``atom`` at +∞ (``up``:
    every value rounded up, a pessimistic version) or at −∞ (not ``up``: rounded down)."""

    h: float
    up: bool
    off: int
    p: np.ndarray
    atom: float = 0.0

    @property
    def values(self) -> np.ndarray:
        return (self.off + np.arange(len(self.p))) * self.h

    def total(self) -> float:
        return float(self.p.sum()) + self.atom

    def trim(self, tol: float = 1e-30) -> "Lat":
        """Moves the end masses below ``tol`` (in all) to the end that keeps the rounding
        direction: up: the low end onto the first kept point, the high end to +∞; down: the
        reverse. Keeps the arrays short; certified."""
        p = np.clip(self.p, 0.0, None)
        if len(p) == 0:
            return Lat(self.h, self.up, 0, np.zeros(1), self.atom)
        c_lo = np.cumsum(p)
        c_hi = np.cumsum(p[::-1])[::-1]
        i0 = int(np.searchsorted(c_lo, tol / 2, side="right"))
        i1 = len(p) - 1 - int(np.searchsorted(c_hi[::-1], tol / 2, side="right"))
        if i0 > i1:
            i0 = i1 = int(np.argmax(p))
        low, high = float(p[:i0].sum()), float(p[i1 + 1:].sum())
        q = p[i0:i1 + 1].copy()
        atom = self.atom
        if self.up:
            q[0] += low
            atom += high
        else:
            q[-1] += high
            atom += low
        return Lat(self.h, self.up, self.off + i0, q, atom)

    def shift(self, k: int) -> "Lat":
        return Lat(self.h, self.up, self.off + int(k), self.p, self.atom)

    def neg(self) -> "Lat":
        """The distribution of −X (rounding direction flips with the sign)."""
        return Lat(self.h, not self.up, -(self.off + len(self.p) - 1), self.p[::-1].copy(), self.atom)


def _idx(x: float, h: float, up: bool) -> int:
    """The lattice index of x rounded up (or down), with a margin against float rounding."""
    y = x / h
    return int(math.ceil(y + 1e-9 * max(1.0, abs(y)))) if up else int(math.floor(y - 1e-9 * max(1.0, abs(y))))


def const(x: float, h: float, up: bool) -> Lat:
    """A point mass at x (rounded)."""
    if x == -math.inf:
        if up:
            raise ValueError("−∞ is not representable rounded up; leave the term out")
        return Lat(h, up, 0, np.zeros(1), 1.0)
    return Lat(h, up, _idx(x, h, up), np.ones(1), 0.0)


def _cell_masses(edges_z: np.ndarray) -> np.ndarray:
    """P(Z in [z_k, z_{k+1}]) for a standard normal Z, accurate in both tails."""
    a, b = edges_z[:-1], edges_z[1:]
    return np.where(b <= 0, ndtr(b) - ndtr(a), ndtr(-a) - ndtr(-b))


def gauss(mean: float, sd: float, h: float, up: bool, tail: float = TAIL_SD) -> Lat:
    """The distribution of mean + sd·Z, Z ~ N(0, 1), rounded onto the lattice."""
    if sd == 0:
        return const(mean, h, up)
    lo = int(math.floor((mean - tail * sd) / h))
    hi = int(math.ceil((mean + tail * sd) / h))
    edges = (np.arange(lo, hi + 1) * h - mean) / sd  # the lattice points lo..hi
    inner = _cell_masses(edges)  # (v_k, v_{k+1}] for k = lo..hi−1
    below = float(ndtr(edges[0]))
    above = float(ndtr(-edges[-1]))
    if up:  # mass in (v_{k−1}, v_k] at v_k: points lo..hi; below v_lo onto v_lo; above v_hi to +∞
        p = np.concatenate([[below], inner])
        return Lat(h, True, lo, p, above)
    p = np.concatenate([inner, [above]])  # [v_k, v_{k+1}) at v_k: points lo..hi; below v_lo to −∞
    return Lat(h, False, lo, p, below)


@lru_cache(maxsize=None)
def _lse_table(h: float, up: bool) -> Tuple[np.ndarray, int, int]:
    """o(d): log(e^{ih} + e^{(i−d)h}) = (i + o(d))·h rounded: o(d) = ⌈log1p(e^{−dh})/h⌉ (up) or ⌊·⌋
    (down) for d < D, and the constant o_inf (1 up, 0 down) for d ≥ D."""
    x_at = lambda d: np.log1p(np.exp(-np.asarray(d, float) * h)) / h  # noqa: E731
    o_inf = 1 if up else 0
    # x(d) ≤ 1 (up) / < 1 (down) from d ≈ −log(e^h − 1)/h on
    dmax = int(math.ceil(-math.log(math.expm1(h)) / h)) + 8
    x = x_at(np.arange(dmax + 1))
    o = np.ceil(x * (1 + 1e-12)).astype(np.int64) if up else np.floor(x * (1 - 1e-12)).astype(np.int64)
    o = np.maximum(o, o_inf)
    D = len(o)
    while D > 0 and o[D - 1] == o_inf:
        D -= 1
    return o[:D].copy(), D, o_inf


def _o_of(absd: np.ndarray, h: float, up: bool) -> np.ndarray:
    o, D, o_inf = _lse_table(h, up)
    if D == 0:
        return np.full(absd.shape, o_inf, np.int64)
    return np.where(absd < D, o[np.minimum(absd, D - 1)], o_inf)


def lse(U: Lat, V: Lat) -> Lat:
    """The distribution of log(e^U + e^V), U and V independent (same lattice and rounding)."""
    assert U.h == V.h and U.up == V.up
    h, up = U.h, U.up
    if len(V.p) == 1 and len(U.p) > 1:
        U, V = V, U
    if len(U.p) == 1:  # a point (plus its atom) against V: a pointwise map of V
        c = U.off
        d = V.off + np.arange(len(V.p)) - c
        idx = c + np.maximum(d, 0) + _o_of(np.abs(d), h, up)
        lo = int(min(c, V.off))
        out: np.ndarray = np.asarray(np.bincount(idx - lo, weights=U.p[0] * V.p), dtype=float)
        if up:
            atom = 1.0 - (1.0 - U.atom) * (1.0 - V.atom)
        else:
            atom = U.atom * V.atom
            out = np.concatenate([out, np.zeros(max(0, V.off + len(V.p) - lo - len(out)))])
            out[V.off - lo:V.off - lo + len(V.p)] += U.atom * V.p
            out[c - lo] += V.atom * U.p[0]
        return Lat(h, up, lo, out, atom).trim()
    a0 = min(U.off, V.off)
    N = max(U.off + len(U.p), V.off + len(V.p)) - a0
    P = np.zeros(N)
    Q = np.zeros(N)
    P[U.off - a0:U.off - a0 + len(U.p)] = U.p
    Q[V.off - a0:V.off - a0 + len(V.p)] = V.p
    o, D, o_inf = _lse_table(h, up)
    top = (int(o[0]) if D else o_inf) + 1
    acc: np.ndarray = np.zeros(N + top + 1)
    # CP[N + k] = Σ_{j<k} P[j] for k = −N..N (zero for k ≤ 0): window sums are slices
    CP = np.concatenate([np.zeros(N + 1), np.cumsum(P)])
    CQ = np.concatenate([np.zeros(N + 1), np.cumsum(Q)])
    # d = 0: both at i
    o0 = int(o[0]) if D else o_inf
    acc[o0:o0 + N] += P * Q
    # groups of d ≥ 1 with one offset v: d in [dlo, dhi] (dhi = ∞ for the last)
    groups: List[Tuple[int, int, Optional[int]]] = []
    if D > 1:
        brk = np.flatnonzero(np.diff(o[1:])) + 1  # positions in o[1:] where o changes
        starts = np.concatenate([[0], brk]) + 1  # as values of d
        ends = np.concatenate([brk, [D - 1]])
        for s_, e_ in zip(starts, ends):
            groups.append((int(o[s_]), int(s_), int(e_)))
        groups.append((o_inf, D, None))
    else:
        groups.append((o_inf, max(D, 1), None))
    for v, dlo, dhi in groups:
        if dlo > N - 1:
            continue
        # Σ_{j = i−dhi}^{i−dlo} = C[i − dlo + 1] − C[i − dhi]
        a = N + 1 - dlo
        wq = CQ[a:a + N].copy()
        wp = CP[a:a + N].copy()
        if dhi is not None and dhi < N:
            b = N - dhi
            wq -= CQ[b:b + N]
            wp -= CP[b:b + N]
        acc[v:v + N] += P * wq + Q * wp
    acc = np.clip(acc, 0.0, None)
    if up:
        atom = 1.0 - (1.0 - U.atom) * (1.0 - V.atom)
    else:  # −∞ ⊕ v = v
        atom = U.atom * V.atom
        acc[:N] += U.atom * Q + V.atom * P
    return Lat(h, up, a0, acc, atom).trim()


def lse_many(terms: Sequence[Lat]) -> Lat:
    terms = list(terms)
    while len(terms) > 1:
        nxt = [lse(terms[k], terms[k + 1]) for k in range(0, len(terms) - 1, 2)]
        if len(terms) % 2:
            nxt.append(terms[-1])
        terms = nxt
    return terms[0]


def _power(T: Lat, m: int, op: Any) -> Lat:
    """m copies of T combined by ``op`` (associative), by doubling."""
    out: Optional[Lat] = None
    sq = T
    while m:
        if m & 1:
            out = sq if out is None else op(out, sq)
        m >>= 1
        if m:
            sq = op(sq, sq)
    assert out is not None
    return out


def lse_power(T: Lat, m: int) -> Lat:
    """LSE of m independent copies of T, by doubling."""
    return _power(T, m, lse)


def add(U: Lat, V: Lat) -> Lat:
    """The distribution of U + V, independent (exact on the lattice)."""
    assert U.h == V.h and U.up == V.up
    p = fftconvolve(U.p, V.p) if min(len(U.p), len(V.p)) > 64 else np.convolve(U.p, V.p)
    atom = 1.0 - (1.0 - U.atom) * (1.0 - V.atom)
    return Lat(U.h, U.up, U.off + V.off, np.clip(p, 0.0, None), atom).trim()


def add_power(U: Lat, m: int) -> Lat:
    """The sum of m independent copies of U."""
    return _power(U, m, add)


def mix(items: Iterable[Tuple[float, Lat]]) -> Lat:
    items = [(w, L) for w, L in items if w > 0]
    h, up = items[0][1].h, items[0][1].up
    a0 = min(L.off for _, L in items)
    a1 = max(L.off + len(L.p) for _, L in items)
    p = np.zeros(a1 - a0)
    atom = 0.0
    for w, L in items:
        assert L.h == h and L.up == up
        p[L.off - a0:L.off - a0 + len(L.p)] += w * L.p
        atom += w * L.atom
    return Lat(h, up, a0, p, atom)


def lse_shared(Wp: Lat, v_mean: float, v_sd: float, tail: float = TAIL_SD) -> Lat:
    """The distribution of log(e^{W' − v} + e^{v}), W' (lattice) independent of
    v ~ N(v_mean, v_sd²): the loss when one coordinate enters two terms with opposite signs.
    v is cut into lattice cells; in cell ((m−1)h, mh] (up) the two exponents are at most
    W' − (m−1)h and m·h, in [mh, (m+1)h) (down) at least W' − (m+1)h and m·h; the tails of v
    (beyond ``tail`` sd) go to +∞ (up) or −∞ (down).

    With u the index of the first exponent and d = u − m, the output index is m + g(d),
    g(d) = max(d, 0) + o(|d|); for each d the pairs (m, w) form a stride-2 diagonal whose
    outputs are consecutive, so the sum is one vector operation per d."""
    h, up = Wp.h, Wp.up
    lo = int(math.floor((v_mean - tail * v_sd) / h))
    hi = int(math.ceil((v_mean + tail * v_sd) / h))
    edges = (np.arange(lo, hi + 1) * h - v_mean) / v_sd
    cells = _cell_masses(edges)  # up: cell m = lo+1..hi is (v_{m−1}, v_m]; down: m = lo..hi−1 is [v_m, v_{m+1})
    tails = float(ndtr(edges[0])) + float(ndtr(-edges[-1]))
    m_lo = lo + 1 if up else lo
    m_hi = m_lo + len(cells) - 1
    s = 1 if up else -1  # u = w − m + s, d = w − 2m + s
    w_lo, pw = Wp.off, Wp.p
    w_hi = w_lo + len(pw) - 1
    o, D, o_inf = _lse_table(h, up)
    o_max = int(o[0]) if D else o_inf
    out_lo = min(m_lo, w_lo - m_hi + s) - 1
    out_hi = max(m_hi, w_hi - m_lo + s) + o_max + 1
    acc = np.zeros(out_hi - out_lo + 1)
    halves = (np.ascontiguousarray(pw[0::2]), np.ascontiguousarray(pw[1::2]))  # stride-2 reads made contiguous
    for d in range(w_lo - 2 * m_hi + s, w_hi - 2 * m_lo + s + 1):
        a = max(m_lo, -((d - s - w_lo) // 2))  # ceil((w_lo − d + s)/2)
        b = min(m_hi, (w_hi - d + s) // 2)
        if a > b:
            continue
        ad = -d if d < 0 else d
        g = (d if d > 0 else 0) + (int(o[ad]) if ad < D else o_inf)
        w0 = d + 2 * a - s - w_lo  # pw[w0], pw[w0 + 2], …, pw[w0 + 2(b − a)]
        half = halves[w0 & 1]
        acc[a + g - out_lo:b + g - out_lo + 1] += cells[a - m_lo:b - m_lo + 1] * half[w0 >> 1:(w0 >> 1) + b - a + 1]
    if up:  # W' = +∞ or v in its tails: +∞
        atom = 1.0 - (1.0 - Wp.atom) * (1.0 - tails)
    else:  # v in its tails: −∞ (a lower bound); W' = −∞: the loss is v ≥ m·h
        atom = tails
        if Wp.atom > 0:
            acc[np.arange(m_lo, m_hi + 1) - out_lo] += Wp.atom * cells
    return Lat(h, up, out_lo, np.clip(acc, 0.0, None), atom).trim()


# ------------------------------------------------------------------------------ hockey-stick and ε


def delta_of(L: Lat, eps: float) -> float:
    """E[(1 − e^{ε − L})_+] of the lattice loss L: an upper bound when L is rounded up, a lower
    bound when rounded down."""
    v = L.values
    sel = v > eps
    d = float(np.dot(L.p[sel], -np.expm1(eps - v[sel])))
    return d + (L.atom if L.up else 0.0)


def epsilon_of(L: Lat, delta: float, xtol: float = 1e-10) -> float:
    """The smallest ε ≥ 0 with delta_of(L, ε) ≤ delta (ε ↦ δ is continuous and decreasing)."""
    if L.up and L.atom >= delta:
        return math.inf
    if delta_of(L, 0.0) <= delta:
        return 0.0
    hi = float(L.values[-1]) + 1.0
    f = lambda e: delta_of(L, e) - delta  # noqa: E731
    return brentq(f, 0.0, hi, xtol=xtol, rtol=1e-12)


@dataclass
class PairLoss:
    """The privacy losses of one adjacent pair (mixture M vs reference), each rounded up and down:
    ``mix_up/mix_dn``: L = log(dM/dref) under M; ``ref_up/ref_dn``: −L under the reference."""

    mix_up: Lat
    mix_dn: Lat
    ref_up: Lat
    ref_dn: Lat

    def compose(self, m: int) -> "PairLoss":
        """m independent copies of the pair (e.g. m epochs with a fresh permutation each)."""
        return PairLoss(*(add_power(L, m) for L in (self.mix_up, self.mix_dn, self.ref_up, self.ref_dn)))

    def delta(self, eps: float) -> Tuple[float, float, float, float]:
        """(lo, hi) of H(M||ref) then (lo, hi) of H(ref||M) at ε."""
        return (delta_of(self.mix_dn, eps), delta_of(self.mix_up, eps),
                delta_of(self.ref_dn, eps), delta_of(self.ref_up, eps))

    def epsilons(self, delta: float) -> "Epsilons":
        return Epsilons(
            mix=(epsilon_of(self.mix_dn, delta), epsilon_of(self.mix_up, delta)),
            ref=(epsilon_of(self.ref_dn, delta), epsilon_of(self.ref_up, delta)),
        )


@dataclass
class Epsilons:
    """ε(δ) brackets of the two directions: ``mix`` = H(M||ref) (the data set holding the
    distinguished record against the one without it, for add/remove), ``ref`` the reverse."""

    mix: Tuple[float, float]
    ref: Tuple[float, float]

    @property
    def lo(self) -> float:
        return max(self.mix[0], self.ref[0])

    @property
    def hi(self) -> float:
        return max(self.mix[1], self.ref[1])

    @property
    def mid(self) -> float:
        return 0.5 * (self.lo + self.hi)


# ------------------------------------------------------------------------------ mixtures of the loaders


def orthogonal_pair(weights: Sequence[float], mus: Sequence[float], h: float, w0: float = 0.0) -> PairLoss:
    """M = w0·N(0, I) + Σ_j w_j N(μ_j e_j, I) against ref = N(0, I) (mean shifts on disjoint
    coordinates, standardized by z): L = log(w0 + Σ_j w_j e^{μ_j x_j − μ_j²/2}).

    This is one permutation shared by every step (fixed batches): the record is in batch j
    (prob. w_j, mean shift s·1 on the P_j steps of batch j: μ_j = s·√P_j / z) or dropped (w0);
    and one epoch of a shuffle under zero-out or replace-one (batch j, prob. |B_j|/n, μ = s/z)."""
    weights = [float(w) for w in weights]
    mus = [float(m) for m in mus]
    assert abs(sum(weights) + w0 - 1) < 1e-12

    def term(j: int, shifted: bool, up: bool) -> Lat:
        w, mu = weights[j], mus[j]
        return gauss(math.log(w) - mu * mu / 2 + (mu * mu if shifted else 0.0), mu, h, up)

    def loss(shift: Optional[int], up: bool) -> Lat:
        # identical unshifted terms are combined by doubling
        keys: dict = {}
        for j in range(len(weights)):
            if j == shift:
                continue
            keys.setdefault((weights[j], mus[j]), []).append(j)
        parts = [lse_power(term(js[0], False, up), len(js)) for js in keys.values()]
        if shift is not None:
            parts.append(term(shift, True, up))
        if w0 > 0:
            parts.append(const(math.log(w0), h, up))
        return lse_many(parts)

    cache = {}

    def loss_c(shift: Optional[int], up: bool) -> Lat:
        # components with the same (w, μ) give the same loss distribution
        key = (None if shift is None else (weights[shift], mus[shift]), up)
        if key not in cache:
            cache[key] = loss(shift, up)
        return cache[key]

    def under_mix(up: bool) -> Lat:
        items = [(w0, loss_c(None, up))] if w0 > 0 else []
        items += [(weights[j], loss_c(j, up)) for j in range(len(weights))]
        return mix(items).trim()

    return PairLoss(
        mix_up=under_mix(True),
        mix_dn=under_mix(False),
        ref_up=loss_c(None, False).neg(),  # −L rounded up = L rounded down, negated
        ref_dn=loss_c(None, True).neg(),
    )


def shuffle_insert_pair(k: int, w_full: float, w_last: float, z: float, h: float) -> PairLoss:
    """One shuffled epoch of k batches (k − 1 full ones and a short last one), all records at −1,
    against the same data set plus one record at +1 (the number of batches k unchanged). The
    record lands in full batch j (prob. ``w_full`` each; that batch sum rises by 2 and the last
    batch, one record longer, falls by 1: mean shift a_j = 2e_j − e_L) or in the last batch
    (``w_last``; a_L = e_L):

        L = log(Σ_j w_full e^{(2x_j − x_L)/z − 5/(2z²)} + w_last e^{x_L/z − 1/(2z²)}).

    With W' = log Σ_j w_full e^{2x_j/z} − 5/(2z²) + c_L, c_L = log w_last − 1/(2z²), and
    v = c_L + x_L/z: L = log(e^{W' − v} + e^v), which :func:`lse_shared` evaluates."""
    assert k >= 2 and abs((k - 1) * w_full + w_last - 1) < 1e-12
    cL = math.log(w_last) - 1 / (2 * z * z)
    base = math.log(w_full) - 5 / (2 * z * z) + cL

    def loss(comp: Optional[str], up: bool) -> Lat:
        # comp None: reference; "j": full batch 0 (x_0 ~ N(2/z, 1), x_L ~ N(−1/z, 1)); "L": x_L ~ N(1/z, 1)
        terms = []
        n_plain = k - 1
        if comp == "j":
            terms.append(gauss(base + 4 / (z * z), 2 / z, h, up))
            n_plain -= 1
        if n_plain:
            terms.append(lse_power(gauss(base, 2 / z, h, up), n_plain))
        Wp = lse_many(terms)
        xL = {None: 0.0, "j": -1 / z, "L": 1 / z}[comp]
        return lse_shared(Wp, cL + xL / z, 1 / z)

    def under_mix(up: bool) -> Lat:
        return mix([((k - 1) * w_full, loss("j", up)), (w_last, loss("L", up))]).trim()

    return PairLoss(
        mix_up=under_mix(True),
        mix_dn=under_mix(False),
        ref_up=loss(None, False).neg(),
        ref_dn=loss(None, True).neg(),
    )


def gaussian_pair(mu: float, h: float) -> PairLoss:
    """The Gaussian mechanism μ on the lattice (L ~ N(μ²/2, μ²) in both directions): a check."""
    up = gauss(mu * mu / 2, mu, h, True)
    dn = gauss(mu * mu / 2, mu, h, False)
    return PairLoss(up, dn, up, dn)


# ------------------------------------------------------------------------------ loader schedules


def batches(n: int, batch_size: int, order: Sequence[int], *, drop_last: bool) -> List[List[int]]:
    """The batches of one epoch: ``order`` cut into runs of ``batch_size`` (the short last one
    kept unless ``drop_last``)."""
    out = [list(order[s:s + batch_size]) for s in range(0, n, batch_size)]
    if drop_last and out and len(out[-1]) < batch_size:
        out.pop()
    return out


def fixed_order_sums(values: Sequence[float], batch_size: int, steps: int) -> np.ndarray:
    """The noiseless releases of a fixed-order loader (no shuffle, last batch short), for
    ``steps`` steps (epochs wrap around)."""
    n = len(values)
    bs = batches(n, batch_size, list(range(n)), drop_last=False)
    v = np.asarray(values, float)
    return np.array([v[bs[t % len(bs)]].sum() for t in range(steps)])


def fixed_order_epsilon(values_a: Sequence[float], values_b: Sequence[float], batch_size: int,
                        steps: int, z: float, delta: float) -> Tuple[float, float]:
    """(μ, exact ε) of two data sets under a fixed-order loader: a deterministic pair, the
    Gaussian mechanism with μ = |Δ sums| / z."""
    d = fixed_order_sums(values_a, batch_size, steps) - fixed_order_sums(values_b, batch_size, steps)
    mu = float(np.linalg.norm(d)) / z
    return mu, gaussian_epsilon(mu, delta)


def alternating_first(n: int, batch_size: int) -> List[float]:
    """Records of a fixed-order data set whose first record, removed, moves every batch by the
    most: the first record of batch j is (−1)^j, the rest 0 (every full batch then changes by
    ±2, the short last one by ±1)."""
    v = [0.0] * n
    for j, s in enumerate(range(0, n, batch_size)):
        v[s] = 1.0 if j % 2 == 0 else -1.0
    return v


def shuffle2_delta_quad(w_full: float, w_last: float, z: float, eps: float, direction: str) -> float:
    """An independent check of :func:`shuffle_insert_pair` for k = 2 (not certified: adaptive
    quadrature): the 2-D hockey-stick integral, analytic in x_0 and by scipy's quad in x_L.
    M = w_full·N((2, −1)/z, I) + w_last·N((0, 1)/z, I), ref = N(0, I)."""
    from scipy.integrate import quad
    from scipy.stats import norm

    a0, aL, bL = 2 / z, -1 / z, 1 / z
    c = math.exp(eps)

    def inner(xL: float) -> float:
        A = w_full * norm.pdf(xL - aL)  # × e^{a0 x0 − a0²/2} φ(x0)
        B = w_last * norm.pdf(xL - bL)  # × φ(x0)
        R = norm.pdf(xL)  # × φ(x0)
        if direction == "mix":  # (A e^{a0x0−a0²/2} + B − c R)_+
            K = c * R - B
            if K <= 0:
                return A + B - c * R
            t = (math.log(K / A) + a0 * a0 / 2) / a0
            return A * float(ndtr(a0 - t)) + (B - c * R) * float(ndtr(-t))
        K = R - c * B  # (R − c B − c A e^{…})_+
        if K <= 0:
            return 0.0
        t = (math.log(K / (c * A)) + a0 * a0 / 2) / a0
        return K * float(ndtr(t)) - c * A * float(ndtr(t - a0))

    lo, hi = -12.0 - 2 / z, 12.0 + 2 / z
    pts = np.linspace(lo, hi, 41)
    return float(sum(quad(inner, pts[i], pts[i + 1], epsabs=1e-16, epsrel=1e-11, limit=200)[0] for i in range(40)))
