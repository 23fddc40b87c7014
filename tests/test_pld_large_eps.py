"""ε above 709.78: the Gaussian mechanism and PLDs whose privacy loss is out of e^x's range.

Before the fix the analytic Gaussian δ(ε) = Φ̄(ε/μ − μ/2) − e^ε·Φ̄(ε/μ + μ/2) (Balle & Wang
2018, arXiv:1805.06530, Theorem 8) was evaluated as written: above ε ≈ 709.78 e^ε overflowed
while Φ̄ underflowed, δ came out 0 and ε was capped at 709.78 (μ = 37 printed 709.78 against an
exact 841.355 at δ = 1e-5, μ = 63 709.78 against 2252.22), and a PLD step whose loss grid went
above 709.78 had no PLD (an error), or lost its top mass silently. Now every e^ε·(tail mass)
is formed with the exponent kept apart (rust/accounting/pld/normal.rs, curve.rs, loss.rs).

References are computed here with mpmath at 60 digits from the closed forms: the analytic
Gaussian, and the hockey-stick divergence of the Poisson-subsampled Gaussian pair in both
directions of add-or-remove (Zhu, Dong, Wang 2022, Proposition 30; δ(ε) as in Sommer, Meiser,
Mohammadi 2019, Theorem 1). Each value is for the float parameters the accountant is given.

Analytic path (no subsampling: Gaussian steps merge into one Gaussian with μ = √k/z): relative
error ≤ 1e-6 and never below the exact ε. Discretised path (any subsampled step present; the
automatic grid: Δ = 1e-4 coarsened until the composed window fits 2^21 atoms, here Δ ≈ 5e-4
to 5e-3): the ε printed must be at or above the exact value and within 1e-3 relative of it
(measured: below 1e-6 for single steps, up to 2.2e-4 for 2500-fold compositions at δ = 1e-12).
Where the exact value of a discretised case is not in closed form, it is bracketed by closed
forms and the upper bound is checked against both ends.
"""

import functools
import math
import warnings

import numpy as np
import pytest

from dpcore.accounting import PldAccountant, RdpAccountant
from dpcore.events import GaussianEvent, PoissonSampledEvent

mp = pytest.importorskip("mpmath")


@pytest.fixture(autouse=True)
def _sixty_digits():
    # Every reference (and every sum of references, e.g. δ + k·(1 − q)) at 60 digits.
    with mp.workdps(60):
        yield

EXP_OVERFLOW = 709.782712893384  # log(f64::MAX): the former cap


def _sf(x):
    return mp.erfc(x / mp.sqrt(2)) / 2


def _cdf(x):
    return mp.erfc(-x / mp.sqrt(2)) / 2


def _gauss_delta(mu, eps):
    """Balle & Wang 2018, Theorem 8: δ(ε) of the Gaussian mechanism with μ = Δ₂/σ."""
    mu, eps = mp.mpf(mu), mp.mpf(eps)
    return _sf(eps / mu - mu / 2) - mp.exp(eps) * _sf(eps / mu + mu / 2)


def _smallest_eps(delta_of, delta, hi=mp.mpf(2) ** 15):
    """The smallest ε ≥ 0 with delta_of(ε) ≤ δ (δ(ε) is nonincreasing): bisection to 2^-185."""
    delta = mp.mpf(delta)
    lo = mp.mpf(0)
    if delta_of(lo) <= delta:
        return lo
    assert delta_of(hi) <= delta
    for _ in range(200):
        mid = (lo + hi) / 2
        if delta_of(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


@functools.lru_cache(maxsize=None)
def gauss_eps(mu, delta):
    """Exact ε(δ) of the Gaussian mechanism (μ and δ as mpmath numbers or floats)."""
    return _smallest_eps(lambda e: _gauss_delta(mu, e), delta)


def _mu(z, k=1):
    """μ of k Gaussian steps with the float noise multiplier z (exactly √k/z)."""
    return mp.sqrt(k) / mp.mpf(z)


def _sub_delta_remove(q, s, eps):
    # P = (1 − q)·N(0, s²) + q·N(1, s²), Q = N(0, s²); the loss is increasing in x: L > ε ⇔ x > x*.
    t = mp.log((mp.exp(eps) - 1 + q) / q)
    x = s * s * t + mp.mpf(1) / 2
    return (1 - q) * _sf(x / s) + q * _sf((x - 1) / s) - mp.exp(eps) * _sf(x / s)


def _sub_delta_add(q, s, eps):
    # P = N(0, s²), Q = the mixture; the loss is decreasing in x and at most −log(1 − q).
    if eps >= -mp.log(1 - q):
        return mp.mpf(0)
    t = mp.log((mp.exp(-eps) - 1 + q) / q)
    x = s * s * t + mp.mpf(1) / 2
    return _cdf(x / s) - mp.exp(eps) * ((1 - q) * _cdf(x / s) + q * _cdf((x - 1) / s))


@functools.lru_cache(maxsize=None)
def subsampled_eps(q, z, delta):
    """Exact ε(δ) of one Poisson-subsampled Gaussian step (the worse of the two directions)."""
    q, s = mp.mpf(q), mp.mpf(z)
    return max(
        _smallest_eps(lambda e: _sub_delta_remove(q, s, e), delta),
        _smallest_eps(lambda e: _sub_delta_add(q, s, e), delta),
    )


def _pld(*parts):
    a = PldAccountant()
    for event, count in parts:
        a.compose(event, count)
    return a


# -- the analytic Gaussian (no subsampling) --------------------------------------------------


@pytest.mark.parametrize("mu", [37, 63, 100])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-8, 1e-12])
def test_analytic_gaussian_matches_the_60_digit_reference(mu, delta):
    z = 1.0 / mu
    got = _pld((GaussianEvent(z), 1)).get_epsilon(delta)
    exact = gauss_eps(_mu(z), delta)
    assert exact > EXP_OVERFLOW
    assert got >= exact, (got, float(exact))
    assert got <= exact * (1 + 1e-6), (got, float(exact))


def test_the_values_of_the_bug_report():
    # μ = 37 and μ = 63 at δ = 1e-5: 841.355 and 2252.22 (before: 709.78 for both).
    assert float(gauss_eps(37, mp.mpf(1e-5))) == pytest.approx(841.3547, abs=1e-4)
    assert float(gauss_eps(63, mp.mpf(1e-5))) == pytest.approx(2252.2206, abs=1e-4)
    assert _pld((GaussianEvent(1 / 37), 1)).get_epsilon(1e-5) == pytest.approx(841.3547, abs=1e-3)
    assert _pld((GaussianEvent(1 / 63), 1)).get_epsilon(1e-5) == pytest.approx(2252.2206, abs=1e-3)


@pytest.mark.parametrize("z,k", [(1.0, 1369), (1.0, 3969), (0.5, 2500), (0.1, 100), (0.02, 4)])
@pytest.mark.parametrize("delta", [1e-3, 1e-12])
def test_k_fold_gaussian_is_the_gaussian_with_mu_sqrt_k_over_z(z, k, delta):
    got = _pld((GaussianEvent(z), k)).get_epsilon(delta)
    exact = gauss_eps(_mu(z, k), delta)
    assert exact > EXP_OVERFLOW
    assert exact <= got <= exact * (1 + 1e-6), (got, float(exact))


def test_poisson_sampling_at_q_one_is_the_analytic_gaussian():
    for delta in (1e-5, 1e-10):
        got = _pld((PoissonSampledEvent(1.0, GaussianEvent(1 / 37)), 3)).get_epsilon(delta)
        exact = gauss_eps(_mu(1 / 37, 3), delta)
        assert exact <= got <= exact * (1 + 1e-6), (got, float(exact))


@pytest.mark.parametrize("mu", [37, 100])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-12])
def test_analytic_gaussian_delta_above_709(mu, delta):
    # δ at the exact ε is δ (it was 0 before: the privacy curve was cut at 709.78).
    z = 1.0 / mu
    eps = float(gauss_eps(_mu(z), delta))
    exact = _gauss_delta(_mu(z), eps)
    a = _pld((GaussianEvent(z), 1))
    lo, up = a.get_delta_bounds(eps)
    assert lo <= exact <= up
    assert a.get_delta(eps) == up
    assert up <= exact * (1 + 1e-6), (up, float(exact))


# -- discretised PLDs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "z,k,delta",
    [(1.0, 1369, 1e-3), (1.0, 1369, 1e-5), (1.0, 1369, 1e-12), (0.5, 2500, 1e-5)],
)
def test_discretised_gaussian_above_709(z, k, delta):
    """k Gaussian steps and one subsampled step that releases almost nothing: the accountant
    discretises the merged Gaussian (μ = 37 or 100, one step whose losses reach ~1000 or
    ~6000) and composes it by FFT. The subsampled step (q = 1e-12, z = 50) is (0, δ')-DP with
    δ' = q·(2Φ(1/(2·50)) − 1) < 1e-14, so the exact ε lies in [ε_G(δ), ε_G(δ − 1e-14)]."""
    a = _pld((GaussianEvent(z), k), (PoissonSampledEvent(1e-12, GaussianEvent(50.0)), 1))
    lo, up = a.get_epsilon_bounds(delta)
    mu = _mu(z, k)
    below, above = gauss_eps(mu, delta), gauss_eps(mu, mp.mpf(delta) - mp.mpf(1e-14))
    assert below > EXP_OVERFLOW
    assert up >= below, (up, float(below))
    assert up <= above * (1 + 1e-3), (up, float(above))
    assert lo <= above and lo <= up
    assert a.get_epsilon(delta) == up


@pytest.mark.parametrize(
    "z,k,delta",
    [(1 / 37, 1, 1e-3), (1 / 37, 4, 1e-5), (1 / 37, 4, 1e-12), (0.1, 100, 1e-5), (0.5, 2500, 1e-12)],
)
def test_composed_subsampled_gaussian_near_q_one_above_709(z, k, delta):
    """k Poisson-subsampled Gaussian steps at q = 1 − 1e-15, each (z = 1/37) or only their
    composition above 709.78. Each step is a post-processing of the Gaussian step (sampling),
    and its outputs are within total variation k·(1 − q) of k Gaussian steps, so the exact ε lies
    in [ε_G(δ + k·(1 − q)), ε_G(δ)] with μ = √k/z."""
    q = 1.0 - 1e-15
    a = _pld((PoissonSampledEvent(q, GaussianEvent(z)), k))
    lo, up = a.get_epsilon_bounds(delta)
    mu = _mu(z, k)
    below = gauss_eps(mu, mp.mpf(delta) + k * (1 - mp.mpf(q)))
    above = gauss_eps(mu, delta)
    assert below > EXP_OVERFLOW
    assert up >= below, (up, float(below))
    assert up <= above * (1 + 1e-3), (up, float(above))
    assert lo <= above and lo <= up


@pytest.mark.parametrize("q,z,delta", [(0.5, 1 / 37, 1e-5), (0.5, 1 / 37, 1e-12), (0.1, 1 / 63, 1e-5)])
def test_single_subsampled_step_matches_the_60_digit_reference(q, z, delta):
    # One step, exact ε from the closed-form hockey stick of both directions: ~835, ~914–940, ~2000.
    a = _pld((PoissonSampledEvent(q, GaussianEvent(z)), 1))
    lo, up = a.get_epsilon_bounds(delta)
    exact = subsampled_eps(q, z, delta)
    assert exact > EXP_OVERFLOW
    assert up >= exact, (up, float(exact))
    assert up <= exact * (1 + 1e-3), (up, float(exact))
    assert lo <= exact
    # δ at the exact ε: the upper bound is at least the true δ.
    dlo, dup = a.get_delta_bounds(float(exact))
    true_delta = max(
        _sub_delta_remove(mp.mpf(q), mp.mpf(z), mp.mpf(float(exact))),
        _sub_delta_add(mp.mpf(q), mp.mpf(z), mp.mpf(float(exact))),
    )
    assert dlo <= true_delta * (1 + 1e-9) and dup >= true_delta * (1 - 1e-9), (dlo, dup, float(true_delta))


def test_explicit_grid_above_709():
    a = PldAccountant(value_discretization_interval=1e-3)
    a.compose(PoissonSampledEvent(0.5, GaussianEvent(1 / 37)))
    up = a.get_epsilon(1e-5)
    exact = subsampled_eps(0.5, 1 / 37, 1e-5)
    assert exact <= up <= exact * (1 + 1e-3), (up, float(exact))


def test_discretised_delta_above_709():
    # The mixed run of test_discretised_gaussian_above_709 at μ = 37: δ at the exact Gaussian ε
    # is at least δ_G(ε) (the extra step only adds) and at most δ_G(ε) + 1e-14, up to the grid.
    eps = float(gauss_eps(37, mp.mpf(1e-5)))
    exact = _gauss_delta(37, eps)
    a = _pld((GaussianEvent(1.0), 1369), (PoissonSampledEvent(1e-12, GaussianEvent(50.0)), 1))
    lo, up = a.get_delta_bounds(eps)
    assert lo <= exact + 1e-14 and up >= exact, (lo, up, float(exact))
    assert up <= exact * (1 + 1e-3)


# -- RDP ------------------------------------------------------------------------------------

#: Orders down to 1.001: for μ = 100 the best order is about 1 + √(2 log(1/δ))/μ ≈ 1.05.
_ORDERS = [1 + i / 1000 for i in range(1, 100)] + [1.1 + i / 10 for i in range(99)] + list(range(11, 64)) + [128, 256, 512, 1024]


@pytest.mark.parametrize("mu", [37, 63, 100])
@pytest.mark.parametrize("delta", [1e-3, 1e-12])
def test_rdp_is_not_capped_above_709(mu, delta):
    # RDP → (ε, δ) works with logs throughout (conversion.rs); no cap, an upper bound within a
    # few percent of the exact Gaussian ε here.
    r = RdpAccountant(orders=_ORDERS)
    r.compose(GaussianEvent(1 / mu))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = r.get_epsilon(delta)
    exact = gauss_eps(_mu(1 / mu), delta)
    assert exact <= got <= exact * 1.05, (got, float(exact))


def test_rdp_subsampled_step_above_709():
    r = RdpAccountant(orders=_ORDERS)
    r.compose(PoissonSampledEvent(0.5, GaussianEvent(1 / 37)))
    got = r.get_epsilon(1e-5)
    exact = subsampled_eps(0.5, 1 / 37, 1e-5)
    assert exact <= got <= exact * 1.05, (got, float(exact))
    assert math.isfinite(got) and not np.isclose(got, EXP_OVERFLOW)
