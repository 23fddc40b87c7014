"""The rule protocol: how one module type hands per-record gradient factors to the engine.

A rule wraps one module's forward while the engine is active. Its forward computes the same
outputs as the module, but through autograd functions whose backward passes return only the
input gradients and hand the factors of each record's parameter gradient to the rule as
:mod:`contributions <dpcore.torch._contrib>`. Autograd never forms the (unclipped) batch
gradient of a parameter that a rule owns.

This module holds :class:`LayerRule` (the base every rule subclasses), the two autograd taps its
helpers build forwards from (:meth:`LayerRule.linear`, :meth:`LayerRule.tap`) and the small
helpers the built-in rules share; each family of rules has a module of its own beside it, and
``_registry.py`` chooses a rule for a module.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .._amp import amp_cast as _amp_cast
from .._autograd import functorch_active, graph_task
from .._contrib import Contribution, Dense, Factored, RowRange, _nograd


class _Flags(threading.local):
    recompute = False  # inside a generic layer's per-record recomputation: no capturing


_flags = _Flags()


#: ``engine.batch_hint`` in a forward pass whose batch has no record (an empty Poisson sample):
#: the hint is 0 while the record count is not known yet, n ≥ 1 for n records.
EMPTY_BATCH = -1


def batch_records(engine: Any) -> Optional[int]:
    """The record count of the engine's forward pass in progress (0 for an empty batch), or
    None while no layer has seen it."""
    h = int(engine.batch_hint)
    return None if h == 0 else max(h, 0)


_graph_task = graph_task
_functorch_active = functorch_active


def _frozen(t: Optional[torch.Tensor], trainable: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
    """``t`` itself when it is the trainable parameter, else detached (or None)."""
    return t if t is None or trainable is not None else t.detach()


def _sl(t: Optional[torch.Tensor], rows: RowRange) -> Optional[torch.Tensor]:
    return t if t is None or rows is None else t[rows[0] : rows[1]]


def _seq_first(rule: LayerRule, x: torch.Tensor, min_dim: int = 3) -> bool:
    """Whether ``x`` holds its records on dim 1 (the engine's ``batch_first=False``, as
    PyTorch's (T, B, ·) sequence layout)."""
    return not rule.engine.batch_first and x.dim() >= min_dim


# ----------------------------------------------------------------------------- autograd taps


class _LinearFn(torch.autograd.Function):
    """y = x W[rows]ᵀ + b[rows] whose backward returns only ∂L/∂x and hands (x, ∂L/∂y) to ``sink``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], wrows: RowRange, brows: RowRange, sink: Callable) -> torch.Tensor:
        x, w, b = _amp_cast(x, _sl(_nograd(weight), wrows), _sl(None if bias is None else _nograd(bias), brows))
        ctx.save_for_backward(x, w)
        ctx.sink = sink
        return F.linear(x, w, b)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None, None, None]:
        x, w = ctx.saved_tensors
        ctx.sink(_nograd(x), _nograd(g))
        gx = g.matmul(w) if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None, None


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
            # (one record counts too: T5's relative bias is looked up per record from it; no
            # record at all, an empty Poisson sample, is EMPTY_BATCH, 0 meaning "not known")
            self.engine.batch_hint = int(n) if n > 0 else EMPTY_BATCH
        return self.forward(*args, **kwargs)

    def clear(self) -> None:
        self.contributions = []

    def add(self, c: Contribution) -> None:
        lean = self.engine.lean
        if lean is not None and lean.take(c):
            return  # lean mode: taken into a norm or a clipped sum as it arrives
        self.contributions.append(c)
        # Which backward pass this came from: records of two passes must never be merged. A
        # forward recomputed inside a backward pass (reentrant activation checkpointing) belongs
        # to that outer pass, whatever backward its recomputation then runs.
        t = self._fwd_task if self._fwd_task != -1 else _graph_task()
        self.engine.passes.add(t)

    def expect(self, *params: Optional[nn.Parameter]) -> None:
        """Declares, in a forward pass, that the node just built will add one contribution to
        each trainable parameter of ``params`` (None: frozen) in its backward pass. Optional:
        without it the memory-lean mode holds the parameter's factors to the end of its first
        backward pass instead of taking the norm as soon as the last of them arrives."""
        self.engine.expect(params)

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
        self.expect(wp, bp)
        return _LinearFn.apply(x, weight if wp is not None else weight.detach(), _frozen(bias, bp), wrows, brows, sink)

    def add_empty(self, *params: Optional[nn.Parameter]) -> None:
        """An empty batch (a Poisson sample of no record): each trainable parameter of
        ``params`` (None: frozen, skipped) gets a contribution of zero records, so that the
        engine sees this layer's batch of 0 and the step releases pure noise."""
        for p in params:
            if p is not None:
                self.add(Dense(p, torch.zeros((0,) + tuple(p.shape), dtype=p.dtype, device=p.device)))

    def tap(self, out: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """``out`` unchanged, with ``sink(∂L/∂out)`` called in the backward pass."""
        return _TapFn.apply(out, self.engine.anchor, sink)
