"""User-level DP federated averaging (DP-FedAvg; McMahan et al. 2018 §1, survey Algorithm 2 of
Ponomareva et al. 2023) on a simulated population, with dpcore's PrivateAggregator.

One record is one user's model update: each round samples users by Poisson sampling from the
core's CSPRNG, each sampled user trains locally (a few SGD steps of logistic regression on its
own data) and sends Δ = w_local − w; the aggregator clips each Δ to C, sums, adds N(0, (zC)²)
from ChaCha20 and divides by q·n (the fixed-denominator estimator). The ledger records every
round in a ledger of privacy unit "user" (each sample over the user population, with the bound
of at most MAX_LOCAL examples behind one user's update); ε is for user-level adjacency (adding
or removing one user's whole data), and equals the plan's ε of the same run
(``dpcore.plan.make_plan(..., privacy_unit="user")``).
``python examples/user_level_fedavg.py [--small]``.
"""

from __future__ import annotations

import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded from its file by another program (the tests): _common.py is beside it
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from _common import parser, quiet_epsilon  # noqa: E402

#: The most examples a user holds (a public bound of the simulation: 5 to 29 each); each user's
#: update is computed from all of them, so at most this many examples are behind one record.
MAX_LOCAL = 30


def population(users: int, d: int, rng: np.random.Generator):
    w_true = rng.normal(size=d)
    data = []
    for _ in range(users):
        m = int(rng.integers(5, MAX_LOCAL))
        shift = rng.normal(scale=0.5, size=d)  # non-IID users
        x = rng.normal(size=(m, d)) + shift
        y = (x @ w_true + rng.normal(scale=0.5, size=m) > 0).astype(np.float64)
        data.append((x, y))
    return data, w_true


def local_update(w, x, y, lr=0.2, steps=5):
    w0 = w.copy()
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        w = w - lr * x.T @ (p - y) / len(y)
    return (w - w0).astype(np.float32)


def accuracy(w, data):
    x = np.concatenate([a for a, _ in data])
    y = np.concatenate([b for _, b in data])
    return float((((x @ w) > 0) == (y > 0.5)).mean())


def main(small: bool = False) -> dict:
    import dpcore

    rng = np.random.default_rng(0)
    users, rounds, d = (300, 15, 10) if small else (3000, 60, 20)
    data, _ = population(users, d, rng)
    test, _ = data[: users // 5], None
    train = data[users // 5:]
    n = len(train)
    q = 50 / n
    clip, z, server_lr = 0.5, 1.0, 1.0
    path = os.path.join(tempfile.mkdtemp(prefix="dpcore-fedavg-"), "ledger.jsonl")
    ledger = dpcore.PrivacyLedger(path, privacy_unit="user")  # one record = one user
    agg = dpcore.PrivateAggregator(dpcore.GaussianAverageQuery(clip, z * clip, q * n), ledger, n, q,
                                   privacy_unit="user", examples_per_user=MAX_LOCAL)
    w = np.zeros(d)
    for _ in range(rounds):
        idx = agg.sample()  # Poisson sample of users, recorded in the ledger
        deltas = np.stack([local_update(w, *train[i]) for i in idx]) if len(idx) else np.zeros((0, d), np.float32)
        w = w + server_lr * agg.aggregate(deltas).astype(np.float64)  # clip, noise, ledger (durable)
    # non-private FedAvg baseline: same rounds, every user, plain average
    wb = np.zeros(d)
    for _ in range(rounds):
        wb = wb + np.mean([local_update(wb, *u) for u in train], axis=0)
    res = {"dp_accuracy": accuracy(w, test), "baseline_accuracy": accuracy(wb, test), "rounds": ledger.num_releases,
           "ledger": path, "users": n, "sampling_probability": q, "noise_multiplier": z,
           "examples_per_user": MAX_LOCAL, "privacy_unit": ledger.privacy_unit}
    res["epsilon"] = quiet_epsilon(ledger.get_epsilon)
    print(f"users {n}, rounds {rounds}: non-private FedAvg accuracy {res['baseline_accuracy']:.3f} | DP-FedAvg "
          f"{res['dp_accuracy']:.3f} | user-level eps = {res['epsilon']} at delta = 1e-5 (ledger {path})")
    return res


if __name__ == "__main__":
    main(parser().parse_args().small)
