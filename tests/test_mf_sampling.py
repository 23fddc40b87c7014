"""Cyclic samplers for matrix-factorization mechanisms (dpcore.sampling.CyclicSampler and
CyclicPoissonSampler): the participation schema they promise, checked at fixed seeds."""

import warnings

import numpy as np
import pytest
from scipy import stats

from dpcore.ledger import PrivacyLedger
from dpcore.matrix_factorization import Participation
from dpcore.sampling import CyclicSampler, CyclicPoissonSampler


def test_cyclic_every_record_once_per_epoch_and_separation_b():
    n, bs = 103, 10  # b = 10 batches, 3 records dropped
    s = CyclicSampler(n, bs, seed=7)
    b = s.steps_per_epoch
    assert b == 10 and s.dropped == 3 and len(s) == b
    assert s.participation == Participation(10)
    epochs = 4
    seen = {}
    for e in range(epochs):
        epoch = [s.draw() for _ in range(b)]
        flat = np.concatenate(epoch)
        assert all(len(x) == bs and np.all(np.diff(x) > 0) for x in epoch)
        # every kept record exactly once per epoch, the dropped ones never
        assert flat.size == np.unique(flat).size == n - s.dropped
        for t, idx in enumerate(epoch):
            for i in idx.tolist():
                seen.setdefault(i, []).append(e * b + t)
    groups = s.groups()
    assert (groups == -1).sum() == 3 and set(np.flatnonzero(groups == -1)).isdisjoint(seen)
    for i, steps in seen.items():
        assert len(steps) == epochs
        assert set(np.diff(steps).tolist()) == {b}  # exactly b steps apart
        assert steps[0] == groups[i]
    assert s.position == epochs * b and s.epoch == epochs


def test_cyclic_same_batches_every_epoch_and_iteration_is_the_rest_of_the_epoch():
    s = CyclicSampler(40, 8, seed=1)
    first = list(s)
    assert len(first) == 5 and s.position == 5
    again = list(s)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    s.draw(); s.draw()
    rest = list(s)  # steps 12..14
    assert len(rest) == 3 and all(np.array_equal(a, b) for a, b in zip(rest, first[2:]))


def test_cyclic_permutation_is_keyed_and_os_keyed_by_default():
    a, b = CyclicSampler(1000, 10, seed=3), CyclicSampler(1000, 10, seed=3)
    assert np.array_equal(a.permutation, b.permutation)
    assert not np.array_equal(a.permutation, CyclicSampler(1000, 10, seed=4).permutation)
    u, v = CyclicSampler(1000, 10), CyclicSampler(1000, 10)
    assert not np.array_equal(u.permutation, v.permutation)  # OS keys (collision ~1/1000!)
    assert sorted(u.permutation.tolist()) == list(range(1000))
    with pytest.raises(ValueError):
        u.permutation[0] = 1  # read-only


def test_cyclic_state_dict_resumes_the_same_cycle():
    a = CyclicSampler(57, 6)  # OS-keyed: only the stored key gives the same order back
    want = [a.draw() for _ in range(20)]
    b = CyclicSampler(57, 6)
    c = CyclicSampler(57, 6)
    for _ in range(7):
        b.draw()
    st = a.state_dict()
    st_b = dict(st, position=7)
    c.load_state_dict(st_b)
    got = [c.draw() for _ in range(13)]
    assert all(np.array_equal(x, y) for x, y in zip(got, want[7:]))
    assert c.state_dict() == dict(st, position=20)
    with pytest.raises(ValueError, match="same partition"):
        CyclicSampler(57, 5).load_state_dict(st)
    with pytest.raises(ValueError, match="not the state"):
        CyclicPoissonSampler(57, 5, 0.5).load_state_dict(st)
    with pytest.raises(ValueError, match="position"):
        c.load_state_dict(dict(st, position=-1))


def test_cyclic_refuses_nonsense():
    with pytest.raises(ValueError, match="larger than the population"):
        CyclicSampler(5, 6)
    with pytest.raises(ValueError):
        CyclicSampler(0, 1)
    with pytest.raises(ValueError):
        CyclicSampler(10, 0)
    with pytest.raises(TypeError):
        CyclicSampler(10, 2.5)
    with pytest.raises(TypeError):
        CyclicSampler(10, 2, ledger="l.jsonl")
    with pytest.raises(ValueError, match="larger than the population"):
        CyclicPoissonSampler(5, 6, 0.5)
    with pytest.raises(ValueError, match="> 0"):
        CyclicPoissonSampler(50, 5, 0.0)
    with pytest.raises(ValueError):
        CyclicPoissonSampler(50, 5, 1.5)
    with pytest.raises(ValueError):
        CyclicPoissonSampler(50, 0, 0.5)


def test_cyclic_poisson_groups_and_inclusion_rate():
    n, b, p = 997, 7, 0.3
    s = CyclicPoissonSampler(n, b, p, seed=11)
    assert s.participation == Participation.cyclic_poisson(b, p)
    groups = s.groups()
    sizes = np.bincount(groups, minlength=b)
    assert groups.min() == 0 and sizes.sum() == n and sizes.max() - sizes.min() <= 1  # none dropped
    assert s.expected_batch_size == pytest.approx(p * n / b)
    steps = 70 * b
    hits = np.zeros(n, np.int64)
    for t in range(steps):
        idx = s.draw()
        assert np.all(np.diff(idx) > 0)
        # a record only ever appears at steps ≡ its group (mod b)
        assert np.all(groups[idx] == t % b)
        hits[idx] += 1
    # each record had steps/b = 70 chances: total inclusions ~ Binomial(70·n, p)
    trials = (steps // b) * n
    test = stats.binomtest(int(hits.sum()), trials, p)
    assert test.pvalue > 1e-3
    # and no record is favoured: per-record counts ~ Binomial(70, p)
    expected = stats.binom(70, p)
    assert abs(hits.mean() - expected.mean()) < 5 * expected.std() / np.sqrt(n)
    assert stats.kstest(hits, expected.cdf).statistic < 0.12


def test_cyclic_poisson_state_dict_and_seeded_draws():
    a = CyclicPoissonSampler(200, 4, 0.5, seed=2)
    want = [a.draw() for _ in range(10)]
    b = CyclicPoissonSampler(200, 4, 0.5, seed=2)
    b.load_state_dict(dict(a.state_dict(), position=6))
    got = [b.draw() for _ in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(got, want[6:]))
    # unseeded: the per-step draws are fresh, the partition is the stored one
    u = CyclicPoissonSampler(200, 4, 0.5)
    v = CyclicPoissonSampler(200, 4, 0.5)
    v.load_state_dict(u.state_dict())
    assert np.array_equal(u.groups(), v.groups())


def test_samplers_record_their_policy(tmp_path):
    led = PrivacyLedger(str(tmp_path / "l.jsonl"))
    s = CyclicSampler(30, 7, ledger=led)
    s.draw()
    assert led._pending.policy == "cyclic" and led._pending.sample_size == 7
    assert led._pending.sampling_probability == 7 / 30 and not led._pending.seeded
    c = CyclicPoissonSampler(30, 3, 0.25, ledger=led, seed=1)
    c.draw()
    assert led._pending.policy == "cyclic_poisson" and led._pending.sampling_probability == 0.25
    assert led._pending.population_size == 30 and led._pending.seeded
