"""The one-run audit (Steinke, Nasr & Jagielski 2023) at its default size: honest runs pass
with a positive lower bound, runs with 4× too little noise fail; and the bound's arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import scipy.stats

from dpcore import audit


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("z", [2.0, 3.0])
def test_honest_runs_pass_and_quarter_noise_fails(seed: int, z: float) -> None:
    honest = audit.one_run_audit(z, seed=seed)
    assert honest.passed and 0.0 < honest.epsilon_lower_bound < honest.epsilon_claimed
    assert honest.canaries == 20_000 and honest.steps == 10 and honest.seconds < 30
    broken = audit.one_run_audit(z, actual_noise_multiplier=z / 4, seed=seed)
    assert broken.epsilon_claimed == honest.epsilon_claimed  # the same claim ...
    assert not broken.passed and broken.epsilon_lower_bound > broken.epsilon_claimed  # ... caught


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


def test_bad_parameters() -> None:
    for kw in ({"steps": 0}, {"canaries": 5}, {"sampling_probability": 1.5}, {"delta": 0.0}, {"confidence": 1.0}):
        with pytest.raises(ValueError):
            audit.one_run_audit(2.0, **kw)
    with pytest.raises(ValueError):
        audit.one_run_audit(-1.0)


def test_cli_audit_json() -> None:
    res = subprocess.run([sys.executable, "-m", "dpcore", "audit", "-z", "3", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["passed"] is True and 0 < out["epsilon_lower_bound"] < out["epsilon_claimed"]
    bad = subprocess.run([sys.executable, "-m", "dpcore", "audit", "-z", "3", "--actual-noise-multiplier", "0.75"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 0 and "FAILED" in bad.stdout
