"""dpcore.opacus as a drop-in for Opacus: tutorial-style scripts whose only difference is the import
lines (``opacus`` -> ``dpcore.opacus``). Each runs with dpcore.opacus (always); when Opacus is
importable (not in CI) the same script also runs with ``opacus`` and ε and accuracy are compared."""

from __future__ import annotations

import importlib.util
import math
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

HAS_OPACUS = importlib.util.find_spec("opacus") is not None

PRELUDE = """
import numpy as np, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from {pkg} import PrivacyEngine
from {pkg}.utils.batch_memory_manager import BatchMemoryManager
from {pkg}.validators import ModuleValidator

torch.manual_seed(SEED)

def digits(images=False):
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    if images:
        X = X.view(-1, 1, 8, 8)
    y = torch.tensor(y)
    g = torch.Generator().manual_seed(0)
    p = torch.randperm(len(y), generator=g)
    tr, te = p[:1400], p[1400:]
    return TensorDataset(X[tr], y[tr]), (X[te], y[te])

def accuracy(model, test):
    model.eval()
    with torch.no_grad():
        return (model(test[0]).argmax(-1) == test[1]).float().mean().item()
"""

MLP = """
train, test = digits()
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
train_loader = DataLoader(train, batch_size=128, shuffle=True)
privacy_engine = PrivacyEngine()
model, optimizer, train_loader = privacy_engine.make_private(
    module=model, optimizer=optimizer, data_loader=train_loader,
    noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="hooks")
criterion = nn.CrossEntropyLoss()
for epoch in range(5):
    model.train()
    for x, y in train_loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
eps = privacy_engine.get_epsilon(delta=1e-5)
acc = accuracy(model, test)
inner = model._module
"""

CNN = """
train, test = digits(images=True)
model = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(16 * 2 * 2, 10))
errors = ModuleValidator.validate(model, strict=False)
assert len(errors) >= 1
model = ModuleValidator.fix(model)
assert not ModuleValidator.validate(model, strict=False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
train_loader = DataLoader(train, batch_size=128)
privacy_engine = PrivacyEngine(accountant="prv")
model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
    module=model, optimizer=optimizer, data_loader=train_loader,
    target_epsilon=4.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    model.train()
    with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=64, optimizer=optimizer) as loader:
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
eps = privacy_engine.get_epsilon(delta=1e-5)
acc = accuracy(model, test)
history = privacy_engine.accountant.history
"""

LSTM = """
from {pkg}.layers import DPLSTM
g = torch.Generator().manual_seed(1)
V, T, n = 12, 5, 1200
X = torch.randint(0, V, (n, T), generator=g)
y = (X[:, -1] >= V // 2).long()           # the class is in the last character
train, test = TensorDataset(X[:900], y[:900]), (X[900:], y[900:])

class CharLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.lstm = DPLSTM(16, 32, batch_first=True)
        self.out = nn.Linear(32, 2)
    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.out(h[:, -1])

model = ModuleValidator.fix(CharLSTM())
optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
train_loader = DataLoader(train, batch_size=100, shuffle=True)
privacy_engine = PrivacyEngine(accountant="rdp")
model, optimizer, train_loader = privacy_engine.make_private(
    module=model, optimizer=optimizer, data_loader=train_loader,
    noise_multiplier=0.8, max_grad_norm=1.0)
criterion = nn.CrossEntropyLoss()
for epoch in range(4):
    model.train()
    for x, y in train_loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
eps = privacy_engine.get_epsilon(delta=1e-5)
acc = accuracy(model, test)
"""

SCRIPTS = {"mlp_digits": (MLP, 0.10, 0.6), "cnn_digits": (CNN, 0.10, 0.5), "char_lstm": (LSTM, 0.5, 0.7)}
#: relative ε tolerance dpcore vs Opacus: PLD vs PRV (both tight numerical bounds) / RDP vs RDP.
EPS_RTOL = {"mlp_digits": 0.10, "cnn_digits": 0.10, "char_lstm": 0.10}
#: accuracy tolerance (absolute): seed spread of these short noisy runs.
ACC_ATOL = 0.15


def run(script: str, pkg: str, seed: int = 0) -> dict:
    import sys
    import types

    mod = types.ModuleType(f"_opacus_script_{pkg.replace('.', '_')}")  # picklable classes (Opacus's fix copies)
    sys.modules[mod.__name__] = mod
    ns = mod.__dict__
    ns["SEED"] = seed
    src = (PRELUDE + script).replace("{pkg}", pkg)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(src, f"<{pkg} script>", "exec"), ns)
    finally:
        sys.modules.pop(mod.__name__, None)
    return ns


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_runs_with_dpcore(name):
    script, chance, floor = SCRIPTS[name]
    ns = run(script, "dpcore.opacus")
    assert math.isfinite(ns["eps"]) and ns["eps"] > 0
    assert ns["acc"] > max(floor, chance + 0.1), ns["acc"]
    if name == "cnn_digits":
        assert ns["eps"] <= 4.0 * (1 + 1e-6)  # calibrated, never overshoots
        assert ns["history"] and all(len(h) == 3 for h in ns["history"])
        assert sum(h[2] for h in ns["history"]) == 2 * 11  # round(1/q) = round(1400/128) steps per epoch
    if name == "mlp_digits":
        assert isinstance(ns["inner"], torch.nn.Sequential)


@pytest.mark.skipif(not HAS_OPACUS, reason="opacus is not installed (the comparison runs where it is)")
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_matches_opacus(name):
    script = SCRIPTS[name][0]
    ours, theirs = run(script, "dpcore.opacus"), run(script, "opacus")
    print(f"{name}: dpcore eps={ours['eps']:.4f} acc={ours['acc']:.3f} | opacus eps={theirs['eps']:.4f} "
          f"acc={theirs['acc']:.3f}")
    assert abs(ours["eps"] - theirs["eps"]) <= EPS_RTOL[name] * theirs["eps"]
    assert abs(ours["acc"] - theirs["acc"]) <= ACC_ATOL


def _tiny():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 5, generator=g)
    y = (X[:, 0] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(5, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(TensorDataset(X, y), batch_size=20)


def _train(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_opacus_habits_accepted(tmp_path):
    from dpcore.opacus import PrivacyEngine

    model, opt, dl = _tiny()
    pe = PrivacyEngine(accountant="gdp", secure_mode=True, ledger=tmp_path / "run.jsonl")
    crit = torch.nn.CrossEntropyLoss()
    m, o, c, loader = pe.make_private(module=model, optimizer=opt, data_loader=dl, criterion=crit,
                                      noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost")
    assert c is crit and m._module is model
    assert o.memory == "lean"  # Opacus's ghost clipping is dpcore's memory-lean mode
    assert list(m.state_dict())[0].startswith("_module.")
    assert pe.get_epsilon(1e-5) == 0.0
    _train(m, o, loader)
    assert pe.ledger.path == str(tmp_path / "run.jsonl")
    h = pe.accountant.history
    assert h[0][0] == pytest.approx(1.0) and h[0][1] == pytest.approx(0.1)
    assert sum(s for _, _, s in h) == pe.ledger.num_releases
    assert pe.get_epsilon(1e-5) == pytest.approx(pe.ledger.get_epsilon(1e-5, accountant="pld"))


def test_target_epsilon_on_make_private_and_rdp():
    from dpcore.opacus import PrivacyEngine

    model, opt, dl = _tiny()
    pe = PrivacyEngine(accountant="rdp")
    m, o, loader = pe.make_private(module=model, optimizer=opt, data_loader=dl, target_epsilon=2.0,
                                   target_delta=1e-5, epochs=2, max_grad_norm=1.0)
    for _ in range(2):
        _train(m, o, loader)
    assert 0 < pe.get_epsilon(1e-5) <= 2.0 * (1 + 1e-6)


def test_shuffled_batches_are_not_amplified():
    """poisson_sampling=False: dpcore records shuffled batches and accounts them without
    amplification (Opacus accounts them as if Poisson sampled)."""
    from dpcore.opacus import PrivacyEngine

    eps = {}
    for poisson in (True, False):
        model, opt, dl = _tiny()
        pe = PrivacyEngine()
        m, o, loader = pe.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
                                       max_grad_norm=1.0, poisson_sampling=poisson)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _train(m, o, loader)
            eps[poisson] = pe.get_epsilon(1e-5)
    assert eps[False] > 1.2 * eps[True]


def test_batch_memory_manager_steps_once_per_logical_batch():
    from dpcore.opacus import PrivacyEngine
    from dpcore.opacus.utils.batch_memory_manager import BatchMemoryManager

    model, opt, dl = _tiny()
    pe = PrivacyEngine()
    m, o, loader = pe.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0)
    physical = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=o) as mem:
        for x, y in mem:
            assert len(x) <= 4
            physical += 1
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    assert loader.max_physical_batch_size is None  # restored
    assert pe.ledger.num_releases == len(loader) == 10
    assert physical > 10


def test_module_validator_and_compat():
    from dpcore.opacus import PrivacyEngine
    from dpcore.opacus.validators import ModuleValidator

    bn = torch.nn.Sequential(torch.nn.Conv2d(1, 6, 3), torch.nn.BatchNorm2d(6))
    assert not ModuleValidator.is_valid(bn) and not PrivacyEngine.is_compatible(module=bn)
    with pytest.raises(ValueError):
        ModuleValidator.validate(bn, strict=True)
    fixed = ModuleValidator.fix(bn)
    assert isinstance(bn[1], torch.nn.BatchNorm2d)  # the original is left as it is
    assert isinstance(fixed[1], torch.nn.GroupNorm) and ModuleValidator.is_valid(fixed)
    lstm = torch.nn.LSTM(3, 4)
    assert ModuleValidator.is_valid(lstm)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyEngine(accountant="moments")
