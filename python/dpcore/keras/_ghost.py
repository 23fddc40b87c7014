"""Ghost norms for Keras's Dense, EinsumDense and Embedding layers: per-record gradient norms and
clipped sums without forming any record's gradient of their weights (Goodfellow 2015,
"Efficient per-example gradient computations"; Li et al. 2022, "Large language models can be
strong differentially private learners", §4 ghost clipping).

A Dense layer's output is z = a·W + b, so record i's gradient of W is A_iᵀΔ_i, with A_i the
layer's inputs of that record (T_i positions) and Δ_i = ∂L_i/∂z_i. Its squared norm is
Σ_{t,s} (a_t·a_s)(δ_t·δ_s) (or ‖a‖²‖δ‖² for one position), and the clipped sum over the batch
is one product Aᵀ diag(c) Δ. Δ is the gradient of a zero *tap* added to z: the per-record pass
differentiates the taps instead of the weights. An Embedding's gradient is Σ_t e_{tok_t}δ_tᵀ:
squared norm Σ_{t,s}[tok_t = tok_s] δ_t·δ_s, clipped sum one segment sum. An EinsumDense's
kernel gradient is one einsum of its input and Δ_i per record (formed: its kernels are small).

While the DP step is traced, :class:`Tapping` replaces the ``call`` of these classes (only for
the layers it taps; any other layer runs its own ``call``) by one that adds the tap and keeps the
input. The computed norms are rounded; each is raised by a bound of its rounding error
(:func:`_dense_bound`), so that clipping to the raised norm bounds the exact product's norm.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Dict, List, Optional, Tuple

import keras
from keras import ops

from ._step import _sq_norms, blocked_sum

__all__ = ["GhostPlan"]

_U32 = 2.0**-24
_LOCK = threading.Lock()
_ACTIVE: Optional["Tapping"] = None

Dense = keras.layers.Dense
EinsumDense = keras.layers.EinsumDense
Embedding = keras.layers.Embedding
BaseConv = keras.layers.Conv2D.__mro__[1]
_ORIG = {Dense: Dense.call, EinsumDense: EinsumDense.call, Embedding: Embedding.call, BaseConv: BaseConv.call}


def _kind(layer: Any) -> Optional[str]:
    # Only the library's own call, unchanged (no LoRA, not quantized): the tapped call repeats it.
    if isinstance(layer, keras.layers.Conv2D) and type(layer).call is _ORIG[BaseConv]:
        plain = (layer.data_format == "channels_last" and layer.groups == 1 and tuple(layer.dilation_rate) == (1, 1)
                 and layer.padding in ("valid", "same") and not getattr(layer, "lora_enabled", False))
        return "conv" if plain else None
    for cls, kind in ((Dense, "dense"), (EinsumDense, "einsum"), (Embedding, "embedding")):
        if type(layer).call is _ORIG[cls] and isinstance(layer, cls):
            if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None) is not None:
                return None
            return kind
    return None


class _Tapped:
    """One tapped layer: its kind, and the indices of its variables among the trainables."""

    def __init__(self, layer: Any, kind: str, index: Dict[int, int]) -> None:
        self.layer, self.kind = layer, kind
        if kind == "embedding":
            self.w, self.b = index[id(layer._embeddings)], None
        else:
            self.w = index[id(layer._kernel)]
            self.b = None if layer.bias is None else index.get(id(layer.bias))
        if kind == "conv":
            self.b = None if layer.bias is None else index.get(id(layer.bias))
        if kind == "einsum":
            self.b = None  # its bias (shaped by bias_axes) takes the per-record path
            eq = layer.equation
            ins, out = eq.split("->")
            self.i_sub, self.k_sub = ins.split(",")
            self.o_sub = out
            free = next(c for c in "ZYXWVUTSRQ" if c not in eq)
            # one record's kernel gradient, batched over the records: "Z{I},Z{O}->Z{K}"
            self.grad_eq = f"{free}{self.i_sub},{free}{self.o_sub}->{free}{self.k_sub}"


class GhostPlan:
    """The layers of ``model`` whose trainable weights get ghost norms, and which trainable
    variables (by index in ``model.trainable_variables``) those are."""

    def __init__(self, model: Any) -> None:
        index = {id(v): k for k, v in enumerate(model.trainable_variables)}
        self.tapped: List[_Tapped] = []
        for layer in model._flatten_layers(include_self=False):
            kind = _kind(layer)
            if kind is None or not layer.trainable:
                continue
            w = layer._embeddings if kind == "embedding" else layer._kernel
            if id(w) not in index:
                continue
            self.tapped.append(_Tapped(layer, kind, index))
        self.by_layer = {id(t.layer): n for n, t in enumerate(self.tapped)}
        self.vars = {t.w for t in self.tapped} | {t.b for t in self.tapped if t.b is not None}

    def tapping(self, taps: Optional[List[List[Any]]] = None) -> "Tapping":
        return Tapping(self, taps)


class Tapping:
    """While active (a ``with`` block, one traced forward at a time): the tapped layers' calls
    add ``taps[n][j]`` to the output of call j of tapped layer n (``taps=None``: nothing added,
    the calls' output shapes recorded) and keep their inputs."""

    def __init__(self, plan: GhostPlan, taps: Optional[List[List[Any]]]) -> None:
        self.plan, self.taps = plan, taps
        self.inputs: List[List[Any]] = [[] for _ in plan.tapped]
        self.shapes: List[List[Tuple[Tuple[int, ...], Any]]] = [[] for _ in plan.tapped]

    def __enter__(self) -> "Tapping":
        global _ACTIVE
        _LOCK.acquire()
        _ACTIVE = self
        Dense.call, EinsumDense.call, Embedding.call, BaseConv.call = _dense_call, _einsum_call, _embedding_call, _conv_call
        return self

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        Dense.call, EinsumDense.call, Embedding.call = _ORIG[Dense], _ORIG[EinsumDense], _ORIG[Embedding]
        BaseConv.call = _ORIG[BaseConv]
        _ACTIVE = None
        _LOCK.release()

    def tap(self, layer: Any, inputs: Any, z: Any) -> Any:
        n = self.plan.by_layer[id(layer)]
        j = len(self.inputs[n])
        self.inputs[n].append(inputs)
        if self.taps is None:
            self.shapes[n].append((tuple(ops.shape(z)), z.dtype))
            return z
        return z + ops.cast(self.taps[n][j], z.dtype)


def _active_for(layer: Any) -> Optional[Tapping]:
    t = _ACTIVE
    return t if t is not None and id(layer) in t.plan.by_layer else None


def _dense_call(self: Any, inputs: Any, training: Any = None) -> Any:
    t = _active_for(self)
    if t is None:
        return _ORIG[Dense](self, inputs, training=training)
    x = ops.matmul(inputs, self.kernel)
    if self.bias is not None:
        x = ops.add(x, self.bias)
    x = t.tap(self, inputs, x)
    return self.activation(x) if self.activation is not None else x


def _einsum_call(self: Any, inputs: Any, training: Any = None) -> Any:
    t = _active_for(self)
    if t is None:
        return _ORIG[EinsumDense](self, inputs, training=training)
    x = ops.einsum(self.equation, inputs, self.kernel)
    if self.bias is not None:
        x = ops.add(x, self.bias)
    x = t.tap(self, inputs, x)
    return self.activation(x) if self.activation is not None else x


def _conv_call(self: Any, inputs: Any) -> Any:
    t = _active_for(self)
    if t is None:
        return _ORIG[BaseConv](self, inputs)
    x = self.convolution_op(inputs, self.kernel)
    if self.use_bias:
        x = ops.add(x, ops.reshape(self.bias, (1,) * (self.rank + 1) + (self.filters,)))
    x = t.tap(self, inputs, x)
    return self.activation(x) if self.activation is not None else x


def _embedding_call(self: Any, inputs: Any) -> Any:
    t = _active_for(self)
    if t is None:
        return _ORIG[Embedding](self, inputs)
    if inputs.dtype != "int32" and inputs.dtype != "int64":
        inputs = ops.cast(inputs, "int32")
    out = ops.cast(ops.take(self.embeddings, inputs, axis=0), dtype=self.compute_dtype)
    return t.tap(self, inputs, out)


# -- norms and sums, after the per-record pass ----------------------------------------------


def _rows(xs: List[Any], last: bool = True) -> Any:
    """A tapped layer's per-record values of all its calls, (B, T, d) (or (B, T) for token ids,
    ``last=False``): each call's positions flattened, the calls concatenated."""
    out = []
    for a in xs:
        s = ops.shape(a)
        b = s[0]
        out.append(ops.reshape(a, (b, -1, s[-1]) if last else (b, -1)))
    return out[0] if len(out) == 1 else ops.concatenate(out, axis=1)


def _norms_rows(ops_: Any, a: Any) -> Any:
    """‖a_t‖ per record and position, (B, T), float32, summed in blocks (:func:`sum_error`)."""
    return ops_.sqrt(blocked_sum(ops_, ops_.square(a)))


def _gram(a: Any) -> Any:
    """a_t·a_s per record, (B, T, T): one batched product (each dot product's rounding is
    bounded by its full length d, see :func:`_dense_bound`)."""
    return ops.einsum("btd,bsd->bts", a, a)


def _formed(t: int, din: int, dout: int) -> bool:
    """Whether a Dense's per-record kernel gradients are formed (B·d_in·d_out numbers) rather
    than normed from Gram matrices (B·T² numbers): the smaller of the two."""
    return t > 1 and t * (din + dout) > din * dout


def _dense_bound(din: int, dout: int, t: int) -> float:
    """γ of a Dense ghost norm from Gram matrices (or ‖a‖²‖δ‖² for one position): the computed
    squared norm of AᵀΔ is within γ·(Σ_t ‖a_t‖‖δ_t‖)² of the exact one (Higham 2002 §3.1, §4.2:
    a sum of n terms in any order is within (n-1)·u·Σ|terms|; the dot products of d_in and d_out
    terms, the T×T products summed by rows, then the rows). For one position the norms are summed
    in blocks, which this bound covers too. Doubled, with room for the products' roundings."""
    return 2.0 * (din + dout + 2 * t + 34) * _U32


def ghost_sq_norms(plan: GhostPlan, inputs: List[List[Any]], deltas: List[List[Any]],
                   formed: Optional[Dict[Any, Any]] = None) -> Dict[int, Any]:
    """Per tapped variable, each record's squared gradient norm raised by its rounding bound,
    (B,) float32; ``inputs``/``deltas`` per tapped layer and call, with a leading record axis.
    ``formed``: a dict that keeps the per-record gradients formed here, for :func:`ghost_sums`
    (torch runs eagerly: they would be formed twice; XLA would merge the two)."""
    keep = {} if formed is None else formed
    sq: Dict[int, Any] = {}
    for tp, xs, ds in zip(plan.tapped, inputs, deltas):
        if not xs:  # a tapped layer the forward did not call: its gradient is 0
            continue
        if tp.kind == "conv":
            g, gb = keep[(tp.w, "w")], keep[(tp.w, "b")] = _conv_grads(tp, xs, ds)
            sq[tp.w] = _sq_norms(ops, g)
            if tp.b is not None:
                sq[tp.b] = _sq_norms(ops, gb)
            continue
        d = ops.cast(_rows(ds), "float32")
        if tp.kind == "einsum":
            g = keep[(tp.w, "w")] = _einsum_grads(tp, xs, ds)
            sq[tp.w] = _sq_norms(ops, g)
            continue
        nd = _norms_rows(ops, d)
        t = ops.shape(d)[1]
        if tp.kind == "embedding":
            tok = _rows(xs, last=False)
            same = ops.cast(ops.equal(ops.expand_dims(tok, 2), ops.expand_dims(tok, 1)), "float32")
            gd = _gram(d)
            s = ops.sum(ops.sum(same * gd, axis=2), axis=1)
            # the pairs summed are those of equal tokens: the bound is over them alone
            pairs = ops.sum(ops.sum(same * ops.expand_dims(nd, 2) * ops.expand_dims(nd, 1), axis=2), axis=1)
            bound = 2.0 * (ops.shape(d)[2] + 2 * t + 34) * _U32 * pairs
            sq[tp.w] = ops.maximum(s, 0.0) + bound
            continue
        a = ops.cast(_rows(xs), "float32")
        din, dout = ops.shape(a)[2], ops.shape(d)[2]
        if _formed(t, din, dout):
            # formed: the record's contribution is this very array (ghost_sums sums it), no bound
            g = keep[(tp.w, "w")] = ops.einsum("bti,bto->bio", a, d)
            sq[tp.w] = _sq_norms(ops, g)
        else:
            na = _norms_rows(ops, a)
            if t == 1:
                s = ops.square(na[:, 0] * nd[:, 0])
            else:
                s = ops.sum(ops.sum(_gram(a) * _gram(d), axis=2), axis=1)
            bound = _dense_bound(din, dout, t) * ops.square(ops.sum(na * nd, axis=1))
            sq[tp.w] = ops.maximum(s, 0.0) + bound
        if tp.b is not None:
            # formed too: the record's bias gradient Σ_t δ_t, summed by ghost_sums as it is
            gb = keep[(tp.w, "b")] = ops.sum(d, axis=1)
            sq[tp.b] = _sq_norms(ops, gb)
    return sq


def _einsum_grads(tp: _Tapped, xs: List[Any], ds: List[Any]) -> Any:
    """Each record's kernel gradient, (B, *kernel): the record's input and Δ keep the layer's
    batch axis (of one record), so the layer's own subscripts apply after the record axis."""
    g = None
    for x, d in zip(xs, ds):
        gi = ops.einsum(tp.grad_eq, ops.cast(x, "float32"), ops.cast(d, "float32"))
        g = gi if g is None else g + gi
    return g


def _conv_grads(tp: _Tapped, xs: List[Any], ds: List[Any]) -> Tuple[Any, Any]:
    """Each record's Conv2D kernel and bias gradients, (B, kh, kw, c_in, c_out) and (B, c_out):
    for each kernel tap (i, j), the strided view of the padded input that tap multiplies, times Δ
    summed over the output positions (one batched matrix product per tap, no im2col)."""
    layer = tp.layer
    kh, kw = layer.kernel_size
    sh, sw = layer.strides
    g = gb = None
    for x, d in zip(xs, ds):
        x = ops.cast(ops.squeeze(x, 1), "float32")  # (B, H, W, c_in): the record's batch-of-one axis dropped
        d = ops.cast(ops.squeeze(d, 1), "float32")  # (B, H', W', c_out)
        h, w = ops.shape(x)[1], ops.shape(x)[2]
        ho, wo = ops.shape(d)[1], ops.shape(d)[2]
        if layer.padding == "same":
            ph = max((ho - 1) * sh + kh - h, 0)
            pw = max((wo - 1) * sw + kw - w, 0)
            x = ops.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
        rows = []
        for i in range(kh):
            cols = []
            for j in range(kw):
                view = x[:, i : i + sh * (ho - 1) + 1 : sh, j : j + sw * (wo - 1) + 1 : sw, :]
                cols.append(ops.einsum("bhwc,bhwo->bco", view, d))
            rows.append(ops.stack(cols, axis=1))
        gi = ops.stack(rows, axis=1)
        g = gi if g is None else g + gi
        bi = ops.sum(d, axis=(1, 2))
        gb = bi if gb is None else gb + bi
    return g, gb


def ghost_sums(plan: GhostPlan, inputs: List[List[Any]], deltas: List[List[Any]], factors: Dict[int, Any],
               bad: Any, shapes: List[Tuple[int, ...]], formed: Optional[Dict[Any, Any]] = None) -> Dict[int, Any]:
    """Per tapped variable, Σ_i c_i·g_i formed from the inputs and Δ (``factors[k]``: (B,) c_i
    of variable k, 0 for padding and for a non-finite record, whose values are zeroed too);
    ``formed``: the per-record gradients :func:`ghost_sq_norms` formed, summed as they are."""
    formed = {} if formed is None else formed
    out: Dict[int, Any] = {}
    for tp, xs, ds in zip(plan.tapped, inputs, deltas):
        if not xs:
            out[tp.w] = ops.zeros(shapes[tp.w], "float32")
            if tp.b is not None:
                out[tp.b] = ops.zeros(shapes[tp.b], "float32")
            continue
        zero = lambda v: ops.where(ops.reshape(bad, (-1,) + (1,) * (ops.ndim(v) - 1)), ops.zeros_like(v), v)  # noqa: E731
        if tp.kind == "conv":
            g, gb = (formed[(tp.w, "w")], formed[(tp.w, "b")]) if (tp.w, "w") in formed else _conv_grads(tp, xs, ds)
            out[tp.w] = ops.tensordot(factors[tp.w], zero(g), axes=1)
            if tp.b is not None:
                out[tp.b] = ops.tensordot(factors[tp.b], zero(gb), axes=1)
            continue
        if tp.kind == "einsum":
            g = zero(formed[(tp.w, "w")] if (tp.w, "w") in formed else _einsum_grads(tp, xs, ds))
            out[tp.w] = ops.tensordot(factors[tp.w], g, axes=1)
            continue
        d = zero(ops.cast(_rows(ds), "float32"))
        if tp.kind == "embedding":
            tok = ops.reshape(_rows(xs, last=False), (-1,))
            dc = d * ops.reshape(factors[tp.w], (-1, 1, 1))
            dim = ops.shape(d)[2]
            out[tp.w] = ops.segment_sum(ops.reshape(dc, (-1, dim)), ops.cast(tok, "int32"), num_segments=shapes[tp.w][0])
            continue
        a = zero(ops.cast(_rows(xs), "float32"))
        t, din, dout = ops.shape(a)[1], ops.shape(a)[2], ops.shape(d)[2]
        if _formed(t, din, dout):
            g = formed[(tp.w, "w")] if (tp.w, "w") in formed else ops.einsum("bti,bto->bio", a, d)
            out[tp.w] = ops.tensordot(factors[tp.w], zero(g), axes=1)
        else:
            out[tp.w] = ops.einsum("bti,bto->io", a, d * ops.reshape(factors[tp.w], (-1, 1, 1)))
        if tp.b is not None:
            gb = formed[(tp.w, "b")] if (tp.w, "b") in formed else ops.sum(d, axis=1)
            out[tp.b] = ops.tensordot(factors[tp.b], zero(gb), axes=1)
    return out
