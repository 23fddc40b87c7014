"""Per-layer rules: how one module type hands per-record gradient factors to the engine.

A rule wraps one module's forward while the engine is active. Its forward computes the same
outputs as the module, but through autograd functions whose backward passes return only the
input gradients and hand the factors of each record's parameter gradient to the rule as
:mod:`contributions <dpcore.torch._contrib>`. Autograd never forms the (unclipped) batch
gradient of a parameter that a rule owns.

Built-in rules (dispatch by module type, :func:`register_layer`, as Opacus's ``grad_sample/``):

* ``nn.Linear``: factored (Goodfellow 2015; ghost norms of Li et al. 2022 for sequences, mixed
  with materialised norms by shape as Bu et al. 2023).
* ``nn.Embedding``: the looked-up rows.
* ``nn.Conv1d``/``nn.Conv2d``: per-record gradients from the unfolded input (one batched matrix
  product per layer, the input gradient by ``convolution_backward`` without the weight's).
* ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``: g·x̂ summed over positions.
* ``nn.MultiheadAttention`` (every form: packed or separate projections, self and cross
  attention, masks, causal, ``add_bias_kv``, ``add_zero_attn``, dropout): its projections are
  factored uses of ``in_proj_weight`` (row blocks q, k, v) and ``out_proj``; the module and its
  ``state_dict`` are unchanged.
* ``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: a hand-written backward through time hands each step's
  gate gradients to factored uses of ``weight_ih``/``weight_hh`` (see ``_rnn.py``).
* any other module with trainable parameters: ``torch.func`` (vmap of vjp), one notice per type.
"""

from __future__ import annotations

import inspect
import math
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ._amp import amp_cast as _amp_cast, amp_dtype
from ._contrib import Contribution, Dense, Factored, Rows, RowRange

__all__ = ["LayerRule", "register_layer", "rule_for"]


class _Flags(threading.local):
    recompute = False  # inside a generic layer's per-record recomputation: no capturing


_flags = _Flags()


def _graph_task() -> int:
    f = getattr(torch._C, "_current_graph_task_id", None)
    return int(f()) if f is not None else -1


def _functorch_active() -> bool:
    f = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(f()) if f is not None else False


def _frozen(t: Optional[torch.Tensor], trainable: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
    """``t`` itself when it is the trainable parameter, else detached (or None)."""
    return t if t is None or trainable is not None else t.detach()


def _sl(t: Optional[torch.Tensor], rows: RowRange) -> Optional[torch.Tensor]:
    return t if t is None or rows is None else t[rows[0] : rows[1]]


# ----------------------------------------------------------------------------- autograd taps


class _LinearFn(torch.autograd.Function):
    """y = x W[rows]ᵀ + b[rows] whose backward returns only ∂L/∂x and hands (x, ∂L/∂y) to ``sink``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], wrows: RowRange, brows: RowRange, sink: Callable) -> torch.Tensor:
        x, w, b = _amp_cast(x, _sl(weight.detach(), wrows), _sl(None if bias is None else bias.detach(), brows))
        ctx.save_for_backward(x, w)
        ctx.sink = sink
        return F.linear(x, w, b)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None, None, None]:
        x, w = ctx.saved_tensors
        ctx.sink(x.detach(), g.detach())
        gx = g.matmul(w) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None, None


class _EmbeddingFn(torch.autograd.Function):
    """Embedding lookup whose backward hands (indices, ∂L/∂y) to ``sink`` (no weight grad)."""

    @staticmethod
    def forward(ctx: Any, idx: torch.Tensor, weight: torch.Tensor, m: nn.Embedding, sink: Callable) -> torch.Tensor:
        ctx.idx, ctx.sink = idx, sink
        return F.embedding(idx, weight.detach(), m.padding_idx, m.max_norm, m.norm_type, False, False)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[None, None, None, None]:
        ctx.sink(ctx.idx, g.detach())
        return None, None, None, None


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
    ``sink`` as torch's own backward forms them: Σ_hw g·x̂ = (Σ_hw g·x − μ·Σ_hw g)·rstd."""

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


class _ParamTapFn(torch.autograd.Function):
    """``value`` (a function of a parameter, e.g. an expanded bias row) fed into the graph; its
    backward hands ∂L/∂value to ``sink`` and returns no gradient to the parameter."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, value: torch.Tensor, sink: Callable) -> torch.Tensor:
        ctx.sink = sink
        return value.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[None, None, None]:
        ctx.sink(g.detach())
        return None, None, None


class _TapFn(torch.autograd.Function):
    """Identity on a generic layer's output; its backward hands ∂L/∂out to ``sink``. The
    ``anchor`` (a scalar leaf that requires grad) makes the output part of the graph even when
    the layer's inputs do not require grad (a first layer)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, anchor: torch.Tensor, sink: Callable) -> torch.Tensor:
        ctx.sink = sink
        return out.view_as(out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        ctx.sink(g.detach())
        return g, None, None


# ----------------------------------------------------------------------------- rule base


class LayerRule:
    """Per-record gradients of one module's trainable parameters (subclass, then
    :func:`register_layer`).

    The engine creates one rule per module and, while DP capture is active, calls
    :meth:`forward` instead of the module's own forward. ``forward`` must return what the module
    returns, computed so that autograd forms no gradient for the parameters in ``self.params``
    (name → parameter; the module's trainable parameters, all of them when ``claims_children``),
    and must call :meth:`add` during the backward pass with contributions whose per-record sum
    is each record's gradient of that parameter. The helpers :meth:`linear`, :meth:`lookup` and
    :meth:`tap` build such forwards. ``claims_children = True``: the rule also owns the
    parameters of the module's submodules (which are then not instrumented themselves).
    """

    kind = "custom"
    claims_children = False

    def __init__(self, name: str, module: nn.Module, params: Dict[str, nn.Parameter], engine: Any) -> None:
        self.name, self.module, self.params, self.engine = name, module, params, engine
        self.contributions: List[Contribution] = []
        self._had_instance_forward = "forward" in module.__dict__
        self._fwd_task = -1
        self._orig = module.forward

    # -- engine plumbing
    def install(self) -> None:
        self.module.forward = self._dispatch  # type: ignore[method-assign]

    def remove(self) -> None:
        if self._had_instance_forward:
            self.module.forward = self._orig  # type: ignore[method-assign]
        else:
            self.module.__dict__.pop("forward", None)

    def active(self) -> bool:
        # Not under torch.func transforms: a user's own vmap/grad of the model sees plain layers.
        return torch.is_grad_enabled() and not _flags.recompute and self.engine.enabled and not _functorch_active()

    def _dispatch(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active():
            return self._orig(*args, **kwargs)
        self._fwd_task = _graph_task()
        a = args[0] if args else None
        if isinstance(a, torch.Tensor) and a.dim() >= 2 and self.engine.batch_hint == 0:
            # The batch's record count is the first instrumented layer's in each forward pass
            # (the model's own input): a later layer's input with another leading size (a
            # table looked up by shared positions) must not redefine it.
            n = a.shape[0] if (self.engine.batch_first or a.dim() < 3) else a.shape[1]
            if n > 1:
                self.engine.batch_hint = int(n)
        return self.forward(*args, **kwargs)

    def clear(self) -> None:
        self.contributions = []

    def add(self, c: Contribution) -> None:
        self.contributions.append(c)
        # Which backward pass this came from: records of two passes must never be merged. A
        # forward recomputed inside a backward pass (reentrant activation checkpointing) belongs
        # to that outer pass, whatever backward its recomputation then runs.
        t = self._fwd_task if self._fwd_task != -1 else _graph_task()
        self.engine.passes.add(t)

    # -- what subclasses implement
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    # -- helpers
    def p(self, name: str) -> Optional[nn.Parameter]:
        """The trainable parameter ``name`` of this rule, or None when frozen or absent."""
        return self.params.get(name)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        wname: Optional[str] = None,
        bname: Optional[str] = None,
        wrows: RowRange = None,
        brows: RowRange = None,
    ) -> torch.Tensor:
        """F.linear(x, weight[wrows], bias[brows]) with records on dim 0 of ``x``; factored
        contributions go to the trainable parameters named ``wname``/``bname``."""
        wp = self.p(wname) if wname else None
        bp = self.p(bname) if bname else None
        if wp is None and bp is None:
            w = _sl(weight, wrows)
            return F.linear(x, w, _sl(bias, brows))

        def sink(a: torch.Tensor, g: torch.Tensor) -> None:
            if wp is not None:
                self.add(Factored(wp, a, g, wrows))
            if bp is not None:
                self.add(Factored(bp, None, g, brows))

        # Frozen tensors enter without their autograd edge; a trainable one keeps the output in
        # the graph even when x does not require grad (a first layer).
        return _LinearFn.apply(x, weight if wp is not None else weight.detach(), _frozen(bias, bp), wrows, brows, sink)

    def tap(self, out: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """``out`` unchanged, with ``sink(∂L/∂out)`` called in the backward pass."""
        return _TapFn.apply(out, self.engine.anchor, sink)


# ----------------------------------------------------------------------------- built-in rules


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

        if _seq_first(self, x):
            x = x.transpose(0, 1)
            return _TransposedLinearFn.apply(x, _frozen(m.weight, wp), _frozen(m.bias, bp), sink).transpose(0, 1)
        return _TransposedLinearFn.apply(x, _frozen(m.weight, wp), _frozen(m.bias, bp), sink)


class EmbeddingRule(LayerRule):
    """``nn.Embedding``: each record's gradient is the rows it looked up. Public as the base of
    rules for embedding-like lookups: subclass it, register it for your module
    (:func:`register_layer`), and in ``forward`` compute the index your module looks up, then
    return ``self.lookup(index)`` (records on dim 0; an index with a leading dim of 1 is looked up
    per record; one with no record axis is refused), transformed as your module transforms it.
    The module must have the ``nn.Embedding`` attributes (``weight``, ``padding_idx``,
    ``max_norm``, ...)."""

    kind = "embedding"
    #: looked up per record by a host rule (T5's relative bias, :class:`RelativeBiasRule`)
    hosted = False

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        m = self.module
        if m.scale_grad_by_freq:
            raise ValueError(
                f"layer {self.name!r}: Embedding(scale_grad_by_freq=True) scales gradients by counts over the "
                "whole batch, which mixes records; use scale_grad_by_freq=False"
            )
        if m.sparse:
            raise ValueError(f"layer {self.name!r}: Embedding(sparse=True) is not supported; noise makes every row dense")
        if self.name.split(".")[-1] == "relative_attention_bias" and not self.hosted:
            raise ValueError(
                f"layer {self.name!r}: a relative attention bias is looked up by (query, key) positions shared by the "
                "records, and its module is not one dpcore knows (T5's compute_bias): no per-record gradient of it "
                "can be formed. Freeze it (requires_grad_(False)) or register a rule for its attention module"
            )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lookup(idx)

    def lookup(self, idx: torch.Tensor) -> torch.Tensor:
        """The module's lookup of ``idx`` with each record's rows captured: records on dim 0
        (dim 1 for sequence-first models). An index shared by the batch (a leading dim of 1, as
        GPT-2's and BART's position ids) is looked up per record: its output would be broadcast
        over the records and its gradient summed over them, so each record gets its own copy
        (the output is the same). An index whose leading dim is neither 1 nor the batch's record
        count has no record axis: refused, naming the parameter."""
        hint = self.engine.batch_hint
        if self.engine.batch_first and idx.dim() >= 2 and idx.shape[0] == 1 and hint > 1:
            idx = idx.expand((hint,) + tuple(idx.shape[1:]))
        seq = _seq_first(self, idx, 2)
        lead = idx.shape[1] if seq else (idx.shape[0] if idx.dim() else 1)
        # (sequence-first models: the hint may be a length, so there the check is not made)
        if self.engine.batch_first and hint > 0 and idx.dim() >= 2 and lead != hint:
            raise ValueError(
                f"layer {self.name!r}: its lookup index has shape {tuple(idx.shape)}, with no axis of the batch's "
                f"{hint} records: its output is shared by the records, and its gradient arrives summed over them, so no "
                f"per-record gradient of {self.name}.weight can be formed. Freeze it "
                f"(model.get_submodule({self.name!r}).weight.requires_grad_(False)) or register a rule for the module "
                "that uses it (dpcore.torch.register_layer; dpcore.torch.EmbeddingRule.lookup looks up per record)"
            )
        if seq:
            return self._lookup(idx.transpose(0, 1)).transpose(0, 1)
        return self._lookup(idx)

    def _lookup(self, idx: torch.Tensor) -> torch.Tensor:
        m, w = self.module, self.params["weight"]

        def sink(i: torch.Tensor, g: torch.Tensor) -> None:
            if m.padding_idx is not None:  # torch gives the padding row no gradient
                g = g * (i != m.padding_idx).unsqueeze(-1).to(g.dtype)
            self.add(Rows(w, i.reshape(i.shape[0], -1) if i.dim() else i.reshape(1, 1), g))

        # The module's weight as it is now: under FSDP2 the gathered one (``w`` is the shard).
        return _EmbeddingFn.apply(idx, m.weight, m, sink)


#: Embedding modules whose own (subclass) forward is running under :class:`EmbeddingSubclassRule`:
#: their ``nn.Embedding.forward`` (the subclass's ``super().forward(...)``) is the rule's lookup.
_SUBCLASS_LOOKUPS: Dict[int, "EmbeddingSubclassRule"] = {}
_EMBEDDING_FORWARD = nn.Embedding.forward


def _embedding_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    rule = _SUBCLASS_LOOKUPS.get(id(self))
    if rule is not None and rule.module is self:
        return rule.lookup(input)
    return _EMBEDDING_FORWARD(self, input)


class EmbeddingSubclassRule(EmbeddingRule):
    """An ``nn.Embedding`` subclass with a forward of its own (BART's scaled word embeddings and
    learned positions, OPT's positions from the attention mask, ...): the subclass's forward runs
    as written, and its ``super().forward(ids)`` is :meth:`EmbeddingRule.lookup`, per record.
    Whatever the subclass does around the lookup (offsets, scales, positions) stays its own; a
    subclass that reads ``self.weight`` directly is refused at the first backward (the engine
    sees a gradient it did not capture)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if nn.Embedding.forward is not _embedding_forward:
            nn.Embedding.forward = _embedding_forward  # type: ignore[method-assign]
        _SUBCLASS_LOOKUPS[id(self.module)] = self
        try:
            return self._orig(*args, **kwargs)
        finally:
            _SUBCLASS_LOOKUPS.pop(id(self.module), None)


class _HostedEmbeddingRule(EmbeddingRule):
    hosted = True


class RelativeBiasRule(LayerRule):
    #: the submodules whose parameters this rule owns (the engine instruments them no further)
    claims = ("relative_attention_bias",)

    """T5's relative attention bias (T5, mT5, UMT5, LongT5, Switch, Pop2Piano: an attention
    module with a ``relative_attention_bias`` embedding and ``compute_bias``). The bias is looked
    up by a (query, key) index with no record axis and broadcast over the batch, so its gradient
    would arrive summed over the records. While DP capture is active the module's
    ``compute_bias`` looks the index up once per record instead, (B, q, k) → a bias of shape
    (B, heads, q, k): the attention adds it to scores of that shape, so the outputs are the same,
    and each record's gradient reaches its own rows. The rule owns only the bias embedding; the
    module's projections keep their own rules."""

    kind = "embedding"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        host = self.module
        if set(self.params) != {"relative_attention_bias.weight"}:
            raise AssertionError(self.params)
        sig = inspect.signature(host.compute_bias)
        names = list(sig.parameters)
        if names[:2] != ["query_length", "key_length"] or not set(names[2:]) <= {"device", "past_seen_tokens", "cache_position"}:
            raise ValueError(
                f"layer {self.name!r}: its compute_bias{sig} is not T5's; its relative_attention_bias cannot be looked "
                "up per record here: freeze it or register a rule (dpcore.torch.register_layer)"
            )
        self._names = names
        self._emb = _HostedEmbeddingRule(f"{self.name}.relative_attention_bias", host.relative_attention_bias,
                                         {"weight": self.params["relative_attention_bias.weight"]}, self.engine)
        self._emb.add = self.add  # type: ignore[method-assign]

    def install(self) -> None:
        super().install()
        self.module.compute_bias = self._compute_bias  # type: ignore[method-assign]

    def remove(self) -> None:
        super().remove()
        self.module.__dict__.pop("compute_bias", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig(*args, **kwargs)

    def _compute_bias(self, query_length: int, key_length: int, device: Any = None, *rest: Any, **kw: Any) -> torch.Tensor:
        host = self.module
        cls_bias = type(host).compute_bias
        if not self.active() or self.engine.batch_hint < 1:
            return cls_bias(host, query_length, key_length, device, *rest, **kw)
        bound = inspect.signature(cls_bias).bind(host, query_length, key_length, device, *rest, **kw)
        a = bound.arguments
        dev = a.get("device") or host.relative_attention_bias.weight.device
        if a.get("cache_position") is not None:
            context = a["cache_position"][:, None].to(dev)
        else:
            context = torch.arange(query_length, dtype=torch.long, device=dev)[:, None] + int(a.get("past_seen_tokens") or 0)
        memory = torch.arange(key_length, dtype=torch.long, device=dev)[None, :]
        bucket = host._relative_position_bucket(
            memory - context, bidirectional=not host.is_decoder, num_buckets=host.relative_attention_num_buckets,
            max_distance=host.relative_attention_max_distance,
        )
        b = self.engine.batch_hint
        values = self._emb._lookup(bucket.expand((b,) + tuple(bucket.shape)))  # (B, q, k, heads)
        return values.permute([0, 3, 1, 2])  # (B, heads, q, k)


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
            out = _AffineFn.apply(xhat, scale, None, tuple(wp.shape), sink)
        else:
            out = xhat * scale
        return out if cast is None else out.to(cast)


class GemmaRMSNormRule(ScaledRMSNormRule):
    variant = "gemma"


class T5LayerNormRule(ScaledRMSNormRule):
    variant = "t5"


class GenericRule(LayerRule):
    """Any module: its output gradient is captured during the backward pass, and the per-record
    gradients of its own parameters are ``torch.func.vmap`` of ``torch.func.vjp`` of the
    module's forward, one record at a time (materialised per record)."""

    kind = "generic"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self._inside = False
        self.captures: List[Any] = []

    def _call_with(self, tensors: Dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        """The original forward with the layer's own parameters replaced (no module hooks run)."""
        p = self.module._parameters
        saved = {n: p[n] for n in tensors}
        try:
            for n, v in tensors.items():
                p[n] = v  # type: ignore[assignment]
            return self._orig(*args, **kwargs)
        finally:
            for n, v in saved.items():
                p[n] = v

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._inside:
            return self._orig(*args, **kwargs)
        self._inside = True
        try:
            # Parameters detached: autograd does not form the (unclipped) batch gradient.
            out = self._call_with({n: p.detach() for n, p in self.params.items()}, args, kwargs)
        finally:
            self._inside = False
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"layer {self.name!r} ({type(self.module).__name__}) returns {type(out).__name__}; the generic "
                "per-record path supports layers that return one tensor: register a rule for it with "
                "dpcore.torch.register_layer"
            )
        dargs = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        # The per-record recomputation runs in the backward pass, outside autocast: it re-enters
        # the forward's autocast state so that it multiplies what the forward multiplied.
        dev = out.device.type
        amp = amp_dtype(dev)

        def per_record(g: torch.Tensor, seq_first: bool = False) -> None:
            if amp is None:
                return self._per_record(dargs, kwargs, g, seq_first=seq_first)
            with torch.autocast(dev, dtype=amp):
                return self._per_record(dargs, kwargs, g, seq_first=seq_first)

        if _seq_first(self, out):
            dargs = tuple(a.transpose(0, 1) if isinstance(a, torch.Tensor) and a.dim() >= 3 else a for a in dargs)
            return self.tap(out, lambda g: per_record(g.transpose(0, 1), seq_first=True))
        return self.tap(out, per_record)

    def _per_record(self, args: Any, kwargs: Any, g: torch.Tensor, seq_first: bool = False) -> None:
        from torch.func import vjp, vmap

        b = g.shape[0]
        params = {n: p.detach() for n, p in self.params.items()}
        pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        for i in pos:
            if args[i].shape[:1] != (b,):
                raise ValueError(
                    f"layer {self.name!r}: tensor argument {i} has no record axis of size {b} (dim 0); the "
                    "generic path batches tensor arguments along dim 0"
                )

        # Keyword tensors with a record axis (a per-record mask) are batched like the positional
        # ones; others (a mask shared by all records) are passed whole to every record.
        kpos = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == b]

        def one(p: Dict[str, torch.Tensor], xs: Tuple[torch.Tensor, ...], ks: Tuple[torch.Tensor, ...], gi: torch.Tensor) -> Any:
            full = list(args)
            for i, x in zip(pos, xs):
                full[i] = x.unsqueeze(1) if seq_first and x.dim() >= 2 else x.unsqueeze(0)
            kw = dict(kwargs)
            for k, v in zip(kpos, ks):
                kw[k] = v.unsqueeze(0)
            _, pull = vjp(lambda q: self._call_with(q, full, kw), p)
            return pull(gi.unsqueeze(1) if seq_first and gi.dim() >= 2 else gi.unsqueeze(0))[0]

        if b == 0:
            per = {n: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for n, p in params.items()}
        else:
            _flags.recompute = True
            try:
                per = vmap(one, in_dims=(None, 0, 0, 0))(
                    params, tuple(args[i] for i in pos), tuple(kwargs[k] for k in kpos), g
                )
            finally:
                _flags.recompute = False
        for n, p in self.params.items():
            self.add(Dense(p, per[n]))


class FunctionRule(GenericRule):
    """A user rule ``fn(module, args, grad_output) -> {param_name: per-record gradient}``."""

    kind = "custom"
    fn: Callable[..., Dict[str, torch.Tensor]]

    def _per_record(self, args: Any, kwargs: Any, g: torch.Tensor, seq_first: bool = False) -> None:
        got = type(self).fn(self.module, args, g)
        b = g.shape[0]
        for n, p in self.params.items():
            if n not in got:
                raise ValueError(f"rule for {type(self.module).__name__} returned no per-record gradient for {n!r}")
            per = got[n]
            if tuple(per.shape) != (b,) + tuple(p.shape):
                raise ValueError(
                    f"rule for {type(self.module).__name__}: per-record gradient of {n!r} has shape "
                    f"{tuple(per.shape)}, expected {(b,) + tuple(p.shape)}"
                )
            self.add(Dense(p, per.detach()))


def _seq_first(rule: LayerRule, x: torch.Tensor, min_dim: int = 3) -> bool:
    """Whether ``x`` holds its records on dim 1 (the engine's ``batch_first=False``, as
    PyTorch's (T, B, ·) sequence layout)."""
    return not rule.engine.batch_first and x.dim() >= min_dim


def _float_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A boolean mask (True = not allowed) as an additive float mask, as PyTorch's attention."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


class MultiheadAttentionRule(LayerRule):
    """``nn.MultiheadAttention`` with its own parameters and ``state_dict`` (no module swap).

    The in-projection is one factored use of ``in_proj_weight`` per distinct input: self
    attention projects q, k and v in one product (rows 0..3E), cross attention (decoder layers)
    projects q from the query (rows 0..E) and k, v from the memory (rows E..3E); the per-record
    norm adds the blocks' squared norms, as they are disjoint rows. ``out_proj`` is factored too
    (claimed here, since PyTorch's attention calls its weights directly). ``bias_k``/``bias_v``
    are tapped per record. The attention itself is PyTorch's ``scaled_dot_product_attention``
    (or the explicit softmax when ``need_weights``), with the masks of ``F.multi_head_attention_forward``.
    """

    kind = "attention"
    claims_children = True

    def _kv_bias(self, name: str, n: int) -> torch.Tensor:
        param = getattr(self.module, name)
        e = param.shape[-1]
        value = param.detach().reshape(1, 1, e).expand(n, 1, e)
        p = self.p(name)
        if p is None:
            return value
        return _ParamTapFn.apply(p, value, lambda g: self.add(Dense(p, g.reshape((n,) + tuple(p.shape)))))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        m = self.module
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint")
        unbatched = query.dim() == 2
        self_attn, same_kv = query is key and key is value, key is value

        def records_first(t: torch.Tensor) -> torch.Tensor:
            return t.unsqueeze(0) if unbatched else (t if m.batch_first else t.transpose(0, 1))

        q_in, k_in, v_in = records_first(query), records_first(key), records_first(value)
        if unbatched and key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        n, tl, e = q_in.shape
        h = m.num_heads
        hd = e // h
        b = m.in_proj_bias
        if m._qkv_same_embed_dim:
            w = m.in_proj_weight
            kw = dict(wname="in_proj_weight", bname="in_proj_bias")
            if self_attn:
                q, k, v = self.linear(q_in, w, b, **kw).chunk(3, -1)
            elif same_kv:
                q = self.linear(q_in, w, b, wrows=(0, e), brows=(0, e), **kw)
                k, v = self.linear(k_in, w, b, wrows=(e, 3 * e), brows=(e, 3 * e), **kw).chunk(2, -1)
            else:
                q = self.linear(q_in, w, b, wrows=(0, e), brows=(0, e), **kw)
                k = self.linear(k_in, w, b, wrows=(e, 2 * e), brows=(e, 2 * e), **kw)
                v = self.linear(v_in, w, b, wrows=(2 * e, 3 * e), brows=(2 * e, 3 * e), **kw)
        else:
            q = self.linear(q_in, m.q_proj_weight, b, wname="q_proj_weight", bname="in_proj_bias", brows=(0, e))
            k = self.linear(k_in, m.k_proj_weight, b, wname="k_proj_weight", bname="in_proj_bias", brows=(e, 2 * e))
            v = self.linear(v_in, m.v_proj_weight, b, wname="v_proj_weight", bname="in_proj_bias", brows=(2 * e, 3 * e))
        if m.bias_k is not None and m.bias_v is not None:
            k = torch.cat([k, self._kv_bias("bias_k", n)], 1)
            v = torch.cat([v, self._kv_bias("bias_v", n)], 1)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        if m.add_zero_attn:
            z = torch.zeros((n, 1, e), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, z], 1), torch.cat([v, z], 1)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        s = k.shape[1]
        causal = is_causal and key_padding_mask is None and not need_weights
        mask = None
        if not causal:
            am = _float_mask(attn_mask, q.dtype)
            if am is not None:
                am = am.reshape(1, 1, tl, s) if am.dim() == 2 else am.reshape(n, h, tl, s)
            kpm = _float_mask(key_padding_mask, q.dtype)
            if kpm is not None:
                kpm = kpm.reshape(n, 1, 1, s)
            mask = am if kpm is None else (kpm if am is None else am + kpm)
        qh = q.reshape(n, tl, h, hd).transpose(1, 2)
        kh = k.reshape(n, s, h, hd).transpose(1, 2)
        vh = v.reshape(n, s, h, hd).transpose(1, 2)
        p_drop = m.dropout if m.training else 0.0
        weights = None
        if need_weights:
            scores = torch.matmul(qh * math.sqrt(1.0 / hd), kh.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            att = torch.softmax(scores, -1)
            if p_drop > 0:
                att = F.dropout(att, p=p_drop)
            out = torch.matmul(att, vh)
            weights = att.mean(1) if average_attn_weights else att
            if unbatched:
                weights = weights.squeeze(0)
        else:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=p_drop, is_causal=causal)
        out = out.transpose(1, 2).reshape(n, tl, e)
        out = self.linear(out, m.out_proj.weight, m.out_proj.bias, wname="out_proj.weight", bname="out_proj.bias")
        out = out.squeeze(0) if unbatched else (out if m.batch_first else out.transpose(0, 1))
        return out, weights


class RecurrentRule(LayerRule):
    """``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` with their own parameters (no module swap): the
    recurrence runs in ``_rnn.py``, whose backward through time hands, per layer and direction,
    the gate gradients d_ih, d_hh (B, T, G·H) with the step inputs x and h_{t−1}; weight_ih is
    then the factored use Σ_t d_ih,t x_tᵀ, weight_hh Σ_t d_hh,t h_{t−1}ᵀ, and the biases Σ_t d."""

    kind = "recurrent"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        if getattr(self.module, "proj_size", 0):
            raise ValueError(f"layer {self.name!r}: LSTM with proj_size > 0 is not supported")

    def forward(self, input: Any, hx: Any = None) -> Any:
        from ._rnn import recurrent_forward

        def sink(layer: int, direction: int, x: torch.Tensor, h_prev: torch.Tensor, d_ih: torch.Tensor, d_hh: torch.Tensor) -> None:
            sfx = f"_l{layer}" + ("_reverse" if direction else "")
            for name, a, g in (("weight_ih", x, d_ih), ("weight_hh", h_prev, d_hh), ("bias_ih", None, d_ih), ("bias_hh", None, d_hh)):
                p = self.p(name + sfx)
                if p is not None:
                    self.add(Factored(p, a, g))

        return recurrent_forward(self.module, input, hx, sink=sink, anchor=self.engine.anchor)


# ----------------------------------------------------------------------------- registry

_REGISTRY: Dict[type, Type[LayerRule]] = {}


def register_layer(module_type: type, rule: Any) -> None:
    """Registers how dpcore.torch computes per-record gradients for ``module_type``.

    ``rule`` is either a :class:`LayerRule` subclass (factored forms, see the built-in rules in
    ``dpcore/torch/_rules.py``) or a function ``rule(module, args, grad_output)`` returning
    ``{parameter_name: per_record_gradient}`` for the module's trainable parameters, each of
    shape (B, *parameter.shape), where ``args`` are the forward's positional arguments and
    ``grad_output`` is ∂L/∂output (records on dim 0), as Opacus's ``register_grad_sampler``.
    The rule applies to ``module_type`` and to subclasses that do not override ``forward``.
    A wrong rule breaks the privacy guarantee silently: test it against per-record autograd.
    """
    if not isinstance(module_type, type) or not issubclass(module_type, nn.Module):
        raise TypeError(f"module_type must be a subclass of torch.nn.Module, got {module_type!r}")
    if isinstance(rule, type) and issubclass(rule, LayerRule):
        _REGISTRY[module_type] = rule
    elif callable(rule):
        _REGISTRY[module_type] = type(f"FunctionRule_{module_type.__name__}", (FunctionRule,), {"fn": staticmethod(rule)})
    else:
        raise TypeError(f"rule must be a LayerRule subclass or a function, got {type(rule).__name__}")


# Types of optional libraries, matched by qualified name so that they need not be imported.
_BY_NAME: Dict[str, Type[LayerRule]] = {"transformers.pytorch_utils.Conv1D": TransposedLinearRule}

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


def rule_for(module: nn.Module) -> Optional[Type[LayerRule]]:
    """The registered rule of ``module``'s type, or of the nearest registered base type whose
    ``forward`` the type inherits unchanged; an ``nn.Embedding`` subclass with a forward of its
    own gets :class:`EmbeddingSubclassRule`, Hugging Face's RMS norms their fused rules; None
    when there is none (generic path)."""
    t = type(module)
    if t in _REGISTRY:
        return _REGISTRY[t]
    named = _BY_NAME.get(f"{t.__module__}.{t.__qualname__}")
    if named is not None:
        return named
    for base in t.__mro__[1:]:
        if base in _REGISTRY and getattr(t, "forward", None) is getattr(base, "forward", None):
            return _REGISTRY[base]
    if _is_relative_bias_host(module):
        return RelativeBiasRule
    if isinstance(module, nn.Embedding):
        return EmbeddingSubclassRule  # a subclass with a forward of its own (plain ones matched above)
    return _rule_by_source(t)


def _is_relative_bias_host(module: nn.Module) -> bool:
    return (isinstance(getattr(module, "relative_attention_bias", None), nn.Embedding)
            and callable(getattr(module, "compute_bias", None))
            and callable(getattr(module, "_relative_position_bucket", None)))


for _t, _r in (
    (nn.Linear, LinearRule),
    (nn.Embedding, EmbeddingRule),
    (nn.Conv1d, ConvRule),
    (nn.Conv2d, ConvRule),
    (nn.Conv3d, ConvRule),
    (nn.LayerNorm, NormRule),
    (nn.GroupNorm, NormRule),
    (nn.MultiheadAttention, MultiheadAttentionRule),
    (nn.LSTM, RecurrentRule),
    (nn.GRU, RecurrentRule),
    (nn.RNN, RecurrentRule),
):
    _REGISTRY[_t] = _r
if hasattr(nn, "RMSNorm") and hasattr(F, "rms_norm"):
    _REGISTRY[nn.RMSNorm] = NormRule
