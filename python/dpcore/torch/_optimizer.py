"""DPOptimizer: any ``torch.optim`` optimizer turned into its DP version (DP-SGD, DP-Adam, ...).

Abadi et al. 2016, Algorithm 1, in the query/ledger architecture of McMahan et al. 2018: each
record's gradient is clipped (flat, per-layer or joint clipping, §2 of McMahan et al.), the
clipped gradients are summed, Gaussian noise from dpcore's ChaCha20 core is added with the
stddevs of a :mod:`dpcore.queries` query, the release is written durably to the privacy ledger,
and only then is the noised average handed to the wrapped optimizer's update rule.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..ledger import PrivacyLedger
from ..mechanism import discrete_sum_release, gaussian_noise
from ..queries import (
    DPQuery,
    GaussianAverageQuery,
    MicrobatchQuery,
    JointClipQuery,
    NestedQuery,
    ReleasePlan,
    per_layer_clip_norms,
    proportional_noise,
)
from ..queries.base import derive_seed
from ..queries.events import ComposedQueryEvent
from ..queries.matrix_factorization import MatrixFactorizationQuery
from ..queries.microbatch import scale_sensitivity
from ._distributed import DistributedError, ShardLayout, current_communicator, flat_views, is_sharded, resolve_ledger, unwrap_ddp
from ._amp import work_dtype
from ._device_noise import device_gaussian_noise_many
from ._engine import PerRecordGradients, clip_factors, clip_margin
from ._rules import GenericRule
from .._validate import positive as _positive

__all__ = ["DPOptimizer", "OverflowSkipWarning", "PlannedStepsWarning"]

CLIPPING = ("flat", "per_layer", "joint")
#: Mechanisms whose release is (clipped sum + noise)/denominator with the denominator folded
#: into the clip factors and the noise (the discrete Gaussian divides after rounding instead).
_DIVIDED = ("gaussian", "matrix_factorization")
_MF = "matrix_factorization"


class OverflowSkipWarning(UserWarning):
    """A step was skipped because the GradScaler found an overflow: nothing was released or
    recorded (see :meth:`DPOptimizer.attach_grad_scaler`)."""


class PlannedStepsWarning(UserWarning):
    """A matrix-factorization stream ran past the steps its strategy and noise were planned
    for: the ledger accounts the steps actually run (ε grows faster than planned)."""


class _Overflow(Exception):
    """Scaled per-record gradients overflowed (float16 with a GradScaler)."""



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


class DPOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that each logical step releases a DP average gradient.

    * ``model``: the module whose parameters ``optimizer`` trains; per-record gradients are
      captured during the ordinary ``loss.backward()`` (see :mod:`dpcore.torch._engine`).
    * ``noise_multiplier`` z and ``max_grad_norm`` C; ``expected_batch_size`` q·n divides the
      noised sum (the fixed-denominator estimator, McMahan et al. 2018 §3).
    * ``clipping``: ``"flat"`` (the record's joint norm over all parameters ≤ C, noise z·C; a
      :class:`GaussianAverageQuery`), ``"per_layer"`` (each parameter tensor clipped to C_p, C_p =
      C/√m unless ``max_grad_norm`` is a list, noise z·√m·C_p; a :class:`NestedQuery`, Eq. (1)
      gives z), or ``"joint"`` (:class:`JointClipQuery` with ``joint_scales`` α_p per tensor).
    * ``ledger``: a :class:`dpcore.PrivacyLedger` or its path (None: the data loader's ledger,
      else a temporary file); each release is written (fsync) before the noised gradient
      reaches ``.grad``. ``get_epsilon(delta)`` reads it.
    * ``data_loader``: a :class:`DPDataLoader`; with micro-batches, :meth:`step` accumulates and
      releases only when its logical batch is complete (virtual batches).
    * ``grad_sample_mode``: ``"auto"`` (factored fast path for Linear/Embedding) or ``"generic"``.
    * ``seed``: tests only (the noise becomes predictable: no privacy).

    Call ``loss.backward()`` then :meth:`step` for every (micro-)batch; an empty Poisson batch
    must be stepped too (it releases pure noise).

    Matrix-factorization (correlated) noise: a group whose query is a
    :class:`~dpcore.queries.MatrixFactorizationQuery` (``make_private(...,
    noise_mechanism=...)``) gets σ·(C⁻¹z)_t at release t, member j of the group being part j of
    the query's noise stream, in float32 for float32/bfloat16/float16 parameters (float64 for
    float64 ones). w_t is computed ahead on a worker thread, in the background of the forward
    and backward passes (it depends on no data), from the buffers of the released steps; the
    buffers advance once per release, only after its ledger entry is durable. The buffers
    (:attr:`noise_state_nbytes`) are in :meth:`state_dict`. With a cyclic loader each release must be the loader's next batch (a
    batch drawn and not stepped makes the next release raise); a failed release whose ledger
    entry stands still advances the stream, keeping stream, ledger and cycle aligned.

    Checkpoints: :meth:`state_dict` carries the DP state (release count, the queries' global
    states, the data loader's position, the ledger's path and length) beside the wrapped
    optimizer's; :meth:`load_state_dict` restores it after checking that the ledger is the
    checkpoint's, with exactly its releases (``ledger_ahead="keep"`` accepts a ledger that
    recorded releases after the checkpoint, keeping them counted).

    Under ``torch.distributed`` (initialised, world size > 1) the optimizer runs data-parallel
    (:mod:`dpcore.torch._distributed`): ``model`` may be plain or wrapped in
    ``DistributedDataParallel`` (its own all-reduce is switched off: the clipped sums are reduced
    once, by dpcore), rank 0's parameters are copied to every rank at construction, rank 0 adds
    the noise and writes the ledger, and every rank applies the same update. A failed
    collective raises :class:`DistributedError` and nothing is recorded or applied.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: torch.nn.Module,
        noise_multiplier: Optional[float] = None,
        max_grad_norm: Any = None,
        expected_batch_size: Optional[float] = None,
        query: Optional[DPQuery] = None,
        ledger: Any = None,
        clipping: str = "flat",
        joint_scales: Optional[Sequence[float]] = None,
        mechanism: str = "gaussian",
        granularity: Optional[float] = None,
        loss_reduction: str = "mean",
        grad_sample_mode: str = "auto",
        batch_first: bool = True,
        data_loader: Any = None,
        grad_scaler: Any = None,
        seed: Optional[int] = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DPOptimizer):
            raise TypeError("optimizer is already a DPOptimizer")
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
            z = float("nan")
            den = float("nan") if expected_batch_size is None else _positive("expected_batch_size", expected_batch_size)
        else:
            if noise_multiplier is None or max_grad_norm is None or expected_batch_size is None:
                raise TypeError("DPOptimizer needs noise_multiplier, max_grad_norm and expected_batch_size (or a query)")
            z = _positive("noise_multiplier", noise_multiplier, allow_zero=True)
            den = _positive("expected_batch_size", expected_batch_size)
        if ledger is None and isinstance(getattr(data_loader, "ledger", None), PrivacyLedger):
            ledger = data_loader.ledger  # the releases go under the samples the loader records
        self._comm = current_communicator()
        self.ledger = resolve_ledger(ledger, self._comm)
        self.original_optimizer = optimizer
        self.noise_multiplier = z
        self.expected_batch_size = den
        self.clipping = clipping if query is None else "query"
        self.data_loader = data_loader
        self._seed = seed
        self._releases = 0
        self._drawn_at_release = 0
        # A MicrobatchQuery at the root makes each record the average gradient of k examples
        # (the engine regroups the factors); its event carries the doubled bound.
        inner, k, self._factor = query, None, 1.0
        if isinstance(query, MicrobatchQuery):
            inner, k, self._factor = query.inner, query.microbatch_size, query.sensitivity_factor
        params = [p for g in optimizer.param_groups for p in g["params"]]
        model = unwrap_ddp(model)
        sharded = [is_sharded(p) for p in params if p.requires_grad]
        if any(sharded):
            if self._comm is None:
                raise ValueError(
                    "the model's parameters are sharded (DTensor, FSDP2's fully_shard) but torch.distributed is not "
                    "initialised with more than one rank"
                )
            if not all(sharded):
                raise ValueError(
                    "some trainable parameters are sharded by fully_shard and others are not: call fully_shard on the "
                    "root module too (after its blocks), so that every parameter is sharded"
                )
        elif self._comm is not None:
            self._comm.broadcast_module(model)  # the ranks start from rank 0's parameters
        self.engine = PerRecordGradients(
            model, params, mode=grad_sample_mode, loss_reduction=loss_reduction, batch_first=batch_first, microbatch_size=k
        )
        self.param_names = list(self.engine.param_names)
        self._params = list(self.engine.params)
        m = len(self._params)
        if m == 0:
            raise ValueError("the optimizer has no trainable parameter in the model")
        #: Under FSDP2: where this rank's rows of each parameter sit (None: not sharded).
        self._layouts: Optional[List[ShardLayout]] = None
        if any(sharded):
            assert self._comm is not None
            generic = [r.name or "<root>" for r in self.engine.rules if isinstance(r, GenericRule)]
            if generic:
                raise NotImplementedError(
                    f"layers without a per-layer rule ({generic[:4]}) under FSDP2: their torch.func fallback needs the "
                    "gathered weights; register a rule for them (dpcore.torch.register_layer)"
                )
            self._layouts = [ShardLayout(p, self._comm) for p in self._params]
            if data_loader is not None:
                data_loader.equal_micro_batches = True  # see physical_batches
        # The sharded gradients this optimizer set last (any other one FSDP2 reduced was not
        # captured per record).
        self._given: Dict[int, int] = {}
        # Under FSDP2 with micro-batches: the noise stddevs this rank's rows got with the logical
        # batch's first micro-batch (None: not noised yet).
        self._shard_noise: Optional[List[List[Optional[float]]]] = None
        if query is None:
            how: Dict[str, Any] = {"mechanism": mechanism, "granularity": granularity}
            if clipping == "per_layer":
                if isinstance(max_grad_norm, (list, tuple)):
                    if len(max_grad_norm) != m:
                        raise ValueError(f"max_grad_norm has {len(max_grad_norm)} values but there are {m} parameter tensors")
                    clips = [_positive(f"max_grad_norm[{k}]", c) for k, c in enumerate(max_grad_norm)]
                else:
                    clips = per_layer_clip_norms(_positive("max_grad_norm", max_grad_norm), m)
                sds = proportional_noise(z, clips)
                inner = NestedQuery(
                    {n: GaussianAverageQuery(c, sd, den, **how) for n, c, sd in zip(self.param_names, clips, sds)}
                )
            else:
                c = _positive("max_grad_norm", max_grad_norm)
                if clipping == "flat":
                    inner = GaussianAverageQuery(c, z * c, den, **how)
                else:
                    if joint_scales is None or len(joint_scales) != m:
                        raise ValueError(f"clipping='joint' needs joint_scales with one scale per parameter tensor ({m})")
                    inner = JointClipQuery(list(joint_scales), c, z * c, denominator=den, **how)
            query = inner
        self.query: Any = query
        if isinstance(inner, NestedQuery):
            for path, q in zip(inner.leaf_paths, inner.leaf_queries):
                if isinstance(q, (NestedQuery, MicrobatchQuery)):
                    raise ValueError(f"query group {path!r}: a MicrobatchQuery goes at the root of the query tree")
            members = _leaf_members(inner, self.param_names)
            self._groups = [_Group(q, mem, self._dim(mem)) for q, mem in zip(inner.leaf_queries, members)]
        elif isinstance(inner, MicrobatchQuery):
            raise ValueError("nested MicrobatchQuery: give one MicrobatchQuery at the root")
        else:
            self._groups = [_Group(inner, list(range(m)), self._dim(range(m)))]
        for g in self._groups:
            plan = g.plan()  # a query that cannot release a caller-formed sum says so now
            if plan.mechanism == _MF and self._comm is not None:
                raise NotImplementedError(
                    "matrix-factorization (correlated) noise is not supported with data-parallel training yet"
                )
            if plan.mechanism != "gaussian" and self._comm is not None:
                raise NotImplementedError(
                    "mechanism='discrete_gaussian' is not supported with data-parallel training yet: the ranks' "
                    "sums would have to be rounded and noised after the all-reduce"
                )
        self._mf_groups = [gi for gi, g in enumerate(self._groups) if g.plan().mechanism == _MF]
        if self._mf_groups:
            self._check_mf_loader()
            if len(self._mf_groups) == 1 and isinstance(self._groups[self._mf_groups[0]].query, MatrixFactorizationQuery):
                # the effective noise multiplier z = σ/(C·sens): what make_private_with_epsilon calibrates
                self.noise_multiplier = self._groups[self._mf_groups[0]].query.noise_multiplier
        self._mf_warned = False
        self._pending: Optional[List[Tuple[ReleasePlan, Any]]] = None
        self._margins = [
            clip_margin(sum(self._params[k].numel() for k in g.members), work_dtype(self._params[g.members[0]].dtype))
            for g in self._groups
        ]
        self._acc: List[Optional[torch.Tensor]] = [None] * m
        self._records = 0
        # Standard normals for the next release, drawn on a background thread while the training
        # loop runs its forward and backward passes (see _noise).
        self._noise_worker: Optional[ThreadPoolExecutor] = None
        self._next_noise: Optional[Tuple[int, List[List[float]], Future]] = None
        self._ledger_worker: Optional[ThreadPoolExecutor] = None
        self._mf_worker: Optional[ThreadPoolExecutor] = None
        # (release index, Future of that release's fresh z per MF group member): drawn ahead
        self._next_mf: Optional[Tuple[int, Future]] = None
        self._mf_commit: Optional[Future] = None  # the last release's buffer update
        # torch.optim.Optimizer plumbing (LR schedulers, hooks) without re-registering parameters
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self.last_step_released = False
        #: What :meth:`load_state_dict` does when the ledger holds releases beyond the
        #: checkpoint's: ``"refuse"`` (raise) or ``"keep"`` (resume, keeping them counted).
        self.ledger_ahead = "refuse"
        # Which parameters train is fixed at wrap time (see _check_trainable).
        names = {id(p): n for n, p in model.named_parameters()}
        self._watch = [(names.get(id(p), f"<parameter of shape {tuple(p.shape)}>"), p, p.requires_grad) for p in params]
        self._noise_device = "auto"
        #: Steps skipped because the GradScaler found an overflow (nothing released or recorded).
        self.skipped_steps = 0
        self._overflowed = False
        self.grad_scaler: Any = None
        if grad_scaler is not None:
            self.attach_grad_scaler(grad_scaler)

    @property
    def noise_device(self) -> str:
        """Where the Gaussian noise is drawn: ``"auto"`` (default: on the parameter's device when
        that is an accelerator, by :func:`dpcore.torch._device_noise.device_gaussian_noise_many`; by
        the Rust core on CPU), ``"device"`` (always torch's ChaCha20, also on CPU) or ``"host"``
        (always the core, copied to the device). Both are ChaCha20 keyed from the OS."""
        return self._noise_device

    @noise_device.setter
    def noise_device(self, mode: str) -> None:
        if mode not in ("auto", "device", "host"):
            raise ValueError(f"noise_device must be 'auto', 'device' or 'host', got {mode!r}")
        self._noise_device = mode
        self._next_noise = None  # a draw made ahead under the old mode is not used

    def _on_device(self, p: torch.Tensor) -> bool:
        mode = self._noise_device
        return mode == "device" or (mode == "auto" and p.device.type != "cpu")

    def _noise_shape(self, k: int) -> Tuple[int, ...]:
        """The shape of parameter k's noise on this rank: its own rows when sharded."""
        if self._layouts is not None:
            return self._layouts[k].local_shape
        return tuple(self._params[k].shape)

    def _check_mf_loader(self) -> None:
        """A matrix-factorization query's participation schema must be the data loader's (when
        the loader declares one: dpcore's cyclic loaders)."""
        dl = self.data_loader
        lp = getattr(dl, "participation", None)
        for gi in self._mf_groups:
            qp = getattr(self._groups[gi].query, "participation", None)
            if lp is None or qp is None:
                continue
            if (qp.kind, qp.min_separation, qp.sampling_probability) != (lp.kind, lp.min_separation, lp.sampling_probability):
                raise ValueError(
                    f"the matrix-factorization query declares {qp.describe()}, but the data loader follows "
                    f"{lp.describe()}: the noise's sensitivity would not hold for the batches trained on"
                )

    # -- plumbing ---------------------------------------------------------------------

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, v: Any) -> None:
        self.original_optimizer.param_groups = v

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.original_optimizer.state

    @state.setter
    def state(self, v: Any) -> None:
        self.original_optimizer.state = v

    def state_dict(self) -> Dict[str, Any]:
        """``{"optimizer": <the wrapped optimizer's state dict>, "dpcore": {...}}``, in plain
        Python types and tensors (``torch.load(..., weights_only=True)`` reads it). The
        ``dpcore`` part holds the release count, each query group's global state (adaptive
        clipping's clip norm), noise multiplier, clipping and parameter names and shapes, the
        data loader's :meth:`~DPDataLoader.state_dict`, and the ledger's absolute path and
        length. Take it at a release boundary (after the :meth:`step` that releases); see
        :mod:`dpcore.torch._checkpoint`."""
        from ._checkpoint import optimizer_state

        self._mf_quiesce()  # the MF streams' buffers of the released steps, updated
        return {"optimizer": self.original_optimizer.state_dict(), "dpcore": optimizer_state(self)}

    def load_state_dict(self, state_dict: Dict[str, Any], *, ledger_ahead: Optional[str] = None) -> None:
        """Restores :meth:`state_dict`, after checking everything (nothing is half-loaded).

        Refused (``ValueError``) for a differently shaped or configured optimizer, or a state
        taken in the middle of a logical batch. The ledger must be the same file (by real path)
        holding exactly the releases the checkpoint saw: fewer raises
        :class:`dpcore.ledger.LedgerError` (a truncated or foreign ledger would under-state ε);
        more (a crash after a release was recorded, before the next checkpoint) raises too
        unless ``ledger_ahead="keep"`` (default: the :attr:`ledger_ahead` attribute,
        ``"refuse"``), which keeps those releases in the ledger, still counted (ε over-counts,
        the safe side). A bare wrapped-optimizer state dict (older checkpoints) loads the
        optimizer's state only, with a warning."""
        from ._checkpoint import load_optimizer_state

        self._mf_quiesce()  # nothing drawing on the streams that the load replaces
        load_optimizer_state(self, state_dict, ledger_ahead)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise RuntimeError("add parameter groups before wrapping: the per-record capture is set up at construction")

    def __repr__(self) -> str:
        return (
            f"DPOptimizer({type(self.original_optimizer).__name__}, noise_multiplier={self.noise_multiplier}, "
            f"clipping={self.clipping!r}, ledger={self.ledger.path!r})"
        )

    def _dim(self, members: Any) -> int:
        return sum(self._params[k].numel() for k in members)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears ``.grad`` and the captured activations (not the accumulated micro-batches)."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.engine.clear()

    def get_epsilon(self, delta: float, **kw: Any) -> float:
        """ε of everything released so far at ``delta``, from the ledger (an upper bound).

        The accountant defaults to the data loader's (a :class:`SamplerDataLoader` of an
        allocation sampler: ``"rdp"``, its only certified analysis, which the ledger would fall
        back to anyway, with a warning), else the ledger's default (PLD)."""
        acct = getattr(self.data_loader, "accountant", None)
        if isinstance(acct, str) and "accountant" not in kw:
            kw["accountant"] = acct
        return self.ledger.get_epsilon(delta, **kw)

    # -- the DP step ------------------------------------------------------------------

    @torch.no_grad()
    def _clip_factors(self) -> Tuple[int, List[Optional[torch.Tensor]]]:
        """This micro-batch's record count and each parameter's per-record factor
        c_i/denominator; raises (recording nothing) on a non-finite per-record gradient."""
        b, sq = self.engine.squared_norms()
        factors: List[Optional[torch.Tensor]] = [None] * len(sq)
        if b == 0:
            return 0, factors
        if self._scaling():
            sums = [s.sum() for s in sq if s is not None]
            if sums and not bool(torch.isfinite(torch.stack(sums).sum())):
                self.engine.clear()
                raise _Overflow()
        dev = next((s.device for s in sq if s is not None), torch.device("cpu"))
        states = []
        for g, margin in zip(self._groups, self._margins):
            plan = g.plan()
            tot = torch.zeros(b, dtype=torch.float64, device=dev)
            for k, a in zip(g.members, plan.part_scales):
                if sq[k] is not None:
                    tot = tot + (sq[k] if a == 1.0 else sq[k] / (a * a))
            # 1/denominator folded into the factors (and the noise): the release is one add. A
            # discrete release rounds the undivided sum onto its grid, so it divides afterwards.
            c = clip_factors(tot, plan.l2_norm_clip, margin)
            if plan.mechanism in _DIVIDED:
                c = c / plan.denominator
            for k in g.members:
                factors[k] = c
            # what the query derives from the records' norms (adaptive clipping's count)
            norms = tot.sqrt().cpu().numpy()
            states.append(g.query.accumulate_norms(g.query.derive_sample_params(g.gs), g.ns, norms))
        for g, st in zip(self._groups, states):  # only once every group passed its checks
            g.ns = st
        return b, factors

    @torch.no_grad()
    def _accumulate(self, b: int, factors: List[Optional[torch.Tensor]]) -> None:
        """Adds this micro-batch's clipped records into the accumulators, in place. If that
        fails part-way, every accumulator is dropped: a half-added batch (or half-added noise)
        must never be released or added to again."""
        if b == 0:
            self.engine.clear()
            return
        try:
            sums = self.engine.clipped_sums(factors, into=self._acc)
        except BaseException:
            self._discard()
            raise
        self._acc = list(sums)

    def discard(self) -> None:
        """Drops the records held for the logical batch being formed (micro-batches added by
        :meth:`accumulate` or by steps that did not release) and those of the last backward
        pass, with nothing released or recorded: for a caller whose micro-batch failed
        part-way through a logical batch. The next release then holds only later records."""
        self._discard()
        self._overflowed = False
        for p in self._params:
            p.grad = None

    def _discard(self) -> None:
        self._acc = [None] * len(self._acc)
        self._shard_noise = None
        self._records = 0
        self._pending = None
        for g in self._groups:
            g.ns = g.query.initial_norm_state()
        self.engine.clear()

    def _plans(self) -> List[ReleasePlan]:
        return [p for p, _ in self._pending] if self._pending is not None else [g.plan() for g in self._groups]

    def _event(self) -> Any:
        events = [p.event for p in self._plans()]
        ev = events[0] if len(self._groups) == 1 and not isinstance(self._inner_query(), NestedQuery) else ComposedQueryEvent(tuple(events))
        return scale_sensitivity(ev, self._factor) if self._factor != 1.0 else ev

    def _inner_query(self) -> Any:
        return self.query.inner if isinstance(self.query, MicrobatchQuery) else self.query

    def _start_ledger_write(self) -> Future:
        """Starts writing this release's entries (write + fsync) on a background thread.

        Started once the records passed every check, so the disk's latency overlaps the
        clipped-sum products; :meth:`_release` waits for it before any noised gradient reaches
        the model, so the entry is durable first (McMahan et al. 2018, §6). If the products
        fail after this point the ledger over-counts one release, the safe direction."""
        if self._ledger_worker is None:
            self._ledger_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpcore-ledger")
        return self._ledger_worker.submit(self.ledger.record_release, self._event())

    def _noise_stddevs(self) -> List[List[Optional[float]]]:
        """Per group and member: the stddev of the noise of the released average, α_j·σ̃/den
        (None for a discrete Gaussian group, noised after its sum is complete)."""
        out = []
        for plan in self._plans():
            gaussian = plan.mechanism == "gaussian"
            out.append([sd / plan.denominator if gaussian else None for sd in plan.part_stddevs])
        return out

    def _draw_noise(self, step: int, stddevs: List[List[float]], parallel: bool = True) -> List[List[torch.Tensor]]:
        """ChaCha20 N(0, sd²) for release ``step``, one array per group member, from the core
        (keyed from the OS, or derived from the test seed), computed in f64 and rounded once.
        ``parallel=False`` keeps the work on the calling thread (the values are the same).

        Members whose parameters live on an accelerator get their noise there, all of them in
        one :func:`device_gaussian_noise_many` call per device (one key, a part per member): a
        call per parameter costs a dozen kernel launches each, most of a small model's step."""
        out: List[List[Any]] = []
        on_device: Dict[torch.device, List[Tuple[int, int, Tuple[int, ...], float, torch.dtype]]] = {}
        for gi, (g, sds) in enumerate(zip(self._groups, stddevs)):
            row: List[Any] = []
            for j, (k, sd) in enumerate(zip(g.members, sds)):
                if sd is None:
                    row.append(None)
                    continue
                p = self._params[k]
                if self._on_device(p):
                    # Drawn where the parameter lives: no host generation, no copy per step.
                    dt = torch.float64 if p.dtype == torch.float64 else torch.float32
                    on_device.setdefault(p.device, []).append((gi, j, self._noise_shape(k), sd, dt))
                    row.append(None)
                    continue
                # Sharded: each rank draws its own rows' noise (a test seed gives each rank its own).
                path = (step, gi, j) if self._layouts is None else (step, gi, j, self._comm.rank)  # type: ignore[union-attr]
                ndt = np.float64 if p.dtype == torch.float64 else np.float32
                z = gaussian_noise(self._noise_shape(k), sd, dtype=ndt, seed=derive_seed(self._seed, *path), parallel=parallel)
                row.append(torch.from_numpy(z))
            out.append(row)
        for d, (dev, members) in enumerate(on_device.items()):
            # one key per device and release; the 1 << 30 keeps these paths apart from the host's
            path = (step, 1 << 30, d) if self._layouts is None else (step, 1 << 30, d, self._comm.rank)  # type: ignore[union-attr]
            zs = device_gaussian_noise_many([(shape, sd, dt) for _, _, shape, sd, dt in members], device=dev,
                                            seed=derive_seed(self._seed, *path))
            for (gi, j, _, _, _), z in zip(members, zs):
                out[gi][j] = z
        return out

    def _noise(self, step: int) -> List[List[torch.Tensor]]:
        """The noise of release ``step``, and the next release's started in the background.

        Noise does not depend on the data, so drawing it ahead changes nothing in the mechanism;
        it lets the core's generator run while torch computes the next backward pass instead of
        after it. A draw is used only for the step and stddevs it was made for, and only once."""
        sds = self._noise_stddevs()
        pending, self._next_noise = self._next_noise, None
        if pending is not None and pending[0] == step and pending[1] == sds:
            z = pending[2].result()
        else:
            z = self._draw_noise(step, sds)
        if self._noise_worker is None:
            self._noise_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpcore-noise")
        self._next_noise = (step + 1, sds, self._noise_worker.submit(self._draw_noise, step + 1, sds, False))
        return z

    @torch.no_grad()
    def _add_noise(self) -> None:
        """Starts each accumulator of the release from its noise: the clipped-sum products of
        the last micro-batch then accumulate onto the noise (``addmm_``), with no extra pass."""
        noise = self._noise(self._releases)
        for g, row in zip(self._groups, noise):
            for k, z in zip(g.members, row):
                if z is None:
                    continue
                p = self._params[k]
                # Shared with torch without a copy on CPU; copied to the device otherwise.
                z = z.to(device=p.device, dtype=work_dtype(p.dtype), non_blocking=True)
                acc = self._acc[k]
                self._acc[k] = z if acc is None else acc.add_(z)

    # -- matrix-factorization (correlated) noise ------------------------------------------

    def _check_mf_step(self, drawn: Optional[int]) -> None:
        """Before a release of a matrix-factorization stream: the loader's batch must be the
        stream's step (every batch of the cycle released, in order), and past the planned steps
        a warning (once)."""
        cyclic = getattr(self.data_loader, "participation", None) is not None
        for gi in self._mf_groups:
            g = self._groups[gi]
            step = int(getattr(g.gs, "step", 0))
            if cyclic and drawn is not None and drawn != step + 1:
                self.engine.clear()
                raise RuntimeError(
                    f"the cyclic loader has drawn {drawn} batches but the matrix-factorization noise stream is at step "
                    f"{step}: every batch of the cycle must be released, in order (a batch was drawn and not stepped, "
                    "or discarded). The noise stream and the cycle must stay aligned for the noise's sensitivity to "
                    "hold; resume from a checkpoint"
                )
            planned = getattr(g.query, "steps", None)
            if planned is not None and step >= planned and not self._mf_warned:
                self._mf_warned = True
                warnings.warn(
                    f"training past the {planned} steps the matrix-factorization noise was planned for (its strategy "
                    "and noise multiplier): the ledger accounts the steps actually run, and ε grows faster from here "
                    "than planned",
                    PlannedStepsWarning,
                    stacklevel=3,
                )

    def _mf_open(self) -> Dict[int, List[Any]]:
        """The matrix-factorization releases of this step: group → [global state after the
        plan, parts drawn, done]."""
        assert self._pending is not None
        return {gi: [self._pending[gi][1], set(), False] for gi in self._mf_groups}

    def _unit_mf(self, step: int, streams: Dict[int, Any], parallel: bool) -> Dict[int, List[np.ndarray]]:
        """The unit noise w_t of release ``step`` for every member of each MF group (``streams``:
        group → its global state at that step), computed without advancing the buffers."""
        out: Dict[int, List[np.ndarray]] = {}
        for gi, gs in streams.items():
            g = self._groups[gi]
            row = []
            for j, k in enumerate(g.members):
                p = self._params[k]
                dt = np.float64 if work_dtype(p.dtype) == torch.float64 else np.float32
                seed = derive_seed(self._seed, step, gi, j)
                row.append(g.query.draw_unit_noise(gs, j, p.numel(), dt, seed=seed, parallel=parallel))
            out[gi] = row
        return out

    def _mf_start(self, write: Future, mf: Dict[int, List[Any]]) -> Future:
        """This release's unit noise w_t for each MF group member.

        w_t = (C⁻¹z)_t depends on no data: it is computed ahead, on a worker thread in the
        background of the forward and backward passes (as the independent noise is), from the
        buffers of the released steps, without changing them. Only the buffers' update waits for
        the release's ledger entry (:meth:`_mf_noise`), so a stream never advances for a step
        the ledger does not count (an unrecorded step would shift the cycle's participations
        against the noise), and checkpoints see exactly the released steps. A draw is used only
        for the release index it was made for; one never used is dropped, never saved."""
        step = self._releases
        pending, self._next_mf = self._next_mf, None
        if pending is not None and pending[0] == step:
            return pending[1]
        if self._mf_worker is None:
            self._mf_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpcore-mf-noise")
        return self._mf_worker.submit(self._unit_mf, step, {gi: st[0] for gi, st in mf.items()}, True)

    @torch.no_grad()
    def _mf_noise(self, drawing: Future, mf: Dict[int, List[Any]], write: Future) -> None:
        """Adds each MF group's correlated noise σ·w_t/denominator to its released sums (in the
        work dtype: float32 accumulators for float32, bfloat16 and float16 parameters), then
        queues, behind the ledger write, the buffers' update and the next release's w."""
        noise = drawing.result()
        assert self._pending is not None
        for gi, st in mf.items():
            g = self._groups[gi]
            plan, _ = self._pending[gi]
            for j, (k, w) in enumerate(zip(g.members, noise[gi])):
                p = self._params[k]
                sd = plan.part_stddevs[j] / plan.denominator
                # w is read again by the buffers' update: scaled into a new tensor, never in place
                t = torch.from_numpy(w).view(p.shape).to(device=p.device, dtype=work_dtype(p.dtype), non_blocking=True)
                acc = self._acc[k]
                self._acc[k] = t * sd if acc is None else acc.add_(t, alpha=sd)
            st[2] = True
        streams = {gi: st[0] for gi, st in mf.items()}
        step = self._releases
        for gi, gs in streams.items():
            # the next global state at once; its stream is closed by the update below, which the
            # next release waits for (_mf_sync)
            self._pending[gi] = (self._pending[gi][0], self._groups[gi].query.released_state(gs))

        def commit() -> Dict[int, List[np.ndarray]]:
            """The buffers' update for this release and, in the same pass, the next release's w."""
            write.result()  # a release the ledger does not hold must not advance the streams
            ahead: Dict[int, List[np.ndarray]] = {}
            for gi, gs in streams.items():
                q = self._groups[gi].query
                ahead[gi] = [
                    q.commit_noise(gs, j, draw_next=True, seed=derive_seed(self._seed, step + 1, gi, j), parallel=False)
                    for j in range(len(self._groups[gi].members))
                ]
                q.close_step(gs)
            return ahead

        if self._mf_worker is None:
            self._mf_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpcore-mf-noise")
        committed = self._mf_worker.submit(commit)
        self._mf_commit = committed
        self._next_mf = (step + 1, committed)

    def _mf_sync(self) -> None:
        """Waits for the last release's buffer update. A failed update (its ledger write failed,
        and the step that made it raised already, leaving the groups' global states at that
        release) leaves the streams unadvanced, as the ledger is."""
        pending, self._mf_commit = self._mf_commit, None
        if pending is not None:
            try:
                pending.result()
            except BaseException:
                pass

    def _mf_quiesce(self) -> None:
        """Before the streams' state is read or replaced: the update done, nothing drawing."""
        self._mf_sync()
        ahead, self._next_mf = self._next_mf, None
        if ahead is not None:
            try:
                ahead[1].result()
            except BaseException:
                pass

    def _mf_settle(self, drawing: Optional[Future], mf: Dict[int, List[Any]]) -> None:
        """After a failed release whose ledger entry stands: every MF stream still advances one
        step (with the w drawn for it, or one drawn now and dropped), so that the stream, the
        ledger and the cycle stay aligned. Nothing is released."""
        if drawing is not None:
            try:
                drawing.result()
            except BaseException:
                pass
        step = self._releases
        for gi, (gs, _, _) in mf.items():
            g = self._groups[gi]
            for j, k in enumerate(g.members):
                part = gs.noise.parts.get(j)
                if part is None or not part.drawn:
                    p = self._params[k]
                    dt = np.float64 if work_dtype(p.dtype) == torch.float64 else np.float32
                    g.query.draw_unit_noise(gs, j, p.numel(), dt, seed=derive_seed(self._seed, step, gi, j))
                g.query.commit_noise(gs, j)
            g.gs, g.ns = g.query.finish_release(gs), g.query.initial_norm_state()

    @property
    def noise_state_nbytes(self) -> int:
        """Bytes of correlated-noise state held (the MF streams' buffers; 0 without MF noise):
        num_buffers·d values of the work dtype per stream."""
        return sum(int(self._groups[gi].gs.noise.state_nbytes) for gi in self._mf_groups)

    @torch.no_grad()
    def _discrete_noise(self) -> None:
        """The discrete Gaussian groups' release (Canonne, Kamath & Steinke 2020): each part's
        clipped sum, complete now, is rounded onto its grid and noised with N_ℤ in the core, then
        divided by the denominator (see :class:`ReleasePlan`). The sum itself was formed on the
        device in the parameters' float type, like the Gaussian one; the recorded sensitivity
        c + √d grid steps covers rounding it, not that float summation."""
        for gi, (g, plan) in enumerate(zip(self._groups, self._plans())):
            if plan.mechanism != "discrete_gaussian":
                continue
            sums = []
            for k in g.members:
                acc = self._acc[k]
                shape = tuple(self._params[k].shape)
                sums.append(np.zeros(shape) if acc is None else acc.detach().to("cpu", torch.float64).numpy())
            outs = discrete_sum_release(
                sums,
                l2_norm_clip=plan.l2_norm_clip,
                noise_multiplier=plan.noise_multiplier or 0.0,
                granularity=plan.granularity,
                part_scales=plan.part_scales,
                denominator=plan.denominator,
                seed=derive_seed(self._seed, self._releases, gi, 0xD15C),
            )
            for k, o in zip(g.members, outs):
                p = self._params[k]
                self._acc[k] = torch.from_numpy(o).to(device=p.device, dtype=work_dtype(p.dtype))

    @torch.no_grad()
    def _release(self, write: Future) -> None:
        # Durable before the noised gradient can reach the model (McMahan et al. 2018, §6).
        write.result()
        self._releases += 1
        self._set_grads()

    def _set_grads(self) -> None:
        """The released average (float32 or wider) becomes each parameter's ``.grad``, cast
        once to the parameter's dtype (bfloat16 or float16 parameters): post-processing."""
        for k, gr in enumerate(self._acc):
            if gr is not None:
                p = self._params[k]
                gr = gr if gr.dtype == p.dtype else gr.to(p.dtype)
                if self._layouts is not None:
                    gr = self._layouts[k].grad(gr)
                    self._given[k] = id(gr)
                self._params[k].grad = gr
        self._acc = [None] * len(self._acc)

    def _logical_complete(self) -> bool:
        dl = self.data_loader
        return True if dl is None else bool(getattr(dl, "logical_batch_complete", True))

    # -- mixed precision: torch.amp.GradScaler ----------------------------------------

    #: GradScaler.step(optimizer) hands this optimizer the scale instead of unscaling ``.grad``
    #: (which dpcore leaves empty until the release): see :meth:`attach_grad_scaler`.
    _step_supports_amp_scaling = True

    def attach_grad_scaler(self, grad_scaler: Any) -> None:
        """Trains with float16 autocast and ``torch.amp.GradScaler`` (also ``make_private(...,
        grad_scaler=scaler)``)::

            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)       # or optimizer.step()
            scaler.update()

        The per-record gradients are captured scaled by the scaler's scale S and divided by S
        before their norms are taken, so the clip sees unscaled gradients. When a scaled
        per-record gradient overflowed (inf or NaN), the step is skipped: nothing is released,
        nothing is recorded in the ledger, no update is applied, an :class:`OverflowSkipWarning`
        says so, :attr:`skipped_steps` counts it, and the scaler is told so that ``update()``
        lowers its scale. With micro-batches, an overflow in any of them skips the whole
        logical batch. bfloat16 autocast needs no scaler."""
        if not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "_per_optimizer_states")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        if self._comm is not None:
            raise NotImplementedError("grad_scaler with data-parallel training is not supported yet")
        if getattr(self, "_mf_groups", None):
            raise ValueError(
                "grad_scaler with matrix-factorization noise: a step skipped for an overflow would leave a batch of the "
                "cycle unreleased and break the noise stream's alignment with it; train with bfloat16 autocast "
                "(no scaler needed) instead"
            )
        self.grad_scaler = grad_scaler

    def _scaling(self) -> bool:
        s = self.grad_scaler
        return s is not None and bool(s.is_enabled())

    def _sync_loss_scale(self) -> None:
        if self.grad_scaler is None and getattr(self, "grad_scale", None) is not None:
            self.engine.clear()
            raise RuntimeError(
                "GradScaler.step() was called on a DPOptimizer that does not know the scaler: pass "
                "grad_scaler=scaler to make_private (or call optimizer.attach_grad_scaler(scaler))"
            )
        self.engine.loss_scale = float(self.grad_scaler.get_scale()) if self._scaling() else 1.0

    def _tell_scaler(self, found_inf: bool) -> None:
        """What ``GradScaler.update()`` reads: whether this step found an overflow."""
        if not self._scaling():
            return
        s = self.grad_scaler
        dev = s._scale.device if getattr(s, "_scale", None) is not None else torch.device("cpu")
        flag = torch.full((1,), 1.0 if found_inf else 0.0, dtype=torch.float32, device=dev)
        s._per_optimizer_states[id(self)]["found_inf_per_device"] = {dev: flag}

    def _skip_overflow(self, releasing: bool, drawn: Optional[int]) -> None:
        """Drops the logical batch after an overflow; at its end, skips the release."""
        self.discard()
        self.last_step_released = False
        if not releasing:
            self._overflowed = True  # the rest of this logical batch is dropped too
            return
        if drawn is not None:
            self._drawn_at_release = drawn
        self.skipped_steps += 1
        warnings.warn(
            f"step skipped: the GradScaler's scaled per-record gradients overflowed at scale "
            f"{self.engine.loss_scale:g}; nothing was released, nothing recorded in the ledger, and no update "
            f"applied ({self.skipped_steps} skipped so far)",
            OverflowSkipWarning,
            stacklevel=3,
        )

    def _check_trainable(self) -> None:
        """Which parameters train is fixed when the optimizer is wrapped. A parameter frozen
        afterwards would still receive noise (an update of pure noise); one unfrozen afterwards
        would get autograd's ordinary, unclipped gradient. Both are refused before anything."""
        for name, p, was in self._watch:
            if p.requires_grad != was:
                self.engine.clear()
                for _, q, _ in self._watch:
                    q.grad = None  # an unfrozen parameter's .grad is unclipped: never kept
                how = "frozen (requires_grad=False)" if was else "unfrozen (requires_grad=True)"
                raise RuntimeError(
                    f"parameter {name!r} was {how} after the optimizer was made private: dpcore fixes the set of "
                    "trainable parameters when it wraps the optimizer. Change requires_grad before make_private, or "
                    "make a new private optimizer (with the same ledger) after changing it; nothing was released"
                )

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Clips the records of the last backward pass; at the end of a logical batch adds noise,
        records the release in the ledger and applies the wrapped optimizer's update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_trainable()
        self._sync_loss_scale()
        releasing = self._logical_complete()
        dl = self.data_loader
        drawn = getattr(dl, "samples_drawn", None)
        if releasing and drawn is not None and drawn <= self._drawn_at_release:
            self.engine.clear()
            raise RuntimeError(
                "no new Poisson sample since the last release: call step() once per (micro-)batch that the "
                "DPDataLoader yields, never twice for one batch"
            )
        if releasing and self._mf_groups:
            self._mf_sync()
            self._check_mf_step(drawn)
        if self._comm is not None and (releasing or self._layouts is not None):
            try:
                self._check_uncaptured()
                b, factors = self._clip_factors()
            except BaseException as e:
                # The other ranks are about to meet this one in the step's collectives: tell them,
                # so that every rank fails now instead of waiting for the process group's timeout.
                # (Under FSDP2 every micro-batch has collectives, not only the releasing one.)
                if releasing:
                    self._step_distributed(0, [], failed=e)
                else:
                    self._hold_sharded(0, [], failed=e)
                raise
        else:
            try:
                b, factors = self._clip_factors()
            except _Overflow:
                self._tell_scaler(True)
                self._skip_overflow(releasing, drawn)
                return loss
        if self._overflowed:  # an earlier micro-batch of this logical batch overflowed
            self.engine.clear()
            self._tell_scaler(True)
            self._skip_overflow(releasing, drawn)
            return loss
        self._tell_scaler(False)
        if not releasing:
            if self._layouts is not None:
                self._hold_sharded(b, factors)
            else:
                self._hold(b, factors)
            return loss
        if self._comm is not None:
            self._step_distributed(b, factors)
        else:
            # The queries' plans for this release: noise, event, and their next global states
            # (adaptive clipping draws its count's noise here), committed only once released.
            self._pending = self._noised_plans([g.ns for g in self._groups])
            mf = self._mf_open()
            write = self._start_ledger_write()
            drawing = self._mf_start(write, mf) if mf else None
            try:
                try:
                    self._add_noise()
                except BaseException:
                    self._discard()
                    raise
                self._accumulate(b, factors)
                try:
                    self._discrete_noise()
                    if drawing is not None:
                        self._mf_noise(drawing, mf, write)
                except BaseException:
                    self._discard()
                    raise
            except BaseException:
                self._pending = None
                write.result()  # the entry stands (over-counting is the safe side); surface the error
                self._mf_settle(drawing, mf)  # ... and the noise stream advances with it
                raise
            self._release(write)
        if drawn is not None:
            self._drawn_at_release = drawn
        for g, (_, gs) in zip(self._groups, self._pending):  # type: ignore[union-attr]
            g.gs, g.ns = gs, g.query.initial_norm_state()
        self._pending = None
        self._records = 0
        self.original_optimizer.step()
        self.last_step_released = True
        return loss

    def _hold(self, b: int, factors: List[Optional[torch.Tensor]]) -> None:
        self._accumulate(b, factors)
        self._records += b
        for p in self._params:
            p.grad = None
        self.last_step_released = False

    def accumulate(self) -> None:
        """Clips the records of the last backward pass and adds them to the logical batch being
        formed, without releasing anything: gradient accumulation driven by the caller (the
        Hugging Face Trainer's ``gradient_accumulation_steps``), where :meth:`step` is called
        once per logical batch. Call it after every backward pass but the logical batch's last
        (calling it after the last too is fine: :meth:`step` then releases what is held).
        A non-finite record raises here, and the records held so far are dropped."""
        if self._comm is not None:
            raise NotImplementedError(
                "accumulate() under torch.distributed: give the DPDataLoader max_physical_batch_size instead"
            )
        self._check_trainable()
        self._sync_loss_scale()
        try:
            b, factors = self._clip_factors()
        except _Overflow:
            self._tell_scaler(True)
            self._skip_overflow(False, None)
            return
        except BaseException:
            self._discard()
            raise
        if self._overflowed:
            self.engine.clear()
            return
        self._tell_scaler(False)
        self._hold(b, factors)

    def _noised_plans(self, norm_states: List[Any]) -> List[Tuple[ReleasePlan, Any]]:
        return [
            g.query.get_noised_plan(
                ns, g.gs, len(g.members), seed=derive_seed(self._seed, self._releases, gi, 0x5EED), dim=g.dim
            )
            for gi, (g, ns) in enumerate(zip(self._groups, norm_states))
        ]

    def _shared_plans(self, step: int, failed: Optional[BaseException]) -> Any:
        """Plans that depend on the records (adaptive clipping's count is a sum over all ranks'
        records, its noise drawn by rank 0 alone): made on rank 0 from every rank's norm
        state and sent to all. A rank that failed says so here, and every rank stops."""
        comm = self._comm
        assert comm is not None
        why = None if failed is None else f"{type(failed).__name__}: {failed}"
        gathered = comm.gather((why, [g.ns for g in self._groups]), f"step {step}: gathering the queries' norm states")
        if failed is not None:
            self._discard()
            return None
        bad = [(r, w) for r, (w, _) in enumerate(gathered) if w is not None]
        if bad:
            raise DistributedError(f"step {step}: rank {bad[0][0]} failed ({bad[0][1]}); nothing was released or recorded")
        merged: Any = None
        if comm.is_root:
            merged = gathered[0][1]
            for _, other in gathered[1:]:
                merged = [g.query.merge_norm_states(a, o) for g, a, o in zip(self._groups, merged, other)]
        return comm.share(self._noised_plans(merged) if comm.is_root else None, f"step {step}: sharing the release plans")

    def _gather_held(self, views: List[torch.Tensor]) -> None:
        """Earlier micro-batches of this logical batch into the release's buffers (views), which
        become the accumulators."""
        for k, acc in enumerate(self._acc):
            if acc is not None:
                views[k].add_(acc.to(device=views[k].device, dtype=views[k].dtype))
        self._acc = list(views)

    @staticmethod
    def _raise_failures(step: int, failures: int) -> None:
        if failures:
            raise DistributedError(
                f"step {step}: {failures} rank(s) failed before the reduction of the clipped sums (see their errors); "
                "nothing was released or recorded"
            )

    def _reduce_scatter(
        self, step: int, b: int, factors: List[Optional[torch.Tensor]], failed: Optional[BaseException], local: bool
    ) -> bool:
        """The sharded (FSDP2) release (:mod:`dpcore.torch._distributed`): after the failure
        count, this micro-batch's sums reduce-scattered (:meth:`_scatter_sums`) onto the rows
        held from the logical batch's earlier micro-batches, with this rank's own rows' noise
        (added with the first micro-batch, or now). The accumulators are then this rank's rows
        of the noised average. False when this rank failed (after telling the others)."""
        comm = self._comm
        assert comm is not None
        if local:
            failures = comm.count(failed is not None, self._params[0].device, f"step {step}: counting failed ranks")
            if failed is not None:
                self._discard()
                return False
            self._raise_failures(step, failures)
        sds = self._noise_stddevs()
        if self._shard_noise is None:
            self._scatter_sums(step, b, factors, sds)
        else:
            # Noised with the first micro-batch at the plan's stddevs then; a release plan asking
            # for more (never expected: the plan comes from the same global state) gets the
            # difference, independent noise, so that each coordinate's variance is the plan's.
            extra = [
                [None if r is None or u is None or r <= u else math.sqrt(r * r - u * u) for r, u in zip(rs, us)]
                for rs, us in zip(sds, self._shard_noise)
            ]
            self._scatter_sums(step, b, factors, extra, top_up=True)
        self._shard_noise = None
        return True

    def _hold_sharded(self, b: int, factors: List[Optional[torch.Tensor]], failed: Optional[BaseException] = None) -> None:
        """A micro-batch that does not release, under FSDP2: its sums reduce-scattered at once
        onto the rows held (the first one with this rank's own rows' noise), so that between
        micro-batches a rank holds only its shard of the sums, never full-size ones. A rank that
        failed tells the others, and every rank drops the logical batch."""
        comm = self._comm
        assert comm is not None
        step = self._releases
        try:
            failures = comm.count(failed is not None, self._params[0].device, f"step {step}: counting failed ranks")
            if failed is not None:
                self._discard()
                return
            self._raise_failures(step, failures)
            if self._shard_noise is None:
                sds = self._noise_stddevs()
                self._scatter_sums(step, b, factors, sds)
                self._shard_noise = sds
            else:
                self._scatter_sums(step, b, factors, None)
        except BaseException:
            self._discard()
            raise
        self._records += b
        for p in self._params:
            p.grad = None
        self.last_step_released = False

    def _scatter_sums(
        self, step: int, b: int, factors: List[Optional[torch.Tensor]], sds: Optional[List[List[Optional[float]]]],
        top_up: bool = False,
    ) -> None:
        """One parameter at a time (no rank ever holds full-size sums of every parameter): the
        parameter's clipped sum over this rank's records in full shape, plus noise of stddevs
        ``sds`` on this rank's own rows only (None: no noise), one reduce-scatter, added onto the
        rows held in the accumulators."""
        comm, layouts = self._comm, self._layouts
        assert comm is not None and layouts is not None
        noise: Dict[int, torch.Tensor] = {}
        if sds is not None:
            drawn = self._draw_noise(step + (1 << 40), sds) if top_up else self._noise(step)
            for g, row in zip(self._groups, drawn):
                for k, z in zip(g.members, row):
                    if z is not None:
                        noise[k] = z
        m = len(self._params)
        held, self._acc = self._acc, [None] * m
        outs: List[Optional[torch.Tensor]] = []
        for k, (lay, p) in enumerate(zip(layouts, self._params)):
            pad = lay.padded(work_dtype(p.dtype), p.device)
            full = pad[: lay.shape[0]]
            z = noise.pop(k, None)
            if z is not None and lay.rows:  # this rank's rows only, from its own generator
                full.narrow(0, lay.start, lay.rows).add_(z.to(device=full.device, dtype=full.dtype))
            if b > 0 and factors[k] is not None:
                into: List[Optional[torch.Tensor]] = [None] * m
                into[k] = full
                self.engine.clipped_sums(factors, into=into, only=k, clear=False)
            out = torch.empty((lay.block,) + lay.shape[1:], dtype=pad.dtype, device=pad.device)
            comm.reduce_scatter_([out], [pad], f"step {step}: reduce-scatter of the clipped sums")
            del pad, full
            mine = out[: lay.rows]
            if held[k] is not None:
                mine.add_(held[k])
                held[k] = None
            outs.append(mine)
        self.engine.clear()
        self._acc = outs

    def _check_uncaptured(self) -> None:
        """Under FSDP2 a gradient that reached a shard by FSDP2's own reduce-scatter was not
        captured per record (a parameter used outside its module's forward): refuse the step."""
        if self._layouts is None:
            return
        for k, p in enumerate(self._params):
            if p.grad is not None and id(p.grad) != self._given.get(k):
                raise RuntimeError(
                    f"parameter {self.param_names[k]!r} received a gradient that dpcore.torch did not capture per record "
                    "(FSDP2 reduced it): some code used it outside its module's forward. Register a rule for the module "
                    "that uses it (dpcore.torch.register_layer), or freeze it; nothing was released"
                )

    def _step_distributed(self, b: int, factors: List[Optional[torch.Tensor]], failed: Optional[BaseException] = None) -> None:
        """One data-parallel release (:mod:`dpcore.torch._distributed`): the queries' plans
        from the norm states of all ranks, decided on rank 0; this rank's clipped sums (and on
        rank 0 the noise) accumulated into flat buffers; one all-reduce; rank 0 records the
        release durably and tells the others, and only then does any rank apply it."""
        comm = self._comm
        assert comm is not None
        step = self._releases
        local = all(g.query.plan_from_global_state for g in self._groups)
        try:
            if local:
                # Fixed clipping: every rank computes the same plans from the same global state.
                # A rank that failed says so in the all-reduce itself (a count after the sums).
                self._pending = self._noised_plans([g.ns for g in self._groups])
            else:
                self._pending = self._shared_plans(step, failed)
                if failed is not None:
                    return  # the caller raises this rank's own error
            if self._layouts is not None:
                if not self._reduce_scatter(step, b, factors, failed, local):
                    return
            else:
                bufs, views = flat_views(self._params, flag=local)
                if failed is None:
                    self._gather_held(views)
                    if comm.is_root:
                        self._add_noise()  # the release's noise, once, from rank 0's generator
                    self._accumulate(b, factors)  # in place into the views
                elif local:
                    bufs[0][-1] = 1
                comm.sum_(bufs, f"step {step}: all-reduce of the clipped sums")
                if local:
                    failures = int(bufs[0][-1].item())
                    if failed is not None:
                        self._discard()
                        return
                    self._raise_failures(step, failures)
        except BaseException:
            self._discard()
            raise
        device = self._params[0].device
        if comm.is_root:
            try:
                self.ledger.record_release(self._event())
            except BaseException:
                self._discard()
                try:
                    comm.commit(False, device, f"step {step}: telling the ranks the ledger write failed")
                except DistributedError:
                    pass  # the ledger's error is the one to report
                raise
            # The entry is durable; if the commit cannot reach a rank, that rank raises, and
            # the ledger counts a release that this rank holds (the safe side).
            comm.commit(True, device, f"step {step}: committing the release")
        else:
            try:
                # (this rank's flag is overwritten by rank 0's)
                ok = comm.commit(False, device, f"step {step}: waiting for rank 0 to record the release")
            except BaseException:
                self._discard()
                raise
            if not ok:
                self._discard()
                raise DistributedError(f"step {step}: rank 0 could not record the release in the ledger; nothing applied")
            self.ledger.record_release(self._event())  # the replica
        self._releases += 1
        self._set_grads()
