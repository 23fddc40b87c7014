"""Sharded DP-SGD under FSDP2 (``torch.distributed.fsdp.fully_shard``): two gloo ranks on CPU.

Each test starts two ranks of tests/fsdp_worker.py as torchrun would and compares what they
saved with a one-process run of the same model on the union of the ranks' samples.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

from dpcore.torch import DPOptimizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker  # noqa: E402
from test_torch_distributed import _ok, load  # noqa: E402
import test_torch_distributed as _td  # noqa: E402

WORKER = str(Path(__file__).parent / "fsdp_worker.py")


def launch(scenario: str, out: Path, **opts: object) -> list:
    old = _td.WORKER
    _td.WORKER = WORKER
    try:
        return _td.launch(scenario, out, **opts)
    finally:
        _td.WORKER = old


def one_process(
    indices: list, *, clip: float, batch: int, lr: float, optim: str = "sgd", adaptive: bool = False, kind: str = "net"
) -> list:
    net = fsdp_worker.model(0, kind=kind)
    ds = fsdp_worker.dataset()
    q = batch / fsdp_worker.N
    kw: dict = dict(noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=q * fsdp_worker.N)
    if adaptive:
        kw = dict(query=fsdp_worker.adaptive_query(clip, 0.0, batch, fsdp_worker.N))
    inner = (torch.optim.Adam if optim == "adam" else torch.optim.SGD)(net.parameters(), lr=lr)
    opt = DPOptimizer(inner, model=net, **kw)
    for idx in indices:
        x, y = ds.tensors[0][torch.from_numpy(idx)], ds.tensors[1][torch.from_numpy(idx)]
        opt.zero_grad()
        if len(x):
            torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.ledger.record_sample(fsdp_worker.N, q, "poisson", seeded=True)
        opt.step()
    return [p.detach() for p in net.parameters()]


def _union(r0: dict, r1: dict) -> list:
    assert len(r0["indices"]) == len(r1["indices"]) > 0
    out = []
    for i0, i1 in zip(r0["indices"], r1["indices"]):
        assert np.all(i0 % 2 == 0) and np.all(i1 % 2 == 1)
        out.append(np.sort(np.concatenate([i0, i1])))
    return out


@pytest.mark.parametrize("optim,physical", [("sgd", None), ("adam", 7)])
def test_two_sharded_ranks_train_like_one_process(tmp_path: Path, optim: str, physical) -> None:
    """Noise 0: the sharded run (reduce-scatter of the clipped sums, each rank updating its own
    rows) ends where one process does on the union of the ranks' samples; with Adam (state in
    shards) and with micro-batches of at most 7 records per rank."""
    opts = dict(seed=3, steps=4, optim=optim, lr=0.05)
    if physical:
        opts["physical"] = physical
    _ok(launch("train", tmp_path, **opts), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    ref = one_process(_union(r0, r1), clip=0.5, batch=48, lr=0.05, optim=optim)
    start = [p.detach() for p in fsdp_worker.model(0).parameters()]
    for a, b, s in zip(r0["params"], ref, start):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, s) for a, s in zip(r0["params"], start))  # training moved them
    assert r0["releases"] == r1["releases"] == 4
    assert not r0["replica"] and r1["replica"]
    if physical:
        # between micro-batches each rank holds its rows of the sums only, never full-size ones
        for r in (r0, r1):
            assert 0 < r["held_numel"] <= r["local_numel"]


def test_a_sharded_transformer_layer_trains_like_one_process(tmp_path: Path) -> None:
    """Attention (packed in-projection, out-projection), LayerNorms and the feed-forward of a
    TransformerEncoderLayer, sharded as one FSDP2 unit."""
    _ok(launch("train", tmp_path, seed=7, steps=3, model="encoder", lr=0.05), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    ref = one_process(_union(r0, r1), clip=0.5, batch=48, lr=0.05, kind="encoder")
    start = [p.detach() for p in fsdp_worker.model(0, kind="encoder").parameters()]
    for a, b, s in zip(r0["params"], ref, start):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, s) for a, s in zip(r0["params"], start))


@pytest.mark.parametrize("reduction,physical", [("mean", None), ("sum", 5)])
def test_empty_batches_on_one_or_both_ranks(tmp_path: Path, reduction: str, physical) -> None:
    """An embedding, a Conv1d and a GroupNorm sharded; rank 0's batch empty at steps 1 and 3,
    rank 1's at step 3 (no record at all). Every rank runs forward and backward on its empty
    batch (FSDP2 gathers the weights together) and steps; every step is released and recorded
    once, the ranks agree, and the run ends where one process does on the union of the samples
    (also with micro-batches of at most 5 records, reduce-scattered at every one)."""
    opts: dict = dict(seed=3, steps=5, model="conv", lr=0.05, reduction=reduction, empty0="1,3", empty1="3")
    if physical:
        opts["physical"] = physical
    _ok(launch("train", tmp_path, **opts), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    assert r0["errors"] is None and r1["errors"] is None
    assert r0["completed"] == r1["completed"] == 5
    assert r0["releases"] == r1["releases"] == 5 and r0["epsilon"] == r1["epsilon"]
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    union = _union(r0, r1)
    assert len(r0["indices"][1]) == len(r0["indices"][3]) == len(union[3]) == 0 < len(r1["indices"][1])
    ref = one_process(union, clip=0.5, batch=48, lr=0.05, kind="conv")
    start = [p.detach() for p in fsdp_worker.model(0, kind="conv").parameters()]
    for a, b, s in zip(r0["params"], ref, start):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, s) for a, s in zip(r0["params"], start))


def test_adaptive_clipping_is_shared_by_the_shards(tmp_path: Path) -> None:
    _ok(launch("train", tmp_path, seed=5, steps=5, adaptive=1, lr=0.05), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    assert r0["clips"] == r1["clips"] and len(set(r0["clips"])) > 1
    ref = one_process(_union(r0, r1), clip=0.5, batch=48, lr=0.05, adaptive=True)
    for a, b in zip(r0["params"], ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("physical", [None, 5])
def test_each_coordinate_gets_the_noise_once(tmp_path: Path, physical) -> None:
    """Zero loss: each released gradient is the noise alone, N(0, (σC/(qN))²) per coordinate:
    not √2 larger (two ranks noising a row), not missing on some rows (padding, uneven shards:
    fc1 has 301 rows on 2 ranks), the same full tensor seen from both ranks; with micro-batches
    of at most 5 records (sums reduce-scattered at every one), still noised once per release."""
    opts = dict(noise=1.3, clip=2.0, steps=4, width=301)
    if physical:
        opts["physical"] = physical
    _ok(launch("noise", tmp_path, **opts), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    g0 = torch.cat([g.reshape(-1) for step in r0["grads"] for g in step]).double()
    g1 = torch.cat([g.reshape(-1) for step in r1["grads"] for g in step]).double()
    assert torch.equal(g0, g1)
    want = r0["noise_std"]
    n = g0.numel()
    assert n > 20000
    # the sample std of n normals is within 5/sqrt(2n) of the truth (5 sigma)
    assert abs(g0.std().item() / want - 1) < 5 / (2 * n) ** 0.5
    assert abs(g0.mean().item()) < 5 * want / n**0.5
    # every row of every parameter was noised: no coordinate is exactly 0 (padding or a missed shard)
    assert int((g0 == 0).sum()) == 0
    # rows held by rank 0 and by rank 1 are independent (not one stream reused)
    w = r0["grads"][0][3]  # fc1.weight, (301, 12): rows 0..150 on rank 0, 151..300 on rank 1
    assert w.shape == (301, 12)
    a, b = w[:150].reshape(-1).double(), w[151:301].reshape(-1).double()
    c = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(c) < 5 / a.numel() ** 0.5
    assert r0["releases"] == 4 and r0["epsilon"] < float("inf")


def test_parameters_and_optimizer_state_are_sharded(tmp_path: Path) -> None:
    """Per-rank parameter and Adam state memory is about 1/W of the model's."""
    _ok(launch("train", tmp_path, seed=1, steps=2, optim="adam", width=301), tmp_path)
    for r in (0, 1):
        d = load(tmp_path, r)
        assert d["local_numel"] <= d["full_numel"] / 2 + 301  # at most one extra row per parameter
        assert d["local_numel"] >= d["full_numel"] / 2 - 301
        assert d["state_local_numel"] == 2 * d["local_numel"]  # exp_avg and exp_avg_sq, shard-shaped
    assert load(tmp_path, 0)["local_numel"] + load(tmp_path, 1)["local_numel"] == load(tmp_path, 0)["full_numel"]


def test_bf16_mixed_precision_policy(tmp_path: Path) -> None:
    """FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16): layers compute in bfloat16 from the
    gathered bf16 weights; the clipped sums, noise and shards stay float32. Close to the float32
    one-process run at bfloat16 precision, and the ranks agree exactly."""
    _ok(launch("train", tmp_path, seed=3, steps=3, mp="bf16", lr=0.05), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b) and a.dtype == torch.float32
    ref = one_process(_union(r0, r1), clip=0.5, batch=48, lr=0.05)
    start = [p.detach() for p in fsdp_worker.model(0).parameters()]
    for a, b, s in zip(r0["params"], ref, start):
        # the update moved by ≤ 3·lr·(bf16 relative error) of itself; the weights close to ref
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    assert any(not torch.allclose(a, s) for a, s in zip(r0["params"], start))


@pytest.mark.parametrize("physical", [None, 5])
def test_a_bad_record_on_one_rank_fails_every_rank(tmp_path: Path, physical) -> None:
    """With on_nonfinite="raise" (a debugging aid); also in a micro-batch that does not release
    (its sums are reduce-scattered at once)."""
    opts = dict(seed=2, steps=4, nan_at=1, on_nonfinite="raise")
    if physical:
        opts["physical"] = physical
    codes = launch("train", tmp_path, **opts)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    assert r1["errors"] and "record 0" in r1["errors"]
    assert r0["errors"] and "DistributedError" in r0["errors"]
    assert r0["completed"] == r1["completed"] == 1
    assert r0["releases"] == 1  # the failed step recorded nothing
    assert codes == [0, 0]


@pytest.mark.parametrize("physical", [None, 5])
def test_a_bad_record_on_one_rank_contributes_zero_by_default(tmp_path: Path, physical) -> None:
    opts = dict(seed=2, steps=4, nan_at=1, noise=0.5)
    if physical:
        opts["physical"] = physical
    codes = launch("train", tmp_path, **opts)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    assert not r0["errors"] and not r1["errors"], (r0["errors"], r1["errors"])
    assert r0["completed"] == r1["completed"] == 4 and r0["releases"] == 4
    assert codes == [0, 0]


def test_a_dead_rank_stops_the_other_and_the_ledger_holds_the_releases(tmp_path: Path) -> None:
    codes = launch("train", tmp_path, seed=4, steps=5, die_after=2, timeout=20)
    assert codes[1] == 3
    from dpcore import PrivacyLedger

    # the survivor stopped (FSDP2's all-gather or dpcore's collective failed) instead of hanging;
    # the ledger holds exactly the two releases applied
    assert PrivacyLedger.load(str(tmp_path / "ledger.jsonl")).num_releases == 2


@pytest.mark.parametrize("physical", [None, 5])
def test_greybox_neighbour_harness_passes_on_every_rank(tmp_path: Path, physical) -> None:
    """The grey-box neighbour harness (FSDP2, 2 ranks on gloo): on D and on seven neighbours
    with identical randomness, every rank's releases, ledger entries and denominators agree and
    the two pre-noise sums (summed over the ranks) differ by at most the declared sensitivity."""
    from greybox_cases import check_ranks

    check_ranks(launch, load, tmp_path, physical)
