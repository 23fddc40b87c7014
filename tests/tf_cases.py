"""dpcore.tensorflow cases, run by test_tensorflow.py in a separate process (TensorFlow and the CUDA build of torch abort when loaded into one process)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import dpcore  # noqa: E402
from dpcore.tensorflow import DPTrainer, per_record_gradients  # noqa: E402


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
    tr = DPTrainer(m, tf.keras.optimizers.SGD(1.0), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   ledger=led, population_size=40, sample_rate=0.5, noise_multiplier=0.0, max_grad_norm=0.2)
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
    tr.noise = tr.query = dpcore.GaussianAverageQuery(0.2, 0.2, 20.0)
    tr.global_state = tr.query.initial_global_state()
    tr.step(xb[:0], yb[:0])
    assert led.num_releases == 2
    assert not np.array_equal(m.trainable_variables[0].numpy(), w1)
