"""Records whose per-record gradient is NaN or infinite (dpcore.torch, ``on_nonfinite=``).

The release path must not branch on one record (Cebere et al., PETS 2026: data-dependent control
flow in DP libraries). With the default ``on_nonfinite="zero"`` a bad record (NaN or ±inf in its
inputs or its target) contributes exactly zero, in every clipping group, and the step releases
as usual: at noise 0 the update equals that of the same batch without the record (checked
against brute force, one backward pass per clean record, and against dpcore on the clean batch),
and the ledger entries are identical. ``on_nonfinite="raise"`` raises, naming the record.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dpcore  # noqa: E402
from dpcore.torch import DPOptimizer, FallbackWarning, PerRecordGradients, clip_factors, clip_margin, make_private  # noqa: E402
from dpcore.torch._engine import MIN_FACTOR  # noqa: E402

torch.set_num_threads(1)

B, BAD, DEN = 8, 3, 7.0


def tmp_ledger():
    return os.path.join(tempfile.mkdtemp(prefix="dpcore-test-"), "ledger.jsonl")


def mse(out, y):
    return ((out - y) ** 2).sum()


# ----------------------------------------------------------------------------- models


from test_torch_amp import Cnn as _Cnn, OwnMatmul  # noqa: E402  (OwnMatmul: no rule, the torch.func fallback)


class Cnn(_Cnn):
    """Conv2d -> GroupNorm -> ReLU -> mean -> Linear, two outputs."""

    def __init__(self):
        super().__init__()
        self.h = nn.Linear(4, 2)


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.h = nn.Embedding(11, 6), nn.Linear(6, 2)

    def forward(self, i):
        return self.h(torch.tanh(self.e(i)).mean(1))


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.h = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        return self.h(self.a(x, x, x, need_weights=False)[0].mean(1))


class Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.r, self.h = nn.LSTM(7, 6, batch_first=True), nn.Linear(6, 2)

    def forward(self, x):
        return self.h(self.r(x)[0][:, -1])


def _gen(seed):
    return torch.Generator().manual_seed(seed)


MODELS = {
    "linear": (lambda: nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 2)), lambda: torch.randn(B, 7, generator=_gen(1))),
    "conv_groupnorm": (Cnn, lambda: torch.randn(B, 3, 6, 6, generator=_gen(2))),
    "embedding": (Emb, lambda: torch.randint(0, 11, (B, 5), generator=_gen(3))),
    "layernorm": (lambda: nn.Sequential(nn.Linear(7, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2)),
                  lambda: torch.randn(B, 7, generator=_gen(4))),
    "attention": (Attn, lambda: torch.randn(B, 5, 8, generator=_gen(5))),
    "lstm": (Lstm, lambda: torch.randn(B, 4, 7, generator=_gen(6))),
    "fallback": (lambda: nn.Sequential(OwnMatmul(), nn.Linear(9, 2)), lambda: torch.randn(B, 7, generator=_gen(7))),
}
Y = torch.randn(B, 2, generator=_gen(9))


def make(family):
    torch.manual_seed(0)
    factory, data = MODELS[family]
    return factory(), data()


def poison(x, y, where, value, i=BAD):
    x, y = x.clone(), y.clone()
    if where == "input":
        x.view(B, -1)[i, 1] = value
    else:
        y[i, 0] = value
    return x, y


def keep(i=BAD, n=B):
    return [k for k in range(n) if k != i]


# ----------------------------------------------------------------------------- references


def per_record(model, x, y, idx):
    """Each record's gradient, by one backward pass per record."""
    m = copy.deepcopy(model)
    params = [p for p in m.parameters() if p.requires_grad]
    out = []
    for i in idx:
        for p in params:
            p.grad = None
        mse(m(x[i : i + 1]), y[i : i + 1]).backward()
        out.append([torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double() for p in params])
    return out


def clipped_sum(records, clip, per_layer=False):
    m = len(records[0])
    tot = [torch.zeros_like(g) for g in records[0]]
    for gs in records:
        if per_layer:
            cs = [min(1.0, (clip / math.sqrt(m)) / max(float(g.norm()), 1e-300)) for g in gs]
        else:
            n = math.sqrt(sum(float((g**2).sum()) for g in gs))
            cs = [min(1.0, clip / n) if n > 0 else 1.0] * m
        for t, g, c in zip(tot, gs, cs):
            t += c * g
    return [t / DEN for t in tot]


def median_clip(records):
    return float(np.median([math.sqrt(sum(float((g**2).sum()) for g in gs)) for gs in records]))


def dp_step(model, x, y, clip, *, noise=0.0, seed=None, loss_reduction="sum", **kw):
    """One DP step on the batch (x, y): the released .grad of every trainable parameter and
    the ledger's lines."""
    m = copy.deepcopy(model)
    params = [p for p in m.parameters() if p.requires_grad]
    path = tmp_ledger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), model=m, noise_multiplier=noise, max_grad_norm=clip,
                          expected_batch_size=DEN, ledger=path, loss_reduction=loss_reduction, seed=seed, **kw)
    opt.ledger.record_sample(100, 0.08)
    out = m(x)
    loss = mse(out, y) if loss_reduction == "sum" else ((out - y) ** 2).sum(1).mean()
    loss.backward()
    opt.step()
    assert opt.last_step_released
    grads = [p.grad.detach().clone() for p in params]
    opt.engine.remove()
    with open(path) as f:
        return grads, f.read().splitlines(), opt


def assert_same(got, want, rtol=1e-5, atol=1e-7):
    for k, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all(), k
        np.testing.assert_allclose(g.double().numpy(), w.double().numpy(), rtol=rtol, atol=atol, err_msg=str(k))


# ----------------------------------------------------------------------------- every layer family


CASES = [
    (family, where, value)
    for family in MODELS
    for where in ("input", "target")
    for value in (float("nan"), float("inf"), -float("inf"))
    if not (family == "embedding" and where == "input")  # token ids: integers
]


@pytest.mark.parametrize("family,where,value", CASES, ids=[f"{f}-{w}-{v}" for f, w, v in CASES])
def test_bad_record_contributes_zero(family, where, value):
    model, x = make(family)
    xb, yb = poison(x, Y, where, value)
    idx = keep()
    recs = per_record(model, x, Y, idx)
    clip = median_clip(recs)
    got, ledger, _ = dp_step(model, xb, yb, clip)
    # brute force over the clean records
    assert_same(got, clipped_sum(recs, clip), rtol=2e-4, atol=2e-4 * clip / DEN)
    # dpcore on the batch without the record: the same update, the same ledger entries
    clean, clean_ledger, _ = dp_step(model, x[idx], Y[idx], clip)
    assert_same(got, clean)
    assert ledger == clean_ledger


@pytest.mark.parametrize("family", ["linear", "attention", "fallback"])
def test_raise_mode_names_the_record(family):
    model, x = make(family)
    xb, yb = poison(x, Y, "input", float("nan"))
    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m, noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=DEN, ledger=tmp_ledger(), on_nonfinite="raise")
    opt.ledger.record_sample(100, 0.08)
    before = [p.detach().clone() for p in m.parameters()]
    mse(m(xb), yb).backward()
    with pytest.raises(ValueError, match=f"record {BAD} of the batch has a non-finite"):
        opt.step()
    assert opt.ledger.num_releases == 0
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    # the next (clean) step releases
    opt.zero_grad()
    opt.ledger.record_sample(100, 0.08)
    mse(m(x), Y).backward()
    opt.step()
    assert opt.ledger.num_releases == 1


def test_on_nonfinite_is_checked():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="on_nonfinite"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, noise_multiplier=1.0, max_grad_norm=1.0,
                    expected_batch_size=4.0, ledger=tmp_ledger(), on_nonfinite="skip")
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 2))
    with pytest.raises(ValueError, match="on_nonfinite"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
                     ledger=tmp_ledger(), on_nonfinite="ignore")


def test_seeded_noise_and_mean_reduction():
    """With noise (a fixed seed: the same draw in both runs) and a mean-reduced loss."""
    model, x = make("linear")
    xb, yb = poison(x, Y, "input", float("nan"))
    idx = keep()
    clip = median_clip(per_record(model, x, Y, idx))
    got, ledger, _ = dp_step(model, xb, yb, clip, noise=1.0, seed=11, loss_reduction="mean")
    clean, clean_ledger, _ = dp_step(model, x[idx], Y[idx], clip, noise=1.0, seed=11, loss_reduction="mean")
    assert_same(got, clean)
    assert ledger == clean_ledger


def test_every_record_bad_releases_pure_noise():
    model, x = make("linear")
    got, ledger, _ = dp_step(model, x * float("nan"), Y, 1.0)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in got)
    assert len(ledger) == 3  # header, sample, release
    got, _, _ = dp_step(model, x * float("nan"), Y, 1.0, noise=1.0, seed=3)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in got)


# ----------------------------------------------------------------------------- clipping groups


class TwoHeads(nn.Module):
    """Two heads on separate inputs; the second head's output is made finite and multiplied by
    0, so a NaN in its input leaves the output and the first head's per-record gradient finite,
    while the second head's weight gradient is 0·NaN = NaN."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(3, 2)

    def forward(self, x):
        return self.a(x[:, :4]) + 0.0 * torch.nan_to_num(self.b(x[:, 4:]), nan=0.0, posinf=0.0, neginf=0.0)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_bad_in_one_group_zeroes_the_record_in_every_group(clipping):
    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(B, 7, generator=_gen(12))
    xb = x.clone()
    xb[BAD, 5] = float("nan")
    # the record's first-head gradient is finite, its second head's is not
    m = copy.deepcopy(model)
    mse(m(xb[BAD : BAD + 1]), Y[BAD : BAD + 1]).backward()
    assert torch.isfinite(m(xb)).all()
    assert torch.isfinite(m.a.weight.grad).all() and not torch.isfinite(m.b.weight.grad).all()
    idx = keep()
    recs = per_record(model, x, Y, idx)
    clip = median_clip(recs)
    got, ledger, _ = dp_step(model, xb, Y, clip, clipping=clipping)
    assert_same(got, clipped_sum(recs, clip, per_layer=clipping == "per_layer"), rtol=2e-4, atol=2e-4 * clip / DEN)
    clean, clean_ledger, _ = dp_step(model, x[idx], Y[idx], clip, clipping=clipping)
    assert_same(got, clean)
    assert ledger == clean_ledger


def test_nested_query_groups():
    from dpcore.queries import GaussianAverageQuery, NestedQuery

    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(B, 7, generator=_gen(12))
    xb = x.clone()
    xb[BAD, 5] = float("inf")
    idx = keep()

    def run(xx, yy):
        m = copy.deepcopy(model)
        q = NestedQuery({"a": GaussianAverageQuery(0.3, 0.0, DEN), "b": GaussianAverageQuery(0.2, 0.0, DEN)})
        opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), model=m, query=q, ledger=tmp_ledger(),
                          loss_reduction="sum")
        opt.ledger.record_sample(100, 0.08)
        mse(m(xx), yy).backward()
        opt.step()
        return [p.grad.clone() for p in m.parameters()]

    assert_same(run(xb, Y), run(x[idx], Y[idx]))


def test_adaptive_clipping_counts_a_zeroed_record_above_the_clip():
    from dpcore.queries import QuantileAdaptiveClipQuery

    model, x = make("linear")
    xb, yb = poison(x, Y, "target", float("nan"))
    idx = keep()
    clip = median_clip(per_record(model, x, Y, idx))

    def run(xx, yy):
        m = copy.deepcopy(model)
        q = QuantileAdaptiveClipQuery(clip, 0.0, 0.5, 0.2, 0.0, expected_num_records=DEN, denominator=DEN)
        opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), model=m, query=q, ledger=tmp_ledger(),
                          loss_reduction="sum")
        opt.ledger.record_sample(100, 0.08)
        mse(m(xx), yy).backward()
        b, _ = opt._queries.clip_factors(opt.engine)
        ns = opt._groups[0].ns
        opt.engine.clear()
        return b, ns

    b, ns = run(xb, yb)
    b_clean, ns_clean = run(x[idx], Y[idx])
    assert b == B and b_clean == B - 1
    assert math.isfinite(ns) and ns == ns_clean - 0.5  # one more record, counted as clipped


# ----------------------------------------------------------------------------- micro-batches


class _Loader:
    """The loader protocol: whether the logical batch is complete."""

    logical_batch_complete = False


@pytest.mark.parametrize("how", ["accumulate", "loader"])
def test_micro_batches(how):
    model, x = make("linear")
    xb, yb = poison(x, Y, "input", float("nan"))
    idx = keep()
    recs = per_record(model, x, Y, idx)
    clip = median_clip(recs)
    m = copy.deepcopy(model)
    loader = _Loader()
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), model=m, noise_multiplier=0.0, max_grad_norm=clip,
                      expected_batch_size=DEN, ledger=tmp_ledger(), loss_reduction="sum",
                      data_loader=loader if how == "loader" else None)
    opt.ledger.record_sample(100, 0.08)
    parts = [range(0, 3), range(3, 6), range(6, 8)]  # the bad record opens the second micro-batch
    for k, part in enumerate(parts):
        opt.zero_grad()
        sel = list(part)
        mse(m(xb[sel]), yb[sel]).backward()
        last = k == len(parts) - 1
        if how == "accumulate" and not last:
            opt.accumulate()
        else:
            loader.logical_batch_complete = last
            opt.step()
    assert opt.ledger.num_releases == 1
    got = [p.grad for p in m.parameters()]
    assert_same(got, clipped_sum(recs, clip), rtol=2e-4, atol=2e-4 * clip / DEN)
    clean, _, _ = dp_step(model, x[idx], Y[idx], clip)
    assert_same(got, clean)


def test_microbatch_query_zeroes_the_whole_unit():
    """A MicrobatchQuery's record is a unit of k examples: a bad example zeroes its unit."""
    from dpcore.queries import GaussianAverageQuery, MicrobatchQuery

    model, x = make("lstm")
    xb, yb = poison(x, Y, "input", float("nan"), i=7)  # the last unit: examples 6 and 7

    def run(xx, yy):
        m = copy.deepcopy(model)
        q = MicrobatchQuery(GaussianAverageQuery(0.05, 0.0, 4.0), 2)
        opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), model=m, query=q, ledger=tmp_ledger(),
                          loss_reduction="sum")
        opt.ledger.record_sample(100, 0.08)
        mse(m(xx), yy).backward()
        opt.step()
        with open(opt.ledger.path) as f:
            return [p.grad.clone() for p in m.parameters()], f.read().splitlines()

    got, ledger = run(xb, yb)
    clean, clean_ledger = run(x[:6], Y[:6])
    assert_same(got, clean)
    assert ledger == clean_ledger


def test_dp_data_loader_with_physical_batches():
    """make_private's loader with max_physical_batch_size: every logical batch releases."""
    torch.manual_seed(0)
    n = 40
    xs, ys = torch.randn(n, 7), torch.randn(n, 2)
    xs[::5, 0] = float("nan")  # a bad record in most physical batches
    model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 2))
    data = torch.utils.data.TensorDataset(xs, ys)
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      torch.utils.data.DataLoader(data, batch_size=16), noise_multiplier=0.5,
                                      max_grad_norm=1.0, ledger=tmp_ledger(), max_physical_batch_size=4, seed=1)
    for xx, yy in loader:
        opt.zero_grad()
        if len(xx):
            mse(model(xx), yy).backward()
        opt.step()
    assert opt.ledger.num_releases == len(opt.ledger.samples) == len(loader)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------- huge finite records


def test_clip_factors_rules():
    sq = torch.tensor([4.0, float("nan"), float("inf"), 0.25, 2.0**240], dtype=torch.float64)
    c = clip_factors(sq, 1.0, 0.0)
    assert c.tolist() == [0.5, 0.0, 0.0, 1.0, 0.0]  # 2⁻¹²⁰ < 2⁻¹⁰⁰: 0
    assert clip_factors(torch.tensor([2.0**190], dtype=torch.float64), 1.0, 0.0).item() == 2.0**-95
    assert clip_factors(torch.tensor([2.0**190], dtype=torch.float64), 1.0, 0.0, min_factor=2.0**-90).item() == 0.0
    with pytest.raises(ValueError, match="record 1"):
        clip_factors(sq, 1.0, 0.0, on_nonfinite="raise")
    assert MIN_FACTOR == 2.0**-100


@pytest.mark.parametrize("den", [1.0, 2.0**30])
def test_huge_finite_records_stay_within_the_clip(den):
    """One record at a time, scaled by 10^k up to 10^36: its released contribution, measured
    exactly in float64, is ≤ C (clipped, or 0 once C/‖x‖ falls below the floor, which keeps the
    float32 factor out of the subnormal range); also with a denominator of 2³⁰."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 2))
    clip = 0.37
    zeroed = 0
    for k in range(0, 37, 3):
        m = copy.deepcopy(model)
        opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), model=m, noise_multiplier=0.0, max_grad_norm=clip,
                          expected_batch_size=den, ledger=tmp_ledger(), loss_reduction="sum")
        opt.ledger.record_sample(100, 0.08)
        x = torch.randn(1, 7, generator=_gen(k)) * 10.0 ** k
        (mse(m(x), Y[:1]) * 10.0 ** k).backward()
        opt.step()
        norm = math.sqrt(sum(float(((p.grad.double() * den) ** 2).sum()) for p in m.parameters()))
        assert norm <= clip, (k, norm)
        if norm == 0.0:
            zeroed += 1
        else:
            assert norm > clip * (1 - 1e-3), (k, norm)
    assert 0 < zeroed < 13


def test_engine_zeroes_stored_factors_of_flagged_records():
    """The engine alone: clipped_sums never lets a flagged record's NaN through, whatever factor
    it is given."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 2))
    x = torch.randn(4, 7)
    x_keep = x.clone()
    x[1, 3] = float("nan")
    x_in = x.clone()
    eng = PerRecordGradients(model, list(model.parameters()), loss_reduction="sum")
    mse(model(x), Y[:4]).backward()
    b, sq = eng.squared_norms()
    assert eng.nonfinite is not None and eng.nonfinite.tolist() == [False, True, False, False]
    c = torch.ones(4, dtype=torch.float64)  # even with factor 1 for the bad record
    sums = eng.clipped_sums([c] * len(sq))
    assert all(torch.isfinite(s).all() for s in sums)
    assert torch.isnan(x[1, 3]) and torch.equal(torch.nan_to_num(x), torch.nan_to_num(x_in))  # input untouched
    # the sums are those of the three clean records (factor 1: autograd's batch gradient)
    eng.remove()
    m = copy.deepcopy(model)
    mse(m(x_keep[[0, 2, 3]]), Y[[0, 2, 3]]).backward()
    for s, p in zip(sums, m.parameters()):
        torch.testing.assert_close(s, p.grad, rtol=1e-5, atol=1e-6)
