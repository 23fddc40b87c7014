"""Rules of normalisation layers.

* ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: g·x̂ summed over positions.
* Hugging Face's RMS norms (Llama's and the classes that copy its forward, Gemma's, T5's),
  recognised by their forward's source: the same product, computed exactly as each module does.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .._amp import amp_dtype
from .._contrib import Dense
from ._base import LayerRule, _frozen, _seq_first


class _AffineFn(torch.autograd.Function):
    """y = x̂·w + b (w, b broadcast as ``view``) whose backward hands (x̂, ∂L/∂y) to ``sink``."""

    @staticmethod
    def forward(ctx: Any, xhat: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], view: Tuple[int, ...], sink: Callable) -> torch.Tensor:
        w = None if weight is None else weight.detach().reshape(view)
        ctx.save_for_backward(xhat, w) if w is not None else ctx.save_for_backward(xhat)
        ctx.sink, ctx.has_w = sink, w is not None
        y = xhat if w is None else xhat * w
        return y if bias is None else y + bias.detach().reshape(view)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None, None]:
        saved = ctx.saved_tensors
        ctx.sink(saved[0].detach(), g.detach())
        gx = (g * saved[1] if ctx.has_w else g) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None


class _GroupNormFn(torch.autograd.Function):
    """GroupNorm with its affine map in one kernel (``native_group_norm``), saving only x and
    the per-(record, group) mean and 1/std for the backward pass (no normalised copy x̂);
    the backward pass returns ∂L/∂x only and hands each record's weight and bias gradients to
    ``sink`` as torch's own backward forms them: Σ_hw g·x̂ = (Σ_hw g·x − μ·Σ_hw g)·rstd (by
    torch's kernel itself, with the records as groups of one record's channels)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], groups: int, eps: float, sink: Callable) -> torch.Tensor:
        n, c = x.shape[:2]
        hw = x[0, 0].numel()
        w = None if weight is None else weight.detach()
        y, mean, rstd = torch.native_group_norm(x, w, None if bias is None else bias.detach(), n, c, hw, groups, eps)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.conf, ctx.sink = (n, c, hw, groups), sink
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None, None, None]:
        x, w, mean, rstd = ctx.saved_tensors
        n, c, hw, groups = ctx.conf
        g = g.contiguous()
        if x.is_contiguous():
            # The batch as one record of n·c channels in n·groups groups (the same groups, each
            # record's channels one after the other): torch's own backward then forms each
            # record's Σ_hw g·x̂ and Σ_hw g as its "batch" weight and bias gradients, in the
            # kernel that forms ∂L/∂x (one pass over g and x, as the non-private step's).
            gx, gw, gb = torch.ops.aten.native_group_norm_backward(
                g.view(1, n * c, hw), x.view(1, n * c, hw), mean.reshape(1, n * groups), rstd.reshape(1, n * groups),
                None if w is None else w.repeat(n), 1, n * c, hw, n * groups, [bool(ctx.needs_input_grad[0]), True, True],
            )
            ctx.sink(gw.view(n, c), gb.view(n, c))
            return (None if gx is None else gx.view(x.shape)), None, None, None, None, None
        gv, xv = g.reshape(n, c, hw), x.reshape(n, c, hw)
        db = gv.sum(2)
        ds = (gv * xv).sum(2)
        mu = mean.reshape(n, groups, 1).expand(n, groups, c // groups).reshape(n, c)
        rs = rstd.reshape(n, groups, 1).expand(n, groups, c // groups).reshape(n, c)
        ctx.sink((ds - db * mu) * rs, db)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.ops.aten.native_group_norm_backward(g, x, mean, rstd, w, n, c, hw, groups, [True, False, False])[0]
        return gx, None, None, None, None, None


class _LayerNormFn(torch.autograd.Function):
    """LayerNorm with its affine map in one kernel (``native_layer_norm``), saving only x and
    each position's mean and 1/std (no normalised copy x̂); the backward pass returns ∂L/∂x
    only and hands (x̂ formed again, ∂L/∂y) to ``sink``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: Tuple[int, ...], weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, sink: Callable) -> torch.Tensor:
        w = None if weight is None else weight.detach()
        b = None if bias is None else bias.detach()
        y, mean, rstd = torch.native_layer_norm(x, list(shape), w, b, eps)
        ctx.save_for_backward(x, w, b, mean, rstd)
        ctx.shape, ctx.sink = list(shape), sink
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None, None, None]:
        x, w, b, mean, rstd = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.ops.aten.native_layer_norm_backward(g, x, ctx.shape, mean, rstd, w, b, [True, False, False])[0]
        ctx.sink(x, mean, rstd, g.detach())
        return gx, None, None, None, None, None


class NormRule(LayerRule):
    """LayerNorm, GroupNorm, RMSNorm: the normalisation x̂ (no parameters) by torch, then the
    affine map through a tap: each record's weight gradient is Σ g·x̂ over its positions."""

    kind = "norm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.module, nn.GroupNorm) and _seq_first(self, x):
            return self._norm(x.transpose(0, 1)).transpose(0, 1)
        return self._norm(x)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the one-kernel forms apply: GroupNorm or LayerNorm on float32/float64 input
        with a record axis, parameters of the input's dtype, outside autocast (where the
        unfused form below casts as autocast does)."""
        m = self.module
        if not isinstance(m, (nn.GroupNorm, nn.LayerNorm)) or x.dtype not in (torch.float32, torch.float64):
            return False
        if amp_dtype(x.device.type) is not None:
            return False
        for t in (getattr(m, "weight", None), getattr(m, "bias", None)):
            if t is not None and (t.dtype != x.dtype or t.device != x.device):
                return False
        if isinstance(m, nn.GroupNorm):
            return x.dim() >= 2 and x.shape[0] > 0 and x.shape[1] == m.num_channels and x[0, 0].numel() > 0
        return x.dim() > len(m.normalized_shape) and x.numel() > 0

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        wp, bp = self.p("weight"), self.p("bias")
        if self._fused(x):
            return self._norm_fused(x, wp, bp)
        if isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(x, m.num_groups, None, None, m.eps)
            view: Tuple[int, ...] = (-1,) + (1,) * (x.dim() - 2)
            keep = 1  # channel dim
        else:
            shape = tuple(m.normalized_shape)
            if isinstance(m, nn.LayerNorm):
                xhat = F.layer_norm(x, shape, None, None, m.eps)
            else:
                xhat = F.rms_norm(x, shape, None, m.eps)
            view, keep = shape, -len(shape)

        def sink(xh: torch.Tensor, g: torch.Tensor) -> None:
            b = g.shape[0]
            if keep == 1:
                red = tuple(range(2, g.dim()))
            else:
                red = tuple(range(1, g.dim() + keep))
            if wp is not None:
                gw = (g * xh).sum(red) if red else g * xh
                self.add(Dense(wp, gw.reshape((b,) + tuple(wp.shape))))
            if bp is not None:
                gb = g.sum(red) if red else g
                self.add(Dense(bp, gb.reshape((b,) + tuple(bp.shape))))

        weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
        self.expect(wp, bp)
        return _AffineFn.apply(xhat, _frozen(weight, wp), _frozen(bias, bp), view, sink)

    def _norm_fused(self, x: torch.Tensor, wp: Any, bp: Any) -> torch.Tensor:
        m = self.module
        weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
        # the trainable parameter itself (not detached) keeps the output in the graph even when
        # x does not require grad; its gradient never forms (the backward returns none for it)
        anchor_w = weight if wp is not None else (None if weight is None else weight.detach())
        anchor_b = bias if bp is not None else (None if bias is None else bias.detach())
        if isinstance(m, nn.GroupNorm):

            def gsink(gw: torch.Tensor, gb: torch.Tensor) -> None:
                if wp is not None:
                    self.add(Dense(wp, gw))
                if bp is not None:
                    self.add(Dense(bp, gb))

            self.expect(wp, bp)
            return _GroupNormFn.apply(x, anchor_w, anchor_b, m.num_groups, m.eps, gsink)
        shape = tuple(m.normalized_shape)
        red = tuple(range(1, x.dim() - len(shape)))

        def lsink(xs: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, g: torch.Tensor) -> None:
            b = g.shape[0]
            if wp is not None:
                xh = (xs - mean).mul_(rstd).mul_(g)  # g·x̂, x̂ as torch's backward forms it
                gw = xh.sum(red) if red else xh
                del xh
                self.add(Dense(wp, gw.reshape((b,) + tuple(wp.shape))))
            if bp is not None:
                gb = g.sum(red) if red else g
                self.add(Dense(bp, gb.reshape((b,) + tuple(bp.shape))))

        self.expect(wp, bp)
        return _LayerNormFn.apply(x, shape, anchor_w, anchor_b, m.eps, lsink)


class ScaledRMSNormRule(LayerRule):
    """The RMS norms of Hugging Face models, exactly as each computes itself: ``llama`` (Llama,
    Mistral, Qwen, Phi-3 and the 140 classes with the same forward: w·(x̂ in float32, cast back
    to the input's dtype)), ``gemma`` (x̂·(1 + w) in float32, cast back) and ``t5`` (x·rsqrt in the
    promoted dtype, cast to w's dtype when it is half precision, times w). The normalisation
    runs first; the scale goes through a tap, so each record's weight gradient is Σ g·x̂ over
    its positions (the same product the module's own backward forms)."""

    kind = "norm"
    variant = "llama"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _seq_first(self, x):
            return self._norm(x.transpose(0, 1)).transpose(0, 1)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6))
        wp = self.p("weight")
        w = m.weight
        if self.variant == "gemma":
            xf = x.float()
            xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            scale = 1.0 + (w if wp is not None else w.detach()).float()
            return self._scaled(xhat, scale, wp, x.dtype)
        if self.variant == "t5":
            var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
            xhat = x * torch.rsqrt(var + eps)
            if w.dtype in (torch.float16, torch.bfloat16):
                xhat = xhat.to(w.dtype)
        else:
            xf = x.to(torch.float32)
            xhat = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return self._scaled(xhat, w if wp is not None else w.detach(), wp, None)

    def _scaled(self, xhat: torch.Tensor, scale: torch.Tensor, wp: Any, cast: Any) -> torch.Tensor:
        if wp is not None:
            def sink(xh: torch.Tensor, g: torch.Tensor) -> None:
                gw = g.float() * xh.float()
                gw = gw.sum(tuple(range(1, gw.dim() - 1))) if gw.dim() > 2 else gw
                self.add(Dense(wp, gw.reshape((g.shape[0],) + tuple(wp.shape))))

            # the affine map's tap: the weight's own gradient never forms, the sink gets g·x̂
            self.expect(wp)
            out = _AffineFn.apply(xhat, scale, None, tuple(wp.shape), sink)
        else:
            out = xhat * scale
        return out if cast is None else out.to(cast)


class GemmaRMSNormRule(ScaledRMSNormRule):
    variant = "gemma"


class T5LayerNormRule(ScaledRMSNormRule):
    variant = "t5"


# Hugging Face norms, recognised by their forward's source (the same code under 140 class names:
# each model copies Llama's); a class whose forward differs falls back to the generic path.
_HF_NORM_SOURCES: Dict[str, Type[LayerRule]] = {}
_SOURCE_RULES: Dict[type, Optional[Type[LayerRule]]] = {}


def _hf_norm_sources() -> Dict[str, Type[LayerRule]]:
    if not _HF_NORM_SOURCES:
        _HF_NORM_SOURCES["llama"] = ScaledRMSNormRule
        for mod, cls, rule in (("llama", "LlamaRMSNorm", ScaledRMSNormRule), ("gemma", "GemmaRMSNorm", GemmaRMSNormRule),
                               ("t5", "T5LayerNorm", T5LayerNormRule)):
            try:
                import importlib

                c = getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), cls)
                _HF_NORM_SOURCES[inspect.getsource(c.forward)] = rule
            except Exception:  # transformers absent or changed: those classes take the generic path
                pass
    return _HF_NORM_SOURCES


def _rule_by_source(t: type) -> Optional[Type[LayerRule]]:
    if t in _SOURCE_RULES:
        return _SOURCE_RULES[t]
    rule: Optional[Type[LayerRule]] = None
    if t.__module__.startswith("transformers.") and (t.__name__.endswith("RMSNorm") or t.__name__.endswith("LayerNorm")):
        try:
            rule = _hf_norm_sources().get(inspect.getsource(t.forward))
        except (OSError, TypeError):
            rule = None
    _SOURCE_RULES[t] = rule
    return rule
