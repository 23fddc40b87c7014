"""dpcore.torch: factored fast path == generic vmap path == numpy reference; clip bounds; the
ledger per logical step; Poisson loader; frozen/shared parameters; fallback notice; errors."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dpcore  # noqa: E402
from dpcore.queries import GaussianAverageQuery, NestedQuery  # noqa: E402
from dpcore.queries.base import SumState  # noqa: E402
from dpcore.torch import DPDataLoader, DPOptimizer, FallbackWarning, PerRecordGradients, make_private  # noqa: E402

torch.set_num_threads(1)


class SeqNet(nn.Module):
    """Embedding -> Linear on a sequence (ghost norms) -> LayerNorm (generic) -> Linear."""

    def __init__(self, vocab=13, d=6, h=5, k=3, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.l1 = nn.Linear(d, h)
        self.ln = nn.LayerNorm(h)
        self.out = nn.Linear(h, k)

    def forward(self, idx):
        h = self.ln(torch.tanh(self.l1(self.emb(idx))))
        return self.out(h.mean(1))


def mlp():
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 4))


def reference_per_record(model, x, y):
    """Per-record gradients by torch.func over the whole model (float64 copy), as numpy."""
    from torch.func import functional_call, grad, vmap

    import copy

    m = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in m.named_parameters() if v.requires_grad}

    def loss(p, xi, yi):
        out = functional_call(m, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0), reduction="sum")

    xs = x.double() if x.is_floating_point() else x
    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, y)
    return {k: v.numpy() for k, v in g.items()}


def captured(model, x, y, mode):
    eng = PerRecordGradients(model, list(model.parameters()), mode=mode, loss_reduction="sum")
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    b, sq = eng.squared_norms()
    names = list(eng.param_names)
    c = torch.linspace(0.1, 1.0, b, dtype=torch.float64)
    sums = eng.clipped_sums([c] * len(sq))
    eng.remove()
    return names, [s.numpy() for s in sq], [s.detach().numpy() for s in sums], c.numpy()


@pytest.mark.parametrize(
    "make,inputs",
    [
        (mlp, lambda: (torch.randn(11, 7), torch.randint(0, 4, (11,)))),
        (SeqNet, lambda: (torch.randint(0, 13, (8, 10)), torch.randint(0, 3, (8,)))),
    ],
)
def test_fast_path_equals_generic_and_numpy(make, inputs):
    torch.manual_seed(1)
    model = make()
    x, y = inputs()
    ref = reference_per_record(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        fast = captured(model, x, y, "auto")
    gen = captured(model, x, y, "generic")
    assert fast[0] == gen[0]
    for name, sq_f, sq_g, s_f, s_g in zip(fast[0], fast[1], gen[1], fast[2], gen[2]):
        r = ref[name].reshape(len(y), -1)
        ref_sq = (r * r).sum(1)
        # the fast path's norms are upper bounds with a tiny rounding allowance
        np.testing.assert_allclose(sq_f, ref_sq, rtol=2e-5, atol=1e-9, err_msg=name)
        np.testing.assert_allclose(sq_g, ref_sq, rtol=2e-5, atol=1e-9, err_msg=name)
        ref_sum = np.tensordot(fast[3], ref[name], axes=([0], [0]))
        np.testing.assert_allclose(s_f, ref_sum, rtol=1e-4, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(s_g, ref_sum, rtol=1e-4, atol=1e-6, err_msg=name)


def test_long_sequence_uses_materialised_norms():
    # T·(din+dout) > din·dout selects the materialised branch; it must agree with the reference
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(2, 3), nn.Flatten(), nn.Linear(3 * 40, 2))
    x, y = torch.randn(5, 40, 2), torch.randint(0, 2, (5,))
    ref = reference_per_record(model, x, y)
    names, sq, sums, c = captured(model, x, y, "auto")
    for n, s, cs in zip(names, sq, sums):
        r = ref[n].reshape(5, -1)
        # float32 products carry their worst-case rounding bound (see test_factored_norms_bound)
        np.testing.assert_allclose(s, (r * r).sum(1), rtol=1e-4, err_msg=n)
        np.testing.assert_allclose(cs, np.tensordot(c, ref[n], axes=([0], [0])), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("t,din,dout", [(40, 2, 3), (6, 16, 16), (64, 128, 512), (1, 5, 7)])
@pytest.mark.parametrize("cancel", [False, True])
def test_factored_norms_bound_the_captured_gradient(t, din, dout, cancel):
    # The norm of Σ_t g_t a_tᵀ from float32 factors (ghost or materialised, float32 products
    # with their rounding bound) is never below the exact norm of the same factors, even when
    # the positions cancel (records whose gradient is tiny next to Σ_t ‖a_t‖‖g_t‖).
    from dpcore.torch._contrib import Factored, param_sq_norms

    gen = torch.Generator().manual_seed(t * 7 + din)
    a = torch.randn(9, t, din, generator=gen)
    g = torch.randn(9, t, dout, generator=gen)
    if cancel and t > 1:
        a[:, 1::2] = a[:, 0:-1:2] if t % 2 == 0 else a[:, 0:-1:2]
        g[:, 1::2] = -g[:, 0:-1:2] * (1 - 1e-4)
    w = nn.Parameter(torch.zeros(dout, din))
    sq, _ = param_sq_norms([Factored(w, a, g)], 9)
    exact = torch.einsum("bto,bti->boi", g.double(), a.double()).pow(2).sum((1, 2))
    # up to float64's own relative rounding, which clip_margin's (D+32)·2⁻⁵³ term covers
    assert torch.all(sq * (1 + 64 * 2.0**-53 * (din * dout + 32)) >= exact), (sq - exact)
    assert torch.all(sq <= exact * 1.05 + 1e-3 * (a.double().norm(dim=2) * g.double().norm(dim=2)).sum(1) ** 2)


@pytest.mark.parametrize("t,dout", [(40, 3), (6, 16), (128, 1024), (1, 7)])
@pytest.mark.parametrize("cancel", [False, True])
def test_bias_norms_bound_the_captured_gradient(t, dout, cancel):
    # A bias's Σ_t g_t is summed in float32 (no float64 copy of g) with its γ_t bound: the norm
    # is never below the exact one, and the clipped sum adds exactly the vectors it measured.
    from dpcore.torch._contrib import Factored, param_sq_norms

    gen = torch.Generator().manual_seed(t * 5 + dout)
    g = torch.randn(9, t, dout, generator=gen) * torch.logspace(-3, 3, 9)[:, None, None]
    if cancel and t > 1:
        g[:, 1::2] = -g[:, 0:-1:2] * (1 - 1e-5)
    b = nn.Parameter(torch.zeros(dout))
    use = Factored(b, None, g)
    sq, _ = param_sq_norms([use], 9)
    exact = g.double().sum(1).pow(2).sum(1)
    assert torch.all(sq * (1 + 64 * 2.0**-53 * (dout + 32)) >= exact), (sq - exact)
    assert torch.all(sq <= exact * 1.05 + 1e-3 * g.double().norm(dim=2).sum(1) ** 2)
    c = torch.rand(9, dtype=torch.float64, generator=gen)
    acc = torch.zeros(dout)
    use.add_clipped(c, acc)
    # exactly Σ_i c_i·(the measured vectors) up to the float32 rounding of that product ...
    cols = use.colsum if use.colsum is not None else g.sum(1)  # t = 1: g itself, no sum formed
    measured = (c[:, None] * cols.double()).sum(0)
    torch.testing.assert_close(acc.double(), measured, rtol=1e-5, atol=1e-6 * float(measured.abs().max()) + 1e-30)
    # ... and those vectors are within γ_t Σ_t |g_t| of the exact sums (cancellation included)
    err = (cols.double() - g.double().sum(1)).abs()
    gamma = t * 2.0**-24 / (1 - t * 2.0**-24)
    assert torch.all(err <= gamma * g.double().abs().sum(1) * (1 + 1e-6))


def test_clipped_records_within_bound_and_match_core():
    # noise_multiplier = 0: the release is exactly the clipped average; compare with the core
    torch.manual_seed(3)
    model = mlp()
    x, y = torch.randn(16, 7) * 10, torch.randint(0, 4, (16,))
    ref = reference_per_record(model, x, y)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    led = dpcore.PrivacyLedger(str(tmp_ledger()))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=16.0, ledger=led, loss_reduction="sum")
    led.record_sample(100, 0.16)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    core_sum, norms = dpcore.clip_sum([ref[n].reshape(16, -1) for n in names], 0.5)
    assert norms.max() > 0.5  # clipping is active
    for n, p, cs in zip(names, model.parameters(), core_sum):
        np.testing.assert_allclose(p.grad.numpy().reshape(-1), cs / 16.0, rtol=1e-4, atol=1e-6)
    # each record's clipped contribution is <= C
    eng = opt.engine
    c = dpcore.torch.clip_factors(torch.from_numpy(norms**2), 0.5, opt._queries.margins[0])
    assert float((c.numpy() * norms).max()) <= 0.5


def tmp_ledger():
    import tempfile, os

    return os.path.join(tempfile.mkdtemp(prefix="dpcore-test-"), "ledger.jsonl")


def ledger_entries(path):
    with open(path) as f:
        return [json.loads(line) for line in f][1:]


def digits_like(n=64, d=7, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g))


def test_make_private_ledger_per_logical_step_with_virtual_batches():
    torch.manual_seed(4)
    ds = digits_like(64)
    path = tmp_ledger()
    led = dpcore.PrivacyLedger(path)
    model = mlp()
    model, opt, dl = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  torch.utils.data.DataLoader(ds, batch_size=32), noise_multiplier=1.3,
                                  max_grad_norm=1.0, ledger=led, max_physical_batch_size=5, seed=7)
    assert isinstance(dl, DPDataLoader) and dl.sampling_probability == 0.5 and len(dl) == 2
    micro = releases = 0
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in dl:
        assert len(x) <= 5
        micro += 1
        opt.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        releases += opt.last_step_released
        if not opt.last_step_released:  # accumulating: parameters unchanged
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        else:
            before = [p.detach().clone() for p in model.parameters()]
    assert releases == 2 and micro > 2
    ents = ledger_entries(path)
    samples = [e for e in ents if e["type"] == "sample"]
    queries = [e for e in ents if e["type"] == "sum_query"]
    assert len(samples) == 2 and len(queries) == 2
    assert samples[0]["policy"] == "poisson" and samples[0]["sampling_probability"] == 0.5
    assert queries[0]["l2_norm_clip"] == 1.0 and queries[0]["stddev"] == pytest.approx(1.3)


def test_virtual_batches_equal_one_physical_batch():
    # micro-batched accumulation == the same logical batch in one piece (same seeded noise)
    ds = digits_like(40, seed=5)
    grads = []
    for mpb in (None, 3):
        torch.manual_seed(5)
        model = mlp()
        led = dpcore.PrivacyLedger(tmp_ledger())
        model, opt, dl = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      torch.utils.data.DataLoader(ds, batch_size=20), noise_multiplier=1.0,
                                      max_grad_norm=0.3, ledger=led, max_physical_batch_size=mpb, seed=11)
        dl.steps = 1
        for x, y in dl:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y, reduction="mean").backward()
            if opt.data_loader.logical_batch_complete:
                opt.original_optimizer.step = lambda: None  # keep .grad for the comparison
            opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_empty_poisson_batch_releases_pure_noise():
    ds = digits_like(30)
    led = dpcore.PrivacyLedger(tmp_ledger())
    dl = DPDataLoader(ds, 1e-9, ledger=led, steps=1)
    model = mlp()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=2.0,
                      max_grad_norm=1.0, expected_batch_size=dl.expected_batch_size, ledger=led, data_loader=dl)
    for x, y in dl:
        assert x.shape == (0, 7) and y.shape == (0,)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()  # NaN loss over no records: no record enters
        opt.step()
    assert led.num_releases == 1
    g = model[0].weight.grad
    assert torch.isfinite(g).all() and float(g.std()) > 0  # pure noise, std 2·1/(q·n)


def test_released_noise_is_the_cores_draw_with_the_plans_stddev_each_step():
    # The noise drawn ahead in the background must be, bit for bit, the core's draw for that step
    # with the query's stddev α·σ̃/den (rounded once), and never the previous step's draw.
    from dpcore.queries.base import derive_seed

    model = nn.Linear(5, 3)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=1.5,
                      max_grad_norm=2.0, expected_batch_size=4.0, seed=42)
    x = torch.zeros(0, 5)
    seen = []
    for step in range(3):
        opt.ledger.record_sample(100, 0.04)
        opt.zero_grad()
        model(x).sum().backward()
        opt.original_optimizer.step = lambda: None
        opt.step()
        for j, p in enumerate(model.parameters()):
            want = dpcore.gaussian_noise(tuple(p.shape), 1.5 * 2.0 / 4.0, seed=derive_seed(42, step, 0, j))
            assert np.array_equal(p.grad.numpy(), want)
        seen.append(model.weight.grad.clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


def test_release_event_matches_query():
    # the ledger's privacy tuple is the one GaussianSumQuery.get_noised_result reports
    model = mlp()
    for clipping in ("flat", "per_layer"):
        led = dpcore.PrivacyLedger(tmp_ledger())
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=1.1,
                          max_grad_norm=2.0, expected_batch_size=8.0, ledger=led, clipping=clipping)
        led.record_sample(80, 0.1)
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(8, 7)), torch.randint(0, 4, (8,))).backward()
        opt.step()
        q = opt.query
        gs = q.initial_global_state()
        template = [np.zeros(p.shape, np.float32) for p in model.parameters()]
        if isinstance(q, NestedQuery):
            tmpl = {n: t for n, t in zip(opt.param_names, template)}
            st = q.initial_sample_state(tmpl)
            st = q.accumulate_records(q.derive_sample_params(gs), st, {n: t[None] for n, t in tmpl.items()})
        else:
            st = q.initial_sample_state(template)
            st = q.accumulate_records(q.derive_sample_params(gs), st, [t[None] for t in template])
        _, _, ev = q.get_noised_result(st, gs)
        rec = led.samples[-1].queries
        assert rec == ev.privacy_tuples()
        assert led.samples[-1].noise_multiplier() == pytest.approx(1.1, rel=1e-9)
        opt.engine.remove()


def test_frozen_parameters_are_skipped():
    model = mlp()
    model[0].weight.requires_grad_(False)
    led = dpcore.PrivacyLedger(tmp_ledger())
    opt = DPOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), model=model,
                      noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0, ledger=led)
    assert opt.param_names == ["0.bias", "2.weight", "2.bias"]
    led.record_sample(40, 0.1)
    nn.functional.cross_entropy(model(torch.randn(4, 7)), torch.randint(0, 4, (4,))).backward()
    opt.step()
    assert model[0].weight.grad is None and model[0].bias.grad is not None


def test_shared_parameters_sum_their_uses():
    # one weight in two layers: its per-record gradient is the sum of both uses
    torch.manual_seed(5)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, nn.Tanh(), b)
    x, y = torch.randn(6, 4), torch.randint(0, 4, (6,))
    ref = reference_per_record(model, x, y)
    names, sq, sums, c = captured(model, x, y, "auto")
    assert names.count("0.weight") == 1 and "2.weight" not in names
    for n, s_ in zip(names, sq):
        r = ref[n].reshape(6, -1)
        np.testing.assert_allclose(s_, (r * r).sum(1), rtol=2e-5, err_msg=n)


def test_reused_module_is_handled():
    # one Linear applied twice: its per-record gradient sums both uses (a longer "sequence")
    torch.manual_seed(6)
    lin = nn.Linear(3, 3)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(x)))

    model = Twice()
    x, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    ref = reference_per_record(model, x, y)
    names, sq, sums, c = captured(model, x, y, "auto")
    for n, s in zip(names, sq):
        r = ref[n].reshape(6, -1)
        np.testing.assert_allclose(s, (r * r).sum(1), rtol=2e-5)


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.w


def test_fallback_notice_once():
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4, 2), Scale(2), Scale(2), nn.GroupNorm(1, 2))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = PerRecordGradients(model, list(model.parameters()))
    msgs = [str(x.message) for x in w if issubclass(x.category, FallbackWarning)]
    assert len(msgs) == 1 and msgs[0].count("Scale") == 1 and "Linear" not in msgs[0] and "Conv1d" not in msgs[0]
    kinds = {l.name: l.kind for l in eng.layers}
    assert kinds == {"0": "conv", "2": "linear", "3": "generic", "4": "generic", "5": "norm"}
    eng.remove()


def test_conv_generic_path_matches_reference():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    x, y = torch.randn(5, 1, 6, 6), torch.randint(0, 3, (5,))
    ref = reference_per_record(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        names, sq, sums, c = captured(model, x, y, "auto")
    for n, s, cs in zip(names, sq, sums):
        r = ref[n].reshape(5, -1)
        # materialised per-record gradients: the norm is that of the tensor whose clipped sum is
        # released (the same float32 values), so it matches the float64 reference to rounding
        np.testing.assert_allclose(s, (r * r).sum(1), rtol=2e-5, err_msg=n)
        np.testing.assert_allclose(cs, np.tensordot(c, ref[n], axes=([0], [0])), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("on_nonfinite", ["zero", "raise"])
def test_non_finite_record(on_nonfinite):
    """The default ("zero"): the record contributes nothing and the step releases (no control
    flow depends on it; tests/test_torch_nonfinite.py has every layer family); "raise" names it."""
    model = mlp()
    led = dpcore.PrivacyLedger(tmp_ledger())
    kw = {} if on_nonfinite == "zero" else {"on_nonfinite": on_nonfinite}
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=4.0, ledger=led, **kw)
    x = torch.randn(4, 7)
    x[2, 1] = float("nan")
    led.record_sample(40, 0.1)
    nn.functional.cross_entropy(model(x), torch.randint(0, 4, (4,))).backward()
    if on_nonfinite == "raise":
        with pytest.raises(ValueError, match="record 2"):
            opt.step()
        assert led.num_releases == 0
    else:
        opt.step()
        assert led.num_releases == 1 and opt.last_step_released
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_failure_part_way_through_accumulation_drops_every_accumulator():
    # Clipped sums accumulate in place; a micro-step that fails after some layers were added must
    # not leave a half-added batch behind: the next release holds only what came after it.
    class Loader:
        logical_batch_complete = False

    torch.manual_seed(8)
    xa, xb, xc = torch.randn(3, 7), torch.randn(3, 7), torch.randn(3, 7)
    y = torch.tensor([0, 1, 2])
    grads = []
    for fail in (True, False):
        torch.manual_seed(9)
        model, dl = mlp(), Loader()
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=0.7,
                          max_grad_norm=0.5, expected_batch_size=3.0, data_loader=dl, seed=3)
        opt.original_optimizer.step = lambda: None  # keep .grad for the comparison
        if fail:
            for x in (xa, xb):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                if x is xb:
                    from dpcore.torch import _contrib

                    orig = _contrib.Factored.add_clipped
                    calls = []

                    def fail_second(self, c, acc, cache=None):
                        calls.append(1)
                        if len(calls) == 2:
                            raise RuntimeError("boom")
                        return orig(self, c, acc, cache)

                    _contrib.Factored.add_clipped = fail_second
                    try:
                        with pytest.raises(RuntimeError, match="boom"):
                            opt.step()
                    finally:
                        _contrib.Factored.add_clipped = orig
                    assert all(a is None for a in opt._batch.acc)
                else:
                    opt.step()
        opt.ledger.record_sample(30, 0.1)
        dl.logical_batch_complete = True
        opt.zero_grad()
        nn.functional.cross_entropy(model(xc), y).backward()
        opt.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_batchnorm_refused():
    with pytest.raises(ValueError, match="BatchNorm"):
        PerRecordGradients(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), [])


def test_get_epsilon_reads_ledger():
    pytest.importorskip("dpcore.accounting")
    ds = digits_like(50)
    model = mlp()
    led = dpcore.PrivacyLedger(tmp_ledger())
    model, opt, dl = make_private(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                  torch.utils.data.DataLoader(ds, batch_size=10), noise_multiplier=1.0,
                                  max_grad_norm=1.0, ledger=led)
    for x, y in dl:
        opt.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert led.num_releases == 5
    eps = opt.get_epsilon(1e-5)
    assert eps == led.get_epsilon(1e-5) and 0 < eps < math.inf
    # more steps cost more
    for x, y in dl:
        opt.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.get_epsilon(1e-5) > eps


def test_lr_scheduler_and_bad_args():
    model = mlp()
    led = dpcore.PrivacyLedger(tmp_ledger())
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=4.0, ledger=led)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    led.record_sample(40, 0.1)
    nn.functional.cross_entropy(model(torch.randn(4, 7)), torch.randint(0, 4, (4,))).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.engine.remove()
    with pytest.raises(ValueError, match="clipping"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, noise_multiplier=1.0,
                    max_grad_norm=1.0, expected_batch_size=4.0, ledger=led, clipping="nope")
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, noise_multiplier=-1.0,
                    max_grad_norm=1.0, expected_batch_size=4.0, ledger=led)


def test_make_private_with_epsilon_calibrates_to_the_target():
    from dpcore import accounting
    from dpcore.torch import make_private_with_epsilon

    ds = digits_like(50)
    model = mlp()
    led = dpcore.PrivacyLedger(tmp_ledger())
    model, opt, dl = make_private_with_epsilon(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(ds, batch_size=10),
        target_epsilon=2.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0, ledger=led)
    q, steps = 10 / 50, 2 * 5
    z = opt.noise_multiplier
    assert z == accounting.calibrate_noise_multiplier(2.0, 1e-5, q, steps)
    assert accounting.epsilon(q, z, steps, 1e-5) <= 2.0 < accounting.epsilon(q, z * 0.99, steps, 1e-5)
    for _ in range(2):
        for x, y in dl:
            opt.zero_grad()
            if len(x):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert led.num_releases == steps
    assert opt.get_epsilon(1e-5) <= 2.0
    for bad in (dict(target_epsilon=0.0), dict(target_delta=1.0), dict(epochs=0)):
        kw = dict(target_epsilon=2.0, target_delta=1e-5, epochs=1, max_grad_norm=1.0)
        kw.update(bad)
        with pytest.raises(ValueError):
            make_private_with_epsilon(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1),
                                      torch.utils.data.DataLoader(ds, batch_size=10), **kw)


def test_old_parameter_names_still_work_with_a_deprecation_warning(tmp_path):
    import dpcore
    from dpcore.torch import DPDataLoader

    ds = torch.utils.data.TensorDataset(torch.randn(10, 2))
    with pytest.warns(DeprecationWarning, match="sampling_probability"):
        dl = DPDataLoader(ds, sample_rate=0.3, ledger=dpcore.PrivacyLedger(tmp_path / "l.jsonl"))
    assert dl.sampling_probability == 0.3 == dl.sample_rate
    with pytest.raises(TypeError, match="sampling_probability= only"):
        DPDataLoader(ds, 0.3, sample_rate=0.3, ledger=dpcore.PrivacyLedger(tmp_path / "m.jsonl"))


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_discrete_gaussian_release_in_the_optimizer(clipping):
    """The discrete Gaussian (DPOptimizer(mechanism=...), make_private(noise_mechanism=...)): the released gradient is the core's discrete release of the
    clipped sum (rounded onto the grid, integer noise, then divided), the ledger records the
    rounded sum's sensitivity C + √d·γ, and a zero-noise release is the clipped sum on the grid."""
    from dpcore.queries.base import derive_seed

    torch.manual_seed(3)
    x, y = torch.randn(6, 7), torch.randint(0, 4, (6,))
    grads = {}
    init = mlp().state_dict()
    for z in (0.0, 1.2):
        model = mlp()
        model.load_state_dict(init)
        led = dpcore.PrivacyLedger(tmp_ledger())
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=z,
                          max_grad_norm=0.5, expected_batch_size=4.0, ledger=led, clipping=clipping,
                          mechanism="discrete_gaussian", seed=5)
        led.record_sample(100, 0.04)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        grads[z] = [p.grad.detach().double().numpy().copy() for p in model.parameters()]
        plans = opt._queries.plans()  # the pending release's plans, else each group's next
        for g, plan in zip(opt._groups, plans):
            assert plan.mechanism == "discrete_gaussian"
            d = sum(model_p.numel() for k, model_p in enumerate(model.parameters()) if k in g.members)
            assert plan.event.mechanism == "discrete_gaussian"
            assert plan.event.l2_norm_clip >= plan.l2_norm_clip + math.sqrt(d) * plan.granularity
            # S is the square rounded up to an integer number of grid steps squared: within 1e-9.
            assert plan.event.l2_norm_clip <= (plan.l2_norm_clip + math.sqrt(d) * plan.granularity) * (1 + 1e-9)
            for k in g.members:  # on the grid γ/den (float32 holds these grid points exactly)
                steps = grads[z][k] * plan.denominator / plan.granularity
                np.testing.assert_array_equal(steps, np.round(steps))
        rec = led.samples[-1].queries
        assert all(q.mechanism == "discrete_gaussian" for q in rec)
        if z > 0:
            assert rec == tuple(p.event for p in plans)
        opt.engine.remove()
    # The zero-noise release is the clipped sum, rounded onto the grid.
    ref = mlp()
    ref.load_state_dict(init)
    per = reference_per_record(ref, x, y)
    names = [n for n, _ in ref.named_parameters()]
    arrays = [per[n].reshape(6, -1) for n in names]
    if clipping == "flat":
        clipped = [s / 4.0 for s in dpcore.clip_sum(arrays, 0.5)[0]]
    else:
        clips = dpcore.queries.per_layer_clip_norms(0.5, len(arrays))
        clipped = [dpcore.clip_sum([a], c)[0][0] / 4.0 for a, c in zip(arrays, clips)]
    for got, want in zip(grads[0.0], clipped):
        np.testing.assert_allclose(got.ravel(), want, atol=1e-6 / 4.0 + 2.0 ** -20)
    assert any(np.any(a != b) for a, b in zip(grads[0.0], grads[1.2]))


def test_discrete_release_of_a_sum_is_the_cores():
    """discrete_sum_release rounds each part's sum onto γ·α_j, adds N_ℤ noise of σ ≥ zc grid
    steps, and divides; seeded, it is reproducible; its variance is (zC)²."""
    s = np.full((200, 100), 0.3)
    out = dpcore.mechanism.discrete_sum_release([s], l2_norm_clip=2.0, noise_multiplier=1.5,
                                                granularity=2.0**-10, seed=4)[0]
    again = dpcore.mechanism.discrete_sum_release([s], l2_norm_clip=2.0, noise_multiplier=1.5,
                                                  granularity=2.0**-10, seed=4)[0]
    assert np.array_equal(out, again) and out.shape == s.shape
    k = out / 2.0**-10
    np.testing.assert_array_equal(k, np.round(k))
    noise = out - np.round(0.3 / 2.0**-10) * 2.0**-10
    assert abs(noise.var() / 9.0 - 1.0) < 6 * math.sqrt(2 / noise.size)
    with pytest.raises(ValueError, match="part_scales"):
        dpcore.mechanism.discrete_sum_release([s], l2_norm_clip=2.0, noise_multiplier=1.5, granularity=1e-3,
                                              part_scales=[1.0, 2.0])


def test_calibration_refuses_the_discrete_gaussian():
    ds = digits_like(32)
    model = mlp()
    with pytest.raises(ValueError, match="mechanism='gaussian' only"):
        dpcore.torch.make_private_with_epsilon(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(ds, batch_size=8),
            target_epsilon=2.0, target_delta=1e-5, epochs=1, max_grad_norm=1.0, noise_mechanism="discrete_gaussian",
        )


def test_make_private_takes_target_epsilon_and_the_one_noise_name():
    # make_private(target_epsilon=, target_delta=, epochs=) is make_private_with_epsilon
    ds = digits_like(32)

    def build(fn, **kw):
        torch.manual_seed(0)
        model = mlp()
        return fn(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(ds, batch_size=8),
                  max_grad_norm=1.0, ledger=tmp_ledger(), **kw)

    _, a, _ = build(make_private, target_epsilon=2.0, target_delta=1e-5, epochs=3)
    _, b, _ = build(dpcore.torch.make_private_with_epsilon, target_epsilon=2.0, target_delta=1e-5, epochs=3)
    assert a.noise_multiplier == b.noise_multiplier > 0
    _, c, _ = build(make_private, target_epsilon=2.0, target_delta=1e-5, epochs=3, sampler="balls_in_bins")
    _, d, _ = build(dpcore.torch.make_private_with_epsilon, target_epsilon=2.0, target_delta=1e-5, epochs=3,
                    sampler="balls_in_bins")
    assert c.noise_multiplier == d.noise_multiplier > 0
    with pytest.raises(ValueError, match="not both"):
        build(make_private, noise_multiplier=1.0, target_epsilon=2.0, target_delta=1e-5, epochs=3)
    with pytest.raises(TypeError, match="target_epsilon needs target_delta"):
        build(make_private, target_epsilon=2.0, epochs=3)
    with pytest.raises(TypeError, match="target_delta goes with target_epsilon"):
        build(make_private, noise_multiplier=1.0, target_delta=1e-5)
    with pytest.raises(TypeError, match="needs epochs"):
        build(make_private, target_epsilon=2.0, target_delta=1e-5)
    with pytest.raises(ValueError, match="epochs= alone goes with target_epsilon"):
        build(make_private, noise_multiplier=1.0, epochs=3)
    with pytest.raises(ValueError, match="accountant= is the calibration's"):
        build(make_private, noise_multiplier=1.0, accountant="rdp")
    # noise_mechanism= takes the per-step mechanisms too
    _, e, _ = build(make_private, noise_multiplier=1.0, noise_mechanism="discrete_gaussian")
    assert e._queries.mechanisms == ["discrete_gaussian"]
    with pytest.raises(ValueError, match="noise_mechanism must be one of"):
        build(make_private, noise_multiplier=1.0, noise_mechanism="laplace")


def test_old_mechanism_keyword_still_works_and_warns():
    ds = digits_like(32)

    def build(**kw):
        model = mlp()
        return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            torch.utils.data.DataLoader(ds, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
                            ledger=tmp_ledger(), **kw)

    with pytest.warns(DeprecationWarning, match="mechanism= is deprecated; it is called noise_mechanism= now"):
        _, opt, _ = build(mechanism="discrete_gaussian")
    assert opt._queries.mechanisms == ["discrete_gaussian"]
    with pytest.warns(DeprecationWarning, match="'discrete' is deprecated; it is called 'discrete_gaussian'"):
        _, opt, _ = build(noise_mechanism="discrete")
    assert opt._queries.mechanisms == ["discrete_gaussian"]
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="one run has one noise mechanism"):
        build(mechanism="discrete_gaussian", noise_mechanism="gaussian")


def test_the_shared_query_builder_is_the_torch_optimizers():
    # dpcore.queries._build.clipping_query (Keras, the custom-loop trainer) builds what the torch
    # optimizer builds, for every clipping mode and per-step noise
    from dpcore.queries._build import clipping_query
    from dpcore.torch._clip import build_query

    names = ["a.weight", "a.bias", "b.weight"]
    for clipping, c, scales in (("flat", 1.0, None), ("per_layer", 1.0, None), ("per_layer", [1.0, 2.0, 3.0], None),
                                ("joint", 1.0, [1.0, 2.0, 0.5])):
        for mech in ("gaussian", "discrete_gaussian"):
            ours = clipping_query(names, clipping=clipping, max_grad_norm=c, noise_multiplier=1.3, denominator=8.0,
                                  noise_mechanism=mech, joint_scales=scales)
            torch_q = build_query(names, noise_multiplier=1.3, max_grad_norm=c, expected_batch_size=8.0,
                                  clipping=clipping, joint_scales=scales, mechanism=mech, granularity=None)
            assert repr(ours) == repr(torch_q)
    as_list = clipping_query(3, clipping="per_layer", max_grad_norm=1.0, noise_multiplier=1.0, denominator=4.0)
    assert isinstance(as_list, NestedQuery) and len(as_list.leaf_queries) == 3
    with pytest.raises(ValueError, match="needs joint_scales"):
        clipping_query(3, clipping="joint", max_grad_norm=1.0, noise_multiplier=1.0, denominator=4.0)
    with pytest.raises(ValueError, match="needs clipping='per_layer'"):
        clipping_query(3, clipping="flat", max_grad_norm=[1.0, 1.0, 1.0], noise_multiplier=1.0, denominator=4.0)
