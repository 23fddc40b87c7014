"""The DP Trainer's training batches: one sample per optimizer step, cut into micro-batches.

Every *logical batch* (one optimizer step, one release) is one Poisson sample of the training
set at q = per_device_train_batch_size × gradient_accumulation_steps / n, drawn by dpcore's
ChaCha20 sampler (:func:`dpcore.poisson_sample`); it is cut into ``gradient_accumulation_steps``
near-equal micro-batches (a Poisson sample varies in size, so a micro-batch may be empty), which
the Trainer feeds to ``training_step`` one by one before calling ``optimizer.step()``.

Each micro-batch carries a :class:`BatchTag`. The sample is recorded in the privacy ledger when
the trainer *consumes* the logical batch's first micro-batch, not when the loader draws it: a
loader or wrapper that fetches ahead can then never attach the current release to the next
sample. The trainer checks the tags (every micro-batch of a logical batch, in order, before its
release; no logical batch begun before the previous one was released).

The position is the trainer's global step: a resumed run continues in the epoch where it
stopped, without drawing (or recording) a sample for the steps it skips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from ..sampling import sampler_class
from ..ledger import PrivacyLedger
from .._seeds import derive_seed
from ..mechanism import gaussian_noise
from ..sampling import poisson_sample
from ..torch._data import empty_batch

__all__ = ["BatchTag", "DPRun", "TrainerBatches", "TAG"]

#: The key under which each micro-batch carries its :class:`BatchTag` (removed by the trainer
#: before the batch reaches the model).
TAG = "_dpcore_batch"


@dataclass(frozen=True)
class BatchTag:
    """Where a micro-batch sits: logical batch ``serial`` (counted from the start of the run),
    micro-batch ``chunk`` of ``chunks``, ``records`` records of the logical batch's ``size``."""

    serial: int
    chunk: int
    chunks: int
    records: int
    size: int


class DPRun:
    """The sampling plan and bookkeeping of one DP training run.

    It also serves as the DPOptimizer's ``data_loader``: :attr:`samples_drawn` counts the samples
    recorded so far (the optimizer refuses to release twice on one sample), and
    :attr:`logical_batch_complete` is always True because the trainer calls
    ``accumulate()`` after each micro-batch itself and ``step()`` once per logical batch."""

    logical_batch_complete = True

    def __init__(
        self,
        *,
        ledger: Optional[PrivacyLedger],
        population_size: int,
        batch_size: int,
        accumulation: int,
        poisson: bool,
        seed: Optional[int],
        declared_population: Optional[int] = None,
    ) -> None:
        self.ledger: PrivacyLedger = ledger  # type: ignore[assignment]
        #: the records of train_dataset (what the sampler draws from)
        self.n = int(population_size)
        #: N, the public population size q and the denominator are stated for (declared with
        #: population_size=, else len(train_dataset), assumed public)
        self.population = self.n if declared_population is None else int(declared_population)
        self.batch_size = int(batch_size)
        self.accumulation = int(accumulation)
        self.logical_batch_size = self.batch_size * self.accumulation
        self.poisson = bool(poisson)
        self.seed = seed
        self.sampling_probability = self.logical_batch_size / self.population
        self.sampler = "poisson" if self.poisson else "shuffle"
        # the plan's epoch (dpcore.plan.steps_for_epochs): round(1/q) Poisson steps, ⌈n/b⌉ batches
        self.steps_per_epoch = sampler_class(self.sampler).epoch_length(min(1.0, self.sampling_probability))
        self.samples_drawn = 0
        self._current: Optional[List[int]] = None  # [serial, micro-batches seen, chunks, size]
        #: Shuffled batches: (the epoch's round in the ledger, the epoch) of the permutation being
        #: trained on; None when an iteration starts (a resumed epoch draws a new permutation).
        self._epoch_round: Optional[Tuple[int, int]] = None
        # Set by the trainer: the mechanism, the δ of the logged ε, the per-record loss.
        self.noise_multiplier = float("nan")
        self.max_grad_norm: Any = None
        self.clipping = "flat"
        self.joint_scales: Optional[Tuple[float, ...]] = None
        self.noise_mechanism = "gaussian"
        self.planned_steps = 0
        self.delta = float("nan")
        self.accountant = "pld"
        self.ledger_ahead = "refuse"
        self.loss_fn: Optional[Callable[[Any, Dict[str, Any]], Any]] = None
        self.eps_cache: Any = (None, 0.0)
        self.warned: set = set()  # kinds of ledger warning already shown by the ε logging

    @property
    def expected_batch_size(self) -> float:
        """The release's denominator: q·n (Poisson), the nominal batch size (shuffle)."""
        return float(self.logical_batch_size)

    @property
    def policy(self) -> str:
        return "poisson" if self.poisson else "shuffle"

    # -- the trainer's checks ------------------------------------------------------------------

    def begin(self, tag: Any) -> BatchTag:
        """A micro-batch is about to be trained on: records its logical batch's sample in the
        ledger if it is the first micro-batch, after checking the order."""
        if not isinstance(tag, BatchTag):
            raise RuntimeError(
                "this training batch does not come from the DP trainer's loader (was get_train_dataloader overridden, "
                "or the batch rebuilt by a collator wrapper?): every batch must be drawn by its Poisson sampler"
            )
        cur = self._current
        if tag.chunk == 0:
            if cur is not None:
                raise RuntimeError(
                    f"logical batch {tag.serial} began before logical batch {cur[0]} was released (optimizer.step() "
                    "must be called once after every gradient_accumulation_steps micro-batches)"
                )
            if self.poisson:
                self.ledger.record_sample(self.population, self.sampling_probability, "poisson", seeded=self.seed is not None)
            else:
                # q = L/n for information only: a shuffled batch gets no amplification. Each batch
                # carries its epoch (one permutation) as a round: one query per epoch under zero-out.
                epoch, k = divmod(tag.serial, self.steps_per_epoch)
                if self._epoch_round is None or self._epoch_round[1] != epoch:
                    self._epoch_round = (self.ledger.next_round, epoch)
                self.ledger.record_sample(self.n, self.sampling_probability, "shuffle",
                                          sample_size=min(self.logical_batch_size, self.n), round=self._epoch_round[0],
                                          step_in_round=k, round_steps=self.steps_per_epoch, round_selected=1)
            self.samples_drawn += 1
            self._current = [tag.serial, 1, tag.chunks, tag.size]
        else:
            if cur is None or cur[0] != tag.serial or cur[1] != tag.chunk:
                raise RuntimeError(
                    f"micro-batch {tag.chunk} of logical batch {tag.serial} arrived out of order "
                    f"(expected {'the first micro-batch of a logical batch' if cur is None else f'micro-batch {cur[1]} of logical batch {cur[0]}'})"
                )
            cur[1] += 1
        return tag

    def before_release(self) -> None:
        cur = self._current
        if cur is None:
            raise RuntimeError("optimizer.step() without a logical batch: no sample was drawn since the last release")
        if cur[1] != cur[2]:
            raise RuntimeError(
                f"optimizer.step() after {cur[1]} of the {cur[2]} micro-batches of logical batch {cur[0]}: the release "
                "must cover the whole Poisson sample"
            )

    def after_release(self) -> None:
        self._current = None

    def abandon(self) -> None:
        """Forgets a logical batch whose training failed (nothing was released from it)."""
        self._current = None

    def state_dict(self) -> Dict[str, Any]:
        return {"samples_drawn": self.samples_drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.samples_drawn = int(state.get("samples_drawn", self.samples_drawn))


class TrainerBatches:
    """The training loader handed to the Trainer (never to ``accelerator.prepare``).

    ``len()`` is the number of micro-batches of one epoch (``steps_per_epoch ×
    gradient_accumulation_steps``), which is how the Trainer counts its steps; ``dataset`` is
    the training set. ``position()`` gives the number of logical batches already trained in
    this run (the trainer's global step) when an epoch's iteration starts."""

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[List[Any]], Any],
        run: DPRun,
        position: Callable[[], int],
    ) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.run = run
        self.batch_size = run.batch_size
        self._position = position
        self._perm: Optional[Tuple[int, np.ndarray]] = None

    def __len__(self) -> int:
        return self.run.steps_per_epoch * self.run.accumulation

    def _indices(self, serial: int, epoch: int, k: int) -> np.ndarray:
        run = self.run
        if run.poisson:
            return poisson_sample(run.n, run.sampling_probability, seed=derive_seed(run.seed, serial))
        # One permutation per epoch, from ChaCha20 keys (OS-keyed; derived from the test seed when
        # given). A resumed epoch draws a new one: a shuffled batch gets no amplification, so the
        # accounting does not depend on which permutation.
        if self._perm is None or self._perm[0] != epoch:
            keys = gaussian_noise((run.n,), 1.0, dtype=np.float64, seed=derive_seed(run.seed, epoch, 0x5F))
            self._perm = (epoch, np.argsort(keys, kind="stable"))
        perm = self._perm[1]
        b = run.logical_batch_size
        return np.sort(perm[k * b : (k + 1) * b])

    def _fetch(self, idx: np.ndarray) -> Dict[str, Any]:
        ds = self.dataset
        if len(idx) == 0:
            # an empty micro-batch with the right keys: collate one record, keep zero rows
            batch = empty_batch(self.collate_fn, ds[0])
        else:
            many = getattr(ds, "__getitems__", None)
            keys = [int(i) for i in idx]
            items = many(keys) if callable(many) else [ds[i] for i in keys]
            batch = self.collate_fn(items)
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"the data collator returned a {type(batch).__name__}; the DP trainer needs batches as dicts of "
                "tensors (the Hugging Face convention)"
            )
        return dict(batch)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        run = self.run
        spe, ga = run.steps_per_epoch, run.accumulation
        epoch, first = divmod(int(self._position()), spe)
        run._epoch_round = None  # a new iteration: a new permutation, so a new round
        for k in range(first, spe):
            serial = epoch * spe + k
            idx = self._indices(serial, epoch, k)
            for c, part in enumerate(np.array_split(idx, ga)):
                batch = self._fetch(part)
                batch[TAG] = BatchTag(serial, c, ga, len(part), len(idx))
                yield batch
