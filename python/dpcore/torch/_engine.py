"""Per-record gradient norms and clipped sums for a torch model, in one backward pass.

Two paths, chosen per layer:

* **Factored fast path** for ``nn.Linear`` and ``nn.Embedding``: the per-record gradient of a
  linear layer is g_iᵀa_i (output gradients times input activations), so its norm follows from
  the factors without forming it (Goodfellow 2015, "Efficient per-example gradient
  computations"): ‖g_i‖²‖a_i‖² for one position per record, and for sequences the ghost-norm
  identity ‖Σ_t g_t a_tᵀ‖²_F = Σ_{t,s} (a_t·a_s)(g_t·g_s) (Li et al. 2022, "Large language models
  can be strong differentially private learners", §4). The clipped sum Σ_i c_i g_iᵀa_i is one
  matrix product (g ⊙ c)ᵀa. The layer's forward is replaced by an autograd function whose
  backward keeps (a, g) and computes only the input gradient: autograd's own (unclipped) weight
  gradient is never formed, so a DP step costs one backward pass plus one weight-gradient-sized
  matrix product per layer — no second backward as in Opacus's ghost clipping.
* **Generic path** for every other layer with trainable parameters: the layer's inputs and its
  output gradient are captured during the same backward pass, and the per-record gradients of
  the layer's own parameters are ``torch.func.vmap`` of ``torch.func.vjp`` of the layer, one
  record at a time (materialised per record).

Norms are computed in float64 with explicit bounds on their rounding error, so that the clip
factors computed from them bound every record's clipped contribution by C (see
:func:`clip_factors`), as the Rust core's clip margin does (rust/clip.rs).
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = ["PerRecordGradients", "FallbackWarning", "clip_factors", "clip_margin"]

_U64 = 2.0**-53


class FallbackWarning(UserWarning):
    """A layer has no factored fast path; its per-record gradients are materialised (vmap)."""


class _Flags(threading.local):
    recompute = False  # inside a generic layer's per-record recomputation: no capturing


_flags = _Flags()


def _functorch_active() -> bool:
    f = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(f()) if f is not None else False


def _roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2.0


def clip_margin(dim: int, dtype: torch.dtype) -> float:
    """Relative slack taken off every clip factor (the core's ``clip_margin``, rust/clip.rs):
    the float64 norm's summation error (≤ (D+32)·2⁻⁵³, doubled) plus two roundings of each
    contribution c_i·g·a in the parameter dtype (factor times output gradient, times activation),
    doubled."""
    return 2.0 * ((dim + 32.0) * _U64) + 4.0 * _roundoff(dtype)


def clip_factors(sq_norms: torch.Tensor, clip: float, margin: float) -> torch.Tensor:
    """min(1, C/(‖x_i‖(1+margin))) per record, float64: a clipped record's norm stays ≤ C.

    ``sq_norms`` are upper bounds of the squared norms (float64, shape (B,)). Raises
    ``ValueError`` naming the first record whose norm is NaN or infinite (the core's rule)."""
    norms = torch.sqrt(sq_norms)
    bad = ~torch.isfinite(norms)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"record {i} of the batch has a non-finite (NaN or infinite) per-record gradient; "
            "nothing was released"
        )
    inflated = norms * (1.0 + margin)
    return torch.where(inflated > clip, clip / inflated, torch.ones_like(inflated))


def _sq(x: torch.Tensor, dims: Any) -> torch.Tensor:
    """Σ x² over ``dims`` in float64 (float32 inputs square exactly in float64)."""
    return torch.linalg.vector_norm(x, dim=dims, dtype=torch.float64).square()


def _row_sq(*ts: torch.Tensor) -> List[torch.Tensor]:
    """Σ_j x_ij² of every row of each 2-D tensor, in float64. On CPU the Rust core reads the
    tensors in place (torch's float64 norm of a float32 tensor converts it first, ~10x slower),
    on this thread: rayon's workers would spin against torch's own threads."""
    if all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) for t in ts):
        from .. import _core

        return [torch.from_numpy(s) for s in _core.part_sumsq([t.detach().contiguous().numpy() for t in ts], parallel=False)]
    return [_sq(t, 1) for t in ts]


def _can_take(base: Optional[torch.Tensor], like: torch.Tensor) -> bool:
    """Whether ``like``'s values can be accumulated into ``base`` in place by one kernel."""
    return base is not None and base.dtype == like.dtype and base.device == like.device


def _add_into(base: Optional[torch.Tensor], s: torch.Tensor) -> torch.Tensor:
    """``base += s`` in place (returns base), or ``s`` itself when there is no base."""
    return s if base is None else base.add_(s.to(device=base.device, dtype=base.dtype))


# ----------------------------------------------------------------------------- autograd taps


class _LinearFn(torch.autograd.Function):
    """y = x Wᵀ + b whose backward returns only ∂L/∂x and hands (x, ∂L/∂y) to the layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], layer: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.layer.captures.append((x.detach(), g.detach()))
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        return gx, None, None, None


class _EmbeddingFn(torch.autograd.Function):
    """Embedding lookup whose backward hands (indices, ∂L/∂y) to the layer (no weight grad)."""

    @staticmethod
    def forward(ctx: Any, idx: torch.Tensor, weight: torch.Tensor, layer: Any) -> torch.Tensor:
        ctx.layer = layer
        ctx.idx = idx
        m = layer.module
        return F.embedding(idx, weight, m.padding_idx, m.max_norm, m.norm_type, False, False)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[None, None, None]:
        ctx.layer.captures.append((ctx.idx, g.detach()))
        return None, None, None


class _TapFn(torch.autograd.Function):
    """Identity on a generic layer's output; its backward hands ∂L/∂out to the layer. The
    ``anchor`` (a scalar leaf that requires grad) makes the output part of the graph even when
    the layer's inputs do not require grad (a first layer)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, anchor: torch.Tensor, layer: Any, args: Any, kwargs: Any) -> torch.Tensor:
        ctx.layer, ctx.args, ctx.kwargs = layer, args, kwargs
        return out.view_as(out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[torch.Tensor, None, None, None, None]:
        ctx.layer.captures.append((ctx.args, ctx.kwargs, g.detach()))
        return g, None, None, None, None


# ----------------------------------------------------------------------------- layers


class _Layer:
    """One module with trainable direct parameters, and what its backward passes captured."""

    kind = "generic"

    def __init__(self, name: str, module: nn.Module, params: List[Tuple[str, nn.Parameter]], engine: "PerRecordGradients") -> None:
        self.name, self.module, self.params, self.engine = name, module, params, engine
        self.captures: List[Any] = []
        self._had_instance_forward = "forward" in module.__dict__
        self._orig = module.forward
        self.scale = 1.0
        self.batch: Optional[int] = None

    def install(self) -> None:
        self.module.forward = self._forward  # type: ignore[method-assign]

    def remove(self) -> None:
        if self._had_instance_forward:
            self.module.forward = self._orig  # type: ignore[method-assign]
        else:
            self.module.__dict__.pop("forward", None)

    def _active(self) -> bool:
        # Not under torch.func transforms: a user's own vmap/grad of the model sees plain layers.
        return (
            torch.is_grad_enabled()
            and not _flags.recompute
            and self.engine.enabled
            and not _functorch_active()
        )

    def _forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def clear(self) -> None:
        self.captures = []
        self.batch = None

    def _record_batch(self, b: int) -> int:
        if self.batch is not None and self.batch != b:
            raise ValueError(
                f"layer {self.name!r} saw batches of {self.batch} and {b} records before one step: call "
                "optimizer.step() (or zero_grad()) after every backward pass; accumulate over micro-batches "
                "with the DPDataLoader's max_physical_batch_size"
            )
        self.batch = b
        return b

    # squared norms per parameter (float64, (B,)), then clipped sums per parameter
    def squared_norms(self) -> List[torch.Tensor]:
        raise NotImplementedError

    def clipped_sums(self, factors: Sequence[torch.Tensor], into: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        """Σ_i factors_i·g_i per parameter, added in place into ``into[k]`` where that is a
        tensor (it is returned), or into a new tensor."""
        raise NotImplementedError


class _LinearLayer(_Layer):
    kind = "linear"

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._active():
            return self._orig(x)
        m = self.module
        return _LinearFn.apply(x, m.weight, m.bias, self)

    def _factors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        m = self.module
        din, dout = m.in_features, m.out_features
        for x, _ in self.captures:
            b = self._record_batch(x.shape[0])
        xs = [x.reshape(b, -1, din) for x, _ in self.captures]
        gs = [g.reshape(b, -1, dout) for _, g in self.captures]
        # A layer called several times per step: its per-record gradient is the sum over all
        # positions of all calls, i.e. one longer sequence.
        x = xs[0] if len(xs) == 1 else torch.cat(xs, 1)
        g = gs[0] if len(gs) == 1 else torch.cat(gs, 1)
        return x, g

    def squared_norms(self) -> List[torch.Tensor]:
        x, g = self._factors()
        self._xg = (x, g)
        b, t, din = x.shape
        dout = g.shape[2]
        out: List[torch.Tensor] = []
        names = [n for n, _ in self.params]
        if t == 1:
            if "weight" in names:
                sx, sg = _row_sq(x[:, 0], g[:, 0])
                out.append(sx * sg)  # ‖g_i a_iᵀ‖² = ‖a_i‖²‖g_i‖²
            else:
                (sg,) = _row_sq(g[:, 0])
            if "bias" in names:
                out.append(sg)
            return out
        gn = torch.linalg.vector_norm(g, dim=2, dtype=torch.float64)
        if "weight" in names:
            xn = torch.linalg.vector_norm(x, dim=2, dtype=torch.float64)
            s = (xn * gn).sum(1)  # Σ_t ‖a_t‖‖g_t‖ ≥ ‖Σ_t g_t a_tᵀ‖: bounds the rounding error
            if t * (din + dout) <= din * dout:
                # ghost norm: Σ_{t,s} (a_t·a_s)(g_t·g_s), two T×T Gram matrices per record
                x64, g64 = x.double(), g.double()
                w = (torch.bmm(x64, x64.transpose(1, 2)) * torch.bmm(g64, g64.transpose(1, 2))).sum((1, 2))
                err = 2.0 * (din + dout + t * t + 8) * _U64 * s.square()
                w = torch.minimum(w.clamp_min(0.0) + err, s.square())
            else:
                # long sequences: materialising g_iᵀa_i (dout×din per record) is cheaper
                x64, g64 = x.double(), g.double()
                chunk = max(1, (1 << 25) // max(1, din * dout))
                parts = [
                    _sq(torch.bmm(g64[i : i + chunk].transpose(1, 2), x64[i : i + chunk]), (1, 2))
                    for i in range(0, b, chunk)
                ]
                w = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=x.device)
                w = torch.minimum((w.sqrt() + 2.0 * (t + 2) * _U64 * s).square(), s.square())
            out.append(w)
        if "bias" in names:
            bs = _sq(g.sum(1, dtype=torch.float64), 1)
            out.append((bs.sqrt() + 2.0 * (t + 2) * _U64 * gn.sum(1)).square())
        return out

    def clipped_sums(self, factors: Sequence[torch.Tensor], into: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        x, g = self._xg
        del self._xg
        b, t, din = x.shape
        dout = g.shape[2]
        names = [n for n, _ in self.params]
        out: List[torch.Tensor] = []
        k = 0
        gw = None
        if "weight" in names:
            c = (factors[k] * self.scale).to(g.dtype)
            gw = g * c[:, None, None]
            a, xm = gw.reshape(b * t, dout).t(), x.reshape(b * t, din).to(g.dtype)
            base = into[k]
            if _can_take(base, a):
                out.append(base.addmm_(a, xm))  # one pass: the product accumulates onto base
            else:
                out.append(_add_into(base, a.matmul(xm)))
            k += 1
        if "bias" in names:
            if gw is not None and factors[k] is factors[0]:
                gb = gw
            else:
                gb = g * (factors[k] * self.scale).to(g.dtype)[:, None, None]
            out.append(_add_into(into[k], gb.sum((0, 1))))
        return out


class _EmbeddingLayer(_Layer):
    kind = "embedding"

    def _forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not self._active():
            return self._orig(idx)
        return _EmbeddingFn.apply(idx, self.module.weight, self)

    def squared_norms(self) -> List[torch.Tensor]:
        m = self.module
        d = m.embedding_dim
        for i, _ in self.captures:
            b = self._record_batch(i.shape[0])
        idx = torch.cat([i.reshape(b, -1) for i, _ in self.captures], 1)
        g = torch.cat([gg.reshape(b, -1, d) for _, gg in self.captures], 1)
        if m.padding_idx is not None:  # torch gives the padding row no gradient
            g = g * (idx != m.padding_idx).unsqueeze(2).to(g.dtype)
        self._ig = (idx, g)
        t = idx.shape[1]
        if t == 1:
            return [_sq(g[:, 0], 1)]
        # Rows of one record that look up the same token add up: group by (record, token).
        keys = torch.arange(b, device=idx.device).unsqueeze(1) * m.num_embeddings + idx
        uniq, inv = torch.unique(keys.reshape(-1), return_inverse=True)
        sums = torch.zeros(uniq.shape[0], d, dtype=torch.float64, device=g.device)
        sums.index_add_(0, inv, g.reshape(-1, d).double())
        gn = torch.linalg.vector_norm(g.reshape(-1, d), dim=1, dtype=torch.float64)
        bound = torch.zeros(uniq.shape[0], dtype=torch.float64, device=g.device).index_add_(0, inv, gn)
        nk = torch.linalg.vector_norm(sums, dim=1) + 2.0 * (t + 2) * _U64 * bound
        rec = torch.div(uniq, m.num_embeddings, rounding_mode="floor")
        w = torch.zeros(b, dtype=torch.float64, device=g.device).index_add_(0, rec, nk.square())
        return [w]

    def clipped_sums(self, factors: Sequence[torch.Tensor], into: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        idx, g = self._ig
        del self._ig
        d = self.module.embedding_dim
        c = (factors[0] * self.scale).to(g.dtype)
        rows = (g * c[:, None, None]).reshape(-1, d)
        weight, base = self.module.weight, into[0]
        target = base if _can_take(base, weight) else torch.zeros_like(weight)
        target.index_add_(0, idx.reshape(-1), rows.to(target.dtype))
        return [target if target is base else _add_into(base, target)]


class _GenericLayer(_Layer):
    kind = "generic"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self._inside = False

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

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._active() or self._inside:
            return self._orig(*args, **kwargs)
        self._inside = True
        try:
            # Parameters detached: autograd does not form the (unclipped) batch gradient.
            out = self._call_with({n: p.detach() for n, p in self.params}, args, kwargs)
        finally:
            self._inside = False
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"layer {self.name!r} ({type(self.module).__name__}) returns {type(out).__name__}; the generic "
                "per-record path supports layers that return one tensor"
            )
        dargs = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        return _TapFn.apply(out, self.engine.anchor, self, dargs, kwargs)

    def _per_record(self) -> List[torch.Tensor]:
        from torch.func import vjp, vmap

        params = {n: p.detach() for n, p in self.params}
        total: Optional[List[torch.Tensor]] = None
        for args, kwargs, g in self.captures:
            b = self._record_batch(g.shape[0])
            pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            for i in pos:
                if args[i].shape[:1] != (b,):
                    raise ValueError(
                        f"layer {self.name!r}: tensor argument {i} has no record axis of size {b} (dim 0); the "
                        "generic path batches tensor arguments along dim 0"
                    )

            def one(p: Dict[str, torch.Tensor], xs: Tuple[torch.Tensor, ...], gi: torch.Tensor) -> Any:
                full = list(args)
                for i, x in zip(pos, xs):
                    full[i] = x.unsqueeze(0)
                _, pull = vjp(lambda q: self._call_with(q, full, kwargs), p)
                return pull(gi.unsqueeze(0))[0]

            if b == 0:
                per = {n: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for n, p in params.items()}
            else:
                _flags.recompute = True
                try:
                    per = vmap(one, in_dims=(None, 0, 0))(params, tuple(args[i] for i in pos), g)
                finally:
                    _flags.recompute = False
            grads = [per[n] for n, _ in self.params]
            total = grads if total is None else [a + b_ for a, b_ in zip(total, grads)]
        assert total is not None
        return total

    def squared_norms(self) -> List[torch.Tensor]:
        self._pe = self._per_record()
        return _row_sq(*(pe.reshape(pe.shape[0], -1) for pe in self._pe))

    def clipped_sums(self, factors: Sequence[torch.Tensor], into: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        pes = self._pe
        del self._pe
        return [
            _add_into(base, torch.tensordot((c * self.scale).to(pe.dtype), pe, dims=([0], [0])))
            for c, pe, base in zip(factors, pes, into)
        ]


# ----------------------------------------------------------------------------- engine

_BATCH_MIXING = (nn.modules.batchnorm._BatchNorm,)


class PerRecordGradients:
    """Installs the per-record capture on ``model`` for the parameters in ``params``.

    ``mode="auto"`` uses the factored fast path for ``nn.Linear`` and ``nn.Embedding`` and the
    generic path elsewhere (one :class:`FallbackWarning` per engine lists the layer types);
    ``mode="generic"`` uses the generic path for every layer (a reference and a fallback).
    ``loss_reduction="mean"`` (the loss averages over the batch) multiplies the captured output
    gradients by the batch size to recover per-record gradients; ``"sum"`` leaves them.
    """

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter], *, mode: str = "auto", loss_reduction: str = "mean") -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if mode not in ("auto", "generic"):
            raise ValueError(f"mode must be 'auto' or 'generic', got {mode!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        self.enabled = True
        wanted = {id(p) for p in params if p.requires_grad}
        owners: Dict[int, List[Tuple[str, nn.Module]]] = {}
        for mname, m in model.named_modules(remove_duplicate=False):
            for pname, p in m.named_parameters(recurse=False):
                if id(p) in wanted:
                    lst = owners.setdefault(id(p), [])
                    if all(mm is not m for _, mm in lst):
                        lst.append((f"{mname}.{pname}" if mname else pname, m))
        for pid, lst in owners.items():
            if len(lst) > 1:
                raise ValueError(
                    "parameters shared across layers are not supported (their per-record gradient is the sum "
                    f"over the layers, which the per-layer norms cannot see): {' and '.join(n for n, _ in lst)} "
                    "are one tensor; untie them or freeze it (requires_grad=False)"
                )
        missing = [p for p in params if p.requires_grad and id(p) not in owners]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameter(s) of the optimizer (shapes "
                f"{[tuple(p.shape) for p in missing][:4]}) do not belong to any module of the model"
            )
        self.anchor = torch.ones((), requires_grad=True)
        self.layers: List[_Layer] = []
        fallback: List[str] = []
        for mname, m in model.named_modules():
            if isinstance(m, _BATCH_MIXING):
                raise ValueError(
                    f"layer {mname!r} is a {type(m).__name__}: batch normalisation mixes the records of a batch, "
                    "so no per-record gradient bounds one record's influence; use GroupNorm or LayerNorm"
                )
            own = [(n, p) for n, p in m.named_parameters(recurse=False) if id(p) in wanted]
            if not own:
                continue
            if mode == "auto" and type(m) is nn.Linear:
                layer: _Layer = _LinearLayer(mname, m, own, self)
            elif mode == "auto" and type(m) is nn.Embedding:
                if m.scale_grad_by_freq:
                    raise ValueError(
                        f"layer {mname!r}: Embedding(scale_grad_by_freq=True) scales gradients by counts over the "
                        "whole batch, which mixes records; use scale_grad_by_freq=False"
                    )
                if m.sparse:
                    raise ValueError(f"layer {mname!r}: Embedding(sparse=True) is not supported; noise makes every row dense")
                layer = _EmbeddingLayer(mname, m, own, self)
            else:
                layer = _GenericLayer(mname, m, own, self)
                if mode == "auto":
                    fallback.append(type(m).__name__)
            self.layers.append(layer)
        if fallback:
            warnings.warn(
                "dpcore.torch: no factored fast path for "
                + ", ".join(sorted(set(fallback)))
                + "; their per-record gradients are materialised with torch.func (vmap of vjp)",
                FallbackWarning,
                stacklevel=3,
            )
        # per-parameter order, as the optimizer releases them
        self.param_order: List[Tuple[_Layer, int, nn.Parameter, str]] = []
        for layer in self.layers:
            for k, (n, p) in enumerate(layer.params):
                self.param_order.append((layer, k, p, f"{layer.name}.{n}" if layer.name else n))
        for layer in self.layers:
            layer.install()

    def remove(self) -> None:
        """Restores the layers' original forward methods."""
        for layer in self.layers:
            layer.remove()
        self.layers = []

    def clear(self) -> None:
        for layer in self.layers:
            layer.clear()

    @torch.no_grad()
    def squared_norms(self) -> Tuple[int, List[Optional[torch.Tensor]]]:
        """(B, [per-parameter squared norms (B,) float64 or None for a layer that never ran])."""
        out: List[Optional[torch.Tensor]] = []
        batch: Optional[int] = None
        for layer in self.layers:
            first = layer.captures[0] if layer.captures else None
            if first is not None and (first[2] if len(first) == 3 else first[1]).shape[0] == 0:
                layer.clear()  # an empty Poisson batch: no record, nothing to clip
            if not layer.captures:
                out.extend([None] * len(layer.params))
                continue
            sq = layer.squared_norms()
            b = int(layer.batch or 0)
            if batch is not None and b != batch:
                raise ValueError(
                    f"layer {layer.name!r} saw {b} records but another layer saw {batch}: every layer must see "
                    "the whole batch along dim 0"
                )
            batch = b
            layer.scale = float(b) if self.loss_reduction == "mean" else 1.0
            out.extend(s * layer.scale**2 for s in sq)
        return (batch or 0), out

    @torch.no_grad()
    def clipped_sums(
        self, factors: List[Optional[torch.Tensor]], into: Optional[Sequence[Optional[torch.Tensor]]] = None
    ) -> List[Optional[torch.Tensor]]:
        """Σ_i c_i·g_i per parameter (the parameter's dtype and device); None where no record.

        With ``into``, parameter k's sum is added in place into ``into[k]`` when that is a tensor
        (and that tensor is returned): for a linear layer the product accumulates straight onto
        it (one ``addmm_``), saving a pass over the accumulator. A failure part-way may leave
        some of ``into`` updated and others not; callers discard them then."""
        into = [None] * len(factors) if into is None else into
        out: List[Optional[torch.Tensor]] = []
        k = 0
        for layer in self.layers:
            n = len(layer.params)
            if not layer.captures:
                out.extend(into[k : k + n])
            else:
                out.extend(layer.clipped_sums(factors[k : k + n], into[k : k + n]))  # type: ignore[arg-type]
            k += n
        self.clear()
        return out
