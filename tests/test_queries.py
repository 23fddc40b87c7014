"""DP queries (McMahan et al. 2018, §2–§4): lifecycle, joint clipping, nests, strategies."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpcore.queries.base import derive_seed
from dpcore.queries import (
    ComposedQueryEvent,
    CountQuery,
    DPQuery,
    GaussianAverageQuery,
    GaussianSumQuery,
    JointClipQuery,
    MicrobatchQuery,
    NestedQuery,
    NonPrivateQueryEvent,
    NoPrivacyQuery,
    QuantileAdaptiveClipQuery,
    ReleasePlan,
    SumQueryEvent,
    SumState,
    dimension_weighted_clip_norms,
    dimensionality_adjusted_noise,
    effective_noise_multiplier,
    flat_clip_norm,
    per_layer_clip_norms,
    proportional_noise,
)


def run(query: DPQuery, records, template, *, seed=None, gs=None):
    gs = query.initial_global_state() if gs is None else gs
    params = query.derive_sample_params(gs)
    state = query.initial_sample_state(template)
    state = query.accumulate_records(params, state, records)
    return query.get_noised_result(state, gs, seed=seed)


def np_clip_sum(parts, clip, scales=None):
    """Hand-written reference: joint clipping of record i over all parts (scaled by 1/α)."""
    parts = [np.asarray(p, np.float64).reshape(p.shape[0], int(np.prod(p.shape[1:]))) for p in parts]
    scales = scales or [1.0] * len(parts)
    norms = np.sqrt(sum(((p / a) ** 2).sum(axis=1) for p, a in zip(parts, scales)))
    f = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    return [(p * f[:, None]).sum(axis=0) for p in parts], norms


def sd_ok(x, sd, k=6.0):
    """The sample stddev of x is sd within k standard errors (SE of s/σ ≈ 1/sqrt(2N))."""
    s = float(np.sqrt(np.mean(np.square(x))))
    assert abs(s / sd - 1.0) < k / math.sqrt(2 * x.size), (s, sd)


# ----------------------------------------------------------------------------- joint clipping (§2)


def joint_records(b, rng):
    """The paper's example: ‖v1‖ ≤ 1, ‖v2‖ ≤ 100, and in each record one of them is zero."""
    v1 = rng.standard_normal((b, 50))
    v1 *= rng.uniform(0, 1, (b, 1)) / np.linalg.norm(v1, axis=1, keepdims=True)
    v2 = rng.standard_normal((b, 30))
    v2 *= rng.uniform(0, 100, (b, 1)) / np.linalg.norm(v2, axis=1, keepdims=True)
    first = rng.random(b) < 0.5
    v1[~first] = 0
    v2[first] = 0
    return v1, v2


def test_joint_clipping_paper_example_no_clipping_happens():
    rng = np.random.default_rng(1)
    v1, v2 = joint_records(400, rng)
    q = JointClipQuery([1.0, 100.0], 1.0, 0.0)
    (r1, r2), _, ev = run(q, [v1, v2], [v1[0], v2[0]])
    # ‖s(v; α)‖ ≤ 1 = S_g for every record: α_j π(s(v))_j = v_j, the sum is exact.
    np.testing.assert_allclose(r1, v1.sum(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r2, v2.sum(0), rtol=1e-12, atol=1e-10)
    assert ev == SumQueryEvent(1.0, 0.0)


def test_joint_clipping_clips_the_scaled_record():
    v1 = np.array([[0.6, 0.8, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    v2 = np.array([[0.0, 0.0], [300.0, 400.0], [0.0, 0.0]])
    q = JointClipQuery([1.0, 100.0], 1.0, 0.0)
    (r1, r2), _, _ = run(q, [v1, v2], [v1[0], v2[0]])
    ref, norms = np_clip_sum([v1, v2], 1.0, [1.0, 100.0])
    np.testing.assert_allclose(norms, [1.0, 5.0, 3.0])
    np.testing.assert_allclose(r1, ref[0], rtol=1e-12)
    np.testing.assert_allclose(r2, ref[1], rtol=1e-12)
    np.testing.assert_allclose(r2, [60.0, 80.0], rtol=1e-12)  # ‖v2‖ = 500 clipped to α_2·S_g = 100
    np.testing.assert_allclose(r1, [0.6 + 1.0, 0.8, 0.0], rtol=1e-12)


def test_joint_clipping_noise_is_alpha_j_sigma():
    # Part j gets N(0, (α_j σ_g)²): σ_g = 0.01 → 0.01 on v1 and 1.0 on v2, measured on an empty sample.
    d = 40_000
    q = JointClipQuery([1.0, 100.0], 1.0, 0.01)
    t = [np.zeros(d), np.zeros(d)]
    (n1, n2), _, ev = run(q, [np.zeros((0, d)), np.zeros((0, d))], t, seed=7)
    sd_ok(n1, 0.01)
    sd_ok(n2, 1.0)
    assert abs(np.corrcoef(n1, n2 / 100)[0, 1]) < 6 / math.sqrt(d)
    # The privacy tuple is (S_g, σ_g) whatever the scales (§2).
    assert ev == SumQueryEvent(1.0, 0.01)
    assert effective_noise_multiplier(ev.privacy_tuples()) == pytest.approx(0.01, rel=1e-14)


def test_release_plan_is_what_get_noised_result_does():
    # A caller that forms the clipped sum itself (dpcore.torch) must add exactly the noise, divide
    # by exactly the denominator and record exactly the event that get_noised_result would.
    d, b = 30_000, 5
    rng = np.random.default_rng(3)
    x = [rng.standard_normal((b, d)), rng.standard_normal((b, d)) * 40]
    t = [np.zeros(d), np.zeros(d)]
    for q in (
        GaussianSumQuery(2.0, 0.5),
        GaussianAverageQuery(2.0, 0.5, 8.0),
        JointClipQuery([1.0, 50.0], 2.0, 0.5, denominator=4.0),
    ):
        gs = q.initial_global_state()
        plan = q.release_plan(gs, 2)
        assert isinstance(plan, ReleasePlan)
        (r1, r2), _, ev = run(q, x, t, seed=11)
        assert plan.event == ev
        scales = plan.part_scales
        norms = np.sqrt(sum(np.sum((xi / a) ** 2, axis=1) for xi, a in zip(x, scales)))
        f = np.minimum(1.0, plan.l2_norm_clip / norms)
        for r, xi, sd in zip((r1, r2), x, plan.part_stddevs):
            noise = r * plan.denominator - f @ xi
            sd_ok(noise, sd)
    assert JointClipQuery([1.0, 50.0], 2.0, 0.5).release_plan(JointClipQuery([1.0, 50.0], 2.0, 0.5).initial_global_state(), 2).part_stddevs == (0.5, 25.0)
    with pytest.raises(ValueError, match="scales"):
        JointClipQuery([1.0, 50.0], 2.0, 0.5).release_plan(GaussianSumQuery(2.0, 0.5).initial_global_state(), 3)
    with pytest.raises(ValueError, match="num_parts"):
        GaussianSumQuery(2.0, 0.5).release_plan(GaussianSumQuery(2.0, 0.5).initial_global_state(), 0)
    nested = NestedQuery({"a": GaussianSumQuery(1.0, 1.0), "b": [CountQuery(2.0)]})
    assert [type(q) for q in nested.leaf_queries] == [GaussianSumQuery, CountQuery]


def test_joint_clipping_beats_one_group_on_the_example():
    # With one group (no scales) the clip S = 100 and noise 1 drown v1's signal; joint clipping
    # gives v1 noise 0.01 at the same privacy tuple ratio.
    rng = np.random.default_rng(3)
    v1, v2 = joint_records(200, rng)
    joint = JointClipQuery([1.0, 100.0], 1.0, 0.01)
    (r1, _), _, ej = run(joint, [v1, v2], [v1[0], v2[0]], seed=1)
    flat = GaussianSumQuery(100.0, 1.0)
    (f1, _), _, ef = run(flat, [v1, v2], [v1[0], v2[0]], seed=1)
    assert effective_noise_multiplier([ej]) == pytest.approx(effective_noise_multiplier([ef]))
    assert np.abs(r1 - v1.sum(0)).mean() < 0.05 < np.abs(f1 - v1.sum(0)).mean()


# ----------------------------------------------------------------------------- sum / average


def test_gaussian_sum_matches_numpy_and_dtype():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 4, 5)).astype(np.float32)
    r, gs, ev = run(GaussianSumQuery(2.0, 0.0), x, x[0])
    ref, _ = np_clip_sum([x], 2.0)
    assert r.dtype == np.float32 and r.shape == (4, 5)
    np.testing.assert_allclose(r.ravel(), ref[0], rtol=2e-6, atol=1e-5)
    assert ev == SumQueryEvent(2.0, 0.0) and gs.l2_norm_clip == 2.0


def test_gaussian_average_divides_sum_and_noise():
    x = np.ones((10, 3))
    q_sum, q_avg = GaussianSumQuery(10.0, 3.0), GaussianAverageQuery(10.0, 3.0, 4.0)
    a, _, ea = run(q_sum, x, x[0], seed=11)
    b, _, eb = run(q_avg, x, x[0], seed=11)
    np.testing.assert_allclose(b, a / 4.0, rtol=1e-12)
    assert ea == eb == SumQueryEvent(10.0, 3.0)  # dividing is post-processing


def test_noise_stddev_statistics_and_seed_reproducibility():
    d = 50_000
    q = GaussianSumQuery(1.0, 2.5)
    a, _, _ = run(q, np.zeros((0, d), np.float32), np.zeros(d, np.float32), seed=5)
    b, _, _ = run(q, np.zeros((0, d), np.float32), np.zeros(d, np.float32), seed=5)
    c, _, _ = run(q, np.zeros((0, d), np.float32), np.zeros(d, np.float32))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    sd_ok(a.astype(np.float64), 2.5)
    sd_ok(c.astype(np.float64), 2.5)


def test_accumulate_record_equals_batch_and_merge():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 3)) * 3
    q = GaussianSumQuery(1.5, 0.0)
    gs = q.initial_global_state()
    p = q.derive_sample_params(gs)
    s_batch = q.accumulate_records(p, q.initial_sample_state(x[0]), x)
    s_one = q.initial_sample_state(x[0])
    for row in x:
        s_one = q.accumulate_record(p, s_one, row)
    s_a = q.accumulate_records(p, q.initial_sample_state(x[0]), x[:3])
    s_b = q.accumulate_records(p, q.initial_sample_state(x[0]), x[3:])
    s_m = q.merge_sample_states(s_a, s_b)
    for s in (s_one, s_m):
        np.testing.assert_allclose(s.sums[0], s_batch.sums[0], rtol=1e-14)
    # States are never modified in place.
    assert np.all(q.initial_sample_state(x[0]).sums[0] == 0)
    np.testing.assert_allclose(q.merge_sample_states(s_a, s_b).sums[0], s_m.sums[0])


def test_count_and_no_privacy_queries():
    ind = np.array([1.0, 0.0, 1.0, 1.0])
    r, _, ev = run(CountQuery(0.0), ind, ind[0])
    assert float(r) == pytest.approx(3.0, rel=1e-6) and float(r) <= 3.0  # rounded to the safe side
    assert ev == SumQueryEvent(1.0, 0.0)
    x = np.arange(12.0).reshape(4, 3)
    r, _, ev = run(NoPrivacyQuery(), x, x[0])
    np.testing.assert_array_equal(r, x.sum(0))
    assert ev == NonPrivateQueryEvent() and not ev.is_private
    r, _, _ = run(NoPrivacyQuery(denominator=4.0), [x, ind], [x[0], ind[0]])
    np.testing.assert_allclose(r[0], x.mean(0))


# ----------------------------------------------------------------------------- NestedQuery


def test_nested_query_vs_numpy():
    rng = np.random.default_rng(4)
    b = 60
    conv = [rng.standard_normal((b, 3, 3)).astype(np.float32), rng.standard_normal((b, 3)).astype(np.float32)]
    dense = rng.standard_normal((b, 10)) * 5
    correct = (rng.random(b) < 0.7).astype(np.float64)
    queries = {
        "grads": [GaussianSumQuery(1.0, 0.0), GaussianAverageQuery(2.0, 0.0, 30.0)],
        "metrics": (CountQuery(0.0),),
    }
    records = {"grads": [conv, dense], "metrics": (correct,)}
    template = {"grads": [[a[0] for a in conv], dense[0]], "metrics": (correct[0],)}
    q = NestedQuery(queries)
    out, _, ev = run(q, records, template)
    ref_conv, _ = np_clip_sum(conv, 1.0)
    ref_dense, _ = np_clip_sum([dense], 2.0)
    assert isinstance(out["grads"], list) and isinstance(out["metrics"], tuple)
    np.testing.assert_allclose(out["grads"][0][0].ravel(), ref_conv[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["grads"][0][1], ref_conv[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["grads"][1], ref_dense[0] / 30.0, rtol=1e-12)
    assert float(out["metrics"][0]) == pytest.approx(correct.sum(), rel=1e-6)
    assert isinstance(ev, ComposedQueryEvent)
    assert ev.privacy_tuples() == (SumQueryEvent(1.0, 0.0), SumQueryEvent(2.0, 0.0), SumQueryEvent(1.0, 0.0))
    assert q.leaf_paths == ["grads/0", "grads/1", "metrics/0"]


def test_nested_noise_per_group_is_independent_and_correct():
    d = 30_000
    q = NestedQuery([GaussianSumQuery(1.0, 0.5), GaussianSumQuery(3.0, 2.0)])
    empty = [np.zeros((0, d)), np.zeros((0, d))]
    (a, b), _, ev = run(q, empty, [np.zeros(d), np.zeros(d)], seed=9)
    sd_ok(a, 0.5)
    sd_ok(b, 2.0)
    assert abs(np.corrcoef(a, b)[0, 1]) < 6 / math.sqrt(d)
    # Eq. (1): z = ((1/0.5)² + (3/2)²)^(-1/2) = 0.4.
    assert effective_noise_multiplier(ev.privacy_tuples()) == pytest.approx(0.4, rel=1e-14)


def test_nested_of_nested_and_metrics():
    inner = NestedQuery({"x": GaussianSumQuery(1.0, 1.0)})
    adaptive = QuantileAdaptiveClipQuery(1.0, 1.0, 0.5, 0.2, 10.0, 50.0)
    q = NestedQuery({"inner": inner, "ad": adaptive})
    x = np.ones((5, 2))
    out, gs, ev = run(q, {"inner": {"x": x}, "ad": x}, {"inner": {"x": x[0]}, "ad": x[0]}, seed=1)
    assert set(out) == {"inner", "ad"} and set(out["inner"]) == {"x"}
    m = q.derive_metrics(gs)
    assert set(m) == {"ad/l2_norm_clip", "ad/unclipped_fraction"}
    assert len(ev.privacy_tuples()) == 3
    # a query alone in a NestedQuery keeps its metrics' names (TF Privacy's nested query test)
    alone = NestedQuery(adaptive)
    own = adaptive.derive_metrics(adaptive.initial_global_state())
    assert own and alone.derive_metrics(alone.initial_global_state()) == own


def test_nested_structure_errors():
    q = NestedQuery({"a": GaussianSumQuery(1.0, 1.0), "b": [GaussianSumQuery(1.0, 1.0)]})
    gs = q.initial_global_state()
    p = q.derive_sample_params(gs)
    t = {"a": np.zeros(2), "b": [np.zeros(2)]}
    s = q.initial_sample_state(t)
    with pytest.raises(ValueError, match="keys differ"):
        q.accumulate_records(p, s, {"a": np.zeros((1, 2))})
    with pytest.raises(TypeError, match="expected a list"):
        q.accumulate_records(p, s, {"a": np.zeros((1, 2)), "b": np.zeros((1, 2))})
    with pytest.raises(ValueError, match="1 entries but"):
        NestedQuery([GaussianSumQuery(1.0, 1.0), GaussianSumQuery(1.0, 1.0)]).initial_sample_state([np.zeros(1)])
    with pytest.raises(ValueError, match="shape"):
        q.accumulate_records(p, s, {"a": np.zeros((1, 3)), "b": [np.zeros((1, 2))]})
    with pytest.raises(TypeError, match="DPQuery"):
        NestedQuery({"a": 1.0})
    with pytest.raises(ValueError, match="empty"):
        NestedQuery({})
    with pytest.raises(TypeError, match="from this NestedQuery"):
        q.get_noised_result(s.leaves[0], gs)


def _leaf_alone(q, records, template, gs, seed):
    params = q.derive_sample_params(gs)
    st = q.accumulate_records(params, q.initial_sample_state(template), records)
    return st, q.get_noised_result(st, gs, seed=seed)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(0, 9),
    widths=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
    f64=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_nested_one_call_equals_each_leaf_alone(b, widths, f64, seed):
    """The fused clip (one core call for all Gaussian leaves) gives each leaf's own bits."""
    rng = np.random.default_rng(seed)
    dt = np.float64 if f64 else np.float32
    kinds = [
        lambda: GaussianSumQuery(float(rng.uniform(0.1, 30)), 0.0),
        lambda: GaussianAverageQuery(float(rng.uniform(0.1, 30)), 0.0, 7.0),
        lambda: JointClipQuery([0.5, 40.0], float(rng.uniform(0.1, 3)), 0.0),
        lambda: CountQuery(0.0),
        lambda: QuantileAdaptiveClipQuery(float(rng.uniform(0.1, 30)), 0.0, 0.5, 0.2, 10.0, 50.0),
    ]
    leaves, records, template = [], [], []
    for k, w in enumerate(widths):
        q = kinds[k % len(kinds)]()
        if isinstance(q, JointClipQuery):
            r = [(rng.standard_normal((b, w)) * 10).astype(dt), (rng.standard_normal((b, 2, 3)) * 50).astype(dt)]
            t = [x[0] if b else np.zeros(x.shape[1:], dt) for x in r]
        else:
            r = (rng.standard_normal((b, w)) * rng.uniform(0.01, 100)).astype(dt)
            t = np.zeros(w, dt)
        leaves.append(q)
        records.append(r)
        template.append(t)
    nest = NestedQuery(leaves)
    gs = nest.initial_global_state()
    params = nest.derive_sample_params(gs)
    state = nest.accumulate_records(params, nest.initial_sample_state(template), records)
    out, new_gs, ev = nest.get_noised_result(state, gs, seed=seed)
    alone_events = []
    for k, q in enumerate(leaves):
        # The adaptive leaf's count noise comes from the leaf's own seed, as NestedQuery splits it.
        leaf_seed = derive_seed(seed, 1_000_003, k)
        st_k, (out_k, gs_k, ev_k) = _leaf_alone(q, records[k], template[k], gs.leaves[k], leaf_seed)
        fused_k = state.leaves[k]
        assert all(np.array_equal(x, y) for x, y in zip(_sums(fused_k).sums, _sums(st_k).sums))
        assert _sums(fused_k).l2_norm_clip == _sums(st_k).l2_norm_clip
        assert getattr(fused_k, "centred_unclipped", None) == getattr(st_k, "centred_unclipped", None)
        for x, y in zip(out[k] if isinstance(out[k], list) else [out[k]], out_k if isinstance(out_k, list) else [out_k]):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)
        assert new_gs.leaves[k] == gs_k
        alone_events.append(ev_k)
    assert ev == ComposedQueryEvent(tuple(alone_events))


def _sums(state):
    return state if isinstance(state, SumState) else state.sums


def test_nested_fused_and_unfused_leaves_together():
    """Leaves that cannot join the one call (discrete, no privacy, microbatches) run on their
    own beside the fused ones, in their places in the result and the event."""
    rng = np.random.default_rng(2)
    b, d = 8, 40
    x = rng.standard_normal((b, d))
    leaves = {
        "g": GaussianSumQuery(1.0, 0.0),
        "plain": NoPrivacyQuery(),
        "disc": GaussianSumQuery(1.0, 1.0, mechanism="discrete_gaussian"),
        "micro": MicrobatchQuery(GaussianSumQuery(1.0, 0.0), 2),
        "h": GaussianSumQuery(0.5, 0.0),
    }
    q = NestedQuery(leaves)
    records = {k: x for k in leaves}
    out, _, ev = run(q, records, {k: x[0] for k in leaves}, seed=3)
    np.testing.assert_allclose(out["g"], np_clip_sum([x], 1.0)[0][0], rtol=1e-12)
    np.testing.assert_allclose(out["h"], np_clip_sum([x], 0.5)[0][0], rtol=1e-12)
    np.testing.assert_allclose(out["plain"], x.sum(axis=0), rtol=1e-12)
    kinds = [type(e).__name__ for e in ev.events]
    assert kinds == ["SumQueryEvent", "NonPrivateQueryEvent", "SumQueryEvent", "SumQueryEvent", "SumQueryEvent"]
    assert [e.mechanism for e in ev.events if isinstance(e, SumQueryEvent)] == ["gaussian", "discrete_gaussian", "gaussian", "gaussian"]
    assert not ev.is_private


def test_nested_one_call_refuses_bad_batches_and_keeps_states():
    q = NestedQuery({"a": GaussianSumQuery(1.0, 1.0), "b": GaussianSumQuery(2.0, 1.0)})
    gs = q.initial_global_state()
    p = q.derive_sample_params(gs)
    s = q.initial_sample_state({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match="records at b: 2 records, but 3 at a"):
        q.accumulate_records(p, s, {"a": np.ones((3, 3)), "b": np.ones((2, 4))})
    bad = np.ones((3, 4))
    bad[1, 2] = np.nan
    # A leaf built with on_nonfinite="raise" (debugging only) makes the one call raise, and no
    # leaf's state changes; the record's NaN is in group b, the raising leaf is a.
    qr = NestedQuery({"a": GaussianSumQuery(1.0, 1.0, on_nonfinite="raise"), "b": GaussianSumQuery(2.0, 1.0)})
    with pytest.raises(ValueError, match="record 1"):
        qr.accumulate_records(p, s, {"a": np.ones((3, 3)), "b": bad})
    assert all(not np.any(x.sums[0]) for x in s.leaves)
    # By default the record adds zero to every group (not only to b): the sums of the other two
    z = q.accumulate_records(p, s, {"a": np.ones((3, 3)), "b": bad})
    np.testing.assert_allclose(z.leaves[0].sums[0], np.full(3, 2 / math.sqrt(3)), rtol=1e-12)
    np.testing.assert_allclose(z.leaves[1].sums[0], np.full(4, 2.0), rtol=1e-12)
    assert all(not np.any(x.sums[0]) for x in s.leaves)
    s2 = q.accumulate_records(p, s, {"a": np.ones((3, 3)), "b": np.ones((3, 4))})
    np.testing.assert_allclose(s2.leaves[0].sums[0], np.full(3, math.sqrt(3)), rtol=1e-12)
    np.testing.assert_allclose(s2.leaves[1].sums[0], np.full(4, 3.0), rtol=1e-12)


# ----------------------------------------------------------------------------- adaptive clipping


def test_adaptive_clip_event_has_both_queries_and_total_z():
    q = QuantileAdaptiveClipQuery(2.0, 1.2, 0.5, 0.2, 5.0, 100.0)
    x = np.random.default_rng(0).standard_normal((100, 8))
    _, gs, ev = run(q, x, x[0])
    tuples = ev.privacy_tuples()
    assert tuples[1] == SumQueryEvent(0.5, 5.0)
    assert tuples[0].l2_norm_clip == 2.0
    assert tuples[0].stddev == pytest.approx(q.sum_noise_multiplier * 2.0)
    # Andrew et al. Theorem 1: the two queries together have the requested z (Eq. (1)).
    assert effective_noise_multiplier(tuples) == pytest.approx(1.2, rel=1e-12)


def test_adaptive_clip_tracks_the_quantile():
    rng = np.random.default_rng(6)
    norms_scale = 4.0
    q = QuantileAdaptiveClipQuery(0.1, 1.0, 0.5, 0.3, 10.0, 200.0)
    gs = q.initial_global_state()
    for t in range(200):
        x = rng.standard_normal((200, 16)) * norms_scale / 4.0
        _, gs, _ = q.get_noised_result(
            q.accumulate_records(q.derive_sample_params(gs), q.initial_sample_state(x[0]), x), gs, seed=t
        )
    median = np.median(np.linalg.norm(rng.standard_normal((100_000, 16)), axis=1)) * norms_scale / 4.0
    assert gs.l2_norm_clip == pytest.approx(median, rel=0.25)


def test_adaptive_clip_release_uses_the_clip_it_accumulated_with():
    q = QuantileAdaptiveClipQuery(1.0, 1.0, 0.5, 0.2, 10.0, 10.0)
    gs = q.initial_global_state()
    x = np.ones((10, 4))
    st = q.accumulate_records(0.25, q.initial_sample_state(x[0]), x)  # a caller bug: another clip
    _, _, ev = q.get_noised_result(st, gs)
    assert ev.privacy_tuples()[0].l2_norm_clip == 0.25  # the bound actually used is reported


def test_adaptive_clip_counts_a_non_finite_record_as_clipped():
    # norm > C, never a NaN in the count: the record adds zero to the sum and b_i = 0
    q = QuantileAdaptiveClipQuery(1.0, 0.0, 0.5, 0.2, 5.0, 10.0)
    gs = q.initial_global_state()
    st0 = q.initial_sample_state(np.zeros(2))
    recs = np.array([[0.1, 0.0], [np.nan, 0.0], [np.inf, 1.0], [5.0, 0.0]])
    st = q.accumulate_records(q.derive_sample_params(gs), st0, recs)
    assert st.centred_unclipped == 1.0 - 0.5 * 4
    np.testing.assert_allclose(st.sums.sums[0], [1.1, 0.0], rtol=1e-12)
    # the same count from norms formed by the caller (the framework adapters' path)
    ns = q.accumulate_norms(1.0, q.initial_norm_state(), np.array([0.1, np.nan, np.inf, 5.0]))
    assert ns == st.centred_unclipped
    # inside a nest (the one fused call) alike
    n = NestedQuery([q])
    nst = n.accumulate_records(n.derive_sample_params(n.initial_global_state()), n.initial_sample_state([np.zeros(2)]), [recs])
    assert nst.leaves[0].centred_unclipped == st.centred_unclipped
    with pytest.raises(ValueError, match="record 1"):
        qr = QuantileAdaptiveClipQuery(1.0, 0.0, 0.5, 0.2, 5.0, 10.0, on_nonfinite="raise")
        qr.accumulate_records(1.0, qr.initial_sample_state(np.zeros(2)), recs)
    assert qr.on_nonfinite == "raise" and q.on_nonfinite == "zero"


def test_adaptive_clip_bad_parameters():
    with pytest.raises(ValueError, match="clipped_count_stddev must be >"):
        QuantileAdaptiveClipQuery(1.0, 1.0, 0.5, 0.2, 0.5, 10.0)
    with pytest.raises(ValueError, match="target_unclipped_quantile"):
        QuantileAdaptiveClipQuery(1.0, 1.0, 1.5, 0.2, 5.0, 10.0)
    with pytest.raises(ValueError, match="expected_num_records"):
        QuantileAdaptiveClipQuery(1.0, 1.0, 0.5, 0.2, 5.0, 0.0)
    with pytest.raises(TypeError, match="learning_rate"):
        QuantileAdaptiveClipQuery(1.0, 1.0, 0.5, "0.2", 5.0, 10.0)
    with pytest.raises(ValueError, match="initial_l2_norm_clip"):
        QuantileAdaptiveClipQuery(float("nan"), 1.0, 0.5, 0.2, 5.0, 10.0)


# ----------------------------------------------------------------------------- microbatches


def test_microbatch_averages_and_doubles_sensitivity():
    x = np.arange(10.0).reshape(5, 2) / 100
    q = MicrobatchQuery(GaussianSumQuery(1.0, 2.0), 2)
    st = q.accumulate_records(1.0, q.initial_sample_state(x[0]), x)
    means = np.stack([x[0:2].mean(0), x[2:4].mean(0), x[4:5].mean(0)])  # ragged last microbatch
    np.testing.assert_allclose(st.sums[0], means.sum(0), rtol=1e-12)
    _, _, ev = q.get_noised_result(st, q.initial_global_state())
    assert ev == SumQueryEvent(2.0, 2.0)  # survey §5.6: sensitivity 2C per example
    assert effective_noise_multiplier([ev]) == pytest.approx(1.0)
    q1 = MicrobatchQuery(GaussianSumQuery(1.0, 2.0), 1)
    assert q1.get_noised_result(st, q1.initial_global_state())[2] == SumQueryEvent(1.0, 2.0)
    qm = MicrobatchQuery(GaussianSumQuery(1.0, 2.0), 4, example_level_privacy=False)
    assert qm.get_noised_result(st, qm.initial_global_state())[2] == SumQueryEvent(1.0, 2.0)


def test_microbatch_in_nest_doubles_every_tuple():
    q = MicrobatchQuery(NestedQuery([GaussianSumQuery(1.0, 1.0), CountQuery(3.0)]), 4)
    x = np.ones((8, 3), np.float32)
    _, _, ev = run(q, [x, np.ones(8)], [x[0], np.ones(())])
    assert ev.privacy_tuples() == (SumQueryEvent(2.0, 1.0), SumQueryEvent(2.0, 3.0))


def test_microbatch_bad_input():
    with pytest.raises(ValueError, match="microbatch_size"):
        MicrobatchQuery(GaussianSumQuery(1.0, 1.0), 0)
    with pytest.raises(TypeError, match="DPQuery"):
        MicrobatchQuery(object(), 2)  # type: ignore[arg-type]
    q = MicrobatchQuery(GaussianSumQuery(1.0, 1.0), 2)
    with pytest.raises(TypeError, match="float32 or float64"):
        q.accumulate_records(1.0, q.initial_sample_state(np.zeros(2)), np.ones((4, 2), np.int64))


# ----------------------------------------------------------------------------- bad input


def test_query_parameter_errors():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="l2_norm_clip"):
            GaussianSumQuery(bad, 1.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stddev"):
            GaussianSumQuery(1.0, bad)
    with pytest.raises(TypeError, match="l2_norm_clip"):
        GaussianSumQuery("1", 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stddev"):
        GaussianSumQuery(1.0, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="denominator"):
        GaussianAverageQuery(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="scales"):
        JointClipQuery([1.0, 0.0], 1.0, 1.0)
    with pytest.raises(ValueError, match="scales is empty"):
        JointClipQuery([], 1.0, 1.0)
    with pytest.raises(TypeError, match="scales"):
        JointClipQuery(2.0, 1.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="overflows"):
        JointClipQuery([1.0, 1e300], 1.0, 1e10)


def test_record_errors():
    q = GaussianSumQuery(1.0, 1.0)
    gs = q.initial_global_state()
    s = q.initial_sample_state(np.zeros(3))
    with pytest.raises(ValueError, match="record 1"):
        GaussianSumQuery(1.0, 1.0, on_nonfinite="raise").accumulate_records(
            1.0, s, np.array([[0.0, 0, 0], [np.nan, 0, 0]])
        )
    # the default: the non-finite record adds zero
    z = q.accumulate_records(1.0, s, np.array([[0.5, 0, 0], [np.nan, 0, 0]]))
    np.testing.assert_array_equal(z.sums[0], [0.5, 0.0, 0.0])
    with pytest.raises(TypeError, match="float32 or float64"):
        q.accumulate_records(1.0, s, np.ones((2, 3), np.int32))
    with pytest.raises(ValueError, match="shape"):
        q.accumulate_records(1.0, s, np.ones((2, 4)))
    with pytest.raises(ValueError, match="arrays"):
        q.accumulate_records(1.0, s, [np.ones((2, 3)), np.ones((2, 3))])
    with pytest.raises(ValueError, match="l2_norm_clip"):
        q.accumulate_records(0.0, s, np.ones((2, 3)))
    with pytest.raises(TypeError, match="sample_state"):
        q.accumulate_records(1.0, gs, np.ones((2, 3)))
    with pytest.raises(TypeError, match="global_state"):
        q.get_noised_result(s, s)
    with pytest.raises(TypeError, match="template"):
        q.initial_sample_state(np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="template is an empty"):
        q.initial_sample_state([])
    # Mixing clip bounds inside one sample is refused (the event could not report one S_g).
    s1 = q.accumulate_records(1.0, s, np.ones((1, 3)))
    with pytest.raises(ValueError, match="one bound"):
        q.accumulate_records(2.0, s1, np.ones((1, 3)))
    s2 = q.accumulate_records(2.0, s, np.ones((1, 3)))
    with pytest.raises(ValueError, match="different bounds"):
        q.merge_sample_states(s1, s2)
    j = JointClipQuery([1.0, 2.0], 1.0, 1.0)
    with pytest.raises(ValueError, match="scales"):
        j.initial_sample_state(np.zeros(3))
    with pytest.raises(ValueError, match="seed"):
        q.get_noised_result(s, gs, seed=-1)


def test_events_validate():
    for bad in ((0.0, 1.0), (-1.0, 1.0), (float("inf"), 1.0), (1.0, -0.1), (1.0, float("nan"))):
        with pytest.raises(ValueError):
            SumQueryEvent(*bad)
    with pytest.raises(TypeError):
        SumQueryEvent("1", 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ComposedQueryEvent((1.0,))
    with pytest.raises(AttributeError):
        SumQueryEvent(1.0, 1.0).stddev = 2.0  # type: ignore[misc]


# ----------------------------------------------------------------------------- strategies (§4)


def test_clip_norm_strategies():
    assert flat_clip_norm(3.0) == 3.0
    s = per_layer_clip_norms(3.0, 4)
    assert s == [1.5] * 4
    w = dimension_weighted_clip_norms(2.0, [10, 30, 60])
    np.testing.assert_allclose(w, [2.0 * math.sqrt(0.1), 2.0 * math.sqrt(0.3), 2.0 * math.sqrt(0.6)])
    assert math.fsum(x * x for x in w) == pytest.approx(4.0)  # the total bound S* is kept
    for f, args in ((per_layer_clip_norms, (1.0, 0)), (dimension_weighted_clip_norms, (1.0, [])),
                    (dimension_weighted_clip_norms, (1.0, [3, 0])), (flat_clip_norm, (-1.0,))):
        with pytest.raises(ValueError):
            f(*args)
    with pytest.raises(TypeError):
        dimension_weighted_clip_norms(1.0, [1.5])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        per_layer_clip_norms(1.0, 2.0)  # type: ignore[arg-type]


def test_noise_allocations_give_target_z():
    s = [1.0, 0.5, 4.0]
    d = [100, 20, 5000]
    p = proportional_noise(1.3, s)
    np.testing.assert_allclose(p, [1.3 * math.sqrt(3) * x for x in s])
    a = dimensionality_adjusted_noise(1.3, s, d)
    np.testing.assert_allclose(a, [1.3 * math.sqrt(sum(d) / dg) * sg for sg, dg in zip(s, d)])
    for sig in (p, a):
        assert effective_noise_multiplier(list(zip(s, sig))) == pytest.approx(1.3, rel=1e-14)
    with pytest.raises(ValueError, match="dims has 2"):
        dimensionality_adjusted_noise(1.0, s, [1, 2])
    with pytest.raises(ValueError, match="noise_multiplier"):
        proportional_noise(-1.0, s)


def test_effective_noise_multiplier_eq1():
    assert effective_noise_multiplier([(2.0, 3.0)]) == pytest.approx(1.5, rel=1e-15)
    assert effective_noise_multiplier([(1.0, 1.0)] * 4) == pytest.approx(0.5, rel=1e-15)
    assert effective_noise_multiplier([(1.0, 1.0), (1.0, 0.0)]) == 0.0
    # S/σ̃ underflows: the true z exceeds every float, the largest finite one is still a lower bound.
    assert effective_noise_multiplier([(1e-200, 1e200)]) == sys.float_info.max
    assert effective_noise_multiplier([(1e200, 1e-200)]) == 0.0
    with pytest.raises(ValueError, match="empty"):
        effective_noise_multiplier([])
    with pytest.raises(TypeError):
        effective_noise_multiplier([1.0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-6, 1e6), st.floats(1e-6, 1e6)), min_size=1, max_size=8))
def test_eq1_is_a_safe_lower_bound_of_z(tuples):
    z = effective_noise_multiplier(tuples)
    exact = 1.0 / math.sqrt(math.fsum((s / sd) ** 2 for s, sd in tuples))
    assert z <= exact and z == pytest.approx(exact, rel=1e-13)
    # Composition can only lower z: adding a group never increases it.
    assert effective_noise_multiplier(tuples + [(1.0, 1e6)]) <= z


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 12),
    st.integers(0, 12),
    st.integers(1, 5),
    st.floats(0.01, 10.0),
    st.integers(0, 2**32 - 1),
)
def test_merge_equals_union_and_clipped_norm_bound(b1, b2, d, clip, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b1 + b2, d)) * rng.uniform(0, 20)
    q = GaussianSumQuery(clip, 0.0)
    t = np.zeros(d)
    whole = q.accumulate_records(clip, q.initial_sample_state(t), x)
    parts = q.merge_sample_states(
        q.accumulate_records(clip, q.initial_sample_state(t), x[:b1]),
        q.accumulate_records(clip, q.initial_sample_state(t), x[b1:]),
    )
    np.testing.assert_allclose(parts.sums[0], whole.sums[0], rtol=1e-9, atol=1e-9)
    # Each record contributes at most S: the sum's norm is at most B·S.
    assert np.linalg.norm(whole.sums[0]) <= (b1 + b2) * clip * (1 + 1e-12)
    ref, _ = np_clip_sum([x], clip)
    np.testing.assert_allclose(whole.sums[0], ref[0], rtol=1e-9, atol=1e-9)
