"""NestedQuery: a tree of queries, one per group of vectors (McMahan et al. 2018, §2–§3).

Each leaf query privatizes one group with its own clip norm and noise ("separate clipping and
noise parameters", §2). All groups see the same sample, so for accounting they are one Gaussian
sum query with the noise multiplier of Eq. (1); the NestedQuery's event is the composition of
its groups' events and the ledger applies Eq. (1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple



from .. import _core
from ..mechanism import check_norms
from .._seeds import derive_seed
from .base import DPQuery, noise_releases
from ..events import ComposedQueryEvent

__all__ = ["NestedQuery"]

Path = Tuple[Any, ...]


def _path_str(path: Path) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def _leaves(nest: Any, path: Path = ()) -> List[Tuple[Path, DPQuery]]:
    if isinstance(nest, DPQuery):
        return [(path, nest)]
    if isinstance(nest, dict):
        if not nest:
            raise ValueError(f"queries at {_path_str(path)}: empty dict")
        return [leaf for k, v in nest.items() for leaf in _leaves(v, path + (k,))]
    if isinstance(nest, (list, tuple)):
        if not nest:
            raise ValueError(f"queries at {_path_str(path)}: empty {type(nest).__name__}")
        return [leaf for k, v in enumerate(nest) for leaf in _leaves(v, path + (k,))]
    raise TypeError(
        f"queries at {_path_str(path)}: expected a DPQuery or a dict/list/tuple of them, got {type(nest).__name__}"
    )


def _flatten_like(structure: Any, values: Any, what: str, path: Path = ()) -> List[Any]:
    """The subtrees of ``values`` at the leaves of the query nest ``structure``."""
    if isinstance(structure, DPQuery):
        return [values]
    if isinstance(structure, dict):
        if not isinstance(values, dict):
            raise TypeError(f"{what} at {_path_str(path)}: expected a dict, got {type(values).__name__}")
        if set(values) != set(structure):
            missing = [k for k in structure if k not in values]
            extra = [k for k in values if k not in structure]
            raise ValueError(f"{what} at {_path_str(path)}: keys differ from the queries' (missing {missing}, unexpected {extra})")
        return [x for k, q in structure.items() for x in _flatten_like(q, values[k], what, path + (k,))]
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{what} at {_path_str(path)}: expected a list or tuple, got {type(values).__name__}")
    if len(values) != len(structure):
        raise ValueError(f"{what} at {_path_str(path)}: {len(values)} entries but {len(structure)} queries")
    return [x for k, q in enumerate(structure) for x in _flatten_like(q, values[k], what, path + (k,))]


def _unflatten(structure: Any, it: Any) -> Any:
    if isinstance(structure, DPQuery):
        return next(it)
    if isinstance(structure, dict):
        return {k: _unflatten(q, it) for k, q in structure.items()}
    out = [_unflatten(q, it) for q in structure]
    return tuple(out) if isinstance(structure, tuple) else out


@dataclass(frozen=True)
class NestedState:
    """A NestedQuery's global or sample state: one entry per leaf, in leaf order."""

    leaves: Tuple[Any, ...]


class NestedQuery(DPQuery):
    """Runs a nest (dicts, lists, tuples; any depth) of queries on the matching nest of records.

    ``records`` given to :meth:`accumulate_records` has the structure of ``queries``; at each
    leaf, the subtree is what that leaf query accepts (an array of shape (B, ...) or a list/tuple
    of arrays for a multi-part group). The result has the structure of ``queries``; the event is
    a :class:`ComposedQueryEvent` of the leaves' events, to which the ledger applies Eq. (1) (§3).

    The Gaussian leaves (sum, average, joint-clipping, count and adaptive-clipping queries) are
    clipped together in one Rust call per batch, each group to its own bound, and noised
    together in one more (see :meth:`DPQuery.clip_job`); for finite records the results are the
    ones the leaves would give on their own, up to the noise drawn. Other leaves run on their own.

    A record with a NaN or ±∞ value in any of the fused groups adds zero to every fused group's
    sum (the record, not the group, is the unit of privacy; each group still contributes at most
    its bound S_g, and zero has norm 0); a leaf run on its own (a discrete Gaussian leaf, say)
    treats its own group's records as that leaf does. If any fused leaf was built with
    ``on_nonfinite="raise"``, the one call raises ``ValueError`` naming the first such record,
    and no leaf's state changes (debugging only, not differentially private).

    Seeds (tests only) are split into an independent one per leaf.
    """

    def __init__(self, queries: Any) -> None:
        self._structure = queries
        self._leaves = _leaves(queries)
        self._queries = [q for _, q in self._leaves]

    def __repr__(self) -> str:
        return f"NestedQuery({self._structure!r})"

    @property
    def leaf_queries(self) -> Tuple[DPQuery, ...]:
        """The groups' queries, in the order of :attr:`leaf_paths` and of the composed event."""
        return tuple(self._queries)

    @property
    def leaf_paths(self) -> List[str]:
        """The groups' paths ("a/0/b"), in the order of the composed event."""
        return [_path_str(p) for p, _ in self._leaves]

    def _state(self, st: Any, what: str) -> Tuple[Any, ...]:
        if not isinstance(st, NestedState) or len(st.leaves) != len(self._queries):
            raise TypeError(f"{what} must come from this NestedQuery, got {type(st).__name__}")
        return st.leaves

    def _map(self, f: Callable[..., Any], *columns: Any) -> NestedState:
        return NestedState(tuple(f(q, *args) for q, *args in zip(self._queries, *columns)))

    def initial_global_state(self) -> NestedState:
        return NestedState(tuple(q.initial_global_state() for q in self._queries))

    def derive_sample_params(self, global_state: Any) -> NestedState:
        return self._map(lambda q, g: q.derive_sample_params(g), self._state(global_state, "global_state"))

    def initial_sample_state(self, template: Any) -> NestedState:
        t = _flatten_like(self._structure, template, "template")
        return self._map(lambda q, x: q.initial_sample_state(x), t)

    def accumulate_records(self, params: Any, sample_state: Any, records: Any) -> NestedState:
        p = self._state(params, "params")
        s = self._state(sample_state, "sample_state")
        r = _flatten_like(self._structure, records, "records")
        # Every leaf checks its records (clip_job) before the one call clips any of them.
        jobs = [q.clip_job(a, b, c) for q, a, b, c in zip(self._queries, p, s, r)]
        fused = [k for k, j in enumerate(jobs) if j is not None]
        out = [None if jobs[k] is not None else q.accumulate_records(p[k], s[k], r[k]) for k, q in enumerate(self._queries)]
        if fused:
            batch = jobs[fused[0]].arrays[0].shape[0]
            for k in fused:
                if jobs[k].arrays[0].shape[0] != batch:
                    raise ValueError(
                        f"records at {self.leaf_paths[k]}: {jobs[k].arrays[0].shape[0]} records, but "
                        f"{batch} at {self.leaf_paths[fused[0]]} (all groups hold the same sample)"
                    )
            arrays = [a for k in fused for a in jobs[k].arrays]
            groups = [g for g, k in enumerate(fused) for _ in jobs[k].arrays]
            scales = [a for k in fused for a in (jobs[k].scales or (1.0,) * len(jobs[k].arrays))]
            flat, norms = _core.clip_sum_groups(arrays, groups, [jobs[k].l2_norm_clip for k in fused], scales)
            if any(getattr(self._queries[k], "on_nonfinite", "zero") == "raise" for k in fused):
                # a non-finite record has norm NaN in every group: group 0's norms tell
                check_norms(norms, "raise", batch)
            it = iter(flat)
            for g, k in enumerate(fused):
                sums = [next(it).reshape(a.shape[1:]) for a in jobs[k].arrays]
                out[k] = self._queries[k].accumulate_clipped(p[k], s[k], sums, norms[g * batch : (g + 1) * batch])
        return NestedState(tuple(out))

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> NestedState:
        a = self._state(sample_state_1, "sample_state_1")
        b = self._state(sample_state_2, "sample_state_2")
        return self._map(lambda q, x, y: q.merge_sample_states(x, y), a, b)

    def get_noised_result(
        self, sample_state: Any, global_state: Any, *, seed: Optional[int] = None
    ) -> Tuple[Any, NestedState, ComposedQueryEvent]:
        s = self._state(sample_state, "sample_state")
        g = self._state(global_state, "global_state")
        rels = [
            q.gaussian_release(a, b, seed=derive_seed(seed, 1_000_003, k))
            for k, (q, a, b) in enumerate(zip(self._queries, s, g))
        ]
        fused = [rel for rel in rels if rel is not None]
        noised = iter(noise_releases(fused, derive_seed(seed, 1_000_003)) if fused else [])
        outs = [
            q.get_noised_result(a, b, seed=derive_seed(seed, 1_000_003, k))
            if rel is None
            else (next(noised), rel.global_state, rel.event)
            for k, (q, a, b, rel) in enumerate(zip(self._queries, s, g, rels))
        ]
        result = _unflatten(self._structure, iter([o[0] for o in outs]))
        return result, NestedState(tuple(o[1] for o in outs)), ComposedQueryEvent(tuple(o[2] for o in outs))

    def derive_metrics(self, global_state: Any) -> dict:
        g = self._state(global_state, "global_state")
        out = {}
        for (path, q), gs in zip(self._leaves, g):
            for k, v in q.derive_metrics(gs).items():
                # a query alone (no structure around it) keeps its metric's own name, as TF
                # Privacy's NestedQuery does; "<root>" is for error messages only
                out[f"{_path_str(path)}/{k}" if path else k] = v
        return out
