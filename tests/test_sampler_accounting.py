"""ε and calibration by the sampler a run uses (dpcore.accounting.samplers), the CLI's
``--sampler`` and the report's sampler section."""

import json
import math
import subprocess
import sys
import warnings

import pytest

import dpcore.accounting as A
from dpcore import PrivacyLedger
from dpcore.accounting.samplers import steps_per_round
from dpcore.events import SumQueryEvent

DELTA = 1e-5


# ----------------------------------------------------------------------------- events


def test_events_of_each_sampler():
    g = A.GaussianEvent(1.2)
    assert A.sampler_event("poisson", 1.2, 30, sampling_probability=0.01) == A.SelfComposedEvent(A.PoissonSampledEvent(0.01, g), 30)
    assert A.sampler_event("truncated_poisson", 1.2, 30, sampling_probability=0.01, population_size=1000, max_batch_size=15) == (
        A.SelfComposedEvent(A.TruncatedPoissonSampledEvent(0.01, 15, 1000, g), 30)
    )
    # Shuffled batches, 30 steps of a 100-step epoch: one epoch begun. Zero-out (the default):
    # C once an epoch; add-or-remove, ≥ 5 steps an epoch: √5·C; replace-one: 2C once an epoch.
    assert A.sampler_event("shuffle", 1.2, 30, sampling_probability=0.01) == A.SelfComposedEvent(g, 1)
    assert A.sampler_event("shuffle", 1.2, 250, sampling_probability=0.01, neighboring="add_or_remove") == (
        A.SelfComposedEvent(A.GaussianEvent(1.2 / math.sqrt(5)), 3))
    assert A.sampler_event("shuffle", 1.2, 250, sampling_probability=0.01, neighboring="replace_one") == (
        A.SelfComposedEvent(A.GaussianEvent(0.6), 3))
    # under 5 steps an epoch, and a fixed order: a swap at every step
    assert A.sampler_event("shuffle", 1.2, 30, sampling_probability=0.5, neighboring="add_or_remove") == (
        A.SelfComposedEvent(A.GaussianEvent(0.6), 30))
    assert A.sampler_event("sequential", 1.2, 250, sampling_probability=0.01, neighboring="add_or_remove") == (
        A.SelfComposedEvent(A.GaussianEvent(0.6), 250))
    assert A.sampler_event("sequential", 1.2, 250, sampling_probability=0.01) == A.SelfComposedEvent(g, 3)
    # fixed batches: ⌊1/q⌋ = 3 batches, 7 steps: 3 participations
    assert A.sampler_event("cyclic", 1.2, 7, sampling_probability=0.3) == A.SelfComposedEvent(g, 3)
    assert A.sampler_event("cyclic", 1.2, 7, sampling_probability=0.3, neighboring="add_or_remove") == (
        A.SelfComposedEvent(A.GaussianEvent(0.6), 3))
    # zero-out for the amplified samplers: the same pair (truncated Poisson: the Poisson one)
    assert A.sampler_event("poisson", 1.2, 30, sampling_probability=0.01, neighboring="zero_out") == (
        A.SelfComposedEvent(A.PoissonSampledEvent(0.01, g), 30))
    assert A.sampler_event("truncated_poisson", 1.2, 30, sampling_probability=0.01, population_size=1000,
                           max_batch_size=15, neighboring="zero_out") == A.SelfComposedEvent(A.PoissonSampledEvent(0.01, g), 30)
    for sampler in ("poisson", "truncated_poisson", "balls_in_bins", "random_allocation"):
        with pytest.raises(ValueError, match="no replace-one analysis"):
            A.sampler_event(sampler, 1.2, 30, sampling_probability=0.01, population_size=1000,
                            max_batch_size=15 if sampler == "truncated_poisson" else None, neighboring="replace_one")
    with pytest.raises(ValueError, match="neighboring must be one of"):
        A.sampler_event("shuffle", 1.2, 30, sampling_probability=0.01, neighboring="add_one")
    # 250 steps of 100-batch epochs: 3 epochs, the cut one counted whole.
    assert A.sampler_event("balls_in_bins", 1.2, 250, sampling_probability=0.01) == A.SelfComposedEvent(A.BallsInBinsSampledEvent(100, g), 3)
    assert A.sampler_event("random_allocation", 1.2, 400, sampling_probability=0.01, num_selected=2) == (
        A.SelfComposedEvent(A.RandomAllocationSampledEvent(200, 2, g), 2)
    )


@pytest.mark.parametrize(
    "sampler, kw, match",
    [
        ("truncated_poisson", {}, "population_size and max_batch_size"),
        ("poisson", {"max_batch_size": 10}, "cap of truncated_poisson"),
        ("poisson", {"num_selected": 2}, "num_selected"),
        ("balls_in_bins", {"num_selected": 2}, "num_selected"),
        ("balls_in_bins", {"sampling_probability": 0.03}, "whole number"),
        ("random_allocation", {"sampling_probability": 0.3, "num_selected": 2}, "whole number"),
        ("balls_in_bins", {"sampling_probability": 0.0}, "> 0"),
        ("uniform", {}, "sampler must be one of"),
    ],
)
def test_bad_sampler_arguments(sampler, kw, match):
    kw = {"sampling_probability": 0.01, **kw}
    with pytest.raises(ValueError, match=match):
        A.sampler_event(sampler, 1.0, 10, **kw)


def test_steps_per_round():
    assert steps_per_round("balls_in_bins", 0.01) == 100
    assert steps_per_round("random_allocation", 0.01, 3) == 300
    assert steps_per_round("balls_in_bins", 1 / 7) == 7


# ----------------------------------------------------------------------------- ε


def test_poisson_and_shuffle_match_their_plain_analyses():
    assert A.sampler_epsilon("poisson", 1.1, 500, DELTA, sampling_probability=0.01) == A.epsilon(0.01, 1.1, 500, DELTA)
    # Shuffled steps, 5 epochs of 100: under zero-out 5 Gaussian queries of sensitivity C = one
    # Gaussian at z/√5; under add-or-remove at z/√25 (√5·C an epoch).
    shuffled = A.sampler_epsilon("shuffle", 30.0, 500, DELTA, sampling_probability=0.01)
    one = A.PldAccountant().compose(A.GaussianEvent(30.0 / math.sqrt(5))).get_epsilon(DELTA)
    assert shuffled == pytest.approx(one, rel=1e-9)
    aor = A.sampler_epsilon("shuffle", 30.0, 500, DELTA, sampling_probability=0.01, neighboring="add_or_remove")
    assert aor == pytest.approx(A.PldAccountant().compose(A.GaussianEvent(30.0 / 5)).get_epsilon(DELTA), rel=1e-9)
    assert shuffled > A.sampler_epsilon("poisson", 30.0, 500, DELTA, sampling_probability=0.01, neighboring="zero_out")


def test_default_accountants():
    from dpcore.accounting.samplers import default_accountant

    assert default_accountant("poisson") == "pld" and default_accountant("truncated_poisson") == "pld"
    assert default_accountant("balls_in_bins") == "rdp" and default_accountant("random_allocation") == "rdp"
    assert default_accountant("balls_in_bins", "pld") == "pld"
    with pytest.raises(ValueError):
        default_accountant("poisson", "exact")


@pytest.mark.parametrize("cap", [560, 600, 700, 60000])
def test_truncated_poisson_never_below_poisson(cap):
    kw = dict(sampling_probability=0.01, population_size=60000, max_batch_size=cap)
    e_t = A.sampler_epsilon("truncated_poisson", 1.0, 200, DELTA, **kw)
    e_p = A.sampler_epsilon("poisson", 1.0, 200, DELTA, sampling_probability=0.01)
    assert e_t >= e_p
    if cap == 60000:
        # The cap binds only when all n + 1 records are drawn: the same ε but for the few ulps of
        # weight the step's mixture puts at +∞ (rust/accounting/pld/truncated.rs), about 4e-9
        # of ε here, always upward.
        assert e_t <= e_p * (1 + 1e-7)


def test_allocation_epsilons_are_finite_and_amplified():
    e_b = A.sampler_epsilon("balls_in_bins", 1.0, 1000, DELTA, sampling_probability=0.01)
    e_s = A.sampler_epsilon("shuffle", 1.0, 1000, DELTA, sampling_probability=0.01, neighboring="add_or_remove")
    e_p = A.sampler_epsilon("poisson", 1.0, 1000, DELTA, sampling_probability=0.01)
    assert math.isfinite(e_b) and e_b < e_s / 10
    # A certified Rényi bound: within a small factor of Poisson's PLD at the same rate.
    assert e_p / 2 < e_b < 3 * e_p
    e_k = A.sampler_epsilon("random_allocation", 1.0, 1000, DELTA, sampling_probability=0.01, num_selected=4)
    assert math.isfinite(e_k) and e_k < e_s / 10


# ----------------------------------------------------------------------------- calibration


@pytest.mark.parametrize(
    "sampler, skw",
    [
        ("poisson", {"sampling_probability": 0.01}),
        ("shuffle", {"sampling_probability": 0.01}),
        ("truncated_poisson", {"sampling_probability": 0.01, "population_size": 60000, "max_batch_size": 620}),
        ("balls_in_bins", {"sampling_probability": 0.01}),
        ("random_allocation", {"sampling_probability": 0.01, "num_selected": 2}),
    ],
)
def test_noise_calibration_is_tight_and_safe(sampler, skw):
    z = A.calibrate_sampler_noise(2.0, DELTA, sampler, 600, **skw)
    assert A.sampler_epsilon(sampler, z, 600, DELTA, **skw) <= 2.0
    assert A.sampler_epsilon(sampler, z * (1 - 1e-3), 600, DELTA, **skw) > 2.0
    if sampler == "poisson":
        assert z == pytest.approx(A.calibrate_noise_multiplier(2.0, DELTA, 0.01, 600), rel=1e-4)


@pytest.mark.parametrize("sampler, unit", [("poisson", 1), ("balls_in_bins", 50), ("shuffle", 1)])
def test_steps_calibration(sampler, unit):
    z = 2.0 if sampler != "shuffle" else 40.0
    t = A.calibrate_sampler_steps(1.0, DELTA, sampler, z, sampling_probability=0.02)
    assert t > 0 and t % unit == 0
    assert A.sampler_epsilon(sampler, z, t, DELTA, sampling_probability=0.02) <= 1.0
    assert A.sampler_epsilon(sampler, z, t + unit, DELTA, sampling_probability=0.02) > 1.0


def test_calibration_refuses_bad_targets():
    with pytest.raises(ValueError):
        A.calibrate_sampler_noise(0.0, DELTA, "poisson", 10, sampling_probability=0.01)
    with pytest.raises(ValueError):
        A.calibrate_sampler_noise(1.0, 1.5, "poisson", 10, sampling_probability=0.01)
    assert A.calibrate_sampler_steps(1e-4, DELTA, "poisson", 0.5, sampling_probability=0.5) == 0


# ----------------------------------------------------------------------------- CLI


def cli(*args):
    return subprocess.run([sys.executable, "-m", "dpcore", *args], capture_output=True, text=True)


def test_cli_epsilon_all_samplers_side_by_side():
    r = cli("epsilon", "-q", "0.01", "-z", "1.0", "--steps", "1000", "--delta", "1e-5", "--sampler", "all",
            "--population-size", "60000", "--max-batch-size", "650", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {row["sampler"]: row for row in out["samplers"]}
    assert out["neighboring"] == "add_or_remove"  # one relation for the whole table
    assert set(rows) == {"poisson", "truncated_poisson", "balls_in_bins", "random_allocation", "shuffle", "sequential", "cyclic"}
    assert rows["poisson"]["epsilon"] == pytest.approx(A.epsilon(0.01, 1.0, 1000, DELTA))
    assert rows["truncated_poisson"]["epsilon"] >= rows["poisson"]["epsilon"]
    assert rows["shuffle"]["ratio_to_poisson"] > 10
    assert rows["balls_in_bins"]["accountant"] == "rdp"


def test_cli_one_sampler_and_calibration():
    r = cli("epsilon", "-q", "0.01", "-z", "1.0", "--steps", "300", "--delta", "1e-5", "--sampler", "balls_in_bins", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["epsilon"] == pytest.approx(A.sampler_epsilon("balls_in_bins", 1.0, 300, DELTA, sampling_probability=0.01))
    assert out["epsilon_poisson_same_rate"] == pytest.approx(A.epsilon(0.01, 1.0, 300, DELTA))
    r = cli("calibrate", "--epsilon", "3", "--delta", "1e-5", "-q", "0.01", "-z", "1.0", "--sampler", "balls_in_bins", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] % 100 == 0


@pytest.mark.parametrize(
    "args, match",
    [
        (("--max-batch-size", "10"), "truncated_poisson"),
        (("--sampler", "truncated_poisson"), "--population-size and --max-batch-size"),
        (("--num-selected", "2"), "random_allocation"),
    ],
)
def test_cli_refuses_inconsistent_sampler_options(args, match):
    r = cli("epsilon", "-q", "0.01", "-z", "1.0", "--steps", "10", "--delta", "1e-5", *args)
    assert r.returncode == 2 and match in r.stderr


# ----------------------------------------------------------------------------- report


def test_report_names_a_better_sampler_for_shuffled_batches(tmp_path):
    p = tmp_path / "l.jsonl"
    with PrivacyLedger(p) as led:
        for _ in range(200):
            led.record_sample(60000, None, "shuffle", sample_size=600)
            led.record_release(SumQueryEvent(1.0, 1.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = PrivacyLedger.load(p).report(DELTA)
    assert [s["policy"] for s in rep.samplers] == ["shuffle"]
    assert rep.samplers[0]["amplification"] == "none"
    text = rep.suggestion
    assert "balls_in_bins" in text and '"poisson"' in text
    e_bins = A.sampler_epsilon("balls_in_bins", 1.1, 200, DELTA, sampling_probability=0.01)
    e_poisson = A.epsilon(0.01, 1.1, 200, DELTA)
    assert f"{e_bins:.6g}" in text and f"{e_poisson:.6g}" in text
    assert e_bins < rep.epsilon and e_poisson < rep.epsilon
    md = rep.to_markdown()
    assert "## Samplers" in md and "**Sampler:**" in md
    assert rep.to_dict()["suggestion"] == text


def test_report_of_poisson_ledger_has_no_suggestion(tmp_path):
    p = tmp_path / "l.jsonl"
    with PrivacyLedger(p) as led:
        for _ in range(5):
            led.record_sample(1000, 0.01, "poisson")
            led.record_release(SumQueryEvent(1.0, 1.1))
    rep = PrivacyLedger.load(p).report(DELTA)
    assert rep.suggestion is None
    assert rep.samplers[0]["policy"] == "poisson" and rep.samplers[0]["steps"] == 5
