"""The privacy unit "user": which examples belong to whom, and the two ways of sampling them.

A record is the unit of privacy (McMahan et al. 2018, §2): one example, or all the data of one
user. ``user_ids`` gives one id per training example; :class:`UserIndex` checks them once and
groups the examples by user. Two samplings give a user-level guarantee (Charles et al. 2024,
"Fine-tuning large language models with user-level differential privacy", arXiv 2407.07737):

* **user-level sampling (ULS)**: a registered sampler draws *users* (Poisson over the user
  population by default); each sampled user contributes at most ``examples_per_user`` of its
  examples, chosen by ChaCha20 without replacement (:meth:`UserIndex.choose`), and the mean of
  their gradients is clipped as one record. The accounting is the example-level one with users
  as records.
* **example-level sampling (ELS)**: each user's data is first bounded to at most
  K = ``max_examples_per_user`` examples in total (:meth:`UserIndex.bound`, ChaCha20), then
  examples are sampled and clipped one by one; the accountant takes a user as up to K examples
  sampled independently (a mixture of Gaussians, Ganesh 2024, arXiv 2401.10294).

Which examples a user keeps or contributes is drawn from the OS-keyed ChaCha20 of the core
(``fixed_size_sample``), never from the data: the choice is part of the sampling, not a
data-dependent branch. ``seed`` is for tests only.
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Any, Optional, Tuple

import numpy as np

from .. import _core
from .._seeds import derive_seed
from ..mechanism import _seed

__all__ = ["UserIndex", "check_examples_per_user"]

_CHOOSE_PATH = 0x05E5  # derive_seed path of a seeded ULS choice: (path, draw, user)
_BOUND_PATH = 0xB0D5  # derive_seed path of a seeded ELS bound: (path, user)


def check_examples_per_user(name: str, value: Any) -> int:
    """``value`` as an int ≥ 1 (``examples_per_user`` or ``max_examples_per_user``), else a
    clear error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _ids_array(user_ids: Any) -> np.ndarray:
    if user_ids is None:
        raise TypeError("user_ids is required for privacy_unit='user': one id per training example")
    try:
        import torch  # noqa: F401  (only to read a tensor without copying twice)

        if isinstance(user_ids, torch.Tensor):
            user_ids = user_ids.detach().cpu().numpy()
    except ImportError:
        pass
    if isinstance(user_ids, (str, bytes)):
        raise TypeError("user_ids must be a sequence of ids (one per example), not a single string")
    if not isinstance(user_ids, np.ndarray):
        # a list mixing 1 and "1" would become one string array (one user): look at each id
        user_ids = list(user_ids)
        obj = np.empty(len(user_ids), dtype=object)
        obj[:] = user_ids
        if any(isinstance(v, (list, tuple, np.ndarray)) for v in user_ids[:1]):
            obj = np.asarray(user_ids)
        user_ids = obj
    ids = np.asarray(user_ids)
    if ids.ndim != 1:
        raise ValueError(f"user_ids must be one-dimensional (one id per example), got shape {ids.shape}")
    kind = ids.dtype.kind
    if kind in "iu":
        return ids.astype(np.int64, copy=False) if kind == "i" else ids
    if kind == "b":
        raise TypeError("user_ids must be integers or strings, got booleans")
    if kind == "f":
        if not np.all(np.isfinite(ids)):
            bad = int(np.flatnonzero(~np.isfinite(ids))[0])
            raise ValueError(f"user_ids must be finite: example {bad} has id {ids[bad]!r}")
        if not np.all(ids == np.round(ids)):
            bad = int(np.flatnonzero(ids != np.round(ids))[0])
            raise ValueError(f"user_ids must be integers or strings: example {bad} has id {ids[bad]!r}")
        return ids.astype(np.int64)
    if kind in "US":
        return ids
    if kind == "O":
        for i, v in enumerate(ids):
            if v is None or (isinstance(v, float) and not np.isfinite(v)):
                raise ValueError(f"user_ids must not be missing: example {i} has id {v!r}")
            if isinstance(v, float) and v == int(v):
                ids[i] = v = int(v)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (str, bytes, numbers.Integral)):
                raise TypeError(f"user_ids must be integers or strings: example {i} has id {v!r} ({type(v).__name__})")
        kinds = {isinstance(v, numbers.Integral) for v in ids}
        if len(kinds) > 1:
            raise TypeError("user_ids mixes integers and strings; give one kind of id")
        return ids.astype(np.int64) if kinds == {True} else ids.astype(str)
    raise TypeError(f"user_ids must be integers or strings, got dtype {ids.dtype}")


class UserIndex:
    """The examples of each user, from ``user_ids`` (one id per example; integers or strings).

    Users are numbered 0..U-1 in the order of their first example. ``num_examples``: the length the
    ids must have (the dataset's), checked here so that a misaligned array fails before anything
    is drawn or recorded. :attr:`fingerprint` identifies the ids (a checkpoint stores it; a
    resume with other ids is refused)."""

    def __init__(self, user_ids: Any, num_examples: Optional[int] = None) -> None:
        ids = _ids_array(user_ids)
        if num_examples is not None and len(ids) != int(num_examples):
            raise ValueError(f"user_ids has {len(ids)} ids but the dataset has {int(num_examples)} examples: give one id per example")
        if len(ids) == 0:
            raise ValueError("user_ids is empty: the dataset has no examples")
        uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        # users numbered in the order of their first example: a user whose examples all come
        # last (a neighbour data set with one user added at the end) leaves the others' numbers
        # (and so their samples under a seed) unchanged
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        uniq, inverse = uniq[order], rank[inverse.reshape(-1)]
        self.num_examples = int(len(ids))
        #: U: the users that have examples here
        self.num_users = int(len(uniq))
        #: the user (0..U-1) of each example
        self.user_of = inverse.astype(np.int64, copy=False).reshape(-1)
        #: examples per user, (U,)
        self.counts = np.bincount(self.user_of, minlength=self.num_users).astype(np.int64)
        self._order = np.argsort(self.user_of, kind="stable").astype(np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.ids = uniq
        h = hashlib.sha256()
        h.update(str(ids.dtype.kind).encode())
        h.update(np.ascontiguousarray(ids).tobytes() if ids.dtype.kind != "U" else "\x1f".join(ids.tolist()).encode())
        self.fingerprint = h.hexdigest()[:32]

    def __len__(self) -> int:
        return self.num_users

    def __repr__(self) -> str:
        return f"UserIndex({self.num_users} users, {self.num_examples} examples, at most {int(self.counts.max())} per user)"

    def examples_of(self, user: int) -> np.ndarray:
        """The examples of ``user`` (0..U-1), in dataset order."""
        return self._order[self._starts[user] : self._starts[user + 1]]

    def choose(self, users: np.ndarray, examples_per_user: Optional[int], *, seed: Optional[int] = None,
               draw: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """ULS: for each of ``users`` (in the order given), at most ``examples_per_user`` of its
        examples, chosen uniformly without replacement by ChaCha20 (all of them when it has
        fewer; None: all). Returns (the examples, user-major: the first user's, then the
        second's...; the number each user gave, (len(users),)). ``seed`` (tests only) with
        ``draw`` derives one independent choice per (draw, user)."""
        users = np.asarray(users, dtype=np.int64).reshape(-1)
        k = None if examples_per_user is None else check_examples_per_user("examples_per_user", examples_per_user)
        parts, counts = [], np.zeros(len(users), dtype=np.int64)
        s = _seed(seed)
        for j, u in enumerate(users):
            ex = self.examples_of(int(u))
            if k is not None and len(ex) > k:
                pick = _core.fixed_size_sample(len(ex), k, derive_seed(s, _CHOOSE_PATH, draw, int(u))).astype(np.int64)
                ex = ex[pick]
            parts.append(ex)
            counts[j] = len(ex)
        out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return out.astype(np.int64, copy=False), counts

    def bound(self, max_examples_per_user: int, *, seed: Optional[int] = None) -> np.ndarray:
        """ELS: the examples kept when each user is bounded to at most ``max_examples_per_user``
        in total, chosen uniformly without replacement by ChaCha20 (all of a user's when it has
        fewer); sorted dataset indices. Drawn once, before training: the bound holds over the
        whole run."""
        k = check_examples_per_user("max_examples_per_user", max_examples_per_user)
        if int(self.counts.max()) <= k:
            return np.arange(self.num_examples, dtype=np.int64)
        s = _seed(seed)
        keep = []
        for u in range(self.num_users):
            ex = self.examples_of(u)
            if len(ex) > k:
                ex = ex[_core.fixed_size_sample(len(ex), k, derive_seed(s, _BOUND_PATH, u)).astype(np.int64)]
            keep.append(ex)
        return np.sort(np.concatenate(keep)).astype(np.int64, copy=False)
