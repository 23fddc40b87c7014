"""The Keras backends of :class:`dpcore.keras.DPModel`: one file per backend, each building the
train function its backend's ``fit`` calls, from the same host step (``_model.py``) and the same
clipping arithmetic (``_step.clipped_sums``).

A backend module has one function, ``make_train_function(model) -> callable``, returning what
that backend's trainer stores as ``model.train_function`` (JAX: ``(state, iterator) -> (logs,
state)``; TensorFlow: ``(iterator) -> logs``; torch: ``(data) -> logs``). Its compiled calls are
the per-record gradients and their clipped sums (the model's ``_dp_clip_args``), and the update
(after the model's ``_dp_release`` has written the ledger and drawn the noise).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BACKENDS", "backend_module", "current"]

#: Keras backend name -> module of this package.
BACKENDS = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}


def current() -> str:
    import keras

    return keras.backend.backend()


def backend_module(name: str = None) -> Any:  # type: ignore[assignment]
    name = current() if name is None else name
    if name not in BACKENDS:
        raise NotImplementedError(
            f"dpcore.keras trains on the Keras backends {sorted(BACKENDS)}; KERAS_BACKEND is {name!r}"
        )
    return importlib.import_module(f"{__name__}.{BACKENDS[name]}")
