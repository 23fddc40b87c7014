"""Rules of attention modules.

* ``nn.MultiheadAttention`` (every form: packed or separate projections, self and cross
  attention, masks, causal, ``add_bias_kv``, ``add_zero_attn``, dropout): its projections are
  factored uses of ``in_proj_weight`` (row blocks q, k, v) and ``out_proj``; the module and its
  ``state_dict`` are unchanged.
* T5's relative attention bias (an attention module with a ``relative_attention_bias`` embedding
  and ``compute_bias``): the bias looked up once per record (:class:`RelativeBiasRule`).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .._contrib import Dense
from ._base import LayerRule, batch_records
from ._embedding import _HostedEmbeddingRule


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
        self.expect(p)
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
        b = batch_records(self.engine)  # (0 for an empty batch: a bias of no record)
        if not self.active() or b is None:
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
        values = self._emb._lookup(bucket.expand((b,) + tuple(bucket.shape)))  # (B, q, k, heads)
        return values.permute([0, 3, 1, 2])  # (B, heads, q, k)


def _is_relative_bias_host(module: nn.Module) -> bool:
    return (isinstance(getattr(module, "relative_attention_bias", None), nn.Embedding)
            and callable(getattr(module, "compute_bias", None))
            and callable(getattr(module, "_relative_position_bucket", None)))
