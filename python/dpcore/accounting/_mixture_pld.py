"""Privacy loss distributions of mixture-of-Gaussians steps, composed in numpy.

The Rust core's PLD accountant (``rust/accounting/pld``) is specialised to the Poisson-subsampled
(and truncated-Poisson) Gaussian. A step of example-level sampling with a user-level guarantee
(ELS; Charles et al. 2024, arXiv:2407.07737) is a mixture of Gaussians: removing a user
removes up to K examples, each in the batch independently with probability q, so the sum moves by
k·C with probability Binom(K, q)(k). Its dominating pair (the mixture-of-Gaussians mechanism of
Ganesh 2024, arXiv:2401.10294; all contributions collinear is the worst case) is, in units of the
clip norm and with noise σ (the noise multiplier):

* remove: P = Σ_k w_k·N(s_k, σ²), Q = N(0, σ²); L(x) = log Σ_k w_k·e^{(2 s_k x − s_k²)/(2σ²)},
  increasing and convex in x, bounded below by log w_0 (w_0 the weight of s = 0);
* add: P = N(0, σ²), Q = Σ_k w_k·N(s_k, σ²); the loss is −L(x), decreasing in x.

This module discretises both pessimistically by "connect the dots" (Doroshenko, Ghazi, Kamath,
Kumar, Manurangsi 2022, arXiv:2207.04380, Algorithm 1) exactly as the core does for its pairs:
the atoms come from the cell masses of the two measures between the grid points
(p_i = y_i·Q(I_i) + N_{i−1}/(1 − e^{−Δ}) − N_i/(e^Δ − 1), N_i = P(I_i) − y_i·Q(I_i), y_i = e^{ε_i};
δ(ε_n) at +∞, the rest of the mass at the bottom atom), never from differences of δ. Its
hockey-stick curve is the interpolation (in e^ε) of the true curve at the grid points, above the
true (convex) curve everywhere: every ε it gives is an upper bound. Components whose weights sum
to at most a thousandth of the per-step tail budget are dropped: in the remove direction their
mass goes to the +∞ atom, in the add direction dropping them only lowers Q (both are dominating
pairs, see :func:`_kept`). Losses above 690 (where e^ε would overflow) are not placed on the grid:
connect the dots puts their mass at +∞, which dominates.

The steps are composed by FFT (Koskela, Jälkö, Honkela 2020, arXiv:1906.03049, §4), T identical
steps as a T-th power of the transform. The window comes from Chernoff bounds on the
composition's cumulant generating function; the finite mass above it is bounded and added to the
+∞ atom, mass wrapped into it from outside only adds mass (pessimistic), and atoms the transform
rounded below zero are set to zero. ε(δ) and δ(ε) come from the hockey-stick divergence
(Sommer, Meiser, Mohammadi 2019, Theorem 1); ε is the worse of the two directions.

A lower bound is computed beside it: losses rounded down onto the grid (a coupling with smaller
losses), for the remove direction (its lightest components dropped: a lighter P lowers the curve)
and for the add direction when no component was dropped, with the mass that may have wrapped into
the window added to δ. It is looser than the core's mirror of connect the dots (by up to Δ per
step in the loss: loose at 10⁵ steps) and is reported only as a lower bound.

The composition itself runs in the core (``_core.pld_compose``, ``rust/accounting/pld/compose.rs``):
tilted towards the δ or ε asked for, with the transform's floating-point rounding bounded and
added to every atom (subtracted for the lower bound), so that the rounding is covered here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

#: The default grid step Δ of the loss (dp_accounting's default, and the core's).
DEFAULT_INTERVAL = 1e-4
#: The composed window is at most this many atoms (an automatic grid is coarsened to fit).
MAX_BINS = 1 << 22
#: An automatic grid is refined so that the composed window holds at least this many atoms.
TARGET_BINS = 4096
MIN_INTERVAL = 1e-9
#: The lower bound is recomputed on finer grids while it is more than this fraction below the upper.
LOWER_GAP = 0.01
#: A step's grid evaluates at most WORK_PER_BIN·MAX_BINS normal tails (grid points × components):
#: a mixture of many components gets a coarser automatic grid.
WORK_PER_BIN = 32
#: Losses above this are not placed on the grid (e^ε would overflow): their mass is at +∞.
TOP_LOSS = 690.0


class GridTooLarge(ValueError):
    """The grid of one step or of the composition exceeds the atom budget (``bins`` atoms)."""

    def __init__(self, message: str, bins: float) -> None:
        super().__init__(message)
        self.bins = bins


@dataclass(frozen=True)
class Kind:
    """``count`` steps of the mixture ``Σ_k weights[k]·N(sensitivities[k], sigma²)`` against
    N(0, sigma²): sensitivities distinct and ≥ 0, weights > 0 summing to 1, some s > 0."""

    sigma: float
    sensitivities: Tuple[float, ...]
    weights: Tuple[float, ...]
    count: int


@dataclass
class Pld:
    """A discrete PLD: atom i at loss (offset + i)·interval, ``inf`` at +∞."""

    interval: float
    offset: int
    probs: np.ndarray
    inf: float = 0.0


def _ndtr(x: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(x)


def _cells(z: np.ndarray, increasing: bool) -> Tuple[np.ndarray, np.ndarray]:
    """Per component (columns) and grid point (rows, standardised points z = (x − s_k)/σ): the
    mass of each cell between consecutive points (rows i, i+1: (z_i, z_{i+1}] when ``increasing``,
    [z_{i+1}, z_i) otherwise), each from the tail it lies in (no cancellation of 1 − ·), and the
    mass beyond the last point (above it when ``increasing``, below otherwise)."""
    lower = _ndtr(z)  # Φ(z)
    upper = _ndtr(-z)  # Φ̄(z)
    if increasing:
        a, b = slice(None, -1), slice(1, None)
        beyond = upper[-1]
    else:
        a, b = slice(1, None), slice(None, -1)
        beyond = lower[-1]
    with np.errstate(invalid="ignore"):
        cell = np.where(z[a] >= 0, upper[a] - upper[b], lower[b] - lower[a])
    return np.maximum(np.nan_to_num(cell, nan=0.0), 0.0), beyond


def _kept(kind: Kind, budget: float) -> Tuple[np.ndarray, np.ndarray, float]:
    """(sensitivities, weights, dropped weight): the lightest components dropped while their
    weights sum to at most ``budget`` (the heaviest component with s > 0 always kept).

    Why dropping is sound. P = (1 − w)·P' + w·P'' (P' the kept components renormalised). Remove
    direction: H_γ(P‖Q) ≤ sup_S [(1 − w)·P'(S) − γ·Q(S)] + w, the curve of the pair whose first
    measure is the kept sub-mixture (unnormalised) plus mass w at a point where Q has none (the
    +∞ atom). Add direction: H_γ(Q‖P) ≤ sup_S [Q(S) − γ·(1 − w)·P'(S)], the pair (Q, kept
    sub-mixture plus mass w at a point where Q has none), whose PLD under Q has losses
    log(Q/((1 − w)·P')). Both are pairs of probability measures that dominate the true ones, so
    that composition keeps the bound (dominating pairs compose: Zhu, Dong, Wang 2022,
    arXiv:2106.08567)."""
    s = np.asarray(kind.sensitivities, dtype=float)
    w = np.asarray(kind.weights, dtype=float)
    order = np.argsort(w, kind="stable")
    keep = np.ones(len(w), dtype=bool)
    pos = s > 0
    heaviest_pos = int(np.flatnonzero(pos)[np.argmax(w[pos])])
    dropped = 0.0
    for i in order:
        if i == heaviest_pos or dropped + w[i] > budget:
            break
        keep[i] = False
        dropped += w[i]
    return s[keep], w[keep], dropped


class _Loss:
    """L(x) = log Σ_k w_k·e^{(2 s_k x − s_k²)/(2σ²)} of a (sub-)mixture, and its inverse."""

    def __init__(self, s: np.ndarray, w: np.ndarray, sigma: float) -> None:
        self.sigma = sigma
        zero = s == 0
        self.w0 = float(w[zero].sum()) if zero.any() else 0.0
        self.log_w0 = math.log(self.w0) if self.w0 > 0 else -math.inf
        self.s = s[~zero]
        self.logw = np.log(w[~zero])
        self.s_all, self.w_all = s, w
        s2 = sigma * sigma
        # the exponent of component k is a_k·x + b_k
        self.a = self.s / s2
        self.b = self.logw - self.s * self.s / (2 * s2)

    def h(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """log Σ_{s_k>0} w_k·e^{a_k x + b_k} and its derivative in x."""
        t = x[:, None] * self.a[None, :] + self.b[None, :]
        m = t.max(axis=1)
        e = np.exp(t - m[:, None])
        tot = e.sum(axis=1)
        return m + np.log(tot), (e * self.a[None, :]).sum(axis=1) / tot

    def loss(self, x: np.ndarray) -> np.ndarray:
        """L(x) (the remove direction's loss)."""
        hx, _ = self.h(np.asarray(x, dtype=float))
        if self.w0 == 0:
            return hx
        return np.logaddexp(hx, self.log_w0)

    def inverse(self, u: np.ndarray) -> np.ndarray:
        """x with L(x) = u (−∞ where u ≤ log w_0): Newton on the convex h from above."""
        u = np.asarray(u, dtype=float)
        x = np.full(u.shape, -np.inf)
        if self.w0 > 0:
            ok = u > self.log_w0
            # h(x) = log(e^u − w_0): log w_0 + log(expm1(v)) near the floor (v = u − log w_0 small,
            # no cancellation), u + log1p(−e^{−v}) above it (no overflow)
            v = np.where(ok, u - self.log_w0, 1.0)
            with np.errstate(divide="ignore", over="ignore"):
                target = np.where(v < 1.0, self.log_w0 + np.log(np.expm1(np.minimum(v, 1.0))),
                                  u + np.log1p(-np.exp(-np.maximum(v, 1.0))))
        else:
            ok = np.ones(u.shape, dtype=bool)
            target = u
        t = target[ok]
        if t.size == 0:
            return x
        # Each term alone reaches t at (t − b_k)/a_k; h is at least the largest term, so the
        # smallest of these points is at or above the root: Newton from there decreases to it
        # monotonically (h convex and increasing).
        xs = np.min((t[:, None] - self.b[None, :]) / self.a[None, :], axis=1)
        live = np.arange(len(xs))
        for _ in range(100):
            hx, dh = self.h(xs[live])
            step = (hx - t[live]) / dh
            step = np.where(np.isfinite(step), np.maximum(step, 0.0), 0.0)
            xs[live] -= step
            live = live[step > 1e-15 * (1.0 + np.abs(xs[live]))]
            if live.size == 0:
                break
        x[ok] = xs
        return x


def _z_of_tail(t: float) -> float:
    """z with Φ̄(z) = t."""
    from scipy.special import ndtri

    return float(-ndtri(min(max(t, 1e-300), 0.5)))


def _mixture_tail_x(loss: _Loss, t: float) -> float:
    """An x with P(X > x) ≤ t for the sub-mixture P (bisection on its tail)."""
    s, w, sig = loss.s_all, loss.w_all, loss.sigma
    lo, hi = float(s.min()) - sig * 40, float(s.max()) + sig * _z_of_tail(t / len(s))
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        tail = float(np.sum(w * _ndtr((s - mid) / sig)))
        if tail > t:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * (1 + abs(hi)):
            break
    return hi


def discretize(kind: Kind, remove: bool, interval: float, per_step: float, max_bins: int = MAX_BINS,
               pessimistic: bool = True) -> Optional[Pld]:
    """One step of ``kind`` in one direction on the grid k·``interval``: connect the dots
    (``pessimistic``), or every loss rounded down with the mass below the grid dropped (a lower
    bound). ``per_step``: the tail budget of the step (the grid holds all but that much of the
    first measure's mass, and components lighter than a thousandth of it are dropped: for the
    lower bound only in the remove direction, where a lighter P lowers the curve; None for the
    add direction's lower bound when a component was dropped)."""
    s, w, dropped = _kept(kind, 1e-3 * per_step)
    if not pessimistic and not remove and dropped > 0:
        # Dropping components lowers Q, which raises the add direction's curve: no lower bound.
        return None
    L = _Loss(s, w, kind.sigma)
    sig = kind.sigma
    zt = _z_of_tail(per_step)
    if remove:
        if L.w0 > 0:
            lo_loss = L.log_w0
        else:
            lo_loss = float(L.loss(np.array([float(s[s > 0].min()) - sig * zt]))[0])
        hi_loss = float(L.loss(np.array([_mixture_tail_x(L, per_step)]))[0])
    else:
        lo_loss = -float(L.loss(np.array([sig * zt]))[0])
        hi_loss = -float(L.loss(np.array([-sig * zt]))[0])
    if not lo_loss < TOP_LOSS:
        # The first measure's mass lies (but for the tail budget) above the top loss: all of it at
        # +∞ dominates the step; all of it rounded down to the top loss is below it.
        if pessimistic:
            return Pld(interval, 0, np.zeros(1), 1.0)
        # (the first measure's mass below lo_loss is at most per_step; dropped components are not in it)
        return Pld(interval, math.floor(TOP_LOSS / interval), np.array([max(0.0, 1.0 - per_step - dropped)]), 0.0)
    hi_loss = min(hi_loss, TOP_LOSS)
    k0 = math.floor(lo_loss / interval)
    k1 = max(math.ceil(hi_loss / interval), k0 + 1)
    if k1 - k0 > max_bins:
        raise GridTooLarge(f"a step's grid needs {k1 - k0} atoms", k1 - k0)
    work = (k1 - k0) * (len(s) + 1)  # normal tails to evaluate
    if work > WORK_PER_BIN * max_bins:
        raise GridTooLarge(f"a step's grid needs {work} normal tails", work / WORK_PER_BIN)
    eps = (k0 + np.arange(k1 - k0 + 1)) * interval
    n = len(eps) - 1
    zero = s == 0
    w0 = float(w[zero].sum())
    # Per cell: the mass of N(0, σ²) (the reference measure, d0), of the sub-mixture (mix) and of
    # its components with s > 0 (pos_mix); in blocks of grid points, so that the (points ×
    # components) arrays stay small. Consecutive blocks share their boundary point.
    d0, mix, pos_mix = np.empty(n), np.empty(n), np.empty(n)
    rows = max(1024, (1 << 21) // (len(s) + 1))
    beyond = np.zeros(len(s) + 1)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)  # cells i0..i1-1 need points i0..i1
        x = L.inverse(eps[i0 : i1 + 1] if remove else -eps[i0 : i1 + 1])
        zs = np.concatenate([(x[:, None] - s[None, :]) / sig, x[:, None] / sig], axis=1)
        cells, beyond = _cells(zs, remove)
        d = cells[:, :-1]
        d0[i0:i1] = cells[:, -1]
        mix[i0:i1] = d @ w
        pos_mix[i0:i1] = d[:, ~zero] @ w[~zero]
    # beyond: the masses past the last point (of the last block)
    mix_top = float(beyond[:-1] @ w)
    top0 = float(beyond[-1])
    y = np.exp(eps[:-1])
    y_n = math.exp(eps[-1])
    if remove:  # A = the sub-mixture, B = N(0, σ²)
        a_cell, b_cell, a_top, b_top = mix, d0, mix_top, top0
        nn = (w0 - y) * d0 + pos_mix  # N_i = A(I_i) − y_i·B(I_i), (w_0 − y_i) exact near y_i = w_0
    else:  # A = N(0, σ²), B = the sub-mixture
        a_cell, b_cell, a_top, b_top = d0, mix, top0, mix_top
        nn = (1.0 - y * w0) * d0 - y * pos_mix
    if not pessimistic:
        probs = np.append(a_cell, a_top)
        return Pld(interval, k0, probs, 0.0)
    nn = np.maximum(nn, 0.0)
    r = y * b_cell
    r_top = y_n * b_top
    up = 1.0 / math.expm1(interval)
    down = 1.0 / -math.expm1(-interval)
    raw = np.empty(n + 1)
    raw[0] = 0.0
    if n > 1:
        raw[1:n] = r[1:n] + nn[0 : n - 1] * down - nn[1:n] * up
    raw[n] = r_top + nn[n - 1] * down
    inf = max(a_top - r_top, 0.0) + (dropped if remove else 0.0)
    raw = np.maximum(raw, 0.0)
    raw[0] = max(0.0, 1.0 - (float(raw[1:].sum()) + inf))
    if not (np.all(np.isfinite(raw)) and math.isfinite(inf)):
        raise ValueError("the privacy loss distribution is not finite at these parameters")
    return Pld(interval, k0, raw, min(inf, 1.0))


# ----------------------------------------------------------------------------- composition


@dataclass
class Composed:
    pld: Pld
    #: mass to subtract from δ for a lower bound (none here: the core's optimistic atoms already
    #: have what may have wrapped in removed)
    wrapped: float
    #: kept for the callers' arithmetic: always 0 (the core bounds the rounding instead)
    excess: float


def compose(parts: Sequence[Tuple[Pld, int]], tail: float, max_bins: int = MAX_BINS, pessimistic: bool = True,
            target: Optional[Tuple[str, float]] = None, halve: bool = True) -> Composed:
    """The composition of ``count`` copies of each PLD (all on one grid), by the core's certified
    FFT composition (``rust/accounting/pld/compose.rs``): tilted towards ``target``
    (``("delta", δ)`` or ``("epsilon", ε)``), the transform's rounding bounded and included, so
    that every atom is an upper bound (``pessimistic``) or a lower bound on the exact
    composition's; the finite mass above the window is added to the +∞ atom. ``halve``: a tilted
    window above ``max_bins`` is retried with weaker tilts (else :class:`GridTooLarge`, for the
    caller to coarsen the grid)."""
    from .. import _core

    interval = parts[0][0].interval
    inf_log = sum(c * math.log1p(-min(p.inf, 1.0)) if p.inf < 1.0 else -math.inf for p, c in parts)
    if not math.isfinite(inf_log):
        return Composed(Pld(interval, 0, np.zeros(1), 1.0), 0.0, 0.0)
    core_parts = [(int(p.offset), np.ascontiguousarray(p.probs, dtype=np.float64), float(p.inf), 0.0, float(c))
                  for p, c in parts if c > 0]
    if not core_parts:
        return Composed(Pld(interval, 0, np.ones(1), 0.0), 0.0, 0.0)
    try:
        offset, probs, inf, wrapped = _core.pld_compose(core_parts, interval, tail, max_bins, pessimistic, target, halve)
    except ValueError as e:
        if "GridTooLarge" in str(e) or "atoms" in str(e):
            raise GridTooLarge(str(e), max_bins + 1) from None
        raise
    return Composed(Pld(interval, offset, np.asarray(probs), min(inf, 1.0)), wrapped, 0.0)


# ----------------------------------------------------------------------------- curves


def delta_at(p: Pld, epsilon: float) -> float:
    """δ(ε) = p_∞ + Σ_{ℓ_i > ε} p_i·(1 − e^{ε − ℓ_i})."""
    ell = (p.offset + np.arange(len(p.probs))) * p.interval
    m = ell > epsilon
    return min(1.0, p.inf + float(np.sum(p.probs[m] * -np.expm1(epsilon - ell[m]))))


def epsilon_at(p: Pld, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ ``delta``."""
    if p.inf > delta:
        return math.inf
    ell = (p.offset + np.arange(len(p.probs))) * p.interval
    keep = ell > 0
    ell, pr = ell[keep], p.probs[keep]
    if len(ell) == 0:
        return 0.0
    # above[i] = Σ_{j ≥ i} p_j, ex[i] = Σ_{j ≥ i} p_j·e^{−ℓ_j} (suffix sums)
    above = np.cumsum(pr[::-1])[::-1]
    ex = np.cumsum((pr * np.exp(-ell))[::-1])[::-1]
    # δ at ε in [ℓ_{i−1}, ℓ_i): p_∞ + above[i] − e^ε·ex[i]; at ε = 0 with i = 0
    d0 = p.inf + above[0] - ex[0]
    if d0 <= delta:
        return 0.0
    # δ at the atoms: δ(ℓ_i) = p_∞ + above[i+1] − e^{ℓ_i}·ex[i+1]
    above1 = np.append(above[1:], 0.0)
    ex1 = np.append(ex[1:], 0.0)
    # e^{ℓ_i}·ex1[i] ≤ above1[i] ≤ 1, formed in log space (e^{ℓ_i} alone overflows beyond 709;
    # e^{−ℓ_j} underflowing to 0 only drops terms, which raises δ: pessimistic)
    with np.errstate(divide="ignore"):
        d_at = p.inf + above1 - np.exp(ell + np.log(ex1))
    ok = np.flatnonzero(d_at <= delta)
    i = int(ok[0])  # the first atom where δ is met; ε lies in (ℓ_{i−1}, ℓ_i]
    num = p.inf + above[i] - delta
    if ex[i] <= 0 or num <= 0:
        return float(ell[i])
    e = math.log(num / float(ex[i]))
    lo_end = float(ell[i - 1]) if i > 0 else 0.0
    return float(min(max(e, lo_end), ell[i]))


# ----------------------------------------------------------------------------- bounds


def _passes(kinds: Sequence[Kind], interval: float, tail: float, max_bins: int, pessimistic: bool,
            directions: Sequence[bool], target: Optional[Tuple[str, float]] = None, halve: bool = True) -> List[Composed]:
    total = sum(k.count for k in kinds)
    per_step = max(tail / total, 1e-300)
    out = []
    for remove in directions:
        steps = [discretize(k, remove, interval, per_step, max_bins, pessimistic) for k in kinds]
        if any(p is None for p in steps):
            continue  # (a lower bound for the other direction only)
        out.append(compose([(p, k.count) for p, k in zip(steps, kinds)], tail, max_bins, pessimistic, target, halve))
    return out


def _run(kinds: Sequence[Kind], interval: Optional[float], tail: float, pessimistic: bool,
         directions: Sequence[bool], max_bins: int = MAX_BINS,
         target: Optional[Tuple[str, float]] = None) -> Tuple[List[Composed], float]:
    """The compositions of both directions, and the grid step used: ``interval``, else 1e-4,
    refined once where the composed window holds fewer than TARGET_BINS atoms (a small
    composition) and coarsened where a grid exceeds ``max_bins`` (the ε stays an upper bound,
    only less tight)."""
    d = DEFAULT_INTERVAL if interval is None else interval
    refined = interval is not None
    while True:
        try:
            out = _passes(kinds, d, tail, max_bins, pessimistic, directions, target,
                          halve=interval is not None or not pessimistic)
        except GridTooLarge as e:
            if interval is not None:
                raise
            d *= max(2.0, 1.1 * e.bins / max_bins)
            refined = True
            continue
        atoms = max((len(c.pld.probs) for c in out), default=0)
        if not refined and 1 < atoms < TARGET_BINS and d > MIN_INTERVAL and all(c.pld.inf < 1.0 for c in out):
            d = max(d * atoms / TARGET_BINS, MIN_INTERVAL)
            refined = True
            continue
        return out, d


def epsilon_bounds(kinds: Sequence[Kind], delta: float, interval: Optional[float] = None,
                   lower: bool = True) -> Tuple[float, float]:
    """(lower, upper) bounds on ε at ``delta`` of the composition of ``kinds`` under
    add-or-remove (the worse of the two directions); ``lower=False`` reports 0 as the lower."""
    if not kinds:
        return 0.0, 0.0
    tail = 1e-4 * delta
    target = ("delta", delta)
    composed, d = _run(kinds, interval, tail, True, (True, False), target=target)
    up = max(epsilon_at(c.pld, delta) for c in composed)
    lo = 0.0
    if lower:
        def lower_at(step: Optional[float]) -> float:
            return max(
                (epsilon_at(c.pld, delta + c.wrapped + c.excess)
                 for c in _run(kinds, step, tail, False, (True, False), target=target)[0]),
                default=0.0,
            )

        try:
            lo = lower_at(d)
        except GridTooLarge:  # (the lower bound's grids keep every component: they may not fit)
            lo = 0.0
        # Rounding down loses up to Δ per step: on an automatic grid, finer grids (4× and 16×)
        # while the gap is above 1% and they fit (any grid's value is a lower bound).
        for _ in range(2):
            if interval is not None or not (math.isfinite(up) and up - lo > LOWER_GAP * up) or d / 4 < MIN_INTERVAL:
                break
            d /= 4
            try:
                lo = max(lo, lower_at(d))
            except GridTooLarge:
                break
        lo = min(lo, up)
    return lo, up


def delta_bounds(kinds: Sequence[Kind], epsilon: float, interval: Optional[float] = None,
                 lower: bool = True) -> Tuple[float, float]:
    """(lower, upper) bounds on δ at ``epsilon``, as :func:`epsilon_bounds`."""
    if not kinds:
        return 0.0, 0.0

    def up_at(tail: float) -> float:
        return max(delta_at(c.pld, epsilon)
                   for c in _run(kinds, interval, tail, True, (True, False), target=("epsilon", epsilon))[0])

    up = up_at(1e-10)
    if up < 1e-6:
        up = up_at(max(up * 1e-4, 1e-300))
    lo = 0.0
    if lower:
        tail = max(up * 1e-4, 1e-300)
        try:
            lo = max(
                (max(delta_at(c.pld, epsilon) - c.wrapped - c.excess, 0.0)
                 for c in _run(kinds, interval, tail, False, (True, False), target=("epsilon", epsilon))[0]),
                default=0.0,
            )
        except GridTooLarge:
            lo = 0.0
        lo = min(lo, up)
    return lo, min(up, 1.0)
