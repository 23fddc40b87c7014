"""Rules of convolutions.

* ``nn.Conv1d``/``nn.Conv2d``/``nn.Conv3d``: the input gradient by ``convolution_backward``
  without the weight's; each record's weight gradient, by shape, the cheapest of: the unfolded
  input times the output gradient (few input channels: a first layer), the factors themselves
  with ghost norms from Gram matrices of the padded input (few positions: the deep layers of a
  ResNet, :class:`~dpcore.torch._contrib.ConvFactors`), or the weight gradient of a grouped
  convolution with the records folded into the channels (elsewhere).
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .._amp import amp_cast as _amp_cast
from .._contrib import ConvFactors, ConvFolded, Dense
from ._base import LayerRule, _frozen


class _ConvFn(torch.autograd.Function):
    """Convolution whose backward returns ∂L/∂x only and hands (x, ∂L/∂y, the weight used) to ``sink``;
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
        ctx.sink(x.detach(), g.detach(), w)
        gx = None
        if ctx.needs_input_grad[0]:
            nd = x.dim() - 2
            gx = torch.ops.aten.convolution_backward(
                g, x, w, None, stride, padding, dilation, False, [0] * nd, groups, [True, False, False]
            )[0]
        return gx, None, None, None, None


class ConvRule(LayerRule):
    """Conv1d/2d/3d: the input gradient by ``convolution_backward`` with the weight's masked
    off; each record's weight gradient in the cheapest of three forms (see :meth:`_capture`):
    the unfolded input times the output gradient (fan-in up to :attr:`UNFOLD_FAN_IN`), the
    factors themselves with ghost norms (:class:`ConvFactors`, where the padded input's Gram
    matrices cost less than materialising), or the weight gradient of a grouped convolution
    with the records folded into the channels (groups = B·groups; the grouped-convolution form
    of per-example conv gradients, as in ``torch.nn.utils._expanded_weights``). Padding modes
    are applied before the tap, so the rule sees an unpadded convolution."""

    kind = "conv"
    #: Conv2d layers with at most this many weights per output channel (C_in·k·k) form their
    #: per-record gradients from the unfolded input (see _capture).
    UNFOLD_FAN_IN = 64
    #: Conv2d layers (float32/float64, fan-in above UNFOLD_FAN_IN) hand their factors to ghost
    #: norms (:class:`ConvFactors`): None chooses by shape (:meth:`_ghost_cheaper`), True and
    #: False always and never (tests compare the paths).
    GHOST_NORMS: Optional[bool] = None

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

        def sink(xi: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> None:
            self._capture(xi, g, w, wp, bp, inner)

        conf = (list(m.stride), inner, list(m.dilation), m.groups)
        self.expect(wp, bp)
        y = _ConvFn.apply(x, _frozen(m.weight, wp), _frozen(m.bias, bp), conf, sink)
        return y.squeeze(0) if unbatched else y

    def _capture(self, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, wp: Any, bp: Any, padding: List[int]) -> None:
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
        fan_in = math.prod(w.shape[1:])
        plain = nd == 2 and g.dtype in (torch.float32, torch.float64) and x.dtype == g.dtype == w.dtype
        if plain and m.groups == 1 and fan_in <= self.UNFOLD_FAN_IN:
            # Few input channels (a first layer on images: 3·3·3 = 27): the grouped convolution
            # with B groups of so few channels runs many times slower than the batch's weight
            # gradient (oneDNN), while the unfolded input is small: each record's gradient is
            # one batched product g_i (C_out × L) · unfold(x_i)ᵀ (L × C_in·k·k).
            self.add(Dense(wp, self._unfolded(x, g, w, padding)))
            return
        ghost = self.GHOST_NORMS
        if plain and (self._ghost_cheaper(x, g, w, padding) if ghost is None else ghost):
            # Few positions and many channels (the deep layers of a ResNet: 8×8 or 4×4 positions,
            # 256-512 channels): the factors themselves, norms from Gram matrices (ghost norms,
            # no per-record gradient formed) and the clipped sum as one weight gradient.
            conf = (list(m.stride), list(padding), list(m.dilation), m.groups)
            self.add(ConvFactors(wp, x, g, w, conf))
            return
        # elsewhere (many positions: the first stages of a ResNet; Conv1d/3d; half precision): the
        # per-record gradients of the folded grouped convolution, a chunk of records at a time
        self.add(ConvFolded(wp, x, g, w, (list(m.stride), list(padding), list(m.dilation), m.groups)))

    def _ghost_cheaper(self, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, padding: List[int]) -> bool:
        """Whether the ghost norms of :class:`ConvFactors` cost less than materialising the
        per-record gradients. Per record, the ghost norms form the Gram matrix of each residue
        class (modulo the stride) of the padded input's positions (P² · C_in/groups each), the
        output gradient's Gram (T² · C_out/groups) and add k·k strided T×T views (memory bound,
        weighted ×10); the grouped convolution's per-record gradients cost about 1.5 times the
        batch weight gradient (T · C_in/groups·k·k · C_out), of which the clipped sum through
        :class:`ConvFactors` pays one (its one weight gradient) and the other path the rest
        (with a pass over the per-record gradients for the norm and one for the sum)."""
        m = self.module
        (sh, sw), (dh, dw), groups = m.stride, m.dilation, m.groups
        kh, kw = int(w.shape[2]), int(w.shape[3])
        ho, wo = int(g.shape[2]), int(g.shape[3])
        t = ho * wo
        hu, wu = sh * (ho - 1) + dh * (kh - 1) + 1, sw * (wo - 1) + dw * (kw - 1) + 1
        classes = {(dh * i % sh, dw * j % sw) for i in range(kh) for j in range(kw)}
        grams = sum((-(-(hu - a) // sh) * -(-(wu - c) // sw)) ** 2 for a, c in classes)
        cin_g, cout = int(x.shape[1]) // groups, int(g.shape[1])
        ghost = grams * cin_g * groups + t * t * cout + 10 * kh * kw * t * t * groups
        folded = 0.5 * t * cin_g * kh * kw * cout + 2 * cout * cin_g * kh * kw
        return ghost < folded

    def _unfolded(self, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, padding: List[int]) -> torch.Tensor:
        """Per-record gradients (B, *weight) as g_i · unfold(x_i)ᵀ, in chunks of records (a 1×1
        convolution with stride 1 and no padding reads its input as it is)."""
        m = self.module
        b, fan_in = x.shape[0], math.prod(w.shape[1:])
        per = torch.empty((b,) + tuple(w.shape), dtype=g.dtype, device=g.device)
        positions = g[0, 0].numel()
        gv = g.reshape(b, g.shape[1], positions)
        pointwise = tuple(w.shape[2:]) == (1, 1) and tuple(m.stride) == (1, 1) and not any(padding)
        if pointwise:
            torch.bmm(gv, x.reshape(b, x.shape[1], positions).transpose(1, 2), out=per.view(b, w.shape[0], fan_in))
            return per
        chunk = max(1, (1 << 22) // max(1, fan_in * positions + g[0].numel()))
        for lo in range(0, b, chunk):
            hi = min(b, lo + chunk)
            cols = F.unfold(x[lo:hi], tuple(w.shape[2:]), dilation=tuple(m.dilation), padding=tuple(padding),
                            stride=tuple(m.stride))
            torch.bmm(gv[lo:hi], cols.transpose(1, 2), out=per[lo:hi].view(hi - lo, w.shape[0], fan_in))
        return per
