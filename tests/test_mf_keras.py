"""dpcore.tensorflow with matrix-factorization noise: DPModel(noise_mechanism=...) and
CyclicBatches.

TensorFlow and the CUDA build of torch abort when both are loaded into one process, so the
cases below run in a fresh process (as tests/test_tensorflow.py runs tests/tf_cases.py): the
one test collected in the main run starts pytest on this file with DPCORE_MF_KERAS_CASES=1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CASES = os.environ.get("DPCORE_MF_KERAS_CASES") == "1"

if not CASES:

    def test_keras_mf_cases_in_subprocess():
        if importlib.util.find_spec("tensorflow") is None:
            pytest.skip("tensorflow not installed")
        env = dict(os.environ, DPCORE_MF_KERAS_CASES="1")
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rsx", "-p", "no:cacheprovider", __file__],
            capture_output=True, text=True, timeout=900, env=env,
        )
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        summary = r.stdout.strip().splitlines()[-1]
        assert "passed" in summary and not any(w in summary for w in ("skipped", "xfail", "failed", "error")), summary

else:
    import warnings

    import numpy as np
    import tensorflow as tf

    import dpcore.matrix_factorization as mf
    from dpcore.ledger import LedgerWarning, PrivacyLedger
    from dpcore.matrix_factorization import BandedStrategy, Participation
    from dpcore.tensorflow import CyclicBatches, PoissonBatches, make_private, make_private_with_epsilon

    keras = tf.keras
    DELTA = 1e-5
    N, BS = 44, 8  # b = 5 batches, 4 records dropped

    def data():
        rng = np.random.default_rng(0)
        return rng.normal(size=(N, 6)).astype("float32"), rng.integers(0, 3, size=N)

    def tiny():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"), keras.layers.Dense(3)])

    def compiled(tmp_path, name="l.jsonl", **kw):
        kw.setdefault("noise_mechanism", "blt")
        kw.setdefault("epochs", 2)
        kw.setdefault("noise_multiplier", 1.0)
        dp = make_private(
            tiny(), keras.optimizers.SGD(0.1), max_grad_norm=1.0, population_size=N,
            ledger=PrivacyLedger(str(tmp_path / name)), seed=1, **kw,
        )
        dp.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return dp

    def eps(dp):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LedgerWarning)
            return dp.get_epsilon(DELTA)

    def test_cyclic_batches_source():
        x, y = data()
        src = CyclicBatches(x, y, batch_size=BS, seed=3)
        assert len(src) == 5 and src.dropped == 4 and src.participation == Participation(5)
        idx = [src.indices(i) for i in range(5)]
        assert np.unique(np.concatenate(idx)).size == 40 and all(len(i) == BS for i in idx)
        assert all(np.array_equal(src.indices(i), idx[i]) for i in range(5))  # the same batches every time
        bx, by = src[2]
        assert np.array_equal(bx, x[idx[2]]) and np.array_equal(by, y[idx[2]])

    def test_fit_with_blt_noise_records_one_stream(tmp_path):
        x, y = data()
        dp = compiled(tmp_path, batch_size=BS)
        before = [v.numpy().copy() for v in dp.inner.trainable_variables]
        dp.fit(CyclicBatches(x, y, batch_size=BS, seed=3), epochs=2, verbose=0)
        assert dp.releases == 10
        assert any(not np.array_equal(a, v.numpy()) for a, v in zip(before, dp.inner.trainable_variables))
        led = dp.ledger
        (sid, dec), = led.streams.items()
        assert isinstance(dec.strategy, mf.BLTStrategy) and dec.steps == 10 and dec.participation == Participation(5, 2)
        assert [s.policy for s in led.samples] == ["cyclic"] * 10 and {s.sample_size for s in led.samples} == {BS}
        qs = [q for s in led.samples for q in s.queries]
        assert {q.stream for q in qs} == {sid} and {q.mechanism for q in qs} == {"matrix_factorization"}
        e = eps(dp)
        assert np.isfinite(e) and e == pytest.approx(mf.epsilon(1.0, DELTA, participation=Participation(5, 2), steps=10), rel=1e-6)
        assert dp.query.noise_multiplier == 1.0 and dp._global_state.noise.state_nbytes == 4 * sum(
            int(np.prod(v.shape)) for v in dp.trainable_variables
        ) * dec.strategy.num_buffers
        # a later fit continues the same stream (whole epochs), past the plan with a warning
        with pytest.warns(UserWarning, match="planned"):
            dp.fit(CyclicBatches(x, y, batch_size=BS, seed=3), epochs=1, verbose=0)
        assert len(dp.ledger.streams) == 1 and dp.releases == 15

    def test_zero_noise_blt_equals_independent(tmp_path):
        # at noise 0 the correlated and the independent mechanism make the same updates
        x, y = data()
        out = []
        for kw, name in ((dict(noise_mechanism="blt"), "a.jsonl"),
                         (dict(noise_mechanism="banded", strategy=mf.IDENTITY), "b.jsonl")):
            dp = compiled(tmp_path, name=name, batch_size=BS, noise_multiplier=0.0, **kw)
            dp.fit(CyclicBatches(x, y, batch_size=BS, seed=3), epochs=2, verbose=0)
            out.append([v.numpy() for v in dp.inner.trainable_variables])
        for a, b in zip(*out):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)

    def test_old_independent_value_still_works_and_warns(tmp_path):
        # noise_mechanism="independent" is noise_mechanism="banded" with strategy=IDENTITY (C = I)
        with pytest.warns(DeprecationWarning, match="'independent' is deprecated"):
            dp = compiled(tmp_path, name="i.jsonl", batch_size=BS, noise_mechanism="independent")
        assert dp.query.strategy == mf.IDENTITY and dp.noise_mechanism == "banded"

    def test_cyclic_poisson_banded(tmp_path):
        x, y = data()
        part = Participation.cyclic_poisson(4, 0.5)
        dp = compiled(tmp_path, participation=part, noise_mechanism="banded")
        dp.fit(CyclicBatches(x, y, participation=part, seed=2), epochs=2, verbose=0)
        assert [s.policy for s in dp.ledger.samples] == ["cyclic_poisson"] * 8
        assert dp.query.strategy.bands <= 4
        want = mf.epsilon(1.0, DELTA, participation=Participation.cyclic_poisson(4, 0.5, 2), steps=8)
        assert eps(dp) == pytest.approx(want, rel=1e-6)

    def test_make_private_with_epsilon(tmp_path):
        x, y = data()
        dp = make_private_with_epsilon(
            tiny(), keras.optimizers.SGD(0.1), target_epsilon=2.0, target_delta=DELTA, epochs=2, max_grad_norm=1.0,
            population_size=N, batch_size=BS, noise_mechanism="banded", ledger=PrivacyLedger(str(tmp_path / "l.jsonl")),
        )
        dp.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        dp.fit(CyclicBatches(x, y, batch_size=BS), epochs=2, verbose=0)
        e = eps(dp)
        assert 1.9 < e <= 2.0

    def test_refusals(tmp_path):
        x, y = data()
        dp = compiled(tmp_path, batch_size=BS)
        with pytest.raises(TypeError, match="CyclicBatches"):
            dp.fit(PoissonBatches(x, y, sampling_probability=0.2), epochs=1, verbose=0)
        with pytest.raises(ValueError, match="shuffle"):
            dp.fit(CyclicBatches(x, y, batch_size=BS), epochs=1, shuffle=True, verbose=0)
        with pytest.raises(ValueError, match="planned for"):
            dp.fit(CyclicBatches(x, y, batch_size=4), epochs=1, verbose=0)
        with pytest.raises(ValueError, match="steps_per_epoch"):
            dp.fit(CyclicBatches(x, y, batch_size=BS), epochs=1, steps_per_epoch=3, verbose=0)
        assert dp.ledger.num_releases == 0
        with pytest.raises(ValueError, match="blt"):
            compiled(tmp_path, name="b.jsonl", participation=Participation.cyclic_poisson(4, 0.5))
        with pytest.raises(ValueError, match="at most"):
            compiled(tmp_path, name="c.jsonl", noise_mechanism="banded", strategy=BandedStrategy([1, 0.5, 0.4, 0.3, 0.2]),
                     participation=Participation.cyclic_poisson(4, 0.5))
        with pytest.raises(ValueError, match="flat"):
            compiled(tmp_path, name="d.jsonl", batch_size=BS, clipping="per_layer")
        with pytest.raises(TypeError, match="epochs"):
            compiled(tmp_path, name="e.jsonl", batch_size=BS, epochs=None)
        with pytest.raises(ValueError, match="noise_mechanism"):
            compiled(tmp_path, name="f.jsonl", batch_size=BS, noise_mechanism=None, sampling_probability=0.2)
