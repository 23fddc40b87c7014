"""Rules of embedding lookups.

* ``nn.Embedding``: the looked-up rows (:class:`EmbeddingRule`, public as the base of rules for
  embedding-like lookups).
* ``nn.Embedding`` subclasses with a forward of their own (BART's, OPT's positions, ...): their
  forward as written, with ``super().forward(ids)`` looked up per record
  (:class:`EmbeddingSubclassRule`).
* an embedding looked up by a host rule (T5's relative attention bias, see ``_attention.py``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .._contrib import Rows
from ._base import LayerRule, _seq_first, batch_records


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
        hint = batch_records(self.engine)  # (0 for an empty batch: a shared index is looked up for no record)
        if self.engine.batch_first and idx.dim() >= 2 and idx.shape[0] == 1 and hint is not None and hint != 1:
            idx = idx.expand((hint,) + tuple(idx.shape[1:]))
        seq = _seq_first(self, idx, 2)
        lead = idx.shape[1] if seq else (idx.shape[0] if idx.dim() else 1)
        # (sequence-first models: the hint may be a length, so there the check is not made)
        if self.engine.batch_first and hint is not None and idx.dim() >= 2 and lead != hint:
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
            self.add(Rows(w, i.reshape(i.shape[0], math.prod(i.shape[1:])) if i.dim() else i.reshape(1, 1), g))

        # The module's weight as it is now: under FSDP2 the gathered one (``w`` is the shard).
        self.expect(w)
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
