"""Microbatches: a record is the average gradient of a microbatch of k examples.

McMahan et al. 2018, Table 1 and §7; Ponomareva et al. 2023 (survey), §5.6 and Algorithm 3.
Clipping the microbatch average instead of each example is cheaper, but when the guarantee is
claimed per *example*, one example can move its microbatch's clipped average from g to −g:
the sensitivity of the sum is 2C, not C (survey §5.6 (a)). The query therefore reports the
doubled bound 2C in its event, and the ledger accounts z_eff = σ̃/(2C). To keep the noise
multiplier of plain DP-SGD, give the inner query a stddev of 2·z·C (the 4σ²C² of Algorithm 3).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import numpy as np

from .._attrs import readonly
from .._validate import count
from .base import DPQuery
from ..events import ComposedQueryEvent, NonPrivateQueryEvent, SumQueryEvent

__all__ = ["MicrobatchQuery", "scale_sensitivity"]


def scale_sensitivity(event: Any, factor: float) -> Any:
    """The event with every privacy tuple's L2 bound multiplied by ``factor`` (noise unchanged).

    Everything else a tuple says is kept: its mechanism (a discrete Gaussian or a matrix-
    factorization step must not be accounted as independent continuous Gaussian noise) and, for
    a matrix-factorization step, its stream and declaration."""
    if isinstance(event, SumQueryEvent):
        return dataclasses.replace(event, l2_norm_clip=event.l2_norm_clip * factor)
    if isinstance(event, ComposedQueryEvent):
        return ComposedQueryEvent(tuple(scale_sensitivity(e, factor) for e in event.events))
    if isinstance(event, NonPrivateQueryEvent):
        return event
    raise TypeError(f"not a query event: {type(event).__name__}")


def _microbatch_means(a: Any, k: int) -> np.ndarray:
    arr = a if isinstance(a, np.ndarray) else np.asarray(a)
    if arr.ndim == 0:
        raise ValueError("records need a leading example axis, got a 0-d array")
    if arr.dtype.kind != "f" or arr.dtype.itemsize not in (4, 8):
        raise TypeError(f"records must be float32 or float64, got dtype {arr.dtype}")
    b = arr.shape[0]
    if b == 0:
        return arr
    starts = np.arange(0, b, k)
    sums = np.add.reduceat(arr, starts, axis=0)
    counts = np.diff(np.append(starts, b)).astype(arr.dtype)
    return sums / counts.reshape((-1,) + (1,) * (arr.ndim - 1))


def _map_arrays(f: Any, nest: Any) -> Any:
    if isinstance(nest, dict):
        return {k: _map_arrays(f, v) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        out = [_map_arrays(f, v) for v in nest]
        return tuple(out) if isinstance(nest, tuple) else out
    return f(nest)


class MicrobatchQuery(DPQuery):
    """Wraps a query so that its records are microbatch averages (survey Algorithm 3).

    ``accumulate_records`` takes per-example records (any nest the inner query accepts, leading
    axis = examples), averages consecutive runs of ``microbatch_size`` examples (the last run may
    be shorter, e.g. for a Poisson sample) with one vectorised numpy reduction, and hands the
    averages to the inner query, which clips each average to C.

    ``example_level_privacy=True`` (the default) claims privacy per example: with
    ``microbatch_size`` > 1 the event's bounds are doubled to 2C (survey §5.6 (a), add-or-remove
    neighbouring). This assumes, as the survey does, that adding or removing one example changes
    only the microbatch it belongs to. With ``example_level_privacy=False`` the privacy unit is the
    microbatch itself (McMahan et al. 2018, Table 1) and the bound stays C. The expected
    denominator of an average is then the expected number of microbatches.

    An example with a NaN or ±∞ value makes its microbatch's average non-finite, and the inner
    query treats that average as its ``on_nonfinite`` says: by default it adds zero (within
    either bound: zero has norm 0); with ``"raise"`` the error names the microbatch's index.
    """

    def __init__(self, query: DPQuery, microbatch_size: int, *, example_level_privacy: bool = True) -> None:
        if not isinstance(query, DPQuery):
            raise TypeError(f"query must be a DPQuery, got {type(query).__name__}")
        microbatch_size = count("microbatch_size", microbatch_size, 1)
        if not isinstance(example_level_privacy, bool):
            raise TypeError("example_level_privacy must be a bool")
        self._inner = query
        self._k = int(microbatch_size)
        self._factor = 2.0 if (example_level_privacy and self._k > 1) else 1.0

    def __repr__(self) -> str:
        return f"MicrobatchQuery({self._inner!r}, microbatch_size={self._k}, sensitivity_factor={self._factor})"

    microbatch_size = readonly[int]("_k", "Examples averaged into each microbatch record.")
    inner = readonly[DPQuery]("_inner", "The wrapped query, which sees microbatch averages as its records.")
    sensitivity_factor = readonly[float](
        "_factor", "2 when example-level privacy is claimed for microbatches of more than one example."
    )

    def initial_global_state(self) -> Any:
        return self._inner.initial_global_state()

    def derive_sample_params(self, global_state: Any) -> Any:
        return self._inner.derive_sample_params(global_state)

    def initial_sample_state(self, template: Any) -> Any:
        return self._inner.initial_sample_state(template)

    def accumulate_records(self, params: Any, sample_state: Any, records: Any) -> Any:
        means = _map_arrays(lambda a: _microbatch_means(a, self._k), records)
        return self._inner.accumulate_records(params, sample_state, means)

    def accumulate_record(self, params: Any, sample_state: Any, record: Any) -> Any:
        """Adds ONE microbatch whose average the caller already computed (no leading axis)."""
        return self._inner.accumulate_record(params, sample_state, record)

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        return self._inner.merge_sample_states(sample_state_1, sample_state_2)

    def get_noised_result(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Tuple[Any, Any, Any]:
        result, gs, event = self._inner.get_noised_result(sample_state, global_state, seed=seed)
        return result, gs, scale_sensitivity(event, self._factor)

    def derive_metrics(self, global_state: Any) -> dict:
        return self._inner.derive_metrics(global_state)

    # -- sums formed by the caller (see DPQuery): records are microbatch averages there too

    def release_plan(self, global_state: Any, num_parts: int, *, dim: Optional[int] = None) -> Any:
        plan = self._inner.release_plan(global_state, num_parts, dim=dim)
        return dataclasses.replace(plan, event=scale_sensitivity(plan.event, self._factor))

    def initial_norm_state(self) -> Any:
        return self._inner.initial_norm_state()

    @property
    def reads_norms(self) -> bool:
        return self._inner.reads_norms

    def accumulate_norms(self, params: Any, norm_state: Any, norms: np.ndarray) -> Any:
        return self._inner.accumulate_norms(params, norm_state, norms)

    def merge_norm_states(self, norm_state_1: Any, norm_state_2: Any) -> Any:
        return self._inner.merge_norm_states(norm_state_1, norm_state_2)

    def get_noised_plan(
        self, norm_state: Any, global_state: Any, num_parts: int, *, seed: Optional[int] = None,
        dim: Optional[int] = None,
    ) -> Any:
        plan, gs = self._inner.get_noised_plan(norm_state, global_state, num_parts, seed=seed, dim=dim)
        return dataclasses.replace(plan, event=scale_sensitivity(plan.event, self._factor)), gs
