"""One name per concept across the API (the core's vocabulary: ``sampling_probability``,
``l2_norm_clip``; ``max_grad_norm`` in the torch and Keras wrappers, as users know it from
Opacus). Old spellings are still accepted for a while, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

_MISSING = object()


def renamed(new: str, value: Any, old: str, old_value: Any, *, required: bool = True, stacklevel: int = 3) -> Any:
    """The value given as ``new`` or, deprecated, as ``old`` (never both)."""
    if old_value is not None:
        if value is not None:
            raise TypeError(f"give {new}= only ({old}= is its old name)")
        warnings.warn(f"{old}= is deprecated; it is called {new}= now", DeprecationWarning, stacklevel=stacklevel)
        return old_value
    if value is None and required:
        raise TypeError(f"missing required keyword argument: {new}")
    return value
