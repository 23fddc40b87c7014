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

Durability: a sample's entries are written with one ``write`` and ``fsync``-ed before
:meth:`PrivacyLedger.record_release` returns, and callers return a noised result only after
that (see :class:`dpcore.PrivateAggregator`). A crash can therefore only tear the entries of a
step whose result was never returned. Loading reports a torn last line with a warning (or an
error with ``strict=True``), never silently; any other unreadable line is an error naming it.

Every value is validated before anything is written; on bad input nothing is written.
"""

from __future__ import annotations

import json
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .queries.events import (
    ComposedQueryEvent,
    NonPrivateQueryEvent,
    SumQueryEvent,
    effective_noise_multiplier,
)

__all__ = [
    "PrivacyLedger",
    "LedgerSample",
    "LedgerError",
    "LedgerWarning",
    "TornTail",
    "FORMAT",
    "VERSION",
    "POLICIES",
]

FORMAT = "dpcore-privacy-ledger"
VERSION = 1
POISSON = "poisson"
FIXED_SIZE = "fixed_size_without_replacement"
SHUFFLE = "shuffle"
POLICIES = (POISSON, FIXED_SIZE, SHUFFLE)

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

    @property
    def released(self) -> bool:
        return bool(self.queries) or self.non_private

    def noise_multiplier(self) -> float:
        """z of the sample's sum queries together, Eq. (1); 0 when any release is non-private."""
        if self.non_private:
            return 0.0
        return effective_noise_multiplier(self.queries)


# ----------------------------------------------------------------------------- validation


def _int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if v < lo or v >= 1 << 63:
        raise ValueError(f"{name} must be >= {lo} (and < 2**63), got {v}")
    return v


def _prob(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"sampling_probability must be a real number, got {type(v).__name__}")
    v = float(v)
    if not 0.0 <= v <= 1.0:  # also rejects NaN
        raise ValueError(f"sampling_probability must be in [0, 1], got {v}")
    return v


def _sample_entry(
    sample: int,
    population_size: Any,
    sampling_probability: Any,
    policy: Any,
    sample_size: Any,
    seeded: Any,
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
    else:
        if sampling_probability is None:
            if b is None:
                raise ValueError(f"policy {policy} needs sampling_probability")
            q = b / n
        else:
            q = _prob(sampling_probability)
    return LedgerSample(sample, n, q, policy, b, seeded)


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
            tuples.append(SumQueryEvent(e.l2_norm_clip, e.stddev))
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
    samples: List[LedgerSample] = field(default_factory=list)
    torn: Optional[TornTail] = None
    lines: int = 0
    valid_bytes: int = 0  # bytes up to the end of the last complete line
    has_header: bool = False


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
        _expect_keys(obj, ("format", "version"), 1, path)
        c.has_header = True
        return
    kind = obj.get("type")
    try:
        if kind == "sample":
            _expect_keys(obj, _SAMPLE_KEYS, lineno, path)
            sid = _int("sample", obj["sample"], 0)
            if sid != len(c.samples):
                raise ValueError(f"sample id {sid} out of sequence (expected {len(c.samples)})")
            s = _sample_entry(
                sid, obj["population_size"], obj["sampling_probability"], obj["policy"], obj["sample_size"], obj["seeded"]
            )
            c.samples.append(s)
        elif kind in ("sum_query", "non_private"):
            keys = ("type", "sample", "l2_norm_clip", "stddev") if kind == "sum_query" else ("type", "sample")
            _expect_keys(obj, keys, lineno, path)
            sid = _int("sample", obj["sample"], 0)
            if not c.samples or sid != c.samples[-1].sample:
                raise ValueError(f"refers to sample {sid}, which is not the current sample")
            last = c.samples[-1]
            if kind == "sum_query":
                for k in ("l2_norm_clip", "stddev"):
                    if isinstance(obj[k], bool) or not isinstance(obj[k], (int, float)):
                        raise TypeError(f"{k} must be a number")
                t = SumQueryEvent(obj["l2_norm_clip"], obj["stddev"])
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


def _read(path: str, data: bytes, strict: bool) -> _Contents:
    c = _Contents()
    if not data:
        return c
    parts = data.split(b"\n")
    complete, tail = parts[:-1], parts[-1]
    offset = 0
    for i, raw in enumerate(complete, start=1):
        _apply(c, _parse_line(raw, i, path), i, path)
        offset += len(raw) + 1
        c.lines = i
        c.valid_bytes = offset
    if tail:
        lineno = len(complete) + 1
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
            trial = _Contents(list(c.samples), None, c.lines, c.valid_bytes, c.has_header)
            _apply(trial, obj, lineno, path)
        except LedgerError:
            pass
        else:
            c.samples, counted = trial.samples, True
            c.has_header = trial.has_header
        warnings.warn(
            msg + ("; the fragment is a complete entry and is counted." if counted else "; the fragment is not counted: "
                   f"{fragment[:120]!r}"),
            LedgerWarning,
            stacklevel=4,
        )
        c.torn = TornTail(lineno, fragment, counted)
    if not c.has_header:
        raise LedgerError(f"{path}: no ledger header on line 1")
    return c


# ----------------------------------------------------------------------------- the ledger


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

    def __init__(self, path: "os.PathLike[str] | str") -> None:
        self._path = os.fspath(path)
        if not isinstance(self._path, str):
            raise TypeError("path must be a str or os.PathLike[str]")
        self._fd: Optional[int] = None
        self._pending: Optional[LedgerSample] = None
        # Whether the last sample was recorded by this object: a release never attaches to a
        # sample from an earlier run of the ledger.
        self._current = False
        self._broken: Optional[str] = None
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            if _fcntl is not None:
                try:
                    _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
                except OSError:
                    raise LedgerError(f"{self._path}: the ledger is open for writing in another process") from None
            data = _read_all(fd)
            contents = _read(self._path, data, strict=False) if data else _Contents()
            self._fd = fd
            if not data:
                self._write([{"format": FORMAT, "version": VERSION}])
                _fsync_dir(self._path)
                contents.has_header = True
                contents.lines = 1
            elif contents.torn is not None:
                self._repair(contents)
        except BaseException:
            self._fd = None
            os.close(fd)
            raise
        self._samples = contents.samples
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
        with open(p, "rb") as f:
            data = f.read()
        if not data:
            raise LedgerError(f"{p}: empty file, not a ledger (no header)")
        contents = _read(p, data, strict)
        self = cls.__new__(cls)
        self._path, self._fd, self._pending, self._broken = p, None, None, "opened read-only with load()"
        self._current = False
        self._samples, self.torn_tail, self._lines = contents.samples, contents.torn, contents.lines
        return self

    # -- writing ------------------------------------------------------------------------

    def _repair(self, contents: _Contents) -> None:
        torn = contents.torn
        assert torn is not None and self._fd is not None
        if torn.counted:
            os.write(self._fd, b"\n")  # complete the line: the entry stays counted
            os.fsync(self._fd)
            contents.lines = torn.line
        else:
            os.ftruncate(self._fd, contents.valid_bytes)
            os.fsync(self._fd)
            self._write([{"type": "torn_tail_repaired", "line": torn.line, "fragment": torn.fragment}])
            contents.lines += 1
        warnings.warn(
            f"{self._path}: torn line {torn.line} repaired before appending "
            + ("(completed; it is counted)" if torn.counted else "(recorded as a torn_tail_repaired entry)"),
            LedgerWarning,
            stacklevel=3,
        )

    def _write(self, entries: List[Dict[str, Any]]) -> None:
        """Appends entries with one write and fsyncs. On failure the file is cut back to where
        it was, so a failed write never leaves half an entry in the middle of the ledger."""
        if self._fd is None:
            raise LedgerError(f"{self._path}: ledger is closed" if self._broken is None else f"{self._path}: {self._broken}")
        if self._broken is not None:
            raise LedgerError(f"{self._path}: ledger unusable: {self._broken}")
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
                self._broken = f"a failed write could not be undone ({e2}); repair by reopening"
            else:
                # The cut is what later writes see; the next successful fsync makes it durable.
                try:
                    os.fsync(self._fd)
                except OSError:
                    pass
            raise LedgerError(f"{self._path}: could not write the ledger: {e}") from e

    def record_sample(
        self,
        population_size: int,
        sampling_probability: Optional[float] = None,
        policy: str = POISSON,
        *,
        sample_size: Optional[int] = None,
        seeded: bool = False,
    ) -> int:
        """Records that a sample was drawn (§5, §6); returns its id.

        ``policy`` is the policy actually used: ``"poisson"`` (each record independently with
        probability q), ``"fixed_size_without_replacement"`` (``sample_size`` = b records uniformly,
        q = b/n) or ``"shuffle"`` (batches of a shuffled epoch: never amplified by sampling).
        ``seeded``: the sample came from a test seed. The entry is written together with the
        sample's first release (a sample nothing was released from costs no privacy).
        """
        if self._fd is None:
            raise LedgerError(f"{self._path}: ledger is not open for writing ({self._broken or 'closed'})")
        sid = len(self._samples)
        self._pending = _sample_entry(sid, population_size, sampling_probability, policy, sample_size, seeded)
        return sid

    def record_release(self, event: Any) -> None:
        """Records the sum queries of ``event`` under the current sample, durably.

        ``event`` is what a query's ``get_noised_result`` returned. The entries are validated,
        written with one ``write`` and fsynced before this returns; return the noised result only
        afterwards. On any error nothing is written.
        """
        if self._fd is None:
            raise LedgerError(f"{self._path}: ledger is not open for writing ({self._broken or 'closed'})")
        tuples, non_private = _tuples_of(event)
        if self._pending is not None:
            sample = self._pending
        elif self._current:
            sample = self._samples[-1]  # a further release on this session's current sample
        else:
            raise LedgerError(
                f"{self._path}: no sample recorded: call record_sample (or draw with a sampler given ledger=) first"
            )
        entries: List[Dict[str, Any]] = []
        if self._pending is not None:
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
        for t in tuples:
            entries.append({"type": "sum_query", "sample": sample.sample, "l2_norm_clip": t.l2_norm_clip, "stddev": t.stddev})
        if non_private:
            entries.append({"type": "non_private", "sample": sample.sample})
        self._write(entries)
        updated = _replace(sample, queries=sample.queries + tuple(tuples), non_private=sample.non_private or non_private)
        if self._pending is not None:
            self._samples.append(updated)
            self._pending = None
            self._current = True
        else:
            self._samples[-1] = updated
        self._lines += len(entries)

    def close(self) -> None:
        """Releases the file (all entries are already durable)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

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

    @property
    def path(self) -> str:
        return self._path

    @property
    def samples(self) -> Tuple[LedgerSample, ...]:
        """The recorded samples with their releases, in order (the pending sample excluded)."""
        return tuple(self._samples)

    @property
    def num_releases(self) -> int:
        """Samples from which something was released (the steps that cost privacy)."""
        return sum(1 for s in self._samples if s.released)

    def __repr__(self) -> str:
        return f"PrivacyLedger({self._path!r}, samples={len(self._samples)})"

    def to_event(self, neighboring: str = "add_or_remove") -> Any:
        """The whole ledger as one accountant event (``dpcore.accounting``), McMahan et al. §6.

        Each sample with releases becomes one Gaussian event whose noise multiplier comes from
        Eq. (1) over its sum queries, wrapped by its sampling policy: Poisson →
        ``PoissonSampledEvent(q, ·)``; fixed size → ``SampledWithoutReplacementEvent(n, b, ·)``;
        shuffle → the bare ``GaussianEvent`` (no amplification: a shuffled epoch is not a random
        sample and has no tight analysis, §5), with a :class:`LedgerWarning`. A sample with a
        non-private release becomes ``NonPrivateEvent`` (ε = ∞). Runs of equal events are
        composed with ``SelfComposedEvent``.

        ``neighboring`` fixes what the noise multiplier is relative to. The recorded S_g bound one
        record's contribution, which is the sensitivity under ``"add_or_remove"``: z = 1/S*
        (Eq. (1)). Replacing a record moves each group's sum by up to 2·S_g, so under
        ``"replace_one"`` z = 1/(2·S*) (exact: a halving). For microbatches recorded with the
        doubled bound 2C this double-counts under replace-one (the survey's footnote 27 gives 2C
        there too): the ε is then an upper bound, not tight.
        """
        from . import accounting as acc

        if neighboring not in ("add_or_remove", "replace_one"):
            raise ValueError(f"neighboring must be 'add_or_remove' or 'replace_one', got {neighboring!r}")
        scale = 1.0 if neighboring == "add_or_remove" else 0.5
        events: List[Any] = []
        shuffled = seeded = 0
        for s in self._samples:
            if not s.released:
                continue
            z = s.noise_multiplier() * scale
            if z == 0.0:
                ev: Any = acc.NonPrivateEvent()
            elif s.policy == POISSON:
                ev = acc.PoissonSampledEvent(s.sampling_probability, acc.GaussianEvent(z))
            elif s.policy == FIXED_SIZE:
                ev = acc.SampledWithoutReplacementEvent(s.population_size, s.sample_size, acc.GaussianEvent(z))
            else:
                shuffled += 1
                ev = acc.GaussianEvent(z)
            seeded += s.seeded
            if events and events[-1][0] == ev:
                events[-1][1] += 1
            else:
                events.append([ev, 1])
        if shuffled:
            warnings.warn(
                f"{self._path}: {shuffled} sample(s) used the shuffle policy; they are accounted without "
                "sampling amplification (each as a full Gaussian query on the whole data set), because a "
                "shuffled epoch is not a random sample and has no tight analysis (McMahan et al. 2018, §5). "
                "Use poisson sampling to get amplification.",
                LedgerWarning,
                stacklevel=2,
            )
        if seeded:
            warnings.warn(
                f"{self._path}: {seeded} sample(s) were drawn from a test seed; a seeded sample is predictable, "
                "so the amplification counted for it does not hold. Seeds are for tests only.",
                LedgerWarning,
                stacklevel=2,
            )
        parts = [e if k == 1 else acc.SelfComposedEvent(e, k) for e, k in events]
        return acc.ComposedEvent(tuple(parts))

    def get_epsilon(
        self,
        delta: float,
        accountant: str = "rdp",
        *,
        neighboring: str = "add_or_remove",
        orders: Any = None,
    ) -> float:
        """ε such that everything released under this ledger is (ε, δ)-DP (an upper bound).

        ``accountant="rdp"``: :class:`dpcore.accounting.RdpAccountant` over :meth:`to_event`.
        The RDP analyses exist for Poisson samples under ``neighboring="add_or_remove"`` and for
        fixed-size samples without replacement under ``"replace_one"``; a ledger is accounted
        under one relation, so it must not mix those two policies.
        """
        if accountant != "rdp":
            raise ValueError(f"accountant must be 'rdp', got {accountant!r}")
        if neighboring not in ("add_or_remove", "replace_one"):
            raise ValueError(f"neighboring must be 'add_or_remove' or 'replace_one', got {neighboring!r}")
        policies = {s.policy for s in self._samples if s.released and s.noise_multiplier() > 0}
        if neighboring == "add_or_remove" and FIXED_SIZE in policies:
            raise ValueError(
                f"{self._path}: the ledger holds fixed_size_without_replacement samples, which the RDP "
                "accountant analyses only under neighboring='replace_one'"
                + ("; it also holds poisson samples (add_or_remove only), so it cannot be accounted as one"
                   if POISSON in policies else "")
            )
        if neighboring == "replace_one" and POISSON in policies:
            raise ValueError(
                f"{self._path}: the ledger holds poisson samples, which the RDP accountant analyses only "
                "under neighboring='add_or_remove'"
            )
        from .accounting import RdpAccountant

        acct = RdpAccountant(orders=orders, neighboring=neighboring)
        acct.compose(self.to_event(neighboring))
        return acct.get_epsilon(delta)


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
