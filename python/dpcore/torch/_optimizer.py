"""DPOptimizer: any ``torch.optim`` optimizer turned into its DP version (DP-SGD, DP-Adam, ...).

Abadi et al. 2016, Algorithm 1, in the query/ledger architecture of McMahan et al. 2018: each
record's gradient is clipped (flat, per-layer or joint clipping, §2 of McMahan et al.), the
clipped gradients are summed, Gaussian noise from dpcore's ChaCha20 core is added with the
stddevs of a :mod:`dpcore.queries` query, the release is written durably to the privacy ledger,
and only then is the noised average handed to the wrapped optimizer's update rule.

The step is a pipeline of stages, each in its own module, chosen once at construction:
capture (:mod:`dpcore.torch._engine`; the trainable set checked by ``_clip.TrainableWatch``) →
clip (``_clip.QueryGroups``) → reduce (the transport of :mod:`dpcore.torch._transport`: one
process, or data-parallel and FSDP2 in :mod:`dpcore.torch._parallel`) → noise (the sources of
:mod:`dpcore.torch._noise`: Gaussian, discrete Gaussian, and the matrix-factorization stream of
:mod:`dpcore.torch._mf`) → record (``_transport.Recorder``) → apply. Which combinations are
supported is decided in one place (:mod:`dpcore.torch._combinations`); the data loader is used
through the loader protocol (:mod:`dpcore.torch._loader`), a GradScaler through
:mod:`dpcore.torch._scaler`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..queries import DPQuery, MicrobatchQuery
from ._clip import MF, QueryGroups, TrainableWatch, build_query, check_arguments
from ._combinations import Setup, check_combination
from ._distributed import current_communicator, is_sharded, resolve_ledger, unwrap_ddp
from ._engine import PerRecordGradients, check_on_nonfinite
from ._lean import check_memory
from ._loader import LoaderView
from ._mf import MFNoise, PlannedStepsWarning
from ._noise import DiscreteGaussianNoise, GaussianNoise, NoiseSource, NoiseSources
from ._parallel import DataParallel, Sharded
from ._scaler import GradScalerGrowthWarning, GradScaling, OverflowSkipWarning, check_grad_scaler, warn_if_growing
from ._transport import Batch, Recorder, SingleProcess, Transport

__all__ = ["DPOptimizer", "GradScalerGrowthWarning", "OverflowSkipWarning", "PlannedStepsWarning"]


def make_transport(
    comm: Any, sharded: bool, model: torch.nn.Module, batch: Batch, queries: QueryGroups, recorder: Recorder,
    params: List[torch.Tensor], seed: Optional[int], loader: Any,
) -> Transport:
    """The transport of this process, chosen once: one process without a communicator, FSDP2
    for sharded parameters, data-parallel otherwise."""
    if comm is None:
        return SingleProcess(batch, queries, recorder, params, seed)
    if sharded:
        return Sharded(comm, batch, queries, recorder, params, seed, loader)
    return DataParallel(comm, model, batch, queries, recorder, params, seed)


def make_noise(
    queries: QueryGroups, params: List[torch.Tensor], seed: Optional[int], engine: PerRecordGradients,
    transport: Transport,
) -> NoiseSources:
    """The noise sources of the query groups' mechanisms, chosen once: the Gaussian one always
    (the transports draw from it; its shapes and rank are the transport's), the discrete
    Gaussian and matrix-factorization ones when a group has that mechanism."""
    others: List[NoiseSource] = []
    if queries.groups_of("discrete_gaussian"):
        others.append(DiscreteGaussianNoise(queries, params, seed))
    if queries.groups_of(MF):
        others.append(MFNoise(queries, params, seed, engine, queries.groups_of(MF)))
    return NoiseSources(GaussianNoise(queries, params, seed, transport.noise_shapes, transport.noise_rank), others)


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
    * ``on_nonfinite``: what a record whose per-record gradient is NaN or infinite does.
      ``"zero"`` (the default, DP): it contributes exactly zero (factor 0 in every clipping
      group, its stored gradient factors zeroed), counts as above any clip for adaptive
      clipping, and the step releases as usual: nothing is raised and nothing about it is
      released, so no control flow depends on one record. ``"raise"``: ``ValueError`` naming
      the first such record, nothing released: a debugging aid whose outcome depends on the
      data (not DP).
    * ``memory``: ``"default"`` (norms and clipped sums from the factors of one backward pass,
      held to the step) or ``"lean"`` (norms in a first backward pass, sums in a second:
      :mod:`dpcore.torch._lean`).
    * ``seed``: tests only (the noise becomes predictable: no privacy).

    Call ``loss.backward()`` then :meth:`step` for every (micro-)batch; an empty Poisson batch
    must be stepped too (it releases pure noise).

    Matrix-factorization (correlated) noise: a group whose query is a
    :class:`~dpcore.queries.MatrixFactorizationQuery` (``make_private(...,
    noise_mechanism=...)``) gets σ·(C⁻¹z)_t at release t from the query's noise stream
    (:class:`dpcore.torch._mf.MFNoise`: w_t computed ahead on a worker thread, the buffers
    advanced once per release, only after its ledger entry is durable); the buffers
    (:attr:`noise_state_nbytes`) are in :meth:`state_dict`. With a cyclic loader each release
    must be the loader's next batch (a batch drawn and not stepped makes the next release raise);
    a failed release whose ledger entry stands still advances the stream, keeping stream, ledger
    and cycle aligned.

    Checkpoints: :meth:`state_dict` carries the DP state (release count, the queries' global
    states, the data loader's position, the ledger's path and length) beside the wrapped
    optimizer's; :meth:`load_state_dict` restores it after checking that the ledger is the
    checkpoint's, with exactly its releases (``ledger_ahead="keep"`` accepts a ledger that
    recorded releases after the checkpoint, keeping them counted). Each stage has public state
    methods (:meth:`checkpoint_state`, :meth:`restore_state` collect them).

    Under ``torch.distributed`` (initialised, world size > 1) the optimizer runs data-parallel
    (:mod:`dpcore.torch._distributed`, :mod:`dpcore.torch._parallel`): ``model`` may be plain or wrapped in
    ``DistributedDataParallel`` (its own all-reduce is switched off: the clipped sums are reduced
    once, by dpcore), rank 0's parameters are copied to every rank at construction, rank 0 adds
    the noise and writes the ledger, and every rank applies the same update. A failed
    collective raises :class:`DistributedError` and nothing is recorded or applied.
    """
    #: GradScaler.step(optimizer) hands this optimizer the scale instead of unscaling ``.grad``
    #: (which dpcore leaves empty until the release): see :meth:`attach_grad_scaler`.
    _step_supports_amp_scaling = True

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
        on_nonfinite: str = "zero",
        memory: str = "default",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DPOptimizer):
            raise TypeError("optimizer is already a DPOptimizer")
        z, den = check_arguments(
            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
            query=query, clipping=clipping, joint_scales=joint_scales, mechanism=mechanism, granularity=granularity,
        )
        self.on_nonfinite = check_on_nonfinite(on_nonfinite)
        if grad_scaler is not None:
            check_grad_scaler(grad_scaler)
        loader = LoaderView(data_loader)
        if ledger is None and loader.ledger is not None:
            ledger = loader.ledger  # the releases go under the samples the loader records
        self._comm = comm = current_communicator()  # (benches/bench_distributed.py times its collectives)
        self.ledger = resolve_ledger(ledger, comm)
        self.original_optimizer = optimizer
        self.noise_multiplier = z
        self.expected_batch_size = den
        self.clipping = clipping if query is None else "query"
        self.data_loader = data_loader
        self._releases = 0
        self._drawn_at_release = 0
        # A MicrobatchQuery at the root makes each record the average gradient of k examples
        # (the engine regroups the factors); its event carries the doubled bound.
        inner, k, factor = query, None, 1.0
        if isinstance(query, MicrobatchQuery):
            inner, k, factor = query.inner, query.microbatch_size, query.sensitivity_factor
        params = [p for g in optimizer.param_groups for p in g["params"]]
        model = unwrap_ddp(model)
        sharded = tuple(is_sharded(p) for p in params if p.requires_grad)
        if check_memory(memory) == "lean" and any(sharded):
            raise ValueError(
                "memory='lean' is not supported with sharded parameters (FSDP2): its sums are held per parameter at "
                "full size, which sharding avoids; use memory='default'"
            )
        # capture
        self.engine = PerRecordGradients(
            model, params, mode=grad_sample_mode, loss_reduction=loss_reduction, batch_first=batch_first, microbatch_size=k,
            memory=check_memory(memory),
        )
        self.param_names = list(self.engine.param_names)
        self._params: List[torch.Tensor] = list(self.engine.params)
        if not self._params:
            raise ValueError("the optimizer has no trainable parameter in the model")
        self._watch = TrainableWatch(model, params)
        # clip
        if query is None:
            query = inner = build_query(
                self.param_names, noise_multiplier=z, max_grad_norm=max_grad_norm, expected_batch_size=den,
                clipping=clipping, joint_scales=joint_scales, mechanism=mechanism, granularity=granularity,
            )
        self.query: Any = query
        self._queries = QueryGroups(query, inner, factor, self._params, self.param_names)
        self._groups = self._queries.groups
        self._setup = Setup.of(self.engine, self._queries, comm, sharded, loader, grad_scaler)
        try:
            check_combination(self._setup)
        except BaseException:
            self.engine.remove()  # the model as it was before the wrap
            raise
        self.noise_multiplier = self._queries.noise_multiplier(z)
        # reduce, noise and record (the transport draws its noise from the noise sources)
        self._batch = Batch(self.engine, self._params, self._queries)
        self._transport = make_transport(
            comm, any(sharded), model, self._batch, self._queries, Recorder(self.ledger), self._params, seed, data_loader
        )
        self._noise = make_noise(self._queries, self._params, seed, self.engine, self._transport)
        self._transport.noise = self._noise
        self._noise.gaussian.ahead = memory != "lean"
        self._scaler = GradScaling(grad_scaler)
        if grad_scaler is not None:
            warn_if_growing(grad_scaler, stacklevel=2)
        self.memory = memory
        if self.engine.lean is not None:
            self.engine.lean.prepare = self._lean_prepare
            self.engine.lean.plan = self._lean_plan
            self.engine.lean.signature = self._lean_signature
        # torch.optim.Optimizer plumbing (LR schedulers, hooks) without re-registering parameters
        self.defaults = optimizer.defaults
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self.last_step_released = False
        #: What :meth:`load_state_dict` does when the ledger holds releases beyond the
        #: checkpoint's: ``"refuse"`` (raise) or ``"keep"`` (resume, keeping them counted).
        self.ledger_ahead = "refuse"
        #: How the error refusing a ledger ahead of the checkpoint tells the user to keep its
        #: releases (None: through this optimizer, ``load_state_dict(..., ledger_ahead='keep')``);
        #: an adapter that builds the optimizer names its own keyword here.
        self.ledger_ahead_hint: Optional[str] = None

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

    @property
    def noise_device(self) -> str:
        """Where the Gaussian noise is drawn: ``"auto"`` (default: on the parameter's device when
        that is an accelerator, by :func:`dpcore.torch._device_noise.device_gaussian_noise_many`; by
        the Rust core on CPU), ``"device"`` (always torch's ChaCha20, also on CPU) or ``"host"``
        (always the core, copied to the device). Both are ChaCha20 keyed from the OS."""
        return self._noise.gaussian.device_mode

    @noise_device.setter
    def noise_device(self, mode: str) -> None:
        self._noise.gaussian.device_mode = mode

    @property
    def noise_state_nbytes(self) -> int:
        """Bytes of correlated-noise state held (the MF streams' buffers; 0 without MF noise):
        num_buffers·d values of the work dtype per stream."""
        return self._noise.state_nbytes

    @property
    def grad_scaler(self) -> Any:
        """The ``torch.amp.GradScaler`` attached (:meth:`attach_grad_scaler`), or None."""
        return self._scaler.grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, v: Any) -> None:
        self._scaler.grad_scaler = v

    @property
    def skipped_steps(self) -> int:
        """Steps skipped after a GradScaler overflow: always 0 in a new run (no step is skipped;
        an overflowed record contributes zero instead). Kept readable for checkpoints of older
        versions, which counted the steps they skipped (restored as they were saved)."""
        return self._scaler.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, v: int) -> None:
        self._scaler.skipped_steps = v

    def state_dict(self) -> Dict[str, Any]:
        """``{"optimizer": <the wrapped optimizer's state dict>, "dpcore": {...}}``, in plain
        Python types and tensors (``torch.load(..., weights_only=True)`` reads it). The
        ``dpcore`` part holds the release count, each query group's global state (adaptive
        clipping's clip norm), noise multiplier, clipping and parameter names and shapes, the
        data loader's :meth:`~DPDataLoader.state_dict`, and the ledger's absolute path and
        length. Take it at a release boundary (after the :meth:`step` that releases); see
        :mod:`dpcore.torch._checkpoint`."""
        from ._checkpoint import optimizer_state

        self._noise.quiesce()  # the MF streams' buffers of the released steps, updated
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

        self._noise.quiesce()  # nothing drawing on the streams that the load replaces
        load_optimizer_state(self, state_dict, ledger_ahead)

    def checkpoint_state(self) -> Dict[str, Any]:
        """The stages' DP state that :mod:`dpcore.torch._checkpoint` stores: release count, samples
        drawn at the last release, steps a GradScaler skipped (0 since no step is skipped), whether no record is held, the
        parameters' names and shapes, each query group's query, members and global state."""
        return {
            "releases": self._releases,
            "drawn_at_release": self._drawn_at_release,
            **self._scaler.checkpoint_state(),
            "logical_batch_complete": not self._batch.held,
            "param_names": list(self.param_names),
            "param_shapes": [list(p.shape) for p in self._params],
            "groups": self._queries.checkpoint_state(),
            "correlated_noise": self._noise.correlated,
        }

    def restore_state(
        self, *, releases: Optional[int] = None, drawn_at_release: Optional[int] = None,
        skipped_steps: Optional[int] = None, global_states: Optional[Sequence[Any]] = None,
    ) -> None:
        """Sets the parts of :meth:`checkpoint_state` given (checked by the caller); the noise
        drawn ahead, for a release index of the run before, is dropped."""
        if global_states is not None:
            self._queries.restore_state(global_states)
        if skipped_steps is not None:
            self._scaler.restore_state({"skipped_steps": skipped_steps})
        self._releases = self._releases if releases is None else int(releases)
        self._drawn_at_release = self._drawn_at_release if drawn_at_release is None else int(drawn_at_release)
        self._noise.forget()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise RuntimeError("add parameter groups before wrapping: the per-record capture is set up at construction")

    def __repr__(self) -> str:
        return (
            f"DPOptimizer({type(self.original_optimizer).__name__}, noise_multiplier={self.noise_multiplier}, "
            f"clipping={self.clipping!r}, ledger={self.ledger.path!r})"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears ``.grad`` and the captured activations (not the accumulated micro-batches)."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.engine.clear()

    def get_epsilon(self, delta: float, **kw: Any) -> float:
        """ε of everything released so far at ``delta``, from the ledger (an upper bound).

        The accountant defaults to the data loader's (a :class:`SamplerDataLoader` of an
        allocation sampler: ``"rdp"``, its only certified analysis, which the ledger would fall
        back to anyway, with a warning), else the ledger's default (PLD)."""
        acct = LoaderView(self.data_loader).accountant
        if acct is not None and "accountant" not in kw:
            kw["accountant"] = acct
        return self.ledger.get_epsilon(delta, **kw)

    def attach_grad_scaler(self, grad_scaler: Any) -> None:
        """Trains with float16 autocast and ``torch.amp.GradScaler`` (also ``make_private(...,
        grad_scaler=scaler)``)::

            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)       # or optimizer.step()
            scaler.update()

        The per-record gradients are captured scaled by the scaler's scale S and divided by S
        before their norms are taken, so the clip sees unscaled gradients. No step is skipped
        and the scale never backs off because of the data: a record whose scaled per-record
        gradient overflowed (inf or NaN) is a non-finite record (see ``on_nonfinite``: by
        default it contributes zero, and the step releases as usual), and the scaler is always
        told that it found no overflow, so that its scale follows only its own growth schedule
        (×``growth_factor`` every ``growth_interval`` calls of ``update()``; with micro-batches
        ``update()`` runs once per physical batch). Both a skip and a backoff would depend on
        one record's gradient and are not covered by the noise. Use a fixed scale,
        ``GradScaler(init_scale=S, growth_interval=2**31 - 1)`` (torch refuses
        ``growth_factor=1.0``), with S small enough that no ordinary
        record overflows (a scaler that grows gets a :class:`GradScalerGrowthWarning`: it would
        end up zeroing every record). bfloat16 autocast needs no scaler."""
        check_grad_scaler(grad_scaler)
        check_combination(self._setup.with_grad_scaler())
        self._setup = self._setup.with_grad_scaler()
        self._scaler.grad_scaler = grad_scaler
        warn_if_growing(grad_scaler, stacklevel=2)

    # -- the memory-lean mode's two passes (dpcore.torch._lean) ---------------------------

    def _lean_prepare(self) -> None:
        # what the step would set before clipping: the loss scale and the batch's users
        self.engine.loss_scale = self._scaler.loss_scale()
        self.engine.record_groups = LoaderView(self.data_loader).record_groups
        self.engine.record_mask = LoaderView(self.data_loader).record_mask

    def _lean_plan(self) -> List[Optional[torch.Tensor]]:
        # The step's own clip stage, its norm states left for the step to commit: the factors
        # of the sum pass are those the step then computes again (and checks) from the same norms.
        return self._queries.clip_factors(self.engine, "zero", commit=False)[1]

    def _lean_signature(self) -> Any:
        # what the clip factors depend on besides the norms: each group's plan and the loss scale
        plans = tuple((p.l2_norm_clip, tuple(p.part_scales), p.denominator, p.mechanism) for p in
                      (g.plan() for g in self._queries.groups))
        s = self.engine.loss_scale
        return plans, (id(s) if isinstance(s, torch.Tensor) else float(s))

    # -- the DP step ------------------------------------------------------------------

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Clips the records of the last backward pass; at the end of a logical batch adds noise,
        records the release in the ledger and applies the wrapped optimizer's update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._watch.check(self.engine)
        self._scaler.sync(self, self.engine, getattr(self, "grad_scale", None))
        loader = LoaderView(self.data_loader)
        releasing = loader.logical_batch_complete
        drawn = loader.samples_drawn
        if releasing and drawn is not None and drawn <= self._drawn_at_release:
            self.engine.clear()
            raise RuntimeError(
                "no new Poisson sample since the last release: call step() once per (micro-)batch that the "
                "DPDataLoader yields, never twice for one batch"
            )
        if releasing:
            self._noise.before_release(self._releases, drawn, loader)
        try:  # clip (a non-finite record is zeroed here, or raises with on_nonfinite="raise")
            self._transport.check_captured()
            self.engine.record_groups = loader.record_groups
            self.engine.record_mask = loader.record_mask
            b, factors = self._queries.clip_factors(self.engine, self.on_nonfinite)
        except BaseException as e:
            self._transport.clip_failed(self._releases, e, releasing)
            raise
        if not releasing:
            self._transport.hold(self._releases, b, factors)
            self.last_step_released = False
            return loss
        self._transport.release(self._releases, b, factors)  # reduce, noise, record (durable)
        self._releases += 1  # apply
        self._transport.set_grads()
        if drawn is not None:
            self._drawn_at_release = drawn
        self._queries.commit()
        self._batch.records = 0
        self.original_optimizer.step()
        self.last_step_released = True
        return loss

    def accumulate(self) -> None:
        """Clips the records of the last backward pass and adds them to the logical batch being
        formed, without releasing anything: gradient accumulation driven by the caller (the
        Hugging Face Trainer's ``gradient_accumulation_steps``), where :meth:`step` is called
        once per logical batch. Call it after every backward pass but the logical batch's last
        (calling it after the last too is fine: :meth:`step` then releases what is held).
        A non-finite record contributes zero (``on_nonfinite="zero"``); with
        ``on_nonfinite="raise"`` it raises here, and the records held so far are dropped."""
        check_combination(self._setup, operation="accumulate")
        self._watch.check(self.engine)
        self._scaler.sync(self, self.engine, getattr(self, "grad_scale", None))
        try:
            self.engine.record_groups = LoaderView(self.data_loader).record_groups
            self.engine.record_mask = LoaderView(self.data_loader).record_mask
            b, factors = self._queries.clip_factors(self.engine, self.on_nonfinite)
        except BaseException:
            self._batch.discard()
            raise
        self._transport.hold(self._releases, b, factors)
        self.last_step_released = False

    def discard(self) -> None:
        """Drops the records held for the logical batch being formed (micro-batches added by
        :meth:`accumulate` or by steps that did not release) and those of the last backward
        pass, with nothing released or recorded: for a caller whose micro-batch failed
        part-way through a logical batch. The next release then holds only later records."""
        self._batch.discard()
        self._batch.clear_grads()
