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

import io
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["ModelLayout", "client_arrays", "array_view", "record_arrays"]

#: Parsed ``.npy`` headers by their bytes: a model's arrays repeat the same few headers every round.
_HEADERS: Dict[bytes, Optional[Tuple[np.dtype, Tuple[int, ...], int]]] = {}


def _header(data: Any) -> Optional[Tuple[np.dtype, Tuple[int, ...], int]]:
    """(dtype, shape, data offset) of ``.npy`` bytes, or None when they are not a plain array."""
    if bytes(data[:6]) != b"\x93NUMPY" or len(data) < 12:
        return None
    major = data[6]
    size = int.from_bytes(bytes(data[8:10]), "little") + 10 if major == 1 else int.from_bytes(bytes(data[8:12]), "little") + 12
    key = bytes(data[:size])
    if key in _HEADERS:
        return _HEADERS[key]
    out = None
    try:
        head = io.BytesIO(key)
        version = np.lib.format.read_magic(head)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(head)
        if not fortran and not dtype.hasobject:
            out = (dtype, tuple(shape), size)
    except Exception:  # noqa: BLE001 - not a header numpy reads: Flower's own decoding decides
        out = None
    if len(_HEADERS) < 4096:
        _HEADERS[key] = out
    return out


def array_view(a: Any) -> np.ndarray:
    """A read-only view of a Flower ``Array``'s bytes, without the copy of ``Array.numpy()``
    (``np.load`` of the ``.npy`` bytes): the header is parsed (once per distinct header) and the
    data viewed in place. An array that is not a plain numpy serialisation (another ``stype``,
    Fortran order, object dtype, a length that does not match its header) goes through
    ``Array.numpy()``."""
    data = getattr(a, "data", None)
    if getattr(a, "stype", None) == "numpy.ndarray" and isinstance(data, (bytes, bytearray, memoryview)):
        h = _header(data)
        if h is not None:
            dtype, shape, offset = h
            count = int(np.prod(shape, dtype=np.int64))
            if len(data) - offset == count * dtype.itemsize:
                return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
    return np.asarray(a.numpy())


def record_arrays(rec: Any) -> Dict[str, np.ndarray]:
    """An ``ArrayRecord``'s arrays by key, in its order, as views (:func:`array_view`)."""
    return {k: array_view(rec[k]) for k in rec.keys()}


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
    def of(cls, arrays: Dict[str, np.ndarray]) -> "ModelLayout":
        return cls(list(arrays), list(arrays.values()))

    @property
    def record_dtype(self) -> np.dtype:
        """The dtype the updates are stacked in: float32 when every released array is float32
        (the query sums in float64 whatever the records' dtype), else float64."""
        dts = {np.dtype(d) for k, d in zip(self.keys, self.dtypes) if k in self.released}
        return np.dtype(np.float32) if dts == {np.dtype(np.float32)} else np.dtype(np.float64)

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
            a = array_view(rec[k])
            if a.shape != shape or a.dtype.kind not in "fiu":
                return None
            out[k] = a
        return out
    except Exception:  # noqa: BLE001 - a client's bytes must never crash a release
        return None
