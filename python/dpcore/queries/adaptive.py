"""Adaptive clipping to a private quantile of the record norms (Andrew et al. 2021,
"Differentially Private Learning with Adaptive Clipping", arXiv:1905.03871).

Each sample releases two Gaussian sum queries on the same records:

* the clipped sum with bound C_t and noise σ_Δ = z_Δ·C_t (the gradients);
* the sum of the centred indicators b_i − ½, b_i = 1[‖x_i‖ ≤ C_t], with bound ½ and noise σ_b
  (Andrew et al., Algorithm 1 and §3.1: centring halves the sensitivity of the count).

Then the clip follows the geometric update C_{t+1} = C_t · exp(−η (b̃_t − γ)) with b̃_t the
private unclipped fraction and γ the target quantile (Andrew et al., Eq. (2) and Algorithm 1).
Given the target noise multiplier z for the whole release, the gradient noise uses
z_Δ = (z^{−2} − (2σ_b)^{−2})^{−1/2} (Andrew et al., Theorem 1), so that by Eq. (1) of McMahan et
al. 2018 the two queries together have noise multiplier exactly z. Both are in the event, so
the ledger accounts the quantile estimate as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from .. import _trace

from ..mechanism import gaussian_noise
from .._seeds import derive_seed
from .base import (
    ClipJob, DPQuery, GaussianRelease, ReleasePlan, SumState, check_parts, noise_releases, nonnegative,
    positive,
)
from ..events import ComposedQueryEvent, SumQueryEvent
from .gaussian import GaussianSumQuery

__all__ = ["QuantileAdaptiveClipQuery", "AdaptiveClipGlobalState", "AdaptiveClipSampleState"]


def _centred_unclipped(norms: np.ndarray, clip: float) -> float:
    """Σ_i (b_i − ½), b_i = 1[‖x_i‖ ≤ C]. A NaN norm (a non-finite record, which the clip left
    out) counts as clipped, b_i = 0: a fixed value, never a NaN in the count (NaN ≤ C is false)."""
    return float(np.count_nonzero(norms <= clip)) - 0.5 * norms.size

# The clip norm stays inside this range whatever the updates (the core needs a finite C > 0).
_CLIP_MIN, _CLIP_MAX = 1e-30, 1e30


@dataclass(frozen=True)
class AdaptiveClipGlobalState:
    l2_norm_clip: float
    noise_multiplier: float
    #: The last private estimate of the unclipped fraction (None before the first release).
    unclipped_fraction: Optional[float] = None


@dataclass(frozen=True)
class AdaptiveClipSampleState:
    sums: SumState
    #: Σ_i (b_i − ½) over the accumulated records (float64; private only once noised).
    centred_unclipped: float
    l2_norm_clip: Optional[float]


class QuantileAdaptiveClipQuery(DPQuery):
    """Gaussian sum (or average) query whose clip norm tracks a quantile of the record norms.

    Parameters (Andrew et al. 2021, Algorithm 1):

    * ``initial_l2_norm_clip``: C_0;
    * ``noise_multiplier``: z, the target noise multiplier of the whole release (Eq. (1));
    * ``target_unclipped_quantile``: γ ∈ [0, 1], the fraction of records that should be unclipped;
    * ``learning_rate``: η ≥ 0 of the geometric update;
    * ``clipped_count_stddev``: σ_b, noise on the count of unclipped records; needs 2σ_b > z
      (Andrew et al. suggest σ_b ≈ expected_num_records/20);
    * ``expected_num_records``: the expected sample size q·n, which turns the noised count into a
      fraction;
    * ``denominator``: divide the result by it (e.g. q·n) for the fixed-denominator average;
    * ``on_nonfinite``: a record with a NaN or ±∞ value adds zero to the sum and counts as a
      clipped record (norm > C: its indicator b_i is 0, a fixed value whatever the record holds,
      so the count's sensitivity is unchanged) with ``"zero"``, the default; ``"raise"`` raises
      ``ValueError`` naming it instead (debugging only, not differentially private).
    """

    def __init__(
        self,
        initial_l2_norm_clip: float,
        noise_multiplier: float,
        target_unclipped_quantile: float,
        learning_rate: float,
        clipped_count_stddev: float,
        expected_num_records: float,
        *,
        denominator: Optional[float] = None,
        on_nonfinite: str = "zero",
    ) -> None:
        self._c0 = positive("initial_l2_norm_clip", initial_l2_norm_clip)
        if not _CLIP_MIN <= self._c0 <= _CLIP_MAX:
            raise ValueError(f"initial_l2_norm_clip must be in [{_CLIP_MIN}, {_CLIP_MAX}], got {self._c0}")
        self._z = nonnegative("noise_multiplier", noise_multiplier)
        self._gamma = nonnegative("target_unclipped_quantile", target_unclipped_quantile)
        if self._gamma > 1:
            raise ValueError(f"target_unclipped_quantile must be in [0, 1], got {self._gamma}")
        self._eta = nonnegative("learning_rate", learning_rate)
        self._sigma_b = nonnegative("clipped_count_stddev", clipped_count_stddev)
        self._expected = positive("expected_num_records", expected_num_records)
        self._den = 1.0 if denominator is None else positive("denominator", denominator)
        if self._z == 0:
            self._z_delta = 0.0
        else:
            if not 2 * self._sigma_b > self._z:
                raise ValueError(
                    f"clipped_count_stddev must be > noise_multiplier/2 = {self._z / 2} (Andrew et al. 2021, "
                    f"Theorem 1: the count's noise alone must not exceed the privacy budget), got {self._sigma_b}"
                )
            inv = self._z**-2 - (2 * self._sigma_b) ** -2
            self._z_delta = inv**-0.5
            if not math.isfinite(self._z_delta):
                raise ValueError("noise_multiplier and clipped_count_stddev leave no finite noise for the sum")
        # The clip used on the records comes from the sample params; the noise from the global state.
        self._sum = GaussianSumQuery(self._c0, self._z_delta * self._c0, on_nonfinite=on_nonfinite)

    def __repr__(self) -> str:
        return (
            f"QuantileAdaptiveClipQuery(initial_l2_norm_clip={self._c0}, noise_multiplier={self._z}, "
            f"target_unclipped_quantile={self._gamma}, learning_rate={self._eta}, "
            f"clipped_count_stddev={self._sigma_b}, expected_num_records={self._expected})"
        )

    @property
    def on_nonfinite(self) -> str:
        """What a record with a NaN or infinite value gets: ``"zero"`` or ``"raise"``."""
        return self._sum.on_nonfinite

    @property
    def sum_noise_multiplier(self) -> float:
        """z_Δ, the noise multiplier of the gradient sum alone (Andrew et al., Theorem 1)."""
        return self._z_delta

    def initial_global_state(self) -> AdaptiveClipGlobalState:
        return AdaptiveClipGlobalState(self._c0, self._z)

    def _global(self, gs: Any) -> AdaptiveClipGlobalState:
        if not isinstance(gs, AdaptiveClipGlobalState):
            raise TypeError(f"global_state must come from initial_global_state, got {type(gs).__name__}")
        return gs

    def _sample(self, st: Any) -> AdaptiveClipSampleState:
        if not isinstance(st, AdaptiveClipSampleState):
            raise TypeError(f"sample_state must come from initial_sample_state, got {type(st).__name__}")
        return st

    def derive_sample_params(self, global_state: Any) -> float:
        return self._global(global_state).l2_norm_clip

    def initial_sample_state(self, template: Any) -> AdaptiveClipSampleState:
        return AdaptiveClipSampleState(self._sum.initial_sample_state(template), 0.0, None)

    def accumulate_records(self, params: Any, sample_state: Any, records: Any) -> AdaptiveClipSampleState:
        st = self._sample(sample_state)
        sums, norms = self._sum.accumulate_with_norms(params, st.sums, records)
        return self._with_count(st, sums, norms)

    def _with_count(self, st: AdaptiveClipSampleState, sums: Any, norms: np.ndarray) -> AdaptiveClipSampleState:
        # The indicator uses the same C as the clipping, in one vectorised pass over the B norms.
        centred = _centred_unclipped(norms, sums.l2_norm_clip)
        return AdaptiveClipSampleState(sums, st.centred_unclipped + centred, sums.l2_norm_clip)

    def clip_job(self, params: Any, sample_state: Any, records: Any) -> Optional[ClipJob]:
        return self._sum.clip_job(params, self._sample(sample_state).sums, records)

    def accumulate_clipped(self, params: Any, sample_state: Any, sums: Any, norms: np.ndarray) -> AdaptiveClipSampleState:
        st = self._sample(sample_state)
        return self._with_count(st, self._sum.accumulate_clipped(params, st.sums, sums, norms), norms)

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> AdaptiveClipSampleState:
        a, b = self._sample(sample_state_1), self._sample(sample_state_2)
        sums = self._sum.merge_sample_states(a.sums, b.sums)
        return AdaptiveClipSampleState(sums, a.centred_unclipped + b.centred_unclipped, sums.l2_norm_clip)

    def get_noised_result(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Tuple[Any, AdaptiveClipGlobalState, ComposedQueryEvent]:
        rel = self.gaussian_release(sample_state, global_state, seed=seed)
        return noise_releases([rel], derive_seed(seed, 0))[0], rel.global_state, rel.event

    def gaussian_release(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> GaussianRelease:
        st, gs = self._sample(sample_state), self._global(global_state)
        clip = st.l2_norm_clip if st.l2_norm_clip is not None else gs.l2_norm_clip
        stddev = self._z_delta * clip
        event = ComposedQueryEvent((SumQueryEvent(clip, stddev), SumQueryEvent(0.5, self._sigma_b)))
        new_gs = self._next_global(gs, st.centred_unclipped, seed)
        return st.sums.release([stddev] * len(st.sums.sums), self._den, event, new_gs)

    def _next_global(self, gs: AdaptiveClipGlobalState, centred: float, seed: Optional[int]) -> AdaptiveClipGlobalState:
        """The geometric clip update from the noised unclipped count (Andrew et al., Eq. (2))."""
        noise_b = float(gaussian_noise((), self._sigma_b, dtype=np.float64, seed=derive_seed(seed, 1)))
        noised = centred + noise_b
        if _trace.active():  # the count is a release of its own (sensitivity 1/2: a record is ±1/2)
            _trace.release(
                "queries.adaptive_count", [{"sums": [np.array([centred])], "sensitivity": 0.5}],
                denominator=self._expected, noise={"stddev": self._sigma_b},
            )
            noised = float(_trace.output("queries.adaptive_count", [np.array([noised])])[0][0])
        fraction = noised / self._expected + 0.5
        fraction = min(1.0, max(0.0, fraction))
        new_clip = gs.l2_norm_clip * math.exp(-self._eta * (fraction - self._gamma))
        new_clip = min(_CLIP_MAX, max(_CLIP_MIN, new_clip))
        return AdaptiveClipGlobalState(new_clip, gs.noise_multiplier, fraction)

    # -- sums formed by the caller (see DPQuery): the count comes from the records' norms

    def release_plan(self, global_state: Any, num_parts: int, *, dim: Optional[int] = None) -> ReleasePlan:
        gs = self._global(global_state)
        check_parts(num_parts)
        clip = gs.l2_norm_clip
        sd = self._z_delta * clip
        event = ComposedQueryEvent((SumQueryEvent(clip, sd), SumQueryEvent(0.5, self._sigma_b)))
        return ReleasePlan(clip, (1.0,) * num_parts, (sd,) * num_parts, self._den, event)

    def initial_norm_state(self) -> float:
        return 0.0

    def accumulate_norms(self, params: Any, norm_state: Any, norms: np.ndarray) -> float:
        clip = positive("l2_norm_clip (sample params)", params)
        return float(norm_state or 0.0) + _centred_unclipped(np.asarray(norms, dtype=np.float64), clip)

    def merge_norm_states(self, norm_state_1: Any, norm_state_2: Any) -> float:
        return float(norm_state_1 or 0.0) + float(norm_state_2 or 0.0)

    def get_noised_plan(
        self, norm_state: Any, global_state: Any, num_parts: int, *, seed: Optional[int] = None,
        dim: Optional[int] = None,
    ) -> Tuple[ReleasePlan, AdaptiveClipGlobalState]:
        gs = self._global(global_state)
        plan = self.release_plan(gs, num_parts)
        return plan, self._next_global(gs, float(norm_state or 0.0), seed)

    def derive_metrics(self, global_state: Any) -> dict:
        gs = self._global(global_state)
        out = {"l2_norm_clip": gs.l2_norm_clip}
        if gs.unclipped_fraction is not None:
            out["unclipped_fraction"] = gs.unclipped_fraction
        return out

