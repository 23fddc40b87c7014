"""The examples run at small size and report accuracy next to a baseline, and ε from the ledger."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

HERE = os.path.join(os.path.dirname(__file__), "..", "examples")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_torch_digits_small():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    r = load("torch_digits").main(small=True)
    # 10 classes: chance is 0.1. The small run (few steps, σ for ε ≈ 4) reached 0.52 against a
    # baseline of 0.83 here; it must learn, not just run.
    assert r["steps"] > 0 and r["baseline_accuracy"] > 0.5
    assert r["dp_accuracy"] >= 0.25 and r["dp_accuracy"] >= 0.3 * r["baseline_accuracy"]
    if r["epsilon"] is not None:
        assert 0 < r["epsilon"] < math.inf


def test_user_level_fedavg_small():
    r = load("user_level_fedavg").main(small=True)
    assert r["rounds"] == 15 and r["baseline_accuracy"] > 0.6
    assert r["dp_accuracy"] >= 0.8 and r["dp_accuracy"] >= r["baseline_accuracy"] - 0.1  # 0.943 vs 0.944 here
    if r["epsilon"] is not None:
        assert 0 < r["epsilon"] < math.inf


def test_tf_digits_small():
    # a fresh process: TensorFlow and the CUDA build of torch cannot share one
    import subprocess
    import sys

    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow not installed")
    r = subprocess.run([sys.executable, os.path.join(HERE, "tf_digits.py"), "--small"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DP-SGD accuracy" in r.stdout and "eps =" in r.stdout
    import re

    base = float(re.search(r"non-private accuracy ([0-9.]+)", r.stdout).group(1))
    dp = float(re.search(r"DP-SGD accuracy ([0-9.]+)", r.stdout).group(1))
    # Chance is 0.1. 25 steps: in 14 runs here the baseline reached 0.83-0.89 and DP-SGD 0.42-0.60
    # (with 10 steps DP-SGD ranged 0.18-0.38 and an earlier bound of 0.2 failed once in CI).
    assert base > 0.6 and dp >= 0.3
