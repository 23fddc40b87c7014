"""The samplers of dpcore.sampling in the torch and Keras adapters: make_private(sampler=...) and
make_private_with_epsilon(sampler=...) with truncated Poisson, balls-in-bins and random allocation.

Each case checks against an independent computation: the ledger's sample entries against the
sampler's policy and round structure, the zero-noise update against a per-record gradient sum
computed by hand on the indices the sampler drew, ε against the accountant run on the sampler's
own ``accountant_event``, the calibrated noise against the target on both sides of the grid.

TensorFlow and the CUDA build of torch abort when both are loaded into one process, so the Keras
cases run in a fresh process (as tests/test_mf_keras.py): the one Keras test collected in the
main run starts pytest on this file with DPCORE_SAMPLER_KERAS_CASES=1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

KERAS_CASES = os.environ.get("DPCORE_SAMPLER_KERAS_CASES") == "1"

DELTA = 1e-5
N, BS = 40, 8
# sampler -> (make_private options, steps per epoch/round, expected batch, accountant)
SAMPLERS = {
    "truncated_poisson": ({"max_batch_size": 11}, 5, None, "pld"),  # expected batch E[min(Bin(40, .2), 11)]
    "balls_in_bins": ({}, 5, 8.0, "rdp"),  # b = 40/8
    "random_allocation": ({"num_selected": 2}, 10, 8.0, "rdp"),  # t = 40·2/8
}


def eps_of(sampler, z, steps, accountant):
    from dpcore.accounting import make_accountant

    return make_accountant(accountant).compose(sampler.accountant_event(z, steps)).get_epsilon(DELTA)


def check_rounds(samples, t):
    """The allocation entries of a ledger: consecutive rounds 0, 1, ... of increasing steps < t."""
    rounds = [(s.round, s.step_in_round) for s in samples]
    assert all(s.round_steps == t for s in samples)
    for (r0, s0), (r1, s1) in zip(rounds, rounds[1:]):
        assert (r1 == r0 and s1 > s0) or (r1 == r0 + 1 and s1 == 0), rounds
    return rounds


if KERAS_CASES:
    import tensorflow as tf

    from dpcore.events import effective_noise_multiplier
    from dpcore.ledger import LedgerWarning, PrivacyLedger
    from dpcore.tensorflow import (
        BallsInBinsBatches,
        PoissonBatches,
        RandomAllocationBatches,
        TruncatedPoissonBatches,
        make_private,
        make_private_with_epsilon,
    )

    keras = tf.keras

    def data(n=N):
        rng = np.random.default_rng(0)
        return (rng.normal(size=(n, 5)) * 3).astype("float32"), rng.integers(0, 3, size=n)

    def logreg():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])

    def numpy_grads(w, b, x, y):
        # softmax cross-entropy per record: dL/dW = x (p - onehot)ᵀ, dL/db = p - onehot
        z = x @ w + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        e = p - np.eye(w.shape[1])[y]
        return np.einsum("bi,bj->bij", x, e), e

    def dp_model(tmp_path, kind, z=1.0, lr=0.5, **kw):
        opts = dict(SAMPLERS[kind][0])
        opts.update(kw)
        dp = make_private(
            logreg(), keras.optimizers.SGD(lr), noise_multiplier=z, max_grad_norm=1.0, population_size=N,
            expected_batch_size=BS, sampler=kind, ledger=PrivacyLedger(tmp_path / f"{kind}.jsonl"), **opts,
        )
        dp.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return dp

    @pytest.mark.parametrize("kind", list(SAMPLERS))
    def test_keras_fit_records_the_samplers_policy(tmp_path, kind):
        x, y = data()
        dp = dp_model(tmp_path, kind)
        batches = dp.batches(x, y)
        t = SAMPLERS[kind][1]
        assert len(batches) == t and batches.policy == kind
        assert dp.expected_batch_size == batches.expected_batch_size == batches.sampler.expected_batch_size
        if SAMPLERS[kind][2] is not None:
            assert dp.expected_batch_size == SAMPLERS[kind][2]
        with warnings.catch_warnings():
            warnings.simplefilter("error", LedgerWarning)  # unseeded, and RDP asked for directly: no warning
            dp.fit(batches, epochs=2, verbose=0)
            samples = dp.ledger.samples
            assert [s.policy for s in samples] == [kind] * (2 * t) and dp.ledger.num_releases == 2 * t
            if kind != "truncated_poisson":
                rounds = check_rounds(samples, t)
                assert [r for r, _ in rounds] == [0] * t + [1] * t  # a Keras epoch is a round
            else:
                assert all(s.sample_size == 11 for s in samples)
            z = effective_noise_multiplier([(1.0, 1.0)])  # as the ledger reads it back (Eq. (1), rounded down)
            assert dp.get_epsilon(DELTA) == eps_of(batches.sampler, z, 2 * t, SAMPLERS[kind][3])
        with pytest.raises(TypeError, match="DPModel.fit"):
            dp.evaluate(batches, verbose=0)  # the batches Keras reads are empty: refused outside fit

    @pytest.mark.parametrize("kind", list(SAMPLERS))
    def test_keras_zero_noise_update_is_the_clipped_sum_over_the_drawn_batch(tmp_path, kind):
        x, y = data()
        dp = dp_model(tmp_path, kind, z=0.0, lr=1.0)
        w0, b0 = [v.numpy().astype(np.float64) for v in dp.inner.trainable_variables]
        batches = dp.batches(x, y, seed=5)
        dp.fit(batches, epochs=1, steps_per_epoch=1, verbose=0)
        idx = batches.last_indices
        assert dp.ledger.num_releases == 1 and len(idx) > 0
        gw, gb = numpy_grads(w0, b0, x[idx].astype(np.float64), y[idx])
        from dpcore import clip_sum

        ref, _ = clip_sum([gw.reshape(len(idx), -1), gb], 1.0)
        w1, b1 = [v.numpy() for v in dp.inner.trainable_variables]
        den = batches.expected_batch_size
        np.testing.assert_allclose(w0 - w1, ref[0].reshape(w0.shape) / den, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(b0 - b1, ref[1] / den, rtol=1e-4, atol=1e-6)

    def test_keras_dataset_classes_and_refusals(tmp_path):
        x, y = data()
        from scipy.stats import binom

        mean = sum(min(j, 11) * binom.pmf(j, N, 0.2) for j in range(N + 1))  # E[min(Bin(40, .2), 11)]
        tp = TruncatedPoissonBatches(x, y, sampling_probability=0.2, max_batch_size=11)
        assert tp.expected_batch_size == pytest.approx(mean, rel=1e-12) and len(tp) == 5
        assert len(BallsInBinsBatches(x, y, num_batches=4)) == 4
        assert len(RandomAllocationBatches(x, y, batch_size=8, num_selected=3)) == 15
        with pytest.raises(ValueError, match="max_batch_size"):
            make_private(logreg(), keras.optimizers.SGD(0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                         population_size=N, expected_batch_size=BS, sampler="truncated_poisson")
        with pytest.raises(ValueError, match="sampler must be one of"):
            make_private(logreg(), keras.optimizers.SGD(0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                         population_size=N, expected_batch_size=BS, sampler="bins")
        with pytest.raises(ValueError, match="num_selected"):
            make_private(logreg(), keras.optimizers.SGD(0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                         population_size=N, expected_batch_size=BS, sampler="balls_in_bins", num_selected=2)
        with pytest.raises(ValueError, match="cyclic|CyclicBatches"):
            make_private(logreg(), keras.optimizers.SGD(0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                         population_size=N, batch_size=BS, noise_mechanism="blt", epochs=2, sampler="balls_in_bins")
        with pytest.raises(ValueError, match="population_size"):
            make_private(logreg(), keras.optimizers.SGD(0.5), noise_multiplier=1.0, max_grad_norm=1.0,
                         expected_batch_size=BS, sampler="balls_in_bins")
        dp = dp_model(tmp_path, "balls_in_bins")
        with pytest.raises(TypeError, match="batches"):
            dp.fit(x, y, verbose=0)  # arrays: the sampler's batches are required
        with pytest.raises(TypeError, match="batches"):
            dp.fit(PoissonBatches(x, y, sampling_probability=0.2), verbose=0)
        with pytest.raises(ValueError, match="made for"):
            dp.fit(BallsInBinsBatches(x, y, num_batches=4), verbose=0)  # another b
        with pytest.raises(ValueError, match="records"):
            dp.batches(x[:30], y[:30])
        (tmp_path / "o").mkdir()
        other = dp_model(tmp_path / "o", "balls_in_bins")
        b = dp.batches(x, y)
        dp.fit(b, epochs=1, steps_per_epoch=1, verbose=0)
        with pytest.raises(ValueError, match="ledger"):
            other.fit(b, verbose=0)  # bound to dp's ledger
        assert dp.ledger.num_releases == 1 and other.ledger.num_releases == 0

    @pytest.mark.parametrize("kind", list(SAMPLERS))
    def test_keras_make_private_with_epsilon_meets_the_target(tmp_path, kind):
        x, y = data()
        opts, t, _, acct = SAMPLERS[kind]
        dp = make_private_with_epsilon(
            logreg(), keras.optimizers.SGD(0.5), target_epsilon=3.0, target_delta=DELTA, epochs=2, max_grad_norm=1.0,
            population_size=N, expected_batch_size=BS, sampler=kind, ledger=PrivacyLedger(tmp_path / "l.jsonl"), **opts,
        )
        dp.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        batches = dp.batches(x, y)
        steps = 2 * t if kind != "random_allocation" else t  # k = 2: one round of t steps is two epochs
        z = dp.noise_multiplier
        assert eps_of(batches.sampler, z, steps, acct) <= 3.0 < eps_of(batches.sampler, z * (1 - 2e-5), steps, acct)
        dp.fit(batches, epochs=steps // t, verbose=0)
        assert dp.ledger.num_releases == steps
        assert dp.get_epsilon(DELTA) <= 3.0

else:
    torch = pytest.importorskip("torch")
    from torch import nn  # noqa: E402
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

    from dpcore.events import effective_noise_multiplier  # noqa: E402
    from dpcore.ledger import LedgerWarning  # noqa: E402
    from dpcore.torch import DPDataLoader, SamplerDataLoader, make_private, make_private_with_epsilon  # noqa: E402

    torch.set_num_threads(1)

    def mlp():
        return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4))

    def dataset(n=N):
        g = torch.Generator().manual_seed(1)
        return TensorDataset(torch.randn(n, 7, generator=g), torch.randint(0, 4, (n,), generator=g))

    def build(ledger, kind, *, z=1.0, clip=1.0, lr=0.2, seed=None, weights=None, **kw):
        torch.manual_seed(0)
        model = mlp()
        if weights is not None:
            model.load_state_dict(weights)
        opts = dict(SAMPLERS[kind][0])
        opts.update(kw)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        return make_private(
            model, opt, DataLoader(dataset(), batch_size=BS), noise_multiplier=z, max_grad_norm=clip,
            ledger=str(ledger), sampler=kind, seed=seed, **opts,
        )

    def train(model, opt, loader, steps):
        """``steps`` releases, pass after pass (breaking out of a pass when done); the indices
        drawn for each release."""
        drawn, done, cur = [], 0, []
        while done < steps:
            for x, y in loader:
                # the records of this (micro-)batch (a shuffled loader does not say: none)
                cur.append(loader.last_indices if hasattr(loader, "sampler") else np.zeros(0, np.int64))
                opt.zero_grad()
                if len(x):
                    nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if opt.last_step_released:
                    drawn.append(np.concatenate(cur))
                    cur, done = [], done + 1
                    if done == steps:
                        return drawn
        return drawn

    @pytest.mark.parametrize("kind", list(SAMPLERS))
    def test_each_sampler_trains_and_records_its_policy(tmp_path, kind):
        opts, t, den, acct = SAMPLERS[kind]
        model, opt, loader = build(tmp_path / "l.jsonl", kind, seed=3)
        assert isinstance(loader, SamplerDataLoader) and len(loader) == t and loader.policy == kind
        assert opt.expected_batch_size == loader.expected_batch_size == loader.sampler.expected_batch_size
        if den is not None:
            assert loader.expected_batch_size == den
        drawn = train(model, opt, loader, 2 * t)
        samples = opt.ledger.samples
        assert [s.policy for s in samples] == [kind] * (2 * t) and opt.ledger.num_releases == 2 * t
        if kind == "truncated_poisson":
            assert all(s.sample_size == 11 and s.sampling_probability == 0.2 for s in samples)
            assert max(len(d) for d in drawn) <= 11
        else:
            k = opts.get("num_selected", 1)
            assert [r for r, _ in check_rounds(samples, t)] == [0] * t + [1] * t
            for r in range(2):  # every record in exactly k steps of each round
                counts = np.bincount(np.concatenate(drawn[r * t : (r + 1) * t]), minlength=N)
                assert (counts == k).all()
        # a loop broken off after 2 batches: the next loop yields the rest of the epoch or round
        assert len(train(model, opt, loader, 2)) == 2 and loader.sampler.position % t == 2
        rest = 0
        for x, y in loader:
            opt.zero_grad()
            if len(x):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            rest += 1
        assert rest == t - 2 and loader.sampler.position % t == 0 and opt.ledger.num_releases == 3 * t
        if kind != "truncated_poisson":
            assert [r for r, _ in check_rounds(opt.ledger.samples, t)][2 * t :] == [2] * t

    @pytest.mark.parametrize("kind,micro", [(k, None) for k in SAMPLERS] + [("random_allocation", 3)])
    def test_zero_noise_update_is_the_sum_of_per_record_gradients_over_the_drawn_batch(tmp_path, kind, micro):
        # noise 0, a clip norm no record reaches, plain SGD at lr 1: the update is the sum of the
        # per-record gradients of the records drawn, over the fixed denominator E[batch]
        model, opt, loader = build(tmp_path / "l.jsonl", kind, z=0.0, clip=1e6, lr=1.0, seed=11,
                                   max_physical_batch_size=micro)
        before = [p.detach().clone() for p in model.parameters()]
        (idx,) = train(model, opt, loader, 1)
        assert len(idx) > 0 and len(np.unique(idx)) == len(idx)
        xs, ys = dataset().tensors
        ref = mlp()
        for p, w in zip(ref.parameters(), before):
            p.data.copy_(w)
        total = [torch.zeros_like(w) for w in before]
        for i in idx:
            ref.zero_grad()
            nn.functional.cross_entropy(ref(xs[i : i + 1]), ys[i : i + 1]).backward()
            for a, p in zip(total, ref.parameters()):
                a += p.grad
        den = loader.sampler.expected_batch_size
        for w0, p, g in zip(before, model.parameters(), total):
            torch.testing.assert_close(w0 - p.detach(), g / den, rtol=1e-4, atol=1e-6)

    @pytest.mark.parametrize("kind", list(SAMPLERS))
    def test_get_epsilon_is_the_accounting_of_the_samplers_event(tmp_path, kind):
        _, t, _, acct = SAMPLERS[kind]
        model, opt, loader = build(tmp_path / "l.jsonl", kind, z=1.3)
        steps = t + t // 2 + 1  # a round cut short: counted whole by the ledger and the event
        train(model, opt, loader, steps)
        with warnings.catch_warnings():
            warnings.simplefilter("error", LedgerWarning)  # RDP asked for directly for allocation: no fallback warning
            eps = opt.get_epsilon(DELTA)
        # the ledger reads z back from the recorded (C, z·C) by Eq. (1), rounded down (the safe side)
        z = effective_noise_multiplier([(1.0, 1.3)])
        assert 1.3 * (1 - 1e-14) < z <= 1.3
        assert eps == eps_of(loader.sampler, z, steps, acct)
        if acct == "rdp":
            assert eps == eps_of(loader.sampler, z, 2 * t, "rdp") > eps_of(loader.sampler, z, t, "rdp")
            assert opt.get_epsilon(DELTA, accountant="rdp") == eps

    def test_poisson_sampling_keeps_working(tmp_path):
        for ps, sampler, cls in ((True, None, DPDataLoader), (None, "poisson", DPDataLoader), (True, "poisson", DPDataLoader),
                                 (False, "shuffle", None), (False, None, None)):
            model = mlp()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _, opt, loader = make_private(
                    model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(dataset(), batch_size=BS),
                    noise_multiplier=1.0, max_grad_norm=1.0, ledger=str(tmp_path / f"{ps}{sampler}.jsonl"),
                    poisson_sampling=ps, sampler=sampler,
                )
            deprecated = [w for w in caught if issubclass(w.category, DeprecationWarning)]
            assert len(deprecated) == (ps is not None) and all("sampler=" in str(w.message) for w in deprecated)
            if cls is not None:
                assert isinstance(loader, cls) and opt.expected_batch_size == 8.0
            else:
                assert type(loader).__name__ == "_ShuffledLoader"

    def test_bad_arguments_are_refused(tmp_path, monkeypatch):
        def mp(**kw):
            model = mlp()
            dl = kw.pop("dl", DataLoader(dataset(), batch_size=BS))
            return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), dl, noise_multiplier=1.0,
                                max_grad_norm=1.0, ledger=str(tmp_path / "l.jsonl"), **kw)

        with pytest.raises(ValueError, match="sampler must be one of"):
            mp(sampler="bins")
        with pytest.raises(ValueError, match="poisson_sampling=True means sampler='poisson'"), pytest.warns(DeprecationWarning):
            mp(sampler="balls_in_bins", poisson_sampling=True)
        with pytest.raises(ValueError, match="poisson_sampling=False means sampler='shuffle'"), pytest.warns(DeprecationWarning):
            mp(sampler="poisson", poisson_sampling=False)
        with pytest.raises(ValueError, match=r"needs max_batch_size.*ceil\(q·n \+ 4·sqrt\(q·n·\(1 − q\)\)\) = 19 here"):
            mp(sampler="truncated_poisson")
        with pytest.raises(ValueError, match="max_batch_size is the cap"):
            mp(sampler="balls_in_bins", max_batch_size=10)
        with pytest.raises(ValueError, match="num_selected is the k"):
            mp(sampler="truncated_poisson", max_batch_size=10, num_selected=2)
        with pytest.raises(ValueError, match="num_selected"):
            mp(sampler="random_allocation", num_selected=0)
        with pytest.raises(ValueError, match="max_batch_size"):
            mp(sampler="truncated_poisson", max_batch_size=0)
        with pytest.raises(ValueError, match="matrix-factorization"):
            mp(sampler="random_allocation", noise_mechanism="blt", epochs=2)
        with pytest.raises(ValueError, match="sampled batches"):
            mp(sampler="shuffle", max_physical_batch_size=4)
        with pytest.raises(ValueError, match="batch_size"):
            mp(sampler="balls_in_bins", dl=DataLoader(dataset(), batch_size=None))

        class Stream(IterableDataset):
            def __iter__(self):
                return iter(dataset())

        with pytest.raises(TypeError, match="map-style"):
            mp(sampler="balls_in_bins", dl=DataLoader(Stream(), batch_size=BS))
        model = mlp()
        with pytest.raises(ValueError, match="no certified PLD"):
            make_private_with_epsilon(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(dataset(), batch_size=BS), target_epsilon=2.0, target_delta=DELTA,
                                      epochs=1, max_grad_norm=1.0, sampler="balls_in_bins", accountant="pld")
        # data-parallel: refused (every rank would need its part of one global sample)
        import dpcore.torch as dt
        import dpcore.torch._samplers as ds

        monkeypatch.setattr(ds, "current_communicator", lambda: object())
        monkeypatch.setattr(dt, "current_communicator", lambda: object())
        with pytest.raises(ValueError, match="torch.distributed"):
            mp(sampler="random_allocation")

    def checkpoint(model, opt, path):
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        return torch.load(path, weights_only=True)

    @pytest.mark.parametrize("kind", ["random_allocation", "balls_in_bins"])
    def test_resume_starts_a_new_round_and_never_under_counts(tmp_path, kind):
        _, t, _, _ = SAMPLERS[kind]
        total, cut = 2 * t, 3  # uninterrupted: two whole rounds
        model, uninterrupted, loader = build(tmp_path / "a.jsonl", kind)
        train(model, uninterrupted, loader, total)

        model, opt, loader = build(tmp_path / "b.jsonl", kind)
        train(model, opt, loader, cut)
        assert loader.sampler.position == cut
        ck = checkpoint(model, opt, tmp_path / "ck.pt")
        saved = ck["optimizer"]["dpcore"]["data_loader"]
        assert saved["kind"] == "SamplerDataLoader" and saved["samples_drawn"] == cut
        assert set(saved["sampler"]) == {"kind", *loader.sampler._config(), "round", "position", "seeded"}
        opt.ledger.close()

        model, opt, loader = build(tmp_path / "b.jsonl", kind, weights=ck["model"])
        opt.load_state_dict(ck["optimizer"])
        assert loader.samples_drawn == cut and loader.sampler.position == 0
        drawn = train(model, opt, loader, total - cut)
        samples = opt.ledger.samples
        rounds = check_rounds(samples, t)
        # the interrupted round keeps its cut steps; the resumed run starts round 1 at step 0
        assert rounds[:cut] == [(0, s) for s in range(cut)] and rounds[cut] == (1, 0)
        assert [r for r, _ in rounds] == [0] * cut + [1] * t + [2] * (total - cut - t)
        k = SAMPLERS[kind][0].get("num_selected", 1)
        counts = np.bincount(np.concatenate(drawn[:t]), minlength=N)  # the resumed, whole round
        assert (counts == k).all()
        got, want = opt.get_epsilon(DELTA), uninterrupted.get_epsilon(DELTA)
        # three rounds recorded for 2t steps: more than the uninterrupted run's two, as the event says
        assert got > want
        z = effective_noise_multiplier([(1.0, 1.0)])
        assert got == eps_of(loader.sampler, z, 3 * t, "rdp") and want == eps_of(loader.sampler, z, 2 * t, "rdp")

    def test_truncated_poisson_resume_continues_the_pass(tmp_path):
        model, opt, loader = build(tmp_path / "a.jsonl", "truncated_poisson", seed=4)
        want = train(model, opt, loader, 8)
        wp = [p.detach().clone() for p in model.parameters()]
        model, opt, loader = build(tmp_path / "b.jsonl", "truncated_poisson", seed=4)
        got = train(model, opt, loader, 3)
        ck = checkpoint(model, opt, tmp_path / "ck.pt")
        opt.ledger.close()
        model, opt, loader = build(tmp_path / "b.jsonl", "truncated_poisson", seed=4, weights=ck["model"])
        opt.load_state_dict(ck["optimizer"])
        assert loader.sampler.position == 3 and loader.samples_drawn == 3
        got += train(model, opt, loader, 5)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))  # a seeded run draws the same samples
        for a, b in zip(model.parameters(), wp):
            assert torch.equal(a.detach(), b)
        assert opt.ledger.num_releases == 8
        # another sampler's state is refused, before anything is loaded
        _, opt2, loader2 = build(tmp_path / "c.jsonl", "balls_in_bins")
        with pytest.raises(ValueError, match="sampler='truncated_poisson'"):
            loader2.check_state_dict(ck["optimizer"]["dpcore"]["data_loader"])

    @pytest.mark.parametrize("kind", list(SAMPLERS))
    def test_make_private_with_epsilon_meets_the_target(tmp_path, kind):
        opts, t, _, acct = SAMPLERS[kind]
        model = mlp()
        model, opt, loader = make_private_with_epsilon(
            model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(dataset(), batch_size=BS),
            target_epsilon=2.0, target_delta=DELTA, epochs=2, max_grad_norm=1.0, sampler=kind,
            ledger=str(tmp_path / "l.jsonl"), **opts,
        )
        assert loader.policy == kind
        steps = 2 * t if kind != "random_allocation" else t  # k = 2: one round of t steps is two epochs
        z = opt.noise_multiplier
        # the smallest z to 1e-5: z meets the target, z 2e-5 lower misses it
        assert eps_of(loader.sampler, z, steps, acct) <= 2.0 < eps_of(loader.sampler, z * (1 - 2e-5), steps, acct)
        train(model, opt, loader, steps)
        assert opt.ledger.num_releases == steps
        assert opt.get_epsilon(DELTA) <= 2.0

    def test_make_private_with_epsilon_shuffle_is_not_amplified(tmp_path):
        # a shuffled batch is a Gaussian query on the whole data set: calibrating it as Poisson at
        # q = bs/n would spend several times the target
        model = mlp()
        model, opt, loader = make_private_with_epsilon(
            model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(dataset(), batch_size=BS, shuffle=True),
            target_epsilon=8.0, target_delta=DELTA, epochs=2, max_grad_norm=1.0, sampler="shuffle",
            ledger=str(tmp_path / "l.jsonl"),
        )
        train(model, opt, loader, 2 * len(loader))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LedgerWarning)  # shuffle: no amplification
            eps = opt.get_epsilon(DELTA)
        assert 7.0 < eps <= 8.0

    def test_keras_cases_in_subprocess():
        if importlib.util.find_spec("tensorflow") is None:
            pytest.skip("tensorflow not installed")
        env = dict(os.environ, DPCORE_SAMPLER_KERAS_CASES="1")
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rsx", "-p", "no:cacheprovider", __file__],
            capture_output=True, text=True, timeout=900, env=env,
        )
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        summary = r.stdout.strip().splitlines()[-1]
        assert "passed" in summary and not any(w in summary for w in ("skipped", "xfail", "failed", "error")), summary
