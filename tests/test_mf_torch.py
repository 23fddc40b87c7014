"""dpcore.torch with matrix-factorization (correlated) noise: make_private(noise_mechanism=...).

At noise 0 an MF run's updates are DP-SGD's on the same fixed batches; the noise added across
steps has the correlation C⁻¹C⁻ᵀ; the noise state is num_buffers·d float32 values; the ledger
holds one stream with the steps run and get_epsilon is the effective Gaussian's; the refusals;
and a run resumed from a checkpoint ends bit for bit where the uninterrupted one does."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Subset, TensorDataset  # noqa: E402

import dpcore.matrix_factorization as mf  # noqa: E402
from dpcore.ledger import LedgerError, LedgerWarning  # noqa: E402
from dpcore.matrix_factorization import BandedStrategy, BLTStrategy, Participation  # noqa: E402
from dpcore.queries import GaussianAverageQuery  # noqa: E402
from dpcore.torch import CyclicDataLoader, PlannedStepsWarning, make_private, make_private_with_epsilon  # noqa: E402

torch.set_num_threads(1)

DELTA = 1e-5
N, BS = 42, 8  # b = 5 fixed batches of 8, 2 records dropped


def mlp():
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 4))


def dataset(n=N):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 7, generator=g), torch.randint(0, 4, (n,), generator=g))


def build(ledger, *, inner="sgd", weights=None, loader=None, seed=3, z=0.8, **kw):
    torch.manual_seed(0)
    model = mlp()
    if weights is not None:
        model.load_state_dict(weights)
    if inner == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    kw.setdefault("noise_mechanism", "blt")
    kw.setdefault("epochs", 3)
    if kw["noise_mechanism"] is None:
        del kw["noise_mechanism"], kw["epochs"]
    loader = loader if loader is not None else DataLoader(dataset(), batch_size=BS)
    return make_private(
        model, opt, loader, noise_multiplier=z, max_grad_norm=1.0, ledger=str(ledger), seed=seed, **kw
    )


def train(model, opt, loader, steps):
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            if len(x):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if opt.last_step_released:
                done += 1
                if done == steps:
                    return


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def epsilon(opt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)  # seeded samples
        return opt.get_epsilon(DELTA)


def cyclic_order_loader(loader):
    """A plain DataLoader (shuffle=False) yielding the cyclic loader's batches in its order."""
    order = np.concatenate([loader.sampler.members(g) for g in range(loader.steps_per_epoch)])
    return DataLoader(Subset(dataset(), order.tolist()), batch_size=BS, shuffle=False)


# ------------------------------------------------------------------------------- the data


def test_cyclic_loader_fixed_batches(tmp_path):
    model, opt, loader = build(tmp_path / "l.jsonl", noise_mechanism="banded")
    assert isinstance(loader, CyclicDataLoader)
    assert len(loader) == 5 and loader.dropped == 2 and loader.expected_batch_size == BS
    assert loader.participation == Participation(5)
    seen = []
    for _ in range(2):
        for x, _y in loader:
            seen.append(loader.last_indices.copy())
            assert len(x) == BS
            opt.zero_grad()
            opt.step()
    assert all(np.array_equal(a, b) for a, b in zip(seen[:5], seen[5:]))  # same batches, same order
    assert np.unique(np.concatenate(seen[:5])).size == N - 2
    assert [s.policy for s in opt.ledger.samples] == ["cyclic"] * 10
    assert {s.sample_size for s in opt.ledger.samples} == {BS}


# ------------------------------------------------------------------ updates and the noise


@pytest.mark.parametrize("mech", ["blt", "banded", "identity"])
def test_zero_noise_equals_dpsgd_on_the_same_fixed_batches(tmp_path, mech):
    steps = 12
    kw = dict(noise_mechanism="banded", strategy=mf.IDENTITY) if mech == "identity" else dict(noise_mechanism=mech)
    model, opt, loader = build(tmp_path / "a.jsonl", z=0.0, **kw)
    plain = cyclic_order_loader(loader)
    train(model, opt, loader, steps)
    want = params(model)

    model2, opt2, loader2 = build(tmp_path / "b.jsonl", noise_mechanism=None, z=0.0, loader=plain, sampler="shuffle")
    train(model2, opt2, loader2, steps)
    for a, b in zip(params(model2), want):
        assert torch.equal(a, b)

    # the caller's own loader kept (its order is fixed): the same again
    model3, opt3, loader3 = build(tmp_path / "c.jsonl", z=0.0, loader=plain, keep_loader=True, **kw)
    assert type(loader3).__name__ == "FixedOrderLoader" and len(loader3) == 5
    train(model3, opt3, loader3, steps)
    for a, b in zip(params(model3), want):
        assert torch.equal(a, b)


def test_old_independent_value_still_works_and_warns(tmp_path):
    # noise_mechanism="independent" is noise_mechanism="banded" with strategy=IDENTITY (C = I): the same run
    with pytest.warns(DeprecationWarning, match="'independent' is deprecated.*IDENTITY"):
        model, opt, loader = build(tmp_path / "a.jsonl", noise_mechanism="independent", z=0.7)
    model2, opt2, loader2 = build(tmp_path / "b.jsonl", noise_mechanism="banded", strategy=mf.IDENTITY, z=0.7)
    assert opt.query.strategy == opt2.query.strategy == mf.IDENTITY
    train(model, opt, loader, 6)
    train(model2, opt2, loader2, 6)
    for a, b in zip(params(model), params(model2)):
        assert torch.equal(a, b)
    # and poisson_sampling= on this path (participation= decides the order) warns too
    with pytest.warns(DeprecationWarning, match="poisson_sampling= is deprecated"):
        build(tmp_path / "c.jsonl", noise_mechanism="banded", participation=Participation.cyclic_poisson(4, 0.5),
              poisson_sampling=True)


def test_independent_noise_is_dpsgd_noise(tmp_path):
    # C = I: the stream's noise is the independent Gaussian of the same keys (same seeds per release)
    steps = 7
    model, opt, loader = build(tmp_path / "a.jsonl", noise_mechanism="banded", strategy=mf.IDENTITY, z=0.7)
    plain = cyclic_order_loader(loader)
    train(model, opt, loader, steps)
    sigma = opt.query.stddev if hasattr(opt.query, "stddev") else opt._groups[0].gs.stddev
    assert sigma == pytest.approx(0.7 * np.sqrt(3))  # effective z·C·sens, sens = √epochs
    torch.manual_seed(0)
    m2 = mlp()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.2, momentum=0.9)
    m2, o2, l2 = make_private(
        m2, o2, plain, query=GaussianAverageQuery(1.0, sigma, BS), ledger=str(tmp_path / "b.jsonl"),
        sampler="shuffle", seed=3,
    )
    train(m2, o2, l2, steps)
    for a, b in zip(params(m2), params(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("strategy", [BandedStrategy([1.0, 0.6, 0.3]), BLTStrategy([0.8, 0.3], [0.5, 0.2])])
def test_noise_across_steps_has_the_correlation_of_c_inverse(tmp_path, strategy):
    # a model whose gradients are all zero: each release is the noise alone
    n, bs, epochs = 16, 4, 3
    steps = epochs * (n // bs)
    ds = TensorDataset(torch.zeros(n, 100), torch.zeros(n))
    model = nn.Linear(100, 40, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    kind = "banded" if isinstance(strategy, BandedStrategy) else "blt"
    model, opt, loader = make_private(
        model, opt, DataLoader(ds, batch_size=bs), noise_mechanism=kind, strategy=strategy, epochs=epochs,
        noise_multiplier=1.3, max_grad_norm=2.0, ledger=str(tmp_path / "l.jsonl"), seed=5,
    )
    noise = []
    for _ in range(epochs):
        for x, _y in loader:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            noise.append(model.weight.grad.detach().double().flatten().numpy().copy())
    w = np.stack(noise)  # steps × d
    assert w.shape == (steps, 4000) and model.weight.grad.dtype == torch.float32
    sigma = opt._groups[0].gs.stddev / bs
    cinv = np.linalg.inv(strategy.matrix(steps))
    want = sigma**2 * cinv @ cinv.T
    got = w @ w.T / w.shape[1]
    # sampling error of a mean of d products of jointly Gaussian values
    se = np.sqrt((np.outer(np.diag(want), np.diag(want)) + want**2) / w.shape[1])
    assert np.all(np.abs(got - want) < 5 * se), np.max(np.abs(got - want) / se)
    # and it is not independent noise: the first off-diagonal is clearly negative (C⁻¹ = I − c_1 L + …)
    assert np.mean(np.diag(got, 1)) < -10 * np.mean(np.diag(se, 1))


@pytest.mark.parametrize("strategy", [BandedStrategy([1.0, 0.5, 0.25, 0.1]), BLTStrategy([0.9, 0.5, 0.1], [0.3, 0.2, 0.1])])
def test_noise_state_memory(tmp_path, strategy):
    kind = "banded" if isinstance(strategy, BandedStrategy) else "blt"
    model, opt, loader = build(tmp_path / "l.jsonl", noise_mechanism=kind, strategy=strategy)
    d = sum(p.numel() for p in model.parameters())
    train(model, opt, loader, 3)
    assert opt.noise_state_nbytes == strategy.num_buffers * d * 4
    assert all(g.dtype == np.float32 for g in opt._groups[0].gs.noise.parts.values())


def test_ledger_holds_one_stream_and_epsilon(tmp_path):
    model, opt, loader = build(tmp_path / "l.jsonl", z=1.1)
    train(model, opt, loader, 15)  # the 3 planned epochs
    led = opt.ledger
    (sid, dec), = led.streams.items()
    assert dec.steps == 15 and dec.participation == Participation(5, 3)
    assert dec.strategy == opt.query.strategy
    qs = [q for s in led.samples for q in s.queries]
    assert len(qs) == 15 and {q.stream for q in qs} == {sid} and {q.mechanism for q in qs} == {"matrix_factorization"}
    eps = epsilon(opt)
    want = mf.epsilon(1.1, DELTA, participation=Participation(5, 3), steps=15)
    assert np.isfinite(eps) and eps == pytest.approx(want, rel=1e-6)
    # the same ε as one Gaussian mechanism at z: independent of the strategy
    model2, opt2, loader2 = build(tmp_path / "m.jsonl", z=1.1, noise_mechanism="banded", strategy=mf.IDENTITY)
    train(model2, opt2, loader2, 15)
    assert epsilon(opt2) == pytest.approx(eps, rel=1e-6)


def test_make_private_with_epsilon_calibrates_the_effective_noise(tmp_path):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = make_private_with_epsilon(
        model, opt, DataLoader(dataset(), batch_size=BS), target_epsilon=3.0, target_delta=DELTA, epochs=2,
        max_grad_norm=1.0, noise_mechanism="banded", ledger=str(tmp_path / "l.jsonl"), seed=1,
    )
    z = opt.noise_multiplier
    assert z == opt.query.noise_multiplier and 0 < z < 10
    train(model, opt, loader, 10)
    eps = epsilon(opt)
    assert eps <= 3.0 and eps > 2.9


def test_cyclic_poisson_sampling(tmp_path):
    part = Participation.cyclic_poisson(4, 0.5)
    model, opt, loader = build(tmp_path / "l.jsonl", noise_mechanism="banded", participation=part, epochs=2)
    assert loader.participation == part and loader.expected_batch_size == pytest.approx(0.5 * N / 4)
    assert opt.query.strategy.bands <= 4
    groups = loader.sampler.groups()
    t = 0
    for x, _y in loader:
        assert np.all(groups[loader.last_indices] == t % 4)
        opt.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), _y).backward()
        opt.step()
        t += 1
    train(model, opt, loader, 4)
    assert [s.policy for s in opt.ledger.samples] == ["cyclic_poisson"] * 8
    want = mf.epsilon(0.8, DELTA, participation=Participation.cyclic_poisson(4, 0.5, 2), steps=8)
    assert epsilon(opt) == pytest.approx(want, rel=1e-6)


def test_micro_batches_release_the_same(tmp_path):
    model, opt, loader = build(tmp_path / "a.jsonl")
    train(model, opt, loader, 6)
    m2, o2, l2 = build(tmp_path / "b.jsonl", max_physical_batch_size=3)
    train(m2, o2, l2, 6)
    for a, b in zip(params(m2), params(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_bfloat16_autocast_keeps_float32_noise(tmp_path):
    model, opt, loader = build(tmp_path / "l.jsonl")
    for x, y in loader:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        nn.functional.cross_entropy(out.float(), y).backward()
        opt.step()
    assert all(g.dtype == np.float32 for g in opt._groups[0].gs.noise.parts.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------- refusals


def test_refusals(tmp_path):
    led = str(tmp_path / "l.jsonl")
    shuffled = DataLoader(dataset(), batch_size=BS, shuffle=True)
    with pytest.raises(ValueError, match="reshuffles every epoch"):
        build(led, loader=shuffled, keep_loader=True)
    with pytest.raises(ValueError, match="blt"):
        build(led, participation=Participation.cyclic_poisson(4, 0.5))
    with pytest.raises(ValueError, match="at most that many bands"):
        build(led, noise_mechanism="banded", strategy=BandedStrategy([1, 0.5, 0.4, 0.3, 0.2]),
              participation=Participation.cyclic_poisson(4, 0.5))
    with pytest.raises(ValueError, match="participation=Participation.cyclic_poisson"), pytest.warns(DeprecationWarning):
        build(led, noise_mechanism="banded", poisson_sampling=True)
    with pytest.raises(ValueError, match="strategy is a BLTStrategy"):
        build(led, noise_mechanism="banded", strategy=BLTStrategy([0.5], [0.5]))
    with pytest.raises(ValueError, match="strategy is a BandedStrategy"):
        build(led, noise_mechanism="blt", strategy=BandedStrategy([1, 0.5]))
    with pytest.raises(ValueError, match="C = I"), pytest.warns(DeprecationWarning):
        build(led, noise_mechanism="independent", strategy=BandedStrategy([1, 0.5]))
    with pytest.raises(ValueError, match="declares 7 batches per epoch"):
        build(led, participation=Participation.cyclic(7))
    with pytest.raises(ValueError, match="poisson_sampling=False"), pytest.warns(DeprecationWarning):
        build(led, participation=Participation.cyclic_poisson(4, 0.5), poisson_sampling=False)
    with pytest.raises(TypeError, match="epochs"):
        build(led, epochs=None)
    with pytest.raises(ValueError, match="noise_mechanism must be one of"):
        build(led, noise_mechanism="dense")
    with pytest.raises(ValueError, match="flat clipping"):
        build(led, clipping="per_layer")
    with pytest.raises(ValueError, match="discrete"), pytest.warns(DeprecationWarning):
        build(led, mechanism="discrete_gaussian")
    with pytest.raises(ValueError, match="grad_scaler"):
        build(led, grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="configure matrix-factorization noise"):
        build(led, noise_mechanism=None, strategy=BandedStrategy([1.0]))
    with pytest.raises(ValueError, match="larger than the dataset"):
        build(led, loader=DataLoader(dataset(), batch_size=N + 1))


def test_the_default_path_is_unchanged(tmp_path):
    from dpcore.torch import DPDataLoader

    model, opt, loader = build(tmp_path / "l.jsonl", noise_mechanism=None)
    assert isinstance(loader, DPDataLoader) and opt._queries.groups_of("matrix_factorization") == []
    assert not opt._noise.correlated


def test_every_drawn_batch_must_be_released(tmp_path):
    model, opt, loader = build(tmp_path / "l.jsonl")
    it = iter(loader)
    x, y = next(it)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    next(it)  # drawn, never stepped
    x, y = next(it)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="every batch of the cycle must be released"):
        opt.step()
    assert opt.ledger.num_releases == 1


def test_training_past_the_planned_steps_warns_once(tmp_path):
    model, opt, loader = build(tmp_path / "l.jsonl", epochs=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        train(model, opt, loader, 12)
    hits = [x for x in w if issubclass(x.category, PlannedStepsWarning)]
    assert len(hits) == 1
    eps12 = epsilon(opt)
    assert eps12 > mf.epsilon(0.8, DELTA, participation=Participation(5, 1), steps=5)
    assert opt.ledger.streams and list(opt.ledger.streams.values())[0].steps == 5


# ----------------------------------------------------------------------- checkpoint/resume


def checkpoint(model, opt, path):
    tmp = str(path) + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)
    return torch.load(path, weights_only=True)


def strip(samples, stream):
    """The samples with their one stream id checked and left out (each run draws its own id)."""
    import dataclasses

    out = []
    for s in samples:
        assert {q.stream for q in s.queries} == {stream}
        out.append(dataclasses.replace(s, queries=tuple(dataclasses.replace(q, stream=None, declaration=None,
                                                                            mechanism="gaussian") for q in s.queries)))
    return out


def noise_state(opt):
    opt.state_dict()  # waits for the last release's buffer update (it runs behind the ledger write)
    return [(k, g.step, g.state_dict()["state"].copy()) for k, g in sorted(opt._groups[0].gs.noise.parts.items())]


@pytest.mark.parametrize("mech,inner,part", [
    ("blt", "sgd", None), ("banded", "adam", None), ("banded", "sgd", Participation.cyclic_poisson(3, 0.6)),
])
def test_resumed_run_equals_uninterrupted(tmp_path, mech, inner, part):
    kw = dict(noise_mechanism=mech, inner=inner, participation=part, epochs=3 if part is None else 4)
    total, k = 12, 7  # the checkpoint falls in the middle of the second epoch
    model, opt, loader = build(tmp_path / "a.jsonl", **kw)
    train(model, opt, loader, total)
    want, want_eps, want_samples, want_noise = params(model), epsilon(opt), opt.ledger.samples, noise_state(opt)
    want_stream = opt._groups[0].gs.stream

    model, opt, loader = build(tmp_path / "b.jsonl", **kw)
    train(model, opt, loader, k)
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    stream = opt._groups[0].gs.stream
    opt.ledger.close()
    dp = ck["optimizer"]["dpcore"]
    assert dp["releases"] == k and dp["data_loader"]["samples_drawn"] == k
    enc = dp["groups"][0]["global_state"]["fields"]
    assert enc["step"] == k and enc["stream"] == stream and enc["noise"]["step"] == k

    model, opt, loader = build(tmp_path / "b.jsonl", weights=ck["model"], **kw)
    opt.load_state_dict(ck["optimizer"])
    assert opt._groups[0].gs.step == k and opt._groups[0].gs.stream == stream and loader.samples_drawn == k
    train(model, opt, loader, total - k)

    for a, b in zip(params(model), want):
        assert torch.equal(a, b)
    assert strip(opt.ledger.samples, stream) == strip(want_samples, want_stream) and len(opt.ledger.streams) == 1
    assert epsilon(opt) == want_eps
    for (k1, s1, a1), (k2, s2, a2) in zip(noise_state(opt), want_noise):
        assert (k1, s1) == (k2, s2) and np.array_equal(a1, a2)
    assert want_stream != stream  # (two runs, two streams: ids come from the OS)


def test_unseeded_resume_continues_the_same_cycle(tmp_path):
    model, opt, loader = build(tmp_path / "l.jsonl", seed=None)
    order = [loader.sampler.members(g) for g in range(5)]
    train(model, opt, loader, 3)
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    opt.ledger.close()
    model, opt, loader = build(tmp_path / "l.jsonl", seed=None, weights=ck["model"])
    perm = loader.sampler.permutation.copy()
    opt.load_state_dict(ck["optimizer"])
    assert not np.array_equal(perm, loader.sampler.permutation)  # a fresh OS key, replaced by the stored one
    seen = []
    for x, y in loader:
        seen.append(loader.last_indices.copy())
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert len(seen) == 2 and all(np.array_equal(a, b) for a, b in zip(seen, order[3:]))
    assert opt.ledger.num_releases == 5 and len(opt.ledger.streams) == 1


def test_checkpoint_refusals(tmp_path):
    model, opt, loader = build(tmp_path / "l.jsonl")
    train(model, opt, loader, 2)
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    train(model, opt, loader, 1)  # recorded after the checkpoint
    opt.ledger.close()
    model, opt, loader = build(tmp_path / "l.jsonl", weights=ck["model"])
    with pytest.raises(LedgerError, match="matrix-factorization"):
        opt.load_state_dict(ck["optimizer"], ledger_ahead="keep")
    opt.ledger.close()
    # another strategy (or noise) is refused
    model, opt, loader = build(tmp_path / "l.jsonl", noise_mechanism="banded")
    with pytest.raises(ValueError):
        opt.load_state_dict(ck["optimizer"])


def test_live_round_trip_is_a_no_op(tmp_path):
    model, opt, loader = build(tmp_path / "a.jsonl")
    train(model, opt, loader, 7)
    want = params(model)
    model, opt, loader = build(tmp_path / "b.jsonl")
    train(model, opt, loader, 3)
    opt.load_state_dict(opt.state_dict())
    train(model, opt, loader, 4)
    for a, b in zip(params(model), want):
        assert torch.equal(a, b)


def test_a_failed_release_keeps_stream_ledger_and_cycle_aligned(tmp_path, monkeypatch):
    model, opt, loader = build(tmp_path / "l.jsonl")
    train(model, opt, loader, 2)
    it = iter(loader)

    # the clipped sums fail after the ledger entry was written: the entry stands (over-counting,
    # the safe side) and the stream advances with it, so the next batch releases normally
    x, y = next(it)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    real = opt._batch.accumulate

    def boom(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(opt._batch, "accumulate", boom)
    before = params(model)
    with pytest.raises(RuntimeError, match="device lost"):
        opt.step()
    monkeypatch.setattr(opt._batch, "accumulate", real)
    assert all(torch.equal(a, b) for a, b in zip(params(model), before))  # nothing applied
    assert opt.ledger.num_releases == 3 and opt._groups[0].gs.step == 3 and loader.samples_drawn == 3
    assert opt._groups[0].gs.noise.step == 3
    x, y = next(it)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.ledger.num_releases == 4 and opt._groups[0].gs.step == 4

    # the ledger write fails: nothing is drawn from the stream, and the cycle has moved on, so
    # the next release is refused (resume from a checkpoint)
    x, y = next(it)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()

    def refuse(event):
        raise OSError("disk full")

    monkeypatch.setattr(opt.ledger, "record_release", refuse)
    with pytest.raises(OSError, match="disk full"):
        opt.step()
    monkeypatch.undo()
    assert opt._groups[0].gs.step == 4 and opt._groups[0].gs.noise.step == 4 and loader.samples_drawn == 5
    assert opt.ledger.num_releases == 4
    x, y = next(iter(loader))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="every batch of the cycle"):
        opt.step()


def test_default_strategy_follows_sgd_momentum(tmp_path):
    """With SGD(momentum=β) the default strategy is optimised for the momentum workload: it has
    a lower momentum-workload loss than the strategy optimised for plain prefix sums."""
    from dpcore.matrix_factorization import expected_loss, optimize as mf_optimize
    from dpcore.torch._mf import sgd_momentum

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    assert sgd_momentum(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == 0.9
    assert sgd_momentum(torch.optim.SGD(model.parameters(), lr=0.1)) == 0.0
    assert sgd_momentum(torch.optim.Adam(model.parameters())) == 0.0
    ds = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
    _, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), DataLoader(ds, batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism="blt", epochs=4, ledger=tmp_path / "l.jsonl",
    )
    got = opt._groups[0].query.strategy
    part = loader.participation
    steps = 4 * len(loader)
    plain = mf_optimize(steps, part, kind="blt")
    assert expected_loss(got, steps, part, momentum=0.9) < expected_loss(plain, steps, part, momentum=0.9)
    assert got == mf_optimize(steps, part, kind="blt", momentum=0.9)
