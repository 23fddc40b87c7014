"""Matrix-factorization streams in the privacy ledger: the format (mf_stream entries, cyclic
policies), refusals, the accounting per stream (sensitivity recomputed from the recorded
declaration), the report, and the MF options of the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest

from dpcore import _core
from dpcore import accounting as A
from dpcore.events import ComposedQueryEvent, NonPrivateQueryEvent, SumQueryEvent
from dpcore.ledger import LedgerError, LedgerWarning, PrivacyLedger
from dpcore.matrix_factorization import (
    IDENTITY,
    BandedStrategy,
    BLTStrategy,
    Participation,
    StreamDeclaration,
    accountant_event,
    calibrate_noise_multiplier,
    epsilon as mf_epsilon,
    noise_multiplier_for,
    stddev_for,
)

MF = "matrix_factorization"
DELTA = 1e-5


def declaration(strategy, participation, steps) -> str:
    return StreamDeclaration(strategy, participation, steps).to_json()


def mf_event(clip, stddev, stream, decl) -> SumQueryEvent:
    return SumQueryEvent(clip, stddev, MF, stream, decl)


def write_stream(path, strategy, participation, planned, run=None, *, clip=1.0, stddev=None, z=1.0,
                 population=1000, stream=None, ledger=None):
    """Records ``run`` (default: planned) steps of one stream, each on its own sample with the
    policy the schema declares; returns the stream id."""
    stream = stream or uuid.uuid4().hex
    decl = declaration(strategy, participation, planned)
    sd = stddev if stddev is not None else stddev_for(z, clip, strategy, participation, planned)
    led = ledger or PrivacyLedger(path)
    b = participation.min_separation
    for t in range(planned if run is None else run):
        if participation.kind == "cyclic":
            size = population // b
            led.record_sample(population, size / population, "cyclic", sample_size=size)
        else:
            led.record_sample(population, participation.sampling_probability, "cyclic_poisson")
        led.record_release(mf_event(clip, sd(t) if callable(sd) else sd, stream, decl))
    if ledger is None:
        led.close()
    return stream


def pld_eps(event) -> float:
    return A.PldAccountant().compose(event).get_epsilon(DELTA)


def quiet_load(p):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LedgerWarning)  # an MF-only ledger warns about nothing
        return PrivacyLedger.load(p)


# ----------------------------------------------------------------------------- events


def test_sum_query_event_stream_fields():
    d = declaration(IDENTITY, Participation.cyclic(4), 8)
    e = mf_event(1.0, 2.0, "abc", d)
    assert (e.mechanism, e.stream, e.declaration) == (MF, "abc", d)
    assert SumQueryEvent(1.0, 2.0) == SumQueryEvent(1.0, 2.0, "gaussian", None, None)
    bad = [
        ((1.0, 2.0, MF), ValueError, "needs its stream id"),
        ((1.0, 2.0, MF, "abc"), ValueError, "needs its stream id"),
        ((1.0, 2.0, MF, None, d), ValueError, "needs its stream id"),
        ((1.0, 2.0, MF, "a b", d), ValueError, "printable ASCII"),
        ((1.0, 2.0, MF, 7, d), TypeError, "stream must be a str"),
        ((1.0, 2.0, MF, "abc", "{"), ValueError, "not valid JSON"),
        ((1.0, 2.0, MF, "abc", json.dumps({"strategy": {}, "participation": {}})), ValueError, "exactly the keys"),
        ((1.0, 2.0, MF, "abc", d.replace('"steps":8', '"steps":0')), ValueError, "steps"),
        ((1.0, 2.0, "gaussian", "abc"), ValueError, "belong to matrix_factorization"),
        ((1.0, 2.0, "discrete_gaussian", None, d), ValueError, "belong to matrix_factorization"),
    ]
    for args, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            SumQueryEvent(*args)


# ----------------------------------------------------------------------------- format


def test_ledger_without_streams_is_byte_identical(tmp_path):
    p = tmp_path / "l.jsonl"
    with PrivacyLedger(p) as led:
        led.record_sample(100, 0.1, "poisson")
        led.record_release(ComposedQueryEvent((SumQueryEvent(1.0, 1.5), SumQueryEvent(0.5, 2.0, "discrete_gaussian"))))
        led.record_sample(100, None, "shuffle", sample_size=10)
        led.record_release(NonPrivateQueryEvent())
    assert p.read_bytes() == (
        b'{"format": "dpcore-privacy-ledger", "version": 1, "privacy_unit": "example"}\n'
        b'{"type": "sample", "sample": 0, "population_size": 100, "sampling_probability": 0.1, "policy": "poisson", '
        b'"sample_size": null, "seeded": false}\n'
        b'{"type": "sum_query", "sample": 0, "l2_norm_clip": 1.0, "stddev": 1.5}\n'
        b'{"type": "sum_query", "sample": 0, "l2_norm_clip": 0.5, "stddev": 2.0, "mechanism": "discrete_gaussian"}\n'
        b'{"type": "sample", "sample": 1, "population_size": 100, "sampling_probability": 0.1, "policy": "shuffle", '
        b'"sample_size": 10, "seeded": false}\n'
        b'{"type": "non_private", "sample": 1}\n'
    )
    assert PrivacyLedger.load(p).streams == {}


def test_mf_entries_round_trip(tmp_path):
    p = tmp_path / "l.jsonl"
    strat, part = BLTStrategy([0.9, 0.5], [0.4, 0.3]), Participation.cyclic(4, 2)
    sid = write_stream(p, strat, part, 8, run=3, clip=0.5, z=1.3)
    ls = [json.loads(x) for x in p.read_text().splitlines()]
    assert [x.get("type") for x in ls] == [None, "sample", "mf_stream", "sum_query", "sample", "sum_query", "sample", "sum_query"]
    assert ls[1]["policy"] == "cyclic" and ls[1]["sample_size"] == 250 and ls[1]["sampling_probability"] == 0.25
    assert ls[2] == {"type": "mf_stream", "stream": sid, "strategy": strat.to_dict(), "participation": part.to_dict(), "steps": 8}
    sd = stddev_for(1.3, 0.5, strat, part, 8)
    assert ls[3] == {"type": "sum_query", "sample": 0, "l2_norm_clip": 0.5, "stddev": sd, "mechanism": MF, "stream": sid}
    # The core's fast reader refuses these entries; the Python reader reads the whole file.
    scanned, refused_at = _core.ledger_scan(p.read_bytes())
    assert scanned is None and refused_at == 2
    led = quiet_load(p)
    assert led.streams == {sid: StreamDeclaration(strat, part, 8)}
    assert [s.policy for s in led.samples] == ["cyclic"] * 3
    assert all(s.queries == (mf_event(0.5, sd, sid, declaration(strat, part, 8)),) for s in led.samples)
    # Continuing the ledger continues the stream: no second declaration, and the samples match.
    with PrivacyLedger(p) as w:
        assert w.streams == led.streams
        write_stream(None, strat, part, 8, run=2, clip=0.5, z=1.3, stream=sid, ledger=w)
        written = w.samples
    again = quiet_load(p)
    assert again.samples == written and len(again.samples) == 5
    assert sum(1 for x in p.read_text().splitlines() if '"mf_stream"' in x) == 1
    # A ledger that starts without streams and gains one later reads the same.
    q = tmp_path / "mixed.jsonl"
    with PrivacyLedger(q) as w:
        w.record_sample(1000, 0.01)
        w.record_release(SumQueryEvent(1.0, 1.1))
        write_stream(None, strat, part, 8, run=2, ledger=w)
        written = w.samples
    assert _core.ledger_scan(q.read_bytes())[0] is None
    assert quiet_load(q).samples == written


def test_torn_tail_in_a_stream(tmp_path):
    p = tmp_path / "l.jsonl"
    part = Participation.cyclic(2)
    sid = write_stream(p, IDENTITY, part, 4, run=2)
    full = p.read_bytes()
    # Cut inside the first release's mf_stream line: the fragment is not counted, and neither
    # its sample's sum query (not written yet) nor the stream exist.
    lines = full.split(b"\n")
    cut = b"\n".join(lines[:2]) + b"\n" + lines[2][:40]
    p.write_bytes(cut)
    with pytest.warns(LedgerWarning, match="torn last line"):
        led = PrivacyLedger.load(p)
    assert led.torn_tail is not None and not led.torn_tail.counted
    assert led.streams == {} and led.num_releases == 0
    with pytest.raises(LedgerError, match="torn"):
        PrivacyLedger.load(p, strict=True)
    # Reopening repairs the line; the stream's next release declares it again.
    with pytest.warns(LedgerWarning):
        w = PrivacyLedger(p)
    write_stream(None, IDENTITY, part, 4, run=1, stream=sid, ledger=w)
    w.close()
    led = quiet_load(p)
    assert list(led.streams) == [sid] and led.num_releases == 1
    # A torn last line that is a complete sum_query entry of the stream is counted.
    p.write_bytes(full.rstrip(b"\n"))
    with pytest.warns(LedgerWarning, match="complete entry and is counted"):
        led = PrivacyLedger.load(p)
    assert led.torn_tail.counted and led.num_releases == 2
    assert led.samples[1].queries[0].stream == sid


@pytest.mark.parametrize(
    "old, new, why",
    [
        ('"stream": "S"}', '"stream": "T"}', "no mf_stream entry declares"),
        ('"mechanism": "matrix_factorization", ', "", "unexpected \\['stream'\\]"),
        ('"steps": 4}', '"steps": 4, "extra": 1}', "unexpected \\['extra'\\]"),
        ('"coefficients": [1.0]', '"coefficients": [1.0, 2.0]', "non-increasing"),
        ('"min_separation": 2', '"min_separation": 0', "min_separation"),
        ('"stream": "S", "strategy"', '"stream": "a b", "strategy"', "printable"),
    ],
)
def test_corrupted_mf_entries_name_the_line(tmp_path, old, new, why):
    p = tmp_path / "l.jsonl"
    write_stream(p, IDENTITY, Participation.cyclic(2), 4, run=1, stream="S")
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))
    with pytest.raises(LedgerError, match=f"line \\d: corrupted .*{why}"):
        PrivacyLedger.load(p)


def test_stream_declared_twice_is_corrupt(tmp_path):
    p = tmp_path / "l.jsonl"
    write_stream(p, IDENTITY, Participation.cyclic(2), 4, run=1, stream="S")
    lines = p.read_text().splitlines()
    lines.insert(3, lines[2])
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(LedgerError, match="line 4: .*declared twice"):
        PrivacyLedger.load(p)


# ----------------------------------------------------------------------------- refusals


def test_changed_declaration_is_refused_and_nothing_written(tmp_path):
    p = tmp_path / "l.jsonl"
    part = Participation.cyclic(4)
    with PrivacyLedger(p) as led:
        sid = write_stream(None, IDENTITY, part, 8, run=2, ledger=led)
        before, samples = p.read_bytes(), led.samples
        others = [
            declaration(IDENTITY, part, 9),  # planned steps
            declaration(BandedStrategy([1.0, 0.5]), part, 8),  # strategy
            declaration(IDENTITY, Participation.cyclic(4, 2), 8),  # schema
        ]
        for other in others:
            led.record_sample(1000, 0.25, "cyclic", sample_size=250)
            with pytest.raises(LedgerError, match=f"{sid}: the declaration changed"):
                led.record_release(mf_event(1.0, 2.0, sid, other))
            assert p.read_bytes() == before and led.samples == samples
        # Two declarations of one new stream in one release: refused, nothing written.
        led.record_sample(1000, 0.25, "cyclic", sample_size=250)
        new = uuid.uuid4().hex
        both = ComposedQueryEvent((mf_event(1.0, 2.0, new, others[0]), mf_event(1.0, 2.0, new, others[1])))
        with pytest.raises(LedgerError, match="declaration changed"):
            led.record_release(both)
        assert p.read_bytes() == before and new not in led.streams
        # The same declaration, written differently (key order, spacing), is the same.
        d = json.loads(declaration(IDENTITY, part, 8))
        same = json.dumps({"steps": d["steps"], "participation": d["participation"], "strategy": d["strategy"]}, indent=2)
        led.record_release(mf_event(1.0, 2.0, sid, same))
        assert len(led.samples) == 3 and led.samples[-1].queries[0].declaration == declaration(IDENTITY, part, 8)
    # The replica of another rank keeps the streams of the samples it was given.
    rep = PrivacyLedger._replica("<replica>", PrivacyLedger.load(p)._samples)
    assert list(rep.streams) == [sid]
    rep.record_sample(1000, 0.25, "cyclic", sample_size=250)
    with pytest.raises(LedgerError, match="declaration changed"):
        rep.record_release(mf_event(1.0, 2.0, sid, others[0]))


def test_policy_mismatch_is_refused(tmp_path):
    p = tmp_path / "l.jsonl"
    cyc = declaration(IDENTITY, Participation.cyclic(4), 8)
    cp = declaration(BandedStrategy([1.0, 0.5]), Participation.cyclic_poisson(4, 0.1), 8)
    with PrivacyLedger(p) as led:
        before = p.read_bytes()
        for policy, q, decl, why in [
            ("poisson", 0.25, cyc, "policy 'poisson'.*declares 'cyclic'"),
            ("shuffle", 0.25, cyc, "policy 'shuffle'"),
            ("cyclic", 0.25, cp, "policy 'cyclic'.*declares 'cyclic_poisson'"),
            ("cyclic_poisson", 0.2, cp, "sampling_probability 0.2.*p = 0.1"),
        ]:
            led.record_sample(1000, q, policy)
            with pytest.raises(LedgerError, match=why):
                led.record_release(mf_event(1.0, 2.0, uuid.uuid4().hex, decl))
            assert p.read_bytes() == before
        # A strategy that cannot serve its schema is refused too: amplified MF needs <= b bands.
        led.record_sample(1000, 0.1, "cyclic_poisson")
        five_bands = json.dumps({
            "strategy": BandedStrategy([1.0, 0.9, 0.8, 0.7, 0.6]).to_dict(),
            "participation": Participation.cyclic_poisson(4, 0.1).to_dict(),
            "steps": 8,
        })
        with pytest.raises(LedgerError, match="invalid declaration.*at most that many bands"):
            led.record_release(mf_event(1.0, 2.0, "x", five_bands))
        assert p.read_bytes() == before
    # A file edited to another policy reads, but is refused by the accountant, naming the sample.
    write_stream(p, IDENTITY, Participation.cyclic(2), 4)
    text = p.read_text()
    lines = text.splitlines()
    assert '"sample": 1,' in lines[4]
    lines[4] = lines[4].replace('"cyclic"', '"shuffle"')
    p.write_text("\n".join(lines) + "\n")
    led = PrivacyLedger.load(p)
    assert led.samples[1].policy == "shuffle"
    for acct in ("pld", "rdp"):
        with pytest.raises(LedgerError, match="sample 1 has policy 'shuffle'.*cannot be accounted"):
            led.get_epsilon(DELTA, acct)
    with pytest.raises(LedgerError, match="sample 1"):
        led.report(DELTA)


# ----------------------------------------------------------------------------- accounting


@pytest.mark.parametrize("epochs", [1, 3])
def test_identity_stream_is_the_gaussian_mechanism(tmp_path, epochs):
    """C = I over fixed batches: one epoch (b = m) is one Gaussian mechanism at z = σ/S; k
    epochs are k Gaussian mechanisms at z, i.e. GaussianEvent(z/√k)."""
    p = tmp_path / "l.jsonl"
    m, z, clip = 12, 1.7, 2.5
    b = m // epochs
    write_stream(p, IDENTITY, Participation.cyclic(b), m, stddev=z * clip, clip=clip)
    led = quiet_load(p)
    (ev,) = led.to_event().events
    assert ev.noise_multiplier == pytest.approx(z / math.sqrt(epochs), rel=1e-11)
    assert ev.noise_multiplier <= z / math.sqrt(epochs)
    eps = led.get_epsilon(DELTA)
    assert eps == pytest.approx(pld_eps(A.GaussianEvent(z / math.sqrt(epochs))), rel=1e-9)
    assert eps == pytest.approx(pld_eps(A.SelfComposedEvent(A.GaussianEvent(z), epochs)), rel=1e-9)
    assert eps >= pld_eps(A.SelfComposedEvent(A.GaussianEvent(z), epochs))
    # The same z as the MF module's effective noise multiplier: σ = z·S·√k.
    assert mf_epsilon(z / math.sqrt(epochs), DELTA, participation=Participation.cyclic(b), steps=m) == pytest.approx(eps, rel=1e-9)
    # RDP: the Gaussian's α/(2z²), converted.
    assert led.get_epsilon(DELTA, "rdp") == pytest.approx(
        A.RdpAccountant().compose(A.GaussianEvent(z / math.sqrt(epochs))).get_epsilon(DELTA), rel=1e-9
    )


def _independent_sensitivity(strategy, n, b) -> float:
    """‖C·1_π‖ at π = {0, b, 2b, …}, from the dense matrix built here from the coefficients."""
    c = np.zeros((n, n))
    coef = strategy.coefficients(n)
    for j in range(n):
        c[j:, j] = coef[: n - j]
    return float(np.linalg.norm(c[:, ::b].sum(axis=1)))


def test_blt_stream_is_gaussian_at_sigma_over_s_sens(tmp_path):
    p = tmp_path / "l.jsonl"
    strat, part, n = BLTStrategy([0.95, 0.6], [0.5, 0.3]), Participation.cyclic(5), 17
    sd, clip = 3.0, 0.7
    write_stream(p, strat, part, n, stddev=sd, clip=clip)
    sens = _independent_sensitivity(strat, n, 5)
    assert sens > 2.0  # more than the identity's √k = 2 (k = 4 participations): correlation costs sensitivity
    led = quiet_load(p)
    (ev,) = led.to_event().events
    assert ev.noise_multiplier == pytest.approx(sd / (clip * sens), rel=1e-11)
    assert led.get_epsilon(DELTA) == pytest.approx(pld_eps(A.GaussianEvent(sd / (clip * sens))), rel=1e-9)
    # σ from stddev_for(z) gives back (at least) z, and ε(z) of the MF module.
    q = tmp_path / "z.jsonl"
    write_stream(q, strat, part, n, z=1.1, clip=clip)
    led = quiet_load(q)
    (ev,) = led.to_event().events
    assert ev.noise_multiplier >= 1.1 and ev.noise_multiplier == pytest.approx(1.1, rel=1e-11)
    assert led.get_epsilon(DELTA) <= mf_epsilon(1.1, DELTA, participation=part, steps=n, strategy=strat)
    assert led.get_epsilon(DELTA) == pytest.approx(mf_epsilon(1.1, DELTA, participation=part, steps=n), rel=1e-9)


def test_running_past_the_planned_steps_costs_more(tmp_path):
    strat, part = BandedStrategy([1.0, 0.7, 0.3]), Participation.cyclic(5, 2)
    eps = {}
    for run in (10, 15, 7):
        p = tmp_path / f"l{run}.jsonl"
        write_stream(p, strat, part, 10, run=run, z=1.0)
        led = quiet_load(p)
        (ev,) = led.to_event().events
        sens = _independent_sensitivity(strat, run, 5)
        sd = stddev_for(1.0, 1.0, strat, part, 10)
        assert ev.noise_multiplier == pytest.approx(sd / sens, rel=1e-11)  # recomputed for the run
        eps[run] = led.get_epsilon(DELTA)
        rep = led.report(DELTA).to_dict()
        (st,) = rep["mf_streams"]
        assert (st["steps"], st["planned_steps"], st["participations"]) == (run, 10, -(-run // 5))
        assert st["sensitivity"] == pytest.approx(sens, rel=1e-11)
        beyond = any("beyond the 10 planned" in w for w in rep["warnings"])
        assert beyond == (run > 10)
    assert eps[7] < eps[10] < eps[15]
    assert eps[10] == pytest.approx(mf_epsilon(1.0, DELTA, participation=part, steps=10), rel=1e-9)


def test_per_step_noise_uses_the_minimum(tmp_path):
    p = tmp_path / "l.jsonl"
    strat, part, n = BandedStrategy([1.0, 0.5]), Participation.cyclic(3), 9
    sds = [2.0, 3.0, 1.5, 4.0, 2.2, 2.0, 5.0, 1.6, 2.0]
    clips = [1.0, 1.0, 1.0, 2.0, 1.0, 0.5, 1.0, 1.0, 1.0]  # σ/S: 2, 3, 1.5, 2, 2.2, 4, 5, 1.6, 2
    decl, sid = declaration(strat, part, n), "varying"
    with PrivacyLedger(p) as led:
        for sd, c in zip(sds, clips):
            led.record_sample(900, 1 / 3, "cyclic", sample_size=300)
            led.record_release(mf_event(c, sd, sid, decl))
    led = quiet_load(p)
    (ev,) = led.to_event().events
    sens = _independent_sensitivity(strat, n, 3)
    assert ev.noise_multiplier == pytest.approx(1.5 / sens, rel=1e-11) and ev.noise_multiplier <= 1.5 / sens
    assert led.get_epsilon(DELTA) == pytest.approx(pld_eps(A.GaussianEvent(1.5 / sens)), rel=1e-9)
    # Two groups of one stream on one sample combine by Eq. (1): z_t = (1/2² + 1/2²)^(-1/2).
    q = tmp_path / "groups.jsonl"
    with PrivacyLedger(q) as led:
        for _ in range(n):
            led.record_sample(900, 1 / 3, "cyclic", sample_size=300)
            led.record_release(ComposedQueryEvent((mf_event(1.0, 2.0, sid, decl), mf_event(0.5, 1.0, sid, decl))))
    (ev,) = quiet_load(q).to_event().events
    assert ev.noise_multiplier == pytest.approx(math.sqrt(2) / sens, rel=1e-11)


def test_cyclic_poisson_matches_dp_accounting(tmp_path):
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    p = tmp_path / "l.jsonl"
    strat, prob, b, m = BandedStrategy([1.0, 0.6, 0.3]), 0.05, 4, 30
    part = Participation.cyclic_poisson(b, prob)
    sd, clip = 2.0, 1.0
    write_stream(p, strat, part, m, stddev=sd, clip=clip)
    led = quiet_load(p)
    colnorm = math.sqrt(1 + 0.36 + 0.09)
    k = -(-m // b)
    z = sd / (clip * colnorm)
    (ev,) = led.to_event().events
    assert isinstance(ev, A.SelfComposedEvent) and ev.count == k == 8
    assert ev.event.sampling_probability == prob and ev.event.event.noise_multiplier == pytest.approx(z, rel=1e-11)
    oracle = pld_privacy_accountant.PLDAccountant()
    oracle.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(prob, dpa.GaussianDpEvent(z)), k))
    eps = led.get_epsilon(DELTA)
    assert eps == pytest.approx(oracle.get_epsilon(DELTA), rel=2e-3)
    assert eps == pytest.approx(mf_epsilon(z, DELTA, participation=part, steps=m), rel=1e-9)
    rdp = led.get_epsilon(DELTA, "rdp")
    assert rdp == pytest.approx(A.epsilon(prob, z, k, DELTA, accountant="rdp"), rel=1e-9) and rdp > eps
    # Poisson sampling has no analysis under replace-one: refused, naming the streams.
    with pytest.raises(ValueError, match="cyclic Poisson sampling.*add_or_remove"), \
            pytest.warns(LedgerWarning, match="cannot be analysed by the PLD accountant"):
        led.get_epsilon(DELTA, neighboring="replace_one")


def test_replace_one_halves_the_stream_z(tmp_path):
    p = tmp_path / "l.jsonl"
    write_stream(p, BandedStrategy([1.0, 0.4]), Participation.cyclic(3), 6, z=2.0)
    led = quiet_load(p)
    (a,) = led.to_event().events
    (r,) = led.to_event("replace_one").events
    assert r.noise_multiplier == a.noise_multiplier / 2
    assert led.get_epsilon(DELTA, neighboring="replace_one") == pytest.approx(pld_eps(A.GaussianEvent(a.noise_multiplier / 2)), rel=1e-9)


def test_other_queries_on_cyclic_samples_are_unamplified_and_apart(tmp_path):
    p = tmp_path / "l.jsonl"
    part = Participation.cyclic(2)
    decl = declaration(IDENTITY, part, 4)
    with PrivacyLedger(p) as led:
        for _ in range(4):
            led.record_sample(100, 0.5, "cyclic", sample_size=50)
            led.record_release(ComposedQueryEvent((mf_event(1.0, 3.0, "s", decl), SumQueryEvent(1.0, 4.0))))
        led.record_sample(100, 0.01, "poisson")
        led.record_release(SumQueryEvent(1.0, 1.0))
    led = PrivacyLedger.load(p)
    assert led.samples[0].noise_multiplier() == pytest.approx(4.0)  # the stream's step is not in Eq. (1)
    with pytest.warns(LedgerWarning, match="4 sample\\(s\\) of cyclic batches .* carry sum queries outside any stream") as rec:
        ev = led.to_event()
    assert not any("Use poisson sampling" in str(w.message) for w in rec)
    other, poisson, stream = ev.events
    assert other.count == 4 and other.event.noise_multiplier == pytest.approx(4.0)  # bare Gaussian each
    assert poisson == A.PoissonSampledEvent(0.01, A.GaussianEvent(poisson.event.noise_multiplier))
    assert stream.noise_multiplier == pytest.approx(3.0 / math.sqrt(2), rel=1e-11)


def test_two_streams_compose(tmp_path):
    p = tmp_path / "l.jsonl"
    with PrivacyLedger(p) as led:
        write_stream(None, IDENTITY, Participation.cyclic(3), 3, stddev=2.0, ledger=led)
        write_stream(None, BandedStrategy([1.0, 0.5]), Participation.cyclic(3), 3, stddev=2.0, ledger=led)
    led = quiet_load(p)
    a, b = led.to_event().events  # one epoch each: sens = ‖C[:, 0]‖ = 1 and √(1 + 0.5²)
    assert a.noise_multiplier == pytest.approx(2.0, rel=1e-11)
    assert b.noise_multiplier == pytest.approx(2.0 / math.sqrt(1.25), rel=1e-11)
    assert led.get_epsilon(DELTA) == pytest.approx(pld_eps(A.ComposedEvent((a, b))), rel=1e-9)
    assert led.get_epsilon(DELTA) > pld_eps(a)


def test_non_private_stream_step_is_infinite(tmp_path):
    p = tmp_path / "l.jsonl"
    write_stream(p, IDENTITY, Participation.cyclic(2), 4, stddev=0.0)
    led = quiet_load(p)
    assert led.get_epsilon(DELTA) == math.inf
    assert any("without noise" in w for w in led.report(DELTA).warnings)


# ----------------------------------------------------------------------------- the MF module


def test_mf_accounting_api():
    part, strat = Participation.cyclic(10, 3), BandedStrategy([1.0, 0.5, 0.25])
    sd = stddev_for(1.2, 0.5, strat, part, 30)
    assert sd == pytest.approx(1.2 * 0.5 * strat.sensitivity(30, part), rel=1e-11)
    assert 1.2 <= noise_multiplier_for(sd, 0.5, strat, part, 30) <= 1.2 * (1 + 1e-11)
    assert accountant_event(1.2, participation=part, steps=30) == A.GaussianEvent(1.2)
    cp = Participation.cyclic_poisson(10, 0.1)
    assert accountant_event(1.2, participation=cp, steps=25) == A.SelfComposedEvent(A.PoissonSampledEvent(0.1, A.GaussianEvent(1.2)), 3)
    assert accountant_event(0.0, participation=cp, steps=25) == A.NonPrivateEvent()
    assert mf_epsilon(1.2, DELTA, participation=part, steps=30) == pld_eps(A.GaussianEvent(1.2))
    assert mf_epsilon(1.2, DELTA, participation=cp, steps=25) == pld_eps(accountant_event(1.2, participation=cp, steps=25))
    assert mf_epsilon(0.0, DELTA, participation=part, steps=30) == math.inf
    with pytest.raises(ValueError, match="at most that many bands"):
        mf_epsilon(1.0, DELTA, participation=Participation.cyclic_poisson(2, 0.1), steps=4, strategy=strat)
    with pytest.raises(ValueError, match="cannot be used with cyclic Poisson"):
        calibrate_noise_multiplier(1.0, DELTA, participation=cp, steps=4, strategy=BLTStrategy([0.5], [0.5]))
    for pt, steps in ((part, 30), (cp, 25)):
        for acct in ("pld", "rdp"):
            z = calibrate_noise_multiplier(2.0, DELTA, participation=pt, steps=steps, accountant=acct)
            e = mf_epsilon(z, DELTA, participation=pt, steps=steps, accountant=acct)
            assert e <= 2.0 and e == pytest.approx(2.0, rel=1e-3)
    dec = StreamDeclaration(strat, part, 30)
    assert StreamDeclaration.from_json(dec.to_json()) == dec and dec.sensitivity() == strat.sensitivity(30, part)
    with pytest.raises(ValueError):
        StreamDeclaration.from_json('{"strategy": {"kind": "banded", "coefficients": [1.0]}, "participation": {"kind": "cyclic"}, "steps": 3}')


# ----------------------------------------------------------------------------- report and CLI


def run(*args: str, check_rc: int = 0) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "dpcore", *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == check_rc, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    return res


def test_report_states_mechanism_and_schema(tmp_path):
    p = tmp_path / "l.jsonl"
    strat, part = BLTStrategy([0.9], [0.6]), Participation.cyclic(4, 2)
    sid = write_stream(p, strat, part, 8, z=1.5)
    led = quiet_load(p)
    rep = led.report(DELTA)
    assert rep.epsilon == led.get_epsilon(DELTA)
    (st,) = rep.to_dict()["mf_streams"]
    assert st["stream"] == sid and st["mechanism"] == strat.describe() and st["buffers"] == 1
    assert st["participation"] == part.describe() and st["participation_schema"] == part.to_dict()
    assert st["sensitivity"] == strat.sensitivity(8, part)
    assert st["noise_multiplier"] == pytest.approx(1.5 * strat.sensitivity(8, part), rel=1e-11)
    assert st["effective_noise_multiplier"] == pytest.approx(1.5, rel=1e-11)
    assert "none needed" in st["amplification"]
    assert rep.effective_noise_multiplier == st["effective_noise_multiplier"]
    assert not any("shuffle" in w or "Use poisson" in w for w in rep.warnings)
    assert any("Matrix-factorization streams" in a for a in rep.assumptions)
    md = rep.to_markdown()
    for text in (strat.describe(), part.describe(), "## Matrix-factorization streams", "8 / 8", "none needed", sid):
        assert text in md, text
    out = run("report", str(p), "--delta", str(DELTA)).stdout
    assert strat.describe() in out and part.describe() in out and "none needed" in out
    js = json.loads(run("report", str(p), "--delta", str(DELTA), "--json").stdout)
    assert js["mf_streams"][0]["stream"] == sid and js["epsilon"] == rep.epsilon
    # Cyclic Poisson: the amplification it uses is stated.
    q = tmp_path / "cp.jsonl"
    cp = Participation.cyclic_poisson(4, 0.1)
    write_stream(q, BandedStrategy([1.0, 0.5]), cp, 8)
    st = quiet_load(q).report(DELTA).to_dict()["mf_streams"][0]
    assert "cyclic Poisson sampling at p = 0.1" in st["amplification"] and st["bands"] == 2
    # A ledger without streams has no MF section.
    r = tmp_path / "plain.jsonl"
    with PrivacyLedger(r) as w:
        w.record_sample(100, 0.1)
        w.record_release(SumQueryEvent(1.0, 1.0))
    plain = PrivacyLedger.load(r).report(DELTA)
    assert plain.to_dict()["mf_streams"] == [] and "Matrix-factorization" not in plain.to_markdown()


def test_epsilon_curve_of_a_stream(tmp_path):
    p = tmp_path / "l.jsonl"
    write_stream(p, BandedStrategy([1.0, 0.5]), Participation.cyclic(3), 12, z=1.0)
    curve = quiet_load(p).epsilon_curve(DELTA, points=4, accountants=("pld",))
    assert curve["steps"] == [3, 6, 9, 12]
    assert all(a < b for a, b in zip(curve["pld"], curve["pld"][1:]))
    assert curve["pld"][-1] >= curve["final"]["pld"] * (1 - 1e-9)


@pytest.mark.parametrize("extra", [[], ["-q", "0.05"]])
def test_cli_calibrate_then_epsilon_round_trip(tmp_path, extra):
    strat = BandedStrategy([1.0, 0.6, 0.2])
    f = tmp_path / "strategy.json"
    f.write_text(json.dumps(strat.to_dict()))
    base = ["--noise-mechanism", "banded", "--min-separation", "10", "--epochs", "3", "--delta", "1e-6", *extra]
    cal = json.loads(run("calibrate", "--epsilon", "2", *base, "--strategy", str(f), "--json").stdout)
    z = cal["noise_multiplier"]
    part = Participation.cyclic(10) if not extra else Participation.cyclic_poisson(10, 0.05)
    assert cal["steps"] == 30 and cal["participations"] == 3
    assert z == calibrate_noise_multiplier(2.0, 1e-6, participation=part, steps=30)
    assert cal["sensitivity"] == strat.sensitivity(30, part)
    assert cal["stddev_per_unit_clip"] == stddev_for(z, 1.0, strat, part, 30)
    out = json.loads(run("epsilon", "-z", repr(z), *base, "--json").stdout)
    assert out["epsilon"] <= 2.0 and out["epsilon"] == pytest.approx(2.0, rel=1e-4)
    assert out["epsilon"] == mf_epsilon(z, 1e-6, participation=part, steps=30)
    assert out["epsilon_pld_lower_bound"] <= out["epsilon"] <= out["epsilon_rdp"]
    text = run("epsilon", "-z", repr(z), *base, "--strategy", str(f)).stdout
    assert f"{out['epsilon']:.6g}" in text and strat.describe() in text and part.describe() in text
    # A ledger run with σ = stddev_for(z) stays within the target.
    p = tmp_path / "run.jsonl"
    write_stream(p, strat, part, 30, z=z)
    assert quiet_load(p).get_epsilon(1e-6) <= 2.0


def test_cli_mf_bad_input(tmp_path):
    for args in (
        ["epsilon", "--noise-mechanism", "banded", "-z", "1", "--steps", "10", "--delta", "1e-5"],  # no --min-separation
        ["epsilon", "-z", "1", "--steps", "10", "--delta", "1e-5"],  # DP-SGD without -q
        ["epsilon", "-q", "0.1", "-z", "1", "--steps", "10", "--delta", "1e-5", "--min-separation", "3"],
        ["calibrate", "--noise-mechanism", "blt", "--epsilon", "1", "--delta", "1e-5", "--min-separation", "3", "-z", "1", "--steps", "5"],
        # BLT with cyclic Poisson sampling: amplified MF needs a banded strategy
        ["epsilon", "--noise-mechanism", "blt", "-z", "1", "--steps", "10", "--min-separation", "3", "-q", "0.1", "--delta", "1e-5"],
    ):
        res = run(*args, check_rc=2)
        assert len([x for x in res.stderr.splitlines() if x.strip()]) == 1
    f = tmp_path / "blt.json"
    f.write_text(json.dumps(BLTStrategy([0.5], [0.5]).to_dict()))
    res = run("epsilon", "--noise-mechanism", "banded", "-z", "1", "--steps", "10", "--min-separation", "3",
              "--delta", "1e-5", "--strategy", str(f), check_rc=1)
    assert "a blt strategy, but --noise-mechanism banded" in res.stderr
    f.write_text(json.dumps(BandedStrategy([1.0, 0.5, 0.4, 0.3]).to_dict()))
    res = run("epsilon", "--noise-mechanism", "banded", "-z", "1", "--steps", "10", "--min-separation", "3", "-q", "0.1",
              "--delta", "1e-5", "--strategy", str(f), check_rc=1)
    assert "needs at most that many bands" in res.stderr
    f.write_text("{")
    res = run("epsilon", "--noise-mechanism", "banded", "-z", "1", "--steps", "10", "--min-separation", "3", "--delta", "1e-5",
              "--strategy", str(f), check_rc=1)
    assert "not a JSON file" in res.stderr


def test_cli_old_mechanism_flag_still_works_and_warns(tmp_path):
    # --mechanism mf is --noise-mechanism banded (or the --strategy file's kind); --mechanism dpsgd is gaussian
    new = json.loads(run("epsilon", "--noise-mechanism", "banded", "-z", "1", "--steps", "10", "--min-separation", "3",
                         "--delta", "1e-5", "--json").stdout)
    res = run("epsilon", "--mechanism", "mf", "-z", "1", "--steps", "10", "--min-separation", "3", "--delta", "1e-5",
              "--json")
    assert json.loads(res.stdout) == new and new["noise_mechanism"] == "banded"
    assert res.stderr.strip() == "dpcore epsilon: warning: --mechanism mf is deprecated: it is --noise-mechanism banded now"
    f = tmp_path / "blt.json"
    f.write_text(json.dumps(BLTStrategy([0.5], [0.5]).to_dict()))
    res = run("calibrate", "--mechanism", "mf", "--epsilon", "1", "--steps", "9", "--min-separation", "3",
              "--delta", "1e-5", "--strategy", str(f), "--json")
    assert json.loads(res.stdout)["noise_mechanism"] == "blt" and "--noise-mechanism blt now" in res.stderr
    res = run("epsilon", "--mechanism", "dpsgd", "-q", "0.01", "-z", "1.1", "--steps", "100", "--delta", "1e-5", "--json")
    assert "--noise-mechanism gaussian now" in res.stderr
    assert json.loads(res.stdout) == json.loads(run("epsilon", "-q", "0.01", "-z", "1.1", "--steps", "100", "--delta",
                                                    "1e-5", "--json").stdout)
    # in-process: a DeprecationWarning
    from dpcore import cli

    with pytest.warns(DeprecationWarning, match="--mechanism mf is deprecated"):
        assert cli.main(["epsilon", "--mechanism", "mf", "-z", "1", "--steps", "10", "--min-separation", "3",
                         "--delta", "1e-5"]) == 0
    run("epsilon", "--mechanism", "mf", "--noise-mechanism", "gaussian", "-z", "1", "--steps", "10",
        "--min-separation", "3", "--delta", "1e-5", check_rc=2)
