"""The transports of data-parallel training and FSDP2 (see :mod:`dpcore.torch._distributed` for
the mechanism cut across the ranks, and :mod:`dpcore.torch._transport` for the protocol).

* :class:`DataParallel`: the queries' plans from the norm states of all ranks, decided on rank 0;
  this rank's clipped sums (and on rank 0 the noise) accumulated into flat buffers; one
  all-reduce; rank 0 records the release durably and tells the others, and only then does any
  rank apply it.
* :class:`Sharded` (FSDP2): every micro-batch's sums reduce-scattered at once, with this rank's
  own rows' noise; the same failure count, ledger and commit message.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._amp import work_dtype
from ._distributed import DistributedError, ShardLayout, flat_views
from ._loader import LoaderView
from .. import _trace
from ._transport import Batch, Recorder, Transport, trace_presums, trace_release

__all__ = ["DataParallel", "Sharded"]


def _raise_failures(step: int, failures: int) -> None:
    if failures:
        raise DistributedError(
            f"step {step}: {failures} rank(s) failed before the reduction of the clipped sums (see their errors); "
            "nothing was released or recorded"
        )


class DataParallel(Transport):
    """Data-parallel training over ``comm``: the ranks start from rank 0's parameters (``model``
    broadcast at construction); a release's sums are all-reduced once, with rank 0's noise."""

    kind = "data-parallel"
    distributed = True

    def __init__(
        self, comm: Any, model: Optional[torch.nn.Module], batch: Batch, queries: Any, recorder: Recorder,
        params: List[torch.Tensor], seed: Optional[int],
    ) -> None:
        super().__init__(batch, queries, recorder, params, seed)
        self.comm = comm
        if model is not None:
            comm.broadcast_module(model)  # the ranks start from rank 0's parameters

    def clip_failed(self, step: int, error: BaseException, releasing: bool) -> None:
        # The other ranks are about to meet this one in the step's collectives: tell them, so
        # that every rank fails now instead of waiting for the process group's timeout.
        if releasing:
            self.release(step, 0, [], failed=error)

    def _shared_plans(self, step: int, failed: Optional[BaseException]) -> Any:
        """Plans that depend on the records (adaptive clipping's count is a sum over all ranks'
        records, its noise drawn by rank 0 alone): made on rank 0 from every rank's norm
        state and sent to all. A rank that failed says so here, and every rank stops."""
        comm, q = self.comm, self.queries
        why = None if failed is None else f"{type(failed).__name__}: {failed}"
        gathered = comm.gather((why, q.norm_states()), f"step {step}: gathering the queries' norm states")
        if failed is not None:
            self.batch.discard()
            return None
        bad = [(r, w) for r, (w, _) in enumerate(gathered) if w is not None]
        if bad:
            raise DistributedError(f"step {step}: rank {bad[0][0]} failed ({bad[0][1]}); nothing was released or recorded")
        merged: Any = None
        if comm.is_root:
            merged = gathered[0][1]
            for _, other in gathered[1:]:
                merged = q.merge_norm_states(merged, other)
        plans = q.noised_plans(merged, self.seed, step) if comm.is_root else None
        return comm.share(plans, f"step {step}: sharing the release plans")

    def release(  # type: ignore[override]
        self, step: int, b: int, factors: List[Optional[torch.Tensor]], failed: Optional[BaseException] = None
    ) -> None:
        """With ``failed``: this rank's own error, told to the others (the caller raises it)."""
        q = self.queries
        local = q.local
        try:
            if local:
                # Fixed clipping: every rank computes the same plans from the same global state.
                # A rank that failed says so in the reduction itself (a count after the sums).
                q.pending = q.noised_plans(q.norm_states(), self.seed, step)
            else:
                q.pending = self._shared_plans(step, failed)
                if failed is not None:
                    return  # the caller raises this rank's own error
            if not self._reduce(step, b, factors, failed, local):
                return
        except BaseException:
            self.batch.discard()
            raise
        self._record(step)
        if _trace.active():  # a grey-box neighbour run releases the first run's values
            _trace.output_tensors(f"torch.{type(self).__name__}", self.batch.acc)

    def _reduce(
        self, step: int, b: int, factors: List[Optional[torch.Tensor]], failed: Optional[BaseException], local: bool
    ) -> bool:
        """The held sums, this micro-batch's and (rank 0) the noise in flat buffers, all-reduced.
        False when this rank failed (after telling the others)."""
        comm, batch = self.comm, self.batch
        bufs, views = flat_views(self.params, flag=local)
        if failed is None:
            # earlier micro-batches of this logical batch into the buffers' views, which become
            # the accumulators
            for k, acc in enumerate(batch.acc):
                if acc is not None:
                    views[k].add_(acc.to(device=views[k].device, dtype=views[k].dtype))
            batch.acc = list(views)
            if _trace.active():  # the grey-box trace: every rank's pre-noise sums, summed (trace only)
                pres = trace_presums(batch, b, factors)
                comm.sum_(pres, f"step {step}: all-reduce of the traced pre-noise sums")
                trace_release(f"torch.{type(self).__name__}", self.queries, pres)
            if comm.is_root:
                self.noise.before_sums(step, batch)  # the release's noise, once, from rank 0's generator
            batch.accumulate(b, factors)  # in place into the views
        elif local:
            bufs[0][-1] = 1
        comm.sum_(bufs, f"step {step}: all-reduce of the clipped sums")
        if local:
            failures = int(bufs[0][-1].item())
            if failed is not None:
                batch.discard()
                return False
            _raise_failures(step, failures)
        return True

    def _record(self, step: int) -> None:
        """Rank 0 records the release durably and tells the others; the others wait for it and
        keep their replica; a rank that cannot learn the outcome applies nothing."""
        comm, batch = self.comm, self.batch
        device = self.params[0].device
        if comm.is_root:
            try:
                self.recorder.record(self.queries.event())
            except BaseException:
                batch.discard()
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
                batch.discard()
                raise
            if not ok:
                batch.discard()
                raise DistributedError(f"step {step}: rank 0 could not record the release in the ledger; nothing applied")
            self.recorder.record(self.queries.event())  # the replica


class Sharded(DataParallel):
    """FSDP2 (``fully_shard``, one-dimensional mesh): each rank holds rows of every parameter
    (:class:`ShardLayout`); every micro-batch's full-shape sums are reduce-scattered onto the
    rows held, so that between micro-batches a rank holds only its shard of the sums; this
    rank's own rows get their noise from its own generator."""

    kind = "FSDP2"

    def __init__(
        self, comm: Any, batch: Batch, queries: Any, recorder: Recorder, params: List[torch.Tensor],
        seed: Optional[int], loader: Any,
    ) -> None:
        super().__init__(comm, None, batch, queries, recorder, params, seed)
        #: Where this rank's rows of each parameter sit.
        self.layouts = [ShardLayout(p, comm) for p in params]
        if loader is not None:
            LoaderView(loader).use_equal_micro_batches()  # see physical_batches
        # The sharded gradients this transport set last (any other one FSDP2 reduced was not
        # captured per record).
        self._given: Dict[int, int] = {}
        # With micro-batches: the noise stddevs this rank's rows got with the logical batch's
        # first micro-batch (None: not noised yet).
        self._shard_noise: Optional[List[List[Optional[float]]]] = None
        batch.on_discard.append(self._forget_noise)
        #: The grey-box trace only: this rank's full-shape pre-noise sums of the logical batch.
        self._trace_sums: Optional[List[torch.Tensor]] = None

    def _forget_noise(self) -> None:
        self._shard_noise = None
        self._trace_sums = None

    @property
    def noise_shapes(self) -> Optional[Sequence[Tuple[int, ...]]]:
        return [lay.local_shape for lay in self.layouts]

    @property
    def noise_rank(self) -> Optional[int]:
        return self.comm.rank

    def check_captured(self) -> None:
        """A gradient that reached a shard by FSDP2's own reduce-scatter was not captured per
        record (a parameter used outside its module's forward): refuse the step."""
        for k, p in enumerate(self.params):
            if p.grad is not None and id(p.grad) != self._given.get(k):
                raise RuntimeError(
                    f"parameter {self.batch.engine.param_names[k]!r} received a gradient that dpcore.torch did not "
                    "capture per record (FSDP2 reduced it): some code used it outside its module's forward. Register a "
                    "rule for the module that uses it (dpcore.torch.register_layer), or freeze it; nothing was released"
                )

    def clip_failed(self, step: int, error: BaseException, releasing: bool) -> None:
        # Under FSDP2 every micro-batch has collectives, not only the releasing one.
        if releasing:
            self.release(step, 0, [], failed=error)
        else:
            self.hold(step, 0, [], failed=error)

    def hold(  # type: ignore[override]
        self, step: int, b: int, factors: List[Optional[torch.Tensor]], failed: Optional[BaseException] = None
    ) -> None:
        """A micro-batch that does not release: its sums reduce-scattered at once onto the rows
        held (the first one with this rank's own rows' noise). A rank that failed tells the
        others, and every rank drops the logical batch."""
        comm, batch = self.comm, self.batch
        try:
            failures = comm.count(failed is not None, self.params[0].device, f"step {step}: counting failed ranks")
            if failed is not None:
                batch.discard()
                return
            _raise_failures(step, failures)
            if _trace.active():
                self._trace_add(b, factors)
            if self._shard_noise is None:
                sds = self.noise.gaussian.stddevs()
                self._scatter_sums(step, b, factors, sds)
                self._shard_noise = sds
            else:
                self._scatter_sums(step, b, factors, None)
        except BaseException:
            batch.discard()
            raise
        batch.records += b
        batch.clear_grads()

    def _reduce(
        self, step: int, b: int, factors: List[Optional[torch.Tensor]], failed: Optional[BaseException], local: bool
    ) -> bool:
        """After the failure count, this micro-batch's sums reduce-scattered onto the rows held
        from the logical batch's earlier micro-batches, with this rank's own rows' noise (added
        with the first micro-batch, or now). The accumulators are then this rank's rows of the
        noised average. False when this rank failed (after telling the others)."""
        comm = self.comm
        if local:
            failures = comm.count(failed is not None, self.params[0].device, f"step {step}: counting failed ranks")
            if failed is not None:
                self.batch.discard()
                return False
            _raise_failures(step, failures)
        sds = self.noise.gaussian.stddevs()
        tracing = _trace.active()
        if tracing:  # this micro-batch's part, before the scatter below clears the factors
            self._trace_add(b, factors)
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
        if tracing:  # every rank's pre-noise sums, summed (trace only)
            pres, self._trace_sums = self._trace_sums, None
            comm.sum_(pres, f"step {step}: all-reduce of the traced pre-noise sums")
            trace_release("torch.Sharded", self.queries, pres)
        return True

    def _trace_add(self, b: int, factors: List[Optional[torch.Tensor]]) -> None:
        """The grey-box trace only: this micro-batch's clipped sums added to :attr:`_trace_sums`
        (full-shape float64 zeros at the logical batch's first micro-batch)."""
        if self._trace_sums is None:
            self._trace_sums = [
                torch.zeros(lay.shape, dtype=torch.float64, device=p.device) for lay, p in zip(self.layouts, self.params)
            ]
        if b == 0:
            return
        into: List[Optional[torch.Tensor]] = list(self._trace_sums or [])
        self.batch.engine.clipped_sums(factors, into=into, clear=False)

    def _scatter_sums(
        self, step: int, b: int, factors: List[Optional[torch.Tensor]], sds: Optional[List[List[Optional[float]]]],
        top_up: bool = False,
    ) -> None:
        """One parameter at a time (no rank ever holds full-size sums of every parameter): the
        parameter's clipped sum over this rank's records in full shape, plus noise of stddevs
        ``sds`` on this rank's own rows only (None: no noise), one reduce-scatter, added onto the
        rows held in the accumulators."""
        comm, batch, gaussian = self.comm, self.batch, self.noise.gaussian
        engine = batch.engine
        noise: Dict[int, torch.Tensor] = {}
        if sds is not None:
            drawn = gaussian.draw(step + (1 << 40), sds) if top_up else gaussian.noise(step)
            for g, row in zip(self.queries.groups, drawn):
                for k, z in zip(g.members, row):
                    if z is not None:
                        noise[k] = z
        m = len(self.params)
        held, batch.acc = batch.acc, [None] * m
        outs: List[Optional[torch.Tensor]] = []
        for k, (lay, p) in enumerate(zip(self.layouts, self.params)):
            pad = lay.padded(work_dtype(p.dtype), p.device)
            full = pad[: lay.shape[0]]
            z = noise.pop(k, None)
            if z is not None and lay.rows:  # this rank's rows only, from its own generator
                full.narrow(0, lay.start, lay.rows).add_(z.to(device=full.device, dtype=full.dtype))
            if b > 0 and factors[k] is not None:
                into: List[Optional[torch.Tensor]] = [None] * m
                into[k] = full
                engine.clipped_sums(factors, into=into, only=k, clear=False)
            out = torch.empty((lay.block,) + lay.shape[1:], dtype=pad.dtype, device=pad.device)
            comm.reduce_scatter_([out], [pad], f"step {step}: reduce-scatter of the clipped sums")
            del pad, full
            mine, h = out[: lay.rows], held[k]
            if h is not None:
                mine.add_(h)
                held[k] = None
            outs.append(mine)
        engine.clear()
        batch.acc = outs

    def _as_grad(self, k: int, gr: torch.Tensor) -> torch.Tensor:
        gr = self.layouts[k].grad(gr)
        self._given[k] = id(gr)
        return gr
