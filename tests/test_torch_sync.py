"""A DP step asks nothing of the device's values (issue 52): counted on CPU under a dispatch mode.

On a GPU every operator that reads a device value on the host (``.item()``, a boolean mask,
``torch.unique``, ``nonzero``, ``repeat_interleave`` without ``output_size``, ...) stalls the
host until the device has caught up, and the step becomes bound by the host. The same operators
are dispatched on CPU, so :class:`dpcore.torch.opcount.OpCounter` counts them here: a
steady-state step (after warm-up, Poisson sampling, noise drawn by the torch ChaCha20 path as on
a GPU) of every layer family, in both memory modes, under bfloat16 autocast, with a GradScaler,
with users as the privacy unit and with micro-batches, dispatches none. Counts are deterministic
and asserted exactly; ``tests/test_cuda.py`` runs a step under
``torch.cuda.set_sync_debug_mode("error")`` where a GPU is lent.
"""

from __future__ import annotations

import copy
import itertools
import os
import tempfile
import warnings

import pytest
import torch
from torch import nn

import dpcore
import dpcore.torch as dt
from dpcore.torch.opcount import OpCounter, is_sync

pytestmark = pytest.mark.filterwarnings("ignore")


# -- the counter itself: a test that could not fail would prove nothing ---------------------


def test_counter_sees_every_kind_of_synchronisation():
    x = torch.randn(8)
    cases = {
        "item": lambda: float(x.sum()),
        "boolean mask": lambda: x[x > 0],
        "boolean index_put": lambda: x.clone().index_put_((x > 0,), torch.tensor(0.0)),
        "unique": lambda: torch.unique(torch.tensor([1, 1, 2])),
        "nonzero": lambda: torch.nonzero(x > 0),
        "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1])),
        "equal": lambda: torch.equal(x, x),
        "masked_select": lambda: torch.masked_select(x, x > 0),
        "bincount": lambda: torch.bincount(torch.tensor([0, 1, 1])),
        "any as bool": lambda: bool((x > 10).any()),
    }
    for name, fn in cases.items():
        with OpCounter() as c:
            fn()
        assert c.syncs >= 1, name


def test_counter_leaves_sync_free_operators_alone():
    x = torch.randn(8, 4, requires_grad=True)
    with OpCounter() as c:
        y = (x * 2).sum(1).sort().values
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1]), output_size=3)
        torch.repeat_interleave(x, 2, dim=0)
        x.detach()[torch.tensor([0, 2])]  # an integer index is not a mask
        torch.where(x > 0, x, 0.0).masked_fill(x < 0, 1.0)
        y.sum().backward()
    assert c.syncs == 0, dict(c.sync_ops)
    assert c.kernels > 5 and c.total > c.kernels  # views count in the total only


def test_is_sync_by_arguments():
    idx = torch.ops.aten.index.Tensor
    x = torch.arange(4.0)
    assert is_sync(idx, (x, [x > 1]), {})
    assert not is_sync(idx, (x, [torch.tensor([1])]), {})
    ri = torch.ops.aten.repeat_interleave.Tensor
    assert is_sync(ri, (torch.tensor([1, 2]),), {})
    assert not is_sync(ri, (torch.tensor([1, 2]),), {"output_size": 3})


# -- a DP step of every layer family ----------------------------------------------------


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16, padding_idx=0)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(self.enc(self.emb(x)).mean(1))


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.rnn(self.emb(x))[0][:, -1])


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.Conv1d(16, 8, 1) if False else nn.Identity(),
        nn.Flatten(), nn.Linear(16 * 3 * 3, 3),
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


N = 96


def _data(kind: str, g: torch.Generator):
    y = torch.randint(0, 3, (N,), generator=g)
    if kind == "tokens":  # few distinct tokens: every record looks some up several times, and the padding row
        return torch.randint(0, 5, (N, 7), generator=g), y
    if kind == "image":
        return torch.randn(N, 3, 12, 12, generator=g), y
    return torch.randn(N, 6, generator=g), y


FAMILIES = {
    "transformer": (_Transformer, "tokens"),
    "lstm": (_LSTM, "tokens"),
    "cnn": (_cnn, "image"),
    "mlp": (_mlp, "vector"),
}


def training_step(model, opt, device_type, *, bf16=False, scaler=None):
    """step(x, y): zero_grad, forward (under bfloat16 autocast with ``bf16``), cross-entropy,
    backward (scaled by ``scaler``) and the optimizer's step (through the scaler)."""
    crit = nn.CrossEntropyLoss()

    def step(xb, yb):
        opt.zero_grad()
        if bf16:
            with torch.autocast(device_type, dtype=torch.bfloat16):
                out = model(xb)
            loss = crit(out.float(), yb)
        else:
            loss = crit(model(xb), yb)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    return step


def _syncs(build, kind, *, memory="default", bf16=False, scaler=None, steps=4, noise=True, released=True, **kw):
    """The synchronising operators of each steady-state step (after one warm-up step)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build()
    x, y = _data(kind, g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if scaler is not None:
        kw["grad_scaler"] = scaler
    ledger = dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(prefix="dpcore-sync-"), "l.jsonl"),
                                  privacy_unit=kw.get("privacy_unit", "example"))
    if noise:
        kw.update(noise_multiplier=1.0, max_grad_norm=1.0)
    model, opt, loader = dt.make_private(model, opt, loader, memory=memory, ledger=ledger, **kw)
    opt.noise_device = "device"  # torch's ChaCha20, the path taken on an accelerator
    opt._noise.gaussian.ahead = False  # drawn in the step, on the thread the dispatch mode watches
    step = training_step(model, opt, "cpu", bf16=bf16, scaler=scaler)
    batches = (b for _ in itertools.count() for b in loader)  # a fresh sample every time
    found = []
    for s in range(steps):
        xb, yb = next(batches)
        with OpCounter() as c:
            step(xb, yb)
        assert opt.last_step_released or not released
        if s:
            found.append(dict(c.sync_ops))
    return found


@pytest.mark.parametrize("memory", ["default", "lean"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_synchronisation_in_a_step(family, memory):
    build, kind = FAMILIES[family]
    assert _syncs(build, kind, memory=memory) == [{}] * 3


@pytest.mark.parametrize("family", ["transformer", "cnn"])
def test_no_synchronisation_under_bfloat16_autocast(family):
    build, kind = FAMILIES[family]
    assert _syncs(build, kind, bf16=True) == [{}] * 3


@pytest.mark.parametrize("memory", ["default", "lean"])
def test_no_synchronisation_with_a_grad_scaler(memory):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2**31 - 1)
    assert _syncs(_mlp, "vector", memory=memory, scaler=scaler) == [{}] * 3


def test_no_synchronisation_with_micro_batches_as_records():
    from dpcore.queries import GaussianAverageQuery, MicrobatchQuery

    q = MicrobatchQuery(GaussianAverageQuery(1.0, 1.0, 16.0), 2)
    assert _syncs(_mlp, "vector", query=q, noise=False) == [{}] * 3


def test_no_synchronisation_when_a_sample_is_split_into_physical_batches():
    # a Poisson sample of ~16 records in physical batches of at most 6: several backward passes per release
    found = _syncs(_mlp, "vector", max_physical_batch_size=6, steps=8, released=False)
    assert found == [{}] * 7


@pytest.mark.parametrize("how", [{"examples_per_user": 2}, {"max_examples_per_user": 3}])
def test_no_synchronisation_with_users_as_the_privacy_unit(how):
    ids = [i // 3 for i in range(N)]
    assert _syncs(_mlp, "vector", privacy_unit="user", user_ids=ids, **how) == [{}] * 3


def test_a_planted_synchronisation_is_caught(monkeypatch):
    # the test above would notice a host read brought back into the clip stage
    from dpcore.torch import _clip

    orig = _clip.clip_factors

    def reading(*a, **kw):
        c = orig(*a, **kw)
        float(c.sum())
        return c

    monkeypatch.setattr(_clip, "clip_factors", reading)
    assert _syncs(_mlp, "vector") == [{"_local_scalar_dense": 1}] * 3


@pytest.mark.parametrize("memory", ["default", "lean"])
def test_no_synchronisation_with_padded_batches(memory):
    # static shapes: every physical batch 16 rows, the padding masked on the device
    build, kind = FAMILIES["transformer"]
    assert _syncs(build, kind, memory=memory, max_physical_batch_size=16, pad_batches=True, steps=6,
                  released=False) == [{}] * 5


def test_stacked_tails_equal_each_parameters_own_bit_for_bit():
    from dpcore.torch._contrib import Tail, finish

    g = torch.Generator().manual_seed(0)
    tails = []
    for j in range(7):
        w = torch.randn(13, generator=g, dtype=torch.float64) * 10 ** (j - 3)
        s = torch.rand(13, generator=g, dtype=torch.float64) * 10 ** (j - 3)
        form, cap = [("ghost", True), ("sum", True), ("sum", False)][j % 3]
        tails.append(Tail(form, w.abs() if form == "sum" else w, s, 2.0**-50 * (j + 1), cap))
    mixed = [torch.ones(13, dtype=torch.float64)] + tails + [None]
    got = finish(mixed)
    assert got[0] is mixed[0] and got[-1] is None
    for t, v in zip(tails, got[1:-1]):
        assert torch.equal(v, t.value())


def test_the_dp_trainer_adds_no_synchronisation_to_the_trainers_own():
    # the Hugging Face Trainer reads a few values itself (its loss bookkeeping); DPTrainer adds none
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
    try:
        import bench_step_ops as bso
    finally:
        sys.path.pop(0)
    plain = bso.count_trainer("lora", "trainer", warmup=2, steps=3)
    dp = bso.count_trainer("lora", "dptrainer", warmup=2, steps=3)
    assert "error" not in plain and "error" not in dp, (plain, dp)
    assert dp["sync_ops"] == plain["sync_ops"], (plain["sync_ops"], dp["sync_ops"])


@pytest.mark.parametrize("width,rank,path,bias", [(32, 32, "ghost", False), (16, 2, "product", False),
                                                  (32, 32, "ghost", True)])
def test_layers_of_one_shape_stacked_give_the_same_bounds(monkeypatch, width, rank, path, bias):
    # four blocks of one shape: their norms are taken as one stack; the bounds are those of one
    # layer at a time (up to the rounding the bounds allow for) and above the exact norms
    from dpcore.torch._engine import PerRecordGradients

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, rank, bias=bias), nn.Linear(rank, width, bias=bias)) for _ in range(4)]
    model = nn.Sequential(*blocks)
    x = torch.randn(6, 5, width)

    def norms(stack: bool):
        eng = PerRecordGradients(model, list(model.parameters()))
        seen = []
        orig = PerRecordGradients._ghost_groups
        monkeypatch.setattr(PerRecordGradients, "_ghost_groups", lambda self, by, sh: seen.append(orig(self, by, sh)) or seen[-1])
        if not stack:
            monkeypatch.setattr(PerRecordGradients, "_ghost_groups", lambda self, by, shared: {})
        model(x).square().sum(2).mean(1).mean().backward()
        b, sq = eng.squared_norms()
        eng.remove()
        monkeypatch.undo()
        if stack:  # every layer went through the stacked path, the one this case is about
            assert len(seen[0]) == (16 if bias else 8)  # the biases stacked too
            assert {t.form for t in seen[0].values()} == ({"ghost" if path == "ghost" else "sum"} | ({"sum"} if bias else set()))
        return torch.stack(sq)

    stacked, alone = norms(True), norms(False)
    torch.testing.assert_close(stacked, alone, rtol=1e-12, atol=0.0)
    exact = []
    ref = copy.deepcopy(model).double()  # brute force in float64
    for i in range(6):
        ref.zero_grad()
        ref(x[i : i + 1].double()).square().sum(2).mean(1).sum().backward()
        exact.append(torch.stack([p.grad.square().sum() for p in ref.parameters()]))
    exact = torch.stack(exact, 1)
    assert (stacked >= exact * (1 - 1e-12)).all() and (stacked <= exact * (1 + 1e-4) + 1e-12).all()


def test_joined_row_norms_equal_each_tensors_own():
    # the accelerator path of row_sq (many tensors in a fixed number of operators), run on CPU
    from dpcore.torch._contrib import _row_sq_joined, _sq

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(5, w, generator=g) * 10.0 ** k for k, w in enumerate((3, 1, 7, 4, 2, 9))]
    _row_sq_joined(ts)  # (the column map is made once per widths)
    with OpCounter() as c:
        got = _row_sq_joined(ts)
    assert c.kernels <= 6, dict(c.ops)  # whatever the number of tensors
    for t, s in zip(ts, got):
        torch.testing.assert_close(s, _sq(t, 1), rtol=1e-14, atol=0.0)
