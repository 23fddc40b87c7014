"""PLD accountant: dp_accounting's PLD as the oracle, the analytic Gaussian, RDP, properties."""

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant as dpa_pld

from dpcore import accounting as acc
from dpcore.accounting import PldAccountant, RdpAccountant, UnsupportedEventError  # noqa: F401
from dpcore.events import GaussianEvent, PoissonSampledEvent, SampledWithoutReplacementEvent, NonPrivateEvent


def ours(q, z, t, d):
    a = PldAccountant()
    a.compose(PoissonSampledEvent(q, GaussianEvent(z)), t)
    return a.get_epsilon_bounds(d)


def oracle(q, z, t, d, pessimistic=True):
    from dp_accounting.pld import privacy_loss_distribution as pld

    if pessimistic:
        a = dpa_pld.PLDAccountant(value_discretization_interval=1e-4)
        a.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t)
        return a.get_epsilon(d)
    p = pld.from_gaussian_mechanism(
        z, value_discretization_interval=1e-4, pessimistic_estimate=False, sampling_prob=q, use_connect_dots=False
    )
    return p.self_compose(t).get_epsilon_for_delta(d)


@pytest.mark.parametrize(
    "q,z,t,d,ref",
    [(256 / 60000, 1.1, 2340, 1e-5, 0.9182), (0.001, 0.8, 1000, 1e-5, 0.3036),
     (0.01, 4.0, 10000, 1e-5, 0.9470), (1e-4, 0.8, 100000, 1e-6, 0.2488)],
)
def test_issue_table_within_half_a_percent_of_dp_accounting(q, z, t, d, ref):
    lo, up = ours(q, z, t, d)
    assert lo <= up <= ref * 1.005
    assert up <= acc.epsilon(q, z, t, d, accountant="rdp")


def _draws(n, seed):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        q = float(10 ** rng.uniform(-5, 0))
        z = float(10 ** rng.uniform(math.log10(0.3), math.log10(50)))
        t = int(10 ** rng.uniform(0, 6))
        d = float(10 ** rng.uniform(-12, -2))
        yield q, z, t, d


@pytest.mark.parametrize("q,z,t,d", list(_draws(8, 13)))
def test_random_draws_against_the_oracle(q, z, t, d):
    lo, up = ours(q, z, t, d)
    pess = oracle(q, z, t, d, True)
    opt = oracle(q, z, t, d, False)
    assert lo <= up
    assert up <= pess * 1.005 + 1e-9, (up, pess)
    assert up >= opt * (1 - 1e-9) - 1e-12, (up, opt)


@pytest.mark.parametrize("z,t,d", [(1.0, 1, 1e-5), (10.0, 100, 1e-6), (0.5, 3, 1e-10)])
def test_unsampled_is_the_analytic_gaussian(z, t, d):
    # Balle & Wang 2018: δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), μ = √t / z.
    from scipy.stats import norm

    mu = math.sqrt(t) / z
    up = ours(1.0, z, t, d)[1]
    delta_at = lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2)  # noqa: E731
    assert delta_at(up) <= d * (1 + 1e-6)
    assert delta_at(up * (1 - 1e-6)) > d * (1 - 1e-6)


def test_pld_never_above_rdp_beyond_discretisation():
    for q, z, t, d in _draws(10, 5):
        up = ours(q, z, t, d)[1]
        assert up <= acc.epsilon(q, z, t, d, accountant="rdp") * 1.001 + 1e-6


@settings(max_examples=15, deadline=None)
@given(st.floats(1e-4, 0.2), st.floats(0.6, 5.0), st.integers(1, 2000), st.integers(1, 2000))
def test_heterogeneous_order_and_monotonicity(q, z, t1, t2):
    a, b = PoissonSampledEvent(q, GaussianEvent(z)), PoissonSampledEvent(min(1.0, 2 * q), GaussianEvent(z * 1.5))
    x = PldAccountant(value_discretization_interval=1e-4).compose(a, t1).compose(b, t2).get_epsilon(1e-6)
    y = PldAccountant(value_discretization_interval=1e-4).compose(b, t2).compose(a, t1).get_epsilon(1e-6)
    assert abs(x - y) <= 1e-9 * max(x, 1e-12)
    # More steps never lower ε (the true one; each printed value is a certified bound whose
    # rounding allowance depends on the composition, so two of them may differ by it: 1e-3);
    # δ(ε(δ)) ≤ δ.
    more = PldAccountant(value_discretization_interval=1e-4).compose(a, t1 + 10).compose(b, t2).get_epsilon(1e-6)
    assert more >= x * (1 - 1e-3)
    p = PldAccountant(value_discretization_interval=1e-4).compose(a, t1).compose(b, t2)
    # δ at ε and ε at δ are two certified bounds under different tilts (the saddle point of ε,
    # the Chernoff tilt of δ) and windows: each above the true curve, within 0.5% of each other.
    # Known gap (issue 51's note): at ε above 50 on this fixed grid the tilted window of δ at ε
    # outgrows the cap and falls back to a weaker tilt, and δ at ε is looser (43× at ε = 168).
    if x < 50:
        assert p.get_delta(x) <= 1e-6 * (1 + 5e-3)


def test_bad_input_and_degenerate_cases():
    p = PldAccountant().compose(PoissonSampledEvent(0.01, GaussianEvent(1.0)), 10)
    for bad in (0.0, 1.0, -1e-5, float("nan")):
        with pytest.raises(ValueError):
            p.get_epsilon(bad)
    with pytest.raises(ValueError):
        p.get_delta(-1.0)
    with pytest.raises(ValueError):
        PoissonSampledEvent(float("nan"), GaussianEvent(1.0))
    with pytest.raises(ValueError):
        PldAccountant(value_discretization_interval=0.0)
    assert PldAccountant().compose(PoissonSampledEvent(0.5, GaussianEvent(0.0)), 3).get_epsilon(1e-5) == math.inf
    assert PldAccountant().compose(PoissonSampledEvent(0.0, GaussianEvent(1.0)), 3).get_epsilon(1e-5) == 0.0
    assert PldAccountant().compose(NonPrivateEvent()).get_epsilon(1e-5) == math.inf
    assert acc.epsilon(0.5, 0.0, 10, 1e-5) == math.inf


def test_sampling_without_replacement_is_refused_with_a_pointer_to_rdp():
    e = SampledWithoutReplacementEvent(1000, 10, GaussianEvent(1.0))
    p = PldAccountant(neighboring="replace_one")
    assert not p.supports(e)
    with pytest.raises(UnsupportedEventError, match="RdpAccountant"):
        p.compose(e)
    assert RdpAccountant(neighboring="replace_one").supports(e)
    # Poisson under replace-one: refused; plain Gaussian under replace-one: the same Gaussian.
    assert not p.supports(PoissonSampledEvent(0.1, GaussianEvent(1.0)))
    g = PldAccountant(neighboring="replace_one").compose(GaussianEvent(2.0), 4).get_epsilon(1e-5)
    assert g == PldAccountant().compose(GaussianEvent(2.0), 4).get_epsilon(1e-5)


def test_extreme_inputs_are_finite_and_fast():
    import time

    t0 = time.perf_counter()
    assert math.isfinite(acc.epsilon(1e-9, 1e4, 10**9, 1e-15))
    assert math.isfinite(acc.epsilon(0.5, 0.3, 10**6, 1e-15))
    assert math.isfinite(acc.epsilon(1e-9, 0.3, 10**9, 1e-15))
    assert time.perf_counter() - t0 < 120  # a hang guard, not a benchmark


def test_calibration_never_overshoots_under_the_accountant_used():
    z = acc.calibrate_noise_multiplier(1.0, 1e-5, 0.004, 250)
    assert acc.epsilon(0.004, z, 250, 1e-5) <= 1.0
    assert acc.epsilon(0.004, z * (1 - 1e-4), 250, 1e-5) > 1.0
    z_rdp = acc.calibrate_noise_multiplier(1.0, 1e-5, 0.004, 250, accountant="rdp")
    assert z < z_rdp
    q = acc.calibrate_sampling_probability(1.0, 1e-5, 1.0, 500)
    assert acc.epsilon(q, 1.0, 500, 1e-5) <= 1.0 < acc.epsilon(q * (1 + 1e-4), 1.0, 500, 1e-5)
    s = acc.calibrate_steps(1.0, 1e-5, 0.01, 1.0)
    assert acc.epsilon(0.01, 1.0, s, 1e-5) <= 1.0 < acc.epsilon(0.01, 1.0, s + 1, 1e-5)


def test_interop_round_trip_for_every_event():
    from dpcore.events import ComposedEvent, SelfComposedEvent

    from dpcore.events import TruncatedPoissonSampledEvent

    e = ComposedEvent((SelfComposedEvent(PoissonSampledEvent(0.01, GaussianEvent(1.0)), 5), NonPrivateEvent(),
                       SampledWithoutReplacementEvent(100, 10, GaussianEvent(2.0)),
                       TruncatedPoissonSampledEvent(0.01, 50, 1000, GaussianEvent(1.5))))
    assert acc.from_dp_accounting(acc.to_dp_accounting(e)) == e
    # The truncated event is translated, and analysed by the PLD accountant
    # (tests/test_truncated_poisson.py).
    t = TruncatedPoissonSampledEvent(0.01, 50, 1000, GaussianEvent(1.5))
    assert PldAccountant().supports(t)


# -- the lower bound -----------------------------------------------------------------------------

BENCH = [(256 / 60000, 1.1, 2340, 1e-5), (0.001, 0.8, 1000, 1e-5), (0.01, 4.0, 10000, 1e-5), (1e-4, 0.8, 100000, 1e-6)]


@pytest.mark.parametrize("q,z,t,d", BENCH)
def test_lower_bound_is_tight_on_the_bench_cases(q, z, t, d):
    # Losses rounded down (the former lower bound) left gaps of 0.05–0.50 here (0 at 10⁵ steps).
    lo, up = ours(q, z, t, d)
    assert 0 < lo <= up and up - lo < 0.025 * up, (lo, up)
    # A lower bound stays below dp_accounting's certified (pessimistic) ε, which is above the true
    # one. (Its optimistic ε is another lower bound, looser: no order between the two.)
    assert lo <= oracle(q, z, t, d, True)


@pytest.mark.parametrize("q,z,t,d", list(_draws(6, 29)))
def test_lower_bound_never_above_the_upper_bounds(q, z, t, d):
    lo, up = ours(q, z, t, d)
    assert lo <= up
    # Below δ ≈ 1e-9 dp_accounting's ε is not an upper bound: its FFT rounding is not bounded
    # (issue 51). Drawn here: q = 0.8203, z = 24.57, 6145 steps, δ = 7.3e-11, where its ε at
    # Δ = 1e-4 is 19.70069 and at Δ = 1e-5 19.70197 (a pessimistic ε that rises on a finer
    # grid was below the truth); PRV brackets [19.70025, 19.70306], ours [19.70162, 19.70171].
    if d >= 1e-9:
        assert lo <= oracle(q, z, t, d, True) * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("z,t,d", [(1.0, 1, 1e-5), (3.0, 9, 1e-6), (0.7, 4, 1e-10), (20.0, 1000, 1e-5)])
def test_both_bounds_bracket_the_analytic_gaussian(z, t, d):
    # Unsampled steps on the discretised path (a subsampled group that releases nothing measurable
    # forces it, an interval fixes the grid): the analytic Gaussian ε (Balle & Wang 2018, Thm 8)
    # lies between the bounds, both within the grid's resolution of it.
    from scipy.stats import norm

    mu = math.sqrt(t) / z
    delta_at = lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2)  # noqa: E731
    lo_e, hi_e = 0.0, 100.0
    for _ in range(200):
        mid = 0.5 * (lo_e + hi_e)
        lo_e, hi_e = (mid, hi_e) if delta_at(mid) > d else (lo_e, mid)
    a = PldAccountant(value_discretization_interval=1e-4)
    a.compose(GaussianEvent(z), t).compose(PoissonSampledEvent(1e-12, GaussianEvent(50.0)))
    lo, up = a.get_epsilon_bounds(d)
    assert lo <= lo_e * (1 + 1e-9) and up >= hi_e * (1 - 1e-9), (lo, up, lo_e)
    assert up - lo < 2e-3 * max(1.0, up), (lo, up)
