"""Bad input: a clear Python exception, nothing computed, never a panic or an abort."""

import numpy as np
import pytest

import dpcore

GOOD = np.ones((3, 4), np.float32)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_non_finite_record_names_first_bad_index_when_asked_to_raise(bad, dt):
    # on_nonfinite="raise": the debugging aid (not DP) keeps the old error, naming the first record
    x = np.ones((400, 5000), dt)
    x[123, 17] = bad
    x[300, 0] = np.nan
    for call in (
        lambda: dpcore.clip_noise(x, 1.0, 1.0, on_nonfinite="raise"),
        lambda: dpcore.clip_noise(x, 1.0, 1.0, on_nonfinite="raise", mechanism="discrete_gaussian"),
        lambda: dpcore.clip_sum([np.ones((400, 2)), x], 1.0, on_nonfinite="raise"),
        lambda: dpcore.record_norms(x, on_nonfinite="raise"),
    ):
        with pytest.raises(ValueError, match=r"record 123\b.*NaN or infinite"):
            call()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_non_finite_record_adds_zero_by_default(bad, dt):
    # the default (on_nonfinite="zero"): no error; the record adds exactly zero, its norm is NaN
    x = np.ones((400, 5000), dt)
    x[123, 17] = bad
    x[300, 0] = np.nan
    keep = np.setdiff1d(np.arange(400), [123, 300])
    (_, s), norms = dpcore.clip_sum([np.ones((400, 2)), x], 1.0)
    (_, ref), ref_norms = dpcore.clip_sum([np.ones((398, 2)), x[keep]], 1.0)
    np.testing.assert_array_equal(s, ref)
    assert np.isnan(norms[[123, 300]]).all() and np.array_equal(norms[keep], ref_norms)
    np.testing.assert_array_equal(dpcore.clip_noise(x, 1.0, 1.0, seed=3), dpcore.clip_noise(x[keep], 1.0, 1.0, seed=3))
    n = dpcore.record_norms(x)
    assert np.flatnonzero(np.isnan(n)).tolist() == [123, 300]


def test_non_finite_in_second_array_of_a_list():
    a, b = np.ones((5, 3)), np.ones((5, 2), np.float32)
    b[2, 1] = np.inf
    with pytest.raises(ValueError, match="record 2"):
        dpcore.clip_noise([a, b], 1.0, 1.0, on_nonfinite="raise")
    out = dpcore.clip_noise([a, b], 1.0, 0.0)
    ref = dpcore.clip_noise([np.delete(a, 2, 0), np.delete(b, 2, 0)], 1.0, 0.0)
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(o, r)


@pytest.mark.parametrize("mode", ["ZERO", "ignore", None, 0, True])
def test_on_nonfinite_must_be_zero_or_raise(mode):
    for call in (
        lambda: dpcore.clip_noise(GOOD, 1.0, 1.0, on_nonfinite=mode),
        lambda: dpcore.clip_sum(GOOD, 1.0, on_nonfinite=mode),
        lambda: dpcore.record_norms(GOOD, on_nonfinite=mode),
        lambda: dpcore.GaussianSumQuery(1.0, 1.0, on_nonfinite=mode),
    ):
        with pytest.raises(ValueError, match="on_nonfinite must be 'zero' or 'raise'"):
            call()


def test_mismatched_batch_sizes():
    with pytest.raises(ValueError, match="records"):
        dpcore.clip_noise([np.ones((3, 2)), np.ones((4, 2))], 1.0, 1.0)


@pytest.mark.parametrize("dt", [np.int32, np.int64, np.bool_, np.complex64, np.complex128, np.float16, object])
def test_non_float_dtypes_are_type_errors(dt):
    x = np.ones((3, 2), dtype=dt)
    for call in (
        lambda: dpcore.clip_noise(x, 1.0, 1.0),
        lambda: dpcore.clip_sum([GOOD, x], 1.0),
        lambda: dpcore.record_norms(x),
    ):
        with pytest.raises(TypeError):
            call()


@pytest.mark.parametrize("clip", [0.0, -1.0, np.nan, np.inf, -np.inf])
def test_bad_clip(clip):
    with pytest.raises(ValueError, match="l2_norm_clip"):
        dpcore.clip_noise(GOOD, clip, 1.0)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        dpcore.clip_sum(GOOD, clip)


@pytest.mark.parametrize("z", [-1e-9, np.nan, np.inf])
def test_bad_noise_multiplier(z):
    with pytest.raises(ValueError, match="noise_multiplier"):
        dpcore.clip_noise(GOOD, 1.0, z)


@pytest.mark.parametrize("d", [0.0, -2.0, np.nan, np.inf])
def test_bad_denominator(d):
    with pytest.raises(ValueError, match="denominator"):
        dpcore.clip_noise(GOOD, 1.0, 1.0, denominator=d)


def test_noise_overflow_is_a_value_error():
    with pytest.raises(ValueError, match="noise_multiplier"):
        dpcore.clip_noise(GOOD, 1e300, 1e300)


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda: dpcore.clip_noise(GOOD, "1", 1.0), TypeError),
        (lambda: dpcore.clip_noise(GOOD, None, 1.0), TypeError),
        (lambda: dpcore.clip_noise(GOOD, 1.0, 1.0, seed=-1), ValueError),
        (lambda: dpcore.clip_noise(GOOD, 1.0, 1.0, seed=2**64), ValueError),
        (lambda: dpcore.clip_noise(GOOD, 1.0, 1.0, seed=1.5), TypeError),
        (lambda: dpcore.clip_noise(np.float32(3.0), 1.0, 1.0), ValueError),
        (lambda: dpcore.clip_noise([], 1.0, 1.0), ValueError),
        (lambda: dpcore.clip_noise([GOOD, GOOD], 1.0, 1.0, scales=[1.0]), ValueError),
        (lambda: dpcore.clip_noise([GOOD, GOOD], 1.0, 1.0, scales=[1.0, 0.0]), ValueError),
        (lambda: dpcore.clip_noise([GOOD, GOOD], 1.0, 1.0, scales=[1.0, np.nan]), ValueError),
        (lambda: dpcore.clip_sum(GOOD, 1.0, dtype=np.int32), TypeError),
        (lambda: dpcore.gaussian_noise((2, -1), 1.0), ValueError),
        (lambda: dpcore.gaussian_noise((2, 3), -1.0), ValueError),
        (lambda: dpcore.gaussian_noise((2, 3), np.nan), ValueError),
        (lambda: dpcore.gaussian_noise((2, 3), 1.0, dtype=np.int32), TypeError),
        (lambda: dpcore.gaussian_noise("abc", 1.0), TypeError),
        (lambda: dpcore.poisson_sample(10, 1.5), ValueError),
        (lambda: dpcore.poisson_sample(-1, 0.5), ValueError),
        (lambda: dpcore.fixed_size_sample(3, 4), ValueError),
    ],
)
def test_bad_arguments(call, exc):
    with pytest.raises(exc):
        call()


def test_impossible_sizes_are_memory_errors_not_aborts():
    with pytest.raises(MemoryError):
        dpcore.gaussian_noise((2**40, 2**20), 1.0)
    with pytest.raises(MemoryError):
        dpcore.poisson_sample(2**62, 0.5)


def test_no_panic_reaches_python():
    # PanicException derives from BaseException, so catching Exception would miss it: make sure
    # every odd input surfaces as an ordinary Exception subclass.
    odd = [
        lambda: dpcore.clip_noise(np.ones((2, 0), np.float32), 1.0, 1.0),
        lambda: dpcore.clip_noise(np.ones((0,), np.float64), 1.0, 1.0),
        lambda: dpcore.clip_noise(np.ones((1, 1)) * 1e308, 1e-308, 0.0),
        lambda: dpcore.clip_noise(np.full((1, 3), 5e-324), 1e-320, 1.0),
        lambda: dpcore.gaussian_noise(0, 1.0),
        lambda: dpcore.gaussian_noise((), 0.0),
        lambda: dpcore.poisson_sample(0, 0.0),
        lambda: dpcore.poisson_sample(2**40, 1e-12),
    ]
    for call in odd:
        try:
            call()
        except Exception:
            pass


# -- inputs that used to be handled wrongly --------------------------------------------------


def test_subnormal_records_have_their_true_norm():
    import numpy as np

    import dpcore

    x = np.full((2, 4), 1e-310)
    np.testing.assert_allclose(dpcore.record_norms([x]), [2e-310, 2e-310], rtol=1e-12)
    s, norms = dpcore.clip_sum([x], 1.0)
    assert s[0].tolist() == [2e-310] * 4  # kept, not zeroed: the norm is far below C


def test_noise_shape_overflow_is_a_clear_error():
    import dpcore

    with pytest.raises((ValueError, MemoryError), match=r"1099511627776"):
        dpcore.gaussian_noise((2**40, 2**40), 1.0)
    with pytest.raises(MemoryError, match="shape"):
        dpcore.gaussian_noise((2**20, 2**20), 1.0)


def test_ledger_on_a_directory_is_a_ledger_error(tmp_path):
    import dpcore
    from dpcore.ledger import LedgerError

    for open_ in (dpcore.PrivacyLedger, dpcore.PrivacyLedger.load):
        with pytest.raises(LedgerError, match=str(tmp_path)):
            open_(tmp_path)


def test_full_disk_step_is_not_released_and_the_ledger_holds_the_released_steps(tmp_path):
    """Under a small RLIMIT_FSIZE the ledger's write fails part-way through a run: the failing
    step raises (its noised result is never returned), and the ledger holds exactly the
    releases that were returned. Run in a child process so the limit stays there."""
    import subprocess
    import sys
    import textwrap

    p = tmp_path / "full.jsonl"
    code = textwrap.dedent(
        f"""
        import resource, signal, json
        import numpy as np
        import dpcore
        from dpcore.queries import GaussianAverageQuery
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
        led = dpcore.PrivacyLedger({str(p)!r})
        agg = dpcore.PrivateAggregator(GaussianAverageQuery(1.0, 1.1, 10.0), led, 100, 0.1)
        returned = 0
        try:
            for _ in range(1000):
                idx = agg.sample()
                agg.aggregate(np.ones((len(idx), 3)))
                returned += 1
        except dpcore.ledger.LedgerError as e:
            print(json.dumps({{"returned": returned, "error": str(e)}}))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = __import__("json").loads(res.stdout.strip().splitlines()[-1])
    assert 0 < out["returned"] < 1000 and "could not write" in out["error"]
    led = dpcore_load(p)
    assert led.num_releases == out["returned"]
    assert p.stat().st_size <= 2000


def dpcore_load(p):
    import dpcore

    return dpcore.PrivacyLedger.load(p)
