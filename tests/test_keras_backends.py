"""Runs the dpcore.keras cases (tests/keras_backend_cases.py) once per Keras backend, each in a
fresh process: Keras reads KERAS_BACKEND once, when it is imported (and TensorFlow and the CUDA
build of torch abort when both are loaded into one process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
CASES = os.path.join(HERE, "keras_backend_cases.py")

#: Keras backend -> the framework it needs.
FRAMEWORKS = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}


@pytest.mark.parametrize("backend", list(FRAMEWORKS))
def test_keras_backend_cases_in_subprocess(backend):
    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras not installed")
    if importlib.util.find_spec(FRAMEWORKS[backend]) is None:
        pytest.skip(f"{FRAMEWORKS[backend]} not installed")
    env = dict(os.environ, KERAS_BACKEND=backend)
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", CASES],
                               capture_output=True, text=True, timeout=600, env=env)
    n = sum(1 for line in collected.stdout.splitlines() if "::" in line)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEsx", "--tb=short", "-p", "no:cacheprovider", CASES],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"KERAS_BACKEND={backend}\n" + r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    # every collected case ran and passed: none skipped, xfailed or deselected
    assert n >= 30 and f"{n} passed" in summary, r.stdout[-2000:]
    assert not any(w in summary for w in ("skipped", "xfail", "deselected", "error")), summary
