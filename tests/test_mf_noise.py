"""The correlated noise of matrix-factorization mechanisms (Rust core) and MatrixFactorizationQuery."""

import numpy as np
import pytest

import dpcore
from dpcore.matrix_factorization import BandedStrategy, BLTStrategy, IDENTITY, Participation
from dpcore.matrix_factorization._noise import CorrelatedNoise
from dpcore.queries import GaussianSumQuery, NestedQuery
from dpcore.queries.matrix_factorization import MatrixFactorizationQuery

BLT = BLTStrategy([0.95, 0.6, 0.1], [0.3, 0.2, 0.1])
BANDED = BandedStrategy([1.0, 0.6, 0.35, 0.2])


def _rows(strategy, d, n, dtype=np.float64, seed0=1000):
    g = CorrelatedNoise(strategy, d, dtype)
    return np.stack([g.next(seed=seed0 + t) for t in range(n)]).astype(np.float64)


def _fresh(d, n, dtype=np.float64, seed0=1000):
    return np.stack([dpcore.gaussian_noise(d, 1.0, dtype=dtype, seed=seed0 + t) for t in range(n)]).astype(np.float64)


def test_identity_is_the_independent_gaussian_noise_bit_for_bit():
    for dt in (np.float32, np.float64):
        assert np.array_equal(_rows(IDENTITY, 40_000, 3, dt), _fresh(40_000, 3, dt))


@pytest.mark.parametrize("strategy", [BLT, BANDED], ids=["blt", "banded"])
def test_the_noise_solves_c_w_equals_z(strategy):
    n, d = 12, 5000
    w, z = _rows(strategy, d, n), _fresh(d, n)
    np.testing.assert_allclose(strategy.matrix(n) @ w, z, rtol=0, atol=1e-12)
    # float32 buffers: the same recursion, rounded once per value
    w32 = _rows(strategy, d, n, np.float32)
    z32 = _fresh(d, n, np.float32)
    np.testing.assert_allclose(strategy.matrix(n) @ w32, z32, rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", [BLT, BANDED], ids=["blt", "banded"])
def test_empirical_covariance_matches_c_inverse(strategy):
    """Cov(w) = C⁻¹C⁻ᵀ: each entry within 5 standard errors (fixed seeds, 2·10⁵ coordinates)."""
    n, d = 10, 200_000
    w = _rows(strategy, d, n, seed0=7)
    emp = w @ w.T / d
    ci = np.linalg.inv(strategy.matrix(n))
    true = ci @ ci.T
    se = np.sqrt((np.outer(np.diag(true), np.diag(true)) + true**2) / d)
    assert np.all(np.abs(emp - true) <= 5 * se), np.max(np.abs(emp - true) / se)
    # and it is not the identity's covariance (the test can tell correlated from independent)
    assert np.max(np.abs(emp - np.eye(n)) / se) > 20


def test_state_is_small_and_resumes_exactly():
    d = 1000
    g = CorrelatedNoise(BLT, d, np.float32)
    assert g.state_nbytes == 3 * d * 4
    assert CorrelatedNoise(BANDED, d, np.float64).state_nbytes == 3 * d * 8
    for t in range(5):
        g.next(seed=t)
    saved = g.state_dict()
    a = [g.next(seed=10 + t) for t in range(3)]
    h = CorrelatedNoise.from_state_dict(saved)
    b = [h.next(seed=10 + t) for t in range(3)]
    assert h.step == 8
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_bad_input_is_refused_and_changes_nothing():
    g = CorrelatedNoise(BANDED, 4, np.float64)
    g.next(seed=1)
    before = g.state_dict()
    with pytest.raises(ValueError, match="NaN"):
        g.next(sum=np.array([0.0, np.nan, 0.0, 0.0]))
    with pytest.raises(ValueError, match="values"):
        g.next(sum=np.zeros(3))
    with pytest.raises(ValueError):
        g.next(stddev=-1.0)
    with pytest.raises(ValueError):
        g.next(denominator=0.0)
    after = g.state_dict()
    assert after["step"] == before["step"] and np.array_equal(after["state"], before["state"])
    with pytest.raises(TypeError):
        CorrelatedNoise(BANDED, 4, np.int32)
    bad = dict(before, state=before["state"][:-1])
    with pytest.raises(ValueError, match="shape"):
        CorrelatedNoise.from_state_dict(bad)


def _query(z=1.0, strategy=BLT, steps=20):
    return MatrixFactorizationQuery(1.0, z, strategy=strategy, participation=Participation.cyclic(5), steps=steps)


def test_query_at_noise_zero_equals_the_gaussian_sum_query():
    rng = np.random.default_rng(0)
    q, ref = _query(z=0.0), GaussianSumQuery(1.0, 0.0)
    gs, rgs = q.initial_global_state(), ref.initial_global_state()
    for t in range(4):
        recs = [rng.normal(size=(8, 3, 2)), rng.normal(size=(8, 5))]
        st = q.accumulate_records(q.derive_sample_params(gs), q.initial_sample_state([r[0] for r in recs]), recs)
        rst = ref.accumulate_records(1.0, ref.initial_sample_state([r[0] for r in recs]), recs)
        out, gs, ev = q.get_noised_result(st, gs)
        rout, rgs, _ = ref.get_noised_result(rst, rgs)
        for a, b in zip(out, rout):
            np.testing.assert_array_equal(a, b)
        assert ev.mechanism == "matrix_factorization" and ev.stream == gs.stream and gs.step == t + 1


def test_query_noise_is_sigma_times_c_inverse_z_and_sensitivity_scaled():
    q = _query(z=2.0)
    sens = BLT.sensitivity(20, Participation.cyclic(5))
    gs = q.initial_global_state()
    assert gs.stddev == pytest.approx(2.0 * sens)
    d, n = 50_000, 6
    outs = []
    for t in range(n):
        st = q.initial_sample_state(np.zeros(d))
        out, gs, ev = q.get_noised_result(st, gs, seed=3)
        outs.append(out)
    w = np.stack(outs) / gs.stddev
    # the release's noise is correlated as C⁻¹: C·w is white (unit variance, uncorrelated steps)
    white = BLT.matrix(n) @ w
    cov = white @ white.T / d
    assert np.all(np.abs(cov - np.eye(n)) < 5 * np.sqrt(2 / d))


def test_stale_global_state_is_refused_and_nested_queries_work():
    q = _query()
    gs0 = q.initial_global_state()
    st = q.initial_sample_state(np.zeros(3))
    _, gs1, _ = q.get_noised_result(st, gs0)
    with pytest.raises(ValueError, match="stale"):
        q.get_noised_result(st, gs0)
    _, gs2, ev = q.get_noised_result(st, gs1)
    assert gs2.step == 2 and ev.stream == gs1.stream
    nested = NestedQuery({"grad": _query(), "count": dpcore.CountQuery(5.0)})
    ngs = nested.initial_global_state()
    tmpl = {"grad": np.zeros(4), "count": np.zeros(())}
    recs = {"grad": np.ones((3, 4)), "count": np.ones(3)}
    for _ in range(3):
        nst = nested.accumulate_records(nested.derive_sample_params(ngs), nested.initial_sample_state(tmpl), recs)
        out, ngs, nev = nested.get_noised_result(nst, ngs)
    mechs = sorted(t.mechanism for t in nev.privacy_tuples())
    assert mechs == ["gaussian", "matrix_factorization"]


def test_scaled_sensitivity_keeps_the_mechanism_and_stream():
    """A microbatched MF step stays an MF step in the ledger (not independent Gaussian noise)."""
    from dpcore.queries import scale_sensitivity

    q = _query()
    _, gs, ev = q.get_noised_result(q.initial_sample_state(np.zeros(2)), q.initial_global_state())
    scaled = scale_sensitivity(ev, 2.0)
    assert scaled.l2_norm_clip == 2.0 * ev.l2_norm_clip
    assert (scaled.mechanism, scaled.stream, scaled.declaration) == (ev.mechanism, ev.stream, ev.declaration)


def test_the_recorded_noise_multiplier_is_never_below_the_one_asked_for():
    from dpcore.matrix_factorization import StreamDeclaration

    for z in (0.5, 1.0, 1.7, 3.3):
        q = _query(z=z)
        _, _, ev = q.get_noised_result(q.initial_sample_state(np.zeros(2)), q.initial_global_state())
        sens = StreamDeclaration.from_json(ev.declaration).sensitivity(20)
        assert ev.stddev / (ev.l2_norm_clip * sens) >= z


@pytest.mark.parametrize("strategy", [BLT, BANDED], ids=["blt", "banded"])
def test_draw_ahead_then_commit_equals_the_fused_step(strategy):
    """draw() computes w_t from the released steps' state without changing it; commit() then
    advances the state: the same noise and state as next()."""
    d = 3000
    fused, split = CorrelatedNoise(strategy, d, np.float64), CorrelatedNoise(strategy, d, np.float64)
    for t in range(6):
        a = fused.next(seed=50 + t)
        before = split.state_dict()
        w = split.draw(seed=50 + t)
        mid = split.state_dict()
        assert mid["step"] == t and np.array_equal(mid["state"], before["state"])
        if t == 2:  # a redraw replaces the pending draw; only the last one is committed
            w = split.draw(seed=50 + t)
        split.commit()
        assert np.array_equal(a, w)
        assert np.array_equal(fused.state_dict()["state"], split.state_dict()["state"])
    with pytest.raises(ValueError, match="not drawn"):
        split.commit()
    split.draw(seed=1)
    fused.next(seed=2)
    saved = split.state_dict()  # a pending draw is not part of the state
    assert saved["step"] == 6
