"""DP-SGD (Abadi et al. 2016, Algorithm 1) on scikit-learn's digits with dpcore.torch.

Prints the test accuracy of the DP model next to a non-private baseline, and ε at δ = 1e-5 read
from the privacy ledger. ``python examples/torch_digits.py [--small]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch
from torch import nn


def load(small: bool):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0)
    if small:
        xtr, ytr = xtr[:400], ytr[:400]
    return torch.utils.data.TensorDataset(xtr, ytr), (xte, yte)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def accuracy(m: nn.Module, test) -> float:
    with torch.no_grad():
        return float((m(test[0]).argmax(1) == test[1]).float().mean())


def main(small: bool = False, epochs: int = 0) -> dict:
    import dpcore
    from dpcore.torch import make_private

    torch.manual_seed(0)
    train, test = load(small)
    epochs = epochs or (3 if small else 15)
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True)

    base = model()
    opt = torch.optim.SGD(base.parameters(), lr=0.5)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(base(x), y).backward()
            opt.step()

    path = os.path.join(tempfile.mkdtemp(prefix="dpcore-digits-"), "ledger.jsonl")
    ledger = dpcore.PrivacyLedger(path)
    dp = model()
    dp, dp_opt, dp_loader = make_private(dp, torch.optim.SGD(dp.parameters(), lr=0.5), loader,
                                         noise_multiplier=1.1, max_grad_norm=1.0, ledger=ledger)
    for _ in range(epochs):
        for x, y in dp_loader:  # Poisson batches; an empty one is stepped too (pure noise)
            dp_opt.zero_grad()
            if len(x):
                nn.functional.cross_entropy(dp(x), y).backward()
            dp_opt.step()
    res = {"baseline_accuracy": accuracy(base, test), "dp_accuracy": accuracy(dp, test),
           "steps": ledger.num_releases}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # accounting notices are not what the example shows
        res["epsilon"] = dp_opt.get_epsilon(1e-5)
    print(f"non-private accuracy {res['baseline_accuracy']:.3f} | DP-SGD accuracy {res['dp_accuracy']:.3f} "
          f"| eps = {res['epsilon']} at delta = 1e-5 after {res['steps']} steps (ledger {path})")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--epochs", type=int, default=0)
    a = ap.parse_args()
    main(a.small, a.epochs)
