"""The backend-neutral half of the Keras DP step: per-record clipping inside the compiled step,
and the host's part of a release (McMahan et al. 2018, §1–§3 and §6; Abadi et al. 2016,
Algorithm 1).

A step of :class:`dpcore.keras.DPModel` is two compiled calls of the backend (``_backends``)
around one host call:

1. *clip* (compiled): per-record gradients g_i of the per-record loss (``jax.vmap``,
   ``torch.func.vmap``, ``tf.vectorized_map``), each query group's norm ‖g_i‖_G, the factor
   c_i = min(1, C_G/‖g_i‖_G)/denominator and the clipped sums Σ_i c_i·g_i (:func:`clipped_sums`,
   written in ``keras.ops`` so that every backend compiles the same arithmetic);
2. *release* (host, :class:`HostRelease`): the sample and the release's event written durably to
   the :class:`~dpcore.PrivacyLedger`, and the Gaussian noise drawn by the core's ChaCha20
   generator (data-independent: drawn ahead, in the background, for the next step);
3. *apply* (compiled): the noise added to the sums and the optimizer's update.

The ledger is written after the clip call is dispatched and before the apply call is: the update
never reaches the weights before its release is on disk. Which records were sampled, what they
hold, or whether one of them is not finite changes no control flow: the batch is padded to a
multiple of :data:`PAD` records whose factor is 0, a record whose gradient holds a NaN or ±∞
gets factor 0 in every group, and the same calls run whatever the data.

Queries whose release is not "clipped sum plus Gaussian noise" (the discrete Gaussian,
matrix-factorization noise) and user-level sampling (the mean of a user's examples is the
record) take the *host* path: the compiled call returns the per-record gradients and the query
clips, noises and records them in the core, as :mod:`dpcore.queries` does for numpy arrays.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .. import _core, _trace
from .._seeds import derive_seed
from ..mechanism import gaussian_noise
from ..queries import MicrobatchQuery, NestedQuery
from ..sampling import padded_size
from ..queries.events import ComposedQueryEvent

__all__ = ["PAD", "ClipSpec", "HostRelease", "clipped_sums", "padded"]

#: Batches are padded to a multiple of this many records (padding has factor 0), so that a
#: Poisson batch of any size runs one of a few compiled shapes.
PAD = 8

#: Clip factors below this are 0 (as in the torch adapter: a factor far below float32's normal
#: range would be rounded with a relative error beyond the margin).
MIN_FACTOR = 2.0**-100

_U32 = 2.0**-24


def block(d: int) -> int:
    """The block of the two-stage float32 sums of ``d`` terms: about √d, so that a term passes
    through at most block + ⌈d/block⌉ ≈ 2√d additions, whatever order the compiler sums in; a
    divisor of d near √d where there is one (no padding copy)."""
    r = max(1, math.isqrt(max(d - 1, 0)) + 1)
    for k in range(r, max(1, r // 2) - 1, -1):
        if d % k == 0:
            return k
    return r


def sum_error(d: int) -> int:
    """n with (n-1)·u bounding the relative error of :func:`blocked_sum` over ``d`` non-negative
    terms (Higham 2002, §4.2: any order of a sum of n terms)."""
    k = block(d)
    return k + -(-d // k)


def f32_margin(dims: Sequence[int]) -> float:
    """Relative slack taken off every clip factor of a group of variables of ``dims``
    coordinates, its squared norm summed in float32 in three stages (blocks of about √d values,
    the blocks of a variable, the variables: :func:`sum_error` each), doubled; plus two roundings
    of each contribution c_i·g_i and of its sum, doubled."""
    n = max(sum_error(d) for d in dims) + len(dims) + 32
    return 2.0 * n * _U32 + 4.0 * _U32


class ClipSpec:
    """What the compiled clip call needs to know of the queries, fixed for a DPModel: each
    variable's group and joint-clipping scale (1/α_j²), and each group's float32 margin."""

    def __init__(self, groups: Sequence[Sequence[int]], scales: Sequence[Sequence[float]], shapes: Sequence[Tuple[int, ...]]):
        m = len(shapes)
        self.group_of = [0] * m
        self.inv_sq_scale = [1.0] * m
        for gi, (members, sc) in enumerate(zip(groups, scales)):
            for k, a in zip(members, sc):
                self.group_of[k] = gi
                self.inv_sq_scale[k] = 1.0 / (float(a) * float(a))
        self.num_groups = len(groups)
        self.margins = []
        for members in groups:
            self.margins.append(f32_margin([int(np.prod(shapes[k], dtype=np.int64)) for k in members]))


def blocked_sum(ops: Any, v: Any) -> Any:
    """Σ over the last axis of ``v`` (float32, non-negative terms), in blocks of about √d (see
    :func:`sum_error`)."""
    shape = ops.shape(v)
    d = int(shape[-1])
    k = block(d)
    if k >= d:
        return ops.sum(v, axis=-1)
    n = -(-d // k)
    if n * k != d:
        v = ops.pad(v, [(0, 0)] * (len(shape) - 1) + [(0, n * k - d)])
    return ops.sum(ops.sum(ops.reshape(v, tuple(shape[:-1]) + (n, k)), axis=-1), axis=-1)


def _sq_norms(ops: Any, g: Any) -> Any:
    """Per-record squared L2 norm of ``g`` (B, ...) in float32, summed in blocks (the bound of
    :func:`f32_margin` holds whatever order the compiler sums in)."""
    b = ops.shape(g)[0]
    d = int(np.prod(ops.shape(g)[1:], dtype=np.int64)) if len(ops.shape(g)) > 1 else 1
    return blocked_sum(ops, ops.square(ops.reshape(ops.cast(g, "float32"), (b, d))))


def clipped_sums(ops: Any, grads: Sequence[Any], mask: Any, spec: ClipSpec, clips: Any, inv_dens: Any,
                 ghost_sq: Optional[dict] = None, ghost_sum: Any = None) -> Tuple[List[Any], Any, Any]:
    """Σ_i c_i·g_i per variable, with c_i = min(1, C_G/(‖g_i‖_G·(1+margin_G)))·mask_i/den_G
    (McMahan et al. 2018, §1 step 2 and §2: the norm of a group is over its variables, each
    divided by its joint scale α_j), c_i = 0 for a record whose gradient is NaN or ±∞ anywhere
    (its contribution is exactly zero) or whose factor is below :data:`MIN_FACTOR`.

    ``ops`` is ``keras.ops``; ``grads`` the per-record gradients (B, *shape); ``mask`` (B,) is
    1 for a record and 0 for padding; ``clips`` and ``inv_dens`` (G,) float32 tensors. Returns
    the sums (float32, like the variables), the squared norms (G, B) and the non-finite flags (B,).

    Variables whose gradient is None in ``grads`` have ghost norms (``_ghost``): their squared
    norms are ``ghost_sq[k]`` and their sums ``ghost_sum(factors, bad)[k]``, given each
    variable's factors (B,)."""
    sq: List[Any] = [None] * spec.num_groups
    bad = None
    for k, (g, gi, s) in enumerate(zip(grads, spec.group_of, spec.inv_sq_scale)):
        n2 = _sq_norms(ops, g) if g is not None else ghost_sq.get(k)
        if n2 is None:  # a ghost variable the forward did not use: gradient 0
            continue
        if s != 1.0:
            n2 = n2 * s
        sq[gi] = n2 if sq[gi] is None else sq[gi] + n2
    norms = []
    for gi in range(spec.num_groups):
        n2 = sq[gi] if sq[gi] is not None else ops.zeros_like(mask)
        fin = ops.isfinite(n2)
        bad = ops.logical_not(fin) if bad is None else ops.logical_or(bad, ops.logical_not(fin))
        norms.append(n2)
    factors = []
    for gi in range(spec.num_groups):
        # sqrt of +inf is +inf and of NaN is NaN: both flagged above and zeroed below
        inflated = ops.sqrt(ops.where(bad, ops.zeros_like(norms[gi]), norms[gi])) * (1.0 + spec.margins[gi])
        clip = clips[gi]
        c = ops.where(inflated > clip, clip / ops.maximum(inflated, 1e-30), ops.ones_like(inflated))
        # the floor as the torch adapter's: c/den stays far inside float32's normal range
        floor = MIN_FACTOR * ops.maximum(1.0, 1.0 / inv_dens[gi])
        c = ops.where(ops.logical_or(bad, c < floor), ops.zeros_like(c), c)
        factors.append(c * mask * inv_dens[gi])
    ghosts = None
    if ghost_sum is not None:
        ghosts = ghost_sum({k: factors[gi] for k, (g, gi) in enumerate(zip(grads, spec.group_of)) if g is None}, bad)
    sums = []
    for k, (g, gi) in enumerate(zip(grads, spec.group_of)):
        if g is None:
            sums.append(ghosts[k])
            continue
        g32 = ops.cast(g, "float32")
        # 0·NaN is NaN: a non-finite record's values are zeroed, not only its factor
        g32 = ops.where(ops.reshape(bad, (-1,) + (1,) * (len(ops.shape(g)) - 1)), ops.zeros_like(g32), g32)
        sums.append(ops.tensordot(factors[gi], g32, axes=1))
    return sums, ops.stack(norms), bad


def padded(batch: Any, b: int, tree: Any) -> Tuple[Any, np.ndarray]:
    """``batch`` (a nest of numpy arrays with B = ``b`` rows) padded with zero rows to a multiple
    of :data:`PAD` (at least one), and the (padded) mask of real records."""
    size = padded_size(b, PAD)

    def pad(a: Any) -> Any:
        a = np.asarray(a)
        if a.shape[0] == size:
            return a
        out = np.zeros((size,) + a.shape[1:], a.dtype)
        out[: a.shape[0]] = a
        return out

    mask = np.zeros(size, np.float32)
    mask[:b] = 1.0
    return tree.map_structure(pad, batch), mask


class _Group:
    def __init__(self, query: Any, members: List[int], dim: int) -> None:
        self.query, self.members, self.dim = query, members, dim
        self.gs = query.initial_global_state()


class HostRelease:
    """The host's part of each release of a DPModel on the compiled path: the query groups and
    their plans (what the clip call clips to; each group's Gaussian noise and event), the noise
    from the core (drawn a step ahead in the background: it does not depend on the data), and
    the ledger write. ``query`` is the DPModel's (flat, per-layer or joint clipping with the
    Gaussian mechanism), ``shapes`` the trainable variables'."""

    def __init__(self, query: Any, shapes: Sequence[Tuple[int, ...]]) -> None:
        self.query = query
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        m = len(shapes)
        size = lambda ks: sum(int(np.prod(self.shapes[k], dtype=np.int64)) for k in ks)  # noqa: E731
        if isinstance(query, MicrobatchQuery):
            raise ValueError("a MicrobatchQuery releases through the host path")
        if isinstance(query, NestedQuery):
            leaves = list(query.leaf_queries)
            if len(leaves) != m:
                raise ValueError(f"the per-layer query has {len(leaves)} groups for {m} trainable variables")
            self.groups = [_Group(q, [k], size([k])) for k, q in enumerate(leaves)]
            self.nested = True
        else:
            self.groups = [_Group(query, list(range(m)), size(range(m)))]
            self.nested = False
        plans = self.plans()
        self.compiled = all(p.mechanism == "gaussian" for p in plans)
        self.spec = ClipSpec([g.members for g in self.groups], [p.part_scales for p in plans], self.shapes)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._ahead: Any = None

    # -- plans ------------------------------------------------------------------------------

    def plans(self) -> List[Any]:
        return [g.query.release_plan(g.gs, len(g.members), dim=g.dim) for g in self.groups]

    @property
    def needs_norms(self) -> bool:
        """Whether a release's plan depends on the records' norms (adaptive clipping's count)."""
        return not all(g.query.plan_from_global_state for g in self.groups)

    def clip_args(self) -> Tuple[np.ndarray, np.ndarray]:
        """(clips, 1/denominators) of the next release, float32 (G,)."""
        plans = self.plans()
        return (np.asarray([p.l2_norm_clip for p in plans], np.float32),
                np.asarray([1.0 / p.denominator for p in plans], np.float32))

    # -- a release --------------------------------------------------------------------------

    def release(self, ledger: Any, step: int, sq_norms: Optional[np.ndarray] = None, sums: Any = None,
                seed: Optional[int] = None) -> Tuple[Optional[List[np.ndarray]], Optional[List[np.ndarray]]]:
        """Writes the release ``step`` to ``ledger`` (durably, before the caller applies it) and
        returns ``(noise, None)``: one float32 array per variable, N(0, (α_j·σ̃_G/den_G)²) from
        the core's ChaCha20 (:func:`dpcore.mechanism.gaussian_noise`, variable j of group G
        seeded by ``derive_seed(seed, G, j)`` for tests; None: keyed from the OS), the noise of
        the sum divided by the denominator as the clipped sums already are. ``sq_norms`` (G, b): the real
        records' squared norms, for a query whose plan depends on them (a non-finite record's
        given as +inf: above any clip; padding left out).

        Under the grey-box harness (:mod:`dpcore._trace`) the pre-noise ``sums`` are traced and
        ``(None, released values)`` returned instead, so that a neighbour run can release the
        first run's values."""
        noised = []
        for gi, g in enumerate(self.groups):
            ns = g.query.initial_norm_state()
            if sq_norms is not None:
                ns = g.query.accumulate_norms(g.query.derive_sample_params(g.gs), ns, np.sqrt(np.asarray(sq_norms[gi], np.float64)))
            noised.append(g.query.get_noised_plan(ns, g.gs, len(g.members), seed=derive_seed(seed, step, gi, 0x5EED), dim=g.dim))
        plans = [p for p, _ in noised]
        events = [p.event for p in plans]
        event = events[0] if not self.nested else ComposedQueryEvent(tuple(events))
        sds = [list(p.part_stddevs) for p in plans]
        dens = [p.denominator for p in plans]
        tracing = _trace.active()
        if tracing:
            _trace.branch("keras.step", "release", True)
            presums = [np.asarray(s_, np.float64) for s_ in sums]
            _trace.release(
                "keras.HostRelease",
                [{"sums": [presums[k] for k in g.members], "sensitivity": p.l2_norm_clip / p.denominator,
                  "scales": list(p.part_scales), "divided": True} for g, p in zip(self.groups, plans)],
                denominator=dens[0], noise={"part_stddevs": sds, "mechanism": [p.mechanism for p in plans]}, event=event,
            )
        key = (step, seed, sds, dens)
        noise = self._noise(key)
        ledger.record_release(event)  # durable before the update (McMahan et al. 2018, §6)
        for g, (_, gs) in zip(self.groups, noised):
            g.gs = gs
        if tracing:
            out = [(presums[k] + noise[k]).astype(np.float32) for k in range(len(noise))]
            return None, _trace.output("keras.HostRelease", out)
        return noise, None

    def _draw(self, key: Any) -> List[np.ndarray]:
        step, seed, sds, dens = key
        # On the calling thread (a background one): the core's generator, one stream per
        # variable, without competing for the cores the compiled step runs on.
        noise: List[Any] = [None] * len(self.shapes)
        for gi, (g, row) in enumerate(zip(self.groups, sds)):
            for j, (k, sd) in enumerate(zip(g.members, row)):
                noise[k] = gaussian_noise(self.shapes[k], sd / dens[gi], dtype=np.float32, seed=derive_seed(seed, gi, j),
                                          parallel=False)
        return noise

    def _noise(self, key: Any) -> List[np.ndarray]:
        # A draw made ahead is used only for the release it was made for, and once. A seeded
        # run draws nothing ahead (its next seed is the caller's to choose).
        pending, self._ahead = self._ahead, None
        if pending is not None and pending[0] == key:
            z = pending[1].result()
        else:
            z = self._draw(key)
        step, seed, sds, dens = key
        if seed is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="dpcore-keras-noise")
            nxt = (step + 1, None, sds, dens)
            self._ahead = (nxt, self._pool.submit(self._draw, nxt))
        return z

    def forget(self) -> None:
        """Drops a draw made ahead (the next release is not the one it was drawn for)."""
        self._ahead = None

    def state(self) -> List[Any]:
        return [g.gs for g in self.groups]
