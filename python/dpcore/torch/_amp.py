"""Mixed precision: what ``torch.autocast`` does to the products whose factors dpcore keeps.

Under autocast, linear maps and convolutions run in bfloat16 (or float16) while the parameters
stay float32. The rules' autograd functions run their backward passes outside autocast, so they
cast their inputs explicitly in the forward pass (as autocast would) and save the cast tensors:
each record's gradient factors are then the very values the forward pass multiplied, and the
engine forms norms and clipped sums from them in float32 or wider (see ``_contrib.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["amp_dtype", "amp_cast", "work_dtype"]


_AMP_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def amp_dtype(device_type: str) -> Optional[torch.dtype]:
    """The lower precision that ``torch.autocast`` runs matrix products in on ``device_type``
    right now (bfloat16 or float16), or None outside autocast."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4
        on = torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    if not on:
        return None
    try:
        return torch.get_autocast_dtype(device_type)
    except AttributeError:  # torch < 2.4
        return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def amp_cast(x: torch.Tensor, *ts: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """``(x, *ts)`` as autocast would hand them to a linear map or convolution: floating
    tensors other than float64 in the autocast dtype. The rules' autograd functions cast
    explicitly and save the cast tensors, so that their backward passes (which run outside
    autocast) multiply tensors of one dtype, and each record's factors are the very values
    the forward pass multiplied."""
    dt = amp_dtype(x.device.type)
    if dt is None:
        return (x, *ts)
    return tuple(t.to(dt) if t is not None and t.dtype in _AMP_CASTS and t.dtype != dt else t for t in (x, *ts))


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a parameter of ``dtype`` gets its clipped sum, noise and released
    gradient before the final cast: float64 for float64, else float32 (never bfloat16/float16,
    whose unit roundoff, 2⁻⁸ and 2⁻¹¹, would enter every record's clipped contribution)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
