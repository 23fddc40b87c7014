"""Data-parallel DP-SGD on torch.distributed: two gloo ranks on CPU against one process.

Each test starts two ranks of tests/dist_worker.py as torchrun would (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment) and compares what they saved.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dpcore  # noqa: E402
from dpcore.torch import DPOptimizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402

WORKER = str(Path(__file__).parent / "dist_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, out: Path, world: int = 2, timeout: float = 240, **opts: object) -> list:
    """Runs ``world`` ranks to the end; returns their exit codes (stderr kept in out/log{r})."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(out / f"log{r}", "w")
        args = [sys.executable, WORKER, scenario, str(out)] + [f"{k}={v}" for k, v in opts.items()]
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"ranks did not finish in {timeout} s: " + (out / "log0").read_text()[-2000:])
    return codes


def load(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def _ok(codes: list, out: Path) -> None:
    for r, c in enumerate(codes):
        assert c == 0, f"rank {r} exited with {c}: " + (out / f"log{r}").read_text()[-3000:]


def single_process(
    indices: list, *, clip: float, batch: int, lr: float = 0.5, adaptive: bool = False, kind: str = "mlp"
) -> list:
    """The same training in one process, on the union of the ranks' samples at each step."""
    net = dist_worker.model(100, kind)  # rank 0's initial weights
    ds = dist_worker.dataset()
    q = batch / dist_worker.N
    kw: dict = {}
    if adaptive:
        kw["query"] = dist_worker.adaptive_query(clip, 0.0, batch, dist_worker.N)
    else:
        kw.update(noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=q * dist_worker.N)
    opt = DPOptimizer(torch.optim.SGD(net.parameters(), lr=lr), model=net, **kw)
    for idx in indices:
        x, y = ds.tensors[0][torch.from_numpy(idx)], ds.tensors[1][torch.from_numpy(idx)]
        opt.zero_grad()
        if len(x):
            torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.ledger.record_sample(dist_worker.N, q, "poisson", seeded=True)
        opt.step()
    return [p.detach() for p in net.parameters()]


def _check_matches_one_process(out: Path, *, batch: int = 48, adaptive: bool = False, kind: str = "mlp") -> None:
    r0, r1 = load(out, 0), load(out, 1)
    # the ranks' parameters are bit-identical
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    # each rank sampled only its shard; together, one sample per step
    steps = len(r0["indices"])
    assert steps == len(r1["indices"]) > 0
    union = []
    for i0, i1 in zip(r0["indices"], r1["indices"]):
        assert np.all(i0 % 2 == 0) and np.all(i1 % 2 == 1)
        assert len(np.unique(i0)) == len(i0) and len(np.unique(i1)) == len(i1)
        union.append(np.sort(np.concatenate([i0, i1])))
    assert [len(u) for u in union] == [a + b for a, b in zip(r0["sizes"], r1["sizes"])]
    ref = single_process(union, clip=0.5, batch=batch, adaptive=adaptive, kind=kind)
    for a, b in zip(r0["params"], ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and training moved them: the comparison is not between two untouched models
    assert any(not torch.allclose(a, b) for a, b in zip(r0["params"], r0["before"]))
    if adaptive:
        assert r0["clips"] == r1["clips"] and len(set(r0["clips"])) > 1


@pytest.mark.parametrize("ddp", ["0", "1"])
def test_two_ranks_train_like_one_process(tmp_path: Path, ddp: str) -> None:
    _ok(launch("train", tmp_path, seed=11, steps=5, ddp=ddp), tmp_path)
    _check_matches_one_process(tmp_path)
    assert load(tmp_path, 0)["releases"] == load(tmp_path, 1)["releases"] == 5


@pytest.mark.parametrize("ddp", ["0", "1"])
def test_lean_memory_on_two_ranks_trains_like_one_process(tmp_path: Path, ddp: str) -> None:
    """memory="lean" (two backward passes per micro-batch) under data parallelism, plain or in
    DistributedDataParallel, with micro-batches and adaptive clipping: the same updates as one process."""
    _ok(launch("train", tmp_path, seed=5, steps=4, physical=5, adaptive=1, memory="lean", ddp=ddp), tmp_path)
    _check_matches_one_process(tmp_path, adaptive=True)


def test_two_ranks_virtual_batches_and_adaptive_clipping(tmp_path: Path) -> None:
    """Micro-batches of at most 5 records (ranks step different numbers of times per logical
    batch) and adaptive clipping, whose count is summed over the ranks."""
    _ok(launch("train", tmp_path, seed=5, steps=6, physical=5, adaptive=1), tmp_path)
    _check_matches_one_process(tmp_path, adaptive=True)


@pytest.mark.parametrize("reduction,extra", [("mean", {}), ("sum", {"physical": 5, "adaptive": 1})])
def test_empty_batches_on_one_or_both_ranks(tmp_path: Path, reduction: str, extra: dict) -> None:
    """A convolution and a GroupNorm, the common loop (forward and backward also on an empty
    batch), rank 0's batch empty at steps 1 and 3, rank 1's at step 3 (no record at all): every
    rank steps at every step, every step is released and recorded once, the ranks agree, and
    the run ends where one process does on the union of the samples (with micro-batches of at
    most 5 records and adaptive clipping, whose count is summed over the ranks, too)."""
    opts = dict(seed=11, steps=5, model="conv", always_backward=1, reduction=reduction, empty0="1,3", empty1="3", **extra)
    _ok(launch("train", tmp_path, **opts), tmp_path)
    _check_matches_one_process(tmp_path, adaptive=bool(extra), kind="conv")
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    assert r0["errors"] is None and r1["errors"] is None
    assert r0["completed"] == r1["completed"] == 5
    assert r0["releases"] == r1["releases"] == 5
    assert r0["epsilon"] == r1["epsilon"]
    assert r0["sizes"][1] == r0["sizes"][3] == r1["sizes"][3] == 0 and r1["sizes"][1] > 0


def test_noise_is_added_once_with_the_single_process_stddev(tmp_path: Path) -> None:
    """Zero loss: the update is the noise alone, N(0, (σC/(qN))²) per coordinate, the same on
    both ranks: not √2 times larger (each rank adding noise), not √2 smaller (shares)."""
    _ok(launch("noise", tmp_path, noise=1.3, clip=2.0, steps=1), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    u0 = torch.cat([u.reshape(-1) for u in r0["updates"]]).double()
    u1 = torch.cat([u.reshape(-1) for u in r1["updates"]]).double()
    assert torch.equal(u0, u1)
    want = r0["noise_std"]  # lr = 1
    assert u0.numel() > 20000
    assert abs(u0.std().item() / want - 1) < 0.05
    assert abs(u0.mean().item()) < 5 * want / u0.numel() ** 0.5


def test_dead_rank_fails_the_step_and_the_ledger_holds_the_released_steps(tmp_path: Path) -> None:
    codes = launch("train", tmp_path, steps=8, die_after=3, timeout=30, seed=3)
    assert codes[1] == 3, (tmp_path / "log1").read_text()[-2000:]
    assert codes[0] == 0, (tmp_path / "log0").read_text()[-3000:]
    r0 = load(tmp_path, 0)
    assert r0["errors"] is not None and "DistributedError" in r0["errors"]
    assert r0["error_after_s"] < 60
    assert r0["completed"] == 3
    led = dpcore.PrivacyLedger.load(tmp_path / "ledger.jsonl")
    assert led.num_releases == 3
    assert all(len(s.queries) == 1 for s in led.samples)


@pytest.mark.parametrize("adaptive", ["0", "1"])
def test_bad_record_on_one_rank_fails_every_rank_at_once(tmp_path: Path, adaptive: str) -> None:
    """With on_nonfinite="raise" (a debugging aid), a non-finite gradient on rank 1 raises there
    (a ValueError naming it); rank 0 learns of it in the same step (in the all-reduce, or with
    adaptive clipping in the gathered norm states) instead of waiting for the timeout, and
    nothing of that step is recorded."""
    codes = launch("train", tmp_path, steps=6, nan_at=2, timeout=60, seed=4, adaptive=adaptive, on_nonfinite="raise")
    _ok(codes, tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    assert r1["errors"].startswith("ValueError") and "finite" in r1["errors"]
    assert r0["errors"].startswith("DistributedError") and "failed" in r0["errors"]
    assert r0["error_after_s"] < 30
    assert r0["completed"] == r1["completed"] == 2
    assert dpcore.PrivacyLedger.load(tmp_path / "ledger.jsonl").num_releases == 2


@pytest.mark.parametrize("adaptive", ["0", "1"])
def test_bad_record_on_one_rank_contributes_zero_by_default(tmp_path: Path, adaptive: str) -> None:
    """The default (on_nonfinite="zero"): the NaN record on rank 1 contributes nothing, every
    step releases on both ranks, and the ranks stay identical and finite."""
    noise = 0.0 if adaptive == "1" else 0.5  # (the adaptive query's count noise is set for z = 0)
    _ok(launch("train", tmp_path, steps=4, nan_at=2, timeout=60, seed=4, adaptive=adaptive, noise=noise), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    assert r0["errors"] is None and r1["errors"] is None
    assert r0["completed"] == r1["completed"] == 4
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    assert dpcore.PrivacyLedger.load(tmp_path / "ledger.jsonl").num_releases == 4


def test_only_rank_zero_writes_the_ledger_and_a_restart_continues_it(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "ledger.jsonl"
    path.parent.mkdir()
    _ok(launch("train", tmp_path, steps=4, noise=1.0, ledger=str(path)), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    assert not r0["replica"] and r1["replica"] and r0["ledger_path"] == str(path)
    assert str(path) in r1["ledger_path"] and r1["ledger_path"] != str(path)
    led = dpcore.PrivacyLedger.load(path)
    assert led.num_releases == 4 and len(led.samples) == 4
    assert [s.population_size for s in led.samples] == [dist_worker.N] * 4
    assert all(s.sampling_probability == pytest.approx(48 / dist_worker.N) for s in led.samples)
    assert r0["epsilon"] == pytest.approx(led.get_epsilon(1e-5), rel=1e-12)
    assert r1["epsilon"] == r0["epsilon"]  # the replica answers on rank 1
    assert sorted(os.listdir(path.parent)) == ["ledger.jsonl"]
    # a second run (a restart) continues the same ledger on both ranks
    _ok(launch("train", tmp_path, steps=3, noise=1.0, ledger=str(path)), tmp_path)
    r0b, r1b = load(tmp_path, 0), load(tmp_path, 1)
    led = dpcore.PrivacyLedger.load(path)
    assert led.num_releases == 7
    assert r0b["epsilon"] == pytest.approx(led.get_epsilon(1e-5), rel=1e-12) == r1b["epsilon"]
    assert r0b["epsilon"] > r0["epsilon"]


def test_torchrun_launch(tmp_path: Path) -> None:
    """The documented launch line (docs/distributed.md): torchrun --standalone --nproc-per-node 2."""
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), WORKER, "train", str(tmp_path), "steps=3", "seed=2"]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_matches_one_process(tmp_path)


@pytest.mark.parametrize("physical", [None, 5])
def test_greybox_neighbour_harness_passes_on_every_rank(tmp_path: Path, physical) -> None:
    """The grey-box neighbour harness (data-parallel, 2 ranks on gloo): on D and on seven neighbours
    with identical randomness, every rank's releases, ledger entries and denominators agree and
    the two pre-noise sums (summed over the ranks) differ by at most the declared sensitivity."""
    from greybox_cases import check_ranks

    check_ranks(launch, load, tmp_path, physical)
