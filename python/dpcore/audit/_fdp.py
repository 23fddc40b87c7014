"""The analyses of a one-run audit: from canary scores to lower bounds on the privacy of the
mechanism, and an estimate.

The game (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run",
NeurIPS 2023): m canaries, each included independently with probability 1/2; the auditor
sees the run's output, guesses "in" or "out" on k of the canaries (abstaining on the others),
and v of its guesses are right. A mechanism that is private for each canary bounds how large v
can be, except with a small probability; a v above that bound refutes the privacy claim.

Three analyses of the same guesses, and one fit of the scores:

* :func:`steinke_p_value` / :func:`steinke_epsilon_lower_bound`: Steinke et al. 2023, Theorem
  3.1 with the δ term of their Algorithm 2 (an (ε, δ) lower bound, valid for any mechanism).
* :func:`fdp_rejects`, :func:`gdp_mu_lower_bound`, :func:`fdp_epsilon_lower_bound`: the f-DP
  analysis of Mahloujifar, Melis & Chaudhuri, "Auditing f-differential privacy in one run",
  ICML 2025 (PMLR 267:42615-42641; arXiv:2410.22235): the observation is tested against a
  whole trade-off curve f (Dong, Roth & Su 2022, "Gaussian differential privacy"), Gaussian
  (μ-GDP) or the (ε, δ) curve, by the recursion of the paper's auditing procedure
  (``audit_rh_with_cap``, as jax_privacy's ``CanaryScoreAuditor.epsilon_one_run_fdp`` names it;
  PrivacyGuard's ``FDPAnalysisNode`` computes the same; we read both and did not copy them). The
  algorithm and theorem numbers of the paper could not be checked against its text here, so
  :func:`fdp_rejects` states the bound it computes and proves it (its docstring).
* :func:`gdp_epsilon`: the ε of μ-GDP at δ (Dong, Roth & Su 2022, Corollary 2.13), to turn a
  μ bound into an ε one.
* :func:`gdp_fit`: an *estimate* (not a bound) of μ from the scores, with the attack's AUROC
  and its TPR at FPR 1% and 0.1%.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import numpy as np

__all__ = [
    "steinke_p_value",
    "steinke_epsilon_lower_bound",
    "gaussian_tradeoff",
    "epsilon_delta_tradeoff",
    "fdp_rejects",
    "gdp_mu_lower_bound",
    "fdp_epsilon_lower_bound",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_fit",
    "guess_counts",
    "count_correct",
]

#: The largest μ (and ε) the searches consider: μ-GDP with μ = 60 is no privacy at all.
_MU_MAX = 60.0
_EPS_MAX = 200.0


def _check_mkv(m: int, k: int, v: int) -> None:
    if not (isinstance(m, (int, np.integer)) and isinstance(k, (int, np.integer)) and isinstance(v, (int, np.integer))):
        raise TypeError(f"m, k and v must be ints, got {type(m).__name__}, {type(k).__name__}, {type(v).__name__}")
    if not 0 <= v <= k <= m or m < 1:
        raise ValueError(f"need 0 <= v <= k <= m and m >= 1, got v={v}, k={k}, m={m}")


def _check_significance(alpha: float) -> float:
    a = float(alpha)
    if not 0.0 < a < 1.0:
        raise ValueError(f"significance must be in (0, 1), got {alpha!r}")
    return a


def _largest(pred: Callable[[float], bool], hi: float, cap: float, tol: float) -> float:
    """The largest x in [0, cap] with pred(x) (pred true on an interval [0, x*)), to ``tol``;
    0 when pred(0) is false."""
    if not pred(0.0):
        return 0.0
    lo = 0.0
    while pred(hi):
        lo = hi
        if hi >= cap:
            return cap
        hi = min(cap, 2.0 * hi)
    while hi - lo > tol * max(1.0, lo):
        mid = 0.5 * (lo + hi)
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


# -- Steinke, Nasr & Jagielski 2023 ------------------------------------------------------------


def steinke_p_value(m: int, k: int, v: int, epsilon: float, delta: float) -> float:
    """An upper bound on P[W ≥ v], W the correct guesses among k guesses on m canaries, under
    (ε, δ)-DP: P[Binom(k, p) ≥ v] + 2mδ · max_{1≤i≤v} P[v − i ≤ Binom(k, p) < v]/i with
    p = e^ε/(1 + e^ε) (Steinke, Nasr & Jagielski 2023, Theorem 3.1 with δ; their Algorithm 2).

    The maximum over i is cut where it can no longer grow: its i-th term is at most
    P[Binom < v]/i."""
    _check_mkv(m, k, v)
    from scipy import special, stats

    if v == 0:
        return 1.0
    p = float(special.expit(epsilon))
    beta = float(stats.binom.sf(v - 1, k, p))  # P[Binom(k, p) >= v]
    if delta == 0 or beta >= 1.0:
        return min(1.0, beta)
    below = float(stats.binom.cdf(v - 1, k, p))  # P[Binom < v] bounds every partial sum
    best, cum, i0, width = 0.0, 0.0, 1, 256
    while i0 <= v:
        i1 = min(v, i0 + width - 1)
        j = np.arange(v - i0, v - i1 - 1, -1)  # Binom values v - i for i = i0..i1
        part = cum + np.cumsum(np.exp(stats.binom.logpmf(j, k, p)))
        best = max(best, float(np.max(part / np.arange(i0, i1 + 1))))
        cum = float(part[-1])
        if below <= best * (i1 + 1):  # every later term is <= below/i < best
            break
        i0, width = i1 + 1, 2 * width
    return min(1.0, beta + best * 2.0 * m * delta)


def steinke_epsilon_lower_bound(m: int, k: int, v: int, delta: float, confidence: float) -> float:
    """The largest ε that ``v`` correct guesses out of ``k`` on ``m`` canaries reject at
    ``confidence``: (ε', δ)-DP with ε' below it would make the observation less likely than
    1 − confidence (Steinke et al. 2023, Theorem 3.1). 0 when no ε ≥ 0 is rejected."""
    _check_mkv(m, k, v)
    alpha = _check_significance(1.0 - confidence)
    if v <= k / 2:  # at most chance: nothing is refuted (and the tail is >= 1/2)
        return 0.0
    # Rejection at ε needs v > k·p_ε (else P[Binom(k, p_ε) >= v] >= 1/2): ε < logit(v/k).
    cap = _EPS_MAX if v == k else min(_EPS_MAX, math.log(v / (k - v)))
    if steinke_p_value(m, k, v, 0.0, 0.0) >= alpha:
        return 0.0

    def rejected(e: float) -> bool:  # the δ-free tail first: it alone often decides
        return steinke_p_value(m, k, v, e, 0.0) < alpha and steinke_p_value(m, k, v, e, delta) < alpha

    return _largest(rejected, min(1.0, cap), cap, 1e-7)


# -- f-DP (Mahloujifar, Melis & Chaudhuri 2025) ------------------------------------------------


def gaussian_tradeoff(mu: float) -> Callable[[float], float]:
    """The trade-off curve of μ-GDP, f_μ(α) = Φ(Φ⁻¹(1 − α) − μ) (Dong, Roth & Su 2022,
    "Gaussian differential privacy").

    The function carries ``at_one_minus(r)`` = f(1 − r) = Φ(Φ⁻¹(r) − μ), computed without
    forming 1 − r (exact for the tiny r of :func:`fdp_rejects`)."""
    from scipy import special

    mu = float(mu)

    def f(a: float) -> float:
        if a <= 0.0:
            return 1.0
        if a >= 1.0:
            return 0.0
        return float(special.ndtr(special.ndtri(1.0 - a) - mu))

    def at_one_minus(r: float) -> float:
        if r <= 0.0:
            return 0.0
        if r >= 1.0:
            return 1.0
        return float(special.ndtr(special.ndtri(r) - mu))

    f.at_one_minus = at_one_minus  # type: ignore[attr-defined]
    return f


def epsilon_delta_tradeoff(epsilon: float, delta: float) -> Callable[[float], float]:
    """The trade-off curve of (ε, δ)-DP, f(α) = max(0, 1 − δ − e^ε α, e^−ε (1 − δ − α))
    (Kairouz, Oh & Viswanath 2015; Dong, Roth & Su 2022), with ``at_one_minus(r)`` =
    f(1 − r) = max(0, (r − δ)·e^−ε, 1 − δ − e^ε (1 − r))."""
    e = math.exp(min(float(epsilon), 700.0))
    d = float(delta)

    def f(a: float) -> float:
        return max(0.0, 1.0 - d - e * a, (1.0 - d - a) / e)

    def at_one_minus(r: float) -> float:
        return max(0.0, (r - d) / e, 1.0 - d - e * (1.0 - r))

    f.at_one_minus = at_one_minus  # type: ignore[attr-defined]
    return f


def fdp_rejects(m: int, k: int, v: int, tradeoff: Callable[[float], float], significance: float) -> bool:
    """Whether ``v`` correct guesses out of ``k`` on ``m`` canaries are inconsistent, at level
    ``significance``, with a mechanism that is f-DP for each canary (f = ``tradeoff``, a
    symmetric trade-off function; its ``at_one_minus(r)`` = f(1 − r) is used where it has one):
    True means P[C ≥ v] < significance for *every* such mechanism
    and every auditor that guesses on exactly k canaries, C its number of correct guesses.

    The recursion is the one of Mahloujifar, Melis & Chaudhuri 2025's auditing procedure
    (``audit_rh_with_cap``). Its proof, as implemented:

    1. For one canary i, fix the other canaries' coins S₋ᵢ and any event E that is a function of
       the output and S₋ᵢ. "Guess in, and E" and "guess out, and E" are two tests of S_i, so by
       f-DP (f symmetric, 1 − f concave) P[guess i right, E] ≤ 1 − f(P[guess i wrong, E]); the
       same holds averaged over S₋ᵢ and over the m canaries (concavity again).
    2. With E = "at least c − 1 right guesses on the other canaries" and W = k − C the wrong
       guesses: R(c) ≤ 1 − f(H(c − 1)), i.e. H(c − 1) ≥ f(1 − R(c)), for c = 1..k, where
       R(c) = E[C·1{C ≥ c}]/m and H(c) = E[W·1{C ≥ c}]/m.
    3. Write T(c) = P[C ≥ c]. Then m·R(c) = c·T(c) + Σ_{j>c} T(j) and H(c) = k·T(c)/m − R(c),
       and step 2 reads T(c − 1) ≥ L_c(T(c), T(c+1), ...) with L_c non-decreasing in every
       argument. So the smallest tails that satisfy the constraints with T(v) ≥ τ are found
       greedily from the top: T(j) = 0 for j > v, T(v) = τ (R = τv/m, H = τ(k − v)/m), then
       H(i) = max(H(i + 1), f(1 − R(i + 1))) and R(i) = R(i + 1) + i/(k − i)·(H(i) − H(i + 1))
       for i = v − 1, ..., 0 (each step puts the least mass at C = i that step 2 allows; once
       H does not grow, nothing grows any more and the loop stops).
    4. Every feasible tail sequence lies above the greedy one, and T(0) = 1, i.e.
       R(0) + H(0) = k/m. So if the greedy R(0) + H(0) exceeds k/m, no f-DP mechanism gives
       P[C ≥ v] ≥ τ: reject.

    Nothing is assumed about the auditor's scores, and k must be fixed before the run (or
    Bonferroni-corrected over a grid fixed before the run, as :func:`dpcore.audit.one_run_audit`
    does)."""
    _check_mkv(m, k, v)
    tau = _check_significance(significance)
    if v == 0:
        return False
    g = getattr(tradeoff, "at_one_minus", None) or (lambda x: tradeoff(1.0 - x))
    r = tau * v / m
    h = tau * (k - v) / m
    for i in range(v - 1, -1, -1):
        h_new = g(r)
        if h_new <= h:
            break
        r = min(1.0, r + i / (k - i) * (h_new - h))
        h = h_new
    return r + h > k / m


def gdp_mu_lower_bound(m: int, k: int, v: int, confidence: float) -> float:
    """The largest μ such that μ-GDP is rejected by :func:`fdp_rejects` at ``confidence``: a
    lower bound on the μ of any μ-GDP claim the observation is consistent with (0 when even
    μ = 0 is not rejected)."""
    _check_mkv(m, k, v)
    alpha = _check_significance(1.0 - confidence)
    if 2 * v <= k:
        return 0.0
    return _largest(lambda mu: fdp_rejects(m, k, v, gaussian_tradeoff(mu), alpha), 0.5, _MU_MAX, 1e-6)


def fdp_epsilon_lower_bound(m: int, k: int, v: int, delta: float, confidence: float) -> float:
    """The largest ε such that the (ε, δ) trade-off curve is rejected by :func:`fdp_rejects`
    at ``confidence``: a lower bound on ε at δ valid for any mechanism, like
    :func:`steinke_epsilon_lower_bound` (close to it at small ε, well above it where its 2mδ
    term dominates: many canaries, large ε)."""
    _check_mkv(m, k, v)
    alpha = _check_significance(1.0 - confidence)
    if 2 * v <= k:
        return 0.0
    return _largest(lambda e: fdp_rejects(m, k, v, epsilon_delta_tradeoff(e, delta), alpha), 1.0, _EPS_MAX, 1e-7)


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth & Su 2022, Corollary 2.13)."""
    from scipy import special

    mu, eps = float(mu), float(epsilon)
    if mu <= 0.0:
        return 0.0
    la = float(special.log_ndtr(-eps / mu + mu / 2))
    lb = eps + float(special.log_ndtr(-eps / mu - mu / 2))
    if lb >= la:
        return 0.0
    return math.exp(la) * -math.expm1(lb - la)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε of μ-GDP at δ: the ε with :func:`gdp_delta` (μ, ε) = δ (0 when δ(0) ≤ δ)."""
    from scipy import optimize

    mu = float(mu)
    if not math.isfinite(mu):
        return math.inf
    if mu <= 0.0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    ld = math.log(delta)

    def gap(eps: float) -> float:
        d = gdp_delta(mu, eps)
        return (math.log(d) if d > 0 else -1e300) - ld

    hi = max(1.0, mu * mu)
    while gap(hi) > 0:
        hi *= 2.0
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-10, rtol=1e-12))


# -- guesses -----------------------------------------------------------------------------------


def guess_counts(m: int, smallest: int = 10) -> List[int]:
    """The numbers of guesses k an audit of m canaries tries, fixed before the run: 10, 20, 50,
    100, 200, 500, ... below m, and every canary (2·⌊m/2⌋); half of each k is guessed "in" on
    the highest scores, half "out" on the lowest. The number of correct guesses can then grow
    with m, so the bound can reach about ln(m/ln(1/α)) (the limit Steinke et al. 2023 state for a one-run audit)."""
    top = 2 * (int(m) // 2)
    ks: List[int] = []
    scale = 10
    while True:
        for f in (1, 2, 5):
            k = f * scale
            if k >= top:
                return ks + ([top] if top >= 2 else [])
            if k >= smallest:
                ks.append(k)
        scale *= 10


def count_correct(scores: np.ndarray, member: np.ndarray, k: int, order: Optional[np.ndarray] = None) -> int:
    """Correct guesses when the k/2 highest scores are guessed "in" and the k/2 lowest "out"
    (the abstaining auditor of Steinke et al. 2023)."""
    order = np.argsort(scores, kind="stable") if order is None else order
    h = k // 2
    if h == 0:
        return 0
    return int(member[order[-h:]].sum() + (~member[order[:h]]).sum())


# -- the Gaussian-DP fit: an estimate ----------------------------------------------------------


def _auroc(in_scores: np.ndarray, out_scores: np.ndarray) -> float:
    from scipy import stats

    n1, n0 = len(in_scores), len(out_scores)
    ranks = stats.rankdata(np.concatenate([in_scores, out_scores]))  # ties: average ranks
    u = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2.0
    return u / (n1 * n0)


def _tpr_at_fpr(in_scores: np.ndarray, out_scores: np.ndarray, fpr: float) -> float:
    """The TPR of the threshold test "in when the score is above t", with t the smallest
    threshold whose FPR is at most ``fpr`` (no interpolation)."""
    out_sorted = np.sort(out_scores)[::-1]
    allowed = int(math.floor(fpr * len(out_sorted) + 1e-9))  # false positives allowed
    if allowed >= len(out_sorted):
        return 1.0
    t = out_sorted[allowed]  # every out-score strictly above t: `allowed` of them at most
    return float(np.mean(in_scores > t))


def gdp_fit(scores: Any, member: Any, delta: float, confidence: float = 0.95) -> Dict[str, Any]:
    """An *estimate* of the mechanism's Gaussian-DP μ from the canary scores, not a bound.

    Under μ-GDP with Gaussian scores (a shift by μ of the same normal, as white-box gradient
    canaries of DP-SGD give at q = 1), the attack's AUROC is Φ(μ/√2); so μ̂ = √2·Φ⁻¹(AUROC),
    with an approximate interval from the AUROC's standard error (Hanley & McNeil 1982) at
    ``confidence``, and ε̂ = :func:`gdp_epsilon` (μ̂, δ). Alongside: the AUROC and the TPR at
    FPR 1% and 0.1% of the best threshold test (Carlini et al. 2022, "Membership inference
    attacks from first principles"). Scores are oriented: higher means "in"."""
    from scipy import special

    s = np.asarray(scores, dtype=np.float64)
    mem = np.asarray(member, dtype=bool)
    if s.shape != mem.shape or s.ndim != 1:
        raise ValueError(f"scores and member must be 1-d of one length, got {s.shape} and {mem.shape}")
    ins, outs = s[mem], s[~mem]
    if len(ins) == 0 or len(outs) == 0:
        raise ValueError("gdp_fit needs canaries both in and out")
    n1, n0 = len(ins), len(outs)
    a = _auroc(ins, outs)
    floor = 0.5 / (n1 * n0)
    a_c = min(max(a, floor), 1.0 - floor)
    q1, q2 = a_c / (2.0 - a_c), 2.0 * a_c * a_c / (1.0 + a_c)
    var = (a_c * (1 - a_c) + (n1 - 1) * (q1 - a_c * a_c) + (n0 - 1) * (q2 - a_c * a_c)) / (n1 * n0)
    z = float(special.ndtri(0.5 + confidence / 2.0))
    se = math.sqrt(max(var, 0.0))
    lo_a, hi_a = min(max(a_c - z * se, floor), 1 - floor), min(max(a_c + z * se, floor), 1 - floor)

    def mu_of(x: float) -> float:
        return math.sqrt(2.0) * float(special.ndtri(x))

    mu, mu_lo, mu_hi = mu_of(a_c), mu_of(lo_a), mu_of(hi_a)

    def eps_of(u: float) -> float:
        return gdp_epsilon(u, delta) if u > 0 else 0.0

    return {
        "mu": mu,
        "mu_interval": [mu_lo, mu_hi],
        "epsilon": eps_of(mu),
        "epsilon_interval": [eps_of(mu_lo), eps_of(mu_hi)],
        "auroc": a,
        "tpr_at_fpr": {"0.01": _tpr_at_fpr(ins, outs, 0.01), "0.001": _tpr_at_fpr(ins, outs, 0.001)},
        "confidence": float(confidence),
    }
