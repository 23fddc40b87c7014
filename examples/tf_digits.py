"""DP-SGD on scikit-learn's digits with Keras's own ``model.fit`` (dpcore.tensorflow.make_private),
next to a non-private baseline; ε at δ = 1e-5 from the ledger. ``python examples/tf_digits.py [--small]``."""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import numpy as np


def main(small: bool = False) -> dict:
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import dpcore
    from dpcore.tensorflow import PoissonBatches, make_private

    tf.random.set_seed(0)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0)
    if small:
        xtr, ytr = xtr[:300], ytr[:300]
    epochs = 2 if small else 10

    def model():
        return tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(32, activation="tanh"),
                                    tf.keras.layers.Dense(10)])

    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    base = model()
    base.compile(tf.keras.optimizers.SGD(0.5), loss)
    base.fit(xtr, ytr, batch_size=64, epochs=epochs, verbose=0)

    path = os.path.join(tempfile.mkdtemp(prefix="dpcore-tf-"), "ledger.jsonl")
    ledger = dpcore.PrivacyLedger(path)
    q = 64 / len(xtr)
    dp = model()
    # fit() on the wrapper trains `dp` itself; each step clips, noises and records in the core
    private = make_private(dp, tf.keras.optimizers.SGD(0.5), noise_multiplier=1.1, max_grad_norm=1.0,
                           population_size=len(xtr), sampling_probability=q, ledger=ledger)
    private.compile(loss=loss, metrics=["accuracy"])
    private.fit(PoissonBatches(xtr, ytr, sampling_probability=q), epochs=epochs, verbose=0)

    def acc(m):
        return float((m(xte).numpy().argmax(1) == yte).mean())

    res = {"baseline_accuracy": acc(base), "dp_accuracy": acc(dp), "steps": ledger.num_releases}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # accounting notices are not what the example shows
        res["epsilon"] = private.get_epsilon(1e-5)
    print(f"non-private accuracy {res['baseline_accuracy']:.3f} | DP-SGD accuracy {res['dp_accuracy']:.3f} "
          f"| eps = {res['epsilon']} at delta = 1e-5 after {res['steps']} steps (ledger {path})")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    main(ap.parse_args().small)
