"""dpcore.keras: DP-SGD for Keras 3 models on every backend (JAX, TensorFlow, torch), through
dpcore's queries and ledger.

Keras's own ``fit`` (Abadi et al. 2016, Algorithm 1; McMahan et al. 2018)::

    import os; os.environ["KERAS_BACKEND"] = "jax"      # or "tensorflow", "torch"
    import keras, dpcore, dpcore.keras as dpk

    dp = dpk.make_private(model, keras.optimizers.SGD(0.5), noise_multiplier=1.1, max_grad_norm=1.0,
                          population_size=n, sampling_probability=q, ledger=dpcore.PrivacyLedger("run.jsonl"))
    dp.compile(loss=..., metrics=[...])
    dp.fit(dpk.PoissonBatches(x, y, sampling_probability=q), epochs=5)
    eps = dp.get_epsilon(1e-5)

The step is compiled by the backend (``_backends``): per-record gradients by its own
vectorisation (``jax.vmap`` under ``jax.jit``; ``tf.vectorized_map`` under ``tf.function``;
``torch.func``), each record clipped and the clipped sum formed inside the compiled call
(``_step.clipped_sums``); the release written durably to the ledger and the noise drawn by the
core's ChaCha20 generator on the host, once per step, before the compiled update applies it.
:class:`DPModel` documents every option (per-layer and joint clipping, other samplers,
matrix-factorization noise, users as the privacy unit, micro-batches). ``dpcore.tensorflow`` is
the same front end, for the TensorFlow backend, with its custom-loop trainer.
"""

from __future__ import annotations

from ._data import (
    BallsInBinsBatches,
    CyclicBatches,
    PoissonBatches,
    RandomAllocationBatches,
    SampledBatches,
    TruncatedPoissonBatches,
    UserPoissonBatches,
)
from ._make_private import make_private, make_private_with_epsilon
from ._model import DPModel

__all__ = [
    "make_private", "make_private_with_epsilon", "DPModel", "PoissonBatches", "CyclicBatches", "SampledBatches",
    "TruncatedPoissonBatches", "BallsInBinsBatches", "RandomAllocationBatches", "UserPoissonBatches", "backend",
]


def backend() -> str:
    """The Keras backend the DP step compiles for (``KERAS_BACKEND``, read when keras is imported)."""
    from ._backends import current

    return current()
