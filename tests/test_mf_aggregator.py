"""The numpy path: PrivateAggregator with a cyclic sampler and a MatrixFactorizationQuery."""

import warnings

import numpy as np
import pytest

import dpcore
from dpcore import PrivacyLedger, PrivateAggregator
from dpcore.ledger import LedgerWarning
from dpcore.matrix_factorization import BLTStrategy, Participation, epsilon, optimize
from dpcore.queries import GaussianSumQuery, MatrixFactorizationQuery
from dpcore.sampling import CyclicSampler, CyclicPoissonSampler

N, BATCH, EPOCHS = 60, 10, 3
B = N // BATCH


def _run(tmp_path, z, steps, seed=0, name="l.jsonl"):
    ledger = PrivacyLedger(tmp_path / name)
    sampler = CyclicSampler(N, BATCH, seed=seed, ledger=ledger)
    part = Participation.cyclic(B, EPOCHS)
    strategy = optimize(B * EPOCHS, part)
    q = MatrixFactorizationQuery(1.0, z, strategy=strategy, participation=part, steps=B * EPOCHS)
    agg = PrivateAggregator(q, ledger, N, sampler=sampler)
    data = np.random.default_rng(1).normal(size=(N, 5))
    outs = []
    for t in range(steps):
        idx = agg.sample()
        outs.append(agg.aggregate(data[idx], seed=100 + t))
    return ledger, outs, data, sampler


def test_aggregator_with_a_cyclic_sampler_releases_and_accounts_the_stream(tmp_path):
    ledger, outs, data, sampler = _run(tmp_path, 1.5, B * EPOCHS)
    assert len(ledger.streams) == 1 and ledger.num_releases == B * EPOCHS
    assert {s.policy for s in ledger.samples} == {"cyclic"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)  # the sampler was seeded (a test)
        eps = ledger.get_epsilon(1e-5)
    assert eps == pytest.approx(epsilon(1.5, 1e-5, participation=Participation.cyclic(B), steps=B * EPOCHS), rel=1e-9)


def test_at_noise_zero_the_releases_are_the_clipped_sums(tmp_path):
    _, outs, data, sampler = _run(tmp_path, 0.0, B + 2)
    ref = GaussianSumQuery(1.0, 0.0)
    for t, out in enumerate(outs):
        idx = sampler.members(t % B)
        st = ref.accumulate_records(1.0, ref.initial_sample_state(data[0]), data[np.sort(idx)])
        want, _, _ = ref.get_noised_result(st, ref.initial_global_state())
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)


def test_a_sampler_that_does_not_fit_is_refused(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.jsonl")
    part = Participation.cyclic(B)
    q = MatrixFactorizationQuery(1.0, 1.0, strategy=BLTStrategy([0.5], [0.3]), participation=part, steps=B)
    with pytest.raises(ValueError, match="ledger"):
        PrivateAggregator(q, ledger, N, sampler=CyclicSampler(N, BATCH))
    with pytest.raises(ValueError, match="follows"):
        PrivateAggregator(q, ledger, N, sampler=CyclicSampler(N, BATCH * 2, ledger=ledger))
    with pytest.raises(ValueError, match="population"):
        PrivateAggregator(q, ledger, N + 1, sampler=CyclicSampler(N, BATCH, ledger=ledger))
    with pytest.raises(ValueError, match="not both"):
        PrivateAggregator(q, ledger, N, 0.1, sampler=CyclicSampler(N, BATCH, ledger=ledger))
    with pytest.raises(TypeError, match="sampler"):
        PrivateAggregator(q, ledger, N, sampler=object())
    poisson = CyclicPoissonSampler(N, B, 0.5, ledger=ledger)
    with pytest.raises(ValueError, match="follows"):
        PrivateAggregator(q, ledger, N, sampler=poisson)
    agg = PrivateAggregator(q, ledger, N, sampler=CyclicSampler(N, BATCH, ledger=ledger))
    with pytest.raises(ValueError, match="seeded"):
        agg.sample(seed=3)
    assert dpcore.PrivateAggregator is PrivateAggregator
