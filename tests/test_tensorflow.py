"""Runs the dpcore.tensorflow tests (tests/tf_cases.py) in a fresh process: TensorFlow and the
CUDA build of torch abort when both are loaded into one process (duplicate native libraries)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)


@pytest.mark.parametrize("name,least", [("tf_cases.py", 12), ("keras_tf_paths_cases.py", 12)])
def test_tensorflow_cases_in_subprocess(name, least):
    # tf_cases: the TensorFlow front end; keras_tf_paths_cases: its per-record paths (and the
    # oneDNN crash they avoid, shown in a subprocess of their own)
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow not installed")
    cases = os.path.join(HERE, name)
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", cases],
                               capture_output=True, text=True, timeout=600)
    n = sum(1 for line in collected.stdout.splitlines() if "::" in line)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsx", "-p", "no:cacheprovider", cases],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    # every collected case ran and passed: none skipped, xfailed or deselected
    assert n >= least and f"{n} passed" in summary, r.stdout[-2000:]
    assert not any(w in summary for w in ("skipped", "xfail", "deselected", "error")), summary
