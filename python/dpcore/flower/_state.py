"""The Flower server's DP state in one file, for a restart: plain values as JSON and arrays (the
released model, correlated-noise buffers) beside them in one ``.npz``, written atomically
(temporary file, fsync, rename) after every release. No pickle: loading a state file runs no
code. A query's global state (a dataclass, or a matrix-factorization noise stream) is rebuilt
against the classes of the query's ``initial_global_state()``."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List

import numpy as np

__all__ = ["write_state", "read_state", "decode_global_state"]

FORMAT = "dpcore-flower-server"
VERSION = 1


def _encode(x: Any, arrays: List[np.ndarray]) -> Any:
    from ..queries.matrix_factorization import NoiseStream

    if isinstance(x, NoiseStream):
        parts = {}
        for k, g in x.parts.items():
            d = g.state_dict()
            arrays.append(np.asarray(d["state"]))
            parts[str(int(k))] = {"strategy": d["strategy"], "size": int(d["size"]), "dtype": str(d["dtype"]),
                                  "step": int(d["step"]), "state": {"array": len(arrays) - 1}}
        return {"class": "NoiseStream", "step": int(x.step), "parts": parts}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"class": type(x).__name__, "fields": {f.name: _encode(getattr(x, f.name), arrays)
                                                      for f in dataclasses.fields(x)}}
    if isinstance(x, np.ndarray):
        arrays.append(x)
        return {"array": len(arrays) - 1}
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return {"class": type(x).__name__, "items": [_encode(v, arrays) for v in x]}
    if isinstance(x, dict):
        return {"class": "dict", "map": {str(k): _encode(v, arrays) for k, v in x.items()}}
    raise TypeError(f"cannot store a {type(x).__name__} in the server state")


def _resolve(x: Any, arrays: Dict[int, np.ndarray]) -> Any:
    """Array references replaced by the arrays; plain containers rebuilt (dataclasses stay
    encoded until :func:`decode_global_state` has their template)."""
    if isinstance(x, dict):
        if set(x) == {"array"}:
            return arrays[int(x["array"])]
        if x.get("class") == "dict":
            return {k: _resolve(v, arrays) for k, v in x["map"].items()}
        if x.get("class") in ("list", "tuple") and "items" in x:
            vals = [_resolve(v, arrays) for v in x["items"]]
            return tuple(vals) if x["class"] == "tuple" else vals
        return {k: _resolve(v, arrays) for k, v in x.items()}
    if isinstance(x, list):
        return [_resolve(v, arrays) for v in x]
    return x


def write_state(path: str, state: Dict[str, Any]) -> None:
    arrays: List[np.ndarray] = []
    header = {"format": FORMAT, "version": VERSION, **{k: _encode(v, arrays) for k, v in state.items()}}
    payload = {f"a{i}": a for i, a in enumerate(arrays)}
    payload["header"] = np.frombuffer(json.dumps(header).encode("utf-8"), np.uint8)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_state(path: str) -> Dict[str, Any]:
    with np.load(path, allow_pickle=False) as z:
        header = json.loads(bytes(z["header"]).decode("utf-8"))
        arrays = {int(k[1:]): z[k] for k in z.files if k != "header"}
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"{path} is not a dpcore Flower server state (format {header.get('format')!r})")
    header.pop("format"), header.pop("version")
    return {k: _resolve(v, arrays) for k, v in header.items()}


def decode_global_state(enc: Any, template: Any, where: str = "global_state") -> Any:
    """The query's global state from its stored form, rebuilt with the classes of ``template``."""
    from ..queries.matrix_factorization import NoiseStream

    if isinstance(template, NoiseStream):
        if not isinstance(enc, dict) or enc.get("class") != "NoiseStream":
            raise ValueError(f"{where}: the saved state holds no noise stream")
        out = NoiseStream(template.strategy)
        parts = {int(k): dict(v, state=np.asarray(v["state"])) for k, v in enc["parts"].items()}
        out.load_state_dict({"step": enc["step"], "parts": parts})
        return out
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        cls = type(template)
        if not isinstance(enc, dict) or enc.get("class") != cls.__name__:
            raise ValueError(f"{where}: the saved state holds a {enc.get('class') if isinstance(enc, dict) else enc!r}, "
                             f"this query's is a {cls.__name__}")
        names = [f.name for f in dataclasses.fields(template)]
        fields = enc.get("fields", {})
        if sorted(fields) != sorted(names):
            raise ValueError(f"{where}: fields {sorted(fields)} differ from {sorted(names)}")
        return cls(**{k: decode_global_state(fields[k], getattr(template, k), f"{where}.{k}") for k in names})
    if isinstance(template, (list, tuple)) and isinstance(enc, (list, tuple)):
        vals = [decode_global_state(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(enc, template))]
        return tuple(vals) if isinstance(template, tuple) else vals
    if isinstance(template, dict) and isinstance(enc, dict):
        return {k: decode_global_state(enc[k], template[k], f"{where}.{k}") for k in template}
    return enc
