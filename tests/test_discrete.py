"""The discrete Gaussian mechanism (Canonne, Kamath & Steinke 2020): grid, noise law, exact sampler,
ledger and accounting."""

import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from scipy import stats

import dpcore
from dpcore import GaussianAverageQuery, GaussianSumQuery, PrivacyLedger
from dpcore.accounting import (
    DiscreteGaussianEvent,
    GaussianEvent,
    PldAccountant,
    PoissonSampledEvent,
    RdpAccountant,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)
from dpcore.accounting.base import UnsupportedEventError
from dpcore.accounting.rdp import rdp_poisson_subsampled_discrete_gaussian, rdp_poisson_subsampled_gaussian
from dpcore.ledger import LedgerWarning

DG = "discrete_gaussian"


def _on_grid(v, g):
    k = np.asarray(v, dtype=np.float64) / g
    return np.array_equal(k, np.round(k))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_is_float64_on_the_grid(dtype):
    x = np.random.default_rng(1).standard_normal((33, 7, 11)).astype(dtype)
    p = dpcore.discrete_gaussian_params(1.5, 0.8, 77)
    out = dpcore.clip_noise(x, 1.5, 0.8, mechanism=DG, seed=3)
    assert out.dtype == np.float64 and out.shape == (7, 11)
    assert _on_grid(out, p.granularity)
    assert math.log2(p.granularity).is_integer()
    # A user grid, and a list of arrays with joint-clipping scales: part j sits on γ·α_j.
    parts = [x.reshape(33, -1)[:, :40], x.reshape(33, -1)[:, 40:]]
    outs = dpcore.clip_noise(parts, 1.5, 0.8, mechanism=DG, granularity=2**-12, scales=[1.0, 4.0], seed=3)
    assert isinstance(outs, list) and _on_grid(outs[0], 2**-12) and _on_grid(outs[1], 4 * 2**-12)
    assert not _on_grid(outs[1], 2**-12 * 8)  # the noise really is at the part's own step


def test_rounded_sum_matches_numpy_at_zero_noise():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((50, 300)) * rng.uniform(0.01, 3, size=(50, 1))
    g = 2.0**-10
    out = dpcore.clip_noise(x, 1.0, 0.0, mechanism=DG, granularity=g)
    norms = np.linalg.norm(x, axis=1)
    f = np.minimum(1.0, 1.0 / norms)
    ref = np.round(x * f[:, None] / g).sum(axis=0) * g
    # Each record is rounded to its nearest grid point (the core's clip margin may move a value
    # across a rounding boundary, one step at most per record).
    assert np.max(np.abs(out - ref)) <= 50 * g
    assert np.mean(out == ref) > 0.9
    # Each rounded record's norm is within the recorded sensitivity.
    p = dpcore.discrete_gaussian_params(1.0, 0.0, 300, granularity=g)
    rounded = np.round(x * f[:, None] / g)
    assert (np.sum(rounded**2, axis=1) <= p.sens_sq).all()
    assert p.sensitivity >= math.sqrt(p.sens_sq) * g >= 1.0


def test_noise_variance_is_zc_squared():
    n = 200_000
    out = dpcore.clip_noise(np.zeros((0, n)), 2.0, 1.5, mechanism=DG, seed=11)
    var = float(np.mean(out**2))
    # (z·C)² = 9; relative standard error √(2/n) = 0.32%.
    assert abs(var / 9.0 - 1) < 0.015, var
    assert abs(float(np.mean(out))) < 5 * 3.0 / math.sqrt(n)


def test_sampler_matches_the_exact_pmf():
    # C = γ = 1 and z = 1.5 give N_Z(0, σ²) with σ² = 2.25 exactly (2.25·2^39 is an integer).
    n = 300_000
    y = dpcore.clip_noise(np.zeros((0, n)), 1.0, 1.5, mechanism=DG, granularity=1.0, seed=5)
    assert _on_grid(y, 1.0)
    ks = np.arange(-40, 41)
    pmf = np.exp(-(ks.astype(float) ** 2) / (2 * 2.25))
    pmf /= pmf.sum()
    cells = np.arange(-6, 7)
    observed = np.array([np.sum(y == k) for k in cells] + [np.sum(np.abs(y) > 6)])
    expected = np.array([pmf[ks == k][0] for k in cells] + [pmf[np.abs(ks) > 6].sum()]) * n
    chi2, p = stats.chisquare(observed, expected)
    assert p > 1e-3, (chi2, p)
    # A shifted law (σ² = 2.5) must be rejected by the same test: it has power.
    alt = np.exp(-(ks.astype(float) ** 2) / (2 * 2.5))
    alt /= alt.sum()
    alt_expected = np.array([alt[ks == k][0] for k in cells] + [alt[np.abs(ks) > 6].sum()]) * n
    assert stats.chisquare(observed, alt_expected)[1] < 1e-6


def test_same_bits_whatever_the_thread_count():
    code = (
        "import numpy as np, dpcore, hashlib;"
        "x = np.random.default_rng(0).standard_normal((300, 20000)).astype(np.float32);"
        "o = dpcore.clip_noise(x, 1.0, 1.0, mechanism='discrete_gaussian', seed=9);"
        "print(hashlib.sha256(o.tobytes()).hexdigest())"
    )
    outs = {
        t: subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "RAYON_NUM_THREADS": str(t)}, capture_output=True, text=True, check=True
        ).stdout
        for t in (1, 2, 3)
    }
    assert len(set(outs.values())) == 1, outs


def test_params_and_bad_inputs():
    p = dpcore.discrete_gaussian_params(1.0, 1.0, 10_000)
    assert 1.0 <= p.sensitivity <= 1.0 + 1.01e-4
    assert p.noise_multiplier <= 1.0 and p.stddev >= 1.0 - 1e-12
    s = dpcore.discrete_gaussian_params(1.0, 1.0, 10_000, rounding="sum", granularity=2**-10)
    assert s.sensitivity >= (1024 + 100) / 1024
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="granularity"):
        dpcore.clip_noise(x, 1.0, 1.0, mechanism=DG, granularity=-1.0)
    with pytest.raises(ValueError, match="granularity"):
        dpcore.clip_noise(x, 1.0, 1.0, mechanism=DG, granularity=1e-30)
    with pytest.raises(ValueError, match="granularity"):
        dpcore.clip_noise(x, 1.0, 1.0, granularity=0.5)
    with pytest.raises(ValueError, match="mechanism"):
        dpcore.clip_noise(x, 1.0, 1.0, mechanism="laplace")
    bad = x.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="record 1"):
        dpcore.clip_noise(bad, 1.0, 1.0, mechanism=DG, on_nonfinite="raise")
    with pytest.raises(ValueError, match="rounding"):
        dpcore.discrete_gaussian_params(1.0, 1.0, 4, rounding="up")


@pytest.mark.parametrize("q,z", [(0.001, 0.7), (0.01, 1.0), (0.1, 2.0), (0.5, 5.0), (1.0, 1.3)])
def test_discrete_rdp_bounds_the_gaussian_one(q, z):
    orders = np.array([1.5, 2, 2.5, 3, 4, 8, 16, 32, 64, 128])
    d = rdp_poisson_subsampled_discrete_gaussian(q, z, orders)
    g = rdp_poisson_subsampled_gaussian(q, z, orders)
    # The general Poisson bound can only be looser than the exact sampled-Gaussian one; at α = 2
    # they coincide (Zhu & Wang 2019, Theorem 6), and never beyond the unamplified α/(2z²).
    assert (d >= g * (1 - 1e-12)).all()
    assert d[1] == pytest.approx(g[1], rel=1e-9)
    assert (d <= orders / (2 * z * z) * (1 + 1e-8) + 1e-12).all() or q == 1.0


def test_accountants_read_the_discrete_event():
    ev = SelfComposedEvent(PoissonSampledEvent(0.01, DiscreteGaussianEvent(1.0)), 1000)
    eps_d = RdpAccountant().compose(ev).get_epsilon(1e-5)
    eps_g = RdpAccountant().compose(SelfComposedEvent(PoissonSampledEvent(0.01, GaussianEvent(1.0)), 1000)).get_epsilon(1e-5)
    assert eps_g < eps_d < 1.5 * eps_g
    assert not PldAccountant().supports(ev)
    with pytest.raises(UnsupportedEventError, match="discrete Gaussian"):
        PldAccountant().compose(ev)
    with pytest.raises(UnsupportedEventError, match="without replacement"):
        RdpAccountant(neighboring="replace_one").compose(SampledWithoutReplacementEvent(100, 10, DiscreteGaussianEvent(1.0)))
    assert json.loads(json.dumps(ev.to_dict())) == ev.to_dict()


def test_query_ledger_and_epsilon(tmp_path):
    x = np.random.default_rng(2).standard_normal((64, 30)).astype(np.float32)
    q = GaussianAverageQuery(1.0, 1.2, 64.0, mechanism=DG)
    path = str(tmp_path / "l.jsonl")
    led = PrivacyLedger(path)
    for step in range(5):
        led.record_sample(1000, 0.064)
        gs = q.initial_global_state()
        st = q.accumulate_records(q.derive_sample_params(gs), q.initial_sample_state(x[0]), x)
        res, _, ev = q.get_noised_result(st, gs, seed=step)
        assert ev.mechanism == DG and ev.l2_norm_clip > 1.0 and ev.stddev >= 1.2
        p = dpcore.discrete_gaussian_params(1.0, 1.2, 30)
        assert res.dtype == np.float64 and _on_grid(res * 64.0, p.granularity)
        led.record_release(ev)
    led.close()
    lines = [json.loads(s) for s in open(path)]
    sums = [e for e in lines if e.get("type") == "sum_query"]
    assert len(sums) == 5 and all(e["mechanism"] == DG for e in sums)
    with pytest.warns(LedgerWarning, match="DiscreteGaussianEvent"):
        eps = PrivacyLedger(path).get_epsilon(1e-5)
    z = ev.stddev / ev.l2_norm_clip
    want = RdpAccountant().compose(SelfComposedEvent(PoissonSampledEvent(0.064, DiscreteGaussianEvent(z)), 5)).get_epsilon(1e-5)
    assert eps == pytest.approx(want, rel=1e-12)
    assert eps >= PrivacyLedger(path).get_epsilon(1e-5, accountant="rdp") * (1 - 1e-12)
    # A Gaussian query beside it keeps its format, and nested queries compose the two by Eq. (1).
    g = GaussianSumQuery(1.0, 1.0)
    gs = g.initial_global_state()
    _, _, gev = g.get_noised_result(g.accumulate_records(1.0, g.initial_sample_state(x[0]), x), gs, seed=1)
    assert gev.mechanism == "gaussian"
