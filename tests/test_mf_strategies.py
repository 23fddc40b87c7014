"""Matrix-factorization strategies: sensitivity, inverses, the expected loss, and its optimisers.

Every loss is checked against a dense numpy computation sens²·‖A·C⁻¹‖_F²/n (Choquette-Choo et al.
2022, arXiv 2211.06530, §3) or against golden values from an independent implementation
(jax_privacy's matrix_factorization; see ``JAXP_*`` below).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpcore.matrix_factorization import (
    IDENTITY,
    BandedStrategy,
    BLTStrategy,
    Participation,
    ToeplitzStrategy,
    banded_sqrt,
    brute_force_sensitivity,
    default_bands,
    expected_loss,
    optimize,
    optimize_banded,
    optimize_blt,
    rmse,
    workload_coefficients,
)
from dpcore.matrix_factorization import _optimize

P = Participation


# ---------------------------------------------------------------------------------------------
# helpers: the dense reference
# ---------------------------------------------------------------------------------------------


def toeplitz(col: np.ndarray) -> np.ndarray:
    n = col.size
    m = np.zeros((n, n))
    for j in range(n):
        m[j:, j] = col[: n - j]
    return m


def dense_workload(n: int, beta: float) -> np.ndarray:
    # Independent of workload_coefficients: prefix sums times the momentum recursion
    # m_t = β m_{t−1} + g_t, written as matrices.
    prefix = np.tril(np.ones((n, n)))
    mom = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            mom[i, j] = beta ** (i - j)
    return prefix @ mom


def dense_sensitivity(cm: np.ndarray, part: Participation) -> float:
    n = cm.shape[0]
    if part.kind == "cyclic_poisson":
        return float(np.max(np.linalg.norm(cm, axis=0)))
    b, k = part.min_separation, part.participations(n)
    return float(np.linalg.norm(cm[:, [i * b for i in range(k)]].sum(axis=1)))


def dense_loss(strategy: ToeplitzStrategy, n: int, part: Participation, beta: float = 0.0) -> float:
    cm = strategy.matrix(n)
    bm = dense_workload(n, beta) @ np.linalg.inv(cm)
    return dense_sensitivity(cm, part) ** 2 * float(np.sum(bm * bm)) / n


def monotone(draw_ratios) -> np.ndarray:
    return np.concatenate([[1.0], np.cumprod(draw_ratios)])


ratios = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=5)
blt_params = st.integers(1, 3).flatmap(
    lambda d: st.tuples(
        st.lists(st.floats(0.0, 0.99), min_size=d, max_size=d),
        st.lists(st.floats(0.0, 1.0), min_size=d, max_size=d),
        st.floats(0.0, 1.0),
    )
)


def make_blt(params) -> BLTStrategy:
    theta, w, total = params
    w = np.array(w)
    omega = np.zeros_like(w) if w.sum() == 0 else w / w.sum() * total * (1 - 1e-12)
    return BLTStrategy(theta, omega)


# ---------------------------------------------------------------------------------------------
# sensitivity
# ---------------------------------------------------------------------------------------------


@given(r=ratios, n=st.integers(1, 8), b=st.integers(1, 9))
def test_banded_sensitivity_is_the_brute_force_maximum(r, n, b):
    s = BandedStrategy(monotone(r))
    part = P(b)
    brute = brute_force_sensitivity(s, n, part)
    got = s.sensitivity(n, part)
    assert brute <= got <= brute * (1 + 1e-9)
    # the loss's own O(n) sensitivity (no rounding up) is the same maximum
    assert math.sqrt(_optimize._sens_sq(s.coefficients(n), n, part)[0]) == pytest.approx(brute, rel=1e-12)


@given(params=blt_params, n=st.integers(1, 8), b=st.integers(1, 9))
def test_blt_sensitivity_is_the_brute_force_maximum(params, n, b):
    s = make_blt(params)
    part = P(b)
    brute = brute_force_sensitivity(s, n, part)
    assert brute <= s.sensitivity(n, part) <= brute * (1 + 1e-9)
    assert math.sqrt(_optimize._sens_sq(s.coefficients(n), n, part)[0]) == pytest.approx(brute, rel=1e-12)


@pytest.mark.parametrize("n,b", [(8, 8), (8, 20), (8, 1), (9, 2), (9, 4)])
def test_sensitivity_single_and_multi_epoch_examples(n, b):
    for s in (banded_sqrt(3), banded_sqrt(9), BLTStrategy([0.9, 0.3], [0.4, 0.3]), IDENTITY):
        brute = brute_force_sensitivity(s, n, P(b))
        assert s.sensitivity(n, P(b)) == pytest.approx(brute, rel=1e-9)
    # identity: one unit per participation, orthogonal columns
    assert IDENTITY.sensitivity(n, P(b)) == pytest.approx(math.sqrt(-(-n // b)), rel=1e-9)


def test_non_monotone_strategies_are_refused():
    with pytest.raises(ValueError, match="non-increasing"):
        BandedStrategy([1.0, 0.5, 0.7])
    with pytest.raises(ValueError, match="non-negative"):
        BandedStrategy([1.0, -0.1])
    with pytest.raises(ValueError, match="sum"):
        BLTStrategy([0.5, 0.5], [0.6, 0.6])
    with pytest.raises(ValueError):
        BLTStrategy([1.0], [0.5])


def test_brute_force_finds_the_non_monotone_worst_case():
    # Why monotonicity is required: for coefficients that rise, the evenly spaced pattern is
    # not the worst one. A checker that ignored the coefficients' shape would fail this.
    class Raw(ToeplitzStrategy):
        def __init__(self, c):
            self._c = np.array(c, dtype=float)

        def coefficients(self, n):
            out = np.zeros(n)
            out[: min(n, self._c.size)] = self._c[:n]
            return out

        num_buffers = 3

        def to_dict(self):
            return {"kind": "raw", "coefficients": self._c.tolist()}

        def describe(self):
            return "raw Toeplitz"

    s = Raw([1.0, 0.0, 0.0, 5.0])
    n, part = 8, P(2)
    v = np.zeros(n)
    for i in range(part.participations(n)):
        v[i * 2 :] += s.coefficients(n)[: n - i * 2]
    assert brute_force_sensitivity(s, n, part) > np.linalg.norm(v) * 1.01


# ---------------------------------------------------------------------------------------------
# inverses
# ---------------------------------------------------------------------------------------------


@given(r=ratios, n=st.integers(1, 24))
def test_banded_inverse_is_the_dense_inverse(r, n):
    s = BandedStrategy(monotone(r))
    np.testing.assert_allclose(s.inverse_coefficients(n), np.linalg.inv(s.matrix(n))[:, 0], rtol=1e-9, atol=1e-12)


@given(params=blt_params, n=st.integers(1, 40))
def test_blt_closed_form_inverse_is_the_dense_one(params, n):
    s = make_blt(params)
    dense = np.linalg.inv(s.matrix(n))[:, 0]
    generic = ToeplitzStrategy.inverse_coefficients(s, n)  # power-series division of c itself
    closed = s.inverse_coefficients(n)
    np.testing.assert_allclose(closed, dense, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(closed, generic, rtol=1e-9, atol=1e-11)


def test_blt_coefficients_and_inverse_known_values():
    s = BLTStrategy([0.5], [0.25])
    np.testing.assert_allclose(s.coefficients(4), [1.0, 0.25, 0.125, 0.0625])
    # c(x) = (1 − 0.25x)/(1 − 0.5x), so C⁻¹ = (1 − 0.5x)/(1 − 0.25x): 1, −0.25, −0.0625, ...
    np.testing.assert_allclose(s.inverse_coefficients(4), [1.0, -0.25, -0.0625, -0.015625])


# ---------------------------------------------------------------------------------------------
# workload and loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9])
def test_workload_coefficients(beta):
    n = 12
    a = workload_coefficients(n, beta)
    np.testing.assert_allclose(a, dense_workload(n, beta)[:, 0], rtol=1e-13)
    np.testing.assert_allclose(toeplitz(a), dense_workload(n, beta), rtol=1e-13)
    with pytest.raises(ValueError):
        workload_coefficients(n, 1.0)
    with pytest.raises(ValueError):
        workload_coefficients(n, -0.1)


LOSS_STRATEGIES = [
    IDENTITY,
    banded_sqrt(3),
    banded_sqrt(16),
    BandedStrategy([1.0, 0.6, 0.3, 0.1]),
    BLTStrategy([0.9, 0.5], [0.3, 0.2]),
    BLTStrategy([0.99], [0.7]),
]


@pytest.mark.parametrize("strategy", LOSS_STRATEGIES, ids=lambda s: s.describe())
@pytest.mark.parametrize("beta", [0.0, 0.9])
@pytest.mark.parametrize("n,b", [(16, 16), (16, 40), (16, 4), (15, 4), (16, 1), (16, 3)])
def test_loss_equals_dense_computation(strategy, beta, n, b):
    part = P(b)
    got = expected_loss(strategy, n, part, momentum=beta)
    assert got == pytest.approx(dense_loss(strategy, n, part, beta), rel=1e-10)
    assert rmse(strategy, n, part, momentum=beta) == pytest.approx(math.sqrt(got), rel=1e-14)


@given(r=ratios, n=st.integers(1, 20), b=st.integers(1, 25), beta=st.sampled_from([0.0, 0.3, 0.95]))
def test_loss_equals_dense_computation_random_banded(r, n, b, beta):
    s = BandedStrategy(monotone(r))
    assert expected_loss(s, n, P(b), momentum=beta) == pytest.approx(dense_loss(s, n, P(b), beta), rel=1e-9)


@given(params=blt_params, n=st.integers(1, 20), b=st.integers(1, 25))
def test_loss_equals_dense_computation_random_blt(params, n, b):
    s = make_blt(params)
    assert expected_loss(s, n, P(b), momentum=0.5) == pytest.approx(dense_loss(s, n, P(b), 0.5), rel=1e-9)


def test_loss_cyclic_poisson_uses_the_column_norm_and_refuses_unusable_strategies():
    n, part = 20, P.cyclic_poisson(4, 0.1)
    s = banded_sqrt(4)
    assert expected_loss(s, n, part) == pytest.approx(dense_loss(s, n, part), rel=1e-10)
    # the column norm is the single-epoch sensitivity
    assert expected_loss(s, n, part) == pytest.approx(expected_loss(s, n, P.single_epoch(n)), rel=1e-12)
    with pytest.raises(ValueError, match="bands"):
        expected_loss(banded_sqrt(5), n, part)
    with pytest.raises(ValueError, match="banded"):
        expected_loss(BLTStrategy([0.5], [0.5]), n, part)


def test_loss_argument_checks():
    with pytest.raises(TypeError):
        expected_loss(IDENTITY, 10, 10)
    with pytest.raises(TypeError):
        expected_loss([1.0], 10, P(10))
    with pytest.raises(ValueError):
        expected_loss(IDENTITY, 0, P(10))
    with pytest.raises(ValueError):
        expected_loss(IDENTITY, 10, P(10), momentum=1.5)


def test_loss_is_fast_for_long_horizons():
    n = 100_000
    t = time.perf_counter()
    for s in (banded_sqrt(64), BLTStrategy([0.9999, 0.99, 0.8], [0.1, 0.2, 0.2]), IDENTITY):
        for part in (P.single_epoch(n), P(1), P(100)):
            assert math.isfinite(expected_loss(s, n, part, momentum=0.9))
    # O(n·bands): well under a second here; O(n²) would take minutes.
    assert time.perf_counter() - t < 20


# ---------------------------------------------------------------------------------------------
# golden values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000])
def test_identity_loss_single_epoch_is_n_plus_one_over_two(n):
    # sens = 1 and ‖A‖_F²/n = Σ_k (n − k)/n = (n + 1)/2
    assert expected_loss(IDENTITY, n, P.single_epoch(n)) == pytest.approx((n + 1) / 2, rel=1e-14)


@pytest.mark.parametrize("k,b", [(2, 50), (4, 25), (10, 10), (100, 1)])
def test_identity_loss_k_epochs_is_k_times_n_plus_one_over_two(k, b):
    n = k * b
    assert expected_loss(IDENTITY, n, P.cyclic(b, k)) == pytest.approx(k * (n + 1) / 2, rel=1e-14)


def test_banded_sqrt_coefficients():
    r = banded_sqrt(8).band_coefficients
    expect = [math.comb(2 * j, j) / 4**j for j in range(8)]
    np.testing.assert_allclose(r, expect, rtol=1e-15)
    np.testing.assert_allclose(r[:4], [1.0, 0.5, 0.375, 0.3125])
    assert banded_sqrt(1) == IDENTITY


@pytest.mark.parametrize("n", [5, 32, 64])
def test_full_square_root_factorization(n):
    # C = A^{1/2} for bands = n, so B = A·C⁻¹ = C as well: loss = ‖c‖²·‖C‖_F²/n.
    s = banded_sqrt(n)
    cm = s.matrix(n)
    prefix = np.tril(np.ones((n, n)))
    np.testing.assert_allclose(cm @ cm, prefix, atol=1e-12)
    np.testing.assert_allclose(prefix @ np.linalg.inv(cm), cm, atol=1e-10)
    c = s.coefficients(n)
    closed = float(c @ c) * float(np.sum(cm * cm)) / n
    assert expected_loss(s, n, P.single_epoch(n)) == pytest.approx(closed, rel=1e-12)
    assert expected_loss(s, n, P.single_epoch(n)) == pytest.approx(dense_loss(s, n, P.single_epoch(n)), rel=1e-10)


# Produced by jax_privacy 2.0.0 (jax 0.10.2, jax_enable_x64) from PyPI:
# toeplitz.minsep_sensitivity_squared(coef, min_sep=b, max_participations=k, n=n) and
# mean(toeplitz.per_query_error(strategy_coef=coef, n=n, workload_coef=a)) · sens².
# (coefficients, n, b, momentum, sens², loss)
JAXP_LOSS = [
    (banded_sqrt(8), 64, 64, 0.0, 1.718379259109497, 7.395300831513772),
    (banded_sqrt(8), 64, 8, 0.0, 13.747034072875977, 59.16240665211018),
    (banded_sqrt(8), 64, 4, 0.0, 43.660149335861206, 187.89794917266025),
    (banded_sqrt(16), 256, 256, 0.0, 1.9438788471567705, 14.88506996740318),
    (banded_sqrt(64), 64, 64, 0.0, 2.388848108295435, 4.9714571679236395),
    (BandedStrategy([1.0, 0.6, 0.3, 0.1]), 48, 3, 0.0, 26.35, 178.24459901692705),
    (BandedStrategy([1.0, 0.6, 0.3, 0.1]), 48, 3, 0.9, 26.35, 9436.239549577735),
    (BLTStrategy([0.9, 0.5], [0.3, 0.2]), 100, 20, 0.0, 9.694049483898022, 39.11366713911005),
]


@pytest.mark.parametrize("strategy,n,b,beta,sens2,loss", JAXP_LOSS)
def test_golden_values_from_jax_privacy(strategy, n, b, beta, sens2, loss):
    part = P(b)
    assert strategy.sensitivity(n, part) ** 2 == pytest.approx(sens2, rel=1e-9)
    assert expected_loss(strategy, n, part, momentum=beta) == pytest.approx(loss, rel=1e-9)


# Optimised losses from jax_privacy 2.0.0: toeplitz.optimize_banded_toeplitz(n, bands,
# max_optimizer_steps=1000) (single participation, mean error) and
# buffered_toeplitz.optimize(n=n, min_sep=b, max_participations=k, error='mean',
# min_buffers=4, max_buffers=4). (n, b, bands or None for a 4-buffer BLT, loss)
JAXP_OPTIMA = [
    (256, 256, 8, 20.681211081439283),
    (1000, 1000, 64, 16.28015849871359),
    (256, 256, None, 6.849942892583377),
    (1000, 1000, None, 9.301433322373708),
    (1000, 100, None, 148.68858033278786),
    (1000, 10, None, 6319.177370294116),
]


@pytest.mark.parametrize("n,b,bands,loss", JAXP_OPTIMA)
def test_optima_match_jax_privacy(n, b, bands, loss):
    part = P(b)
    s = optimize_banded(n, bands, part) if bands else optimize_blt(n, part, buffers=4)
    got = expected_loss(s, n, part)
    # At least as good (to optimiser tolerance), and not suspiciously better than a
    # converged independent optimiser of the same objective.
    assert got <= loss * (1 + 1e-5)
    assert got >= loss * (1 - 1e-3)


# ---------------------------------------------------------------------------------------------
# optimisation
# ---------------------------------------------------------------------------------------------

OPT_CASES = [
    (64, P.single_epoch(64), 0.0),
    (200, P.single_epoch(200), 0.0),
    (200, P.cyclic(50), 0.0),
    (240, P.cyclic(12), 0.0),
    (300, P.cyclic(7), 0.9),
    (128, P.single_epoch(128), 0.9),
    (120, P.cyclic_poisson(10, 0.05), 0.0),
]


@pytest.mark.parametrize("n,part,beta", OPT_CASES)
def test_optimized_banded_beats_sqrt_beats_identity(n, part, beta):
    m = default_bands(n, part)
    s = optimize_banded(n, m, part, momentum=beta)
    c = s.band_coefficients
    assert c[0] == 1.0 and np.all(c >= 0) and np.all(np.diff(c) <= 0)
    assert s.bands <= m
    opt = expected_loss(s, n, part, momentum=beta)
    sq = expected_loss(banded_sqrt(m), n, part, momentum=beta)
    ident = expected_loss(IDENTITY, n, part, momentum=beta)
    assert opt <= sq * (1 + 1e-12)
    assert sq < ident
    assert opt < ident


@pytest.mark.parametrize("n,part,beta", [c for c in OPT_CASES if c[1].kind == "cyclic"])
def test_optimized_blt_is_valid_and_beats_identity(n, part, beta):
    s = optimize_blt(n, part, buffers=3, momentum=beta)
    c = s.coefficients(n)
    assert np.all(c >= 0) and np.all(np.diff(c) <= 0)
    assert np.all(s.theta < 1) and math.fsum(s.omega.tolist()) <= 1
    assert expected_loss(s, n, part, momentum=beta) < expected_loss(IDENTITY, n, part, momentum=beta)
    # the sensitivity the ledger will recompute is the one optimised for
    assert s.sensitivity(n, part) == pytest.approx(brute_sens_fast(s, n, part), rel=1e-9)


def brute_sens_fast(s, n, part):
    return math.sqrt(_optimize._sens_sq(s.coefficients(n), n, part)[0])


def test_blt_matches_best_toeplitz_single_epoch():
    # McMahan et al. 2024: a few buffers come within a few percent of the best Toeplitz strategy.
    n = 256
    part = P.single_epoch(n)
    best_toeplitz = rmse(optimize_banded(n, n, part), n, part)
    blt = rmse(optimize_blt(n, part, buffers=4), n, part)
    assert blt <= best_toeplitz * 1.01
    assert blt >= best_toeplitz * (1 - 1e-3)  # a BLT is a Toeplitz strategy
    assert best_toeplitz < rmse(banded_sqrt(n), n, part)


def test_optimizers_handle_long_horizons():
    n = 10_000
    for part in (P.single_epoch(n), P(1000)):
        t = time.perf_counter()
        banded = optimize_banded(n, 64, part)
        blt = optimize_blt(n, part)
        # a few seconds each here; the bound only catches an O(n²) step
        assert time.perf_counter() - t < 60
        sq = expected_loss(banded_sqrt(64), n, part)
        assert expected_loss(banded, n, part) < sq
        assert expected_loss(blt, n, part) < expected_loss(banded, n, part)


def finite_difference(fun, x, eps=1e-6):
    return np.array([(fun(x + eps * e)[0] - fun(x - eps * e)[0]) / (2 * eps) for e in np.eye(x.size)])


@pytest.mark.parametrize("part", [P.single_epoch(60), P(7), P(1), P.cyclic_poisson(8, 0.1)])
@pytest.mark.parametrize("beta", [0.0, 0.8])
def test_banded_gradient_matches_finite_differences(part, beta):
    n, m = 60, 8
    fun = _optimize._banded_objective(n, m, part, beta)
    rng = np.random.default_rng(1)
    for r in (rng.uniform(0.2, 0.95, m - 1), np.array([0.9, 0.0, 0.5, 1.0, 0.3, 0.7, 0.6])):
        val, grad = fun(r)
        c = np.concatenate([[1.0], np.cumprod(r)])
        assert val == pytest.approx(math.log(dense_loss(BandedStrategy(c), n, part, beta)), rel=1e-10)
        # central differences at the box edges still see the smooth extension
        np.testing.assert_allclose(grad, finite_difference(fun, r), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("part", [P.single_epoch(50), P(6), P(1)])
@pytest.mark.parametrize("beta", [0.0, 0.8])
def test_blt_gradient_matches_finite_differences(part, beta):
    n = 50
    fun, params = _optimize._blt_objective(n, 3, part, beta)
    for theta, omega in (([0.95, 0.7, 0.2], [0.2, 0.2, 0.1]), ([0.99, 0.9, 0.5], [0.05, 0.5, 0.3])):
        x = params.pack(np.array(theta), np.array(omega))
        val, grad = fun(x)
        th, om, _, _ = params.unpack(x)
        np.testing.assert_allclose(th, theta, rtol=1e-12)
        np.testing.assert_allclose(om, omega, rtol=1e-9)
        assert val == pytest.approx(math.log(dense_loss(BLTStrategy(th, om), n, part, beta)), rel=1e-10)
        np.testing.assert_allclose(grad, finite_difference(fun, x), rtol=1e-5, atol=1e-8)


def test_momentum_changes_the_optimum():
    n, part = 200, P.single_epoch(200)
    plain = optimize_banded(n, 16, part)
    mom = optimize_banded(n, 16, part, momentum=0.9)
    assert expected_loss(mom, n, part, momentum=0.9) < expected_loss(plain, n, part, momentum=0.9) * (1 - 1e-3)


# ---------------------------------------------------------------------------------------------
# the front door
# ---------------------------------------------------------------------------------------------


def test_optimize_front_door():
    n = 120
    assert optimize(n, P(10), kind="banded", bands=1) is IDENTITY
    assert optimize(n, P(1), kind="banded") is IDENTITY  # b = 1: bands ≤ b leaves only C = I
    s = optimize(n, P(10), kind="banded")
    assert isinstance(s, BandedStrategy) and s.bands <= 10
    assert default_bands(n, P(10)) == 10
    assert default_bands(n, P.single_epoch(n)) == 64
    assert default_bands(20, P.single_epoch(20)) == 20
    assert default_bands(10_000, P(500)) == 64
    b = optimize(n, P(10))
    assert isinstance(b, BLTStrategy) and b.num_buffers == _optimize.DEFAULT_BUFFERS == 2
    four = optimize(n, P(10), buffers=4)
    assert isinstance(four, BLTStrategy) and four.num_buffers == 4
    poisson = P.cyclic_poisson(10, 0.1)
    s = optimize(n, poisson, kind="banded")
    assert s.bands <= 10 and math.isfinite(expected_loss(s, n, poisson))
    with pytest.raises(ValueError, match="bands"):
        optimize(n, poisson, kind="banded", bands=11)
    with pytest.raises(ValueError, match="banded"):
        optimize(n, poisson)
    with pytest.raises(ValueError, match="kind"):
        optimize(n, P(10), kind="dense")
    with pytest.raises(ValueError):
        optimize(n, P(10), kind="blt", bands=4)
    with pytest.raises(ValueError):
        optimize(n, P(10), kind="banded", buffers=4)
    with pytest.raises(TypeError):
        optimize(n, 10)


def test_optimized_strategies_round_trip():
    from dpcore.matrix_factorization import strategy_from_dict

    for s in (optimize(80, P(8), kind="banded"), optimize(80, P(8))):
        assert strategy_from_dict(s.to_dict()) == s
