"""Mixed precision with ``torch.amp.GradScaler``: the DPOptimizer's grad-scaler component.

The per-record gradients are captured scaled by the scaler's scale S and divided by S before
their norms are taken (the engine's ``loss_scale``), so the clip sees unscaled gradients.

No step is skipped and the scale never backs off because of the data: a record whose scaled
per-record gradient overflowed float16 is a non-finite record like any other (its contribution
is zero under the default ``on_nonfinite="zero"``; see
:meth:`dpcore.torch.DPOptimizer.attach_grad_scaler`), every step releases, and the scaler is
always told that no step found an overflow. Its scale then follows only its own growth schedule
(×``growth_factor`` every ``growth_interval`` calls of ``update()``), which does not depend on
the data. Skipping a step, or lowering the scale, after an overflow would both depend on one
record's gradient, and neither is covered by the noise.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

import torch

__all__ = ["GradScaling", "GradScalerGrowthWarning", "OverflowSkipWarning"]

#: A growth interval at least this long counts as a fixed scale (no run grows it). torch's
#: GradScaler refuses growth_factor=1.0; growth_interval=2**31 - 1 (its int32 counter's
#: largest) fixes the scale instead.
_FIXED_INTERVAL = 10**9


class OverflowSkipWarning(UserWarning):
    """Deprecated, never emitted: dpcore no longer skips a step whose scaled per-record
    gradients overflowed (the skip depended on the data); an overflowed record contributes
    zero instead (see :meth:`DPOptimizer.attach_grad_scaler`). Kept importable so that
    existing warning filters still work."""


class GradScalerGrowthWarning(UserWarning):
    """The attached GradScaler grows its scale, and under dpcore it never backs off: records
    whose scaled gradients overflow float16 contribute nothing. Fix the scale instead
    (``GradScaler(init_scale=S, growth_interval=2**31 - 1)``: torch refuses
    ``growth_factor=1.0``)."""


def check_grad_scaler(grad_scaler: Any) -> None:
    if not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "_per_optimizer_states")):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")


def warn_if_growing(grad_scaler: Any, stacklevel: int) -> None:
    """Warns (:class:`GradScalerGrowthWarning`) when an enabled scaler's scale grows."""
    try:
        if not grad_scaler.is_enabled():
            return
        factor, interval = float(grad_scaler.get_growth_factor()), int(grad_scaler.get_growth_interval())
    except (AttributeError, TypeError, ValueError):
        return
    if factor == 1.0 or interval >= _FIXED_INTERVAL:
        return
    warnings.warn(
        f"the GradScaler grows its scale ×{factor:g} every {interval} update() calls and, under dpcore, never lowers "
        "it (backing off after an overflow would depend on the data): once the scale is too large, records whose "
        "scaled float16 gradients overflow contribute nothing. Prefer a fixed scale: "
        "torch.amp.GradScaler(init_scale=S, growth_interval=2**31 - 1), with S chosen so that per-record gradients "
        "times S stay below float16's 65504",
        GradScalerGrowthWarning,
        stacklevel=stacklevel + 1,
    )


class GradScaling:
    """The scaler an optimizer trains with (None: none). :attr:`skipped_steps` is what a
    checkpoint of an older version recorded (steps are never skipped now)."""

    def __init__(self, grad_scaler: Any = None) -> None:
        self.grad_scaler: Any = grad_scaler
        self._cached: Any = None
        #: Steps an older dpcore skipped after a GradScaler overflow, as restored from its
        #: checkpoint; 0 for a new run (no step is skipped any more).
        self.skipped_steps = 0

    @property
    def active(self) -> bool:
        """Whether the per-record gradients are scaled (a scaler is attached and enabled)."""
        s = self.grad_scaler
        return s is not None and bool(s.is_enabled())

    def sync(self, optimizer: Any, engine: Any, grad_scale: Any) -> None:
        """The engine's ``loss_scale`` from the scaler, before the records are clipped, and
        the scaler told that this step found no overflow (it never does: an overflowed record
        is zeroed, not a reason to skip). ``grad_scale``: what ``GradScaler.step(optimizer)``
        set on the optimizer (None: nothing)."""
        if self.grad_scaler is None and grad_scale is not None:
            engine.clear()
            raise RuntimeError(
                "GradScaler.step() was called on a DPOptimizer that does not know the scaler: pass "
                "grad_scaler=scaler to make_private (or call optimizer.attach_grad_scaler(scaler))"
            )
        engine.loss_scale = self.loss_scale()
        self.tell(optimizer)

    def loss_scale(self) -> Any:
        """The factor the loss was multiplied by before backward (1.0 without an active scaler):
        the scaler's own scale tensor (float64, 0-d, on its device) once it has scaled a loss,
        never read on the host (``get_scale()`` would be a synchronisation every step)."""
        if not self.active:
            return 1.0
        s = getattr(self.grad_scaler, "_scale", None)
        if isinstance(s, torch.Tensor):
            # one float64 copy per value of the scale (its version counts in-place updates, a
            # host-side fact): the lean mode's two passes see the very same tensor
            key = (id(s), s._version)
            if self._cached is None or self._cached[0] != key or self._cached[1] is not s:
                self._cached = (key, s, s.to(torch.float64).reshape(()))
            return self._cached[2]
        return float(self.grad_scaler.get_scale())  # not yet used: its initial scale, a host value

    def tell(self, optimizer: Any) -> None:
        """What ``GradScaler.update()`` reads: no overflow, always. The scale so follows the
        scaler's growth schedule alone, never the data."""
        if not self.active:
            return
        s = self.grad_scaler
        dev = s._scale.device if getattr(s, "_scale", None) is not None else torch.device("cpu")
        flag = torch.zeros((1,), dtype=torch.float32, device=dev)
        s._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {dev: flag}

    # -- checkpoints --------------------------------------------------------------------

    def checkpoint_state(self) -> Dict[str, int]:
        # kept for checkpoints of older versions (steps skipped after an overflow); 0 in new runs
        return {"skipped_steps": int(self.skipped_steps)}

    def restore_state(self, state: Dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
