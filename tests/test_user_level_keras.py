"""User-level DP in the Keras adapter (issue 40): runs tests/tf_user_level_cases.py in a fresh
process (TensorFlow and the CUDA build of torch abort when both are loaded into one process).
``python -m pytest tests/tf_user_level_cases.py`` runs the cases themselves, one by one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


def test_user_level_keras_cases_in_subprocess():
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow not installed")
    cases = os.path.join(HERE, "tf_user_level_cases.py")
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", cases],
                               capture_output=True, text=True, timeout=600)
    n = sum(1 for line in collected.stdout.splitlines() if "::" in line)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsx", "-p", "no:cacheprovider", cases],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    # every collected case ran and passed: none skipped, xfailed or deselected
    assert n >= 30 and f"{n} passed" in summary, r.stdout[-2000:]
    assert not any(w in summary for w in ("skipped", "xfail", "deselected", "error")), summary
