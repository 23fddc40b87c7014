"""The capture check and the clip stage of a :class:`~dpcore.torch.DPOptimizer`.

* :class:`TrainableWatch`: which parameters train is fixed when the optimizer is wrapped.
* :func:`build_query`: the query of ``noise_multiplier``/``max_grad_norm``/``clipping`` (flat,
  per-layer or joint clipping, §2 of McMahan et al. 2018) when no ``query=`` is given.
* :class:`QueryGroups`: each query group over its parameters (its global state, the norm state
  of the records held), the per-record clip factors c_i/denominator of a micro-batch, the release
  plans of the next release, and the ledger event they make.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..queries._build import clipping_query
from ..queries import (
    DPQuery,
    MicrobatchQuery,
    NestedQuery,
    ReleasePlan,
)
from .._seeds import derive_seed
from ..queries.events import ComposedQueryEvent
from ..queries.matrix_factorization import MatrixFactorizationQuery
from ..queries.microbatch import scale_sensitivity
from .._validate import positive as _positive
from ._amp import work_dtype
from ._engine import MIN_FACTOR, clip_factors, clip_margin, nonfinite_error

__all__ = ["CLIPPING", "DIVIDED", "MF", "QueryGroups", "TrainableWatch", "build_query", "check_arguments"]

CLIPPING = ("flat", "per_layer", "joint")
#: Mechanisms whose release is (clipped sum + noise)/denominator with the denominator folded
#: into the clip factors and the noise (the discrete Gaussian divides after rounding instead).
DIVIDED = ("gaussian", "matrix_factorization")
MF = "matrix_factorization"


class TrainableWatch:
    """Which parameters train is fixed when the optimizer is wrapped. A parameter frozen
    afterwards would still receive noise (an update of pure noise); one unfrozen afterwards
    would get autograd's ordinary, unclipped gradient. Both are refused before anything."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.Tensor]) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        self._watch = [(names.get(id(p), f"<parameter of shape {tuple(p.shape)}>"), p, p.requires_grad) for p in params]

    def check(self, engine: Any) -> None:
        for name, p, was in self._watch:
            if p.requires_grad != was:
                engine.clear()
                for _, q, _ in self._watch:
                    q.grad = None  # an unfrozen parameter's .grad is unclipped: never kept
                how = "frozen (requires_grad=False)" if was else "unfrozen (requires_grad=True)"
                raise RuntimeError(
                    f"parameter {name!r} was {how} after the optimizer was made private: dpcore fixes the set of "
                    "trainable parameters when it wraps the optimizer. Change requires_grad before make_private, or "
                    "make a new private optimizer (with the same ledger) after changing it; nothing was released"
                )


def check_arguments(
    *, noise_multiplier: Any, max_grad_norm: Any, expected_batch_size: Any, query: Any, clipping: str,
    joint_scales: Any, mechanism: str, granularity: Any,
) -> Tuple[float, float]:
    """The DPOptimizer's arguments checked: its noise multiplier z and denominator (NaN: from
    the query)."""
    if clipping not in CLIPPING:
        raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
    if query is not None:
        if not isinstance(query, DPQuery):
            raise TypeError(f"query must be a dpcore.queries.DPQuery, got {type(query).__name__}")
        if (
            noise_multiplier is not None or max_grad_norm is not None or clipping != "flat" or joint_scales is not None
            or mechanism != "gaussian" or granularity is not None
        ):
            raise ValueError("give either query= or noise_multiplier/max_grad_norm/clipping/mechanism, not both")
        den = float("nan") if expected_batch_size is None else _positive("expected_batch_size", expected_batch_size)
        return float("nan"), den
    if noise_multiplier is None or max_grad_norm is None or expected_batch_size is None:
        raise TypeError("DPOptimizer needs noise_multiplier, max_grad_norm and expected_batch_size (or a query)")
    z = _positive("noise_multiplier", noise_multiplier, allow_zero=True)
    return z, _positive("expected_batch_size", expected_batch_size)


def build_query(
    names: List[str], *, noise_multiplier: float, max_grad_norm: Any, expected_batch_size: float, clipping: str,
    joint_scales: Optional[Sequence[float]], mechanism: str, granularity: Optional[float],
) -> Any:
    """The query of the optimizer's ``clipping`` over the parameter tensors ``names``: the
    clipping query every front end builds (:func:`dpcore.queries._build.clipping_query`)."""
    return clipping_query(
        names, clipping=clipping, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
        denominator=expected_batch_size, noise_mechanism=mechanism, granularity=granularity, joint_scales=joint_scales,
    )


class _Group:
    """One query over some parameters: its global state, and what it derived from the norms
    of the records accumulated towards the next release (the query protocol for sums formed
    by the caller, :class:`dpcore.queries.DPQuery`)."""

    def __init__(self, query: Any, members: List[int], dim: int) -> None:
        self.query = query
        self.gs = query.initial_global_state()
        self.members = members
        self.dim = dim
        self.ns = query.initial_norm_state()

    def plan(self) -> ReleasePlan:
        # How the next release clips (clip, scales, denominator): this adapter forms the
        # clipped sums itself, on the parameters' device.
        return self.query.release_plan(self.gs, len(self.members), dim=self.dim)


def _leaf_members(nested: NestedQuery, names: List[str]) -> List[List[int]]:
    """Parameter indices of each leaf of a NestedQuery whose keys are parameter names or
    module-name prefixes ("encoder" covers "encoder.layers.0.linear1.weight")."""
    members: List[List[int]] = []
    owner: Dict[int, str] = {}
    for path in nested.leaf_paths:
        key = path.replace("/", ".")
        mine = [k for k, n in enumerate(names) if n == key or n.startswith(key + ".") or key == "<root>"]
        if not mine:
            raise ValueError(f"query group {path!r} matches no trainable parameter (names: {names[:6]}...)")
        for k in mine:
            if k in owner:
                raise ValueError(f"parameter {names[k]!r} is in two query groups, {owner[k]!r} and {path!r}")
            owner[k] = path
        members.append(mine)
    left = [names[k] for k in range(len(names)) if k not in owner]
    if left:
        raise ValueError(f"parameters in no query group: {left[:6]}; every trainable parameter needs one")
    return members


class QueryGroups:
    """The clip stage: the query groups of ``query`` (a MicrobatchQuery's inner query when it is
    one, ``factor`` its sensitivity factor) over ``params``, and the plans of the release being
    made (:attr:`pending`: each group's noised plan and next global state; None between releases)."""

    def __init__(self, query: Any, inner: Any, factor: float, params: List[torch.Tensor], names: List[str]) -> None:
        self.query, self.inner, self.factor = query, inner, factor
        self.names = names
        m = len(params)
        dim = lambda members: sum(params[k].numel() for k in members)  # noqa: E731
        if isinstance(inner, NestedQuery):
            for path, q in zip(inner.leaf_paths, inner.leaf_queries):
                if isinstance(q, (NestedQuery, MicrobatchQuery)):
                    raise ValueError(f"query group {path!r}: a MicrobatchQuery goes at the root of the query tree")
            members = _leaf_members(inner, names)
            self.groups = [_Group(q, mem, dim(mem)) for q, mem in zip(inner.leaf_queries, members)]
        elif isinstance(inner, MicrobatchQuery):
            raise ValueError("nested MicrobatchQuery: give one MicrobatchQuery at the root")
        else:
            self.groups = [_Group(inner, list(range(m)), dim(range(m)))]
        #: Each group's mechanism (a query that cannot release a caller-formed sum says so now).
        self.mechanisms = [g.plan().mechanism for g in self.groups]
        self.margins = [
            clip_margin(sum(params[k].numel() for k in g.members), work_dtype(params[g.members[0]].dtype))
            for g in self.groups
        ]
        self.pending: Optional[List[Tuple[ReleasePlan, Any]]] = None
        self._wcache: Dict[Any, torch.Tensor] = {}

    def groups_of(self, mechanism: str) -> List[int]:
        return [gi for gi, m in enumerate(self.mechanisms) if m == mechanism]

    def noise_multiplier(self, default: float) -> float:
        """The optimizer's noise multiplier: a single matrix-factorization query's effective one
        z = σ/(C·sens) (what make_private_with_epsilon calibrates), else ``default``."""
        mf = self.groups_of(MF)
        if len(mf) == 1 and isinstance(self.groups[mf[0]].query, MatrixFactorizationQuery):
            return self.groups[mf[0]].query.noise_multiplier
        return default

    @property
    def local(self) -> bool:
        """Whether every group plans from its global state alone (fixed clipping)."""
        return all(g.query.plan_from_global_state for g in self.groups)

    @torch.no_grad()
    def clip_factors(
        self, engine: Any, on_nonfinite: str = "zero", *, commit: bool = True
    ) -> Tuple[int, List[Optional[torch.Tensor]]]:
        """This micro-batch's record count and each parameter's per-record factor
        c_i/denominator.

        A record whose per-record gradient is NaN or infinite in any parameter (a NaN in its
        data, a float16 overflow of its scaled gradient under a GradScaler) gets factor 0 in
        every group and its stored factors zeroed, so that it adds exactly nothing; the adaptive
        clipping count sees it as above any clip (norm +inf). Nothing about it is raised or
        released: which records those are changes no control flow. ``on_nonfinite="raise"``
        raises ``ValueError`` naming the first such record instead (recording nothing).
        ``commit=False``: the factors only, the queries' norm states left as they were (the
        memory-lean mode's sum pass, before the step commits them)."""
        b, sq = engine.squared_norms()
        factors: List[Optional[torch.Tensor]] = [None] * len(sq)
        if b == 0:
            return 0, factors
        # A device mask, never read on the host (a synchronisation, and control flow on the
        # data): the records it marks get factor 0 and their stored factors zeroed, whatever it
        # holds. on_nonfinite="raise" reads it, by design (a debugging aid, not DP).
        bad = engine.nonfinite
        if bad is not None:
            if on_nonfinite == "raise" and bool(bad.any()):
                i = int(torch.nonzero(bad)[0, 0])
                engine.clear()
                raise nonfinite_error(i, float(engine.loss_scale))
            engine.zero_records()
        dev = next((s.device for s in sq if s is not None), torch.device("cpu"))
        if bad is not None:
            bad = bad.to(dev)
        # The clipped sums apply c_i/denominator·(records/loss scale) in float32: with every
        # factor ≥ 2⁻¹⁰⁰·max(1, S·den) that product stays ≥ 2⁻¹⁰⁰, far inside float32's normal
        # range (see clip_factors). The floor depends on the record's norm and public constants
        # only (the loss scale follows the scaler's data-independent schedule; a device tensor
        # under a GradScaler, never read on the host).
        loss_scale = engine.loss_scale
        states = []
        live = [k for k, s in enumerate(sq) if s is not None]
        for g, margin in zip(self.groups, self.margins):
            plan = g.plan()
            tot = self._total(engine, g, plan, sq, live, b, dev)
            # 1/denominator folded into the factors (and the noise): the release is one add. A
            # discrete release rounds the undivided sum onto its grid, so it divides afterwards.
            den = float(plan.denominator) if plan.mechanism in DIVIDED else 1.0
            if isinstance(loss_scale, torch.Tensor):
                floor: Any = torch.clamp(loss_scale.to(dev, torch.float64) * den, min=1.0) * MIN_FACTOR
            else:
                floor = MIN_FACTOR * max(1.0, float(loss_scale) * den)
            c = clip_factors(tot, plan.l2_norm_clip, margin, min_factor=floor, bad=bad,
                             scale=1.0 / plan.denominator if plan.mechanism in DIVIDED else 1.0)
            for k in g.members:
                factors[k] = c
            # what the query derives from the records' norms (adaptive clipping's count): a
            # zeroed record counts as above any clip. Read on the host only for a query that
            # uses them (a synchronisation on an accelerator).
            if g.query.reads_norms:
                norms = tot.sqrt()
                if bad is not None:
                    norms = norms.masked_fill(bad, float("inf"))
                mask = getattr(engine, "record_mask", None)
                if mask is not None:  # padding is no record: the real ones are the first rows
                    norms = norms[: int(np.count_nonzero(mask))]
                states.append(g.query.accumulate_norms(g.query.derive_sample_params(g.gs), g.ns, norms.cpu().numpy()))
            else:
                states.append(g.ns)
        if commit:
            for g, st in zip(self.groups, states):  # only once every group passed its checks
                g.ns = st
        return b, factors

    def _weights(self, dev: torch.device, scales: Tuple[float, ...]) -> torch.Tensor:
        """1/α_j² per member as a (P, 1) float64 tensor on ``dev``, made once per scales (a
        tensor built from host values in the step would be a copy that waits on the device)."""
        key = (dev, scales)
        w = self._wcache.get(key)
        if w is None:
            w = self._wcache[key] = torch.tensor([1.0 / (a * a) for a in scales], dtype=torch.float64,
                                                 device=dev).view(-1, 1)
        return w

    def _total(self, engine: Any, g: Any, plan: Any, sq: List[Optional[torch.Tensor]], live: List[int], b: int,
               dev: torch.device) -> torch.Tensor:
        """Σ_j ‖g_ij‖²/α_j² over the group's members: the engine's total when the group holds
        every parameter with a norm at scale 1 (flat clipping), else one stacked product; the
        records of :attr:`nonfinite` may hold anything (their factor is 0 whatever this holds)."""
        mine = [(k, a) for k, a in zip(g.members, plan.part_scales) if sq[k] is not None]
        total = getattr(engine, "sq_total", None)
        if not mine:
            tot = torch.zeros(b, dtype=torch.float64, device=dev)
        elif total is not None and len(mine) == len(live) and all(a == 1.0 for _, a in mine):
            tot = total
        elif len(mine) == 1:
            k, a = mine[0]
            tot = sq[k] if a == 1.0 else sq[k] / (a * a)
        else:
            st = torch.stack([sq[k].to(dev) for k, _ in mine])
            scales = tuple(a for _, a in mine)
            if any(a != 1.0 for a in scales):
                st = st * self._weights(dev, scales)
            tot = st.sum(0)
        return tot

    # -- the release's plans ------------------------------------------------------------

    def norm_states(self) -> List[Any]:
        return [g.ns for g in self.groups]

    def merge_norm_states(self, a: List[Any], b: List[Any]) -> List[Any]:
        return [g.query.merge_norm_states(x, y) for g, x, y in zip(self.groups, a, b)]

    def noised_plans(self, norm_states: List[Any], seed: Optional[int], step: int) -> List[Tuple[ReleasePlan, Any]]:
        """The queries' plans for release ``step``: noise, event, and their next global states
        (adaptive clipping draws its count's noise here), committed only once released."""
        return [
            g.query.get_noised_plan(ns, g.gs, len(g.members), seed=derive_seed(seed, step, gi, 0x5EED), dim=g.dim)
            for gi, (g, ns) in enumerate(zip(self.groups, norm_states))
        ]

    def plans(self) -> List[ReleasePlan]:
        return [p for p, _ in self.pending] if self.pending is not None else [g.plan() for g in self.groups]

    def event(self) -> Any:
        """The ledger event of the release being made (or of the next one)."""
        events = [p.event for p in self.plans()]
        single = len(self.groups) == 1 and not isinstance(self.inner, NestedQuery)
        ev = events[0] if single else ComposedQueryEvent(tuple(events))
        return scale_sensitivity(ev, self.factor) if self.factor != 1.0 else ev

    def reset(self) -> None:
        """Drops the norm states of the records held and the plans of a release not made."""
        self.pending = None
        for g in self.groups:
            g.ns = g.query.initial_norm_state()

    def commit(self) -> None:
        """After a release: each group's next global state, and fresh norm states."""
        assert self.pending is not None
        for g, (_, gs) in zip(self.groups, self.pending):
            g.gs, g.ns = gs, g.query.initial_norm_state()
        self.pending = None

    # -- checkpoints --------------------------------------------------------------------

    def checkpoint_state(self) -> List[Dict[str, Any]]:
        """Per group: its query, its members' names and its global state."""
        return [
            {"query": g.query, "members": [self.names[k] for k in g.members], "global_state": g.gs}
            for g in self.groups
        ]

    def restore_state(self, global_states: Sequence[Any]) -> None:
        for g, gs in zip(self.groups, global_states):
            g.gs, g.ns = gs, g.query.initial_norm_state()
        self.pending = None
