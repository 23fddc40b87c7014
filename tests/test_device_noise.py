"""Accelerator noise (dpcore.torch._device_noise): its ChaCha20 words are the core's, word for
word, on the core's stream layout; its normals are deterministic under a seed, independent of
threads and batching, and N(0, sd²) by standard tests. Run on CPU tensors here."""

from __future__ import annotations

import inspect
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
scipy_stats = pytest.importorskip("scipy.stats")

from dpcore import _core  # noqa: E402
from dpcore.torch import _device_noise as dn  # noqa: E402
from dpcore.torch._device_noise import (  # noqa: E402
    NOISE_CHUNK,
    chacha20_blocks,
    chacha20_stream_words,
    device_gaussian_noise,
)

CPU = torch.device("cpu")
TWO32 = 2.0**32
KEYS = [
    _core.seed_key(0),
    _core.seed_key(2**64 - 1),
    bytes(range(32)),
    bytes([0xFF] * 32),
    bytes.fromhex("9f3c1a0e5b7d2c4f8a6e1b3d5f7a9c0e2b4d6f8a1c3e5a7b9d0f2a4c6e8b0d1f"),
]


def core_words(key: bytes, part: int, chunk: int, n: int, start: int = 0) -> np.ndarray:
    w = _core.chacha_stream_words(key, part, chunk, n, start)
    assert w.dtype == np.uint32 and w.shape == (n,)
    return w


def torch_words(key: bytes, part: int, chunk: int, n: int, start: int = 0) -> np.ndarray:
    return chacha20_stream_words(key, part, chunk, n, start, device=CPU).numpy().astype(np.uint32)


def box_muller(words: np.ndarray, sd: float) -> np.ndarray:
    """The documented transform, in numpy, from the core's words."""
    w = words.astype(np.float64)
    r = np.sqrt(-2.0 * np.log((w[0::2] + 1.0) * (1.0 / TWO32))) * sd
    th = w[1::2] * (2.0 * math.pi / TWO32)
    z = np.empty(len(w))
    z[0::2] = np.cos(th) * r
    z[1::2] = np.sin(th) * r
    return z


# ---------------------------------------------------------------------------------------------
# (a) The words are the core's.


def test_chunk_size_is_the_cores() -> None:
    assert NOISE_CHUNK == _core.NOISE_CHUNK


def test_block_function_matches_rfc8439_test_vector() -> None:
    # RFC 8439 §2.3.2: key 00..1f, block counter 1, nonce 00:00:00:09:00:00:00:4a:00:00:00:00.
    # In the 64/64 layout, state words 12-15 are (1, 0x09000000, 0x4a000000, 0).
    counter = torch.tensor([1 | 0x09000000 << 32], dtype=torch.int64)
    stream = torch.tensor([0x4A000000], dtype=torch.int64)
    got = chacha20_blocks(bytes(range(32)), stream, counter)[0].tolist()
    want = [
        0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3, 0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
        0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9, 0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2,
    ]  # fmt: skip
    assert got == want


@pytest.mark.parametrize("key", KEYS, ids=["seed0", "seedmax", "iota", "ff", "fixed"])
@pytest.mark.parametrize(
    "part, chunk, start, n",
    [
        (0, 0, 0, 3000),  # several 16-block batches from the start
        (1, 1, 0, NOISE_CHUNK),  # a whole chunk's words
        (5, 12345, NOISE_CHUNK - 300, 600),  # across the end of a chunk's words
        (2**24 - 1, 2**32 - 1, 7, 1),  # the largest part and chunk
        (3, 2**31, 255, 2),  # across a batch boundary; chunk with the top bit of word 14
        (2, 9, ((1 << 32) - 16) * 16 + 5, 700),  # blocks 2^32 - 16 .. : counter carries into word 13
    ],
)
def test_stream_words_equal_the_cores(key: bytes, part: int, chunk: int, start: int, n: int) -> None:
    np.testing.assert_array_equal(torch_words(key, part, chunk, n, start), core_words(key, part, chunk, n, start))


@given(
    key=st.binary(min_size=32, max_size=32),
    part=st.integers(0, 2**24 - 1),
    chunk=st.integers(0, 2**32 - 1),
    start=st.integers(0, 2**40),
    n=st.integers(0, 600),
)
@settings(max_examples=30)
def test_stream_words_equal_the_cores_property(key: bytes, part: int, chunk: int, start: int, n: int) -> None:
    np.testing.assert_array_equal(torch_words(key, part, chunk, n, start), core_words(key, part, chunk, n, start))


def test_blocks_match_stream_words_block_by_block() -> None:
    # chacha20_blocks is block-major; the core's order is word-major within 16-block batches.
    key = KEYS[4]
    stream = 1 << 56 | 4 << 32 | 77
    blocks = chacha20_blocks(key, torch.full((48,), stream, dtype=torch.int64), torch.arange(48, dtype=torch.int64))
    words = core_words(key, 4, 77, 48 * 16).reshape(3, 16, 16)  # (batch, word, lane)
    want = words.transpose(0, 2, 1).reshape(48, 16)  # (block, word)
    np.testing.assert_array_equal(blocks.numpy().astype(np.uint32), want)


def test_batched_chunk_words_are_each_chunks_stream() -> None:
    key = KEYS[2]
    kw = dn._key_words(key)
    got = dn._chunk_words(kw, 7, 3, 3, NOISE_CHUNK // 16, CPU)
    assert got.shape == (3, NOISE_CHUNK)
    for j in range(3):
        np.testing.assert_array_equal(got[j].numpy().view(np.uint32), core_words(key, 7, 3 + j, NOISE_CHUNK))
    # A partial chunk: whole 16-block batches.
    tail = dn._chunk_words(kw, 7, 10, 1, 32, CPU)[0]
    np.testing.assert_array_equal(tail.numpy().view(np.uint32), core_words(key, 7, 10, 512))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("part, n", [(0, 2 * NOISE_CHUNK + 301), (3, 1000), (2**24 - 1, NOISE_CHUNK + 1)])
def test_noise_is_box_muller_of_the_cores_words(dtype: torch.dtype, part: int, n: int) -> None:
    # Chunk boundaries and a partial (odd-length) last chunk: every value from its own stream.
    seed, sd = 21, 1.75
    got = device_gaussian_noise(n, sd, device=CPU, dtype=dtype, part=part, seed=seed).numpy()
    key = _core.seed_key(seed)
    want = np.concatenate(
        [
            box_muller(core_words(key, part, c, NOISE_CHUNK), sd)[: min(NOISE_CHUNK, n - c * NOISE_CHUNK)]
            for c in range(-(-n // NOISE_CHUNK))
        ]
    )
    assert got.dtype == (np.float32 if dtype == torch.float32 else np.float64)
    rtol = 1e-6 if dtype == torch.float32 else 1e-12  # torch's log/cos vs numpy's: an ulp or so
    np.testing.assert_allclose(got, want.astype(got.dtype), rtol=rtol, atol=1e-12)


def test_os_keyed_path_uses_the_os_key(monkeypatch: pytest.MonkeyPatch) -> None:
    key = _core.seed_key(99)
    calls = []

    def fake_urandom(k: int) -> bytes:
        calls.append(k)
        return key

    monkeypatch.setattr(dn.os, "urandom", fake_urandom)
    a = device_gaussian_noise(5000, 1.0, device=CPU, part=2)
    monkeypatch.undo()
    assert calls == [32]
    assert torch.equal(a, device_gaussian_noise(5000, 1.0, device=CPU, part=2, seed=99))


def test_seed_key_is_the_key_of_the_cores_seeded_noise() -> None:
    # That seed_key(s) is Seed::Fixed(s).key() is checked by the Rust tests (rng.rs); here: the
    # map is fixed (a pinned value) and injective on a range.
    assert _core.seed_key(7) == _core.seed_key(7)
    assert len({_core.seed_key(s) for s in range(50)}) == 50
    assert _core.seed_key(7).hex() == "c80c403bd0206c0937a63b6ff24f251e3cbb2f1bb384565a9aa066150d1b203f"


# ---------------------------------------------------------------------------------------------
# (b) Determinism under a seed; streams differ.


def test_same_seed_same_bits_and_os_keys_differ() -> None:
    n = NOISE_CHUNK * 2 + 5
    a = device_gaussian_noise(n, 1.0, device=CPU, seed=4)
    b = device_gaussian_noise(n, 1.0, device=CPU, seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, device_gaussian_noise(n, 1.0, device=CPU, seed=5))
    x = device_gaussian_noise(n, 1.0, device=CPU)
    y = device_gaussian_noise(n, 1.0, device=CPU)
    assert (x != y).float().mean() > 0.99


def test_parts_and_chunks_get_different_noise() -> None:
    n = 3 * NOISE_CHUNK
    p0 = device_gaussian_noise(n, 1.0, device=CPU, seed=8, part=0)
    p1 = device_gaussian_noise(n, 1.0, device=CPU, seed=8, part=1)
    assert (p0 != p1).float().mean() > 0.99
    c = p0.view(3, NOISE_CHUNK)
    assert (c[0] != c[1]).float().mean() > 0.99 and (c[1] != c[2]).float().mean() > 0.99
    # Scaling: stddev multiplies the same draw.
    q = device_gaussian_noise(n, 3.0, device=CPU, seed=8, part=0)
    torch.testing.assert_close(q, 3.0 * p0, rtol=1e-6, atol=0)


def test_shape_and_prefix_consistency() -> None:
    a = device_gaussian_noise((3, 4, 5), 1.0, device=CPU, seed=2, dtype=torch.float64)
    assert a.shape == (3, 4, 5) and a.dtype == torch.float64 and a.is_contiguous()
    b = device_gaussian_noise(60, 1.0, device=CPU, seed=2, dtype=torch.float64)
    assert torch.equal(a.reshape(-1), b)
    # A draw is a prefix of a longer one (same streams, same positions).
    c = device_gaussian_noise(NOISE_CHUNK + 1000, 1.0, device=CPU, seed=2, dtype=torch.float64)
    assert torch.equal(c[:60], b)
    assert device_gaussian_noise((), 1.0, device=CPU, seed=2).shape == ()
    assert device_gaussian_noise((0, 7), 1.0, device=CPU, seed=2).shape == (0, 7)
    assert device_gaussian_noise(torch.Size([2, 3]), 1.0, device="cpu", seed=2).shape == (2, 3)


# ---------------------------------------------------------------------------------------------
# (c) Threads and batching do not change the bits.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_thread_count_does_not_change_bits(dtype: torch.dtype) -> None:
    n = (1 << 21) + 3 * NOISE_CHUNK + 77  # more than one CPU batch, a partial last chunk
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = device_gaussian_noise(n, 1.0, device=CPU, dtype=dtype, seed=13, part=1)
        torch.set_num_threads(2)
        two = device_gaussian_noise(n, 1.0, device=CPU, dtype=dtype, seed=13, part=1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_batch_size_does_not_change_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 5 * NOISE_CHUNK + 999
    a = device_gaussian_noise(n, 1.0, device=CPU, seed=6, dtype=torch.float64)
    monkeypatch.setattr(dn, "_batch_words", lambda device: 2 * NOISE_CHUNK)
    b = device_gaussian_noise(n, 1.0, device=CPU, seed=6, dtype=torch.float64)
    monkeypatch.setattr(dn, "_batch_words", lambda device: 1)
    c = device_gaussian_noise(n, 1.0, device=CPU, seed=6, dtype=torch.float64)
    assert torch.equal(a, b) and torch.equal(a, c)


# ---------------------------------------------------------------------------------------------
# (d) Statistics at fixed seeds.

N_STAT = 10**6
SD = 2.5


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["f32", "f64"])
def draw(request: pytest.FixtureRequest) -> np.ndarray:
    x = device_gaussian_noise(N_STAT, SD, device=CPU, dtype=request.param, seed=2024, part=1)
    return x.numpy().astype(np.float64)


def test_ks_against_the_normal(draw: np.ndarray) -> None:
    res = scipy_stats.kstest(draw, "norm", args=(0.0, SD))
    assert res.pvalue > 1e-4, res


def test_mean_and_variance_within_five_sigma(draw: np.ndarray) -> None:
    n = len(draw)
    assert abs(draw.mean()) < 5 * SD / math.sqrt(n)
    var = draw.var(ddof=1)
    assert abs(var - SD**2) < 5 * SD**2 * math.sqrt(2.0 / (n - 1))
    # Fourth moment: kurtosis 3 (a uniform or a clipped transform would miss it).
    k = np.mean((draw / SD) ** 4)
    assert abs(k - 3.0) < 5 * math.sqrt(96.0 / n)


def test_tail_frequency_beyond_four_sd(draw: np.ndarray) -> None:
    p = 2 * scipy_stats.norm.sf(4.0)  # 6.33e-5
    n = len(draw)
    count = int(np.sum(np.abs(draw) > 4 * SD))
    assert abs(count - n * p) < 5 * math.sqrt(n * p * (1 - p)), count
    # The documented hard limit of 32-bit Box-Muller: sqrt(64 ln 2) = 6.660 standard deviations.
    assert np.abs(draw).max() <= math.sqrt(64 * math.log(2)) * SD * (1 + 1e-6)
    # Both signs, both halves of each pair, populate the tails.
    for half in (draw[0::2], draw[1::2]):
        assert np.sum(half > 3 * SD) > 0.5 * len(half) * scipy_stats.norm.sf(3.0)
        assert np.sum(half < -3 * SD) > 0.5 * len(half) * scipy_stats.norm.sf(3.0)


def test_adjacent_values_are_uncorrelated(draw: np.ndarray) -> None:
    n = len(draw) - 1
    bound = 5 / math.sqrt(n)
    z = draw / SD
    for lag in (1, 2, NOISE_CHUNK):
        a, b = z[:-lag], z[lag:]
        assert abs(np.corrcoef(a, b)[0, 1]) < bound, lag
        # Squares too: a Box-Muller pair shares its radius, so dependence would show here.
        assert abs(np.corrcoef(a * a, b * b)[0, 1]) < bound, lag
    # Pairs (2j, 2j+1) specifically.
    a, b = z[0::2], z[1::2]
    m = len(a)
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(m)
    assert abs(np.corrcoef(a * a, b * b)[0, 1]) < 5 / math.sqrt(m)
    assert abs(np.corrcoef(np.abs(a), np.abs(b))[0, 1]) < 5 / math.sqrt(m)


# ---------------------------------------------------------------------------------------------
# (e) Bad input.


def test_zero_stddev_gives_zeros_without_drawing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*_: object) -> bytes:
        raise AssertionError("drew a key")

    monkeypatch.setattr(dn, "_key", no)
    z = device_gaussian_noise((4, 5), 0.0, device=CPU, dtype=torch.float64)
    assert z.dtype == torch.float64 and z.shape == (4, 5) and not z.any()
    assert not device_gaussian_noise(10, -0.0, device=CPU, seed=1).any()


@pytest.mark.parametrize("sd", [-1.0, -1e-300, float("nan"), float("inf"), -float("inf")])
def test_bad_stddev_is_a_value_error(sd: float) -> None:
    with pytest.raises(ValueError, match="stddev"):
        device_gaussian_noise(4, sd, device=CPU, seed=1)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"stddev": "1"}, TypeError, "stddev"),
        ({"stddev": True}, TypeError, "stddev"),
        ({"stddev": None}, TypeError, "stddev"),
        ({"dtype": torch.float16}, TypeError, "dtype"),
        ({"dtype": torch.bfloat16}, TypeError, "dtype"),
        ({"dtype": torch.int32}, TypeError, "dtype"),
        ({"dtype": np.float32}, TypeError, "dtype"),
        ({"shape": (-1, 2)}, ValueError, "shape"),
        ({"shape": (2.5,)}, TypeError, "shape"),
        ({"shape": (True, 2)}, TypeError, "shape"),
        ({"shape": "abc"}, TypeError, "shape"),
        ({"shape": -3}, ValueError, "shape"),
        ({"shape": (2**40, 2**7)}, ValueError, "2\\^46"),
        ({"part": -1}, ValueError, "part"),
        ({"part": 2**24}, ValueError, "part"),
        ({"part": 1.0}, TypeError, "part"),
        ({"part": True}, TypeError, "part"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"seed": True}, TypeError, "seed"),
        ({"device": 3.5}, TypeError, "device"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, exc: type, match: str) -> None:
    args = {"shape": 8, "stddev": 1.0, "device": CPU, "seed": 1}
    args.update(kwargs)
    shape, stddev = args.pop("shape"), args.pop("stddev")
    with pytest.raises(exc, match=match):
        device_gaussian_noise(shape, stddev, **args)


def test_unknown_device_raises() -> None:
    with pytest.raises(RuntimeError):
        device_gaussian_noise(8, 1.0, device="nodevice", seed=1)


def test_signature_is_the_integration_contract() -> None:
    sig = inspect.signature(device_gaussian_noise)
    params = sig.parameters
    assert list(params)[:2] == ["shape", "stddev"]
    for name in ("device", "dtype", "part", "seed"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["dtype"].default is torch.float32
    assert params["part"].default == 0 and params["seed"].default is None
    assert params["device"].default is inspect.Parameter.empty


def test_core_bindings_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        _core.chacha_stream_words(b"\x00" * 31, 0, 0, 4)
    with pytest.raises(ValueError, match="part"):
        _core.chacha_stream_words(b"\x00" * 32, 2**24, 0, 4)
    with pytest.raises(ValueError, match="chunk"):
        _core.chacha_stream_words(b"\x00" * 32, 0, 2**32, 4)
    with pytest.raises(ValueError, match="start"):
        _core.chacha_stream_words(b"\x00" * 32, 0, 0, 4, 2**64 - 2)
    with pytest.raises(OverflowError):
        _core.seed_key(-1)
    with pytest.raises(OverflowError):
        _core.seed_key(2**64)
    assert len(_core.chacha_stream_words(b"\x00" * 32, 0, 0, 0)) == 0
    with pytest.raises(ValueError, match="32 bytes"):
        chacha20_stream_words(b"\x00" * 31, 0, 0, 4)
    with pytest.raises(TypeError):
        chacha20_blocks(bytes(32), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# The compiled (fused) block function, used on accelerators: forced on CPU here.


def test_compiled_block_function_gives_the_cores_words_and_the_same_noise() -> None:
    key = KEYS[4]
    kw = dn._key_words(key)
    got = dn._chunk_words(kw, 5, 2, 2, NOISE_CHUNK // 16, CPU, fused=True)
    assert dn._FUSED.get("cpu") is not None  # compiled and passed its self-check
    for j in range(2):
        np.testing.assert_array_equal(got[j].numpy().view(np.uint32), core_words(key, 5, 2 + j, NOISE_CHUNK))
    tail = dn._chunk_words(kw, 5, 9, 1, 48, CPU, fused=True)[0]  # another length: no recompilation needed
    np.testing.assert_array_equal(tail.numpy().view(np.uint32), core_words(key, 5, 9, 768))
    for dtype in (torch.float32, torch.float64):
        a = device_gaussian_noise((3, NOISE_CHUNK + 77), 0.9, device=CPU, dtype=dtype, seed=8, fused=True)
        b = device_gaussian_noise((3, NOISE_CHUNK + 77), 0.9, device=CPU, dtype=dtype, seed=8, fused=False)
        assert torch.equal(a, b)


def test_a_compiled_function_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # A miscompiled kernel (here: one word flipped) fails the self-check: a warning, eager ops.
    monkeypatch.setattr(dn, "_FUSED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (lambda s: fn(s) ^ (s[:1] * 0 + 1)))
    with pytest.warns(RuntimeWarning, match="disagreed"):
        f = dn._block_function(CPU, fused=True)
    assert f is dn._blocks_i32
    monkeypatch.setattr(dn, "_FUSED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (_ for _ in ()).throw(RuntimeError("no compiler")))
    with pytest.warns(RuntimeWarning, match="no compiler"):
        assert dn._block_function(CPU, fused=True) is dn._blocks_i32


# ---------------------------------------------------------------------------------------------
# In the optimizer: noise drawn where the parameters live.


@pytest.mark.parametrize("mode", ["device", "host", "auto"])
def test_dp_optimizer_draws_noise_on_the_device_when_asked(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    from dpcore.torch import DPOptimizer
    from dpcore.torch import _noise as optmod  # the optimizer's noise stage

    calls: list = []
    real = optmod.device_gaussian_noise_many

    def spy(*a, **kw):
        calls.append(kw["device"])
        return real(*a, **kw)

    monkeypatch.setattr(optmod, "device_gaussian_noise_many", spy)
    torch.manual_seed(0)
    net = torch.nn.Linear(300, 200)
    opt = DPOptimizer(torch.optim.SGD(net.parameters(), lr=1.0), model=net, noise_multiplier=1.5, max_grad_norm=2.0,
                      expected_batch_size=8.0)
    opt.noise_device = mode
    before = [p.detach().clone() for p in net.parameters()]
    x = torch.randn(8, 300)
    (net(x) * 0.0).sum().backward()  # zero gradients: the update is the noise alone
    opt.ledger.record_sample(800, 0.01, "poisson")
    opt.step()
    upd = torch.cat([(b - p.detach()).reshape(-1) for p, b in zip(net.parameters(), before)]).double()
    want = 1.5 * 2.0 / 8.0
    n = upd.numel()
    assert abs(upd.std().item() / want - 1) < 5 / (2 * n) ** 0.5
    # (one call for all parameters; the next release's noise is drawn ahead, in the background:
    # 2 calls per release)
    assert (len(calls) >= 2) == (mode == "device")  # "auto" on CPU parameters: the core
    assert all(d == torch.device("cpu") for d in calls)
    with pytest.raises(ValueError, match="noise_device"):
        opt.noise_device = "gpu"
    assert opt.noise_device == mode


# ---------------------------------------------------------------------------------------------
# Many tensors in one call: each is the one-tensor call with its own part.


@pytest.mark.parametrize("seed", [0, 12345])
def test_many_equals_one_call_per_part(seed: int) -> None:
    from dpcore.torch._device_noise import device_gaussian_noise_many

    specs = [((3, 5), 1.5, torch.float32), ((2 * NOISE_CHUNK + 7,), 0.5, torch.float64), (100, 0.0, torch.float32),
             ((300, 200), 2.0, torch.float32), ((0,), 1.0, torch.float32), ((NOISE_CHUNK,), 3.0, torch.float64)]
    many = device_gaussian_noise_many(specs, device=CPU, seed=seed)
    assert len(many) == len(specs)
    for i, (shape, sd, dt) in enumerate(specs):
        one = device_gaussian_noise(shape, sd, device=CPU, dtype=dt, part=i, seed=seed)
        assert many[i].shape == one.shape and many[i].dtype == dt
        assert torch.equal(many[i], one), i
    # small batches (several block-function calls) give the same bits
    import dpcore.torch._device_noise as mod

    orig = mod._batch_words
    try:
        mod._batch_words = lambda d: NOISE_CHUNK
        again = device_gaussian_noise_many(specs, device=CPU, seed=seed)
    finally:
        mod._batch_words = orig
    assert all(torch.equal(a, b) for a, b in zip(many, again))


def test_many_os_keyed_tensors_differ_and_bad_specs_raise() -> None:
    from dpcore.torch._device_noise import device_gaussian_noise_many

    a, b = device_gaussian_noise_many([(1000, 1.0, torch.float32)] * 2, device=CPU)
    assert not torch.equal(a, b)  # different parts
    c = device_gaussian_noise_many([(1000, 1.0, torch.float32)], device=CPU)[0]
    assert not torch.equal(a, c)  # a fresh OS key per call
    with pytest.raises(TypeError, match="specs"):
        device_gaussian_noise_many([(10, 1.0)], device=CPU)
    with pytest.raises(ValueError, match="stddev"):
        device_gaussian_noise_many([(10, -1.0, torch.float32)], device=CPU)
    with pytest.raises(TypeError, match="dtype"):
        device_gaussian_noise_many([(10, 1.0, torch.float16)], device=CPU)
