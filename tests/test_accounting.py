"""dpcore.accounting: API, edge cases, events, calibration, golden values (fast tests)."""

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dpcore.accounting as A
from dpcore.accounting import (
    ComposedEvent,
    GaussianEvent,
    NonPrivateEvent,
    PoissonSampledEvent,
    RdpAccountant,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)

OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


# -- golden values -------------------------------------------------------------------------


def test_opacus_golden_value_on_its_grid():
    # Opacus' test: q=0.04, z=1.5, 2250 steps, delta=1e-5 on its grid -> 7.32911117143.
    acc = RdpAccountant(orders=OPACUS_ORDERS).compose(PoissonSampledEvent(0.04, GaussianEvent(1.5)), 2250)
    grid_eps, grid_order = A.epsilon_from_rdp(acc.orders, acc.rdp, 1e-5)
    assert grid_eps == pytest.approx(7.32911117143, rel=1e-9)
    assert grid_eps >= 7.32911117143 * (1 - 1e-11)  # an upper bound, never below the exact value
    assert grid_order == 3.9
    eps, order = acc.get_epsilon_and_order(1e-5)
    assert eps <= grid_eps  # continuous search never reports more than the grid
    assert eps < grid_eps * (1 - 1e-5)  # and here it finds a better order between 3.9 and 4.0
    assert 3.9 < order < 4.0


def test_abadi_2016_moments_accountant_example():
    # Abadi et al. 2016 §3.1: q=0.01, sigma=4, delta=1e-5, T=10000 -> eps ~ 1.26 with the moments
    # accountant (integer lambda <= 32, tail bound delta = min exp(alpha(lambda) - lambda eps)).
    o = np.arange(2.0, 34.0)
    r = A.rdp_poisson_subsampled_gaussian(0.01, 4.0, o) * 10000
    classic = np.min(r + np.log(1e5) / (o - 1))
    assert round(classic, 2) == 1.26
    # The improved conversion (CKS 2020 Prop. 12) with continuous orders is smaller.
    assert A.epsilon(0.01, 4.0, 10000, 1e-5) < classic


def test_gaussian_mechanism_closed_form():
    # q = 1: RDP alpha/(2 z^2) (Mironov 2017 Prop. 7); eps at a real order is closed-form.
    z, steps, delta = 3.0, 10, 1e-6
    rho = steps / (2 * z * z)
    from scipy.optimize import minimize_scalar

    f = lambda a: rho * a + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
    fine = minimize_scalar(f, bounds=(1.5, 64), method="bounded", options={"xatol": 1e-10}).fun
    eps = A.epsilon(1.0, z, steps, delta, accountant="rdp")
    assert fine * (1 - 1e-7) <= eps <= fine * (1 + 1e-7)


# -- edge cases ----------------------------------------------------------------------------


def test_rdp_edge_cases():
    o = [1.5, 2.0, 7.25, 64.0]
    assert (A.rdp_poisson_subsampled_gaussian(0.0, 1.0, o) == 0).all()
    assert np.isinf(A.rdp_poisson_subsampled_gaussian(0.1, 0.0, o)).all()
    assert np.isinf(A.rdp_poisson_subsampled_gaussian(0.1, 1.0, [math.inf]))[0]
    r = A.rdp_poisson_subsampled_gaussian(1.0, 2.0, o)
    np.testing.assert_allclose(r, np.array(o) / 8.0, rtol=1e-14)
    assert (r >= np.array(o) / 8.0).all()
    assert A.rdp_poisson_subsampled_gaussian(0.1, 1.0, np.array([[2.0, 3.5]])).shape == (1, 2)


@pytest.mark.parametrize(
    "args, name",
    [
        ((1.5, 1.0, [2.0]), "sampling_probability"),
        ((-0.1, 1.0, [2.0]), "sampling_probability"),
        ((math.nan, 1.0, [2.0]), "sampling_probability"),
        ((0.1, -1.0, [2.0]), "noise_multiplier"),
        ((0.1, 1.0, [1.0]), "orders"),
        ((0.1, 1.0, [0.5, 2.0]), "orders"),
    ],
)
def test_bad_input_names_the_parameter(args, name):
    with pytest.raises(ValueError, match=name):
        A.rdp_poisson_subsampled_gaussian(*args)


def test_bad_input_elsewhere():
    with pytest.raises(ValueError, match="delta"):
        A.epsilon(0.1, 1.0, 10, 1.5)
    with pytest.raises(ValueError, match="sampling_probability"):
        A.epsilon(1.1, 1.0, 10, 1e-5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        A.epsilon(0.1, -1.0, 10, 1e-5)
    with pytest.raises(ValueError, match="steps"):
        A.epsilon(0.1, 1.0, -1, 1e-5)
    with pytest.raises(TypeError):
        A.epsilon("0.1", 1.0, 10, 1e-5)
    with pytest.raises(ValueError, match="sampling_probability"):
        PoissonSampledEvent(2.0, GaussianEvent(1.0))
    with pytest.raises(ValueError, match="noise_multiplier"):
        GaussianEvent(-1.0)
    with pytest.raises(ValueError, match="sample_size"):
        SampledWithoutReplacementEvent(10, 11, GaussianEvent(1.0))
    with pytest.raises(ValueError, match="neighboring"):
        RdpAccountant(neighboring="replace_all")
    with pytest.raises(ValueError, match="add_or_remove"):
        RdpAccountant(neighboring="replace_one").compose(PoissonSampledEvent(0.1, GaussianEvent(1.0)))
    with pytest.raises(ValueError, match="replace_one"):
        RdpAccountant().compose(SampledWithoutReplacementEvent(100, 10, GaussianEvent(1.0)))
    with pytest.raises(ValueError, match="target_epsilon"):
        A.calibrate_noise_multiplier(-1.0, 1e-5, 0.01, 100)


def test_no_finite_guarantee_is_inf_not_error():
    acc = RdpAccountant().compose(PoissonSampledEvent(0.01, GaussianEvent(1.0)), 10).compose(NonPrivateEvent())
    assert acc.get_epsilon(1e-5) == math.inf
    assert acc.get_delta(1.0) == 1.0
    assert A.epsilon(0.1, 0.0, 10, 1e-5) == math.inf
    assert A.epsilon(0.1, 1.0, 10, 0.0, accountant="rdp") == math.inf
    assert A.epsilon(0.0, 1.0, 10, 1e-5) == 0.0
    assert A.epsilon(0.0, 1.0, 10, 0.0, accountant="rdp") == 0.0
    assert RdpAccountant().get_epsilon(1e-5) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", A.OrderRangeWarning)  # best order 1.1, the grid's edge
        assert not math.isnan(A.epsilon(1e-9, 1e-3, 10, 1e-5))


def test_warns_when_best_order_is_at_the_edge():
    acc = RdpAccountant(orders=[2.0, 3.0, 4.0]).compose(PoissonSampledEvent(0.001, GaussianEvent(5.0)), 10)
    with pytest.warns(A.OrderRangeWarning):
        acc.get_epsilon(1e-5)
    # No warning when continuous search lands inside the grid.
    acc = RdpAccountant().compose(PoissonSampledEvent(0.01, GaussianEvent(1.1)), 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.get_epsilon(1e-5)


def test_delta_roundtrip():
    acc = RdpAccountant().compose(PoissonSampledEvent(0.02, GaussianEvent(1.0)), 500)
    eps = acc.get_epsilon(1e-6)
    d = acc.get_delta(eps)
    assert d <= 1e-6 * (1 + 1e-6)
    assert d >= 1e-6 * 0.99
    assert acc.get_delta(eps * 0.9) > 1e-6


# -- events ---------------------------------------------------------------------------------

gauss = st.builds(GaussianEvent, st.floats(0, 100))
leaf = st.one_of(
    gauss,
    st.builds(PoissonSampledEvent, st.floats(0, 1), gauss),
    st.builds(lambda n, k, e: SampledWithoutReplacementEvent(n, min(k, n), e), st.integers(1, 10**6), st.integers(0, 10**6), gauss),
    st.just(NonPrivateEvent()),
)
events = st.recursive(
    leaf,
    lambda ch: st.one_of(
        st.builds(SelfComposedEvent, ch, st.integers(0, 10**6)),
        st.builds(ComposedEvent, st.lists(ch, max_size=4).map(tuple)),
    ),
    max_leaves=10,
)


@given(events)
@settings(max_examples=60, deadline=None)
def test_events_roundtrip_json(e):
    back = A.event_from_dict(json.loads(json.dumps(e.to_dict())))
    assert back == e
    assert hash(back) == hash(e)
    with pytest.raises(Exception):
        e.noise_multiplier = 3.0  # frozen


def test_from_dict_rejects_garbage():
    with pytest.raises(ValueError):
        A.event_from_dict({"type": "LaplaceEvent"})
    with pytest.raises(ValueError):
        A.event_from_dict({"noise_multiplier": 1.0})


# -- composition ----------------------------------------------------------------------------


def test_grouping_a_million_heterogeneous_steps():
    schedule = [PoissonSampledEvent(q, GaussianEvent(z)) for q, z in [(0.01, 1.0), (0.02, 1.3), (0.005, 0.8)]]
    big = ComposedEvent(tuple(schedule[i % 3] for i in range(10**6)))
    a = RdpAccountant().compose(big)
    b = RdpAccountant()
    for k, e in enumerate(schedule):
        b.compose(e, count=10**6 // 3 + (1 if k < 10**6 % 3 else 0))
    np.testing.assert_array_equal(a.rdp, b.rdp)
    assert a.get_epsilon(1e-5) == b.get_epsilon(1e-5)


def test_composition_adds_rdp():
    o = [1.5, 2.0, 3.3, 8.0, 32.0]
    acc = RdpAccountant(orders=o)
    parts = [(0.01, 1.0, 100), (0.03, 2.0, 50), (1.0, 10.0, 3)]
    for q, z, c in parts:
        acc.compose(SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), c) if q < 1 else SelfComposedEvent(GaussianEvent(z), c))
    want = sum(c * A.rdp_poisson_subsampled_gaussian(q, z, o) for q, z, c in parts)
    np.testing.assert_allclose(acc.rdp, want, rtol=1e-14)
    assert (acc.rdp >= want).all()


def test_composed_gaussians_in_one_sample_combine():
    # Two Gaussians on the same Poisson sample act as one with 1/z^2 = 1/z1^2 + 1/z2^2.
    a = RdpAccountant().compose(PoissonSampledEvent(0.01, ComposedEvent((GaussianEvent(1.0), GaussianEvent(2.0)))), 100)
    b = RdpAccountant().compose(PoissonSampledEvent(0.01, GaussianEvent(1 / math.sqrt(1.25))), 100)
    np.testing.assert_allclose(a.rdp, b.rdp, rtol=1e-12)


def test_monotone_in_steps_noise_and_rate():
    e = A.epsilon(0.01, 1.0, 1000, 1e-5)
    assert A.epsilon(0.01, 1.0, 1001, 1e-5) >= e
    assert A.epsilon(0.01, 1.01, 1000, 1e-5) <= e
    assert A.epsilon(0.0101, 1.0, 1000, 1e-5) >= e


# -- calibration ----------------------------------------------------------------------------


@pytest.mark.parametrize("q, steps, target", [(0.01, 1000, 1.0), (0.04, 2250, 8.0), (0.001, 10**5, 3.0), (1.0, 10, 2.0)])
def test_calibrate_noise_multiplier(q, steps, target):
    z = A.calibrate_noise_multiplier(target, 1e-5, q, steps, accountant="rdp")
    assert A.epsilon(q, z, steps, 1e-5, accountant="rdp") <= target
    assert A.epsilon(q, z * (1 - 1e-6), steps, 1e-5, accountant="rdp") > target


@pytest.mark.parametrize("z, steps, target", [(1.0, 1000, 1.0), (1.5, 2250, 8.0), (0.8, 100, 0.5)])
def test_calibrate_sampling_probability(z, steps, target):
    q = A.calibrate_sampling_probability(target, 1e-5, z, steps, accountant="rdp")
    assert 0 < q < 1
    assert A.epsilon(q, z, steps, 1e-5, accountant="rdp") <= target
    assert A.epsilon(min(1.0, q * (1 + 1e-6)), z, steps, 1e-5, accountant="rdp") > target


def test_calibrate_sampling_probability_all_fit():
    assert A.calibrate_sampling_probability(100.0, 1e-5, 5.0, 10) == 1.0


@pytest.mark.parametrize("q, z, target", [(0.01, 1.0, 1.0), (0.04, 1.5, 8.0), (0.1, 0.7, 0.1)])
def test_calibrate_steps(q, z, target):
    s = A.calibrate_steps(target, 1e-5, q, z, accountant="rdp")
    if s > 0:
        assert A.epsilon(q, z, s, 1e-5, accountant="rdp") <= target
    assert A.epsilon(q, z, s + 1, 1e-5, accountant="rdp") > target
