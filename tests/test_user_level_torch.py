"""The privacy unit "user" in dpcore.torch (issue 40): per-user clipping of the mean of a user's
example gradients, without per-example gradients, exact against brute force.

At noise 0 with every user sampled and examples_per_user at least every user's count, the
release is Σ_u clip(mean of u's example gradients, C) / denominator. The brute force takes each
example's gradient by its own backward pass, averages each user's, clips it, and sums.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dpcore  # noqa: E402
from dpcore.torch import DPOptimizer, FallbackWarning, make_private  # noqa: E402
from test_cuda import FAMILIES, N, Y  # noqa: E402  (the 13 layer families; CPU tensors)


def _ledger(unit="user"):
    return dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(prefix="dpcore-user-"), "l.jsonl"), privacy_unit=unit)


def ce(out, y):
    return nn.functional.cross_entropy(out.float(), y, reduction="sum")


def _loss(x):
    def loss_of(m, i):
        return ce(m(x[i]), Y[i])

    return loss_of


def user_brute_force(model, loss_of, users, clip=None):
    """(clip, Σ_u clip(mean_u) per parameter in float64, user norms): one backward pass per example."""
    m = copy.deepcopy(model)
    params = [p for p in m.parameters() if p.requires_grad]
    per = {}
    for u in users:
        for i in u:
            for p in params:
                p.grad = None
            loss_of(m, [i]).backward()
            per[i] = [torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.detach().double() for p in params]
    means = [[sum(per[i][k] for i in u) / len(u) for k in range(len(params))] for u in users]
    norms = torch.tensor([math.sqrt(sum(float((g**2).sum()) for g in gs)) for gs in means])
    if clip is None:
        clip = float(norms.median())
    out = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for gs, nm in zip(means, norms):
        c = min(1.0, clip / float(nm)) if nm > 0 else 1.0
        for o, g in zip(out, gs):
            o += c * g
    return clip, out, norms


class _Users:
    """The loader protocol's one member the optimizer reads for users: the batch's counts."""

    def __init__(self, counts):
        self.record_groups = np.asarray(counts)


def user_release(model, loss_of, order, counts, clip, den, **kw):
    m = copy.deepcopy(model)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), model=m, noise_multiplier=0.0, max_grad_norm=clip,
                      expected_batch_size=den, ledger=_ledger(), loss_reduction="sum", data_loader=_Users(counts), **kw)
    opt.ledger.record_sample(100, 0.1, examples_per_user=max(counts))
    loss_of(m, order).backward()
    opt.step()
    got = [p.grad for p in params]
    names = [nm for nm, p in m.named_parameters() if p.requires_grad]
    opt.engine.remove()
    return got, names


# users of the N = 6 examples: uneven (1, 2 and 3 examples, not in dataset order) and even
GROUPINGS = {
    "uneven": [[0, 3], [5], [2, 4, 1]],
    "even": [[1, 0], [2, 5], [4, 3]],
}


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_user_release_equals_brute_force(family, grouping):
    make, x = FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    users = GROUPINGS[grouping]
    loss_of = _loss(x)
    clip, ref, norms = user_brute_force(model, loss_of, users)
    assert min(norms) < clip < max(norms) or family == "generic"
    order = [i for u in users for i in u]
    with warnings.catch_warnings():
        if family != "generic":
            warnings.simplefilter("error", FallbackWarning)
        got, names = user_release(model, loss_of, order, [len(u) for u in users], clip, 7.0)
    scale = max(float(r.abs().max()) for r in ref) / 7.0
    for name, g, r in zip(names, got, ref):
        assert g is not None, name
        np.testing.assert_allclose(g.double().numpy(), (r / 7.0).numpy(), rtol=2e-4, atol=2e-4 * scale, err_msg=name)


def test_user_norm_is_of_the_mean_not_of_each_example():
    # two examples whose gradients cancel: the user's mean gradient is 0, so clipping to a tiny
    # C keeps it 0, where per-example clipping would not
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])

    def loss_of(m, i):
        return m(x[i]).sum()

    got, _ = user_release(lin, loss_of, [0, 1, 2], [2, 1], 1e-3, 1.0)
    np.testing.assert_allclose(got[0].numpy(), [[0.0, 1e-3]], rtol=1e-5, atol=1e-12)


def test_counts_that_do_not_match_the_batch_are_refused():
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    m = copy.deepcopy(lin)
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), model=m, noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=2.0, ledger=_ledger(), data_loader=_Users([2, 1]))
    m(x).sum().backward()
    with pytest.raises(ValueError, match="counts sum to 3"):
        opt.step()
    assert opt.ledger.num_releases == 0


def test_nonfinite_example_zeroes_its_whole_user():
    lin = nn.Linear(2, 1)
    x = torch.tensor([[1.0, 2.0], [float("nan"), 1.0], [0.5, 0.5], [1.0, -1.0]])
    order, counts = [0, 1, 2, 3], [2, 2]
    got, _ = user_release(lin, lambda m, i: m(x[i]).sum(), order, counts, 100.0, 1.0)
    # the first user (examples 0 and 1) adds nothing; the second adds its mean gradient
    want_w = (x[2] + x[3]) / 2
    np.testing.assert_allclose(got[0].numpy()[0], want_w.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got[1].numpy(), [1.0], rtol=1e-6)


# ----------------------------------------------------------------------------- make_private


IDS = np.array(["ann", "bob", "bob", "cat", "cat", "cat", "dan", "eve", "eve", "eve", "eve"])


def _data(n=len(IDS), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _private(batch_size, **kw):
    ds = _data()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch_size)
    kw.setdefault("ledger", _ledger())
    return ds, model, *make_private(model, opt, dl, noise_multiplier=0.0, max_grad_norm=0.5, seed=3,
                                    privacy_unit="user", user_ids=IDS, **kw)


def _one_release(model, opt, loader, ds):
    """Runs the logical batch of one sample; returns (the examples of each user in it, grads)."""
    users = []
    for x, y in loader:
        idx, counts = loader.last_indices, loader.record_groups
        assert len(idx) == int(counts.sum()) == len(x)
        starts = np.concatenate([[0], np.cumsum(counts)])
        users += [list(idx[a:b]) for a, b in zip(starts[:-1], starts[1:])]
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if opt.last_step_released:
            return users, [p.grad.clone() for p in model.parameters()]
    raise AssertionError("no release")


@pytest.mark.parametrize("micro", [None, 4])
def test_make_private_user_level_sampling_equals_brute_force(micro):
    ds, model0, model, opt, loader = _private(5, examples_per_user=3, max_physical_batch_size=micro)
    assert loader.sampling_probability == 1.0 and loader.expected_batch_size == 5.0  # 5 users, all sampled
    users, got = _one_release(model, opt, loader, ds)
    assert sorted({IDS[u[0]] for u in users}) == ["ann", "bob", "cat", "dan", "eve"]
    for u in users:
        assert len(u) == min(3, int((IDS == IDS[u[0]]).sum())) and len(set(IDS[u])) == 1
    x, y = ds.tensors

    def loss_of(m, i):
        return nn.functional.cross_entropy(m(x[i]), y[i], reduction="sum")

    _, ref, _ = user_brute_force(_mlp(), loss_of, users, clip=0.5)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.double().numpy(), (r / 5.0).numpy(), rtol=2e-5, atol=1e-7)
    led = opt.ledger
    assert led.privacy_unit == "user" and led.num_releases == 1
    s = led.samples[-1]
    assert s.population_size == 5 and s.sampling_probability == 1.0


def test_micro_batches_never_split_a_user():
    ds, _, model, opt, loader = _private(5, examples_per_user=4, max_physical_batch_size=4)
    seen = []
    for x, y in loader:
        counts, idx = loader.record_groups, loader.last_indices
        assert len(x) <= 4
        starts = np.concatenate([[0], np.cumsum(counts)])
        seen += [tuple(sorted(set(IDS[idx[a:b]]))) for a, b in zip(starts[:-1], starts[1:])]
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if opt.last_step_released:
            break
    assert all(len(s) == 1 for s in seen) and len(seen) == len(set(seen)) == 5


def test_example_level_sampling_bounds_each_user():
    ds, _, model, opt, loader = _private(4, max_examples_per_user=2)
    kept = loader.kept
    _, counts = np.unique(IDS[kept], return_counts=True)
    assert counts.max() <= 2 and len(kept) == 8  # min(count, 2) summed: 1 + 2 + 2 + 1 + 2
    assert loader.sampling_probability == 0.5 and loader.expected_batch_size == 4.0
    for x, y in loader:
        assert set(loader.last_indices) <= set(kept.tolist())
        assert loader.record_groups is None  # examples are clipped one by one
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        break
    assert opt.ledger.privacy_unit == "user"


@pytest.mark.parametrize("kw, err", [
    (dict(privacy_unit="user", examples_per_user=2), "needs user_ids"),
    (dict(privacy_unit="user", user_ids=IDS), "exactly one of"),
    (dict(privacy_unit="user", user_ids=IDS, examples_per_user=2, max_examples_per_user=2), "exactly one of"),
    (dict(privacy_unit="user", user_ids=IDS, examples_per_user=0), ">= 1"),
    (dict(privacy_unit="user", user_ids=IDS, examples_per_user=True), ">= 1"),
    (dict(privacy_unit="user", user_ids=IDS[:-1], examples_per_user=2), "11 examples"),
    (dict(privacy_unit="user", user_ids=np.array([1.0] * 10 + [np.nan]), examples_per_user=2), "finite"),
    (dict(privacy_unit="user", user_ids=[None] + [1] * 10, examples_per_user=2), "missing"),
    (dict(privacy_unit="example", user_ids=IDS), "need privacy_unit='user'"),
    (dict(privacy_unit="person", user_ids=IDS, examples_per_user=2), "privacy_unit must be"),
    (dict(privacy_unit="user", user_ids=IDS, examples_per_user=3, max_physical_batch_size=2), "never splits"),
    (dict(privacy_unit="user", user_ids=IDS, examples_per_user=3, sampler="shuffle"), "Poisson"),
])
def test_bad_user_arguments_fail_before_anything_is_recorded(kw, err):
    led = _ledger(kw["privacy_unit"] if kw["privacy_unit"] in ("user", "example") else "user")
    path = led.path
    model = _mlp()
    dl = torch.utils.data.DataLoader(_data(), batch_size=4)
    with pytest.raises((ValueError, TypeError), match=err):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), dl, noise_multiplier=1.0, max_grad_norm=1.0,
                     ledger=led, **kw)
    led.close()
    assert dpcore.PrivacyLedger.load(path).num_releases == 0


def test_a_ledger_of_another_unit_is_refused():
    model = _mlp()
    dl = torch.utils.data.DataLoader(_data(), batch_size=4)
    with pytest.raises(ValueError, match="privacy unit 'example'"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), dl, noise_multiplier=1.0, max_grad_norm=1.0,
                     ledger=_ledger("example"), privacy_unit="user", user_ids=IDS, examples_per_user=2)


def test_resume_with_other_user_ids_is_refused():
    ds, _, model, opt, loader = _private(5, examples_per_user=2)
    _one_release(model, opt, loader, ds)
    state = opt.state_dict()
    for other, bound in ((np.where(IDS == "ann", "zed", IDS), 2), (IDS, 3)):
        model2 = _mlp()
        _, opt2, _ = make_private(model2, torch.optim.SGD(model2.parameters(), lr=0.0),
                                  torch.utils.data.DataLoader(_data(), batch_size=5), noise_multiplier=0.0,
                                  max_grad_norm=0.5, ledger=opt.ledger, privacy_unit="user", user_ids=other,
                                  examples_per_user=bound)
        with pytest.raises(ValueError, match="other user ids|other examples_per_user"):
            opt2.load_state_dict(state)


# ----------------------------------------------------------------------------- data-parallel


def test_two_gloo_ranks_sample_users_and_release_like_one_process(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import dist_worker
    from test_torch_distributed import _ok, launch, load

    _ok(launch("train", tmp_path, seed=11, steps=3, users=4, batch=12, physical=8), tmp_path)
    r0, r1 = load(tmp_path, 0), load(tmp_path, 1)
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    ids = dist_worker.user_ids()
    users = np.unique(ids)
    number = dpcore.sampling.UserIndex(ids).user_of  # users numbered by their first example
    ds = dist_worker.dataset()
    net = dist_worker.model(100)
    q = 12 / len(users)
    opt = DPOptimizer(torch.optim.SGD(net.parameters(), lr=0.5), model=net, noise_multiplier=0.0, max_grad_norm=0.5,
                      expected_batch_size=q * len(users), ledger=_ledger(), data_loader=_Users([1]))
    g0, g1 = iter(r0["groups"]), iter(r1["groups"])
    for i0, i1 in zip(r0["indices"], r1["indices"]):
        # rank r sampled users r, r + 2, ... (of the sorted ids); each user's examples together
        parts = []
        for idx, groups, rank in ((i0, g0, 0), (i1, g1, 1)):
            counts = []
            while sum(counts) < len(idx):
                counts += list(next(groups))
            assert sum(counts) == len(idx)
            starts = np.concatenate([[0], np.cumsum(counts)])
            for a, b in zip(starts[:-1], starts[1:]):
                u = np.unique(number[idx[a:b]])
                assert len(u) == 1 and int(u[0]) % 2 == rank and b - a <= 4
            parts.append((idx, counts))
        idx = np.concatenate([p[0] for p in parts])
        opt.data_loader = _Users(parts[0][1] + parts[1][1])
        x, y = ds.tensors[0][torch.from_numpy(idx)], ds.tensors[1][torch.from_numpy(idx)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.ledger.record_sample(len(users), q, "poisson", seeded=True, examples_per_user=4)
        opt.step()
    for a, b in zip(r0["params"], net.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, b) for a, b in zip(r0["params"], r0["before"]))


# ----------------------------------------------------------------------------- bf16, LoRA


@pytest.mark.parametrize("family", ["linear", "conv2d", "attention", "embedding", "groupnorm"])
def test_user_release_under_bf16_autocast(family):
    """4u (u = 2⁻⁸) of the largest entry, as tests/test_torch_amp.py states for examples: the
    brute force runs under the same autocast."""
    make, x = FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    users = GROUPINGS["uneven"]

    def loss_of(m, i):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x[i])
        return ce(out.float(), Y[i])

    clip, ref, norms = user_brute_force(model, loss_of, users)
    got, names = user_release(model, loss_of, [i for u in users for i in u], [len(u) for u in users], clip, 7.0)
    scale = max(float(r.abs().max()) for r in ref) / 7.0
    for name, g, r in zip(names, got, ref):
        err = float((g.double() - r / 7.0).abs().max())
        assert err <= 4 * 2.0**-8 * scale, (name, err / scale)


def test_user_release_lora_through_peft():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from test_torch_hf import gpt2, lm_loss, lora

    model = lora(gpt2(), ["c_attn"])
    users = [[4, 0], [2], [1, 3]]
    clip, ref, norms = user_brute_force(model, lm_loss, users)
    assert min(norms) < clip < max(norms)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, names = user_release(model, lm_loss, [i for u in users for i in u], [len(u) for u in users], clip, 7.0)
    assert names and all("lora" in n for n in names)
    scale = max(float(r.abs().max()) for r in ref) / 7.0
    for name, g, r in zip(names, got, ref):
        np.testing.assert_allclose(g.double().numpy(), (r / 7.0).numpy(), rtol=2e-4, atol=2e-4 * scale, err_msg=name)


# ----------------------------------------------------------------------------- grey-box


@pytest.mark.parametrize("micro,memory", [(None, "default"), (6, "default"), (None, "lean"), (6, "lean")])
def test_greybox_users_as_neighbours(micro, memory):
    """The grey-box harness with users as the neighbouring unit: the run on D and on D without
    its largest (or smallest) user release through the same control flow, ledger, denominator
    and noise, and the pre-noise sums differ by at most C."""
    from dpcore.audit import neighbour_audit, users_last

    g = torch.Generator().manual_seed(2)
    users = np.repeat(np.arange(12), [1, 2, 3, 7, 1, 2, 4, 9, 1, 1, 5, 2])
    n = len(users)
    x, y = torch.randn(n, 5, generator=g).numpy(), torch.randint(0, 3, (n,), generator=g).numpy()
    for kind in ("largest_user", "smallest_user"):
        cols = users_last((x, y, users), 2, kind)

        def train(c, seed):
            xs, ys, ids = c
            net = _mlp()
            data = torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.from_numpy(xs), torch.from_numpy(ys)), batch_size=4)
            net, opt, loader = make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), data,
                                            noise_multiplier=1.0, max_grad_norm=1.0, seed=seed, ledger=_ledger(),
                                            population_size=12, privacy_unit="user", user_ids=ids,
                                            examples_per_user=6, max_physical_batch_size=micro, memory=memory)
            loader.steps = 3
            for xb, yb in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(net(xb), yb).backward()
                opt.step()

        res = neighbour_audit(train, cols, (kind,), user_column=2)
        assert not res.findings, res.table()
        assert all(r.releases == 3 for r in res.runs)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
def test_user_release_equals_brute_force_on_cuda(family, grouping):
    dev = torch.device("cuda")
    make, x = FAMILIES[family]
    torch.manual_seed(0)
    model = make().to(dev)
    users = GROUPINGS[grouping]
    xd, yd = x.to(dev), Y.to(dev)

    def loss_of(m, i):
        return ce(m(xd[i]), yd[i])

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 against float32 (see tests/test_cuda.py)
    try:
        clip, ref, norms = user_brute_force(model, loss_of, users)
        got, names = user_release(model, loss_of, [i for u in users for i in u], [len(u) for u in users], clip, 7.0)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    scale = max(float(r.abs().max()) for r in ref) / 7.0
    for name, g, r in zip(names, got, ref):
        assert g.device.type == "cuda", name
        np.testing.assert_allclose(g.double().cpu().numpy(), (r / 7.0).cpu().numpy(), rtol=2e-4, atol=2e-4 * scale,
                                   err_msg=name)


def test_a_dataset_that_changes_size_between_epochs_is_refused():
    x = torch.randn(len(IDS), 5)
    y = torch.zeros(len(IDS), dtype=torch.long)

    class Growing(torch.utils.data.Dataset):
        n = len(IDS)

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return x[i % len(IDS)], y[i % len(IDS)]

    ds = Growing()
    model = _mlp()
    _, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  torch.utils.data.DataLoader(ds, batch_size=5), noise_multiplier=1.0,
                                  max_grad_norm=1.0, ledger=_ledger(), privacy_unit="user", user_ids=IDS,
                                  examples_per_user=2)
    ds.n += 1
    before = len(opt.ledger.samples)
    with pytest.raises(ValueError, match="users of a run are fixed"):
        next(iter(loader))
    assert len(opt.ledger.samples) == before


@pytest.mark.parametrize("sampler, kw", [("truncated_poisson", {"max_batch_size": 4}), ("balls_in_bins", {}),
                                         ("random_allocation", {"num_selected": 2})])
def test_other_samplers_draw_users(sampler, kw):
    ds = _data()
    model = _mlp()
    _, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  torch.utils.data.DataLoader(ds, batch_size=2), noise_multiplier=1.0,
                                  max_grad_norm=1.0, ledger=_ledger(), seed=4, sampler=sampler, privacy_unit="user",
                                  user_ids=IDS, examples_per_user=3, **kw)
    seen = []
    for x, y in loader:
        counts, idx = loader.record_groups, loader.last_indices
        starts = np.concatenate([[0], np.cumsum(counts)])
        seen += [IDS[idx[a]] for a in starts[:-1]]
        for a, b in zip(starts[:-1], starts[1:]):
            assert len(set(IDS[idx[a:b]])) == 1 and b - a <= 3
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if sampler != "truncated_poisson":  # every user in the epoch's (round's) batches
        assert sorted(set(seen)) == sorted(set(IDS))
    led = opt.ledger
    assert led.privacy_unit == "user" and all(s.population_size == 5 for s in led.samples)
    assert led.num_releases == len(loader) and np.isfinite(opt.get_epsilon(1e-5))


def test_a_resumed_example_level_run_keeps_each_users_examples():
    ds, _, model, opt, loader = _private(4, max_examples_per_user=2)
    kept = loader.kept.copy()
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        break
    state = opt.state_dict()
    for _ in range(5):  # unseeded: a fresh build draws its own bound, the resume restores the run's
        model2 = _mlp()
        _, opt2, loader2 = make_private(model2, torch.optim.SGD(model2.parameters(), lr=0.0),
                                        torch.utils.data.DataLoader(_data(), batch_size=4), noise_multiplier=0.0,
                                        max_grad_norm=0.5, ledger=opt.ledger, privacy_unit="user", user_ids=IDS,
                                        max_examples_per_user=2)
        opt2.load_state_dict(state)
        assert np.array_equal(loader2.kept, kept)


@pytest.mark.parametrize("bound", [{"examples_per_user": 3}, {"max_examples_per_user": 3}])
@pytest.mark.parametrize("index", [False, True])
def test_make_private_with_epsilon_calibrates_the_user_level_target(bound, index):
    from dpcore.plan import make_plan
    from dpcore.torch import make_private_with_epsilon

    model = _mlp()
    ids = dpcore.sampling.UserIndex(IDS) if index else IDS
    _, opt, loader = make_private_with_epsilon(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(_data(), batch_size=2),
        target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0, ledger=_ledger(), privacy_unit="user",
        user_ids=ids, **bound)
    n = 5 if "examples_per_user" in bound else 10  # users; or examples kept: 1 + 2 + 3 + 1 + 3
    assert loader.population_size == n
    plan = make_plan(sampling_probability=2 / n, noise_multiplier=opt.noise_multiplier, epochs=2, privacy_unit="user",
                     target_delta=1e-5, **bound)
    assert len(loader) * 2 == plan.steps
    eps = plan.epsilon()
    assert eps <= 3.0 and eps > 2.9


@pytest.mark.parametrize("bound", [{"examples_per_user": 2}, {"max_examples_per_user": 2}])
def test_a_resumed_user_level_run_releases_what_an_uninterrupted_one_would(bound):
    """Seeded: 4 releases in one go against 2, a checkpoint, a fresh build on the same ledger and
    2 more: the same users, the same examples of each, the same parameters."""

    def build(led):
        model = _mlp()
        model, opt, loader = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                          torch.utils.data.DataLoader(_data(), batch_size=3), noise_multiplier=0.5,
                                          max_grad_norm=0.5, seed=7, ledger=led, privacy_unit="user", user_ids=IDS,
                                          **bound)
        return model, opt, loader

    def run(model, opt, loader, releases):
        seen = []
        while releases:
            for x, y in loader:
                seen.append(loader.last_indices.copy())
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if opt.last_step_released:
                    releases -= 1
                    if not releases:
                        return seen
        return seen

    m1, o1, l1 = build(_ledger())
    whole = run(m1, o1, l1, 4)
    led = _ledger()
    m2, o2, l2 = build(led)
    first = run(m2, o2, l2, 2)
    state, weights = o2.state_dict(), copy.deepcopy(m2.state_dict())
    m3, o3, l3 = build(led)
    m3.load_state_dict(weights)
    o3.load_state_dict(state)
    rest = run(m3, o3, l3, 2)
    assert all(np.array_equal(a, b) for a, b in zip(whole, first + rest)) and len(whole) == len(first + rest)
    for a, b in zip(m1.parameters(), m3.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert led.num_releases == 4
