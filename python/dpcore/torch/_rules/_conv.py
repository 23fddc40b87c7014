"""Rules of convolutions.

* ``nn.Conv1d``/``nn.Conv2d``/``nn.Conv3d``: per-record gradients from the unfolded input (one
  batched matrix product per layer, the input gradient by ``convolution_backward`` without the
  weight's).
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .._amp import amp_cast as _amp_cast
from .._contrib import Dense, Factored
from ._base import LayerRule, _frozen


class _ConvFn(torch.autograd.Function):
    """Convolution whose backward returns ∂L/∂x only and hands (x, ∂L/∂y) to ``sink``;
    ``conf`` = (stride, padding, dilation, groups)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conf: Any, sink: Callable) -> torch.Tensor:
        x, w, b = _amp_cast(x, weight.detach(), None if bias is None else bias.detach())
        ctx.save_for_backward(x, w)
        ctx.conf, ctx.sink = conf, sink
        stride, padding, dilation, groups = conf
        nd = x.dim() - 2
        return torch.ops.aten.convolution(x, w, b, stride, padding, dilation, False, [0] * nd, groups)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None, None]:
        x, w = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conf
        ctx.sink(x.detach(), g.detach())
        gx = None
        if ctx.needs_input_grad[0]:
            nd = x.dim() - 2
            gx = torch.ops.aten.convolution_backward(
                g, x, w, None, stride, padding, dilation, False, [0] * nd, groups, [True, False, False]
            )[0]
        return gx, None, None, None, None


class ConvRule(LayerRule):
    """Conv1d/2d/3d: each record's weight gradient is the weight gradient of a grouped
    convolution with the batch folded into the channels (groups = B·groups; the grouped-
    convolution form of per-example conv gradients, as in ``torch.nn.utils._expanded_weights``),
    one ``convolution_backward`` per layer, as fast as the batch weight gradient; the input
    gradient by ``convolution_backward`` with the weight's masked off. Padding modes are applied
    before the tap, so the rule sees an unpadded convolution."""

    kind = "conv"
    #: Conv2d layers with at most this many weights per output channel (C_in·k·k) form their
    #: per-record gradients from the unfolded input (see _capture).
    UNFOLD_FAN_IN = 64
    #: Conv2d layers whose unfolded input (B × positions × C_in·k·k) has at most this many
    #: elements are taken as factored products (see _capture).
    FACTORED_ELEMENTS = 1 << 25

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        nd = m.weight.dim() - 2
        unbatched = x.dim() == nd + 1
        if unbatched:
            x = x.unsqueeze(0)
        pad = m._reversed_padding_repeated_twice
        # Symmetric zero padding stays inside the convolutions (no padded copy of x).
        inner = [pad[2 * i] for i in reversed(range(nd))]
        symmetric = m.padding_mode == "zeros" and all(pad[2 * i] == pad[2 * i + 1] for i in range(nd))
        if not symmetric:
            inner = [0] * nd
            x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
        wp, bp = self.p("weight"), self.p("bias")

        def sink(xi: torch.Tensor, g: torch.Tensor) -> None:
            self._capture(xi, g, wp, bp, inner)

        conf = (list(m.stride), inner, list(m.dilation), m.groups)
        y = _ConvFn.apply(x, _frozen(m.weight, wp), _frozen(m.bias, bp), conf, sink)
        return y.squeeze(0) if unbatched else y

    def _capture(self, x: torch.Tensor, g: torch.Tensor, wp: Any, bp: Any, padding: List[int]) -> None:
        m = self.module
        b = x.shape[0]
        if b == 0:  # an empty Poisson batch: no record (the reshapes below need one to infer a size)
            self.add_empty(wp, bp)
            return
        if bp is not None:
            self.add(Dense(bp, g.reshape(b, g.shape[1], -1).sum(2)))
        if wp is None:
            return
        nd = x.dim() - 2
        w = m.weight
        fan_in = math.prod(w.shape[1:])
        positions = g[0, 0].numel()
        if (nd == 2 and m.groups == 1 and g.dtype in (torch.float32, torch.float64)
                and positions * (fan_in + w.shape[0]) <= fan_in * w.shape[0]
                and b * positions * fan_in <= self.FACTORED_ELEMENTS):
            # Few positions and many channels (the deep layers of a ResNet: 4×4 or 8×8 positions,
            # 256-512 channels): the convolution as the matrix product it is (im2col), each
            # record's gradient Σ_t g_t a_tᵀ over its output positions t with a_t the unfolded
            # input patch. As a factored contribution its norms come from Gram matrices (ghost
            # norms, T²(din + dout) instead of T·din·dout) and the clipped sum from one product
            # over the batch. Elsewhere unfolding costs more than it saves (im2col of a 32×32
            # map): the folded convolution below. The unfolded input is bounded.
            cols = F.unfold(x, tuple(w.shape[2:]), dilation=tuple(m.dilation), padding=tuple(padding),
                            stride=tuple(m.stride))
            # (records, positions, features) laid out once, so the norms and the clipped sum read
            # them without further copies
            self.add(Factored(wp, cols.transpose(1, 2).contiguous(),
                              g.reshape(b, g.shape[1], positions).transpose(1, 2).contiguous()))
            return
        per = torch.empty((b,) + tuple(w.shape), dtype=g.dtype, device=g.device)
        # records in chunks, so that the folded convolution's operands stay moderate
        chunk = max(1, (1 << 26) // max(1, x[0].numel() + g[0].numel()))
        if nd == 2 and m.groups == 1 and fan_in <= self.UNFOLD_FAN_IN and g.dtype in (torch.float32, torch.float64):
            # Few input channels (a first layer on images: 3·3·3 = 27): the grouped convolution
            # with B groups of so few channels runs many times slower than the batch's weight
            # gradient (oneDNN), while the unfolded input is small: each record's gradient is
            # one batched product g_i (C_out × L) · unfold(x_i)ᵀ (L × C_in·k·k).
            chunk = max(1, (1 << 26) // max(1, fan_in * g[0, 0].numel() + g[0].numel()))
            for lo in range(0, b, chunk):
                hi = min(b, lo + chunk)
                cols = F.unfold(x[lo:hi], tuple(w.shape[2:]), dilation=tuple(m.dilation), padding=tuple(padding),
                                stride=tuple(m.stride))
                gi = g[lo:hi].reshape(hi - lo, g.shape[1], -1)
                torch.bmm(gi, cols.transpose(1, 2), out=per[lo:hi].view(hi - lo, w.shape[0], fan_in))
            self.add(Dense(wp, per))
            return
        for lo in range(0, b, chunk):
            hi = min(b, lo + chunk)
            n = hi - lo
            shape = (n * w.shape[0],) + tuple(w.shape[1:])
            per[lo:hi] = torch.ops.aten.convolution_backward(
                g[lo:hi].reshape((1, n * g.shape[1]) + tuple(g.shape[2:])),
                x[lo:hi].reshape((1, n * x.shape[1]) + tuple(x.shape[2:])),
                torch.empty(shape, dtype=g.dtype, device=g.device),
                None, list(m.stride), padding, list(m.dilation), False, [0] * nd, n * m.groups,
                [False, True, False],
            )[1].reshape((n,) + tuple(w.shape))
        self.add(Dense(wp, per))
