"""An empty Poisson sample, stepped as every other one: it releases pure noise.

Each record joins a step's batch independently with probability q, so a batch can hold no
record. Its step must still be taken (skipping it would reveal that no record was sampled): the
loop runs ``loss_fn(model(x), y).backward()`` on zero rows (under FSDP2 every rank must, as the
ranks gather the weights together) and ``optimizer.step()`` releases the noise alone, divided
by the fixed denominator q·n, recorded once in the ledger. For every layer family with a rule
(and the ``torch.func`` fallback, a function rule, tied and shared embeddings, sequence-first
layouts), with mean and sum losses, flat and per-layer clipping and micro-batches: the forward
pass on zero rows gives zero rows, the backward pass and the step run, one release is recorded,
at noise 0 nothing moves, and with noise the gradient is exactly the noise that a step with no
backward pass at all releases (the same seed), of the plan's standard deviation.
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
from torch.utils.data import Dataset, TensorDataset  # noqa: E402

import dpcore  # noqa: E402
from dpcore.torch import DPDataLoader, DPOptimizer, FallbackWarning, register_layer  # noqa: E402

torch.set_num_threads(1)
K = 3  # classes
V = 10  # vocabulary
N = 8  # records in each dataset


def _ledger() -> dpcore.PrivacyLedger:
    return dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(prefix="dpcore-test-"), "l.jsonl"))


# ----------------------------------------------------------------------------- the layer families


class Head(nn.Module):
    """``body`` then a linear head on the mean over the positions (dims after the first)."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.body, self.head = body, nn.Linear(width, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h.flatten(1, -2).mean(1) if h.dim() > 2 else h)


class Channels(nn.Module):
    """Convolutions and GroupNorm: (B, C, ...) pooled over the positions, then a head."""

    def __init__(self, *layers: nn.Module, width: int) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(*layers), nn.Linear(width, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h.flatten(2).mean(2))  # (no reshape(..., -1): ambiguous for no record)


class Attention(nn.Module):
    def __init__(self, batch_first: bool = True, **kw) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw)
        self.head = nn.Linear(8, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        pad = torch.zeros(b, t, dtype=torch.bool)
        pad[:, -1] = True  # a padded key in every record
        s = x if self.batch_first else x.transpose(0, 1)
        out, _ = self.attn(s, s, s, key_padding_mask=pad, need_weights=True)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1))


class EncoderDecoder(nn.Module):
    """TransformerEncoderLayer and a causal TransformerDecoderLayer with cross attention."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(8, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mem = self.enc(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.dec(x, mem, tgt_mask=mask, tgt_is_causal=True).mean(1))


class Recurrent(nn.Module):
    def __init__(self, kind: str, **kw) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 6, num_layers=2, bidirectional=True, batch_first=True, **kw)
        self.head = nn.Linear(12, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class Tied(nn.Module):
    """One matrix as the input embedding and the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.out = nn.Linear(8, V, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(idx))).mean(1)


class Positions(nn.Module):
    """Learned positions looked up by one (1, T) index shared by the records (GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, 8), nn.Embedding(6, 8), nn.Linear(8, K)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1]).unsqueeze(0)
        return self.head((self.tok(idx) + self.pos(pos)).mean(1))


class SeqFirst(nn.Module):
    """(T, B) inputs, records on dim 1 (``batch_first=False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.norm, self.head = nn.Embedding(V, 8), nn.GRU(8, 6), nn.LayerNorm(6), nn.Linear(6, K)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.rnn(self.emb(idx.t()))[0])[-1])


class Scale(nn.Module):
    """No rule: the torch.func fallback."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w)


class RuledScale(Scale):
    """A rule registered as a function (``register_layer``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


register_layer(RuledScale, lambda m, args, g: {"w": args[0] * g})


def _floats(*shape):
    return lambda n: torch.randn((n,) + shape)


def _ids(*shape):
    return lambda n: torch.randint(0, V, (n,) + shape)


#: family → (model builder, records of n, extra DPOptimizer arguments)
FAMILIES = {
    "linear": (lambda: nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, K)), _floats(5), {}),
    "linear_positions": (lambda: Head(nn.Linear(5, 6), 6), _floats(4, 5), {}),
    "embedding": (lambda: Head(nn.Embedding(V, 6), 6), _ids(4), {}),
    "embedding_padding_idx": (lambda: Head(nn.Embedding(V, 6, padding_idx=0), 6), _ids(4), {}),
    "tied_embedding": (Tied, _ids(4), {}),
    "shared_positions": (Positions, _ids(5), {}),
    "conv1d": (lambda: Channels(nn.Conv1d(2, 4, 3), width=4), _floats(2, 8), {}),
    "conv2d_folded": (lambda: Channels(nn.Conv2d(16, 8, 3, bias=True), width=8), _floats(16, 6, 6), {}),
    "conv2d_unfolded": (lambda: Channels(nn.Conv2d(3, 32, 3, stride=2), width=32), _floats(3, 8, 8), {}),
    "conv2d_factored": (lambda: Channels(nn.Conv2d(64, 64, 3, padding=1), width=64), _floats(64, 4, 4), {}),
    "conv2d_reflect_groups": (
        lambda: Channels(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect", groups=2), width=4), _floats(4, 5, 5), {}
    ),
    "conv3d": (lambda: Channels(nn.Conv3d(2, 4, 2), width=4), _floats(2, 3, 3, 3), {}),
    "conv_transpose": (lambda: Channels(nn.ConvTranspose2d(3, 4, 2), width=4), _floats(3, 4, 4), {}),
    "layernorm": (lambda: Head(nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6)), 6), _floats(4, 5), {}),
    "groupnorm": (lambda: Channels(nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8), width=8), _floats(3, 5, 5), {}),
    "groupnorm_alone": (lambda: Channels(nn.GroupNorm(2, 4), width=4), _floats(4, 3, 3), {}),
    "multihead_attention": (lambda: Attention(add_bias_kv=True, add_zero_attn=True), _floats(4, 8), {}),
    "multihead_attention_seq_first": (lambda: Attention(batch_first=False), _floats(4, 8), {}),
    "transformer_layers": (EncoderDecoder, _floats(4, 8), {}),
    "lstm": (lambda: Recurrent("LSTM"), _floats(5, 4), {}),
    "gru": (lambda: Recurrent("GRU"), _floats(5, 4), {}),
    "rnn": (lambda: Recurrent("RNN", nonlinearity="relu"), _floats(5, 4), {}),
    "sequence_first": (SeqFirst, _ids(5), {"batch_first": False}),
    "generic_fallback": (lambda: nn.Sequential(Scale(5), nn.Linear(5, K)), _floats(5), {}),
    "function_rule": (lambda: nn.Sequential(RuledScale(5), nn.Linear(5, K)), _floats(5), {}),
}
if hasattr(nn, "RMSNorm"):
    FAMILIES["rmsnorm"] = (lambda: Head(nn.Sequential(nn.Linear(5, 6), nn.RMSNorm(6)), 6), _floats(4, 5), {})


def _build(family: str, seed: int = 0):
    make, records, kw = FAMILIES[family]
    torch.manual_seed(seed)
    model = make()
    x = records(N)
    y = torch.randint(0, K, (N,))
    return model, TensorDataset(x, y), kw


def _optimizer(model, loader, *, noise=0.0, clipping="flat", seed=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        return DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model=model, noise_multiplier=noise,
                           max_grad_norm=1.0, clipping=clipping, expected_batch_size=loader.expected_batch_size,
                           data_loader=loader, seed=seed, **kw)


def _empty_loader(ds, **kw) -> DPDataLoader:
    """A seeded Poisson loader of one step whose sample holds no record (q = 1e-9)."""
    return DPDataLoader(ds, 1e-9, ledger=_ledger(), steps=1, seed=0, **kw)


def _loss(model, x, y, reduction):
    return nn.functional.cross_entropy(model(x), y, reduction=reduction)


# ----------------------------------------------------------------------------- noise 0: nothing moves


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_empty_sample_steps_and_releases_once(family: str, reduction: str, clipping: str) -> None:
    model, ds, kw = _build(family)
    loader = _empty_loader(ds)
    opt = _optimizer(model, loader, clipping=clipping, loss_reduction=reduction, **kw)
    before = [p.detach().clone() for p in model.parameters()]
    steps = 0
    for x, y in loader:
        assert len(x) == 0 and len(y) == 0
        opt.zero_grad()
        out = model(x)
        assert out.dim() == 2 and out.shape[0] == 0
        loss = nn.functional.cross_entropy(out, y, reduction=reduction)
        # 0/0 for a mean over no record (harmless: no record enters); 0 for a sum
        assert bool(torch.isnan(loss)) if reduction == "mean" else float(loss.detach()) == 0.0
        loss.backward()
        opt.step()
        steps += 1
    assert steps == 1 and opt.last_step_released
    assert loader.ledger.num_releases == 1
    for p, b in zip(model.parameters(), before):
        assert p.grad is not None and not bool(p.grad.any())  # the release: zero noise over no record
        assert torch.equal(p, b)
    opt.engine.remove()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_on_no_record(family: str) -> None:
    """``model(x)`` on zero rows gives zero rows, instrumented or not, with or without grad."""
    model, ds, kw = _build(family)
    ref = copy.deepcopy(model)
    x = ds.tensors[0][:0]
    opt = _optimizer(model, _empty_loader(ds), **kw)
    out = model(x)
    assert out.shape == ref(x).shape == (0, out.shape[1]) and out.requires_grad  # (PyTorch's own layers agree)
    with torch.no_grad():
        assert model(x).shape == out.shape
    opt.zero_grad()
    opt.engine.remove()


# ----------------------------------------------------------------------------- with noise: the noise alone


def _released_noise(family: str, *, backward: bool, clipping: str = "flat", reduction: str = "mean",
                    microbatch: bool = False, physical=None):
    """The .grad of the one release of an empty sample at noise 1.3, seed 5: with forward and
    backward run on the empty batch (or no backward pass at all)."""
    model, ds, kw = _build(family)
    loader = _empty_loader(ds, max_physical_batch_size=physical)
    if microbatch:
        from dpcore.queries import GaussianAverageQuery, MicrobatchQuery

        q = MicrobatchQuery(GaussianAverageQuery(1.0, 1.3, loader.expected_batch_size), 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model=model, query=q,
                              data_loader=loader, seed=5, loss_reduction=reduction, **kw)
    else:
        opt = _optimizer(model, loader, noise=1.3, clipping=clipping, seed=5, loss_reduction=reduction, **kw)
    opt.original_optimizer.step = lambda *a, **k: None  # keep the parameters: only .grad is compared
    for x, y in loader:
        opt.zero_grad()
        if backward:
            _loss(model, x, y, reduction).backward()
        opt.step()
    assert loader.ledger.num_releases == 1
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.engine.remove()
    return grads, loader.expected_batch_size


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_empty_sample_releases_exactly_the_noise(family: str) -> None:
    """The backward pass over no record changes nothing: .grad is the very noise a step with no
    backward pass releases (same seed), N(0, (σC/(q·n))²) per coordinate."""
    got, den = _released_noise(family, backward=True)
    want, _ = _released_noise(family, backward=False)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    flat = torch.cat([g.reshape(-1) for g in got]).double()
    sd = 1.3 * 1.0 / den
    n = flat.numel()
    assert bool(torch.isfinite(flat).all()) and int((flat == 0).sum()) == 0
    # the sample std of n normals is within 6/sqrt(2n) of the truth (6 sigma)
    assert abs(float(flat.std()) / sd - 1) < 6 / math.sqrt(2 * n)


@pytest.mark.parametrize("family", ["conv2d_unfolded", "embedding", "lstm", "multihead_attention", "generic_fallback"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("how", ["per_layer", "microbatch_query", "physical"])
def test_an_empty_sample_with_per_layer_clipping_and_micro_batches(family: str, reduction: str, how: str) -> None:
    kw: dict = {"per_layer": dict(clipping="per_layer"), "microbatch_query": dict(microbatch=True),
                "physical": dict(physical=2)}[how]
    got, _ = _released_noise(family, backward=True, reduction=reduction, **kw)
    want, _ = _released_noise(family, backward=False, reduction=reduction, **kw)
    for g, w in zip(got, want):
        assert torch.equal(g, w) and bool(torch.isfinite(g).all()) and bool(g.any())


@pytest.mark.parametrize("family", ["conv2d_folded", "tied_embedding", "gru", "transformer_layers"])
def test_an_empty_micro_batch_adds_nothing_to_its_logical_batch(family: str) -> None:
    """A logical batch of micro-batches, one of them empty (as FSDP2 cuts a rank's short sample):
    the release is that of the other micro-batches alone."""
    model, ds, kw = _build(family)
    x, y = ds.tensors
    ref = copy.deepcopy(model)

    def release(m, parts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), model=m, noise_multiplier=0.0, max_grad_norm=0.5,
                              expected_batch_size=4.0, ledger=_ledger(), **kw)
        opt.ledger.record_sample(100, 0.04)
        for k, part in enumerate(parts):
            opt.zero_grad()
            _loss(m, x[part], y[part], "mean").backward()
            opt.accumulate() if k < len(parts) - 1 else opt.step()
        assert opt.ledger.num_releases == 1
        g = [p.grad.clone() for p in m.parameters()]
        opt.engine.remove()
        return g

    got = release(model, [slice(0, 3), slice(3, 3), slice(3, 5), slice(5, 5)])
    want = release(ref, [slice(0, 3), slice(3, 5)])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert any(bool(g.any()) for g in got)


# ----------------------------------------------------------------------------- the loaders' empty batches


class Texts(Dataset):
    """Records with a string field (``default_collate`` leaves strings as a list)."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> dict:
        return {"text": f"record {i}", "x": torch.full((3,), float(i)), "y": i % K}


def test_an_empty_batch_of_a_map_style_dataset_holds_no_record() -> None:
    """Nothing of the record collated for the shapes is left in an empty batch: the strings
    of ``default_collate`` are a list with one entry per record, cut too."""
    loader = DPDataLoader(Texts(), 1e-9, ledger=_ledger(), steps=2, seed=0)
    batches = list(loader)
    assert len(batches) == 2
    for b in batches:
        assert b["text"] == [] and b["x"].shape == (0, 3) and b["y"].shape == (0,)


def test_an_empty_batch_keeps_each_part_s_record_axis() -> None:
    from dpcore.torch._data import empty_batch

    # records on dim 1 (a sequence-first collate), and a value shared by the batch
    def collate(rs):
        return {"seq": torch.stack([r for r in rs], 1), "shared": torch.arange(4), "n": "batch"}

    b = empty_batch(collate, torch.ones(4))
    assert b["seq"].shape == (4, 0) and torch.equal(b["shared"], torch.arange(4)) and b["n"] == "batch"
    # a list of per-record tensors (no stacking) is a list of none
    assert empty_batch(lambda rs: [torch.as_tensor(r) for r in rs], [1.0, 2.0]) == []


# ----------------------------------------------------------------------------- Hugging Face models


def _hf(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=V, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=16, max_position_embeddings=16, num_labels=K,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
        return transformers.BertForSequenceClassification(cfg)
    cfg = transformers.T5Config(vocab_size=V, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                                relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg)


def _hf_loss(model, kind: str, ids: torch.Tensor) -> torch.Tensor:
    if kind == "bert":
        return model(input_ids=ids, labels=ids[:, 0] % K).loss
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("kind", ["gpt2", "bert", "t5"])
def test_hugging_face_models_one_record_and_no_record(kind: str) -> None:
    """A Poisson sample of one record: its release at noise 0 is its clipped gradient (T5's
    relative attention bias is looked up for that one record). No record: Hugging Face models
    cannot run a batch of zero rows themselves, so the documented loop runs the forward and
    backward passes on one placeholder record and drops its records with ``zero_grad()``
    before ``step()`` (what FSDP2, which needs every rank's passes, asks): exactly the noise of
    a step with no backward pass."""
    model = _hf(kind)
    ids = torch.randint(2, V, (1, 6))
    ref = copy.deepcopy(model)
    ref.zero_grad()
    _hf_loss(ref, kind, ids).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    gref = [p.grad for p in ref.parameters() if p.requires_grad]
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in gref if g is not None))
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), model=model, noise_multiplier=0.0, max_grad_norm=norm / 2,
                      expected_batch_size=2.0, ledger=_ledger())
    opt.ledger.record_sample(100, 0.02)
    _hf_loss(model, kind, ids).backward()
    opt.step()
    for p, g in zip(params, gref):
        want = torch.zeros_like(p) if g is None else g * (0.5 / 2.0)
        np.testing.assert_allclose(p.grad.double().numpy(), want.double().numpy(), rtol=2e-4, atol=1e-7)
    opt.engine.remove()

    def noise(run_placeholder: bool):
        m = _hf(kind)
        o = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), model=m, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2.0, ledger=_ledger(), seed=9)
        o.ledger.record_sample(100, 0.02)
        if run_placeholder:
            _hf_loss(m, kind, torch.full((1, 6), 2)).backward()
            o.zero_grad()
        o.step()
        assert o.ledger.num_releases == 1
        g = [p.grad.clone() for p in m.parameters()]
        o.engine.remove()
        return g

    for a, b in zip(noise(True), noise(False)):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


def test_t5_relative_bias_of_an_empty_batch() -> None:
    """T5's relative attention bias, looked up per record, for a batch of no record: (0, heads, q, k)."""
    from dpcore.torch._rules import EMPTY_BATCH

    model = _hf("t5")
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=0.0,
                      max_grad_norm=1.0, expected_batch_size=2.0, ledger=_ledger())
    host = model.encoder.block[0].layer[0].SelfAttention
    opt.engine.batch_hint = EMPTY_BATCH
    bias = host.compute_bias(5, 5)
    assert bias.shape == (0, 2, 5, 5)
    opt.engine.batch_hint = 3
    assert host.compute_bias(5, 5).shape == (3, 2, 5, 5)
    opt.engine.remove()
