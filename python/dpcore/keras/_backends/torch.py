"""The torch backend of :class:`dpcore.keras.DPModel`: per-record gradients of the per-record
loss (Abadi et al. 2016, Algorithm 1) by ``torch.func.vmap`` of ``torch.func.grad_and_value``
over the model's stateless call, clipped and summed in the same pass (``_step.clipped_sums``);
the noised update by the Keras optimizer."""

from __future__ import annotations

import warnings
from typing import Any

import keras
import torch
from torch.func import grad_and_value, vmap

from .._ghost import GhostPlan, ghost_sq_norms, ghost_sums
from .._step import clipped_sums
from ._common import loss_of_one, update_metrics

__all__ = ["make_train_function"]


def make_train_function(model: Any) -> Any:
    f = loss_of_one(model)
    spec = model._dp_spec
    tvars = list(model.trainable_variables)
    seeded = any("seed_generator" in v.path for v in model.non_trainable_variables)

    def tensors(t: Any) -> Any:
        return None if t is None else keras.tree.map_structure(keras.ops.convert_to_tensor, t)

    state = {"vmap": True}
    plan = GhostPlan(model) if model._dp_ghost else None
    ghost = set() if plan is None else plan.vars
    shapes = [tuple(v.shape) for v in tvars]

    def per_record(x: Any, y: Any, sw: Any, mask: Any, use_ghost: bool) -> Any:
        ntv = [v.value for v in model.non_trainable_variables]
        mv = [v.value for v in model.metrics_variables]
        params = [v.value.detach() for v in tvars]

        def one(p: Any, xi: Any, yi: Any, swi: Any) -> Any:
            e = lambda t: None if t is None else keras.tree.map_structure(lambda a: a.unsqueeze(0), t)  # noqa: E731
            loss, (y_pred, _) = f(p, ntv, mv, e(xi), e(yi), e(swi))
            return loss, keras.tree.map_structure(lambda t: t[0].detach(), y_pred)

        gv = grad_and_value(one, has_aux=True)
        if state["vmap"]:
            dims = (None, 0, 0 if y is not None else None, 0 if sw is not None else None)
            try:
                if use_ghost:
                    return _ghosted(params, ntv, mv, x, y, sw, dims)
                gs, (losses, y_pred) = vmap(gv, in_dims=dims)(params, x, y, sw)
                return losses, y_pred, list(gs), None
            except (RuntimeError, NotImplementedError) as e:
                # torch.func cannot batch some kernels (e.g. a channels-last clone in Keras's
                # convolutions): one record at a time is the same arithmetic, slower
                state["vmap"] = False
                warnings.warn(f"dpcore.keras (torch): torch.func.vmap failed on this model ({str(e).splitlines()[0][:160]}); "
                              "per-record gradients are computed one record at a time", UserWarning, stacklevel=4)
        at = lambda t, i: None if t is None else keras.tree.map_structure(lambda a: a[i], t)  # noqa: E731
        outs = [gv(params, at(x, i), at(y, i), at(sw, i)) for i in range(int(mask.shape[0]))]
        gs = [torch.stack([o[0][k] for o in outs]) for k in range(len(params))]
        losses = torch.stack([o[1][0] for o in outs])
        y_pred = keras.tree.map_structure(lambda *t: torch.stack(t), *[o[1][1] for o in outs])
        return losses, y_pred, gs, None

    def _ghosted(params: Any, ntv: Any, mv: Any, x: Any, y: Any, sw: Any, dims: Any) -> Any:
        # Dense, EinsumDense, Embedding and Conv2D weights by their taps (``_ghost``): the
        # per-record pass differentiates zero taps on their outputs, not their weights
        other = [k for k in range(len(params)) if k not in ghost]
        e = lambda t: None if t is None else keras.tree.map_structure(lambda a: a[:1], t)  # noqa: E731
        with torch.no_grad(), plan.tapping(None) as found:
            f(params, ntv, mv, e(x), e(y), e(sw))
        taps = [[torch.zeros(shape, dtype=getattr(torch, str(dtype).split(".")[-1])) for shape, dtype in calls]
                for calls in found.shapes]

        def one(p_other: Any, taps: Any, xi: Any, yi: Any, swi: Any) -> Any:
            full = list(params)
            for k, v in zip(other, p_other):
                full[k] = v
            u = lambda t: None if t is None else keras.tree.map_structure(lambda a: a.unsqueeze(0), t)  # noqa: E731
            with plan.tapping(taps) as tp:
                loss, (y_pred, _) = f(full, ntv, mv, u(xi), u(yi), u(swi))
            return loss, (keras.tree.map_structure(lambda t: t[0].detach(), y_pred), tp.inputs)

        g = grad_and_value(one, argnums=(0, 1), has_aux=True)
        (g_other, deltas), (losses, (y_pred, inputs)) = vmap(g, in_dims=(None, None) + dims[1:])(
            [params[k] for k in other], taps, x, y, sw
        )
        gs: list = [None] * len(params)
        for k, v in zip(other, g_other):
            gs[k] = v
        return losses, y_pred, gs, (inputs, deltas)

    def advance_seeds(x: Any, y: Any, sw: Any) -> None:
        ntv = [v.value for v in model.non_trainable_variables]
        mv = [v.value for v in model.metrics_variables]
        e = lambda t: None if t is None else keras.tree.map_structure(lambda a: a[:1], t)  # noqa: E731
        with torch.no_grad():
            _, (_, ntv2) = f([v.value for v in tvars], ntv, mv, e(x), e(y), e(sw))
        for v, val in zip(model.non_trainable_variables, ntv2):
            v.assign(val)

    def train_function(data: Any) -> Any:
        batch = model._dp_begin(data[0])
        logs = None
        sums, sqs, bads, recs = None, [], [], []
        clips = inv_dens = None
        if batch.compiled:
            clips, inv_dens = (keras.ops.convert_to_tensor(a) for a in model._dp_clip_args())
        for x, y, sw, mask in batch.chunks:
            x, y, sw, mask = tensors(x), tensors(y), tensors(sw), keras.ops.convert_to_tensor(mask)
            # the host path's query needs every record's gradient formed: no ghost norms there
            losses, y_pred, gs, taps = per_record(x, y, sw, mask, bool(ghost) and batch.compiled)
            with torch.no_grad():
                if batch.compiled and taps is not None:
                    inputs, deltas = taps
                    formed: dict = {}  # the per-record gradients the norms form, summed as formed
                    s, sq, bad = clipped_sums(
                        keras.ops, gs, mask, spec, clips, inv_dens, ghost_sq=ghost_sq_norms(plan, inputs, deltas, formed),
                        ghost_sum=lambda fs, b: ghost_sums(plan, inputs, deltas, fs, b, shapes, formed),
                    )
                elif batch.compiled:
                    s, sq, bad = clipped_sums(keras.ops, gs, mask, spec, clips, inv_dens)
                else:
                    recs.append([g.cpu() for g in gs])
                if batch.compiled:
                    sums = s if sums is None else [a + b for a, b in zip(sums, s)]
                    sqs.append(sq.cpu())
                    bads.append(bad.cpu())
                if seeded:
                    advance_seeds(x, y, sw)
                logs = update_metrics(model, losses, x, y, y_pred, sw, mask)
        with torch.no_grad():
            if batch.compiled:
                noise, values = model._dp_release(batch, sqs, bads, [s.cpu() for s in sums])  # the ledger first
                if values is None:
                    grads = [s + keras.ops.convert_to_tensor(z) for s, z in zip(sums, noise)]
                else:
                    grads = [keras.ops.convert_to_tensor(v) for v in values]
            else:
                grads = [keras.ops.convert_to_tensor(r) for r in model._dp_host_release(batch, recs)]
            model.optimizer.apply([keras.ops.cast(g, v.dtype) for g, v in zip(grads, tvars)], tvars)
        return logs

    return train_function
