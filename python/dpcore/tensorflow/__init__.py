"""dpcore.tensorflow: DP-SGD for Keras models through dpcore's queries and ledger.

Keras's own ``fit`` (Abadi et al. 2016, Algorithm 1; McMahan et al. 2018)::

    dp = dpcore.tensorflow.make_private(model, keras.optimizers.SGD(0.5), noise_multiplier=1.1,
                                        max_grad_norm=1.0, population_size=n, sampling_probability=q,
                                        ledger=dpcore.PrivacyLedger("run.jsonl"))
    dp.compile(loss=..., metrics=[...])      # run_eagerly: the core is called from Python
    dp.fit(PoissonBatches(x, y, sampling_probability=q), epochs=5)
    eps = dp.get_epsilon(1e-5)

:class:`DPModel` is :class:`dpcore.keras.DPModel` (this package is the TensorFlow alias of
:mod:`dpcore.keras`): per-record gradients come from ``tf.vectorized_map`` under ``tf.function``,
clipped inside the compiled step (optionally in micro-batches); the query (a
:class:`dpcore.GaussianAverageQuery` for flat clipping, a :class:`dpcore.NestedQuery` per
variable for per-layer clipping; McMahan et al. 2018 §2) clips them in the Rust core, adds
ChaCha20 Gaussian noise, and the release is written durably to the ledger before the optimizer
applies it (McMahan et al. 2018, §6). :class:`PoissonBatches` draws the batches with
:func:`dpcore.poisson_sample`. :class:`CustomLoopTrainer` is the same step for a hand-written
training loop (its old name ``DPTrainer`` is a deprecated alias: it collided with
:class:`dpcore.transformers.DPTrainer`, the Hugging Face trainer).
User-level DP (``privacy_unit="user"``, ``user_ids=``, and ``examples_per_user=k`` or
``max_examples_per_user=K``; see :class:`DPModel`): ``fit(dp.batches(x, y))`` trains on a
:class:`UserPoissonBatches` (users sampled, each user's mean gradient clipped once) or on the
:class:`PoissonBatches` of the examples kept after bounding each user to K.
Requires the ``tensorflow`` extra (Keras 3).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import numpy as np
import tensorflow as tf

from ..ledger import PrivacyLedger
from ..queries.base import DPQuery
from ..sampling import poisson_sample
import keras as _keras

if _keras.backend.backend() != "tensorflow":
    raise ImportError(
        f"dpcore.tensorflow is the TensorFlow backend's front end, but Keras runs on {_keras.backend.backend()!r} "
        "(KERAS_BACKEND): use dpcore.keras, the same front end for every backend"
    )

from ..keras import (  # noqa: E402  - the one Keras front end; this package is its TensorFlow alias
    BallsInBinsBatches,
    CyclicBatches,
    DPModel,
    PoissonBatches,
    RandomAllocationBatches,
    SampledBatches,
    TruncatedPoissonBatches,
    UserPoissonBatches,
    make_private,
    make_private_with_epsilon,
)

__all__ = [
    "make_private", "make_private_with_epsilon", "DPModel", "PoissonBatches", "CyclicBatches", "SampledBatches",
    "TruncatedPoissonBatches", "BallsInBinsBatches", "RandomAllocationBatches", "UserPoissonBatches",
    "per_record_gradients", "CustomLoopTrainer",
]


def __getattr__(name: str) -> Any:
    # DPTrainer was the custom-loop trainer's name; it collided with dpcore.transformers.DPTrainer
    if name == "DPTrainer":
        import warnings

        warnings.warn(
            "dpcore.tensorflow.DPTrainer is deprecated; it is called CustomLoopTrainer now (DPTrainer is the Hugging "
            "Face trainer, dpcore.transformers.DPTrainer)", DeprecationWarning, stacklevel=2,
        )
        return CustomLoopTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def per_record_gradients(model: tf.keras.Model, loss_fn: Callable[[Any, Any], Any], x: Any, y: Any) -> List[tf.Tensor]:
    """One gradient per record for each trainable variable: tensors of shape (B, *var.shape).

    ``loss_fn(y_true, y_pred)`` is evaluated on a batch of one record, so any Keras loss works.
    """
    variables = model.trainable_variables

    def one(args):
        xi, yi = args
        with tf.GradientTape() as tape:
            loss = loss_fn(yi[None], model(xi[None], training=True))
        return tape.gradient(loss, variables)

    return tf.vectorized_map(one, (x, y))


class CustomLoopTrainer:
    """A DP training step for a Keras model in a hand-written training loop: ``trainer.step(x, y)``
    per Poisson batch.

    ``query`` defaults to the query of ``clipping`` (:func:`dpcore.queries._build.clipping_query`,
    as :class:`DPModel` and the torch optimizer build it): ``"flat"``,
    ``GaussianAverageQuery(C, z·C, q·n)``; ``"per_layer"``, C/√m per trainable variable (or a list
    ``max_grad_norm``); ``"joint"``, a :class:`~dpcore.JointClipQuery` with ``joint_scales``. The
    per-layer and joint queries need the model built (its variables). ``noise_mechanism``:
    ``"gaussian"`` (the default) or ``"discrete_gaussian"`` (with ``granularity``). :meth:`batches`
    yields Poisson samples of (x, y) drawn by dpcore's CSPRNG sampler and recorded in ``ledger``;
    an empty batch must be stepped too (it releases pure noise). ``get_epsilon(delta)`` reads the
    ledger. ``on_nonfinite`` (for the query built here): a record whose gradient holds a NaN or
    ±∞ contributes zero (``"zero"``, the default) or :meth:`step` raises ``ValueError`` naming
    it before anything is recorded (``"raise"``: debugging only, not differentially private).
    """

    def __init__(self, model: tf.keras.Model, optimizer: tf.keras.optimizers.Optimizer, loss_fn: Callable[[Any, Any], Any],
                 *, ledger: PrivacyLedger, population_size: int, sampling_probability: Optional[float] = None,
                 noise_multiplier: float = 1.0, max_grad_norm: Any = 1.0, query: Optional[DPQuery] = None,
                 clipping: str = "flat", joint_scales: Any = None, noise_mechanism: Optional[str] = None,
                 granularity: Optional[float] = None, sample_rate: Optional[float] = None,
                 on_nonfinite: str = "zero") -> None:
        from .. import _names
        from ..queries._build import clipping_query

        sampling_probability = _names.renamed("sampling_probability", sampling_probability, "sample_rate", sample_rate)
        if not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"ledger must be a dpcore.PrivacyLedger, got {type(ledger).__name__}")
        nm = _names.noise_mechanism(noise_mechanism)
        if nm in _names.MF_NOISE:
            raise ValueError(
                f"noise_mechanism={nm!r}: the custom-loop trainer draws Poisson batches, and matrix-factorization noise "
                "needs the fixed cyclic order its strategy is planned for; use dpcore.tensorflow.make_private("
                f"noise_mechanism={nm!r}, epochs=..., ...) with CyclicBatches"
            )
        self.model, self.optimizer, self.loss_fn, self.ledger = model, optimizer, loss_fn, ledger
        self.n, self.q = int(population_size), float(sampling_probability)
        if query is not None and on_nonfinite != "zero":
            raise ValueError("on_nonfinite configures the query built here; give it to your query= instead")
        if query is None:
            m = len(model.trainable_variables) if clipping != "flat" else 1
            if m == 0:
                raise ValueError(f"clipping={clipping!r} needs the model's variables: build it first (e.g. keras.Input)")
            query = clipping_query(
                m, clipping=clipping, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                denominator=self.q * self.n, noise_mechanism=nm, granularity=granularity, joint_scales=joint_scales,
                what="trainable variables", on_nonfinite=on_nonfinite,
            )
        self.query = query
        self.global_state = self.query.initial_global_state()

    def batches(self, x: np.ndarray, y: np.ndarray, steps: Optional[int] = None, *, seed: Optional[int] = None):
        from .._seeds import derive_seed

        for s in range(steps or max(1, round(1 / self.q))):
            idx = poisson_sample(self.n, self.q, ledger=self.ledger, seed=derive_seed(seed, s))
            yield x[idx], y[idx]

    def step(self, x: Any, y: Any, *, seed: Optional[int] = None) -> None:
        variables = self.model.trainable_variables
        template = [np.zeros(tuple(v.shape), np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype))) for v in variables]
        q, gs = self.query, self.global_state
        state = q.initial_sample_state(template)
        if len(x):
            grads = per_record_gradients(self.model, self.loss_fn, tf.convert_to_tensor(x), tf.convert_to_tensor(y))
            records = [g.numpy().reshape(g.shape[0], *v.shape) for g, v in zip(grads, variables)]
            state = q.accumulate_records(q.derive_sample_params(gs), state, records)  # core clip, in place
        result, self.global_state, event = q.get_noised_result(state, gs, seed=seed)
        self.ledger.record_release(event)  # durable before the update
        self.optimizer.apply_gradients(zip([tf.convert_to_tensor(r) for r in result], variables))

    def get_epsilon(self, delta: float, **kw: Any) -> float:
        return self.ledger.get_epsilon(delta, **kw)
