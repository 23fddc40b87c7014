"""User-level accounting (issue 40, the accounting half): example-level sampling with a user-level
guarantee (ELS) accounted as a mixture of Gaussians by PLD, user-level sampling (ULS) as the
example-level analysis over users, the group-privacy cross-check, the plan, the ledger, the report
and the CLI, and the refusals (nothing recorded)."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import integrate, stats

from dpcore import PrivacyLedger
from dpcore.accounting import (
    GaussianEvent,
    MixtureOfGaussiansEvent,
    PldAccountant,
    PoissonSampledEvent,
    RdpAccountant,
    SelfComposedEvent,
    TruncatedPoissonSampledEvent,
    UnsupportedEventError,
    example_level_sampling_event,
    group_privacy_epsilon,
)
from dpcore.events import SumQueryEvent, event_from_dict
from dpcore.ledger import LedgerError
from dpcore.plan import PRIVACY_UNITS, calibrate_noise, make_plan

DELTA = 1e-5
ROOT = os.path.join(os.path.dirname(__file__), "..")


def els(q, z, k, t):
    return SelfComposedEvent(example_level_sampling_event(q, z, k), t)


def poisson(q, z, t):
    return SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), t)


def eps(event, delta=DELTA):
    return PldAccountant().compose(event).get_epsilon(delta)


# ----------------------------------------------------------------------------- the oracle

ORACLE = [(0.01, 1.0, k, t) for k in (2, 4, 16) for t in (100, 1000)]
#: dp_accounting builds the PLD of a mixture in Python, one grid point at a time: at its default
#: 1e-4 a K = 16 step takes minutes. Its pessimistic (connect the dots) PLD is taken at 1e-3, where
#: its ε agrees with the 1e-4 one to ~1e-5 relative (connect the dots errs at second order in the
#: grid step); its optimistic one (privacy buckets, losses rounded down: a lower bound at any grid
#: step, looser on a coarser one) at 5e-3.
PESSIMISTIC_INTERVAL, OPTIMISTIC_INTERVAL = 1e-3, 5e-3


@functools.lru_cache(maxsize=None)
def dp_accounting_step(q, z, k, pessimistic):
    """dp_accounting's PLD of one step of its MixtureOfGaussiansDpEvent (what its PLD accountant
    builds for the event; built directly, which is the same PLD without the accountant's slow
    composition with its empty start)."""
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import privacy_loss_distribution

    sens = list(range(k + 1))
    ev = dpa.dp_event.MixtureOfGaussiansDpEvent(z, sens, list(stats.binom.pmf(sens, k, q)))
    return privacy_loss_distribution.from_mixture_gaussian_mechanism(
        ev.standard_deviation, ev.sensitivities, ev.sampling_probs, pessimistic_estimate=pessimistic,
        value_discretization_interval=PESSIMISTIC_INTERVAL if pessimistic else OPTIMISTIC_INTERVAL,
        use_connect_dots=pessimistic,
    )


def dp_accounting_bounds(q, z, k, t):
    """dp_accounting's (pessimistic, optimistic) ε of ``t`` steps."""
    return tuple(dp_accounting_step(q, z, k, p).self_compose(t).get_epsilon_for_delta(DELTA) for p in (True, False))


@pytest.mark.parametrize("q,z,k,t", ORACLE)
def test_els_matches_dp_accountings_mixture_of_gaussians(q, z, k, t):
    ours = eps(els(q, z, k, t))
    pess, opt = dp_accounting_bounds(q, z, k, t)
    assert ours <= 1.005 * pess
    assert ours >= opt
    # and tight: within the two grids' discretisation of each other
    assert ours == pytest.approx(pess, rel=2e-4)
    # a user costs more than an example, less than the group bound
    assert ours > eps(poisson(q, z, t))
    assert ours < group_privacy_epsilon(poisson(q, z, t), k, DELTA)


def test_one_step_delta_is_an_upper_bound_of_the_exact_hockey_stick():
    """T = 1: δ(ε) from the PLD against the hockey-stick divergence integrated numerically, both
    directions of the pair P = Σ_k Binom(K, q)(k)·N(k, z²), Q = N(0, z²)."""
    q, z, k = 0.2, 1.0, 3
    w = stats.binom.pmf(np.arange(k + 1), k, q)

    def p(x):
        return sum(wi * stats.norm.pdf(x, i, z) for i, wi in enumerate(w))

    def q0(x):
        return stats.norm.pdf(x, 0, z)

    def hockey(a, b, e):
        f = lambda x: max(a(x) - math.exp(e) * b(x), 0.0)  # noqa: E731
        return integrate.quad(f, -20, 25, limit=400, points=[0, 1, 2, 3], epsabs=1e-14)[0]

    acct = PldAccountant().compose(example_level_sampling_event(q, z, k))
    for e in (0.05, 0.5, 1.0, 2.0, 3.0):
        exact = max(hockey(p, q0, e), hockey(q0, p, e))
        lo, up = acct.get_delta_bounds(e)
        assert up >= exact * (1 - 1e-9)
        assert up <= exact + 1e-6
        assert lo <= exact * (1 + 1e-9)


# ----------------------------------------------------------------------------- K = 1, events


def test_k1_is_the_example_level_epsilon_exactly():
    q, z, t = 0.02, 0.9, 500
    assert example_level_sampling_event(q, z, 1) == PoissonSampledEvent(q, GaussianEvent(z))
    assert eps(els(q, z, 1, t)) == eps(poisson(q, z, t))
    # a mixture that is a Poisson-subsampled Gaussian is accounted as one (in the core)
    mog = MixtureOfGaussiansEvent(z, (0.0, 1.0), (1 - q, q))
    assert eps(SelfComposedEvent(mog, t)) == eps(poisson(q, z, t))
    # a single sensitivity s at probability 1 is the Gaussian of noise z/s
    assert eps(SelfComposedEvent(MixtureOfGaussiansEvent(2.0, (1.0,), (1.0,)), 3)) == eps(SelfComposedEvent(GaussianEvent(2.0), 3))
    # plans: ELS with K = 1 is the example-level plan, calibration included
    a = make_plan(sampling_probability=q, target_epsilon=2.0, target_delta=DELTA, steps=t, privacy_unit="user",
                  max_examples_per_user=1)
    b = make_plan(sampling_probability=q, target_epsilon=2.0, target_delta=DELTA, steps=t)
    assert a.noise_multiplier == b.noise_multiplier and a.epsilon() == b.epsilon()


def test_mixture_event_validates_and_round_trips():
    e = example_level_sampling_event(0.1, 1.2, 5)
    assert isinstance(e, MixtureOfGaussiansEvent)
    assert e.sensitivities == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
    np.testing.assert_allclose(e.probabilities, stats.binom.pmf(np.arange(6), 5, 0.1), rtol=1e-12)
    d = json.loads(json.dumps(SelfComposedEvent(e, 7).to_dict()))
    assert event_from_dict(d) == SelfComposedEvent(e, 7)
    assert hash(event_from_dict(d)) == hash(SelfComposedEvent(e, 7))
    with pytest.raises(ValueError, match="same length"):
        MixtureOfGaussiansEvent(1.0, (0.0, 1.0), (1.0,))
    with pytest.raises(ValueError, match=">= 0"):
        MixtureOfGaussiansEvent(1.0, (-1.0, 1.0), (0.5, 0.5))
    with pytest.raises(ValueError, match="sum to 1"):
        MixtureOfGaussiansEvent(1.0, (0.0, 1.0), (0.5, 0.6))
    with pytest.raises(ValueError, match="noise_multiplier"):
        MixtureOfGaussiansEvent(-1.0, (0.0, 1.0), (0.5, 0.5))
    with pytest.raises(TypeError, match="max_examples_per_user"):
        example_level_sampling_event(0.1, 1.0, True)
    with pytest.raises(ValueError, match="max_examples_per_user"):
        example_level_sampling_event(0.1, 1.0, 0)


def test_accountants_refuse_what_they_cannot_analyse():
    ev = example_level_sampling_event(0.01, 1.0, 4)
    assert not RdpAccountant().supports(ev)
    with pytest.raises(UnsupportedEventError, match="PldAccountant"):
        RdpAccountant().compose(ev)
    with pytest.raises(UnsupportedEventError, match="add_or_remove"):
        PldAccountant(neighboring="replace_one").compose(ev)
    # truncated Poisson does not compose with mixtures: refused, and nothing recorded
    acct = PldAccountant().compose(ev, 10)
    before = acct.get_epsilon(DELTA)
    with pytest.raises(UnsupportedEventError, match="truncated"):
        acct.compose(TruncatedPoissonSampledEvent(0.01, 50, 1000, GaussianEvent(1.0)))
    assert acct.get_epsilon(DELTA) == before
    # no noise: no guarantee; no sensitivity: nothing released
    assert eps(MixtureOfGaussiansEvent(0.0, (0.0, 1.0, 2.0), (0.5, 0.3, 0.2))) == math.inf
    assert eps(MixtureOfGaussiansEvent(1.0, (0.0,), (1.0,))) == 0.0


def test_mixed_composition_adds_up():
    """Poisson steps composed beside mixtures go through the same numpy path: ε of the whole is
    above each part's and below their sum's bound by basic composition."""
    a, b = els(0.01, 1.0, 3, 200), poisson(0.02, 1.1, 300)
    both = PldAccountant().compose(a).compose(b)
    e_ab = both.get_epsilon(DELTA)
    assert max(eps(a), eps(b)) < e_ab < eps(a, DELTA / 2) + eps(b, DELTA / 2)
    lo, up = both.get_epsilon_bounds(DELTA)
    assert lo <= up == e_ab and up - lo < 0.02 * up
    # δ at the ε found is at the target (the two directions of the same curve)
    assert both.get_delta(e_ab) <= DELTA * (1 + 1e-3)


# ----------------------------------------------------------------------------- group privacy


def test_group_privacy_is_looser_and_consistent():
    q, z, t = 0.01, 1.0, 300
    ex = poisson(q, z, t)
    assert group_privacy_epsilon(ex, 1, DELTA) == eps(ex)
    for k in (2, 4):
        g = group_privacy_epsilon(ex, k, DELTA)
        assert eps(els(q, z, k, t)) < g < math.inf
        assert g >= k * eps(ex)  # the group δ' is below δ, so the example ε is taken at a smaller δ
    # the pair form: (kε, k·e^{(k−1)ε}·δ')
    assert group_privacy_epsilon((1.0, 1e-7), 3, 1e-5) == 3.0
    assert group_privacy_epsilon((1.0, 1e-6), 3, 1e-5) == math.inf  # 3·e²·1e-6 > 1e-5
    with pytest.raises(TypeError):
        group_privacy_epsilon("x", 2, DELTA)
    with pytest.raises(ValueError):
        group_privacy_epsilon(ex, 0, DELTA)


# ----------------------------------------------------------------------------- the plan


def test_plans_of_both_user_level_modes():
    assert PRIVACY_UNITS == ("example", "user")
    q, z, t = 0.01, 1.0, 1000
    uls = make_plan(sampling_probability=q, noise_multiplier=z, steps=t, population_size=5000, privacy_unit="user",
                    examples_per_user=8)
    assert (uls.examples_per_user, uls.max_examples_per_user) == (8, None)
    assert uls.epsilon(DELTA) == eps(poisson(q, z, t)) and uls.event() == make_plan(
        sampling_probability=q, noise_multiplier=z, steps=t, population_size=5000).event()
    e = make_plan(sampling_probability=q, noise_multiplier=z, steps=t, privacy_unit="user", max_examples_per_user=4)
    assert (e.examples_per_user, e.max_examples_per_user, e.accountant) == (None, 4, "pld")
    assert e.event() == els(q, z, 4, t)
    assert e.epsilon(DELTA) == eps(els(q, z, 4, t))


def test_calibration_round_trip():
    q, t, k, target = 0.01, 1000, 4, 4.0
    plan = make_plan(sampling_probability=q, target_epsilon=target, target_delta=DELTA, steps=t, privacy_unit="user",
                     max_examples_per_user=k)
    z = plan.noise_multiplier
    assert z == calibrate_noise(target, DELTA, sampler="poisson", sampling_probability=q, steps=t,
                                max_examples_per_user=k)
    assert plan.epsilon() <= target
    assert eps(els(q, z, k, t)) <= target
    assert eps(els(q, z * (1 - 1e-3), k, t)) > target
    # a user costs more noise than an example at the same target
    assert z > make_plan(sampling_probability=q, target_epsilon=target, target_delta=DELTA, steps=t).noise_multiplier


@pytest.mark.parametrize("kw,exc,match", [
    (dict(privacy_unit="user"), ValueError, "exactly one of"),
    (dict(privacy_unit="user", examples_per_user=2, max_examples_per_user=2), ValueError, "exactly one of"),
    (dict(max_examples_per_user=2), ValueError, "needs privacy_unit='user'"),
    (dict(privacy_unit="example", examples_per_user=2), ValueError, "needs privacy_unit='user'"),
    (dict(privacy_unit="user", max_examples_per_user=0), ValueError, "max_examples_per_user"),
    (dict(privacy_unit="user", max_examples_per_user=True), TypeError, "max_examples_per_user"),
    (dict(privacy_unit="user", max_examples_per_user=2.0), TypeError, "max_examples_per_user"),
    (dict(privacy_unit="user", examples_per_user=-1), ValueError, "examples_per_user"),
    (dict(privacy_unit="user", max_examples_per_user=2, sampler="shuffle"), ValueError, "Poisson"),
    (dict(privacy_unit="user", max_examples_per_user=2, accountant="rdp"), ValueError, "PLD only"),
    (dict(privacy_unit="user", max_examples_per_user=2, noise_mechanism="banded"), ValueError, "Gaussian noise"),
    (dict(privacy_unit="person", examples_per_user=2), ValueError, "privacy_unit must be one of"),
])
def test_plan_refusals(kw, exc, match):
    with pytest.raises(exc, match=match):
        make_plan(sampling_probability=0.01, noise_multiplier=1.0, steps=10, **kw)


# ----------------------------------------------------------------------------- the ledger


def entries(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def record(led, n, q, steps, z=1.0, c=0.5, **kw):
    for _ in range(steps):
        led.record_sample(n, q, "poisson", **kw)
        led.record_release(SumQueryEvent(c, z * c))


def test_els_ledger_round_trip(tmp_path):
    p = tmp_path / "els.jsonl"
    q, z, k, t = 0.01, 1.1, 8, 300
    with PrivacyLedger(p, privacy_unit="user") as led:
        record(led, 20_000, q, t, z=z, max_examples_per_user=k)
    samples = [e for e in entries(p) if e.get("type") == "sample"]
    assert len(samples) == t and all(s["max_examples_per_user"] == k and "examples_per_user" not in s for s in samples)
    led = PrivacyLedger.load(p)
    assert led.samples[0].max_examples_per_user == k and led.privacy_unit == "user"
    ev = led.to_event()
    inner = ev.events[0]
    assert isinstance(inner, SelfComposedEvent) and inner.count == t
    assert isinstance(inner.event, MixtureOfGaussiansEvent) and inner.event.sensitivities[-1] == k
    plan = make_plan(sampling_probability=q, noise_multiplier=z, steps=t, privacy_unit="user", max_examples_per_user=k)
    assert led.get_epsilon(DELTA) == pytest.approx(plan.epsilon(DELTA), rel=1e-9)
    with pytest.raises(UnsupportedEventError, match="PldAccountant"):
        led.get_epsilon(DELTA, "rdp")
    with pytest.raises(ValueError, match="add_or_remove"):
        led.get_epsilon(DELTA, neighboring="replace_one")
    # continued with the same bound; K = 1 ledgers are example-level accounting exactly
    with PrivacyLedger(p) as w:
        record(w, 20_000, q, 1, z=z, max_examples_per_user=k)
    assert PrivacyLedger.load(p).num_releases == t + 1
    p1 = tmp_path / "k1.jsonl"
    with PrivacyLedger(p1, privacy_unit="user") as led1:
        record(led1, 20_000, q, 50, z=z, max_examples_per_user=1)
    p0 = tmp_path / "ex.jsonl"
    with PrivacyLedger(p0) as led0:
        record(led0, 20_000, q, 50, z=z)
    assert PrivacyLedger.load(p1).get_epsilon(DELTA) == PrivacyLedger.load(p0).get_epsilon(DELTA)


def test_uls_ledger_records_the_bound_and_accounts_users(tmp_path):
    p = tmp_path / "uls.jsonl"
    n, q, z, t = 2000, 0.05, 1.0, 40
    with PrivacyLedger(p, privacy_unit="user") as led:
        record(led, n, q, t, z=z, examples_per_user=4)
        record(led, n, q, t, z=z, examples_per_user=6)  # a per-step bound may change
    samples = [e for e in entries(p) if e.get("type") == "sample"]
    assert [s["examples_per_user"] for s in samples] == [4] * t + [6] * t
    led = PrivacyLedger.load(p)
    assert led.get_epsilon(DELTA) == pytest.approx(eps(poisson(q, z, 2 * t)), rel=1e-9)
    rep = led.report(DELTA)
    assert "at most 4 and 6 examples per step" in rep.contribution_bound and "among 2000 users" in rep.contribution_bound


def test_report_states_user_level_guarantees(tmp_path):
    p = tmp_path / "els.jsonl"
    with PrivacyLedger(p, privacy_unit="user") as led:
        record(led, 10_000, 0.01, 100, max_examples_per_user=4)
    rep = PrivacyLedger.load(p).report(DELTA)
    md = rep.to_markdown()
    assert f"user-level (ε, δ) = ({rep.epsilon:.6g}, {DELTA:g})" in md and "at the user level" in md
    assert "each user's data bounded to at most 4 examples in total; examples Poisson-sampled" in md
    assert "mixture of Gaussians (Ganesh 2024)" in md
    d = rep.to_dict()
    assert d["contribution_bound"] == rep.contribution_bound and d["segments"][0]["max_examples_per_user"] == 4
    assert any("max_examples_per_user" in a for a in d["assumptions"])
    assert rep.epsilon_lower_bound <= rep.epsilon and rep.epsilon_rdp is None
    assert any("RdpAccountant cannot analyse MixtureOfGaussiansEvent" in w for w in rep.warnings)
    # an example-level report says nothing of users
    q = tmp_path / "ex.jsonl"
    with PrivacyLedger(q) as led:
        record(led, 10_000, 0.01, 10)
    rep = PrivacyLedger.load(q).report(DELTA)
    assert rep.contribution_bound is None and "user-level" not in rep.to_markdown()
    # users as records without a bound (written before bounds were recorded): still stated
    u = tmp_path / "u.jsonl"
    with PrivacyLedger(u, privacy_unit="user") as led:
        record(led, 300, 0.1, 5)
    assert "each record is one user" in PrivacyLedger.load(u).report(DELTA).contribution_bound


def _bytes(p):
    with open(p, "rb") as f:
        return f.read()


@pytest.mark.parametrize("unit,first,second,exc,match", [
    ("example", None, dict(max_examples_per_user=4), LedgerError, "privacy unit is 'example'"),
    ("example", None, dict(examples_per_user=4), LedgerError, "privacy unit is 'example'"),
    ("user", None, dict(max_examples_per_user=0), ValueError, "max_examples_per_user"),
    ("user", None, dict(max_examples_per_user=True), TypeError, "max_examples_per_user"),
    ("user", None, dict(examples_per_user=1.5), TypeError, "examples_per_user"),
    ("user", None, dict(examples_per_user=2, max_examples_per_user=2), ValueError, "not both"),
    ("user", None, dict(max_examples_per_user=4, policy="shuffle", sample_size=10), ValueError, "Poisson"),
    ("user", None, dict(max_examples_per_user=4, policy="fixed_size_without_replacement", sample_size=10), ValueError,
     "Poisson"),
    ("user", dict(max_examples_per_user=4), dict(max_examples_per_user=5), LedgerError, "one value on every sample"),
    ("user", dict(max_examples_per_user=4), dict(examples_per_user=5), LedgerError, "one value on every sample"),
    ("user", dict(max_examples_per_user=4), dict(), LedgerError, "one value on every sample"),
    ("user", dict(examples_per_user=4), dict(max_examples_per_user=4), LedgerError, "one value on every sample"),
])
def test_ledger_refusals_record_nothing(tmp_path, unit, first, second, exc, match):
    p = tmp_path / "l.jsonl"
    led = PrivacyLedger(p, privacy_unit=unit)
    if first is not None:
        record(led, 1000, 0.1, 2, **first)
    before = _bytes(p)
    kw = dict(second)
    policy = kw.pop("policy", "poisson")
    size = kw.pop("sample_size", None)
    with pytest.raises(exc, match=match):
        led.record_sample(1000, None if size else 0.1, policy, sample_size=size, **kw)
    led.close()
    assert _bytes(p) == before
    assert PrivacyLedger.load(p).num_releases == (0 if first is None else 2)
    if first is None:  # nothing pending either: a release has no sample to go on
        with PrivacyLedger(p) as again, pytest.raises(LedgerError, match="no sample recorded"):
            again.record_release(SumQueryEvent(1.0, 1.0))


def test_units_are_never_mixed_in_one_ledger(tmp_path):
    p = tmp_path / "l.jsonl"
    with PrivacyLedger(p, privacy_unit="user") as led:
        record(led, 1000, 0.1, 1, max_examples_per_user=2)
    before = _bytes(p)
    with pytest.raises(LedgerError, match="privacy unit 'user'"):
        PrivacyLedger(p, privacy_unit="example")
    assert _bytes(p) == before
    q = tmp_path / "e.jsonl"
    with PrivacyLedger(q) as led:
        record(led, 1000, 0.1, 1)
    with pytest.raises(LedgerError, match="privacy unit 'example'"):
        PrivacyLedger(q, privacy_unit="user")


def test_files_stay_backward_compatible_and_are_checked_on_load(tmp_path):
    head = '{"format": "dpcore-privacy-ledger", "version": 1%s}'
    sample = ('{"type": "sample", "sample": %d, "population_size": 1000, "sampling_probability": 0.1, '
              '"policy": "poisson", "sample_size": null, "seeded": false%s}')
    query = '{"type": "sum_query", "sample": %d, "l2_norm_clip": 1.0, "stddev": 1.0}'

    def write(name, unit, extras):
        lines = [head % ("" if unit is None else f', "privacy_unit": "{unit}"')]
        for i, extra in enumerate(extras):
            lines += [sample % (i, extra), query % i]
        p = tmp_path / name
        p.write_text("\n".join(lines) + "\n")
        return p

    # written before the bounds existed: an example ledger without a unit, a user ledger without bounds
    old = write("old.jsonl", None, ["", ""])
    # (the ledger's z is Eq. (1)'s, rounded down by a few ulps: hence approx)
    assert PrivacyLedger.load(old).get_epsilon(DELTA) == pytest.approx(eps(poisson(0.1, 1.0, 2)), rel=1e-9)
    users = write("users.jsonl", "user", ["", ""])
    assert PrivacyLedger.load(users).get_epsilon(DELTA) == pytest.approx(eps(poisson(0.1, 1.0, 2)), rel=1e-9)
    good = write("good.jsonl", "user", [', "max_examples_per_user": 3'] * 2)
    assert PrivacyLedger.load(good).get_epsilon(DELTA) == pytest.approx(eps(els(0.1, 1.0, 3, 2)), rel=1e-9)
    for name, unit, extras, match in [
        ("ex.jsonl", "example", [', "max_examples_per_user": 3'], "privacy unit is 'example'"),
        ("none.jsonl", None, [', "examples_per_user": 3'], "privacy unit is 'example'"),
        ("change.jsonl", "user", [', "max_examples_per_user": 3', ', "max_examples_per_user": 4'], "line 4"),
        ("null.jsonl", "user", [', "max_examples_per_user": null'], "only when given"),
        ("zero.jsonl", "user", [', "examples_per_user": 0'], "examples_per_user"),
    ]:
        with pytest.raises(LedgerError, match=match):
            PrivacyLedger.load(write(name, unit, extras))


# ----------------------------------------------------------------------------- the CLI


def cli(*args):
    return subprocess.run([sys.executable, "-m", "dpcore", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_cli_els_and_uls():
    base = ["-q", "0.01", "--steps", "300", "--delta", "1e-5"]
    r = cli("epsilon", "-z", "1.0", *base, "--privacy-unit", "user", "--max-examples-per-user", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["epsilon"] == eps(els(0.01, 1.0, 4, 300)) and out["privacy_unit"] == "user"
    assert out["epsilon_example_level"] < out["epsilon"] < out["epsilon_group_privacy"]
    text = cli("epsilon", "-z", "1.0", *base, "--privacy-unit", "user", "--max-examples-per-user", "4").stdout
    assert text.startswith("user-level ε = ") and "at most 4 examples in total" in text
    # ULS: the ordinary command over the user population, stated for a user
    r = cli("epsilon", "-z", "1.0", *base, "--privacy-unit", "user", "--examples-per-user", "4", "--json")
    uls = json.loads(r.stdout)
    ex = json.loads(cli("epsilon", "-z", "1.0", *base, "--json").stdout)
    assert uls["epsilon"] == ex["epsilon"] and uls["examples_per_user"] == 4 and uls["privacy_unit"] == "user"
    assert "user-level ε" in cli("epsilon", "-z", "1.0", *base, "--privacy-unit", "user", "--examples-per-user", "4").stdout
    # calibrate: the plan's z, stated for a user
    r = cli("calibrate", "--epsilon", "3", *base, "--privacy-unit", "user", "--max-examples-per-user", "4", "--json")
    assert r.returncode == 0, r.stderr
    cal = json.loads(r.stdout)
    assert cal["noise_multiplier"] == calibrate_noise(3.0, 1e-5, sampler="poisson", sampling_probability=0.01,
                                                      steps=300, max_examples_per_user=4)
    assert cal["epsilon_achieved"] <= 3.0
    assert "user-level ε = 3" in cli("calibrate", "--epsilon", "3", *base, "--privacy-unit", "user",
                                     "--max-examples-per-user", "4").stdout


@pytest.mark.parametrize("extra,match", [
    (["--max-examples-per-user", "4"], "needs --privacy-unit user"),
    (["--privacy-unit", "example", "--examples-per-user", "4"], "needs --privacy-unit user"),
    (["--privacy-unit", "user"], "exactly one of"),
    (["--privacy-unit", "user", "--max-examples-per-user", "4", "--examples-per-user", "2"], "exactly one of"),
    (["--privacy-unit", "user", "--max-examples-per-user", "0"], "integer >= 1"),
    (["--privacy-unit", "user", "--max-examples-per-user", "4", "--sampler", "shuffle"], "Poisson sampling only"),
    (["--privacy-unit", "user", "--max-examples-per-user", "4", "--accountant", "rdp"], "PLD only"),
])
def test_cli_refusals(extra, match):
    r = cli("epsilon", "-q", "0.01", "-z", "1", "--steps", "10", "--delta", "1e-5", *extra)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr
