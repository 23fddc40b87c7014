"""One-run audits (:mod:`dpcore.audit`): the mechanism's fast path against the dense one, the
three analyses (Steinke, Nasr & Jagielski 2023; the f-DP analysis of Mahloujifar, Melis &
Chaudhuri 2025; the Gaussian-DP fit), honest runs passing and under-noised ones failing, the
command line's exit codes, and the audit of a real dpcore.torch training run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats

from dpcore import accounting, audit
from dpcore.audit import _one_run


# -- the mechanism's fast path ----------------------------------------------------------------


@pytest.mark.parametrize("m,c,z,ids", [(50, 1.0, 2.0, [1, 5, 7, 33]), (300, 0.7, 1.3, list(range(0, 300, 3))),
                                       (1000, 2.5, 0.5, [999]), (64, 1.0, 1.0, [])])
def test_fast_release_equals_clip_noise_on_dense_one_hot_records(m, c, z, ids) -> None:
    ids = np.array(ids, dtype=np.int64)
    fast = _one_run._release(ids, m, c, z, 1234)
    dense = _one_run._release_dense(ids, m, c, z, 1234)  # dpcore.clip_noise on (len(ids) × m) records
    assert np.array_equal(fast, dense)  # bit for bit: the same clipping and the same ChaCha20 noise
    assert 0.99 * c < _one_run._clipped_canary(c, m) <= c  # clipped from 2C to C (minus the core's margin)


def test_whole_audit_through_the_dense_path_is_the_same(monkeypatch) -> None:
    kw = dict(steps=4, sampling_probability=0.7, canaries=400, seed=9)
    fast = audit.one_run_audit(2.0, **kw)
    monkeypatch.setattr(_one_run, "_release", lambda ids, m, c, z, seed, value=None: _one_run._release_dense(ids, m, c, z, seed))
    dense = audit.one_run_audit(2.0, **kw)
    assert fast.guesses == dense.guesses and fast.gdp_fit == dense.gdp_fit


# -- the analyses -----------------------------------------------------------------------------


def test_p_value_against_a_direct_computation() -> None:
    m, r, v, eps, delta = 1000, 60, 45, 0.8, 1e-3
    p = 1 / (1 + math.exp(-eps))
    beta = scipy.stats.binom.sf(v - 1, r, p)
    alpha = max(
        sum(scipy.stats.binom.pmf(v - j, r, p) for j in range(1, i + 1)) / i for i in range(1, v + 1)
    )
    assert audit.p_value(m, r, v, eps, delta) == pytest.approx(beta + 2 * m * delta * alpha, rel=1e-9)
    assert audit.p_value(m, r, v, eps, 0.0) == pytest.approx(beta, rel=1e-9)


def test_lower_bound_is_monotone_and_consistent() -> None:
    m, r = 10_000, 1000
    bounds = [audit.epsilon_lower_bound(m, r, v, 1e-5, 0.95) for v in (500, 600, 800, 950, 1000)]
    assert bounds[0] == 0.0 and all(a <= b for a, b in zip(bounds, bounds[1:])) and bounds[-1] > 3
    e = bounds[2]
    assert audit.p_value(m, r, 800, e * 0.999, 1e-5) < 0.05 <= audit.p_value(m, r, 800, e * 1.001 + 1e-9, 1e-5)


def test_fdp_recursion_by_hand() -> None:
    # 10 guesses on 100 canaries, all right, at level 0.1, against f = 0 (no privacy) and
    # f(α) = 1 − α (perfect privacy): R = 0.1·10/100 = 0.01, H = 0; f(1 − R) = 0 stops at once
    # (0.01 < 0.1: not rejected); perfect privacy: H(9) = 0.01, R(9) = 0.01 + 9·0.01 = 0.1, then
    # H(8) = 0.1, ... R(0) + H(0) = 1 > 0.1: rejected.
    assert not audit.fdp_rejects(100, 10, 10, lambda a: 0.0, 0.1)
    assert audit.fdp_rejects(100, 10, 10, lambda a: 1.0 - a, 0.1)
    assert not audit.fdp_rejects(100, 10, 5, lambda a: 1.0 - a, 0.1)  # chance: nothing to refute
    # the curves
    f = audit.gaussian_tradeoff(1.0)
    assert f(0.05) == pytest.approx(scipy.stats.norm.cdf(scipy.stats.norm.ppf(0.95) - 1.0))
    g = audit.epsilon_delta_tradeoff(1.0, 0.01)
    assert g(0.1) == pytest.approx(max(0.0, 1 - 0.01 - math.e * 0.1, (1 - 0.01 - 0.1) / math.e))


@pytest.mark.parametrize("m", [1000, 20_000, 100_000])
def test_fdp_bound_is_at_least_steinkes_on_the_same_guesses(m: int) -> None:
    conf = 1 - 0.05 / 28  # what an audit of 100 000 canaries uses for each k and analysis
    for k in (100, 1000, 10_000, 100_000):
        if k > m:
            continue
        for frac in (0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0):
            v = int(round(frac * k))
            st = audit.steinke_epsilon_lower_bound(m, k, v, 1e-5, conf)
            gdp = audit.gdp_epsilon(audit.gdp_mu_lower_bound(m, k, v, conf), 1e-5)  # the bound at q = 1
            ed = audit.fdp_epsilon_lower_bound(m, k, v, 1e-5, conf)  # the (ε, δ) curves (q < 1)
            assert gdp >= st and ed >= st - 1e-6, (m, k, v, st, gdp, ed)
    # where Steinke's 2mδ term dominates (many canaries, every guess right), far above it
    st = audit.steinke_epsilon_lower_bound(100_000, 100_000, 100_000, 1e-5, conf)
    assert audit.fdp_epsilon_lower_bound(100_000, 100_000, 100_000, 1e-5, conf) > st + 4


def test_gdp_conversion_matches_the_accountant() -> None:
    mu = math.sqrt(10) / 1.898  # 10 full-batch steps at σ = 1.898: exactly μ-GDP
    eps = audit.gdp_epsilon(mu, 1e-5)
    assert audit.gdp_delta(mu, eps) == pytest.approx(1e-5, rel=1e-8)
    assert eps == pytest.approx(accounting.epsilon(1.0, 1.898, 10, 1e-5), abs=0.01)  # the PLD's ε ≈ 8
    assert audit.gdp_epsilon(0.0, 1e-5) == 0.0 and audit.gdp_epsilon(1e-6, 1e-5) == 0.0  # δ(0) ≤ δ already
    assert audit.gdp_delta(0.01, audit.gdp_epsilon(0.01, 1e-5)) == pytest.approx(1e-5, rel=1e-8)


def test_gaussian_scores_never_refute_their_own_mu() -> None:
    # Scores of an exact μ-GDP mechanism (in-canaries shifted by μ): the μ lower bound is below
    # μ every time (it may fail with probability ≤ 5% only), the fit scatters around μ.
    rng = np.random.default_rng(0)
    for mu, m in ((1.0, 1000), (3.0, 2000), (0.3, 10_000)):
        fits = []
        for _ in range(15):
            member = rng.random(m) < 0.5
            scores = rng.standard_normal(m) + mu * member
            a = audit.analyze_scores(scores, member, delta=1e-5, confidence=0.95, mu_claimed=mu)
            assert a["mu_lower_bound"] < mu and a["epsilon_lower_bound_fdp"] < audit.gdp_epsilon(mu, 1e-5)
            assert a["epsilon_lower_bound_steinke"] <= a["epsilon_lower_bound_fdp"]
            fits.append(a["gdp_fit"]["mu"])
        assert np.mean(fits) == pytest.approx(mu, rel=0.1)
    fit = audit.gdp_fit([0.0, 1.0, 2.0, 3.0], [False, False, True, True], 1e-5)
    assert fit["auroc"] == 1.0 and fit["tpr_at_fpr"]["0.01"] == 1.0


def test_guess_counts() -> None:
    assert audit.guess_counts(100_000) == [10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000]
    assert audit.guess_counts(25) == [10, 20, 24] and audit.guess_counts(10) == [10]


# -- audits of the mechanism --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("z", [2.0, 3.0])
def test_honest_runs_pass_and_quarter_noise_fails(seed: int, z: float) -> None:
    honest = audit.one_run_audit(z, seed=seed)
    assert honest.passed and 0.0 < honest.epsilon_lower_bound < honest.epsilon_claimed
    assert honest.fdp_curve == "epsilon_delta" and honest.mu_claimed is None  # q = 0.5: not a Gaussian claim
    assert honest.canaries == 100_000 and honest.steps == 10 and honest.seconds < 30
    broken = audit.one_run_audit(z, actual_noise_multiplier=z / 4, seed=seed)
    assert broken.epsilon_claimed == honest.epsilon_claimed  # the same claim ...
    assert not broken.passed and broken.epsilon_lower_bound > broken.epsilon_claimed  # ... caught


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_quarter_noise_refuted_at_epsilon_8_with_100k_canaries(seed: int) -> None:
    kw = dict(steps=10, sampling_probability=1.0, canaries=100_000, seed=seed)
    honest = audit.one_run_audit(1.898, **kw)
    assert honest.epsilon_claimed == pytest.approx(8.0, abs=0.01) and honest.mu_claimed == pytest.approx(math.sqrt(10) / 1.898)
    assert honest.passed and honest.fdp_curve == "gaussian" and honest.mu_lower_bound < honest.mu_claimed
    assert abs(honest.gdp_fit["mu"] - honest.mu_claimed) < 0.1  # the fit: an estimate, near the truth
    broken = audit.one_run_audit(1.898, actual_noise_multiplier=1.898 / 4, **kw)
    assert not broken.passed and broken.epsilon_lower_bound_fdp > 8.0 + 3  # refuted, by the f-DP analysis
    assert broken.mu_lower_bound > broken.mu_claimed
    assert broken.seconds < 15  # O(m) per release: seconds, not minutes


def test_bad_parameters() -> None:
    for kw in ({"steps": 0}, {"canaries": 5}, {"sampling_probability": 1.5}, {"delta": 0.0}, {"confidence": 1.0}):
        with pytest.raises(ValueError):
            audit.one_run_audit(2.0, **kw)
    with pytest.raises(ValueError):
        audit.one_run_audit(-1.0)
    with pytest.raises(ValueError):
        audit.fdp_rejects(10, 20, 5, lambda a: 1 - a, 0.05)  # k > m
    with pytest.raises(ValueError):
        audit.analyze_scores([1.0, float("nan")], [True, False], delta=1e-5, confidence=0.95)


def test_cli_audit_json_and_exit_codes() -> None:
    res = subprocess.run([sys.executable, "-m", "dpcore", "audit", "-z", "3", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["passed"] is True and out["exit_code"] == 0 and 0 < out["epsilon_lower_bound"] < out["epsilon_claimed"]
    assert out["epsilon_lower_bound"] == max(out["epsilon_lower_bound_steinke"], out["epsilon_lower_bound_fdp"])
    bad = subprocess.run([sys.executable, "-m", "dpcore", "audit", "-z", "3", "--actual-noise-multiplier", "0.75"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 3 and "FAILED" in bad.stdout and "Traceback" not in bad.stderr
    assert "Steinke" in bad.stdout and "f-DP" in bad.stdout and "Gaussian-DP fit" in bad.stdout


# -- a real dpcore.torch training run ------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_audits():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from dpcore.plan import calibrate_noise

    honest = {eps: audit.audit_torch_training(eps, canaries=10_000, steps=10, seed=eps) for eps in (1, 4, 8)}
    z = calibrate_noise(8.0, 1e-5, sampler="poisson", sampling_probability=1.0, steps=10)
    broken = audit.audit_torch_training(noise_multiplier=z, actual_noise_multiplier=z / 4, canaries=10_000, steps=10, seed=5)
    return honest, broken


def test_torch_gradient_canaries_honest_runs_pass(torch_audits) -> None:
    honest, _ = torch_audits
    for eps, r in honest.items():
        assert r.target == "torch" and r.canary_kind == "gradient" and r.fdp_curve == "gaussian"
        assert r.epsilon_claimed == pytest.approx(eps, abs=0.01)
        assert r.extra["epsilon_ledger"] == pytest.approx(r.epsilon_claimed, rel=1e-9)  # the run's own ledger
        assert r.passed and 0 < r.epsilon_lower_bound_steinke <= r.epsilon_lower_bound_fdp < r.epsilon_claimed
        assert r.mu_lower_bound < r.mu_claimed
        lo, hi = r.gdp_fit["mu_interval"]
        assert lo - 0.1 < r.mu_claimed < hi + 0.1  # the estimate: near the claim (the truth at q = 1)
        assert r.test_accuracy > 0.6
    assert honest[1].epsilon_lower_bound_fdp < honest[4].epsilon_lower_bound_fdp < honest[8].epsilon_lower_bound_fdp


def test_torch_gradient_canaries_catch_quarter_noise(torch_audits) -> None:
    _, broken = torch_audits
    assert broken.epsilon_claimed == pytest.approx(8.0, abs=0.01)
    assert not broken.passed and broken.epsilon_lower_bound_fdp > broken.epsilon_claimed
    assert broken.mu_lower_bound > broken.mu_claimed
    assert broken.extra["epsilon_ledger"] > 30  # the ledger states the noise that was really added


def test_torch_input_canaries_run_and_stay_below_the_claim() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    r = audit.audit_torch_training(8.0, kind="input", canaries=500, steps=10, seed=3)
    assert r.canary_kind == "input" and r.canaries == 500 and r.passed
    assert r.epsilon_lower_bound <= r.epsilon_claimed and 0.0 <= r.gdp_fit["auroc"] <= 1.0
    with pytest.raises(ValueError):
        audit.audit_torch_training(8.0, kind="weights")
    with pytest.raises(ValueError):
        audit.audit_torch_training(8.0, noise_multiplier=1.0)
