"""Trace points of the release paths, read by the grey-box neighbour harness
(:mod:`dpcore.audit._greybox`; Cebere, Erb, Desfontaines, Bellet & Fitzsimons, "Privacy in
Theory, Bugs in Practice: Grey-Box Auditing of DP Libraries", PETS 2026).

Every release path calls :func:`release` with its pre-noise sums and what it declares about them
(sensitivity, denominator, noise), :func:`branch` at each decision that could depend on data
(whether a step releases, whether it was skipped), and the ledger calls :func:`ledger` for each
entry it writes. Outside a harness run nothing is recorded and each call costs one global read:
``active()`` is False, and call sites that would have to compute something only for the trace
(a copy of the pre-noise sums) ask it first.

The tracer is process-wide, not a context variable: the torch adapter writes its ledger entries
on a background thread, which must be traced too. The harness runs one training at a time.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["active", "release", "branch", "ledger", "output", "output_tensors", "Tracer", "start", "stop"]


class Tracer:
    """What one run did, in order: ``events`` is a list of dicts with a ``"kind"`` of
    ``"release"``, ``"branch"`` or ``"ledger"``; ``outputs`` the noised values it released.

    ``replay``: the ``outputs`` of an earlier run, returned in place of this run's own (each
    release site's k-th output for its k-th): the neighbour run then sees exactly the history
    that the first run released, so the model, the adaptive clip and every later release start
    from the same state, and each release is compared as one mechanism of the adaptive
    composition (the adversary's view up to that step held fixed)."""

    def __init__(self, replay: Optional[List[Any]] = None) -> None:
        self.events: List[Dict[str, Any]] = []
        self.outputs: List[Any] = []
        self.replay = replay
        self._lock = threading.Lock()

    def add(self, ev: Dict[str, Any]) -> None:
        with self._lock:
            self.events.append(ev)


_TRACER: Optional[Tracer] = None


def active() -> bool:
    """Whether a harness run is being traced (call sites skip trace-only work otherwise)."""
    return _TRACER is not None


def start(replay: Optional[List[Any]] = None) -> Tracer:
    global _TRACER
    if _TRACER is not None:
        raise RuntimeError("a grey-box trace is already running in this process (one run at a time)")
    _TRACER = Tracer(replay)
    return _TRACER


def stop() -> None:
    global _TRACER
    _TRACER = None


def _numpy(x: Any) -> Any:
    """A float64 numpy copy of an array or tensor (torch's on any device, TF's eager)."""
    import numpy as np

    if hasattr(x, "detach"):  # torch
        x = x.detach().to("cpu").double().numpy()
    elif hasattr(x, "numpy") and not isinstance(x, np.ndarray):  # TF eager
        x = x.numpy()
    return np.array(x, dtype=np.float64, copy=True)


def release(
    site: str,
    parts: Sequence[Dict[str, Any]],
    *,
    denominator: Optional[float],
    noise: Dict[str, Any],
    event: Any = None,
) -> None:
    """A release at ``site``: ``parts`` are the groups that are clipped and noised apart (one for
    flat clipping), each a dict with ``"sums"`` (the pre-noise sums of its arrays, in the units
    released: already divided by ``denominator`` where the path folds it into the clip factors,
    then ``"divided": True``), ``"sensitivity"`` (the declared L2 bound on one record's
    contribution to those sums, in the same units) and optionally ``"scales"`` (joint clipping:
    the norm is that of the arrays divided by their scales). ``noise``: the declared noise
    (stddev per part, mechanism)."""
    t = _TRACER
    if t is None:
        return
    t.add(
        {
            "kind": "release",
            "site": site,
            "parts": [
                {
                    "sums": [_numpy(s) for s in p["sums"] if s is not None],
                    "sensitivity": float(p["sensitivity"]),
                    "scales": None if p.get("scales") is None else [float(a) for a in p["scales"]],
                    "divided": bool(p.get("divided", False)),
                }
                for p in parts
            ],
            "denominator": None if denominator is None else float(denominator),
            "noise": {k: _plain(v) for k, v in noise.items()},
            "event": None if event is None else repr(event),
        }
    )


def branch(site: str, name: str, value: Any) -> None:
    """A decision at ``site`` (``name``: what was decided) that the release path takes."""
    t = _TRACER
    if t is not None:
        t.add({"kind": "branch", "site": site, "name": name, "value": _plain(value)})


def ledger(entry: Dict[str, Any]) -> None:
    """An entry the ledger wrote (its public fields; times and paths left out)."""
    t = _TRACER
    if t is not None:
        t.add({"kind": "ledger", "entry": {k: _plain(v) for k, v in entry.items()}})


def _replayed(t: Tracer, site: str, shapes: List[Any]) -> Optional[List[Any]]:
    """The first run's output for this run's next output at ``site`` (None: nothing to replay,
    or the runs no longer line up, which the harness reports from the events)."""
    k = len(t.outputs)
    t.outputs.append((site, shapes))
    if t.replay is None or k >= len(t.replay):
        return None
    rsite, rvals = t.replay[k]
    if rsite != site or [getattr(v, "shape", None) for v in rvals] != shapes:
        return None
    return rvals


def output(site: str, values: List[Any]) -> List[Any]:
    """Noised numpy values that ``site`` releases: recorded, and in a replayed run replaced by
    the first run's (see :class:`Tracer`). Returns the values to release."""
    t = _TRACER
    if t is None:
        return values
    import numpy as np

    shapes = [np.shape(v) for v in values]
    rep = _replayed(t, site, shapes)
    t.outputs[-1] = (site, [np.array(v, copy=True) for v in values])
    if rep is None:
        return values
    return [np.array(r, dtype=np.asarray(v).dtype, copy=True) for r, v in zip(rep, values)]


def output_tensors(site: str, tensors: List[Any]) -> None:
    """As :func:`output` for torch tensors released in place (None entries skipped)."""
    t = _TRACER
    if t is None:
        return
    live = [x for x in tensors if x is not None]
    rep = _replayed(t, site, [tuple(x.shape) for x in live])
    t.outputs[-1] = (site, [x.detach().clone() for x in live])
    if rep is not None:
        for x, r in zip(live, rep):
            x.copy_(r.to(device=x.device, dtype=x.dtype))


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return repr(v)
