"""Samplers of the core: sizes, uniformity and determinism at fixed seeds."""

import numpy as np
from scipy import stats

import dpcore


def test_poisson_sample_size_and_uniformity():
    n, q = 100_000, 0.02
    sizes, hits = [], np.zeros(20)
    for s in range(40):
        idx = dpcore.poisson_sample(n, q, seed=s)
        assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < n
        sizes.append(idx.size)
        hits += np.bincount(idx * 20 // n, minlength=20)
    # Size ~ Binomial(n, q): mean of 40 sizes within 5 standard errors.
    assert abs(np.mean(sizes) - n * q) < 5 * np.sqrt(n * q * (1 - q) / 40)
    assert stats.chisquare(hits).pvalue > 1e-3


def test_poisson_sample_edges_and_seed():
    assert dpcore.poisson_sample(100, 0.0).size == 0
    np.testing.assert_array_equal(dpcore.poisson_sample(5, 1.0), np.arange(5))
    np.testing.assert_array_equal(dpcore.poisson_sample(1000, 0.3, seed=1), dpcore.poisson_sample(1000, 0.3, seed=1))


def test_fixed_size_sample_uniform():
    n, b = 50, 10
    counts = np.zeros(n)
    for s in range(2000):
        idx = dpcore.fixed_size_sample(n, b, seed=s)
        assert idx.size == b and np.unique(idx).size == b and np.all(np.diff(idx) > 0)
        counts[idx] += 1
    assert stats.chisquare(counts).pvalue > 1e-3
