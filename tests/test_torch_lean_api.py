"""The memory-lean mode through the public API: make_private, micro-batches, users, GradScaler,
non-finite records, the errors, and how little it holds at once."""

from __future__ import annotations

import os
import tempfile
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dpcore  # noqa: E402
from dpcore.torch import DPOptimizer, make_private  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::dpcore.ledger.LedgerWarning")


def _ledger():
    return dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(prefix="dpcore-test-"), "l.jsonl"))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 7, generator=g), torch.randint(0, 3, (n,), generator=g))


def _dp(model, memory, *, clip=1.0, lr=0.1, den=8):
    """A DPOptimizer over ``model`` at noise 0 whose ledger holds one sample (a release may follow)."""
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model=model, noise_multiplier=0.0,
                      max_grad_norm=clip, expected_batch_size=den, ledger=_ledger(), memory=memory)
    opt.ledger.record_sample(100, den / 100)
    return opt


def _train(memory, *, steps=3, users=False, phys=None, nan_row=None, noise=0.7, **kw):
    model = _mlp()
    ds = _data()
    loader = torch.utils.data.DataLoader(ds, batch_size=16)
    extra = {}
    if users:
        extra = dict(privacy_unit="user", user_ids=np.arange(len(ds)) // 4, examples_per_user=2)
    model, opt, loader = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.3), loader, noise_multiplier=noise, max_grad_norm=0.5,
        ledger=os.path.join(tempfile.mkdtemp(prefix="dpcore-test-"), "l.jsonl"), seed=7, memory=memory, max_physical_batch_size=phys, **extra, **kw)
    done = 0
    for x, y in loader:
        if nan_row is not None and len(x) > nan_row:
            x = x.clone()
            x[nan_row] = float("nan")
        opt.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        done += opt.last_step_released
        if done == steps:
            break
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("case", [
    dict(),
    dict(phys=3),                      # micro-batches: several backward passes per release
    dict(users=True),                  # the privacy unit is the user
    dict(nan_row=1),                   # a record with a NaN contributes zero
    dict(clipping="per_layer"),
    dict(noise_mechanism="blt", epochs=2),  # correlated noise over the cyclic order
])
def test_lean_trains_as_the_default_mode(case):
    """Same seed, same noise: the lean mode releases what the default mode releases (the clipped
    sums only summed in another order)."""
    a, oa = _train("default", **case)
    b, ob = _train("lean", **case)
    assert ob.memory == "lean" and ob.engine.lean is not None and oa.engine.lean is None
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    assert oa.get_epsilon(1e-5) == ob.get_epsilon(1e-5)
    assert ob.ledger.num_releases == oa.ledger.num_releases >= 1


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Flatten(), nn.LayerNorm(16 * 4 * 4), nn.Linear(16 * 4 * 4, 3))


@pytest.mark.parametrize("make,shape", [(_mlp, (7,)), (_cnn, (3, 8, 8))], ids=["mlp", "cnn"])
def test_lean_holds_one_layer_at_a_time(make, shape):
    """The norm pass takes each parameter's norm as soon as its last contribution arrives: for a
    chain of Linear, Conv2d, GroupNorm and LayerNorm layers no contribution stays pending once
    its layer is done (each rule declares them with expect), and nothing is held to the step."""
    model = make()
    opt = _dp(model, "lean", clip=1.0, lr=0.1, den=8)
    lean = opt.engine.lean
    most = [0]
    orig = lean.take

    def take(c):
        r = orig(c)
        most[0] = max(most[0], sum(len(v) for v in lean.pending.values()))
        return r

    lean.take = take
    x, y = torch.randn((8,) + shape), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    assert most[0] == 0  # each parameter's contribution completes it on arrival
    assert lean.phase == "sums" and all(not r.contributions for r in opt.engine.rules)
    n = len(opt.engine.params)
    assert lean.counts == lean.summed == [1] * n
    opt.step()
    assert lean.phase is None and all(a is None for a in lean.acc)


def test_tied_parameter_is_held_until_its_last_use():
    """A parameter used twice (a layer applied twice) keeps its first contribution until the
    second arrives; the norm is of the sum, exact against the default mode."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    x = torch.randn(6, 5)
    res = []
    for memory in ("default", "lean"):
        m = nn.Sequential(*[mod for mod in model])  # the same modules: same parameters
        with torch.no_grad():
            for p, q in zip(m.parameters(), model.parameters()):
                p.copy_(q)
        mm = __import__("copy").deepcopy(model)
        opt = _dp(mm, memory, clip=0.3, lr=1.0, den=6)
        mm(x).pow(2).sum().backward()
        if memory == "lean":
            assert opt.engine.lean.counts == [2, 2]
        opt.step()
        res.append([p.detach().clone() for p in mm.parameters()])
    for u, v in zip(*res):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-7)


def test_grad_scaler_in_lean_mode():
    """float16 autocast with a GradScaler at scale 2¹⁰: the lean mode reads the scale before its norm
    pass and trains as the default mode."""
    out = []
    for memory in ("default", "lean"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 3))
        loader = torch.utils.data.DataLoader(_data(), batch_size=8)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2**31 - 1)
        model, opt, loader = make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.05), loader, noise_multiplier=0.0, max_grad_norm=1.0,
            ledger=_ledger(), grad_scaler=scaler, seed=3, memory=memory)
        for x, y in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        out.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_lean_mode_errors():
    model = _mlp()
    opt = _dp(model, "lean", clip=1.0, lr=0.1, den=8)
    x, y = _data(8)[:]
    # a loss that combines two separate calls of the model: refused at the step, nothing recorded
    (nn.functional.cross_entropy(model(x), y) + model(x * 2).pow(2).mean()).backward()
    with pytest.raises(ValueError, match="two separate"):
        opt.step()
    assert opt.ledger.num_releases == 0
    # two backward passes before a step
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="second backward pass"):
        nn.functional.cross_entropy(model(x), y).backward()
    opt.zero_grad()
    with pytest.raises(ValueError, match="memory must be one of"):
        make_private(_mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1),
                     torch.utils.data.DataLoader(_data(), batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
                     memory="ghost")
    # after the errors, a clean step releases
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.ledger.num_releases == 1


def test_an_output_that_does_not_require_grad_and_a_dict_output():
    """Only the outputs that require grad pass the tap; a dict output keeps its keys and class."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x):
            return {"logits": self.a(x), "aux": x.sum(1), "pair": (self.a(x) * 2, 1)}

    torch.manual_seed(0)
    res = []
    for memory in ("default", "lean"):
        net = Net()
        torch.manual_seed(0)
        net.a.reset_parameters()
        opt = _dp(net, memory, clip=0.2, lr=1.0, den=5)
        out = net(torch.randn(5, 4, generator=torch.Generator().manual_seed(3)))
        assert set(out) == {"logits", "aux", "pair"} and out["pair"][1] == 1
        (out["logits"].pow(2).sum() + out["pair"][0].sum()).backward()
        opt.step()
        res.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_submodules_called_one_by_one():
    """The layers called one after another outside the model's forward (as a LightningModule's
    training_step may call self.net): each outermost call is tapped; the norm pass runs below the
    last one and the others pass their gradients on. Exact against the default mode."""
    res = []
    for memory in ("default", "lean"):
        model = _mlp()
        opt = _dp(model, memory, clip=0.3, lr=1.0, den=8)
        x, y = _data(8)[:]
        h = torch.relu(model[0](x))
        h = torch.tanh(model[2](h))
        nn.functional.cross_entropy(model[4](h), y).backward()
        opt.step()
        res.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_an_input_that_requires_grad_gets_its_gradient_once():
    """The norm pass runs the whole backward pass; a leaf that is not a parameter (an input that
    requires grad, as adversarial training asks) keeps the gradient of the sum pass only."""
    grads = []
    for memory in ("default", "lean"):
        model = _mlp()
        opt = _dp(model, memory, clip=1.0, lr=0.1, den=8)
        x, y = _data(8)[:]
        x = x.clone().requires_grad_(True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        grads.append(x.grad.clone())
        assert opt.engine.anchor.grad is None or memory == "default"
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
