"""``dpcore.flower.clipping_mod``: client-side clipping for :class:`~dpcore.flower.DifferentialPrivacy`
with ``clipping_mode="client"``.

The client clips its own update before it leaves (McMahan et al. 2018 §2; the server never sees
an unclipped update): Δ = w_local − w is clipped to the bound the server sent in the round's
ConfigRecord (flat: ‖Δ‖₂ ≤ C; per layer: ‖Δ_j‖₂ ≤ C_j) and w + clip(Δ) is sent instead of
w_local. Without the server's bound the mod refuses to train at all (an error reply), so a
misconfigured server cannot collect raw updates. A non-finite update is replaced by a zero update.
"""

from __future__ import annotations

from logging import ERROR
from typing import Any, List, Optional

import numpy as np

from flwr.app import Array, ArrayRecord, Error, Message, MessageType
from flwr.supercore import log

from ._strategy import CONFIG_CLIP, CONFIG_CLIPPING

__all__ = ["clipping_mod", "clip_update"]

#: Flower's error code of a mod whose precondition failed (flwr.common.constant.ErrorCode).
_MOD_FAILED_PRECONDITION = 4


def _error(msg: Message, reason: str) -> Message:
    log(ERROR, reason)
    try:
        from flwr.common.constant import ErrorCode

        code = ErrorCode.MOD_FAILED_PRECONDITION
    except Exception:  # noqa: BLE001 - the constant moved between Flower releases
        code = _MOD_FAILED_PRECONDITION
    return Message(Error(code=code, reason=reason), reply_to=msg)


def clip_update(new: List[np.ndarray], old: List[np.ndarray], clip: Any, clipping: str) -> List[np.ndarray]:
    """``old + clip(new − old)`` over the floating-point arrays (others are sent back as the
    server sent them): flat (one bound over all arrays) or per layer (a bound per array)."""
    flt = [i for i, a in enumerate(old) if np.asarray(a).dtype.kind == "f"]
    deltas = {i: np.asarray(new[i], np.float64) - np.asarray(old[i], np.float64) for i in flt}
    out = [np.asarray(a).copy() for a in old]
    finite = all(np.isfinite(d).all() for d in deltas.values())
    if not finite:
        return out  # zero update: the same contribution the server gives a non-finite one
    if clipping == "per_layer":
        clips = list(clip)
        if len(clips) != len(flt):
            raise ValueError(f"the server sent {len(clips)} bounds for {len(flt)} floating-point arrays")
        factors = {i: min(1.0, c / max(float(np.linalg.norm(deltas[i])), 1e-300)) for i, c in zip(flt, clips)}
    else:
        norm = float(np.sqrt(sum(float(np.sum(d * d)) for d in deltas.values())))
        f = min(1.0, float(clip) / max(norm, 1e-300))
        factors = {i: f for i in flt}
    for i in flt:
        out[i] = (np.asarray(old[i], np.float64) + deltas[i] * factors[i]).astype(np.asarray(old[i]).dtype)
    return out


def _bound(msg: Message) -> Optional[tuple]:
    for cfg in msg.content.config_records.values():
        if CONFIG_CLIP in cfg:
            return cfg[CONFIG_CLIP], str(cfg.get(CONFIG_CLIPPING, "flat"))
    return None


def clipping_mod(msg: Message, ctxt: Any, call_next: Any) -> Message:
    """A Flower client mod (``ClientApp(mods=[dpcore.flower.clipping_mod])``): clips the update
    of every training reply to the bound the server's :class:`DifferentialPrivacy` sent."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    bound = _bound(msg)
    if bound is None:
        return _error(msg, f"dpcore.flower.clipping_mod: the server sent no clip bound ({CONFIG_CLIP!r}); it must "
                           "run dpcore.flower.DifferentialPrivacy(..., clipping_mode='client'). Refusing to train.")
    if len(msg.content.array_records) != 1:
        return _error(msg, "dpcore.flower.clipping_mod expects exactly one ArrayRecord (the model) from the server")
    sent = next(iter(msg.content.array_records.values()))
    keys = list(sent.keys())
    old = [np.asarray(a) for a in sent.to_numpy_ndarrays()]
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    if len(out.content.array_records) != 1:
        return _error(msg, "dpcore.flower.clipping_mod expects exactly one ArrayRecord (the model) in the reply")
    rkey, rec = next(iter(out.content.array_records.items()))
    if list(rec.keys()) != keys:
        return _error(msg, "dpcore.flower.clipping_mod: the reply's arrays are not the model's the server sent")
    new = [np.asarray(a) for a in rec.to_numpy_ndarrays()]
    if any(a.shape != b.shape for a, b in zip(new, old)):
        return _error(msg, "dpcore.flower.clipping_mod: the reply's arrays have other shapes than the model's")
    clipped = clip_update(new, old, bound[0], bound[1])
    out.content.array_records[rkey] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in zip(keys, clipped)})
    return out
