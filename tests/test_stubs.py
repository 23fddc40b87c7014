"""The extension's type stubs match the module (mypy's stubtest) and document every function."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import dpcore

STUB = os.path.join(os.path.dirname(dpcore.__file__), "_core.pyi")


def test_stubtest_finds_no_difference() -> None:
    res = subprocess.run([sys.executable, "-m", "mypy.stubtest", "dpcore._core"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "Success" in res.stdout


def test_every_stub_function_has_a_docstring() -> None:
    tree = ast.parse(open(STUB, encoding="utf-8").read())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert len(funcs) >= 19
    undocumented = [f.name for f in funcs if not ast.get_docstring(f)]
    assert undocumented == []
