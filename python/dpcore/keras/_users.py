"""The privacy unit "user" in the Keras adapter (issue 40): checking the arguments, binding the
users to the ledger, and the per-user means of the user-level train step.

Two samplings give a user-level guarantee (:mod:`dpcore.sampling._users`; Charles et al. 2024,
arXiv 2407.07737):

* **ULS** (``examples_per_user=k``): :class:`~dpcore.keras.UserPoissonBatches` draws users;
  the train step averages each sampled user's per-example gradients (weights 1/count, summed in
  float64 over the user's contiguous examples, across micro-batches) and hands the query one
  record per user, which it clips to C: a user moves the noised sum by at most C.
* **ELS** (``max_examples_per_user=K``): each user is bounded to at most K examples once, before
  training (:meth:`~dpcore.sampling.UserIndex.bound`); the batches are ordinary
  :class:`~dpcore.keras.PoissonBatches` over the kept examples, clipped one by one.

A resumed run must use the same users (and, for ELS, the same kept examples: a fresh bound
would let a user contribute other examples, up to 2K in all). The users are therefore bound to
the ledger by a side file ``<ledger>.users.npz`` (the ids' fingerprint, the bound, the kept
examples), written durably before the first step; a ledger that already holds samples is
continued only with the same ids and bound.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np

from ..sampling._users import UserIndex

__all__ = ["PRIVACY_UNITS", "UserConfig", "user_config", "bind_users", "user_means"]

#: The privacy units of the Keras adapter.
PRIVACY_UNITS = ("example", "user")


@dataclass
class UserConfig:
    """The user-level part of a DPModel: the users, and k (ULS) or K (ELS)."""

    users: UserIndex
    examples_per_user: Optional[int] = None
    max_examples_per_user: Optional[int] = None
    #: ELS: the sorted example indices kept by the bound (set by :func:`bind_users`).
    kept: Optional[np.ndarray] = None

    @property
    def uls(self) -> bool:
        return self.examples_per_user is not None

    @property
    def ledger_bounds(self) -> dict:
        """What each sample of the ledger records about the bound."""
        if self.uls:
            return {"examples_per_user": self.examples_per_user}
        return {"max_examples_per_user": self.max_examples_per_user}

    @property
    def population(self) -> int:
        """The records sampled from: U users (ULS) or the Σ_u min(count_u, K) kept examples (ELS)."""
        if self.uls:
            return self.users.num_users
        assert self.max_examples_per_user is not None
        return int(np.minimum(self.users.counts, int(self.max_examples_per_user)).sum())


def user_config(privacy_unit: Any, user_ids: Any, examples_per_user: Any, max_examples_per_user: Any) -> Optional[UserConfig]:
    """The checked user-level arguments (None for ``privacy_unit="example"``); a clear error for
    any inconsistent or bad one, before anything is drawn or recorded
    (:func:`dpcore._adapters.check_privacy_unit`, the rule of every adapter)."""
    from .._adapters import check_privacy_unit

    if not check_privacy_unit("example" if privacy_unit is None else privacy_unit, user_ids, examples_per_user,
                              max_examples_per_user):
        return None
    k = None if examples_per_user is None else int(examples_per_user)
    kk = None if max_examples_per_user is None else int(max_examples_per_user)
    users = user_ids if isinstance(user_ids, UserIndex) else UserIndex(user_ids)
    return UserConfig(users, k, kk)


def _side_path(ledger: Any) -> str:
    return f"{ledger.path}.users.npz"


def _meta(cfg: UserConfig) -> dict:
    return {
        "fingerprint": cfg.users.fingerprint, "num_users": cfg.users.num_users, "num_examples": cfg.users.num_examples,
        **cfg.ledger_bounds,
    }


def bind_users(cfg: UserConfig, ledger: Any, seed: Optional[int]) -> None:
    """Binds the users (and ELS's bound) to ``ledger`` through its side file (module docstring):
    an existing binding is reused when it matches, refused when it differs and the ledger already
    holds samples; otherwise the binding (for ELS a fresh bound, drawn by ChaCha20; ``seed``:
    tests only) is written durably. Sets ``cfg.kept`` for ELS."""
    path = _side_path(ledger)
    meta = _meta(cfg)
    recorded = len(ledger.samples) > 0
    if os.path.exists(path):
        with np.load(path, allow_pickle=False) as f:
            old = json.loads(str(f["meta"]))
            kept = np.asarray(f["kept"], dtype=np.int64)
        if old == meta:
            if not cfg.uls:
                cfg.kept = kept
            return
        if recorded:
            what = [k for k in sorted(set(old) | set(meta)) if old.get(k) != meta.get(k)]
            raise ValueError(
                f"{ledger.path} was written for other users or another bound ({', '.join(what)} differ from {path}): "
                "a resumed user-level run must use the same user_ids and the same examples_per_user / "
                "max_examples_per_user; start a new ledger for other ones"
            )
    elif recorded and ledger.privacy_unit == "user":
        raise ValueError(
            f"{ledger.path} already records user-level samples but not the users they were drawn from (no {path}): "
            "continue it with the program that wrote it, or start a new ledger"
        )
    kept = np.zeros(0, np.int64) if cfg.max_examples_per_user is None else cfg.users.bound(cfg.max_examples_per_user, seed=seed)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        np.savez(fh, meta=np.array(json.dumps(meta, sort_keys=True)), kept=kept)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:
        d = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(d)
        finally:
            os.close(d)
    except OSError:  # pragma: no cover - directories cannot be fsynced everywhere
        pass
    if not cfg.uls:
        cfg.kept = kept


class UserMeans:
    """Per-user means of per-example gradients over a user-major step cut in micro-batches.

    ``slots``: each example's user slot (non-decreasing, 0..m-1), ``counts``: the examples of
    each user. :meth:`add` takes the per-example gradients of examples ``[start, stop)`` and
    returns the means of the users complete by ``stop`` (one record per user, each variable's
    array with a leading user axis); a user whose examples continue in the next micro-batch is
    carried over."""

    def __init__(self, slots: np.ndarray, counts: np.ndarray) -> None:
        self.slots = np.asarray(slots, np.int64)
        self.weights = 1.0 / np.asarray(counts, np.float64)
        self.carry: Optional[List[np.ndarray]] = None

    def add(self, start: int, grads: Any, dtypes: List[Any]) -> Optional[List[np.ndarray]]:
        b = len(self.slots)
        s = self.slots[start : start + int(np.shape(grads[0])[0])]
        stop = start + len(s)
        cut = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # where each user's examples begin
        w = self.weights[s]
        sums = []
        for g in grads:
            g = np.asarray(g, dtype=np.float64)
            sums.append(np.add.reduceat(g * w.reshape((-1,) + (1,) * (g.ndim - 1)), cut, axis=0))
        if self.carry is not None:  # the first user here began in the previous micro-batch
            for x, c in zip(sums, self.carry):
                x[0] += c
        done = len(cut) if stop >= b or self.slots[stop] != s[-1] else len(cut) - 1
        self.carry = None if done == len(cut) else [x[-1].copy() for x in sums]
        if done == 0:
            return None
        return [x[:done].astype(dt, copy=False) for x, dt in zip(sums, dtypes)]


def user_means(slots: np.ndarray, counts: np.ndarray) -> UserMeans:
    return UserMeans(slots, counts)
