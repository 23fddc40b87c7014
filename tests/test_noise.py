"""Noise statistics at fixed seeds, seeding, determinism across thread counts, and fork safety."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

import dpcore


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("seed", [0, 1, 2**63 + 5])
def test_gaussian_noise_moments_and_ks(dt, seed):
    x = dpcore.gaussian_noise(400_000, 2.5, dtype=dt, seed=seed).astype(np.float64)
    n = x.size
    assert abs(x.mean()) < 5 * 2.5 / np.sqrt(n)
    assert abs(x.var() / 6.25 - 1) < 5 * np.sqrt(2 / n)
    assert abs(stats.kurtosis(x)) < 5 * np.sqrt(24 / n)
    assert stats.kstest(x / 2.5, "norm").pvalue > 1e-3
    # Tails at their true rate (the ziggurat's slow path): P(|Z| > 3.5) = 4.65e-4.
    p = 2 * stats.norm.sf(3.5)
    assert abs((np.abs(x) > 3.5 * 2.5).mean() - p) < 5 * np.sqrt(p / n)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_clip_noise_adds_noise_of_stddev_z_times_c(dt):
    x = np.zeros((10, 300_000), dt)
    out = dpcore.clip_noise(x, 0.7, 1.3, seed=5).astype(np.float64)
    assert abs(out.std() / (0.7 * 1.3) - 1) < 5 * np.sqrt(1 / (2 * out.size))
    assert stats.kstest(out / (0.7 * 1.3), "norm").pvalue > 1e-3


def test_seeded_calls_repeat_and_unseeded_calls_do_not():
    a = dpcore.gaussian_noise(1000, 1.0, seed=42)
    np.testing.assert_array_equal(a, dpcore.gaussian_noise(1000, 1.0, seed=42))
    assert not np.array_equal(a, dpcore.gaussian_noise(1000, 1.0, seed=43))
    u, v = dpcore.gaussian_noise(100_000, 1.0), dpcore.gaussian_noise(100_000, 1.0)
    assert not np.array_equal(u, v)


def test_independence_between_calls():
    n = 200_000
    for a, b in [
        (dpcore.gaussian_noise(n, 1.0), dpcore.gaussian_noise(n, 1.0)),
        (dpcore.gaussian_noise(n, 1.0, seed=1), dpcore.gaussian_noise(n, 1.0, seed=2)),
        (dpcore.clip_noise(np.zeros((0, n)), 1.0, 1.0), dpcore.clip_noise(np.zeros((0, n)), 1.0, 1.0)),
    ]:
        r = np.corrcoef(a, b)[0, 1]
        assert abs(r) < 5 / np.sqrt(n)
    # Within one call: consecutive values and values one stream-chunk apart are uncorrelated.
    x = dpcore.gaussian_noise(40 * 16384, 1.0, dtype=np.float64, seed=3)
    assert abs(np.corrcoef(x[:-1], x[1:])[0, 1]) < 5 / np.sqrt(x.size)
    assert abs(np.corrcoef(x[:-16384], x[16384:])[0, 1]) < 5 / np.sqrt(x.size)


def test_different_arrays_of_one_call_get_different_noise():
    z = np.zeros((0, 1000))
    a, b = dpcore.clip_noise([z, z], 1.0, 1.0, seed=8)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.2 and not np.array_equal(a, b)


SCRIPT = r"""
import hashlib, numpy as np, dpcore
rng = np.random.default_rng(0)
grads = [rng.standard_normal((96, 40_000)).astype(np.float32), rng.standard_normal((96, 300_000)).astype(np.float32), rng.standard_normal((96, 5))]
h = hashlib.sha256()
for a in dpcore.clip_noise(grads, 1.0, 1.1, denominator=50.0, seed=123):
    h.update(a.tobytes())
h.update(dpcore.clip_sum(grads, 0.5)[1].tobytes())
h.update(dpcore.gaussian_noise(3_000_001, 1.0, seed=9).tobytes())
h.update(dpcore.gaussian_noise(1_000_003, 1.0, dtype=np.float64, seed=9).tobytes())
h.update(dpcore.poisson_sample(10**6, 0.01, seed=3).tobytes())
print(h.hexdigest())
"""


def test_seed_determinism_across_thread_counts():
    digests = set()
    for threads in ("1", "2", "3"):
        env = dict(os.environ, RAYON_NUM_THREADS=threads)
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
def test_forked_child_does_not_replay_parent_noise():
    dpcore.gaussian_noise(10, 1.0)  # the parent has used the generator before forking
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        os.write(w, dpcore.gaussian_noise(64, 1.0, dtype=np.float64).tobytes())
        os._exit(0)
    os.close(w)
    child = b""
    while chunk := os.read(r, 4096):
        child += chunk
    os.waitpid(pid, 0)
    parent = dpcore.gaussian_noise(64, 1.0, dtype=np.float64).tobytes()
    assert len(child) == 512 and child != parent
