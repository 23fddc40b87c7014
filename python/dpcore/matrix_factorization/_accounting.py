"""Accounting of matrix-factorization (MF) mechanisms: ε for a noise multiplier, and back.

**The effective noise multiplier.** An MF mechanism with strategy C adds σ·(C⁻¹z)_t at step t
to the clipped sum x_t (clip norm S). Multiplying the releases by C (post-processing) gives
C·x + σ·z, a Gaussian mechanism on the whole stream whose L2 sensitivity is S·sens(C), with
sens(C) the maximum over the participation schema's patterns of ‖C·u_π‖ (Choquette-Choo et al.
2022, arXiv 2211.06530, §2 and Theorem 2; :meth:`ToeplitzStrategy.sensitivity`). Its noise
multiplier is therefore

    z = σ / (S · sens(C, steps, participation)),

and that z is the number users choose and calibrate here: ``σ = z·S·sens`` (:func:`stddev_for`).
With it, the privacy of an MF mechanism does not depend on the strategy at all:

* **cyclic fixed batches** (:data:`CYCLIC`): the whole run is *one* Gaussian mechanism with
  noise multiplier z. ε is the analytic Gaussian mechanism's (Balle & Wang 2018, arXiv
  1805.06530, Theorem 8), which the PLD accountant computes exactly (rounded up) for a
  ``GaussianEvent``; no sampling amplification is used or needed.
* **cyclic Poisson sampling** (:data:`CYCLIC_POISSON`, amplified banded MF, Choquette-Choo et al.
  2023, arXiv 2306.08153, Theorem 4): for a banded C with at most b bands, the run is dominated
  by ⌈steps/b⌉ Poisson-subsampled Gaussian steps at rate p and noise multiplier z, where sens is
  then the largest column norm ‖C[:, 0]‖.

The strategy still matters for utility (how much of the noise σ·C⁻¹z remains in the model) and
for σ, not for ε at a given z. Everything here is stated under the **zero-out** relation (the
MF papers' adjacency, jax_privacy's for equal-split partitions): a record's contributions are
replaced by zero and the number of records is public, so its sensitivity is S as recorded. It
is not the add-or-remove relation: adding a record to the permutation the fixed batches are cut
from changes the cut. Under add-or-remove the ledger accounts fixed batches at 2S per
participation (a coupling in which one batch changes by a swap, the number of batches ⌊n/b⌋
public) and refuses cyclic Poisson sampling (:mod:`dpcore.ledger._events`).

The ledger accounts what actually ran with the same events (:func:`accountant_event`), but from
the recorded stddevs and clip norms and a sensitivity it recomputes for the number of steps run.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from .._validate import count, real
from ._participation import CYCLIC_POISSON, Participation
from ._declaration import StreamDeclaration, _check_pair, _from_json, _sensitivity  # noqa: F401 (re-exported)
from ._strategies import ToeplitzStrategy

__all__ = [
    "StreamDeclaration",
    "stddev_for",
    "noise_multiplier_for",
    "accountant_event",
    "epsilon",
    "calibrate_noise_multiplier",
]


def _z(noise_multiplier: Any) -> float:
    z = real("noise_multiplier", noise_multiplier)
    if not (z >= 0 and math.isfinite(z)):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {z}")
    return z


def stddev_for(
    noise_multiplier: float, l2_norm_clip: float, strategy: ToeplitzStrategy, participation: Participation, steps: int
) -> float:
    """σ = z·S·sens(C, steps, participation): the stddev a matrix-factorization query must use
    (σ·(C⁻¹z)_t at step t) for the *effective* noise multiplier z over ``steps`` planned steps.

    Rounded up by a relative 1e-12, so that the ledger, which divides the recorded σ by S and by
    the recomputed sensitivity (each rounded to the safe side), never finds less than z."""
    z = _z(noise_multiplier)
    s = real("l2_norm_clip", l2_norm_clip)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"l2_norm_clip must be finite and > 0, got {s}")
    _check_pair(strategy, participation)
    sens = strategy.sensitivity(count("steps", steps, 1), participation)
    return z * s * sens * (1.0 + 1e-12)


def noise_multiplier_for(
    stddev: float, l2_norm_clip: float, strategy: ToeplitzStrategy, participation: Participation, steps: int
) -> float:
    """z = σ/(S·sens(C, steps, participation)): the effective noise multiplier of a stream
    with stddev σ and clip norm S after ``steps`` steps, rounded down (the inverse of
    :func:`stddev_for`)."""
    sd = real("stddev", stddev)
    if not (sd >= 0 and math.isfinite(sd)):
        raise ValueError(f"stddev must be finite and >= 0, got {sd}")
    s = real("l2_norm_clip", l2_norm_clip)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"l2_norm_clip must be finite and > 0, got {s}")
    _check_pair(strategy, participation)
    sens = strategy.sensitivity(count("steps", steps, 1), participation)
    return _down(sd / s / sens)


def _down(x: float) -> float:
    for _ in range(3):
        x = math.nextafter(x, 0.0)
    return max(x, 0.0)


def _shape(participation: Any, steps: Any, strategy: Any) -> "tuple[float, int]":
    """(q, count) of the Poisson-subsampled Gaussian composition that an MF run at effective
    noise multiplier z is: (1, 1) for fixed batches (one Gaussian mechanism), (p, ⌈steps/b⌉)
    for cyclic Poisson sampling."""
    if not isinstance(participation, Participation):
        raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
    n = count("steps", steps, 1)
    if strategy is not None:
        _check_pair(strategy, participation)
    if participation.kind == CYCLIC_POISSON:
        return float(participation.sampling_probability), participation.participations(n)  # type: ignore[arg-type]
    return 1.0, 1


def accountant_event(noise_multiplier: float, *, participation: Participation, steps: int) -> Any:
    """The accountant event (:mod:`dpcore.accounting`) of ``steps`` steps of an MF mechanism at
    effective noise multiplier z: ``GaussianEvent(z)`` for cyclic fixed batches,
    ``SelfComposedEvent(PoissonSampledEvent(p, GaussianEvent(z)), ⌈steps/b⌉)`` for cyclic
    Poisson sampling; ``NonPrivateEvent()`` for z = 0."""
    from ..events import GaussianEvent, NonPrivateEvent, PoissonSampledEvent, SelfComposedEvent

    z = _z(noise_multiplier)
    q, k = _shape(participation, steps, None)
    if z == 0.0:
        return NonPrivateEvent()
    if participation.kind == CYCLIC_POISSON:
        return SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(z)), k)
    return GaussianEvent(z)


def epsilon(
    noise_multiplier: float,
    delta: float,
    *,
    participation: Participation,
    steps: int,
    strategy: Optional[ToeplitzStrategy] = None,
    accountant: str = "pld",
) -> float:
    """ε at ``delta`` of ``steps`` steps of an MF mechanism at *effective* noise multiplier z
    (σ = z·S·sens, :func:`stddev_for`), under the zero-out relation (the module docs; under
    add-or-remove, fixed batches cost what z/2 costs here, via the ledger).

    Cyclic fixed batches: the Gaussian mechanism's ε at z (PLD: the analytic Gaussian of Balle &
    Wang 2018, exact and rounded up; RDP: α/(2z²) converted). Cyclic Poisson sampling: ⌈steps/b⌉
    Poisson-subsampled Gaussian steps at rate p and z (PLD, Doroshenko et al. 2022; or RDP).
    ``strategy``, if given, is only checked to fit the schema (cyclic Poisson sampling needs a
    banded strategy with at most b bands): ε at a given effective z does not depend on it."""
    from ..accounting.rdp import epsilon as _epsilon

    z = _z(noise_multiplier)
    q, k = _shape(participation, steps, strategy)
    if z == 0.0:
        return math.inf
    return _epsilon(q, z, k, delta, accountant=accountant)


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    *,
    participation: Participation,
    steps: int,
    strategy: Optional[ToeplitzStrategy] = None,
    accountant: str = "pld",
) -> float:
    """The smallest effective noise multiplier z (to 1e-5 relative under PLD, 1e-6 under RDP,
    never below the boundary) with :func:`epsilon` ≤ ``target_epsilon`` at ``target_delta``.

    The run is the composition :func:`epsilon` describes, so this is
    :func:`dpcore.accounting.calibrate_noise_multiplier` at (q, steps) = (1, 1) for cyclic fixed
    batches and (p, ⌈steps/b⌉) for cyclic Poisson sampling. Use σ = :func:`stddev_for`\\ (z, S,
    strategy, participation, steps) in the query."""
    from ..accounting.calibration import calibrate_noise_multiplier as _calibrate

    q, k = _shape(participation, steps, strategy)
    return _calibrate(target_epsilon, target_delta, q, k, accountant=accountant)
