"""The grey-box neighbour harness: a training function run twice, on a dataset D and on a
neighbour D′, with identical randomness, every release compared (Cebere, Erb, Desfontaines,
Bellet & Fitzsimons, "Privacy in Theory, Bugs in Practice: Grey-Box Auditing of DP Libraries",
PETS 2026, arXiv 2602.17454, §4: neighbouring runs with a fixed seed, internal values recorded).

A differentially private release path may depend on one record only through the noised sum: the
sequence of releases, the ledger's entries, the denominators, the noise parameters and the
branches taken must be *identical* on D and D′, and the two pre-noise sums may differ by at most
the sensitivity the release declares (McMahan et al. 2018, §2 and Eq. (1): one record's clipped
contribution has norm ≤ C; a replaced record moves the sum by ≤ 2C). Every release path of
dpcore reports those values to :mod:`dpcore._trace` while a harness run is active:

* the query layer (numpy ``clip_noise`` queries, :class:`~dpcore.aggregator.PrivateAggregator`,
  Keras, a user's own :class:`~dpcore.queries.DPQuery` released through
  :func:`~dpcore.queries.base.noise_releases`) at ``queries.noise_releases``;
* the torch adapter at each transport's release (``torch.SingleProcess`` ...), with a
  ``torch.step`` branch per (micro-)batch: release or hold;
* the ledger, at each entry it writes.

With the same seed both runs draw the same noise and the same Poisson decisions for the records
they share (the core's geometric-skip sampler gives indices ``< n`` the same draws whatever the
population), so a neighbour is added or removed at the **end** of the dataset.

What is reported (:class:`Finding`): a run that raised where the other did not ("control flow"),
a different sequence of trace events ("control flow"), a different ledger entry ("ledger"), a
different denominator ("denominator"), noise parameters or declared sensitivity ("noise",
"sensitivity"), a different branch ("branch"), and a release whose pre-noise sums differ by more
than the declared sensitivity ("sensitivity exceeded"). The distance allows the rounding of the
records the two runs share (``rtol`` of the bound, 1e-3 by default: a float32 sum of a batch of
records of norm ≤ C rounds far below that, a planted bug moves it by orders of magnitude).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _trace

__all__ = [
    "Neighbour",
    "Finding",
    "NeighbourRun",
    "NeighbourAuditResult",
    "neighbour_audit",
    "neighbours",
    "NEIGHBOUR_KINDS",
    "users_last",
]

Columns = Tuple[np.ndarray, ...]
ADD_OR_REMOVE = "add_or_remove"
REPLACE = "replace"


@dataclass(frozen=True)
class Neighbour:
    """A way to form D′ from D. ``relation``: ``"add_or_remove"`` (one record, or one user's
    records, more or fewer: the sums may differ by the declared sensitivity) or ``"replace"``
    (one record swapped: by twice that). ``make(columns) -> columns``."""

    name: str
    relation: str
    make: Callable[[Columns], Columns]

    def __repr__(self) -> str:
        return f"Neighbour({self.name!r}, {self.relation!r})"


@dataclass(frozen=True)
class Finding:
    """One place where the two runs differ as a DP release path must not."""

    neighbour: str
    kind: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.neighbour}] {self.kind} at {self.where}: {self.detail}"


@dataclass
class NeighbourRun:
    """The comparison of D with one neighbour."""

    neighbour: str
    relation: str
    releases: int
    ledger_entries: int
    #: max over releases and groups of ‖sum(D) − sum(D′)‖ / declared bound (≤ 1 + rtol passes)
    max_ratio: float
    findings: List[Finding] = field(default_factory=list)
    #: fields that differ but were declared public (``assume_public``)
    public: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.findings


@dataclass
class NeighbourAuditResult:
    runs: List[NeighbourRun]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.runs)

    @property
    def findings(self) -> List[Finding]:
        return [f for r in self.runs for f in r.findings]

    def table(self) -> str:
        """A Markdown table: one row per neighbour."""
        rows = ["| neighbour | relation | releases | ledger entries | max ‖Δsum‖/bound | findings |", "|---|---|---|---|---|---|"]
        for r in self.runs:
            what = "none" if r.passed else "; ".join(sorted({f.kind for f in r.findings}))
            ratio = "—" if r.releases == 0 or math.isnan(r.max_ratio) else f"{r.max_ratio:.3g}"
            rows.append(f"| {r.neighbour} | {r.relation} | {r.releases} | {r.ledger_entries} | {ratio} | {what} |")
        return "\n".join(rows)

    def raise_for_findings(self) -> None:
        """Raises :class:`AssertionError` listing every finding (for a test)."""
        if not self.passed:
            raise AssertionError("grey-box neighbour audit found:\n" + "\n".join(str(f) for f in self.findings))


# -- neighbours -------------------------------------------------------------------------


def _columns(data: Any) -> Columns:
    cols = tuple(np.asarray(c) for c in (data if isinstance(data, (tuple, list)) else (data,)))
    if not cols or any(c.ndim == 0 for c in cols):
        raise ValueError("the dataset must be an array or a tuple of arrays with the records on axis 0")
    n = {len(c) for c in cols}
    if len(n) != 1:
        raise ValueError(f"the dataset's columns must have one length (records on axis 0), got {sorted(n)}")
    if n.pop() < 2:
        raise ValueError("the dataset needs at least 2 records")
    return cols


def _append(cols: Columns, record: Sequence[np.ndarray]) -> Columns:
    return tuple(np.concatenate([c, np.asarray(r, dtype=c.dtype)[None]], 0) for c, r in zip(cols, record))


def _floating(cols: Columns, poison: Optional[Sequence[int]]) -> List[int]:
    if poison is not None:
        return list(poison)
    return [k for k, c in enumerate(cols) if np.issubdtype(c.dtype, np.floating)]


def _ordinary(cols: Columns) -> List[np.ndarray]:
    """A record unlike any one of D: the mean of the first half's float features reflected
    through the mean of the second half (labels from record 0)."""
    n = len(cols[0])
    out = []
    for c in cols:
        if np.issubdtype(c.dtype, np.floating):
            out.append((2.0 * c[n // 2 :].mean(0) - c[: n // 2].mean(0)).astype(c.dtype))
        else:
            out.append(c[0].copy())
    return out


def _filled(cols: Columns, value: Callable[[np.dtype], float], poison: Optional[Sequence[int]]) -> List[np.ndarray]:
    rec = [c[0].copy() for c in cols]
    for k in _floating(cols, poison):
        rec[k] = np.full_like(rec[k], value(cols[k].dtype))
    return rec


def _subnormal(dt: np.dtype) -> float:
    return float(np.finfo(dt).smallest_subnormal) * 3.0


#: The built-in neighbour kinds: (relation, how the extra or replacing record is built).
NEIGHBOUR_KINDS: Dict[str, str] = {
    "remove": "the last record removed",
    "add": "an ordinary record appended",
    "replace": "the last record replaced by an ordinary one",
    "duplicate": "a copy of record 0 appended",
    "nan": "a record of NaN features appended",
    "inf": "a record of +Inf features appended",
    "-inf": "a record of -Inf features appended",
    "huge": "a record of 1e30 features appended",
    "subnormal": "a record of subnormal features appended",
    "zero": "a record of zero features appended",
    "replace_nan": "the last record's features replaced by NaN",
    "replace_inf": "the last record's features replaced by +Inf",
    "replace_huge": "the last record's features replaced by 1e30",
    "replace_zero": "the last record's features replaced by zeros",
    "replace_duplicate": "the last record replaced by a copy of record 0",
    "largest_user": "every record of the user with most records removed",
    "smallest_user": "every record of the user with fewest records removed",
}


def neighbours(
    kinds: Iterable[str] = ("remove", "add", "replace", "duplicate", "nan", "inf", "-inf", "huge", "subnormal", "zero"),
    *,
    poison_columns: Optional[Sequence[int]] = None,
    user_column: Optional[int] = None,
) -> List[Neighbour]:
    """Built-in neighbours by name (:data:`NEIGHBOUR_KINDS`). Values are written into the float
    columns (or ``poison_columns``); integer columns (labels) keep record 0's. The user kinds
    need ``user_column``, the column of user ids; their records are moved to the end of D (in a
    stable order) so that removing them leaves the other records' positions unchanged."""
    out: List[Neighbour] = []
    for k in kinds:
        if k not in NEIGHBOUR_KINDS:
            raise ValueError(f"unknown neighbour kind {k!r}; the built-in ones are {sorted(NEIGHBOUR_KINDS)}")
        out.append(_neighbour(k, poison_columns, user_column))
    return out


def _neighbour(k: str, poison: Optional[Sequence[int]], user_column: Optional[int]) -> Neighbour:
    fills: Dict[str, Callable[[np.dtype], float]] = {
        "nan": lambda dt: float("nan"),
        "inf": lambda dt: float("inf"),
        "-inf": lambda dt: float("-inf"),
        "huge": lambda dt: 1e30,
        "subnormal": _subnormal,
        "zero": lambda dt: 0.0,
    }
    if k == "remove":
        return Neighbour(k, ADD_OR_REMOVE, lambda cols: tuple(c[:-1] for c in cols))
    if k == "add":
        return Neighbour(k, ADD_OR_REMOVE, lambda cols: _append(cols, _ordinary(cols)))
    if k == "replace":
        return Neighbour(k, REPLACE, lambda cols: _append(tuple(c[:-1] for c in cols), _ordinary(cols)))
    if k == "duplicate":
        return Neighbour(k, ADD_OR_REMOVE, lambda cols: _append(cols, [c[0].copy() for c in cols]))
    if k == "replace_duplicate":
        return Neighbour(k, REPLACE, lambda cols: _append(tuple(c[:-1] for c in cols), [c[0].copy() for c in cols]))
    if k.startswith("replace_"):  # replace-one versions of the bad values (a fixed n: cyclic batches)
        f = fills[k[len("replace_"):]]
        return Neighbour(k, REPLACE, lambda cols: _append(tuple(c[:-1] for c in cols), _filled(cols, f, poison)))
    if k in fills:
        f = fills[k]
        return Neighbour(k, ADD_OR_REMOVE, lambda cols: _append(cols, _filled(cols, f, poison)))
    if user_column is None:
        raise ValueError(f"neighbour {k!r} needs user_column= (the column of user ids)")
    largest = k == "largest_user"

    def drop_user(cols: Columns) -> Columns:
        ids = cols[user_column]
        users, counts = np.unique(ids, return_counts=True)
        u = users[np.argmax(counts)] if largest else users[np.argmin(counts)]
        return tuple(c[ids != u] for c in cols)

    return Neighbour(k, ADD_OR_REMOVE, drop_user)


def users_last(columns: Any, user_column: int, kind: str = "largest_user") -> Columns:
    """D with the records of the largest (or smallest) user moved to the end, in a stable
    order: the dataset to give :func:`neighbour_audit` with a user neighbour."""
    cols = _columns(columns)
    ids = cols[user_column]
    users, counts = np.unique(ids, return_counts=True)
    u = users[np.argmax(counts)] if kind == "largest_user" else users[np.argmin(counts)]
    order = np.concatenate([np.nonzero(ids != u)[0], np.nonzero(ids == u)[0]])
    return tuple(c[order] for c in cols)


# -- runs ---------------------------------------------------------------------------------


@dataclass
class _Run:
    events: List[Dict[str, Any]]
    outputs: List[Any]
    error: Optional[BaseException]


def _traced(train: Callable[[Columns, int], Any], cols: Columns, seed: int, replay: Optional[List[Any]] = None) -> _Run:
    tracer = _trace.start(replay)
    try:
        train(cols, seed)
        err: Optional[BaseException] = None
    except Exception as e:  # a crash is a finding, not the harness's failure
        err = e
    finally:
        _trace.stop()
    return _Run(tracer.events, tracer.outputs, err)


def neighbour_audit(
    train: Callable[[Columns, int], Any],
    dataset: Any,
    kinds: Optional[Sequence[Union[str, Neighbour]]] = None,
    *,
    seed: int = 0,
    rtol: float = 1e-3,
    assume_public: Sequence[str] = (),
    poison_columns: Optional[Sequence[int]] = None,
    user_column: Optional[int] = None,
) -> NeighbourAuditResult:
    """Runs ``train(columns, seed)`` on ``dataset`` (an array or a tuple of arrays, records on
    axis 0) and on each neighbour with the same ``seed``, and compares the traces (module
    docstring). ``train`` must build its model, optimizer, loader and ledger afresh from the
    columns it is given and pass ``seed`` to dpcore wherever it takes one (a test seed).

    ``kinds``: names of :data:`NEIGHBOUR_KINDS` or :class:`Neighbour` objects (default:
    :func:`neighbours`'s ten). ``assume_public``: ledger fields allowed to differ because the
    caller states them public (``"population_size"``: the dataset's size is then a public
    number; listed in :attr:`NeighbourRun.public`, never a finding). ``rtol``: the rounding
    allowed on the sensitivity bound."""
    cols = _columns(dataset)
    if _trace.active():
        raise RuntimeError("neighbour_audit cannot run inside another grey-box trace")
    chosen: List[Neighbour] = []
    for nb in kinds if kinds is not None else neighbours(poison_columns=poison_columns):
        chosen.extend(neighbours([nb], poison_columns=poison_columns, user_column=user_column) if isinstance(nb, str) else [nb])
    base = _traced(train, cols, seed)
    if base.error is not None:
        raise RuntimeError(
            f"the training function raised on D itself ({type(base.error).__name__}: {base.error}); "
            "the harness compares runs that complete"
        ) from base.error
    runs = []
    for nb in chosen:
        other = _traced(train, nb.make(cols), seed, replay=base.outputs)
        runs.append(_compare(nb, base, other, rtol, set(assume_public)))
    return NeighbourAuditResult(runs)


# -- comparison -----------------------------------------------------------------------------


def _describe(ev: Dict[str, Any]) -> str:
    if ev["kind"] == "release":
        return f"release ({ev['site']})"
    if ev["kind"] == "branch":
        return f"branch {ev['site']}.{ev['name']}={ev['value']!r}"
    return f"ledger entry {ev['entry'].get('type')}"


def _part_distance(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    scales = a["scales"] or [1.0] * len(a["sums"])
    tot = 0.0
    for x, y, s in zip(a["sums"], b["sums"], scales):
        d = (x - y) / s
        tot += float(np.sum(d * d)) if np.all(np.isfinite(d)) else math.inf
    return math.sqrt(tot)


_STREAM = re.compile(r"stream='([^']+)'")


def _canonical_streams(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The events with each matrix-factorization stream id (a random name a run gives its
    stream) replaced by its order of appearance: an identifier, not a function of the data."""
    names: Dict[str, str] = {}

    def name(s: str) -> str:
        return names.setdefault(s, f"stream#{len(names)}")

    out = []
    for ev in events:
        if ev["kind"] == "ledger" and "stream" in ev["entry"]:
            ev = dict(ev, entry=dict(ev["entry"], stream=name(str(ev["entry"]["stream"]))))
        elif ev["kind"] == "release" and ev.get("event"):
            ev = dict(ev, event=_STREAM.sub(lambda m: f"stream='{name(m.group(1))}'", ev["event"]))
        out.append(ev)
    return out


def _compare(nb: Neighbour, a: _Run, b: _Run, rtol: float, public: set) -> NeighbourRun:
    findings: List[Finding] = []
    run = NeighbourRun(nb.name, nb.relation, 0, 0, 0.0, findings)

    def add(kind: str, where: str, detail: str) -> None:
        findings.append(Finding(nb.name, kind, where, detail))

    if (a.error is None) != (b.error is None) or (a.error is not None and type(a.error) is not type(b.error)):
        which = "D′" if b.error is not None else "D"
        err = b.error if b.error is not None else a.error
        add("control flow", "the run", f"the run on {which} raised {type(err).__name__}: {err}")
    mult = 2.0 if nb.relation == REPLACE else 1.0
    rel_i = 0
    ratios: List[float] = []
    for i, (x, y) in enumerate(zip(_canonical_streams(a.events), _canonical_streams(b.events))):
        where = f"trace event {i}" if x["kind"] != "release" else f"release {rel_i} ({x['site']})"
        if x["kind"] != y["kind"] or x.get("site") != y.get("site") or x.get("name") != y.get("name"):
            add("control flow", f"trace event {i}", f"D: {_describe(x)}; D′: {_describe(y)}")
            break  # after a divergence the runs no longer line up
        if x["kind"] == "branch":
            if x["value"] != y["value"]:
                add("branch", where, f"{x['site']}.{x['name']}: {x['value']!r} on D, {y['value']!r} on D′")
        elif x["kind"] == "ledger":
            ex, ey = x["entry"], y["entry"]
            run.ledger_entries += 1
            for k in sorted(set(ex) | set(ey)):
                if ex.get(k) != ey.get(k):
                    if k in public:
                        if k not in run.public:
                            run.public.append(k)
                        continue
                    what = "the dataset's size read as the population (declare it public)" if k == "population_size" else ""
                    add("ledger", f"ledger entry {run.ledger_entries - 1} ({ex.get('type')})",
                        f"{k}: {ex.get(k)!r} on D, {ey.get(k)!r} on D′" + (f": {what}" if what else ""))
        else:
            run.releases += 1
            rel_i += 1
            if x["denominator"] != y["denominator"]:
                add("denominator", where, f"{x['denominator']!r} on D, {y['denominator']!r} on D′")
            if x["noise"] != y["noise"]:
                add("noise", where, f"{x['noise']} on D, {y['noise']} on D′")
            if x["event"] != y["event"]:
                add("ledger", where, f"event {x['event']} on D, {y['event']} on D′")
            if len(x["parts"]) != len(y["parts"]):
                add("control flow", where, f"{len(x['parts'])} groups on D, {len(y['parts'])} on D′")
                continue
            for gi, (p, q) in enumerate(zip(x["parts"], y["parts"])):
                if p["sensitivity"] != q["sensitivity"] or p["scales"] != q["scales"]:
                    add("sensitivity", f"{where}, group {gi}",
                        f"declared {p['sensitivity']!r} on D, {q['sensitivity']!r} on D′")
                    continue
                if [s.shape for s in p["sums"]] != [s.shape for s in q["sums"]]:
                    add("control flow", f"{where}, group {gi}", "the sums have different shapes")
                    continue
                bound = mult * p["sensitivity"]
                dist = _part_distance(p, q)
                ratio = dist / bound if bound > 0 else (0.0 if dist == 0 else math.inf)
                ratios.append(ratio)
                if not ratio <= 1.0 + rtol:
                    add("sensitivity exceeded", f"{where}, group {gi}",
                        f"‖sum(D) − sum(D′)‖ = {dist:.6g} > {'2×' if mult == 2 else ''}declared {p['sensitivity']:.6g}")
    if len(a.events) != len(b.events) and not any(f.kind == "control flow" and f.where.startswith("trace") for f in findings):
        longer, which = (a, "D") if len(a.events) > len(b.events) else (b, "D′")
        extra = longer.events[min(len(a.events), len(b.events))]
        add("control flow", f"trace event {min(len(a.events), len(b.events))}",
            f"only the run on {which} goes on, with {_describe(extra)} ({len(a.events)} events on D, {len(b.events)} on D′)")
    run.max_ratio = max(ratios) if ratios else float("nan")
    return run
