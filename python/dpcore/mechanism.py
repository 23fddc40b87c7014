"""The Gaussian sum mechanism on numpy arrays: concern (b) of McMahan et al. 2018.

Every function here takes the per-record arrays of one batch: a single array of shape (B, ...)
or a list/tuple of such arrays (one per parameter tensor of a model). Record i is row i of all of
them taken together, and its norm is the joint L2 norm over all arrays ("flat clipping", §2 of the
paper). Arrays are read in place by the Rust core, without copies, when they are C-contiguous,
aligned and native-endian; other layouts are copied once.

Randomness: noise is drawn from ChaCha20 keyed afresh from the operating system on every call.
Passing ``seed`` replaces that key with a deterministic one. **A seed is for tests and
reproductions only**: anyone who knows it can recompute and subtract the noise, so output
produced with a seed carries no privacy guarantee.

Non-finite records (``on_nonfinite``). A record with a NaN or ±∞ value anywhere in its arrays
contributes exactly zero to the sum, and its norm is reported as NaN; the release goes ahead
(``on_nonfinite="zero"``, the default). This is differentially private: the clip bounds every
record's contribution by C (McMahan et al. 2018, §2) and the zero vector has norm 0 ≤ C, so
replacing a record by zero is the change of one record that the privacy analysis already
covers. Raising instead would not be: whether the call fails would depend on one record, and an
adversary who plants a NaN record would learn whether it was sampled (Cebere et al., PETS 2026,
grey-box auditing of DP libraries). ``on_nonfinite="raise"`` raises ``ValueError`` naming the
first such record, **a debugging aid whose behaviour depends on the data: not differentially
private**. Huge finite values (whose squares overflow) and subnormal ones are finite records,
clipped as usual.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _trace
from ._validate import parts as _parts, real as _real
from . import _core

ArrayLike = Any
Grads = Union[np.ndarray, Sequence[np.ndarray]]

_SEED_LIMIT = 1 << 64



def _seed(seed: Any) -> Optional[int]:
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be None or an int, got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def _dim(d: Any) -> int:
    if isinstance(d, bool):
        raise TypeError("a dimension must be an int")
    return operator.index(d)


def _noise_shape(shape: Any) -> Tuple[int, ...]:
    """A noise array's shape from an int or a sequence of ints (no bools, none negative)."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (int(shape),)
    try:
        dims = tuple(_dim(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must not have negative dimensions, got {dims}")
    return dims


_NATIVE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _float_array(a: ArrayLike, k: int) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype in _NATIVE_FLOATS and a.ndim and a.flags.c_contiguous and a.flags.aligned:
        return a  # the common case, without np.require's overhead (a per-group cost in a NestedQuery)
    arr = a if isinstance(a, np.ndarray) else np.asarray(a)
    dt = arr.dtype
    if dt.kind != "f" or dt.itemsize not in (4, 8):
        raise TypeError(
            f"array {k}: records must be float32 or float64, got dtype {dt}"
            + (" (cast with .astype(numpy.float32))" if dt.kind == "f" else "")
        )
    if arr.ndim == 0:
        raise ValueError(f"array {k}: needs a leading record axis, got a 0-d array")
    # Read in place when possible; copy only for non-contiguous, misaligned or byte-swapped input.
    return np.require(arr, dtype=dt.newbyteorder("="), requirements=["C", "A"])


def _unpack(grads: Grads) -> Tuple[List[np.ndarray], type]:
    """The arrays of a batch, and the container type to give results back in."""
    arrays, kind = _parts(grads, "grads", _float_array)
    batch = arrays[0].shape[0]
    for k, a in enumerate(arrays[1:], start=1):
        if a.shape[0] != batch:
            raise ValueError(f"array {k} has {a.shape[0]} records (leading axis) but array 0 has {batch}")
    return arrays, kind


def _scales(scales: Any, n: int) -> Optional[List[float]]:
    if scales is None:
        return None
    if isinstance(scales, numbers.Real):
        raise TypeError("scales must be a sequence with one scale per array")
    vals = [_real("scales", a) for a in scales]
    if len(vals) != n:
        raise ValueError(f"scales has {len(vals)} values but grads has {n} arrays")
    return vals


def _pack(flat: List[np.ndarray], arrays: List[np.ndarray], kind: type) -> Any:
    outs = [f.reshape(a.shape[1:]) for f, a in zip(flat, arrays)]
    if kind is np.ndarray:
        return outs[0]
    return kind(outs)


MECHANISMS = ("gaussian", "discrete_gaussian")

#: What a record with a NaN or infinite value gets (``on_nonfinite=``): zero contribution (the
#: default, differentially private) or a ``ValueError`` (debugging only; see the module docs).
ON_NONFINITE = ("zero", "raise")


def check_on_nonfinite(on_nonfinite: Any) -> str:
    """``on_nonfinite`` checked: one of :data:`ON_NONFINITE`."""
    if not isinstance(on_nonfinite, str) or on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be 'zero' or 'raise', got {on_nonfinite!r}")
    return on_nonfinite


def nonfinite_error(index: int) -> ValueError:
    """The ``on_nonfinite="raise"`` error for record ``index``."""
    return ValueError(
        f"record {index} contains a NaN or infinite value (on_nonfinite='raise', a debugging aid that is not "
        "differentially private; the default on_nonfinite='zero' gives such a record zero contribution)"
    )


def check_norms(norms: np.ndarray, on_nonfinite: str, batch: Optional[int] = None) -> None:
    """With ``on_nonfinite="raise"``, the ``ValueError`` naming the first record whose norm is NaN
    (the core's mark of a record with a NaN or infinite value; a finite record never has one).
    ``norms`` may be group-major (G·B values): a non-finite record is NaN in every group, so the
    first ``batch`` values (group 0) tell. With ``"zero"`` nothing is looked at."""
    if on_nonfinite == "zero":
        return
    head = norms if batch is None else norms[:batch]
    bad = np.flatnonzero(np.isnan(head))
    if bad.size:
        raise nonfinite_error(int(bad[0]))


def check_mechanism(mechanism: Any) -> str:
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be 'gaussian' or 'discrete_gaussian', got {mechanism!r}")
    return mechanism


@dataclass(frozen=True)
class DiscreteGaussianParams:
    """The fixed parameters of a discrete Gaussian release (Canonne, Kamath & Steinke 2020).

    ``granularity`` is the grid step γ; ``sensitivity`` the L2 bound of one record's contribution
    after rounding onto the grid (≥ ``l2_norm_clip``: c + √d/2 grid steps for records rounded one
    by one, c + √d when only the sum is rounded; Kairouz, Liu & Steinke 2021, §4), rounded up;
    ``stddev`` the noise's σ in the records' units, rounded down (σ·γ ≥ z·C is what is sampled).
    The privacy tuple recorded for the release is (``sensitivity``, ``stddev``).
    """

    granularity: float
    sensitivity: float
    stddev: float
    sens_sq: int
    variance_ratio: Tuple[int, int]

    @property
    def noise_multiplier(self) -> float:
        """σ/Δ: the noise multiplier the accountant uses (slightly below the requested one)."""
        return self.stddev / self.sensitivity


def _params(t: Tuple[float, int, int, int, float, float]) -> DiscreteGaussianParams:
    g, s, n, d, sens, sd = t
    return DiscreteGaussianParams(g, sens, sd, s, (n, d))


def discrete_gaussian_params(
    l2_norm_clip: float,
    noise_multiplier: float,
    dimension: int,
    *,
    granularity: Optional[float] = None,
    rounding: str = "per_record",
) -> DiscreteGaussianParams:
    """The parameters a discrete Gaussian release over ``dimension`` coordinates will use.

    ``granularity`` None picks the largest power of two whose sensitivity inflation is at most
    10⁻⁴ (a power of two keeps every output an exact float multiple of γ). ``rounding`` is
    "per_record" (:func:`clip_noise`, the queries) or "sum" (the torch optimizer, which forms the
    sum itself). Deterministic: the same arguments give the same parameters.
    """
    if rounding not in ("per_record", "sum"):
        raise ValueError(f"rounding must be 'per_record' or 'sum', got {rounding!r}")
    g = None if granularity is None else _real("granularity", granularity)
    return _params(
        _core.discrete_params(
            _real("l2_norm_clip", l2_norm_clip),
            _real("noise_multiplier", noise_multiplier),
            operator.index(dimension),
            g,
            rounding == "per_record",
        )
    )


def discrete_sum_release(
    sums: Sequence[np.ndarray],
    *,
    l2_norm_clip: float,
    noise_multiplier: float,
    granularity: float,
    part_scales: Optional[Sequence[float]] = None,
    denominator: Optional[float] = None,
    seed: Optional[int] = None,
) -> List[np.ndarray]:
    """The discrete Gaussian release of clipped sums formed by the caller (the torch optimizer).

    Part j's sum (in the records' units, not divided) is rounded to the nearest point of the grid
    γ·α_j·ℤ^d, γ = ``granularity``; N_ℤ(0, σ²) is added to every coordinate in grid units, with
    σ² ≥ (z·c)² and c = C/γ, the discrete Gaussian of Canonne, Kamath & Steinke 2020 sampled
    exactly from ChaCha20 with integer arithmetic; the result is float64, divided by ``denominator``. Rounding a sum moves it by at
    most √d/2 grid steps, so neighbouring sums differ by at most c + √d steps after rounding: the
    sensitivity :func:`discrete_gaussian_params` gives with ``rounding="sum"``, which the ledger
    must record. ``seed``: tests and reproductions only.
    """
    arrays = [np.ascontiguousarray(s, dtype=np.float64) for s in sums]
    if not arrays:
        raise ValueError("sums is empty; give one array per part of the group")
    scales = [1.0] * len(arrays) if part_scales is None else [_real("part_scales", a) for a in part_scales]
    if len(scales) != len(arrays):
        raise ValueError(f"part_scales has {len(scales)} values but there are {len(arrays)} sums")
    dim = sum(int(a.size) for a in arrays)
    outs = _core.discrete_release(
        [a.ravel() for a in arrays],
        scales,
        _real("l2_norm_clip", l2_norm_clip),
        _real("noise_multiplier", noise_multiplier),
        dim,
        _real("granularity", granularity),
        False,
        None if denominator is None else _real("denominator", denominator),
        _seed(seed),
        True,
    )
    return [o.reshape(a.shape) for o, a in zip(outs, arrays)]


def clip_noise(
    grads: Grads,
    l2_norm_clip: float,
    noise_multiplier: float,
    *,
    denominator: Optional[float] = None,
    seed: Optional[int] = None,
    scales: Optional[Sequence[float]] = None,
    mechanism: str = "gaussian",
    granularity: Optional[float] = None,
    on_nonfinite: str = "zero",
) -> Any:
    """Privatized sum of per-record clipped vectors: the Gaussian sum mechanism.

    McMahan et al. 2018, §1 steps 2–3 (and Abadi et al. 2016, Algorithm 1): each record x_i is
    scaled by min(1, C/‖x_i‖₂) with C = ``l2_norm_clip``, the scaled records are summed, and
    N(0, (z·C)²) with z = ``noise_multiplier`` is added to every coordinate. With ``denominator``
    the result is divided by it, e.g. the expected batch size q·n (the fixed-denominator
    estimator of the paper's §3).

    ``scales`` (one α_j > 0 per array) selects joint clipping (§2 of the paper): record i is
    clipped by the norm of (x_i1/α_1, …, x_iK/α_K), and array j receives noise of stddev
    α_j·z·C. The privacy tuple is (C, z·C) whatever the scales; they only shape the clipping
    region and the noise to parts of very different magnitude.

    Norms, clip factors and the sum are computed in float64; a clipped record's norm never
    exceeds C, also after rounding to float32. The result has the structure (array, list or
    tuple), the shapes without the record axis, and the dtypes of ``grads``. B = 0 (an empty
    Poisson sample) is valid and gives pure noise.

    A record with a NaN or ±∞ value contributes zero (``on_nonfinite="zero"``, the default; the
    release is that of the batch without it). ``on_nonfinite="raise"`` raises ``ValueError``
    naming the first such record instead: a debugging aid, not differentially private (see the
    module docs). Raises ``ValueError`` for mismatched record counts or out-of-range parameters;
    ``TypeError`` for non-float dtypes. On error nothing is returned. ``seed`` is for tests and
    reproductions only (see the module docs).

    ``mechanism="discrete_gaussian"`` gives floating-point-safe noise (Canonne, Kamath & Steinke
    2020): each clipped record is rounded to the nearest point of the grid γ·ℤ^d (γ =
    ``granularity``, times α_j for joint clipping), the records are summed exactly in integers,
    and discrete Gaussian noise N_ℤ(0, σ²) with σ·γ ≥ z·C, sampled with integer arithmetic from
    ChaCha20, is added. The output is float64 (multiples of γ before any ``denominator``)
    whatever the input dtype. Rounding adds up to √d/2 grid steps to a record's norm, so the
    privacy tuple is (Δ, σ·γ) with Δ slightly above C: :func:`discrete_gaussian_params` gives
    both, and the queries and optimizers record them in the ledger.
    """
    clip = _real("l2_norm_clip", l2_norm_clip)
    z = _real("noise_multiplier", noise_multiplier)
    den = None if denominator is None else _real("denominator", denominator)
    s = _seed(seed)
    mode = check_on_nonfinite(on_nonfinite)
    arrays, kind = _unpack(grads)
    if check_mechanism(mechanism) == "discrete_gaussian":
        g = None if granularity is None else _real("granularity", granularity)
        flat, norms, _ = _core.discrete_gaussian_sum_flat(arrays, clip, z, g, den, s, _scales(scales, len(arrays)))
    else:
        if granularity is not None:
            raise ValueError("granularity applies to mechanism='discrete_gaussian' only")
        flat, norms = _core.gaussian_sum_flat(arrays, clip, z, den, s, _scales(scales, len(arrays)))
    check_norms(norms, mode)
    if _trace.active() and check_mechanism(mechanism) == "gaussian":  # the grey-box harness: the clipped sum, before its noise
        pre, _ = clip_sum(arrays, clip, scales=scales, dtype=np.float64)
        _trace.release(
            "mechanism.clip_noise", [{"sums": list(pre), "sensitivity": clip, "scales": scales}],
            denominator=den, noise={"noise_multiplier": z}, event=("gaussian", clip, z * clip),
        )
        flat = _trace.output("mechanism.clip_noise", list(flat))
    return _pack(flat, arrays, kind)


def clip_sum(
    grads: Grads,
    l2_norm_clip: float,
    *,
    scales: Optional[Sequence[float]] = None,
    dtype: Any = None,
    on_nonfinite: str = "zero",
) -> Tuple[Any, np.ndarray]:
    """Sum of per-record clipped vectors without noise, and the records' unclipped norms.

    The clipping of McMahan et al. 2018, §2 (flat clipping): Σ_i min(1, C/‖x_i‖₂)·x_i. Returns
    ``(clipped_sum, norms)``: the sum with the structure and dtypes of ``grads``, and a float64
    array of shape (B,). This is not private by itself; noise it with :func:`gaussian_noise`
    or use :func:`clip_noise`. ``scales`` selects joint clipping as in :func:`clip_noise`, and
    the norms are then those of the scaled records. ``dtype=numpy.float64`` returns the sums
    in float64 whatever the input dtype (for callers that keep accumulating across batches).

    A record with a NaN or ±∞ value adds zero to the sum and its norm is NaN
    (``on_nonfinite="zero"``, the default); ``on_nonfinite="raise"`` raises ``ValueError`` naming
    the first one (debugging only, see the module docs). The norms, NaNs included, are not
    private: do not publish them or counts derived from them.
    """
    clip = _real("l2_norm_clip", l2_norm_clip)
    if dtype is not None and np.dtype(dtype) != np.float64:
        raise TypeError(f"dtype must be None (the input's) or float64, got {np.dtype(dtype)}")
    mode = check_on_nonfinite(on_nonfinite)
    arrays, kind = _unpack(grads)
    flat, norms = _core.gaussian_sum_flat(
        arrays, clip, 0.0, None, None, _scales(scales, len(arrays)), dtype is not None
    )
    check_norms(norms, mode)
    return _pack(flat, arrays, kind), norms


def record_norms(
    grads: Grads, *, scales: Optional[Sequence[float]] = None, on_nonfinite: str = "zero"
) -> np.ndarray:
    """The joint L2 norm ‖x_i‖₂ of every record over all arrays, float64 of shape (B,).

    With ``scales``, the norm of the scaled record (x_i1/α_1, …, x_iK/α_K). A record with a NaN
    or infinite value has norm NaN (``on_nonfinite="zero"``: the records the clip leaves out);
    ``on_nonfinite="raise"`` raises ``ValueError`` naming the first one (debugging only). The
    norms are not private.
    """
    mode = check_on_nonfinite(on_nonfinite)
    arrays, _ = _unpack(grads)
    norms = _core.record_norms(arrays, _scales(scales, len(arrays)))
    check_norms(norms, mode)
    return norms


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platforms without sysconf
        return sys.maxsize


def gaussian_noise(
    shape: Union[int, Sequence[int]],
    stddev: float,
    *,
    dtype: Any = np.float32,
    seed: Optional[int] = None,
    parallel: bool = True,
) -> np.ndarray:
    """An array of i.i.d. N(0, stddev²) values from ChaCha20 (sampled in float64, rounded once).

    The noise of the Gaussian mechanism (McMahan et al. 2018, §1 step 3). Keyed from the OS on
    every call; ``seed`` is for tests and reproductions only (see the module docs).
    ``parallel=False`` keeps the work on the calling thread, for noise drawn in the background
    of other parallel work; the values do not depend on it.
    """
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be float32 or float64, got {dt}")
    shape = _noise_shape(shape)
    sd = _real("stddev", stddev)
    n = math.prod(shape)  # exact: numpy's int64 product wraps around silently
    if n * dt.itemsize > sys.maxsize:
        raise ValueError(
            f"shape {shape} holds {n} values ({n * dt.itemsize} bytes of {dt}): more than an array can address"
        )
    if n * dt.itemsize > _physical_memory():
        # The core would fail to allocate, and a failed allocation in Rust aborts the process.
        raise MemoryError(f"shape {shape} needs {n * dt.itemsize / 2**30:.1f} GiB of {dt}, more than this machine's memory")
    flat = _core.gaussian_flat(n, sd, dt == np.float64, _seed(seed), bool(parallel))
    return flat.reshape(shape)
