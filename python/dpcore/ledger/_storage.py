"""The ledger file: format, validation, parsing, torn-tail handling and durable appends.

This implements the file format and the durability rules described in :mod:`dpcore.ledger`.
Nothing here knows about accountants; :mod:`._events` turns what is read into accountant events.
Every value is validated before anything is written; on bad input nothing is written.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .. import _core
from .._validate import count as _int, probability
from ..events import (
    MATRIX_FACTORIZATION,
    ComposedQueryEvent,
    NonPrivateQueryEvent,
    SumQueryEvent,
    check_stream_id,
    effective_noise_multiplier,
    is_discrete,
    is_matrix_factorization,
)

FORMAT = "dpcore-privacy-ledger"
VERSION = 1
POISSON = "poisson"
FIXED_SIZE = "fixed_size_without_replacement"
SHUFFLE = "shuffle"
#: Fixed batches of a partition cut once, batch t mod b at step t (matrix-factorization
#: pipelines): ``sample_size`` is the batch's size, ``sampling_probability`` batch/population.
CYCLIC = "cyclic"
#: Group t mod b of a partition cut once, each of its records with probability p (amplified
#: banded matrix factorization): ``sampling_probability`` is p.
CYCLIC_POISSON = "cyclic_poisson"
#: A Poisson sample at q capped at ``sample_size`` = B records (a uniformly random B of them
#: when more are drawn): ``sampling_probability`` is q.
TRUNCATED_POISSON = "truncated_poisson"
#: One epoch of b steps in which every record takes part in exactly one step, chosen uniformly
#: and independently (Chua et al. 2025, arXiv 2412.16802): ``sampling_probability`` is 1/b.
BALLS_IN_BINS = "balls_in_bins"
#: One round of t steps in which every record takes part in exactly k of them, a uniformly random
#: k-subset chosen independently (Feldman & Shenfeld 2025, arXiv 2502.08202):
#: ``sampling_probability`` is k/t.
RANDOM_ALLOCATION = "random_allocation"
#: Batches of the records in a fixed order (a DataLoader without shuffle): ``sample_size`` is
#: the batch size, ``sampling_probability`` batch/population. Told apart from ``shuffle`` (a fresh
#: permutation every epoch) because adding or removing a record shifts every later batch.
SEQUENTIAL = "sequential"
# Appended, never reordered: the core's fast reader numbers the first three policies (and
# refuses every other one, so that this reader handles them).
POLICIES = (POISSON, FIXED_SIZE, SHUFFLE, CYCLIC, CYCLIC_POISSON, TRUNCATED_POISSON, BALLS_IN_BINS, RANDOM_ALLOCATION,
            SEQUENTIAL)
#: The policies of epochs without amplification: each record in at most one batch of an epoch.
#: Their samples may carry the epoch as a round (:data:`ROUND_KEYS`, round_selected 1), which the
#: accountant then reads per epoch; without it (ledgers written before), per step.
EPOCH_POLICIES = (SHUFFLE, SEQUENTIAL)
#: The policies whose privacy rests on a round of steps rather than on each step: their sample
#: entries carry the round (:data:`ROUND_KEYS`), and the accountant reads one event per round.
ALLOCATION_POLICIES = (BALLS_IN_BINS, RANDOM_ALLOCATION)
#: The keys that the sample entries of an allocation policy add (and no other policy has): the
#: round's index in the ledger (0, 1, 2, ... over all allocation rounds), the step's index within
#: its round, the round's t (steps) and k (steps each record takes part in; 1 for balls-in-bins).
ROUND_KEYS = ("round", "step_in_round", "round_steps", "round_selected")
#: What one record of the ledger's population is (the unit of privacy, Ponomareva et al. 2023,
#: §5.3.3): recorded in the header when a ledger is created. Ledgers written before it was
#: recorded are example-level.
DEFAULT_PRIVACY_UNIT = "example"

try:  # advisory lock so that two processes never append to one ledger
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - non-POSIX
    _fcntl = None  # type: ignore[assignment]


class LedgerError(ValueError):
    """A ledger file that cannot be read or written as a ledger (names the file and line)."""


class LedgerWarning(UserWarning):
    """Something the accountant's user must know: a torn last line, a shuffled policy, a seed."""


@dataclass(frozen=True)
class TornTail:
    """An incomplete last line (no newline) left by a process that stopped mid-write."""

    line: int
    fragment: str
    #: True when the fragment is a complete, valid entry that only lacks its newline; such an
    #: entry is counted (over-counting is safe).
    counted: bool


@dataclass(frozen=True)
class LedgerSample:
    """One sampling event and the sum queries released on it."""

    sample: int
    population_size: int
    sampling_probability: float
    policy: str
    sample_size: Optional[int] = None
    seeded: bool = False
    queries: Tuple[SumQueryEvent, ...] = ()
    non_private: bool = False
    #: Allocation policies only (None otherwise): the round, the step within it, t and k.
    round: Optional[int] = None
    step_in_round: Optional[int] = None
    round_steps: Optional[int] = None
    round_selected: Optional[int] = None

    @property
    def allocation(self) -> bool:
        """Whether the sample is one step of a round: an allocation round (balls-in-bins,
        random allocation) or an epoch of a shuffled or fixed-order loader recorded with its
        epoch; accounted per round, not per step."""
        return self.round is not None

    @property
    def released(self) -> bool:
        return bool(self.queries) or self.non_private

    @property
    def independent_queries(self) -> Tuple[SumQueryEvent, ...]:
        """The sum queries with independent noise (all but the steps of matrix-factorization
        streams): the ones Eq. (1) combines on this sample."""
        if not any(is_matrix_factorization(t) for t in self.queries):
            return self.queries
        return tuple(t for t in self.queries if not is_matrix_factorization(t))

    def stream_queries(self) -> Dict[str, Tuple[SumQueryEvent, ...]]:
        """The steps of matrix-factorization streams released on this sample, by stream id
        (in order of first appearance)."""
        out: Dict[str, Tuple[SumQueryEvent, ...]] = {}
        for t in self.queries:
            if is_matrix_factorization(t) and t.stream is not None:
                out[t.stream] = out.get(t.stream, ()) + (t,)
        return out

    def noise_multiplier(self) -> float:
        """z of the sample's independent sum queries together, Eq. (1); 0 when any release is
        non-private; ∞ when every query on it is a step of a matrix-factorization stream (those
        are accounted per stream, over all their steps: :mod:`dpcore.ledger._events`)."""
        if self.non_private:
            return 0.0
        queries = self.independent_queries
        if not queries and self.queries:
            return math.inf
        return effective_noise_multiplier(queries)

    @property
    def discrete(self) -> bool:
        """Whether a query on this sample used the discrete Gaussian mechanism."""
        return is_discrete(self.queries)


# ----------------------------------------------------------------------------- validation



def _prob(v: Any) -> float:
    return probability("sampling_probability", v)


def _sample_entry(
    sample: int,
    population_size: Any,
    sampling_probability: Any,
    policy: Any,
    sample_size: Any,
    seeded: Any,
    round: Any = None,
    step_in_round: Any = None,
    round_steps: Any = None,
    round_selected: Any = None,
) -> LedgerSample:
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, got {type(policy).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if not isinstance(seeded, bool):
        raise TypeError(f"seeded must be a bool, got {type(seeded).__name__}")
    n = _int("population_size", population_size, 1)
    b = None if sample_size is None else _int("sample_size", sample_size, 0)
    if b is not None and b > n:
        raise ValueError(f"sample_size must be <= population_size {n}, got {b}")
    if policy == FIXED_SIZE:
        if b is None:
            raise ValueError("policy fixed_size_without_replacement needs sample_size")
        q = b / n
        if sampling_probability is not None and _prob(sampling_probability) != q:
            raise ValueError(
                f"sampling_probability {sampling_probability} differs from sample_size/population_size = {q}"
            )
    rounds = (round, step_in_round, round_steps, round_selected)
    if policy in ALLOCATION_POLICIES:
        return _allocation_entry(sample, n, sampling_probability, policy, b, seeded, *rounds)
    if policy in EPOCH_POLICIES and any(v is not None for v in rounds):
        return _epoch_entry(sample, n, sampling_probability, policy, b, seeded, *rounds)
    if any(v is not None for v in rounds):
        raise ValueError(
            f"round, step_in_round, round_steps and round_selected belong to allocation and epoch policies, not to {policy}"
        )
    if policy == CYCLIC_POISSON:
        # p is the schema's; a realised batch size says nothing about it.
        if sampling_probability is None:
            raise ValueError("policy cyclic_poisson needs sampling_probability (the p of each record of the group)")
        q = _prob(sampling_probability)
    elif policy == TRUNCATED_POISSON:
        # q is the Poisson rate and B the cap; the accountant needs both (and n).
        if sampling_probability is None or b is None:
            raise ValueError(
                "policy truncated_poisson needs sampling_probability (q) and sample_size (the cap B on the batch)"
            )
        if b < 1:
            raise ValueError("policy truncated_poisson: sample_size (the cap B) must be >= 1")
        q = _prob(sampling_probability)
    else:
        q = _rate(policy, sampling_probability, b, n)
    return LedgerSample(sample, n, q, policy, b, seeded)


def _rate(policy: str, sampling_probability: Any, b: Optional[int], n: int) -> float:
    """q as given, else b/n."""
    if sampling_probability is None:
        if b is None:
            raise ValueError(f"policy {policy} needs sampling_probability or sample_size")
        return b / n
    return _prob(sampling_probability)


def _round_keys(what: str, round: Any, step_in_round: Any, round_steps: Any, round_selected: Any) -> Tuple[int, int, int, int]:
    """(round, step in it, t, k), checked: all given, k ≤ t, the step < t."""
    if any(v is None for v in (round, step_in_round, round_steps, round_selected)):
        raise ValueError(f"{what} needs round, step_in_round, round_steps and round_selected")
    r = _int("round", round, 0)
    t = _int("round_steps", round_steps, 1)
    k = _int("round_selected", round_selected, 1)
    s = _int("step_in_round", step_in_round, 0)
    if k > t:
        raise ValueError(f"round_selected must be <= round_steps = {t}, got {k}")
    if s >= t:
        raise ValueError(f"step_in_round must be < round_steps = {t}, got {s}")
    return r, s, t, k


def _allocation_entry(
    sample: int, n: int, sampling_probability: Any, policy: str, b: Optional[int], seeded: bool,
    round: Any, step_in_round: Any, round_steps: Any, round_selected: Any,
) -> LedgerSample:
    """A sample of an allocation policy: one step of a round of t steps in which every record
    takes part in k of them. q is k/t, the rate at which a record takes part in a step."""
    r, s, t, k = _round_keys(f"policy {policy}", round, step_in_round, round_steps, round_selected)
    if policy == BALLS_IN_BINS and k != 1:
        raise ValueError(f"policy balls_in_bins puts every record in one step of the epoch: round_selected must be 1, got {k}")
    if b is not None:
        raise ValueError(f"policy {policy} has no sample_size (its batches vary in size)")
    q = k / t
    if sampling_probability is not None and _prob(sampling_probability) != q:
        raise ValueError(f"sampling_probability {sampling_probability} differs from round_selected/round_steps = {q}")
    return LedgerSample(sample, n, q, policy, None, seeded, round=r, step_in_round=s, round_steps=t, round_selected=k)


def _epoch_entry(
    sample: int, n: int, sampling_probability: Any, policy: str, b: Optional[int], seeded: bool,
    round: Any, step_in_round: Any, round_steps: Any, round_selected: Any,
) -> LedgerSample:
    """A batch of an epoch of a shuffled or fixed-order loader, with its epoch as a round: the
    round's index, the batch's index in the epoch, the epoch's t batches and k = 1 (each record
    in at most one batch of the epoch). A resumed epoch is a new round (its order is a new one)."""
    r, s, t, k = _round_keys(f"policy {policy} with an epoch", round, step_in_round, round_steps, round_selected)
    if k != 1:
        raise ValueError(f"policy {policy}: every record is in at most one batch of an epoch, round_selected must be 1, got {k}")
    q = _rate(policy, sampling_probability, b, n)
    return LedgerSample(sample, n, q, policy, b, seeded, round=r, step_in_round=s, round_steps=t, round_selected=k)


def check_round(prev: Optional[LedgerSample], last_round: Optional[int], s: LedgerSample) -> Optional[str]:
    """Why ``s`` cannot follow the ledger's samples, or None. ``prev`` is the ledger's last
    sample and ``last_round`` the index of its last allocation round (None: none yet).

    The accountant reads one event per allocation round (:mod:`._events`), which covers that
    round's steps only if they are what the round's analysis assumes: a round's samples are
    consecutive (nothing else released between them), at most t of them, in increasing order of
    their step, with the same t, k, policy and population; round indices increase by one."""
    if not s.allocation:
        return None
    if prev is not None and prev.allocation and prev.round == s.round:
        if (prev.policy, prev.round_steps, prev.round_selected, prev.population_size) != (
            s.policy, s.round_steps, s.round_selected, s.population_size
        ):
            return (
                f"round {s.round} changes its sampler: {prev.policy} with t={prev.round_steps}, k={prev.round_selected} "
                f"over {prev.population_size} records, then {s.policy} with t={s.round_steps}, k={s.round_selected} "
                f"over {s.population_size}"
            )
        if s.step_in_round <= prev.step_in_round:  # type: ignore[operator]
            return (
                f"round {s.round}: step {s.step_in_round} follows step {prev.step_in_round}; a round's steps are "
                "recorded once each, in order"
            )
        return None
    expected = 0 if last_round is None else last_round + 1
    if s.round != expected:
        if s.round == last_round:
            return (
                f"round {s.round} is over (other samples followed its last step): a round's samples are "
                f"consecutive; the next round is {expected}"
            )
        return f"round {s.round} out of sequence: round indices increase by one, the next round is {expected}"
    return None


def last_round_of(samples: Any) -> Optional[int]:
    """The index of the last allocation round among ``samples`` (None: there is none)."""
    runs = samples.runs() if isinstance(samples, SampleLog) else [(s, 1) for s in samples]
    for s, _ in reversed(runs):
        if s.allocation:
            return s.round
    return None


# ----------------------------------------------------------------------------- MF streams


def _declaration(text: Any) -> Any:
    """The :class:`~dpcore.matrix_factorization.StreamDeclaration` of a declaration text, fully
    checked (imported here: a ledger without matrix-factorization streams never loads it)."""
    from ..matrix_factorization._accounting import StreamDeclaration

    return StreamDeclaration.from_json(text)


def _declaration_of_entry(obj: Dict[str, Any]) -> Any:
    from ..matrix_factorization._accounting import StreamDeclaration

    return StreamDeclaration.from_dict({k: obj[k] for k in ("strategy", "participation", "steps")})


def _check_stream_policy(sample: LedgerSample, stream: str, declaration: Any) -> Optional[str]:
    """Why the steps of ``stream`` cannot have been released on ``sample``, or None: its
    sampling policy must be the one the stream's participation schema declares."""
    part = declaration.participation
    if sample.policy != part.kind:
        return (
            f"sample {sample.sample} has policy {sample.policy!r}, but matrix-factorization stream {stream} declares "
            f"{part.kind!r} participation ({part.describe()}); its steps must be released on {part.kind!r} samples"
        )
    if part.kind == CYCLIC_POISSON and sample.sampling_probability != part.sampling_probability:
        return (
            f"sample {sample.sample} was drawn with sampling_probability {sample.sampling_probability!r}, but "
            f"matrix-factorization stream {stream} declares p = {part.sampling_probability!r}"
        )
    return None


def _stream_entries(
    sample: LedgerSample, tuples: List[SumQueryEvent], streams: Dict[str, str]
) -> Tuple[List[SumQueryEvent], Dict[str, str]]:
    """The tuples to record, their declarations replaced by the canonical text of the stream
    (the one already recorded, or the normalised new one), and the streams this release
    declares first (id → canonical text). Raises :class:`LedgerError` for a declaration that
    differs from the stream's recorded one, or a sample whose policy does not match it."""
    new: Dict[str, str] = {}
    out: List[SumQueryEvent] = []
    for t in tuples:
        if not is_matrix_factorization(t):
            out.append(t)
            continue
        sid = t.stream
        assert sid is not None
        known = streams.get(sid, new.get(sid))
        try:
            if known is not None and t.declaration == known:  # the common case: the recorded text itself
                dec, text = _declaration(known), known
            else:
                dec = _declaration(t.declaration)
                text = dec.to_json()
        except (TypeError, ValueError) as e:
            raise LedgerError(f"matrix-factorization stream {sid}: invalid declaration: {e}") from None
        if known is None:
            new[sid] = known = text
        elif known != text:
            raise LedgerError(
                f"matrix-factorization stream {sid}: the declaration changed; the ledger records {known}, this "
                f"release declares {text}. A stream's strategy, participation schema and planned steps are fixed "
                "(start a new query, with a new stream id, for a new schedule)"
            )
        why = _check_stream_policy(sample, sid, dec)
        if why is not None:
            raise LedgerError(why)
        out.append(SumQueryEvent(t.l2_norm_clip, t.stddev, MATRIX_FACTORIZATION, sid, known))
    return out, new


def streams_of(samples: Any) -> Dict[str, str]:
    """The matrix-factorization streams (id → canonical declaration text) of these samples."""
    out: Dict[str, str] = {}
    runs = samples.runs() if isinstance(samples, SampleLog) else [(s, 1) for s in samples]
    for s, _ in runs:
        for t in s.queries:
            if is_matrix_factorization(t) and t.stream not in out:
                out[t.stream] = t.declaration  # type: ignore[index,assignment]
    return out


def _tuples_of(event: Any) -> Tuple[List[SumQueryEvent], bool]:
    """The (re-validated) privacy tuples of a query event, and whether any part is non-private."""
    tuples: List[SumQueryEvent] = []
    non_private = False

    def walk(e: Any, depth: int) -> None:
        nonlocal non_private
        if depth > 1000:
            raise ValueError("event nests too deeply")
        if isinstance(e, SumQueryEvent):
            # Rebuilt so that an event mutated behind the frozen dataclass is checked again.
            tuples.append(SumQueryEvent(e.l2_norm_clip, e.stddev, e.mechanism, e.stream, e.declaration))
        elif isinstance(e, NonPrivateQueryEvent):
            non_private = True
        elif isinstance(e, ComposedQueryEvent):
            for x in e.events:
                walk(x, depth + 1)
        else:
            raise TypeError(
                "event must be a query event (SumQueryEvent, ComposedQueryEvent or NonPrivateQueryEvent), "
                f"got {type(e).__name__}"
            )

    walk(event, 0)
    if not tuples and not non_private:
        raise ValueError("event holds no sum query: nothing to record")
    return tuples, non_private


def _release_entries(
    sample: LedgerSample,
    tuples: List[SumQueryEvent],
    non_private: bool,
    *,
    with_sample: bool,
    new_streams: Optional[Dict[str, str]] = None,
) -> List[Dict[str, Any]]:
    """The entries recording one release on ``sample`` (preceded by the sample's own entry on
    its first release, then by the ``mf_stream`` entry of each stream this release declares
    first)."""
    entries: List[Dict[str, Any]] = []
    if with_sample:
        entries.append(
            {
                "type": "sample",
                "sample": sample.sample,
                "population_size": sample.population_size,
                "sampling_probability": sample.sampling_probability,
                "policy": sample.policy,
                "sample_size": sample.sample_size,
                "seeded": sample.seeded,
            }
        )
        if sample.allocation:  # only then: other entries keep the format every earlier reader accepts
            entries[-1].update({k: getattr(sample, k) for k in ROUND_KEYS})
    for sid, text in (new_streams or {}).items():
        d = json.loads(text)
        entries.append(
            {"type": "mf_stream", "stream": sid, "strategy": d["strategy"], "participation": d["participation"], "steps": d["steps"]}
        )
    for t in tuples:
        entry = {"type": "sum_query", "sample": sample.sample, "l2_norm_clip": t.l2_norm_clip, "stddev": t.stddev}
        if t.mechanism != "gaussian":
            # Only then: a Gaussian entry keeps the format every earlier reader (and the fast
            # reader in the core) accepts.
            entry["mechanism"] = t.mechanism
        if t.stream is not None:
            entry["stream"] = t.stream
        entries.append(entry)
    if non_private:
        entries.append({"type": "non_private", "sample": sample.sample})
    return entries


def _dumps(entry: Dict[str, Any]) -> str:
    return json.dumps(entry, allow_nan=False, ensure_ascii=True, separators=(", ", ": ")) + "\n"


# ----------------------------------------------------------------------------- parsing


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid ledger value")


def _parse_line(raw: bytes, lineno: int, path: str) -> Dict[str, Any]:
    def bad(why: str) -> LedgerError:
        return LedgerError(f"{path}, line {lineno}: corrupted ledger entry ({why}): {raw[:200]!r}")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("not UTF-8") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise bad(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad("not a JSON object")
    return obj


def _expect_keys(obj: Dict[str, Any], keys: Tuple[str, ...], lineno: int, path: str) -> None:
    if set(obj) != set(keys):
        missing = sorted(set(keys) - set(obj))
        extra = sorted(set(obj) - set(keys))
        raise LedgerError(
            f"{path}, line {lineno}: corrupted {obj.get('type')!r} entry (missing keys {missing}, unexpected {extra})"
        )


@dataclass
class _Contents:
    samples: "SampleLog" = field(default_factory=lambda: SampleLog())
    torn: Optional[TornTail] = None
    lines: int = 0
    valid_bytes: int = 0  # bytes up to the end of the last complete line
    has_header: bool = False
    privacy_unit: Optional[str] = None
    #: Matrix-factorization streams declared so far: id → canonical declaration text.
    streams: Dict[str, str] = field(default_factory=dict)
    #: The index of the last allocation round read (None: none).
    last_round: Optional[int] = None


_SAMPLE_KEYS = ("type", "sample", "population_size", "sampling_probability", "policy", "sample_size", "seeded")


def _apply(c: _Contents, obj: Dict[str, Any], lineno: int, path: str) -> None:
    """Adds one parsed entry to ``c``, checking it thoroughly."""
    if lineno == 1:
        if obj.get("format") != FORMAT:
            raise LedgerError(f"{path}, line 1: not a dpcore privacy ledger (header {obj!r})")
        if obj.get("version") != VERSION:
            raise LedgerError(
                f"{path}, line 1: ledger format version {obj.get('version')!r} is not supported (this dpcore reads {VERSION})"
            )
        if "privacy_unit" in obj:
            _expect_keys(obj, ("format", "version", "privacy_unit"), 1, path)
            unit = obj["privacy_unit"]
            if not isinstance(unit, str) or not unit:
                raise LedgerError(f"{path}, line 1: privacy_unit must be a non-empty string, got {unit!r}")
            c.privacy_unit = unit
        else:
            _expect_keys(obj, ("format", "version"), 1, path)
        c.has_header = True
        return
    kind = obj.get("type")
    try:
        if kind == "sample":
            allocation = obj.get("policy") in ALLOCATION_POLICIES or (obj.get("policy") in EPOCH_POLICIES and "round" in obj)
            _expect_keys(obj, _SAMPLE_KEYS + ROUND_KEYS if allocation else _SAMPLE_KEYS, lineno, path)
            sid = _int("sample", obj["sample"], 0)
            if sid != len(c.samples):
                raise ValueError(f"sample id {sid} out of sequence (expected {len(c.samples)})")
            s = _sample_entry(
                sid, obj["population_size"], obj["sampling_probability"], obj["policy"], obj["sample_size"], obj["seeded"],
                *(obj[k] for k in ROUND_KEYS if allocation),
            )
            why = check_round(c.samples[-1] if c.samples else None, c.last_round, s)
            if why is not None:
                raise ValueError(why)
            c.samples.append(s)
            if s.allocation:
                c.last_round = s.round
        elif kind == "mf_stream":
            _expect_keys(obj, ("type", "stream", "strategy", "participation", "steps"), lineno, path)
            stream = check_stream_id(obj["stream"])
            if stream in c.streams:
                raise ValueError(f"matrix-factorization stream {stream} is declared twice")
            c.streams[stream] = _declaration_of_entry(obj).to_json()
        elif kind in ("sum_query", "non_private"):
            keys: Tuple[str, ...] = ("type", "sample", "l2_norm_clip", "stddev") if kind == "sum_query" else ("type", "sample")
            if kind == "sum_query" and "mechanism" in obj:
                keys += ("mechanism",)
            if kind == "sum_query" and obj.get("mechanism") == MATRIX_FACTORIZATION:
                keys += ("stream",)
            _expect_keys(obj, keys, lineno, path)
            sid = _int("sample", obj["sample"], 0)
            if not c.samples or sid != c.samples[-1].sample:
                raise ValueError(f"refers to sample {sid}, which is not the current sample")
            last = c.samples[-1]
            if kind == "sum_query":
                for k in ("l2_norm_clip", "stddev"):
                    if isinstance(obj[k], bool) or not isinstance(obj[k], (int, float)):
                        raise TypeError(f"{k} must be a number")
                mech = obj.get("mechanism", "gaussian")
                if not isinstance(mech, str) or mech == "gaussian" and "mechanism" in obj:
                    raise ValueError(f"mechanism must be a non-default mechanism name, got {mech!r}")
                mf_id: Optional[str] = None
                declaration: Optional[str] = None
                if mech == MATRIX_FACTORIZATION:
                    mf_id = check_stream_id(obj["stream"])
                    declaration = c.streams.get(mf_id)
                    if declaration is None:
                        raise ValueError(f"refers to matrix-factorization stream {mf_id}, which no mf_stream entry declares")
                t = SumQueryEvent(obj["l2_norm_clip"], obj["stddev"], mech, mf_id, declaration)
                c.samples[-1] = _replace(last, queries=last.queries + (t,))
            else:
                c.samples[-1] = _replace(last, non_private=True)
        elif kind == "torn_tail_repaired":
            _expect_keys(obj, ("type", "line", "fragment"), lineno, path)
            if not isinstance(obj["fragment"], str):
                raise TypeError("fragment must be a string")
            _int("line", obj["line"], 1)
        else:
            raise ValueError(f"unknown entry type {kind!r}")
    except (TypeError, ValueError) as e:
        if isinstance(e, LedgerError):
            raise
        raise LedgerError(f"{path}, line {lineno}: corrupted {kind!r} entry: {e}") from None


def _replace(s: LedgerSample, **kw: Any) -> LedgerSample:
    d = dict(s.__dict__)
    d.update(kw)
    return LedgerSample(**d)


class SampleLog:
    """The samples of a ledger, in order: runs of samples identical but for their ids (as the
    fast reader returns them for a long ledger), then samples appended one at a time.

    It behaves as the list of :class:`LedgerSample` it stands for (``len``, indexing,
    iteration, ``append``, replacing the last one), while :meth:`runs` lets the accountant and
    the report work on (sample, count) pairs without building a million objects."""

    __slots__ = ("_runs", "_run_total", "_tail")

    def __init__(self, runs: Any = (), tail: Any = ()) -> None:
        self._runs: List[List[Any]] = [[s, int(k)] for s, k in runs]  # [first sample, count]
        self._run_total = sum(k for _, k in self._runs)
        self._tail: List[LedgerSample] = list(tail)

    def copy(self) -> "SampleLog":
        return SampleLog([(s, k) for s, k in self._runs], self._tail)

    def __len__(self) -> int:
        return self._run_total + len(self._tail)

    def _at(self, i: int) -> LedgerSample:
        for s, k in self._runs:
            if i < k:
                return s if i == 0 else _replace(s, sample=s.sample + i)
            i -= k
        raise IndexError(i)

    def __getitem__(self, i: int) -> LedgerSample:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("sample index out of range")
        if i >= self._run_total:
            return self._tail[i - self._run_total]
        if i == self._run_total - 1:  # the last run's last sample, without a walk
            s, k = self._runs[-1]
            return _replace(s, sample=s.sample + k - 1)
        return self._at(i)

    def __setitem__(self, i: int, value: LedgerSample) -> None:
        if i not in (-1, len(self) - 1):
            raise IndexError("only the last sample can be replaced")
        if not self._tail:  # the last sample of the last run leaves it
            self._runs[-1][1] -= 1
            self._run_total -= 1
            if self._runs[-1][1] == 0:
                self._runs.pop()
            self._tail.append(value)
        else:
            self._tail[-1] = value

    def append(self, value: LedgerSample) -> None:
        self._tail.append(value)

    def __iter__(self) -> Any:
        for s, k in self._runs:
            yield s
            for j in range(1, k):
                yield _replace(s, sample=s.sample + j)
        yield from self._tail

    def runs(self) -> List[Tuple[LedgerSample, int]]:
        """(first sample, count) of each run of samples equal but for their ids."""
        out: List[Tuple[LedgerSample, int]] = [(s, k) for s, k in self._runs]
        for s in self._tail:
            if out and _same_but_id(out[-1][0], s):
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((s, 1))
        return out


def _same_but_id(a: LedgerSample, b: LedgerSample) -> bool:
    return (
        a.population_size == b.population_size
        and a.sampling_probability == b.sampling_probability
        and a.policy == b.policy
        and a.sample_size == b.sample_size
        and a.seeded == b.seeded
        and a.queries == b.queries
        and a.non_private == b.non_private
        and a.round == b.round
        and a.step_in_round == b.step_in_round
        and a.round_steps == b.round_steps
        and a.round_selected == b.round_selected
    )


def _from_scan(runs: Any) -> SampleLog:
    out = []
    for first, count, n, q, pol, b, seeded, non_private, queries in runs:
        proto = LedgerSample(
            int(first), int(n), float(q), POLICIES[pol], b, bool(seeded),
            tuple(SumQueryEvent(c, sd) for c, sd in queries), bool(non_private),
        )
        out.append((proto, count))
    return SampleLog(out)


def _read(path: str, data: bytes, strict: bool, stacklevel: int = 4) -> _Contents:
    c = _Contents()
    if not data:
        return c
    # The complete lines by the core's fast reader; anything it refuses (with the line), and
    # every error message, comes from the Python reader below, the reference.
    scanned, _refused_at = _core.ledger_scan(data)
    if scanned is not None:
        lines, valid, unit, runs = scanned
        c.samples, c.lines, c.valid_bytes, c.privacy_unit = _from_scan(runs), int(lines), int(valid), unit
        c.has_header = c.lines >= 1
        tail = data[c.valid_bytes :]
    else:
        parts = data.split(b"\n")
        complete, tail = parts[:-1], parts[-1]
        offset = 0
        for i, raw in enumerate(complete, start=1):
            _apply(c, _parse_line(raw, i, path), i, path)
            offset += len(raw) + 1
            c.lines = i
            c.valid_bytes = offset
    if tail:
        lineno = c.lines + 1
        fragment = tail.decode("utf-8", errors="replace")
        msg = (
            f"{path}, line {lineno}: torn last line ({len(tail)} bytes without a newline): the writing "
            f"process stopped mid-write. Its step's result was never returned (entries are fsynced first)"
        )
        if strict:
            raise LedgerError(msg + "; load with strict=False to accept it")
        counted = False
        try:
            obj = _parse_line(tail, lineno, path)
            trial = _Contents(
                c.samples.copy(), None, c.lines, c.valid_bytes, c.has_header, c.privacy_unit, dict(c.streams),
                c.last_round,
            )
            _apply(trial, obj, lineno, path)
        except LedgerError:
            pass
        else:
            c.samples, counted = trial.samples, True
            c.has_header, c.privacy_unit, c.streams = trial.has_header, trial.privacy_unit, trial.streams
            c.last_round = trial.last_round
        warnings.warn(
            msg + ("; the fragment is a complete entry and is counted." if counted else "; the fragment is not counted: "
                   f"{fragment[:120]!r}"),
            LedgerWarning,
            stacklevel=stacklevel,
        )
        c.torn = TornTail(lineno, fragment, counted)
    if not c.has_header:
        raise LedgerError(f"{path}: no ledger header on line 1")
    return c


def read_ledger(path: str, *, strict: bool = False) -> _Contents:
    """Reads a whole ledger file without opening it for writing (see ``PrivacyLedger.load``)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except IsADirectoryError:
        raise LedgerError(f"{path}: is a directory, not a ledger file") from None
    if not data:
        raise LedgerError(f"{path}: empty file, not a ledger (no header)")
    # _read sits one frame deeper here (PrivacyLedger.load -> read_ledger -> _read); keep the
    # warning attributed to the same frame as when load called _read itself.
    return _read(path, data, strict, stacklevel=5)


# ----------------------------------------------------------------------------- appending


class LedgerFile:
    """A ledger file held open for appending by this process (under an exclusive lock).

    Opening creates the file with a header if it does not exist, reads back what is already there
    (:attr:`contents`; a corrupted ledger raises :class:`LedgerError`) and repairs a torn last
    line before anything is appended after it. :meth:`write` appends durably or not at all.

    ``stacklevel`` is counted as by :func:`warnings.warn` from this constructor, so that the
    torn-line warnings are attributed to the same frames however deep the opener sits.
    """

    def __init__(self, path: str, *, privacy_unit: Optional[str] = None, stacklevel: int = 2) -> None:
        self.path = path
        self._fd: Optional[int] = None
        #: Why the file can no longer be written, once a failed write could not be undone.
        self.broken: Optional[str] = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        except IsADirectoryError:
            raise LedgerError(f"{path}: is a directory, not a ledger file") from None
        except OSError as e:
            raise LedgerError(f"{path}: cannot open the ledger for writing: {e.strerror or e}") from e
        try:
            if _fcntl is not None:
                try:
                    _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
                except OSError:
                    raise LedgerError(f"{path}: the ledger is open for writing in another process") from None
            data = _read_all(fd)
            contents = _read(path, data, strict=False, stacklevel=stacklevel + 2) if data else _Contents()
            self._fd = fd
            if not data:
                unit = privacy_unit or DEFAULT_PRIVACY_UNIT
                self.write([{"format": FORMAT, "version": VERSION, "privacy_unit": unit}])
                _fsync_dir(path)
                contents.has_header = True
                contents.lines = 1
                contents.privacy_unit = unit
            elif contents.torn is not None:
                self._repair(contents, stacklevel + 1)
        except BaseException:
            self._fd = None
            os.close(fd)
            raise
        self.contents = contents

    @property
    def closed(self) -> bool:
        return self._fd is None

    def _repair(self, contents: _Contents, stacklevel: int) -> None:
        torn = contents.torn
        assert torn is not None and self._fd is not None
        if torn.counted:
            os.write(self._fd, b"\n")  # complete the line: the entry stays counted
            os.fsync(self._fd)
            contents.lines = torn.line
        else:
            os.ftruncate(self._fd, contents.valid_bytes)
            os.fsync(self._fd)
            self.write([{"type": "torn_tail_repaired", "line": torn.line, "fragment": torn.fragment}])
            contents.lines += 1
        warnings.warn(
            f"{self.path}: torn line {torn.line} repaired before appending "
            + ("(completed; it is counted)" if torn.counted else "(recorded as a torn_tail_repaired entry)"),
            LedgerWarning,
            stacklevel=stacklevel,
        )

    def write(self, entries: List[Dict[str, Any]]) -> None:
        """Appends entries with one write and fsyncs. On failure the file is cut back to where
        it was, so a failed write never leaves half an entry in the middle of the ledger."""
        if self._fd is None:
            raise LedgerError(f"{self.path}: ledger is closed" if self.broken is None else f"{self.path}: {self.broken}")
        if self.broken is not None:
            raise LedgerError(f"{self.path}: ledger unusable: {self.broken}")
        data = "".join(_dumps(e) for e in entries).encode("utf-8")
        start = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except BaseException as e:
            try:
                os.ftruncate(self._fd, start)
            except OSError as e2:
                self.broken = f"a failed write could not be undone ({e2}); repair by reopening"
            else:
                # The cut is what later writes see; the next successful fsync makes it durable.
                try:
                    os.fsync(self._fd)
                except OSError:
                    pass
            raise LedgerError(f"{self.path}: could not write the ledger: {e}") from e

    def close(self) -> None:
        """Releases the file and its lock (all entries are already durable)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks)


def _fsync_dir(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
