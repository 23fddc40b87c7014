"""Shuffled batches: a fresh ChaCha20 permutation every epoch, cut into batches of b (the last
one short). No amplification by sampling (a shuffled epoch is not a random sample: McMahan et
al. 2018, §5; Chua et al. 2024, arXiv 2403.17673): each record is in one batch an epoch, so an
epoch is one Gaussian query of the record's sensitivity there, which depends on the neighbouring
relation (:mod:`dpcore.accounting.samplers` gives the bounds)."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from .._validate import count as _count
from ._base import Sampler, derive, os_key, register_sampler

_EPOCH_PATH = 0x5F1E  # derive_seed path of a seeded ShuffleSampler' epoch permutations


@register_sampler
class ShuffleSampler(Sampler):
    """Batches of ``batch_size`` records from a fresh permutation every epoch (a
    ``DataLoader(shuffle=True)``): ⌈n/b⌉ steps an epoch, each recorded as a ``shuffle`` sample
    carrying its epoch as a round, which the ledger accounts as one event per epoch."""

    name = "shuffle"
    report_text = (
        "batches of a fresh permutation every epoch: not a random sample",
        "none",
        "GaussianEvent per epoch (zero-out: C; add-or-remove: √5·C, or 2C per step under 5 steps an epoch)",
    )
    relations = ("add_or_remove", "zero_out", "replace_one")
    default_relation = "zero_out"
    guarantee = ("none by sampling: one Gaussian query per epoch (zero-out), √5·C per epoch or 2C per step "
                 "(add-or-remove)")
    amplified = False
    rounds = "epoch"
    drawn = False

    def __init__(self, population_size: int, batch_size: int, *, seed: Optional[int] = None, ledger: Any = None) -> None:
        n = _count("population_size", population_size, 1)
        b = _count("batch_size", batch_size, 1)
        self._b = min(b, n)
        self._q = self._b / n
        self._setup(n, -(-n // self._b), seed, ledger)
        self._order: Optional[np.ndarray] = None
        self._ledger_round: Optional[int] = None

    @property
    def batch_size(self) -> int:
        return self._b

    def _permutation(self, epoch: int) -> np.ndarray:
        from ..mechanism import gaussian_noise

        keys = gaussian_noise((self._n,), 1.0, dtype=np.float64, seed=derive(self._seed, _EPOCH_PATH, epoch) if
                              self._seed is not None else os_key())
        return np.argsort(keys, kind="stable").astype(np.int64, copy=False)

    def _indices(self, t: int) -> np.ndarray:
        k = t % self._len
        if k == 0 or self._order is None:
            self._order = self._permutation(t // self._len)
        return np.sort(self._order[k * self._b:(k + 1) * self._b])

    def _record(self, ledger: Any, idx: np.ndarray) -> None:
        k = self._position % self._len
        if k == 0 or self._ledger_round is None:
            self._ledger_round = ledger.next_round
        ledger.record_sample(self._n, self._q, self.policy, sample_size=self._b, seeded=self.seeded,
                             round=self._ledger_round, step_in_round=k, round_steps=self._len, round_selected=1)

    def _config(self) -> dict:
        return {"population_size": self._n, "batch_size": self._b}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        # a resumed epoch is a new round (its order differs from the interrupted one's)
        self._order, self._ledger_round = None, None

    @classmethod
    def epoch_length(cls, sampling_probability: float, *, steps_per_epoch: Optional[int] = None, **options: Any) -> int:
        """⌈n/b⌉ = ⌈1/q⌉ steps an epoch (the last batch short), or the given ``steps_per_epoch``
        (a DataLoader's ``len``)."""
        if steps_per_epoch is not None:
            return _count("steps_per_epoch", steps_per_epoch, 1)
        q = float(sampling_probability)
        if not 0 < q <= 1:
            raise ValueError(f"sampling_probability must be in (0, 1] for {cls.name}, got {sampling_probability!r}")
        return max(1, math.ceil(1.0 / q - 1e-9))  # 1e-9: q = b/n given as a float

    @classmethod
    def for_batch_size(cls, population_size: int, batch_size: float, *, seed: Optional[int] = None,
                       ledger: Any = None, **options: Any) -> "ShuffleSampler":
        cls.check_options(options)
        return cls(population_size, max(1, round(float(batch_size))), seed=seed, ledger=ledger)

    @classmethod
    def _epochs_event(cls, z: float, steps: int, epochs: int, steps_in_epoch: int, neighboring: str) -> Any:
        """E epochs begun, ``steps`` steps: zero-out C once an epoch; replace-one 2C once an epoch;
        add-or-remove √5·C an epoch when reshuffled with k ≥ 5 steps (the insertion coupling: a swap
        in one batch and one record in the short last one), else a swap (2C) every step."""
        from ..events import GaussianEvent, SelfComposedEvent

        if neighboring == "zero_out":
            return SelfComposedEvent(GaussianEvent(z), epochs)
        if neighboring == "replace_one":
            return SelfComposedEvent(GaussianEvent(z / 2.0), epochs)
        if cls.reshuffled and steps_in_epoch >= 5:
            return SelfComposedEvent(GaussianEvent(z / math.sqrt(5.0)), epochs)
        return SelfComposedEvent(GaussianEvent(z / 2.0), steps)

    #: Whether every epoch has a fresh permutation (the add-or-remove coupling needs it).
    reshuffled = True

    @classmethod
    def _planned_event(cls, z, steps, q, n, neighboring, steps_per_epoch, **options):  # type: ignore[no-untyped-def]
        k = cls.epoch_length(q, steps_per_epoch=steps_per_epoch)
        return cls._epochs_event(z, steps, -(-steps // k), k, neighboring)

    @classmethod
    def step_event(cls, sample, z, neighboring, gaussian, acc):  # type: ignore[no-untyped-def]
        # without its epoch (ledgers written before epochs were recorded): C under zero-out,
        # a swap (2C) otherwise
        return gaussian(z if neighboring == "zero_out" else z / 2.0)

    @classmethod
    def round_event(cls, first, z_min, steps, neighboring, gaussian, acc):  # type: ignore[no-untyped-def]
        if neighboring == "zero_out":
            return gaussian(z_min), 1
        if neighboring == "replace_one":
            return gaussian(z_min / 2.0), 1
        if cls.reshuffled and first.round_steps >= 5:
            return gaussian(z_min / math.sqrt(5.0)), 1
        return gaussian(z_min / 2.0), steps
