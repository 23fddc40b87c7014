"""dpcore.keras cases, run once per Keras backend by test_keras_backends.py, each in a fresh process
with KERAS_BACKEND set (Keras reads it once, when it is imported).

Every update is compared with a brute-force reference: record i's gradient of its own loss (a
batch of one record, through ``model.stateless_call``) by the backend's own autodiff
(``jax.grad``, ``tf.GradientTape``, ``torch.autograd.grad``), clipped in float64
(flat: g·min(1, C/‖g‖) over all trainable variables; per_layer: each of the m variables to
C/√m), summed and divided by q·n. With SGD(1.0) and noise 0 the weights move by exactly minus
that average.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

# XLA's cheapest CPU pipeline: the compiled steps are small, and compiling them is most of this
# file's time (any correct compilation must give the same updates).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

import numpy as np
import pytest

import keras

BACKEND = keras.backend.backend()
_FRAMEWORK = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}.get(BACKEND)
if _FRAMEWORK is None or importlib.util.find_spec(_FRAMEWORK) is None:  # pragma: no cover
    pytest.skip(f"Keras backend {BACKEND!r} is not one dpcore.keras trains on here", allow_module_level=True)

import dpcore  # noqa: E402
import dpcore.keras as dpk  # noqa: E402
from dpcore._seeds import derive_seed  # noqa: E402

L = keras.layers
CLIPPINGS = ("flat", "per_layer")
RTOL, ATOL = 1e-4, 1e-6


def SCE():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ------------------------------------------------------------------ brute-force per-record gradients


def _np(t):
    if hasattr(t, "detach"):  # torch
        t = t.detach().cpu()
    return np.asarray(t, dtype=np.float64)


def values(variables):
    """The variables' current values, as (float32 or int) numpy copies."""
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in variables]


def record_gradient_fn(model):
    """``g(trainable_values, x1, y1) -> [float64 arrays]``: the gradient of the loss of the batch
    of one record (x1, y1) with respect to the trainable variables, by the backend's autodiff on
    the model's stateless call (the non-trainable values are the model's current ones)."""
    loss = SCE()
    ntv = values(model.non_trainable_variables)

    def f(tv, ntv_, x1, y1):
        y_pred, _ = model.stateless_call(tv, ntv_, x1, training=True)
        return loss(y1, y_pred)

    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        grad = jax.jit(jax.grad(f))
        ntv_j = [jnp.asarray(a) for a in ntv]

        def g(tv, x1, y1):
            return [_np(t) for t in grad([jnp.asarray(a) for a in tv], ntv_j, jnp.asarray(x1), jnp.asarray(y1))]

        return g
    if BACKEND == "tensorflow":
        import tensorflow as tf

        ntv_t = [tf.constant(a) for a in ntv]

        def g(tv, x1, y1):
            tv = [tf.constant(a) for a in tv]
            with tf.GradientTape() as tape:
                tape.watch(tv)
                out = f(tv, ntv_t, tf.constant(x1), tf.constant(y1))
            gs = tape.gradient(out, tv, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [_np(tf.convert_to_tensor(t)) for t in gs]  # an Embedding's gradient is IndexedSlices

        return g
    import torch

    ntv_p = [torch.tensor(a) for a in ntv]

    def g(tv, x1, y1):
        tv = [torch.tensor(a, requires_grad=True) for a in tv]
        out = f(tv, ntv_p, torch.tensor(x1), torch.tensor(y1))
        gs = torch.autograd.grad(out, tv, allow_unused=True)
        return [np.zeros(p.shape) if t is None else _np(t) for t, p in zip(gs, tv)]

    return g


def record_gradients(model, x, y):
    """Each record's gradient (a list over records of lists over trainable variables)."""
    g = record_gradient_fn(model)
    tv = values(model.trainable_variables)
    return [g(tv, x[i : i + 1], y[i : i + 1]) for i in range(len(y))]


def clip_one(g, C, clipping):
    """(clipped g, whether it was clipped) in float64."""
    if clipping == "flat":
        norm = np.sqrt(sum(float((t**2).sum()) for t in g))
        f = 1.0 if norm <= C else C / norm
        return [t * f for t in g], norm > C
    cv = C / np.sqrt(len(g))
    out, clipped = [], False
    for t in g:
        norm = float(np.sqrt((t**2).sum()))
        out.append(t if norm <= cv else t * (cv / norm))
        clipped |= norm > cv
    return out, clipped


def reference_update(grads, idx, C, clipping, den):
    """-(1/den)·Σ_{i in idx} clip(g_i, C) per variable, and how many records were clipped."""
    total = [np.zeros_like(t) for t in grads[0]]
    clipped = 0
    for i in idx:
        c, was = clip_one(grads[i], C, clipping)
        total = [a + b for a, b in zip(total, c)]
        clipped += int(was)
    return [-t / den for t in total], clipped


def clip_for(grads, clipping, frac=0.5):
    """A clip norm below most records' norms: frac of the median (flat: whole norm; per_layer:
    the record's largest variable norm, scaled by √m)."""
    if clipping == "flat":
        norms = [np.sqrt(sum(float((t**2).sum()) for t in g)) for g in grads]
        return float(frac * np.median(norms))
    m = len(grads[0])
    norms = [max(float(np.sqrt((t**2).sum())) for t in g) for g in grads]
    return float(frac * np.median(norms) * np.sqrt(m))


# ------------------------------------------------------------------ models and data


def build(kind, seed=0):
    keras.utils.set_random_seed(seed)
    if kind == "mlp":
        i = keras.Input((6,))
        o = L.Dense(3)(L.Dense(5, activation="tanh")(i))
    elif kind == "cnn":  # strided Conv2D, DepthwiseConv2D, SeparableConv2D, then Conv1D over the 16 positions
        i = keras.Input((8, 8, 2))
        h = L.Conv2D(3, 3, strides=2, padding="same", activation="tanh")(i)
        h = L.DepthwiseConv2D(2, padding="same", activation="tanh")(h)
        h = L.SeparableConv2D(4, 2, padding="same", activation="tanh")(h)
        h = L.Reshape((16, 4))(h)
        h = L.Conv1D(3, 3, strides=2, activation="tanh")(h)
        o = L.Dense(3)(L.GlobalAveragePooling1D()(h))
    elif kind in ("lstm", "gru"):
        i = keras.Input((6,), dtype="int32")
        h = L.Embedding(12, 4)(i)
        o = L.Dense(3)((L.LSTM if kind == "lstm" else L.GRU)(5)(h))
    elif kind == "mha":  # a small transformer block over 5 positions
        i = keras.Input((5, 4))
        a = L.MultiHeadAttention(num_heads=2, key_dim=3)(i, i)
        h = L.LayerNormalization()(L.Add()([a, i]))
        h = L.Dense(4, activation="tanh")(h)
        o = L.Dense(3)(L.GlobalAveragePooling1D()(h))
    elif kind == "shared":  # one Dense called twice
        i = keras.Input((6,))
        d = L.Dense(6, activation="tanh")
        o = L.Dense(3)(d(d(i)))
    elif kind == "frozen_bn":
        i = keras.Input((6,))
        bn = L.BatchNormalization(name="frozen_bn")
        bn.trainable = False
        o = L.Dense(3)(bn(L.Dense(5)(i)))
        model = keras.Model(i, o)
        rng = np.random.default_rng(seed + 1)  # moving statistics away from (0, 1): they matter
        bn.moving_mean.assign(rng.normal(size=5).astype("float32"))
        bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=5).astype("float32"))
        bn.gamma.assign(rng.uniform(0.5, 1.5, size=5).astype("float32"))
        bn.beta.assign(rng.normal(size=5).astype("float32"))
        return model
    elif kind == "bow":  # 8 tokens of a vocabulary of 5: every record repeats a token
        i = keras.Input((8,), dtype="int32")
        h = L.Embedding(5, 4)(i)
        o = L.Dense(3)(L.GlobalAveragePooling1D()(h))
    elif kind == "seq_gram":  # Dense on (B, T=3, 8) -> 8: T·(din+dout)=48 <= din·dout=64 (Gram matrices)
        i = keras.Input((3, 8))
        o = L.Dense(3)(L.Flatten()(L.Dense(8, activation="tanh")(i)))
    elif kind == "seq_formed":  # Dense on (B, T=12, 3) -> 2: T·(din+dout)=60 > din·dout=6 (product formed)
        i = keras.Input((12, 3))
        o = L.Dense(3)(L.Flatten()(L.Dense(2, activation="tanh")(i)))
    elif kind == "seq_long":  # Dense on (B, T=1024, 4) -> 4: the product formed, a long sequence
        i = keras.Input((1024, 4))
        o = L.Dense(3)(L.GlobalAveragePooling1D()(L.Dense(4, activation="tanh")(i)))
    else:  # pragma: no cover
        raise ValueError(kind)
    return keras.Model(i, o)


def make_data(kind, n, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n).astype("int32")
    if kind == "cnn":
        x = rng.normal(size=(n, 8, 8, 2)) * 2
    elif kind in ("lstm", "gru"):
        return rng.integers(0, 12, (n, 6)).astype("int32"), y
    elif kind == "bow":
        x = rng.integers(0, 5, (n, 8)).astype("int32")
        x[:, 1] = x[:, 0]  # a repeated token in every record, whatever the draw
        return x, y
    elif kind == "mha":
        x = rng.normal(size=(n, 5, 4)) * 2
    elif kind == "seq_gram":
        x = rng.normal(size=(n, 3, 8)) * 2
    elif kind == "seq_formed":
        x = rng.normal(size=(n, 12, 3)) * 2
    elif kind == "seq_long":
        x = rng.normal(size=(n, 1024, 4)) * 2
    else:
        x = rng.normal(size=(n, 6)) * 3
    return x.astype("float32"), y


_CACHE = {}


def case(kind, n=12):
    """A fresh model of ``kind`` (always the same initial weights), its data and the records'
    gradients at those weights (computed once per kind)."""
    model = build(kind)
    key = (kind, n)
    if key not in _CACHE:
        x, y = make_data(kind, n)
        _CACHE[key] = (model.get_weights(), x, y, record_gradients(model, x, y))
    weights, x, y, grads = _CACHE[key]
    model.set_weights(weights)
    return model, x, y, grads


def new_ledger():
    return dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(prefix="dpk-cases-"), "ledger.jsonl"))


def private(model, C, clipping="flat", *, n, q=1.0, z=0.0, ledger=None, optimizer=None, seed=0, **kw):
    led = ledger if ledger is not None else new_ledger()
    dp = dpk.make_private(model, optimizer or keras.optimizers.SGD(1.0), noise_multiplier=z, max_grad_norm=C,
                          population_size=n, sampling_probability=q, ledger=led, clipping=clipping, seed=seed, **kw)
    dp.compile(loss=SCE(), metrics=["accuracy"])
    return dp, led


def assert_update(w0, w1, ref, rtol=RTOL, atol=ATOL):
    for k, (a, b, r) in enumerate(zip(w0, w1, ref)):
        np.testing.assert_allclose(b.astype(np.float64) - a, r, rtol=rtol, atol=atol, err_msg=f"variable {k}")


# ------------------------------------------------------------------ 1. exactness at noise 0

KINDS = ("mlp", "cnn", "lstm", "gru", "mha", "shared", "frozen_bn", "bow", "seq_gram", "seq_formed", "seq_long")


@pytest.mark.parametrize("clipping", CLIPPINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_update_equals_brute_force(kind, clipping):
    # Every model on every backend, to rtol 1e-4. On JAX the Dense/EinsumDense/Embedding/Conv2D
    # weights take the ghost-norm path (_ghost.py), whose norms are raised by a worst-case
    # rounding bound; seq_long (T=1024 positions through one Dense) is where that bound, which
    # grows with T, shows as over-clipping.
    model, x, y, grads = case(kind)
    n = len(y)
    C = clip_for(grads, clipping)
    ref, clipped = reference_update(grads, range(n), C, clipping, float(n))
    assert clipped >= n / 2, (clipped, n)  # clipping is active
    w0 = values(model.trainable_variables)
    dp, led = private(model, C, clipping, n=n)
    dp.fit(dpk.PoissonBatches(x, y, sampling_probability=1.0, steps=1, seed=1), epochs=1, verbose=0)
    assert led.num_releases == 1 == dp.releases
    assert_update(w0, values(model.trainable_variables), ref)


def test_frozen_batch_norm_statistics_stay_put():
    model, x, y, grads = case("frozen_bn")
    bn = model.get_layer("frozen_bn")
    stats = values(bn.non_trainable_variables)
    dp, _ = private(model, clip_for(grads, "flat"), n=len(y))
    dp.fit(dpk.PoissonBatches(x, y, sampling_probability=1.0, steps=1, seed=1), epochs=1, verbose=0)
    for a, b in zip(stats, values(bn.non_trainable_variables)):
        np.testing.assert_array_equal(a, b)


def test_trainable_batch_norm_is_refused():
    keras.utils.set_random_seed(0)
    i = keras.Input((6,))
    model = keras.Model(i, L.Dense(3)(L.BatchNormalization()(L.Dense(5)(i))))
    with pytest.raises(TypeError, match="batch statistics"):
        dpk.make_private(model, keras.optimizers.SGD(1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                         population_size=12, sampling_probability=1.0, ledger=new_ledger())


def test_batch_norm_unfrozen_after_wrapping_is_refused_at_fit():
    model, x, y, _ = case("frozen_bn")
    dp, led = private(model, 1.0, n=len(y))
    model.get_layer("frozen_bn").trainable = True
    dp.compile(loss=SCE())
    with pytest.raises(TypeError, match="batch statistics"):
        dp.fit(dpk.PoissonBatches(x, y, sampling_probability=1.0, steps=1, seed=1), epochs=1, verbose=0)
    assert led.num_releases == 0


# ------------------------------------------------------------------ 2. micro-batches


@pytest.mark.parametrize("clipping", CLIPPINGS)
@pytest.mark.parametrize("kind", ["mlp", "bow"])
def test_micro_batches_give_the_same_update(kind, clipping):
    n, q = 16, 0.75
    src = dpk.PoissonBatches(*make_data(kind, n), sampling_probability=q, steps=1, seed=3)
    idx = src.indices(0)
    assert len(idx) > 6  # several micro-batches of 3
    ups = {}
    for micro in (None, 3):
        model, x, y, grads = case(kind, n)
        C = clip_for(grads, clipping)
        w0 = values(model.trainable_variables)
        dp, _ = private(model, C, clipping, n=n, q=q, max_physical_batch_size=micro)
        begin, sizes = dp._dp_begin, []
        object.__setattr__(dp, "_dp_begin", lambda data: (lambda b: (sizes.extend(b.sizes), b)[1])(begin(data)))
        dp.fit(dpk.PoissonBatches(x, y, sampling_probability=q, steps=1, seed=3), epochs=1, verbose=0)
        assert sum(sizes) == len(idx) and max(sizes) == (micro or len(idx))  # really cut
        ups[micro] = [b.astype(np.float64) - a for a, b in zip(w0, values(model.trainable_variables))]
    ref, clipped = reference_update(grads, idx, C, clipping, q * n)
    assert clipped >= len(idx) / 2
    assert_update([0 * r for r in ref], ups[None], ref)
    for a, b in zip(ups[None], ups[3]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ 3. a non-finite record


@pytest.mark.parametrize("clipping", CLIPPINGS)
def test_nan_record_contributes_zero_and_training_goes_on(clipping):
    model, x, y, grads = case("mlp")
    n = len(y)
    C = clip_for(grads, clipping)
    norms = [np.sqrt(sum(float((t**2).sum()) for t in g)) for g in grads]
    bad = int(np.argmax(norms))  # the record that would move the weights the most
    xn = x.copy()
    xn[bad, 2] = np.nan
    w0 = values(model.trainable_variables)
    dp, led = private(model, C, clipping, n=n)
    dp.fit(dpk.PoissonBatches(xn, y, sampling_probability=1.0, steps=1, seed=1), epochs=1, verbose=0)
    assert led.num_releases == 1 == dp.releases and len(led.samples) == 1
    w1 = values(model.trainable_variables)
    assert all(np.isfinite(w).all() for w in w1)
    keep = [i for i in range(n) if i != bad]
    ref, _ = reference_update(grads, keep, C, clipping, float(n))  # without the record, same denominator
    assert_update(w0, w1, ref)
    with_bad, _ = reference_update(grads, range(n), C, clipping, float(n))
    assert max(np.abs(a - b).max() for a, b in zip(ref, with_bad)) > 1e-3  # the record's absence is visible
    # training goes on: the next step releases too and keeps the weights finite
    dp.fit(dpk.PoissonBatches(xn, y, sampling_probability=1.0, steps=1, seed=2), epochs=1, verbose=0)
    assert led.num_releases == 2 == dp.releases and len(led.samples) == 2
    w2 = values(model.trainable_variables)
    assert all(np.isfinite(w).all() for w in w2) and any(not np.array_equal(a, b) for a, b in zip(w1, w2))


# ------------------------------------------------------------------ 4. noise


@pytest.mark.parametrize("clipping", CLIPPINGS)
def test_empty_poisson_batch_releases_exactly_the_noise(clipping):
    # With nothing sampled the update is the noise alone: N(0, (z·C/(q·n))²) per coordinate (per
    # layer too: z·√m·C_v = z·C), drawn by the core's ChaCha20, variable j of query group G from
    # derive_seed(derive_seed(seed, release), G, j) (HostRelease.release; as tests/tf_cases.py's
    # test_empty_poisson_batch_releases_pure_noise). Nothing comes from the data.
    n, q, z, C = 20, 0.02, 2.0, 0.5
    x, y = make_data("mlp", n)
    seed = next(s for s in range(1000) if len(dpk.PoissonBatches(x, y, sampling_probability=q, steps=1, seed=s).indices(0)) == 0)
    src = dpk.PoissonBatches(x, y, sampling_probability=q, steps=1, seed=seed)
    assert len(src.indices(0)) == 0
    model = build("mlp")
    w0 = values(model.trainable_variables)
    dp, led = private(model, C, clipping, n=n, q=q, z=z, seed=5)
    dp.fit(src, epochs=1, verbose=0)
    assert led.num_releases == 1 and led.samples[0].policy == "poisson" and len(led.samples[0].queries) >= 1
    sd = z * C / (q * n)
    groups = [(0, j) for j in range(len(w0))] if clipping == "flat" else [(k, 0) for k in range(len(w0))]
    noise = [dpcore.mechanism.gaussian_noise(a.shape, sd, dtype=np.float32, seed=derive_seed(derive_seed(5, 0), g, j))
             for a, (g, j) in zip(w0, groups)]
    w1 = values(model.trainable_variables)
    assert max(np.abs(a - b).max() for a, b in zip(w0, w1)) > 0.1
    for a, b, e in zip(w0, w1, noise):
        np.testing.assert_allclose(a - b, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clipping", CLIPPINGS)
def test_noise_is_gaussian_with_the_right_scale(clipping):
    from scipy import stats

    n, q, z, C = 20, 0.5, 1.0, 1.0  # q·n = 10
    rng = np.random.default_rng(4)
    x, y = (rng.normal(size=(n, 200)) * 2).astype("float32"), rng.integers(0, 100, n).astype("int32")

    def run(noise):
        keras.utils.set_random_seed(0)
        i = keras.Input((200,))
        model = keras.Model(i, L.Dense(100)(i))  # 20,100 weights
        w0 = values(model.trainable_variables)
        dp, _ = private(model, C, clipping, n=n, q=q, z=noise, seed=123)
        dp.fit(dpk.PoissonBatches(x, y, sampling_probability=q, steps=1, seed=7), epochs=1, verbose=0)
        return w0, values(model.trainable_variables)

    w0, clean = run(0.0)
    w0b, noised = run(z)
    for a, b in zip(w0, w0b):
        np.testing.assert_array_equal(a, b)
    sd = z * C / (q * n)  # per coordinate, after the fixed denominator; SGD(1.0)
    diffs = [(b.astype(np.float64) - a).ravel() / sd for a, b in zip(clean, noised)]
    everything = np.concatenate(diffs)
    assert everything.size > 20000
    for d in diffs + [everything]:
        s = float((d**2).sum())
        lo, hi = stats.chi2.ppf(1e-4, d.size), stats.chi2.ppf(1 - 1e-4, d.size)
        assert lo < s < hi, (d.size, s, lo, hi)
        assert abs(d.mean()) < 4.0 / np.sqrt(d.size)


# ------------------------------------------------------------------ 5. ledger and ε


@pytest.mark.parametrize("clipping", CLIPPINGS)
def test_ledger_records_each_step_and_epsilon_matches_accounting(clipping):
    n, q, z, C, steps = 16, 0.25, 1.3, 0.7, 3
    model = build("mlp")
    x, y = make_data("mlp", n)
    dp, led = private(model, C, clipping, n=n, q=q, z=z, seed=None)
    dp.fit(dpk.PoissonBatches(x, y, sampling_probability=q, steps=steps), epochs=1, verbose=0)
    assert led.num_releases == steps == dp.releases and len(led.samples) == steps
    for s in led.samples:
        assert (s.policy, s.population_size, s.sampling_probability, s.seeded) == ("poisson", n, q, False)
    if clipping == "flat":
        for s in led.samples:
            assert [(e.l2_norm_clip, e.stddev) for e in s.queries] == [(C, pytest.approx(z * C))]
    eps = dp.get_epsilon(1e-5)
    ref = dpcore.accounting.epsilon(q, z, steps, 1e-5)
    assert 0 < eps < np.inf and eps == pytest.approx(ref, rel=1e-9)
    assert eps == pytest.approx(led.get_epsilon(1e-5), rel=1e-12)
    assert dpcore.PrivacyLedger.load(led.path).get_epsilon(1e-5) == pytest.approx(eps, rel=1e-12)
    assert dpcore.accounting.epsilon(q, z, steps - 1, 1e-5) < eps


# ------------------------------------------------------------------ 6. resume from a checkpoint


def _resumed_run(z, directory, *, split):
    """Trains the MLP for 4 steps (2 epochs of 2 seeded Poisson batches), with SGD with
    momentum; ``split``: 2 steps, then the model's weights and the optimizer's state saved, the
    ledger closed, and a fresh model, optimizer, DPModel and ledger object (on the same file)
    continue for 2 more. Returns (final trainable values, ledger path, ε or None)."""
    n, q, C = 16, 0.5, 0.8
    x, y = make_data("mlp", n)
    path = os.path.join(directory, "ledger.jsonl")
    src = lambda: dpk.PoissonBatches(x, y, sampling_probability=q, steps=2, seed=9)  # noqa: E731
    opt = lambda: keras.optimizers.SGD(0.5, momentum=0.9)  # noqa: E731
    model = build("mlp")
    led = dpcore.PrivacyLedger(path)
    dp, _ = private(model, C, n=n, q=q, z=z, ledger=led, optimizer=opt(), seed=3)
    if not split:
        dp.fit(src(), epochs=2, verbose=0)
    else:
        dp.fit(src(), epochs=1, verbose=0)
        assert led.num_releases == 2
        weights = os.path.join(directory, "model.weights.h5")
        model.save_weights(weights)
        opt_state = [np.array(keras.ops.convert_to_numpy(v.value)) for v in dp.optimizer.variables]
        led.close()
        del model, dp, led
        model = build("mlp", seed=1)  # other initial weights: the checkpoint must replace them
        model.load_weights(weights)
        led = dpcore.PrivacyLedger(path)
        assert led.num_releases == 2  # continued, not restarted
        dp, _ = private(model, C, n=n, q=q, z=z, ledger=led, optimizer=opt(), seed=3)
        dp.optimizer.build(dp.trainable_variables)
        assert len(dp.optimizer.variables) == len(opt_state)
        for v, a in zip(dp.optimizer.variables, opt_state):
            v.assign(a)
        dp.fit(src(), epochs=1, verbose=0)
    assert led.num_releases == 4 and len(led.samples) == 4
    eps = dp.get_epsilon(1e-5) if z > 0 else None
    return values(model.trainable_variables), path, eps


def test_resume_continues_the_ledger():
    # ε of 4 steps of one uninterrupted run is accounting.epsilon(q, z, 4, δ): see
    # test_ledger_records_each_step_and_epsilon_matches_accounting
    z = 1.0
    _, path, eps_resumed = _resumed_run(z, tempfile.mkdtemp(prefix="dpk-resume-"), split=True)
    assert dpcore.PrivacyLedger.load(path).num_releases == 4
    assert eps_resumed == pytest.approx(dpcore.accounting.epsilon(0.5, z, 4, 1e-5), rel=1e-9)
    assert eps_resumed > dpcore.accounting.epsilon(0.5, z, 2, 1e-5)


def test_resume_at_zero_noise_equals_an_uninterrupted_run():
    w_resumed, _, _ = _resumed_run(0.0, tempfile.mkdtemp(prefix="dpk-resume-"), split=True)
    w_whole, _, _ = _resumed_run(0.0, tempfile.mkdtemp(prefix="dpk-whole-"), split=False)
    for a, b in zip(w_resumed, w_whole):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    first = build("mlp")
    assert any(np.abs(a - b).max() > 1e-3 for a, b in zip(values(first.trainable_variables), w_whole))  # it trained


# ------------------------------------------------------------------ 7. misuse


def test_train_on_batch_is_refused():
    model, x, y, _ = case("mlp")
    dp, led = private(model, 1.0, n=len(y))
    w0 = values(model.trainable_variables)
    with pytest.raises(RuntimeError, match="inside fit"):
        dp.train_on_batch(x, y)
    assert led.num_releases == 0
    for a, b in zip(w0, values(model.trainable_variables)):
        np.testing.assert_array_equal(a, b)


def test_auto_scale_loss_is_refused():
    model, _, y, _ = case("mlp")
    dp = dpk.make_private(model, keras.optimizers.SGD(1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                          population_size=len(y), sampling_probability=1.0, ledger=new_ledger())
    with pytest.raises(ValueError, match="auto_scale_loss"):
        dp.compile(loss=SCE(), auto_scale_loss=True)


# -- the grey-box neighbour harness on this backend's release path --------------------------


@pytest.mark.parametrize("clipping", CLIPPINGS)
def test_greybox_neighbours_on_the_compiled_release_path(clipping):
    # A record added, removed, replaced, duplicated, NaN, ±inf or huge, with identical randomness:
    # the same branches and ledger entries, pre-noise sums within the declared sensitivity. On JAX
    # and torch the Dense layers take the ghost-norm path (taps), so that path is audited too.
    import warnings

    from dpcore.audit import neighbour_audit
    from greybox_cases import FEW, classification, ledger_path

    n, q = 48, 1 / 3

    def train(cols, seed):
        x, y = cols
        keras.utils.set_random_seed(0)  # the same initial weights in every run
        m = keras.Sequential([keras.Input((8,)), L.Dense(6, activation="relu"), L.Dense(3)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dp = dpk.make_private(m, keras.optimizers.SGD(0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                                  clipping=clipping, population_size=n, sampling_probability=q,
                                  ledger=dpcore.PrivacyLedger(ledger_path()), seed=seed)
            dp.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            dp.fit(dpk.PoissonBatches(x, y, sampling_probability=q, steps=3, seed=seed), epochs=1, verbose=0)

    res = neighbour_audit(train, classification(n), FEW, assume_public=("population_size",))
    res.raise_for_findings()
    groups = 1 if clipping == "flat" else 4
    for r in res.runs:
        assert r.releases == 3 and r.ledger_entries == 3 + 3 * groups, r
        if r.neighbour in ("nan", "inf"):
            assert r.max_ratio < 1e-6, r
    assert max(r.max_ratio for r in res.runs) > 0.05  # the neighbour was sampled and moved the sum
