"""Rényi DP of random allocation (k of t) and balls-in-bins sampling
(:mod:`dpcore.accounting.allocation`): the remove direction against the authors' package
(golden values), against exact multinomial sums and the log-normal's cumulants in high
precision; both directions against 2-D numerical integration at t = 2 and the Gaussian
mechanism at t = 1; the add direction against Monte Carlo at fixed seeds and its AM-GM bound;
the reduction of k of t to blocks; the accountants."""

from __future__ import annotations

import itertools
import math

import mpmath as mp
import numpy as np
import pytest
from scipy import integrate

from dpcore.accounting import (
    DEFAULT_ORDERS,
    BallsInBinsSampledEvent,
    ComposedEvent,
    DiscreteGaussianEvent,
    GaussianEvent,
    NonPrivateEvent,
    PldAccountant,
    PoissonSampledEvent,
    RandomAllocationSampledEvent,
    RdpAccountant,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    UnsupportedEventError,
    epsilon_from_rdp,
    rdp_random_allocation,
    to_dp_accounting,
)
from dpcore.accounting import allocation as A

ORDERS = np.asarray(DEFAULT_ORDERS)


# ============================================================================= golden values

# allocation_RDP_remove(alpha, sigma, num_steps) of the authors' package (Feldman & Shenfeld
# 2025, arXiv:2502.08202, Corollary 6.2), random-allocation==1.0.5 from PyPI,
# random_allocation/random_allocation_scheme/direct.py, run in a separate venv (it pins
# numpy<2.2 and numba) on 2026-11-25. Rows: (sigma, num_steps, alpha, value).
AUTHORS_RDP_REMOVE = (
    (0.5, 1, 2, 4.0),
    (0.5, 2, 3, 5.307355760347518),
    (0.5, 10, 8, 13.697414907013066),
    (1.0, 2, 2, 0.6201145069582776),
    (1.0, 10, 3, 0.25183749830467406),
    (1.0, 100, 8, 0.07651002280504267),
    (1.0, 1000, 32, 9.092244721053362),
    (2.0, 10, 32, 1.7014897704781722),
    (2.0, 100, 3, 0.004255466955305209),
    (2.0, 1000, 8, 0.0011361236278253678),
    (5.0, 100, 32, 0.006529477582152169),
    (5.0, 1000, 2, 4.080994145638783e-05),
    (5.0, 2, 8, 0.08086903618086579),
    (1.0, 1, 32, 16.0),
    (0.5, 1000, 3, 0.140097348593061),
    (2.0, 2, 32, 3.3072993052394035),
)

# allocation_epsilon_direct(PrivacyParams(sigma, num_steps, num_selected, num_epochs,
# delta=delta), SchemeConfig(allocation_direct_alpha_orders=list(range(2, 61))),
# Direction.REMOVE) of the same package and run: the remove direction's ε after num_epochs
# rounds, minimised over the integer orders 2..60 with ε = E·k·RDP(1-of-⌊t/k⌋) +
# max(log1p(−1/α) − log(δα)/(α − 1), 0). Rows: (sigma, t, k, epochs, delta, epsilon).
AUTHORS_EPSILON_REMOVE = (
    (1.0, 100, 1, 10, 1e-05, 1.9792093958959602),
    (2.0, 1000, 1, 5, 1e-06, 0.2051226433382028),
    (0.8, 10, 1, 50, 1e-05, 26.124654264194383),
    (1.5, 200, 4, 3, 1e-05, 1.5544533573652064),
)


@pytest.mark.parametrize("sigma,t,alpha,value", AUTHORS_RDP_REMOVE)
def test_remove_matches_authors_package(sigma, t, alpha, value):
    # Alone (series up to α) and inside the accountant's grid (series up to 1024).
    ours = rdp_random_allocation(t, 1, sigma, [alpha], "remove")[0]
    on_grid = rdp_random_allocation(t, 1, sigma, ORDERS, "remove")[list(ORDERS).index(alpha)]
    for v in (ours, on_grid):
        assert abs(v - value) <= 1e-9 * value
        # An upper bound: never below the exact value (theirs, up to their own rounding).
        assert v >= value * (1 - 1e-12)


@pytest.mark.parametrize("sigma,t,k,epochs,delta,eps_theirs", AUTHORS_EPSILON_REMOVE)
def test_remove_epsilon_matches_authors_package(sigma, t, k, epochs, delta, eps_theirs):
    ints = np.arange(2, 61, dtype=np.float64)
    rdp_ints = epochs * rdp_random_allocation(t, k, sigma, ints, "remove")
    # Their conversion on their orders, from our RDP: theirs, up to our upward rounding.
    conv = min(r + max(math.log1p(-1 / a) - math.log(delta * a) / (a - 1), 0.0) for a, r in zip(ints, rdp_ints))
    assert eps_theirs * (1 - 1e-12) <= conv <= eps_theirs * (1 + 1e-9)
    # The accountant's richer grid can only do better (by at most a rounding otherwise).
    rich = epsilon_from_rdp(ORDERS, epochs * rdp_random_allocation(t, k, sigma, ORDERS, "remove"), delta)[0]
    assert rich <= conv * (1 + 1e-12)
    acct = RdpAccountant().compose(SelfComposedEvent(RandomAllocationSampledEvent(t, k, GaussianEvent(sigma)), epochs))
    both = acct.get_epsilon(delta)
    assert both >= rich * (1 - 1e-12)  # both directions: never below the remove direction


# ============================================================================= exact checks


def _remove_moment_mp(sigma, t, alpha):
    """E_Q[S^α] by the multinomial sum over all compositions of α into t parts, in mpmath."""
    mp.mp.dps = 60
    kappa = mp.mpf(1) / (2 * mp.mpf(sigma) ** 2)
    total = mp.mpf(0)
    for ks in itertools.product(range(alpha + 1), repeat=t):
        if sum(ks) != alpha:
            continue
        coef = mp.factorial(alpha) / mp.fprod(mp.factorial(k) for k in ks)
        total += coef * mp.e ** (kappa * sum(k * (k - 1) for k in ks))
    return total / mp.mpf(t) ** alpha


@pytest.mark.parametrize("sigma,t,alpha", [(0.7, 3, 6), (1.0, 4, 5), (3.0, 3, 7), (10.0, 2, 9), (0.4, 5, 4)])
def test_remove_equals_multinomial_sum(sigma, t, alpha):
    exact = float(mp.log(_remove_moment_mp(sigma, t, alpha)) / (alpha - 1))
    ours = rdp_random_allocation(t, 1, sigma, [alpha], "remove")[0]
    assert exact <= ours <= exact * (1 + 1e-10) + 1e-15


@pytest.mark.parametrize("sigma,t", [(2.0, 3), (6.0, 50)])
def test_remove_high_orders_against_series_power(sigma, t):
    # E_Q[S^n] = n! t^{−n} [x^n] g(x)^t by repeated squaring of the truncated series in
    # 50-digit arithmetic: an algorithm independent of the cumulant recursions, up to n = 128.
    mp.mp.dps = 50
    n_max = 128
    kappa = mp.mpf(1) / (2 * mp.mpf(sigma) ** 2)
    g = [mp.e ** (kappa * j * (j - 1)) / mp.factorial(j) for j in range(n_max + 1)]

    def mul(a, b):
        return [mp.fsum(a[i] * b[n - i] for i in range(n + 1)) for n in range(n_max + 1)]

    h, base, e = [mp.mpf(1)] + [mp.mpf(0)] * n_max, g, t
    while e:
        if e & 1:
            h = mul(h, base)
        e >>= 1
        if e:
            base = mul(base, base)
    orders = [2, 7, 33, 64, 100, 128]
    ours = rdp_random_allocation(t, 1, sigma, orders, "remove")
    for n, v in zip(orders, ours):
        exact = float(mp.log(mp.factorial(n) * h[n] / mp.mpf(t) ** n) / (n - 1))
        assert exact * (1 - 1e-13) <= v <= exact * (1 + 1e-9) + 1e-15, n


@pytest.mark.parametrize("sigma", [0.5, 1.0, 5.0, 30.0])
def test_lognormal_cumulants_match_high_precision_inversion(sigma):
    # κ_n from the moments q^{C(n,2)} by the moment–cumulant recursion in 400-digit
    # arithmetic (which cancels catastrophically in floats) vs Kreweras' positive recurrence.
    mp.mp.dps = 400
    q = mp.e ** (1 / mp.mpf(sigma) ** 2)
    n_max = 24
    m = [q ** (n * (n - 1) // 2) for n in range(n_max + 1)]
    kap = [mp.mpf(0)] * (n_max + 1)
    for n in range(1, n_max + 1):
        kap[n] = m[n] - sum(mp.binomial(n - 1, j - 1) * kap[j] * m[n - j] for j in range(1, n))
    lk, ek = A._log_cumulants(float(sigma), n_max)
    for n in range(1, n_max + 1):
        exact = float(mp.log(kap[n]))
        assert abs(lk[n] - exact) <= ek[n] + 1e-300, n
        assert ek[n] <= 1e-10 * max(1.0, abs(exact))


@pytest.mark.parametrize("sigma", [0.3, 1.0, 4.0])
def test_one_step_is_the_gaussian_mechanism(sigma):
    g = ORDERS / (2 * sigma**2)
    for d in ("remove", "add", "both"):
        v = rdp_random_allocation(1, 1, sigma, ORDERS, d)
        assert np.all(v >= g)
        np.testing.assert_allclose(v, g, rtol=1e-14)


def _brute_t2(sigma, alpha, direction):
    """D_α of the t = 2 pair by 2-D quadrature: E_Q[S^α] (remove) or E_Q[S^{1−α}] (add)."""
    kappa = 0.5 / sigma**2
    power = alpha if direction == "remove" else 1 - alpha
    c = -math.log(2 * math.pi)

    def f(z2, z1):
        s = 0.5 * (math.exp(z1 / sigma - kappa) + math.exp(z2 / sigma - kappa))
        return math.exp(c - 0.5 * (z1 * z1 + z2 * z2) + power * math.log(s))

    v, err = integrate.dblquad(f, -40, 40, -40, 40, epsabs=0, epsrel=1e-11)
    assert err <= 1e-10 * v
    return math.log(v) / (alpha - 1)


@pytest.mark.parametrize("sigma", [1.0, 2.0])
@pytest.mark.parametrize("alpha", [2, 3, 5])
def test_two_steps_against_2d_integration(sigma, alpha):
    for d in ("remove", "add"):
        exact = _brute_t2(sigma, alpha, d)
        ours = rdp_random_allocation(2, 1, sigma, [alpha], d)[0]
        assert exact * (1 - 1e-10) <= ours <= exact * (1 + 1e-8), d


def test_two_steps_real_order_is_the_chord():
    # Between integers: the chord of the convex (α − 1)D_α, above the exact value.
    for d in ("remove", "add"):
        exact = _brute_t2(1.0, 2.5, d)
        chord = (0.5 * _brute_t2(1.0, 2, d) + 0.5 * 2 * _brute_t2(1.0, 3, d)) / 1.5
        ours = rdp_random_allocation(2, 1, 1.0, [2.5], d)[0]
        assert exact < chord
        assert chord * (1 - 1e-10) <= ours <= chord * (1 + 1e-8)


# ============================================================================= add direction


@pytest.mark.parametrize("sigma,t,rs", [(1.0, 10, (1, 2, 3)), (2.0, 3, (1, 2, 4)), (0.8, 50, (1, 2)), (1.5, 1000, (1, 3))])
def test_add_numeric_against_monte_carlo(sigma, t, rs):
    rng = np.random.default_rng(20261125)
    kappa = 0.5 / sigma**2
    n = 400_000 if t <= 50 else 20_000
    samples = []
    for _ in range(5):
        z = rng.standard_normal((n, t))
        samples.append(np.exp(z / sigma - kappa).mean(axis=1))
    s = np.concatenate(samples)
    num = A._add_log_moments_numeric(float(sigma), t, tuple(rs))
    for r, u in zip(rs, num):
        x = s ** (-r)
        mean, se = x.mean(), x.std() / math.sqrt(x.size)
        assert abs(math.exp(u) - mean) <= 5 * se, (r, math.exp(u), mean, se)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_add_numeric_at_one_step_equals_closed_form(sigma):
    # t = 1: E[X^{−r}] = exp(r(r+1)/(2σ²)) exactly; the quadrature must be above, and close.
    kappa = 0.5 / sigma**2
    rs = (1, 2, 5, 10)
    num = A._add_log_moments_numeric(float(sigma), 1, rs)
    for r, u in zip(rs, num):
        exact = kappa * r * (r + 1)
        assert exact <= u <= exact + 1e-5 * max(1.0, exact)


@pytest.mark.parametrize("sigma,t", [(0.7, 2), (1.0, 10), (1.0, 1000), (3.0, 100), (0.5, 10_000)])
def test_add_below_the_am_gm_bound(sigma, t):
    add = rdp_random_allocation(t, 1, sigma, ORDERS, "add")
    pointwise = (ORDERS - 1) / (2 * t * sigma**2) + 1 / (2 * sigma**2)
    assert np.all(add <= pointwise * (1 + 1e-12))
    assert np.all(add > 0)
    # The quadrature improves on the pointwise bound, a lot where its constant dominates.
    i2 = list(ORDERS).index(2.0)
    assert add[i2] < (0.5 if t >= 10 else 0.9) * pointwise[i2]


def test_am_gm_bound_is_paid_per_round():
    # The pointwise bound log(Q/P) ≤ Gaussian loss + (1 − 1/t)/(2σ²) holds round by round, so
    # its constant adds up over rounds. Counterexample to a single constant for a whole run
    # (random-allocation 1.0.5's allocation_epsilon_direct_add): at σ = 1, t = 10 the add-
    # direction loss has mean KL(Q‖P) > 1/(2tσ²), the Gaussian part's, so after E rounds the
    # true ε grows like E·KL while ε_Gauss(σ√(t/E)) + constant grows like E/(2tσ²).
    rng = np.random.default_rng(7)
    z = rng.standard_normal((400_000, 10))
    loss = -np.log(np.exp(z - 0.5).mean(axis=1))
    kl, var = loss.mean(), loss.var()
    kl_lo = kl - 5 * loss.std() / math.sqrt(loss.size)
    assert kl_lo > 1 / 20 + 0.02
    # Cantelli: P(Σ loss ≥ E·KL − √(E var)) ≥ 1/2, so δ(ℓ − 1) ≥ (1 − 1/e)/2 > 1e-5 at
    # ℓ = E·KL − √(E var): the true ε(1e-5) exceeds ℓ − 1.
    epochs = 20_000
    lower = epochs * kl_lo - math.sqrt(epochs * var * 1.01) - 1
    # allocation_epsilon_direct_add(PrivacyParams(1.0, 10, 1, 20000, delta=1e-5)), same run as
    # the golden values above: 1190.2739221562392.
    assert lower > 1190.2739221562392
    # Our add direction (RDP, constant per round inside the bound, quadrature) stays above.
    ours = epsilon_from_rdp(ORDERS, epochs * rdp_random_allocation(10, 1, 1.0, ORDERS, "add"), 1e-5)[0]
    assert ours >= lower


# ============================================================================= k of t


@pytest.mark.parametrize("sigma", [0.8, 2.0])
def test_all_steps_selected_is_t_gaussian_steps(sigma):
    for t in (1, 3, 7):
        v = rdp_random_allocation(t, t, sigma, ORDERS)
        np.testing.assert_allclose(v, t * ORDERS / (2 * sigma**2), rtol=1e-14)


@pytest.mark.parametrize("t,k", [(100, 4), (60, 3), (12, 12), (1000, 10)])
def test_k_divides_t_is_k_blocks(t, k):
    for d in ("remove", "add", "both"):
        v = rdp_random_allocation(t, k, 1.3, ORDERS, d)
        one = rdp_random_allocation(t // k, 1, 1.3, ORDERS, d)
        np.testing.assert_allclose(v, k * one, rtol=1e-14)


def test_uneven_blocks():
    # t = 10, k = 3: blocks of 3, 3 and 4 steps.
    for d in ("remove", "add"):
        v = rdp_random_allocation(10, 3, 1.1, ORDERS, d)
        blocks = 2 * rdp_random_allocation(3, 1, 1.1, ORDERS, d) + rdp_random_allocation(4, 1, 1.1, ORDERS, d)
        np.testing.assert_allclose(v, blocks, rtol=1e-14)
    both = rdp_random_allocation(10, 3, 1.1, ORDERS)
    np.testing.assert_array_equal(
        both, np.maximum(rdp_random_allocation(10, 3, 1.1, ORDERS, "remove"), rdp_random_allocation(10, 3, 1.1, ORDERS, "add"))
    )


# ============================================================================= monotonicity


def test_decreasing_in_noise():
    prev = None
    for sigma in (0.4, 0.7, 1.0, 1.5, 3.0, 10.0):
        v = rdp_random_allocation(50, 1, sigma, ORDERS)
        assert np.all(np.isfinite(v))
        if prev is not None:
            assert np.all(v <= prev)
        prev = v


@pytest.mark.parametrize("sigma,t", [(0.6, 5), (1.0, 100), (2.0, 1000), (5.0, 10_000)])
def test_never_worse_than_full_batch_steps(sigma, t):
    v = rdp_random_allocation(t, 1, sigma, ORDERS)
    gauss = ORDERS / (2 * sigma**2)
    assert np.all(v <= t * gauss)
    # The remove direction never exceeds one unsampled Gaussian step either.
    assert np.all(rdp_random_allocation(t, 1, sigma, ORDERS, "remove") <= gauss * (1 + 1e-12))


def test_more_steps_more_amplification():
    # ε(α) of one round falls as the round gets longer (one step out of more).
    vals = [rdp_random_allocation(t, 1, 1.0, [2.0, 8.0, 32.0]) for t in (2, 10, 100, 1000)]
    for a, b in zip(vals, vals[1:]):
        assert np.all(b < a)


# ============================================================================= validation


def test_bad_parameters():
    for bad in (0, -3):
        with pytest.raises(ValueError):
            rdp_random_allocation(bad, 1, 1.0, ORDERS)
    with pytest.raises(ValueError):
        rdp_random_allocation(5, 6, 1.0, ORDERS)
    with pytest.raises(ValueError):
        rdp_random_allocation(5, 0, 1.0, ORDERS)
    for z in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError):
            rdp_random_allocation(5, 1, z, ORDERS)
    with pytest.raises(TypeError):
        rdp_random_allocation(5.0, 1, 1.0, ORDERS)
    with pytest.raises(TypeError):
        rdp_random_allocation(5, True, 1.0, ORDERS)
    with pytest.raises(TypeError):
        rdp_random_allocation(5, 1, "1.0", ORDERS)
    with pytest.raises(ValueError):
        rdp_random_allocation(5, 1, 1.0, [0.5, 2.0])
    with pytest.raises(ValueError):
        rdp_random_allocation(5, 1, 1.0, [math.nan])
    with pytest.raises(ValueError):
        rdp_random_allocation(5, 1, 1.0, ORDERS, direction="sideways")
    with pytest.raises(ValueError):
        RandomAllocationSampledEvent(5, 6, GaussianEvent(1.0))


def test_edge_values():
    assert np.all(rdp_random_allocation(7, 2, math.inf, ORDERS) == 0)
    v = rdp_random_allocation(7, 1, 1.0, [2.0, math.inf])
    assert math.isfinite(v[0]) and v[1] == math.inf
    assert rdp_random_allocation(7, 1, 1.0, np.array([[2.0, 3.0]])).shape == (1, 2)
    # Orders beyond 1024 keep the closed forms (Gaussian for remove, AM-GM for add).
    big = rdp_random_allocation(100, 1, 2.0, [2048.0, 3000.5], "remove")
    np.testing.assert_allclose(big, np.array([2048.0, 3000.5]) / 8.0, rtol=1e-14)
    assert np.all(big >= np.array([2048.0, 3000.5]) / 8.0)
    add = rdp_random_allocation(100, 1, 2.0, [2048.0], "add")[0]
    assert add == pytest.approx(2047 / 800 + 1 / 8, rel=1e-14) and add >= 2047 / 800 + 1 / 8
    # Tiny noise: huge but finite or +inf, never NaN.
    v = rdp_random_allocation(7, 1, 1e-3, ORDERS)
    assert not np.isnan(v).any() and np.all(v > 0)


# ============================================================================= accountants


def test_accountant_composes_rounds():
    ev = RandomAllocationSampledEvent(100, 2, GaussianEvent(1.2))
    acct = RdpAccountant().compose(SelfComposedEvent(ev, 300))
    per_round = rdp_random_allocation(100, 2, 1.2, ORDERS)
    np.testing.assert_allclose(acct.rdp, 300 * per_round, rtol=1e-13)
    assert np.all(acct.rdp >= 300 * per_round)
    eps, order = acct.get_epsilon_and_order(1e-5)
    assert (eps, order) == epsilon_from_rdp(ORDERS, acct.rdp, 1e-5)
    d = acct.get_delta(eps)
    assert d <= 1e-5 * (1 + 1e-9)
    assert RdpAccountant().supports(SelfComposedEvent(ev, 3))


def test_balls_in_bins_is_one_of_b():
    a = RdpAccountant().compose(SelfComposedEvent(BallsInBinsSampledEvent(64, GaussianEvent(0.9)), 10))
    b = RdpAccountant().compose(SelfComposedEvent(RandomAllocationSampledEvent(64, 1, GaussianEvent(0.9)), 10))
    np.testing.assert_array_equal(a.rdp, b.rdp)
    assert a.get_epsilon(1e-6) == b.get_epsilon(1e-6)


def test_nested_and_mixed_events():
    ra = RandomAllocationSampledEvent(20, 1, GaussianEvent(1.5))
    po = PoissonSampledEvent(0.05, GaussianEvent(1.5))
    acct = RdpAccountant().compose(ComposedEvent([SelfComposedEvent(ra, 3), po, ra]))
    expected = 4 * rdp_random_allocation(20, 1, 1.5, ORDERS) + RdpAccountant().compose(po).rdp
    np.testing.assert_allclose(acct.rdp, expected, rtol=1e-13)
    # Gaussians composed on each batch: one Gaussian of the combined noise multiplier.
    inner = ComposedEvent([GaussianEvent(2.0), GaussianEvent(2.0)])
    c = RdpAccountant().compose(RandomAllocationSampledEvent(20, 1, inner))
    np.testing.assert_allclose(c.rdp, rdp_random_allocation(20, 1, math.sqrt(2.0), ORDERS), rtol=1e-13)
    # Inside hyperparameter tuning (the inner run's curve comes from this accountant).
    run = SelfComposedEvent(ra, 10)
    plain = RdpAccountant().compose(run).get_epsilon(1e-5)
    tuned = RdpAccountant().compose(RepeatAndSelectEvent(run, 10.0, 1.0)).get_epsilon(1e-5)
    assert plain < tuned < math.inf


def test_non_private_and_empty_inner_events():
    assert RdpAccountant().compose(RandomAllocationSampledEvent(5, 1, NonPrivateEvent())).get_epsilon(1e-5) == math.inf
    assert RdpAccountant().compose(RandomAllocationSampledEvent(5, 1, GaussianEvent(0.0))).get_epsilon(1e-5) == math.inf
    nothing = RdpAccountant().compose(RandomAllocationSampledEvent(5, 1, SelfComposedEvent(GaussianEvent(1.0), 0)))
    assert nothing.get_epsilon(1e-5) == 0.0


def test_refusals():
    ra = RandomAllocationSampledEvent(10, 2, GaussianEvent(1.0))
    with pytest.raises(UnsupportedEventError, match="add_or_remove"):
        RdpAccountant(neighboring="replace_one").compose(ra)
    assert not RdpAccountant(neighboring="replace_one").supports(ra)
    with pytest.raises(UnsupportedEventError, match="discrete Gaussian"):
        RdpAccountant().compose(RandomAllocationSampledEvent(10, 1, DiscreteGaussianEvent(1.0)))
    with pytest.raises(TypeError):
        RdpAccountant().compose(RandomAllocationSampledEvent(10, 1, PoissonSampledEvent(0.5, GaussianEvent(1.0))))
    for ev in (ra, BallsInBinsSampledEvent(10, GaussianEvent(1.0)), SelfComposedEvent(ra, 4)):
        with pytest.raises(UnsupportedEventError, match=r"no certified PLD analysis.*RdpAccountant"):
            PldAccountant().compose(ev)
        assert not PldAccountant().supports(ev)
    pytest.importorskip("dp_accounting")
    for ev in (ra, BallsInBinsSampledEvent(10, GaussianEvent(1.0))):
        with pytest.raises(TypeError, match="dp_accounting has no event"):
            to_dp_accounting(ev)
