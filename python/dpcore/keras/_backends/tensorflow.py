"""The TensorFlow backend of :class:`dpcore.keras.DPModel`: per-record gradients of the
per-record loss (Abadi et al. 2016, Algorithm 1) inside one ``tf.function``, clipped and summed
there (``_step.clipped_sums``); the noised update in another.

How the per-record gradients are formed is chosen per model (``_tf_paths.choose_path``):
``tf.vectorized_map`` where it works, else a path that does (a per-record loop compiled by XLA, or
the vectorized graph compiled by XLA), said in a warning, for the cases where TF's vectorisation
fails (an RNN fed by an Embedding) or where oneDNN's batch matmul would corrupt the process or
give wrong per-record gradients (einsum layers, hence MultiHeadAttention).
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import tensorflow as tf

from .. import _tf_paths
from .._step import clipped_sums
from ._common import loss_of_one, update_metrics

__all__ = ["make_train_function"]


def _seeded(model: Any) -> bool:
    return any("seed_generator" in v.path for v in model.non_trainable_variables)


def make_train_function(model: Any) -> Any:
    f = loss_of_one(model)
    spec = model._dp_spec
    tvars = list(model.trainable_variables)
    # the path that works for this model on this TF build, chosen from its traced (never run)
    # per-record graph: a crash of oneDNN's batch matmul is predicted, not caught
    path, why = _tf_paths.choose_path(model)
    if why:
        warnings.warn(f"dpcore.keras (TensorFlow): per-record gradients by the {path!r} path: {why}", UserWarning,
                      stacklevel=3)

    def per_record(x: Any, y: Any, sw: Any) -> Any:
        ntv = [v.value for v in model.non_trainable_variables]
        mv = [v.value for v in model.metrics_variables]
        params = [v.value for v in tvars]
        rec = {"x": x}
        if y is not None:
            rec["y"] = y
        if sw is not None:
            rec["sw"] = sw

        def one(p: Any, r: Any) -> Any:
            e = lambda t: None if t is None else keras.tree.map_structure(lambda a: a[None], t)  # noqa: E731
            loss, (y_pred, _) = f(p, ntv, mv, e(r["x"]), e(r.get("y")), e(r.get("sw")))
            return loss, keras.tree.map_structure(lambda t: t[0], y_pred)

        return _tf_paths.per_record(one, params, rec, path=path)

    def advance_seeds(x: Any, y: Any, sw: Any) -> None:
        # the seed generators (dropout) move on as one record's forward moves them
        ntv = [v.value for v in model.non_trainable_variables]
        mv = [v.value for v in model.metrics_variables]
        e = lambda t: None if t is None else keras.tree.map_structure(lambda a: a[:1], t)  # noqa: E731
        _, (_, ntv2) = f([v.value for v in tvars], ntv, mv, e(x), e(y), e(sw))
        for v, val in zip(model.non_trainable_variables, ntv2):
            v.assign(val)

    seeded = _seeded(model)

    @tf.function(reduce_retracing=True)
    def clip(x: Any, y: Any, sw: Any, mask: Any, clips: Any, inv_dens: Any) -> Any:
        losses, y_pred, grads = per_record(x, y, sw)
        sums, sq, bad = clipped_sums(keras.ops, grads, mask, spec, clips, inv_dens)
        return sums, sq, bad, losses, y_pred

    @tf.function(reduce_retracing=True)
    def metrics(losses: Any, x: Any, y: Any, y_pred: Any, sw: Any, mask: Any) -> Any:
        if seeded:
            advance_seeds(x, y, sw)
        return update_metrics(model, losses, x, y, y_pred, sw, mask)

    @tf.function(reduce_retracing=True)
    def apply_noised(sums: Any, noise: Any) -> None:
        model.optimizer.apply([tf.cast(s + z, v.dtype) for s, z, v in zip(sums, noise, tvars)], tvars)

    @tf.function(reduce_retracing=True)
    def apply(grads: Any) -> None:
        model.optimizer.apply([tf.cast(g, v.dtype) for g, v in zip(grads, tvars)], tvars)

    @tf.function(reduce_retracing=True)
    def records(x: Any, y: Any, sw: Any) -> Any:
        return per_record(x, y, sw)

    def train_function(iterator: Any) -> Any:
        batch = model._dp_begin(next(iterator))
        logs = None
        if batch.compiled:
            clips, inv_dens = model._dp_clip_args()
            sums, sqs, bads = None, [], []
            for x, y, sw, mask in batch.chunks:
                s, sq, bad, losses, y_pred = clip(x, y, sw, mask, clips, inv_dens)
                logs = metrics(losses, x, y, y_pred, sw, mask)
                sums = s if sums is None else [a + b for a, b in zip(sums, s)]
                sqs.append(sq)
                bads.append(bad)
            noise, values = model._dp_release(batch, sqs, bads, sums)  # the ledger, before the update
            if values is None:
                apply_noised(sums, noise)
            else:
                apply(values)
        else:
            recs = []
            for x, y, sw, mask in batch.chunks:
                losses, y_pred, grads = records(x, y, sw)
                logs = metrics(losses, x, y, y_pred, sw, mask)
                recs.append(grads)
            apply(model._dp_host_release(batch, recs))
        return logs

    return train_function
