"""PrivateAggregator and the samplers' ledger events (McMahan et al. 2018, §1, §5, §6)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpcore.aggregator import PrivateAggregator
from dpcore.ledger import PrivacyLedger
from dpcore.queries import (
    CountQuery,
    GaussianAverageQuery,
    GaussianSumQuery,
    MicrobatchQuery,
    NestedQuery,
    QuantileAdaptiveClipQuery,
    SumQueryEvent,
)
from dpcore.sampling import fixed_size_sample, poisson_sample


@pytest.fixture
def ledger(tmp_path):
    led = PrivacyLedger(tmp_path / "ledger.jsonl")
    yield led
    led.close()


def test_training_loop_with_metrics(ledger):
    n, q = 2000, 0.05
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 20)).astype(np.float32)
    correct = (rng.random(n) < 0.8).astype(np.float32)
    query = NestedQuery(
        {"grad": GaussianAverageQuery(1.0, 1.0, q * n), "correct": CountQuery(5.0), "count": CountQuery(5.0)}
    )
    agg = PrivateAggregator(query, ledger, n, q)
    for _ in range(5):
        idx = agg.sample()
        out = agg.aggregate({"grad": x[idx], "correct": correct[idx], "count": np.ones(len(idx), np.float32)})
        assert out["grad"].shape == (20,) and out["grad"].dtype == np.float32
    loaded = PrivacyLedger.load(ledger.path)
    assert loaded.num_releases == 5
    for s in loaded.samples:
        assert (s.population_size, s.sampling_probability, s.policy) == (n, q, "poisson")
        assert s.queries == (SumQueryEvent(1.0, 1.0), SumQueryEvent(1.0, 5.0), SumQueryEvent(1.0, 5.0))


def test_accuracy_estimate_is_unbiased_in_aggregate(ledger):
    # The private accuracy (noised correct count / noised count) tracks the true one.
    n = 5000
    correct = np.zeros(n)
    correct[: int(0.7 * n)] = 1
    query = NestedQuery({"correct": CountQuery(2.0), "count": CountQuery(2.0)})
    agg = PrivateAggregator(query, ledger, n, 0.2)
    c = t = 0.0
    for s in range(5):
        idx = agg.sample(seed=s)
        out = agg.aggregate({"correct": correct[idx], "count": np.ones(len(idx))}, seed=100 + s)
        c += float(out["correct"])
        t += float(out["count"])
    assert c / t == pytest.approx(0.7, abs=0.02)


def test_fixed_size_policy_and_adaptive_clip(ledger):
    q = QuantileAdaptiveClipQuery(0.5, 1.0, 0.5, 0.5, 5.0, 50.0, denominator=50.0)
    agg = PrivateAggregator(q, ledger, 500, sample_size=50, sampler="fixed_size_without_replacement")
    x = np.random.default_rng(1).standard_normal((500, 10)) * 3
    clips = [agg.metrics()["l2_norm_clip"]]
    for _ in range(30):
        idx = agg.sample()
        assert len(idx) == 50
        agg.aggregate(x[idx])
        clips.append(agg.metrics()["l2_norm_clip"])
    assert clips[-1] > 4 * clips[0]  # grew towards the median norm (≈ 9.3)
    led = PrivacyLedger.load(ledger.path)
    assert all(s.policy == "fixed_size_without_replacement" and s.sample_size == 50 for s in led.samples)
    # Every step ledgers the clip it used, and both of the adaptive query's sum queries.
    for s, c in zip(led.samples, clips):
        assert s.queries[0].l2_norm_clip == c and s.queries[1] == SumQueryEvent(0.5, 5.0)
        assert s.noise_multiplier() == pytest.approx(1.0, rel=1e-9)


def test_microbatches_through_the_aggregator(ledger):
    q = MicrobatchQuery(GaussianSumQuery(1.0, 2.0), 4)
    agg = PrivateAggregator(q, ledger, 1000, 0.05)
    idx = agg.sample(seed=1)
    agg.aggregate(np.ones((len(idx), 3)))
    assert PrivacyLedger.load(ledger.path).samples[0].queries == (SumQueryEvent(2.0, 2.0),)


def test_aggregate_errors_release_nothing(ledger):
    agg = PrivateAggregator(GaussianSumQuery(1.0, 1.0), ledger, 100, 0.5)
    with pytest.raises(RuntimeError, match="sample"):
        agg.aggregate(np.ones((3, 2)))
    idx = agg.sample(seed=4)
    with pytest.raises(ValueError, match="records but the sample has"):
        agg.aggregate(np.ones((len(idx) + 1, 2)))
    with pytest.raises(TypeError, match="float32 or float64"):
        agg.aggregate(np.ones((len(idx), 2), np.int64))
    assert PrivacyLedger.load(ledger.path).samples == ()  # nothing was released
    agg.aggregate(np.ones((len(idx), 2)))  # the sample is still open for a correct call
    with pytest.raises(RuntimeError, match="sample"):
        agg.aggregate(np.ones((len(idx), 2)))  # but only once
    assert PrivacyLedger.load(ledger.path).num_releases == 1


def test_non_finite_record_adds_zero_or_raises_when_asked(tmp_path):
    """The default releases, and the NaN record adds exactly zero (as a zero record would);
    on_nonfinite="raise" (debugging only) raises naming the record and releases nothing."""
    outs = []
    for name, mode, bad_value in (("a", "zero", np.nan), ("b", "zero", None), ("c", "raise", np.inf)):
        led = PrivacyLedger(tmp_path / f"{name}.jsonl")
        agg = PrivateAggregator(GaussianSumQuery(1.0, 1.0), led, 100, 0.5, on_nonfinite=mode)
        assert agg.on_nonfinite == mode
        idx = agg.sample(seed=4)
        recs = np.full((len(idx), 2), 0.3)
        recs[len(idx) // 2] = 0.0 if bad_value is None else [bad_value, 1.0]  # b: a zero record
        if mode == "raise":
            with pytest.raises(ValueError, match=rf"record {len(idx) // 2}\b.*NaN or infinite"):
                agg.aggregate(recs, seed=9)
            assert PrivacyLedger.load(led.path).num_releases == 0
            recs[len(idx) // 2] = 0.0
        outs.append(agg.aggregate(recs, seed=9))
        assert PrivacyLedger.load(led.path).num_releases == 1
        led.close()
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="on_nonfinite"):
        PrivateAggregator(GaussianSumQuery(1.0, 1.0), PrivacyLedger(tmp_path / "d.jsonl"), 100, 0.5, on_nonfinite="drop")


def test_aggregator_bad_parameters(ledger):
    g = GaussianSumQuery(1.0, 1.0)
    cases = [
        ((object(), ledger, 10, 0.1), {}, TypeError, "query"),
        ((g, "ledger.jsonl", 10, 0.1), {}, TypeError, "ledger"),
        ((g, ledger, 0, 0.1), {}, ValueError, "population_size"),
        ((g, ledger, 10.0, 0.1), {}, TypeError, "population_size"),
        ((g, ledger, 10, 1.5), {}, ValueError, "sampling_probability"),
        ((g, ledger, 10, None), {}, ValueError, "needs sampling_probability"),
        ((g, ledger, 10, "0.1"), {}, TypeError, "sampling_probability"),
        ((g, ledger, 10, 0.1), {"sample_size": 2}, ValueError, "sample_size"),
        ((g, ledger, 10), {"sampler": "fixed_size_without_replacement"}, ValueError, "needs sample_size"),
        ((g, ledger, 10), {"sampler": "fixed_size_without_replacement", "sample_size": 11}, ValueError, "sample_size"),
        ((g, ledger, 10, 0.1), {"sampler": "shuffle"}, ValueError, r"record_sample\(\.\.\., policy='shuffle'\)"),
        ((g, ledger, 10, 0.1), {"sampler": "truncated_poisson"}, ValueError, "TruncatedPoissonSampler"),
        ((g, ledger, 10, 0.1), {"sampler": "bogus"}, ValueError, "sampler must be one of"),
    ]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            PrivateAggregator(*args, **kw)


def test_policy_is_a_deprecated_alias_of_sampler(ledger):
    with pytest.warns(DeprecationWarning, match="policy= is deprecated; it is called sampler= now"):
        agg = PrivateAggregator(GaussianSumQuery(1.0, 1.0), ledger, 10, sample_size=4,
                                policy="fixed_size_without_replacement")
    idx = agg.sample(seed=1)
    agg.aggregate(np.ones((len(idx), 2)), seed=2)
    assert len(idx) == 4 and ledger.samples[-1].policy == "fixed_size_without_replacement"
    with pytest.raises(TypeError, match="give sampler= only"):
        PrivateAggregator(GaussianSumQuery(1.0, 1.0), ledger, 10, 0.1, sampler="poisson", policy="poisson")


# ----------------------------------------------------------------------------- samplers


def test_poisson_sample_statistics_at_fixed_seeds():
    n, q, reps = 20_000, 0.01, 200
    sizes = []
    counts = np.zeros(20)
    for s in range(reps):
        idx = poisson_sample(n, q, seed=s)
        assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0) and (idx.size == 0 or 0 <= idx[0] and idx[-1] < n)
        sizes.append(idx.size)
        counts += np.bincount(idx * 20 // n, minlength=20)
    # Sizes: Binomial(n, q); the mean of 200 has sd sqrt(n q (1-q) / 200) ≈ 0.995.
    assert abs(np.mean(sizes) - n * q) < 5 * math.sqrt(n * q * (1 - q) / reps)
    assert np.var(sizes, ddof=1) == pytest.approx(n * q * (1 - q), rel=0.35)
    # Uniform position: chi-square over 20 bins.
    assert stats.chisquare(counts).pvalue > 1e-4
    # A seed reproduces the sample (tests only).
    np.testing.assert_array_equal(poisson_sample(n, q, seed=3), poisson_sample(n, q, seed=3))


def test_fixed_size_sample_statistics_at_fixed_seeds():
    n, b, reps = 50, 10, 3000
    hits = np.zeros(n)
    for s in range(reps):
        idx = fixed_size_sample(n, b, seed=s)
        assert idx.size == b and np.all(np.diff(idx) > 0)
        hits[idx] += 1
    # Each index is included with probability b/n.
    assert stats.chisquare(hits).pvalue > 1e-4
    assert hits.sum() == b * reps


def test_samplers_record_in_ledger(ledger):
    idx = poisson_sample(1000, 0.1, ledger=ledger)
    ledger.record_release(SumQueryEvent(1.0, 1.0))
    fixed_size_sample(1000, 30, seed=1, ledger=ledger)
    ledger.record_release(SumQueryEvent(1.0, 1.0))
    s0, s1 = PrivacyLedger.load(ledger.path).samples
    assert (s0.policy, s0.population_size, s0.sampling_probability, s0.seeded) == ("poisson", 1000, 0.1, False)
    assert (s1.policy, s1.sample_size, s1.sampling_probability, s1.seeded) == (
        "fixed_size_without_replacement", 30, 0.03, True)
    assert idx.size > 0


def test_sampler_bad_input_records_nothing(ledger):
    with pytest.raises(TypeError, match="ledger"):
        poisson_sample(10, 0.1, ledger="ledger.jsonl")
    with pytest.raises(ValueError, match="sampling_probability|q"):
        poisson_sample(10, 1.5, ledger=ledger)
    with pytest.raises(ValueError, match="n must be >= 1"):
        poisson_sample(0, 0.5, ledger=ledger)
    with pytest.raises(ValueError, match="sample_size|b"):
        fixed_size_sample(10, 11, ledger=ledger)
    with pytest.raises(TypeError, match="n must be an int"):
        fixed_size_sample(10.0, 1, ledger=ledger)
    with pytest.raises(Exception, match="no sample"):
        ledger.record_release(SumQueryEvent(1.0, 1.0))
    # Without a ledger the samplers behave as before.
    assert poisson_sample(0, 0.5).size == 0
    assert fixed_size_sample(3, 3).tolist() == [0, 1, 2]
