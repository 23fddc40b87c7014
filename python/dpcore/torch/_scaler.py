"""Mixed precision with ``torch.amp.GradScaler``: the DPOptimizer's grad-scaler component.

The per-record gradients are captured scaled by the scaler's scale S and divided by S before
their norms are taken (the engine's ``loss_scale``), so the clip sees unscaled gradients. A step
whose scaled per-record gradients overflowed is skipped whole: nothing released or recorded, and
the scaler told (``found_inf``) so that ``update()`` lowers its scale. See
:meth:`dpcore.torch.DPOptimizer.attach_grad_scaler`.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

import torch

__all__ = ["GradScaling", "Overflow", "OverflowSkipWarning"]


class OverflowSkipWarning(UserWarning):
    """A step was skipped because the GradScaler found an overflow: nothing was released or
    recorded (see :meth:`DPOptimizer.attach_grad_scaler`)."""


class Overflow(Exception):
    """Scaled per-record gradients overflowed (float16 with a GradScaler)."""


def check_grad_scaler(grad_scaler: Any) -> None:
    if not (hasattr(grad_scaler, "get_scale") and hasattr(grad_scaler, "_per_optimizer_states")):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")


class GradScaling:
    """The scaler an optimizer trains with (None: none), the steps it made skip, and whether the
    logical batch being formed overflowed (its remaining micro-batches are dropped too)."""

    def __init__(self, grad_scaler: Any = None) -> None:
        self.grad_scaler: Any = grad_scaler
        #: Steps skipped because the GradScaler found an overflow (nothing released or recorded).
        self.skipped_steps = 0
        self.overflowed = False

    @property
    def active(self) -> bool:
        """Whether the per-record gradients are scaled (a scaler is attached and enabled)."""
        s = self.grad_scaler
        return s is not None and bool(s.is_enabled())

    def sync(self, engine: Any, grad_scale: Any) -> None:
        """The engine's ``loss_scale`` from the scaler, before the records are clipped.
        ``grad_scale``: what ``GradScaler.step(optimizer)`` set on the optimizer (None: nothing)."""
        if self.grad_scaler is None and grad_scale is not None:
            engine.clear()
            raise RuntimeError(
                "GradScaler.step() was called on a DPOptimizer that does not know the scaler: pass "
                "grad_scaler=scaler to make_private (or call optimizer.attach_grad_scaler(scaler))"
            )
        engine.loss_scale = float(self.grad_scaler.get_scale()) if self.active else 1.0

    def tell(self, optimizer: Any, found_inf: bool) -> None:
        """What ``GradScaler.update()`` reads: whether this step found an overflow."""
        if not self.active:
            return
        s = self.grad_scaler
        dev = s._scale.device if getattr(s, "_scale", None) is not None else torch.device("cpu")
        flag = torch.full((1,), 1.0 if found_inf else 0.0, dtype=torch.float32, device=dev)
        s._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {dev: flag}

    def skip(self, releasing: bool, loss_scale: float, stacklevel: int) -> bool:
        """After an overflow (the logical batch already dropped): before its end, marks the rest
        of the batch dropped (False); at its end counts and reports the skipped release (True)."""
        if not releasing:
            self.overflowed = True
            return False
        self.skipped_steps += 1
        warnings.warn(
            f"step skipped: the GradScaler's scaled per-record gradients overflowed at scale "
            f"{loss_scale:g}; nothing was released, nothing recorded in the ledger, and no update "
            f"applied ({self.skipped_steps} skipped so far)",
            OverflowSkipWarning,
            stacklevel=stacklevel + 1,
        )
        return True

    # -- checkpoints --------------------------------------------------------------------

    def checkpoint_state(self) -> Dict[str, int]:
        # steps a GradScaler overflow skipped (nothing released); the scaler has its own state_dict
        return {"skipped_steps": int(self.skipped_steps)}

    def restore_state(self, state: Dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
