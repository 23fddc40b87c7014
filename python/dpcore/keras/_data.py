"""Poisson-sampled batches for ``model.fit`` from dpcore's ChaCha20 sampler (Abadi et al. 2016,
"lots"; McMahan et al. 2018, §5).

:class:`PoissonBatches` is a ``keras.utils.PyDataset``: batch ``i`` of an epoch is a fresh
Poisson sample (each of the n records joins independently with probability q, drawn by
:func:`dpcore.poisson_sample`), so batches vary in size and may be empty; an empty batch is
still yielded, because skipping it would reveal that no record was sampled.

The source does not write to the ledger itself. Keras reads batches ahead of training (it peeks
at the first batches to infer shapes, and prefetches), so a sample drawn here may be released
later or never; the DP train step of :class:`dpcore.keras.DPModel` records the sampling event
(n, q, ``poisson``) right before the release it belongs to. A sample that is drawn but never
released costs no privacy.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import numpy as np
import keras

from .._attrs import readonly
from .._validate import real as _real
from .._seeds import derive_seed
from ..sampling import poisson_sample
from ..sampling._users import UserIndex, check_examples_per_user

__all__ = [
    "PoissonBatches", "CyclicBatches", "SampledBatches", "TruncatedPoissonBatches", "BallsInBinsBatches",
    "RandomAllocationBatches", "UserPoissonBatches",
]


def _leading(name: str, tree: Any) -> int:
    leaves = keras.tree.flatten(tree)
    if not leaves:
        raise ValueError(f"{name} holds no array")
    sizes = set()
    for a in leaves:
        if np.ndim(a) < 1:
            raise ValueError(f"{name}: every array needs a leading record axis, got shape {np.shape(a)}")
        sizes.add(int(np.shape(a)[0]))
    if len(sizes) != 1:
        raise ValueError(f"{name}: arrays disagree on the number of records: {sorted(sizes)}")
    return sizes.pop()


def _records(x: Any, y: Any, sample_weight: Any) -> Any:
    """(x, y, sample_weight) as numpy nests with one leading record axis, and the record count."""
    x = keras.tree.map_structure(np.asarray, x)
    y = None if y is None else keras.tree.map_structure(np.asarray, y)
    sw = None if sample_weight is None else keras.tree.map_structure(np.asarray, sample_weight)
    n = _leading("x", x)
    for name, part in (("y", y), ("sample_weight", sw)):
        if part is not None and _leading(name, part) != n:
            raise ValueError(f"{name} has {_leading(name, part)} records but x has {n}")
    if n < 1:
        raise ValueError("x holds no record")
    return x, y, sw, n


def _rate_and_steps(n: int, sampling_probability: Any, expected_batch_size: Any, steps: Any, of: str) -> "tuple[float, int]":
    """q (from itself, or the expected batch over the n records) and the steps of a pass (default
    round(1/q)), checked. ``of``: what a record is, for the message (" of a user")."""
    if (sampling_probability is None) == (expected_batch_size is None):
        raise ValueError("give exactly one of sampling_probability and expected_batch_size"
                         + (" (expected users per step)" if of else ""))
    if sampling_probability is None:
        q = _real("expected_batch_size", expected_batch_size) / n
    else:
        q = _real("sampling_probability", sampling_probability)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"the sampling probability{of} must be in (0, 1], got {q}")
    if steps is None:
        steps = max(1, round(1.0 / q))
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    return q, int(steps)


class PoissonBatches(keras.utils.PyDataset):
    """``steps`` Poisson samples per epoch of ``(x, y[, sample_weight])`` at rate q.

    * ``x``, ``y``, ``sample_weight``: arrays (or dicts/lists of arrays) with n records each.
    * ``sampling_probability`` q, or ``expected_batch_size`` q·n.
    * ``steps``: batches per epoch (default round(1/q): one expected pass over the data).
    * ``seed``: tests only — a seeded sample is predictable, gives no amplification in truth,
      and is marked ``seeded`` in the ledger. Batch i then always gets the sample of
      ``derive_seed(seed, i)``, in every epoch: Keras reads batches ahead and calls the epoch
      hooks around its prefetching, so nothing else would make a seeded run reproducible.
    * ``workers``, ``use_multiprocessing``, ``max_queue_size``: as for any ``PyDataset``.
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        sampling_probability: Optional[float] = None,
        expected_batch_size: Optional[float] = None,
        steps: Optional[int] = None,
        seed: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._x, self._y, self._sw, n = _records(x, y, sample_weight)
        q, steps = _rate_and_steps(n, sampling_probability, expected_batch_size, steps, "")
        self._n, self._q, self._steps, self._seed = n, q, steps, seed
        derive_seed(seed, 0)  # validates the seed now rather than on the first batch

    population_size = readonly[int]("_n", "n, the number of examples sampled from.")
    sampling_probability = readonly[float]("_q", "q, each example's inclusion probability per batch.")

    @property
    def expected_batch_size(self) -> float:
        """q·n: the denominator of the fixed-denominator average (McMahan et al. 2018, §3)."""
        return self._q * self._n

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    def __len__(self) -> int:
        return self._steps

    def indices(self, index: int) -> np.ndarray:
        """The record indices of batch ``index``: a fresh Poisson sample on every call (seeded:
        the one sample that batch ``index`` always gets)."""
        if not 0 <= index < self._steps:
            raise IndexError(f"batch {index} out of range for {self._steps} steps")
        return poisson_sample(self._n, self._q, seed=derive_seed(self._seed, index))

    def __getitem__(self, index: int) -> Any:
        idx = self.indices(index)
        take = lambda a: a[idx]  # noqa: E731
        out = [keras.tree.map_structure(take, self._x)]
        if self._y is not None or self._sw is not None:
            out.append(None if self._y is None else keras.tree.map_structure(take, self._y))
        if self._sw is not None:
            out.append(keras.tree.map_structure(take, self._sw))
        return tuple(out)


class UserPoissonBatches(keras.utils.PyDataset):
    """User-level Poisson batches (ULS) of ``(x, y[, sample_weight])`` for a
    :class:`~dpcore.keras.DPModel` made with ``privacy_unit="user"`` and ``examples_per_user``
    (:meth:`DPModel.batches <dpcore.keras.DPModel.batches>` builds the one a model needs).

    Each step draws **users**: each of the U users (the distinct ``user_ids``, one id per
    example) joins independently with probability q (:func:`dpcore.poisson_sample` over the
    users), and each sampled user contributes at most ``examples_per_user`` k of its examples,
    chosen by ChaCha20 without replacement (all of them when it has fewer;
    :meth:`dpcore.sampling.UserIndex.choose`). The step's examples are user-major (the first
    sampled user's, then the second's...); :attr:`last_slots` gives each example's user slot
    (0..m-1 over the m users sampled) and :attr:`last_counts` each user's count, from which the
    DP train step forms each user's mean gradient and clips it as one record.

    * ``sampling_probability`` q (per user), or ``expected_batch_size`` q·U: the expected number
      of **users** per step, the fixed denominator of the average.
    * ``steps``: batches per epoch (default round(1/q): one expected pass over the users).
    * ``seed``: tests only (step t draws its users from ``derive_seed(seed, t)`` and its
      examples from ``seed`` and t); a seeded sample is predictable and marked ``seeded``.

    As with :class:`SampledBatches`, the DP train step draws each step itself (:meth:`draw`),
    right before its release, and records it in the model's ledger (U, q, ``poisson``,
    ``examples_per_user=k``); what Keras reads from this dataset is the record structure only
    (zero rows). A step with no user sampled is an empty batch, and still releases noise.
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        user_ids: Any,
        examples_per_user: int,
        sampling_probability: Optional[float] = None,
        expected_batch_size: Optional[float] = None,
        steps: Optional[int] = None,
        seed: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._x, self._y, self._sw, n = _records(x, y, sample_weight)
        if isinstance(user_ids, UserIndex):
            if user_ids.num_examples != n:
                raise ValueError(
                    f"user_ids has {user_ids.num_examples} ids but the dataset has {n} examples: give one id per example"
                )
            users = user_ids
        else:
            users = UserIndex(user_ids, num_examples=n)
        k = check_examples_per_user("examples_per_user", examples_per_user)
        q, steps = _rate_and_steps(users.num_users, sampling_probability, expected_batch_size, steps, " of a user")
        derive_seed(seed, 0)  # validates the seed now rather than on the first batch
        self._users: UserIndex = users
        self._k: int = k
        self._q: float = q
        self._steps: int = steps
        self._seed: Optional[int] = seed
        self._draws: int = 0
        self._in_fit: bool = False
        #: The example indices of the last step drawn (user-major), None before the first.
        self.last_indices: Optional[np.ndarray] = None
        #: The users (0..U-1) of the last step drawn, in the order of their examples.
        self.last_users: Optional[np.ndarray] = None
        #: The number of examples each of :attr:`last_users` contributes (1..k).
        self.last_counts: Optional[np.ndarray] = None
        #: The user slot (0..m-1) of each example of the last step drawn.
        self.last_slots: Optional[np.ndarray] = None

    users = readonly[UserIndex]("_users", "The :class:`~dpcore.sampling.UserIndex` of the user ids.")
    examples_per_user = readonly[int]("_k", "k: the most examples a sampled user contributes to a step.")
    sampling_probability = readonly[float]("_q", "q, each user's inclusion probability per step.")

    @property
    def population_size(self) -> int:
        """U, the number of users sampled from."""
        return self._users.num_users

    @property
    def num_examples(self) -> int:
        return self._users.num_examples

    @property
    def expected_batch_size(self) -> float:
        """q·U, the expected number of users per step: the fixed denominator of the average."""
        return self._q * self._users.num_users

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    def __len__(self) -> int:
        return self._steps

    def draw(self) -> Any:
        """The next step's ``(x, y[, sample_weight])``, user-major (see the class): the users by
        Poisson sampling, then at most k examples of each. Sets :attr:`last_slots` and
        :attr:`last_counts`. Records nothing (the train step does, right before its release)."""
        t = self._draws
        self._draws += 1
        users = poisson_sample(self._users.num_users, self._q, seed=derive_seed(self._seed, t))
        idx, counts = self._users.choose(users, self._k, seed=self._seed, draw=t)
        self.last_users, self.last_counts, self.last_indices = users, counts, idx
        self.last_slots = np.repeat(np.arange(len(users), dtype=np.int64), counts)
        return self._take(idx)

    def _take(self, idx: Any) -> Any:
        take = lambda a: a[idx]  # noqa: E731
        out = [keras.tree.map_structure(take, self._x)]
        if self._y is not None or self._sw is not None:
            out.append(None if self._y is None else keras.tree.map_structure(take, self._y))
        if self._sw is not None:
            out.append(keras.tree.map_structure(take, self._sw))
        return tuple(out)

    def __getitem__(self, index: int) -> Any:
        if not self._in_fit:
            raise TypeError(
                "UserPoissonBatches are drawn by dpcore's DPModel.fit at each release; they cannot be read as a dataset "
                "of their own (use arrays for evaluate and predict)"
            )
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for {len(self)} batches")
        return self._take(np.zeros(0, np.int64))  # the record structure only: see the class


class CyclicBatches(keras.utils.PyDataset):
    """Cyclic batches of ``(x, y[, sample_weight])`` for matrix-factorization noise
    (``DPModel(noise_mechanism=...)``): batch i of every epoch is batch (group) i of a partition
    cut once from a ChaCha20 shuffle (:class:`dpcore.sampling.CyclicBatches`; keyed from the
    OS, ``seed`` for tests only).

    * ``batch_size``: b = n // batch_size fixed batches of exactly ``batch_size`` records; the
      n mod batch_size records left over are never trained on (:attr:`dropped`).
    * ``participation``: a cyclic Poisson :class:`~dpcore.matrix_factorization.Participation`
      (b groups, probability p) instead: batch i samples group i (each record with probability
      p, fresh from the OS at every call; seeded: the same sample for batch i in every epoch).

    Like :class:`PoissonBatches` it writes nothing to the ledger: the DP train step records each
    sample right before its release. Every epoch must run all b batches in order (``fit``
    refuses ``steps_per_epoch`` other than b), so that release t trains on batch t mod b.
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        batch_size: Optional[int] = None,
        participation: Any = None,
        seed: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        from ..matrix_factorization._participation import Participation
        from ..sampling import CyclicPoissonSampler, CyclicSampler as _Fixed

        super().__init__(**kwargs)
        self._x, self._y, self._sw, n = _records(x, y, sample_weight)
        if participation is not None and not isinstance(participation, Participation):
            raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
        if participation is not None and participation.kind == "cyclic_poisson":
            if batch_size is not None:
                raise ValueError("batch_size has no role with cyclic Poisson sampling (the expected batch is p·n/b)")
            self._sampler: Any = CyclicPoissonSampler(
                n, participation.min_separation, participation.sampling_probability, seed=seed  # type: ignore[arg-type]
            )
        else:
            if batch_size is None:
                if participation is None:
                    raise TypeError("CyclicBatches needs batch_size (fixed batches) or a cyclic Poisson participation")
                batch_size = n // participation.min_separation if participation.min_separation <= n else n + 1
            self._sampler = _Fixed(n, batch_size, seed=seed)
            if participation is not None and participation.min_separation != self._sampler.steps_per_epoch:
                raise ValueError(
                    f"participation declares {participation.min_separation} batches per epoch, but {n} records in "
                    f"batches of {batch_size} make {self._sampler.steps_per_epoch}"
                )
        self._seed = seed

    @property
    def sampler(self) -> Any:
        """The :mod:`dpcore.sampling` sampler holding the partition."""
        return self._sampler

    @property
    def population_size(self) -> int:
        return self._sampler.population_size

    @property
    def participation(self) -> Any:
        return self._sampler.participation

    @property
    def policy(self) -> str:
        return self._sampler.kind

    @property
    def batch_size(self) -> Optional[int]:
        return getattr(self._sampler, "batch_size", None)

    @property
    def sampling_probability(self) -> float:
        return self._sampler.sampling_probability

    @property
    def expected_batch_size(self) -> float:
        return self._sampler.expected_batch_size

    @property
    def dropped(self) -> int:
        return int(getattr(self._sampler, "dropped", 0))

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    def __len__(self) -> int:
        return self._sampler.steps_per_epoch

    def indices(self, index: int) -> np.ndarray:
        """The record indices of batch ``index`` (group ``index`` of the partition)."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for {len(self)} batches")
        return self._sampler._indices(index)

    def __getitem__(self, index: int) -> Any:
        idx = self.indices(index)
        take = lambda a: a[idx]  # noqa: E731
        out = [keras.tree.map_structure(take, self._x)]
        if self._y is not None or self._sw is not None:
            out.append(None if self._y is None else keras.tree.map_structure(take, self._y))
        if self._sw is not None:
            out.append(keras.tree.map_structure(take, self._sw))
        return tuple(out)


class SampledBatches(keras.utils.PyDataset):
    """The batches of a :mod:`dpcore.sampling` sampler over ``(x, y[, sample_weight])``, for
    :meth:`DPModel.fit <dpcore.keras.DPModel.fit>` only: :class:`TruncatedPoissonBatches`,
    :class:`BallsInBinsBatches`, :class:`RandomAllocationBatches` (or
    :meth:`DPModel.batches <dpcore.keras.DPModel.batches>`, which builds the one a model
    was made for).

    Unlike :class:`PoissonBatches`, each batch is drawn by the DP train step itself, right before
    its release, from the sampler (ChaCha20 keyed from the OS; ``seed`` for tests only), which
    records it in the model's ledger with its own policy. Keras reads a ``PyDataset`` ahead of
    training, peeks at batches to infer shapes, and may reorder them (``shuffle``); an
    allocation round's steps must instead be released as the sampler draws them, every record
    in exactly k of the round's t steps, with the ledger's round boundaries where the sampler's
    are. What Keras reads from this dataset is therefore only the record structure (zero rows of
    every array); the records of each step come from :meth:`draw`. ``len()`` is the sampler's
    steps per epoch or round, so one Keras epoch is one balls-in-bins epoch or allocation round
    when ``fit`` starts at a round boundary (the sampler keeps its rounds across epochs and
    ``fit`` calls regardless). ``workers``, ``use_multiprocessing``, ``max_queue_size``: as for
    any ``PyDataset`` (the batches Keras reads are empty, so they cost nothing).

    The sampler is built without a ledger; :meth:`DPModel.fit` binds it to the model's ledger
    on first use (a dataset is bound to one ledger for good).
    """

    kind = ""

    def __init__(self, x: Any, y: Any, sample_weight: Any, args: dict, seed: Optional[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._x, self._y, self._sw, n = _records(x, y, sample_weight)
        self._n, self._args, self._seed = n, dict(args), seed
        self._sampler = self._build(None)
        self._ledger: Any = None
        self._in_fit = False
        #: The record indices of the last step drawn (sorted int64), None before the first.
        self.last_indices: Optional[np.ndarray] = None

    @classmethod
    def _sampler_class(cls) -> Any:
        from ..sampling import sampler_class

        return sampler_class(cls.kind)

    @classmethod
    def _probe(cls, n: int, args: dict) -> Any:
        """A sampler of this kind over n records (no data, no ledger): its rate and expected batch."""
        return cls._sampler_class()(n, *args.values())

    @classmethod
    def _with(cls, x: Any, y: Any, sample_weight: Any, args: dict, seed: Optional[int], **kwargs: Any) -> "SampledBatches":
        """The batches of the sampler with the constructor arguments ``args`` (after n)."""
        out = cls.__new__(cls)
        SampledBatches.__init__(out, x, y, sample_weight, args, seed, **kwargs)
        return out

    def _build(self, ledger: Any) -> Any:
        return self._sampler_class()(self._n, *self._args.values(), seed=self._seed, ledger=ledger)

    @property
    def sampler(self) -> Any:
        """The :mod:`dpcore.sampling` sampler that draws the batches."""
        return self._sampler

    @property
    def policy(self) -> str:
        return self._sampler.policy

    @property
    def population_size(self) -> int:
        return self._n

    @property
    def sampling_probability(self) -> float:
        """A record's inclusion rate per step: q, 1/b or k/t."""
        return float(self._sampler.sampling_probability)

    @property
    def expected_batch_size(self) -> float:
        """The sampler's expected batch: the fixed denominator of the average (McMahan et al.
        2018, §3) that the DPModel must divide by."""
        return float(self._sampler.expected_batch_size)

    @property
    def max_batch_size(self) -> Optional[int]:
        return self._sampler.max_batch_size

    @property
    def steps_per_epoch(self) -> int:
        return int(self._sampler.steps_per_epoch)

    @property
    def seeded(self) -> bool:
        return self._seed is not None

    @property
    def ledger(self) -> Any:
        """The ledger the sampler records in (None until a :meth:`DPModel.fit` binds it)."""
        return self._ledger

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _bind(self, ledger: Any) -> None:
        """Records the samples in ``ledger`` from now on (the first binding builds the sampler
        anew with it: nothing was drawn before); another ledger later is refused."""
        if self._ledger is None:
            self._sampler = self._build(ledger)  # nothing was drawn before: draw() needs a ledger
            self._ledger = ledger
        elif self._ledger is not ledger:
            raise ValueError(
                f"these batches record their samples in the ledger {self._ledger.path!r}, not this model's "
                f"({ledger.path!r}): make new batches for this model (model.batches(x, y))"
            )

    def _take(self, idx: Any) -> Any:
        take = lambda a: a[idx]  # noqa: E731
        out = [keras.tree.map_structure(take, self._x)]
        if self._y is not None or self._sw is not None:
            out.append(None if self._y is None else keras.tree.map_structure(take, self._y))
        if self._sw is not None:
            out.append(keras.tree.map_structure(take, self._sw))
        return tuple(out)

    def draw(self) -> Any:
        """The next step's ``(x, y[, sample_weight])``, drawn by the sampler and recorded in the
        bound ledger (the DP train step calls it right before the release)."""
        if self._ledger is None:
            raise RuntimeError("these batches are drawn by DPModel.fit's train step (no ledger is bound yet)")
        idx = self._sampler.draw()
        self.last_indices = idx
        return self._take(idx)

    def __getitem__(self, index: int) -> Any:
        if not self._in_fit:
            raise TypeError(
                f"{type(self).__name__} is drawn by dpcore's DPModel.fit at each release; it cannot be read as a "
                "dataset of its own (use arrays for evaluate and predict)"
            )
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for {len(self)} batches")
        return self._take(np.zeros(0, np.int64))  # the record structure only: see the class


class TruncatedPoissonBatches(SampledBatches):
    """Truncated Poisson batches (:class:`dpcore.sampling.TruncatedPoissonSampler`): each record
    with probability q, capped at ``max_batch_size`` B records (a uniformly random B when more are
    drawn); round(1/q) steps per epoch. ``sampling_probability`` q, or ``expected_batch_size``
    q·n. Accounted by PLD (``TruncatedPoissonSampledEvent``). See :class:`SampledBatches`."""

    kind = "truncated_poisson"

    def __init__(
        self, x: Any, y: Any = None, sample_weight: Any = None, *, sampling_probability: Optional[float] = None,
        expected_batch_size: Optional[float] = None, max_batch_size: Optional[int] = None, seed: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        from .. import _adapters

        n = _records(x, y, sample_weight)[3]
        if (sampling_probability is None) == (expected_batch_size is None):
            raise ValueError("give exactly one of sampling_probability and expected_batch_size")
        bs = _real("expected_batch_size", expected_batch_size) if sampling_probability is None else (
            _real("sampling_probability", sampling_probability) * n
        )
        args = _adapters.shape(self.kind, n, bs, max_batch_size=max_batch_size)
        super().__init__(x, y, sample_weight, args, seed, **kwargs)


class BallsInBinsBatches(SampledBatches):
    """Balls-in-bins batches (:class:`dpcore.sampling.BallsInBinsSampler`; Chua et al. 2025,
    arXiv 2412.16802): every epoch throws each record into one of ``num_batches`` b batches,
    uniformly and independently (or b = round(n/``batch_size``)). Accounted by RDP
    (``BallsInBinsSampledEvent``, one per epoch). See :class:`SampledBatches`."""

    kind = "balls_in_bins"

    def __init__(
        self, x: Any, y: Any = None, sample_weight: Any = None, *, num_batches: Optional[int] = None,
        batch_size: Optional[float] = None, seed: Optional[int] = None, **kwargs: Any,
    ) -> None:
        from .. import _adapters
        from .._validate import count

        n = _records(x, y, sample_weight)[3]
        if (num_batches is None) == (batch_size is None):
            raise ValueError("give exactly one of num_batches and batch_size")
        if num_batches is None:
            args = _adapters.shape(self.kind, n, _real("batch_size", batch_size))
        else:
            args = {"num_batches": count("num_batches", num_batches, 1)}
        super().__init__(x, y, sample_weight, args, seed, **kwargs)


class RandomAllocationBatches(SampledBatches):
    """Random-allocation batches (:class:`dpcore.sampling.RandomAllocationSampler`; Feldman &
    Shenfeld 2025, arXiv 2502.08202): in every round of ``num_steps`` t steps each record takes
    part in exactly ``num_selected`` k of them, a uniformly random k-subset (or t =
    round(n·k/``batch_size``)). Accounted by RDP (``RandomAllocationSampledEvent``, one per
    round; a round cut short counts whole). See :class:`SampledBatches`."""

    kind = "random_allocation"

    def __init__(
        self, x: Any, y: Any = None, sample_weight: Any = None, *, num_steps: Optional[int] = None,
        num_selected: int = 1, batch_size: Optional[float] = None, seed: Optional[int] = None, **kwargs: Any,
    ) -> None:
        from .. import _adapters
        from .._validate import count

        n = _records(x, y, sample_weight)[3]
        if (num_steps is None) == (batch_size is None):
            raise ValueError("give exactly one of num_steps and batch_size")
        k = count("num_selected", num_selected, 1)
        if num_steps is None:
            args = _adapters.shape(self.kind, n, _real("batch_size", batch_size), num_selected=k)
        else:
            args = {"num_steps": count("num_steps", num_steps, 1), "num_selected": k}
        super().__init__(x, y, sample_weight, args, seed, **kwargs)


#: The dataset class of each built-in ``sampler=`` that a dpcore.sampling sampler draws.
SAMPLED_BATCHES = {c.kind: c for c in (TruncatedPoissonBatches, BallsInBinsBatches, RandomAllocationBatches)}


def sampled_batches(kind: str) -> Any:
    """The dataset class of ``sampler=kind``: a built-in one, or for a sampler registered with
    :func:`dpcore.sampling.register_sampler` a :class:`SampledBatches` drawing from it (built
    with the constructor arguments of its ``config()``)."""
    cls = SAMPLED_BATCHES.get(kind)
    if cls is None:
        from ..sampling import sampler_class

        name = sampler_class(kind).__name__.replace("Sampler", "") + "Batches"
        cls = type(name, (SampledBatches,), {"kind": kind, "__module__": __name__})
        SAMPLED_BATCHES[kind] = cls
    return cls
