"""Mixed precision in dpcore.torch: bfloat16 autocast and bfloat16 parameters on every layer
family, float16 with a GradScaler (on CPU here; the same code path runs on CUDA).

The stated bound (docs/pytorch.md, "Mixed precision"): at noise 0 the release equals the brute-force
per-record clipped sum (one backward pass per record, under the same autocast, clipped and
summed in float64) within 4u of the largest reference entry, u = 2⁻⁸ for bfloat16. The gap is
autograd's own rounding: its per-record weight gradient is a bfloat16 product (≤ u), and
bfloat16 parameters receive the update rounded to bfloat16 (≤ u/2); dpcore forms the products
from the same bfloat16 factors in float32. A wrong norm (a missed use, a wrong block) is off by
far more than 4u. Separately, the clipped contribution of one record never exceeds C, checked
exactly in float64 on records scaled far past C.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dpcore  # noqa: E402
from dpcore.torch import (  # noqa: E402
    DPOptimizer, GradScalerGrowthWarning, OverflowSkipWarning, PerRecordGradients, clip_factors, clip_margin, make_private,
)
from test_torch_layers import brute_force, ce, dp_update  # noqa: E402

torch.set_num_threads(1)
BF16 = torch.bfloat16
U = 2.0**-8


class Seq(nn.Module):
    """Embedding -> Linear over positions -> LayerNorm -> Linear."""

    def __init__(self):
        super().__init__()
        self.emb, self.l, self.ln, self.h = nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, i):
        return self.h(self.ln(torch.tanh(self.l(self.emb(i)))).mean(1))


class Enc(nn.Module):
    """Embedding -> TransformerEncoderLayer (MultiheadAttention, LayerNorm) -> Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.h = nn.Linear(8, 3)

    def forward(self, i):
        return self.h(self.enc(self.emb(i)).mean(1))


class Rnn(nn.Module):
    """Embedding -> LSTM (or GRU) -> Linear. ``reference=True`` runs the recurrent layer as CUDA
    autocast does (in the autocast dtype) by casting by hand: PyTorch's CPU LSTM fails under
    bfloat16 autocast (oneDNN "could not create a primitive descriptor"), so the brute force
    cannot use it."""

    reference = False
    cell = nn.LSTM

    def __init__(self):
        super().__init__()
        self.emb, self.r, self.h = nn.Embedding(11, 8), self.cell(8, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, i):
        e = self.emb(i)
        if self.reference and torch.is_autocast_enabled("cpu"):
            from torch.func import functional_call

            with torch.autocast("cpu", enabled=False):
                w = {k: v.to(BF16) for k, v in self.r.named_parameters()}
                out = functional_call(self.r, w, (e.to(BF16),))[0]
        else:
            out = self.r(e)[0]
        return self.h(out[:, -1])


class Gru(Rnn):
    cell = nn.GRU


class OwnMatmul(nn.Module):
    """A layer with no rule (the torch.func fallback): its own weight in a matrix product,
    which autocast runs in bfloat16, and an elementwise scale."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(9, 7) * 0.3)
        self.s = nn.Parameter(torch.ones(9))

    def forward(self, x):
        return torch.tanh(x @ self.w.t()) * self.s


class Cnn(nn.Module):
    """Conv2d -> GroupNorm -> ReLU -> mean -> Linear."""

    def __init__(self):
        super().__init__()
        self.c, self.g, self.h = nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.h(torch.relu(self.g(self.c(x))).mean((2, 3)))


def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


IDX = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(2))
IMG = torch.randn(6, 3, 6, 6, generator=torch.Generator().manual_seed(3))
VEC = torch.randn(6, 7, generator=torch.Generator().manual_seed(4))

MODELS = {
    "linear": (lambda: nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 3)), VEC),
    "embedding": (Seq, IDX),
    "attention": (Enc, IDX),
    "lstm": (Rnn, IDX),
    "gru": (Gru, IDX),
    # behind a Linear: under autocast its input arrives in bfloat16, so its per-record
    # recomputation (in the backward pass) must run under the forward's autocast too
    "generic": (lambda: nn.Sequential(nn.Linear(7, 7), OwnMatmul(), nn.Linear(9, 3)), VEC),
    "conv": (Cnn, IMG),
}


def _loss(x, autocast):
    def loss_of(m, i):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            out = m(x[i])
        return ce(out.float(), Y[i])

    return loss_of


def _compare(model, loss_of, n, ref_model=None, den=7.0, u=U):
    clip, ref, norms = brute_force(ref_model or model, loss_of, n)
    assert (norms > clip).any() and (norms < clip).any()
    got, opt, m = dp_update(model, loss_of, n, clip, den)
    scale = max(float(r.abs().max()) for r in ref) / den
    names = [nm for nm, p in m.named_parameters() if p.requires_grad]
    for name, p, g, r in zip(names, [p for p in m.parameters() if p.requires_grad], got, ref):
        assert g is not None and g.dtype == p.dtype, name
        err = float((g.double() - r.double() / den).abs().max())
        assert err <= 4 * u * scale, (name, err / scale)
    opt.engine.remove()
    return opt


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("mode", ["autocast", "bf16-params", "fp16-params"])
def test_low_precision_release_equals_brute_force(family, mode):
    """bf16 autocast, bf16 parameters, and float16 parameters (u = 2⁻¹¹; float16 autocast is a
    CUDA feature, with its GradScaler tested below on CPU)."""
    make, x = MODELS[family]
    torch.manual_seed(0)
    model = make()
    u = U
    if mode.endswith("-params"):
        dt = BF16 if mode == "bf16-params" else torch.float16
        u = 2.0**-8 if dt == BF16 else 2.0**-11
        model = model.to(dt)
        x = x.to(dt) if x.is_floating_point() else x
    ref_model = None
    if family in ("lstm", "gru") and mode == "autocast":
        ref_model = copy.deepcopy(model)
        ref_model.reference = True
    _compare(model, _loss(x, mode == "autocast"), 6, ref_model, u=u)


def test_bf16_autocast_gpt2_tied_embedding():
    torch.manual_seed(0)
    model = gpt2()
    ids = torch.randint(0, 40, (5, 8), generator=torch.Generator().manual_seed(1))

    def loss_of(m, i):
        with torch.autocast("cpu", dtype=BF16):
            logits = m(input_ids=ids[i]).logits
        return nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, 40), ids[i][:, 1:].reshape(-1), reduction="sum")

    _compare(model, loss_of, 5)


@pytest.mark.parametrize("mode", ["autocast", "bf16-params"])
def test_bf16_clipped_record_never_exceeds_the_clip(mode):
    """One record at a time, scaled to norms of 10³-10⁶·C: the float32 clipped sum the engine
    forms, measured exactly in float64, is ≤ C; and it is float32, not bfloat16."""
    torch.manual_seed(0)
    model = Seq()
    if mode == "bf16-params":
        model = model.to(BF16)
    eng = PerRecordGradients(model, list(model.parameters()), loss_reduction="sum")
    dim = sum(p.numel() for p in model.parameters())
    clip = 0.37
    worst = 0.0
    for trial in range(30):
        idx = torch.randint(0, 11, (1, 5), generator=torch.Generator().manual_seed(trial))
        scale = 10.0 ** (3 + trial % 4)
        with torch.autocast("cpu", dtype=BF16, enabled=mode == "autocast"):
            out = model(idx)
        (ce(out.float(), Y[:1]) * scale).backward()
        b, sq = eng.squared_norms()
        tot = sum(s for s in sq if s is not None)
        c = clip_factors(tot, clip, clip_margin(dim, torch.float32))
        sums = eng.clipped_sums([c] * len(sq))
        assert all(s.dtype == torch.float32 for s in sums if s is not None)
        norm = float(torch.sqrt(sum((s.double() ** 2).sum() for s in sums if s is not None)))
        assert norm <= clip, (trial, norm)
        worst = max(worst, norm)
    assert worst > clip * (1 - 1e-3)  # records were clipped, to within the margin of C
    eng.remove()


def test_noise_is_added_in_float32_and_cast_once():
    """bfloat16 parameters: the accumulator that receives the noise is float32; the parameter's
    .grad is that float32 release rounded once to bfloat16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 3)).to(BF16)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=4.0, loss_reduction="sum", seed=5,
                      ledger=os.path.join(tempfile.mkdtemp(), "l.jsonl"))
    seen = {}
    orig = opt._transport.set_grads

    def spy():
        seen["acc"] = [a.clone() for a in opt._batch.acc]
        orig()

    opt._transport.set_grads = spy
    opt.ledger.record_sample(100, 0.04)
    ce(model(VEC[:4].to(BF16)).float(), Y[:4]).backward()
    opt.step()
    assert all(a.dtype == torch.float32 for a in seen["acc"])
    for a, p in zip(seen["acc"], model.parameters()):
        assert p.grad.dtype == BF16
        assert torch.equal(p.grad, a.to(BF16))
    # the noise is not rounded to bfloat16 before it is added: the float32 release has
    # values between bfloat16 neighbours
    assert any(not torch.equal(a, a.to(BF16).float()) for a in seen["acc"])


# ----------------------------------------------------------------------------- GradScaler


FIXED = 2**31 - 1  # a growth interval no run reaches: a fixed scale (torch refuses growth_factor=1.0)


def _fp16_setup(init_scale, phys=None, n=64, batch=8, seed=3, growth_interval=FIXED):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 3))
    data = torch.utils.data.TensorDataset(torch.randn(n, 7), torch.randint(0, 3, (n,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    ledger = dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(), "l.jsonl"))
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.05), loader, noise_multiplier=0.0, max_grad_norm=1.0,
        ledger=ledger, grad_scaler=scaler, seed=seed, max_physical_batch_size=phys)
    return model, opt, loader, scaler, ledger


def _fp16_step(model, opt, scaler, x, y, via_scaler=True):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ce(model(x), y)
    scaler.scale(loss).backward()
    if via_scaler:
        scaler.step(opt)
    else:
        opt.step()
    scaler.update()


def test_grad_scaler_unscales_before_the_clip():
    """At noise 0 the update under a scale of 2¹⁰ equals the unscaled float16 run's."""
    results = []
    for init_scale, via in ((1.0, True), (2.0**10, True), (2.0**10, False)):
        model, opt, loader, scaler, ledger = _fp16_setup(init_scale)
        for x, y in loader:
            _fp16_step(model, opt, scaler, x, y, via)
        assert ledger.num_releases == len(loader) and opt.skipped_steps == 0
        results.append([p.detach().clone() for p in model.parameters()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-4)


# The issue's reproduction (Cebere et al., PETS 2026): a regression MLP under float16 autocast
# with GradScaler(init_scale=2**10); one record whose target is 3e3 overflows its scaled float16
# gradient (2·3e3·1024 > 65504). dpcore used to skip all three steps (scale 1024 -> 512 -> 256 ->
# 128), and to release all three at 1024 without that record: the skips and the scale depended on
# one record. Now both runs release three steps at scale 1024, and the outlier contributes zero.

OUTLIER = 5


def _regression_run(outlier, steps=3, growth_interval=2000, on_nonfinite="zero", micro=None):
    """``steps`` releases of one fixed batch (the outlier record included or dropped); returns
    (parameters, scales seen at each step, ledger lines)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    y[OUTLIER] = 3e3
    if not outlier:
        keep = [i for i in range(8) if i != OUTLIER]
        x, y = x[keep], y[keep]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)

    class Loader:
        logical_batch_complete = True

    loader = Loader()
    path = os.path.join(tempfile.mkdtemp(), "l.jsonl")
    with pytest.warns(GradScalerGrowthWarning, match="never lowers"):
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model, noise_multiplier=0.0,
                          max_grad_norm=1.0, expected_batch_size=8.0, ledger=path, loss_reduction="sum",
                          grad_scaler=scaler, data_loader=loader, on_nonfinite=on_nonfinite)
    scales = []
    parts = [slice(0, None)] if micro is None else [slice(i, i + micro) for i in range(0, len(x), micro)]
    for _ in range(steps):
        opt.ledger.record_sample(100, 0.08)
        for k, part in enumerate(parts):
            loader.logical_batch_complete = k == len(parts) - 1
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[part])
            loss = ((out.float() - y[part]) ** 2).sum()
            scales.append(float(scaler.get_scale()))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    with open(path) as f:
        return [p.detach().clone() for p in model.parameters()], scales, f.read().splitlines(), opt


def test_issue_repro_every_step_releases_at_a_fixed_scale():
    with warnings.catch_warnings():
        warnings.simplefilter("error", OverflowSkipWarning)  # deprecated: never emitted
        got, scales, ledger, opt = _regression_run(True)
        ref, ref_scales, ref_ledger, _ = _regression_run(False)
    assert scales == ref_scales == [2.0**10] * 3
    assert opt.grad_scaler.get_scale() == 2.0**10  # no backoff after the outlier's overflow
    assert opt.ledger.num_releases == 3 and opt.skipped_steps == 0 and opt.last_step_released
    assert ledger == ref_ledger
    for a, b in zip(got, ref):  # the outlier contributed zero
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    # it did overflow: "raise" names it
    with pytest.raises(ValueError, match=f"record {OUTLIER} .*scaled by 1024"):
        _regression_run(True, on_nonfinite="raise")


def test_scale_follows_its_growth_schedule_alone():
    """growth_interval=2: ×2 every 2 steps with or without the overflowing record."""
    got, scales, _, _ = _regression_run(True, steps=5, growth_interval=2)
    ref, ref_scales, _, _ = _regression_run(False, steps=5, growth_interval=2)
    assert scales == ref_scales == [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**12]


def test_overflow_in_a_micro_batch_releases_the_logical_batch():
    got, scales, ledger, opt = _regression_run(True, steps=2, micro=3)  # the outlier in the second of 3
    ref, _, ref_ledger, _ = _regression_run(False, steps=2, micro=3)
    assert set(scales) == {2.0**10} and opt.ledger.num_releases == 2
    # the clean run's micro-batches differ (7 records), the releases do not
    assert ledger == ref_ledger
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_grad_scaler_overflow_never_skips():
    """A scale far too large (2²⁰: float16 overflows at 65504): every record overflows or not,
    every step releases and the scale never backs off."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, loader, scaler, ledger = _fp16_setup(2.0**20, batch=4)
        for x, y in loader:
            _fp16_step(model, opt, scaler, x, y)
    assert not [w for w in caught if w.category is OverflowSkipWarning]
    assert ledger.num_releases == len(ledger.samples) == len(loader) and opt.skipped_steps == 0
    assert scaler.get_scale() == 2.0**20
    assert all(s.released for s in ledger.samples)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_growing_scaler_warns_fixed_does_not():
    model = nn.Linear(7, 3)
    kw = dict(model=model, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0,
              ledger=os.path.join(tempfile.mkdtemp(), "l.jsonl"))
    with pytest.warns(GradScalerGrowthWarning, match=r"growth_interval=2\*\*31 - 1"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=torch.amp.GradScaler("cpu"), **kw).engine.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradScalerGrowthWarning)
        sc = torch.amp.GradScaler("cpu", growth_interval=FIXED)
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=sc, **kw).engine.remove()


def test_scaler_not_attached_is_refused():
    torch.manual_seed(0)
    model = nn.Linear(7, 3)
    data = torch.utils.data.TensorDataset(torch.randn(16, 7), torch.randint(0, 3, (16,)))
    model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      torch.utils.data.DataLoader(data, batch_size=4), noise_multiplier=1.0,
                                      max_grad_norm=1.0, ledger=os.path.join(tempfile.mkdtemp(), "l.jsonl"))
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(loader))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ce(model(x), y)
    scaler.scale(loss).backward()
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        scaler.step(opt)
    assert opt.ledger.num_releases == 0
    with pytest.raises(TypeError, match="GradScaler"):
        opt.attach_grad_scaler(object())
