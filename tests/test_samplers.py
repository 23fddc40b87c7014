"""The samplers of issue 28 (dpcore.sampling): truncated Poisson, random allocation (k of t) and
balls-in-bins. Each law the accountant assumes is checked against its exact value at fixed
seeds (chi-square / binomial tests, or brute force over every outcome on small cases); then
resuming, the ledger's allocation rounds (format, strict reader, events) and the numpy
PrivateAggregator with each sampler."""

from __future__ import annotations

import itertools
import json
import math
import pickle
import warnings
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from dpcore import _core
from dpcore import accounting as A
from dpcore.aggregator import PrivateAggregator
from dpcore.events import SumQueryEvent
from dpcore.ledger import LedgerError, LedgerWarning, PrivacyLedger
from dpcore.ledger._events import rdp_relation_error
from dpcore.queries import GaussianSumQuery
from dpcore.sampling import (
    BallsInBinsSampler,
    RandomAllocationSampler,
    TruncatedPoissonSampler,
    poisson_accountant_event,
    poisson_sample,
    truncated_poisson_sample,
)

P_MIN = 1e-3  # every statistical test below runs at a fixed seed; a correct sampler passes it


def chisquare(observed, probs, min_expected=5.0):
    """p-value of Pearson's test of ``observed`` counts against ``probs`` (cells with a small
    expectation pooled into their neighbour, so that the chi-square approximation holds)."""
    observed = np.asarray(observed, float)
    expected = np.asarray(probs, float) * observed.sum()
    assert abs(expected.sum() - observed.sum()) < 1e-6 * observed.sum()
    obs, exp, o, e = [], [], 0.0, 0.0
    for oi, ei in zip(observed, expected):
        o, e = o + oi, e + ei
        if e >= min_expected:
            obs.append(o)
            exp.append(e)
            o = e = 0.0
    if e > 0:
        obs[-1] += o
        exp[-1] += e
    return stats.chisquare(obs, exp).pvalue


def round_of(sampler):
    """The batches of one whole round (the sampler must be at a round boundary)."""
    assert sampler.position == 0
    batches = list(sampler)
    assert len(batches) == len(sampler) and sampler.position == 0
    return batches


def steps_of(batches, n):
    """For each record, the tuple of steps (of this round) it took part in."""
    out = [[] for _ in range(n)]
    for s, idx in enumerate(batches):
        for i in idx.tolist():
            out[i].append(s)
    return [tuple(x) for x in out]


# ============================================================================ truncated Poisson


def truncated_law(n, q, cap):
    """The exact law of the truncated Poisson sample: subset → probability (brute force)."""
    law = Counter()
    for m in range(n + 1):
        for p in itertools.combinations(range(n), m):
            w = q**m * (1 - q) ** (n - m)
            if m <= cap:
                law[p] += w
            else:
                subsets = list(itertools.combinations(p, cap))
                for s in subsets:
                    law[s] += w / len(subsets)
    return law


@pytest.mark.parametrize("n,q,cap", [(4, 0.5, 2), (5, 0.7, 3)])
def test_truncated_poisson_exact_law_of_the_sample(n, q, cap):
    # Every subset's frequency against its exact probability: this checks the batch-size law,
    # the inclusion rate and that the kept subset is a uniform one, all at once.
    law = truncated_law(n, q, cap)
    keys = sorted(law, key=lambda s: (len(s), s))
    draws = 12000
    counts = Counter(tuple(truncated_poisson_sample(n, q, cap, seed=s).tolist()) for s in range(draws))
    assert set(counts) <= set(keys)
    assert chisquare([counts[k] for k in keys], [law[k] for k in keys]) > P_MIN


def test_truncated_poisson_batch_size_law_and_inclusion_rate():
    n, q, cap, draws = 30, 0.2, 5, 5000
    sampler = TruncatedPoissonSampler(n, q, cap, seed=5)
    sizes = np.zeros(draws, np.int64)
    hits = np.zeros(n, np.int64)
    for d in range(draws):
        idx = sampler.draw()
        assert idx.dtype == np.int64 and np.all(np.diff(idx) > 0) and idx.size <= cap
        sizes[d] = idx.size
        hits[idx] += 1
    # batch size ~ min(Bin(n, q), B): exact pmf, the cap's mass in the last cell
    pmf = stats.binom.pmf(np.arange(cap), n, q)
    probs = np.append(pmf, stats.binom.sf(cap - 1, n, q))
    assert chisquare(np.bincount(sizes, minlength=cap + 1), probs) > P_MIN
    # a record's inclusion probability is q·E[min(1, B/(1 + Bin(n−1, q)))] (exact)
    j = np.arange(n)
    incl = q * np.sum(stats.binom.pmf(j, n - 1, q) * np.minimum(1.0, cap / (1.0 + j)))
    expected_size = np.sum(stats.binom.pmf(np.arange(n + 1), n, q) * np.minimum(np.arange(n + 1), cap))
    assert n * incl == pytest.approx(expected_size, rel=1e-12)  # the two formulas agree
    assert sampler.expected_batch_size == pytest.approx(expected_size, rel=1e-10)
    for i in (0, n - 1):  # each record's count over the independent draws is Bin(draws, incl)
        assert stats.binomtest(int(hits[i]), draws, incl).pvalue > P_MIN
    assert abs(incl - q) > 0.01  # the cap binds: the test above could tell q from incl
    # no record favoured (counts are negatively correlated: the statistic is conservative)
    assert stats.chisquare(hits).pvalue > P_MIN


def test_truncated_poisson_keeps_a_uniform_subset_of_the_poisson_sample():
    n, q, cap = 200, 0.3, 20
    kept_by_rank = np.zeros(10)
    expected = np.zeros(10)
    for s in range(600):
        full = poisson_sample(n, q, seed=s)
        cut = truncated_poisson_sample(n, q, cap, seed=s)
        assert np.all(np.isin(cut, full)) and cut.size == min(full.size, cap)
        if full.size > cap:
            ranks = np.searchsorted(full, cut)  # positions of the kept records in the sample
            kept_by_rank += np.bincount(ranks * 10 // full.size, minlength=10)
            expected += np.bincount(np.arange(full.size) * 10 // full.size, minlength=10) * cap / full.size
    assert expected.sum() > 10000
    assert stats.chisquare(kept_by_rank, expected).pvalue > P_MIN


def test_truncated_poisson_sampler_api_and_refusals(tmp_path):
    s = TruncatedPoissonSampler(1000, 0.01, 8)
    assert len(s) == s.steps_per_epoch == 100 and s.max_batch_size == 8 and s.policy == "truncated_poisson"
    assert s.sampling_probability == 0.01 and not s.seeded and s.position == 0
    assert s.expected_batch_size < 8 and s.expected_batch_size == pytest.approx(
        sum(stats.binom.pmf(j, 1000, 0.01) * min(j, 8) for j in range(1001)), rel=1e-10
    )
    assert TruncatedPoissonSampler(10, 1.0, 4).expected_batch_size == 4.0
    assert len(TruncatedPoissonSampler(100, 0.3, 4)) == 3
    epoch = list(s)
    assert len(epoch) == 100 and s.position == 100 and s.epoch == 1
    s.draw()
    assert len(list(s)) == 99  # the rest of the epoch
    ev = s.accountant_event(1.3, 250)
    assert ev == A.SelfComposedEvent(A.TruncatedPoissonSampledEvent(0.01, 8, 1000, A.GaussianEvent(1.3)), 250)
    assert s.accountant_event(0.0, 3) == A.NonPrivateEvent()
    assert poisson_accountant_event(0.01, 1.3, 7) == A.SelfComposedEvent(
        A.PoissonSampledEvent(0.01, A.GaussianEvent(1.3)), 7
    )
    with pytest.raises(ValueError, match="larger than the population"):
        TruncatedPoissonSampler(10, 0.5, 11)
    with pytest.raises(ValueError, match="larger than the population"):
        truncated_poisson_sample(10, 0.5, 11)
    with pytest.raises(ValueError, match="> 0"):
        TruncatedPoissonSampler(10, 0.0, 3)
    with pytest.raises(ValueError):
        TruncatedPoissonSampler(10, 0.5, 0)
    with pytest.raises(ValueError):
        TruncatedPoissonSampler(10, 1.5, 3)
    with pytest.raises(TypeError):
        TruncatedPoissonSampler(10, 0.5, 2.5)
    with pytest.raises(TypeError):
        TruncatedPoissonSampler(10, 0.5, 2, ledger=str(tmp_path / "l.jsonl"))
    # state: the position; a seeded sampler continues its stream
    a = TruncatedPoissonSampler(300, 0.1, 12, seed=4)
    want = [a.draw() for _ in range(6)]
    b = TruncatedPoissonSampler(300, 0.1, 12, seed=4)
    b.load_state_dict(dict(a.state_dict(), position=3))
    assert all(np.array_equal(x, y) for x, y in zip([b.draw() for _ in range(3)], want[3:]))
    with pytest.raises(ValueError, match="max_batch_size"):
        TruncatedPoissonSampler(300, 0.1, 11).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="not the state"):
        RandomAllocationSampler(300, 10).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="position"):
        b.load_state_dict(dict(a.state_dict(), position=-1))
    # unseeded: fresh OS keys (two samples of 1000 of 10^5 records coincide with prob ~0)
    assert not np.array_equal(truncated_poisson_sample(10**5, 0.5, 1000), truncated_poisson_sample(10**5, 0.5, 1000))


# ============================================================================ random allocation


@pytest.mark.parametrize("n,t,k", [(50, 5, 2), (7, 3, 3), (5, 10, 1), (1, 1, 1), (100, 7, 4), (30, 4, 1)])
@pytest.mark.parametrize("seed", [None, 9])
def test_allocation_every_record_in_exactly_k_steps_per_round(n, t, k, seed):
    s = RandomAllocationSampler(n, t, k, seed=seed)
    assert (len(s), s.steps_per_epoch, s.num_steps, s.num_selected) == (t, t, t, k)
    assert s.sampling_probability == k / t and s.expected_batch_size == n * k / t and s.max_batch_size is None
    for r in range(3):
        batches = round_of(s)
        assert s.round == r
        assert all(b.dtype == np.int64 and np.all(np.diff(b) > 0) for b in batches)
        assert all(len(steps) == k for steps in steps_of(batches, n))  # exact, every record


def test_allocation_batch_size_law():
    # Each step's batch is Bin(n, k/t); the rounds are independent, so each fixed step across
    # rounds gives independent draws (the first and the last step, where the sequential
    # construction is forced, are tested on their own).
    for n, t, k, rounds in [(40, 5, 1, 1500), (24, 5, 2, 1000)]:
        s = RandomAllocationSampler(n, t, k, seed=17)
        sizes = np.array([[b.size for b in round_of(s)] for _ in range(rounds)])
        assert np.all(sizes.sum(axis=1) == n * k)
        probs = stats.binom.pmf(np.arange(n + 1), n, k / t)
        for step in (0, t // 2, t - 1):
            assert chisquare(np.bincount(sizes[:, step], minlength=n + 1), probs) > P_MIN, (n, t, k, step)


def test_allocation_k_subsets_are_uniform():
    n, t, k = 3000, 5, 2
    s = RandomAllocationSampler(n, t, k, seed=23)
    cells = list(itertools.combinations(range(t), k))
    for _ in range(2):
        counts = Counter(steps_of(round_of(s), n))
        assert set(counts) <= set(cells)
        assert chisquare([counts[c] for c in cells], [1 / len(cells)] * len(cells)) > P_MIN


@pytest.mark.parametrize("n,t,k,rounds", [(3, 3, 1, 2700), (2, 4, 2, 3600)])
def test_allocation_joint_law_of_a_round_brute_force(n, t, k, rounds):
    # Every joint assignment (each record's k-subset) equally likely: uniform and independent.
    cells = list(itertools.product(itertools.combinations(range(t), k), repeat=n))
    s = RandomAllocationSampler(n, t, k, seed=31)
    counts = Counter(tuple(steps_of(round_of(s), n)) for _ in range(rounds))
    assert set(counts) <= set(cells)
    assert chisquare([counts[c] for c in cells], [1 / len(cells)] * len(cells)) > P_MIN


def test_allocation_records_are_independent_pair_co_occurrence():
    # Balls-in-bins: for distinct pairs the events "same batch" are pairwise independent, each
    # with probability 1/t; so adjacent and distant pairs both co-occur at rate 1/t, and their
    # count over the rounds has variance pairs·rounds·(1/t)(1 − 1/t).
    n, t, rounds = 60, 6, 300
    s = RandomAllocationSampler(n, t, 1, seed=41)
    near = far = 0
    for _ in range(rounds):
        bins = np.array([st[0] for st in steps_of(round_of(s), n)])
        near += int(np.sum(bins[:-1] == bins[1:]))
        far += int(np.sum(bins[: n // 2] == bins[n // 2 :]))
    for count, pairs in ((near, n - 1), (far, n // 2)):
        mean, sd = pairs * rounds / t, math.sqrt(pairs * rounds * (1 / t) * (1 - 1 / t))
        assert abs(count - mean) < 4.5 * sd, (count, mean, sd)


def test_allocation_refusals_and_accountant_event():
    with pytest.raises(ValueError, match="larger than num_steps"):
        RandomAllocationSampler(10, 3, 4)
    for bad in [(0, 3, 1), (10, 0, 1), (10, 3, 0)]:
        with pytest.raises(ValueError):
            RandomAllocationSampler(*bad)
    with pytest.raises(TypeError):
        RandomAllocationSampler(10, 3.0)
    with pytest.raises(ValueError):
        BallsInBinsSampler(10, 0)
    s = RandomAllocationSampler(100, 10, 3)
    ev = A.RandomAllocationSampledEvent(10, 3, A.GaussianEvent(2.0))
    assert s.accountant_event(2.0, 25) == A.SelfComposedEvent(ev, 3)  # a cut round counts whole
    assert s.accountant_event(2.0, 30) == A.SelfComposedEvent(ev, 3)
    assert s.accountant_event(2.0, 0) == A.SelfComposedEvent(ev, 0)
    b = BallsInBinsSampler(100, 4)
    assert b.accountant_event(1.5, 9) == A.SelfComposedEvent(A.BallsInBinsSampledEvent(4, A.GaussianEvent(1.5)), 3)
    assert b.accountant_event(0.0, 9) == A.NonPrivateEvent()
    with pytest.raises(ValueError):
        b.accountant_event(-1.0, 9)


def test_allocation_streams_are_os_keyed_unless_seeded():
    a, b = RandomAllocationSampler(500, 5, 2, seed=3), RandomAllocationSampler(500, 5, 2, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(list(a) + list(a), list(b) + list(b)))
    u, v = RandomAllocationSampler(500, 5, 2), RandomAllocationSampler(500, 5, 2)
    assert not all(np.array_equal(x, y) for x, y in zip(list(u), list(v)))


# ============================================================================ balls-in-bins


def test_balls_in_bins_once_per_epoch_and_multinomial_sizes():
    s = BallsInBinsSampler(4, 3, seed=2)
    assert (s.num_batches, len(s), s.sampling_probability, s.policy) == (3, 3, 1 / 3, "balls_in_bins")
    assert s.expected_batch_size == pytest.approx(4 / 3)
    comps = [c for c in itertools.product(range(5), repeat=3) if sum(c) == 4]
    probs = [math.factorial(4) / math.prod(math.factorial(x) for x in c) / 3**4 for c in comps]
    counts = Counter()
    for _ in range(3000):
        batches = round_of(s)
        flat = np.concatenate(batches)
        assert np.array_equal(np.sort(flat), np.arange(4))  # each record exactly once
        counts[tuple(b.size for b in batches)] += 1
    assert set(counts) <= set(comps)
    assert chisquare([counts[c] for c in comps], probs) > P_MIN
    # and at a realistic size, every record once per epoch
    big = BallsInBinsSampler(10_000, 50)
    flat = np.concatenate(round_of(big))
    assert np.array_equal(np.sort(flat), np.arange(10_000))


# ============================================================================ resuming


def test_a_restored_allocation_sampler_starts_a_new_round():
    a = RandomAllocationSampler(20, 5, 2, seed=3)
    a.draw(), a.draw()
    st = a.state_dict()
    assert st == {"kind": "random_allocation", "population_size": 20, "num_steps": 5, "num_selected": 2,
                  "round": 0, "position": 2, "seeded": True}
    # plain values only: the round's assignment is never stored
    assert all(isinstance(v, (int, str, bool)) for v in st.values())
    rest = [a.draw() for _ in range(3)]
    assert a.position == 0 and len(rest) == 3
    next_round = round_of(a)
    b = RandomAllocationSampler(20, 5, 2, seed=3)
    b.load_state_dict(st)
    assert b.position == 0 and b.round == 0
    got = round_of(b)  # a whole new round: the interrupted one's steps 2..4 are skipped
    assert b.round == 1
    assert all(np.array_equal(x, y) for x, y in zip(got, next_round))  # seeded: round 1 of the stream
    assert all(len(x) == 2 for x in steps_of(got, 20))
    # unseeded too, and pickling drops the round in progress
    u = RandomAllocationSampler(50, 4, 1)
    u.draw()
    assert u.position == 1
    v = pickle.loads(pickle.dumps(u))
    assert v.position == 0 and "_state" in v.__dict__ and v.__dict__["_state"] is None
    assert all(len(x) == 1 for x in steps_of(round_of(v), 50))
    assert u.position == 1  # the original is untouched
    # refusals
    with pytest.raises(ValueError, match="num_selected"):
        RandomAllocationSampler(20, 5, 1).load_state_dict(st)
    with pytest.raises(ValueError, match="not the state"):
        BallsInBinsSampler(20, 5).load_state_dict(st)
    with pytest.raises(ValueError, match="position"):
        b.load_state_dict(dict(st, position=5))
    with pytest.raises(ValueError, match="round"):
        b.load_state_dict(dict(st, round=-2))
    bb = BallsInBinsSampler(20, 5)
    bb.draw()
    assert bb.state_dict() == {"kind": "balls_in_bins", "population_size": 20, "num_batches": 5, "round": 0,
                               "position": 1, "seeded": False}


def test_an_interrupted_round_is_accounted_as_a_whole_round(tmp_path):
    path = tmp_path / "l.jsonl"
    led = PrivacyLedger(path)
    s = RandomAllocationSampler(40, 5, 2, ledger=led)
    for _ in range(3):
        s.draw()
        led.record_release(SumQueryEvent(1.0, 2.0))
    st = s.state_dict()
    led.close()  # the process stops mid-round
    led = PrivacyLedger(path)
    r = RandomAllocationSampler(40, 5, 2, ledger=led)
    r.load_state_dict(st)
    for _ in range(7):  # a new whole round, then two steps of the next
        r.draw()
        led.record_release(SumQueryEvent(1.0, 4.0))
    samples = PrivacyLedger.load(path).samples
    assert [(x.round, x.step_in_round) for x in samples] == [(0, 0), (0, 1), (0, 2)] + [(1, i) for i in range(5)] + [
        (2, 0), (2, 1)
    ]
    ev = led.to_event()
    assert [type(e).__name__ for e in ev.events] == ["RandomAllocationSampledEvent", "SelfComposedEvent"]
    first, rest = ev.events
    assert (first.num_steps, first.num_selected) == (5, 2) and first.event.noise_multiplier == pytest.approx(2.0)
    assert first.event.noise_multiplier <= 2.0  # Eq. (1) rounds z down
    assert rest.count == 2 and rest.event.event.noise_multiplier == pytest.approx(4.0)
    assert rest.event == A.RandomAllocationSampledEvent(5, 2, rest.event.event)


# ============================================================================ the ledger


def alloc_entry(sample, rnd, step, t=4, k=1, n=20, policy="balls_in_bins", **kw):
    e = {"type": "sample", "sample": sample, "population_size": n, "sampling_probability": k / t, "policy": policy,
         "sample_size": None, "seeded": False, "round": rnd, "step_in_round": step, "round_steps": t,
         "round_selected": k}
    e.update(kw)
    return e


def query_entry(sample, stddev=2.0):
    return {"type": "sum_query", "sample": sample, "l2_norm_clip": 1.0, "stddev": stddev}


def write_entries(path, samples):
    """A ledger file: header, then each sample entry followed by one sum query."""
    lines = [{"format": "dpcore-privacy-ledger", "version": 1, "privacy_unit": "example"}]
    for e in samples:
        lines += [e, query_entry(e["sample"])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def poisson_entry(sample, **kw):
    e = {"type": "sample", "sample": sample, "population_size": 20, "sampling_probability": 0.1, "policy": "poisson",
         "sample_size": None, "seeded": False}
    e.update(kw)
    return e


def test_ledger_round_trip_and_the_fast_reader_refuses_the_new_entries(tmp_path):
    path = tmp_path / "l.jsonl"
    with PrivacyLedger(path) as led:
        for policy_sampler in (
            TruncatedPoissonSampler(20, 0.3, 4, ledger=led), BallsInBinsSampler(20, 3, ledger=led),
            RandomAllocationSampler(20, 3, 2, ledger=led),
        ):
            for _ in range(4):
                policy_sampler.draw()
                led.record_release(SumQueryEvent(1.0, 3.0))
        written = led.samples
    loaded = PrivacyLedger.load(path)
    assert loaded.samples == written
    assert [(s.policy, s.round, s.step_in_round) for s in written] == (
        [("truncated_poisson", None, None)] * 4
        + [("balls_in_bins", 0, 0), ("balls_in_bins", 0, 1), ("balls_in_bins", 0, 2), ("balls_in_bins", 1, 0)]
        + [("random_allocation", 2, 0), ("random_allocation", 2, 1), ("random_allocation", 2, 2),
           ("random_allocation", 3, 0)]
    )
    assert written[0].sample_size == 4 and written[0].sampling_probability == 0.3
    assert written[8].sampling_probability == 2 / 3 and written[8].round_selected == 2 and written[8].round_steps == 3
    assert loaded.next_round == 4
    # The core's fast reader refuses each new kind of entry (the Python reader reads them):
    # an unknown policy, and unknown keys even on a known policy.
    lines = path.read_bytes().splitlines(keepends=True)
    header, first = lines[0], lines[1:3]
    assert _core.ledger_scan(header + lines[1].replace(b"truncated_poisson", b"poisson") + lines[2])[0] is not None
    assert _core.ledger_scan(header + b"".join(first)) == (None, 2)  # truncated_poisson
    ballsline = [x for x in lines if b"balls_in_bins" in x][0]
    allocline = [x for x in lines if b"random_allocation" in x][0]
    for line in (ballsline, allocline):
        entry = json.loads(line)
        entry["sample"] = 0
        assert _core.ledger_scan(header + json.dumps(entry).encode() + b"\n")[0] is None
        # the round keys on a poisson entry: refused by both readers
        entry.update(policy="poisson", sampling_probability=0.5)
        assert _core.ledger_scan(header + json.dumps(entry).encode() + b"\n")[0] is None
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(header + json.dumps(entry).encode() + b"\n")
        with pytest.raises(LedgerError, match="line 2"):
            PrivacyLedger.load(bad)


def test_a_ledger_without_the_new_policies_is_byte_identical(tmp_path):
    path = tmp_path / "l.jsonl"
    with PrivacyLedger(path) as led:
        led.record_sample(100, 0.1, "poisson")
        led.record_release(SumQueryEvent(1.0, 2.0))
        led.record_sample(100, None, "fixed_size_without_replacement", sample_size=10)
        led.record_release(SumQueryEvent(1.0, 2.0))
    assert path.read_bytes() == (
        b'{"format": "dpcore-privacy-ledger", "version": 1, "privacy_unit": "example"}\n'
        b'{"type": "sample", "sample": 0, "population_size": 100, "sampling_probability": 0.1, "policy": "poisson", '
        b'"sample_size": null, "seeded": false}\n'
        b'{"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0, "stddev": 2.0}\n'
        b'{"type": "sample", "sample": 1, "population_size": 100, "sampling_probability": 0.1, '
        b'"policy": "fixed_size_without_replacement", "sample_size": 10, "seeded": false}\n'
        b'{"type": "sum_query", "sample": 1, "l2_norm_clip": 1.0, "stddev": 2.0}\n'
    )
    assert _core.ledger_scan(path.read_bytes())[0] is not None  # still the fast reader's


BAD_LEDGERS = {
    "missing round keys": ([alloc_entry(0, 0, 0)], {"round": None}, "missing keys"),
    "round keys on poisson": ([poisson_entry(0, round=0)], {}, "unexpected"),
    "step beyond the round": ([alloc_entry(0, 0, 4)], {}, "step_in_round must be < round_steps"),
    "balls with k = 2": ([alloc_entry(0, 0, 0, k=2)], {}, "round_selected must be 1"),
    "q is not k/t": ([alloc_entry(0, 0, 0, sampling_probability=0.3)], {}, "differs from round_selected/round_steps"),
    "a sample size": ([alloc_entry(0, 0, 0, sample_size=5)], {}, "no sample_size"),
    "steps out of order": ([alloc_entry(0, 0, 1), alloc_entry(1, 0, 1)], {}, "follows step 1"),
    "a round skipped": ([alloc_entry(0, 0, 0), alloc_entry(1, 2, 0)], {}, "the next round is 1"),
    "first round not 0": ([alloc_entry(0, 1, 0)], {}, "the next round is 0"),
    "round not consecutive": (
        [alloc_entry(0, 0, 0), poisson_entry(1), alloc_entry(2, 0, 1)], {}, "round 0 is over"
    ),
    "t changes in a round": ([alloc_entry(0, 0, 0), alloc_entry(1, 0, 1, t=5)], {}, "changes its sampler"),
    "population changes in a round": (
        [alloc_entry(0, 0, 0), alloc_entry(1, 0, 1, n=21)], {}, "changes its sampler"
    ),
    "policy changes in a round": (
        [alloc_entry(0, 0, 0), alloc_entry(1, 0, 1, policy="random_allocation")], {}, "changes its sampler"
    ),
    "truncated without a cap": ([poisson_entry(0, policy="truncated_poisson")], {}, "needs sampling_probability"),
    "truncated with round keys": (
        [alloc_entry(0, 0, 0, policy="truncated_poisson", sample_size=3)], {}, "unexpected"
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LEDGERS))
def test_the_reader_refuses_malformed_or_misordered_rounds(tmp_path, case):
    entries, drop, match = BAD_LEDGERS[case]
    entries = [dict(e) for e in entries]
    for k in drop:
        entries[-1].pop(k)
    path = write_entries(tmp_path / "l.jsonl", entries)
    bad_line = 2 * len(entries)  # the last sample entry
    with pytest.raises(LedgerError, match=f"line {bad_line}: corrupted .*{match}"):
        PrivacyLedger.load(path)
    with pytest.raises(LedgerError, match=f"line {bad_line}"):
        PrivacyLedger(path)  # nor continued
    # the same file without its last sample is fine (the entries before it are valid)
    if len(entries) > 1:
        assert len(PrivacyLedger.load(write_entries(tmp_path / "ok.jsonl", entries[:-1])).samples) == len(entries) - 1


def test_recording_refuses_rounds_that_the_accountant_could_not_read(tmp_path):
    path = tmp_path / "l.jsonl"
    led = PrivacyLedger(path)
    kw = dict(round_steps=4, round_selected=1)
    led.record_sample(20, 0.25, "balls_in_bins", round=0, step_in_round=0, **kw)
    led.record_release(SumQueryEvent(1.0, 2.0))
    before = path.read_bytes()
    for bad, match in [
        (dict(round=2, step_in_round=0, **kw), "the next round is 1"),
        (dict(round=0, step_in_round=0, **kw), "follows step 0"),
        (dict(round=0, step_in_round=1, round_steps=5, round_selected=1), "changes its sampler"),
        (dict(round=1, step_in_round=0, round_steps=4, round_selected=2), "round_selected must be 1"),
    ]:
        with pytest.raises((LedgerError, ValueError), match=match):
            led.record_sample(20, None, "balls_in_bins", **bad)
    with pytest.raises(ValueError, match="needs round"):
        led.record_sample(20, 0.25, "balls_in_bins")
    with pytest.raises(ValueError, match="belong to allocation and epoch policies"):
        led.record_sample(20, 0.25, "poisson", round=1)
    with pytest.raises(ValueError, match="round_selected must be 1"):  # an epoch: one batch per record
        led.record_sample(20, 0.25, "shuffle", round=1, step_in_round=0, round_steps=4, round_selected=2)
    with pytest.raises(ValueError, match="with an epoch needs round"):
        led.record_sample(20, 0.25, "sequential", round=1)
    with pytest.raises(ValueError, match="needs sampling_probability"):
        led.record_sample(20, 0.25, "truncated_poisson")
    assert path.read_bytes() == before  # nothing written
    # a Poisson sample ends the round: round 0 cannot go on after it
    led.record_sample(20, 0.1, "poisson")
    led.record_release(SumQueryEvent(1.0, 2.0))
    with pytest.raises(LedgerError, match="round 0 is over"):
        led.record_sample(20, None, "balls_in_bins", round=0, step_in_round=1, **kw)
    assert led.next_round == 1
    led.record_sample(20, None, "balls_in_bins", round=1, step_in_round=3, **kw)  # a round may begin late
    led.record_release(SumQueryEvent(1.0, 2.0))
    led.close()
    assert [s.round for s in PrivacyLedger.load(path).samples] == [0, None, 1]


def test_matrix_factorization_queries_are_refused_on_the_new_policies(tmp_path):
    from dpcore.matrix_factorization import IDENTITY, Participation, StreamDeclaration

    decl = StreamDeclaration(IDENTITY, Participation(4), 8).to_json()
    mf = SumQueryEvent(1.0, 3.0, "matrix_factorization", "s1", decl)
    path = tmp_path / "l.jsonl"
    led = PrivacyLedger(path)
    before = path.read_bytes()
    for sampler in (BallsInBinsSampler(20, 4, ledger=led), RandomAllocationSampler(20, 4, 2, ledger=led),
                    TruncatedPoissonSampler(20, 0.25, 5, ledger=led)):
        sampler.draw()
        with pytest.raises(LedgerError, match="cyclic"):
            led.record_release(mf)
    assert path.read_bytes() == before


def test_rounds_become_allocation_events(tmp_path):
    path = tmp_path / "l.jsonl"
    led = PrivacyLedger(path)
    b = BallsInBinsSampler(30, 3, ledger=led)
    stddevs = [2.0, 1.5, 3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]  # round 0 has z_min 1.5
    for sd in stddevs:
        b.draw()
        led.record_release(SumQueryEvent(1.0, sd))
    t = TruncatedPoissonSampler(30, 0.2, 4, ledger=led)
    for _ in range(2):
        t.draw()
        led.record_release(SumQueryEvent(0.5, 1.0))
    r = RandomAllocationSampler(30, 4, 2, ledger=led)
    r.draw()
    led.record_release(SumQueryEvent(1.0, 2.0))
    r.draw()
    led.record_release(SumQueryEvent(1.0, 0.0))  # a non-private release: the round is
    r.draw()  # drawn, never released: costs nothing
    ev = led.to_event()
    parts = ev.events
    assert len(parts) == 4
    assert parts[0] == A.BallsInBinsSampledEvent(3, A.GaussianEvent(parts[0].event.noise_multiplier))
    assert parts[0].event.noise_multiplier == pytest.approx(1.5) and parts[0].event.noise_multiplier <= 1.5
    assert isinstance(parts[1], A.SelfComposedEvent) and parts[1].count == 2
    assert parts[1].event.event.noise_multiplier == pytest.approx(2.0)
    assert isinstance(parts[2], A.SelfComposedEvent) and parts[2].count == 2
    tp = parts[2].event
    assert (tp.sampling_probability, tp.max_batch_size, tp.population_size) == (0.2, 4, 30)
    assert tp.event.noise_multiplier == pytest.approx(2.0) and tp.event.noise_multiplier <= 2.0
    assert parts[3] == A.NonPrivateEvent()
    assert PrivacyLedger.load(path).to_event() == ev
    # replace-one: refused for the allocation policies, and by RDP for truncated Poisson
    with pytest.raises(ValueError, match="add_or_remove"):
        led.to_event("replace_one")
    with pytest.raises(ValueError, match="add_or_remove"):
        led.get_epsilon(1e-5, "rdp", neighboring="replace_one")
    assert "balls_in_bins" in rdp_relation_error(led.samples, "p", "replace_one")
    assert rdp_relation_error(led.samples, "p", "add_or_remove") is None
    tp_only = tmp_path / "t.jsonl"
    with PrivacyLedger(tp_only) as l2:
        TruncatedPoissonSampler(30, 0.2, 4, ledger=l2).draw()
        l2.record_release(SumQueryEvent(1.0, 2.0))
        assert "truncated_poisson" in rdp_relation_error(l2.samples, "p", "replace_one")
        assert l2.to_event("replace_one").events[0].event.noise_multiplier == pytest.approx(1.0)  # z halved


def test_a_round_with_a_discrete_gaussian_step_is_a_discrete_gaussian_round(tmp_path):
    led = PrivacyLedger(tmp_path / "l.jsonl")
    b = BallsInBinsSampler(30, 2, ledger=led)
    b.draw()
    led.record_release(SumQueryEvent(1.0, 2.0))
    b.draw()
    led.record_release(SumQueryEvent(1.0, 3.0, "discrete_gaussian"))
    (part,) = led.to_event().events
    assert isinstance(part.event, A.DiscreteGaussianEvent) and part.event.noise_multiplier == pytest.approx(2.0)


def test_seeded_samples_are_flagged_and_warned(tmp_path):
    led = PrivacyLedger(tmp_path / "l.jsonl")
    for s in (BallsInBinsSampler(30, 3, seed=1, ledger=led), TruncatedPoissonSampler(30, 0.2, 4, seed=1, ledger=led)):
        s.draw()
        led.record_release(SumQueryEvent(1.0, 2.0))
    assert [x.seeded for x in led.samples] == [True, True]
    with pytest.warns(LedgerWarning, match="2 sample.*test seed"):
        led.to_event()
    led2 = PrivacyLedger(tmp_path / "m.jsonl")
    BallsInBinsSampler(30, 3, ledger=led2).draw()
    led2.record_release(SumQueryEvent(1.0, 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        led2.to_event()


# ============================================================================ the aggregator


def make_samplers(ledger, n, seed):
    return [
        TruncatedPoissonSampler(n, 0.1, 12, seed=seed, ledger=ledger),
        RandomAllocationSampler(n, 5, 2, seed=seed, ledger=ledger),
        BallsInBinsSampler(n, 4, seed=seed, ledger=ledger),
    ]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_aggregator_with_each_sampler(tmp_path, which):
    n = 200
    x = np.random.default_rng(3).standard_normal((n, 6))
    # noise 0 (and a clip no record reaches): the release is the exact sum of the sampled records
    led = PrivacyLedger(tmp_path / "a.jsonl")
    sampler = make_samplers(led, n, 7)[which]
    agg = PrivateAggregator(GaussianSumQuery(1e6, 0.0), led, n, sampler=sampler)
    assert agg.sampler is sampler
    seen = 0
    for _ in range(2 * len(sampler)):
        idx = agg.sample()
        out = agg.aggregate(x[idx])
        np.testing.assert_allclose(out, x[idx].sum(axis=0), rtol=1e-10, atol=1e-10)
        if idx.size:
            np.testing.assert_allclose(out / idx.size, np.mean(x[idx], axis=0), rtol=1e-10, atol=1e-10)
        seen += idx.size
    if which:  # allocation: every record k times a round
        assert seen == 2 * n * sampler.num_selected
    with pytest.warns(LedgerWarning, match="test seed"):
        assert all(e == A.NonPrivateEvent() for e in _flat(led.to_event()))
    # private: the ledger's event is the sampler's accountant event
    led2 = PrivacyLedger(tmp_path / "b.jsonl")
    sampler = make_samplers(led2, n, None)[which]
    agg = PrivateAggregator(GaussianSumQuery(1.0, 1.25), led2, n, sampler=sampler)
    steps = 2 * len(sampler) + 1
    for _ in range(steps):
        idx = agg.sample()
        agg.aggregate(x[idx])
    flat = _flat(PrivacyLedger.load(led2.path).to_event())
    z = flat[0].event.noise_multiplier  # σ/S = 1.25, rounded down by Eq. (1)
    assert z == pytest.approx(1.25) and z <= 1.25
    want = sampler.accountant_event(z, steps)  # ⌈steps/t⌉ rounds: the cut round counts whole
    assert len(flat) == want.count and all(e == want.event for e in flat)


def _flat(event):
    out = []
    for e in event.events:
        out += [e.event] * e.count if isinstance(e, A.SelfComposedEvent) else [e]
    return out


def test_aggregator_refuses_a_sampler_that_does_not_fit(tmp_path):
    from dpcore.matrix_factorization import IDENTITY, Participation
    from dpcore.queries import MatrixFactorizationQuery

    led = PrivacyLedger(tmp_path / "a.jsonl")
    other = PrivacyLedger(tmp_path / "b.jsonl")
    q = GaussianSumQuery(1.0, 1.0)
    with pytest.raises(ValueError, match="aggregator's ledger"):
        PrivateAggregator(q, led, 50, sampler=BallsInBinsSampler(50, 5, ledger=other))
    with pytest.raises(ValueError, match="draws from"):
        PrivateAggregator(q, led, 51, sampler=BallsInBinsSampler(50, 5, ledger=led))
    with pytest.raises(ValueError, match="not both"):
        PrivateAggregator(q, led, 50, 0.1, sampler=TruncatedPoissonSampler(50, 0.1, 5, ledger=led))
    with pytest.raises(TypeError, match="sampler must be"):
        PrivateAggregator(q, led, 50, sampler=object())
    mfq = MatrixFactorizationQuery(1.0, 1.0, strategy=IDENTITY, participation=Participation(5), steps=10)
    with pytest.raises(ValueError, match="cyclic participation only"):
        PrivateAggregator(mfq, led, 50, sampler=RandomAllocationSampler(50, 5, ledger=led))
    agg = PrivateAggregator(q, led, 50, sampler=BallsInBinsSampler(50, 5, ledger=led))
    with pytest.raises(ValueError, match="seeded"):
        agg.sample(seed=1)
