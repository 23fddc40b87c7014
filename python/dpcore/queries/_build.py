"""The query of a framework adapter's ``clipping``/``max_grad_norm``/``noise_multiplier``: one
place for every front end that builds its own query (when the user gives no ``query=``).

McMahan et al. 2018, §2 (clipping strategies) and §4 (noise proportional to each group's bound,
so that by Eq. (1) the release has noise multiplier exactly z):

===============  =================================================================================
``clipping``     query over the m parts (parameter tensors, Keras variables)
===============  =================================================================================
``"flat"``       ``GaussianAverageQuery(C, z·C, den)``: each record's parts clipped jointly to C
``"per_layer"``  ``NestedQuery`` of one ``GaussianAverageQuery(C_j, z·√m·C_j, den)`` per part, with
                 C_j = C/√m (:func:`per_layer_clip_norms`) or the m values of a list ``max_grad_norm``
                 (noise by :func:`proportional_noise`)
``"joint"``      ``JointClipQuery(joint_scales, C, z·C, denominator=den)``: the parts scaled by their
                 α_j, clipped jointly to C, noised with α_j·z·C each, and scaled back
===============  =================================================================================

The semantics are those of the torch optimizer's own builder (``dpcore.torch._clip.build_query``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from .._validate import positive as _positive
from .gaussian import GaussianAverageQuery, JointClipQuery
from .nested import NestedQuery
from .strategies import per_layer_clip_norms, proportional_noise

__all__ = ["CLIPPING", "clipping_query"]

#: The clipping modes of :func:`clipping_query` (and of every front end: :data:`dpcore.plan.CLIPPING`).
CLIPPING = ("flat", "per_layer", "joint")
#: The per-step noise mechanisms a clipping query adds (``noise_mechanism=``).
_MECHANISMS = ("gaussian", "discrete_gaussian")


def clipping_query(
    parts: Union[int, Sequence[str]],
    *,
    clipping: str,
    max_grad_norm: Any,
    noise_multiplier: float,
    denominator: float,
    noise_mechanism: str = "gaussian",
    granularity: Optional[float] = None,
    joint_scales: Optional[Sequence[float]] = None,
    what: str = "parameter tensors",
    on_nonfinite: str = "zero",
) -> Any:
    """The query of ``clipping`` over ``parts``: their number m (a per-layer NestedQuery is then
    a list, in the parts' order) or their names (a per-layer NestedQuery keyed by them).
    ``max_grad_norm`` C is one bound, or for ``"per_layer"`` a list of m bounds;
    ``noise_multiplier`` z; ``denominator`` the fixed denominator of the average (the expected
    batch); ``noise_mechanism`` ``"gaussian"`` or ``"discrete_gaussian"`` (with ``granularity``);
    ``joint_scales`` the m scales α_j of ``"joint"``. ``what`` names the parts in errors.
    ``on_nonfinite``: what a record with a NaN or infinite value gets in every leaf, ``"zero"``
    (zero contribution, the default) or ``"raise"`` (``ValueError``; debugging only, not DP)."""
    names = None if isinstance(parts, int) else list(parts)
    m = parts if names is None else len(names)
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"a clipping query needs at least one part, got {parts!r}")
    if clipping not in CLIPPING:
        raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
    if noise_mechanism not in _MECHANISMS:
        raise ValueError(f"a clipping query's noise_mechanism is one of {_MECHANISMS}, got {noise_mechanism!r}")
    z, den = _positive("noise_multiplier", noise_multiplier, allow_zero=True), _positive("denominator", denominator)
    if joint_scales is not None and clipping != "joint":
        raise ValueError("joint_scales are the scales of clipping='joint'")
    if clipping == "per_layer":
        if isinstance(max_grad_norm, (list, tuple)):
            if len(max_grad_norm) != m:
                raise ValueError(f"max_grad_norm has {len(max_grad_norm)} values but there are {m} {what}")
            clips = [_positive(f"max_grad_norm[{k}]", c) for k, c in enumerate(max_grad_norm)]
        else:
            clips = per_layer_clip_norms(_positive("max_grad_norm", max_grad_norm), m)
        sds = proportional_noise(z, clips)
        leaves = [GaussianAverageQuery(c, sd, den, mechanism=noise_mechanism, granularity=granularity,
                                       on_nonfinite=on_nonfinite)
                  for c, sd in zip(clips, sds)]
        return NestedQuery(leaves if names is None else dict(zip(names, leaves)))
    if isinstance(max_grad_norm, (list, tuple)):
        raise ValueError("a list of max_grad_norm values needs clipping='per_layer'")
    c = _positive("max_grad_norm", max_grad_norm)
    if clipping == "flat":
        return GaussianAverageQuery(c, z * c, den, mechanism=noise_mechanism, granularity=granularity,
                                    on_nonfinite=on_nonfinite)
    if joint_scales is None or isinstance(joint_scales, (str, bytes)) or len(joint_scales) != m:
        raise ValueError(f"clipping='joint' needs joint_scales with one scale per part ({m} {what})")
    return JointClipQuery(list(joint_scales), c, z * c, denominator=den, mechanism=noise_mechanism,
                          granularity=granularity, on_nonfinite=on_nonfinite)
