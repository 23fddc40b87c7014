"""The model, each partition's data and a client's local training: plain numpy, deterministic,
so that the test recomputes every client's update bit for bit in its own process."""

from __future__ import annotations

from typing import Dict

import numpy as np

DIM = 4
EXAMPLES = 48
LEARNING_RATE = 0.2


def initial_model() -> Dict[str, np.ndarray]:
    """Linear regression y = X·w + b, float64 (so that the test can compare to ~1e-12)."""
    return {"w": np.zeros(DIM, np.float64), "b": np.zeros(1, np.float64)}


def partition(pid: int):
    """Partition ``pid``'s examples: its own features and its own true weights (the clients
    disagree, so every client's update is different)."""
    rng = np.random.default_rng(1000 + pid)
    x = rng.standard_normal((EXAMPLES, DIM))
    w_true = np.linspace(-1.0, 1.0, DIM) + 0.5 * pid
    y = x @ w_true + (0.3 * pid - 0.2) + 0.05 * rng.standard_normal(EXAMPLES)
    return x, y


def local_train(model: Dict[str, np.ndarray], pid: int, steps: int) -> Dict[str, np.ndarray]:
    """``steps`` full-batch gradient steps of the mean squared error from ``model``."""
    x, y = partition(pid)
    w, b = model["w"].astype(np.float64).copy(), model["b"].astype(np.float64).copy()
    for _ in range(steps):
        err = x @ w + b[0] - y
        w -= LEARNING_RATE * (x.T @ err) / EXAMPLES
        b -= LEARNING_RATE * np.array([err.mean()])
    return {"w": w, "b": b}
