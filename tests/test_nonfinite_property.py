"""A record with a NaN or ±∞ value is a record with zero contribution (the default,
``on_nonfinite="zero"``): the clipped sum with the bad records equals, bit for bit, the clipped
sum with those records removed, whatever the positions, dtypes, groups or thread count.

Why this is the DP-safe behaviour: an error would make whether a step succeeds depend on one
record, which an adversary who plants a NaN record can observe (Cebere et al., PETS 2026).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dpcore
from dpcore import _core
from dpcore.queries import GaussianAverageQuery, GaussianSumQuery, JointClipQuery, MicrobatchQuery, NestedQuery

BAD = [np.nan, np.inf, -np.inf]


@st.composite
def batches_with_bad_records(draw, max_b=24):
    """Arrays of b records (float32/float64, various shapes) with NaN/±∞ at random places, and
    the indices of the records that hold one."""
    b = draw(st.integers(1, max_b))
    k = draw(st.integers(1, 3))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e6]))
    arrays = []
    for _ in range(k):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=2)))
        dt = draw(st.sampled_from([np.float32, np.float64]))
        seed = draw(st.integers(0, 2**32 - 1))
        arrays.append((np.random.default_rng(seed).standard_normal((b, *shape)) * scale).astype(dt))
    hits = draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, k - 1), st.integers(0, 10**6),
                                   st.sampled_from(BAD)), min_size=0, max_size=5))
    bad = set()
    for r, j, pos, v in hits:
        flat = arrays[j].reshape(b, -1)
        flat[r, pos % flat.shape[1]] = v
        bad.add(r)
    return arrays, sorted(bad)


def _keep(b, bad):
    return np.setdiff1d(np.arange(b), bad)


@settings(max_examples=150, deadline=None)
@given(batches_with_bad_records(), st.sampled_from([1e-3, 0.5, 7.0]))
def test_clip_sum_with_bad_records_equals_clip_sum_without_them(case, clip):
    arrays, bad = case
    keep = _keep(arrays[0].shape[0], bad)
    with_bad, norms = dpcore.clip_sum(arrays, clip)
    without, ref_norms = dpcore.clip_sum([a[keep] for a in arrays], clip)
    for x, y in zip(with_bad, without):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)  # bit for bit (no tolerance)
        assert x.tobytes() == y.tobytes()  # signed zeros included
    assert np.flatnonzero(np.isnan(norms)).tolist() == bad
    np.testing.assert_array_equal(norms[keep], ref_norms)
    if bad:
        with pytest.raises(ValueError, match=rf"record {bad[0]}\b"):
            dpcore.clip_sum(arrays, clip, on_nonfinite="raise")


@settings(max_examples=60, deadline=None)
@given(batches_with_bad_records(max_b=12), st.integers(0, 2**63))
def test_noised_and_discrete_releases_ignore_bad_records(case, seed):
    arrays, bad = case
    keep = _keep(arrays[0].shape[0], bad)
    for mech in ("gaussian", "discrete_gaussian"):
        a = dpcore.clip_noise(arrays, 1.0, 1.1, seed=seed, mechanism=mech)
        b = dpcore.clip_noise([x[keep] for x in arrays], 1.0, 1.1, seed=seed, mechanism=mech)
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


@settings(max_examples=60, deadline=None)
@given(batches_with_bad_records(max_b=16))
def test_grouped_clip_leaves_a_bad_record_out_of_every_group(case):
    arrays, bad = case
    b = arrays[0].shape[0]
    keep = _keep(b, bad)
    groups = list(range(len(arrays)))  # one group per array: a record bad in one is left out of all
    clips = [0.3 + g for g in groups]
    flat = [np.ascontiguousarray(a.reshape(b, -1)) for a in arrays]
    sums, norms = _core.clip_sum_groups(flat, groups, clips)
    ref, ref_norms = _core.clip_sum_groups([f[keep] for f in flat], groups, clips)
    for x, y in zip(sums, ref):
        assert x.tobytes() == y.tobytes()
    norms = norms.reshape(len(groups), b)
    assert all(np.flatnonzero(np.isnan(n)).tolist() == bad for n in norms)
    np.testing.assert_array_equal(norms[:, keep].ravel(), ref_norms)


def test_queries_give_bad_records_zero_contribution():
    rng = np.random.default_rng(2)
    a, c = rng.standard_normal((30, 4, 2)), rng.standard_normal((30, 5)).astype(np.float32)
    a[4, 1, 1], c[11, 3], c[29, 0] = np.nan, np.inf, np.nan
    keep = _keep(30, [4, 11, 29])
    tmpl = [np.zeros((4, 2)), np.zeros(5, np.float32)]

    def result(q, recs, template=tmpl):
        gs = q.initial_global_state()
        st_ = q.accumulate_records(q.derive_sample_params(gs), q.initial_sample_state(template), recs)
        return q.get_noised_result(st_, gs, seed=7)[0]

    queries = [
        GaussianSumQuery(1.0, 0.5),
        GaussianAverageQuery(1.0, 0.5, 12.0),
        JointClipQuery([1.0, 3.0], 1.0, 0.5),
        GaussianSumQuery(1.0, 0.5, mechanism="discrete_gaussian"),
    ]
    for q in queries:
        for x, y in zip(result(q, [a, c]), result(q, [a[keep], c[keep]])):
            assert x.tobytes() == y.tobytes(), q
    nq = NestedQuery({"a": GaussianSumQuery(1.0, 0.5), "c": GaussianAverageQuery(2.0, 0.5, 3.0)})
    got = result(nq, {"a": a, "c": c}, {"a": tmpl[0], "c": tmpl[1]})
    ref = result(nq, {"a": a[keep], "c": c[keep]}, {"a": tmpl[0], "c": tmpl[1]})
    for k in ("a", "c"):
        assert got[k].tobytes() == ref[k].tobytes()
    # microbatches: the NaN example's whole microbatch (examples 4, 5) is left out
    mq = MicrobatchQuery(GaussianSumQuery(1.0, 0.5), 2)
    mkeep = np.setdiff1d(np.arange(30), [4, 5, 10, 11, 28, 29])
    for x, y in zip(result(mq, [a, c]), result(mq, [a[mkeep], c[mkeep]])):
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("mechanism", ["gaussian", "discrete_gaussian"])
def test_same_bits_whatever_the_thread_count(mechanism):
    """Wide records (the owned-columns path with several threads, the tiled one with one), bad
    records in several tiles: the same bits at every thread count, equal to the batch without
    them."""
    code = (
        "import numpy as np, dpcore, hashlib;"
        "x = np.random.default_rng(0).standard_normal((300, 20000)).astype(np.float32);"
        "x[7, 5] = np.nan; x[150, 19999] = np.inf; x[299, 0] = -np.inf;"
        "keep = np.setdiff1d(np.arange(300), [7, 150, 299]);"
        f"o = dpcore.clip_noise(x, 1.0, 1.0, mechanism={mechanism!r}, seed=9);"
        f"r = dpcore.clip_noise(x[keep], 1.0, 1.0, mechanism={mechanism!r}, seed=9);"
        "s, n = dpcore.clip_sum(x, 1.0);"
        "print(hashlib.sha256(o.tobytes()).hexdigest(), hashlib.sha256(s.tobytes()).hexdigest(),"
        " np.flatnonzero(np.isnan(n)).tolist(), o.tobytes() == r.tobytes())"
    )
    outs = {
        t: subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "RAYON_NUM_THREADS": str(t)}, capture_output=True,
            text=True, check=True,
        ).stdout
        for t in (1, 2, 4)
    }
    assert len(set(outs.values())) == 1, outs
    assert outs[1].strip().endswith("[7, 150, 299] True"), outs[1]
