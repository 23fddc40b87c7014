"""Model updates from Flower messages as dpcore records (one record per sampled client).

A client's record is its update Δ_u = w_u − w, the difference between the arrays it sends back
and the global arrays the server sent it, over the model's floating-point arrays. A reply that is
not a well-formed update (an error reply, no reply, several ArrayRecords, other keys, other
shapes, a non-numeric array) is a *missing* participant: it contributes nothing, exactly as a
client that is not in the population (:meth:`dpcore.PrivateAggregator.aggregate`'s
``missing``), and whether the round is released, its denominator and its noise never depend on
what one client sent (issue 41; the grey-box rule of the developers' guide). A non-finite update
is handed to the query as it is, and the query gives it zero contribution
(``on_nonfinite="zero"``; adaptive clipping counts it as clipped).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["ModelLayout", "client_arrays"]


class ModelLayout:
    """The keys, shapes and dtypes of the global model's arrays, and which of them are released
    (the floating-point ones: integer buffers such as a BatchNorm's step counter are kept at the
    server's value, never taken from a client)."""

    def __init__(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        self.keys: Tuple[str, ...] = tuple(keys)
        self.shapes = tuple(tuple(a.shape) for a in arrays)
        self.dtypes = tuple(a.dtype for a in arrays)
        self.released = tuple(k for k, a in zip(self.keys, arrays) if a.dtype.kind == "f")
        if not self.released:
            raise ValueError("the global model has no floating-point array: there is nothing to train privately")

    @classmethod
    def of(cls, array_record: Any) -> "ModelLayout":
        keys = list(array_record.keys())
        return cls(keys, [np.asarray(a) for a in array_record.to_numpy_ndarrays()])

    def signature(self) -> List[List[Any]]:
        """Plain values that identify the layout (checked when a server's state is resumed)."""
        return [[k, list(s), str(d)] for k, s, d in zip(self.keys, self.shapes, self.dtypes)]


def client_arrays(reply: Any, layout: ModelLayout) -> Optional[Dict[str, np.ndarray]]:
    """The released arrays of a reply, keyed as the layout, or None when the reply is not a
    well-formed model (the caller gives it zero contribution)."""
    try:
        if reply is None or reply.has_error():
            return None
        records = list(reply.content.array_records.values())
        if len(records) != 1:
            return None
        rec = records[0]
        if list(rec.keys()) != list(layout.keys):
            return None
        out: Dict[str, np.ndarray] = {}
        for k, shape in zip(layout.keys, layout.shapes):
            if k not in layout.released:
                continue
            a = np.asarray(rec[k].numpy())
            if a.shape != shape or a.dtype.kind not in "fiu":
                return None
            out[k] = a
        return out
    except Exception:  # noqa: BLE001 - a client's bytes must never crash a release
        return None
