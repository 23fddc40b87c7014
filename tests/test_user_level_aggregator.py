"""User-level DP through the numpy PrivateAggregator (issue 40): records that are users (federated
averaging, examples/user_level_fedavg.py), the ledger's unit and bound, ε against the plan, and
the aggregator's refusals (nothing recorded)."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import numpy as np
import pytest

import dpcore
from dpcore import GaussianAverageQuery, PrivacyLedger, PrivateAggregator
from dpcore.plan import make_plan

HERE = os.path.join(os.path.dirname(__file__), "..", "examples")
DELTA = 1e-5


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ledger(tmp_path, unit="user", name="l.jsonl"):
    return PrivacyLedger(str(tmp_path / name), privacy_unit=unit)


def sample_entries(path):
    with open(path) as f:
        return [e for e in map(json.loads, f) if e.get("type") == "sample"]


def test_fedavg_example_epsilon_is_the_plans_at_user_level():
    r = load("user_level_fedavg").main(small=True)
    led = PrivacyLedger.load(r["ledger"])
    assert r["privacy_unit"] == led.privacy_unit == "user"
    n, q, z, k, rounds = r["users"], r["sampling_probability"], r["noise_multiplier"], r["examples_per_user"], r["rounds"]
    assert rounds == 15 == led.num_releases
    for s in sample_entries(r["ledger"]):
        assert (s["population_size"], s["sampling_probability"], s["policy"]) == (n, q, "poisson")
        assert s["examples_per_user"] == k
    # the plan of the same run (users are the records: ULS accounting over the user population)
    plan = make_plan(sampling_probability=q, noise_multiplier=z, steps=rounds, population_size=n, privacy_unit="user",
                     examples_per_user=k)
    eps = led.get_epsilon(DELTA)
    assert 0 < eps < math.inf
    assert eps == pytest.approx(plan.epsilon(DELTA), rel=1e-9)
    assert eps == pytest.approx(dpcore.accounting.epsilon(q, z, rounds, DELTA), rel=1e-9)
    if r["epsilon"] is not None:
        assert r["epsilon"] == pytest.approx(eps, rel=1e-12)
    rep = led.report(DELTA)
    assert rep.privacy_unit == "user"
    assert "at the user level" in rep.to_markdown()


def test_user_records_release_the_clipped_sum_and_record_the_bound(tmp_path):
    led = ledger(tmp_path)
    n, q, C = 30, 0.5, 0.4
    agg = PrivateAggregator(GaussianAverageQuery(C, 0.0, q * n), led, n, q, privacy_unit="user", examples_per_user=8)
    assert agg.privacy_unit == "user" and agg.examples_per_user == 8
    rng = np.random.default_rng(0)
    updates = rng.normal(size=(n, 4)) * 2  # one model update per user
    idx = agg.sample(seed=3)
    out = agg.aggregate(updates[idx])
    norms = np.linalg.norm(updates[idx], axis=1)
    ref = (updates[idx] * np.minimum(1.0, C / norms)[:, None]).sum(0) / (q * n)
    assert norms.max() > C
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-9)
    (s,) = sample_entries(led.path)
    assert (s["population_size"], s["sampling_probability"], s["policy"], s["seeded"]) == (n, q, "poisson", True)
    assert s["examples_per_user"] == 8
    # fixed-size draws record the bound too
    led2 = ledger(tmp_path, name="f.jsonl")
    agg2 = PrivateAggregator(GaussianAverageQuery(C, 1.0, 5), led2, n, sample_size=5,
                             sampler="fixed_size_without_replacement", privacy_unit="user", examples_per_user=2)
    idx = agg2.sample()
    assert len(idx) == 5
    agg2.aggregate(updates[idx])
    (s,) = sample_entries(led2.path)
    assert (s["policy"], s["sample_size"], s["examples_per_user"]) == ("fixed_size_without_replacement", 5, 2)


def test_backward_compatible_unit_from_the_ledger(tmp_path):
    q = GaussianAverageQuery(1.0, 1.0, 5.0)
    ex = PrivateAggregator(q, PrivacyLedger(str(tmp_path / "a.jsonl")), 10, 0.5)
    assert ex.privacy_unit == "example" and ex.examples_per_user is None
    us = PrivateAggregator(q, ledger(tmp_path, name="b.jsonl"), 10, 0.5)  # records are users: the ledger says so
    assert us.privacy_unit == "user"
    idx = us.sample(seed=1)
    us.aggregate(np.ones((len(idx), 3)))
    (s,) = sample_entries(str(tmp_path / "b.jsonl"))
    assert "examples_per_user" not in s or s["examples_per_user"] is None


@pytest.mark.parametrize("unit,kw,exc,match", [
    ("example", dict(privacy_unit="user"), ValueError, "privacy_unit='user'"),
    ("user", dict(privacy_unit="example"), ValueError, "mixing units"),
    ("example", dict(privacy_unit="person"), ValueError, "privacy_unit must be one of"),
    ("example", dict(examples_per_user=3), ValueError, "needs privacy_unit='user'"),
    ("example", dict(privacy_unit="example", examples_per_user=3), ValueError, "needs privacy_unit='user'"),
    ("user", dict(privacy_unit="user", examples_per_user=0), ValueError, "examples_per_user"),
    ("user", dict(privacy_unit="user", examples_per_user=2.5), TypeError, "examples_per_user"),
    ("user", dict(privacy_unit="user", examples_per_user=True), TypeError, "examples_per_user"),
])
def test_bad_unit_arguments_raise_before_anything_is_recorded(tmp_path, unit, kw, exc, match):
    led = ledger(tmp_path, unit)
    with open(led.path, "rb") as f:
        before = f.read()
    with pytest.raises(exc, match=match):
        PrivateAggregator(GaussianAverageQuery(1.0, 1.0, 5.0), led, 10, 0.5, **kw)
    with open(led.path, "rb") as f:
        assert f.read() == before


def test_examples_per_user_refused_with_a_sampler_object(tmp_path):
    from dpcore.sampling import TruncatedPoissonSampler

    led = ledger(tmp_path)
    s = TruncatedPoissonSampler(10, 0.5, 8, ledger=led)
    with pytest.raises(ValueError, match="sampler object records its own"):
        PrivateAggregator(GaussianAverageQuery(1.0, 1.0, 5.0), led, 10, sampler=s, privacy_unit="user",
                          examples_per_user=2)
    assert led.num_releases == 0 and not sample_entries(led.path)
