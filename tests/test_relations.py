"""The neighbouring relation is part of every guarantee (issue: ε printed under the wrong
relation). What each sampler supports, what the ledger records and states, and the examples the
issue gives, through the public API. The exact privacy curves of small adversarial datasets are
in test_relations_exact.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import pytest

import dpcore
from dpcore import accounting as A
from dpcore.ledger import LedgerWarning, PrivacyLedger
from dpcore.ledger._events import run_relation  # noqa: F401  (the run's relation, tested through the ledger)

DELTA = 1e-5


def _eps(led, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)
        return led.get_epsilon(DELTA, **kw)


# ----------------------------------------------------------------------------- the examples


def test_shuffled_epochs_are_accounted_per_epoch():
    # 1000 steps at batch/n = 0.01: 10 epochs of 100 steps, z = 1
    zero = A.sampler_epsilon("shuffle", 1.0, 1000, DELTA, sampling_probability=0.01, neighboring="zero_out")
    aor = A.sampler_epsilon("shuffle", 1.0, 1000, DELTA, sampling_probability=0.01, neighboring="add_or_remove")
    assert zero == pytest.approx(17.86, rel=5e-3)  # μ = √10
    assert aor == pytest.approx(54.4, rel=5e-3)  # μ = √50
    # the default relation of shuffled batches is zero-out
    assert A.sampler_epsilon("shuffle", 1.0, 1000, DELTA, sampling_probability=0.01) == zero


@pytest.mark.parametrize("n,bs,epochs,z,exact", [(1000, 10, 2, 1.0, 516.2), (100, 45, 4, 2.0, 16.675)])
def test_fixed_order_add_or_remove_is_above_the_exact_pair(n, bs, epochs, z, exact):
    k = -(-n // bs)
    e = A.sampler_epsilon("sequential", z, epochs * k, DELTA, sampling_probability=bs / n, neighboring="add_or_remove")
    assert e >= exact


def test_two_steps_an_epoch_add_or_remove_is_above_the_exact_pair():
    e = A.sampler_epsilon("shuffle", 1.0, 20, DELTA, sampling_probability=0.9, neighboring="add_or_remove")
    assert e >= 51.7


@pytest.mark.parametrize("sampler,rel,k,steps", [
    ("shuffle", "zero_out", 100, 1000), ("shuffle", "add_or_remove", 100, 1000), ("shuffle", "add_or_remove", 3, 30),
    ("sequential", "add_or_remove", 20, 60), ("sequential", "replace_one", 20, 60), ("cyclic", "add_or_remove", 4, 10),
])
def test_epoch_statements_against_dp_accounting(sampler, rel, k, steps):
    """The same composition of Gaussian mechanisms in dp_accounting: between its optimistic and
    pessimistic PLDs (ours is a pessimistic bound too: never below the optimistic one)."""
    dpa = pytest.importorskip("dp_accounting")
    z = 2.0
    ev = A.sampler_event(sampler, z, steps, sampling_probability=1.0 / k, neighboring=rel, steps_per_epoch=k)
    ours = A.PldAccountant().compose(ev).get_epsilon(DELTA)
    mu = {  # the per-epoch (or per-step) noise multiplier and count the module docs give
        ("shuffle", "zero_out"): (z, -(-steps // k)), ("shuffle", "add_or_remove"): (z / math.sqrt(5), -(-steps // k))
        if k >= 5 else (z / 2, steps), ("sequential", "add_or_remove"): (z / 2, steps),
        ("sequential", "replace_one"): (z / 2, -(-steps // k)), ("cyclic", "add_or_remove"): (z / 2, -(-steps // k)),
    }[(sampler, rel)]
    from dp_accounting.pld import privacy_loss_distribution as pld

    out = []
    for pessimistic in (True, False):
        one = pld.from_gaussian_mechanism(mu[0], pessimistic_estimate=pessimistic, value_discretization_interval=1e-4)
        out.append(one.self_compose(mu[1]).get_epsilon_for_delta(DELTA))
    assert out[1] < out[0]  # the two estimates bracket the exact value
    assert ours >= out[1] * (1 - 1e-9) and ours <= out[0] * (1 + 1e-3), (ours, out)


def test_epsilon_above_709_is_not_capped():
    # Gaussian mechanisms at μ = 37 and 63 (the 60-digit references are in test_pld_large_eps.py)
    for mu, exact in ((37.0, 841.355), (63.0, 2252.22)):
        e = A.PldAccountant().compose(A.GaussianEvent(1.0 / mu)).get_epsilon(DELTA)
        assert e == pytest.approx(exact, rel=1e-5)


# ----------------------------------------------------------------------------- torch loaders


torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def _data(n=100):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


def _run(tmp_path, loader, epochs=3, name="l.jsonl", **kw):
    from dpcore.torch import make_private

    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    m, opt, loader = make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), loader, noise_multiplier=1.0,
                                  max_grad_norm=1.0, sampler="shuffle", ledger=str(tmp_path / name), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)
        for _ in range(epochs):
            for x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
    return m, opt, loader


@pytest.mark.parametrize("shuffle,policy", [(True, "shuffle"), (False, "sequential")])
def test_torch_loader_records_its_order_and_epochs(tmp_path, shuffle, policy):
    _, opt, _ = _run(tmp_path, DataLoader(_data(), batch_size=10, shuffle=shuffle))
    led = opt.ledger
    s = led.samples
    assert {x.policy for x in s} == {policy} and len(s) == 30
    assert [x.round for x in s] == [0] * 10 + [1] * 10 + [2] * 10
    assert [x.step_in_round for x in s[:10]] == list(range(10))
    assert all(x.round_steps == 10 and x.sample_size == 10 for x in s)
    assert led.neighboring == "zero_out"
    # zero-out: 3 epochs, each one Gaussian of noise multiplier 1
    three = A.PldAccountant().compose(A.SelfComposedEvent(A.GaussianEvent(1.0), 3)).get_epsilon(DELTA)
    assert opt.get_epsilon(DELTA) == pytest.approx(three, rel=1e-12) == _eps(led)
    aor = _eps(led, neighboring="add_or_remove")
    if shuffle:  # 10 ≥ 5 steps an epoch: √5·C an epoch
        want = A.PldAccountant().compose(A.SelfComposedEvent(A.GaussianEvent(1 / math.sqrt(5)), 3)).get_epsilon(DELTA)
    else:  # a swap at each of the 30 steps
        want = A.PldAccountant().compose(A.SelfComposedEvent(A.GaussianEvent(0.5), 30)).get_epsilon(DELTA)
    assert aor == pytest.approx(want, rel=1e-9)
    assert _eps(led, neighboring="replace_one") == pytest.approx(
        A.PldAccountant().compose(A.SelfComposedEvent(A.GaussianEvent(0.5), 3)).get_epsilon(DELTA), rel=1e-9)
    # the report states the relation in words, and suggests samplers with amplification
    rep = led.report(DELTA)
    md = rep.to_markdown()
    assert rep.neighboring == "zero_out" and "the number of records is public" in md
    assert "balls-in-bins" in md and "Poisson sampling" in md
    led.close()
    # read back by the Python reader (epoch entries are not the core's fast format)
    again = PrivacyLedger.load(tmp_path / "l.jsonl")
    assert _eps(again) == _eps(led) and _eps(again, neighboring="add_or_remove") == aor


def test_torch_loader_refuses_a_sampler_that_may_repeat_records(tmp_path):
    sampler = torch.utils.data.RandomSampler(_data(), replacement=True)
    with pytest.raises(ValueError, match="RandomSampler without replacement"):
        _run(tmp_path, DataLoader(_data(), batch_size=10, sampler=sampler))


def test_few_steps_an_epoch_cost_a_swap_per_step(tmp_path):
    # 100 records in batches of 45: 3 steps an epoch, under 5
    _, opt, _ = _run(tmp_path, DataLoader(_data(), batch_size=45, shuffle=True), epochs=4)
    want = A.PldAccountant().compose(A.SelfComposedEvent(A.GaussianEvent(0.5), 12)).get_epsilon(DELTA)
    assert _eps(opt.ledger, neighboring="add_or_remove") == pytest.approx(want, rel=1e-9)


def test_a_resumed_epoch_is_a_new_round(tmp_path):
    from dpcore.torch import make_private

    loader = DataLoader(_data(), batch_size=10, shuffle=True)
    m, opt, dl = _run(tmp_path, loader, epochs=0)
    it = iter(dl)
    for _ in range(4):
        x, y = next(it)
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    state = opt.state_dict()
    opt.ledger.close()
    torch.manual_seed(0)
    m2 = nn.Linear(3, 2)
    m2, opt2, dl2 = make_private(m2, torch.optim.SGD(m2.parameters(), lr=0.1), loader, noise_multiplier=1.0,
                                 max_grad_norm=1.0, sampler="shuffle", ledger=str(tmp_path / "l.jsonl"))
    opt2.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)
        for x, y in dl2:
            opt2.zero_grad()
            nn.functional.cross_entropy(m2(x), y).backward()
            opt2.step()
    s = opt2.ledger.samples
    assert [x.round for x in s] == [0] * 4 + [1] * 6  # the rest of the epoch, in a new order: a new round
    assert [x.step_in_round for x in s[4:]] == list(range(4, 10))
    two = A.PldAccountant().compose(A.SelfComposedEvent(A.GaussianEvent(1.0), 2)).get_epsilon(DELTA)
    assert _eps(opt2.ledger) == pytest.approx(two, rel=1e-12)
    opt2.ledger.close()


# ----------------------------------------------------------------------------- matrix factorization


def _mf_run(tmp_path, participation=None):
    from dpcore.matrix_factorization import BandedStrategy
    from dpcore.torch import make_private

    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    kw = {} if participation is None else {"participation": participation}
    # 20 records, batch 16: one fixed batch (the rest dropped), 2 epochs, one band (independent noise)
    m, opt, dl = make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(_data(20), batch_size=16),
                              noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism="banded",
                              strategy=BandedStrategy([1.0]), epochs=2, ledger=str(tmp_path / "mf.jsonl"), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            for x, y in dl:
                opt.zero_grad()
                if len(x):
                    nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
    return opt


def test_fixed_batches_are_zero_out_unless_asked(tmp_path):
    opt = _mf_run(tmp_path)
    led = opt.ledger
    assert led.neighboring == "zero_out"
    zero = _eps(led)
    assert zero == pytest.approx(4.377, abs=1e-3)  # the value: right under zero-out
    rep = led.report(DELTA)
    assert rep.neighboring == "zero_out" and "`zero_out`" in rep.to_markdown()
    aor = _eps(led, neighboring="add_or_remove")
    assert aor >= 9.671  # the exact ε of one adjacent pair under add-or-remove (removing)
    assert _eps(led, neighboring="replace_one") == pytest.approx(aor, rel=1e-12)  # 2C per participation both


def test_cyclic_poisson_refuses_add_or_remove(tmp_path):
    from dpcore.matrix_factorization import Participation

    opt = _mf_run(tmp_path, participation=Participation.cyclic_poisson(1, 0.5))
    led = opt.ledger
    assert led.neighboring == "zero_out" and math.isfinite(_eps(led))
    with pytest.raises(ValueError, match="neighboring='zero_out' only"):
        _eps(led, neighboring="add_or_remove")


# ----------------------------------------------------------------------------- relations of the samplers


def test_every_sampler_states_its_relations():
    for sampler, rels in A.samplers.RELATIONS.items():
        for rel in A.samplers.NEIGHBORING:
            kw = dict(sampling_probability=0.01, neighboring=rel)
            if sampler == "truncated_poisson":
                kw.update(population_size=10_000, max_batch_size=150)
            if rel in rels:
                assert math.isfinite(A.sampler_epsilon(sampler, 2.0, 300, DELTA, **kw))
            else:
                with pytest.raises(ValueError, match=rel.replace("_", "-")):
                    A.sampler_epsilon(sampler, 2.0, 300, DELTA, **kw)


def test_zero_out_never_above_add_or_remove_for_the_same_run():
    for sampler in ("poisson", "shuffle", "sequential", "cyclic", "balls_in_bins"):
        z = A.sampler_epsilon(sampler, 1.5, 400, DELTA, sampling_probability=0.02, neighboring="zero_out")
        a = A.sampler_epsilon(sampler, 1.5, 400, DELTA, sampling_probability=0.02, neighboring="add_or_remove")
        assert z <= a, sampler


def test_calibration_meets_the_target_under_the_relation():
    for rel in ("zero_out", "add_or_remove"):
        z = A.calibrate_sampler_noise(8.0, DELTA, "shuffle", 500, sampling_probability=0.01, neighboring=rel)
        e = A.sampler_epsilon("shuffle", z, 500, DELTA, sampling_probability=0.01, neighboring=rel)
        assert 7.99 < e <= 8.0
        steps = A.calibrate_sampler_steps(8.0, DELTA, "sequential", 3.0, sampling_probability=0.01, neighboring=rel)
        assert A.sampler_epsilon("sequential", 3.0, steps, DELTA, sampling_probability=0.01, neighboring=rel) <= 8.0


def cli(*args):
    return subprocess.run([sys.executable, "-m", "dpcore", *args], capture_output=True, text=True)


def test_cli_takes_the_relation(tmp_path):
    r = cli("epsilon", "-q", "0.01", "-z", "1.0", "--steps", "1000", "--delta", "1e-5", "--sampler", "shuffle",
            "--neighboring", "add_or_remove", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["neighboring"] == "add_or_remove" and out["epsilon"] == pytest.approx(54.38, rel=1e-3)
    r = cli("epsilon", "-q", "0.01", "-z", "1.0", "--steps", "1000", "--delta", "1e-5", "--sampler", "shuffle", "--json")
    assert json.loads(r.stdout)["neighboring"] == "zero_out"
    r = cli("epsilon", "-q", "0.01", "-z", "1.0", "--steps", "100", "--delta", "1e-5", "--sampler", "balls_in_bins",
            "--neighboring", "replace_one")
    assert r.returncode != 0 and "no replace-one analysis" in r.stderr
    r = cli("calibrate", "--epsilon", "8", "--delta", "1e-5", "-q", "0.01", "--steps", "200", "--sampler", "sequential",
            "--neighboring", "add_or_remove", "--json")
    assert r.returncode == 0, r.stderr
    z = json.loads(r.stdout)["noise_multiplier"]
    assert A.sampler_epsilon("sequential", z, 200, DELTA, sampling_probability=0.01, neighboring="add_or_remove") <= 8.0
    # report: the run's relation by default, another on request
    _, opt, _ = _run(tmp_path, DataLoader(_data(), batch_size=10, shuffle=True), epochs=2)
    opt.ledger.close()
    r = cli("report", str(tmp_path / "l.jsonl"), "--delta", "1e-5", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["neighboring"] == "zero_out"
    r = cli("report", str(tmp_path / "l.jsonl"), "--delta", "1e-5", "--format", "json", "--neighboring", "add_or_remove")
    assert json.loads(r.stdout)["neighboring"] == "add_or_remove"
