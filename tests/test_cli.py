"""The command line, driven through subprocess as a user runs it: epsilon, calibrate, report,
plot, and the exit codes and one-line errors of bad input."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import dpcore
from dpcore import accounting
from dpcore.events import SumQueryEvent


def run(*args: str, check_rc: int = 0) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "dpcore", *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == check_rc, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    return res


def js(*args: str) -> dict:
    return json.loads(run(*args, "--json").stdout)


def test_epsilon_matches_the_library() -> None:
    out = js("epsilon", "-q", "0.01", "-z", "1.1", "--steps", "1000", "--delta", "1e-5")
    assert out["accountant"] == "pld"
    assert out["epsilon"] == accounting.epsilon(0.01, 1.1, 1000, 1e-5)
    assert out["epsilon_rdp"] == accounting.epsilon(0.01, 1.1, 1000, 1e-5, accountant="rdp")
    assert out["epsilon_pld_lower_bound"] <= out["epsilon"] < out["epsilon_rdp"]
    rdp = js("epsilon", "-q", "0.01", "-z", "1.1", "--steps", "1000", "--delta", "1e-5", "--accountant", "rdp")
    assert rdp["accountant"] == "rdp" and rdp["epsilon"] == out["epsilon_rdp"]
    # --epochs with -q stands in for --steps: 10 epochs at q = 0.01 are 1000 steps
    ep = js("epsilon", "-q", "0.01", "-z", "1.1", "--epochs", "10", "--delta", "1e-5")
    assert ep["steps"] == 1000 and ep["epsilon"] == out["epsilon"]
    text = run("epsilon", "-q", "0.01", "-z", "1.1", "--steps", "1000", "--delta", "1e-5").stdout
    assert f"{out['epsilon']:.6g}" in text and "RDP" in text


def test_calibrate_finds_each_missing_parameter() -> None:
    z = js("calibrate", "--epsilon", "2", "--delta", "1e-5", "-q", "0.01", "--steps", "1000")["noise_multiplier"]
    assert z == accounting.calibrate_noise_multiplier(2.0, 1e-5, 0.01, 1000)
    assert accounting.epsilon(0.01, z, 1000, 1e-5) <= 2.0
    z5 = js("calibrate", "--epsilon", "2", "--delta", "1e-5", "-q", "0.01", "--epochs", "10")
    assert z5["steps"] == 1000 and z5["noise_multiplier"] == z
    run("calibrate", "--epsilon", "2", "--delta", "1e-5", "-z", "1.0", "--epochs", "5", "-q", "0.01", check_rc=2)
    q = js("calibrate", "--epsilon", "2", "--delta", "1e-5", "-z", "1.0", "--steps", "1000")["sampling_probability"]
    assert q == accounting.calibrate_sampling_probability(2.0, 1e-5, 1.0, 1000)
    t = js("calibrate", "--epsilon", "2", "--delta", "1e-5", "-z", "1.0", "-q", "0.01")["steps"]
    assert t == accounting.calibrate_steps(2.0, 1e-5, 0.01, 1.0)


def _ledger(path: Path, steps: int = 30) -> dpcore.PrivacyLedger:
    with dpcore.PrivacyLedger(path) as led:
        for i in range(steps):
            led.record_sample(10_000, 0.02 if i < 20 else 0.05, "poisson")
            led.record_release(SumQueryEvent(1.0, 1.2))
            led.record_release(SumQueryEvent(0.5, 0.9))  # a second query group (Eq. 1)
    return dpcore.PrivacyLedger.load(path)


def test_report_matches_the_ledger(tmp_path: Path) -> None:
    p = tmp_path / "run.jsonl"
    led = _ledger(p)
    out = js("report", str(p), "--delta", "1e-6")
    assert out["epsilon"] == led.get_epsilon(1e-6)
    assert out["epsilon_rdp"] == led.get_epsilon(1e-6, "rdp")
    assert out["epsilon_lower_bound"] <= out["epsilon"]
    assert out["ledger_sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert out["releases"] == 30 and out["privacy_unit"] == "example" and out["neighboring"] == "add_or_remove"
    assert out["accountant"] == "pld" and out["delta"] == 1e-6 and out["dpcore_version"] == dpcore.__version__
    assert out["setting"] == "central"
    assert out["noise_multiplier"] == [1.2, 1.8]
    z = 1.0 / (1 / 1.2**2 + 1 / 1.8**2) ** 0.5
    assert out["effective_noise_multiplier"] == pytest.approx(z, rel=1e-12)
    segs = out["segments"]
    assert [(s["steps"], s["policy"], s["sampling_probability"]) for s in segs] == [(20, "poisson", 0.02), (10, "poisson", 0.05)]
    assert any("tuning" in a for a in out["assumptions"]) and any("shuffle" in a for a in out["assumptions"])
    assert out["warnings"] == []
    assert led.report(1e-6).to_dict() == out  # the Python API gives the same object
    md = run("report", str(p), "--delta", "1e-6").stdout
    assert hashlib.sha256(p.read_bytes()).hexdigest() in md and "| Unit of privacy | example |" in md
    assert f"{out['epsilon']:.6g}" in md


def test_report_states_warnings_and_the_unit(tmp_path: Path) -> None:
    p = tmp_path / "user.jsonl"
    with dpcore.PrivacyLedger(p, privacy_unit="user") as led:
        led.record_sample(500, 0.1, "poisson", seeded=True)
        led.record_release(SumQueryEvent(1.0, 2.0))
        led.record_sample(500, None, "shuffle", sample_size=50)
        led.record_release(SumQueryEvent(1.0, 2.0))
    out = js("report", str(p), "--delta", "1e-5")
    assert out["privacy_unit"] == "user"
    text = " ".join(out["warnings"])
    assert "test seed" in text and "shuffle" in text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert out["epsilon"] == dpcore.PrivacyLedger.load(p).get_epsilon(1e-5)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    p = tmp_path / "run.jsonl"
    _ledger(p, steps=40)
    png = tmp_path / "eps.png"
    out = js("plot", str(p), "--delta", "1e-5", "-o", str(png), "--points", "20")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    from matplotlib import image

    img = image.imread(str(png))
    assert img.shape[0] > 200 and img.shape[1] > 300
    led = dpcore.PrivacyLedger.load(p)
    assert out["epsilon_pld"] == led.get_epsilon(1e-5) and out["points"] == 20
    curve = led.epsilon_curve(1e-5, points=20)
    assert all(a <= b for a, b in zip(curve["pld"], curve["pld"][1:]))  # ε grows with the steps
    assert curve["pld"][-1] >= curve["final"]["pld"]  # the coarse grid is an upper bound too


@pytest.mark.parametrize(
    "args",
    [
        ["epsilon", "-q", "1.5", "-z", "1", "--steps", "10", "--delta", "1e-5"],
        ["epsilon", "-q", "0.1", "-z", "1", "--steps", "10", "--delta", "0"],
        ["epsilon", "-q", "0.1", "-z", "1", "--delta", "1e-5"],
        ["epsilon", "-q", "0.1", "-z", "-1", "--steps", "10", "--delta", "1e-5"],
        ["calibrate", "--epsilon", "1", "--delta", "1e-5", "-q", "0.1"],
        ["report", "x.jsonl", "--delta", "0"],
        ["nonsense"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list) -> None:
    res = run(*args, check_rc=2)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "error" in lines[0], res.stderr


def test_bad_data_exit_1_with_one_line(tmp_path: Path) -> None:
    cases = {}
    cases["missing"] = (str(tmp_path / "nope.jsonl"), "no such file")
    cases["directory"] = (str(tmp_path), "directory")
    p = tmp_path / "corrupt.jsonl"
    _ledger(p, steps=3)
    lines = p.read_text().splitlines()
    lines[2] = lines[2].replace('"stddev": 1.2', '"stddev": "x"')
    p.write_text("\n".join(lines) + "\n")
    cases["corrupt"] = (str(p), "line 3")
    for cmd in ("report", "plot"):
        for name, (path, want) in cases.items():
            extra = ["-o", str(tmp_path / "x.png")] if cmd == "plot" else []
            res = run(cmd, path, "--delta", "1e-5", *extra, check_rc=1)
            err = [x for x in res.stderr.splitlines() if x.strip()]
            assert len(err) == 1 and want in err[0], (cmd, name, res.stderr)


def test_demo_ledger_report(tmp_path: Path) -> None:
    p = tmp_path / "demo.jsonl"
    res = js("demo", "--epochs", "1", "--ledger", str(p))
    out = js("report", str(p), "--delta", "1e-5")
    assert out["releases"] == res["steps"] > 0 and out["noise_multiplier"] == [3.0]
    assert out["epsilon"] == pytest.approx(res["epsilon"], rel=1e-12)


def test_audit_exit_codes_gate_a_ci_job(capsys) -> None:
    # passes: exit 0, the three analyses printed beside the claim
    ok = run("audit", "-z", "1.898", "-q", "1", "--steps", "10", "--canaries", "20000")
    assert ok.stdout.startswith("audit passed") and "Steinke" in ok.stdout and "f-DP" in ok.stdout
    assert "Gaussian-DP fit" in ok.stdout and "claimed μ = 1.666" in ok.stdout
    # 4× too little noise: the result, then exit 3 (AUDIT_FAILED), with --json too
    bad = run("audit", "-z", "1.898", "-q", "1", "--steps", "10", "--canaries", "100000",
              "--actual-noise-multiplier", "0.4745", "--json", check_rc=3)
    out = json.loads(bad.stdout)
    assert out["passed"] is False and out["exit_code"] == 3 and out["fdp_curve"] == "gaussian"
    assert out["epsilon_lower_bound_fdp"] > out["epsilon_claimed"] == pytest.approx(8.0, abs=0.01)
    # in process: main() raises SystemExit(3) after printing
    from dpcore import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "-z", "3", "--canaries", "20000", "--actual-noise-multiplier", "0.75"])
    assert e.value.code == cli.AUDIT_FAILED == 3
    assert "audit FAILED" in capsys.readouterr().out
    assert cli.main(["audit", "-z", "3", "--canaries", "20000"]) == 0
    run("audit", "-z", "3", "--canaries", "5", check_rc=2)  # bad arguments keep exit code 2


def test_epsilon_sampler_all_lists_every_selectable_sampler() -> None:
    """``--sampler all`` has a row for every sampler a run can select (random allocation
    included, whatever --num-selected), and says why one cannot be accounted from the
    arguments given instead of leaving it out."""
    from dpcore.sampling import registered_samplers

    out = js("epsilon", "-q", "0.01", "-z", "1", "--steps", "1000", "--delta", "1e-5", "--sampler", "all")
    rows = {r["sampler"]: r for r in out["samplers"]}
    selectable = registered_samplers(selectable=True)
    assert "random_allocation" in selectable
    assert set(selectable) <= set(rows)
    assert [r["sampler"] for r in out["samplers"]][: len(selectable)] == list(selectable)
    assert rows["random_allocation"]["epsilon"] == accounting.sampler_epsilon(
        "random_allocation", 1.0, 1000, 1e-5, sampling_probability=0.01, accountant=rows["random_allocation"]["accountant"]
    )
    assert "--population-size" in rows["truncated_poisson"]["error"]
    k2 = js("epsilon", "-q", "0.01", "-z", "1", "--steps", "1000", "--delta", "1e-5", "--sampler", "all", "--num-selected", "2")
    assert "random_allocation" in {r["sampler"] for r in k2["samplers"]}
    text = run("epsilon", "-q", "0.01", "-z", "1", "--steps", "1000", "--delta", "1e-5", "--sampler", "all").stdout
    assert all(name in text for name in selectable)
