"""Random allocation (Feldman & Shenfeld 2025, arXiv 2502.08202) and its k = 1 case,
balls-in-bins (Chua et al. 2025, arXiv 2412.16802): every record in exactly k of each round's t
steps. Accounted per round by the certified Rényi bound of :mod:`dpcore.accounting.allocation`."""

from __future__ import annotations

import math
from typing import Any, List, Optional

import numpy as np

from .. import _core
from .._validate import count as _count, probability as _probability
from ..mechanism import _seed
from ._base import Sampler, check_state, composed, derive, ledger_of, register_sampler, state_int


def steps_per_round(sampler: str, sampling_probability: float, num_selected: int = 1) -> int:
    """The steps of one round of an allocation sampler: b = 1/q batches of a balls-in-bins
    epoch, t = k/q steps of a random-allocation round. ValueError when that is not a whole
    number (to 1e-9): the rate of these samplers is k/t exactly."""
    q = _probability("sampling_probability", sampling_probability)
    k = _count("num_selected", num_selected, 1)
    if sampler == "balls_in_bins" and k != 1:
        raise ValueError("balls_in_bins puts every record in one batch per epoch: num_selected must be 1")
    if not q > 0:
        raise ValueError(f"sampling_probability must be > 0 for {sampler}, got {q}")
    t = round(k / q)
    if t < k or abs(t * q - k) > 1e-9 * k:
        raise ValueError(
            f"{sampler}: sampling_probability must be num_selected/steps_per_round exactly "
            f"(got q = {q!r}, num_selected = {k}: k/q = {k / q!r} is not a whole number of steps)"
        )
    return t


# Random allocation (Feldman & Shenfeld 2025, arXiv 2502.08202): in each round of t steps every
# record takes part in exactly k steps, a uniformly random k-subset of the t, chosen
# independently of the other records; balls-in-bins (Chua et al. 2025, arXiv 2412.16802) is
# k = 1. The amplification rests on the round's assignment being secret, so it is drawn step by
# step and never stored (no state dict or checkpoint holds it):
#
# Sequential selection sampling. At step s of a round (s = 0 … t−1), a record that still has r
# steps to take part in joins with probability r/(t−s). For one record this yields a uniform
# r-subset of the remaining steps: by induction on t−s, the first remaining step is in a uniform
# r-subset of t−s steps with probability C(t−s−1, r−1)/C(t−s, r) = r/(t−s), and the rest is a
# uniform subset of the steps after it (of size r−1 if it joined, r if not). A record with
# r = t−s joins with probability 1, so every record ends the round with r = 0: exactly k steps.
# Records are independent because each one's joins are independent Bernoulli draws.
#
# The records with the same r are drawn together with the core's Poisson sampler (ChaCha20,
# keyed from the OS at every step and group; geometric skips: work ∝ the records drawn). Each
# group keeps an array of its records; a record leaving the group (its r decreased) stays in the
# array until the array is compacted, which happens when fewer than half are still members; a
# draw over the array then discards the stale entries it hits (each member is still joined with
# probability r/(t−s), independently). So a round costs O(n·k) work: n·k joins in all, each
# moving one record once, and compactions paid for by those moves.

_ALLOCATION_PATH = 0xA110  # derive_seed path of a seeded allocation sampler's draws


class _Round:
    """The assignment of one allocation round while it is being drawn: ``left[i]`` = the steps
    record i has still to take part in, ``members[r]`` = an array holding every record with
    ``left == r`` (and stale ones, with a smaller ``left``) in its first ``fill[r]`` entries."""

    __slots__ = ("left", "members", "fill", "live")

    def __init__(self, n: int, k: int) -> None:
        self.left = np.full(n, k, dtype=np.int32 if k < 2**31 else np.int64)
        self.members: List[Optional[np.ndarray]] = [None] * (k + 1)
        self.members[k] = np.arange(n, dtype=np.int64)
        self.fill = [0] * (k + 1)
        self.live = [0] * (k + 1)
        self.fill[k] = self.live[k] = n

    def step(self, s: int, t: int, key: Any) -> np.ndarray:
        """The records that take part in step s (sorted int64); ``key(r)`` is the ChaCha20 key
        of group r's draw (None: from the OS)."""
        joined = []
        for r in range(1, len(self.members)):
            if self.live[r] == 0:
                continue
            if r > t - s:  # cannot happen: a record with r = t−s joins with probability 1
                raise RuntimeError(f"random allocation: {self.live[r]} record(s) need {r} of the last {t - s} steps")
            group = self.members[r][: self.fill[r]]  # type: ignore[index]
            pos = _core.poisson_sample(group.size, r / (t - s), key(r)).astype(np.int64, copy=False)
            rec = group[pos]
            if self.fill[r] != self.live[r]:
                rec = rec[self.left[rec] == r]  # drop the stale entries drawn
            joined.append((r, rec))
        for r, rec in joined:  # after all groups are drawn: each record once per step
            self.left[rec] = r - 1
            self.live[r] -= rec.size
            if r > 1 and rec.size:
                self._push(r - 1, rec)
            if 2 * self.live[r] < self.fill[r]:
                self._compact(r)
        if not joined:
            return np.empty(0, np.int64)
        out = np.concatenate([rec for _, rec in joined]) if len(joined) > 1 else joined[0][1]
        out.sort()
        return out

    def _push(self, r: int, rec: np.ndarray) -> None:
        buf, f = self.members[r], self.fill[r]
        if buf is None or f + rec.size > buf.size:
            # A record enters group r at most once a round: n entries always suffice.
            grown = np.empty(min(self.left.size, max(64, 2 * (f + rec.size))), np.int64)
            if buf is not None:
                grown[:f] = buf[:f]
            self.members[r] = buf = grown
        buf[f : f + rec.size] = rec
        self.fill[r] = f + rec.size
        self.live[r] += rec.size

    def _compact(self, r: int) -> None:
        buf, f = self.members[r], self.fill[r]
        assert buf is not None
        keep = buf[:f][self.left[buf[:f]] == r]
        buf[: keep.size] = keep
        self.fill[r] = keep.size


class RandomAllocationSampler(Sampler):
    """Random allocation (Feldman & Shenfeld 2025, "Privacy amplification by random allocation",
    arXiv 2502.08202): rounds of t = ``num_steps`` steps in which every record takes part in
    exactly k = ``num_selected`` steps, a uniformly random k-subset of the t, chosen
    independently of the other records.

    A step's batch holds about n·k/t records (Bin(n, k/t) each, the batches of a round summing
    to n·k); it may be empty. The round's assignment is drawn as the round goes (sequential
    selection sampling, keyed from the OS at every step: see the comment above this class), so
    the steps to come are not fixed before they are drawn.

    With ``ledger``, :meth:`draw` records a ``"random_allocation"`` sample naming its round (the
    ledger's :attr:`~dpcore.ledger.PrivacyLedger.next_round` when the round begins) and its step;
    the accountant reads each round as one ``RandomAllocationSampledEvent(t, k, ·)``, whether all
    its steps were released or only some. ``seed`` is for tests only (the ledger marks its
    samples ``seeded``).

    **Resuming.** The round's assignment is what the amplification rests on, so it is never
    stored: not in :meth:`state_dict`, not when the sampler is pickled. A sampler restored from a
    state dict (or unpickled) starts a *new* round at its next draw; the interrupted round's
    remaining steps are skipped (some records then took part in fewer than k of its steps), and
    the ledger accounts the interrupted round as a whole round anyway (post-processing).
    """

    name = "random_allocation"
    report_text = (
        "each record in exactly k of every round's t steps, a uniformly random k-subset",
        "random allocation (k of t)",
        "RandomAllocationSampledEvent per round (certified Rényi bound)",
    )
    default_accountant = "rdp"
    guarantee = "amplification close to Poisson at q = k/t, certified by a Rényi bound"
    rounds = "allocation"
    options = {"num_selected": 1}

    @classmethod
    def check_options(cls, options: Any) -> Any:
        out = super().check_options(options)
        if cls.name == "balls_in_bins" and out.get("num_selected", 1) != 1:
            raise ValueError("balls_in_bins puts every record in one batch per epoch: num_selected must be 1")
        return out

    @classmethod
    def epoch_length(cls, sampling_probability: float, *, steps_per_epoch: Optional[int] = None, **options: Any) -> int:
        """t = k/q, the steps of a round (ValueError unless a whole number)."""
        return steps_per_round(cls.name, sampling_probability, options.get("num_selected", 1))

    @classmethod
    def steps_for_epochs(cls, epochs: Any, sampling_probability: float, *, steps_per_epoch: Optional[int] = None,
                         **options: Any) -> int:
        """⌈epochs/k⌉ whole rounds of t steps (a round is k passes over the data; the ledger
        counts a round cut short as a whole round, so that is what ``epochs`` costs)."""
        e = float(epochs)
        if not (math.isfinite(e) and e > 0):
            raise ValueError(f"epochs must be finite and > 0, got {epochs!r}")
        opts = cls.check_options(options)
        k = int(opts.get("num_selected", 1))
        return max(1, math.ceil(e / k - 1e-9)) * cls.epoch_length(sampling_probability, **opts)

    @classmethod
    def _planned_event(cls, z, steps, q, n, neighboring, steps_per_epoch, num_selected=1):  # type: ignore[no-untyped-def]
        from ..events import GaussianEvent, SelfComposedEvent

        t = cls.epoch_length(q, num_selected=num_selected)
        return SelfComposedEvent(cls._allocation_event(t, num_selected, GaussianEvent(z)), -(-steps // t))

    @classmethod
    def _allocation_event(cls, t: int, k: int, gaussian: Any) -> Any:
        from ..events import RandomAllocationSampledEvent

        return RandomAllocationSampledEvent(t, k, gaussian)

    @classmethod
    def round_event(cls, first, z_min, steps, neighboring, gaussian, acc):  # type: ignore[no-untyped-def]
        return acc.RandomAllocationSampledEvent(first.round_steps, first.round_selected, gaussian(z_min)), 1

    @classmethod
    def for_batch_size(cls, population_size: int, batch_size: float, *, seed: Optional[int] = None,
                       ledger: Any = None, num_selected: Any = 1, **options: Any) -> "RandomAllocationSampler":
        """t = max(k, round(n·k/bs)) steps per round, each record in k of them (expected batch
        n·k/t, the nearest to bs a whole t gives)."""
        n = _count("population_size", population_size, 1)
        k = _count("num_selected", num_selected, 1)
        return cls(n, max(k, round(n * k / float(batch_size))), k, seed=seed, ledger=ledger)

    def __init__(
        self, population_size: int, num_steps: int, num_selected: int = 1, *, seed: Optional[int] = None,
        ledger: Any = None,
    ) -> None:
        n = _count("population_size", population_size, 1)
        t = _count("num_steps", num_steps, 1)
        k = _count("num_selected", num_selected, 1)
        if k > t:
            raise ValueError(f"num_selected {k} is larger than num_steps {t}: a record cannot take part in more steps than a round has")
        self._init(n, t, k, seed, ledger)

    def _init(self, n: int, t: int, k: int, seed: Optional[int], ledger: Any) -> None:
        self._ledger = ledger_of(ledger)
        self._seed = _seed(seed)
        self._n, self._t, self._k = n, t, k
        self._round = -1  # this sampler's count of rounds begun (seeds derive from it)
        self._ledger_round: Optional[int] = None  # the current round's index in the ledger
        self._position = 0
        self._state: Optional[_Round] = None

    # -- what the sampler is -------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """t, the steps of a round."""
        return self._t

    @property
    def num_selected(self) -> int:
        """k, the steps of a round each record takes part in."""
        return self._k

    @property
    def sampling_probability(self) -> float:
        """k/t: the probability that a record takes part in a given step."""
        return self._k / self._t

    @property
    def expected_batch_size(self) -> float:
        """n·k/t: the mean batch (the fixed denominator of an average over one step's sample)."""
        return self._n * self._k / self._t

    @property
    def steps_per_epoch(self) -> int:
        """t: a round is an epoch (each record takes part k times)."""
        return self._t

    @property
    def position(self) -> int:
        """The step within the current round that the next draw makes (0: a new round)."""
        return 0 if self._state is None or self._position >= self._t else self._position

    @property
    def round(self) -> int:
        """This sampler's rounds begun, minus one: the current round's number (−1 before the
        first draw). A restored sampler continues the count; the ledger numbers rounds itself."""
        return self._round

    # -- drawing ----------------------------------------------------------------------------

    def draw(self) -> np.ndarray:
        """The sorted record indices (int64) of the next step, recorded in the ledger (when one
        was given). After the last step of a round (or after a restore), a new round begins."""
        new = self._state is None or self._position >= self._t
        step = 0 if new else self._position
        if self._ledger is not None:
            # Recorded first: a sample the ledger refuses leaves the sampler as it was.
            ledger_round = self._ledger.next_round if new else self._ledger_round
            self._ledger.record_sample(
                self._n, self.sampling_probability, self.kind, seeded=self.seeded, round=ledger_round,
                step_in_round=step, round_steps=self._t, round_selected=self._k,
            )
            self._ledger_round = ledger_round
        if new:
            self._round += 1
            self._state = _Round(self._n, self._k)
        assert self._state is not None
        seed, rnd = self._seed, self._round
        idx = self._state.step(step, self._t, lambda r: derive(seed, _ALLOCATION_PATH, rnd, step, r))
        self._position = step + 1
        if self._position >= self._t:
            self._state = None  # the round is over: its assignment is dropped
        return idx

    def __iter__(self) -> Any:
        """The rest of the current round: steps :attr:`position` … t−1 (a full round when a new
        one begins, ``len(self)`` steps). Each is drawn (and recorded) as it is yielded."""
        for _ in range(self._t - self.position):
            yield self.draw()

    def __len__(self) -> int:
        return self._t

    def _round_event(self, gaussian: Any) -> Any:
        return self._allocation_event(self._t, self._k, gaussian)

    def accountant_event(self, noise_multiplier: float, steps: int) -> Any:
        """The event of ``steps`` steps of this sampler (from the start of a round), each
        releasing a Gaussian of noise multiplier z: ``SelfComposedEvent(
        RandomAllocationSampledEvent(t, k, GaussianEvent(z)), ⌈steps/t⌉)`` (``NonPrivateEvent``
        for z = 0). A round cut short is covered by a whole round's event, as the ledger
        accounts it."""
        steps = _count("steps", steps)
        return composed(self._round_event, noise_multiplier, -(-steps // self._t))

    # -- checkpoints --------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return max(self._round, 0)

    def _config(self) -> dict:
        return {"population_size": self._n, "num_steps": self._t, "num_selected": self._k}

    def state_dict(self) -> dict:
        """The configuration, the round count and the position within the round (plain Python
        values); never the round's assignment. A sampler loaded with it starts a new round."""
        return {
            "kind": self.kind, **self._config(), "round": int(self._round), "position": int(self.position),
            "seeded": self.seeded,
        }

    def check_state_dict(self, state: Any) -> None:
        """Raises ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        check_state(self.kind, self._config(), state, "the same allocation (the ledger's rounds depend on it)")
        state_int(state, "round", -1)
        state_int(state, "position", 0, self._t - 1)

    def load_state_dict(self, state: dict) -> None:
        """Restores the round count of :meth:`state_dict`. The interrupted round is not resumed
        (its assignment was never stored): the next draw starts a new round (see the class
        docstring). A seeded sampler's new round derives from its seed and the round count."""
        self.check_state_dict(state)
        self._round = int(state["round"])
        self._state, self._position, self._ledger_round = None, 0, None

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_state"], d["_position"], d["_ledger_round"] = None, 0, None  # never the round's assignment
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)

    def __repr__(self) -> str:
        return (
            f"RandomAllocationSampler(population_size={self._n}, num_steps={self._t}, num_selected={self._k}, "
            f"round={self._round}, position={self.position})"
        )


class BallsInBinsSampler(RandomAllocationSampler):
    """Balls-in-bins sampling (Chua et al. 2025, "Balls-and-Bins Sampling for DP-SGD", arXiv
    2412.16802): in each epoch of b = ``num_batches`` steps every record is thrown into one of the
    b batches, uniformly and independently. It is random allocation with k = 1 and t = b
    (:class:`RandomAllocationSampler`, same construction and the same resuming rule: a restored
    sampler starts a new epoch), recorded with its own policy ``"balls_in_bins"``; the accountant
    reads each epoch as one ``BallsInBinsSampledEvent(b, ·)``. A batch holds Bin(n, 1/b) records
    and the epoch's batch sizes are multinomial(n; 1/b, …, 1/b).
    """

    name = "balls_in_bins"
    report_text = (
        "each record in exactly one of the epoch's batches, chosen uniformly and independently",
        "random allocation (1 of b)",
        "BallsInBinsSampledEvent per epoch (certified Rényi bound)",
    )
    guarantee = "amplification close to Poisson at q = 1/b, certified by a Rényi bound"
    options = {}

    @classmethod
    def steps_for_epochs(cls, epochs: Any, sampling_probability: float, *, steps_per_epoch: Optional[int] = None,
                         **options: Any) -> int:
        """⌈epochs · b⌉ steps (an epoch is b batches)."""
        return Sampler.steps_for_epochs.__func__(cls, epochs, sampling_probability, **options)  # type: ignore[attr-defined]

    @classmethod
    def _allocation_event(cls, t: int, k: int, gaussian: Any) -> Any:
        from ..events import BallsInBinsSampledEvent

        return BallsInBinsSampledEvent(t, gaussian)

    @classmethod
    def round_event(cls, first, z_min, steps, neighboring, gaussian, acc):  # type: ignore[no-untyped-def]
        return acc.BallsInBinsSampledEvent(first.round_steps, gaussian(z_min)), 1

    @classmethod
    def for_batch_size(cls, population_size: int, batch_size: float, *, seed: Optional[int] = None,
                       ledger: Any = None, **options: Any) -> "BallsInBinsSampler":
        """b = max(1, round(n/bs)) batches per epoch (expected batch n/b)."""
        cls.check_options(options)
        n = _count("population_size", population_size, 1)
        return cls(n, max(1, min(n, round(n / float(batch_size)))), seed=seed, ledger=ledger)

    def __init__(self, population_size: int, num_batches: int, *, seed: Optional[int] = None, ledger: Any = None) -> None:
        n = _count("population_size", population_size, 1)
        b = _count("num_batches", num_batches, 1)
        self._init(n, b, 1, seed, ledger)

    @property
    def num_batches(self) -> int:
        """b, the batches (steps) of an epoch."""
        return self._t

    def accountant_event(self, noise_multiplier: float, steps: int) -> Any:
        """The event of ``steps`` steps (from the start of an epoch), each releasing a Gaussian of
        noise multiplier z: ``SelfComposedEvent(BallsInBinsSampledEvent(b, GaussianEvent(z)),
        ⌈steps/b⌉)`` (``NonPrivateEvent`` for z = 0). An epoch cut short is covered by a whole
        epoch's event, as the ledger accounts it."""
        return super().accountant_event(noise_multiplier, steps)

    def _config(self) -> dict:
        return {"population_size": self._n, "num_batches": self._t}

    def __repr__(self) -> str:
        return (
            f"BallsInBinsSampler(population_size={self._n}, num_batches={self._t}, round={self._round}, "
            f"position={self.position})"
        )


# balls-in-bins first: the order every listing of the samplers keeps
register_sampler(BallsInBinsSampler)
register_sampler(RandomAllocationSampler)
