"""Poisson-sampled batches for DP-SGD from dpcore's ChaCha20 sampler (Abadi et al. 2016, "lots";
McMahan et al. 2018, §5).

Every logical batch is one Poisson sample: each record joins independently with probability q,
drawn by :func:`dpcore.poisson_sample` and recorded in the ledger (the sampling the
subsampled-Gaussian accountant assumes). Batches vary in size and may be empty; an empty batch is
still yielded (with zero rows: every part of the batch that holds one value per record is cut to
none, :func:`empty_batch`), because skipping it would reveal that no record was sampled. The
training loop runs its forward and backward passes on it as on any other, and the optimizer's
step releases the noise alone.
With ``max_physical_batch_size`` a logical batch is cut into micro-batches that the optimizer
accumulates (virtual batches): noise and the ledger's release come once per logical batch.

Under ``torch.distributed`` (see :mod:`dpcore.torch._distributed`) rank r of W samples only the
records i with i mod W = r, at the same rate q, from its own generator: the union over the ranks
is one Poisson sample of the whole dataset, recorded once as (N, q).
"""

from __future__ import annotations

import numbers
import secrets
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from ..ledger import PrivacyLedger
from .._seeds import derive_seed
from ..sampling import UserIndex, check_examples_per_user, physical_chunks, poisson_sample
from ._distributed import current_communicator, resolve_ledger

__all__ = ["DPDataLoader"]


class DPDataLoader:
    """Iterates over ``steps`` Poisson samples of ``dataset`` at rate ``sampling_probability``
    (q; ``sample_rate=`` is its deprecated Opacus-era alias).

    * ``ledger``: the :class:`dpcore.PrivacyLedger` that records each sample (policy ``poisson``),
      or its path (under ``torch.distributed``, the same path on every rank: rank 0 opens it).
    * ``steps``: logical batches per pass (default round(1/q), one expected epoch).
    * ``max_physical_batch_size``: cut a logical batch into micro-batches of at most this size;
      :attr:`logical_batch_complete` is True after the last micro-batch of a logical batch.
    * ``pad_batches``: static shapes (for a GPU, ``torch.compile``, CUDA graphs): every
      micro-batch holds exactly ``max_physical_batch_size`` rows, the real records first and
      then copies of record 0 whose clip factor is 0 (they add exactly nothing, never enter the
      denominator and change nothing recorded); :attr:`record_mask` marks the real rows. A
      sample larger than the size is split, never cut; an empty one is one batch of padding.
    * ``collate_fn``: for map-style datasets other than :class:`TensorDataset` (default
      :func:`torch.utils.data.default_collate`).
    * ``population_size``: N, the public number of records the sampling and the average are
      stated for (default: ``len(dataset)``). The ledger records N, and the fixed denominator is
      q·N; the sample is drawn from the dataset's actual records. Under add-or-remove adjacency
      the dataset's size is itself a function of the data (Opacus #571): declare N when it is
      not public, so that neither q, the denominator nor the ledger reads it from the data.
    * ``seed``: tests and reproductions only — a seeded sample is predictable, gives no
      amplification in truth, and is marked ``seeded`` in the ledger (each rank derives its own).
    * ``user_ids`` (one id per example of ``dataset``) with ``examples_per_user`` k: the privacy
      unit is the user (user-level sampling, Charles et al. 2024, arXiv 2407.07737). Each step
      draws *users*, each with probability q (q = the expected users per step over the user
      population, ``population_size`` users, default the number of distinct ids), and each
      sampled user gives at most k of its examples, chosen by ChaCha20 without replacement.
      A batch holds the sampled users' examples user-major; :attr:`record_groups` gives the
      number of examples of each user in the batch just yielded, from which the optimizer
      clips each user's mean gradient as one record. Micro-batches never split a user
      (``max_physical_batch_size`` ≥ k). The ledger (privacy unit ``"user"``) records each
      sample over the user population with the bound k.
    * ``user_ids`` with ``max_examples_per_user`` K: example-level sampling with a user-level
      guarantee (Charles et al. 2024): each user is bounded once, before the first sample, to at
      most K of its examples (ChaCha20), and the kept examples are Poisson sampled and clipped one
      by one; the ledger (unit ``"user"``) records K, and the accountant takes a user as up to K
      independently sampled examples (a mixture of Gaussians). ``population_size`` then counts
      kept examples (default: how many were kept, assumed public).

    Under ``torch.distributed`` (initialised, world size W > 1) the loader yields this rank's
    part of each sample: about q·N/W records (``last_indices`` are indices into the dataset).

    Checkpoints: :meth:`state_dict` (samples drawn, and logical batches done in the current
    pass) and :meth:`load_state_dict`, which :class:`DPOptimizer`'s state dict carries. After a
    load, the next ``for batch in loader`` yields the rest of the interrupted pass (``steps -
    done`` logical batches), later passes are full, and a seeded loader draws exactly the samples
    of an uninterrupted run. A state taken in the middle of a logical batch is refused.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampling_probability: Optional[float] = None,
        *,
        ledger: Any,
        steps: Optional[int] = None,
        max_physical_batch_size: Optional[int] = None,
        collate_fn: Optional[Callable[[Any], Any]] = None,
        seed: Optional[int] = None,
        sample_rate: Optional[float] = None,
        population_size: Optional[int] = None,
        user_ids: Any = None,
        examples_per_user: Optional[int] = None,
        max_examples_per_user: Optional[int] = None,
        pad_batches: bool = False,
    ) -> None:
        from .._names import renamed

        q = renamed("sampling_probability", sampling_probability, "sample_rate", sample_rate)
        if ledger is None:
            raise TypeError("DPDataLoader needs a ledger (a dpcore.PrivacyLedger or a path)")
        if isinstance(q, bool) or not isinstance(q, numbers.Real):
            raise TypeError(f"sampling_probability must be a real number, got {type(q).__name__}")
        if not 0.0 < float(q) <= 1.0:
            raise ValueError(f"sampling_probability must be in (0, 1], got {q}")
        self.dataset = dataset
        self.n = len(dataset)  # type: ignore[arg-type]
        if self.n < 1:
            raise ValueError("dataset is empty")
        #: the privacy unit "user" (None: a record is an example), see the class docstring
        self.users: Optional[UserIndex] = None
        self.examples_per_user: Optional[int] = None
        self.max_examples_per_user: Optional[int] = None
        #: ELS: the examples kept after bounding each user (indices into ``dataset``)
        self.kept: Optional[np.ndarray] = None
        #: ULS: each user's example count in the batch just yielded (user-major), else None
        self.record_groups: Optional[np.ndarray] = None
        if user_ids is None:
            if examples_per_user is not None or max_examples_per_user is not None:
                raise ValueError("examples_per_user and max_examples_per_user need user_ids (one id per example)")
        else:
            if (examples_per_user is None) == (max_examples_per_user is None):
                raise ValueError(
                    "with user_ids give examples_per_user=k (user-level sampling: users are sampled, each gives the "
                    "mean of at most k examples) or max_examples_per_user=K (each user bounded to K examples, "
                    "examples sampled), not both"
                )
            self.users = user_ids if isinstance(user_ids, UserIndex) else UserIndex(user_ids, self.n)
            if self.users.num_examples != self.n:
                raise ValueError(f"user_ids has {self.users.num_examples} ids but the dataset has {self.n} examples")
            if examples_per_user is not None:
                self.examples_per_user = check_examples_per_user("examples_per_user", examples_per_user)
                if max_physical_batch_size is not None and int(max_physical_batch_size) < self.examples_per_user:
                    raise ValueError(
                        f"max_physical_batch_size ({max_physical_batch_size}) must be >= examples_per_user "
                        f"({self.examples_per_user}): a micro-batch never splits a user's examples"
                    )
                self.n = self.users.num_users
            else:
                self.max_examples_per_user = check_examples_per_user("max_examples_per_user", max_examples_per_user)
                # The bound is drawn once for the run from a key that the checkpoint keeps, so that
                # a resumed run keeps the same examples of each user (at most K over the whole run).
                # Which examples are kept is not secret: the analysis takes any K of a user's.
                comm = current_communicator()
                key = derive_seed(seed, 0xB0)
                if key is None and (comm is None or comm.is_root):
                    key = secrets.randbits(63)
                if comm is not None:  # one bound for the run: rank 0's key on every rank
                    key = comm.share(key, "sharing the key of the examples kept per user")
                self._bound_key = int(key)  # type: ignore[arg-type]
                self.kept = self.users.bound(self.max_examples_per_user, seed=self._bound_key)
                self.n = len(self.kept)
        #: N: the declared (public) population size, else len(dataset) (assumed public)
        self.population_size = self.n if population_size is None else _population(population_size)
        self.population_declared = population_size is not None
        self.sampling_probability = float(q)
        self.steps = max(1, round(1.0 / self.sampling_probability)) if steps is None else int(steps)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if max_physical_batch_size is not None and int(max_physical_batch_size) < 1:
            raise ValueError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.max_physical_batch_size = None if max_physical_batch_size is None else int(max_physical_batch_size)
        #: static shapes: every physical batch padded to max_physical_batch_size rows (physical_batches)
        self.pad_batches = check_pad_batches(pad_batches, self.max_physical_batch_size, self.users is not None)
        self.record_mask: Optional[np.ndarray] = None
        self.collate_fn = collate_fn or default_collate
        self._comm = current_communicator()
        self.rank, self.world_size = (0, 1) if self._comm is None else (self._comm.rank, self._comm.world_size)
        # Validated above first, so that bad arguments fail on every rank before the collective.
        self.ledger = resolve_ledger(ledger, self._comm, "user" if self.users is not None else None)
        self.seed = seed
        self.logical_batch_complete = True
        self.samples_drawn = 0
        self.last_indices: Optional[np.ndarray] = None
        self._draws = 0
        # Logical batches drawn in the current pass, and where the next pass starts after
        # load_state_dict (None: a full pass).
        self._pass_done = 0
        self._resume_at: Optional[int] = None

    @classmethod
    def from_data_loader(cls, data_loader: DataLoader, *, ledger: PrivacyLedger, **kw: Any) -> "DPDataLoader":
        """The Poisson version of a DataLoader: q = batch_size / N, N the declared
        ``population_size`` or else len(dataset) (its collate_fn kept)."""
        ds = data_loader.dataset
        bs = data_loader.batch_size
        if bs is None:
            raise ValueError("data_loader has no batch_size; give sampling_probability to DPDataLoader directly")
        kw.setdefault("collate_fn", data_loader.collate_fn)
        n = kw.get("population_size")
        if n is None and kw.get("user_ids") is not None:
            # the privacy unit "user": q over the users (user-level sampling) or over the examples
            # kept after bounding each user to K (Σ_u min(count_u, K): no draw needed to count them)
            users = kw["user_ids"] if isinstance(kw["user_ids"], UserIndex) else UserIndex(kw["user_ids"], len(ds))  # type: ignore[arg-type]
            kw["user_ids"] = users
            k = kw.get("max_examples_per_user")
            n = users.num_users if k is None else int(np.minimum(users.counts, check_examples_per_user("max_examples_per_user", k)).sum())
        n = len(ds) if n is None else _population(n)  # type: ignore[arg-type]
        return cls(ds, min(1.0, bs / n), ledger=ledger, **kw)

    @property
    def sample_rate(self) -> float:
        """Deprecated name of :attr:`sampling_probability`."""
        return self.sampling_probability

    @property
    def expected_batch_size(self) -> float:
        """q·N: the denominator of the fixed-denominator average (McMahan et al. 2018, §3), N the
        population size (declared, or len(dataset))."""
        return self.sampling_probability * self.population_size

    def __len__(self) -> int:
        return self.steps

    #: Whether every rank cuts each logical batch into the same number of micro-batches (see
    #: :func:`physical_batches`); set by :meth:`use_equal_micro_batches`.
    equal_micro_batches = False

    def use_equal_micro_batches(self) -> None:
        """Loader protocol (:mod:`dpcore.torch._loader`): called by a DPOptimizer under FSDP2,
        where every forward and backward pass gathers the weights with all ranks."""
        self.equal_micro_batches = True

    def _fetch(self, idx: np.ndarray) -> Any:
        if isinstance(self.dataset, TensorDataset):
            t = torch.from_numpy(idx)
            return tuple(x[t] for x in self.dataset.tensors)
        if len(idx) == 0:
            return empty_batch(self.collate_fn, self.dataset[0])
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def _record(self, seeded: bool) -> None:
        bounds: Dict[str, Any] = {}
        if self.examples_per_user is not None:
            bounds["examples_per_user"] = self.examples_per_user
        if self.max_examples_per_user is not None:
            bounds["max_examples_per_user"] = self.max_examples_per_user
        self.ledger.record_sample(self.population_size, self.sampling_probability, "poisson", seeded=seeded, **bounds)

    def _sample(self) -> np.ndarray:
        """This rank's part of the next Poisson sample (all of it in one process): records (the
        sampled users under user-level sampling, see :meth:`_examples`)."""
        r, w = self.rank, self.world_size
        if w == 1:
            seed = derive_seed(self.seed, self._draws)
            self._draws += 1
            idx = poisson_sample(self.n, self.sampling_probability, seed=seed)
            self._record(seed is not None)
            return idx
        seed = derive_seed(self.seed, self._draws, r)  # a test seed: still one stream per rank
        self._draws += 1
        shard = max(0, (self.n - r + w - 1) // w)  # records r, r + w, r + 2w, ...
        local = poisson_sample(shard, self.sampling_probability, seed=seed)
        # Every rank records the whole sample (N, q); only rank 0's ledger is a file.
        self._record(seed is not None)
        return r + w * local

    def _examples(self, idx: np.ndarray) -> "tuple[np.ndarray, Optional[np.ndarray]]":
        """The dataset indices of sampled records ``idx``, and under user-level sampling each
        sampled user's number of examples (their examples user-major)."""
        if self.kept is not None:
            return self.kept[idx], None
        if self.users is not None:
            seed = derive_seed(self.seed, 0x05E5, self.rank)
            return self.users.choose(idx, self.examples_per_user, seed=seed, draw=self._draws)
        return idx, None

    def __iter__(self) -> Iterator[Any]:
        if self.users is not None and len(self.dataset) != self.users.num_examples:  # type: ignore[arg-type]
            raise ValueError(
                f"the dataset has {len(self.dataset)} examples but its user_ids were given for "  # type: ignore[arg-type]
                f"{self.users.num_examples}: the users of a run are fixed when the loader is built"
            )
        start, self._resume_at = self._resume_at, None
        self._pass_done = 0 if start is None or start >= self.steps else start
        while self._pass_done < self.steps:
            idx, counts = self._examples(self._sample())
            self.samples_drawn += 1
            self._pass_done += 1
            self._resume_at = None  # a resumed position is consumed by the pass that runs now
            yield from physical_batches(self, idx, counts)

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Where the loader stands, in plain Python types: samples drawn (a seeded loader derives
        each sample's seed from their count) and logical batches done in the current pass (0
        after a pass's last batch: the next iteration is a full pass). Take it at a release
        boundary, after :meth:`DPOptimizer.step`; :meth:`load_state_dict` refuses a state taken
        in the middle of a logical batch (micro-batches)."""
        return {
            "kind": "DPDataLoader",
            "samples_drawn": int(self.samples_drawn),
            "draws": int(self._draws),
            "pass_position": int(self._pass_done if self._pass_done < self.steps else 0),
            "steps": int(self.steps),
            "sampling_probability": float(self.sampling_probability),
            "population_size": int(self.population_size),
            "logical_batch_complete": bool(self.logical_batch_complete),
            **({} if self.users is None else {"users": self.users.fingerprint,
                                               "examples_per_user": self.examples_per_user,
                                               "max_examples_per_user": self.max_examples_per_user}),
            **({} if self.kept is None else {"bound_key": self._bound_key}),
        }

    def check_state_dict(self, state: Any) -> None:
        """Raises (ValueError) if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        if not isinstance(state, dict) or state.get("kind") != "DPDataLoader":
            raise ValueError(f"not a DPDataLoader state (kind {state.get('kind') if isinstance(state, dict) else type(state).__name__!r})")
        for key in ("samples_drawn", "draws", "pass_position", "steps"):
            v = state.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DPDataLoader state: {key} must be a non-negative int, got {v!r}")
        if not state.get("logical_batch_complete", True):
            raise ValueError(
                "the DPDataLoader state was taken in the middle of a logical batch (micro-batches): the records "
                "accumulated so far are not in any checkpoint; take checkpoints at release boundaries, after the "
                "optimizer step that completes a logical batch (optimizer.last_step_released is True)"
            )
        if not self.logical_batch_complete:
            raise ValueError(
                "this DPDataLoader is in the middle of a logical batch (micro-batches); restore a checkpoint "
                "before iterating, or at a release boundary"
            )
        if int(state["population_size"]) != self.population_size or float(state["sampling_probability"]) != self.sampling_probability:
            raise ValueError(
                f"the DPDataLoader state is for n={state['population_size']}, q={state['sampling_probability']}; "
                f"this loader has n={self.population_size}, q={self.sampling_probability}"
            )
        mine = None if self.users is None else self.users.fingerprint
        if state.get("users") != mine:
            raise ValueError(
                "the DPDataLoader state was taken with other user ids than this loader's (or with another privacy "
                "unit): a user-level run resumes only over the same users"
            )
        if self.users is not None and (state.get("examples_per_user"), state.get("max_examples_per_user")) != (
                self.examples_per_user, self.max_examples_per_user):
            raise ValueError("the DPDataLoader state was taken with other examples_per_user / max_examples_per_user")
        if int(state["pass_position"]) > self.steps:
            raise ValueError(f"pass_position {state['pass_position']} exceeds this loader's {self.steps} steps per pass")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`: the next ``for batch in loader`` continues the pass where
        the state was taken (``steps - pass_position`` logical batches), later passes are full, and
        a seeded loader draws the same samples as an uninterrupted run."""
        self.check_state_dict(state)
        if self.kept is not None and state.get("bound_key") is not None and int(state["bound_key"]) != self._bound_key:
            # the bound of the run being resumed: each user keeps the same examples
            self._bound_key = int(state["bound_key"])
            self.kept = self.users.bound(self.max_examples_per_user, seed=self._bound_key)  # type: ignore[union-attr]
        self.samples_drawn = int(state["samples_drawn"])
        self._draws = int(state["draws"])
        self._pass_done = int(state["pass_position"])
        self._resume_at = self._pass_done
        self.logical_batch_complete = True


def check_pad_batches(pad: Any, max_physical_batch_size: Optional[int], users: bool) -> bool:
    """``pad_batches`` checked against the loader's other options (before anything is drawn)."""
    if not isinstance(pad, bool):
        raise TypeError(f"pad_batches must be True or False, got {pad!r}")
    if not pad:
        return False
    if max_physical_batch_size is None:
        raise ValueError(
            "pad_batches=True pads every physical batch to max_physical_batch_size rows: give "
            "max_physical_batch_size (e.g. about 1.3 x the expected batch size, so that most samples fit in one)"
        )
    if users:
        raise ValueError(
            "pad_batches=True is not yet available with users as the privacy unit (a padded row would join a "
            "user's examples); use pad_batches=False"
        )
    if current_communicator() is not None:
        raise ValueError("pad_batches=True is not yet available under torch.distributed; use pad_batches=False")
    return True


def _population(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or int(n) < 1:
        raise ValueError(f"population_size must be an int >= 1, got {n!r}")
    return int(n)


def _user_chunks(counts: np.ndarray, m: Optional[int]) -> "list[tuple[int, int]]":
    """(first user, end user) of each micro-batch: whole users, at most ``m`` examples each
    (every user has at most m: see DPDataLoader)."""
    if m is None or int(counts.sum()) <= m:
        return [(0, len(counts))]
    out, lo, tot = [], 0, 0
    for u, c in enumerate(counts.tolist()):
        if tot + c > m and u > lo:
            out.append((lo, u))
            lo, tot = u, 0
        tot += c
    out.append((lo, len(counts)))
    return out


def physical_batches(loader: Any, idx: np.ndarray, counts: Optional[np.ndarray] = None) -> Iterator[Any]:
    """The batches of one logical sample ``idx``, cut at ``loader.max_physical_batch_size``
    records; ``loader.logical_batch_complete`` is True on the last one (the optimizer releases
    then), and ``loader.last_indices`` holds the records of the batch just yielded. ``counts``
    (user-level sampling): ``idx`` holds users' examples user-major, this many each; a cut
    never splits a user, and ``loader.record_groups`` holds the batch's counts.

    ``loader.pad_batches``: every batch holds exactly ``max_physical_batch_size`` rows, the
    real records first, then copies of record 0 (:func:`dpcore.sampling.physical_chunks`);
    ``loader.record_mask`` (numpy bool, True for a real record) tells the optimizer which rows
    to give clip factor 0. An empty sample is one batch of padding."""
    m = loader.max_physical_batch_size
    loader.record_mask = None
    if getattr(loader, "pad_batches", False):
        # static shapes: every physical batch holds exactly m rows, the real records first
        at_least = 1
        comm = getattr(loader, "_comm", None)
        if getattr(loader, "equal_micro_batches", False) and comm is not None:
            at_least = comm.maximum(max(1, -(-len(idx) // m)), "agreeing on the number of micro-batches")
        chunks = physical_chunks(idx, m, fill=0, at_least=at_least)
        for k, (c, real) in enumerate(chunks):
            loader.logical_batch_complete = k == len(chunks) - 1
            loader.last_indices = c[:real]
            loader.record_mask = np.arange(m) < real
            yield loader._fetch(c)
        loader.logical_batch_complete = True
        loader.record_mask = None
        return
    if counts is not None:
        bounds = _user_chunks(counts, m)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        comm = getattr(loader, "_comm", None)
        if m is not None and getattr(loader, "equal_micro_batches", False) and comm is not None:
            k = comm.maximum(len(bounds), "agreeing on the number of micro-batches")
            while len(bounds) < k:  # empty micro-batches: every rank runs as many passes
                bounds.append((len(counts), len(counts)))
        for j, (lo, hi) in enumerate(bounds):
            loader.logical_batch_complete = j == len(bounds) - 1
            c = idx[starts[lo] : starts[hi]]
            loader.last_indices = c
            loader.record_groups = counts[lo:hi].copy()
            yield loader._fetch(c)
        loader.logical_batch_complete = True
        return
    chunks = [idx] if m is None or len(idx) <= m else [idx[i : i + m] for i in range(0, len(idx), m)]
    comm = getattr(loader, "_comm", None)
    if m is not None and getattr(loader, "equal_micro_batches", False) and comm is not None:
        # Sharded training (FSDP2): every forward and backward pass gathers the weights with
        # all ranks, so every rank must run the same number of them. The ranks agree on the
        # most micro-batches any of them needs; a rank with fewer records cuts its sample into
        # as many (smaller, possibly empty) ones.
        k = comm.maximum(len(chunks), "agreeing on the number of micro-batches")
        chunks = list(np.array_split(idx, k)) if k > len(chunks) else chunks
    for k, c in enumerate(chunks):
        loader.logical_batch_complete = k == len(chunks) - 1
        loader.last_indices = c
        yield loader._fetch(c)
    loader.logical_batch_complete = True


def empty_batch(collate_fn: Callable[[Any], Any], record: Any) -> Any:
    """A batch of no record (an empty Poisson sample) shaped as ``collate_fn``'s batches, so
    that the training loop runs its forward and backward passes on it unchanged: the collation
    of one record and of two copies of it are compared, and every part that grows with the
    records is cut to none (a tensor along the dim that grows, with its other dims kept; a list
    or tuple of per-record values such as the strings that ``default_collate`` leaves as they
    are). Parts that do not grow (batch-level values) are kept. A collate function that fails on
    two records gets the cut of :func:`_take_none` (every tensor's dim 0)."""
    one = collate_fn([record])
    try:
        two = collate_fn([record, record])
        return _cut_records(one, two)
    except Exception:
        return _take_none(one)


def _cut_records(one: Any, two: Any) -> Any:
    if isinstance(one, torch.Tensor):
        if not isinstance(two, torch.Tensor) or two.dim() != one.dim():
            raise ValueError("the two collations differ in structure")
        grows = [d for d in range(one.dim()) if one.shape[d] != two.shape[d]]
        return one.narrow(grows[0], 0, 0) if grows else one
    if isinstance(one, Mapping):
        if not isinstance(two, Mapping) or set(one) != set(two):
            raise ValueError("the two collations differ in structure")
        out = {k: _cut_records(v, two[k]) for k, v in one.items()}
        try:
            return type(one)(out)  # type: ignore[call-arg]  # (a Hugging Face BatchEncoding stays one)
        except Exception:
            return out
    if isinstance(one, (list, tuple)):
        if not isinstance(two, (list, tuple)):
            raise ValueError("the two collations differ in structure")
        if len(two) != len(one):  # one value per record (strings left as a list by default_collate)
            return type(one)() if type(one) in (list, tuple) else []
        items = [_cut_records(a, b) for a, b in zip(one, two)]
        if hasattr(one, "_fields"):  # a namedtuple
            return type(one)(*items)
        return type(one)(items)
    return one


def _take_none(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else batch
    if isinstance(batch, Mapping):
        return {k: _take_none(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take_none(v) for v in batch)
    return batch
