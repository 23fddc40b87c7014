"""``make_private(..., noise_mechanism=...)``: DP training with matrix-factorization noise.

The pieces (see :mod:`dpcore.matrix_factorization`): a data order that follows a participation
schema (:mod:`._cyclic`), a Toeplitz strategy C optimised for the planned steps
(:func:`dpcore.matrix_factorization.optimize`), and a
:class:`~dpcore.queries.MatrixFactorizationQuery` whose noise the DPOptimizer draws from the
stream at each release (:class:`MFNoise`, its noise source). ``noise_multiplier`` is the
*effective* one, z = σ/(C·sens(C)).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from .._validate import count
from ..matrix_factorization._participation import CYCLIC_POISSON, Participation
from ..matrix_factorization._strategies import ToeplitzStrategy
from .._seeds import derive_seed
from ._amp import work_dtype
from ._noise import NoiseSource
from ._workers import Worker

NOISE_MECHANISMS = ("independent", "banded", "blt")


@dataclass(frozen=True)
class Schedule:
    """What the data order will be: ``order`` is "fixed" (dpcore's cyclic fixed batches),
    "poisson" (cyclic Poisson sampling) or "keep" (the caller's loader, checked to repeat);
    ``participation`` has max_participations = epochs; ``steps`` = epochs·b."""

    order: str
    participation: Participation
    steps: int


def schedule(
    data_loader: DataLoader,
    *,
    noise_mechanism: Any,
    epochs: Any,
    participation: Any,
    poisson_sampling: Optional[bool],
    keep_loader: bool,
) -> Schedule:
    """Checks the data-order arguments of an MF run and derives its schedule (no side effect)."""
    from ._cyclic import check_fixed_order

    if noise_mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS} (or None for DP-SGD), got {noise_mechanism!r}")
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    if epochs is None:
        raise TypeError(
            f"noise_mechanism={noise_mechanism!r} needs epochs=: the correlated noise and its strategy are planned for "
            "epochs × batches-per-epoch steps"
        )
    epochs = count("epochs", epochs, 1)
    if participation is not None and not isinstance(participation, Participation):
        raise TypeError(f"participation must be a dpcore.matrix_factorization.Participation, got {type(participation).__name__}")
    if not isinstance(keep_loader, bool):
        raise TypeError(f"keep_loader must be a bool, got {type(keep_loader).__name__}")
    wants_poisson = participation is not None and participation.kind == CYCLIC_POISSON
    if poisson_sampling is None:
        poisson_sampling = wants_poisson
    if poisson_sampling and keep_loader:
        raise ValueError("keep_loader=True keeps the DataLoader's fixed batches; it cannot be combined with cyclic Poisson sampling")
    n = len(data_loader.dataset)  # type: ignore[arg-type]
    if n < 1:
        raise ValueError("dataset is empty")
    if poisson_sampling:
        if not wants_poisson:
            raise ValueError(
                "Poisson sampling with matrix-factorization noise is cyclic Poisson sampling (amplified banded MF, "
                "Choquette-Choo et al. 2023): give participation=Participation.cyclic_poisson(b, p) (b groups, each "
                "record of group t mod b sampled with probability p at step t; the expected batch is p·n/b). The "
                "recommended default is cyclic fixed batches (leave participation= out)"
            )
        b = participation.min_separation  # type: ignore[union-attr]
        if b > n:
            raise ValueError(f"participation has {b} groups but the dataset only {n} records")
        part = Participation(b, epochs, participation.sampling_probability)  # type: ignore[union-attr]
        return Schedule("poisson", part, epochs * b)
    if wants_poisson:
        raise ValueError(
            "participation is cyclic Poisson but fixed batches were asked for (sampler='shuffle' or "
            "poisson_sampling=False): leave the sampler out for cyclic Poisson sampling, or give a cyclic "
            "participation for fixed batches"
        )
    if keep_loader:
        check_fixed_order(data_loader)
        b = len(data_loader)
        order = "keep"
    else:
        bs = data_loader.batch_size
        if bs is None:
            raise ValueError("data_loader has no batch_size: the fixed batches' size")
        if bs > n:
            raise ValueError(f"batch_size {bs} is larger than the dataset ({n} records): not even one fixed batch")
        b = n // bs
        order = "fixed"
    if participation is not None and participation.min_separation != b:
        raise ValueError(
            f"participation declares {participation.min_separation} batches per epoch, but the data order has {b} "
            f"({'len(data_loader)' if keep_loader else 'n // batch_size'}): the strategy and the data must agree"
        )
    return Schedule(order, Participation(b, epochs), epochs * b)


def sgd_momentum(optimizer: Any) -> float:
    """The heavy-ball β of a ``torch.optim.SGD`` whose parameter groups all share it (0 for any
    other optimizer, or when the groups differ): the workload a default strategy is optimised
    for. Adaptive optimizers (Adam) rescale per coordinate, which no Toeplitz workload models."""
    import torch

    if not isinstance(optimizer, torch.optim.SGD):
        return 0.0
    betas = {float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups}
    beta = betas.pop() if len(betas) == 1 else 0.0
    return beta if 0.0 < beta < 1.0 else 0.0


def choose_strategy(noise_mechanism: str, strategy: Any, sched: Schedule, momentum: float = 0.0) -> ToeplitzStrategy:
    """The strategy of an MF run: checked against the mechanism and schedule, or optimised
    (:func:`dpcore.matrix_factorization.strategy_for`) for SGD's ``momentum``."""
    from ..matrix_factorization import strategy_for

    return strategy_for(noise_mechanism, sched.participation, sched.steps, strategy, momentum=momentum)


# -- the noise source of a DPOptimizer --------------------------------------------------------


class PlannedStepsWarning(UserWarning):
    """A matrix-factorization stream ran past the steps its strategy and noise were planned
    for: the ledger accounts the steps actually run (ε grows faster than planned)."""


class MFNoise(NoiseSource):
    """Matrix-factorization (correlated) noise for the query groups ``groups`` of ``queries``.

    A group gets σ·(C⁻¹z)_t at release t, member j of the group being part j of the query's
    noise stream, in float32 for float32/bfloat16/float16 parameters (float64 for float64 ones).
    w_t = (C⁻¹z)_t depends on no data: it is computed ahead, on this source's worker thread in
    the background of the forward and backward passes, from the buffers of the released steps,
    without changing them. Only the buffers' update waits for the release's ledger entry, so a
    stream never advances for a step the ledger does not count (an unrecorded step would shift
    the cycle's participations against the noise), and checkpoints see exactly the released
    steps. A draw is used only for the release index it was made for; one never used is
    dropped, never saved. A failed release whose ledger entry stands still advances the stream
    (:meth:`abort`), keeping stream, ledger and cycle aligned."""

    correlated = True

    def __init__(self, queries: Any, params: List[torch.Tensor], seed: Optional[int], engine: Any, groups: List[int]) -> None:
        self.queries, self.params, self.seed, self.engine, self.groups = queries, params, seed, engine, groups
        self._warned = False
        self._worker = Worker("mf-noise")
        # (release index, Future of that release's fresh z per MF group member): drawn ahead
        self._next: Optional[Tuple[int, Future]] = None
        self._commit: Optional[Future] = None  # the last release's buffer update
        # The release being made: group → [global state after the plan, parts drawn, done],
        # and the Future of its unit noise.
        self._open: Dict[int, List[Any]] = {}
        self._drawing: Optional[Future] = None

    @property
    def state_nbytes(self) -> int:
        """Bytes of the streams' buffers: num_buffers·d values of the work dtype per stream."""
        return sum(int(self.queries.groups[gi].gs.noise.state_nbytes) for gi in self.groups)

    @property
    def drawn_ahead(self) -> Optional[int]:
        return None if self._next is None else self._next[0]

    def forget(self) -> None:
        self._next = None

    def _dtype(self, k: int) -> Any:
        return np.float64 if work_dtype(self.params[k].dtype) == torch.float64 else np.float32

    def before_release(self, step: int, drawn: Optional[int], loader: Any) -> None:
        """The last release's buffer update done; the loader's batch must be the stream's step
        (every batch of the cycle released, in order), and past the planned steps a warning
        (once)."""
        self._sync()
        cyclic = loader.participation is not None
        for gi in self.groups:
            g = self.queries.groups[gi]
            at = int(getattr(g.gs, "step", 0))
            if cyclic and drawn is not None and drawn != at + 1:
                self.engine.clear()
                raise RuntimeError(
                    f"the cyclic loader has drawn {drawn} batches but the matrix-factorization noise stream is at step "
                    f"{at}: every batch of the cycle must be released, in order (a batch was drawn and not stepped, "
                    "or discarded). The noise stream and the cycle must stay aligned for the noise's sensitivity to "
                    "hold; resume from a checkpoint"
                )
            planned = getattr(g.query, "steps", None)
            if planned is not None and at >= planned and not self._warned:
                self._warned = True
                warnings.warn(
                    f"training past the {planned} steps the matrix-factorization noise was planned for (its strategy "
                    "and noise multiplier): the ledger accounts the steps actually run, and ε grows faster from here "
                    "than planned",
                    PlannedStepsWarning,
                    stacklevel=4,  # DPOptimizer.step's caller
                )

    def _unit(self, step: int, streams: Dict[int, Any], parallel: bool) -> Dict[int, List[np.ndarray]]:
        """The unit noise w_t of release ``step`` for every member of each MF group (``streams``:
        group → its global state at that step), computed without advancing the buffers."""
        out: Dict[int, List[np.ndarray]] = {}
        for gi, gs in streams.items():
            g = self.queries.groups[gi]
            row = []
            for j, k in enumerate(g.members):
                seed = derive_seed(self.seed, step, gi, j)
                row.append(g.query.draw_unit_noise(gs, j, self.params[k].numel(), self._dtype(k), seed=seed, parallel=parallel))
            out[gi] = row
        return out

    def start(self, step: int, write: Future) -> None:
        """This release's unit noise w_t for each member: the one drawn ahead for ``step``, or
        drawn now on the worker."""
        pending = self.queries.pending
        assert pending is not None
        self._open = {gi: [pending[gi][1], set(), False] for gi in self.groups}
        ahead, self._next = self._next, None
        if ahead is not None and ahead[0] == step:
            self._drawing = ahead[1]
        else:
            self._drawing = self._worker.submit(self._unit, step, {gi: st[0] for gi, st in self._open.items()}, True)

    @torch.no_grad()
    def after_sums(self, step: int, batch: Any, write: Future) -> None:
        """Adds each MF group's correlated noise σ·w_t/denominator to its released sums (in the
        work dtype: float32 accumulators for float32, bfloat16 and float16 parameters), then
        queues, behind the ledger write, the buffers' update and the next release's w."""
        assert self._drawing is not None
        noise = self._drawing.result()
        pending = self.queries.pending
        assert pending is not None
        for gi, st in self._open.items():
            g = self.queries.groups[gi]
            plan, _ = pending[gi]
            for j, (k, w) in enumerate(zip(g.members, noise[gi])):
                p = self.params[k]
                sd = plan.part_stddevs[j] / plan.denominator
                # w is read again by the buffers' update: scaled into a new tensor, never in place
                t = torch.from_numpy(w).view(p.shape).to(device=p.device, dtype=work_dtype(p.dtype), non_blocking=True)
                acc = batch.acc[k]
                batch.acc[k] = t * sd if acc is None else acc.add_(t, alpha=sd)
            st[2] = True
        streams = {gi: st[0] for gi, st in self._open.items()}
        for gi, gs in streams.items():
            # the next global state at once; its stream is closed by the update below, which the
            # next release waits for (before_release)
            pending[gi] = (pending[gi][0], self.queries.groups[gi].query.released_state(gs))
        groups = self.queries.groups

        def commit() -> Dict[int, List[np.ndarray]]:
            """The buffers' update for this release and, in the same pass, the next release's w."""
            write.result()  # a release the ledger does not hold must not advance the streams
            ahead: Dict[int, List[np.ndarray]] = {}
            for gi, gs in streams.items():
                q = groups[gi].query
                ahead[gi] = [
                    q.commit_noise(gs, j, draw_next=True, seed=derive_seed(self.seed, step + 1, gi, j), parallel=False)
                    for j in range(len(groups[gi].members))
                ]
                q.close_step(gs)
            return ahead

        committed = self._worker.submit(commit)
        self._commit = committed
        self._next = (step + 1, committed)
        self._open, self._drawing = {}, None

    def _sync(self) -> None:
        """Waits for the last release's buffer update. A failed update (its ledger write failed,
        and the step that made it raised already, leaving the groups' global states at that
        release) leaves the streams unadvanced, as the ledger is."""
        pending, self._commit = self._commit, None
        if pending is not None:
            try:
                pending.result()
            except BaseException:
                pass

    def quiesce(self) -> None:
        """Before the streams' state is read or replaced: the update done, nothing drawing."""
        self._sync()
        ahead, self._next = self._next, None
        if ahead is not None:
            try:
                ahead[1].result()
            except BaseException:
                pass

    def abort(self, step: int) -> None:
        """After a failed release whose ledger entry stands: every MF stream still advances one
        step (with the w drawn for it, or one drawn now and dropped), so that the stream, the
        ledger and the cycle stay aligned. Nothing is released."""
        drawing, opened = self._drawing, self._open
        self._open, self._drawing = {}, None
        if drawing is not None:
            try:
                drawing.result()
            except BaseException:
                pass
        for gi, (gs, _, _) in opened.items():
            g = self.queries.groups[gi]
            for j, k in enumerate(g.members):
                part = gs.noise.parts.get(j)
                if part is None or not part.drawn:
                    g.query.draw_unit_noise(gs, j, self.params[k].numel(), self._dtype(k), seed=derive_seed(self.seed, step, gi, j))
                g.query.commit_noise(gs, j)
            g.gs, g.ns = g.query.finish_release(gs), g.query.initial_norm_state()
