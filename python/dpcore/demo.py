"""The main job: DP logistic regression on scikit-learn's bundled digits.

Per-example gradients of a softmax regression are computed in numpy, privatized with
:func:`dpcore.clip_noise` (DP-SGD: Abadi et al. 2016, Algorithm 1, with Poisson sampling and the
fixed-denominator average of McMahan et al. 2018, §3), and the test accuracy is printed next to a
non-private baseline trained the same way without clipping or noise.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

import dpcore
from dpcore.plan import steps_for_epochs
from dpcore.events import SumQueryEvent


@dataclass(frozen=True)
class DemoConfig:
    # Chosen for a meaningful guarantee on a small data set: ε ≈ 3 at δ = 1e-5.
    epochs: int = 20
    expected_batch_size: int = 256
    l2_norm_clip: float = 1.0
    noise_multiplier: float = 3.0
    learning_rate: float = 4.0
    delta: float = 1e-5
    seed: Optional[int] = None
    #: A privacy ledger file that records the private run (``dpcore report`` reads it).
    ledger: Optional[str] = None


def load_digits(split_seed: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits as sk_load
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise SystemExit("the demo needs scikit-learn: pip install 'dpcore[demo]'") from e
    x, y = sk_load(return_X_y=True)
    x = x.astype(np.float64) / 16.0
    # The train/test split is public bookkeeping, not part of the private mechanism.
    order = np.random.default_rng(split_seed).permutation(len(y))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def per_example_grads(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Cross-entropy gradients of softmax regression, one per example: (B, d, k) and (B, k)."""
    err = _softmax(x @ w + b)
    err[np.arange(len(y)), y] -= 1.0
    return np.einsum("bi,bk->bik", x, err), err


def accuracy(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(((x @ w + b).argmax(axis=1) == y).mean())


def train(x, y, cfg: DemoConfig, private: bool):
    n, d = x.shape
    k = int(y.max()) + 1
    w, b = np.zeros((d, k)), np.zeros(k)
    q = cfg.expected_batch_size / n
    steps = steps_for_epochs("poisson", cfg.epochs, q)  # the plan's formula: round(1/q) steps an epoch
    seed = cfg.seed
    led = dpcore.PrivacyLedger(cfg.ledger) if private and cfg.ledger else None
    for t in range(steps):
        s = None if seed is None else seed + 2 * t
        idx = dpcore.poisson_sample(n, q, seed=s, ledger=led)  # Poisson sampling from ChaCha20
        gw, gb = per_example_grads(w, b, x[idx], y[idx])
        if private:
            nw, nb = dpcore.clip_noise(
                [gw, gb],
                cfg.l2_norm_clip,
                cfg.noise_multiplier,
                denominator=q * n,  # fixed expected denominator: the sample size stays private
                seed=None if seed is None else seed + 2 * t + 1,
            )
            if led is not None:  # durable before the noised average is used (McMahan et al. §6)
                led.record_release(SumQueryEvent(cfg.l2_norm_clip, cfg.noise_multiplier * cfg.l2_norm_clip))
        else:
            nw, nb = gw.sum(axis=0) / (q * n), gb.sum(axis=0) / (q * n)
        w -= cfg.learning_rate * nw
        b -= cfg.learning_rate * nb
    if led is not None:
        led.close()
    return w, b, q, steps


def epsilon_for(q: float, z: float, steps: int, delta: float) -> Optional[float]:
    """ε from the default (PLD) accountant, or None before that module exists."""
    try:
        from dpcore import accounting
    except ImportError:
        return None
    return float(accounting.epsilon(q, z, steps, delta))


def run(cfg: DemoConfig, out=sys.stdout) -> dict:
    if cfg.seed is not None:
        print("note: --seed makes the noise reproducible and voids the privacy guarantee", file=out)
    xtr, ytr, xte, yte = load_digits()
    t0 = time.perf_counter()
    w, b, q, steps = train(xtr, ytr, cfg, private=True)
    t_dp = time.perf_counter() - t0
    acc_dp = accuracy(w, b, xte, yte)
    w0, b0, _, _ = train(xtr, ytr, cfg, private=False)
    acc_np = accuracy(w0, b0, xte, yte)
    eps = epsilon_for(q, cfg.noise_multiplier, steps, cfg.delta)
    print(f"digits: {len(ytr)} train / {len(yte)} test examples, 64 features, 10 classes", file=out)
    print(
        f"DP-SGD: q={q:.4f} (expected batch {cfg.expected_batch_size}), {steps} steps, "
        f"clip C={cfg.l2_norm_clip}, noise multiplier z={cfg.noise_multiplier}, {t_dp:.2f} s",
        file=out,
    )
    print(f"test accuracy  private: {acc_dp:.4f}   non-private baseline: {acc_np:.4f}", file=out)
    if eps is None:
        print("epsilon: the accountant is not available in this build", file=out)
    else:
        from dpcore import accounting

        rdp = accounting.epsilon(q, cfg.noise_multiplier, steps, cfg.delta, accountant="rdp")
        print(
            f"privacy: ({eps:.3f}, {cfg.delta:g})-DP  (PLD accountant, Poisson sampling, add/remove; "
            f"RDP would certify {rdp:.3f})",
            file=out,
        )
    return {"accuracy_private": acc_dp, "accuracy_nonprivate": acc_np, "epsilon": eps, "steps": steps, "q": q}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.expected_batch_size, help="expected batch size q·n")
    p.add_argument("--clip", type=float, default=d.l2_norm_clip, help="L2 clip norm C")
    p.add_argument("--noise-multiplier", type=float, default=d.noise_multiplier)
    p.add_argument("--lr", type=float, default=d.learning_rate)
    p.add_argument("--delta", type=float, default=d.delta)
    p.add_argument("--seed", type=int, default=None, help="tests and reproductions only: voids privacy")
    p.add_argument("--ledger", default=None, help="record the private run in this ledger file (see dpcore report)")


def from_args(a: argparse.Namespace) -> DemoConfig:
    return DemoConfig(a.epochs, a.batch_size, a.clip, a.noise_multiplier, a.lr, a.delta, a.seed, a.ledger)
