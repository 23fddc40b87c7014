"""The generic rule and user function rules.

* any other module with trainable parameters: ``torch.func`` (vmap of vjp), one notice per type
  (:class:`GenericRule`).
* a function registered with :func:`register_layer <dpcore.torch.register_layer>`
  (:class:`FunctionRule`), as Opacus's ``register_grad_sampler``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

from .._amp import amp_dtype
from .._contrib import Dense
from ._base import LayerRule, _flags, _seq_first


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
            self.expect(*self.params.values())
            return self.tap(out, lambda g: per_record(g.transpose(0, 1), seq_first=True))
        self.expect(*self.params.values())
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
        b = g.shape[0]
        if b == 0:  # an empty Poisson batch: no record to ask the user's rule about
            self.add_empty(*self.params.values())
            return
        got = type(self).fn(self.module, args, g)
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
