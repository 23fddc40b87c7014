"""dpcore.torch checkpoint and resume (DPOptimizer/DPDataLoader state dicts) and shuffled batches
(make_private(sampler="shuffle")).

A seeded run interrupted and rebuilt from its checkpoint ends bit for bit where the uninterrupted
run ends, with the same ledger; loading refuses another or a truncated ledger, a ledger ahead of
the checkpoint (unless ledger_ahead="keep"), a different model, and a mid-logical-batch state; a
process killed with SIGKILL resumes without losing a release or applying an update twice."""

from __future__ import annotations

import copy
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import dpcore  # noqa: E402
from dpcore.ledger import LedgerError, LedgerWarning  # noqa: E402
from dpcore.queries import QuantileAdaptiveClipQuery  # noqa: E402
from dpcore.torch import DPDataLoader, make_private  # noqa: E402

torch.set_num_threads(1)

DELTA = 1e-5
N, BS = 40, 8  # q = 0.2: 5 logical batches per pass


def mlp():
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 4))


def dataset(n=N):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 7, generator=g), torch.randint(0, 4, (n,), generator=g))


def adaptive():
    return QuantileAdaptiveClipQuery(
        initial_l2_norm_clip=1.0, noise_multiplier=1.0, target_unclipped_quantile=0.5, learning_rate=0.5,
        clipped_count_stddev=4.0, expected_num_records=BS, denominator=BS,
    )


def build(ledger, *, seed=3, inner="sgd", query=False, weights=None, model=None, n=N, **kw):
    torch.manual_seed(0)
    model = model if model is not None else mlp()
    if weights is not None:
        model.load_state_dict(weights)
    if inner == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    how = {"query": adaptive()} if query else {"noise_multiplier": 0.8, "max_grad_norm": 1.0}
    return make_private(model, opt, DataLoader(dataset(n), batch_size=BS), ledger=str(ledger), seed=seed, **how, **kw)


def train(model, opt, loader, steps, bf16=False):
    """``steps`` releases, pass after pass; breaks out of the pass in the middle when done.
    ``bf16``: the forward passes under bfloat16 autocast."""
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            if len(x):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(x)
                nn.functional.cross_entropy(out.float(), y).backward()
            opt.step()
            if opt.last_step_released:
                done += 1
                if done == steps:
                    return


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def epsilon(opt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerWarning)  # seeded samples
        return opt.get_epsilon(DELTA)


def checkpoint(model, opt, path):
    """What a training script saves (atomically), read back as the Hugging Face Trainer does."""
    tmp = str(path) + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, path)
    return torch.load(path, weights_only=True)


PADDED = {"max_physical_batch_size": 12, "pad_batches": True}  # static shapes: samples above 12 split


@pytest.mark.parametrize("inner,query,bf16,memory,pad", [
    ("sgd", False, False, "default", False), ("adam", True, False, "default", False),
    ("adam", True, True, "default", False), ("sgd", False, False, "lean", False), ("adam", True, True, "lean", False),
    ("adam", True, False, "default", True), ("sgd", False, True, "lean", True),
])
def test_resumed_run_equals_uninterrupted(tmp_path, inner, query, bf16, memory, pad):
    total, k = 8, 3  # the checkpoint falls in the middle of the first pass
    opts = dict(memory=memory, **(PADDED if pad else {}))
    model, opt, loader = build(tmp_path / "a.jsonl", inner=inner, query=query, **opts)
    train(model, opt, loader, total, bf16)
    want, want_eps, want_samples = params(model), epsilon(opt), opt.ledger.samples
    want_gs = [g.gs for g in opt._groups]

    model, opt, loader = build(tmp_path / "b.jsonl", inner=inner, query=query, **opts)
    train(model, opt, loader, k, bf16)
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    saved_gs = [g.gs for g in opt._groups]
    opt.ledger.close()  # the process ends
    assert ck["optimizer"]["dpcore"]["releases"] == k
    assert ck["optimizer"]["dpcore"]["data_loader"]["pass_position"] == k

    model, opt, loader = build(tmp_path / "b.jsonl", inner=inner, query=query, weights=ck["model"], **opts)
    if query:  # the adaptive clip norm moved: a rebuilt optimizer starts from C_0, the checkpoint restores it
        assert saved_gs[0].l2_norm_clip != opt._groups[0].gs.l2_norm_clip
    opt.load_state_dict(ck["optimizer"])
    assert [g.gs for g in opt._groups] == saved_gs
    assert opt._releases == k and loader.samples_drawn == k and opt._drawn_at_release == k
    train(model, opt, loader, total - k, bf16)

    for a, b in zip(params(model), want):
        assert torch.equal(a, b)
    assert [g.gs for g in opt._groups] == want_gs
    assert opt.ledger.num_releases == total and opt._releases == total
    assert opt.ledger.samples == want_samples
    assert epsilon(opt) == want_eps


def test_live_round_trip_is_a_no_op(tmp_path):
    # accelerate wraps an optimizer with state_dict() then load_state_dict() on the same object
    model, opt, loader = build(tmp_path / "a.jsonl", inner="adam", query=True)
    train(model, opt, loader, 7)
    want = params(model)

    model, opt, loader = build(tmp_path / "b.jsonl", inner="adam", query=True)
    opt.load_state_dict(opt.state_dict())  # at wrap time
    train(model, opt, loader, 3)
    before = opt.state_dict()["dpcore"]
    opt.load_state_dict(opt.state_dict())  # and in the middle of a pass
    assert opt._noise.drawn_ahead == [None]  # the noise drawn ahead (by every noise source) is dropped on load
    assert opt.state_dict()["dpcore"] == before
    train(model, opt, loader, 4)
    for a, b in zip(params(model), want):
        assert torch.equal(a, b)


def test_state_dict_is_plain_and_loads_with_weights_only(tmp_path):
    model, opt, loader = build(tmp_path / "l.jsonl", inner="adam", query=True)
    train(model, opt, loader, 2)
    sd = opt.state_dict()
    assert set(sd) == {"optimizer", "dpcore"}

    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, (str, int)) and plain(w) for k, w in v.items())
        if isinstance(v, (list, tuple)):
            return all(plain(w) for w in v)
        return v is None or isinstance(v, (bool, int, float, str, torch.Tensor))

    assert plain(sd["dpcore"])
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert back["dpcore"] == sd["dpcore"]
    dp = back["dpcore"]
    assert dp["ledger"] == {"path": os.path.abspath(opt.ledger.path), "num_releases": 2, "num_samples": 2}
    assert dp["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"] and dp["num_params"] == 4
    gs = dp["groups"][0]["global_state"]
    assert gs["class"] == "AdaptiveClipGlobalState"
    assert gs["fields"]["l2_norm_clip"] == opt._groups[0].gs.l2_norm_clip
    assert dp["data_loader"]["samples_drawn"] == 2 and dp["data_loader"]["draws"] == 2
    opt.load_state_dict(back)


def test_refuses_another_ledger(tmp_path):
    model, opt, loader = build(tmp_path / "a.jsonl")
    train(model, opt, loader, 2)
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    opt.ledger.close()
    model, opt, loader = build(tmp_path / "other.jsonl", weights=ck["model"])
    with pytest.raises(LedgerError, match="this optimizer writes"):
        opt.load_state_dict(ck["optimizer"])
    assert opt._releases == 0 and loader.samples_drawn == 0 and not opt.original_optimizer.state  # nothing loaded


def test_refuses_a_truncated_ledger(tmp_path):
    path = tmp_path / "a.jsonl"
    model, opt, loader = build(path)
    train(model, opt, loader, 2)
    shutil.copy(path, tmp_path / "earlier.jsonl")
    train(model, opt, loader, 1)
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    opt.ledger.close()
    os.replace(tmp_path / "earlier.jsonl", path)  # the ledger lost its last release
    model, opt, loader = build(path, weights=ck["model"])
    assert opt.ledger.num_releases == 2
    with pytest.raises(LedgerError, match="fewer than the 3"):
        opt.load_state_dict(ck["optimizer"], ledger_ahead="keep")
    assert opt._releases == 0 and not opt.original_optimizer.state


def test_ledger_ahead_refused_by_default_kept_on_request(tmp_path):
    path = tmp_path / "a.jsonl"
    model, opt, loader = build(path)
    train(model, opt, loader, 2)
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    eps_ckpt = epsilon(opt)
    train(model, opt, loader, 1)  # recorded, then the process dies before its checkpoint
    opt.ledger.close()

    model, opt, loader = build(path, weights=ck["model"])
    with pytest.raises(LedgerError, match=r"1 release\(s\) more.*ledger_ahead='keep'") as err:
        opt.load_state_dict(ck["optimizer"])
    # a direct user of the optimizer is told its own keyword (the HF trainer names DPTrainer's)
    assert "optimizer.load_state_dict(state, ledger_ahead='keep')" in str(err.value)
    assert "DPTrainer" not in str(err.value)
    assert opt._releases == 0 and loader.samples_drawn == 0 and not opt.original_optimizer.state
    opt.load_state_dict(ck["optimizer"], ledger_ahead="keep")
    assert opt._releases == 2 and loader.samples_drawn == 2
    assert opt.ledger.num_releases == 3  # kept, still counted
    assert epsilon(opt) > eps_ckpt
    train(model, opt, loader, 2)
    assert opt.ledger.num_releases == 5 and opt._releases == 4
    opt.ledger.close()

    # the attribute does the same (for code that calls load_state_dict(sd) itself, as Trainer does)
    model, opt, loader = build(path, weights=ck["model"])
    opt.ledger_ahead = "keep"
    opt.load_state_dict(ck["optimizer"])
    assert opt._releases == 2 and opt.ledger.num_releases == 5
    with pytest.raises(ValueError, match="ledger_ahead"):
        opt.load_state_dict(ck["optimizer"], ledger_ahead="drop")


def test_refuses_a_different_model(tmp_path):
    path = tmp_path / "a.jsonl"
    model, opt, loader = build(path)
    train(model, opt, loader, 2)
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    opt.ledger.close()
    torch.manual_seed(0)
    model, opt, loader = build(path, model=nn.Sequential(nn.Linear(7, 4)))
    with pytest.raises(ValueError, match="4 parameter tensors, this optimizer has 2"):
        opt.load_state_dict(ck["optimizer"])
    assert opt._releases == 0 and not opt.original_optimizer.state
    opt.ledger.close()
    model, opt, loader = build(path, model=nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 5)))
    with pytest.raises(ValueError, match="shapes"):
        opt.load_state_dict(ck["optimizer"])
    opt.ledger.close()
    torch.manual_seed(0)
    m = mlp()
    _, opt, _ = make_private(m, torch.optim.SGD(m.parameters(), lr=0.2), DataLoader(dataset(), batch_size=BS),
                             noise_multiplier=2.0, max_grad_norm=1.0, ledger=str(path), seed=3)
    with pytest.raises(ValueError, match="noise_multiplier"):
        opt.load_state_dict(ck["optimizer"])


def test_refuses_mid_logical_batch(tmp_path):
    path = tmp_path / "a.jsonl"
    model, opt, loader = build(path, max_physical_batch_size=2)
    it = iter(loader)
    x, y = next(it)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert not opt.last_step_released and not loader.logical_batch_complete
    sd = opt.state_dict()
    assert sd["dpcore"]["logical_batch_complete"] is False
    assert sd["dpcore"]["data_loader"]["logical_batch_complete"] is False
    with pytest.raises(ValueError, match="middle of a logical batch"):
        DPDataLoader(dataset(), BS / N, ledger=dpcore.PrivacyLedger(tmp_path / "b.jsonl"),
                     max_physical_batch_size=2).load_state_dict(sd["dpcore"]["data_loader"])
    del it
    opt.ledger.close()
    model, opt, loader = build(path, max_physical_batch_size=2)
    with pytest.raises(ValueError, match="middle of a logical batch"):
        opt.load_state_dict(sd)


def test_bare_optimizer_state_loads_with_a_warning(tmp_path):
    model, opt, loader = build(tmp_path / "a.jsonl", inner="adam")
    train(model, opt, loader, 2)
    old = opt.original_optimizer.state_dict()
    opt.ledger.close()
    model, opt, loader = build(tmp_path / "a.jsonl", inner="adam")
    with pytest.warns(UserWarning, match="DP state|not restored"):
        opt.load_state_dict(old)
    assert len(opt.original_optimizer.state) == 4 and opt._releases == 0


def test_loader_resumes_the_pass(tmp_path):
    ledger = dpcore.PrivacyLedger(tmp_path / "l.jsonl")

    def loader():
        return DPDataLoader(dataset(), BS / N, ledger=ledger, seed=5)

    whole = loader()
    want = []
    for _ in range(2):
        for _batch in whole:
            want.append(whole.last_indices.tolist())
    part = loader()
    got = []
    for j, _batch in enumerate(part):
        got.append(part.last_indices.tolist())
        if j == 1:
            break
    state = part.state_dict()
    assert state["pass_position"] == 2 and state["samples_drawn"] == 2
    resumed = loader()
    resumed.load_state_dict(state)
    first = [resumed.last_indices.tolist() for _ in resumed]
    assert len(first) == 3  # the rest of the pass
    second = [resumed.last_indices.tolist() for _ in resumed]
    assert len(second) == 5  # then full passes
    assert got + first + second == want


# -- SIGKILL -----------------------------------------------------------------------------------

WORKER = os.path.join(os.path.dirname(__file__), "ckpt_worker.py")


def _lines(path, prefix):
    try:
        with open(path) as f:
            return [ln for ln in f.read().splitlines() if ln.startswith(prefix)]
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("when", ["random", "after_release"])
def test_sigkill_and_resume(tmp_path, when):
    rng = random.Random(2024 if when == "random" else 7)
    k = rng.randint(3, 8)
    total = 14
    d = str(tmp_path)
    progress = os.path.join(d, "progress")
    args = [sys.executable, WORKER, "train", d, str(total)] + ([str(k + 1)] if when == "after_release" else [])
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    try:
        while True:
            if when == "random" and len(_lines(progress, "applied")) >= k:
                time.sleep(rng.uniform(0, 0.02))  # somewhere in a later step
                break
            if when == "after_release" and _lines(progress, "released"):
                break  # recorded and applied, not yet checkpointed
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the worker made no progress"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL  # it was killed, not finished

    applied = len(_lines(progress, "applied"))  # steps known applied (each also checkpointed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at_kill = dpcore.PrivacyLedger.load(os.path.join(d, "ledger.jsonl"))  # LedgerError if corrupted
    torn = [w for w in caught if "torn" in str(w.message)]
    assert bool(torn) == (at_kill.torn_tail is not None)
    ck = torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)  # never torn: os.replace
    ck_steps = int(ck["model"]["applied"])
    assert ck["optimizer"]["dpcore"]["releases"] == ck_steps
    assert applied <= ck_steps <= applied + 1
    releases_at_kill = at_kill.num_releases
    assert releases_at_kill >= ck_steps  # no applied update without its release in the ledger
    assert releases_at_kill <= ck_steps + 1
    if when == "after_release":
        assert ck_steps == k and releases_at_kill == k + 1

    out = subprocess.run([sys.executable, WORKER, "resume", d, str(total)], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    with open(os.path.join(d, "result.json")) as f:
        r = json.load(f)
    assert r["ckpt_steps"] == ck_steps and r["ckpt_releases"] == ck_steps
    assert r["ahead"] == releases_at_kill - ck_steps
    if r["ahead"]:
        assert r["refused_without_keep"] is True
    assert r["ledger_at_start"] == releases_at_kill
    assert r["releases_after_load"] == ck_steps  # the resumed optimizer continues from the checkpoint
    assert r["final_applied"] == total == ck_steps + r["resumed_steps"]  # none lost, none applied twice
    final = dpcore.PrivacyLedger.load(os.path.join(d, "ledger.jsonl"))
    assert final.num_releases == r["final_ledger"] == releases_at_kill + r["resumed_steps"]


# -- shuffled batches --------------------------------------------------------------------------


def test_shuffled_batches(tmp_path):
    n, steps = 30, 8  # batches of 8, 8, 8 and 6 per epoch
    torch.manual_seed(0)
    m = mlp()
    start = params(m)
    loader_in = DataLoader(dataset(n), batch_size=BS, shuffle=True)
    model, opt, loader = make_private(m, torch.optim.SGD(m.parameters(), lr=0.2), loader_in, noise_multiplier=0.8,
                                      max_grad_norm=1.0, ledger=str(tmp_path / "s.jsonl"), sampler="shuffle")
    assert opt.expected_batch_size == BS and opt._groups[0].plan().denominator == BS
    sizes = []
    for _ in range(2):
        for x, y in loader:
            sizes.append(len(x))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert sizes == [8, 8, 8, 6] * 2  # the short last batch too
    assert any(not torch.equal(a, b) for a, b in zip(params(model), start))
    samples = opt.ledger.samples
    assert len(samples) == steps and opt.ledger.num_releases == steps
    assert {s.policy for s in samples} == {"shuffle"} and all(s.population_size == n for s in samples)
    with pytest.warns(LedgerWarning, match="shuffle"):
        eps_shuffle = opt.get_epsilon(DELTA)
    report = opt.ledger.report(DELTA)
    assert any("shuffle" in w and "amplification" in w for w in report.warnings)
    assert report.epsilon == eps_shuffle

    torch.manual_seed(0)
    m = mlp()
    model, popt, ploader = make_private(m, torch.optim.SGD(m.parameters(), lr=0.2), DataLoader(dataset(n), batch_size=BS),
                                        noise_multiplier=0.8, max_grad_norm=1.0, ledger=str(tmp_path / "p.jsonl"))
    train(model, popt, ploader, steps)
    eps_poisson = popt.get_epsilon(DELTA)
    assert 0 < eps_poisson < eps_shuffle < float("inf")


def test_shuffled_loader_checkpoint(tmp_path):
    n = 30
    path = tmp_path / "s.jsonl"
    torch.manual_seed(0)
    m = mlp()
    model, opt, loader = make_private(m, torch.optim.SGD(m.parameters(), lr=0.2),
                                      DataLoader(dataset(n), batch_size=BS, shuffle=True), noise_multiplier=0.8,
                                      max_grad_norm=1.0, ledger=str(path), sampler="shuffle")
    train(model, opt, loader, 5)  # one epoch of 4 batches, then one batch
    ck = checkpoint(model, opt, tmp_path / "ckpt.pt")
    assert ck["optimizer"]["dpcore"]["data_loader"]["pass_position"] == 1
    opt.ledger.close()
    torch.manual_seed(0)
    m = mlp()
    m.load_state_dict(ck["model"])
    model, opt, loader = make_private(m, torch.optim.SGD(m.parameters(), lr=0.2),
                                      DataLoader(dataset(n), batch_size=BS, shuffle=True), noise_multiplier=0.8,
                                      max_grad_norm=1.0, ledger=str(path), sampler="shuffle")
    opt.load_state_dict(ck["optimizer"])
    assert loader.samples_drawn == 5 and opt._releases == 5
    for epoch, want in enumerate([3, 4]):  # the rest of the epoch, then a full one
        k = 0
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            k += 1
        assert k == want
    assert opt.ledger.num_releases == 12 and loader.samples_drawn == 12


def test_default_ledger_path_is_logged_once(tmp_path, caplog):
    """Without ledger=, the run's ledger is a temporary file: one INFO line on the ``dpcore``
    logger says where (and it is optimizer.ledger.path)."""
    import logging

    torch.manual_seed(0)
    model = mlp()
    with caplog.at_level(logging.INFO, logger="dpcore"):
        model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(dataset(), batch_size=BS), noise_multiplier=1.0, max_grad_norm=1.0)
    lines = [r for r in caplog.records if r.name == "dpcore" and "ledger" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert str(opt.ledger.path) in lines[0].getMessage() and "ledger=" in lines[0].getMessage()
    opt.ledger.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dpcore"):
        _, opt2, _ = build(tmp_path / "given.jsonl")
    assert not [r for r in caplog.records if r.name == "dpcore" and "ledger" in r.getMessage()]
    opt2.ledger.close()
