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

The privacy unit "user" (:class:`~dpcore.sampling.UserIndex`, one id per row of the training set):
under user-level sampling (``examples_per_user`` k) the Poisson sample draws *users* at
q = per_device_train_batch_size × gradient_accumulation_steps / U, each sampled user gives at most
k of its rows (ChaCha20, :meth:`UserIndex.choose`), the rows come user-major and a micro-batch
holds whole users only; each micro-batch's :attr:`BatchTag.groups` gives its users' row counts,
which the trainer hands to the DP optimizer as ``record_groups`` (each user's mean gradient is
clipped as one record). Under example-level sampling with a user-level guarantee
(``max_examples_per_user`` K) each user is bounded once to at most K rows
(:meth:`UserIndex.bound`) and the kept rows are Poisson sampled as records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from ..sampling import sampler_class
from ..ledger import PrivacyLedger
from .._seeds import derive_seed
from ..mechanism import gaussian_noise
from ..sampling import UserIndex, padded_size, physical_chunks, poisson_sample
from ..torch._data import empty_batch

__all__ = ["BatchTag", "DPRun", "TrainerBatches", "TAG"]

#: The key under which each micro-batch carries its :class:`BatchTag` (removed by the trainer
#: before the batch reaches the model).
TAG = "_dpcore_batch"

_CHOOSE_PATH = 0x05E5  # derive_seed path of a seeded run's choice of each sampled user's rows
_BOUND_PATH = 0xB0  # derive_seed path of a seeded run's bound of each user's rows (ELS)


@dataclass(frozen=True)
class BatchTag:
    """Where a micro-batch sits: logical batch ``serial`` (counted from the start of the run),
    micro-batch ``chunk`` of ``chunks``, ``records`` rows (examples) of the logical batch's
    ``size``. ``groups``: under user-level sampling, the row count of each user in the
    micro-batch, user-major (they sum to ``records``); None when a record is a row. ``rows``:
    padded micro-batches (``pad_batches``), the rows of the batch, its ``records`` real ones
    first; None when every row is a record."""

    serial: int
    chunk: int
    chunks: int
    records: int
    size: int
    groups: Optional[Tuple[int, ...]] = None
    rows: Optional[int] = None


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
        users: Optional[UserIndex] = None,
        examples_per_user: Optional[int] = None,
        max_examples_per_user: Optional[int] = None,
    ) -> None:
        self.ledger: PrivacyLedger = ledger  # type: ignore[assignment]
        #: the rows of train_dataset
        self.rows = int(population_size)
        #: the privacy unit "user": each row's user (None: a record is a row)
        self.users = users
        self.examples_per_user = examples_per_user
        self.max_examples_per_user = max_examples_per_user
        #: ELS: the rows kept after bounding each user to max_examples_per_user (sorted)
        self.kept: Optional[np.ndarray] = None
        #: ULS: each user's row count in the micro-batch being trained on (user-major), set by
        #: the trainer from its :class:`BatchTag`; read by the DPOptimizer (loader protocol)
        self.record_groups: Optional[np.ndarray] = None
        #: padded micro-batches: the rows each is padded to (None: no padding), and the real
        #: records of the micro-batch being trained on (read by the DPOptimizer: loader protocol)
        self.pad_rows: Optional[int] = None
        self.record_mask: Optional[np.ndarray] = None
        if users is not None:
            if users.num_examples != self.rows:
                raise ValueError(f"the user ids cover {users.num_examples} rows but train_dataset has {self.rows}")
            if (examples_per_user is None) == (max_examples_per_user is None):
                raise ValueError("the privacy unit 'user' needs exactly one of examples_per_user and max_examples_per_user")
            if examples_per_user is not None:
                population_size = users.num_users
            else:
                self.kept = users.bound(int(max_examples_per_user), seed=derive_seed(seed, _BOUND_PATH))  # type: ignore[arg-type]
                population_size = len(self.kept)
        elif examples_per_user is not None or max_examples_per_user is not None:
            raise ValueError("examples_per_user and max_examples_per_user need the privacy unit 'user'")
        #: the records the sampler draws from: rows (example), users (ULS), kept rows (ELS)
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

    def pad_to(self, pad: Any) -> None:
        """Padded micro-batches (``pad_batches``): ``True`` pads each to the expected micro-batch
        plus four standard deviations of a Poisson sample's size, rounded up to a multiple of 8
        (a micro-batch above it, about 3e-5 of them, is padded to its own multiple of 8), an int
        to that many rows."""
        if pad is False:
            self.pad_rows = None
            return
        if pad is True:
            m = self.logical_batch_size
            spread = 4.0 * math.sqrt(m) if self.poisson else 0.0
            self.pad_rows = padded_size(math.ceil((m + spread) / self.accumulation), 8)
        else:
            self.pad_rows = int(pad)

    @property
    def expected_batch_size(self) -> float:
        """The release's denominator: q·n (Poisson), the nominal batch size (shuffle)."""
        return float(self.logical_batch_size)

    @property
    def policy(self) -> str:
        return "poisson" if self.poisson else "shuffle"

    @property
    def privacy_unit(self) -> str:
        """``"user"`` or ``"example"``: what one record of the ledger is."""
        return "example" if self.users is None else "user"

    @property
    def user_level_sampling(self) -> bool:
        """Whether the sampler draws users (ULS: ``examples_per_user``)."""
        return self.users is not None and self.examples_per_user is not None

    @property
    def bounds(self) -> Dict[str, int]:
        """The contribution bound each sample is recorded with (privacy unit "user"; else none)."""
        if self.users is None:
            return {}
        if self.examples_per_user is not None:
            return {"examples_per_user": int(self.examples_per_user)}
        return {"max_examples_per_user": int(self.max_examples_per_user)}  # type: ignore[arg-type]

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
                self.ledger.record_sample(self.population, self.sampling_probability, "poisson", seeded=self.seed is not None,
                                          **self.bounds)
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
        self.record_groups = None

    def abandon(self) -> None:
        """Forgets a logical batch whose training failed (nothing was released from it)."""
        self._current = None
        self.record_groups = None

    def set_groups(self, tag: BatchTag) -> None:
        """The row counts of the users of the micro-batch ``tag`` is about to be trained on, for
        the DP optimizer's clip (``record_groups``); checked against the privacy unit. With
        padded micro-batches, which rows are records (``record_mask``)."""
        if tag.rows is not None and (self.pad_rows is None or tag.rows < tag.records):
            raise RuntimeError("a padded micro-batch reached a DP trainer that does not pad its batches")
        self.record_mask = None if tag.rows is None else np.arange(tag.rows) < tag.records
        if not self.user_level_sampling:
            if tag.groups is not None:
                raise RuntimeError("a micro-batch grouped by user reached a DP trainer whose record is one row")
            self.record_groups = None
            return
        groups = None if tag.groups is None else np.asarray(tag.groups, dtype=np.int64).reshape(-1)
        if groups is None or int(groups.sum()) != tag.records or (groups.size and int(groups.min()) < 1):
            raise RuntimeError(
                f"micro-batch {tag.chunk} of logical batch {tag.serial} does not say which of its {tag.records} rows "
                "belong to which user: with privacy_unit='user' every batch must come from the DP trainer's loader"
            )
        self.record_groups = groups

    def unit_state(self) -> Dict[str, Any]:
        """The privacy unit as a checkpoint states it: the unit, the users' fingerprint
        (:attr:`UserIndex.fingerprint`) and the contribution bounds."""
        return {
            "privacy_unit": self.privacy_unit,
            "users": None if self.users is None else self.users.fingerprint,
            "examples_per_user": self.examples_per_user,
            "max_examples_per_user": self.max_examples_per_user,
        }

    def check_unit_state(self, state: Mapping[str, Any], where: str) -> None:
        """Refuses (ValueError) a checkpoint taken with another privacy unit, other user ids or
        other contribution bounds (a state without them is an example-level run's)."""
        saved = state.get("privacy_unit", "example")
        if saved != self.privacy_unit:
            raise ValueError(
                f"{where} was saved by a run whose privacy unit is {saved!r}, but this trainer's is "
                f"{self.privacy_unit!r}: a run resumes with its own unit"
            )
        if self.users is None:
            return
        if state.get("users") != self.users.fingerprint:
            raise ValueError(
                f"{where} was saved with other user ids than this trainer's user_id_column holds (fingerprint "
                f"{state.get('users')!r}, now {self.users.fingerprint!r}): a user-level run resumes only over the "
                "same users, each with the same rows"
            )
        for key in ("examples_per_user", "max_examples_per_user"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"{where} was saved with {key}={state.get(key)!r}; this trainer has {getattr(self, key)!r}")

    def state_dict(self) -> Dict[str, Any]:
        return {"samples_drawn": self.samples_drawn, **self.unit_state()}

    def check_state_dict(self, state: Any) -> None:
        if isinstance(state, Mapping):
            self.check_unit_state(state, "the DP optimizer's checkpoint")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.check_state_dict(state)
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

    def _indices(self, serial: int, epoch: int, k: int) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
        """The rows of logical batch ``serial``; under user-level sampling (the rows user-major,
        each sampled user's row count)."""
        run = self.run
        if run.poisson:
            idx = poisson_sample(run.n, run.sampling_probability, seed=derive_seed(run.seed, serial))
            if run.kept is not None:  # ELS: a sample of the rows kept per user
                return run.kept[idx]
            if run.users is not None:  # ULS: a sample of users, at most k rows each
                return run.users.choose(idx, run.examples_per_user, seed=derive_seed(run.seed, _CHOOSE_PATH), draw=serial)
            return idx
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
            got = self._indices(serial, epoch, k)
            if isinstance(got, tuple):  # user-level sampling: whole users per micro-batch
                idx, counts = got
                ends = np.cumsum(counts)
                cuts = [0, *(int(np.searchsorted(ends, len(idx) * j / ga, side="right")) for j in range(1, ga)),
                        len(counts)]
                for c in range(ga):
                    lo, hi = cuts[c], max(cuts[c], cuts[c + 1])
                    a = int(ends[lo - 1]) if lo > 0 else 0
                    b = int(ends[hi - 1]) if hi > 0 else 0
                    part = idx[a:b]
                    batch = self._fetch(part)
                    batch[TAG] = BatchTag(serial, c, ga, len(part), len(idx), tuple(int(x) for x in counts[lo:hi]))
                    yield batch
                continue
            for c, part in enumerate(np.array_split(got, ga)):
                if run.pad_rows is None:
                    batch = self._fetch(part)
                    batch[TAG] = BatchTag(serial, c, ga, len(part), len(got))
                else:
                    # static shapes: the real rows first, then copies of the first (of row 0 for an
                    # empty micro-batch), whose clip factor is 0; a micro-batch above the size
                    # (rare) is padded to the next multiple of 8, never cut
                    rows = run.pad_rows if len(part) <= run.pad_rows else padded_size(len(part), 8)
                    (padded, real), = physical_chunks(part, rows, fill=int(part[0]) if len(part) else 0)
                    batch = self._fetch(padded)
                    batch[TAG] = BatchTag(serial, c, ga, real, len(got), rows=rows)
                yield batch
