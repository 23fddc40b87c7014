"""dpcore.clip_noise / clip_sum / record_norms: properties against a float64 numpy reference."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dpcore

DTYPES = [np.float32, np.float64]


def reference(arrays, clip):
    """Flat clipping in float64 (McMahan et al. 2018 §2), the unclipped norms, and Σ|f_i x_i|."""
    b = arrays[0].shape[0]
    flat = [np.asarray(a, np.float64).reshape(b, int(np.prod(a.shape[1:]))) for a in arrays]
    norms = np.sqrt(sum((f**2).sum(axis=1) for f in flat)) if b else np.zeros(0)
    with np.errstate(divide="ignore"):
        factors = np.minimum(1.0, clip / norms) if b else np.zeros(0)
    sums = [(factors[:, None] * f).sum(axis=0).reshape(a.shape[1:]) for f, a in zip(flat, arrays)]
    mags = [(factors[:, None] * np.abs(f)).sum(axis=0).reshape(a.shape[1:]) for f, a in zip(flat, arrays)]
    return sums, norms, mags


@st.composite
def batches(draw, max_b=12):
    b = draw(st.integers(0, max_b))
    k = draw(st.integers(1, 4))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 10.0, 1e6, 1e30]))
    arrays = []
    for _ in range(k):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        dt = draw(st.sampled_from(DTYPES))
        seed = draw(st.integers(0, 2**32 - 1))
        a = np.random.default_rng(seed).standard_normal((b, *shape)) * scale
        arrays.append(a.astype(dt))
    container = draw(st.sampled_from([list, tuple]))
    return container(arrays)


@given(batches(), st.sampled_from([1e-3, 0.5, 1.0, 7.0, 1e5]))
def test_zero_noise_equals_float64_reference(grads, clip):
    out = dpcore.clip_noise(grads, clip, 0.0)
    sums, _, mags = reference(grads, clip)
    assert type(out) is type(grads) and len(out) == len(grads)
    # The clip factor's documented safety margin (rust/clip.rs: 2·((D + 32)·2⁻⁵³ + u_out), u_out
    # the largest output unit roundoff), plus f64 accumulation and one rounding to the output
    # type; nothing looser.
    dim = sum(int(np.prod(g.shape[1:])) for g in grads)
    u_out = max(np.finfo(g.dtype).eps / 2 for g in grads)
    margin = 2 * ((dim + 32) * 2.0**-53 + u_out)
    for o, g, s, m in zip(out, grads, sums, mags):
        assert o.dtype == g.dtype and o.shape == g.shape[1:]
        tol = (margin + 2 * np.finfo(g.dtype).eps) * m + 1e-300
        assert np.all(np.abs(o.astype(np.float64) - s) <= tol)


@given(batches(max_b=6))
def test_norms_match_reference(grads):
    _, norms, _ = reference(grads, 1.0)
    got = dpcore.record_norms(grads)
    assert got.dtype == np.float64 and got.shape == (grads[0].shape[0],)
    np.testing.assert_allclose(got, norms, rtol=1e-12, atol=0)
    _, n2 = dpcore.clip_sum(grads, 1.0)
    np.testing.assert_array_equal(n2, got)


@given(
    st.integers(1, 3000),
    st.sampled_from(DTYPES),
    st.floats(1e-6, 1e6),
    st.floats(-8, 8),
    st.integers(0, 2**32 - 1),
)
def test_clipped_record_norm_never_exceeds_clip(d, dt, clip, log_scale, seed):
    x = (np.random.default_rng(seed).standard_normal((1, d)) * 10.0**log_scale).astype(dt)
    out, norms = dpcore.clip_sum(x, clip)
    # Exact norm of the returned (rounded) record: each square is exact in f64 for f32 values,
    # and math.fsum is correctly rounded.
    exact = math.sqrt(math.fsum(float(v) ** 2 for v in out.astype(np.float64)))
    assert exact <= clip
    if norms[0] <= clip * (1 - 1e-6):
        np.testing.assert_array_equal(out, x[0])  # unclipped records pass unchanged


def test_norm_bound_at_float32_rounding_edges():
    # Records whose clipped coordinates all round up in float32 are the worst case.
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.uniform(0.9, 1.1, size=(1, 1000)).astype(np.float32) * np.float32(3.3)
        out, _ = dpcore.clip_sum(x, 1.0)
        assert math.sqrt(math.fsum(float(v) ** 2 for v in out)) <= 1.0


def test_structure_single_array_list_tuple():
    a = np.ones((4, 2, 3), np.float32)
    b = np.ones((4,), np.float64)
    assert isinstance(dpcore.clip_noise(a, 1.0, 1.0), np.ndarray)
    out = dpcore.clip_noise([a, b], 1.0, 1.0)
    assert isinstance(out, list) and out[0].shape == (2, 3) and out[1].shape == ()
    assert out[0].dtype == np.float32 and out[1].dtype == np.float64
    out = dpcore.clip_noise((a,), 1.0, 1.0)
    assert isinstance(out, tuple) and len(out) == 1


def test_joint_clipping_scales_paper_example():
    # McMahan et al. 2018 §2: ‖v1‖ ≤ 1, ‖v2‖ ≤ 100, α = (1, 100), S = 1.
    v1 = np.array([[0.6, 0.8], [0.0, 0.0], [3.0, 4.0]])
    v2 = np.array([[0.0, 0.0], [60.0, 80.0], [0.0, 0.0]])
    s, norms = dpcore.clip_sum([v1, v2], 1.0, scales=[1.0, 100.0])
    np.testing.assert_allclose(norms, [1.0, 1.0, 5.0])
    np.testing.assert_allclose(s[0], [0.6 + 0.6, 0.8 + 0.8], rtol=1e-12)
    np.testing.assert_allclose(s[1], [60.0, 80.0], rtol=1e-12)
    # Noise: part j gets α_j·σ.
    z = np.zeros((0, 200_000))
    out = dpcore.clip_noise([z, z], 1.0, 0.01, scales=[1.0, 100.0], seed=3)
    assert abs(out[0].std() / 0.01 - 1) < 0.02 and abs(out[1].std() / 1.0 - 1) < 0.02


def test_denominator_divides_sum_and_noise():
    x = np.random.default_rng(1).standard_normal((50, 1000)).astype(np.float64)
    a = dpcore.clip_noise(x, 1.0, 1.0, seed=9)
    b = dpcore.clip_noise(x, 1.0, 1.0, denominator=25.0, seed=9)
    np.testing.assert_allclose(b, a / 25.0, rtol=1e-14)


def test_empty_batch_is_pure_noise():
    out = dpcore.clip_noise([np.zeros((0, 300, 100), np.float32), np.zeros((0, 7))], 2.0, 1.5, seed=4)
    assert out[0].shape == (300, 100) and out[0].dtype == np.float32 and out[1].shape == (7,)
    assert abs(out[0].std() / 3.0 - 1) < 0.02 and abs(out[0].mean()) < 0.05


def test_non_contiguous_and_negative_strides():
    rng = np.random.default_rng(2)
    base = rng.standard_normal((20, 30, 40)).astype(np.float32)
    views = [base[:, ::2, :], base[::-1], base.transpose(0, 2, 1), np.asfortranarray(base)]
    for v in views:
        got = dpcore.clip_noise(v, 2.0, 0.0)
        want = dpcore.clip_noise(np.ascontiguousarray(v), 2.0, 0.0)
        np.testing.assert_array_equal(got, want)
    big_endian = base.astype(">f4")
    np.testing.assert_array_equal(dpcore.clip_sum(big_endian, 1.0)[0], dpcore.clip_sum(base, 1.0)[0])


class ArrayLike:
    """An object exposing __array__, like a CPU torch tensor."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a


def test_non_numpy_inputs_are_converted():
    x = np.array([[3.0, 4.0], [0.0, 1.0]])
    np.testing.assert_allclose(dpcore.clip_noise(ArrayLike(x), 1.0, 0.0), [0.6, 0.8 + 1.0])
    # A list is always a list of arrays: here two arrays of two one-value records each.
    out = dpcore.clip_noise([[3.0, 4.0], [0.0, 1.0]], 1.0, 0.0)
    assert isinstance(out, list) and out[0].shape == ()


def test_huge_and_tiny_float64_records():
    x = np.array([[1e200, 1e200], [1e-200, 1e-200]])
    out, norms = dpcore.clip_sum(x, 1e-201)
    np.testing.assert_allclose(norms, [math.sqrt(2) * 1e200, math.sqrt(2) * 1e-200], rtol=1e-15)
    assert np.all(np.isfinite(out)) and np.linalg.norm(out) <= 2e-201


@pytest.mark.parametrize("dt", DTYPES)
def test_huge_and_subnormal_records_are_clipped_not_left_out(dt):
    # Finite records whose squares overflow (float64) or whose values are near the type's limits,
    # and subnormal ones: measured with scaling and clipped to <= C as before, never zeroed.
    info = np.finfo(dt)
    rows = [
        [1e30, -3e30, 0.0, 1.0],
        [float(info.max) / 4, float(info.max) / 4, -float(info.max) / 4, 0.0],
        [float(info.smallest_subnormal), -3 * float(info.smallest_subnormal), 0.0, 0.0],
        [float(info.tiny) / 2, 0.0, float(info.tiny), 0.0],
    ]
    x = np.array(rows, dt)
    for clip in (1e-3, 2.5):
        out, norms = dpcore.clip_sum(x, clip)
        assert np.isfinite(norms).all() and (norms > 0).all()
        for r in range(len(rows)):
            one, _ = dpcore.clip_sum(x[r : r + 1], clip)
            assert np.any(one != 0), f"record {r} was left out"
            assert math.sqrt(math.fsum(float(v) ** 2 for v in one.astype(np.float64))) <= clip
        assert np.isfinite(out).all()
    assert not np.isnan(dpcore.record_norms(x)).any()


@pytest.mark.parametrize("mechanism", ["gaussian", "discrete_gaussian"])
@pytest.mark.parametrize("dt", DTYPES)
def test_non_finite_records_add_exactly_zero(mechanism, dt):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((50, 7, 3)).astype(dt)
    b = rng.standard_normal((50, 11)).astype(dt) * 10
    a[3, 2, 1], b[17, 0], a[49, 0, 0], b[49, 10] = np.nan, np.inf, -np.inf, np.nan
    keep = np.setdiff1d(np.arange(50), [3, 17, 49])
    for z, seed in ((0.0, None), (1.3, 21)):
        with_bad = dpcore.clip_noise([a, b], 0.8, z, seed=seed, mechanism=mechanism, denominator=4.0)
        without = dpcore.clip_noise([a[keep], b[keep]], 0.8, z, seed=seed, mechanism=mechanism, denominator=4.0)
        for o, r in zip(with_bad, without):
            np.testing.assert_array_equal(o, r)
            assert np.isfinite(o).all()
    with pytest.raises(ValueError, match=r"record 3\b"):
        dpcore.clip_noise([a, b], 0.8, 1.0, mechanism=mechanism, on_nonfinite="raise")
