"""The GPU suite's script (benches/gpu/run.sh) in its CPU dry run: every step runs and exits 0,
and the summary holds each step's table. Keeps the script from rotting between GPU sessions."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_suite_dry_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    p = subprocess.run([os.path.join(ROOT, "benches", "gpu", "run.sh"), "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    steps = re.findall(r"^## (.+)$", summary, flags=re.M)
    assert len(steps) == 8, steps
    exits = re.findall(r"→ exit (\d+)", summary)
    assert exits == ["0"] * 8, summary[-3000:]
    assert "dry run" in summary
    for table in ("skipped", "non-private torch", "dpcore.torch", "transformers.Trainer", "dpcore DPTrainer", "== cpu",
                  "ULS / example-level median step", "CUDA-synchronising operators per step"):
        assert table in summary, table
    for f in ("torch.json", "memory.json", "trainer.json", "noise.json", "users.json", "ops.json", "log.txt"):
        assert (tmp_path / f).stat().st_size > 0, f
