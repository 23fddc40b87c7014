"""What every backend's DP step shares: the loss of one record through the model's stateless
call, and the metrics of a padded batch."""

from __future__ import annotations

from typing import Any, Callable

import keras


def loss_of_one(model: Any) -> Callable[..., Any]:
    """``f(trainable, non_trainable, metrics, x1, y1, sw1) -> (loss, (y_pred, non_trainable))``:
    the compiled loss (and the model's own losses) of a batch of one record (x1 with a leading
    axis of 1), whatever its reduction: the per-record loss L_i whose gradient is g_i (Abadi et
    al. 2016, Algorithm 1)."""

    def f(tv: Any, ntv: Any, mv: Any, x1: Any, y1: Any, sw1: Any) -> Any:
        y_pred, ntv2, losses = model.stateless_call(tv, ntv, x1, return_losses=True, training=True)
        if losses:
            model._losses_override.clear()
            model._losses_override = losses
        loss, _ = model.stateless_compute_loss(tv, ntv2, mv, x=x1, y=y1, y_pred=y_pred, sample_weight=sw1, training=True)
        if losses:
            model._losses_override.clear()
        return loss, (y_pred, ntv2)

    return f


def one(t: Any) -> Any:
    """A record's slice as a batch of one."""
    return None if t is None else keras.ops.expand_dims(t, 0)


def weights(mask: Any, sw: Any) -> Any:
    """The metrics' sample weights of a padded batch: 0 for padding."""
    if sw is None:
        return mask
    sw = keras.ops.cast(sw, mask.dtype)
    return sw * keras.ops.reshape(mask, (-1,) + (1,) * (len(keras.ops.shape(sw)) - 1))


def update_metrics(model: Any, losses: Any, x: Any, y: Any, y_pred: Any, sw: Any, mask: Any) -> Any:
    """The loss tracker (mean per-record loss over the real records) and the compiled metrics,
    the padding weighted 0. Returns the logs."""
    ops = keras.ops
    b = ops.sum(mask)
    if model._loss_tracker is not None:
        mean = ops.sum(ops.where(mask > 0, losses, ops.zeros_like(losses))) / ops.maximum(b, 1.0)
        model._loss_tracker.update_state(mean, sample_weight=b)
    return model.compute_metrics(x, y, y_pred, sample_weight=weights(mask, sw))
