"""dpcore.torch's recurrent layers (``_rnn.py``) compute exactly what PyTorch's fused LSTM, GRU
and RNN compute: outputs, final states, and the gradients of the input and initial states; the
batch sum of the per-record weight gradients from the sink equals PyTorch's weight gradients."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from dpcore.torch._rnn import recurrent_forward  # noqa: E402

torch.set_num_threads(1)

KINDS = [("LSTM", {}), ("GRU", {}), ("RNN", {}), ("RNN", {"nonlinearity": "relu"})]


def _sums_from_sink():
    acc = {}

    def sink(layer, direction, x, hp, d_ih, d_hh):
        sfx = f"_l{layer}" + ("_reverse" if direction else "")
        for name, v in (("weight_ih" + sfx, torch.einsum("btg,bti->gi", d_ih, x)),
                        ("weight_hh" + sfx, torch.einsum("btg,bth->gh", d_hh, hp)),
                        ("bias_ih" + sfx, d_ih.sum((0, 1))), ("bias_hh" + sfx, d_hh.sum((0, 1)))):
            acc[name] = acc.get(name, 0) + v

    return acc, sink


@pytest.mark.filterwarnings("ignore:dropout option adds dropout")
@pytest.mark.parametrize("kind,kw", KINDS)
@pytest.mark.parametrize("layers,bidi,bf", [(1, False, True), (2, True, False), (2, False, True), (1, True, True)])
@pytest.mark.parametrize("with_hx", [False, True])
def test_matches_pytorch(kind, kw, layers, bidi, bf, with_hx):
    torch.manual_seed(0)
    m = getattr(nn, kind)(3, 4, num_layers=layers, bidirectional=bidi, batch_first=bf, dropout=0.3, **kw).double()
    m.eval()  # dropout between layers only in training mode
    x = torch.randn((5, 6, 3) if bf else (6, 5, 3), dtype=torch.float64, requires_grad=True)
    nd = 2 if bidi else 1
    hx = None
    if with_hx:
        h0 = torch.randn(layers * nd, 5, 4, dtype=torch.float64, requires_grad=True)
        hx = (h0, torch.randn(layers * nd, 5, 4, dtype=torch.float64, requires_grad=True)) if kind == "LSTM" else h0
    ref = m(x, hx)
    acc, sink = _sums_from_sink()
    got = recurrent_forward(m, x, hx, sink=sink)
    flat = lambda r: [r[0]] + (list(r[1]) if isinstance(r[1], tuple) else [r[1]])  # noqa: E731
    for a, b in zip(flat(got), flat(ref)):
        torch.testing.assert_close(a, b)
    weights = [torch.randn_like(t) for t in flat(ref)]
    ins = [x] + ([t for t in (hx if isinstance(hx, tuple) else (hx,))] if with_hx else [])
    g_ref = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, flat(ref))), ins + list(m.parameters()))
    g_got = torch.autograd.grad(sum((w * t).sum() for w, t in zip(weights, flat(got))), ins)
    for a, b in zip(g_got, g_ref[: len(ins)]):
        torch.testing.assert_close(a, b)
    for (name, _), g in zip(m.named_parameters(), g_ref[len(ins):]):
        torch.testing.assert_close(acc[name], g, msg=name)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_unbatched_and_float32(kind):
    torch.manual_seed(1)
    m = getattr(nn, kind)(3, 4, num_layers=2)
    x = torch.randn(7, 3)
    ref = m(x)
    got = recurrent_forward(m, x, sink=lambda *a: None)
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])


def test_packed_sequence_refused():
    m = nn.LSTM(3, 4)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3), [5, 3])
    with pytest.raises(TypeError, match="PackedSequence"):
        recurrent_forward(m, packed, sink=lambda *a: None)
