"""DP-SGD (Abadi et al. 2016, Algorithm 1) on scikit-learn's digits with dpcore.torch.

Prints the test accuracy of the DP model next to a non-private baseline, and ε at δ = 1e-5 read
from the privacy ledger. ``python examples/torch_digits.py [--small]``.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded from its file by another program (the tests): _common.py is beside it
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from _common import digits, parser, quiet_epsilon, report_dp_sgd, temp_ledger  # noqa: E402
from torch import nn  # noqa: E402


def load(small: bool):
    xtr, xte, ytr, yte = digits(400 if small else None)
    xtr, xte = torch.tensor(xtr), torch.tensor(xte)
    ytr, yte = torch.tensor(ytr, dtype=torch.long), torch.tensor(yte, dtype=torch.long)
    return torch.utils.data.TensorDataset(xtr, ytr), (xte, yte)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def accuracy(m: nn.Module, test) -> float:
    with torch.no_grad():
        return float((m(test[0]).argmax(1) == test[1]).float().mean())


def main(small: bool = False, epochs: int = 0) -> dict:
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

    ledger, path = temp_ledger("dpcore-digits-")
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
    res["epsilon"] = quiet_epsilon(dp_opt.get_epsilon)
    return report_dp_sgd(res, path)


if __name__ == "__main__":
    ap = parser()
    ap.add_argument("--epochs", type=int, default=0)
    a = ap.parse_args()
    main(a.small, a.epochs)
