"""The ledger file: format, validation, parsing, torn-tail handling and durable appends.

This implements the file format and the durability rules described in :mod:`dpcore.ledger`.
Nothing here knows about accountants; :mod:`._events` turns what is read into accountant events.
Every value is validated before anything is written; on bad input nothing is written.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .. import _core
from .._validate import count as _int
from ..events import MATRIX_FACTORIZATION, SumQueryEvent, check_stream_id
from ._entries import (
    ALLOCATION_POLICIES,
    DEFAULT_PRIVACY_UNIT,
    EPOCH_POLICIES,
    FORMAT,
    POLICIES,
    ROUND_KEYS,
    USER_KEYS,
    VERSION,
    LedgerError,
    LedgerSample,
    LedgerWarning,
    TornTail,
    _declaration_of_entry,
    _dumps,
    _sample_entry,
    check_round,
    check_user_bounds,
)

try:  # advisory lock so that two processes never append to one ledger
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - non-POSIX
    _fcntl = None  # type: ignore[assignment]



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
            bounds = tuple(k for k in USER_KEYS if k in obj)  # optional: only where the sample has one
            _expect_keys(obj, (_SAMPLE_KEYS + ROUND_KEYS if allocation else _SAMPLE_KEYS) + bounds, lineno, path)
            sid = _int("sample", obj["sample"], 0)
            if sid != len(c.samples):
                raise ValueError(f"sample id {sid} out of sequence (expected {len(c.samples)})")
            for k in bounds:
                if obj[k] is None:
                    raise ValueError(f"{k} is written only when given, got null")
            s = _sample_entry(
                sid, obj["population_size"], obj["sampling_probability"], obj["policy"], obj["sample_size"], obj["seeded"],
                *(obj[k] for k in ROUND_KEYS if allocation), **{k: obj[k] for k in bounds},
            )
            prev = c.samples[-1] if c.samples else None
            why = check_round(prev, c.last_round, s) or check_user_bounds(c.privacy_unit or DEFAULT_PRIVACY_UNIT, prev, s)
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
        and a.examples_per_user == b.examples_per_user
        and a.max_examples_per_user == b.max_examples_per_user
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
