"""The reduce and record stages of a :class:`~dpcore.torch.DPOptimizer`: how the clipped sums
of a logical batch become the noised release, recorded in the ledger before any update.

* :class:`Batch`: the logical batch being formed (per parameter, the clipped sums held so far,
  float32 or wider, and the records in them).
* :class:`Recorder`: the ledger writes of the releases (its own background thread).
* :class:`Transport`: the protocol of a transport, chosen once at construction
  (``dpcore.torch._optimizer.make_transport``): :class:`SingleProcess` here; data-parallel
  training and FSDP2 in :mod:`dpcore.torch._parallel`. The optimizer calls, per (micro-)batch::

      check_captured()                      before the records are clipped
      clip_failed(step, error, releasing)   this rank could not clip: tell the other ranks
      hold(step, b, factors)                a micro-batch that does not release
      release(step, b, factors)             plans, sums, noise, the durable ledger entry
      set_grads()                           the released average becomes each ``.grad``
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .. import _trace
from ..ledger import PrivacyLedger
from ._workers import Worker

__all__ = ["Batch", "Recorder", "Transport", "SingleProcess", "trace_presums", "trace_release"]


@torch.no_grad()
def trace_presums(batch: "Batch", b: int, factors: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """For the grey-box trace only (:mod:`dpcore._trace`): the release's pre-noise sums, per
    parameter in float64: the micro-batches held so far plus this one's clipped sums, formed by
    the same engine call as the release (keeping the factors for it), before any noise."""
    extra = batch.engine.clipped_sums(factors, clear=False) if b else [None] * len(batch.params)
    out = []
    for p, held, new in zip(batch.params, batch.acc, extra):
        s = torch.zeros(tuple(p.shape), dtype=torch.float64, device=p.device)
        for t in (held, new):
            if t is not None:
                s += t.double()
        out.append(s)
    return out


def trace_release(site: str, queries: Any, presums: List[torch.Tensor]) -> None:
    """The grey-box trace of a release: per query group its pre-noise sums and the sensitivity
    its plan declares, in the released units (the Gaussian and matrix-factorization mechanisms
    fold 1/denominator into the clip factors, so their sums are already divided)."""
    from ._clip import DIVIDED

    plans = queries.plans()
    parts = []
    for g, plan in zip(queries.groups, plans):
        div = plan.mechanism in DIVIDED
        sens = plan.l2_norm_clip * queries.factor / (plan.denominator if div else 1.0)
        parts.append(
            {"sums": [presums[k] for k in g.members], "sensitivity": sens, "scales": list(plan.part_scales), "divided": div}
        )
    _trace.release(
        site,
        parts,
        denominator=plans[0].denominator if plans else None,
        noise={"part_stddevs": [list(p.part_stddevs) for p in plans], "mechanism": [p.mechanism for p in plans]},
        event=queries.event(),
    )


class Batch:
    """The logical batch being formed: :attr:`acc` holds, per parameter, the sum of the clipped
    records of its micro-batches so far (None: nothing yet), :attr:`records` their count.
    :meth:`discard` drops it with the queries' norm states and the captured activations."""

    def __init__(self, engine: Any, params: List[torch.Tensor], queries: Any) -> None:
        self.engine, self.params, self.queries = engine, params, queries
        self.acc: List[Optional[torch.Tensor]] = [None] * len(params)
        self.records = 0
        #: Called by :meth:`discard` (a transport's own held state).
        self.on_discard: List[Callable[[], None]] = []

    @property
    def held(self) -> bool:
        """Whether records of an incomplete logical batch are held."""
        return bool(self.records) or any(a is not None for a in self.acc)

    @torch.no_grad()
    def accumulate(self, b: int, factors: List[Optional[torch.Tensor]]) -> None:
        """Adds this micro-batch's clipped records into the accumulators, in place. If that
        fails part-way, every accumulator is dropped: a half-added batch (or half-added noise)
        must never be released or added to again."""
        if b == 0:
            self.engine.clear()
            return
        try:
            sums = self.engine.clipped_sums(factors, into=self.acc)
        except BaseException:
            self.discard()
            raise
        self.acc = list(sums)

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def hold(self, b: int, factors: List[Optional[torch.Tensor]]) -> None:
        self.accumulate(b, factors)
        self.records += b
        self.clear_grads()

    def discard(self) -> None:
        self.acc = [None] * len(self.acc)
        for fn in self.on_discard:
            fn()
        self.records = 0
        self.queries.reset()
        self.engine.clear()


class Recorder:
    """The record stage: each release's entry in ``ledger`` (written and fsynced), on this
    stage's background thread (:meth:`start`) or on the calling one (:meth:`record`)."""

    def __init__(self, ledger: PrivacyLedger) -> None:
        self.ledger = ledger
        self._worker = Worker("ledger")

    def start(self, event: Any) -> Future:
        return self._worker.submit(self.ledger.record_release, event)

    def record(self, event: Any) -> None:
        self.ledger.record_release(event)


class Transport:
    """How a release's sums are reduced, noised and recorded (the protocol; see the module).
    ``noise`` (:class:`dpcore.torch._noise.NoiseSources`) is set by the optimizer once the
    noise sources exist (they depend on :attr:`noise_shapes` and :attr:`noise_rank`)."""

    #: What the transport is, in words.
    kind = "one process"
    #: Whether the ranks of torch.distributed take part.
    distributed = False

    def __init__(self, batch: Batch, queries: Any, recorder: Recorder, params: List[torch.Tensor], seed: Optional[int]) -> None:
        self.batch, self.queries, self.recorder, self.params, self.seed = batch, queries, recorder, params, seed
        self.noise: Any = None

    @property
    def noise_shapes(self) -> Optional[Sequence[Tuple[int, ...]]]:
        """Each parameter's noise shape on this process (None: the parameters' shapes)."""
        return None

    @property
    def noise_rank(self) -> Optional[int]:
        """The rank whose own generator noises this process's rows (None: not sharded)."""
        return None

    def check_captured(self) -> None:
        """Raises if a gradient reached a parameter without being captured per record."""

    def clip_failed(self, step: int, error: BaseException, releasing: bool) -> None:
        """This process failed to clip its records (``error`` is raised next): tells the
        ranks that meet it in the step's collectives. Nothing to do in one process."""

    def hold(self, step: int, b: int, factors: List[Optional[torch.Tensor]]) -> None:
        """A micro-batch that does not release: its clipped sums held for the release."""
        self.batch.hold(b, factors)

    def release(self, step: int, b: int, factors: List[Optional[torch.Tensor]]) -> None:
        """Release ``step`` from the held sums and this micro-batch's: plans, noise, reduction,
        and its ledger entry, durable on return. Raises if any of that failed."""
        raise NotImplementedError

    def _as_grad(self, k: int, gr: torch.Tensor) -> torch.Tensor:
        return gr

    def set_grads(self) -> None:
        """The released average (float32 or wider) becomes each parameter's ``.grad``, cast
        once to the parameter's dtype (bfloat16 or float16 parameters): post-processing."""
        for k, gr in enumerate(self.batch.acc):
            if gr is not None:
                p = self.params[k]
                gr = gr if gr.dtype == p.dtype else gr.to(p.dtype)
                p.grad = self._as_grad(k, gr)
        self.batch.acc = [None] * len(self.batch.acc)


class SingleProcess(Transport):
    """One process: the noise is added around the last micro-batch's sums, while the ledger
    entry is written on the recorder's thread (the disk's latency overlaps the clipped-sum
    products); it is waited for before any noised gradient can reach the model (McMahan et al.
    2018, §6). If the products fail after the write started, the entry stands (the ledger
    over-counts one release, the safe direction) and a correlated noise stream still advances."""

    @torch.no_grad()
    def release(self, step: int, b: int, factors: List[Optional[torch.Tensor]]) -> None:
        q, batch, noise = self.queries, self.batch, self.noise
        q.pending = q.noised_plans(q.norm_states(), self.seed, step)
        if _trace.active():
            _trace.branch("torch.step", "release", True)
            trace_release("torch.SingleProcess", q, trace_presums(batch, b, factors))
        write = self.recorder.start(q.event())
        noise.start(step, write)
        try:
            try:
                noise.before_sums(step, batch)
            except BaseException:
                batch.discard()
                raise
            batch.accumulate(b, factors)
            try:
                noise.after_sums(step, batch, write)
            except BaseException:
                batch.discard()
                raise
        except BaseException:
            q.pending = None
            write.result()  # the entry stands (over-counting is the safe side); surface the error
            noise.abort(step)  # ... and a noise stream advances with it
            raise
        # Durable before the noised gradient can reach the model (McMahan et al. 2018, §6).
        write.result()
        if _trace.active():  # a grey-box neighbour run releases the first run's values
            _trace.output_tensors("torch.SingleProcess", batch.acc)

    @torch.no_grad()
    def set_grads(self) -> None:
        super().set_grads()

