"""Batches for DP-SGD from dpcore's other samplers: truncated Poisson, balls-in-bins and random
allocation (:mod:`dpcore.sampling`), each accounted by its own analysis.

* Truncated Poisson (:class:`dpcore.sampling.TruncatedPoissonSampler`): a Poisson sample at q,
  capped at B records (a uniformly random B when more are drawn), so a step's memory is
  bounded. Accounted by PLD (``TruncatedPoissonSampledEvent``; the mixture analysis of
  arXiv 2508.15089).
* Balls-in-bins (:class:`dpcore.sampling.BallsInBinsSampler`; Chua et al. 2025, arXiv
  2412.16802): every record is thrown into one of an epoch's b batches, uniformly and
  independently, so each record is trained on exactly once per epoch.
* Random allocation (:class:`dpcore.sampling.RandomAllocationSampler`; Feldman & Shenfeld
  2025, arXiv 2502.08202): every record takes part in exactly k of a round's t steps, a
  uniformly random k-subset.

The allocation samplers are accounted by the certified Rényi-DP bound of
:mod:`dpcore.accounting.allocation` (one event per round; a round cut short counts as a whole
round). The sampler records each sample in the ledger with its own policy as it is drawn; the
entry becomes durable with the sample's release.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from .. import _adapters
from .._seeds import derive_seed
from ..sampling import UserIndex, check_examples_per_user
from ._data import check_pad_batches, empty_batch, physical_batches
from ._distributed import current_communicator, resolve_ledger

__all__ = ["SamplerDataLoader"]


class _UserBound:
    """The ledger a sampler records user samples in: each sample entry carries the
    ``examples_per_user`` bound (user-level sampling), which the sampler itself knows nothing of."""

    def __init__(self, ledger: Any, examples_per_user: int) -> None:
        self.ledger, self.examples_per_user = ledger, examples_per_user

    def record_sample(self, *args: Any, **kw: Any) -> int:
        return self.ledger.record_sample(*args, examples_per_user=self.examples_per_user, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)


def refuse_distributed(kind: str) -> None:
    """The new samplers under ``torch.distributed`` are refused for now: every rank would have to
    train on its share of one global sample, which for an allocation round means one assignment
    drawn once and shared, and recorded alike in every rank's ledger replica."""
    if current_communicator() is not None:
        raise ValueError(
            f"sampler={kind!r} is not supported under torch.distributed yet (every rank must train on its part of "
            "one global sample, which these samplers do not split across ranks); use sampler='poisson' for "
            "data-parallel training"
        )


class SamplerDataLoader:
    """The logical batches that a :mod:`dpcore.sampling` sampler draws from ``dataset``.

    * ``sampler``: a :class:`~dpcore.sampling.TruncatedPoissonSampler`,
      :class:`~dpcore.sampling.BallsInBinsSampler` or
      :class:`~dpcore.sampling.RandomAllocationSampler` over ``len(dataset)`` records, built
      with the ``ledger`` that records its samples (its policy is what the ledger accounts).
    * ``max_physical_batch_size``, ``collate_fn``: as for :class:`~dpcore.torch.DPDataLoader`
      (micro-batches of a logical batch; :attr:`logical_batch_complete` after the last).

    ``len(loader)`` is the sampler's steps per epoch or round: round(1/q) truncated Poisson
    steps, the b batches of a balls-in-bins epoch, the t steps of an allocation round (k passes
    over the data when each record takes part in k of them). One ``for batch in loader`` yields
    the rest of the current epoch or round (a full one when a new one begins); breaking out of
    a loop and starting another continues it. An empty batch is yielded too (zero rows): skipping
    it would reveal that no record was drawn.

    Checkpoints: :meth:`state_dict` holds the sampler's state dict and the samples drawn; the
    secret assignment of an allocation round is never stored, so a loader restored with
    :meth:`load_state_dict` starts a **new** round at its next draw (the interrupted round's
    remaining steps are skipped; the ledger counts that round as a whole round anyway, so ε is
    never under-stated). Not supported under ``torch.distributed`` yet.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: Any,
        *,
        max_physical_batch_size: Optional[int] = None,
        collate_fn: Optional[Callable[[Any], Any]] = None,
        user_ids: Any = None,
        examples_per_user: Optional[int] = None,
        seed: Optional[int] = None,
        pad_batches: bool = False,
    ) -> None:
        kind = getattr(sampler, "policy", None)
        if kind not in _adapters.DRAWN:
            raise TypeError(
                "sampler must be a dpcore.sampling TruncatedPoissonSampler, BallsInBinsSampler or RandomAllocationSampler, "
                f"got {type(sampler).__name__}"
            )
        refuse_distributed(kind)
        if isinstance(dataset, IterableDataset):
            raise TypeError(f"sampler={kind!r} needs a map-style dataset (len() and indexing), not an IterableDataset")
        n = len(dataset)  # type: ignore[arg-type]
        #: user-level sampling: the sampler draws users, each gives at most k examples
        self.users: Optional[UserIndex] = None
        self.examples_per_user: Optional[int] = None
        self.record_groups: Optional[np.ndarray] = None
        self._seed = seed
        if user_ids is not None:
            self.users = user_ids if isinstance(user_ids, UserIndex) else UserIndex(user_ids, n)
            self.examples_per_user = check_examples_per_user("examples_per_user", examples_per_user)
            if max_physical_batch_size is not None and int(max_physical_batch_size) < self.examples_per_user:
                raise ValueError(
                    f"max_physical_batch_size ({max_physical_batch_size}) must be >= examples_per_user "
                    f"({self.examples_per_user}): a micro-batch never splits a user's examples"
                )
            if not isinstance(getattr(sampler, "_ledger", None), _UserBound):
                raise ValueError("a user-level sampler records its samples with their bound: build the loader with "
                                 "SamplerDataLoader.from_data_loader(..., user_ids=, examples_per_user=)")
            n = self.users.num_users
        elif examples_per_user is not None:
            raise ValueError("examples_per_user needs user_ids")
        if n != sampler.population_size:
            raise ValueError(f"the sampler draws from {sampler.population_size} records but the dataset has {n}")
        if getattr(sampler, "ledger", None) is None:
            raise ValueError("the sampler has no ledger: build it with ledger= (its samples must be recorded)")
        if max_physical_batch_size is not None and int(max_physical_batch_size) < 1:
            raise ValueError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.dataset = dataset
        self.n = n
        self.sampler = sampler
        led = sampler.ledger
        self.ledger = led.ledger if isinstance(led, _UserBound) else led
        self.max_physical_batch_size = None if max_physical_batch_size is None else int(max_physical_batch_size)
        self.pad_batches = check_pad_batches(pad_batches, self.max_physical_batch_size, self.users is not None)
        self.record_mask: Optional[np.ndarray] = None
        self.collate_fn = collate_fn or default_collate
        self.logical_batch_complete = True
        self.last_indices: Optional[np.ndarray] = None
        #: Logical batches drawn since the start of the run (restored by load_state_dict).
        self.samples_drawn = 0

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        sampler: str,
        *,
        ledger: Any,
        max_batch_size: Optional[int] = None,
        num_selected: int = 1,
        max_physical_batch_size: Optional[int] = None,
        seed: Optional[int] = None,
        user_ids: Any = None,
        examples_per_user: Optional[int] = None,
        pad_batches: bool = False,
    ) -> "SamplerDataLoader":
        """The ``sampler`` version of a DataLoader, for its ``batch_size`` bs (expected batch):
        truncated Poisson at q = bs/n capped at ``max_batch_size``, balls-in-bins with
        round(n/bs) batches per epoch, random allocation of ``num_selected`` = k of round(n·k/bs)
        steps per round (see :func:`dpcore._adapters.shape`). Its ``collate_fn`` is kept.
        ``seed``: tests only (a seeded sample is predictable: no privacy)."""
        if sampler not in _adapters.DRAWN:
            raise ValueError(f"sampler must be one of {_adapters.DRAWN}, got {sampler!r}")
        refuse_distributed(sampler)
        bs = data_loader.batch_size
        if bs is None:
            raise ValueError(f"sampler={sampler!r} needs a DataLoader with a batch_size (the expected batch size)")
        ds = data_loader.dataset
        if isinstance(ds, IterableDataset):
            raise TypeError(f"sampler={sampler!r} needs a map-style dataset (len() and indexing), not an IterableDataset")
        n = len(ds)  # type: ignore[arg-type]
        if n < 1:
            raise ValueError("dataset is empty")
        users = None
        if user_ids is not None:  # user-level sampling: the sampler draws users (bs: users per step)
            users = user_ids if isinstance(user_ids, UserIndex) else UserIndex(user_ids, n)
            n = users.num_users
            check_examples_per_user("examples_per_user", examples_per_user)
        led: Any = resolve_ledger(ledger, None, None if users is None else "user")
        if users is not None:
            led = _UserBound(led, int(examples_per_user))  # type: ignore[arg-type]
        s = _adapters.build(
            sampler, n, bs, max_batch_size=max_batch_size, num_selected=num_selected, seed=seed, ledger=led
        )
        return cls(ds, s, max_physical_batch_size=max_physical_batch_size, collate_fn=data_loader.collate_fn,
                   user_ids=users, examples_per_user=examples_per_user, seed=seed, pad_batches=pad_batches)

    # -- what the loader is ---------------------------------------------------------------

    @property
    def policy(self) -> str:
        """The ledger policy of every sample: ``truncated_poisson``, ``balls_in_bins`` or
        ``random_allocation``."""
        return self.sampler.policy

    @property
    def accountant(self) -> str:
        """The accountant that certifies this sampler (:meth:`DPOptimizer.get_epsilon`'s
        default): PLD for truncated Poisson, RDP for the allocation samplers."""
        return _adapters.default_accountant(self.policy)

    @property
    def sampling_probability(self) -> float:
        """A record's inclusion rate per step: q, 1/b, or k/t."""
        return float(self.sampler.sampling_probability)

    @property
    def expected_batch_size(self) -> float:
        """The fixed denominator of the average (McMahan et al. 2018, §3): the sampler's
        expected batch (E[min(Bin(n, q), B)] for truncated Poisson, n/b, n·k/t)."""
        return float(self.sampler.expected_batch_size)

    @property
    def max_batch_size(self) -> Optional[int]:
        return self.sampler.max_batch_size

    @property
    def steps_per_epoch(self) -> int:
        return int(self.sampler.steps_per_epoch)

    def __len__(self) -> int:
        return int(self.sampler.steps_per_epoch)

    def _fetch(self, idx: np.ndarray) -> Any:
        if isinstance(self.dataset, TensorDataset):
            t = torch.from_numpy(idx)
            return tuple(x[t] for x in self.dataset.tensors)
        if len(idx) == 0:
            return empty_batch(self.collate_fn, self.dataset[0])
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def __iter__(self) -> Iterator[Any]:
        # The rest of the sampler's epoch or round: its position is the step within the round
        # (0 at a new one, and after a restore) or the steps drawn so far (truncated Poisson).
        t = len(self)
        for _ in range(t - int(self.sampler.position) % t):
            idx = self.sampler.draw()  # recorded in the ledger; written with its release
            self.samples_drawn += 1
            counts = None
            if self.users is not None:
                idx, counts = self.users.choose(idx, self.examples_per_user, seed=derive_seed(self._seed, 0x05E5),
                                                draw=self.samples_drawn)
            yield from physical_batches(self, idx, counts)

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The sampler's state dict (plain Python values; never an allocation round's
        assignment) and the samples drawn."""
        return {
            "kind": "SamplerDataLoader",
            "policy": self.policy,
            "sampler": self.sampler.state_dict(),
            "samples_drawn": int(self.samples_drawn),
            "logical_batch_complete": bool(self.logical_batch_complete),
            **({} if self.users is None else {"users": self.users.fingerprint, "examples_per_user": self.examples_per_user}),
        }

    def check_state_dict(self, state: Any) -> None:
        """Raises ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        if not isinstance(state, dict) or state.get("kind") != "SamplerDataLoader":
            kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a SamplerDataLoader state (kind {kind!r})")
        if state.get("policy") != self.policy:
            raise ValueError(f"the loader state is for sampler={state.get('policy')!r}, this loader's is {self.policy!r}")
        v = state.get("samples_drawn")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"loader state: samples_drawn must be a non-negative int, got {v!r}")
        if not state.get("logical_batch_complete", True):
            raise ValueError(
                "the loader state was taken in the middle of a logical batch (micro-batches); take checkpoints at "
                "release boundaries, after the optimizer step that completes a logical batch"
            )
        if not self.logical_batch_complete:
            raise ValueError("this loader is in the middle of a logical batch; restore a checkpoint before iterating")
        if state.get("users") != (None if self.users is None else self.users.fingerprint) or (
                self.users is not None and state.get("examples_per_user") != self.examples_per_user):
            raise ValueError("the loader state was taken with other user ids or examples_per_user than this loader's: a "
                             "user-level run resumes only over the same users")
        self.sampler.check_state_dict(state.get("sampler"))

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`. An allocation sampler starts a new round at its next draw
        (so the next ``for batch in loader`` is a full round); a truncated-Poisson pass continues."""
        self.check_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.samples_drawn = int(state["samples_drawn"])
        self.logical_batch_complete = True

    def __repr__(self) -> str:
        return f"SamplerDataLoader({self.sampler!r})"
