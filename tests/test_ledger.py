"""The privacy ledger (McMahan et al. 2018, §6): format, durability, corruption, accounting."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
import types
import warnings
from dataclasses import make_dataclass
from typing import Any, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dpcore
from dpcore.ledger import LedgerError, LedgerWarning, PrivacyLedger
from dpcore.queries import ComposedQueryEvent, NonPrivateQueryEvent, SumQueryEvent


def lines(path):
    with open(path, "rb") as f:
        return f.read().decode().splitlines()


def write_steps(path, steps=3, policy="poisson"):
    with PrivacyLedger(path) as led:
        for t in range(steps):
            if policy == "fixed_size_without_replacement":
                led.record_sample(1000, None, policy, sample_size=10)
            else:
                led.record_sample(1000, 0.01, policy)
            led.record_release(ComposedQueryEvent((SumQueryEvent(1.0, 1.1), SumQueryEvent(0.5, 3.0))))
    return path


# ----------------------------------------------------------------------------- format


def test_format_and_roundtrip(tmp_path):
    p = tmp_path / "l.jsonl"
    with PrivacyLedger(p) as led:
        assert led.record_sample(60000, 0.01, "poisson") == 0
        led.record_release(SumQueryEvent(1.0, 1.1))
        led.record_release(SumQueryEvent(2.0, 5.0))  # a second release on the same sample
        assert led.record_sample(60000, None, "fixed_size_without_replacement", sample_size=600) == 1
        led.record_release(NonPrivateQueryEvent())
        led.record_sample(60000, 0.01, "shuffle")  # never released: costs nothing, not written
    ls = [json.loads(x) for x in lines(p)]
    assert ls[0] == {"format": "dpcore-privacy-ledger", "version": 1, "privacy_unit": "example"}
    assert ls[1] == {
        "type": "sample", "sample": 0, "population_size": 60000, "sampling_probability": 0.01,
        "policy": "poisson", "sample_size": None, "seeded": False,
    }
    assert ls[2] == {"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0, "stddev": 1.1}
    assert ls[4]["policy"] == "fixed_size_without_replacement" and ls[4]["sampling_probability"] == 0.01
    assert ls[5] == {"type": "non_private", "sample": 1}
    assert len(ls) == 6
    led2 = PrivacyLedger.load(p)
    s0, s1 = led2.samples
    assert s0.queries == (SumQueryEvent(1.0, 1.1), SumQueryEvent(2.0, 5.0)) and not s0.non_private
    assert s0.noise_multiplier() == pytest.approx((1 / 1.1**2 + 1 / 2.5**2) ** -0.5)
    assert s1.non_private and s1.noise_multiplier() == 0.0 and s1.sample_size == 600
    assert led2.num_releases == 2 and led2.torn_tail is None
    with pytest.raises(LedgerError, match="not open for writing"):
        led2.record_sample(10, 0.1)


def test_reopen_continues_the_ledger(tmp_path):
    p = write_steps(tmp_path / "l.jsonl", 2)
    with PrivacyLedger(p) as led:
        assert len(led.samples) == 2
        with pytest.raises(LedgerError, match="no sample recorded"):
            led.record_release(SumQueryEvent(1.0, 1.0))  # never onto a sample of an earlier run
        assert led.record_sample(1000, 0.01) == 2
        led.record_release(SumQueryEvent(1.0, 1.0))
    assert [s.sample for s in PrivacyLedger.load(p).samples] == [0, 1, 2]


def test_one_writer_at_a_time(tmp_path):
    p = tmp_path / "l.jsonl"
    led = PrivacyLedger(p)
    with pytest.raises(LedgerError, match="another process"):
        PrivacyLedger(p)
    PrivacyLedger.load(p)  # readers are fine
    led.close()
    PrivacyLedger(p).close()


# ----------------------------------------------------------------------------- bad input: nothing written


def _forged():
    e = SumQueryEvent(1.0, 1.0)
    object.__setattr__(e, "stddev", float("nan"))  # a query bug behind the frozen dataclass
    return e


def test_bad_input_writes_nothing(tmp_path):
    p = write_steps(tmp_path / "l.jsonl", 1)
    before = open(p, "rb").read()
    with PrivacyLedger(p) as led:
        led.record_sample(1000, 0.01)
        with pytest.raises(ValueError, match="stddev"):
            led.record_release(ComposedQueryEvent((SumQueryEvent(1.0, 1.0), _forged())))
    with open(p, "rb") as f:
        assert f.read() == before  # not even the valid first tuple, nor the sample entry

    q = tmp_path / "fresh.jsonl"
    with PrivacyLedger(q) as led:
        header = open(q, "rb").read()
        with pytest.raises(LedgerError, match="no sample recorded"):
            led.record_release(SumQueryEvent(1.0, 1.0))
        bad_samples = [
            ((0, 0.1), ValueError, "population_size"),
            ((10, 1.5), ValueError, "sampling_probability"),
            ((10, float("nan")), ValueError, "sampling_probability"),
            ((10, 0.1, "bogus"), ValueError, "policy"),
            ((10, 0.1, 3), TypeError, "policy"),
            ((10.0, 0.1), TypeError, "population_size"),
            ((10, "0.1"), TypeError, "sampling_probability"),
            ((10, None, "poisson"), ValueError, "needs sampling_probability"),
            ((10, None, "fixed_size_without_replacement"), ValueError, "needs sample_size"),
        ]
        for args, exc, msg in bad_samples:
            with pytest.raises(exc, match=msg):
                led.record_sample(*args)
        with pytest.raises(ValueError, match="sample_size must be <="):
            led.record_sample(10, None, "fixed_size_without_replacement", sample_size=11)
        with pytest.raises(ValueError, match="differs"):
            led.record_sample(10, 0.5, "fixed_size_without_replacement", sample_size=3)
        with pytest.raises(TypeError, match="seeded"):
            led.record_sample(10, 0.5, seeded=1)
        with pytest.raises(LedgerError, match="no sample recorded"):
            led.record_release(SumQueryEvent(1.0, 1.0))  # the bad calls left no sample open
        led.record_sample(10, 0.5)
        forged = _forged()
        for bad, exc in (
            (forged, ValueError),
            (ComposedQueryEvent((SumQueryEvent(1.0, 1.0), forged)), ValueError),
            (ComposedQueryEvent(()), ValueError),
            ((1.0, 1.0), TypeError),
            (None, TypeError),
        ):
            with pytest.raises(exc):
                led.record_release(bad)
        assert open(q, "rb").read() == header
        assert led.samples == ()


def test_failed_write_is_rolled_back(tmp_path, monkeypatch):
    p = write_steps(tmp_path / "l.jsonl", 1)
    before = open(p, "rb").read()
    led = PrivacyLedger(p)
    led.record_sample(1000, 0.01)

    def no_fsync(fd):
        raise OSError(5, "simulated I/O error")

    monkeypatch.setattr(os, "fsync", no_fsync)
    with pytest.raises(LedgerError, match="could not write"):
        led.record_release(SumQueryEvent(1.0, 1.0))
    monkeypatch.undo()
    assert open(p, "rb").read() == before  # the half-done write was cut back
    assert len(led.samples) == 1  # and not counted in memory either
    led.record_release(SumQueryEvent(1.0, 1.0))  # the ledger still works
    led.close()
    assert len(PrivacyLedger.load(p).samples) == 2


# ----------------------------------------------------------------------------- corruption


@pytest.mark.parametrize(
    "lineno, text, why",
    [
        (3, "{not json", "not valid JSON"),
        (3, '{"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0, "stddev": -1.0}', "stddev"),
        (3, '{"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0, "stddev": NaN}', "NaN"),
        (3, '{"type": "sum_query", "sample": 0, "l2_norm_clip": "1", "stddev": 1.0}', "number"),
        (3, '{"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0}', "missing keys"),
        (3, '{"type": "sum_query", "sample": 5, "l2_norm_clip": 1.0, "stddev": 1.0}', "not the current sample"),
        (3, '{"type": "mystery", "sample": 0}', "unknown entry type"),
        (3, "[1, 2]", "not a JSON object"),
        (3, "", "not valid JSON"),
        (4, '{"type": "sample", "sample": 7, "population_size": 1000, "sampling_probability": 0.01, '
            '"policy": "poisson", "sample_size": null, "seeded": false}', "out of sequence"),
        (4, '{"type": "sample", "sample": 1, "population_size": 1000, "sampling_probability": 2.0, '
            '"policy": "poisson", "sample_size": null, "seeded": false}', "sampling_probability"),
        (4, '{"type": "sample", "sample": 1, "population_size": 1000, "sampling_probability": 0.01, '
            '"policy": "poisson", "sample_size": null, "seeded": false, "extra": 1}', "unexpected"),
        (1, '{"format": "dpcore-privacy-ledger", "version": 2}', "version 2"),
        (1, '{"format": "something else", "version": 1}', "not a dpcore privacy ledger"),
    ],
)
def test_corrupted_line_raises_naming_the_line(tmp_path, lineno, text, why):
    p = write_steps(tmp_path / "l.jsonl", 3)
    ls = lines(p)
    ls[lineno - 1] = text
    with open(p, "w") as f:
        f.write("\n".join(ls) + "\n")
    with pytest.raises(LedgerError, match=f"line {lineno}") as e:
        PrivacyLedger.load(p)
    assert why in str(e.value) and str(p) in str(e.value)
    with pytest.raises(LedgerError, match=f"line {lineno}"):
        PrivacyLedger(p)  # nor can it be appended to


def test_binary_garbage_and_empty_file(tmp_path):
    p = write_steps(tmp_path / "l.jsonl", 1)
    with open(p, "ab") as f:
        f.write(b"\xff\xfe\n")
    with pytest.raises(LedgerError, match="line 5.*UTF-8"):
        PrivacyLedger.load(p)
    e = tmp_path / "empty.jsonl"
    e.write_bytes(b"")
    with pytest.raises(LedgerError, match="empty file"):
        PrivacyLedger.load(e)
    with pytest.raises(FileNotFoundError):
        PrivacyLedger.load(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------- torn last line


def test_torn_last_line_is_reported_not_dropped(tmp_path):
    p = write_steps(tmp_path / "l.jsonl", 2)
    full = open(p, "rb").read()
    with open(p, "ab") as f:
        f.write(b'{"type": "sample", "sample": 2, "popul')
    with pytest.warns(LedgerWarning, match=r"line 8: torn last line"):
        led = PrivacyLedger.load(p)
    assert led.torn_tail is not None and led.torn_tail.line == 8 and not led.torn_tail.counted
    assert len(led.samples) == 2
    with pytest.raises(LedgerError, match="line 8: torn"):
        PrivacyLedger.load(p, strict=True)
    # Appending first repairs the file and leaves a trace of the fragment.
    with pytest.warns(LedgerWarning, match="torn"):
        w = PrivacyLedger(p)
    w.record_sample(1000, 0.01)
    w.record_release(SumQueryEvent(1.0, 2.0))
    w.close()
    ls = lines(p)
    assert open(p, "rb").read().startswith(full)
    assert json.loads(ls[7]) == {"type": "torn_tail_repaired", "line": 8, "fragment": '{"type": "sample", "sample": 2, "popul'}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = PrivacyLedger.load(p)
    assert len(again.samples) == 3 and again.samples[2].queries == (SumQueryEvent(1.0, 2.0),)


def test_torn_complete_entry_is_counted(tmp_path):
    p = write_steps(tmp_path / "l.jsonl", 1)
    with open(p, "ab") as f:
        f.write(b'{"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0, "stddev": 0.5}')
    with pytest.warns(LedgerWarning, match="complete entry and is counted"):
        led = PrivacyLedger.load(p)
    assert led.samples[0].queries[-1] == SumQueryEvent(1.0, 0.5)  # over-counting is the safe side
    with pytest.warns(LedgerWarning):
        PrivacyLedger(p).close()
    assert open(p, "rb").read().endswith(b"0.5}\n")


# ----------------------------------------------------------------------------- crash safety

CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from dpcore.ledger import PrivacyLedger
    from dpcore.aggregator import PrivateAggregator
    from dpcore.queries import NestedQuery, GaussianSumQuery, CountQuery
    led = PrivacyLedger(sys.argv[1])
    paused = sys.argv[2] == "paused"
    q = NestedQuery({"g": GaussianSumQuery(1.0, 1.0), "n": CountQuery(4.0)})
    agg = PrivateAggregator(q, led, 5000, 0.02)
    x = np.ones((5000, 64), np.float32)
    step = 0
    while True:
        idx = agg.sample()
        agg.aggregate({"g": x[idx], "n": np.ones(len(idx))})
        print(step, flush=True)   # this step's noised result has been returned
        if paused:
            sys.stdin.readline()  # wait: the parent kills right after a release
        step += 1
    """
)


@pytest.mark.parametrize("kill_after, mode", [(1, "paused"), (5, "paused"), (1, "running"), (7, "running"), (40, "running")])
def test_sigkill_mid_run_loses_no_released_step(tmp_path, kill_after, mode):
    p = tmp_path / "l.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(p), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    released = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            released.append(int(line))
            if len(released) >= kill_after:
                proc.kill()  # SIGKILL, at whatever point the child has reached
                break
            if mode == "paused":
                proc.stdin.write("go\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -9, proc.stderr.read() if proc.stderr else ""  # type: ignore[union-attr]
    assert len(released) == kill_after
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)  # a torn line is possible (and reported)
        led = PrivacyLedger.load(p)
    for step in released:
        s = led.samples[step]
        assert s.queries == (SumQueryEvent(1.0, 1.0), SumQueryEvent(1.0, 4.0)), step
    assert led.num_releases >= len(released)
    if mode == "paused":
        assert led.num_releases == len(released)  # killed between steps: exactly the released ones


# ----------------------------------------------------------------------------- to_event (fake accountant)


def _fake_event(name: str, *fields: Tuple[str, Any]) -> type:
    """A bare frozen dataclass with the fields of the dpcore.accounting event of that name."""
    return make_dataclass(name, list(fields), frozen=True)


# The event contract of dpcore.accounting, without its validation: fields only.
GaussianEvent = _fake_event("GaussianEvent", ("noise_multiplier", float))
PoissonSampledEvent = _fake_event("PoissonSampledEvent", ("sampling_probability", float), ("event", Any))
SampledWithoutReplacementEvent = _fake_event(
    "SampledWithoutReplacementEvent", ("source_size", int), ("sample_size", int), ("event", Any)
)
SelfComposedEvent = _fake_event("SelfComposedEvent", ("event", Any), ("count", int))
ComposedEvent = _fake_event("ComposedEvent", ("events", Tuple[Any, ...]))
NonPrivateEvent = _fake_event("NonPrivateEvent")


@pytest.fixture
def fake_accounting(monkeypatch):
    """The event contract of dpcore.accounting, to test the ledger's conversion on its own."""
    mod = types.ModuleType("dpcore.accounting")
    for c in (GaussianEvent, PoissonSampledEvent, SampledWithoutReplacementEvent, SelfComposedEvent,
              ComposedEvent, NonPrivateEvent):
        setattr(mod, c.__name__, c)
    monkeypatch.setitem(sys.modules, "dpcore.accounting", mod)
    monkeypatch.setattr(dpcore, "accounting", mod, raising=False)
    return mod


def test_to_event_structure(tmp_path, fake_accounting):
    p = tmp_path / "l.jsonl"
    z = (1 / 1.1**2 + 1 / 6.0**2) ** -0.5
    with PrivacyLedger(p) as led:
        for _ in range(3):
            led.record_sample(1000, 0.01)
            led.record_release(ComposedQueryEvent((SumQueryEvent(1.0, 1.1), SumQueryEvent(0.5, 3.0))))
        led.record_sample(1000, 0.5)  # drawn, nothing released: not accounted
        led.record_sample(1000, None, "fixed_size_without_replacement", sample_size=20)
        led.record_release(SumQueryEvent(2.0, 2.0))
        led.record_sample(1000, 0.01)
        led.record_release(ComposedQueryEvent((SumQueryEvent(1.0, 1.1), NonPrivateQueryEvent())))
        led.record_sample(1000, 0.01)
        led.record_release(SumQueryEvent(1.0, 0.0))  # zero noise is non-private too
        ev = led.to_event()
    assert isinstance(ev, ComposedEvent)
    first, fixed, nonpriv = ev.events
    assert isinstance(first, SelfComposedEvent) and first.count == 3
    assert first.event.sampling_probability == 0.01
    assert first.event.event.noise_multiplier == pytest.approx(z, rel=1e-14)
    assert first.event.event.noise_multiplier <= z
    assert fixed == SampledWithoutReplacementEvent(1000, 20, GaussianEvent(fixed.event.noise_multiplier))
    assert fixed.event.noise_multiplier == pytest.approx(1.0)
    assert nonpriv == SelfComposedEvent(NonPrivateEvent(), 2)


def test_replace_one_halves_z(tmp_path, fake_accounting):
    p = write_steps(tmp_path / "l.jsonl", 2, policy="fixed_size_without_replacement")
    led = PrivacyLedger.load(p)
    z = led.samples[0].noise_multiplier()
    (a,) = led.to_event().events
    (r,) = led.to_event("replace_one").events
    assert a.event.event.noise_multiplier == z
    assert r.event.event.noise_multiplier == z / 2  # replacing moves a sum by 2·S_g
    with pytest.raises(ValueError, match="neighboring"):
        led.to_event("bounded")


def test_get_epsilon_refuses_a_relation_the_policies_do_not_support(tmp_path):
    fixed = PrivacyLedger.load(write_steps(tmp_path / "f.jsonl", 1, policy="fixed_size_without_replacement"))
    with pytest.raises(ValueError, match="only under neighboring='replace_one'"):
        fixed.get_epsilon(1e-5)
    poisson = PrivacyLedger.load(write_steps(tmp_path / "p.jsonl", 1))
    with pytest.raises(ValueError, match="only under neighboring='add_or_remove'"):
        poisson.get_epsilon(1e-5, neighboring="replace_one")
    with pytest.raises(ValueError, match="neighboring"):
        poisson.get_epsilon(1e-5, neighboring="bounded")
    p = tmp_path / "mixed.jsonl"
    with PrivacyLedger(p) as led:
        led.record_sample(100, 0.1)
        led.record_release(SumQueryEvent(1.0, 1.0))
        led.record_sample(100, None, "fixed_size_without_replacement", sample_size=10)
        led.record_release(SumQueryEvent(1.0, 1.0))
    with pytest.raises(ValueError, match="cannot be accounted as one"):
        PrivacyLedger.load(p).get_epsilon(1e-5)


def test_shuffle_is_never_amplified(tmp_path, fake_accounting):
    p = write_steps(tmp_path / "l.jsonl", 4, policy="shuffle")
    led = PrivacyLedger.load(p)
    assert led.neighboring == "zero_out"  # the run's relation: batches that are not random samples
    with pytest.warns(LedgerWarning, match="no sampling amplification"):
        ev = led.to_event()
    (only,) = ev.events
    # recorded without its epoch (as ledgers written before epochs were): one query per step,
    # C under zero-out, a swap (2C) under add-or-remove
    assert isinstance(only.event, GaussianEvent) and only.count == 4
    with pytest.warns(LedgerWarning):
        (other,) = led.to_event("add_or_remove").events
    assert other.count == 4 and other.event.noise_multiplier == only.event.noise_multiplier / 2


def test_seeded_samples_warn(tmp_path, fake_accounting):
    p = tmp_path / "l.jsonl"
    with PrivacyLedger(p) as led:
        dpcore.sampling.poisson_sample(100, 0.1, seed=3, ledger=led)
        led.record_release(SumQueryEvent(1.0, 1.0))
    assert PrivacyLedger.load(p).samples[0].seeded
    with pytest.warns(LedgerWarning, match="test seed"):
        PrivacyLedger.load(p).to_event()


# ----------------------------------------------------------------------------- the real accountant


def test_ledger_replay_equals_direct_accounting(tmp_path):
    acc = pytest.importorskip("dpcore.accounting")
    p = tmp_path / "l.jsonl"
    tuples = (SumQueryEvent(1.0, 1.2), SumQueryEvent(0.3, 1.0), SumQueryEvent(1.0, 8.0))
    with PrivacyLedger(p) as led:
        for _ in range(50):
            led.record_sample(60000, 0.004)
            led.record_release(ComposedQueryEvent(tuples))
    z = (sum((t.l2_norm_clip / t.stddev) ** 2 for t in tuples)) ** -0.5
    direct = acc.RdpAccountant()
    direct.compose(acc.PoissonSampledEvent(0.004, acc.GaussianEvent(z)), 50)
    eps = PrivacyLedger.load(p).get_epsilon(1e-5, accountant="rdp")
    assert eps == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert eps >= direct.get_epsilon(1e-5) * (1 - 1e-12)  # z rounded down: never a smaller ε
    assert math.isfinite(eps) and eps > 0


def test_fixed_size_replay_equals_direct_accounting(tmp_path):
    acc = pytest.importorskip("dpcore.accounting")
    p = write_steps(tmp_path / "l.jsonl", 20, policy="fixed_size_without_replacement")
    z = (1 / 1.1**2 + 1 / 6.0**2) ** -0.5
    direct = acc.RdpAccountant(neighboring="replace_one")
    direct.compose(acc.SampledWithoutReplacementEvent(1000, 10, acc.GaussianEvent(z / 2)), 20)
    eps = PrivacyLedger.load(p).get_epsilon(1e-5, neighboring="replace_one")
    assert eps == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


def test_shuffle_epsilon_is_unamplified(tmp_path):
    acc = pytest.importorskip("dpcore.accounting")
    shuffled = write_steps(tmp_path / "s.jsonl", 10, policy="shuffle")
    poisson = write_steps(tmp_path / "p.jsonl", 10, policy="poisson")
    with pytest.warns(LedgerWarning, match="shuffle"):
        e_s = PrivacyLedger.load(shuffled).get_epsilon(1e-5, accountant="rdp")
    e_p = PrivacyLedger.load(poisson).get_epsilon(1e-5, accountant="rdp")
    z = (1 / 1.1**2 + 1 / 6.0**2) ** -0.5
    direct = acc.RdpAccountant()
    direct.compose(acc.GaussianEvent(z), 10)
    assert e_s == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    assert e_s > e_p


def test_non_private_ledger_is_infinite(tmp_path):
    pytest.importorskip("dpcore.accounting")
    p = tmp_path / "l.jsonl"
    with PrivacyLedger(p) as led:
        led.record_sample(100, 0.1)
        led.record_release(NonPrivateQueryEvent())
    assert PrivacyLedger.load(p).get_epsilon(1e-5) == math.inf


def test_get_epsilon_bad_accountant(tmp_path):
    led = PrivacyLedger.load(write_steps(tmp_path / "l.jsonl", 1))
    for bad in ("bogus", "PLD", None, 1):
        with pytest.raises(ValueError, match=r"accountant must be one of \('pld', 'rdp'\)"):
            led.get_epsilon(1e-5, accountant=bad)
        with pytest.raises(ValueError, match=r"accountant must be one of \('pld', 'rdp'\)"):
            led.get_delta(1.0, accountant=bad)
    # Rényi orders mean nothing to the PLD accountant: refused rather than silently ignored.
    with pytest.raises(ValueError, match="orders"):
        led.get_epsilon(1e-5, orders=[2, 4, 8])
    with pytest.raises(ValueError, match="orders"):
        led.get_delta(1.0, accountant="pld", orders=[2, 4, 8])


# ----------------------------------------------------------------------------- choice of accountant


def test_default_accountant_is_pld(tmp_path):
    acc = pytest.importorskip("dpcore.accounting")
    assert inspect.signature(PrivacyLedger.get_epsilon).parameters["accountant"].default == "pld"
    assert inspect.signature(PrivacyLedger.get_delta).parameters["accountant"].default == "pld"
    led = PrivacyLedger.load(write_steps(tmp_path / "l.jsonl", 50))
    ref = acc.PldAccountant()
    ref.compose(led.to_event())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Poisson ledger needs no fallback
        eps = led.get_epsilon(1e-5)
        assert led.get_epsilon(1e-5, accountant="pld") == eps
        delta = led.get_delta(eps)
    assert eps == ref.get_epsilon(1e-5)
    assert delta == ref.get_delta(eps)
    assert 0 < eps < math.inf and 0 < delta < 1
    # The reason PLD is the default: for Poisson-sampled Gaussians it certifies a smaller ε.
    assert eps < led.get_epsilon(1e-5, accountant="rdp")


def test_rdp_accountant_still_available_and_unchanged(tmp_path):
    acc = pytest.importorskip("dpcore.accounting")
    led = PrivacyLedger.load(write_steps(tmp_path / "l.jsonl", 30))
    z = led.samples[0].noise_multiplier()
    direct = acc.RdpAccountant()
    direct.compose(acc.PoissonSampledEvent(0.01, acc.GaussianEvent(z)), 30)
    assert led.get_epsilon(1e-5, accountant="rdp") == direct.get_epsilon(1e-5)
    assert led.get_delta(1.0, accountant="rdp") == direct.get_delta(1.0)
    orders = [1.5, 2.0, 4.0, 8.0, 16.0, 32.0]
    coarse = acc.RdpAccountant(orders=orders)
    coarse.compose(acc.PoissonSampledEvent(0.01, acc.GaussianEvent(z)), 30)
    assert led.get_epsilon(1e-5, accountant="rdp", orders=orders) == coarse.get_epsilon(1e-5)
    fixed = PrivacyLedger.load(write_steps(tmp_path / "f.jsonl", 5, policy="fixed_size_without_replacement"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for RDP: no fallback, so no fallback warning
        e = fixed.get_epsilon(1e-5, accountant="rdp", neighboring="replace_one")
    assert 0 < e < math.inf


def test_pld_falls_back_to_rdp_for_the_whole_ledger(tmp_path):
    pytest.importorskip("dpcore.accounting")
    fallback = "cannot be analysed by the PLD accountant; the whole ledger is accounted with RDP instead"
    # Fixed-size samples (no PLD analysis) next to shuffled ones (a plain Gaussian, which PLD
    # could analyse): still one RDP analysis of everything, never PLD for a part.
    p = write_steps(tmp_path / "l.jsonl", 5, policy="fixed_size_without_replacement")
    with PrivacyLedger(p) as w:
        w.record_sample(1000, 0.01, "shuffle")
        w.record_release(SumQueryEvent(1.0, 4.0))
    led = PrivacyLedger.load(p)
    with pytest.warns(LedgerWarning) as rec:
        eps = led.get_epsilon(1e-5, neighboring="replace_one")
    msgs = [str(r.message) for r in rec]
    assert any(fallback in m and "SampledWithoutReplacementEvent" in m and str(p) in m for m in msgs), msgs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)  # the shuffle warning
        assert eps == led.get_epsilon(1e-5, accountant="rdp", neighboring="replace_one")
        rdp_delta = led.get_delta(eps, accountant="rdp", neighboring="replace_one")
    with pytest.warns(LedgerWarning) as rec:
        assert led.get_delta(eps, neighboring="replace_one") == rdp_delta
    assert any(fallback in str(r.message) for r in rec)
    # Under add_or_remove RDP has no analysis of fixed-size samples either: the fallback is
    # announced, then RDP's own refusal is raised (no partial ε).
    with pytest.warns(LedgerWarning) as rec, pytest.raises(ValueError, match="only under neighboring='replace_one'"):
        led.get_epsilon(1e-5, neighboring="add_or_remove")
    assert any(fallback in str(r.message) for r in rec)
    # The run's own relation (it used shuffled batches) is zero-out, under which a sample of b
    # without replacement is the zeroed record's Poisson pair at b/n: PLD analyses everything.
    assert led.neighboring == "zero_out"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        eps0 = led.get_epsilon(1e-5)
    assert not any(fallback in str(r.message) for r in rec)
    assert eps0 == led.get_epsilon(1e-5, neighboring="zero_out") and 0 < eps0 < math.inf


# ----------------------------------------------------------------------------- properties


event_st = st.recursive(
    st.builds(SumQueryEvent, st.floats(1e-3, 1e3), st.floats(0.0, 1e3)) | st.just(NonPrivateQueryEvent()),
    lambda inner: st.lists(inner, min_size=1, max_size=4).map(lambda xs: ComposedQueryEvent(tuple(xs))),
    max_leaves=6,
)
step_st = st.tuples(
    st.sampled_from(["poisson", "fixed_size_without_replacement", "shuffle"]),
    st.integers(1, 10**9),
    st.floats(0.0, 1.0),
    st.lists(event_st, min_size=0, max_size=3),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(step_st, max_size=6))
def test_roundtrip_property(tmp_path_factory, steps):
    p = tmp_path_factory.mktemp("h") / "l.jsonl"
    with PrivacyLedger(p) as led:
        for policy, n, q, events in steps:
            if policy == "fixed_size_without_replacement":
                led.record_sample(n, None, policy, sample_size=int(q * n))
            else:
                led.record_sample(n, q, policy)
            for e in events:
                led.record_release(e)
        written = led.samples
    loaded = PrivacyLedger.load(p)
    assert loaded.samples == written
    assert loaded.num_releases == sum(1 for *_, evs in steps if evs)
    for s in loaded.samples:
        exact = [t for t in s.queries]
        if s.non_private or any(t.stddev == 0 for t in exact):
            assert s.noise_multiplier() == 0.0
        else:
            ref = 1 / math.hypot(*(t.l2_norm_clip / t.stddev for t in exact))
            assert s.noise_multiplier() <= ref


# -- the core's fast reader against the Python reader (the reference) --------------------------

_MUTATIONS = [
    ("0.", "1."), ("false", "true"), ("false", "0"), ("1.0", "true"), (", \"seeded\": false", ""), ("null", "0"),
    ("null", "\"x\""), ("poisson", "poison"), ("\"sample\": 1,", "\"sample\": 3,"), ("\"version\": 1", "\"version\": 1.0"),
    ("sum_query", "non_private"), ("}", ", \"extra\": 1}"), ("\"stddev\": ", "\"stddev\": -"), ("\n", "\n\n"), ("\"", "'"),
    ("\"sample\": 0", "\"sample\": 0, \"sample\": 0"), ("poisson", "pois\\u0073on"), ("1000", "1e3"), ("\"population_size\": 1000", "\"population_size\": 0"),
]


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["poisson", "shuffle", "fixed_size_without_replacement"]),
            st.floats(0.0, 1.0, allow_nan=False),
            st.integers(1, 3),
            st.floats(0.01, 10.0),
        ),
        min_size=1,
        max_size=6,
    ),
    mutation=st.one_of(st.none(), st.tuples(st.sampled_from(_MUTATIONS), st.integers(0, 10**6))),
    cut=st.one_of(st.none(), st.integers(1, 400)),
)
def test_fast_reader_accepts_only_what_the_python_reader_accepts(tmp_path_factory, steps, mutation, cut) -> None:
    """Every ledger the core's reader accepts, the Python reader accepts with the same samples,
    lines and unit (valid ledgers, one mutated spot, a torn tail); otherwise the file is read
    by the Python reader, whose errors name the line."""
    import dpcore.ledger._storage as storage

    p = tmp_path_factory.mktemp("fast") / "l.jsonl"
    with PrivacyLedger(p) as led:
        for i, (policy, q, k, sd) in enumerate(steps):
            if policy == "fixed_size_without_replacement":
                led.record_sample(1000, None, policy, sample_size=int(q * 1000))
            else:
                led.record_sample(1000, q, policy)
            for j in range(k):
                led.record_release(SumQueryEvent(1.0 + j, sd))
    data = p.read_bytes()
    if mutation is not None:
        (old, new), at = mutation
        hits = [i for i in range(len(data)) if data.startswith(old.encode(), i)]
        if hits:
            i = hits[at % len(hits)]
            data = data[:i] + new.encode() + data[i + len(old):]
    if cut is not None:
        data = data[: max(1, len(data) - cut)]

    def python_read(d):
        real = storage._core.ledger_scan
        try:
            storage._core.ledger_scan = lambda _d: (None, 0)
            return storage._read("l", d, strict=False)
        finally:
            storage._core.ledger_scan = real

    scanned, _ = storage._core.ledger_scan(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ref = python_read(data)
        except LedgerError:
            ref = None
        if scanned is None:
            return
        assert ref is not None, f"the fast reader accepted what the Python reader refuses: {data!r}"
        fast = storage._read("l", data, strict=False)
    assert list(fast.samples) == list(ref.samples)
    assert (fast.lines, fast.valid_bytes, fast.privacy_unit) == (ref.lines, ref.valid_bytes, ref.privacy_unit)
    assert fast.torn == ref.torn


def test_fast_reader_groups_a_long_ledger_into_runs(tmp_path) -> None:
    p = tmp_path / "l.jsonl"
    lines = ['{"format": "dpcore-privacy-ledger", "version": 1, "privacy_unit": "user"}']
    for i in range(3000):
        q = 0.01 if i < 2000 else 0.02
        lines.append(f'{{"type": "sample", "sample": {i}, "population_size": 5000, "sampling_probability": {q}, '
                     f'"policy": "poisson", "sample_size": null, "seeded": false}}')
        lines.append(f'{{"type": "sum_query", "sample": {i}, "l2_norm_clip": 1.0, "stddev": 1.2}}')
    p.write_text("\n".join(lines) + "\n")
    led = PrivacyLedger.load(p)
    assert led.privacy_unit == "user" and led.num_releases == 3000 and len(led.samples) == 3000
    assert led._samples.runs()[0][1] == 2000 and len(led._samples.runs()) == 2
    assert led.samples[2500].sample == 2500 and led.samples[2500].sampling_probability == 0.02
    # continuing it appends after the runs, and the runs stay intact
    with PrivacyLedger(p) as w:
        w.record_sample(5000, 0.02)
        w.record_release(SumQueryEvent(1.0, 1.2))
    again = PrivacyLedger.load(p)
    assert again.num_releases == 3001 and len(again._samples.runs()) == 2
    with pytest.raises(LedgerError, match="privacy unit 'user'"):
        PrivacyLedger(p, privacy_unit="example")
