"""The DPQuery lifecycle (McMahan et al. 2018, §2 and §7; the design of TF Privacy's DPQuery).

A query turns the records of one sample into a privatized aggregate in five steps::

    gs = q.initial_global_state()
    params = q.derive_sample_params(gs)
    st = q.initial_sample_state(template)          # template: one record's arrays (or specs)
    st = q.accumulate_records(params, st, batch)   # batch: the records with a leading B axis
    st = q.merge_sample_states(st, other_st)       # hierarchical / distributed aggregation
    result, gs, event = q.get_noised_result(st, gs)

``accumulate_records`` hands a whole batch to the Rust core in one call per group: per-record
Python calls were what made older libraries slow. ``event`` is the privacy-tuple event of
:mod:`dpcore.events`, which the ledger records (§6).

Sample states hold float64 sums and are never modified in place by the queries: every call
returns a new state, so a state can be merged or reused safely.

``seed`` arguments exist for tests and reproductions only: noise drawn from a known seed can be
recomputed and subtracted, so a seeded result carries no privacy guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from ..mechanism import _seed
from .._validate import nonnegative, parts, positive  # noqa: F401 (the queries import them from here)
from .._seeds import derive_seed  # noqa: F401 (its home before dpcore._seeds)
from .. import _trace


class DPQuery:
    """Base class of all queries. Subclasses implement every method except where noted."""

    def initial_global_state(self) -> Any:
        """The state carried across samples (clip norms, noise stddevs, adaptive estimates)."""
        return None

    def derive_sample_params(self, global_state: Any) -> Any:
        """What accumulation needs from the global state for one sample (e.g. the clip norm)."""
        return None

    def initial_sample_state(self, template: Any) -> Any:
        """An empty sample state shaped like one record; ``template`` holds arrays or specs
        (anything with ``.shape`` and ``.dtype``) with the shapes of a single record."""
        raise NotImplementedError

    def accumulate_records(self, params: Any, sample_state: Any, records: Any) -> Any:
        """Adds a batch of records (arrays with a leading record axis) to a sample state."""
        raise NotImplementedError

    def accumulate_record(self, params: Any, sample_state: Any, record: Any) -> Any:
        """Adds one record (arrays without the record axis). Same as a batch of one."""
        return self.accumulate_records(params, sample_state, _batch_of_one(record))

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        """The state of the union of two disjoint sets of records."""
        raise NotImplementedError

    def get_noised_result(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Tuple[Any, Any, Any]:
        """``(result, new_global_state, event)``: the privatized aggregate, the updated global
        state and the privacy-tuple event to record in the ledger. ``seed``: tests only."""
        raise NotImplementedError

    def derive_metrics(self, global_state: Any) -> dict:
        """Metrics of the global state, e.g. an adaptive clip norm (only values already released)."""
        return {}

    # -- sums formed by the caller ------------------------------------------------------
    # Framework adapters (dpcore.torch) clip and sum the records on the device from factored
    # per-record gradients, so the records never reach accumulate_records. The query still
    # drives the release: release_plan says how to clip; accumulate_norms sees each record's
    # norm (for what a query derives from the records besides their sum, e.g. the unclipped
    # count of adaptive clipping); get_noised_plan gives the release's noise and event and the
    # next global state. Lifecycle::
    #
    #     plan = q.release_plan(gs, num_parts)                  # clip, scales, denominator
    #     ns = q.accumulate_norms(q.derive_sample_params(gs), q.initial_norm_state(), norms)
    #     plan, gs = q.get_noised_plan(ns, gs, num_parts)       # noise stddevs, event; new state

    def release_plan(self, global_state: Any, num_parts: int, *, dim: Optional[int] = None) -> "ReleasePlan":
        """How the next release clips records and adds noise (see :class:`ReleasePlan`).
        ``dim``: the group's number of coordinates, which a discrete Gaussian release needs."""
        raise TypeError(f"{type(self).__name__} cannot release a sum formed outside the query")

    def initial_norm_state(self) -> Any:
        """What the query derives from record norms before a release (nothing by default)."""
        return None

    def accumulate_norms(self, params: Any, norm_state: Any, norms: np.ndarray) -> Any:
        """Adds a batch of records' L2 norms (of the scaled records for joint clipping)."""
        return norm_state

    def merge_norm_states(self, norm_state_1: Any, norm_state_2: Any) -> Any:
        return norm_state_1

    @property
    def reads_norms(self) -> bool:
        """Whether :meth:`accumulate_norms` uses the records' norms (adaptive clipping's count):
        an adapter on an accelerator then reads them back to the host every step; a query that
        keeps the default :meth:`accumulate_norms` needs no such read."""
        return type(self).accumulate_norms is not DPQuery.accumulate_norms

    #: True when :meth:`get_noised_plan` is a function of the global state alone (no norm
    #: state, no randomness): callers on several processes may then each compute it.
    plan_from_global_state: bool = False

    def get_noised_plan(
        self, norm_state: Any, global_state: Any, num_parts: int, *, seed: Optional[int] = None,
        dim: Optional[int] = None,
    ) -> Tuple["ReleasePlan", Any]:
        """``(plan, new_global_state)`` of a release whose clipped sum the caller formed with
        the clip of :meth:`release_plan`: the caller adds N(0, plan.part_stddevs[j]²) to part j,
        divides by plan.denominator and records plan.event in the ledger first. ``seed``: tests."""
        raise TypeError(f"{type(self).__name__} cannot release a sum formed outside the query")

    # -- many queries in one core call -----------------------------------------------------
    # A NestedQuery clips the batch of every group in one Rust call, and noises every group's
    # sum in one more, instead of two calls per group: small groups would otherwise each run
    # alone on one thread, and pay the Python overhead of a call. A query takes part by saying
    # what its accumulate_records and get_noised_result would do in the core; one that returns
    # None (the default) is run on its own. Lifecycle::
    #
    #     job = q.clip_job(params, st, records)          # arrays, bound, scales; or None
    #     st = q.accumulate_clipped(params, st, sums, norms)  # sums, norms: from the one call
    #     rel = q.gaussian_release(st, gs)               # sums, stddevs, event; or None
    #     result = noise_releases([rel, ...])[0]         # one call for all of them

    def clip_job(self, params: Any, sample_state: Any, records: Any) -> Optional["ClipJob"]:
        """What :meth:`accumulate_records` would clip in the core, checked against the sample
        state, or None when it does more than a clipped sum."""
        return None

    def accumulate_clipped(self, params: Any, sample_state: Any, sums: List[np.ndarray], norms: np.ndarray) -> Any:
        """The state :meth:`accumulate_records` would return, given the core's clipped sums of
        the :meth:`clip_job` (fresh float64 arrays shaped like one record's) and the norms (B,)."""
        raise TypeError(f"{type(self).__name__} has no clip_job; call accumulate_records")

    def gaussian_release(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Optional["GaussianRelease"]:
        """What :meth:`get_noised_result` would release, before its Gaussian noise is drawn, or
        None. ``seed`` (tests) is for any other randomness of the new global state."""
        return None


@dataclass(frozen=True)
class ReleasePlan:
    """What a Gaussian query's release adds, for callers that form the clipped sum themselves.

    Framework adapters (dpcore.torch) compute Σ_i min(1, S/‖x_i‖)·x_i on the device from
    factored per-record gradients and never hand the records to the core; the plan tells them
    the rest of McMahan et al. 2018, §1 steps 2–3, exactly as :meth:`GaussianSumQuery.
    get_noised_result` would do it: clip each record (scaled by 1/α_j for joint clipping, §2)
    to ``l2_norm_clip``, add N(0, ``part_stddevs[j]``²) to part j of the sum, divide by
    ``denominator``, and record ``event`` in the ledger before returning the result.

    With ``mechanism`` "discrete_gaussian" the caller instead rounds the undivided sum of part j
    onto the grid of step ``granularity``·α_j and adds discrete Gaussian noise (Canonne, Kamath &
    Steinke 2020) of ``part_stddevs[j]``/(``granularity``·α_j) grid steps, then divides by
    ``denominator`` (:func:`dpcore.mechanism.discrete_sum_release`); ``event`` then carries the
    sensitivity of a rounded sum, c + √d grid steps (Kairouz, Liu & Steinke 2021, §4).
    """

    l2_norm_clip: float
    part_scales: Tuple[float, ...]
    part_stddevs: Tuple[float, ...]
    denominator: float
    event: Any
    mechanism: str = "gaussian"
    granularity: Optional[float] = None
    noise_multiplier: Optional[float] = None
    dim: Optional[int] = None


@dataclass(frozen=True)
class ClipJob:
    """The clipped sum a query's :meth:`DPQuery.accumulate_records` computes: ``arrays`` (the
    records, each (B, ...)) clipped jointly to ``l2_norm_clip``, with joint-clipping ``scales``."""

    arrays: Tuple[np.ndarray, ...]
    l2_norm_clip: float
    scales: Optional[Tuple[float, ...]]


@dataclass(frozen=True)
class GaussianRelease:
    """A release before its noise: part j of the result is (sums[j] + N(0, part_stddevs[j]²))
    / denominator in dtypes[j], packed as ``kind`` (an array, a list or a tuple); ``event`` and
    ``global_state`` are what :meth:`DPQuery.get_noised_result` returns beside it."""

    sums: Tuple[np.ndarray, ...]
    part_stddevs: Tuple[float, ...]
    denominator: float
    dtypes: Tuple[np.dtype, ...]
    kind: type
    event: Any
    global_state: Any


def noise_releases(releases: Sequence[GaussianRelease], seed: Optional[int] = None) -> List[Any]:
    """The results of many Gaussian releases, with all their noise drawn in one core call (the
    Gaussian mechanism of McMahan et al. 2018, §1 step 3, for each group; every part of every
    release reads its own ChaCha20 streams). ``seed``: tests only."""
    if _trace.active():
        for r in releases:
            _trace_release(r)
    sums = [np.ascontiguousarray(s, dtype=np.float64).ravel() for r in releases for s in r.sums]
    sds = [float(sd) for r in releases for sd in r.part_stddevs]
    dens = [float(r.denominator) for r in releases for _ in r.sums]
    f32 = [np.dtype(dt) == np.float32 for r in releases for dt in r.dtypes]
    flat = iter(_core.gaussian_release(sums, sds, dens, f32, _seed(seed)))
    results = []
    for r in releases:
        outs = [next(flat).reshape(s.shape) for s in r.sums]
        if _trace.active():  # a grey-box neighbour run releases the first run's values
            outs = _trace.output("queries.noise_releases", outs)
        results.append(outs[0] if r.kind is np.ndarray else r.kind(outs))
    return results


def _trace_release(r: GaussianRelease) -> None:
    """The grey-box trace of a release (:mod:`dpcore._trace`): its undivided pre-noise sums
    and the sensitivity its event declares; joint clipping's part scales are the ratios of the
    parts' stddevs to the event's."""
    ev = r.event
    while getattr(ev, "events", None):  # adaptive clipping: (the sums' event, the count's event)
        ev = ev.events[0]
    clip = getattr(ev, "l2_norm_clip", None)
    base = getattr(ev, "stddev", None)
    scales = [sd / base for sd in r.part_stddevs] if base else None
    _trace.release(
        "queries.noise_releases",
        [{"sums": list(r.sums), "sensitivity": float("nan") if clip is None else clip, "scales": scales}],
        denominator=r.denominator,
        noise={"part_stddevs": list(r.part_stddevs)},
        event=r.event,
    )


def check_parts(num_parts: Any) -> int:
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_parts must be an int >= 1, got {num_parts!r}")
    return num_parts


def _batch_of_one(record: Any) -> Any:
    if isinstance(record, dict):
        return {k: _batch_of_one(v) for k, v in record.items()}
    if isinstance(record, (list, tuple)):
        return type(record)(_batch_of_one(v) for v in record) if type(record) in (list, tuple) else [
            _batch_of_one(v) for v in record
        ]
    a = np.asarray(record)
    return a[np.newaxis]


# ----------------------------------------------------------------------------- sum states


def _spec(x: Any, k: int) -> Tuple[Tuple[int, ...], np.dtype]:
    if isinstance(x, np.ndarray) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        shape, dt = tuple(int(d) for d in x.shape), np.dtype(x.dtype)
    else:
        a = np.asarray(x)
        shape, dt = a.shape, a.dtype
    if dt.kind != "f" or dt.itemsize not in (4, 8):
        raise TypeError(f"template array {k}: records must be float32 or float64, got dtype {dt}")
    return shape, dt


@dataclass(frozen=True)
class SumState:
    """The sample state of a sum query: float64 sums shaped like one record's arrays.

    ``l2_norm_clip`` is the bound that the accumulated records were actually clipped to (None
    while no batch has been added); the released event reports it, so a query whose global state
    changed between accumulation and release cannot under-report the sensitivity.
    """

    sums: Tuple[np.ndarray, ...]
    dtypes: Tuple[np.dtype, ...]
    kind: type
    l2_norm_clip: Optional[float] = None

    @staticmethod
    def from_template(template: Any) -> "SumState":
        specs, kind = parts(template, "template", _spec)
        return SumState(
            tuple(np.zeros(s, np.float64) for s, _ in specs), tuple(d for _, d in specs), kind, None
        )

    def check_records(self, arrays: Sequence[np.ndarray]) -> None:
        if len(arrays) != len(self.sums):
            raise ValueError(f"records have {len(arrays)} arrays but the sample state has {len(self.sums)}")
        for k, (a, s) in enumerate(zip(arrays, self.sums)):
            if a.shape[1:] != s.shape:
                raise ValueError(
                    f"records array {k}: a record has shape {a.shape[1:]} but the sample state expects {s.shape}"
                )

    def added(self, sums: List[np.ndarray], clip: Optional[float]) -> "SumState":
        """A new state with ``sums`` (fresh float64 arrays, consumed) added."""
        if self.l2_norm_clip is not None and clip is not None and clip != self.l2_norm_clip:
            raise ValueError(
                f"records of one sample must be clipped to one bound: the state holds records clipped "
                f"to {self.l2_norm_clip}, these to {clip}"
            )
        for s, old in zip(sums, self.sums):
            np.add(s, old, out=s)
        return SumState(tuple(sums), self.dtypes, self.kind, clip if clip is not None else self.l2_norm_clip)

    def merged(self, other: "SumState") -> "SumState":
        if not isinstance(other, SumState):
            raise TypeError(f"cannot merge a SumState with {type(other).__name__}")
        if len(other.sums) != len(self.sums) or any(a.shape != b.shape for a, b in zip(self.sums, other.sums)):
            raise ValueError("cannot merge sample states of different shapes")
        clips = {c for c in (self.l2_norm_clip, other.l2_norm_clip) if c is not None}
        if len(clips) > 1:
            raise ValueError(f"cannot merge sample states clipped to different bounds: {sorted(clips)}")
        clip = clips.pop() if clips else None
        return SumState(tuple(a + b for a, b in zip(self.sums, other.sums)), self.dtypes, self.kind, clip)

    def release(self, stddevs: Sequence[float], denominator: float, event: Any, global_state: Any) -> GaussianRelease:
        """This state's sums, released with N(0, stddevs[j]²) on part j and divided by
        ``denominator``, in the template's dtypes."""
        return GaussianRelease(self.sums, tuple(stddevs), denominator, self.dtypes, self.kind, event, global_state)
