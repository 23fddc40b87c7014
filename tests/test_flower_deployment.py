"""dpcore.flower on Flower's deployment engine, with a SuperNode killed mid-run (issue 41).

A SuperLink and three SuperNodes run as separate processes on localhost (insecure, free ports
chosen at runtime), started from Flower's console scripts; ``flwr run`` ships the app of
``tests/flower_app`` to the SuperLink as a FAB. Its ServerApp runs
``DifferentialPrivacy(FedAvg(fraction_evaluate=0), population_size=3, sampling_probability=1,
...)`` for three rounds with a short round timeout. In round 2 the ClientApp of partition 2 (the
victim) leaves a marker file and sleeps; the test then kills its SuperNode with SIGKILL (the
node, its SuperExec and the sleeping ClientApp: a crash, no goodbye to the SuperLink), so the
node dies while the server waits for it, and is still on the SuperLink's list of nodes but dead
in round 3 (the server sends it the model and hears nothing).

Checked afterwards: the ledger holds one sample and one release per round (every round
released despite the dead node); the ε the ServerApp logged in dpcore's metrics is
``PrivacyLedger.load(path).get_epsilon(δ)``; the final model is finite and moved; and every
round's global model equals a brute force computed here from the clients' own code: the
clipped updates of the clients the server heard from, plus the round's noise, over the fixed
denominator 3, so the dead node contributed exactly zero from its death on while the
denominator stayed 3. The noise is seeded (``seed=``, for tests only) and replayed in this
process by the same strategy on an in-process grid whose clients send back the model
unchanged: the brute force takes nothing else from dpcore.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest

pytest.importorskip("flwr")

APP_DIR = Path(__file__).resolve().parent / "flower_app"
sys.path.insert(0, str(APP_DIR))

from dpcore_e2e.task import initial_model, local_train  # noqa: E402  (the ClientApp's own code)
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

import dpcore  # noqa: E402
import dpcore.flower as dpf  # noqa: E402
from dpcore.flower.testing import LocalGrid  # noqa: E402
from dpcore.ledger import PrivacyLedger  # noqa: E402

NODES = 3  # SuperNodes, partitions 0..2; population_size of the strategy
ROUNDS = 3
VICTIM = 2  # the partition whose SuperNode is killed ...
VICTIM_ROUND = 2  # ... while the server waits for it in this round (it is dead in the next ones)
NOISE = 0.7
CLIP = 1.0
DELTA = 1e-5
SEED = 20240541
LOCAL_STEPS = 5
# The server waits this long for the replies of a round. A healthy round takes 6-13 s on 2
# busy cores: the SuperNode polls the SuperLink every 3 s and starts a ClientApp process per
# message, and the server's grid polls for replies every 3 s, the last time before the timeout
# (so 19 s is an 18 s window). The dead node costs about 21 s in every round from its death
# on: the SuperLink only notices a crashed node after two missed 30 s heartbeats.
ROUND_TIMEOUT = 19.0
STARTUP_TIMEOUT = 60.0  # each process's readiness
RUN_TIMEOUT = 150.0  # the whole run, a failure bound only


# -- the engine's processes ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail_text(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return _tail_text(path.read_text(errors="replace"), lines)
    except OSError:
        return "(no log)"


class Engine:
    """Flower's processes, each with its own FLWR_HOME and log file under ``root``.

    Every process is started in a new session with an environment variable that names it
    (``DPCORE_E2E_PROC=<run tag>:<name>``); its descendants inherit it. The SuperLink and the
    SuperNodes start their SuperExec (which starts the ServerApp and ClientApp processes), some
    in sessions of their own, and a killed parent leaves them to init: so a kill takes every
    process whose environment carries the name (read from /proc), not only a process group."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = uuid.uuid4().hex
        self.procs: Dict[str, subprocess.Popen] = {}
        self.logs: Dict[str, Path] = {}
        self.path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        dpcore_root = os.path.dirname(os.path.dirname(os.path.abspath(dpcore.__file__)))
        no_proxy = ",".join(
            p for p in ("127.0.0.1,localhost", os.environ.get("NO_PROXY", os.environ.get("no_proxy"))) if p)
        self.env = dict(
            os.environ,
            PATH=self.path,  # Flower starts flower-superexec, flwr-serverapp... by name
            # the ServerApp imports the dpcore under test, from where this process imports it
            PYTHONPATH=os.pathsep.join(p for p in (dpcore_root, os.environ.get("PYTHONPATH")) if p),
            FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1",  # no request to flower.ai (offline)
            PYTHONUNBUFFERED="1",
            NO_PROXY=no_proxy, no_proxy=no_proxy,  # HTTP and gRPC to the engine stay on localhost
        )

    def home(self, name: str) -> Path:
        h = self.root / f"home-{name}"
        h.mkdir(exist_ok=True)
        return h

    def command(self, script: str) -> str:
        exe = shutil.which(script, path=self.path)
        if exe is None:
            pytest.fail(f"Flower's console script {script!r} is not installed next to {sys.executable}")
        return exe

    def start(self, name: str, script: str, *args: str) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        env = dict(self.env, FLWR_HOME=str(self.home(name)), DPCORE_E2E_PROC=f"{self.tag}:{name}")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [self.command(script), *args], env=env, cwd=self.home(name), stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.procs[name], self.logs[name] = proc, log
        return proc

    def wait_for(self, name: str, pattern: str, timeout: float = STARTUP_TIMEOUT) -> "re.Match[str]":
        """The first match of ``pattern`` in ``name``'s log; fails (with the log) if the
        process exits first or nothing matches within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.logs[name].read_text(errors="replace")
            m = re.search(pattern, text)
            if m:
                return m
            rc = self.procs[name].poll()
            if rc is not None:
                pytest.fail(f"{name} exited with code {rc} before it was ready (engine could not start):\n"
                            f"{_tail(self.logs[name])}")
            if time.monotonic() > deadline:
                pytest.fail(f"{name} was not ready within {timeout:g} s (no {pattern!r} in its log):\n"
                            f"{_tail(self.logs[name])}")
            time.sleep(0.2)

    def check_alive(self, name: str) -> None:
        rc = self.procs[name].poll()
        if rc is not None:
            pytest.fail(f"{name} exited with code {rc} during the run:\n{_tail(self.logs[name])}")

    def processes(self, name: Optional[str] = None) -> Dict[int, str]:
        """{pid: command line} of the live processes started as ``name`` (all of this engine's
        with None) and of their descendants, found by the environment variable they inherit
        (a zombie's is empty: it is not counted)."""
        want = f"DPCORE_E2E_PROC={self.tag}:{name or ''}".encode()
        found = {}
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                if any(v == want if name else v.startswith(want) for v in env):
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # gone, or not ours
        return found

    def kill(self, name: Optional[str] = None) -> None:
        """SIGKILL ``name`` (every process with None) with all its descendants, then reap."""
        names = [name] if name else list(self.procs)
        for n in names:
            if self.procs[n].poll() is None:  # not reaped yet: its pid is still its own
                try:
                    os.killpg(self.procs[n].pid, signal.SIGKILL)  # its session's group (all, where /proc is absent)
                except (ProcessLookupError, PermissionError):
                    pass
        for _ in range(50):  # a parent may start a child while dying: sweep until none is left
            pids = list(self.processes(name))
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.1)
        for n in names:
            try:
                self.procs[n].wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """The ``flwr`` CLI, with the engine's connection in its own FLWR_HOME."""
        env = dict(self.env, FLWR_HOME=str(self.home("cli")), DPCORE_E2E_PROC=f"{self.tag}:cli")
        try:
            return subprocess.run([self.command("flwr"), *args], env=env, cwd=self.home("cli"),
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"`flwr {' '.join(args)}` did not return within {timeout:g} s:\n{e.stdout}\n{e.stderr}")

    def run_log(self, run_id: str) -> str:
        """The run's logs as the SuperLink holds them (the ServerApp's output), for a failure."""
        res = self.flwr("log", str(run_id), "e2e", "--show", timeout=30.0)
        return _tail_text(res.stdout + res.stderr)


def start_engine(engine: Engine) -> Dict[int, int]:
    """Starts the SuperLink and the SuperNodes; returns {node id: partition id}."""
    link_port = _free_port()
    # One HTTP port serves the Control, ServerAppIo (runtime) and Fleet APIs in Flower 1.42;
    # no `uv sync` of the app's dependencies (offline: the test's environment has them).
    engine.start("superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(link_port),
                 "--disable-runtime-dependency-installation")
    engine.wait_for("superlink", r"Uvicorn running on http://127\.0\.0\.1:\d+")
    nodes = {}
    for pid in range(NODES):
        engine.start(f"node{pid}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                     "--port", str(_free_port()),  # the SuperNode's own runtime API, for its ClientApps
                     "--node-config", f"partition-id={pid} num-partitions={NODES}")
    for pid in range(NODES):
        m = engine.wait_for(f"node{pid}", r"SuperNode ID: (\d+)")
        nodes[int(m.group(1))] = pid
    # The CLI's connection to this SuperLink (Flower 1.42 reads it from $FLWR_HOME/config.toml).
    (engine.home("cli") / "config.toml").write_text(
        f'[superlink]\ndefault = "e2e"\n\n[superlink.e2e]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n'
    )
    return nodes


# -- the run ------------------------------------------------------------------------------


def run_config(out: Path) -> str:
    """The run config: everything the ServerApp and ClientApps read (pyproject's defaults
    overridden, so this file is the one place the numbers live)."""
    import tomli_w

    return tomli_w.dumps({
        "num-server-rounds": ROUNDS, "population-size": NODES, "noise-multiplier": NOISE, "max-grad-norm": CLIP,
        "target-delta": DELTA, "seed": SEED, "round-timeout": ROUND_TIMEOUT, "local-steps": LOCAL_STEPS,
        "victim-partition": VICTIM, "victim-round": VICTIM_ROUND, "victim-sleep": 3 * RUN_TIMEOUT,
        "out-dir": str(out),
    })


def replay_in_process():
    """The same strategy and seed on an in-process grid whose clients send the model back
    unchanged: every update is zero, so each release moves the model by the round's noise over
    the denominator, and nothing else. Returns each round's noise (on the sum) and ε."""

    def echo(msg, ctx):
        sent = msg.content["arrays"]
        return Message(RecordDict({"arrays": ArrayRecord({k: Array(sent[k].numpy()) for k in sent.keys()}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    models = []

    def keep(server_round, arrays):
        models.append({k: arrays[k].numpy().copy() for k in arrays.keys()})

    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the strategy's per-round log: the ServerApp's run has printed it
    dp = dpf.DifferentialPrivacy(
        FedAvg(fraction_evaluate=0.0), population_size=NODES, sampling_probability=1.0, noise_multiplier=NOISE,
        max_grad_norm=CLIP, target_delta=DELTA, num_rounds=ROUNDS, ledger=None, seed=SEED,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = dp.start(LocalGrid({i + 1: echo for i in range(NODES)}),
                           ArrayRecord({k: Array(v) for k, v in initial_model().items()}), num_rounds=ROUNDS,
                           timeout=1, evaluate_fn=keep)
    finally:
        logger.setLevel(level)
        os.unlink(dp.ledger.path)
    noise = [{k: dp.denominator * (models[t][k] - models[t - 1][k]) for k in models[t]} for t in range(1, ROUNDS + 1)]
    return noise, [res.train_metrics_clientapp[t]["dpcore.epsilon"] for t in range(1, ROUNDS + 1)]


def clipped_update(model: Dict[str, np.ndarray], pid: int) -> Dict[str, np.ndarray]:
    """Partition ``pid``'s update from ``model``, clipped to CLIP (flat: one norm over all arrays)."""
    new = local_train(model, pid, LOCAL_STEPS)
    delta = {k: new[k] - model[k] for k in model}
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in delta.values()))
    return {k: d * min(1.0, CLIP / norm) for k, d in delta.items()}


def run_engine(tmp_path: Path, out: Path, observed: Dict) -> Dict[int, int]:
    """Starts the engine, runs the app, kills the victim's SuperNode when its ClientApp waits in
    the victim round, waits for the ServerApp's result, and stops every process (also on
    failure). Returns {node id: partition id}."""
    engine = Engine(tmp_path)
    marker = out / f"victim-waiting-round-{VICTIM_ROUND}"
    t0 = time.monotonic()
    try:
        nodes = start_engine(engine)
        observed["engine_start_s"] = round(time.monotonic() - t0, 1)
        (tmp_path / "run-config.toml").write_text(run_config(out))
        res = engine.flwr("run", str(APP_DIR), "e2e", "--run-config", str(tmp_path / "run-config.toml"),
                          "--format", "json")
        brace = res.stdout.find("{")  # --format json: one JSON object, maybe after a warning
        run = json.loads(res.stdout[brace:]) if brace >= 0 else {}
        assert res.returncode == 0 and run.get("success"), (
            f"flwr run failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        observed["run_id"] = run["run-id"]
        t_run = time.monotonic()
        deadline = t_run + RUN_TIMEOUT
        server_seen = False
        while not (out / "result.json").exists():
            if (out / "server-error.txt").exists():
                pytest.fail(f"the ServerApp failed:\n{(out / 'server-error.txt').read_text()}")
            # The ServerApp is a process of the SuperLink's SuperExec: gone without a result
            # (an import error, a crash) is a failure now, not at RUN_TIMEOUT.
            if any("flwr-serverapp" in c for c in engine.processes("superlink").values()):
                server_seen = True
            elif server_seen and not (out / "result.json").exists():
                pytest.fail(f"the ServerApp exited without a result; its log:\n{engine.run_log(run['run-id'])}")
            if "killed_at" not in observed and marker.exists():
                engine.kill(f"node{VICTIM}")
                observed["killed_at"] = time.time()
                assert engine.processes(f"node{VICTIM}") == {}, "the victim's processes survived SIGKILL"
            engine.check_alive("superlink")
            if time.monotonic() > deadline:
                pytest.fail(f"the run did not finish within {RUN_TIMEOUT:g} s; the ServerApp's log:\n"
                            f"{engine.run_log(run['run-id'])}\nthe SuperLink's:\n{_tail(engine.logs['superlink'])}")
            time.sleep(0.2)
        observed["run_s"] = round(time.monotonic() - t_run, 1)
        assert "killed_at" in observed, f"the victim never reached round {VICTIM_ROUND} (no {marker.name})"
        for pid in range(NODES):
            if pid != VICTIM:
                engine.check_alive(f"node{pid}")
    finally:
        engine.kill()
    assert engine.processes() == {}, "processes of the engine survived the cleanup"
    observed["engine_total_s"] = round(time.monotonic() - t0, 1)
    return nodes


def test_deployment_engine_node_killed_mid_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    observed: Dict = {}
    nodes = run_engine(tmp_path, out, observed)
    victim_node = next(n for n, p in nodes.items() if p == VICTIM)

    result = json.loads((out / "result.json").read_text())
    with np.load(out / "models.npz") as f:
        models = {r: {k: f[f"round{r}/{k}"] for k in ("w", "b")} for r in range(ROUNDS + 1)}
        final = {k: f[f"final/{k}"] for k in ("w", "b")}

    # Who the server heard from, per round: everyone before the victim round, the survivors from
    # it on (a survivor missing a round means ROUND_TIMEOUT is too short for the machine).
    t_first = result["rounds"]["1"]["started"]
    heard: Dict[int, List[int]] = {}
    observed["rounds"] = {}
    for r in range(1, ROUNDS + 1):
        rec = result["rounds"][str(r)]
        ok = [x for x in rec["replies"] if not x["error"]]
        for x in ok:
            assert nodes[x["node"]] == x["partition"], "a node's reply names another partition than its node config"
        heard[r] = sorted(nodes[x["node"]] for x in ok)
        survivors = list(range(NODES)) if r < VICTIM_ROUND else [p for p in range(NODES) if p != VICTIM]
        assert heard[r] == survivors, (
            f"round {r}: heard from partitions {heard[r]}, expected {survivors} (ROUND_TIMEOUT={ROUND_TIMEOUT:g} s "
            "too short for this machine?)")
        observed["rounds"][r] = {
            "sent_to_partitions": sorted(nodes[n] for n in rec["sent"]),
            "heard_from_partitions": heard[r],
            "errors": sum(x["error"] for x in rec["replies"]),
            "seconds": [round(rec["started"] - t_first, 1), round(rec["finished"] - t_first, 1)],
        }
    killed = observed.pop("killed_at") - t_first
    assert result["rounds"][str(VICTIM_ROUND)]["started"] - t_first < killed, "the victim was killed before its round"
    observed["victim"] = {"partition": VICTIM, "node_id": victim_node, "killed_s": round(killed, 1),
                          "in_round": VICTIM_ROUND}

    # The ledger: one sample and one release per round, every round released.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seeded samples' LedgerWarning (seed= is for tests)
        ledger = PrivacyLedger.load(out / "dp.ledger")
        eps_ledger = ledger.get_epsilon(DELTA)
    assert ledger.privacy_unit == "user"
    assert ledger.num_releases == ROUNDS
    assert len(ledger.samples) == ROUNDS
    for i, s in enumerate(ledger.samples):
        assert (s.sample, s.population_size, s.sampling_probability, s.policy) == (i, NODES, 1.0, "poisson")
        assert [(q.l2_norm_clip, q.stddev) for q in s.queries] == [(CLIP, pytest.approx(NOISE * CLIP))]

    # dpcore's metrics: a release per round, every roster client sampled, ε growing; the last ε
    # is the ledger's at the same δ, and every round's is the in-process replay's.
    metrics = [result["metrics"][str(r)] for r in range(1, ROUNDS + 1)]
    eps = [m["dpcore.epsilon"] for m in metrics]
    assert [m["dpcore.releases"] for m in metrics] == list(range(1, ROUNDS + 1))
    assert all(m["dpcore.sampled-clients"] == NODES and m["dpcore.delta"] == DELTA for m in metrics)
    assert all(math.isfinite(e) and e > 0 for e in eps) and eps == sorted(eps)
    assert eps[-1] == pytest.approx(eps_ledger, rel=1e-9)
    noise, eps_replay = replay_in_process()
    assert eps == pytest.approx(eps_replay, rel=1e-9)

    # The model: finite, moved, and every round's equal to the brute force: the clipped updates
    # of the clients the server heard from, plus the round's noise, over the fixed denominator.
    init = initial_model()
    assert all(np.isfinite(final[k]).all() for k in final)
    assert math.sqrt(sum(float(np.sum((final[k] - init[k]) ** 2)) for k in init)) > 0.1
    for k in init:
        np.testing.assert_array_equal(models[0][k], init[k])
        np.testing.assert_array_equal(final[k], models[ROUNDS][k])
    w = init
    for r in range(1, ROUNDS + 1):
        total = {k: noise[r - 1][k].copy() for k in w}
        for pid in heard[r]:
            for k, d in clipped_update(w, pid).items():
                total[k] += d
        w = {k: w[k] + total[k] / NODES for k in w}
        for k in w:
            np.testing.assert_allclose(models[r][k], w[k], rtol=0, atol=1e-9, err_msg=f"round {r}, {k!r}")
    # The check has power: the victim's update, had it been counted in its round, is not small.
    missed = clipped_update(models[VICTIM_ROUND - 1], VICTIM)
    assert math.sqrt(sum(float(np.sum(d * d)) for d in missed.values())) / NODES > 0.05

    observed.update(epsilon=[round(e, 6) for e in eps], epsilon_ledger=round(eps_ledger, 6), delta=DELTA,
                    ledger={"releases": ledger.num_releases, "samples": len(ledger.samples)},
                    final_model={k: np.round(v, 6).tolist() for k, v in final.items()})
    print("\ndeployment-engine run:", json.dumps(observed))
