"""Runs the dpcore.tensorflow tests (tests/tf_cases.py) in a fresh process: TensorFlow and the
CUDA build of torch abort when both are loaded into one process (duplicate native libraries)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


def test_tensorflow_cases_in_subprocess():
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow not installed")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(HERE, "tf_cases.py")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "12 passed" in r.stdout, r.stdout[-2000:]
