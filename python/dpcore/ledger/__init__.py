"""The privacy ledger: McMahan et al. 2018, §6.

The ledger records what the mechanism did, and nothing else: *sampling events* (a sample was
drawn from a population of n records with probability q, by the policy actually used) and, under
each sample, the *sum-query events* released on it with their privacy tuples (S_g, σ̃_g). An
accountant processes it afterwards (:meth:`PrivacyLedger.get_epsilon`), first turning each sample
and its sum queries into one Gaussian sum query with noise multiplier
z = (Σ_g (S_g/σ̃_g)²)^(−1/2) (Eq. (1)). Bugs in hyperparameter code cannot change the estimate,
and the ledger can be reprocessed when a tighter accountant appears.

File format: JSON lines, UTF-8, append-only. Line 1 is the header
``{"format": "dpcore-privacy-ledger", "version": 1}``; then entries::

    {"type": "sample", "sample": 0, "population_size": 60000, "sampling_probability": 0.01,
     "policy": "poisson", "sample_size": null, "seeded": false}
    {"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0, "stddev": 1.1}
    {"type": "non_private", "sample": 0}
    {"type": "torn_tail_repaired", "line": 7, "fragment": "{\\"type\\": \\"sum_q"}

Matrix-factorization (correlated-noise) queries add two kinds of lines, only when used (a ledger
without them is byte for byte what it was): the first release of a stream declares it, in the
same write as that release and before its sum queries, and each step names its stream::

    {"type": "mf_stream", "stream": "9f1c…", "strategy": {"kind": "banded", "coefficients": [1.0, 0.4]},
     "participation": {"kind": "cyclic", "min_separation": 100}, "steps": 1000}
    {"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0, "stddev": 3.2,
     "mechanism": "matrix_factorization", "stream": "9f1c…"}

Their samples have the policy ``"cyclic"`` (fixed batches, batch t mod b at step t) or
``"cyclic_poisson"`` (group t mod b, each record with probability p). A stream's declaration
is fixed: a release declaring another one is refused. The accountant rebuilds the strategy from
the declaration and recomputes its sensitivity (:mod:`._events`).

The samplers of :mod:`dpcore.sampling` add three policies, again without changing any other
line: ``"truncated_poisson"`` (Poisson at q = ``sampling_probability`` capped at
``sample_size`` = B records) has the keys of every sample; the allocation policies
``"balls_in_bins"`` and ``"random_allocation"`` (every record in exactly k of a round's t
steps) add the round: its index over the ledger, the step's index within it, t and k::

    {"type": "sample", "sample": 7, "population_size": 60000, "sampling_probability": 0.01,
     "policy": "balls_in_bins", "sample_size": null, "seeded": false,
     "round": 0, "step_in_round": 7, "round_steps": 100, "round_selected": 1}

A round's samples are consecutive and in increasing steps, with one t, k, policy and population,
and round indices increase by one: checked when recording and when reading. The accountant reads
one event per round (:mod:`._events`). The core's fast reader refuses these entries (an unknown
policy, unknown keys), so that the reader here, the reference, reads such a ledger.

A ledger whose privacy unit is ``"user"`` (the header's ``privacy_unit``) may record on each
sample the bound on a user's contribution, again only when given: ``examples_per_user`` k for
user-level sampling (the population and the sample are users; each sampled user contributes the
clipped mean of at most k of its examples) or ``max_examples_per_user`` K for example-level
sampling with a user-level guarantee (each user's data bounded to at most K examples over the
run; the sample is of examples, Poisson only; K is one value on every sample of the ledger)::

    {"type": "sample", "sample": 0, "population_size": 48210, "sampling_probability": 0.01,
     "policy": "poisson", "sample_size": null, "seeded": false, "max_examples_per_user": 16}

The accountant reads an ELS sample as a mixture of Gaussians (:mod:`._events`).

Durability: a sample's entries are written with one ``write`` and ``fsync``-ed before
:meth:`PrivacyLedger.record_release` returns, and callers return a noised result only after
that (see :class:`dpcore.PrivateAggregator`). A crash can therefore only tear the entries of a
step whose result was never returned. Loading reports a torn last line with a warning (or an
error with ``strict=True``), never silently; any other unreadable line is an error naming it.

Every value is validated before anything is written; on bad input nothing is written.

Layout: :mod:`._storage` holds the file format and durable appends, :mod:`._events` the
conversion of samples into accountant events; :class:`PrivacyLedger` joins them.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

from .._attrs import readonly
from .. import _trace
from ..accounting.base import DEFAULT_ACCOUNTANT, check_accountant, make_accountant
from ..events import SelfComposedEvent
from ._events import analysis_relation, check_neighboring, rdp_relation_error, run_relation, samples_to_event
from ._entries import (
    ALLOCATION_POLICIES,
    BALLS_IN_BINS,
    CYCLIC,
    CYCLIC_POISSON,
    RANDOM_ALLOCATION,
    TRUNCATED_POISSON,
    DEFAULT_PRIVACY_UNIT,
    FIXED_SIZE,
    FORMAT,
    POISSON,
    POLICIES,
    SHUFFLE,
    VERSION,
    LedgerError,
    LedgerSample,
    LedgerWarning,
    TornTail,
    _release_entries,
    _sample_entry,
    _stream_entries,
    _tuples_of,
    check_round,
    check_user_bounds,
    last_round_of,
    streams_of,
)
from ._storage import LedgerFile, SampleLog, _replace, read_ledger

__all__ = [
    "PrivacyLedger",
    "LedgerSample",
    "LedgerError",
    "LedgerWarning",
    "TornTail",
    "FORMAT",
    "VERSION",
    "POLICIES",
    "POISSON",
    "FIXED_SIZE",
    "SHUFFLE",
    "CYCLIC",
    "CYCLIC_POISSON",
    "TRUNCATED_POISSON",
    "BALLS_IN_BINS",
    "RANDOM_ALLOCATION",
]


class PrivacyLedger:
    """An append-only, crash-safe record of sampling and sum-query events (McMahan et al. 2018, §6).

    ``PrivacyLedger(path)`` opens ``path`` for appending, creating it with a header if it does
    not exist, and reads back what is already there (an existing ledger is continued; a corrupted
    one raises :class:`LedgerError`). Only one process may hold a ledger open for writing.
    :meth:`load` opens one read-only.

    Typical use is through :class:`dpcore.PrivateAggregator`; by hand::

        sid = ledger.record_sample(n, q, "poisson")   # or poisson_sample(n, q, ledger=ledger)
        ...                                            # accumulate, get_noised_result -> event
        ledger.record_release(event)                   # durable on return
        return result                                  # only now
    """

    def __init__(self, path: "os.PathLike[str] | str", *, privacy_unit: Optional[str] = None) -> None:
        self._path = os.fspath(path)
        if not isinstance(self._path, str):
            raise TypeError("path must be a str or os.PathLike[str]")
        if privacy_unit is not None and (not isinstance(privacy_unit, str) or not privacy_unit.strip()):
            raise ValueError(f"privacy_unit must be a non-empty string such as 'example' or 'user', got {privacy_unit!r}")
        self._file: Optional[LedgerFile] = None
        self._read_only: Optional[str] = None
        self._pending: Optional[LedgerSample] = None
        # Whether the last sample was recorded by this object: a release never attaches to a
        # sample from an earlier run of the ledger.
        self._current = False
        self._file = LedgerFile(self._path, privacy_unit=privacy_unit, stacklevel=3)
        contents = self._file.contents
        self._unit = contents.privacy_unit or DEFAULT_PRIVACY_UNIT
        if privacy_unit is not None and privacy_unit != self._unit:
            self._file.close()
            raise LedgerError(
                f"{self._path}: the ledger records privacy unit {self._unit!r}; it cannot be continued as {privacy_unit!r}"
            )
        self._samples = contents.samples
        self._streams = contents.streams
        self._last_round = contents.last_round
        self.torn_tail: Optional[TornTail] = contents.torn
        self._lines = contents.lines

    @classmethod
    def load(cls, path: "os.PathLike[str] | str", *, strict: bool = False) -> "PrivacyLedger":
        """Reads a ledger without opening it for writing.

        A corrupted line raises :class:`LedgerError` naming the file and line. A torn last line
        is reported with a :class:`LedgerWarning` (a :class:`LedgerError` with ``strict=True``)
        and kept in :attr:`torn_tail`; it is counted when it is a complete entry.
        """
        p = os.fspath(path)
        contents = read_ledger(p, strict=strict)
        self = cls.__new__(cls)
        self._path, self._file, self._pending = p, None, None
        self._read_only = "opened read-only with load()"
        self._current = False
        self._samples, self.torn_tail, self._lines = contents.samples, contents.torn, contents.lines
        self._streams = contents.streams
        self._last_round = contents.last_round
        self._unit = contents.privacy_unit or DEFAULT_PRIVACY_UNIT
        return self

    @classmethod
    def _replica(cls, label: str, samples: Any, privacy_unit: str = "example") -> "PrivacyLedger":
        """An in-memory ledger that follows another process's ledger, for ranks other than 0
        in data-parallel training (:mod:`dpcore.torch`): it starts from that ledger's samples
        and is sent the same entries, so ``get_epsilon`` answers on every rank, while only
        rank 0 writes a file. Nothing it holds is durable."""
        self = cls.__new__(cls)
        self._path, self._read_only, self._pending, self._current = label, None, None, False
        self._file = _MemoryFile(label)  # type: ignore[assignment]
        self._samples = samples.copy() if isinstance(samples, SampleLog) else SampleLog((), samples)
        self._streams = streams_of(self._samples)
        self._last_round = last_round_of(self._samples)
        self.torn_tail, self._lines, self._unit = None, 0, privacy_unit
        return self

    @property
    def is_replica(self) -> bool:
        """True for the in-memory copy that ranks other than 0 keep of rank 0's ledger."""
        return isinstance(self._file, _MemoryFile)

    # -- writing ------------------------------------------------------------------------

    def _writable(self) -> LedgerFile:
        f = self._file
        if f is None or f.closed:
            why = self._read_only or (f.broken if f is not None else None) or "closed"
            raise LedgerError(f"{self._path}: ledger is not open for writing ({why})")
        return f

    def record_sample(
        self,
        population_size: int,
        sampling_probability: Optional[float] = None,
        policy: str = POISSON,
        *,
        sample_size: Optional[int] = None,
        seeded: bool = False,
        round: Optional[int] = None,
        step_in_round: Optional[int] = None,
        round_steps: Optional[int] = None,
        round_selected: Optional[int] = None,
        examples_per_user: Optional[int] = None,
        max_examples_per_user: Optional[int] = None,
    ) -> int:
        """Records that a sample was drawn (§5, §6); returns its id.

        ``policy`` is the policy actually used: ``"poisson"`` (each record independently with
        probability q), ``"truncated_poisson"`` (Poisson at q, capped at ``sample_size`` = B
        records: a uniformly random B of them when more are drawn),
        ``"fixed_size_without_replacement"`` (``sample_size`` = b records uniformly,
        q = b/n), ``"shuffle"`` (batches of a shuffled epoch: never amplified by sampling), for
        matrix-factorization streams ``"cyclic"`` (batch t mod b of a partition cut once;
        ``sample_size`` = the batch's size, q = batch/population) and ``"cyclic_poisson"`` (group
        t mod b, each record with probability q = p), or an allocation policy:
        ``"random_allocation"`` (one step of a round of t = ``round_steps`` steps in which every
        record takes part in exactly k = ``round_selected`` steps, a uniformly random k-subset;
        Feldman & Shenfeld 2025, arXiv 2502.08202) or ``"balls_in_bins"`` (the same with k = 1:
        one of the epoch's t batches; Chua et al. 2025, arXiv 2412.16802). An allocation sample
        names its ``round`` (0, 1, 2, ... over the ledger: :attr:`next_round`) and its
        ``step_in_round`` (0 ≤ s < t); q is k/t. A round's samples must be consecutive, in
        increasing steps, with one t, k, policy and population, and a new round must be
        :attr:`next_round`; otherwise :class:`LedgerError` and nothing is recorded (the
        accountant reads one event per round, which covers only such a round).
        ``seeded``: the sample came from a test seed. The entry is written together with the
        sample's first release (a sample nothing was released from costs no privacy).

        A ledger of privacy unit ``"user"`` states the bound on a user's contribution (at most
        one of the two; both only in such a ledger, else :class:`LedgerError`):
        ``examples_per_user`` = k, user-level sampling (the population and the sample are
        users, each sampled user contributes the clipped mean of at most k of its examples;
        accounted as the example-level analysis with users as records), or
        ``max_examples_per_user`` = K, example-level sampling with a user-level guarantee (each
        user's data bounded to at most K examples in total, examples Poisson-sampled; policy
        ``"poisson"`` only, and one K on every sample of the ledger, since it bounds the whole
        run; accounted as a mixture of Gaussians, Ganesh 2024). A sample of a user-level ledger
        without either is a sample of users whose contribution is clipped as one record. On any
        refusal nothing is recorded.
        """
        self._writable()
        sid = len(self._samples)
        pending = _sample_entry(
            sid, population_size, sampling_probability, policy, sample_size, seeded,
            round, step_in_round, round_steps, round_selected,
            examples_per_user=examples_per_user, max_examples_per_user=max_examples_per_user,
        )
        prev = self._samples[-1] if len(self._samples) else None
        why = check_round(prev, self._last_round, pending) or check_user_bounds(self._unit, prev, pending)
        if why is not None:
            raise LedgerError(f"{self._path}: {why}")
        self._pending = pending
        return sid

    def record_release(self, event: Any) -> None:
        """Records the sum queries of ``event`` under the current sample, durably.

        ``event`` is what a query's ``get_noised_result`` returned. The entries are validated,
        written with one ``write`` and fsynced before this returns; return the noised result only
        afterwards. On any error nothing is written.

        A step of a matrix-factorization stream (``SumQueryEvent(mechanism="matrix_factorization")``)
        must be released on a sample whose policy its participation schema declares (``"cyclic"``,
        or ``"cyclic_poisson"`` at its p), and declare what the stream's first release declared;
        otherwise :class:`LedgerError`. The first release of a stream records its declaration.
        """
        f = self._writable()
        tuples, non_private = _tuples_of(event)
        if self._pending is not None:
            sample = self._pending
        elif self._current:
            sample = self._samples[-1]  # a further release on this session's current sample
        else:
            raise LedgerError(
                f"{self._path}: no sample recorded: call record_sample (or draw with a sampler given ledger=) first"
            )
        new_streams: dict = {}
        if any(t.stream is not None for t in tuples):
            try:
                tuples, new_streams = _stream_entries(sample, tuples, self._streams)
            except LedgerError as e:
                raise LedgerError(f"{self._path}: {e}") from None
        entries = _release_entries(
            sample, tuples, non_private, with_sample=self._pending is not None, new_streams=new_streams
        )
        f.write(entries)
        if _trace.active():
            for e in entries:
                _trace.ledger(e)
        self._streams.update(new_streams)
        updated = _replace(sample, queries=sample.queries + tuple(tuples), non_private=sample.non_private or non_private)
        if self._pending is not None:
            self._samples.append(updated)
            self._pending = None
            self._current = True
            if updated.allocation:
                self._last_round = updated.round
        else:
            self._samples[-1] = updated
        self._lines += len(entries)

    def close(self) -> None:
        """Releases the file (all entries are already durable)."""
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "PrivacyLedger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- reading and accounting -----------------------------------------------------------

    path = readonly[str]("_path", "The ledger file.")
    privacy_unit = readonly[str]("_unit", 'What one record is ("example" unless the ledger was created with another unit).')

    @property
    def samples(self) -> Tuple[LedgerSample, ...]:
        """The recorded samples with their releases, in order (the pending sample excluded)."""
        return tuple(self._samples)

    @property
    def streams(self) -> Dict[str, Any]:
        """The matrix-factorization streams recorded, by id: each one's
        :class:`~dpcore.matrix_factorization.StreamDeclaration` (strategy, participation schema,
        planned steps), as its first release declared it."""
        from ._entries import _declaration

        return {sid: _declaration(text) for sid, text in self._streams.items()}

    @property
    def next_round(self) -> int:
        """The index the next allocation round (balls-in-bins, random allocation) must record:
        one more than the last round recorded, 0 for the first. A round none of whose steps was
        released is not recorded, so its index is given again."""
        return 0 if self._last_round is None else self._last_round + 1

    @property
    def num_releases(self) -> int:
        """Samples from which something was released (the steps that cost privacy)."""
        return sum(k for s, k in self._samples.runs() if s.released)

    def __repr__(self) -> str:
        return f"PrivacyLedger({self._path!r}, samples={len(self._samples)})"

    @property
    def neighboring(self) -> str:
        """The neighbouring relation this run's ε is stated under by default: ``"zero_out"``
        (one record replaced by one contributing nothing, the number of records public) when any
        release used shuffled, fixed-order or fixed batches or a matrix-factorization stream,
        whose add-or-remove bounds pay for the batches shifting; else ``"add_or_remove"``.
        Every method that takes ``neighboring=`` uses this one when it is None; see the
        "Neighbouring relations" section of the accounting docs."""
        return run_relation(self._samples)

    def to_event(self, neighboring: Optional[str] = None) -> Any:
        """The whole ledger as one accountant event (``dpcore.accounting``), McMahan et al. §6.

        Each sample with releases becomes one Gaussian event whose noise multiplier comes from
        Eq. (1) over its sum queries, wrapped by its sampling policy: Poisson →
        ``PoissonSampledEvent(q, ·)``; truncated Poisson → ``TruncatedPoissonSampledEvent(q, B,
        n, ·)``; fixed size → ``SampledWithoutReplacementEvent(n, b, ·)``;
        shuffle → the bare ``GaussianEvent`` (no amplification: a shuffled epoch is not a random
        sample and has no tight analysis, §5), with a :class:`LedgerWarning`. A sample with a
        non-private release becomes ``NonPrivateEvent`` (ε = ∞). Each allocation round (however
        many of its steps were released) becomes one ``RandomAllocationSampledEvent(t, k, ·)`` or
        ``BallsInBinsSampledEvent(t, ·)`` of a Gaussian with the smallest z of its steps (see
        :mod:`dpcore.ledger._events`; add-or-remove only). A Poisson sample recorded with
        ``max_examples_per_user`` K ≥ 2 (example-level sampling, user-level guarantee) becomes
        the mixture-of-Gaussians step ``example_level_sampling_event(q, z, K)``
        (:class:`~dpcore.events.MixtureOfGaussiansEvent`; K = 1 is the Poisson event). Runs of
        equal events are composed with ``SelfComposedEvent``.

        The steps of each matrix-factorization stream are left out of Eq. (1) and accounted
        together, after the per-sample events: ``GaussianEvent(z/sens)`` for cyclic fixed
        batches, ``SelfComposedEvent(PoissonSampledEvent(p, GaussianEvent(z/sens)), ⌈m/b⌉)`` for
        cyclic Poisson sampling, with z the smallest σ/S of its m steps and sens the strategy's
        sensitivity recomputed for m steps from the recorded declaration
        (:func:`dpcore.ledger._events.account_streams`). Other queries on cyclic samples are
        accounted like shuffled ones (no amplification), with a warning.

        ``neighboring`` (None: :attr:`neighboring`, the run's relation) fixes what the noise
        multiplier is relative to. The recorded S_g bound one record's contribution, which is the
        sensitivity under ``"add_or_remove"`` and ``"zero_out"`` for a sampled step: z = 1/S*
        (Eq. (1)). Replacing a record moves each group's sum by up to 2·S_g, so under
        ``"replace_one"`` z = 1/(2·S*) (exact: a halving). For microbatches recorded with the
        doubled bound 2C this double-counts under replace-one (the survey's footnote 27 gives 2C
        there too): the ε is then an upper bound, not tight. Shuffled, fixed-order and fixed
        batches are accounted per epoch under each relation as :mod:`dpcore.ledger._events`
        says (zero-out: C once an epoch; add-or-remove: a record shifts the batches).
        """
        return samples_to_event(self._samples, self._path, self._relation(neighboring))

    def _relation(self, neighboring: Optional[str]) -> str:
        return self.neighboring if neighboring is None else check_neighboring(neighboring)

    def get_epsilon(
        self,
        delta: float,
        accountant: str = DEFAULT_ACCOUNTANT,
        *,
        neighboring: Optional[str] = None,
        orders: Any = None,
    ) -> float:
        """ε such that everything released under this ledger is (ε, δ)-DP (an upper bound)
        under ``neighboring`` (None: :attr:`neighboring`, the run's relation; ε is never
        comparable across relations).

        ``accountant="pld"`` (the default): :class:`dpcore.accounting.PldAccountant` over
        :meth:`to_event`, the tightest bound. When the ledger holds an event the PLD accountant
        cannot analyse (fixed-size samples without replacement), the *whole* ledger is accounted
        with RDP instead, with a :class:`LedgerWarning`: one ε always comes from one analysis.

        ``accountant="rdp"``: :class:`dpcore.accounting.RdpAccountant` (``orders`` is its grid of
        Rényi orders, and is accepted with RDP only). The RDP analyses exist for Poisson samples
        under ``neighboring="add_or_remove"`` and for fixed-size samples without replacement
        under ``"replace_one"``; a ledger is accounted under one relation, so it must not mix
        those two policies.
        """
        return self._accountant(accountant, neighboring, orders).get_epsilon(delta)

    def report(self, delta: float, *, neighboring: Optional[str] = None, accountant: str = DEFAULT_ACCOUNTANT) -> Any:
        """The privacy report of this ledger at ``delta`` (:class:`~dpcore.ledger.PrivacyReport`):
        the checklist of Ponomareva et al. 2023, §5.3.3 (setting, unit, neighbouring relation,
        data accesses, mechanism, accounting, assumptions), ε exactly as :meth:`get_epsilon`
        with the PLD lower bound and RDP beside it, and the file's SHA-256."""
        from ._report import build_report

        return build_report(self, delta, neighboring=self._relation(neighboring), accountant=accountant)

    def epsilon_curve(self, delta: float, *, points: int = 200, accountants: Any = ("pld", "rdp"), **kw: Any) -> Any:
        """ε after the first t releases for about ``points`` values of t, under each accountant
        (see :func:`dpcore.ledger._report.epsilon_curve`)."""
        from ._report import epsilon_curve

        return epsilon_curve(self, delta, points=points, accountants=accountants, **kw)

    def get_delta(
        self,
        epsilon: float,
        accountant: str = DEFAULT_ACCOUNTANT,
        *,
        neighboring: Optional[str] = None,
        orders: Any = None,
    ) -> float:
        """δ such that everything released under this ledger is (ε, δ)-DP (an upper bound).

        The accountant is chosen as in :meth:`get_epsilon`, with the same whole-ledger fallback
        from PLD to RDP.
        """
        return self._accountant(accountant, neighboring, orders).get_delta(epsilon)

    def _accountant(self, accountant: str, neighboring: Optional[str], orders: Any) -> Any:
        """An accountant of the requested kind holding the whole ledger (or RDP, see
        :meth:`get_epsilon`). Warnings are attributed to the caller of get_epsilon/get_delta."""
        check_accountant(accountant)
        neighboring = self._relation(neighboring)
        if orders is not None and accountant != "rdp":
            raise ValueError(f"orders are Rényi orders, for accountant='rdp' only (got accountant={accountant!r})")
        event = None
        if accountant == "pld":
            event = samples_to_event(self._samples, self._path, neighboring, stacklevel=4)
            acct = make_accountant("pld", analysis_relation(neighboring))
            if acct.supports(event):
                acct.compose(event)
                return acct
            # Not PLD for the part it supports plus RDP for the rest: joining two (ε, δ) from
            # different analyses needs a split of δ and basic composition, looser than either
            # analysis and easy to get wrong. One analysis of everything is what ε then means.
            kinds = _unsupported_kinds(acct, event)
            warnings.warn(
                f"{self._path}: the ledger holds "
                + (f"{', '.join(kinds)} events" if kinds else "events")
                + f" (neighboring={neighboring!r}), which cannot be analysed by the PLD accountant; "
                "the whole ledger is accounted with RDP instead",
                LedgerWarning,
                stacklevel=3,
            )
        why = rdp_relation_error(self._samples, self._path, neighboring)
        if why is not None:
            raise ValueError(why)
        if event is None:
            # Built after the relation check, so a refused ledger raises before any warning.
            event = samples_to_event(self._samples, self._path, neighboring, stacklevel=4)
        acct = make_accountant("rdp", analysis_relation(neighboring), orders=orders)
        acct.compose(event)
        return acct


class _MemoryFile:
    """The file interface of a replica: entries are kept only in the ledger's own lists."""

    broken: Optional[str] = None

    def __init__(self, label: str) -> None:
        self.path, self.closed = label, False

    def write(self, entries: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _unsupported_kinds(acct: Any, event: Any) -> List[str]:
    """Names of the ledger's top-level event kinds that ``acct`` cannot analyse, for messages."""
    kinds: List[str] = []
    for part in getattr(event, "events", ()):
        if acct.supports(part):
            continue
        inner = part.event if isinstance(part, SelfComposedEvent) else part
        # Name the mechanism when the sampling is fine but what it samples is not.
        mech = getattr(inner, "event", None)
        name = type(inner).__name__ + (f"({type(mech).__name__})" if mech is not None else "")
        if name not in kinds:
            kinds.append(name)
    return kinds
