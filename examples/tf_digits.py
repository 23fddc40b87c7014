"""DP-SGD on scikit-learn's digits with Keras's own ``model.fit`` (dpcore.tensorflow.make_private),
next to a non-private baseline; ε at δ = 1e-5 from the ledger. ``python examples/tf_digits.py [--small]``."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded from its file by another program (the tests): _common.py is beside it
    sys.path.insert(0, _HERE)

from _common import digits, parser, quiet_epsilon, report_dp_sgd, temp_ledger  # noqa: E402


def main(small: bool = False) -> dict:
    import tensorflow as tf

    from dpcore.tensorflow import PoissonBatches, make_private

    tf.random.set_seed(0)
    xtr, xte, ytr, yte = digits(300 if small else None)
    epochs = 5 if small else 10

    def model():
        return tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(32, activation="tanh"),
                                    tf.keras.layers.Dense(10)])

    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    base = model()
    base.compile(tf.keras.optimizers.SGD(0.5), loss)
    base.fit(xtr, ytr, batch_size=64, epochs=epochs, verbose=0)

    ledger, path = temp_ledger("dpcore-tf-")
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
    res["epsilon"] = quiet_epsilon(private.get_epsilon)
    return report_dp_sgd(res, path)


if __name__ == "__main__":
    main(parser().parse_args().small)
