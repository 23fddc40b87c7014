"""The privacy report of a ledger: what a trained model guarantees, from what actually ran.

It states what Ponomareva et al. 2023 ("How to DP-fy ML", §5.3.3) ask of an honest DP claim:
the DP setting, the unit of privacy, the neighbouring relation, the data accesses (releases and
the sampling policy of each segment), the mechanism (noise multiplier and clip norm of each
query group, and the effective noise multiplier of Eq. (1) of McMahan et al. 2018), the
accounting (ε at δ under PLD with its lower bound, and RDP beside it), and the assumptions
behind the number. Everything comes from the ledger file alone; its SHA-256 makes the report
reproducible.

Matrix-factorization streams get a section of their own: the strategy (bands or buffers), the
participation schema, the steps run against the planned ones, the sensitivity recomputed for the
steps run, σ/S and the effective noise multiplier σ/(S·sens) the stream is accounted with
(:mod:`dpcore.ledger._events`).
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._events import StreamAccount, account_streams, analysis_relation, samples_to_event
from ._entries import CYCLIC_POISSON, USER, LedgerWarning
from ._storage import SampleLog

__all__ = ["PrivacyReport", "build_report", "epsilon_curve"]

SETTING = "central"
TRUST_MODEL = "trusted aggregator: the process that holds the records clips them and adds the noise"
NEIGHBORING_TEXT = {
    "add_or_remove": "add or remove one {unit}: neighbouring datasets differ by the records of one {unit}",
    "zero_out": "zero out one {unit}: neighbouring datasets have the same number of records, and in one of them the "
                "records of one {unit} are replaced by records that contribute nothing (zero gradient); the number of "
                "records is public",
    "replace_one": "replace one {unit} by another",
}
ASSUMPTIONS = (
    "Samples recorded with the shuffle or sequential policy (and queries on cyclic batches outside a "
    "matrix-factorization stream) get no sampling amplification: each record is in one batch an epoch, and an "
    "epoch is one Gaussian query, its sensitivity that of the neighbouring relation; the number of steps an epoch "
    "(which depends on the number of records) is treated as public.",
    "Samples drawn with a test seed void the guarantee: a seeded sample is predictable, so the "
    "amplification counted for it does not hold.",
    "Hyperparameter tuning is not included: runs made to choose the hyperparameters cost privacy too, "
    "and are not in this ledger; account the tuning runs and this one together with `dpcore report --study` "
    "(dpcore.study.Study: Papernot & Steinke 2022).",
    "Each record is one {unit}. The population size n recorded for each sample is public: the sampling "
    "probability and the fixed denominator of an average (q·n) are stated for it. Under add-or-remove adjacency "
    "the true number of records is itself data; dpcore's adapters record the size declared with "
    "population_size=, and otherwise read it from the dataset and assume it public.",
    "The noise and the sampling come from ChaCha20 keyed from the operating system (no test seed).",
)
ELS_ASSUMPTION = (
    "Example-level sampling with a user-level guarantee: the records sampled are examples; before training, each "
    "user's examples were bounded to at most the recorded max_examples_per_user in total (which ones chosen at "
    "random, not from the data), and the population size recorded is the number of examples kept. The ledger "
    "records the bound, not the bounding: the mixture-of-Gaussians accounting of a user assumes it held."
)
DROPOUT_ASSUMPTION = (
    "Dropouts (user unit): a sampled user that delivers nothing, a federated client that failed, timed out or sent "
    "something that is not an update of the model (dpcore.flower), contributes nothing to that step's release, as a "
    "user absent from the population would; the step is still released and recorded, with the planned denominator "
    "and noise, so the ε holds whatever drops out. Dropouts only shrink the average towards zero (the denominator "
    "is the expected number of users, not the number that answered)."
)
MF_ASSUMPTION = (
    "Matrix-factorization streams: the data pipeline followed each stream's declared participation "
    "schema (the records cut once into b batches or groups, batch t mod b used at step t, so that one "
    "{unit} takes part at most once every b steps). The ledger records the policy of each sample, not "
    "which records were in it; this is what the sensitivity assumes."
)


@dataclass(frozen=True)
class PrivacyReport:
    """What a ledger guarantees at ``delta`` (:meth:`dpcore.PrivacyLedger.report`).

    :meth:`to_dict` gives the JSON form, :meth:`to_markdown` the table."""

    epsilon: float
    delta: float
    accountant: str
    epsilon_lower_bound: Optional[float]
    epsilon_rdp: Optional[float]
    releases: int
    samples: int
    privacy_unit: str
    neighboring: str
    noise_multiplier: Tuple[float, ...]
    effective_noise_multiplier: float
    segments: Tuple[Dict[str, Any], ...]
    ledger_path: str
    ledger_sha256: str
    dpcore_version: str
    warnings: Tuple[str, ...] = ()
    assumptions: Tuple[str, ...] = field(default=())
    #: The matrix-factorization streams, one dict each (see :func:`stream_summary`).
    streams: Tuple[Dict[str, Any], ...] = ()
    #: The sampling policies that ran, one dict each (see :func:`sampler_summary`).
    samplers: Tuple[Dict[str, Any], ...] = ()
    #: For a ledger with shuffled batches: the sampler to switch to, and the ε it would give.
    suggestion: Optional[str] = None
    #: For a user-level ledger: the bound on a user's contribution, in words (see
    #: :func:`contribution_bound`); None for an example-level one.
    contribution_bound: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return {
            "epsilon": _num(self.epsilon),
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon_lower_bound": _num(self.epsilon_lower_bound),
            "epsilon_rdp": _num(self.epsilon_rdp),
            "setting": SETTING,
            "trust_model": TRUST_MODEL,
            "privacy_unit": self.privacy_unit,
            "neighboring": self.neighboring,
            "releases": self.releases,
            "samples": self.samples,
            "segments": [dict(s) for s in self.segments],
            "mf_streams": [dict(s) for s in self.streams],
            "samplers": [dict(s) for s in self.samplers],
            "suggestion": self.suggestion,
            "contribution_bound": self.contribution_bound,
            "noise_multiplier": [_num(z) for z in self.noise_multiplier],
            "effective_noise_multiplier": _num(self.effective_noise_multiplier),
            "assumptions": list(self.assumptions),
            "warnings": list(self.warnings),
            "ledger": self.ledger_path,
            "ledger_sha256": self.ledger_sha256,
            "dpcore_version": self.dpcore_version,
        }

    def to_markdown(self) -> str:
        unit = self.privacy_unit
        lo = "" if self.epsilon_lower_bound is None else f" (lower bound {_fmt(self.epsilon_lower_bound)})"
        rdp = "n/a" if self.epsilon_rdp is None else _fmt(self.epsilon_rdp)
        guarantee = f"({_fmt(self.epsilon)}, {self.delta:g})-DP at the {unit} level"
        if unit == USER:
            guarantee = f"user-level (ε, δ) = ({_fmt(self.epsilon)}, {self.delta:g}): {guarantee}"
        rows = [
            ("Guarantee", guarantee),
            ("DP setting", f"{SETTING} DP; {TRUST_MODEL}"),
            ("Unit of privacy", unit),
            *([("Contribution bound", self.contribution_bound)] if self.contribution_bound else []),
            ("Neighbouring relation", f"`{self.neighboring}`: " + NEIGHBORING_TEXT[self.neighboring].format(unit=unit)),
            ("Data accesses", f"{self.releases} releases from {self.samples} samples, in {len(self.segments)} segment(s)"),
            ("Noise multiplier per query group", ", ".join(_fmt(z) for z in self.noise_multiplier) or "n/a"),
            (
                "Effective noise multiplier (Eq. 1" + ("; MF streams: σ/(S·sens))" if self.streams else ")"),
                _fmt(self.effective_noise_multiplier),
            ),
            (f"ε at δ = {self.delta:g}", f"{_fmt(self.epsilon)} ({self.accountant}){lo}; RDP: {rdp}"),
            ("Ledger", f"`{self.ledger_path}`, SHA-256 `{self.ledger_sha256}`"),
            ("dpcore", self.dpcore_version),
        ]
        out = ["# Privacy report", "", "| | |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in rows]
        out += ["", "## Segments", "", "| steps | releases | policy | population | q or batch size | clip norm per group | noise multiplier per group | effective z |",
                "|---|---|---|---|---|---|---|---|"]
        for s in self.segments:
            rate = f"q = {s['sampling_probability']:.6g}" if s["sample_size"] is None else f"b = {s['sample_size']}"
            mf = s.get("mf_groups", [])
            clips = ", ".join([_fmt(g["l2_norm_clip"]) for g in s["groups"]] + [_fmt(g["l2_norm_clip"]) for g in mf]) or "-"
            zs = ", ".join(
                [_fmt(g["noise_multiplier"]) for g in s["groups"]]
                + [f"σ/S = {_fmt(g['stddev_over_clip'])} (MF stream {_short(g['stream'])})" for g in mf]
            ) or "-"
            z = s["effective_noise_multiplier"]
            out.append(
                f"| {s['first_step']}–{s['first_step'] + s['steps'] - 1} | {s['releases']} | {s['policy']} | "
                f"{s['population_size']} | {rate} | {clips} | {zs} | {'per stream' if z is None else _fmt(z)} |"
            )
        if self.streams:
            out += ["", "## Matrix-factorization streams", "",
                    "| stream | mechanism | participation schema | steps run / planned | participations | "
                    "sensitivity (recomputed) | σ/S (min) | effective z = σ/(S·sens) | sampling amplification |",
                    "|---|---|---|---|---|---|---|---|---|"]
            for m in self.streams:
                out.append(
                    f"| `{m['stream']}` | {m['mechanism']} | {m['participation']} | {m['steps']} / {m['planned_steps']} | "
                    f"{m['participations']} | {_fmt(m['sensitivity'])} | {_fmt(m['noise_multiplier'])} | "
                    f"{_fmt(m['effective_noise_multiplier'])} | {m['amplification']} |"
                )
        if self.samplers:
            out += ["", "## Samplers", "", "| policy | steps | what the accountant assumes | amplification | event (accountant) |",
                    "|---|---|---|---|---|"]
            for m in self.samplers:
                out.append(f"| {m['policy']} | {m['steps']} | {m['assumes']} | {m['amplification']} | {m['event']} |")
        if self.suggestion:
            out += ["", "**Sampler:** " + self.suggestion]
        out += ["", "## Assumptions", ""] + [f"- {a}" for a in self.assumptions]
        out += ["", "## Warnings", ""] + ([f"- {w}" for w in self.warnings] or ["- none"])
        return "\n".join(out) + "\n"


def json_safe(v: Any) -> Any:
    """``v`` with every non-finite float written as a string ("inf", "-inf", "nan"): JSON has
    no infinity, and ε = ∞ (a non-private release) must still be printable."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


_num = json_safe


def format_number(v: float) -> str:
    """A number as reports print it (ε, noise multipliers, clip norms): six significant digits,
    ∞ for infinity."""
    return "∞" if v == math.inf else f"{v:.6g}"


_fmt = format_number


def _short(stream: str) -> str:
    return stream if len(stream) <= 12 else stream[:8] + "…"


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _segments(log: SampleLog) -> List[Dict[str, Any]]:
    segs: List[Dict[str, Any]] = []
    step = 0
    for s, k in log.runs():
        groups = [
            {
                "l2_norm_clip": q.l2_norm_clip,
                "stddev": q.stddev,
                "noise_multiplier": (q.stddev / q.l2_norm_clip) if q.stddev > 0 else 0.0,
            }
            for q in s.independent_queries
        ]
        # The steps of MF streams: σ/S is not their noise multiplier (that is the stream's, over
        # all its steps: σ/(S·sens)); it is shown as what it is.
        mf_groups = [
            {"stream": q.stream, "l2_norm_clip": q.l2_norm_clip, "stddev": q.stddev, "stddev_over_clip": q.stddev / q.l2_norm_clip}
            for ts in s.stream_queries().values()
            for q in ts
        ]
        z = s.noise_multiplier() if s.released else math.inf
        seg = {
            "first_step": step,
            "steps": k,
            "releases": k if s.released else 0,
            "policy": s.policy,
            "population_size": s.population_size,
            "sampling_probability": s.sampling_probability,
            "sample_size": s.sample_size,
            "seeded": k if s.seeded else 0,
            "non_private": s.non_private,
            "groups": groups,
            "mf_groups": mf_groups,
            # None: every query on these samples is a step of an MF stream (accounted per stream).
            "effective_noise_multiplier": None if math.isinf(z) and s.released else z,
            # user-level ledgers: the contribution bound of these samples (None: none recorded)
            "examples_per_user": s.examples_per_user,
            "max_examples_per_user": s.max_examples_per_user,
        }
        prev = segs[-1] if segs else None
        same = prev is not None and all(
            prev[key] == seg[key]
            for key in ("policy", "population_size", "sampling_probability", "sample_size", "non_private", "groups",
                        "mf_groups", "examples_per_user", "max_examples_per_user")
        )
        if same:
            prev["steps"] += k
            prev["releases"] += seg["releases"]
            prev["seeded"] += seg["seeded"]
        else:
            segs.append(seg)
        step += k
    return segs


def build_report(ledger: Any, delta: float, *, neighboring: Optional[str] = None, accountant: str = "pld") -> PrivacyReport:
    """The report of ``ledger`` (a :class:`dpcore.PrivacyLedger`) at ``delta``; ε is exactly
    ``ledger.get_epsilon(delta, accountant, neighboring=...)``, with the PLD lower bound and
    the RDP value beside it."""
    from .._core import __version__
    from ..accounting import PldAccountant
    from ..accounting.base import check_delta

    delta = check_delta(delta)
    neighboring = ledger._relation(neighboring)
    notes: List[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acct = ledger._accountant(accountant, neighboring, None)
        used = acct.name
        lower: Optional[float] = None
        if isinstance(acct, PldAccountant):
            lower, eps = acct.get_epsilon_bounds(delta)  # one pass: the upper bound is get_epsilon's
        else:
            eps = acct.get_epsilon(delta)
        try:
            eps_rdp: Optional[float] = ledger._accountant("rdp", neighboring, None).get_epsilon(delta) if used != "rdp" else eps
        except ValueError as e:
            eps_rdp = None
            notes.append(f"no RDP value: {e}")
    for w in caught:
        if issubclass(w.category, (LedgerWarning, UserWarning)):
            msg = str(w.message)
            if msg not in notes:
                notes.append(msg)
    log = ledger._samples
    segs = _segments(log)
    streams = [stream_summary(a) for a in account_streams(log, ledger.path)]
    released = [s for s in segs if s["releases"]]
    if any(s["non_private"] or s["effective_noise_multiplier"] == 0.0 for s in released) or any(
        m["effective_noise_multiplier"] == 0.0 for m in streams
    ):
        notes.append("some releases were made without noise (non-private): ε is infinite")
    for m in streams:
        if m["steps"] > m["planned_steps"]:
            notes.append(
                f"matrix-factorization stream {m['stream']} ran {m['steps']} steps, beyond the {m['planned_steps']} "
                "planned: it is accounted for the steps that ran (a larger sensitivity than the one its noise was "
                "chosen for, so a larger ε than planned)"
            )
    if ledger.torn_tail is not None:
        notes.append(f"the ledger's last line {ledger.torn_tail.line} was torn (a step that stopped mid-write)")
    ngroups = max((len(s["groups"]) for s in released), default=0)
    per_group = tuple(
        min((s["groups"][g]["noise_multiplier"] for s in released if len(s["groups"]) > g), default=math.inf)
        for g in range(ngroups)
    )
    z_eff = min(
        [s["effective_noise_multiplier"] for s in released if s["effective_noise_multiplier"] is not None]
        + [m["effective_noise_multiplier"] for m in streams],
        default=math.inf,
    )
    unit = ledger.privacy_unit
    path = ledger.path
    sha = file_sha256(path) if os.path.isfile(path) else ""
    samplers = sampler_summary(segs)
    suggestion = shuffle_suggestion(segs, delta, eps, neighboring) if neighboring != "replace_one" else None
    bound = contribution_bound(segs) if unit == USER else None
    return PrivacyReport(
        epsilon=eps,
        delta=delta,
        accountant=used,
        epsilon_lower_bound=lower,
        epsilon_rdp=eps_rdp,
        releases=sum(s["releases"] for s in segs),
        samples=len(log),
        privacy_unit=unit,
        neighboring=neighboring,
        noise_multiplier=per_group,
        effective_noise_multiplier=z_eff,
        segments=tuple(segs),
        ledger_path=path,
        ledger_sha256=sha,
        dpcore_version=__version__,
        warnings=tuple(notes),
        assumptions=tuple(a.format(unit=unit) for a in ASSUMPTIONS + ((MF_ASSUMPTION,) if streams else ())
                          + ((ELS_ASSUMPTION,) if any(g["max_examples_per_user"] for g in released) else ())
                          + ((DROPOUT_ASSUMPTION,) if unit == USER else ())),
        streams=tuple(streams),
        samplers=tuple(samplers),
        suggestion=suggestion,
        contribution_bound=bound,
    )


def _values(xs: Sequence[Any]) -> str:
    """Distinct values in order of appearance, as words ("5", "5 and 8", "5, 8 and 9")."""
    out: List[str] = []
    for x in xs:
        t = f"{x:g}" if isinstance(x, float) else str(x)
        if t not in out:
            out.append(t)
    return out[0] if len(out) == 1 else ", ".join(out[:-1]) + " and " + out[-1]


def contribution_bound(segments: Sequence[Dict[str, Any]]) -> str:
    """What a user-level ledger's samples bound, in words, from the bounds its released samples
    recorded: user-level sampling (``examples_per_user``), example-level sampling with a
    user-level guarantee (``max_examples_per_user``), or users as records with no bound recorded."""
    released = [s for s in segments if s["releases"]]
    els = [s for s in released if s["max_examples_per_user"] is not None]
    uls = [s for s in released if s["max_examples_per_user"] is None and s["examples_per_user"] is not None]
    plain = [s for s in released if s["max_examples_per_user"] is None and s["examples_per_user"] is None]
    parts = []
    if els:
        parts.append(
            f"each user's data bounded to at most {_values([s['max_examples_per_user'] for s in els])} examples in "
            f"total; examples Poisson-sampled (q = {_values([s['sampling_probability'] for s in els])} from "
            f"{_values([s['population_size'] for s in els])} examples); accounted as a mixture of Gaussians "
            "(Ganesh 2024)"
        )
    if uls:
        parts.append(
            f"each user contributes the clipped mean of at most {_values([s['examples_per_user'] for s in uls])} "
            f"examples per step, sampled as a user among {_values([s['population_size'] for s in uls])} users"
        )
    if plain:
        parts.append(
            f"each record is one user (among {_values([s['population_size'] for s in plain])}), its contribution "
            "clipped as one record (no bound on its examples recorded)"
        )
    return "; ".join(parts) if parts else "no release recorded"


def policy_text(policy: str) -> Any:
    """What a sampling policy of the ledger means for the accountant, from its sampler class
    (:attr:`dpcore.sampling.Sampler.report_text`): what it assumes of the data pipeline, the
    amplification it gets, the event and accountant it is analysed with."""
    from ..sampling import registered_samplers, sampler_class

    if policy not in registered_samplers():
        return ("?", "?", "?")
    cls = sampler_class(policy)
    return cls.report_text or (cls.guarantee or "?", "?", "?")


def sampler_summary(segments: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One entry per sampling policy that released something: its steps and what the
    accountant assumes of it (:func:`policy_text`)."""
    steps: Dict[str, int] = {}
    for s in segments:
        if s["releases"]:
            steps[s["policy"]] = steps.get(s["policy"], 0) + s["releases"]
    out = []
    for policy, k in steps.items():
        assumes, amp, event = policy_text(policy)
        out.append({"policy": policy, "steps": k, "assumes": assumes, "amplification": amp, "event": event})
    return out


def shuffle_suggestion(
    segments: Sequence[Dict[str, Any]], delta: float, epsilon: float, neighboring: str = "zero_out"
) -> Optional[str]:
    """For a ledger whose private steps include shuffled batches (accounted without
    amplification): the samplers that keep the batch shape and do get amplification, with the ε
    the same steps would have had under them (same population, noise and expected batch size);
    None when no step was shuffled. Only the shuffled steps are replaced; the rest of the
    ledger is accounted as recorded."""
    from .. import accounting as acc

    from ..sampling import registered_samplers, sampler_class

    epochal = [n for n in registered_samplers() if sampler_class(n).rounds == "epoch"]
    shuffled = [s for s in segments if s["policy"] in epochal and s["releases"]]
    if not shuffled or not math.isfinite(epsilon):
        return None
    if any(s["effective_noise_multiplier"] in (None, 0.0) or not s["sample_size"] for s in shuffled):
        return None

    def other(s: Dict[str, Any], kind: str) -> Any:
        n, b, z = s["population_size"], s["sample_size"], s["effective_noise_multiplier"]
        if kind in epochal:
            return acc.sampler_event(kind, z, s["releases"], sampling_probability=min(1.0, b / n), neighboring=neighboring)
        if kind == "poisson":
            return acc.sampler_event("poisson", z, s["releases"], sampling_probability=min(1.0, b / n),
                                     neighboring=neighboring)
        nb = max(1, n // b)
        return acc.sampler_event("balls_in_bins", z, s["releases"], sampling_probability=1.0 / nb, neighboring=neighboring)

    # The comparison is made on the shuffled steps alone: that is what switching the sampler
    # changes (the rest of the ledger would be accounted as recorded).
    def eps_of(accountant: str, events: Any) -> Optional[float]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return acc.make_accountant(accountant, analysis_relation(neighboring)).compose(
                    acc.ComposedEvent(tuple(events))).get_epsilon(delta)
        except (ValueError, TypeError):
            return None

    # as the segments' epochs would be with ⌈n/b⌉ steps each (the ledger's own ε reads its epochs)
    alone = eps_of("pld", (other(s, s["policy"]) for s in shuffled))
    bins = eps_of("rdp", (other(s, "balls_in_bins") for s in shuffled))
    poisson = eps_of("pld", (other(s, "poisson") for s in shuffled))
    steps = sum(s["releases"] for s in shuffled)
    text = f"{steps} step(s) used shuffled or fixed-order batches, which get no amplification"
    text += f": those steps alone cost ε = {_fmt(alone)}." if alone is not None else "."
    options = []
    if bins is not None:
        options.append(
            f"ε = {_fmt(bins)} under balls-in-bins sampling (each record in one batch per epoch, as with shuffling; "
            '`sampler="balls_in_bins"`)'
        )
    if poisson is not None:
        options.append(
            f'ε = {_fmt(poisson)} under Poisson sampling (`sampler="poisson"`, or `"truncated_poisson"` to cap the batch size)'
        )
    if options:
        text += " With the same noise and expected batch size they would cost " + " or ".join(options) + "."
    return text


def stream_summary(account: StreamAccount) -> Dict[str, Any]:
    """The report's entry for one matrix-factorization stream: the mechanism (strategy, its
    bands or buffers), the participation schema, the steps run and planned, the recomputed
    sensitivity, σ/S and the effective noise multiplier (add-or-remove), and the amplification."""
    dec = account.declaration
    strategy, part = dec.strategy, dec.participation
    if part.kind == CYCLIC_POISSON:
        amp = (
            f"cyclic Poisson sampling at p = {part.sampling_probability:g}: {account.participations} Poisson-sampled "
            "Gaussian participations (amplified banded MF, Choquette-Choo et al. 2023)"
        )
    else:
        amp = (
            "none needed: the whole stream is one Gaussian mechanism over fixed batches (Choquette-Choo et al. "
            "2022, Theorem 2), accounted without sampling amplification"
        )
    out: Dict[str, Any] = {
        "stream": account.stream,
        "mechanism": strategy.describe(),
        "strategy": strategy.to_dict(),
        "buffers": strategy.num_buffers,
        "participation": part.describe(),
        "participation_schema": part.to_dict(),
        "steps": account.steps,
        "planned_steps": dec.steps,
        "participations": account.participations,
        "first_sample": account.first_sample,
        "last_sample": account.last_sample,
        "sensitivity": account.sensitivity,
        "noise_multiplier": account.noise_multiplier,
        "effective_noise_multiplier": account.effective_noise_multiplier,
        "amplification": amp,
    }
    bands = getattr(strategy, "bands", None)
    if bands is not None:
        out["bands"] = bands
    return out


def epsilon_curve(
    ledger: Any,
    delta: float,
    *,
    points: int = 200,
    accountants: Sequence[str] = ("pld", "rdp"),
    neighboring: Optional[str] = None,
    interval: float = 2e-3,
    progress: Any = None,
) -> Dict[str, Any]:
    """ε after the first t releases for about ``points`` values of t (the last one the whole
    ledger), under each accountant: ``{"steps": [...], "pld": [...], "rdp": [...]}``.

    Each value is the accountant's ε of that prefix of the ledger (an upper bound, as
    everywhere). Under PLD the prefixes are discretised on a coarser loss grid (``interval``,
    default 2e-3: a pessimistic grid stays an upper bound, about 1% looser than the default
    grid's at 10⁵ steps, at a tenth of the cost); ``"final"`` holds each accountant's ε of the
    whole ledger on its default grid, exactly ``ledger.get_epsilon(delta, accountant)``. The prefixes are accounted in parallel threads (the
    accountants run in the core without the GIL). ``progress``: called with the number of
    values done. ``neighboring``: None for the run's relation (``ledger.neighboring``)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..accounting import make_accountant
    from ..accounting.base import check_accountant, check_delta

    delta = check_delta(delta)
    neighboring = ledger._relation(neighboring)
    for a in accountants:
        check_accountant(a)
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise ValueError(f"points must be an int >= 1, got {points!r}")
    runs = [(s, k) for s, k in ledger._samples.runs() if s.released]
    total = sum(k for _, k in runs)
    if total == 0:
        return {"steps": [], "final": {}, **{a: [] for a in accountants}}
    n = min(points, total)
    ts = sorted({max(1, round(total * (i + 1) / n)) for i in range(n)})

    def prefix(t: int) -> SampleLog:
        out, left = [], t
        for s, k in runs:
            if left <= 0:
                break
            out.append((s, min(k, left)))
            left -= k
        return SampleLog(out)

    def one(job: Tuple[str, int]) -> float:
        name, t = job
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ev = samples_to_event(prefix(t), ledger.path, neighboring)
            kw = {"value_discretization_interval": interval} if name == "pld" and t > 0 else {}
            acct = make_accountant(name, analysis_relation(neighboring), **kw)
            if not acct.supports(ev):
                return math.nan
            acct.compose(ev)
            return acct.get_epsilon(delta)

    jobs = [(a, t) for a in accountants for t in ts]
    res: List[float] = []
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        for i, v in enumerate(pool.map(one, jobs)):
            res.append(v)
            if progress is not None:
                progress(i + 1)
    out: Dict[str, Any] = {"steps": ts, "final": {}}
    for j, a in enumerate(accountants):
        out[a] = res[j * len(ts) : (j + 1) * len(ts)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out["final"][a] = ledger.get_epsilon(delta, a, neighboring=neighboring)
            except ValueError:
                out["final"][a] = math.nan
    return out
