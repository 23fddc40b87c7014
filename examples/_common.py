"""What the examples share: the digits data, a privacy ledger in a fresh temporary folder, ε read
without the accounting notices, the DP-SGD result line and the ``--small`` command line.

Each example puts its own folder on sys.path to import it: ``python examples/x.py`` has done so
already, a program that loads an example from its file (as the tests do) has not.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import numpy as np


def digits(train_size: int | None = None):
    """scikit-learn's digits, features scaled to [0, 1] as float32, split 75/25 with a fixed seed:
    (x_train, x_test, y_train, y_test), the training part cut to `train_size` records if given."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split((x / 16.0).astype(np.float32), y, test_size=0.25, random_state=0)
    if train_size:
        xtr, ytr = xtr[:train_size], ytr[:train_size]
    return xtr, xte, ytr, yte


def temp_ledger(prefix: str):
    """(a dpcore.PrivacyLedger in a new temporary folder, its file's path)."""
    import dpcore

    path = os.path.join(tempfile.mkdtemp(prefix=prefix), "ledger.jsonl")
    return dpcore.PrivacyLedger(path), path


def quiet_epsilon(get_epsilon, delta: float = 1e-5):
    """get_epsilon(delta), with the accounting notices silenced: they are not what the examples show."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_epsilon(delta)


def report_dp_sgd(res: dict, path: str) -> dict:
    """Print a DP-SGD run's result (accuracies, ε, steps, ledger file) and return `res`."""
    print(f"non-private accuracy {res['baseline_accuracy']:.3f} | DP-SGD accuracy {res['dp_accuracy']:.3f} "
          f"| eps = {res['epsilon']} at delta = 1e-5 after {res['steps']} steps (ledger {path})")
    return res


def parser() -> argparse.ArgumentParser:
    """The examples' command line: ``--small`` for the short run that the tests make."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    return ap
