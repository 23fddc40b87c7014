"""The grey-box neighbour harness on the Keras release path (run by
tests/test_greybox_adapters.py in a fresh process: TensorFlow and torch's CUDA build abort in
one process)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from dpcore import PrivacyLedger  # noqa: E402
from dpcore.audit import neighbour_audit  # noqa: E402
from dpcore.tensorflow import PoissonBatches, make_private  # noqa: E402

from greybox_cases import FEW, classification, ledger_path  # noqa: E402

N, Q = 48, 1 / 3
SCE = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def keras_train(clipping="flat", **kw):
    def train(cols, seed):
        x, y = cols
        tf.keras.utils.set_random_seed(0)  # the same initial weights in every run
        m = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(6, activation="relu"), tf.keras.layers.Dense(3)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dp = make_private(m, tf.keras.optimizers.SGD(0.1), noise_multiplier=1.0, max_grad_norm=1.0, clipping=clipping,
                              population_size=N, sampling_probability=Q, ledger=PrivacyLedger(ledger_path()), seed=seed, **kw)
            dp.compile(loss=SCE)
            dp.fit(PoissonBatches(x, y, sampling_probability=Q, steps=3, seed=seed), epochs=1, verbose=0)

    return train


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_keras_release_path_passes(clipping):
    res = neighbour_audit(keras_train(clipping), classification(N), FEW, assume_public=("population_size",))
    res.raise_for_findings()
    groups = 1 if clipping == "flat" else 4  # per layer: a ledger entry for each variable's group
    for r in res.runs:
        # one traced release per step (the compiled step traces its groups as the parts of one)
        assert r.releases == 3 and r.ledger_entries == 3 + 3 * groups, r
        if r.neighbour in ("nan", "inf"):
            assert r.max_ratio < 1e-6, r
    assert max(r.max_ratio for r in res.runs) > 0.05


def test_keras_micro_batches_pass():
    res = neighbour_audit(keras_train(max_physical_batch_size=5), classification(N), ("remove", "replace", "nan", "huge", "zero"),
                          assume_public=("population_size",))
    res.raise_for_findings()
