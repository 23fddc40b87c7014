"""The main job runs end to end and learns."""

import subprocess
import sys

from dpcore import demo


def test_demo_learns_and_reports():
    # A fixed seed (tests only): with OS-seeded sampling the non-private baseline's last steps
    # (learning rate 4, samples of ~256) left it at exactly 0.90 once in CI, at 0.94-0.96 usually.
    res = demo.run(demo.DemoConfig(epochs=8, seed=0))
    assert res["accuracy_nonprivate"] > 0.9
    assert res["accuracy_private"] > 0.8
    # ε of the run equals the accountant's for the same (q, z, steps): the demo reports what it did.
    from dpcore import accounting

    assert res["epsilon"] == accounting.epsilon(res["q"], 3.0, res["steps"], 1e-5)
    assert 0 < res["epsilon"] < 10


def test_cli_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "dpcore", "demo", "--epochs", "2"], capture_output=True, text=True, check=True
    ).stdout
    assert "test accuracy  private:" in out and "non-private baseline:" in out and "-DP" in out
