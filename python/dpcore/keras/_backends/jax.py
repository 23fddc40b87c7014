"""The JAX backend of :class:`dpcore.keras.DPModel`: per-record gradients by ``jax.vmap`` of
``jax.value_and_grad`` of the per-record loss (Abadi et al. 2016, Algorithm 1), clipped and summed
inside one ``jax.jit`` call; the noised update in another (``optimizer.stateless_apply``).

The Keras JAX trainer keeps the model's state out of its variables during ``fit`` and passes it
to the train function; this one takes and returns that state as the trainer's own does.
"""

from __future__ import annotations

from typing import Any, List

import jax
import jax.numpy as jnp
import keras
from keras.src import backend as kbackend

from .._step import clipped_sums
from .._ghost import GhostPlan, ghost_sq_norms, ghost_sums
from ._common import loss_of_one, update_metrics

__all__ = ["make_train_function"]


def _per_record(model: Any, plan: Any = None) -> Any:
    """``grads(tv, ntv, mv, x, y, sw) -> (loss, y_pred, grads, ntv, taps)``: per-record losses,
    predictions and gradients (None for the variables ``plan`` gives ghost norms: their layers'
    inputs and output gradients are in ``taps`` instead), by ``jax.vmap`` over the records."""
    f = loss_of_one(model)
    ghost = set() if plan is None else plan.vars

    seeds = [k for k, v in enumerate(model.non_trainable_variables) if "seed_generator_state" in v.path]

    def grads(tv: Any, ntv_step: Any, mv: Any, x: Any, y: Any, sw: Any) -> Any:
        other = [k for k in range(len(tv)) if k not in ghost]

        def g(xi: Any, yi: Any, swi: Any, i: Any) -> Any:
            # each record its own random stream (dropout): the seed generators' seed moved by the
            # record's index, their counter as the step's (record 0 keeps the step's own stream)
            ntv = list(ntv_step)
            for k in seeds:
                ntv[k] = ntv[k] + jnp.stack([i, jnp.zeros_like(i)]).astype(ntv[k].dtype)
            one = lambda t: None if t is None else jnp.expand_dims(t, 0)  # noqa: E731
            x1, y1, sw1 = jax.tree.map(one, xi), jax.tree.map(one, yi), jax.tree.map(one, swi)
            if not ghost:
                (loss, (y_pred, ntv2)), gs = jax.value_and_grad(f, has_aux=True)(tv, ntv, mv, x1, y1, sw1)
                return loss, y_pred, gs, ntv2, None
            with plan.tapping(None) as found:  # the taps' shapes (this forward is traced only)
                f(tv, ntv, mv, x1, y1, sw1)
            taps = [[jnp.zeros(shape, dtype) for shape, dtype in calls] for calls in found.shapes]

            def fwd(p_other: Any, taps: Any) -> Any:
                full = list(tv)
                for k, v in zip(other, p_other):
                    full[k] = v
                with plan.tapping(taps) as tp:
                    loss, aux = f(full, ntv, mv, x1, y1, sw1)
                return loss, (aux, tp.inputs)

            (loss, ((y_pred, ntv2), inputs)), (g_other, deltas) = jax.value_and_grad(fwd, argnums=(0, 1), has_aux=True)(
                [tv[k] for k in other], taps
            )
            gs: List[Any] = [None] * len(tv)
            for k, v in zip(other, g_other):
                gs[k] = v
            return loss, y_pred, gs, ntv2, (inputs, deltas)

        b = jax.tree.leaves(x)[0].shape[0]
        loss, y_pred, gs, ntv2, taps = jax.vmap(g)(x, y, sw, jnp.arange(b, dtype=jnp.uint32))
        y_pred = jax.tree.map(lambda t: t[:, 0], y_pred)
        # the non-trainable state (seed generators) as one record's forward left it
        ntv2 = [v[0] for v in ntv2]
        return loss, y_pred, gs, ntv2, taps

    return grads


def _metrics(model: Any, mv: Any, losses: Any, x: Any, y: Any, y_pred: Any, sw: Any, mask: Any) -> Any:
    with kbackend.StatelessScope(state_mapping=list(zip(model.metrics_variables, mv))) as scope:
        logs = update_metrics(model, losses, x, y, y_pred, sw, mask)
    new = []
    for v, old in zip(model.metrics_variables, mv):
        cur = scope.get_current_value(v)
        new.append(old if cur is None else cur)
    return logs, new


def make_train_function(model: Any) -> Any:
    plan = GhostPlan(model) if model._dp_ghost else None
    ghosted = _per_record(model, plan)
    per_record = _per_record(model)
    spec = model._dp_spec
    shapes = [tuple(v.shape) for v in model.trainable_variables]

    @jax.jit
    def clip(tv: Any, ntv: Any, mv: Any, x: Any, y: Any, sw: Any, mask: Any, clips: Any, inv_dens: Any) -> Any:
        loss, y_pred, gs, ntv2, taps = ghosted(tv, ntv, mv, x, y, sw)
        if taps is None:
            sums, sq, bad = clipped_sums(keras.ops, gs, mask, spec, clips, inv_dens)
        else:
            inputs, deltas = taps
            formed: dict = {}  # the per-record gradients the norms form, summed as formed
            sums, sq, bad = clipped_sums(
                keras.ops, gs, mask, spec, clips, inv_dens, ghost_sq=ghost_sq_norms(plan, inputs, deltas, formed),
                ghost_sum=lambda factors, bad: ghost_sums(plan, inputs, deltas, factors, bad, shapes, formed),
            )
        logs, mv2 = _metrics(model, mv, loss, x, y, y_pred, sw, mask)
        return sums, sq, bad, ntv2, mv2, logs

    @jax.jit
    def records(tv: Any, ntv: Any, mv: Any, x: Any, y: Any, sw: Any, mask: Any) -> Any:
        loss, y_pred, gs, ntv2, _ = per_record(tv, ntv, mv, x, y, sw)
        logs, mv2 = _metrics(model, mv, loss, x, y, y_pred, sw, mask)
        return gs, ntv2, mv2, logs

    def _apply(tv: Any, ov: Any, grads: List[Any]) -> Any:
        grads = [g.astype(v.dtype) for g, v in zip(grads, tv)]
        return model.optimizer.stateless_apply(ov, grads, tv)

    apply_noised = jax.jit(lambda tv, ov, sums, noise: _apply(tv, ov, [s + z for s, z in zip(sums, noise)]),
                           donate_argnums=(0, 1))
    apply = jax.jit(_apply, donate_argnums=(0, 1))
    add = jax.jit(lambda a, b: [x + y for x, y in zip(a, b)])

    def train_function(state: Any, iterator: Any) -> Any:
        tv, ntv, ov, mv = state
        batch = model._dp_begin(next(iterator))
        logs = None
        if batch.compiled:
            clips, inv_dens = model._dp_clip_args()
            sums, sqs, bads = None, [], []
            for x, y, sw, mask in batch.chunks:
                s, sq, bad, ntv, mv, logs = clip(tv, ntv, mv, x, y, sw, mask, clips, inv_dens)
                sums = s if sums is None else add(sums, s)
                sqs.append(sq)
                bads.append(bad)
            noise, values = model._dp_release(batch, sqs, bads, sums)  # the ledger, before the update
            tv, ov = apply_noised(tv, ov, sums, noise) if values is None else apply(tv, ov, values)
        else:
            recs = []
            for x, y, sw, mask in batch.chunks:
                gs, ntv, mv, logs = records(tv, ntv, mv, x, y, sw, mask)
                recs.append(gs)
            result = model._dp_host_release(batch, recs)
            tv, ov = apply(tv, ov, result)
        return logs, (tv, ntv, ov, mv)

    return train_function
