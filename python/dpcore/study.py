"""A hyperparameter-tuning study: the ledgers of several training runs, accounted as one release.

Ponomareva et al. 2023 ("How to DP-fy ML", §5.4.2 and §5.3.3) ask that a model trained after
tuning on private data report at least the guarantee of the final run alone and, ideally, a
(weaker) guarantee that covers the tuning runs too. A :class:`Study` gives both, from the runs'
ledgers (:class:`dpcore.PrivacyLedger`), and :meth:`Study.report` states them with the
assumptions behind each (``dpcore report --study``).

A study is either a **directory** (every ``*.jsonl`` ledger in it is a run; an optional
``study.json`` in it adds the distribution and the selected run) or a **study file**::

    {"format": "dpcore-study", "version": 1,
     "distribution": {"mean": 10, "shape": 1} or null,   # shape "inf": Poisson
     "runs": ["run-0.jsonl", "run-1.jsonl"],              # relative to the file
     "selected": "run-1.jsonl",                           # optional: the run released
     "num_runs": 2, "seeded": false}                      # written by Study.create

Protocol (Papernot & Steinke 2022, arXiv:2110.03620): :meth:`Study.create` fixes the
distribution of the number of runs K, draws K (:func:`dpcore.accounting.tuning.draw_num_runs`,
ChaCha20 keyed from the OS) and records it; then K runs are made, each with hyperparameters
drawn at random independently of the data and with its own ledger, added with
:meth:`Study.add_run`; the best one is released (:meth:`Study.select`).

Accounting. One run's RDP curve is taken as the pointwise maximum over the runs' curves: a run
is a data-independent random choice of hyperparameters followed by training, a mixture of the
candidates' mechanisms, and Rényi divergence is jointly quasi-convex (van Erven & Harremoës 2014,
"Rényi divergence and Kullback-Leibler divergence", Theorem 13), so the mixture's divergence is
at most the largest candidate's; the runs of the study must include the candidate with the
largest cost (assumption stated in the report). Then:

(a) with a declared distribution: Papernot & Steinke's Theorem 2 (truncated negative binomial)
    or Theorem 6 (Poisson) on that curve (:func:`dpcore.accounting.tuning.rdp_repeat_and_select`),
    converted to (ε, δ) over the grid (Canonne, Kamath & Steinke 2020, Proposition 12). It holds
    for the released run while K and the other runs' outputs stay secret, and only if the number
    of runs made is the K drawn.
(b) the composition of all runs' events (PLD, or RDP where PLD cannot analyse a run): the
    guarantee of the runs that were made, K being data-independent, whatever of them is
    disclosed.

The tuning-inclusive ε is (a) when a distribution is declared and its conditions are met (the
runs made are the K drawn, not drawn from a test seed), (b) otherwise. The smaller of the two is *not* taken: which one is smaller depends on K, so
reporting the smaller would disclose something about K (that it is large when (a) is chosen),
and (a) does not hold for an adversary who knows that. (b) remains a valid statement and is
always reported beside (a), named as the statement that holds whatever is disclosed: state it
where K may be known.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Study", "StudyError", "StudyReport", "StudyRun", "STUDY_FORMAT", "STUDY_VERSION", "STUDY_FILE"]

STUDY_FORMAT = "dpcore-study"
STUDY_VERSION = 1
#: The study file's name in the directory form.
STUDY_FILE = "study.json"
_KEYS_REQUIRED = ("format", "version", "distribution", "runs")
_KEYS_OPTIONAL = ("selected", "num_runs", "seeded")

ASSUMPTIONS = (
    "Each run's hyperparameters were chosen independently of the data: drawn at random from the candidates, "
    "the same way for every run, and not from earlier runs' results.",
    "The runs of this study include the candidate with the largest privacy cost: one run's Rényi curve is "
    "taken as the largest of the runs' curves (a data-independent mixture of mechanisms costs at most its "
    "worst component: Rényi divergence is jointly quasi-convex, van Erven & Harremoës 2014, Theorem 13).",
    "The best run is chosen from the runs' outputs alone (scores computed from the released models on public "
    "data, or released with DP and recorded in the run's ledger).",
    "No run other than those listed here used the private data, and each run's ledger records everything "
    "that run released (see each ledger's own report for its assumptions: sampling, seeds, shuffling).",
)
PS_ASSUMPTION = (
    "Papernot & Steinke's bound (a) needs the number of runs K drawn from the declared distribution before "
    "any run, independently of the data, and kept secret together with the other runs' outputs: an adversary "
    "who knows K faces the fixed-K procedure, which it does not cover. This report discloses K; publish "
    "(a) without it, or state (b)."
)


class StudyError(ValueError):
    """A study that cannot be read, written or accounted (names the file and the reason)."""


def _shape_from_json(v: Any, where: str) -> float:
    if v == "inf":
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise StudyError(f'{where}: distribution "shape" must be a number >= 0 or "inf" (Poisson), got {v!r}')
    return float(v)


def _distribution_from_json(d: Any, where: str) -> Optional[Tuple[float, float]]:
    from .accounting.tuning import check_distribution

    if d is None:
        return None
    if not isinstance(d, dict) or set(d) != {"mean", "shape"}:
        raise StudyError(f'{where}: "distribution" must be null or an object with exactly "mean" and "shape", got {d!r}')
    mean = d["mean"]
    if isinstance(mean, bool) or not isinstance(mean, (int, float)):
        raise StudyError(f'{where}: distribution "mean" must be a number >= 1, got {mean!r}')
    try:
        return check_distribution(float(mean), _shape_from_json(d["shape"], where))
    except (TypeError, ValueError) as e:
        raise StudyError(f"{where}: bad distribution: {e}") from None


def _distribution_to_json(dist: Optional[Tuple[float, float]]) -> Any:
    if dist is None:
        return None
    mean, shape = dist
    return {"mean": mean, "shape": "inf" if math.isinf(shape) else shape}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value")


def _read_study_file(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f, parse_constant=_no_constant)
    except FileNotFoundError:
        raise StudyError(f"{path}: no such study file") from None
    except OSError as e:
        raise StudyError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise StudyError(f"{path}: not a JSON study file: {e}") from None
    if not isinstance(d, dict):
        raise StudyError(f"{path}: a study file holds a JSON object, got {type(d).__name__}")
    if d.get("format") != STUDY_FORMAT:
        raise StudyError(f'{path}: not a dpcore study file ("format" must be {STUDY_FORMAT!r}, got {d.get("format")!r})')
    if d.get("version") != STUDY_VERSION:
        raise StudyError(f"{path}: unsupported study file version {d.get('version')!r} (this dpcore reads {STUDY_VERSION})")
    missing = [k for k in _KEYS_REQUIRED if k not in d]
    unknown = sorted(set(d) - set(_KEYS_REQUIRED) - set(_KEYS_OPTIONAL))
    if missing or unknown:
        raise StudyError(
            f"{path}: "
            + "; ".join(
                ([f"missing key(s) {', '.join(missing)}"] if missing else [])
                + ([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
            )
        )
    runs = d["runs"]
    if not isinstance(runs, list) or not all(isinstance(r, str) and r for r in runs):
        raise StudyError(f'{path}: "runs" must be a list of ledger paths (strings), got {runs!r}')
    sel = d.get("selected")
    if sel is not None and (not isinstance(sel, str) or not sel):
        raise StudyError(f'{path}: "selected" must be a ledger path (a string) or null, got {sel!r}')
    k = d.get("num_runs")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise StudyError(f'{path}: "num_runs" must be an int >= 0 or null, got {k!r}')
    seeded = d.get("seeded", False)
    if not isinstance(seeded, bool):
        raise StudyError(f'{path}: "seeded" must be true or false, got {seeded!r}')
    return d


def _write_atomic(path: str, data: Dict[str, Any], *, exclusive: bool) -> None:
    """Writes ``data`` as JSON to ``path`` through a temporary file, fsync and a rename (or a
    link, with ``exclusive``: never over an existing file), so that a crash leaves either the old
    file or the new one, never half of one."""
    d = os.path.dirname(os.path.abspath(path))
    text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".study-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise StudyError(f"{path}: a study already exists there (its number of runs is drawn once)") from None
        else:
            os.replace(tmp, path)
            tmp = ""
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:  # pragma: no cover
                pass
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # pragma: no cover - platforms without directory fds
        pass


@dataclass(frozen=True)
class StudyRun:
    """One run of a study, as reported: its ledger, releases, ε alone and the accountant of it."""

    path: str
    releases: int
    epsilon: float
    accountant: str
    sha256: str
    selected: bool


@dataclass(frozen=True)
class StudyReport:
    """What a study guarantees at ``delta`` (:meth:`Study.report`); :meth:`to_dict` is the JSON
    form, :meth:`to_text` the Markdown one."""

    epsilon: float
    epsilon_basis: str
    delta: float
    neighboring: str
    privacy_unit: str
    epsilon_selected_run: Optional[float]
    selected_run: Optional[str]
    epsilon_papernot_steinke: Optional[float]
    papernot_steinke_order: Optional[float]
    papernot_steinke_note: Optional[str]
    epsilon_composition: float
    composition_accountant: str
    distribution: Optional[Dict[str, Any]]
    num_runs: int
    num_runs_drawn: Optional[int]
    runs: Tuple[StudyRun, ...]
    study: str
    dpcore_version: str
    assumptions: Tuple[str, ...] = ()
    warnings: Tuple[str, ...] = field(default=())

    def to_dict(self) -> Dict[str, Any]:
        from .ledger._report import json_safe

        return json_safe(
            {
                "epsilon": self.epsilon,
                "epsilon_basis": self.epsilon_basis,
                "delta": self.delta,
                "setting": "central",
                "privacy_unit": self.privacy_unit,
                "neighboring": self.neighboring,
                "selected_run": self.selected_run,
                "epsilon_selected_run": self.epsilon_selected_run,
                "epsilon_max_single_run": max(r.epsilon for r in self.runs),
                "epsilon_papernot_steinke": self.epsilon_papernot_steinke,
                "papernot_steinke_order": self.papernot_steinke_order,
                "papernot_steinke_note": self.papernot_steinke_note,
                "epsilon_composition": self.epsilon_composition,
                "composition_accountant": self.composition_accountant,
                "distribution": self.distribution,
                "num_runs": self.num_runs,
                "num_runs_drawn": self.num_runs_drawn,
                "runs": [
                    {"path": r.path, "releases": r.releases, "epsilon": r.epsilon, "accountant": r.accountant,
                     "sha256": r.sha256, "selected": r.selected}
                    for r in self.runs
                ],
                "assumptions": list(self.assumptions),
                "warnings": list(self.warnings),
                "study": self.study,
                "dpcore_version": self.dpcore_version,
            }
        )

    def to_text(self) -> str:
        from .ledger._report import format_number

        unit, d = self.privacy_unit, self.delta
        basis = {
            "papernot_steinke": "(a) Papernot & Steinke, the declared distribution of K (holds while K and the "
                                "other runs stay secret)",
            "composition": "(b) composition of the runs made (holds whatever is disclosed)",
        }[self.epsilon_basis]
        if self.selected_run is not None and self.epsilon_selected_run is not None:
            final = f"({format_number(self.epsilon_selected_run)}, {d:g})-DP: `{self.selected_run}` alone (its ledger's ε)"
        else:
            final = (
                f"no run selected; the largest ε of a single run is {format_number(max(r.epsilon for r in self.runs))} "
                f"at δ = {d:g}"
            )
        if self.epsilon_papernot_steinke is not None and self.distribution is not None:
            ps = (
                f"({format_number(self.epsilon_papernot_steinke)}, {d:g})-DP (RDP, order {self.papernot_steinke_order:g}): "
                f"the best of K ~ {self.distribution['name']} runs, E[K] = {self.distribution['mean']:g}; "
                "holds while K and the other runs stay secret"
            )
        else:
            ps = "n/a: " + (self.papernot_steinke_note or "no distribution of K declared")
        comp = (
            f"({format_number(self.epsilon_composition)}, {d:g})-DP ({self.composition_accountant}): all {self.num_runs} "
            "run(s) composed; holds whatever is disclosed"
        )
        rows = [
            ("Tuning-inclusive guarantee", f"({format_number(self.epsilon)}, {d:g})-DP at the {unit} level, from {basis}"),
            ("Final model alone", final),
            ("(a) Papernot & Steinke 2022", ps),
            ("(b) Composition of the runs", comp),
            ("DP setting", "central DP; trusted aggregator (each run clips and noises in the process holding the data)"),
            ("Unit of privacy", unit),
            ("Neighbouring relation", f"`{self.neighboring}`"),
            (
                "Data accesses covered",
                f"{self.num_runs} training run(s) of the study"
                + ("" if self.num_runs_drawn is None else f" (K drawn: {self.num_runs_drawn})")
                + "; the released output is the selected run's",
            ),
            ("Study", f"`{self.study}`"),
            ("dpcore", self.dpcore_version),
        ]
        out = ["# Privacy report of a tuning study", "", "| | |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in rows]
        out += ["", "## Runs", "", "| run | releases | ε alone | accountant | selected | SHA-256 |", "|---|---|---|---|---|---|"]
        for r in self.runs:
            out.append(
                f"| `{r.path}` | {r.releases} | {format_number(r.epsilon)} | {r.accountant} | {'yes' if r.selected else ''} | "
                f"`{r.sha256[:16]}…` |"
            )
        out += ["", "## Assumptions", ""] + [f"- {a}" for a in self.assumptions]
        out += ["", "## Warnings", ""] + ([f"- {w}" for w in self.warnings] or ["- none"])
        return "\n".join(out) + "\n"


class Study:
    """A tuning study: runs' ledgers, the distribution of the number of runs, the selected run.

    :meth:`load` reads a directory or a study file, :meth:`create` starts one (drawing K),
    :meth:`add_run` and :meth:`select` update its file atomically and this object with it, :meth:`epsilon` and
    :meth:`report` account it (see the module docstring for the analysis)."""

    def __init__(
        self,
        location: str,
        study_file: Optional[str],
        runs: Sequence[str],
        distribution: Optional[Tuple[float, float]],
        selected: Optional[str],
        num_runs_drawn: Optional[int],
        seeded: bool,
        listed: Sequence[str] = (),
    ) -> None:
        self._location = location
        self._file = study_file
        self._runs = tuple(runs)  # as displayed: relative to the study's directory when inside it
        self._listed = tuple(listed)  # what the study file lists (written back by add_run)
        self._distribution = distribution
        self._selected = selected
        self._num_runs_drawn = num_runs_drawn
        self._seeded = seeded

    # -- reading ------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The directory or study file the study was loaded from."""
        return self._location

    @property
    def base_dir(self) -> str:
        return self._location if self._file is None or os.path.isdir(self._location) else os.path.dirname(os.path.abspath(self._file))

    @property
    def runs(self) -> Tuple[str, ...]:
        """The runs' ledger paths, relative to the study's directory (as listed)."""
        return self._runs

    @property
    def distribution(self) -> Optional[Tuple[float, float]]:
        """(mean, shape) of the declared distribution of K, or None."""
        return self._distribution

    @property
    def selected(self) -> Optional[str]:
        return self._selected

    @property
    def num_runs_drawn(self) -> Optional[int]:
        """The K drawn by :meth:`create`, if recorded."""
        return self._num_runs_drawn

    @property
    def seeded(self) -> bool:
        return self._seeded

    def __repr__(self) -> str:
        return f"Study({self._location!r}, runs={len(self._runs)}, distribution={self._distribution})"

    @classmethod
    def load(cls, path: "os.PathLike[str] | str") -> "Study":
        """The study in ``path``: a directory (its ``*.jsonl`` ledgers, and ``study.json`` if
        present) or a study file. Raises :class:`StudyError` for a missing or malformed study,
        a run listed twice, or a ``selected`` run that is not in the study; the ledgers are read
        when accounting."""
        p = os.fspath(path)
        if not isinstance(p, str):
            raise TypeError("path must be a str or os.PathLike[str]")
        if os.path.isdir(p):
            sf = os.path.join(p, STUDY_FILE)
            d = _read_study_file(sf) if os.path.isfile(sf) else None
            base = p
            found = sorted(n for n in os.listdir(p) if n.endswith(".jsonl") and os.path.isfile(os.path.join(p, n)))
        elif os.path.exists(p):
            sf, d = p, _read_study_file(p)
            base = os.path.dirname(os.path.abspath(p))
            found = []
        else:
            raise StudyError(f"{p}: no such study directory or file")
        listed = list(d["runs"]) if d is not None else []
        runs: List[str] = []
        seen: Dict[str, str] = {}
        for i, r in enumerate(listed + found):
            key = os.path.realpath(os.path.join(base, r))
            if key in seen:
                if i >= len(listed):
                    continue  # listed in study.json and also found in the directory
                raise StudyError(f"{sf}: run {r!r} is listed twice (as {seen[key]!r})")
            seen[key] = r
            runs.append(r)
        where = sf if d is not None else p
        dist = _distribution_from_json(d["distribution"], where) if d is not None else None
        selected = d.get("selected") if d is not None else None
        if selected is not None and os.path.realpath(os.path.join(base, selected)) not in seen:
            raise StudyError(f"{where}: the selected run {selected!r} is not one of the study's runs")
        return cls(
            p, sf if d is not None else None, runs, dist, selected,
            d.get("num_runs") if d is not None else None, bool(d.get("seeded", False)) if d is not None else False,
            listed,
        )

    # -- writing ------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: "os.PathLike[str] | str",
        mean: Optional[float] = None,
        shape: Optional[float] = None,
        *,
        seed: Optional[int] = None,
    ) -> "Study":
        """Starts a study at ``path`` and, with a distribution (``mean`` = E[K], ``shape`` = η,
        inf for Poisson), draws its number of runs K now and records it
        (:func:`dpcore.accounting.tuning.draw_num_runs`): make exactly :attr:`num_runs_drawn`
        runs, each with its own ledger (:meth:`add_run`), then :meth:`select` the best.

        ``path``: a directory (created if needed; the study file is ``study.json`` in it and
        every ``*.jsonl`` put there is a run) or a file name ending in ``.json``. An existing
        study is never overwritten (K is drawn once), and a directory that already holds ledgers
        is refused (K must be drawn before any run). ``seed`` is for tests only: a K drawn from
        a known seed is known, which voids bound (a) (the report says so)."""
        from .accounting.tuning import check_distribution, draw_num_runs

        p = os.fspath(path)
        if (mean is None) != (shape is None):
            raise ValueError("give both mean and shape (the distribution of the number of runs), or neither")
        dist = check_distribution(mean, shape) if mean is not None else None
        directory = not p.endswith(".json")
        if directory:
            os.makedirs(p, exist_ok=True)
            if os.path.exists(os.path.join(p, STUDY_FILE)):
                raise StudyError(f"{os.path.join(p, STUDY_FILE)}: a study already exists there (its number of runs is drawn once)")
            ledgers = [n for n in os.listdir(p) if n.endswith(".jsonl")]
            if ledgers:
                raise StudyError(
                    f"{p}: the directory already holds ledgers ({', '.join(sorted(ledgers)[:3])}…): a study's number "
                    "of runs must be drawn before any run"
                )
            sf = os.path.join(p, STUDY_FILE)
        else:
            sf = p
            if not os.path.isdir(os.path.dirname(os.path.abspath(sf))):
                raise StudyError(f"{sf}: its directory does not exist")
        if os.path.exists(sf):
            raise StudyError(f"{sf}: a study already exists there (its number of runs is drawn once)")
        k = draw_num_runs(dist[0], dist[1], seed=seed) if dist is not None else None
        data = {
            "format": STUDY_FORMAT, "version": STUDY_VERSION, "distribution": _distribution_to_json(dist),
            "runs": [], "selected": None, "num_runs": k, "seeded": seed is not None,
        }
        _write_atomic(sf, data, exclusive=True)
        return cls.load(p)

    def _rewrite(self, **changes: Any) -> "Study":
        if self._file is None:
            raise StudyError(f"{self._location}: the directory has no {STUDY_FILE} to record this in; create one with Study.create")
        d = _read_study_file(self._file)
        d.update(changes)
        _write_atomic(self._file, d, exclusive=False)
        # this object follows its file: the caller's ``study`` is the study as now recorded
        self.__dict__.update(Study.load(self._location).__dict__)
        return self

    def _relative(self, ledger: "os.PathLike[str] | str") -> str:
        lp = os.path.abspath(os.fspath(ledger))
        rel = os.path.relpath(lp, os.path.abspath(self.base_dir))
        return lp if rel.startswith(os.pardir) else rel

    def add_run(self, ledger: "os.PathLike[str] | str") -> "Study":
        """Lists the ledger of one more run in the study file (the ledger may not exist yet: a
        run about to start) and in this object; returns this study (``study = study.add_run(p)``
        works too). A ledger listed twice is refused, and a refused update changes nothing."""
        rel = self._relative(ledger)
        key = os.path.realpath(os.path.join(self.base_dir, rel))
        if any(os.path.realpath(os.path.join(self.base_dir, r)) == key for r in self._listed):
            raise StudyError(f"{self._file}: run {rel!r} is already in the study")
        return self._rewrite(runs=list(self._listed) + [rel])

    def select(self, ledger: "os.PathLike[str] | str") -> "Study":
        """Records, in the study file and in this object, which run's output is released (it must
        be one of the study's runs); returns this study."""
        rel = self._relative(ledger)
        key = os.path.realpath(os.path.join(self.base_dir, rel))
        if all(os.path.realpath(os.path.join(self.base_dir, r)) != key for r in self._runs):
            raise StudyError(f"{self._location}: {rel!r} is not one of the study's runs; add it first")
        return self._rewrite(selected=rel)

    # -- accounting ---------------------------------------------------------------------

    def _ledgers(self) -> List[Tuple[str, Any, List[str]]]:
        """(path as listed, loaded ledger, its load warnings) for each run."""
        from .ledger import LedgerError, PrivacyLedger

        if not self._runs:
            drawn = "" if self._num_runs_drawn is None else f" (it drew K = {self._num_runs_drawn})"
            raise StudyError(f"{self._location}: the study holds no run{drawn}: there is nothing to account")
        out = []
        for r in self._runs:
            full = os.path.join(self.base_dir, r)
            if not os.path.isfile(full):
                raise StudyError(f"{full}: missing ledger of run {r!r}")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    led = PrivacyLedger.load(full)
                except LedgerError as e:
                    raise StudyError(f"run {r!r}: {e}") from None
                except OSError as e:
                    raise StudyError(f"{full}: {e.strerror or e}") from None
            out.append((r, led, [str(w.message) for w in caught]))
        units = {led.privacy_unit for _, led, _ in out}
        if len(units) > 1:
            raise StudyError(f"{self._location}: the runs record different privacy units ({', '.join(sorted(units))})")
        return out

    def epsilon(self, delta: float, *, neighboring: Optional[str] = None, accountant: str = "pld") -> float:
        """The tuning-inclusive ε at ``delta``: bound (a) when a distribution is declared and
        applies, (b) otherwise (see the module docstring)."""
        return self.report(delta, neighboring=neighboring, accountant=accountant).epsilon

    def report(self, delta: float, *, neighboring: Optional[str] = None, accountant: str = "pld") -> StudyReport:
        """The study's privacy report at ``delta`` (:class:`StudyReport`): the final run's own
        guarantee, bounds (a) and (b), per-run lines, assumptions and warnings.

        ``accountant`` is that of each run's own ε and of the composition (b): ``"pld"`` (the
        default, RDP where PLD cannot analyse a ledger, as :meth:`dpcore.PrivacyLedger.get_epsilon`)
        or ``"rdp"``. Bound (a) is a Rényi bound."""
        from ._core import __version__
        from .accounting import make_accountant
        from .accounting.base import check_accountant, check_delta
        from .accounting.rdp import epsilon_from_rdp
        from .accounting.tuning import distribution_name, rdp_repeat_and_select
        from .events import ComposedEvent
        from .ledger._events import analysis_relation, check_neighboring
        from .ledger._report import file_sha256

        delta = check_delta(delta)
        check_accountant(accountant)
        runs = self._ledgers()
        if neighboring is None:
            # one relation for every run: zero-out holds for every run that add-or-remove holds for
            neighboring = "zero_out" if any(led.neighboring == "zero_out" for _, led, _ in runs) else "add_or_remove"
        check_neighboring(neighboring)
        notes: List[str] = []
        for r, _, ws in runs:
            notes += [f"run {r}: {w}" for w in ws]

        def caught(fn: Any, label: str) -> Any:
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                try:
                    v = fn()
                except ValueError as e:
                    raise StudyError(f"{label}: {e}") from None
            for w in ws:
                msg = f"{label}: {w.message}"
                if msg not in notes:
                    notes.append(msg)
            return v

        per_run: List[StudyRun] = []
        events, curves = [], []
        sel_key = None if self._selected is None else os.path.realpath(os.path.join(self.base_dir, self._selected))
        for r, led, _ in runs:
            acct = caught(lambda: led._accountant(accountant, neighboring, None), f"run {r}")
            eps = acct.get_epsilon(delta)
            events.append(caught(lambda: led.to_event(neighboring), f"run {r}"))
            rdp_acct = acct if acct.name == "rdp" else caught(lambda: led._accountant("rdp", neighboring, None), f"run {r}")
            curves.append(rdp_acct.rdp)
            orders = rdp_acct.orders
            full = os.path.join(self.base_dir, r)
            per_run.append(StudyRun(
                path=r, releases=led.num_releases, epsilon=eps, accountant=acct.name, sha256=file_sha256(full),
                selected=sel_key is not None and os.path.realpath(full) == sel_key,
            ))

        # (b) the composition of every run, under one analysis (PLD unless it cannot analyse all).
        composed = ComposedEvent(tuple(events))
        comp = make_accountant("pld", analysis_relation(neighboring)) if accountant == "pld" else None
        if comp is not None and comp.supports(composed):
            comp.compose(composed)
        else:
            if comp is not None:
                notes.append("the composition (b) is accounted with RDP: the PLD accountant cannot analyse every run")
            comp = make_accountant("rdp", analysis_relation(neighboring))
            try:
                comp.compose(composed)
            except ValueError as e:
                raise StudyError(f"{self._location}: the runs cannot be composed under {neighboring!r}: {e}") from None
        eps_b = comp.get_epsilon(delta)

        # (a) Papernot & Steinke on the largest of the runs' curves.
        eps_a: Optional[float] = None
        order_a: Optional[float] = None
        why_not_a: Optional[str] = None
        dist_out: Optional[Dict[str, Any]] = None
        k = len(runs)
        if self._distribution is not None:
            mean, shape = self._distribution
            dist_out = {"mean": mean, "shape": shape, "name": distribution_name(shape), "num_runs_drawn": self._num_runs_drawn}
            if self._num_runs_drawn is not None and self._num_runs_drawn != k:
                why_not_a = (
                    f"the study drew K = {self._num_runs_drawn} runs but holds {k}: bound (a) covers the protocol only "
                    "when exactly the drawn number of runs is made"
                    + (" (an unfinished study: account it when its runs are done)" if k < self._num_runs_drawn else "")
                )
            else:
                base = np.max(np.vstack(curves), axis=0)
                tuned = rdp_repeat_and_select(orders, base, mean, shape)
                eps_a, order_a = epsilon_from_rdp(orders.tolist(), tuned.tolist(), delta)
                if self._num_runs_drawn is None:
                    notes.append(
                        "the study file does not record the K drawn: bound (a) assumes the number of runs listed was "
                        "drawn from the declared distribution before any run"
                    )
        if eps_a is not None and not self._seeded:
            eps, basis = eps_a, "papernot_steinke"
            if eps_b < eps_a:
                notes.append(
                    f"the composition of the {k} run(s) made, (b) ε = {eps_b:.6g}, is below (a) here and may be stated "
                    "instead (it holds given K, whatever is disclosed); the two are not combined by taking the "
                    "smaller, since which one is smaller depends on K, and (a) needs K secret"
                )
        else:
            eps, basis = eps_b, "composition"
        if self._seeded:
            notes.append(
                "the number of runs was drawn with a test seed: it is predictable, which voids bound (a); the "
                "tuning-inclusive ε is the composition (b)"
            )
        if self._selected is None:
            notes.append("no run is recorded as selected (the released one): Study.select records it")

        selected_eps = next((r.epsilon for r in per_run if r.selected), None)
        unit = runs[0][1].privacy_unit
        assumptions = tuple(a for a in ASSUMPTIONS) + ((PS_ASSUMPTION,) if self._distribution is not None else ())
        return StudyReport(
            epsilon=eps,
            epsilon_basis=basis,
            delta=delta,
            neighboring=neighboring,
            privacy_unit=unit,
            epsilon_selected_run=selected_eps,
            selected_run=self._selected,
            epsilon_papernot_steinke=eps_a,
            papernot_steinke_order=order_a,
            papernot_steinke_note=why_not_a,
            epsilon_composition=eps_b,
            composition_accountant=comp.name,
            distribution=dist_out,
            num_runs=k,
            num_runs_drawn=self._num_runs_drawn,
            runs=tuple(per_run),
            study=self._location,
            dpcore_version=__version__,
            assumptions=assumptions,
            warnings=tuple(notes),
        )
