"""Hyperparameter strategies of McMahan et al. 2018, §2 and §4, as plain functions.

Clip norms for G groups under a total L2 bound S* (§2):

* flat: one group with S_g = S* (the "flat clipping" of McMahan et al. [2018]);
* per-layer: S_g = S*/√m for each of m groups ("per-layer clipping");
* dimension-weighted: S_g = S*·√(d_g/D).

Noise allocation for bounds S_g and a target noise multiplier z (§4):

* proportional: σ̃_g = z·√G·S_g;
* dimensionality-adjusted: σ̃_g = z·√(D/d_g)·S_g, D = Σ_g d_g.

Both allocations give exactly the target z through Eq. (1) (:func:`effective_noise_multiplier`),
which is what the ledger will account; these functions only choose parameters and cannot affect
the privacy estimate (§6).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, List, Sequence

from ..events import effective_noise_multiplier
from .._validate import positive as _positive

__all__ = [
    "flat_clip_norm",
    "per_layer_clip_norms",
    "dimension_weighted_clip_norms",
    "proportional_noise",
    "dimensionality_adjusted_noise",
    "effective_noise_multiplier",
]



def _dims(dims: Sequence[int]) -> List[int]:
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence):
        raise TypeError("dims must be a sequence of ints, one per group")
    out = []
    for k, d in enumerate(dims):
        if isinstance(d, bool):
            raise TypeError(f"dims[{k}] must be an int, got bool")
        try:
            d = operator.index(d)
        except TypeError:
            raise TypeError(f"dims[{k}] must be an int, got {type(d).__name__}") from None
        if d <= 0:
            raise ValueError(f"dims[{k}] must be > 0, got {d}")
        out.append(d)
    if not out:
        raise ValueError("dims is empty; give one dimension per group")
    return out


def _count(name: str, m: Any) -> int:
    if isinstance(m, bool) or not isinstance(m, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(m).__name__}")
    if m <= 0:
        raise ValueError(f"{name} must be > 0, got {m}")
    return int(m)


def flat_clip_norm(total_l2_norm_clip: float) -> float:
    """S_g = S*: all vectors clipped as one group (flat clipping, McMahan et al. 2018, §2)."""
    return _positive("total_l2_norm_clip", total_l2_norm_clip)


def per_layer_clip_norms(total_l2_norm_clip: float, num_groups: int) -> List[float]:
    """S_g = S*/√m for each of m groups (per-layer clipping, McMahan et al. 2018, §2).

    Σ_g S_g² = S*², so a record's total contribution is still bounded by S*.
    """
    s = _positive("total_l2_norm_clip", total_l2_norm_clip)
    m = _count("num_groups", num_groups)
    return [s / math.sqrt(m)] * m


def dimension_weighted_clip_norms(total_l2_norm_clip: float, dims: Sequence[int]) -> List[float]:
    """S_g = S*·√(d_g/D), D = Σ_g d_g: bounds that grow with each group's dimension (§2).

    The paper prints this as S*/√(d_g/D); we use S*·√(d_g/D), which keeps Σ_g S_g² = S*² as
    the total L2 bound S* requires (the printed form would give Σ_g S_g² = S*²·Σ_g D/d_g ≥ G²·S*²)
    and gives every coordinate the same bound S*/√D. The choice of S_g never affects the
    accounted privacy, which the ledger computes from the S_g actually used.
    """
    s = _positive("total_l2_norm_clip", total_l2_norm_clip)
    d = _dims(dims)
    total = sum(d)
    return [s * math.sqrt(dg / total) for dg in d]


def _clips(l2_norm_clips: Sequence[float]) -> List[float]:
    if isinstance(l2_norm_clips, (str, bytes)) or not isinstance(l2_norm_clips, Sequence):
        raise TypeError("l2_norm_clips must be a sequence of floats, one per group")
    out = [_positive(f"l2_norm_clips[{k}]", s) for k, s in enumerate(l2_norm_clips)]
    if not out:
        raise ValueError("l2_norm_clips is empty; give one bound per group")
    return out


def proportional_noise(noise_multiplier: float, l2_norm_clips: Sequence[float]) -> List[float]:
    """σ̃_g = z·√G·S_g: noise proportional to each group's bound (McMahan et al. 2018, §4).

    By Eq. (1) the G groups together have noise multiplier exactly z.
    """
    z = _positive("noise_multiplier", noise_multiplier, allow_zero=True)
    s = _clips(l2_norm_clips)
    g = math.sqrt(len(s))
    return [z * g * sg for sg in s]


def dimensionality_adjusted_noise(
    noise_multiplier: float, l2_norm_clips: Sequence[float], dims: Sequence[int]
) -> List[float]:
    """σ̃_g = z·√(D/d_g)·S_g, D = Σ_g d_g (McMahan et al. 2018, §4).

    Noise proportional to the largest root-mean-square coordinate a group can have given its bound
    S_g and dimension d_g. By Eq. (1): Σ_g (S_g/σ̃_g)² = Σ_g d_g/(D·z²) = 1/z², so the groups
    together have noise multiplier exactly z.
    """
    z = _positive("noise_multiplier", noise_multiplier, allow_zero=True)
    s = _clips(l2_norm_clips)
    d = _dims(dims)
    if len(d) != len(s):
        raise ValueError(f"dims has {len(d)} values but l2_norm_clips has {len(s)}")
    total = sum(d)
    return [z * math.sqrt(total / dg) * sg for sg, dg in zip(s, d)]
