"""Padded batches (``pad_batches=True``, issue 52): static shapes for a GPU step.

Every physical batch holds exactly ``max_physical_batch_size`` rows: the sample's records first,
then copies of record 0 with clip factor 0. Checked here: the shapes never change; a sample
larger than the size is split into padded batches, never cut, and an empty sample is one batch of
padding; at noise 0 the trained model equals the unpadded run's (the padded rows add exactly
zero, up to the float rounding of a sum over more, zero rows); the ledger is the same; a padded
row whose values are huge or NaN changes nothing; adaptive clipping's count sees only the real
records; options that cannot be padded yet are refused before anything is recorded. The grey-box
harness runs padded paths in ``test_greybox_adapters.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import dpcore
import dpcore.torch as dt
from dpcore.sampling import padded_size, physical_chunks

pytestmark = pytest.mark.filterwarnings("ignore")


def test_physical_chunks_split_and_pad():
    idx = np.arange(10, 23)  # 13 records
    chunks = physical_chunks(idx, 5, fill=0)
    assert [len(c) for c, _ in chunks] == [5, 5, 5] and [r for _, r in chunks] == [5, 5, 3]
    assert np.concatenate([c[:r] for c, r in chunks]).tolist() == idx.tolist()  # every record, once, in order
    assert chunks[-1][0][3:].tolist() == [0, 0]
    (empty, real), = physical_chunks(np.arange(0), 4, fill=7)
    assert real == 0 and empty.tolist() == [7, 7, 7, 7]
    assert len(physical_chunks(idx, 5, at_least=5)) == 5
    assert [r for _, r in physical_chunks(idx, 20)] == [13]
    with pytest.raises(ValueError, match="physical batch size"):
        physical_chunks(idx, 0)
    assert padded_size(0, 8) == 8 and padded_size(8, 8) == 8 and padded_size(9, 8) == 16


class _Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.enc(self.emb(x)).mean(1))


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 3))


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


MODELS = {
    "mlp": (_mlp, lambda g, n: torch.randn(n, 6, generator=g)),
    "cnn": (_cnn, lambda g, n: torch.randn(n, 1, 8, 8, generator=g)),
    "transformer": (_Seq, lambda g, n: torch.randint(0, 4, (n, 5), generator=g)),
}


def _run(name, pad, *, memory="default", noise=0.0, m=12, n=160, bs=10, poison=None, query=None, sampler=None, seed=3):
    build, make = MODELS[name]
    torch.manual_seed(0)
    model = build()
    g = torch.Generator().manual_seed(1)
    x, y = make(g, n), torch.randint(0, 3, (n,), generator=g)
    if poison is not None:
        x = x.clone().float() if name != "transformer" else x
        x[0] = poison
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=bs)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    path = os.path.join(tempfile.mkdtemp(prefix="dpcore-pad-"), "l.jsonl")
    kw = dict(query=query) if query is not None else dict(noise_multiplier=noise, max_grad_norm=0.1)
    if sampler is not None:
        kw["sampler"] = sampler
    model, opt, loader = dt.make_private(model, opt, loader, seed=seed, max_physical_batch_size=m, pad_batches=pad,
                                         memory=memory, ledger=path, **kw)
    shapes, releases = [], 0
    for xb, yb in loader:
        shapes.append(tuple(xb.shape))
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        releases += opt.last_step_released
    with open(path) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    return [p.detach().clone() for p in model.parameters()], shapes, releases, entries, opt


def _strip(entries):
    # what a ledger entry says about the run, without its time
    return [{k: v for k, v in e.items() if k not in ("time", "timestamp", "wall_time", "created")} for e in entries]


@pytest.mark.parametrize("memory", ["default", "lean"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_padding_changes_shapes_only(name, memory):
    a, sa, ra, la, _ = _run(name, False, memory=memory)
    b, sb, rb, lb, _ = _run(name, True, memory=memory)
    assert len({s[0] for s in sb}) == 1 and sb[0][0] == 12  # one shape, every step
    assert len({s[0] for s in sa}) > 3  # (Poisson batches vary without padding)
    assert ra == rb and _strip(la) == _strip(lb)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_large_samples_are_split_and_empty_ones_padded():
    # expected batch 10 in physical batches of 4: most samples take 2-4 padded batches
    a, sa, ra, la, _ = _run("mlp", False, m=4)
    b, sb, rb, lb, _ = _run("mlp", True, m=4)
    assert {s[0] for s in sb} == {4} and len(sb) > rb and ra == rb
    assert _strip(la) == _strip(lb)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    # q = 1/160: about e⁻¹ of the samples are empty; padded, each is one batch of padding, and the release is the noise alone
    a, sa, ra, la, _ = _run("mlp", False, bs=1, noise=1.0)
    b, sb, rb, lb, _ = _run("mlp", True, bs=1, noise=1.0)
    assert sum(s[0] == 0 for s in sa) > 30 and {s[0] for s in sb} == {12} and len(sb) == len(sa) == ra == rb
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-5)  # the same noise, the same few records


@pytest.mark.parametrize("poison", [1e30, float("nan"), float("inf")])
def test_what_the_padding_holds_does_not_matter(poison):
    # the padding repeats record 0: made huge or non-finite, it changes the run only through record 0 itself
    a, _, _, _, _ = _run("mlp", False, poison=poison)
    b, _, _, _, _ = _run("mlp", True, poison=poison)
    for u, v in zip(a, b):
        assert torch.isfinite(v).all()
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_unmasked_padding_would_be_noticed(monkeypatch):
    # the comparison above can fail: padding counted as records moves the model
    from dpcore.torch._engine import PerRecordGradients

    a, _, _, _, _ = _run("mlp", False, poison=3.0)
    monkeypatch.setattr(PerRecordGradients, "with_padding", lambda self, bad: bad)
    b, _, _, _, _ = _run("mlp", True, poison=3.0)
    assert max(float((u - v).abs().max()) for u, v in zip(a, b)) > 1e-3


def test_adaptive_clipping_counts_real_records_only():
    from dpcore.queries import QuantileAdaptiveClipQuery

    def q():
        return QuantileAdaptiveClipQuery(0.1, 0.0, 0.5, 0.2, 1.0, 10, denominator=10)

    _, _, _, _, oa = _run("mlp", False, query=q())
    _, _, _, _, ob = _run("mlp", True, query=q())
    ga, gb = oa._queries.groups[0].gs, ob._queries.groups[0].gs
    assert ga.l2_norm_clip == pytest.approx(gb.l2_norm_clip, rel=1e-12)
    assert ga.l2_norm_clip != pytest.approx(0.1)  # it adapted


def test_registered_samplers_pad_too():
    a, sa, ra, la, _ = _run("mlp", False, sampler="balls_in_bins")
    b, sb, rb, lb, _ = _run("mlp", True, sampler="balls_in_bins")
    assert {s[0] for s in sb} == {12} and ra == rb and _strip(la) == _strip(lb)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def _refused(**kw):
    model = _mlp()
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    path = os.path.join(tempfile.mkdtemp(prefix="dpcore-pad-"), "l.jsonl")
    kw.setdefault("noise_multiplier", 1.0)
    dt.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, max_grad_norm=1.0,
                    ledger=path, pad_batches=True, **kw)
    return path


def test_what_cannot_be_padded_is_refused_before_anything_is_recorded():
    with pytest.raises(ValueError, match="give max_physical_batch_size"):
        _refused()
    with pytest.raises(ValueError, match="users as the privacy unit"):
        _refused(max_physical_batch_size=8, privacy_unit="user", user_ids=[i // 2 for i in range(40)],
                 examples_per_user=2)
    with pytest.raises(ValueError, match="sampler='shuffle'"):
        _refused(max_physical_batch_size=8, sampler="shuffle")
    with pytest.raises(TypeError, match="True or False"):
        dt.DPDataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), 0.5, ledger=dpcore.PrivacyLedger(
            os.path.join(tempfile.mkdtemp(), "l.jsonl")), max_physical_batch_size=2, pad_batches=1)


def test_a_compiled_model_trains_as_eager_and_padding_compiles_once():
    # torch.compile(model) over dpcore's layers (graph breaks at its autograd functions): the same
    # training as eager at noise 0; with padded batches the graphs are made in the first step only
    import torch._dynamo
    from torch._dynamo.utils import counters

    def run(compiled, pad):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))
        g = torch.Generator().manual_seed(2)
        x, y = torch.randn(400, 6, generator=g), torch.randint(0, 3, (400,), generator=g)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, loader = dt.make_private(model, opt, loader, noise_multiplier=0.0, max_grad_norm=0.5, seed=1,
                                             max_physical_batch_size=16, pad_batches=pad)
        fn = torch.compile(model) if compiled else model
        graphs = []
        for i, (xb, yb) in enumerate(loader):
            opt.zero_grad()
            nn.functional.cross_entropy(fn(xb), yb).backward()
            opt.step()
            graphs.append(counters["stats"].get("unique_graphs", 0))
            if i == 9:
                break
        return [p.detach().clone() for p in model.parameters()], graphs

    eager, _ = run(False, True)
    compiled, graphs = run(True, True)
    for u, v in zip(eager, compiled):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    assert graphs[0] > 0 and graphs == [graphs[0]] * len(graphs), graphs
    _, unpadded = run(True, False)
    assert unpadded[-1] > graphs[-1]  # (Poisson batch sizes: graphs made again for a dynamic batch)
