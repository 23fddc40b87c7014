"""Gaussian noise drawn on a tensor's own device, from ChaCha20 with the core's stream layout.

On CPU the Rust core remains the path dpcore uses (``dpcore.gaussian_noise`` and the
mechanisms: faster there, and its sampler is a ziggurat with a longer tail). This module is for
parameters that live on an accelerator: the noise is generated there with plain torch tensor
ops, instead of d floats generated on the host and copied over PCIe every step. It runs
unchanged on CPU tensors, which is how the tests check it.

Generator. ChaCha20 (Bernstein 2008, "ChaCha, a variant of Salsa20"; the 20 rounds and the
state layout of RFC 8439 §2.3, with words 12–15 holding a 64-bit block counter and a 64-bit
stream number, as in the core and rand_chacha). The block function is evaluated for many
(stream, counter) pairs at once, one tensor row per state word, on int32 tensors: additions wrap
modulo 2^32 and the right half of each rotation is an arithmetic shift masked back to a logical
one, so the words are exact (the tests compare them with the core's). The key is 256 bits:
from the operating system (``os.urandom``, the source the core's ``getrandom`` reads) on every
call when ``seed`` is None — the only private mode — or, for an integer ``seed``, the key the
core derives from that seed (``_core.seed_key``). ``seed`` is for tests and reproductions only:
anyone who knows it can subtract the noise.

Stream layout. Output value ``i`` belongs to chunk ``c = i // NOISE_CHUNK`` (2^14 values) and
reads word ``i % NOISE_CHUNK`` of ChaCha20 stream ``stream_id(Noise, part, c) = 1 << 56 |
part << 32 | c`` of the key, the words in the core's order (word-major batches of sixteen
blocks: word ``16·w + l`` of batch ``t`` is word ``w`` of block ``16·t + l``). So the random
words are the ones the core's generator for that chunk reads, and they depend on the key alone,
not on the device, the thread count or the batching.

Transform. Each pair of words (``a``, ``b``) at positions (2j, 2j+1) of a chunk gives two
values by Box–Muller (Box & Muller 1958), in float64: ``u1 = (a + 1)·2^-32`` in (0, 1],
``θ = 2π·b·2^-32``, ``r = sqrt(-2 ln u1)``, values ``(r cos θ, r sin θ)``, times stddev, rounded
once to ``dtype``. Box–Muller suits an accelerator (no rejection, no tables, no branches);
float64 keeps ``u1`` and ``θ`` exact for 32-bit words. Its honest limits: ``|z| <=
sqrt(64 ln 2) = 6.660`` standard deviations (the smallest ``u1`` is 2^-32), where the exact
normal puts 2.7e-11 of its mass beyond; and ``u1``, ``θ`` take 2^32 values each. The core's
ziggurat reaches further into the tail, and its normals are NOT these: only the words agree.
As for the core, the accountant assumes the continuous Gaussian (floating-point caveat of
Mironov 2012). The transcendental functions are torch's for the device, so float bits may
differ between devices (CPU vs CUDA) even where the words agree.

Memory. Chunks are processed in batches of at most ``_batch_words(device)`` values (2^21 on
CPU, 2^24 on accelerators) with about 16 bytes of temporaries per batch value (the int32 state
and its copy, then the words and three float64 half-size vectors of Box–Muller), so the peak is
the output plus a bounded ~32 MiB on CPU (~256 MiB on a GPU) whatever the size of the draw;
measured on CPU for 10^7 float32 values: peak RSS 38 MiB of output + ~30 MiB.

Speed. Without kernel fusion every one of the ~2000 integer operations of a ChaCha20 batch is
one pass over memory, so this is memory-bound and far slower than ``torch.randn`` (which is not
a CSPRNG). On accelerators the block function is therefore compiled with ``torch.compile``
(one fused kernel: the 20 rounds stay in registers), on int64 words masked to 32 bits (no
signed overflow in any backend), dynamic in the batch length so it compiles once per device
type. Before its first use the compiled function is checked against the eager one on 4096
blocks; on any difference or compile error it is not used (a warning says so) and the eager
ops run instead, so the words are the core's either way. ``DPCORE_DEVICE_NOISE_COMPILE=0``
turns compilation off. On CPU (tests) it runs eagerly unless asked: the Rust core is faster
there. Measured on CPU only (no GPU was available), on a loaded 2-core VM: 10^7 values in
0.55 s compiled and 0.53 s eagerly (CPU batches stay in cache, so fusion gains nothing there),
after 60 s of compilation. On a GPU, where each unfused op is a pass over device memory, it is
untimed.
"""

from __future__ import annotations

import math
import numbers
import os
import struct
import warnings
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from . import opcount as _opcount
from .._validate import real as _real
from ..mechanism import _noise_shape, _seed

__all__ = ["device_gaussian_noise", "device_gaussian_noise_many", "chacha20_blocks", "chacha20_stream_words", "NOISE_CHUNK"]

#: Values per ChaCha20 stream; the core's ``NOISE_CHUNK`` (checked by the tests).
NOISE_CHUNK = 1 << 14
_BLOCKS_PER_CHUNK = NOISE_CHUNK // 16
_NOISE_DOMAIN = 1
_PART_LIMIT = 1 << 24
_CHUNK_LIMIT = 1 << 32
_TWO32 = 4294967296.0
# "expand 32-byte k", as signed int32.
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)


def _i32(v: int) -> int:
    """An unsigned 32-bit value as the int32 with the same bits."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _key_words(key: bytes) -> Tuple[int, ...]:
    if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
        raise ValueError("key must be 32 bytes")
    return struct.unpack("<8i", bytes(key))


def _batch_words(device: torch.device) -> int:
    """Values generated per batch: large on accelerators (few kernel launches per value),
    cache-sized on CPU."""
    return 1 << 21 if device.type == "cpu" else 1 << 24


# ---------------------------------------------------------------------------------------------
# The block function.


def _rotl_(x: torch.Tensor, r: int, tmp: torch.Tensor) -> None:
    """x <- x rotated left by r (32-bit), in place; tmp is scratch of x's shape."""
    torch.bitwise_right_shift(x, 32 - r, out=tmp)  # arithmetic on int32 ...
    tmp.bitwise_and_((1 << r) - 1)  # ... made logical
    x.bitwise_left_shift_(r)
    x.bitwise_or_(tmp)


def _quarter_round(x: List[torch.Tensor], a: int, b: int, c: int, d: int, tmp: torch.Tensor) -> None:
    xa, xb, xc, xd = x[a], x[b], x[c], x[d]
    xa.add_(xb)
    xd.bitwise_xor_(xa)
    _rotl_(xd, 16, tmp)
    xc.add_(xd)
    xb.bitwise_xor_(xc)
    _rotl_(xb, 12, tmp)
    xa.add_(xb)
    xd.bitwise_xor_(xa)
    _rotl_(xd, 8, tmp)
    xc.add_(xd)
    xb.bitwise_xor_(xc)
    _rotl_(xb, 7, tmp)


def _blocks_i32(
    key_words: Sequence[int],
    counter_lo: torch.Tensor,
    counter_hi: torch.Tensor,
    stream_lo: torch.Tensor,
    stream_hi: torch.Tensor,
) -> torch.Tensor:
    """The ChaCha20 blocks of N (counter, stream) pairs given as four int32 tensors of shape
    (N,) or broadcastable scalars (one 0-d tensor each): an int32 tensor of shape (16, N), row
    w holding word w of every block (the bits of the u32 words)."""
    n = counter_lo.shape[0]
    device = counter_lo.device
    state = torch.empty((16, n), dtype=torch.int32, device=device)
    for w, v in enumerate(_SIGMA):
        state[w].fill_(_i32(v))
    for w, v in enumerate(key_words):
        state[4 + w].fill_(v)
    state[12].copy_(counter_lo)
    state[13].copy_(counter_hi)
    state[14].copy_(stream_lo)
    state[15].copy_(stream_hi)
    x = state.clone()
    rows = list(x.unbind(0))
    tmp = torch.empty(n, dtype=torch.int32, device=device)
    for _ in range(10):
        _quarter_round(rows, 0, 4, 8, 12, tmp)
        _quarter_round(rows, 1, 5, 9, 13, tmp)
        _quarter_round(rows, 2, 6, 10, 14, tmp)
        _quarter_round(rows, 3, 7, 11, 15, tmp)
        _quarter_round(rows, 0, 5, 10, 15, tmp)
        _quarter_round(rows, 1, 6, 11, 12, tmp)
        _quarter_round(rows, 2, 7, 8, 13, tmp)
        _quarter_round(rows, 3, 4, 9, 14, tmp)
    x.add_(state)
    return x


_M32 = 0xFFFFFFFF


def _rotl64(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _qr64(x: List[torch.Tensor], a: int, b: int, c: int, d: int) -> None:
    x[a] = (x[a] + x[b]) & _M32
    x[d] = _rotl64(x[d] ^ x[a], 16)
    x[c] = (x[c] + x[d]) & _M32
    x[b] = _rotl64(x[b] ^ x[c], 12)
    x[a] = (x[a] + x[b]) & _M32
    x[d] = _rotl64(x[d] ^ x[a], 8)
    x[c] = (x[c] + x[d]) & _M32
    x[b] = _rotl64(x[b] ^ x[c], 7)


def _rounds64(state: torch.Tensor) -> torch.Tensor:
    """The ChaCha20 block function on a (16, N) int64 state of 32-bit words: a functional form
    (no in-place ops) for torch.compile to fuse into one kernel."""
    st = list(state.unbind(0))
    x = list(st)
    for _ in range(10):
        _qr64(x, 0, 4, 8, 12)
        _qr64(x, 1, 5, 9, 13)
        _qr64(x, 2, 6, 10, 14)
        _qr64(x, 3, 7, 11, 15)
        _qr64(x, 0, 5, 10, 15)
        _qr64(x, 1, 6, 11, 12)
        _qr64(x, 2, 7, 8, 13)
        _qr64(x, 3, 4, 9, 14)
    return torch.stack([(a + b) & _M32 for a, b in zip(x, st)])


#: Compiled block functions by device type (None: compilation failed or disagreed: eager ops).
_FUSED: dict = {}


def _blocks_fused(fn: Any, key_words: Sequence[int], counter_lo: torch.Tensor, counter_hi: torch.Tensor,
                  stream_lo: torch.Tensor, stream_hi: torch.Tensor) -> torch.Tensor:
    n = counter_lo.shape[0]
    state = torch.empty((16, n), dtype=torch.int64, device=counter_lo.device)
    for w, v in enumerate(_SIGMA):
        state[w].fill_(v & _M32)
    for w, v in enumerate(key_words):
        state[4 + w].fill_(v & _M32)
    for w, v in zip((12, 13, 14, 15), (counter_lo, counter_hi, stream_lo, stream_hi)):
        state[w].copy_(v.to(torch.int64) & _M32)
    return fn(state).to(torch.int32)  # the low 32 bits: the words' bits as int32


def _block_function(device: torch.device, fused: Optional[bool] = None) -> Any:
    """The block function for ``device``: the compiled one on accelerators once it has passed
    its check against the eager ops (or wherever ``fused=True``), else the eager one."""
    if fused is None:
        fused = device.type != "cpu" and os.environ.get("DPCORE_DEVICE_NOISE_COMPILE", "1") != "0"
    if not fused:
        return _blocks_i32
    key = device.type
    if key not in _FUSED:
        _FUSED[key] = None
        try:
            fn = torch.compile(_rounds64, dynamic=True)
            kw = tuple(_i32(0x9E3779B9 * (i + 1)) for i in range(8))
            k = torch.arange(4096, dtype=torch.int32, device=device)
            args = (k, k.flip(0), k * 3, torch.full_like(k, _i32(0xDEADBEEF)))
            if torch.equal(_blocks_fused(fn, kw, *args), _blocks_i32(kw, *args)):
                _FUSED[key] = fn
            else:
                warnings.warn(f"dpcore: the compiled ChaCha20 block function disagreed with the eager one on {key}; "
                              "using the eager ops", RuntimeWarning, stacklevel=3)
        except Exception as e:  # no compiler, unsupported backend: the eager ops are exact everywhere
            warnings.warn(f"dpcore: torch.compile of the ChaCha20 block function failed on {key} ({type(e).__name__}: "
                          f"{e}); using the eager ops", RuntimeWarning, stacklevel=3)
    fn = _FUSED[key]
    if fn is None:
        return _blocks_i32
    return lambda kw, *a: _blocks_fused(fn, kw, *a)


def _split64(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """An int64 tensor read as u64 (two's complement): its low and high 32-bit halves, int32."""
    lo = v.bitwise_and(0xFFFFFFFF).to(torch.int32)  # int64 -> int32 keeps the low 32 bits
    hi = v.bitwise_right_shift(32).to(torch.int32)
    return lo, hi


def chacha20_blocks(key: bytes, streams: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """ChaCha20 keystream blocks for many (stream, block counter) pairs at once.

    ``streams`` and ``counters`` are int64 tensors of one shape (N,) on the device to compute on,
    read as unsigned 64-bit (two's complement). Returns an int64 tensor of shape (N, 16) with the
    sixteen 32-bit words of each block (values in [0, 2^32)), in RFC 8439 word order.
    """
    kw = _key_words(key)
    if streams.dtype != torch.int64 or counters.dtype != torch.int64:
        raise TypeError("streams and counters must be int64 tensors")
    if streams.shape != counters.shape or streams.dim() != 1:
        raise ValueError("streams and counters must be 1-d tensors of one shape")
    c_lo, c_hi = _split64(counters)
    s_lo, s_hi = _split64(streams.to(counters.device))
    x = _blocks_i32(kw, c_lo, c_hi, s_lo, s_hi)
    return x.t().to(torch.int64).bitwise_and_(0xFFFFFFFF)


def _word_major(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """Blocks (16, chunks·B) of `chunks` streams (B blocks each, a multiple of 16) to the words of
    each stream in the core's order: shape (chunks, 16·B), int32."""
    b = x.shape[1] // chunks
    return x.view(16, chunks, b // 16, 16).permute(1, 2, 0, 3).reshape(chunks, 16 * b)


def _chunk_words(
    key_words: Sequence[int], part: int, first_chunk: int, chunks: int, blocks: int, device: torch.device,
    fused: Optional[bool] = None,
) -> torch.Tensor:
    """Words [0, 16·blocks) of the noise streams of chunks [first_chunk, first_chunk + chunks) of
    `part`, in the core's order: int32 of shape (chunks, 16·blocks)."""
    k = torch.arange(blocks, dtype=torch.int32, device=device)
    counter_lo = k.repeat(chunks)
    c = torch.arange(first_chunk, first_chunk + chunks, dtype=torch.int64, device=device)
    stream_lo = c.bitwise_and(0xFFFFFFFF).to(torch.int32).repeat_interleave(blocks)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    stream_hi = torch.tensor(_i32(_NOISE_DOMAIN << 24 | part), dtype=torch.int32, device=device)
    with _opcount.fused("chacha20_block"):
        x = _block_function(device, fused)(key_words, counter_lo, zero.expand(counter_lo.shape), stream_lo,
                                           stream_hi.expand(counter_lo.shape))
    return _word_major(x, chunks)


def chacha20_stream_words(
    key: bytes, part: int, chunk: int, n: int, start: int = 0, *, device: Union[str, torch.device] = "cpu"
) -> torch.Tensor:
    """Words ``[start, start + n)`` of the noise stream of chunk ``chunk`` of part ``part`` of the
    32-byte ``key``, in the core's order, as int64 values in [0, 2^32) on ``device``; the torch
    twin of ``dpcore._core.chacha_stream_words`` (``start`` < 2^62 here)."""
    kw = _key_words(key)
    part = _int_in("part", part, _PART_LIMIT)
    chunk = _int_in("chunk", chunk, _CHUNK_LIMIT)
    n = _int_in("n", n, 1 << 62)
    start = _int_in("start", start, 1 << 62)
    device = torch.device(device)
    first = (start // 256) * 16
    last = -(-(start + n) // 256) * 16
    counters = torch.arange(first, last, dtype=torch.int64, device=device)
    c_lo, c_hi = _split64(counters)
    s_lo = torch.tensor(_i32(chunk), dtype=torch.int32, device=device)
    s_hi = torch.tensor(_i32(_NOISE_DOMAIN << 24 | part), dtype=torch.int32, device=device)
    x = _blocks_i32(kw, c_lo, c_hi, s_lo, s_hi)
    words = _word_major(x, 1)[0]
    off = start - first * 16
    return words[off : off + n].to(torch.int64).bitwise_and_(0xFFFFFFFF)


# ---------------------------------------------------------------------------------------------
# Noise.


def _box_muller_(words: torch.Tensor, stddev: float, out: torch.Tensor) -> None:
    """Standard normals from an even number of int32 words (pairs at 2j, 2j+1), times stddev,
    written into ``out`` (same number of elements, any float dtype; rounded once)."""
    pairs = words.view(-1, 2)
    r = pairs[:, 0].to(torch.float64).remainder_(_TWO32)  # the u32 value, exactly
    r.add_(1.0).mul_(1.0 / _TWO32).log_().mul_(-2.0).sqrt_().mul_(stddev)
    theta = pairs[:, 1].to(torch.float64).remainder_(_TWO32).mul_(2.0 * math.pi / _TWO32)
    o = out.view(-1, 2)
    o[:, 0].copy_(torch.cos(theta).mul_(r))
    o[:, 1].copy_(theta.sin_().mul_(r))


def _int_in(name: str, v: Any, limit: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if not 0 <= v < limit:
        raise ValueError(f"{name} must be in [0, {limit}), got {v}")
    return v


def _key(seed: Optional[int]) -> bytes:
    if seed is None:
        return os.urandom(32)  # the private path: a fresh OS key for every call
    from .. import _core

    return bytes(_core.seed_key(seed))


def _check_draw(shape: Any, stddev: Any, dtype: Any) -> Tuple[Tuple[int, ...], float, int]:
    """(dims, stddev, number of values) of one draw, checked."""
    dims = _noise_shape(shape)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    sd = _real("stddev", stddev)
    if not (math.isfinite(sd) and sd >= 0.0):
        raise ValueError(f"stddev must be finite and >= 0, got {sd}")
    n = math.prod(dims)
    if n > _CHUNK_LIMIT * NOISE_CHUNK:
        raise ValueError(f"shape {dims} holds {n} values, more than the 2^46 the chunked streams can address")
    return dims, sd, n


def _device(device: Any) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    return torch.device(device)


def device_gaussian_noise(
    shape: Union[int, Sequence[int], torch.Size],
    stddev: float,
    *,
    device: Union[str, torch.device],
    dtype: torch.dtype = torch.float32,
    part: int = 0,
    seed: Optional[int] = None,
    fused: Optional[bool] = None,
) -> torch.Tensor:
    """A tensor of i.i.d. N(0, stddev²) values generated on ``device`` from ChaCha20.

    Value ``i`` comes from word ``i % NOISE_CHUNK`` (and its Box–Muller partner) of ChaCha20
    stream ``stream_id(Noise, part, i // NOISE_CHUNK)``, as in the core; see the module docs
    for the transform and its tail limit (6.66 standard deviations). ``seed=None`` keys the call
    from the OS (the private mode); an integer ``seed`` in [0, 2^64) uses the core's key for that
    seed, for tests and reproductions only. ``part`` in [0, 2^24) selects the streams, so
    different parts never share noise. ``dtype`` is torch.float32 or torch.float64 (computed in
    float64, rounded once). ``stddev`` 0 gives zeros without drawing. ``fused``: compile the
    block function (default: on accelerators; see the module docs); the words are the same.
    """
    dims, sd, n = _check_draw(shape, stddev, dtype)
    part = _int_in("part", part, _PART_LIMIT)
    seed = _seed(seed)
    dev = _device(device)
    if sd == 0.0 or n == 0:
        return torch.zeros(dims, dtype=dtype, device=dev)
    kw = _key_words(_key(seed))
    out = torch.empty(n, dtype=dtype, device=dev)
    full, rest = divmod(n, NOISE_CHUNK)
    per_batch = max(1, _batch_words(dev) // NOISE_CHUNK)
    for c0 in range(0, full, per_batch):
        k = min(per_batch, full - c0)
        words = _chunk_words(kw, part, c0, k, _BLOCKS_PER_CHUNK, dev, fused)
        _box_muller_(words, sd, out[c0 * NOISE_CHUNK : (c0 + k) * NOISE_CHUNK])
        del words
    if rest:
        blocks = -(-rest // 256) * 16  # whole 16-block batches, as the core reads them
        words = _chunk_words(kw, part, full, 1, blocks, dev, fused)[0]
        tail = torch.empty(16 * blocks, dtype=dtype, device=dev)
        _box_muller_(words, sd, tail)
        out[full * NOISE_CHUNK :].copy_(tail[:rest])
    return out.view(dims)


def _rows_words(
    key_words: Sequence[int], stream_hi: torch.Tensor, stream_lo: torch.Tensor, device: torch.device,
    fused: Optional[bool] = None,
) -> torch.Tensor:
    """The whole-chunk words of k noise streams at once, stream r being (``stream_hi[r]``,
    ``stream_lo[r]``) (int32 tensors of length k on ``device``): int32 of shape (k, NOISE_CHUNK),
    each row in the core's order (one block-function call for streams of different parts)."""
    k = stream_hi.shape[0]
    blocks = _BLOCKS_PER_CHUNK
    counter_lo = torch.arange(blocks, dtype=torch.int32, device=device).repeat(k)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    lo = stream_lo.repeat_interleave(blocks, output_size=k * blocks)
    hi = stream_hi.repeat_interleave(blocks, output_size=k * blocks)
    with _opcount.fused("chacha20_block"):  # one compiled kernel on an accelerator
        x = _block_function(device, fused)(key_words, counter_lo, zero.expand(counter_lo.shape), lo, hi)
    return _word_major(x, k)


def device_gaussian_noise_many(
    specs: Sequence[Tuple[Union[int, Sequence[int], torch.Size], float, torch.dtype]],
    *,
    device: Union[str, torch.device],
    seed: Optional[int] = None,
    fused: Optional[bool] = None,
) -> List[torch.Tensor]:
    """The noise of many tensors in one pass: ``specs`` is a sequence of (shape, stddev, dtype);
    tensor ``i`` equals ``device_gaussian_noise(shape_i, stddev_i, device=device, dtype=dtype_i,
    part=i, seed=seed)`` value for value (same key, part ``i``), so the tensors are independent
    and each is the core's layout.

    Why: a DP release noises every parameter, and one call per parameter costs a dozen kernel
    launches and a host-to-device copy each (about 2 ms a call on an H200, most of a small
    model's step). Here every chunk of every tensor goes through one block-function call per
    batch of ``_batch_words(device)`` values, and Box–Muller runs with a per-chunk stddev. The
    tensors returned are views into one buffer per dtype, padded to whole chunks (at most
    NOISE_CHUNK − 1 unused values per tensor). ``seed=None``: one OS key for the whole call (the
    private path); an integer is for tests and reproductions only."""
    items = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, (tuple, list)) or len(spec) != 3:
            raise TypeError(f"specs[{i}] must be a (shape, stddev, dtype) tuple, got {spec!r}")
        shape, stddev, dtype = spec
        try:
            dims, sd, n = _check_draw(shape, stddev, dtype)
        except (TypeError, ValueError) as e:
            raise type(e)(f"specs[{i}]: {e}") from None
        items.append((dims, sd, dtype, n))
    if len(items) > _PART_LIMIT:
        raise ValueError(f"at most {_PART_LIMIT} tensors per call (one part each), got {len(items)}")
    seed = _seed(seed)
    dev = _device(device)
    out: List[Optional[torch.Tensor]] = [None] * len(items)
    drawn = [i for i, (_, sd, _, n) in enumerate(items) if sd > 0.0 and n > 0]
    for i, (dims, sd, dtype, n) in enumerate(items):
        if not (sd > 0.0 and n > 0):
            out[i] = torch.zeros(dims, dtype=dtype, device=dev)
    if not drawn:
        return out  # type: ignore[return-value]
    kw = _key_words(_key(seed))
    per_batch = max(1, _batch_words(dev) // NOISE_CHUNK)
    for dtype in (torch.float32, torch.float64):
        mine = [i for i in drawn if items[i][2] == dtype]
        if not mine:
            continue
        # one row of NOISE_CHUNK values per chunk: (part, chunk index, stddev) of each row
        hi: List[int] = []
        lo: List[int] = []
        sds: List[float] = []
        start: List[int] = []
        for i in mine:
            chunks = -(-items[i][3] // NOISE_CHUNK)
            start.append(len(hi))
            hi += [_i32(_NOISE_DOMAIN << 24 | i)] * chunks
            lo += [_i32(c) for c in range(chunks)]
            sds += [items[i][1]] * chunks
        rows = len(hi)
        flat = torch.empty((rows, NOISE_CHUNK), dtype=dtype, device=dev)
        hi_t, lo_t, sd_t = _row_tables(hi, lo, sds, dev)
        for r0 in range(0, rows, per_batch):
            r1 = min(rows, r0 + per_batch)
            words = _rows_words(kw, hi_t[r0:r1], lo_t[r0:r1], dev, fused)
            _box_muller_rows_(words, sd_t[r0:r1], flat[r0:r1])
            del words
        # each tensor a view of its rows (one split for all, not a slice each), padding skipped
        sizes: List[int] = []
        for j, (i, s0) in enumerate(zip(mine, start)):
            end = start[j + 1] if j + 1 < len(start) else rows
            n = items[i][3]
            sizes += [n, (end - s0) * NOISE_CHUNK - n]
        pieces = flat.view(-1).split(sizes)
        for j, i in enumerate(mine):
            out[i] = pieces[2 * j].view(items[i][0])
    return out  # type: ignore[return-value]


#: The (stream hi, stream lo, stddev) tables of a draw's rows on its device, by their values: the
#: same every release of a run (a copy to the device made once, not three every step).
_TABLES: dict = {}


def _row_tables(hi: List[int], lo: List[int], sds: List[float], dev: torch.device) -> Tuple[torch.Tensor, ...]:
    key = (dev, tuple(hi), tuple(lo), tuple(sds))
    hit = _TABLES.get(key)
    if hit is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        hit = _TABLES[key] = (
            torch.tensor(hi, dtype=torch.int32).to(dev, non_blocking=True),
            torch.tensor(lo, dtype=torch.int32).to(dev, non_blocking=True),
            torch.tensor(sds, dtype=torch.float64).to(dev, non_blocking=True),
        )
    return hit


def _box_muller_rows_(words: torch.Tensor, stddevs: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`_box_muller_` for rows of words (k, NOISE_CHUNK) with one stddev per row (a
    float64 tensor of length k), written into ``out`` (k, NOISE_CHUNK); the same arithmetic in
    the same order, so each row equals the one-stddev transform of that row."""
    k = words.shape[0]
    pairs = words.view(k, -1, 2)
    r = pairs[:, :, 0].to(torch.float64).remainder_(_TWO32)
    r.add_(1.0).mul_(1.0 / _TWO32).log_().mul_(-2.0).sqrt_().mul_(stddevs.view(k, 1))
    theta = pairs[:, :, 1].to(torch.float64).remainder_(_TWO32).mul_(2.0 * math.pi / _TWO32)
    o = out.view(k, -1, 2)
    o[:, :, 0].copy_(torch.cos(theta).mul_(r))
    o[:, :, 1].copy_(theta.sin_().mul_(r))
