"""Clients and runs shared by the Flower tests: each client holds a target vector per array
and its local training moves the model halfway towards it, so that its update is known in closed
form (Δ_u = ½(t_u − w)) and the brute force needs no Flower at all."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

#: The model: two float32 arrays and an int64 buffer (kept at the server's value).
SHAPES = {"w": (5,), "b": (2, 3)}
#: client behaviours (the ``mode`` column): a normal update, a reply with other shapes, an error
#: reply, no reply at all (a dead node), several ArrayRecords, a float16 reply
NORMAL, WRONG_SHAPE, ERROR, SILENT, TWO_RECORDS = 0, 1, 2, 3, 4


def initial(seed: int = 0) -> ArrayRecord:
    rng = np.random.default_rng(seed)
    return ArrayRecord({
        "w": Array((0.1 * rng.normal(size=SHAPES["w"])).astype(np.float32)),
        "b": Array((0.1 * rng.normal(size=SHAPES["b"])).astype(np.float32)),
        "steps": Array(np.array([7], np.int64)),
    })


def arrays_of(rec: ArrayRecord) -> Dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in zip(rec.keys(), rec.to_numpy_ndarrays())}


def targets(n: int, seed: int = 1, scale: float = 3.0) -> np.ndarray:
    """(n, 11) targets (w then b flattened); client norms spread so that some are clipped."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 11)) * np.linspace(0.1, scale, n)[:, None]


def split(t: np.ndarray) -> Dict[str, np.ndarray]:
    return {"w": t[:5].reshape(SHAPES["w"]), "b": t[5:].reshape(SHAPES["b"])}


def client(target: np.ndarray, mode: int = NORMAL, calls: Optional[List[int]] = None):
    """A ClientApp-like callable: ``(message, context) -> reply``."""
    tgt = split(np.asarray(target, np.float64))

    def train(msg: Message, ctx: Any) -> Message:
        if calls is not None:
            calls.append(int(msg.metadata.dst_node_id))
        arr = arrays_of(msg.content["arrays"])
        new = {k: (arr[k] + 0.5 * (tgt[k] - arr[k])).astype(np.float32) for k in SHAPES}
        out = {"w": new["w"], "b": new["b"], "steps": arr["steps"]}
        if mode == WRONG_SHAPE:
            out["w"] = np.zeros(7, np.float32)
        if mode == ERROR:
            return Message(Error(code=0, reason="client failed"), reply_to=msg)
        content = RecordDict({"arrays": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in out.items()}),
                              "metrics": MetricRecord({"num-examples": 10, "train-loss": 0.5})})
        if mode == TWO_RECORDS:
            content["more"] = ArrayRecord({"x": Array(np.zeros(1, np.float32))})
        return Message(content, reply_to=msg)

    return train


def brute_force(w0: Dict[str, np.ndarray], tg: np.ndarray, present: Sequence[int], clip: float, den: float,
                clipping: str = "flat") -> Dict[str, np.ndarray]:
    """w0 + Σ_{u present} clip(Δ_u) / den, Δ_u = ½(t_u − w0), computed in float64."""
    total = {k: np.zeros(SHAPES[k]) for k in SHAPES}
    for u in present:
        t = split(tg[u])
        d = {k: 0.5 * (t[k] - w0[k].astype(np.float64)) for k in SHAPES}
        if clipping == "flat":
            norm = np.sqrt(sum(float(np.sum(v * v)) for v in d.values()))
            f = {k: min(1.0, clip / norm) for k in SHAPES}
        else:
            c = clip / np.sqrt(len(SHAPES))
            f = {k: min(1.0, c / np.linalg.norm(d[k])) for k in SHAPES}
        for k in SHAPES:
            total[k] += d[k] * f[k]
    return {k: w0[k].astype(np.float64) + total[k] / den for k in SHAPES}


def quiet() -> Any:
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.simplefilter("ignore")
    return w


def config() -> ConfigRecord:
    return ConfigRecord({"lr": 0.1})
