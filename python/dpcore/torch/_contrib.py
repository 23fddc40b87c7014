"""What a layer's backward pass leaves behind for one parameter, and how it becomes a norm.

A *contribution* is one use of a parameter in the forward pass, in a form from which each
record's gradient of that use follows (Goodfellow 2015, "Efficient per-example gradient
computations"):

* :class:`Factored`: Σ_t g_t a_tᵀ over positions t (a linear map applied at T positions: dense
  layers, attention projections, recurrent weights). ``a=None`` is a bias: Σ_t g_t.
* :class:`Rows`: rows ``idx_t`` of the parameter receive g_t (an embedding lookup).
* :class:`Dense`: the per-record gradients themselves, shape (B, *slice) (the ``torch.func``
  fallback, normalisation layers, convolutions with few input channels, user rules).
* :class:`ConvFactors`: a convolution's input and output gradient; ghost norms from Gram
  matrices of the padded input, the clipped sum as one weight gradient (deep conv layers).
  :class:`ConvFolded`: the same factors, each record's gradient materialised by chunks of
  records as a grouped convolution's weight gradient (the other conv layers).

A parameter's per-record gradient is the sum over its uses (shared or tied parameters, a layer
applied twice), so norms are taken per parameter, over all of its contributions together.
Uses of disjoint row ranges (the q, k and v blocks of an attention in-projection) add their
squared norms; uses of the same rows are concatenated along T when they have one form, and
materialised and summed otherwise.

Every norm is an upper bound of the exact one, computed in float64 with explicit bounds on its
rounding error, and the clipped sums are formed from the same factors, so the clip factors of
:func:`dpcore.torch.clip_factors` bound each record's released contribution by C.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_U64 = 2.0**-53

# Materialised per-record gradients are formed this many float64 elements at a time.
_CHUNK = 1 << 25

RowRange = Optional[Tuple[int, int]]

#: Key of a cache dict's entry holding the ids of the factors that more than one use shares
#: (see :func:`shared_factors`); with it, Gram matrices and scaled copies of other factors are
#: not kept once their use is done (they would otherwise all stay alive until the step ends).
SHARED = "shared-factors"


def shared_factors(cs: Sequence["Contribution"]) -> set:
    """Ids of the factor tensors (activations, output gradients) of weight uses that appear in
    more than one :class:`Factored` use: only those are worth caching."""
    seen: set = set()
    twice: set = set()
    for c in cs:
        if isinstance(c, Factored) and c.a is not None:
            for t in (c.a, c.g):
                (twice if id(t) in seen else seen).add(id(t))
    return twice


def _keep(cache: Optional[dict], fid: int) -> bool:
    """Whether a value derived from the factor with id ``fid`` goes into ``cache``."""
    if cache is None:
        return False
    shared = cache.get(SHARED)
    return shared is None or fid in shared


def _sq(x: torch.Tensor, dims) -> torch.Tensor:
    """Σ x² over ``dims`` in float64 (float32 inputs square exactly in float64)."""
    return torch.linalg.vector_norm(x, dim=dims, dtype=torch.float64).square()


def is_one(x: Any) -> bool:
    """Whether a scale is the host value 1.0 (a device tensor is never compared on the host)."""
    return isinstance(x, (int, float)) and x == 1.0


def _nograd(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached only when it requires grad (a detach is an operator of its own)."""
    return t.detach() if t.requires_grad else t


def row_sq(*ts: torch.Tensor) -> List[torch.Tensor]:
    """Σ_j x_ij² of every row of each 2-D tensor, in float64. On CPU the Rust core reads the
    tensors in place (torch's float64 norm of a float32 tensor converts it first, ~10x slower),
    on this thread: rayon's workers would spin against torch's own threads."""
    if all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) for t in ts):
        from .. import _core

        return [torch.from_numpy(s) for s in _core.part_sumsq([_nograd(t).contiguous().numpy() for t in ts], parallel=False)]
    if len(ts) > 2 and len({(t.shape[0], t.device) for t in ts}) == 1:
        return _row_sq_joined(ts)
    return [_sq(t, 1) for t in ts]


#: Column -> tensor index of joined row norms (:func:`_row_sq_joined`), by (widths, device).
_SEGMENTS: Dict[Any, torch.Tensor] = {}


def _row_sq_joined(ts: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """:func:`row_sq` of many 2-D tensors with the same rows on an accelerator, in a fixed
    number of operators: the tensors side by side, squared in float64 (exact for float32 and
    narrower) and summed per tensor by one ``index_add_`` (instead of two operators a tensor)."""
    b, dev = ts[0].shape[0], ts[0].device
    widths = tuple(int(t.shape[1]) for t in ts)
    key = (widths, dev)
    seg = _SEGMENTS.get(key)
    if seg is None:
        if len(_SEGMENTS) > 256:
            _SEGMENTS.clear()
        seg = _SEGMENTS[key] = torch.repeat_interleave(torch.arange(len(ts)), torch.tensor(widths)).to(dev, non_blocking=True)
    dt = ts[0].dtype if len({t.dtype for t in ts}) == 1 else torch.float64
    sq = torch.cat([t.to(dt) for t in ts], 1).to(torch.float64).square_()
    out = torch.zeros(len(ts), b, dtype=torch.float64, device=dev).index_add_(0, seg, sq.t())
    return list(out.unbind(0))


def _zero_rows(t: torch.Tensor, mask: torch.Tensor, memo: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``t`` with its records (rows of dim 0) where ``mask`` holds set to 0, whatever they held
    (NaN and ±inf included: multiplying them by a zero clip factor would leave NaN). Out of
    place, since a factor may be a tensor the caller still holds (a model input, a layer's
    output); one copy per distinct tensor (``memo``, keyed by id), so that factors several uses
    share stay shared (their ids are what the caches of :func:`shared_factors` key on)."""
    hit = memo.get(id(t))
    if hit is not None and hit[0] is t:
        return hit[1]
    mk = ("mask", t.device, t.dim())
    hm = memo.get(mk)  # the mask shaped for this rank of tensor, once per step
    if hm is None or hm[0] is not mask:
        hm = memo[mk] = (mask, mask.to(device=t.device).reshape((-1,) + (1,) * (t.dim() - 1)))
    out = t.masked_fill(hm[1], 0)
    memo[id(t)] = (t, out)  # t kept alive with it: its id is not reused while the memo lives
    return out


def _cw(c: torch.Tensor, dtype: torch.dtype, ndim: int, cache: Optional[dict]) -> torch.Tensor:
    """The clip factors ``c`` (B,) in ``dtype``, shaped to scale a tensor of ``ndim`` dims along
    its records: formed once per call of the clipped sums (``cache``) and shared by every use of
    the group, not a cast and a reshape per layer (each an operator, a launch on a GPU)."""
    key = ("cw", id(c), dtype, ndim)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None and hit[0] is c:
            return hit[1]
    out = c.to(dtype)
    if ndim > 1:
        out = out.view((-1,) + (1,) * (ndim - 1))
    if cache is not None:
        cache[key] = (c, out)
    return out


def _rows_view(param: torch.Tensor, rows: RowRange, t: torch.Tensor) -> torch.Tensor:
    """``t`` (shaped like ``param``) restricted to the row range (dim 0)."""
    return t if rows is None else t[rows[0] : rows[1]]


#: The attributes of a contribution that hold one row per record (its batch on dim 0).
_RECORD_TENSORS = ("a", "g", "colsum", "per")


class Contribution:
    """One use of ``param`` (restricted to rows ``rows`` of dim 0, or all of it)."""

    param: nn.Parameter
    rows: RowRange

    @property
    def batch(self) -> int:
        raise NotImplementedError

    def slice_shape(self) -> Tuple[int, ...]:
        s = tuple(self.param.shape)
        return s if self.rows is None else (self.rows[1] - self.rows[0],) + s[1:]

    def regroup(self, weights: torch.Tensor, k: int) -> "Contribution":
        """Microbatches: record i·k+j (j < k) joins unit i with weight ``weights`` (B,); the
        batch is padded with zero records to a multiple of k."""
        raise NotImplementedError

    def group(self, weights: torch.Tensor, grouping: "Grouping", memo: Dict[Any, torch.Tensor]) -> "Contribution":
        """Users (the privacy unit "user"): the examples of unit u, ``grouping.index[u]``, join
        it with weights ``weights`` (B,) (1/count: the unit's gradient is the mean of its
        examples'). A unit is a record whose positions are its examples' positions one after
        the other (a longer sequence), so every norm and clipped sum applies unchanged.
        ``memo``: one gathered copy per factor tensor (uses that share a factor keep sharing it)."""
        raise NotImplementedError

    def dense(self, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Records lo..hi materialised in float64, (n, *slice), and a bound on each one's
        rounding error relative to the parameter-dtype arithmetic of :meth:`add_clipped`."""
        raise NotImplementedError

    def add_clipped(self, c: torch.Tensor, acc: torch.Tensor, cache: Optional[dict] = None) -> None:
        """acc[rows] += Σ_i c_i·g_i (``c``: (B,) float64, already including any loss scale);
        ``cache`` lets uses that share factors share their scaled copies within one call."""
        raise NotImplementedError

    def zero_records(self, mask: torch.Tensor, memo: Optional[Dict[int, Any]] = None) -> None:
        """Records (B,) where ``mask`` holds get a zero gradient: every per-record tensor held
        (activations ``a``, output gradients ``g``, the bias sums ``colsum``, materialised
        ``per``) has their rows set to 0, out of place (see :func:`_zero_rows`). A record whose
        gradient is not finite then adds exactly 0 to the clipped sums, where a zero clip factor
        alone would add NaN (0·NaN). ``memo`` is shared between the uses of one step."""
        memo = {} if memo is None else memo
        for k in _RECORD_TENSORS:
            t = getattr(self, k, None)
            if isinstance(t, torch.Tensor):
                setattr(self, k, _zero_rows(t, mask, memo))

    def release(self) -> None:
        """Drops the tensors held (once the clipped sum is formed): they are freed as soon as no
        other use holds them, instead of at the end of the step."""
        for k in ("a", "g", "colsum", "idx", "per"):
            if hasattr(self, k):
                setattr(self, k, None)


def _btd(t: torch.Tensor) -> torch.Tensor:
    """(B, positions..., d) as (B, T, d); (B, d) as (B, 1, d)."""
    return t if t.dim() == 3 else t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def _pad_to(t: torch.Tensor, n: int) -> torch.Tensor:
    if t.shape[0] == n:
        return t
    pad = torch.zeros((n - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], 0)


class Grouping:
    """Examples (B,) grouped into units (U,) that are consecutive runs of ``counts`` examples
    (user-major batches, :meth:`dpcore.sampling.UserIndex.choose`). ``index`` (U·kmax,) lists
    each unit's examples padded with B (a zero row appended to each factor) up to ``kmax``."""

    __slots__ = ("counts", "kmax", "units", "batch", "index", "unit_of", "uniform")

    def __init__(self, counts: Any, device: torch.device) -> None:
        # Host-side facts (the sampler's), computed with numpy: no tensor operator is dispatched
        # and nothing is read back from a device; the indices go to the device without a wait.
        c = np.asarray(counts.cpu().numpy() if isinstance(counts, torch.Tensor) else counts, dtype=np.int64).reshape(-1)
        self.counts = torch.from_numpy(c)
        self.units = int(c.size)
        self.batch = int(c.sum())
        self.kmax = int(c.max()) if self.units else 0
        self.uniform = bool((c == self.kmax).all())
        starts = np.cumsum(c) - c
        j = np.arange(self.kmax, dtype=np.int64)
        idx = np.where(j[None, :] < c[:, None], starts[:, None] + j[None, :], self.batch)
        self.index = torch.from_numpy(np.ascontiguousarray(idx.reshape(-1))).to(device, non_blocking=True)
        self.unit_of = torch.from_numpy(np.repeat(np.arange(self.units, dtype=np.int64), c)).to(device, non_blocking=True)

    def gather(self, t: torch.Tensor, memo: Dict[Any, torch.Tensor], key: Any) -> torch.Tensor:
        """(B, T, ...) as (U, kmax·T, ...): each unit's examples one after the other, zero rows
        where a unit has fewer than kmax."""
        hit = memo.get(key)
        if hit is not None:
            return hit
        b = t.shape[0]
        rest = tuple(t.shape[2:])
        if self.uniform:
            out = t.reshape((self.units, self.kmax * t.shape[1]) + rest)
        else:
            padded = torch.cat([t, torch.zeros((1,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)], 0)
            out = padded.index_select(0, self.index.to(t.device)).reshape((self.units, self.kmax * t.shape[1]) + rest)
        assert b == self.batch
        memo[key] = out
        return out


def _weighted(t: torch.Tensor, weights: torch.Tensor, memo: Dict[Any, torch.Tensor]) -> torch.Tensor:
    key = ("w", id(t))
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = t * weights.to(device=t.device, dtype=t.dtype).reshape((-1,) + (1,) * (t.dim() - 1))
        memo[("keep", id(t))] = t  # t alive while the memo lives: its id is not reused
    return hit


class Factored(Contribution):
    """Per-record gradient Σ_t g_t a_tᵀ of ``param`` viewed as (rows, din); ``a=None``: Σ_t g_t."""

    __slots__ = ("param", "rows", "a", "g", "colsum")

    def __init__(self, param: nn.Parameter, a: Optional[torch.Tensor], g: torch.Tensor, rows: RowRange = None) -> None:
        self.param, self.rows = param, rows
        self.g = _btd(g)
        self.a = None if a is None else _btd(a)
        #: Σ_t g_t per record (B, dout), left by the norm of a bias for its clipped sum.
        self.colsum: Optional[torch.Tensor] = None

    @property
    def batch(self) -> int:
        return int(self.g.shape[0])

    def regroup(self, weights: torch.Tensor, k: int) -> "Factored":
        b, t = self.g.shape[:2]
        m = -(-b // k)
        g = _pad_to(self.g * weights.to(self.g.dtype)[:, None, None], m * k).reshape(m, k * t, -1)
        a = None if self.a is None else _pad_to(self.a, m * k).reshape(m, k * t, -1)
        return Factored(self.param, a, g, self.rows)

    def group(self, weights: torch.Tensor, grouping: Grouping, memo: Dict[Any, torch.Tensor]) -> "Factored":
        g = grouping.gather(_weighted(self.g, weights, memo), memo, ("g", id(self.g)))
        a = None if self.a is None else grouping.gather(self.a, memo, ("a", id(self.a)))
        if self.a is not None:
            memo[("keep", id(self.a))] = self.a
        return Factored(self.param, a, g, self.rows)

    def dense(self, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = self.g[lo:hi].double()
        t = g.shape[1]
        gn = torch.linalg.vector_norm(g, dim=2)
        if self.a is None:
            return g.sum(1).reshape((hi - lo,) + self.slice_shape()), 2.0 * (t + 2) * _U64 * gn.sum(1)
        a = self.a[lo:hi].double()
        s = (torch.linalg.vector_norm(a, dim=2) * gn).sum(1)
        per = torch.bmm(g.transpose(1, 2), a)
        return per.reshape((hi - lo,) + self.slice_shape()), 2.0 * (t + 2) * _U64 * s

    def add_clipped(self, c: torch.Tensor, acc: torch.Tensor, cache: Optional[dict] = None) -> None:
        b, t, dout = self.g.shape
        wd = acc.dtype  # float32 or wider (see _amp.work_dtype): bfloat16 factors widen exactly
        if self.a is None:
            if self.colsum is not None:  # Σ_i c_i (Σ_t g_it) from the sums the norm formed
                s = _cw(c, self.colsum.dtype, 1, cache) @ self.colsum
            else:
                s = (self.g.to(wd) * _cw(c, wd, 3, cache)).sum((0, 1))
            _rows_view(self.param, self.rows, acc).add_(s.to(acc.dtype))
            return
        din = self.a.shape[2]
        target = _rows_view(self.param, self.rows, acc.view(acc.shape[0], -1))
        # c_i scales record i's narrower factor (Σ_t g_t (c·a_t)ᵀ = Σ_t (c·g_t) a_tᵀ); uses that
        # share a factor (q/k/v rows of one input, an LSTM's gate gradients) share its copy.
        scale_a = din <= dout
        f = self.a if scale_a else self.g
        key = (id(f), id(c))
        fc = cache.get(key) if cache is not None else None
        if fc is None:
            fc = f.to(wd) * _cw(c, wd, 3, cache)
            if _keep(cache, id(f)):
                cache[key] = fc
        gg, aa = (self.g.to(wd), fc) if scale_a else (fc, self.a.to(wd))
        lhs, rhs = gg.reshape(b * t, dout).t(), aa.reshape(b * t, din)
        if target.dtype == lhs.dtype:
            target.addmm_(lhs, rhs.to(lhs.dtype))  # one pass: the product accumulates in place
        else:
            target.add_(lhs.matmul(rhs.to(lhs.dtype)).to(target.dtype))


class Rows(Contribution):
    """Rows ``idx`` (B, T) of ``param`` receive g (B, T, d): an embedding lookup."""

    __slots__ = ("param", "rows", "idx", "g")

    def __init__(self, param: nn.Parameter, idx: torch.Tensor, g: torch.Tensor) -> None:
        self.param, self.rows = param, None
        self.idx = idx.reshape(idx.shape[0], math.prod(idx.shape[1:]))
        self.g = _btd(g)

    @property
    def batch(self) -> int:
        return int(self.g.shape[0])

    def regroup(self, weights: torch.Tensor, k: int) -> "Rows":
        b, t = self.idx.shape
        m = -(-b // k)
        g = _pad_to(self.g * weights.to(self.g.dtype)[:, None, None], m * k).reshape(m, k * t, -1)
        return Rows(self.param, _pad_to(self.idx, m * k).reshape(m, k * t), g)

    def group(self, weights: torch.Tensor, grouping: Grouping, memo: Dict[Any, torch.Tensor]) -> "Rows":
        g = grouping.gather(_weighted(self.g, weights, memo), memo, ("g", id(self.g)))
        idx = grouping.gather(self.idx, memo, ("idx", id(self.idx)))  # padding looks up row 0 with g = 0
        memo[("keep", id(self.idx))] = self.idx
        return Rows(self.param, idx, g)

    def dense(self, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        n, t = hi - lo, self.idx.shape[1]
        v, d = self.param.shape[0], self.g.shape[2]
        out = torch.zeros(n * v, d, dtype=torch.float64, device=self.g.device)
        keys = (torch.arange(n, device=self.idx.device).unsqueeze(1) * v + self.idx[lo:hi]).reshape(-1)
        g = self.g[lo:hi].double()
        out.index_add_(0, keys, g.reshape(-1, d))
        err = 2.0 * (t + 2) * _U64 * torch.linalg.vector_norm(g, dim=2).sum(1)
        return out.reshape(n, v, d), err

    def sq_norms(self) -> torch.Tensor:
        """Each record's squared norm: rows of one record that look up the same token add up,
        so the positions are grouped by (record, token) and each group summed in float64.

        The groups are found by sorting the keys record·V + token: a group starts where the
        sorted key changes, and its index is the running count of starts. Everything has the
        static size B·T (at most B·T groups; unused group rows stay 0): no ``torch.unique``,
        no boolean mask, nothing whose size depends on the values, so no value is read back to
        the host (a synchronisation per step on an accelerator). The bound added to each
        group's norm is the float64 summation's, 2(T+2)·u·Σ‖row‖ (one term for a token looked
        up once)."""
        b, t = self.idx.shape
        d, v = self.g.shape[2], self.param.shape[0]
        g = self.g
        if t == 1:
            return _sq(g[:, 0], 1)
        n = b * t
        dev = g.device
        rec_of_row = torch.arange(b, device=self.idx.device).unsqueeze(1).expand(b, t)
        keys = (rec_of_row * v + self.idx).reshape(-1).to(dev)
        sk, perm = torch.sort(keys)
        starts = torch.ones(n, dtype=torch.int64, device=dev)
        starts[1:] = sk[1:] != sk[:-1]
        group = torch.empty_like(perm).scatter_(0, perm, torch.cumsum(starts, 0).sub_(1))
        rows = g.reshape(n, d).double()
        sums = torch.zeros(n, d, dtype=torch.float64, device=dev).index_add_(0, group, rows)
        gn = torch.linalg.vector_norm(rows, dim=1)
        bound = torch.zeros(n, dtype=torch.float64, device=dev).index_add_(0, group, gn)
        slack = 2.0 * (t + 2) * _U64
        nk = torch.linalg.vector_norm(sums, dim=1).add_(bound, alpha=slack)
        # the record of each group (rows of one group share it); unused groups add 0 to record 0
        owner = torch.zeros(n, dtype=torch.int64, device=dev).scatter_(0, group, rec_of_row.reshape(-1).to(dev))
        return torch.zeros(b, dtype=torch.float64, device=dev).index_add_(0, owner, nk.square_())

    def add_clipped(self, c: torch.Tensor, acc: torch.Tensor, cache: Optional[dict] = None) -> None:
        d = self.g.shape[2]
        rows = (self.g.to(acc.dtype) * _cw(c, acc.dtype, 3, cache)).reshape(-1, d)
        acc.index_add_(0, self.idx.reshape(-1), rows.to(acc.dtype))


class Dense(Contribution):
    """The per-record gradients themselves: (B, *slice)."""

    __slots__ = ("param", "rows", "per")

    def __init__(self, param: nn.Parameter, per: torch.Tensor, rows: RowRange = None) -> None:
        self.param, self.rows, self.per = param, rows, per

    @property
    def batch(self) -> int:
        return int(self.per.shape[0])

    def regroup(self, weights: torch.Tensor, k: int) -> "Dense":
        b = self.per.shape[0]
        m = -(-b // k)
        w = weights.to(self.per.dtype).reshape((b,) + (1,) * (self.per.dim() - 1))
        return Dense(self.param, _pad_to(self.per * w, m * k).reshape((m, k) + tuple(self.per.shape[1:])).sum(1), self.rows)

    def group(self, weights: torch.Tensor, grouping: Grouping, memo: Dict[Any, torch.Tensor]) -> "Dense":
        per = _weighted(self.per, weights, memo)
        rest = tuple(per.shape[1:])
        if not grouping.uniform:  # summed in a fixed order (no atomics): the same bits every run
            per = torch.cat([per, torch.zeros((1,) + rest, dtype=per.dtype, device=per.device)], 0)
            per = per.index_select(0, grouping.index.to(per.device))
        return Dense(self.param, per.reshape((grouping.units, grouping.kmax) + rest).sum(1), self.rows)

    def dense(self, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.per[lo:hi].double(), torch.zeros(hi - lo, dtype=torch.float64, device=self.per.device)

    def add_clipped(self, c: torch.Tensor, acc: torch.Tensor, cache: Optional[dict] = None) -> None:
        per = self.per.to(acc.dtype)
        # Σ_i c_i·per_i as one matrix-vector product (tensordot would add permutes and views)
        s = torch.mv(per.reshape(per.shape[0], -1).t(), _cw(c, acc.dtype, 1, cache))
        _rows_view(self.param, self.rows, acc).add_(s.view(per.shape[1:]))


#: Elements of the Gram matrices one chunk of records of a :class:`ConvFactors` forms at a time.
_GHOST_CHUNK = 1 << 22


@contextlib.contextmanager
def _no_tf32(t: torch.Tensor) -> Iterator[None]:
    """A block in which a cuDNN convolution of ``t`` rounds in float32, not TF32 (cuDNN's
    default): the clipped sum of :class:`ConvFactors` rounds each product c_i·g·a in the
    parameter dtype, as the clip margin assumes, while its norm bounds the exact gradient."""
    cudnn = torch.backends.cudnn
    if t.device.type != "cuda" or not cudnn.allow_tf32:
        yield
        return
    cudnn.allow_tf32 = False
    try:
        yield
    finally:
        cudnn.allow_tf32 = True


class ConvFactors(Contribution):
    """The weight of a 2-D convolution, held as its factors: each record's input ``a`` (B, C_in,
    H, W; any padding other than symmetric zeros already applied) and output gradient ``g``
    (B, C_out, H_out, W_out), with the convolution's ``conf`` = (stride, padding, dilation,
    groups) and its weight ``w`` (read for its shape only). Record i's gradient is the weight
    gradient of the convolution of a_i alone: Σ_t g_it a_itᵀ over output positions t, a_it the
    input patch read at t (im2col), per group of channels.

    * Norms (:meth:`sq_norms`): ghost norms Σ_{t,s}(a_t·a_s)(g_t·g_s) (Li et al. 2022) without
      unfolding the input: a_t·a_s is the sum over the kernel's taps of the Gram matrix of the
      zero-padded input's positions (one Gram per residue class of the stride), read as k·k
      strided views. For the deep layers of a CNN (8×8 or 4×4 positions, many channels) this
      costs a small fraction of the weight gradient; the rule chooses it by shape.
    * Clipped sum (:meth:`add_clipped`): Σ_i c_i·g_i is the weight gradient of the batch with
      each record's output gradient scaled by c_i: one ``convolution_backward``, the cost of
      the non-private step's weight gradient.
    """

    __slots__ = ("param", "rows", "a", "g", "w", "conf")

    def __init__(self, param: nn.Parameter, a: torch.Tensor, g: torch.Tensor, w: torch.Tensor, conf: Any) -> None:
        self.param, self.rows = param, None
        self.a, self.g, self.w = a, g, w
        stride, padding, dilation, groups = conf
        self.conf = (tuple(int(v) for v in stride), tuple(int(v) for v in padding), tuple(int(v) for v in dilation), int(groups))

    @property
    def batch(self) -> int:
        return int(self.g.shape[0])

    def _shape(self) -> Tuple[int, int, int, int, int, int]:
        """(groups, C_in per group, C_out per group, kh, kw, positions T)."""
        groups = self.conf[3]
        kh, kw = int(self.w.shape[2]), int(self.w.shape[3])
        return groups, int(self.a.shape[1]) // groups, int(self.g.shape[1]) // groups, kh, kw, int(self.g.shape[2] * self.g.shape[3])

    def _unfold(self, x: torch.Tensor) -> torch.Tensor:
        """The input patches of records ``x``: (n·groups, C_in/groups·kh·kw, T)."""
        stride, padding, dilation, groups = self.conf
        cols = F.unfold(x, tuple(self.w.shape[2:]), dilation=dilation, padding=padding, stride=stride)
        return cols.reshape(x.shape[0] * groups, cols.shape[1] // groups, cols.shape[2])

    def _per(self, lo: int, hi: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """Records lo..hi materialised in ``dtype`` (n, *param.shape), and Σ_t ‖a_t‖‖g_t‖ per
        record in float64 (which bounds each record's gradient norm)."""
        groups, _, cout_g, _, _, t = self._shape()
        n = hi - lo
        cols = self._unfold(self.a[lo:hi].to(dtype))
        gv = self.g[lo:hi].to(dtype).reshape(n * groups, cout_g, t)
        per = torch.bmm(gv, cols.transpose(1, 2))
        s = (torch.linalg.vector_norm(cols, dim=1, dtype=torch.float64) * torch.linalg.vector_norm(gv, dim=1, dtype=torch.float64))
        return per.reshape((n,) + tuple(self.param.shape)), s.reshape(n, -1).sum(1)

    def as_dense(self) -> "Dense":
        """The per-record gradients themselves (in the factors' dtype), chunked by records."""
        b = self.batch
        per = torch.empty((b,) + tuple(self.param.shape), dtype=self.g.dtype, device=self.g.device)
        groups, cin_g, cout_g, kh, kw, t = self._shape()
        chunk = max(1, _GHOST_CHUNK // max(1, groups * (cin_g * kh * kw * (t + cout_g))))
        for lo in range(0, b, chunk):
            hi = min(b, lo + chunk)
            per[lo:hi] = self._per(lo, hi, self.g.dtype)[0]
        return Dense(self.param, per)

    def regroup(self, weights: torch.Tensor, k: int) -> "Dense":
        return self.as_dense().regroup(weights, k)

    def group(self, weights: torch.Tensor, grouping: Grouping, memo: Dict[Any, torch.Tensor]) -> "Dense":
        return self.as_dense().group(weights, grouping, memo)

    def dense(self, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        per, s = self._per(lo, hi, torch.float64)
        t = self._shape()[5]
        return per, 2.0 * (t + 2) * _U64 * s

    def sq_norms(self, defer: bool = False) -> Any:
        """Upper bounds of ‖Σ_t g_t a_tᵀ‖² per record (float64, (B,)) by ghost norms, with the
        bounds of :func:`_factored_sq`: float32 Grams (when matmuls round in float32) carry
        their worst-case rounding error γ_n, other dtypes are computed in float64.

        Entry (t, s) of the input Gram is Σ over the k·k taps (i, j) of the padded input's
        Gram at positions (σ·t + δ·(i, j), σ·s + δ·(i, j)) (stride σ, dilation δ): positions
        of one residue class modulo σ, so each class's Gram is formed once (C_in/groups terms
        per entry), and the k·k taps are added as strided views of it (k·k − 1 more additions;
        the entry is a dot product of C_in/groups·k·k terms summed in some order, within
        γ_{C_in/groups + k·k} of the exact one by Higham §3.1). The diagonals of the Grams
        bound each patch's norm: fl(Σ x²) ≥ (1 − γ_n)·Σ x² for terms of one sign."""
        a, g = self.a, self.g
        b = self.batch
        (sh, sw), (ph, pw), (dh, dw), groups = self.conf
        _, cin_g, cout_g, kh, kw, t = self._shape()
        ho, wo = int(g.shape[2]), int(g.shape[3])
        fast = _exact_matmul(a) and _exact_matmul(g)
        wdt = a.dtype if fast else torch.float64
        # the rows and columns of the zero-padded input that the kernel reads
        hu, wu = sh * (ho - 1) + dh * (kh - 1) + 1, sw * (wo - 1) + dw * (kw - 1) + 1
        taps = [(dh * i, dw * j) for i in range(kh) for j in range(kw)]
        classes = sorted({(oi % sh, oj % sw) for oi, oj in taps})
        sizes = {c: (-(-(hu - c[0]) // sh), -(-(wu - c[1]) // sw)) for c in classes}
        per_rec = groups * (sum((hh * ww) ** 2 for hh, ww in sizes.values()) + 3 * t * t)
        chunk = max(1, _GHOST_CHUNK // max(1, per_rec))
        na, ng = cin_g + kh * kw, cout_g
        ga_, gg_ = _gamma(na, wdt), _gamma(ng, wdt)
        ws, ss = [], []
        for lo in range(0, b, chunk):
            hi = min(b, lo + chunk)
            n = hi - lo
            xi = a[lo:hi].to(wdt)
            if ph or pw:
                xi = F.pad(xi, (pw, pw, ph, ph))
            xi = xi[:, :, :hu, :wu]
            grams = {}
            for c in classes:
                sub = xi[:, :, c[0] :: sh, c[1] :: sw]
                hh, ww = sub.shape[2], sub.shape[3]
                sv = sub.reshape(n * groups, cin_g, hh * ww)
                grams[c] = torch.bmm(sv.transpose(1, 2), sv).view(n * groups, hh, ww, hh, ww)
            ga: Optional[torch.Tensor] = None
            for oi, oj in taps:
                r0, q0 = oi // sh, oj // sw
                gm = grams[(oi % sh, oj % sw)]
                # gm[:, r0:r0+ho, q0:q0+wo, r0:r0+ho, q0:q0+wo] as one strided view (four slices
                # would be four operators each, per tap and layer)
                st = gm.stride()
                v = gm.as_strided((gm.shape[0], ho, wo, ho, wo), st,
                                  gm.storage_offset() + r0 * st[1] + q0 * st[2] + r0 * st[3] + q0 * st[4])
                ga = v.clone(memory_format=torch.contiguous_format) if ga is None else ga.add_(v)
            del grams
            assert ga is not None
            ga = ga.view(n * groups, t, t)
            gv = g[lo:hi].to(wdt).reshape(n * groups, cout_g, t)
            gg = torch.bmm(gv.transpose(1, 2), gv)
            # upper bounds of ‖a_t‖ and ‖g_t‖ from the computed diagonals
            an = (ga.diagonal(dim1=1, dim2=2).double() / (1.0 - ga_)).clamp_min(0.0).sqrt()
            gn = (gg.diagonal(dim1=1, dim2=2).double() / (1.0 - gg_)).clamp_min(0.0).sqrt()
            ss.append((an * gn).reshape(n, groups * t).sum(1))
            # each row's t products summed in the Grams' dtype, the rows in float64
            ws.append(ga.mul_(gg).sum(2).double().reshape(n, groups * t).sum(1))
            del ga, gg
        w = _cat(ws)
        # Σ_t ‖a_t‖‖g_t‖ (over every group: Σ_j s_j² ≤ (Σ_j s_j)²), its float64 rounding covered
        s = _cat(ss) * (1.0 + 2.0 * (groups * t + 4) * _U64)
        if fast:
            rel = ga_ + gg_ + ga_ * gg_
            rel = rel + _gamma(t + 1, wdt) * (1.0 + rel)
        else:
            rel = 0.0
        tail = Tail("ghost", w, s, rel * (1.0 + 1e-6) + 2.0 * (na + ng + groups * t * t + 8) * _U64)
        return tail if defer else tail.value()

    def add_clipped(self, c: torch.Tensor, acc: torch.Tensor, cache: Optional[dict] = None) -> None:
        stride, padding, dilation, groups = self.conf
        g = self.g.to(acc.dtype)
        gc = g * _cw(c, acc.dtype, g.dim(), cache)
        a = self.a.to(acc.dtype)
        # only the weight's shape is read (a sharded model's gathered weight may be freed by now)
        w = torch.empty(tuple(self.w.shape), dtype=acc.dtype, device=a.device)
        nd = a.dim() - 2
        with _no_tf32(a):
            s = torch.ops.aten.convolution_backward(
                gc, a, w, None, list(stride), list(padding), list(dilation), False, [0] * nd, groups, [False, True, False]
            )[1]
        acc.add_(s.to(acc.dtype))


class ConvFolded(ConvFactors):
    """A convolution's weight use whose per-record gradients are materialised, as the weight
    gradient of a grouped convolution with the records folded into the groups (groups =
    records·groups, the form of ``torch.nn.utils._expanded_weights``), a chunk of records at a
    time: chunks of ~8-16 records run faster than the whole batch (oneDNN), and each chunk's
    gradients stay a moderate buffer, reused by the allocator, where one buffer of the whole
    batch's (tens of MB) would be mapped afresh every step. The chunks are what the norm and the
    clipped sum read (as :class:`Dense` reads its tensor): the norms of :meth:`sq_norms` are of
    exactly the values summed. Any number of spatial dimensions (Conv1d/2d/3d)."""

    __slots__ = ("parts", "spans")
    #: At most this many records per chunk.
    CHUNK = 16

    def __init__(self, param: nn.Parameter, a: torch.Tensor, g: torch.Tensor, w: torch.Tensor, conf: Any) -> None:
        self.param, self.rows = param, None
        self.a, self.g, self.w = a, g, w
        stride, padding, dilation, groups = conf
        self.conf = (tuple(int(v) for v in stride), tuple(int(v) for v in padding), tuple(int(v) for v in dilation), int(groups))
        #: The chunks of per-record gradients, once formed; the factors are dropped then.
        self.parts: Optional[List[torch.Tensor]] = None
        b = int(g.shape[0])
        per_rec = a[0].numel() + g[0].numel() + w.numel() if b else 1
        chunk = min(self.CHUNK, max(1, (1 << 21) // max(1, per_rec)))
        self.spans = [(lo, min(b, lo + chunk)) for lo in range(0, b, chunk)]

    @property
    def batch(self) -> int:
        return self.spans[-1][1] if self.spans else 0

    def _spans(self) -> List[Tuple[int, int]]:
        return self.spans

    def _keep(self, parts: List[torch.Tensor]) -> List[torch.Tensor]:
        """Holds the chunks (what the norm and the sum read from now on), not the factors."""
        self.parts = parts
        self.a = self.g = None  # type: ignore[assignment]
        return parts

    def _fold(self, lo: int, hi: int) -> torch.Tensor:
        stride, padding, dilation, groups = self.conf
        a, g, w = self.a, self.g, self.w
        n, nd = hi - lo, a.dim() - 2
        shape = (n * w.shape[0],) + tuple(w.shape[1:])
        return torch.ops.aten.convolution_backward(
            g[lo:hi].reshape((1, n * g.shape[1]) + tuple(g.shape[2:])),
            a[lo:hi].reshape((1, n * a.shape[1]) + tuple(a.shape[2:])),
            torch.empty(shape, dtype=g.dtype, device=g.device),
            None, list(stride), list(padding), list(dilation), False, [0] * nd, n * groups, [False, True, False],
        )[1].reshape((n,) + tuple(w.shape))

    def _parts(self) -> List[torch.Tensor]:
        """The chunks, formed once (:meth:`sq_norms`) or again the same way (a lean sum pass)."""
        if self.parts is None:
            return [self._fold(lo, hi) for lo, hi in self._spans()]
        return self.parts

    def sq_norms(self, defer: bool = False) -> torch.Tensor:
        parts = self._keep(self._parts())
        return torch.cat([row_sq(p.reshape(p.shape[0], -1))[0] for p in parts])

    def as_dense(self) -> "Dense":
        return Dense(self.param, torch.cat(self._parts()))

    def dense(self, lo: int, hi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        # kept: the clipped sum must add exactly the values this norm was taken of
        parts = self._keep(self._parts())
        out = []
        for (a, b), part in zip(self._spans(), parts):
            if a < hi and lo < b:
                out.append(part[max(lo, a) - a : min(hi, b) - a])
        return torch.cat(out).double(), torch.zeros(hi - lo, dtype=torch.float64, device=parts[0].device)

    def add_clipped(self, c: torch.Tensor, acc: torch.Tensor, cache: Optional[dict] = None) -> None:
        parts = self.parts
        cw = _cw(c, acc.dtype, 1, cache)
        flat = acc.view(1, -1) if acc.is_contiguous() else None
        for k, (lo, hi) in enumerate(self._spans()):
            part = parts[k] if parts is not None else self._fold(lo, hi)
            part = part.to(acc.dtype).reshape(hi - lo, -1)
            if flat is not None:
                flat.addmm_(cw[lo:hi].view(1, -1), part)  # Σ_i c_i·g_i of the chunk, added in place
            else:
                acc.add_(torch.mm(cw[lo:hi].view(1, -1), part).view(acc.shape))

    def zero_records(self, mask: torch.Tensor, memo: Optional[Dict[int, Any]] = None) -> None:
        super().zero_records(mask, memo)
        if self.parts is not None:
            m = mask.to(self.parts[0].device)
            self.parts = [
                p.masked_fill(m[lo:hi].reshape((-1,) + (1,) * (p.dim() - 1)), 0)
                for p, (lo, hi) in zip(self.parts, self._spans())
            ]

    def release(self) -> None:
        super().release()
        self.parts = None


# ----------------------------------------------------------------------------- norms


def _gamma(n: int, dtype: torch.dtype) -> float:
    """γ_n = n·u/(1 − n·u): the relative error bound of an n-term dot product in ``dtype``,
    whatever the summation order (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1)."""
    nu = n * float(torch.finfo(dtype).eps) / 2.0
    return nu / (1.0 - nu) if nu < 0.5 else float("inf")


def _exact_matmul(t: torch.Tensor) -> bool:
    """Whether a float32 matmul of ``t`` rounds in float32 (not TF32 or bfloat16 passes)."""
    if t.dtype != torch.float32:
        return False
    if torch.get_float32_matmul_precision() != "highest":
        return False
    if t.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return False
    return True


def _gram(x: torch.Tensor, cache: Optional[dict], key: Any) -> torch.Tensor:
    """x xᵀ per record (in x's dtype), shared between uses with the same factor (an LSTM's
    weight_ih and weight_hh have the same gate gradients)."""
    if cache is not None and key in cache:
        return cache[key]
    out = torch.bmm(x, x.transpose(1, 2))
    if _keep(cache, key[0]):
        cache[key] = out
    return out


def _cat(parts: List[torch.Tensor]) -> torch.Tensor:
    """The chunks' results joined (one chunk, the usual case: itself, no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _widen(t: torch.Tensor) -> torch.Tensor:
    """bfloat16/float16 as float32 (exact: every such value is a float32)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class RowSq:
    """A parameter's per-record squared norms to be taken as the row sums of squares of ``t``
    (B, d): :func:`finish` takes those of all such parameters in one :func:`row_sq` call (one
    call of the core on CPU, a fixed number of operators on an accelerator)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def value(self) -> torch.Tensor:
        return row_sq(self.t)[0]


class Tail:
    """An upper bound of per-record squared norms (B,) left before its last elementwise steps,
    which are the same for many parameters: :func:`finish` runs them once on the stack of all
    the parameters' tails (a few operators per step, not a few per parameter: a GPU step is
    bound by its launches). ``form`` ``"ghost"``: min(max(w, 0) + k·s², s²); ``"sum"``:
    (√w + k·s)², capped at s² when ``cap``. ``w`` and ``s`` are float64 (B,); ``k`` a Python
    float. The stacked steps are the same float64 operations in the same order as one
    parameter's: the values are bit for bit those of :meth:`value`."""

    __slots__ = ("form", "w", "s", "k", "cap")

    def __init__(self, form: str, w: torch.Tensor, s: torch.Tensor, k: float, cap: bool = True) -> None:
        self.form, self.w, self.s, self.k, self.cap = form, w, s, float(k), cap

    def value(self) -> torch.Tensor:
        return _tail_ops(self.form, self.cap, self.w, self.s, self.k)


def _tail_ops(form: str, cap: bool, w: torch.Tensor, s: torch.Tensor, k: Any) -> torch.Tensor:
    if form == "ghost":
        s2 = s.square()
        return torch.minimum(w.clamp_min(0.0) + k * s2, s2)
    out = (w.sqrt() + k * s).square()
    return torch.minimum(out, s.square()) if cap else out


#: The (L, 1) float64 tensors of the tails' constants, by (device, constants): made once, not
#: copied to the device every step (small, few: one per model and batch shape).
_TAIL_K: Dict[Any, torch.Tensor] = {}


def finish(values: List[Any]) -> List[Any]:
    """``values`` with every :class:`Tail` replaced by its value, the tails of one form stacked
    and finished together (:class:`Tail`)."""
    out = list(values)
    rows: Dict[Any, List[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, RowSq):
            rows.setdefault((v.t.device, v.t.shape[0]), []).append(i)
    for idx in rows.values():
        for i, s in zip(idx, row_sq(*[values[i].t for i in idx])):
            out[i] = s
    values = out
    out = list(values)
    groups: Dict[Any, List[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, Tail):
            groups.setdefault((v.form, v.cap, v.w.device, tuple(v.w.shape)), []).append(i)
    for (form, cap, dev, _), idx in groups.items():
        if len(idx) == 1:
            out[idx[0]] = values[idx[0]].value()
            continue
        ks = tuple(values[i].k for i in idx)
        key = (dev, ks)
        kt = _TAIL_K.get(key)
        if kt is None:
            if len(_TAIL_K) > 256:
                _TAIL_K.clear()
            kt = _TAIL_K[key] = torch.tensor(ks, dtype=torch.float64).view(-1, 1).to(dev, non_blocking=True)
        w = torch.stack([values[i].w for i in idx])
        s = torch.stack([values[i].s for i in idx])
        for i, row in zip(idx, _tail_ops(form, cap, w, s, kt).unbind(0)):
            out[i] = row
    return out


def _factored_sq(cs: Sequence[Factored], cache: Optional[dict] = None, defer: bool = False) -> Any:
    """Upper bounds of ‖Σ_u Σ_t g_t a_tᵀ‖² per record over same-row factored uses (one longer
    sequence). Mixed ghost clipping (Bu et al. 2023, "Differentially private optimization on
    large model at small cost"): per record, the ghost norm Σ_{t,s}(a_t·a_s)(g_t·g_s) (Li et
    al. 2022) costs T²(din+dout) and materialising g_iᵀa_i costs T·din·dout; the cheaper one is
    taken. Float32 products run in float32 (no float64 copy of the activations) with their
    worst-case rounding error γ_n added to the bound; other dtypes in float64. bfloat16 and
    float16 factors (mixed precision) are widened to float32 first, exactly."""
    g0 = cs[0].g if len(cs) == 1 else torch.cat([c.g for c in cs], 1)
    g = _widen(g0)
    b, t, dout = g.shape
    if cs[0].a is None:
        (sg,) = row_sq(g.reshape(b * t, dout))
        if t == 1:
            return sg
        gn = sg.sqrt().view(b, t)
        if g.dtype == torch.float32:
            # Summed in float32 (no float64 copy of g): each coordinate of the computed Σ_t g_t
            # is within γ_t Σ_t |g_t| of the exact one, so the norm within γ_t Σ_t ‖g_t‖.
            cols = g.sum(1)
            if len(cs) == 1:
                cs[0].colsum = cols  # the clipped sum adds exactly these vectors
            rel = _gamma(t, g.dtype) * (1.0 + 1e-6)
            tail = Tail("sum", _sq(cols, 1), gn.sum(1), rel + 2.0 * (t + 2) * _U64, cap=False)
            return tail if defer else tail.value()
        bs = _sq(g.sum(1, dtype=torch.float64), 1)
        tail = Tail("sum", bs, gn.sum(1), 2.0 * (t + 2) * _U64, cap=False)
        return tail if defer else tail.value()
    a0 = cs[0].a if len(cs) == 1 else torch.cat([c.a for c in cs], 1)
    a = _widen(a0)
    din = a.shape[2]
    if t == 1:
        sx, sg = row_sq(a[:, 0], g[:, 0])
        return sx * sg  # ‖g_i a_iᵀ‖² = ‖a_i‖²‖g_i‖²
    if a.dtype != g.dtype:
        a = a.to(g.dtype)
    sx, sg = row_sq(a.reshape(b * t, din), g.reshape(b * t, dout))
    s = (sx.sqrt() * sg.sqrt()).view(b, t).sum(1)  # Σ_t ‖a_t‖‖g_t‖ ≥ ‖Σ_t g_t a_tᵀ‖
    fast = _exact_matmul(g)
    if t * (din + dout) <= din * dout:
        chunk = max(1, _CHUNK // max(1, t * (t + din + dout)))
        parts = []
        for i in range(0, b, chunk):
            ai, gi = (a, g) if chunk >= b else (a[i : i + chunk], g[i : i + chunk])
            if not fast:
                ai, gi = ai.double(), gi.double()
            # keyed by the layer's own tensors (a widened copy's id may be reused once it is freed)
            ga = _gram(ai, cache, (id(a0), i, fast))
            gg = _gram(gi, cache, (id(g0), i, fast))
            # each row's t products summed in the Grams' dtype, the rows in float64
            parts.append((ga * gg).sum(2).double().sum(1))
        w = _cat(parts)
        if fast:
            # |Âts·Ĝts − Ats·Gts| ≤ (γ_din + γ_dout + γ_din·γ_dout)‖a_t‖‖a_s‖‖g_t‖‖g_s‖, and the
            # float32 product and row sums add γ_{t+1} of Σ_{t,s}|Âts·Ĝts| ≤ (1 + rel)·s²
            ga_, gg_ = _gamma(din, g.dtype), _gamma(dout, g.dtype)
            rel = ga_ + gg_ + ga_ * gg_
            rel = rel + _gamma(t + 1, g.dtype) * (1.0 + rel)
        else:
            rel = 0.0
        tail = Tail("ghost", w, s, rel * (1.0 + 1e-6) + 2.0 * (din + dout + t * t + 8) * _U64)
        return tail if defer else tail.value()
    chunk = max(1, _CHUNK // max(1, din * dout + t * (din + dout)))
    parts = []
    for i in range(0, b, chunk):
        gi, ai = (g, a) if chunk >= b else (g[i : i + chunk], a[i : i + chunk])
        if not fast:
            gi, ai = gi.double(), ai.double()
        per = torch.bmm(gi.transpose(1, 2), ai)
        (sq,) = row_sq(per.reshape(per.shape[0], -1))
        parts.append(sq)
    w = _cat(parts)
    # each entry of the float32 product is off by ≤ γ_T Σ_t |g_t,i||a_t,j|: in norm ≤ γ_T·s
    rel = _gamma(t, g.dtype) * (1.0 + 1e-6) if fast else 0.0
    tail = Tail("sum", w, s, rel + 2.0 * (t + 2) * _U64, cap=True)
    return tail if defer else tail.value()


def ghost_key(c: Contribution, shared: set) -> Optional[Tuple[Any, ...]]:
    """For a parameter's single factored use whose norm :func:`_factored_sq` would take in
    float32, in one chunk, from factors no other use shares: the path (ghost norms or the
    materialised product) and the shape under which uses can be stacked
    (:func:`ghost_sq_many`); else None."""
    if type(c) is not Factored or c.rows is not None:
        return None
    if c.a is None:  # a bias: Σ_t g_t, summed in float32
        g = c.g
        if g.dtype != torch.float32 or id(g) in shared or g.shape[1] == 1:
            return None
        return ("bias", int(g.shape[0]), int(g.shape[1]), 0, int(g.shape[2]), g.device)
    a, g = c.a, c.g
    if id(a) in shared or id(g) in shared or a.dtype != torch.float32 or g.dtype != torch.float32:
        return None
    if not (_exact_matmul(g) and _exact_matmul(a)) or a.device != g.device:
        return None
    b, t, dout = g.shape
    din = a.shape[2]
    if t == 1:
        return None
    if t * (din + dout) <= din * dout:
        return None if b > max(1, _CHUNK // max(1, t * (t + din + dout))) else ("ghost", b, t, din, dout, a.device)
    if b > max(1, _CHUNK // max(1, din * dout + t * (din + dout))):
        return None
    return ("product", b, t, din, dout, a.device)


def ghost_sq_many(cs: Sequence[Factored]) -> List[Tail]:
    """The ghost-norm bounds of :func:`_factored_sq` for L uses of one :func:`ghost_key`, as
    stacked products: one batched Gram product per factor for all of them (L·B matrices), the
    row norms and sums of all at once, instead of a dozen operators per layer. Each layer's
    bound is the one-layer formula with its own constants (the γ bounds hold for any order of
    summation, so batching changes no bound)."""
    if cs[0].a is None:
        return _bias_sq_many(cs)
    a = torch.stack([c.a for c in cs])  # type: ignore[misc]
    g = torch.stack([c.g for c in cs])
    n, b, t, din = a.shape
    dout = g.shape[3]
    af, gf = a.view(n * b, t, din), g.view(n * b, t, dout)
    sx, sg = row_sq(af.reshape(n * b * t, din), gf.reshape(n * b * t, dout))
    s = (sx.sqrt() * sg.sqrt()).view(n, b, t).sum(2)  # Σ_t ‖a_t‖‖g_t‖ per layer and record
    if t * (din + dout) > din * dout:
        # the materialised per-record products g_iᵀa_i, their norms (the "sum" bound)
        per = torch.bmm(gf.transpose(1, 2), af)
        (w,) = row_sq(per.reshape(n * b, din * dout))
        kp = _gamma(t, g.dtype) * (1.0 + 1e-6) + 2.0 * (t + 2) * _U64
        return [Tail("sum", wl, sl, kp, cap=True) for wl, sl in zip(w.view(n, b).unbind(0), s.unbind(0))]
    ga = torch.bmm(af, af.transpose(1, 2))
    gg = torch.bmm(gf, gf.transpose(1, 2))
    w = (ga * gg).sum(2).double().sum(1).view(n, b)
    ga_, gg_ = _gamma(din, g.dtype), _gamma(dout, g.dtype)
    rel = ga_ + gg_ + ga_ * gg_
    rel = rel + _gamma(t + 1, g.dtype) * (1.0 + rel)
    k = rel * (1.0 + 1e-6) + 2.0 * (din + dout + t * t + 8) * _U64
    return [Tail("ghost", wl, sl, k) for wl, sl in zip(w.unbind(0), s.unbind(0))]


def _bias_sq_many(cs: Sequence[Factored]) -> List[Tail]:
    """The float32 bias bounds of :func:`_factored_sq` for L biases of one shape, stacked: each
    record's Σ_t g_t of every bias in one sum (left on each use for its clipped sum, which adds
    exactly these vectors), the row norms of all in one call. The bound, γ_t·Σ_t‖g_t‖ on the
    summed vector, holds for any order of summation."""
    g = torch.stack([c.g for c in cs])
    n, b, t, dout = g.shape
    (sg,) = row_sq(g.reshape(n * b * t, dout))
    gn = sg.sqrt().view(n, b, t).sum(2)
    cols = g.sum(2)
    for c, col in zip(cs, cols.unbind(0)):
        c.colsum = col
    k = _gamma(t, g.dtype) * (1.0 + 1e-6) + 2.0 * (t + 2) * _U64
    return [Tail("sum", w, s, k, cap=False) for w, s in zip(_sq(cols, 2).unbind(0), gn.unbind(0))]


def _tied_sq(rows: Rows, fs: Sequence[Factored]) -> torch.Tensor:
    """‖L + E‖² per record for a matrix used both as an embedding (E: rows idx_s get e_s) and
    as a linear map (L = Σ_t g_t a_tᵀ): tied input and output embeddings of language models.
    ‖L‖² and ‖E‖² by their own bounds, and the cross term without materialising either:
    ⟨L, E⟩ = Σ_{t,s} g_t[idx_s]·(a_t·e_s) (the ghost-norm idea applied to the pair).
    Each term is bounded above, so their sum bounds ‖L + E‖²."""
    wl = _factored_sq(fs)
    we = rows.sq_norms()
    g = fs[0].g if len(fs) == 1 else torch.cat([c.g for c in fs], 1)
    a = fs[0].a if len(fs) == 1 else torch.cat([c.a for c in fs], 1)  # type: ignore[list-item]
    assert a is not None
    b, t, _ = g.shape
    idx, e = rows.idx, rows.g.to(a.dtype)
    sl = (torch.linalg.vector_norm(a, dim=2, dtype=torch.float64) * torch.linalg.vector_norm(g, dim=2, dtype=torch.float64)).sum(1)
    se = torch.linalg.vector_norm(e, dim=2, dtype=torch.float64).sum(1)
    n = idx.shape[1]
    fast = _exact_matmul(a)
    chunk = max(1, _CHUNK // max(1, t * n * 4 + t * g.shape[2]))
    parts = []
    for i in range(0, b, chunk):
        sel = torch.gather(g[i : i + chunk], 2, idx[i : i + chunk].unsqueeze(1).expand(-1, t, n))
        ai, ei = a[i : i + chunk], e[i : i + chunk]
        if not fast:
            ai, ei = ai.double(), ei.double()
        ae = torch.bmm(ai, ei.transpose(1, 2))
        parts.append((sel.double() * ae.double()).sum((1, 2)))
    cross = _cat(parts)
    rel = _gamma(a.shape[2], a.dtype) * (1.0 + 1e-6) if fast else 0.0
    err = (rel + 2.0 * (a.shape[2] + t * n + 8) * _U64) * sl * se
    total = wl + we + 2.0 * (cross + err)
    cap = (wl.sqrt() + we.sqrt()).square()
    return torch.minimum(total.clamp_min(0.0), cap)


def _dense_sq(cs: Sequence[Contribution], b: int) -> torch.Tensor:
    """‖Σ_u g_u‖² per record by materialising every use in float64, plus their error bounds."""
    param = cs[0].param
    chunk = max(1, _CHUNK // max(1, param.numel() * 2))
    out = []
    for lo in range(0, b, chunk):
        hi = min(b, lo + chunk)
        tot = torch.zeros((hi - lo,) + tuple(param.shape), dtype=torch.float64, device=param.device)
        err = torch.zeros(hi - lo, dtype=torch.float64, device=param.device)
        for c in cs:
            per, e = c.dense(lo, hi)
            (tot if c.rows is None else tot[:, c.rows[0] : c.rows[1]]).add_(per)
            err = err + e
        n = torch.linalg.vector_norm(tot.reshape(hi - lo, -1), dim=1)
        out.append((n + err).square())
    return _cat(out)


def _overlap(x: Tuple[int, int], y: Tuple[int, int]) -> bool:
    return x[0] < y[1] and y[0] < x[1]


def _by_rows(cs: Sequence[Contribution], nrows: int) -> List[List[Contribution]]:
    """Uses grouped so that groups touch disjoint rows (their squared norms add)."""
    spans: List[Tuple[Tuple[int, int], List[Contribution]]] = []
    for c in cs:
        r = c.rows if c.rows is not None else (0, nrows)
        hit = [k for k, (s, _) in enumerate(spans) if _overlap(s, r)]
        if not hit:
            spans.append((r, [c]))
            continue
        members = [c]
        lo, hi = r
        for k in reversed(hit):
            s, m = spans.pop(k)
            members = m + members
            lo, hi = min(lo, s[0]), max(hi, s[1])
        spans.append(((lo, hi), members))
    return [m for _, m in spans]


def _merge_dense(cs: List[Contribution]) -> List[Contribution]:
    """Dense uses of the same rows summed once: the norm and the clipped sum then read the
    same tensor, whatever the rounding of the sum."""
    dense = [c for c in cs if isinstance(c, Dense)]
    if len(dense) < 2 or any(c.rows != dense[0].rows for c in dense):
        return cs
    tot = dense[0].per.clone()
    for c in dense[1:]:
        tot.add_(c.per.to(tot.dtype))
    return [c for c in cs if not isinstance(c, Dense)] + [Dense(dense[0].param, tot, dense[0].rows)]


def _plus(total: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x if total is None else total + x


def param_sq_norms(
    cs: List[Contribution], b: int, cache: Optional[dict] = None, *, defer: bool = False
) -> Tuple[Any, List[Contribution]]:
    """(upper bounds of each record's squared gradient norm for one parameter, the uses to
    form its clipped sum from). ``defer``: a parameter of one factored use may return its
    bound as a :class:`Tail`, for :func:`finish` to complete with the other parameters'."""
    param = cs[0].param
    total: Any = None
    used: List[Contribution] = []
    groups = _by_rows(cs, int(param.shape[0]) if param.dim() else 1)
    if defer and len(groups) == 1:
        group = _merge_dense(groups[0])
        if len({c.rows for c in group}) == 1 and {type(c) for c in group} == {Factored} and len(
            {c.a is None for c in group}
        ) == 1 and len({None if c.a is None else c.a.shape[2] for c in group}) == 1:  # type: ignore[union-attr]
            return _factored_sq(group, cache if len(group) == 1 else None, defer=True), list(group)  # type: ignore[arg-type]
        if len(group) == 1 and isinstance(group[0], ConvFactors):
            return group[0].sq_norms(defer=True), list(group)
        if len(group) == 1 and type(group[0]) is Dense:
            return RowSq(group[0].per.reshape(b, -1)), list(group)  # type: ignore[attr-defined]
    for group in groups:
        group = _merge_dense(group)
        same = all(c.rows == group[0].rows for c in group)
        kinds = {type(c) for c in group}
        if same and kinds == {Factored} and len({c.a is None for c in group}) == 1 and len({None if c.a is None else c.a.shape[2] for c in group}) == 1:  # type: ignore[union-attr]
            # a cache only for single uses, whose factors are the layers' own tensors (ids stable)
            total = _plus(total, _factored_sq(group, cache if len(group) == 1 else None))  # type: ignore[arg-type]
        elif len(group) == 1 and isinstance(group[0], Rows):
            total = _plus(total, group[0].sq_norms())
        elif same and kinds == {Rows}:
            r = Rows(param, torch.cat([c.idx for c in group], 1), torch.cat([c.g for c in group], 1))  # type: ignore[attr-defined]
            total = _plus(total, r.sq_norms())
            group = [r]
        elif (
            same
            and kinds == {Rows, Factored}
            and group[0].rows is None
            and all(c.a is not None for c in group if isinstance(c, Factored))  # type: ignore[union-attr]
            and len({c.a.shape[2] for c in group if isinstance(c, Factored)}) == 1  # type: ignore[union-attr]
        ):
            rs = [c for c in group if isinstance(c, Rows)]
            fs = [c for c in group if isinstance(c, Factored)]
            r = rs[0] if len(rs) == 1 else Rows(param, torch.cat([c.idx for c in rs], 1), torch.cat([c.g for c in rs], 1))
            total = _plus(total, _tied_sq(r, fs))
            group = [r, *fs]
        elif len(group) == 1 and isinstance(group[0], ConvFactors):
            total = _plus(total, group[0].sq_norms())
        elif len(group) == 1 and isinstance(group[0], Dense):
            (s,) = row_sq(group[0].per.reshape(b, -1))
            total = _plus(total, s)
        else:
            total = _plus(total, _dense_sq(group, b))
        used.extend(group)
    if total is None:
        total = torch.zeros(b, dtype=torch.float64, device=param.device)
    return total, used


def gather(contributions: Sequence[Contribution]) -> Dict[int, List[Contribution]]:
    """Uses keyed by parameter identity, in order."""
    out: Dict[int, List[Contribution]] = {}
    for c in contributions:
        out.setdefault(id(c.param), []).append(c)
    return out
