"""Rules of linear layers.

* ``nn.Linear``: factored (Goodfellow 2015; ghost norms of Li et al. 2022 for sequences, mixed
  with materialised norms by shape as Bu et al. 2023).
* Hugging Face's ``Conv1D`` (GPT-2, weight stored (in, out)): the same factored form with the
  roles of its two factors exchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from .._amp import amp_cast as _amp_cast
from .._contrib import Factored
from ._base import LayerRule, _frozen, _seq_first


class LinearRule(LayerRule):
    kind = "linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if _seq_first(self, x):
            return self.linear(x.transpose(0, 1), m.weight, m.bias, wname="weight", bname="bias").transpose(0, 1)
        return self.linear(x, m.weight, m.bias, wname="weight", bname="bias")


class _TransposedLinearFn(torch.autograd.Function):
    """y = x W + b with W of shape (in, out) (Hugging Face's ``Conv1D``): backward returns
    ∂L/∂x only and hands (x, ∂L/∂y) to ``sink``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], sink: Callable) -> torch.Tensor:
        x, w, b = _amp_cast(x, weight.detach(), None if bias is None else bias.detach())
        ctx.save_for_backward(x, w)
        ctx.sink = sink
        if b is None:
            return x.matmul(w)
        # one fused product with the bias, as Conv1D's own forward (no separate pass for + b)
        return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(x.shape[:-1] + (w.shape[-1],))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        x, w = ctx.saved_tensors
        ctx.sink(x.detach(), g.detach())
        return (g.matmul(w.t()) if ctx.needs_input_grad[0] else None), None, None, None


class TransposedLinearRule(LayerRule):
    """Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2): a linear layer whose weight
    is stored (in, out), so each record's weight gradient is Σ_t x_t g_tᵀ: the factored form
    with the roles of the two factors exchanged."""

    kind = "linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        wp, bp = self.p("weight"), self.p("bias")

        def sink(a: torch.Tensor, g: torch.Tensor) -> None:
            if wp is not None:
                self.add(Factored(wp, g, a))
            if bp is not None:
                self.add(Factored(bp, None, g))

        self.expect(wp, bp)
        if _seq_first(self, x):
            x = x.transpose(0, 1)
            return _TransposedLinearFn.apply(x, _frozen(m.weight, wp), _frozen(m.bias, bp), sink).transpose(0, 1)
        return _TransposedLinearFn.apply(x, _frozen(m.weight, wp), _frozen(m.bias, bp), sink)
