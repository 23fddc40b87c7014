"""Per-record gradients of a Keras 3 model on the TensorFlow backend, by the path that works.

DP-SGD clips each record's gradient before summing (Abadi et al. 2016, Algorithm 1, "compute
gradient" for each x_i of the lot), so the train step needs g_i = ∇_θ L(θ, x_i) for every record,
not the batch mean. :func:`per_record` computes them by one of four paths (:data:`PATHS`):

``"vectorized"``
    ``tf.vectorized_map`` (pfor) of one record's ``GradientTape`` gradient: the batch dimension is
    added to every op of the one-record graph, run by TF's own kernels. The fast default.
``"xla"``
    the same vectorized graph compiled by XLA (a nested ``tf.function(jit_compile=True)``), the
    batch padded to a size bucket so that a Poisson batch compiles once per bucket, not per size.
``"loop_xla"``
    ``tf.map_fn`` over the records (one one-record gradient per iteration), compiled by XLA.
``"loop"``
    the same loop on TF's kernels: slowest, works wherever the model runs at all.

Two known failures on TF 2.21 / Keras 3.15 CPU decide between them (:func:`choose_path`):

* pfor cannot vectorize the gradient of a ``tf.while_loop``-based RNN (Keras LSTM and GRU
  with ``unroll=False``) fed by integer inputs (an Embedding): ``TypeError: dtype <dtype:
  'variant'> is not compatible with 0 of dtype int64`` at trace time, XLA or not. A per-record
  loop has no such conversion; under XLA it is ~15x faster than without (CPU, batch 64).
* oneDNN's ``BatchMatMulV2`` kernel (TF's default on x86 CPUs, ``TF_ENABLE_ONEDNN_OPTS``) corrupts
  the heap when the left operand is rank 4 with batch dims (n > 1, 1) and the right one is
  broadcast over them, e.g. (64, 1, 12, 16) @ (16, 16): ``free(): invalid pointer``, a segfault or
  a hang, even eagerly; at other shapes ((4, 1, 6, 8) @ (8, 8)) no error at all, but wrong values
  for some records (never seen for the first). Ordinary training never builds that shape; the vectorized
  one-record graph does, because pfor prepends the batch axis to the one-record batch ``x[None]``
  of an ``EinsumDense`` (and so of every ``MultiHeadAttention``). XLA does not use that kernel.

A killed process raises nothing to catch, so the crash is predicted from the traced (never run)
vectorized graph; the RNN failure is a Python exception at trace time and is probed the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

PATHS = ("vectorized", "xla", "loop_xla", "loop")

# Batch sizes XLA compiles for: every size up to 8, then 4 steps per octave. XLA compiles once
# per input shape, and a Poisson batch's size changes every step: 40 steps of Poisson(64) batches
# met 19 sizes but 4 buckets, at the price of at most 25% padded records per step. Up to 2**24.
_LADDER = sorted({*range(1, 9), *(2**k * m // 4 for k in range(3, 25) for m in (4, 5, 6, 7))})

_BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
_ONEDNN_DTYPES = (tf.float32, tf.bfloat16, tf.float16)


def _one_record_grad(loss_of_one: Callable, params: Sequence[tf.Tensor]) -> Callable:
    params = list(params)

    def one(rec: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss, y_pred = loss_of_one(params, rec)
        grads = tape.gradient(loss, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # An Embedding's gradient is IndexedSlices: per-record results are stacked, so dense.
        return loss, y_pred, [tf.convert_to_tensor(g) for g in grads]

    return one


def _one_spec(batched: Any) -> Any:
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), batched)


def _vectorized(one: Callable, batched: Any) -> Any:
    # fallback_to_while_loop: an op pfor has no converter for runs in a loop instead of failing.
    return tf.vectorized_map(one, batched, fallback_to_while_loop=True, warn=False)


def _loop(one: Callable, batched: Any) -> Any:
    # map_fn must know the output structure before its loop exists: trace one record (not run).
    out = tf.function(one, autograph=False).get_concrete_function(_one_spec(batched)).structured_outputs
    sig = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), out)
    return tf.map_fn(one, batched, fn_output_signature=sig)


def _bucket(b: tf.Tensor) -> tf.Tensor:
    ladder = tf.constant(_LADDER, tf.int32)
    return tf.gather(ladder, tf.searchsorted(ladder, tf.reshape(b, [1]), side="left"))[0]


def _xla(inner: Callable, one: Callable, batched: Any) -> Any:
    b = tf.shape(tf.nest.flatten(batched)[0])[0]
    # Padded with copies of record 0, valid inputs for any model; their results are dropped.
    r = tf.range(_bucket(b))
    idx = tf.where(r < b, r, tf.zeros_like(r))
    padded = tf.nest.map_structure(lambda t: tf.gather(t, idx), batched)
    compiled = tf.function(lambda rec: inner(one, rec), jit_compile=True, autograph=False)
    out = compiled(padded)
    return tf.nest.map_structure(lambda t: t[:b], out)


def per_record(loss_of_one: Callable, params: Sequence[tf.Tensor], batched: Any, *, path: str) -> Tuple[tf.Tensor, Any, List[tf.Tensor]]:
    """Per-record losses, predictions and gradients (Abadi et al. 2016, Algorithm 1, per-example
    gradients g_i = ∇_θ L(θ, x_i), before clipping).

    ``loss_of_one(params, rec) -> (loss, y_pred)`` is the loss of one record ``rec`` (the batched
    nest sliced at one index, no batch axis) and its prediction; ``params`` are the values of the
    trainable variables. Returns ``losses`` (B,), ``y_pred`` (the nest with a leading B) and one
    (B, *p.shape) gradient per entry of ``params``. ``path`` is one of :data:`PATHS` (see the
    module docstring; :func:`choose_path` picks it). Meant to be traced inside a ``tf.function``
    (with a free batch axis: any B >= 1); called eagerly, the XLA paths compile on every call.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    one = _one_record_grad(loss_of_one, params)
    if path == "vectorized":
        loss, y_pred, grads = _vectorized(one, batched)
    elif path == "loop":
        loss, y_pred, grads = _loop(one, batched)
    else:
        loss, y_pred, grads = _xla(_vectorized if path == "xla" else _loop, one, batched)
    return loss, y_pred, list(grads)


# -- choosing the path ------------------------------------------------------------------------


def onednn_enabled() -> bool:
    """Whether TF runs its oneDNN CPU kernels (fixed when TF is imported, from
    ``TF_ENABLE_ONEDNN_OPTS``; on by default for x86 Linux builds since TF 2.9)."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        # Unset is assumed on: a false alarm costs XLA, a miss kills the process.
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1").strip().lower() not in ("0", "false", "off", "no")


def _risky_matmul(op: tf.Operation) -> bool:
    """A float batch matmul that broadcasts batch dims with an operand of rank >= 4, the family of
    the oneDNN kernel that corrupts the heap for (n, 1, m, k) @ (k, p). Wider than the shapes seen
    to crash (a missed one kills the process, a false alarm only costs XLA); rank-3 broadcasts,
    which pfor makes of every Dense layer's one-record matmul, ran clean at every shape tried."""
    if op.type == "Einsum":
        # TF lowers an einsum to a batch matmul; only "..." lets its operands' batch dims differ.
        eq = op.get_attr("equation").decode() if isinstance(op.get_attr("equation"), bytes) else op.get_attr("equation")
        return "..." in eq and op.inputs[0].dtype in _ONEDNN_DTYPES and any(
            t.shape.rank is None or t.shape.rank >= 4 for t in op.inputs)
    if op.type not in _BATCH_MATMULS or len(op.inputs) < 2:
        return False
    x, y = op.inputs[0], op.inputs[1]
    if x.dtype not in _ONEDNN_DTYPES:
        return False
    if x.shape.rank is None or y.shape.rank is None:
        return True
    if max(x.shape.rank, y.shape.rank) < 4:
        return False
    bx, by = x.shape.as_list()[:-2], y.shape.as_list()[:-2]
    # Two unknown dims in one place are pfor's loop axis on both sides: equal, no broadcast.
    return len(bx) != len(by) or any(a != b for a, b in zip(bx, by))


def _graphs(graph: Any) -> Any:
    # The vectorized graph holds while-loop bodies (pfor's fallback, RNNs) as nested functions.
    seen, todo = set(), [graph]
    while todo:
        g = todo.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        yield g
        for fn in getattr(g, "_functions", {}).values():
            sub = getattr(fn, "graph", None)
            if sub is not None:
                todo.append(sub)


def _record_spec(model: Any, sample_rec: Any) -> Optional[Any]:
    """The one-record spec (no batch axis) of ``{"x": ...}`` plus whatever else ``sample_rec``
    holds, or None if unknown."""
    if sample_rec is not None:
        rec = sample_rec if isinstance(sample_rec, dict) and "x" in sample_rec else {"x": sample_rec}
        return tf.nest.map_structure(lambda t: tf.TensorSpec(tf.convert_to_tensor(t).shape, tf.convert_to_tensor(t).dtype), rec)
    # A functional model keeps its inputs' nest (a dict of named inputs stays a dict).
    struct = getattr(model, "_inputs_struct", None)
    if struct is None:
        try:
            inputs = model.inputs
        except (AttributeError, ValueError):
            return None
        if not inputs:
            return None
        struct = inputs[0] if len(inputs) == 1 else list(inputs)
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(tuple(t.shape)[1:], t.dtype), struct)
    if any(d is None for s in tf.nest.flatten(specs) for d in s.shape):
        return None
    return {"x": specs}


def _probe_loss(model: Any) -> Callable:
    # The user's loss is not known here; a sum of the outputs has the same model graph to vectorize.
    def loss_of_one(params: Any, rec: Any) -> Any:
        x1 = tf.nest.map_structure(lambda t: t[None], rec["x"])
        ntv = [v.value for v in model.non_trainable_variables]
        y_pred, _ = model.stateless_call(params, ntv, x1, training=True)
        flat = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(y_pred) if t.dtype.is_floating]
        return tf.add_n(flat) if flat else tf.zeros(()), tf.nest.map_structure(lambda t: t[0], y_pred)

    return loss_of_one


def _xla_compiles(model: Any, loss_of_one: Callable, rec_spec: Any, inner: Callable) -> Optional[str]:
    """None if XLA lowers the path's graph (to HLO only: nothing runs), else the reason."""
    params = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
    batched = tf.nest.map_structure(lambda s: tf.TensorSpec((2, *s.shape), s.dtype), rec_spec)
    flat = params + tf.nest.flatten(batched)

    # experimental_get_compiler_ir takes flat TensorSpec arguments only.
    def fn(*args: Any) -> Any:
        p, rec = list(args[: len(params)]), tf.nest.pack_sequence_as(batched, list(args[len(params):]))
        return inner(_one_record_grad(loss_of_one, p), rec)

    try:
        with _quiet_tf():
            tf.function(fn, jit_compile=True, autograph=False).experimental_get_compiler_ir(*flat)(stage="hlo")
    except Exception as e:  # noqa: BLE001 - any lowering failure means "not XLA", whatever its type
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return None


@contextlib.contextmanager
def _quiet_tf() -> Any:
    # pfor logs each failed conversion at ERROR level before raising; the probe expects failures.
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _static_rnn(model: Any) -> bool:
    import keras

    rnn = getattr(keras.layers, "RNN", ())
    for layer in getattr(model, "_flatten_layers", lambda: [])():
        if isinstance(layer, rnn) and not getattr(layer, "unroll", False):
            return True
    return False


def _static_einsum(model: Any) -> bool:
    import keras

    kinds = tuple(getattr(keras.layers, n) for n in ("EinsumDense", "MultiHeadAttention", "GroupQueryAttention") if hasattr(keras.layers, n))
    return any(isinstance(layer, kinds) for layer in getattr(model, "_flatten_layers", lambda: [])())


def choose_path(model: Any, sample_rec: Any = None, *, loss_of_one: Optional[Callable] = None) -> Tuple[str, Optional[str]]:
    """The per-record gradient path (:data:`PATHS`) for ``model`` on this TF build, and why it is
    not ``"vectorized"`` (for a ``UserWarning``), else None.

    ``sample_rec``: one record (a dict nest with ``"x"``, optionally ``"y"``, ``"sw"``; no batch
    axis) or its ``x`` alone; when None the one-record spec comes from the model's inputs.
    ``loss_of_one`` (as for :func:`per_record`, given with a full ``sample_rec``) is traced
    instead of the sum of the model's outputs. The vectorized graph of the one-record gradient is
    traced, never run: a trace-time failure (the RNN ``TypeError``) means a loop; a broadcasting
    float batch matmul in it while oneDNN is on means the oneDNN crash, so XLA. Each fallback is
    lowered to HLO (nothing runs) to check that XLA takes it, else ``"loop"``. Without a spec (a
    subclassed model never called on ``keras.Input``), or if the one-record gradient itself does
    not trace, the rule is static: a recurrent layer that is not unrolled means a loop; an
    ``EinsumDense`` or attention layer with oneDNN on means XLA.
    """
    onednn = onednn_enabled()
    rec_spec = _record_spec(model, sample_rec)
    if loss_of_one is None or rec_spec is None or "y" not in rec_spec:
        loss_of_one = _probe_loss(model)
    params = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
    if rec_spec is not None:
        try:
            # Not vectorized: a failure here is the probe's (the spec, the loss), not pfor's.
            with _quiet_tf():
                tf.function(lambda p, r: _one_record_grad(loss_of_one, p)(r), autograph=False).get_concrete_function(params, rec_spec)
        except Exception:  # noqa: BLE001 - any: then the probe tells nothing
            rec_spec = None
    if rec_spec is None:
        if _static_rnn(model):
            return "loop_xla", ("the model has a recurrent layer (not unrolled), whose per-record gradient "
                                "tf.vectorized_map cannot vectorize; per-record gradients run in an XLA loop")
        if onednn and _static_einsum(model):
            return "xla", ("the model has an EinsumDense/attention layer, whose vectorized per-record gradient "
                           "breaks oneDNN's batch matmul (TF_ENABLE_ONEDNN_OPTS=0 at import avoids it); compiled with XLA instead")
        return "vectorized", None

    batched = tf.nest.map_structure(lambda s: tf.TensorSpec((None, *s.shape), s.dtype), rec_spec)

    def vec(params: Any, rec: Any) -> Any:
        return _vectorized(_one_record_grad(loss_of_one, params), rec)

    try:
        with _quiet_tf():
            graph = tf.function(vec, autograph=False).get_concrete_function(params, batched).graph
    except Exception as e:  # noqa: BLE001 - pfor's failures are TypeError, ValueError, NotImplementedError...
        why = f"tf.vectorized_map cannot vectorize this model's per-record gradient ({type(e).__name__}: {str(e).strip().splitlines()[-1][:160]})"
        bad = _xla_compiles(model, loss_of_one, rec_spec, _loop)
        if bad is None:
            return "loop_xla", why + "; per-record gradients run in an XLA-compiled loop"
        return "loop", why + f"; XLA does not compile it either ({bad}), so a per-record loop"

    if onednn and any(_risky_matmul(op) for g in _graphs(graph) for op in g.get_operations()):
        why = ("the vectorized per-record gradient has a broadcasting batch matmul (EinsumDense/attention), on which "
               "oneDNN's kernel kills the process or returns wrong values (TF_ENABLE_ONEDNN_OPTS=0 at import avoids it)")
        bad = _xla_compiles(model, loss_of_one, rec_spec, _vectorized)
        if bad is None:
            return "xla", why + "; compiled with XLA instead"
        return "loop", why + f"; XLA does not compile it ({bad}), so a per-record loop"
    return "vectorized", None
