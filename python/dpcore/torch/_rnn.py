"""LSTM, GRU and RNN layers whose backward through time hands out per-record gate gradients.

PyTorch's fused recurrent kernels return only the batch-summed weight gradients. Here each
(layer, direction) runs as one autograd function: the forward loop computes the module's own
outputs from its own parameters; the backward loop is written out by hand (the standard
backpropagation-through-time recursions) and, instead of the weight gradients, hands the
pre-activation gradients of every step to ``sink``:

    sink(layer, direction, x, h_prev, d_ih, d_hh)

with x (B, T, in) the step inputs, h_prev (B, T, H) the hidden state entering each step, and
d_ih, d_hh (B, T, G·H) the gradients of x_t W_ihᵀ + b_ih and h_{t−1} W_hhᵀ + b_hh, in PyTorch's
gate order (G = 4 for LSTM i, f, g, o; 3 for GRU r, z, n; 1 for RNN). Each record's gradient of
weight_ih is then Σ_t d_ih,t x_tᵀ, of weight_hh Σ_t d_hh,t h_{t−1}ᵀ, of the biases Σ_t d: the
factored form of a linear layer applied at T positions. The steps of the reverse direction are
handed over in processing order, which these sums do not depend on.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.utils.rnn import PackedSequence

from ._amp import amp_cast, amp_dtype
from ._autograd import retaining_graph

__all__ = ["recurrent_forward"]

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def _fused(mode: str, xt: torch.Tensor, h0: torch.Tensor, c0: Optional[torch.Tensor], w: Tuple[Any, ...]) -> Tuple[torch.Tensor, ...]:
    """PyTorch's own fused kernel for one layer and direction, time-major: (outputs, h_n[, c_n])."""
    params = [t for t in w if t is not None]
    has_b = w[2] is not None
    if mode == "LSTM":
        return torch._VF.lstm(xt, (h0.unsqueeze(0), c0.unsqueeze(0)), params, has_b, 1, 0.0, False, False, False)  # type: ignore[attr-defined]
    f = {"GRU": torch._VF.gru, "RNN_TANH": torch._VF.rnn_tanh, "RNN_RELU": torch._VF.rnn_relu}[mode]  # type: ignore[attr-defined]
    return f(xt, h0.unsqueeze(0), params, has_b, 1, 0.0, False, False, False)


def _lstm_states(xw: torch.Tensor, hs: torch.Tensor, c0: torch.Tensor, w_hh: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The activated gates and the cell states of every step, from the hidden states of the
    fused forward: the gates need no recursion once h_{t−1} is known (one product for all
    steps), and the cells only the cheap c_t = f_t·c_{t−1} + i_t·g_t."""
    t_len, b, g4 = xw.shape
    hid = g4 // 4
    gates = torch.addmm(xw.view(-1, g4), hs[:-1].reshape(-1, hid), w_hh.t()).view(t_len, b, g4)
    gates[..., : 2 * hid].sigmoid_()
    gates[..., 2 * hid : 3 * hid].tanh_()
    gates[..., 3 * hid :].sigmoid_()
    ig = gates[..., :hid] * gates[..., 2 * hid : 3 * hid]
    f = gates[..., hid : 2 * hid]
    cs = c0.new_empty((t_len + 1, b, hid))
    cs[0] = c0
    for t in range(t_len):
        torch.addcmul(ig[t], f[t], cs[t], out=cs[t + 1])
    return gates, cs


def _lstm_backward(dout: torch.Tensor, dh: torch.Tensor, dc: torch.Tensor, hs: torch.Tensor, cs: torch.Tensor, gates: torch.Tensor, w_hh: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t_len, b, g4 = gates.shape
    hid = g4 // 4
    # Everything that does not depend on the recursion, for all steps at once (a few large ops
    # instead of ~20 small ones per step): with tc = tanh(c_t),
    #   dc_t  = dc_{t+1}·f_{t+1} + dh_t·o·(1 − tc²)
    #   d_pre = [dc·g·i(1−i), dc·c_{t−1}·f(1−f), dc·i·(1−g²), dh·tc·o(1−o)]
    i, f, g, o = gates[..., :hid], gates[..., hid : 2 * hid], gates[..., 2 * hid : 3 * hid], gates[..., 3 * hid :]
    tc = torch.tanh(cs[1:])
    ocf = o * (1 - tc * tc)
    q = torch.empty_like(gates)
    q4 = q.view(t_len, b, 4, hid)
    torch.mul(g, i - i * i, out=q4[:, :, 0])
    torch.mul(cs[:-1], f - f * f, out=q4[:, :, 1])
    torch.mul(i, 1 - g * g, out=q4[:, :, 2])
    torch.mul(tc, o - o * o, out=q4[:, :, 3])
    del tc
    d = torch.empty_like(gates)
    d4 = d.view(t_len, b, 4, hid)
    dh = dh.clone()
    for t in range(t_len - 1, -1, -1):
        dh.add_(dout[t])
        dc = torch.addcmul(dc, dh, ocf[t])
        torch.mul(dc.unsqueeze(1), q4[t, :, :3], out=d4[t, :, :3])
        torch.mul(dh, q4[t, :, 3], out=d4[t, :, 3])
        dc = dc * f[t]
        dh = d[t].matmul(w_hh)
    return d, dh, dc


def _gru_states(xw: torch.Tensor, hs: torch.Tensor, w_hh: torch.Tensor, b_hh: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """r, z, n (activated) and W_hn·h_{t−1} + b_hn of every step, from the fused forward's
    hidden states (no recursion)."""
    t_len, b, g3 = xw.shape
    hid = g3 // 3
    hp = hs[:-1].reshape(-1, hid)
    gh = (hp.matmul(w_hh.t()) if b_hh is None else torch.addmm(b_hh, hp, w_hh.t())).view(t_len, b, g3)
    rzn = xw
    rzn[..., : 2 * hid].add_(gh[..., : 2 * hid]).sigmoid_()
    gh_n = gh[..., 2 * hid :].contiguous()
    rzn[..., 2 * hid :].addcmul_(rzn[..., :hid], gh_n).tanh_()
    return rzn, gh_n


def _gru_backward(dout: torch.Tensor, dh: torch.Tensor, hs: torch.Tensor, rzn: torch.Tensor, gh_n: torch.Tensor, w_hh: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t_len = dout.shape[0]
    hid = dh.shape[1]
    d_ih = torch.empty_like(rzn)
    d_hh = torch.empty_like(rzn)
    for t in range(t_len - 1, -1, -1):
        x = rzn[t]
        r, z, n = x[:, :hid], x[:, hid : 2 * hid], x[:, 2 * hid :]
        dh = dh + dout[t]
        dn_pre = dh * (1 - z) * (1 - n * n)
        di, dhh = d_ih[t], d_hh[t]
        torch.mul(dn_pre * gh_n[t], r * (1 - r), out=di[:, :hid])
        torch.mul(dh * (hs[t] - n), z * (1 - z), out=di[:, hid : 2 * hid])
        di[:, 2 * hid :] = dn_pre
        dhh[:, : 2 * hid] = di[:, : 2 * hid]
        torch.mul(dn_pre, r, out=dhh[:, 2 * hid :])
        dh = torch.addmm(dh * z, dhh, w_hh)
    return d_ih, d_hh, dh


def _rnn_backward(dout: torch.Tensor, dh: torch.Tensor, hs: torch.Tensor, w_hh: torch.Tensor, relu: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    t_len = dout.shape[0]
    d = torch.empty_like(dout)
    for t in range(t_len - 1, -1, -1):
        dh = dh + dout[t]
        y = hs[t + 1]
        torch.mul(dh, (y > 0).to(y.dtype) if relu else 1 - y * y, out=d[t])
        dh = d[t].matmul(w_hh)
    return d, dh


class _RecurrentFn(torch.autograd.Function):
    """One layer and direction over the whole sequence (time-major inside)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h0: torch.Tensor, c0: Optional[torch.Tensor], anchor: torch.Tensor, w: Tuple[Any, ...], conf: Tuple[Any, ...]) -> Tuple[torch.Tensor, ...]:
        if amp_dtype(x.device.type) is None:
            return _RecurrentFn._run(ctx, x, h0, c0, w, conf)
        # Under autocast: the whole recurrence in the autocast dtype (as autocast runs PyTorch's
        # own recurrent kernels), with autocast off inside so that nothing is cast back and forth.
        x, h0, c0, *ws = amp_cast(x, h0, c0, *w)
        with torch.autocast(x.device.type, enabled=False):
            return _RecurrentFn._run(ctx, x, h0, c0, tuple(ws), conf)

    @staticmethod
    def _run(ctx: Any, x: torch.Tensor, h0: torch.Tensor, c0: Optional[torch.Tensor], w: Tuple[Any, ...], conf: Tuple[Any, ...]) -> Tuple[torch.Tensor, ...]:
        mode, reverse, sink = conf
        w_ih, w_hh, b_ih, b_hh = w
        xt = x.transpose(0, 1)  # (T, B, in)
        if reverse:
            xt = xt.flip(0)
        # (explicit sizes: an empty Poisson batch has B = 0, where a -1 could be any size)
        xw = xt.matmul(w_ih.t()) if b_ih is None else torch.addmm(b_ih, xt.reshape(-1, xt.shape[2]), w_ih.t()).view(xt.shape[0], xt.shape[1], w_ih.shape[0])
        xw = xw.contiguous()
        fused = _fused(mode, xt.contiguous(), h0, c0, (w_ih, w_hh, b_ih, b_hh))
        hs = torch.cat([h0.unsqueeze(0), fused[0]], 0)
        if mode == "LSTM":
            if b_hh is not None:
                xw += b_hh
            gates, cs = _lstm_states(xw, hs, c0, w_hh)
            saved: Tuple[torch.Tensor, ...] = (hs, cs, gates)
        elif mode == "GRU":
            rzn, gh_n = _gru_states(xw, hs, w_hh, b_hh)
            saved = (hs, rzn, gh_n)
        else:
            saved = (hs,)
        ctx.saved = saved
        ctx.x, ctx.w, ctx.conf = x, w, conf
        # The outputs are PyTorch's own; backward linearises at the states recomputed above.
        out = fused[0]
        if reverse:
            out = out.flip(0)
        out = out.transpose(0, 1)
        if mode != "LSTM":
            return out, fused[1][0]
        return out, fused[1][0], fused[2][0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dh_n: Optional[torch.Tensor], dc_n: Optional[torch.Tensor] = None) -> Tuple[Any, ...]:
        mode, reverse, sink = ctx.conf
        w_ih, w_hh, _, _ = ctx.w
        saved = ctx.saved
        hs = saved[0]
        dt = dout.transpose(0, 1)
        if reverse:
            dt = dt.flip(0)
        dh = torch.zeros_like(hs[0]) if dh_n is None else dh_n
        dc0 = None
        if mode == "LSTM":
            dc = torch.zeros_like(hs[0]) if dc_n is None else dc_n
            d_ih, dh0, dc0 = _lstm_backward(dt, dh, dc, hs, saved[1], saved[2], w_hh)
            d_hh = d_ih
        elif mode == "GRU":
            d_ih, d_hh, dh0 = _gru_backward(dt, dh, hs, saved[1], saved[2], w_hh)
        else:
            d_ih, dh0 = _rnn_backward(dt, dh, hs, w_hh, mode == "RNN_RELU")
            d_hh = d_ih
        if not retaining_graph():  # (a lean norm pass runs this node again)
            del ctx.saved
        x = ctx.x
        xt = x.transpose(0, 1)
        if reverse:
            xt = xt.flip(0)
        # Records first for the sink (one contiguous copy each, which the norms and sums then read
        # in place; d_hh is d_ih itself for LSTM and RNN, so the weights share its products).
        # The steps of a reverse direction stay in processing order.
        d_ih_b = d_ih.transpose(0, 1).contiguous()
        d_hh_b = d_ih_b if d_hh is d_ih else d_hh.transpose(0, 1).contiguous()
        sink(xt.transpose(0, 1).contiguous(), hs[:-1].transpose(0, 1).contiguous(), d_ih_b, d_hh_b)
        dx = None
        if ctx.needs_input_grad[0]:
            dxt = d_ih.matmul(w_ih)
            if reverse:
                dxt = dxt.flip(0)
            dx = dxt.transpose(0, 1)
        return dx, dh0, dc0, None, None, None


def recurrent_forward(module: nn.RNNBase, input: Any, hx: Any = None, *, sink: Callable[..., None], anchor: Optional[torch.Tensor] = None) -> Any:
    """``module(input, hx)`` computed from the module's own parameters, with ``sink(layer,
    direction, x, h_prev, d_ih, d_hh)`` called in the backward pass (see the module docstring).
    Same outputs as PyTorch's LSTM/GRU/RNN: multi-layer, bidirectional, batch_first or not,
    unbatched input, dropout between layers in training mode."""
    if isinstance(input, PackedSequence):
        raise TypeError(
            f"{type(module).__name__}: PackedSequence inputs are not supported by dpcore.torch; pad the "
            "sequences (per-record gradients of padded steps are exact when the loss ignores them)"
        )
    mode = module.mode
    if mode not in _GATES:
        raise ValueError(f"unsupported recurrent mode {mode!r}")
    if getattr(module, "proj_size", 0):
        raise ValueError("LSTM with proj_size > 0 is not supported")
    if anchor is None:
        anchor = torch.ones((), requires_grad=True)
    unbatched = input.dim() == 2
    x = input.unsqueeze(0) if unbatched else (input if module.batch_first else input.transpose(0, 1))
    b = x.shape[0]
    nd = 2 if module.bidirectional else 1
    hid = module.hidden_size
    lstm = mode == "LSTM"
    if hx is None:
        h0 = x.new_zeros((module.num_layers * nd, b, hid))
        c0 = h0 if lstm else None
    else:
        h0, c0 = (hx if lstm else (hx, None))
        if unbatched:
            h0 = h0.unsqueeze(1)
            c0 = c0.unsqueeze(1) if c0 is not None else None
    hn: List[torch.Tensor] = []
    cn: List[torch.Tensor] = []
    layer_in = x
    for layer in range(module.num_layers):
        outs = []
        for direction in range(nd):
            sfx = f"_l{layer}" + ("_reverse" if direction else "")
            w = tuple(
                None if getattr(module, name + sfx, None) is None else getattr(module, name + sfx).detach()
                for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
            )
            k = layer * nd + direction

            def layer_sink(xx: torch.Tensor, hp: torch.Tensor, di: torch.Tensor, dhh: torch.Tensor, _l: int = layer, _d: int = direction) -> None:
                sink(_l, _d, xx, hp, di, dhh)

            res = _RecurrentFn.apply(
                layer_in, h0[k], None if c0 is None else c0[k], anchor, w, (mode, direction == 1, layer_sink)
            )
            outs.append(res[0])
            hn.append(res[1])
            if lstm:
                cn.append(res[2])
        layer_in = outs[0] if nd == 1 else torch.cat(outs, 2)
        if module.dropout > 0 and module.training and layer < module.num_layers - 1:
            layer_in = F.dropout(layer_in, p=module.dropout, training=True)
    out = layer_in
    h_n = torch.stack(hn, 0)
    c_n = torch.stack(cn, 0) if lstm else None
    if unbatched:
        out, h_n = out.squeeze(0), h_n.squeeze(1)
        c_n = c_n.squeeze(1) if c_n is not None else None
    elif not module.batch_first:
        out = out.transpose(0, 1)
    return (out, (h_n, c_n)) if lstm else (out, h_n)
