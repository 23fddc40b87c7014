"""Checkpoint and resume of a :class:`~dpcore.torch.DPOptimizer` (its ``state_dict`` and
``load_state_dict``).

The state dict is ``{"optimizer": <the wrapped optimizer's state dict>, "dpcore": {...}}`` in
plain Python types (dicts, lists, str, int, float, bool, None) and tensors only, so that
``torch.load(..., weights_only=True)`` reads it (as the Hugging Face Trainer does with
``optimizer.pt``). The ``dpcore`` part carries what the DP step needs to continue exactly where
it stopped: the release count (the noise and the adaptive clip's seeds of a seeded run derive
from it), each query group's global state (adaptive clipping's current clip norm), the data
loader's position, and the ledger's path and length at the checkpoint. A matrix-factorization
query's global state carries its stream id, step and noise buffers (CPU tensors), and a cyclic
loader's state the key of its permutation, so that a resumed run continues the same noise stream
over the same cycle; a ledger ahead of such a checkpoint is refused even with ``"keep"`` (the
lost releases used steps of the stream that the checkpoint cannot replay).

The optimizer is read and restored through its public state methods only
(:meth:`~dpcore.torch.DPOptimizer.checkpoint_state`, :meth:`~dpcore.torch.DPOptimizer.restore_state`,
which gather those of its stages), and its data loader through the loader protocol
(:mod:`dpcore.torch._loader`).

Loading checks everything before it changes anything. The ledger is the safety check: it must be
the same file, holding exactly the releases the checkpoint saw. Fewer means the ledger was
truncated or belongs to another run, and ε would be under-stated: refused. More is what a crash
between a release's ledger write and the next checkpoint leaves (those releases were spent, but
their updates are lost): refused unless the caller opts in with ``ledger_ahead="keep"``, which
keeps them counted (ε over-counts, the safe side). Ledger entries are never dropped or rewritten.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any, Dict, Optional

from ..ledger import LedgerError
from ._loader import LoaderView

FORMAT = "dpcore-torch-optimizer"
VERSION = 1
LEDGER_AHEAD = ("refuse", "keep")


def check_ledger_ahead(value: Any) -> str:
    if value not in LEDGER_AHEAD:
        raise ValueError(f"ledger_ahead must be 'refuse' or 'keep', got {value!r}")
    return value


# -- global states: frozen dataclasses of floats, as plain values ----------------------------


def _encode_noise_stream(x: Any) -> Dict[str, Any]:
    """A matrix-factorization query's noise buffers: its strategy, step, and each part's
    generator state, the buffers as CPU tensors (num_buffers·size values each, copied)."""
    import torch

    parts = []
    for k in sorted(x.parts):
        d = x.parts[k].state_dict()
        parts.append({
            "part": int(k), "size": int(d["size"]), "dtype": str(d["dtype"]), "step": int(d["step"]),
            "state": torch.from_numpy(d["state"]),
        })
    return {"class": "NoiseStream", "strategy": x.strategy.to_dict(), "step": int(x.step), "parts": parts}


def _decode_noise_stream(enc: Any, template: Any, where: str) -> Any:
    import numpy as np
    import torch

    from ..queries.matrix_factorization import NoiseStream

    if not isinstance(enc, dict) or enc.get("class") != "NoiseStream":
        got = enc.get("class") if isinstance(enc, dict) else type(enc).__name__
        raise ValueError(f"{where}: the checkpoint holds a {got}, this query's noise state is a NoiseStream")
    if enc.get("strategy") != template.strategy.to_dict():
        raise ValueError(
            f"{where}: the checkpoint's noise stream has strategy {enc.get('strategy')}, this query "
            f"{template.strategy.to_dict()}"
        )
    parts = {}
    try:
        for p in enc["parts"]:
            st = p["state"]
            arr = st.detach().cpu().numpy().copy() if isinstance(st, torch.Tensor) else np.asarray(st)
            parts[int(p["part"])] = {
                "strategy": enc["strategy"], "size": p["size"], "dtype": p["dtype"], "step": p["step"], "state": arr,
            }
        out = NoiseStream(template.strategy)
        out.load_state_dict({"step": enc["step"], "parts": parts})
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a noise stream state ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return out


def encode_state(x: Any) -> Any:
    """A query's global state (a dataclass of floats, ints, str, None and nested such values)
    as plain Python values, with each dataclass's class name. A matrix-factorization query's
    noise buffers (a ``NoiseStream``) are stored as CPU tensors beside its strategy and step."""
    from ..queries.matrix_factorization import NoiseStream

    if isinstance(x, NoiseStream):
        return _encode_noise_stream(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"class": type(x).__name__, "fields": {f.name: encode_state(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return {"class": type(x).__name__, "items": [encode_state(v) for v in x]}
    raise TypeError(f"cannot store a query global state holding a {type(x).__name__} in a checkpoint")


def decode_state(enc: Any, template: Any, where: str) -> Any:
    """The inverse of :func:`encode_state`, rebuilt with the classes of ``template`` (the query's
    ``initial_global_state()``, or the value in the same place of it)."""
    from ..queries.matrix_factorization import NoiseStream

    if isinstance(template, NoiseStream):
        return _decode_noise_stream(enc, template, where)
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        cls = type(template)
        if not isinstance(enc, dict) or enc.get("class") != cls.__name__:
            got = enc.get("class") if isinstance(enc, dict) else type(enc).__name__
            raise ValueError(f"{where}: the checkpoint holds a {got} global state, this query's is a {cls.__name__}")
        fields = enc.get("fields")
        names = [f.name for f in dataclasses.fields(template)]
        if not isinstance(fields, dict) or sorted(fields) != sorted(names):
            raise ValueError(f"{where}: the checkpoint's {cls.__name__} has fields {sorted(fields or {})}, expected {sorted(names)}")
        return cls(**{k: decode_state(fields[k], getattr(template, k), f"{where}.{k}") for k in names})
    if isinstance(enc, dict) and "items" in enc:
        items = enc["items"]
        tmpl = list(template) if isinstance(template, (list, tuple)) else []
        vals = [decode_state(v, tmpl[i] if i < len(tmpl) else None, f"{where}[{i}]") for i, v in enumerate(items)]
        return tuple(vals) if enc.get("class") == "tuple" else vals
    if isinstance(enc, dict):
        # a dataclass where the template has a plain value (e.g. None): rebuild from its name
        raise ValueError(f"{where}: cannot rebuild a {enc.get('class')} without a template of that class")
    if enc is not None and not isinstance(enc, (bool, int, float, str)):
        raise ValueError(f"{where}: unexpected {type(enc).__name__} in a stored global state")
    return enc


# -- the optimizer's state ----------------------------------------------------------------


def _same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _ledger_path(ledger: Any) -> str:
    return ledger.path if ledger.is_replica else os.path.abspath(ledger.path)


def optimizer_state(opt: Any) -> Dict[str, Any]:
    """The ``dpcore`` part of :meth:`DPOptimizer.state_dict`, from the stages' state
    (:meth:`DPOptimizer.checkpoint_state`), the data loader's and the ledger's."""
    st = opt.checkpoint_state()
    ledger = opt.ledger
    return {
        "format": FORMAT,
        "version": VERSION,
        "releases": int(st["releases"]),
        "drawn_at_release": int(st["drawn_at_release"]),
        # steps a GradScaler overflow skipped (nothing released); the scaler has its own state_dict
        "skipped_steps": int(st["skipped_steps"]),
        "logical_batch_complete": bool(st["logical_batch_complete"]),
        # None when a query= gives the noise (the optimizer's noise_multiplier is then NaN)
        "noise_multiplier": None if math.isnan(opt.noise_multiplier) else float(opt.noise_multiplier),
        "clipping": str(opt.clipping),
        "expected_batch_size": float(opt.expected_batch_size),
        "num_params": len(st["param_names"]),
        "param_names": list(st["param_names"]),
        "param_shapes": [list(s) for s in st["param_shapes"]],
        "groups": [
            {
                "query": type(g["query"]).__name__,
                "members": list(g["members"]),
                "initial_global_state": encode_state(g["query"].initial_global_state()),
                "global_state": encode_state(g["global_state"]),
            }
            for g in st["groups"]
        ],
        "data_loader": LoaderView(opt.data_loader).state_dict(),
        "ledger": {
            "path": _ledger_path(ledger),
            "num_releases": int(ledger.num_releases),
            "num_samples": len(ledger.samples),
        },
    }


def _check_shape(opt: Any, st: Dict[str, Any], dp: Dict[str, Any]) -> None:
    names, shapes = list(st["param_names"]), [list(s) for s in st["param_shapes"]]
    if dp.get("num_params") != len(names):
        raise ValueError(
            f"the checkpoint is for {dp.get('num_params')} parameter tensors, this optimizer has {len(names)}: "
            "it was taken from a differently shaped model or optimizer"
        )
    if list(dp.get("param_names") or []) != names:
        diff = [(a, b) for a, b in zip(dp.get("param_names") or [], names) if a != b][:3]
        raise ValueError(f"the checkpoint's parameter names differ from this optimizer's (checkpoint vs here: {diff})")
    if [list(s) for s in dp.get("param_shapes") or []] != shapes:
        bad = [(n, a, b) for n, a, b in zip(names, dp.get("param_shapes") or [], shapes) if list(a) != b][:3]
        raise ValueError(f"the checkpoint's parameter shapes differ from this optimizer's (name, checkpoint, here): {bad}")
    z = dp.get("noise_multiplier")
    if dp.get("clipping") != opt.clipping or not _same_float(math.nan if z is None else float(z), opt.noise_multiplier):
        raise ValueError(
            f"the checkpoint was taken with clipping={dp.get('clipping')!r}, noise_multiplier={dp.get('noise_multiplier')}; "
            f"this optimizer has clipping={opt.clipping!r}, noise_multiplier={opt.noise_multiplier}"
        )
    groups, mine = dp.get("groups") or [], st["groups"]
    if len(groups) != len(mine):
        raise ValueError(f"the checkpoint has {len(groups)} query groups, this optimizer has {len(mine)}")
    for gi, (sg, g) in enumerate(zip(groups, mine)):
        q = g["query"]
        if sg.get("query") != type(q).__name__ or list(sg.get("members") or []) != list(g["members"]):
            raise ValueError(
                f"query group {gi}: the checkpoint's is a {sg.get('query')} over {sg.get('members')}, this optimizer's "
                f"a {type(q).__name__} over {list(g['members'])}"
            )
        if sg.get("initial_global_state") != encode_state(q.initial_global_state()):
            raise ValueError(
                f"query group {gi} ({type(q).__name__}) is configured differently from the checkpoint's "
                f"(initial global state {sg.get('initial_global_state')} there, "
                f"{encode_state(q.initial_global_state())} here)"
            )


#: How a direct user of the optimizer keeps the releases; an adapter that builds the optimizer
#: (the HF trainer) sets ``optimizer.ledger_ahead_hint`` to the keyword of its own API.
_LEDGER_AHEAD_HINT = "call optimizer.load_state_dict(state, ledger_ahead='keep') or set optimizer.ledger_ahead = 'keep' first"


def _check_ledger(opt: Any, saved: Dict[str, Any], ledger_ahead: str) -> int:
    """How many releases the ledger holds beyond the checkpoint (0, or more with ``keep``)."""
    ledger = opt.ledger
    path = saved.get("path")
    if not ledger.is_replica and (
        not isinstance(path, str) or os.path.realpath(path) != os.path.realpath(os.path.abspath(ledger.path))
    ):
        raise LedgerError(
            f"the checkpoint's ledger is {path!r}, but this optimizer writes {os.path.abspath(ledger.path)!r}: resume with "
            "the checkpoint's ledger, or ε would leave out the releases recorded there"
        )
    want_r, want_s = int(saved.get("num_releases", -1)), int(saved.get("num_samples", -1))
    have_r, have_s = int(ledger.num_releases), len(ledger.samples)
    where = ledger.path
    if have_r < want_r or have_s < want_s:
        raise LedgerError(
            f"{where}: the ledger holds {have_r} releases ({have_s} samples), fewer than the {want_r} ({want_s}) the "
            "checkpoint saw: it was truncated, or it is another run's ledger; resuming would under-state ε"
        )
    ahead = max(have_r - want_r, have_s - want_s)
    if ahead and ledger_ahead != "keep":
        raise LedgerError(
            f"{where}: the ledger holds {ahead} release(s) more than the checkpoint saw ({have_r} vs {want_r}): the run "
            f"stopped after recording them but before the next checkpoint, so their noise was spent and their updates are "
            f"lost. To resume from this checkpoint with them kept in the ledger (still counted in ε, which then "
            f"over-counts: the safe side), {getattr(opt, 'ledger_ahead_hint', None) or _LEDGER_AHEAD_HINT}"
        )
    return ahead


def load_optimizer_state(opt: Any, state_dict: Any, ledger_ahead: Optional[str]) -> None:
    """:meth:`DPOptimizer.load_state_dict`: validates all, then loads (nothing half-loaded)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    if "dpcore" not in state_dict:
        if "state" in state_dict and "param_groups" in state_dict:
            warnings.warn(
                "loading a bare optimizer state dict (a checkpoint from before dpcore saved its DP state): only the "
                "wrapped optimizer's state was restored; the release count, the queries' global states (adaptive clip "
                "norms) and the data loader's position were not",
                UserWarning,
                stacklevel=3,
            )
            opt.original_optimizer.load_state_dict(state_dict)
            opt.restore_state()  # (drops the noise drawn ahead)
            return
        raise ValueError("not a DPOptimizer state dict: expected keys 'optimizer' and 'dpcore'")
    dp, inner = state_dict["dpcore"], state_dict.get("optimizer")
    if not isinstance(dp, dict) or dp.get("format") != FORMAT:
        raise ValueError(f"not a DPOptimizer state dict (format {dp.get('format') if isinstance(dp, dict) else None!r})")
    if dp.get("version") != VERSION:
        raise ValueError(f"DPOptimizer state dict version {dp.get('version')!r} is not supported (this dpcore reads {VERSION})")
    if not isinstance(inner, dict):
        raise ValueError("the DPOptimizer state dict has no wrapped optimizer state ('optimizer')")
    how = check_ledger_ahead(opt.ledger_ahead if ledger_ahead is None else ledger_ahead)
    if not dp.get("logical_batch_complete", True):
        raise ValueError(
            "the checkpoint was taken in the middle of a logical batch: the records held then are not in it; take "
            "checkpoints at release boundaries (after the step that completes a logical batch)"
        )
    st = opt.checkpoint_state()
    if not st["logical_batch_complete"]:
        raise ValueError("this optimizer holds records of an incomplete logical batch; load a checkpoint before training")
    _check_shape(opt, st, dp)
    states = [
        decode_state(sg["global_state"], g["query"].initial_global_state(), f"query group {gi}")
        for gi, (sg, g) in enumerate(zip(dp["groups"], st["groups"]))
    ]
    loader, loader_state = LoaderView(opt.data_loader), dp.get("data_loader")
    restore_loader = loader_state is not None and loader.can_restore
    if restore_loader:
        loader.check_state_dict(loader_state)
    elif loader_state is not None and loader.loader is not None:
        warnings.warn(
            f"the checkpoint holds a data loader position, but this optimizer's data loader "
            f"({type(loader.loader).__name__}) has no load_state_dict: its position was not restored",
            UserWarning,
            stacklevel=3,
        )
    releases, drawn = int(dp["releases"]), int(dp["drawn_at_release"])
    if releases < 0 or drawn < 0:
        raise ValueError("the checkpoint's release and sample counts must be non-negative")
    ahead = _check_ledger(opt, dp.get("ledger") or {}, how)
    if ahead and st["correlated_noise"]:
        raise LedgerError(
            f"{opt.ledger.path}: the ledger holds {ahead} release(s) more than the checkpoint saw, and this optimizer "
            "adds matrix-factorization (correlated) noise: those releases used steps of the noise stream and batches "
            "of the cycle that the checkpoint does not hold, so resuming from it would replay them with other noise, "
            "which the stream's accounting does not cover. Resume from a later checkpoint (take one after every "
            "release), or start a new run with a new ledger"
        )
    # Everything checked: load. The wrapped optimizer checks its own state first, then sets it.
    opt.original_optimizer.load_state_dict(inner)
    opt.restore_state(releases=releases, skipped_steps=int(dp.get("skipped_steps", 0)), global_states=states)
    if restore_loader:
        loader.load_state_dict(loader_state)
        opt.restore_state(drawn_at_release=drawn)
    elif loader.samples_drawn is not None:
        # The loader's count was not restored: the step's "a new sample since the last release"
        # check counts from where this loader stands.
        opt.restore_state(drawn_at_release=int(loader.samples_drawn))
    else:
        opt.restore_state(drawn_at_release=drawn)
