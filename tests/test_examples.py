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
    assert r["steps"] > 0 and 0.0 <= r["dp_accuracy"] <= 1.0 and r["baseline_accuracy"] > 0.5
    if r["epsilon"] is not None:
        assert 0 < r["epsilon"] < math.inf


def test_user_level_fedavg_small():
    r = load("user_level_fedavg").main(small=True)
    assert r["rounds"] == 15 and r["baseline_accuracy"] > 0.6
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
