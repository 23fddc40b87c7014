"""Gaussian sum and average queries over one group of vectors (McMahan et al. 2018, §1–§2).

A group's records are one array of shape (B, ...) or a list/tuple of such arrays (the parts of
the group, e.g. the tensors of one layer); record i is row i of all of them, clipped jointly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .. import _core, _trace
from ..mechanism import (
    DiscreteGaussianParams, _unpack, check_mechanism, check_norms, check_on_nonfinite, clip_sum, discrete_gaussian_params,
)
from .base import (
    ClipJob, DPQuery, GaussianRelease, ReleasePlan, SumState, check_parts, noise_releases, nonnegative, positive,
)
from ..events import NonPrivateQueryEvent, SumQueryEvent

__all__ = [
    "ReleasePlan",
    "GaussianSumQuery",
    "GaussianAverageQuery",
    "JointClipQuery",
    "CountQuery",
    "NoPrivacyQuery",
    "GaussianGlobalState",
]


@dataclass(frozen=True)
class GaussianGlobalState:
    """Global state of a Gaussian sum query: the clip norm S_g and the noise stddev σ̃_g."""

    l2_norm_clip: float
    stddev: float


@functools.lru_cache(maxsize=256)
def _sum_event(l2_norm_clip: float, stddev: float) -> SumQueryEvent:
    """The (immutable, validated) event of a Gaussian sum release; a step of a nested query
    builds one per group with the same values every time."""
    return SumQueryEvent(l2_norm_clip, stddev)


def _state(sample_state: Any) -> SumState:
    if not isinstance(sample_state, SumState):
        raise TypeError(
            f"sample_state must come from initial_sample_state (a SumState), got {type(sample_state).__name__}"
        )
    return sample_state


def _global(global_state: Any) -> GaussianGlobalState:
    if not isinstance(global_state, GaussianGlobalState):
        raise TypeError(
            f"global_state must come from initial_global_state (a GaussianGlobalState), got {type(global_state).__name__}"
        )
    return global_state


class GaussianSumQuery(DPQuery):
    """Σ_i π_S(x_i) + N(0, σ̃²·I): the Gaussian mechanism for sums, privacy tuple (S, σ̃).

    McMahan et al. 2018, §1 steps 2–3 and §2 ("separate clipping and noise parameters"): each
    record (all arrays of the group together) is clipped to L2 norm ``l2_norm_clip`` = S in the
    Rust core, the clipped records are summed in float64, and noise of stddev ``stddev`` = σ̃ is
    added to every coordinate of the sum. Its event is ``SumQueryEvent(S, σ̃)``; the noise
    multiplier is σ̃/S.

    ``mechanism="discrete_gaussian"`` makes the noise floating-point safe (Canonne, Kamath &
    Steinke 2020; see :func:`dpcore.clip_noise`): records are rounded onto the grid of step
    ``granularity`` (default: the power of two of :func:`dpcore.discrete_gaussian_params` for
    the group's size), summed exactly, and noised with N_ℤ; the result is float64 and the event
    is ``SumQueryEvent(Δ, σ̃, "discrete_gaussian")`` with Δ ≥ S the sensitivity after rounding.

    ``on_nonfinite``: a record with a NaN or ±∞ value adds zero to the sum (``"zero"``, the
    default: the zero vector has norm 0 ≤ S, so the tuple (S, σ̃) holds, and nothing about the
    record shows in whether the step succeeds), or :meth:`accumulate_records` raises
    ``ValueError`` naming the first one and adds nothing (``"raise"``: a debugging aid whose
    behaviour depends on the data, not differentially private). See :mod:`dpcore.mechanism`.
    """

    _scales: Optional[Tuple[float, ...]] = None
    _on_nonfinite: str = "zero"

    def __init__(
        self, l2_norm_clip: float, stddev: float, *, mechanism: str = "gaussian", granularity: Optional[float] = None,
        on_nonfinite: str = "zero",
    ) -> None:
        self._on_nonfinite = check_on_nonfinite(on_nonfinite)
        self._clip = positive("l2_norm_clip", l2_norm_clip)
        self._stddev = nonnegative("stddev", stddev)
        self._mechanism = check_mechanism(mechanism)
        if granularity is not None and mechanism != "discrete_gaussian":
            raise ValueError("granularity applies to mechanism='discrete_gaussian' only")
        self._granularity = None if granularity is None else positive("granularity", granularity)

    def __repr__(self) -> str:
        extra = "" if self._mechanism == "gaussian" else f", mechanism={self._mechanism!r}"
        return f"{type(self).__name__}(l2_norm_clip={self._clip}, stddev={self._stddev}{extra}{self._nonfinite_repr()})"

    def _nonfinite_repr(self) -> str:
        return "" if self._on_nonfinite == "zero" else f", on_nonfinite={self._on_nonfinite!r}"

    @property
    def mechanism(self) -> str:
        return self._mechanism

    @property
    def on_nonfinite(self) -> str:
        """What a record with a NaN or infinite value gets: ``"zero"`` (zero contribution, the
        default) or ``"raise"`` (``ValueError``; debugging only, not differentially private)."""
        return self._on_nonfinite

    def _discrete(self, clip: float, stddev: float, dim: int) -> DiscreteGaussianParams:
        return discrete_gaussian_params(clip, stddev / clip, dim, granularity=self._granularity)

    def _denominator(self) -> float:
        return 1.0

    def initial_global_state(self) -> GaussianGlobalState:
        return GaussianGlobalState(self._clip, self._stddev)

    def derive_sample_params(self, global_state: Any) -> float:
        return _global(global_state).l2_norm_clip

    def initial_sample_state(self, template: Any) -> SumState:
        st = SumState.from_template(template)
        if self._scales is not None and len(st.sums) != len(self._scales):
            raise ValueError(f"template has {len(st.sums)} arrays but scales has {len(self._scales)} values")
        return st

    def accumulate_with_norms(self, params: Any, sample_state: Any, records: Any) -> Tuple[SumState, np.ndarray]:
        """As :meth:`accumulate_records`, also returning the records' unclipped norms (B,) (of the
        scaled records for joint clipping; NaN for a record with a NaN or infinite value, which
        added zero). The norms are not private; use them only inside a query that privatizes
        what it derives from them."""
        job = self.clip_job(params, sample_state, records)
        if job is not None:
            sums, norms = clip_sum(
                list(job.arrays), job.l2_norm_clip, scales=job.scales, dtype=np.float64, on_nonfinite=self._on_nonfinite
            )
            return self.accumulate_clipped(params, sample_state, list(sums), norms), norms
        # The discrete Gaussian: each record rounded onto the grid, which depends on the clip
        # actually used; the noise uses the stddev of the release.
        st = _state(sample_state)
        clip = positive("l2_norm_clip (sample params)", params)
        arrays, _ = _unpack(records)
        st.check_records(arrays)
        dim = sum(int(s.size) for s in st.sums)
        p = self._discrete(clip, self._stddev or clip, dim)
        scales = None if self._scales is None else list(self._scales)
        flat, norms, _ = _core.clip_round_sum(list(arrays), clip, p.granularity, p.sens_sq, scales)
        check_norms(norms, self._on_nonfinite)
        sums = [f.reshape(s.shape) for f, s in zip(flat, st.sums)]
        return st.added(sums, clip), norms

    def clip_job(self, params: Any, sample_state: Any, records: Any) -> Optional[ClipJob]:
        if self._mechanism != "gaussian":
            return None  # records are rounded onto the grid one by one: not a plain clipped sum
        st = _state(sample_state)
        clip = positive("l2_norm_clip (sample params)", params)
        arrays, _ = _unpack(records)
        st.check_records(arrays)
        return ClipJob(tuple(arrays), clip, self._scales)

    def accumulate_clipped(self, params: Any, sample_state: Any, sums: Any, norms: np.ndarray) -> SumState:
        return _state(sample_state).added(list(sums), positive("l2_norm_clip (sample params)", params))

    def accumulate_records(self, params: Any, sample_state: Any, records: Any) -> SumState:
        return self.accumulate_with_norms(params, sample_state, records)[0]

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> SumState:
        return _state(sample_state_1).merged(_state(sample_state_2))

    def get_noised_result(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Tuple[Any, GaussianGlobalState, SumQueryEvent]:
        st, gs = _state(sample_state), _global(global_state)
        scales = self._scales or (1.0,) * len(st.sums)
        if self._scales is not None and len(st.sums) != len(self._scales):
            raise ValueError(f"sample state has {len(st.sums)} arrays but scales has {len(self._scales)} values")
        clip = st.l2_norm_clip if st.l2_norm_clip is not None else gs.l2_norm_clip
        if self._mechanism == "discrete_gaussian":
            return self._discrete_release(st, gs, clip, scales, seed), gs, self._discrete_event(st, gs, clip)
        rel = self.gaussian_release(st, gs)
        assert rel is not None
        return noise_releases([rel], seed)[0], gs, rel.event

    def gaussian_release(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Optional[GaussianRelease]:
        if self._mechanism != "gaussian":
            return None
        st, gs = _state(sample_state), _global(global_state)
        if self._scales is not None and len(st.sums) != len(self._scales):
            raise ValueError(f"sample state has {len(st.sums)} arrays but scales has {len(self._scales)} values")
        scales = self._scales or (1.0,) * len(st.sums)
        clip = st.l2_norm_clip if st.l2_norm_clip is not None else gs.l2_norm_clip
        # The event reports the bound the records were clipped to (see SumState) and the noise
        # actually added; both are validated by SumQueryEvent before any noise is drawn.
        event = _sum_event(clip, gs.stddev)
        return st.release([gs.stddev * a for a in scales], self._denominator(), event, gs)

    def _discrete_event(self, st: SumState, gs: GaussianGlobalState, clip: float) -> SumQueryEvent:
        dim = sum(int(s.size) for s in st.sums)
        p = self._discrete(clip, gs.stddev or clip, dim)
        return SumQueryEvent(p.sensitivity, p.stddev if gs.stddev else 0.0, "discrete_gaussian")

    def _discrete_release(
        self, st: SumState, gs: GaussianGlobalState, clip: float, scales: Sequence[float], seed: Optional[int]
    ) -> Any:
        """(Σ on the grid + N_ℤ(0, σ²))·γ·α_j / denominator, float64 (CKS 2020, Theorem 14)."""
        dim = sum(int(s.size) for s in st.sums)
        z = gs.stddev / clip
        p = self._discrete(clip, gs.stddev or clip, dim)
        flat = [np.ascontiguousarray(s, dtype=np.float64).ravel() for s in st.sums]
        outs = _core.discrete_release(
            flat, list(scales), clip, z, dim, p.granularity, True, self._denominator(), seed, False
        )
        outs = [o.reshape(s.shape) for o, s in zip(outs, st.sums)]
        if _trace.active():  # the grey-box harness: the rounded sums (grid steps γ·α_j) and their sensitivity
            ev = self._discrete_event(st, gs, clip)
            _trace.release(
                "queries.discrete_release", [{"sums": [x * (p.granularity * a) for x, a in zip(st.sums, scales)],
                                                "sensitivity": ev.l2_norm_clip, "scales": list(scales)}],
                denominator=self._denominator(), noise={"stddev": ev.stddev, "granularity": p.granularity},
                event=ev,
            )
            outs = _trace.output("queries.discrete_release", outs)
        return outs[0] if st.kind is np.ndarray else st.kind(outs)

    plan_from_global_state = True

    def get_noised_plan(
        self, norm_state: Any, global_state: Any, num_parts: int, *, seed: Optional[int] = None,
        dim: Optional[int] = None,
    ) -> Tuple[ReleasePlan, GaussianGlobalState]:
        """The release of a sum formed by the caller: this query's plan; the state is unchanged."""
        return self.release_plan(global_state, num_parts, dim=dim), _global(global_state)

    def release_plan(self, global_state: Any, num_parts: int, *, dim: Optional[int] = None) -> ReleasePlan:
        """The plan of this query's next release over a group of ``num_parts`` arrays, for a
        caller that clips and sums the records itself (see :class:`ReleasePlan`). A discrete
        Gaussian query rounds the sum, not each record, and needs the group's ``dim``."""
        gs = _global(global_state)
        check_parts(num_parts)
        if self._scales is not None and num_parts != len(self._scales):
            raise ValueError(f"the group has {num_parts} arrays but scales has {len(self._scales)} values")
        scales = self._scales or (1.0,) * num_parts
        if self._mechanism == "discrete_gaussian":
            if dim is None:
                raise ValueError("a discrete Gaussian release of a sum formed by the caller needs the group's dim")
            z = gs.stddev / gs.l2_norm_clip
            p = discrete_gaussian_params(
                gs.l2_norm_clip, z if z > 0 else 1.0, dim, granularity=self._granularity, rounding="sum"
            )
            sd = p.stddev if z > 0 else 0.0
            return ReleasePlan(
                l2_norm_clip=gs.l2_norm_clip,
                part_scales=tuple(scales),
                part_stddevs=tuple(sd * a for a in scales),
                denominator=self._denominator(),
                event=SumQueryEvent(p.sensitivity, sd, "discrete_gaussian"),
                mechanism="discrete_gaussian",
                granularity=p.granularity,
                noise_multiplier=z,
                dim=dim,
            )
        return ReleasePlan(
            l2_norm_clip=gs.l2_norm_clip,
            part_scales=tuple(scales),
            part_stddevs=tuple(gs.stddev * a for a in scales),
            denominator=self._denominator(),
            event=SumQueryEvent(gs.l2_norm_clip, gs.stddev),
        )


class GaussianAverageQuery(GaussianSumQuery):
    """(Σ_i π_S(x_i) + N(0, σ̃²·I)) / denominator: the fixed-expected-denominator estimator.

    McMahan et al. 2018, §1 step 3 and footnote 1 (the estimator f̃ of McMahan et al. 2018b):
    with Poisson sampling at rate q over n records, ``denominator`` = q·n makes the result an
    unbiased estimate of the average. Dividing is post-processing: the privacy tuple is that of
    the sum, (S, σ̃), where σ̃ = q·n·σ for a per-average stddev σ (§2).
    """

    def __init__(
        self, l2_norm_clip: float, stddev: float, denominator: float, *, mechanism: str = "gaussian",
        granularity: Optional[float] = None, on_nonfinite: str = "zero",
    ) -> None:
        super().__init__(l2_norm_clip, stddev, mechanism=mechanism, granularity=granularity, on_nonfinite=on_nonfinite)
        self._den = positive("denominator", denominator)

    def __repr__(self) -> str:
        return (
            f"GaussianAverageQuery(l2_norm_clip={self._clip}, stddev={self._stddev}, denominator={self._den}"
            f"{self._nonfinite_repr()})"
        )

    def _denominator(self) -> float:
        return self._den


class JointClipQuery(GaussianSumQuery):
    """The joint clipping mechanism of McMahan et al. 2018, §2.

    For a group of K parts v = (v_1, …, v_K) with scales α_j (``scales``):

    1. scale: s(v; α) = (v_1/α_1, …, v_K/α_K);
    2. clip the scaled record jointly: π_S(s(v; α)) with S = ``l2_norm_clip`` (S_g ∈ [0, √K]);
    3. sum, and add N(0, (α_j·σ̃)²) to part j, σ̃ = ``stddev``;
    4. scale part j back by α_j.

    Steps 1, 2 and 4 are fused in the Rust core (the clip factor computed on the scaled record
    multiplies the unscaled parts). The output is a post-processing of a Gaussian sum query with
    privacy tuple (S, σ̃) — the event — whatever the scales. Records are a list/tuple of K
    arrays (or one array when K = 1); with ``denominator`` the result is divided by it.
    """

    def __init__(
        self, scales: Sequence[float], l2_norm_clip: float, stddev: float, *, denominator: Optional[float] = None,
        mechanism: str = "gaussian", granularity: Optional[float] = None, on_nonfinite: str = "zero",
    ) -> None:
        super().__init__(l2_norm_clip, stddev, mechanism=mechanism, granularity=granularity, on_nonfinite=on_nonfinite)
        if isinstance(scales, (str, bytes)) or not isinstance(scales, Sequence):
            raise TypeError("scales must be a sequence of floats, one per part of the group")
        vals = tuple(positive(f"scales[{k}]", a) for k, a in enumerate(scales))
        if not vals:
            raise ValueError("scales is empty; give one scale per part of the group")
        if not math.isfinite(self._stddev * max(vals)):
            raise ValueError("stddev * max(scales) overflows: the noise of the largest part is not finite")
        self._scales = vals
        self._den = 1.0 if denominator is None else positive("denominator", denominator)

    def __repr__(self) -> str:
        return (
            f"JointClipQuery(scales={list(self._scales or ())}, l2_norm_clip={self._clip}, stddev={self._stddev}"
            f"{self._nonfinite_repr()})"
        )

    def _denominator(self) -> float:
        return self._den


class CountQuery(GaussianSumQuery):
    """A private count or sum of indicators: GaussianSumQuery with S = 1 (McMahan et al. 2018,
    §1 and §9: metrics such as accuracy or per-class counts estimated beside the gradients).

    Records are per-record values of shape (B,) or (B, k): a 1 per record for a count, a 0/1
    correctness indicator for accuracy, a one-hot row for per-class counts. Each record's row is
    clipped to L2 norm 1, so values outside [−1, 1] are shrunk (and the sum is rounded to the
    safe side by the core's clip margin, a relative 1e-7 at most). Put it in a
    :class:`NestedQuery` beside the gradient groups so it is accounted with them by Eq. (1).
    """

    def __init__(self, stddev: float, *, on_nonfinite: str = "zero") -> None:
        super().__init__(1.0, stddev, on_nonfinite=on_nonfinite)

    def __repr__(self) -> str:
        return f"CountQuery(stddev={self._stddev}{self._nonfinite_repr()})"


class NoPrivacyQuery(DPQuery):
    """Plain sum (or average with ``denominator``) without clipping or noise.

    For baselines and debugging. Its event is :class:`NonPrivateQueryEvent`: a ledger holding it
    reports ε = ∞.
    """

    def __init__(self, denominator: Optional[float] = None) -> None:
        self._den = 1.0 if denominator is None else positive("denominator", denominator)

    def __repr__(self) -> str:
        return "NoPrivacyQuery()" if self._den == 1.0 else f"NoPrivacyQuery(denominator={self._den})"

    def initial_sample_state(self, template: Any) -> SumState:
        return SumState.from_template(template)

    def accumulate_records(self, params: Any, sample_state: Any, records: Any) -> SumState:
        st = _state(sample_state)
        arrays, _ = _unpack(records)
        st.check_records(arrays)
        return st.added([np.asarray(np.add.reduce(a, axis=0, dtype=np.float64)) for a in arrays], None)

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> SumState:
        return _state(sample_state_1).merged(_state(sample_state_2))

    def get_noised_result(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Tuple[Any, Any, NonPrivateQueryEvent]:
        st = _state(sample_state)
        outs = [(s / self._den).astype(dt, copy=False) for s, dt in zip(st.sums, st.dtypes)]
        result = outs[0] if st.kind is np.ndarray else st.kind(outs)
        return result, global_state, NonPrivateQueryEvent()
