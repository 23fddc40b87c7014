"""dpcore.events: the one event vocabulary, its re-export paths and the package's layering."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

import dpcore
import dpcore.accounting.events as accounting_events
import dpcore.events as ev
import dpcore.queries.events as query_events

PKG = pathlib.Path(dpcore.__file__).parent


def test_every_event_is_defined_once():
    for mod in (query_events, accounting_events):
        for name in mod.__all__:
            assert getattr(mod, name) is getattr(ev, name), (mod.__name__, name)
            assert name in ev.__all__
    assert dpcore.queries.SumQueryEvent is ev.SumQueryEvent
    assert dpcore.accounting.GaussianEvent is ev.GaussianEvent
    assert dpcore.effective_noise_multiplier is ev.effective_noise_multiplier


def _imports(path: pathlib.Path):
    """(level, module) of every import statement in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((0, a.name, []) for a in node.names)
    return out


def test_layering():
    # _validate.py (the parameter checks) is the bottom: nothing from dpcore. events.py sits on
    # it and on nothing else of dpcore.
    for level, module, _ in _imports(PKG / "_validate.py"):
        assert level == 0 and not module.startswith("dpcore"), module
    for level, module, _ in _imports(PKG / "events.py"):
        assert (level == 0 and not module.startswith("dpcore")) or (level == 1 and module == "_validate"), module
    # The ledger and the accountants never reach up into the queries.
    for sub in ("ledger", "accounting"):
        for f in sorted((PKG / sub).glob("*.py")):
            for level, module, names in _imports(f):
                assert "queries" not in module.split("."), (f, module)
                assert not (level == 2 and not module and "queries" in names), f  # from .. import queries


def test_truncated_poisson_sampled_event():
    inner = ev.GaussianEvent(1.1)
    e = ev.TruncatedPoissonSampledEvent(0.01, 64, 60000, inner)
    assert (e.sampling_probability, e.max_batch_size, e.population_size, e.event) == (0.01, 64, 60000, inner)
    d = json.loads(json.dumps(e.to_dict()))
    assert d == {
        "type": "TruncatedPoissonSampledEvent", "sampling_probability": 0.01, "max_batch_size": 64,
        "population_size": 60000, "event": {"type": "GaussianEvent", "noise_multiplier": 1.1},
    }
    assert ev.event_from_dict(d) == e and hash(ev.event_from_dict(d)) == hash(e)
    # written before the cap was called max_batch_size: still read; the old attribute warns
    old_dict = {**{k: v for k, v in d.items() if k != "max_batch_size"}, "max_sample_size": 64}
    assert ev.event_from_dict(old_dict) == e
    with pytest.warns(DeprecationWarning, match="max_batch_size"):
        assert e.max_sample_size == 64
    nested = ev.ComposedEvent((ev.SelfComposedEvent(e, 3), ev.NonPrivateEvent()))
    assert ev.event_from_dict(json.loads(json.dumps(nested.to_dict()))) == nested
    assert ev.TruncatedPoissonSampledEvent(1, 1, 1, inner).sampling_probability == 1.0
    bad = [
        ((1.5, 64, 100, inner), ValueError, "sampling_probability"),
        ((float("nan"), 64, 100, inner), ValueError, "sampling_probability"),
        (("0.1", 64, 100, inner), TypeError, "sampling_probability"),
        ((0.1, 0, 100, inner), ValueError, "max_batch_size"),
        ((0.1, 64.0, 100, inner), TypeError, "max_batch_size"),
        ((0.1, True, 100, inner), TypeError, "max_batch_size"),
        ((0.1, 1, 0, inner), ValueError, "population_size"),
        ((0.1, 101, 100, inner), ValueError, "max_batch_size must be <= population_size"),
        ((0.1, 64, 100, 1.1), TypeError, "event must be an Event"),
    ]
    for args, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            ev.TruncatedPoissonSampledEvent(*args)
