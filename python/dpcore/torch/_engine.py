"""Per-record gradient norms and clipped sums for a torch model, in one backward pass.

Every module with trainable parameters gets a *rule* (``_rules.py``), chosen by its type from a
registry (:func:`dpcore.torch.register_layer`). While the engine is installed, the rule's
forward replaces the module's: it computes the same outputs through autograd functions whose
backward passes return only input gradients and leave each record's parameter gradient
behind in factored form (``_contrib.py``): the input activations and output gradients of a
linear map (Goodfellow 2015), the looked-up rows of an embedding, or the per-record gradient
itself where that is cheap (conv, normalisation) or unavoidable (the ``torch.func`` fallback).
Autograd never forms the (unclipped) batch gradient.

After the backward pass the engine groups the factors by parameter, so that a parameter used
several times (tied embedding and output, a layer applied twice, the q/k/v blocks of an
attention) has the sum over its uses as each record's gradient, takes each record's norm
(ghost norm or materialised, the cheaper by shape: mixed ghost clipping, Bu et al. 2023) and
then the clipped sums Σ_i c_i·g_i from the same factors: norms and sums from one backward pass
(book-keeping, Bu et al. 2023), and no per-record gradient is materialised where the factored
form applies.

Norms are computed in float64 with explicit bounds on their rounding error, so that the clip
factors computed from them bound every record's clipped contribution by C (see
:func:`clip_factors`), as the Rust core's clip margin does (rust/clip.rs).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch
from torch import nn

from ._amp import work_dtype
from ._contrib import (
    _CHUNK as CHUNK, SHARED, Contribution, Dense, Grouping, _cw, finish, gather, ghost_key, ghost_sq_many, is_one,
    param_sq_norms, row_sq, shared_factors,
)
from ._lean import LeanPasses, check_memory
from ._rules import GenericRule, LayerRule, _functorch_active, rule_for

__all__ = ["PerRecordGradients", "FallbackWarning", "clip_factors", "clip_margin", "replace_batchnorm", "MIN_FACTOR", "ON_NONFINITE"]

_U64 = 2.0**-53


def _per_device(t: torch.Tensor) -> Any:
    """device -> ``t`` (a host tensor) copied there once, without waiting for the device."""
    copies: Dict[Any, torch.Tensor] = {}

    def on(device: Any) -> torch.Tensor:
        if device not in copies:
            copies[device] = t.to(device, non_blocking=True)
        return copies[device]

    return on


_row_sq = row_sq  # used by the optimizer and tests


class FallbackWarning(UserWarning):
    """A layer has no rule; its per-record gradients are materialised (torch.func vmap)."""


def _roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2.0


def clip_margin(dim: int, dtype: torch.dtype) -> float:
    """Relative slack taken off every clip factor (the core's ``clip_margin``, rust/clip.rs):
    the float64 norm's summation error (≤ (D+32)·2⁻⁵³, doubled) plus two roundings of each
    contribution c_i·g·a in the parameter dtype (factor times output gradient, times activation),
    doubled."""
    return 2.0 * ((dim + 32.0) * _U64) + 4.0 * _roundoff(dtype)


#: Clip factors below this are 0 (see :func:`clip_factors`).
MIN_FACTOR = 2.0**-100

#: What happens to a record whose per-record gradient is not finite (``on_nonfinite=``).
ON_NONFINITE = ("zero", "raise")


def check_on_nonfinite(value: Any) -> str:
    if value not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {value!r}")
    return str(value)


def nonfinite_error(i: int, loss_scale: float = 1.0) -> ValueError:
    """The ``on_nonfinite="raise"`` error naming record ``i``."""
    why = (
        f" (the loss was scaled by {loss_scale:g} for the GradScaler: its scaled gradient may have overflowed "
        "float16)" if float(loss_scale) != 1.0 else ""
    )
    return ValueError(
        f"record {i} of the batch has a non-finite (NaN or infinite) per-record gradient{why}; nothing was "
        "released (on_nonfinite='raise': a debugging aid whose outcome depends on the data, not DP; the default "
        "on_nonfinite='zero' gives such a record a zero contribution and releases the step)"
    )


def clip_factors(
    sq_norms: torch.Tensor, clip: float, margin: float, *, on_nonfinite: str = "zero", min_factor: Any = MIN_FACTOR,
    bad: Optional[torch.Tensor] = None, scale: float = 1.0,
) -> torch.Tensor:
    """min(1, C/(‖x_i‖(1+margin))) per record, float64: a clipped record's norm stays ≤ C.

    ``sq_norms`` are upper bounds of the squared norms (float64, shape (B,)).

    * A record whose norm is NaN or infinite gets factor 0 (``on_nonfinite="zero"``, the default;
      its stored factors must be zeroed too, as :meth:`PerRecordGradients.clipped_sums` does,
      since 0·NaN is NaN), or raises ``ValueError`` naming the first such record
      (``on_nonfinite="raise"``, the core's rule: whether the step fails then depends on one
      record, so it is a debugging aid, not DP).
    * A factor below ``min_factor`` (default 2⁻¹⁰⁰) is 0: the clipped sums apply it in float32,
      where a factor scaled below float32's normal range (2⁻¹²⁶) would be rounded to a subnormal
      with a relative error far beyond the margin, and the record's contribution could exceed C.
      A record whose norm is above 2¹⁰⁰·C adds nothing instead, which is within the sensitivity
      (its contribution is 0 ≤ C) and depends on that record alone.
    * ``bad``: the records already known to be non-finite (a device mask; default: those whose
      ``sq_norms`` is); ``scale``: a factor applied to every clip factor afterwards (1/the
      denominator), in the same pass.

    No value is read back to the host (``on_nonfinite="raise"`` excepted): on an accelerator
    the factors are a few kernels and no synchronisation.
    """
    norms = torch.sqrt(sq_norms)
    if bad is None:
        bad = ~torch.isfinite(norms)
    if on_nonfinite == "raise":
        if bool(bad.any()):
            raise nonfinite_error(int(torch.nonzero(bad)[0, 0]))
    elif on_nonfinite != "zero":
        check_on_nonfinite(on_nonfinite)
    # min(1, C/inflated): a zero norm gives C/0 = inf, clamped to 1
    c = torch.clamp(clip / (norms * (1.0 + margin)), max=1.0)
    c = c.masked_fill(bad | (c < min_factor), 0.0)
    return c.mul_(scale) if scale != 1.0 else c


_BATCH_MIXING = (nn.modules.batchnorm._BatchNorm,)


def replace_batchnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Replaces every BatchNorm{1,2,3}d of ``model`` (in place; also returned) by a GroupNorm
    over the same channels with ``min(num_groups, C)`` groups, reduced until it divides C
    (Opacus's ``ModuleValidator.fix`` does the same). BatchNorm mixes the records of a batch,
    so no per-record gradient bounds one record's influence; GroupNorm normalises each record
    on its own. The new layer starts from weight 1, bias 0 (BatchNorm's running statistics
    have no GroupNorm counterpart)."""
    for name, child in list(model.named_children()):
        if isinstance(child, _BATCH_MIXING):
            c = child.num_features
            g = min(num_groups, c)
            while c % g:
                g -= 1
            gn = nn.GroupNorm(g, c, eps=child.eps, affine=child.affine)
            if child.affine:
                gn = gn.to(device=child.weight.device, dtype=child.weight.dtype)
            setattr(model, name, gn)
        else:
            replace_batchnorm(child, num_groups)
    return model


class PerRecordGradients:
    """Installs the per-record capture on ``model`` for the parameters in ``params``.

    ``mode="auto"`` dispatches each module to its registered rule (Linear, Embedding, Conv1d/2d,
    LayerNorm, GroupNorm, RMSNorm, MultiheadAttention, LSTM, GRU, RNN, and those added with
    :func:`register_layer`) and uses the ``torch.func`` path elsewhere (one
    :class:`FallbackWarning` per engine lists those types); ``mode="generic"`` uses the
    ``torch.func`` path for every layer (a reference). ``loss_reduction="mean"`` (the loss
    averages over the batch) multiplies the captured gradients by the batch size to recover
    per-record gradients; ``"sum"`` leaves them. ``microbatch_size`` k: a record is the average
    gradient of k consecutive examples (McMahan et al. 2018 §7; the last one may be shorter).
    ``batch_first=False``: layers that take sequences get them as (T, B, ·), records on dim 1
    (as Opacus's option of the same name); attention and recurrent layers follow their own
    ``batch_first`` whatever this is.
    """

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[nn.Parameter],
        *,
        mode: str = "auto",
        loss_reduction: str = "mean",
        microbatch_size: Optional[int] = None,
        batch_first: bool = True,
        memory: str = "default",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if mode not in ("auto", "generic"):
            raise ValueError(f"mode must be 'auto' or 'generic', got {mode!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if microbatch_size is not None and (isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1):
            raise ValueError(f"microbatch_size must be an int >= 1, got {microbatch_size!r}")
        check_memory(memory)
        self.loss_reduction = loss_reduction
        #: ``"lean"``: norms in a first backward pass, clipped sums in a second (see _lean.py).
        self.memory = memory
        self.lean: Optional[LeanPasses] = None
        self.batch_first = bool(batch_first)
        self.microbatch_size = microbatch_size
        #: The privacy unit "user": the number of examples of each user in the next batch, in
        #: batch order (user-major), set by the optimizer from its loader before each clip
        #: (:attr:`dpcore.torch.DPDataLoader.record_groups`); None: a record is an example.
        self.record_groups: Any = None
        #: Padded batches: which records of the next batch are real (numpy bool (B,), set by
        #: the optimizer from its loader, :attr:`dpcore.torch.DPDataLoader.record_mask`); the
        #: others get factor 0 and their stored factors zeroed, as a non-finite record. None:
        #: every record is real.
        self.record_mask: Any = None
        self.enabled = True
        self.batch_hint = 0  # the last record count a layer saw (see EmbeddingRule)
        #: The factor the loss was multiplied by before backward (a GradScaler's scale): the
        #: captured gradients are divided by it, so norms and clipped sums are of the true ones.
        self.loss_scale = 1.0
        #: Ids of the backward passes whose contributions are held (see squared_norms).
        self.passes: Set[int] = set()
        for mname, m in model.named_modules():
            if isinstance(m, _BATCH_MIXING):
                raise ValueError(
                    f"layer {mname!r} is a {type(m).__name__}: batch normalisation mixes the records of a batch, "
                    "so no per-record gradient bounds one record's influence; use GroupNorm (or LayerNorm): "
                    "dpcore.torch.replace_batchnorm(model) swaps every BatchNorm for a GroupNorm"
                )
        wanted = {id(p) for p in params if p.requires_grad}
        self.anchor = torch.ones((), requires_grad=True)
        self.rules: List[LayerRule] = []
        fallback: List[str] = []
        claimed: Set[int] = set()
        for mname, m in model.named_modules():
            if id(m) in claimed:
                continue
            cls = rule_for(m) if mode == "auto" else None
            if cls is not None and cls.claims_children:
                own = {n: p for n, p in m.named_parameters() if id(p) in wanted}
                claimed.update(id(s) for s in m.modules())
            elif cls is not None and getattr(cls, "claims", ()):
                # a rule that owns its own parameters and those of the named submodules only
                own = {n: p for n, p in m.named_parameters(recurse=False) if id(p) in wanted}
                for c in cls.claims:
                    sub = m.get_submodule(c)
                    own.update({f"{c}.{n}": p for n, p in sub.named_parameters() if id(p) in wanted})
                    claimed.update(id(x) for x in sub.modules())
            else:
                own = {n: p for n, p in m.named_parameters(recurse=False) if id(p) in wanted}
            if not own:
                continue
            if cls is None:
                cls = GenericRule
                if mode == "auto":
                    fallback.append(type(m).__name__)
            self.rules.append(cls(mname, m, own, self))
        if fallback:
            warnings.warn(
                "dpcore.torch: no per-layer rule for "
                + ", ".join(sorted(set(fallback)))
                + "; their per-record gradients are materialised with torch.func (vmap of vjp). "
                "dpcore.torch.register_layer adds a rule",
                FallbackWarning,
                stacklevel=3,
            )
        self.params: List[nn.Parameter] = []
        self.param_names: List[str] = []
        seen: Dict[int, str] = {}
        for r in self.rules:
            for n, p in r.params.items():
                if id(p) not in seen:
                    seen[id(p)] = f"{r.name}.{n}" if r.name else n
                    self.params.append(p)
                    self.param_names.append(seen[id(p)])
        missing = [p for p in params if p.requires_grad and id(p) not in seen]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameter(s) of the optimizer (shapes "
                f"{[tuple(p.shape) for p in missing][:4]}) do not belong to any module of the model: per-record "
                "gradients are captured in the forward passes of the model's modules; pass the model that owns "
                "them, or leave them out of the optimizer"
            )
        self._hooks = [p.register_hook(self._bypass(n)) for p, n in zip(self.params, self.param_names)]
        # The record count a layer learns from its input (batch_hint) belongs to one forward pass:
        # carried into the next, a one-record batch's shared index row would be expanded to the
        # previous batch's size, counting that record several times.
        self._root_hook = model.register_forward_pre_hook(self._new_forward)
        self._lean_hooks: List[Any] = []
        if memory == "lean":
            self.lean = LeanPasses(self)
            self._lean_hooks = self.lean.install(model)
        self._used: List[Optional[List[Contribution]]] = []
        self._scale = 1.0
        #: After :meth:`squared_norms`: the records (units) whose squared norm is NaN or infinite
        #: for some parameter, (B,) bool, or None when every record's is finite.
        self.nonfinite: Optional[torch.Tensor] = None
        #: After :meth:`squared_norms`: Σ over parameters of each record's squared norm (B,).
        self.sq_total: Optional[torch.Tensor] = None
        self._zeroed = False
        for r in self.rules:
            r.install()

    @property
    def layers(self) -> List[LayerRule]:
        """The rules, one per instrumented module."""
        return self.rules

    def _bypass(self, name: str) -> Any:
        def hook(grad: Optional[torch.Tensor]) -> None:
            # Fires with None for the rules' own inputs (they return no parameter gradient).
            if grad is not None and self.enabled and not _functorch_active():
                raise RuntimeError(
                    f"parameter {name!r} received a gradient that dpcore.torch did not capture per record: some "
                    "code used it outside its module's forward (e.g. F.linear(module.weight, ...) in a parent "
                    "module). Register a rule for the module that uses it (dpcore.torch.register_layer), or "
                    "freeze it"
                )

        return hook

    def _new_forward(self, module: nn.Module, args: Any) -> None:
        self.batch_hint = 0

    def remove(self) -> None:
        """Restores the layers' original forward methods."""
        for r in self.rules:
            r.remove()
        for h in self._hooks:
            h.remove()
        self._root_hook.remove()
        for h in self._lean_hooks:
            h.remove()
        self._lean_hooks = []
        self._hooks = []
        self.rules = []

    def clear(self) -> None:
        for r in self.rules:
            r.clear()
        self._used = []
        self.passes = set()
        self.batch_hint = 0
        self.nonfinite = None
        self.sq_total = None
        self._zeroed = False
        if self.lean is not None:
            self.lean.reset()

    def expect(self, params: Sequence[Optional[nn.Parameter]]) -> None:
        """A layer's forward built a node whose backward adds one contribution to each of
        ``params`` (None: frozen): lean mode takes a parameter's norm as soon as its last
        expected contribution arrives, instead of holding its factors to the end of the pass."""
        if self.lean is not None:
            self.lean.expect(params)

    def units(self, b: int, cs: List[Contribution]) -> Tuple[int, List[Contribution]]:
        """(the number of privacy units among ``b`` records, ``cs`` regrouped into units):
        users (``record_groups``) or microbatches, else the records themselves."""
        k = self.microbatch_size
        groups = self.record_groups
        if self.record_mask is not None and ((k is not None and k > 1) or groups is not None):
            raise ValueError("padded batches (pad_batches=True) cannot be combined with micro-batches or users as records")
        if groups is not None:
            # The privacy unit "user": a user's gradient is the mean of its examples' (Charles
            # et al. 2024, user-level sampling), clipped as one record.
            if k is not None and k > 1:
                raise ValueError("microbatches (MicrobatchQuery) and users as the privacy unit cannot be combined")
            # the users' example counts are the sampler's, host values: numpy, never a device read
            counts = np.asarray(groups.cpu().numpy() if isinstance(groups, torch.Tensor) else groups,
                                dtype=np.int64).reshape(-1)
            if int(counts.sum()) != b or (counts.size and int(counts.min()) < 1):
                raise ValueError(
                    f"the batch holds {b} examples but its users' example counts sum to {int(counts.sum())}: with "
                    "privacy_unit='user', step once per batch of the loader that make_private returned"
                )
            grouping = Grouping(counts, self.params[0].device)
            w = torch.from_numpy(np.repeat(1.0 / counts.astype(np.float64), counts))
            memo: Dict[Any, torch.Tensor] = {}
            on = _per_device(w)
            return grouping.units, [c.group(on(c.param.device), grouping, memo) for c in cs]
        if k is not None and k > 1:
            units = -(-b // k)
            counts_f = np.full(units, float(k))
            counts_f[-1] = b - k * (units - 1)
            wk = torch.from_numpy(np.repeat(1.0 / counts_f, k)[:b])
            on = _per_device(wk)
            return units, [c.regroup(on(c.param.device), k) for c in cs]
        return b, cs

    @torch.no_grad()
    def squared_norms(self) -> Tuple[int, List[Optional[torch.Tensor]]]:
        """(B, [per-parameter squared norms (B,) float64, or None for a parameter that no
        layer used]); B counts microbatches when ``microbatch_size`` is set. Sets
        :attr:`nonfinite`: the records whose norm is NaN or infinite for some parameter (their
        stored factors are zeroed by :meth:`zero_records`, at the latest by :meth:`clipped_sums`)."""
        contribs = [(r, c) for r in self.rules for c in r.contributions]
        n = len(self.params)
        if self.lean is not None:
            return self.lean.squared_norms(contribs)
        self.nonfinite, self.sq_total, self._zeroed = None, None, False
        if not contribs:
            self._used = [None] * n
            return 0, [None] * n
        if len(self.passes) > 1:
            # Record i of one backward pass and record i of the next are different records; their
            # factors must never be merged into one norm.
            raise ValueError(
                f"the per-record gradients of {len(self.passes)} backward passes are pending: call "
                "optimizer.step() after every backward pass (or optimizer.accumulate() to add a micro-batch "
                "to the logical batch), or optimizer.zero_grad() to drop them"
            )
        sizes = {c.batch for _, c in contribs}
        if len(sizes) > 1:
            for r in self.rules:
                own = {c.batch for c in r.contributions}
                if len(own) > 1:
                    a, b = sorted(own)[:2]
                    raise ValueError(
                        f"layer {r.name!r} saw batches of {a} and {b} records before one step: call "
                        "optimizer.step() (or zero_grad()) after every backward pass; accumulate over "
                        "micro-batches with the DPDataLoader's max_physical_batch_size"
                    )
            (r1, c1), (r2, c2) = contribs[0], next(x for x in contribs if x[1].batch != contribs[0][1].batch)
            raise ValueError(
                f"layer {r2.name!r} saw {c2.batch} records but layer {r1.name!r} saw {c1.batch}: every layer "
                "must see the whole batch along dim 0"
            )
        b = sizes.pop()
        if b == 0:  # an empty Poisson batch: no record, nothing to clip
            self.clear()
            self._used = [None] * n
            return 0, [None] * n
        self._scale = (float(b) if self.loss_reduction == "mean" else 1.0) / self.loss_scale
        units, cs = self.units(b, [c for _, c in contribs])
        by = gather(cs)
        out: List[Optional[torch.Tensor]] = []
        self._used = []
        s2 = self._scale**2
        # Gram matrices of factors shared between parameters (only those: the others' are
        # dropped as soon as their norm is taken)
        cache: Dict[Any, Any] = {SHARED: shared_factors(cs)}
        stacked = self._ghost_groups(by, cache[SHARED])
        for k, p in enumerate(self.params):
            mine = by.get(id(p))
            if not mine:
                out.append(None)
                self._used.append(None)
                continue
            if k in stacked:
                out.append(stacked[k])
                self._used.append(list(mine))
                continue
            sq, used = param_sq_norms(mine, units, cache, defer=True)
            out.append(sq)
            self._used.append(used)
        out = self._stacked(finish(out), s2)
        return units, out

    def _ghost_groups(self, by: Dict[int, List[Contribution]], shared: set) -> Dict[int, Any]:
        """The ghost norms of layers of one shape (the blocks of a transformer) stacked: {param
        index: its Tail} for groups of two or more (:func:`ghost_sq_many`)."""
        groups: Dict[Any, List[int]] = {}
        for k, p in enumerate(self.params):
            mine = by.get(id(p))
            if mine and len(mine) == 1:
                key = ghost_key(mine[0], shared)
                if key is not None:
                    groups.setdefault(key, []).append(k)
        out: Dict[int, Any] = {}
        for key, ks in groups.items():
            path, b, t, din, dout, _ = key
            # as many layers per stack as one chunk of the one-layer path holds (temporaries bounded)
            per = b * (t * (t + din + dout) if path == "ghost" else t * dout if path == "bias" else din * dout + t * (din + dout))
            step = max(1, CHUNK // max(1, per))
            for i in range(0, len(ks), step):
                part = ks[i : i + step]
                if len(part) >= 2:
                    out.update(zip(part, ghost_sq_many([by[id(self.params[k])][0] for k in part])))  # type: ignore[misc]
        return out

    def _stacked(self, out: List[Optional[torch.Tensor]], s2: Any) -> List[Optional[torch.Tensor]]:
        """The parameters' squared norms scaled by ``s2`` in one operator on their stack (P, B),
        their total (:attr:`sq_total`) and :attr:`nonfinite`: a handful of operators per step
        whatever the number of parameters (a GPU step is bound by its launches)."""
        live = [k for k, s in enumerate(out) if s is not None]
        if not live:
            self.sq_total, self.nonfinite = None, None
            return out
        dev = out[live[0]].device
        if len(live) == 1:
            s = out[live[0]]
            s = s if is_one(s2) else s * s2
            out[live[0]] = s
            self.sq_total = s
        else:
            st = torch.stack([out[k].to(dev) for k in live])
            if not is_one(s2):
                st = st * s2
            for k, row in zip(live, st.unbind(0)):
                out[k] = row
            self.sq_total = st.sum(0)
        self.nonfinite = self.with_padding(~torch.isfinite(self.sq_total))
        return out

    def with_padding(self, bad: torch.Tensor) -> torch.Tensor:
        """``bad`` (B,) with the padded rows of :attr:`record_mask` added: they get factor 0 and
        their stored factors zeroed, exactly as a non-finite record (a host mask, copied to the
        device without a wait)."""
        m = self.record_mask
        if m is None:
            return bad
        m = np.asarray(m, dtype=bool).reshape(-1)
        if m.shape[0] != bad.shape[0]:
            raise ValueError(f"the batch's record mask has {m.shape[0]} rows but the batch {bad.shape[0]} records")
        return bad | torch.from_numpy(~m).to(bad.device, non_blocking=True)

    @torch.no_grad()
    def zero_records(self, mask: Optional[torch.Tensor] = None) -> None:
        """Gives the records (units) where ``mask`` (B,) holds (default: :attr:`nonfinite`) a
        zero gradient in every parameter: the rows of every factor held for the clipped sums
        are set to 0, out of place (:meth:`Contribution.zero_records`), shared and regrouped
        (micro-batched) factors included. Call after :meth:`squared_norms`."""
        if mask is None:
            mask = self.nonfinite
            if mask is None or self._zeroed:
                return
            self._zeroed = True
        if self.lean is not None:
            self.lean.zero_records(mask)
            return
        memo: Dict[int, Any] = {}
        for used in self._used:
            for u in used or ():
                u.zero_records(mask, memo)

    def _scaled(self, f: torch.Tensor, cache: Dict[Any, Any]) -> torch.Tensor:
        key = ("c", id(f))
        c = cache.get(key)
        if c is None:  # one scaled copy per group, shared by its parameters
            c = cache[key] = f if is_one(self._scale) else f * self._scale
        return c

    def _dense_sums(self, factors: List[Optional[torch.Tensor]], into: Sequence[Optional[torch.Tensor]],
                    cache: Dict[Any, Any]) -> Dict[int, torch.Tensor]:
        """The clipped sums of the parameters whose one use is a materialised per-record
        gradient (normalisation layers' scales and shifts, biases of some rules), three or more
        of one clipping group: one matrix-vector product over their concatenation and one
        ``_foreach_add_`` into their accumulators, instead of two operators per parameter.
        {parameter index: its accumulator} of those done."""
        groups: Dict[Any, List[int]] = {}
        for k, p in enumerate(self.params):
            used = self._used[k] if k < len(self._used) else None
            base = into[k]
            if not used or len(used) != 1 or factors[k] is None or type(used[0]) is not Dense or used[0].rows is not None:
                continue
            wd = work_dtype(p.dtype)
            if base is None or base.dtype != wd or base.device != p.device or not base.is_contiguous():
                continue
            groups.setdefault((id(factors[k]), p.device, wd), []).append(k)
        done: Dict[int, torch.Tensor] = {}
        for (_, _, wd), ks in groups.items():
            if len(ks) < 3:
                continue
            c = _cw(self._scaled(factors[ks[0]], cache), wd, 1, cache)  # type: ignore[arg-type]
            pers = [self._used[k][0].per for k in ks]  # type: ignore[index]
            b = pers[0].shape[0]
            mat = torch.cat([q.reshape(b, -1).to(wd) for q in pers], 1)
            sums = torch.mv(mat.t(), c).split([q[0].numel() for q in pers])
            accs = [into[k] for k in ks]
            torch._foreach_add_([a.view(-1) for a in accs], list(sums))  # type: ignore[union-attr]
            done.update(zip(ks, accs))  # type: ignore[arg-type]
        return done

    @torch.no_grad()
    def clipped_sums(
        self,
        factors: List[Optional[torch.Tensor]],
        into: Optional[Sequence[Optional[torch.Tensor]]] = None,
        *,
        only: Optional[int] = None,
        clear: bool = True,
    ) -> List[Optional[torch.Tensor]]:
        """Σ_i c_i·g_i per parameter (on its device, in float32 or wider: :func:`work_dtype`);
        None where no record. The records of :attr:`nonfinite` add exactly 0, whatever their
        factor (:meth:`zero_records`).

        Call after :meth:`squared_norms`. With ``into``, parameter k's sum is added in place
        into ``into[k]`` when that is a tensor (and that tensor is returned): a linear use's
        product accumulates straight onto it (one ``addmm_``). A failure part-way may leave
        some of ``into`` updated and others not; callers discard them then.

        ``only=k`` forms parameter k's sum alone (the others are returned as given), and
        ``clear=False`` keeps the factors for further calls: sharded training forms and
        reduce-scatters one parameter at a time, so that no full-size buffer of every parameter
        is ever held (call :meth:`clear` after the last)."""
        into = [None] * len(factors) if into is None else into
        if self.lean is not None:
            return self.lean.clipped_sums(factors, into, only=only, clear=clear)
        out: List[Optional[torch.Tensor]] = []
        # a record whose norm was not finite adds exactly 0 (a zero factor times NaN is NaN)
        self.zero_records()
        # scaled copies of factors that several uses share (only those: see _contrib.SHARED)
        cache: Dict[Any, Any] = {SHARED: shared_factors([u for used in self._used if used for u in used])}
        try:
            done = self._dense_sums(factors, into, cache) if only is None else {}
            for k, p in enumerate(self.params):
                used = self._used[k] if k < len(self._used) else None
                base = into[k]
                if k in done:
                    out.append(done[k])
                    if clear:
                        for u in used or ():
                            u.release()
                        self._used[k] = None
                    continue
                if used is None or factors[k] is None or (only is not None and k != only):
                    out.append(base)
                    continue
                wd = work_dtype(p.dtype)
                direct = base is not None and base.dtype == wd and base.device == p.device and base.is_contiguous()
                # A plain tensor of the parameter's full shape, also for a sharded (FSDP2) one:
                # the sums are reduce-scattered to the shards afterwards.
                acc = base if direct else torch.zeros(tuple(p.shape), dtype=wd, device=p.device)
                c = self._scaled(factors[k], cache)  # type: ignore[arg-type]
                for u in used:
                    u.add_clipped(c, acc, cache)  # type: ignore[arg-type]
                if base is not None and not direct:
                    acc = base.add_(acc.to(device=base.device, dtype=base.dtype))
                out.append(acc)
                if clear:
                    # this parameter's factors are done with (everything is cleared at the end of
                    # this call): freed now unless another use holds them, so the sums of later
                    # parameters do not run with every factor alive
                    for u in used:
                        u.release()
                    self._used[k] = None
        finally:
            if clear:
                self.clear()
        return out
