"""dpcore.tensorflow cases, run by test_tensorflow.py in a separate process (TensorFlow and the CUDA build of torch abort when loaded into one process)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dpcore  # noqa: E402
from dpcore.tensorflow import CustomLoopTrainer, per_record_gradients  # noqa: E402


def logreg(d=5, k=3):
    m = tf.keras.Sequential([tf.keras.Input((d,)), tf.keras.layers.Dense(k)])
    return m


def numpy_grads(w, b, x, y):
    # softmax cross-entropy per record: dL/dW = x (p - onehot)ᵀ, dL/db = p - onehot
    z = x @ w + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    e = p - np.eye(w.shape[1])[y]
    return np.einsum("bi,bj->bij", x, e), e


def test_per_record_gradients_match_numpy():
    tf.random.set_seed(0)
    m = logreg()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(9, 5)).astype(np.float32), rng.integers(0, 3, 9)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    gw, gb = per_record_gradients(m, loss, tf.constant(x), tf.constant(y))
    w, b = [v.numpy() for v in m.trainable_variables]
    rw, rb = numpy_grads(w.astype(np.float64), b, x.astype(np.float64), y)
    np.testing.assert_allclose(gw.numpy(), rw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gb.numpy(), rb, rtol=1e-4, atol=1e-6)


def test_dp_step_clips_and_ledgers():
    tf.random.set_seed(1)
    m = logreg()
    rng = np.random.default_rng(1)
    x, y = (rng.normal(size=(40, 5)) * 5).astype(np.float32), rng.integers(0, 3, 40)
    led = dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(), "l.jsonl"))
    w0, b0 = [v.numpy().copy() for v in m.trainable_variables]
    tr = CustomLoopTrainer(m, tf.keras.optimizers.SGD(1.0), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   ledger=led, population_size=40, sampling_probability=0.5, noise_multiplier=0.0, max_grad_norm=0.2)
    (xb, yb), = list(tr.batches(x, y, steps=1, seed=3))
    tr.step(xb, yb)
    rw, rb = numpy_grads(w0.astype(np.float64), b0, xb.astype(np.float64), yb)
    ref, norms = dpcore.clip_sum([rw.reshape(len(yb), -1), rb], 0.2)
    assert norms.max() > 0.2
    w1, b1 = [v.numpy() for v in m.trainable_variables]
    np.testing.assert_allclose(w0 - w1, ref[0].reshape(w0.shape) / 20.0, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b0 - b1, ref[1] / 20.0, rtol=1e-4, atol=1e-6)
    assert led.num_releases == 1 and led.samples[0].queries[0].l2_norm_clip == 0.2
    # an empty batch still releases (pure noise)
    led.record_sample(40, 0.5)
    w1 = m.trainable_variables[0].numpy().copy()
    tr.query = dpcore.GaussianAverageQuery(0.2, 0.2, 20.0)  # the same clip, now with noise
    tr.global_state = tr.query.initial_global_state()
    tr.step(xb[:0], yb[:0])
    assert led.num_releases == 2
    assert led.samples[1].queries[0].stddev == 0.2  # the release is the noised one
    moved = m.trainable_variables[0].numpy() - w1
    assert np.count_nonzero(moved) == moved.size  # every coordinate got noise, no record


# ----------------------------------------------------------------------------- model.fit path

from dpcore.queries.base import derive_seed  # noqa: E402
from dpcore.tensorflow import DPModel, PoissonBatches, make_private  # noqa: E402

SCE = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def new_ledger():
    return dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(), "l.jsonl"))


def data(n=40, d=5, k=3, scale=5.0, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, d)) * scale).astype(np.float32), rng.integers(0, k, n)


def dp_logreg(ledger, lr=1.0, **kw):
    tf.random.set_seed(0)
    m = logreg()
    dp = make_private(m, tf.keras.optimizers.SGD(lr), ledger=ledger, **kw)
    dp.compile(loss=SCE, metrics=["accuracy"])
    return m, dp


def clipped_average(x, y, w, b, clip, den, per_layer=False):
    """Reference in numpy only: per-record grads clipped to C (jointly, or per variable to
    C/sqrt(2)), summed, divided by the fixed denominator."""
    gw, gb = numpy_grads(w.astype(np.float64), b.astype(np.float64), x.astype(np.float64), y)
    if per_layer:
        c = clip / np.sqrt(2.0)
        fw = np.minimum(1.0, c / np.linalg.norm(gw.reshape(len(y), -1), axis=1))
        fb = np.minimum(1.0, c / np.linalg.norm(gb, axis=1))
        norms = np.concatenate([np.linalg.norm(gw.reshape(len(y), -1), axis=1), np.linalg.norm(gb, axis=1)])
        return (fw[:, None, None] * gw).sum(0) / den, (fb[:, None] * gb).sum(0) / den, norms / c
    norms = np.sqrt((gw.reshape(len(y), -1) ** 2).sum(1) + (gb**2).sum(1))
    f = np.minimum(1.0, clip / norms)
    return (f[:, None, None] * gw).sum(0) / den, (f[:, None] * gb).sum(0) / den, norms / clip


def test_fit_trains_and_records_one_release_per_step():
    x, y = data(60)
    led = new_ledger()
    m, dp = dp_logreg(led, lr=0.5, noise_multiplier=1.1, max_grad_norm=1.0, population_size=60, sampling_probability=0.2)
    w0 = [v.numpy().copy() for v in m.trainable_variables]
    hist = dp.fit(PoissonBatches(x, y, sampling_probability=0.2, steps=4), epochs=3, verbose=0)
    assert led.num_releases == 12 == dp.releases and len(led.samples) == 12
    assert dp.optimizer.iterations.numpy() == 12
    for s in led.samples:
        assert (s.policy, s.population_size, s.sampling_probability, s.seeded) == ("poisson", 60, 0.2, False)
        assert [(e.l2_norm_clip, e.stddev) for e in s.queries] == [(1.0, pytest.approx(1.1))]
    # the wrapped model itself was trained, and fit logged the usual metrics
    assert all(not np.allclose(a, v.numpy()) for a, v in zip(w0, m.trainable_variables))
    assert set(hist.history) == {"loss", "accuracy"} and len(hist.history["loss"]) == 3
    # the ledger on disk says the same
    assert dpcore.PrivacyLedger.load(led.path).num_releases == 12


def test_epsilon_matches_accounting_of_the_same_events():
    x, y = data(100)
    led = new_ledger()
    _, dp = dp_logreg(led, noise_multiplier=1.3, max_grad_norm=0.7, expected_batch_size=10.0)
    dp.fit(PoissonBatches(x, y, sampling_probability=0.1, steps=7), epochs=2, verbose=0)
    eps = dp.get_epsilon(1e-5)
    ref = dpcore.accounting.epsilon(0.1, 1.3, 14, 1e-5)
    assert 0 < eps < np.inf and eps == pytest.approx(ref, rel=1e-9)
    # one step more must cost more: the count of releases is what is accounted
    assert dpcore.accounting.epsilon(0.1, 1.3, 13, 1e-5) < eps


@pytest.mark.parametrize("clipping,micro", [("flat", None), ("flat", 3), ("per_layer", None)])
def test_update_equals_numpy_reference_at_zero_noise(clipping, micro):
    x, y = data(40)
    led = new_ledger()
    m, dp = dp_logreg(led, noise_multiplier=0.0, max_grad_norm=0.2, population_size=40, sampling_probability=0.5,
                      clipping=clipping, max_physical_batch_size=micro)
    w0, b0 = [v.numpy().copy() for v in m.trainable_variables]
    src = PoissonBatches(x, y, sampling_probability=0.5, steps=1, seed=11)
    idx = src.indices(0)
    assert len(idx) > 6  # several micro-batches when micro=3
    # spy on the per-record gradient pass: micro-batches must really be cut
    begin, sizes = dp._dp_begin, []
    object.__setattr__(dp, "_dp_begin", lambda data: (lambda b: (sizes.extend(b.sizes), b)[1])(begin(data)))
    dp.fit(src, epochs=1, verbose=0, shuffle=False)
    assert sum(sizes) == len(idx) and max(sizes) == (micro or len(idx))
    assert led.samples[0].seeded and led.samples[0].policy == "poisson"
    rw, rb, ratio = clipped_average(x[idx], y[idx], w0, b0, 0.2, 20.0, per_layer=clipping == "per_layer")
    assert ratio.max() > 1.5  # clipping is active: an unclipped reference would differ
    w1, b1 = [v.numpy() for v in m.trainable_variables]
    np.testing.assert_allclose(w0 - w1, rw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b0 - b1, rb, rtol=1e-4, atol=1e-6)
    assert led.num_releases == 1
    want = [(0.2, 0.0)] if clipping == "flat" else [(pytest.approx(0.2 / np.sqrt(2)), 0.0)] * 2
    assert [(e.l2_norm_clip, e.stddev) for e in led.samples[0].queries] == want


def test_empty_poisson_batch_releases_pure_noise():
    x, y = data(20)
    q = 0.02
    seed = next(s for s in range(1000) if len(dpcore.poisson_sample(20, q, seed=derive_seed(s, 0))) == 0)
    src = PoissonBatches(x, y, sampling_probability=q, steps=1, seed=seed)
    assert len(src.indices(0)) == 0
    led = new_ledger()
    m, dp = dp_logreg(led, lr=1.0, noise_multiplier=2.0, max_grad_norm=0.5, expected_batch_size=20 * q, seed=5)
    w0, b0 = [v.numpy().copy() for v in m.trainable_variables]
    dp.fit(src, epochs=1, verbose=0)
    assert led.num_releases == 1 and led.samples[0].policy == "poisson"
    # exactly the core's noise for release 0: N(0, (z·C/(q·n))²), variable j's stream seeded by
    # derive_seed(derive_seed(seed, release), group, j), nothing from the data
    sd = 2.0 * 0.5 / (20 * q)
    noise = [dpcore.mechanism.gaussian_noise(a.shape, sd, dtype=np.float32, seed=derive_seed(derive_seed(5, 0), 0, j))
             for j, a in enumerate((w0, b0))]
    w1, b1 = [v.numpy() for v in m.trainable_variables]
    assert np.abs(w0 - w1).max() > 0.1
    np.testing.assert_allclose(w0 - w1, noise[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b0 - b1, noise[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_nan_record_trains_and_adds_zero(clipping):
    # The default on_nonfinite="zero": a record whose per-record gradient is NaN (from a NaN
    # input) does not stop the step; it releases, and the record's contribution is exactly zero.
    x, y = data(30)
    led = new_ledger()
    m, dp = dp_logreg(led, noise_multiplier=0.0, max_grad_norm=1.0, population_size=30, sampling_probability=1.0,
                      clipping=clipping)
    assert dp.on_nonfinite == "zero"
    w0, b0 = [v.numpy().copy() for v in m.trainable_variables]
    # the record whose (finite) gradient is largest: it would move the weights the most
    *_, n0 = clipped_average(x, y, w0, b0, 1.0, 30.0)
    bad = int(np.argmax(n0))
    xn = x.copy()
    xn[bad, 2] = np.nan
    dp.fit(PoissonBatches(xn, y, sampling_probability=1.0, steps=1), verbose=0)
    assert led.num_releases == 1 == dp.releases and dp.optimizer.iterations.numpy() == 1
    w1, b1 = [v.numpy() for v in m.trainable_variables]
    assert np.isfinite(w1).all() and np.isfinite(b1).all()
    per_layer = clipping == "per_layer"
    keep = np.delete(np.arange(30), bad)
    rw, rb, _ = clipped_average(x[keep], y[keep], w0, b0, 1.0, 30.0, per_layer=per_layer)  # without the record
    fw, fb, _ = clipped_average(x, y, w0, b0, 1.0, 30.0, per_layer=per_layer)  # with its finite value
    np.testing.assert_allclose(w0 - w1, rw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b0 - b1, rb, rtol=1e-4, atol=1e-6)
    assert max(np.abs(fw - rw).max(), np.abs(fb - rb).max()) > 1e-3  # the finite record would have counted


def test_nan_record_raises_when_asked_and_leaves_ledger_untouched():
    # on_nonfinite="raise": the debugging aid (not DP) raises before the ledger or the weights
    x, y = data(30)
    led = new_ledger()
    m, dp = dp_logreg(led, noise_multiplier=1.0, max_grad_norm=1.0, population_size=30, sampling_probability=1.0,
                      on_nonfinite="raise")
    dp.fit(PoissonBatches(x, y, sampling_probability=1.0, steps=1), verbose=0)  # one good release
    with open(led.path, "rb") as f:
        before = f.read()
    w = [v.numpy().copy() for v in m.trainable_variables]
    xn = x.copy()
    xn[7, 2] = np.nan
    with pytest.raises(ValueError, match=r"record 7\b.*NaN or infinite"):
        dp.fit(PoissonBatches(xn, y, sampling_probability=1.0, steps=1), verbose=0)
    with open(led.path, "rb") as f:
        assert f.read() == before
    assert led.num_releases == 1 == dp.releases and dp.optimizer.iterations.numpy() == 1
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(w, m.trainable_variables))
    # the next good step is recorded normally, as a new sample
    dp.fit(PoissonBatches(x, y, sampling_probability=1.0, steps=1), verbose=0)
    assert led.num_releases == 2 and [s.sample for s in led.samples] == [0, 1]
    with pytest.raises(ValueError, match="on_nonfinite"):
        make_private(logreg(), tf.keras.optimizers.SGD(1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                     expected_batch_size=3.0, on_nonfinite="skip")


def test_custom_loop_nan_record_adds_zero():
    tf.random.set_seed(1)
    m = logreg()
    x, y = data(12, seed=3)
    xn = x.copy()
    xn[4, 0] = np.inf
    w0, b0 = [v.numpy().copy() for v in m.trainable_variables]
    led = new_ledger()
    tr = CustomLoopTrainer(m, tf.keras.optimizers.SGD(1.0), SCE, ledger=led, population_size=12,
                           sampling_probability=1.0, noise_multiplier=0.0, max_grad_norm=0.5)
    led.record_sample(12, 1.0)
    tr.step(xn, y)
    assert led.num_releases == 1
    keep = np.delete(np.arange(12), 4)
    rw, rb, _ = clipped_average(x[keep], y[keep], w0, b0, 0.5, 12.0)
    w1, b1 = [v.numpy() for v in m.trainable_variables]
    np.testing.assert_allclose(w0 - w1, rw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b0 - b1, rb, rtol=1e-4, atol=1e-6)
    strict = CustomLoopTrainer(m, tf.keras.optimizers.SGD(1.0), SCE, ledger=new_ledger(), population_size=12,
                               sampling_probability=1.0, noise_multiplier=0.0, max_grad_norm=0.5, on_nonfinite="raise")
    with pytest.raises(ValueError, match=r"record 4\b"):
        strict.step(xn, y)


def test_fit_on_arrays_records_shuffle_samples():
    x, y = data(50)
    led = new_ledger()
    _, dp = dp_logreg(led, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=10.0)
    with pytest.warns(dpcore.ledger.LedgerWarning, match="shuffle"):
        dp.fit(x, y, epochs=2, verbose=0)  # batch_size defaults to round(q·n) = 10
    assert led.num_releases == 10
    assert {(s.policy, s.population_size, s.sampling_probability) for s in led.samples} == {("shuffle", 50, 0.2)}
    # each batch recorded with its epoch: 2 epochs of 5 batches
    assert [s.round for s in led.samples] == [0] * 5 + [1] * 5
    assert [s.step_in_round for s in led.samples] == list(range(5)) * 2
    assert all(s.sample_size == 10 and s.round_steps == 5 for s in led.samples)
    with pytest.warns(dpcore.ledger.LedgerWarning):
        shuffled = dp.get_epsilon(1e-5)
    assert shuffled > dpcore.accounting.epsilon(0.2, 1.0, 10, 1e-5)  # no amplification
    # zero-out (the run's relation): one Gaussian query per epoch
    A = dpcore.accounting
    assert shuffled == pytest.approx(A.PldAccountant().compose(A.SelfComposedEvent(A.GaussianEvent(1.0), 2)).get_epsilon(1e-5))
    # a fixed order (shuffle=False) is recorded as such: under add-or-remove every step costs a swap
    led3 = new_ledger()
    _, dp3 = dp_logreg(led3, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=10.0)
    with pytest.warns(dpcore.ledger.LedgerWarning):
        dp3.fit(x, y, epochs=2, verbose=0, shuffle=False)
    assert {s.policy for s in led3.samples} == {"sequential"}
    with pytest.warns(dpcore.ledger.LedgerWarning):
        aor = led3.get_epsilon(1e-5, neighboring="add_or_remove")
    assert aor == pytest.approx(A.PldAccountant().compose(A.SelfComposedEvent(A.GaussianEvent(0.5), 10)).get_epsilon(1e-5))
    # an opaque source (tf.data) is accepted only when the population is known, as shuffle
    led2 = new_ledger()
    _, dp2 = dp_logreg(led2, noise_multiplier=1.0, max_grad_norm=1.0, population_size=50, sampling_probability=0.1)
    with pytest.warns(dpcore.ledger.LedgerWarning, match="shuffle"):
        dp2.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(5), verbose=0, shuffle=False)
    assert led2.num_releases == 10 and {s.policy for s in led2.samples} == {"shuffle"}


def test_misuse_is_refused():
    x, y = data(20)
    _, dp = dp_logreg(new_ledger(), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=5.0)
    with pytest.raises(ValueError, match="q·n"):
        dp.fit(PoissonBatches(x, y, sampling_probability=0.5), verbose=0)
    with pytest.raises(TypeError, match="PoissonBatches"):
        dp.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(5), verbose=0)
    with pytest.raises(RuntimeError, match="inside fit"):
        dp.train_on_batch(x[:4], y[:4])
    with pytest.raises(ValueError, match="auto_scale_loss"):
        dp.compile(loss=SCE, auto_scale_loss=True)
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        dp.compile(loss=SCE, optimizer=tf.keras.optimizers.LossScaleOptimizer(tf.keras.optimizers.SGD(0.1)))
    assert dp.ledger.num_releases == 0
    bn = tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.BatchNormalization(), tf.keras.layers.Dense(3)])
    with pytest.raises(TypeError, match="batch statistics"):
        DPModel(bn, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=5.0)


def test_make_private_with_epsilon_calibrates_to_the_target():
    from dpcore import accounting
    from dpcore.tensorflow import make_private_with_epsilon

    tf.random.set_seed(0)
    dp = make_private_with_epsilon(logreg(), tf.keras.optimizers.SGD(0.5), target_epsilon=3.0, target_delta=1e-5,
                                   epochs=2, max_grad_norm=1.0, population_size=40, sampling_probability=0.25,
                                   ledger=new_ledger())
    z = dp.noise_multiplier
    assert z == accounting.calibrate_noise_multiplier(3.0, 1e-5, 0.25, 8)
    assert accounting.epsilon(0.25, z, 8, 1e-5) <= 3.0 < accounting.epsilon(0.25, z * 0.99, 8, 1e-5)
    with pytest.raises(ValueError):
        make_private_with_epsilon(logreg(), tf.keras.optimizers.SGD(0.5), target_epsilon=3.0, target_delta=1e-5,
                                  epochs=0, max_grad_norm=1.0, population_size=40, sampling_probability=0.25)


def test_old_clip_name_still_works_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="max_grad_norm"):
        _, dp = dp_logreg(new_ledger(), noise_multiplier=1.0, l2_norm_clip=0.7, expected_batch_size=5.0)
    assert dp.l2_norm_clip == 0.7
    with pytest.raises(TypeError, match="max_grad_norm= only"):
        dp_logreg(new_ledger(), noise_multiplier=1.0, l2_norm_clip=0.7, max_grad_norm=0.7, expected_batch_size=5.0)



def test_joint_clipping_equals_numpy_reference_at_zero_noise():
    # clipping="joint": the weights scaled by 1/α_w, the biases by 1/α_b, clipped jointly, scaled back
    x, y = data(40)
    led = new_ledger()
    scales = [2.0, 0.5]
    m, dp = dp_logreg(led, noise_multiplier=0.0, max_grad_norm=0.2, population_size=40, sampling_probability=0.5,
                      clipping="joint", joint_scales=scales)
    w0, b0 = [v.numpy().copy() for v in m.trainable_variables]
    src = PoissonBatches(x, y, sampling_probability=0.5, steps=1, seed=11)
    idx = src.indices(0)
    dp.fit(src, epochs=1, verbose=0, shuffle=False)
    assert isinstance(dp.query, dpcore.queries.JointClipQuery)
    gw, gb = numpy_grads(w0.astype(np.float64), b0.astype(np.float64), x[idx].astype(np.float64), y[idx])
    norms = np.sqrt(((gw / scales[0]) ** 2).reshape(len(idx), -1).sum(1) + ((gb / scales[1]) ** 2).sum(1))
    f = np.minimum(1.0, 0.2 / norms)
    assert f.min() < 0.5  # clipping is active
    w1, b1 = [v.numpy() for v in m.trainable_variables]
    np.testing.assert_allclose(w0 - w1, (f[:, None, None] * gw).sum(0) / 20.0, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b0 - b1, (f[:, None] * gb).sum(0) / 20.0, rtol=1e-4, atol=1e-6)
    assert [(e.l2_norm_clip, e.stddev) for e in led.samples[0].queries] == [(0.2, 0.0)]
    with pytest.raises(ValueError, match="needs joint_scales"):
        dp_logreg(new_ledger(), noise_multiplier=1.0, max_grad_norm=0.2, expected_batch_size=5.0, clipping="joint")
    with pytest.raises(ValueError, match="joint_scales with one scale per part"):
        _, bad = dp_logreg(new_ledger(), noise_multiplier=1.0, max_grad_norm=0.2, expected_batch_size=5.0,
                           clipping="joint", joint_scales=[1.0])
        bad.query


def test_discrete_gaussian_and_target_epsilon_in_make_private():
    from dpcore.tensorflow import make_private_with_epsilon

    x, y = data(40)
    led = new_ledger()
    _, dp = dp_logreg(led, noise_multiplier=1.0, max_grad_norm=0.5, population_size=40, sampling_probability=0.25,
                      noise_mechanism="discrete_gaussian")
    dp.fit(PoissonBatches(x, y, sampling_probability=0.25, steps=1), epochs=1, verbose=0)
    ev = led.samples[0].queries[0]
    assert ev.mechanism == "discrete_gaussian" and ev.l2_norm_clip >= 0.5
    # make_private(target_epsilon=, target_delta=, epochs=) is make_private_with_epsilon
    kw = dict(max_grad_norm=1.0, population_size=40, sampling_probability=0.25)
    a = make_private(logreg(), tf.keras.optimizers.SGD(0.5), target_epsilon=3.0, target_delta=1e-5, epochs=2,
                     ledger=new_ledger(), **kw)
    b = make_private_with_epsilon(logreg(), tf.keras.optimizers.SGD(0.5), target_epsilon=3.0, target_delta=1e-5,
                                  epochs=2, ledger=new_ledger(), **kw)
    assert a.noise_multiplier == b.noise_multiplier > 0
    with pytest.raises(ValueError, match="not both"):
        make_private(logreg(), tf.keras.optimizers.SGD(0.5), noise_multiplier=1.0, target_epsilon=3.0,
                     target_delta=1e-5, epochs=2, **kw)
    with pytest.raises(TypeError, match="noise_multiplier=, or target_epsilon="):
        make_private(logreg(), tf.keras.optimizers.SGD(0.5), **kw)
    with pytest.raises(ValueError, match="calibrates for noise_mechanism='gaussian' only"):
        make_private(logreg(), tf.keras.optimizers.SGD(0.5), target_epsilon=3.0, target_delta=1e-5, epochs=2,
                     noise_mechanism="discrete_gaussian", **kw)


def test_custom_loop_trainer_clipping_modes_and_old_name():
    m = logreg()
    led = new_ledger()
    kw = dict(ledger=led, population_size=40, sampling_probability=0.5, noise_multiplier=1.0, max_grad_norm=1.0)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tr = CustomLoopTrainer(m, tf.keras.optimizers.SGD(1.0), loss, clipping="per_layer", **kw)
    assert isinstance(tr.query, dpcore.NestedQuery) and len(tr.query.leaf_queries) == 2
    tr = CustomLoopTrainer(m, tf.keras.optimizers.SGD(1.0), loss, clipping="joint", joint_scales=[1.0, 2.0], **kw)
    assert isinstance(tr.query, dpcore.queries.JointClipQuery)
    with pytest.raises(ValueError, match="cyclic order"):
        CustomLoopTrainer(m, tf.keras.optimizers.SGD(1.0), loss, noise_mechanism="blt", **kw)
    # the old name: a deprecated alias
    with pytest.warns(DeprecationWarning, match="DPTrainer is deprecated; it is called CustomLoopTrainer"):
        from dpcore.tensorflow import DPTrainer
    assert DPTrainer is CustomLoopTrainer
