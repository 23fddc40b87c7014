"""Federated learning on Flower (``dpcore.flower``): user-level (client-level) accuracy of dpcore's
DP-FedAvg and BLT DP-FTRL against Flower's own central-DP wrapper at the same ε, and the server's
time per round of each wrapper.

**The task** (``population()``; numpy seed 0, the same in every run). scikit-learn's digits (1,797
8x8 images, features scaled to [0, 1]) split once at random into a 297-image test set, held by the
server, and a 1,500-image training pool. ``--clients`` clients (default 2,000) hold
``--per-client`` examples each (default 20) with label skew in the manner of McMahan et al. 2017:
2N shards, shard j of label j mod 10, shuffled and dealt two to a client, so that every client
holds one or two labels (about a tenth hold one); a shard is ``--per-client``/2 images of its label
drawn from the training pool (with replacement) plus N(0, 0.1²) pixel noise. The model is softmax
regression (64x10 weights and 10 biases, float32, 650 parameters, zeros at the start) in an
``ArrayRecord``; a sampled client takes ``--local-steps`` (5) minibatch SGD steps of
``--local-batch`` (10) of its examples at ``--client-lr`` (0.5) and returns its model; the clients
run in this process through :class:`dpcore.flower.testing.LocalGrid` (no Ray), and each run is one
``strategy.start(grid, initial_arrays, num_rounds=T, evaluate_fn=...)`` whose ``evaluate_fn``
measures the server's test accuracy. The server's learning rate is 1 (FedAvg: the new model is the
aggregate), for every method. dpcore's ledgers are written under /dev/shm in this part.

**The methods**, at user-level ε in ``--epsilons`` (1, 4, 8) with δ = 1e-5 (< 1/N), the same T =
``--rounds`` (100), the same expected m = q·N clients a round (``--clients-per-round``, 100: q =
0.05), the same local training and the same clip C = ``--clip`` (1.0) on a client's model update:

* ``dpcore DP-FedAvg``: ``DifferentialPrivacy(FedAvg(...), population_size=N, sampler="poisson",
  sampling_probability=q, target_epsilon=ε, target_delta=δ, num_rounds=T, max_grad_norm=C)``:
  Poisson sampling of the clients, the clipped sum plus N(0, (zC)²) divided by the fixed q·N, z
  calibrated by dpcore's PLD accountant with the sampling credited (calibrated in the first seed's
  run and passed as ``noise_multiplier=`` in the others: the same z).
* ``dpcore BLT DP-FTRL``: the same with ``noise_mechanism="blt", sampler="cyclic",
  sample_size=m``: the clients dealt into b = N/m fixed groups visited in turn (min-separation b,
  T/b participations each), BLT correlated noise (Choquette-Choo et al. 2024); its z is the
  multiplier of the whole run's single Gaussian mechanism (per unit of the strategy's
  sensitivity), not comparable with a per-round z. Its ε is stated, as dpcore states it for the
  cyclic groups, for zero-out adjacency (one client's data replaced by nothing while its group
  keeps its place), the relation of DP-FTRL; the other rows' is add-or-remove one client.
* ``Flower DP (fixed clipping)``: ``flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping(
  FedAvg(fraction_train=q), noise_multiplier=z, clipping_norm=C, num_sampled_clients=m,
  accountant=RdpAccountant(PrivacyConfig(δ, N, "add-or-remove-one", "no-amplification")))`` with z
  the smallest (to 1e-4 relative, by bisection) at which *Flower's own accountant* gives ε ≤ the
  target after T rounds. That accountant (``flwr.supercore.privacy_accounting``, Flower 1.42) accepts
  only ``sampling_method="no-amplification"`` for this wrapper: it cannot credit the sampling of m
  of N clients (each client is in a round with probability m/N, which the accounting of the dpcore
  rows uses), so it charges every round as if every client took part, and needs a z 9 to 19x
  larger at the same ε here. Its clients are sampled by ``random.sample`` (m exactly), its noise
  N(0, (zC/m)²) on the average comes from ``np.random``.
* ``non-private FedAvg``: ``FedAvg(fraction_train=q)``, no clipping, no noise: the reference.

Seeds (``--seeds``, default 3): the seed fixes the clients' minibatch draws and Flower's sampling
and noise (``random`` and ``np.random``); dpcore's sampling and noise come from its ChaCha20
CSPRNG seeded by the OS (the production path, ``seed=None``), so they differ between runs too. Each
cell is the median and the min–max of the final test accuracy over the seeds. The tuning, once, on
seed 0: C ∈ {0.5, 1, 2} x client lr ∈ {0.25, 0.5, 1} on dpcore DP-FedAvg at ε = 4 (0.912–0.953),
C ∈ {0.5, 1, 2} at ε = 1 (0.926 / 0.963 / 0.933), C ∈ {0.5, 1} for Flower's wrapper at ε = 8
(0.909 / 0.912), lr ∈ {0.25, 0.5, 1} non-private (0.960 / 0.963 / 0.963): differences within
the run-to-run spread, so C = 1 and lr 0.5 for every method.

**Server time per round** (``--skip-time`` skips it). The time of ``configure_train`` plus
``aggregate_train`` of the outermost strategy (what the server does each round; the clients'
training and the grid are outside it), rounds driven by hand as ``Strategy.start`` drives them,
the contenders alternated round by round on the same clients, medians over ``--time-rounds``
rounds (after one warm-up round each). Two models: the digits model above with its real clients
(N = 2,000, 100 a round), and an MLP 784-1024-256-10 (1,068,810 float32 parameters in 6 arrays;
N = 1,000, 100 clients a round) whose clients reply at once with one of ten precomputed models
(the update's norm about 3C, so every update is clipped), so that the aggregation dominates.
Contenders: Flower's wrapper without and with its accountant; dpcore DP-FedAvg as a user gets it
(ledger in a temporary file: two fsyncs a round; PLD ε every round for the metrics), the same with
the ledger under /dev/shm, the same with ``accountant="rdp"`` (the per-round ε by RDP); dpcore
BLT (cyclic, 100 a round); non-private FedAvg as the floor. The noise multiplier is 1.0 for all (the
time of dpcore's PLD ε depends on it: 10–40 ms a round at z ≈ 2, 70–190 ms at z = 1 to 0.7, for
q = 0.05 and 1 to 200 rounds).
Then one cProfile of dpcore's default rounds on each model says where its time goes (cProfile's
own overhead inflates the Python-heavy parts).

``python benches/bench_flower.py [--seeds 3] [--rounds 100] [--clients 2000] [--epsilons 1 4 8]
[--time-rounds 20] [--quick] [--json out.json] [--skip-accuracy | --skip-time]``. The default run
takes 6 to 8 minutes on 2 CPU cores; ``--quick`` (200 clients, 20 a round, 10 rounds, 1 seed,
3 timed rounds, a 101,770-parameter MLP with 20 clients a round) under a minute.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import math
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from _timing import fill_defaults, finish, run_parts

DELTA = 1e-5
EPSILONS = (1.0, 4.0, 8.0)
TEST_SIZE = 297
PIXEL_NOISE = 0.1
METHODS = ("dpcore DP-FedAvg", "dpcore BLT DP-FTRL", "Flower DP (fixed clipping)", "non-private FedAvg")


# -- the population ---------------------------------------------------------------------------


def population(n_clients: int, per_client: int, seed: int = 0) -> Dict[str, Any]:
    """Label-skewed clients (2 shards of one label each) over the digits training pool; the test set."""
    from sklearn.datasets import load_digits

    if per_client % 2:
        raise ValueError("--per-client must be even (two shards of per_client/2 examples)")
    x_all, y_all = load_digits(return_X_y=True)
    x_all = (x_all / 16.0).astype(np.float32)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y_all))
    test, pool = perm[:TEST_SIZE], perm[TEST_SIZE:]
    by_label = [pool[y_all[pool] == c] for c in range(10)]
    half = per_client // 2
    shard_label = np.arange(2 * n_clients) % 10
    rng.shuffle(shard_label)
    labels = np.repeat(shard_label, half).reshape(n_clients, per_client)
    imgs = np.empty(labels.shape, np.int64)
    for c in range(10):
        where = labels == c
        imgs[where] = rng.choice(by_label[c], size=int(where.sum()))
    x = x_all[imgs] + rng.normal(0.0, PIXEL_NOISE, imgs.shape + (64,)).astype(np.float32)
    n_labels = np.array([len(set(r)) for r in shard_label.reshape(n_clients, 2).tolist()])
    return {"x": x.astype(np.float32), "y": labels.astype(np.int64), "x_test": x_all[test], "y_test": y_all[test],
            "one_label_clients": int((n_labels == 1).sum()), "pool": len(pool)}


def digits_arrays() -> Any:
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({"w": Array(np.zeros((64, 10), np.float32)), "b": Array(np.zeros(10, np.float32))})


def accuracy(arrays: Any, x: np.ndarray, y: np.ndarray) -> float:
    w, b = arrays["w"].numpy(), arrays["b"].numpy()
    return float(((x @ w + b).argmax(1) == y).mean())


def local_train(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray, steps: int, batch: int, lr: float,
                rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """`steps` minibatch SGD steps of softmax regression (cross-entropy), float32."""
    w, b = w.copy(), b.copy()
    n = len(y)
    lr32 = np.float32(lr)
    for _ in range(steps):
        i = rng.choice(n, size=min(batch, n), replace=False)
        xb, yb = x[i], y[i]
        z = xb @ w + b
        z -= z.max(1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(yb)), yb] -= 1.0
        p /= np.float32(len(yb))
        w -= lr32 * (xb.T @ p)
        b -= lr32 * p.sum(0)
    return w, b


def digits_clients(pop: Dict[str, Any], args: argparse.Namespace, seed: int) -> Dict[int, Callable[..., Any]]:
    """Node id k+1 holds client k's data; its minibatches are drawn from (seed, round, node)."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    x, y = pop["x"], pop["y"]
    steps, batch, lr = args.local_steps, args.local_batch, args.client_lr

    def client(msg: Any, ctx: Any) -> Any:
        nid = int(ctx.node_id)
        rec = msg.content.array_records["arrays"]
        rnd = int(msg.content.config_records["config"].get("server-round", 0))
        rng = np.random.default_rng([seed, rnd, nid])
        w, b = local_train(rec["w"].numpy(), rec["b"].numpy(), x[nid - 1], y[nid - 1], steps, batch, lr, rng)
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w), "b": Array(b)}),
                                   "metrics": MetricRecord({"num-examples": int(len(y[nid - 1]))})}), reply_to=msg)

    return {k + 1: client for k in range(len(y))}


# -- Flower's accountant -----------------------------------------------------------------------


def flower_accountant(n: int) -> Any:
    from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    return RdpAccountant(PrivacyConfig(target_delta=DELTA, population_size=n,
                                       neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                       sampling_method=SamplingMethod.NO_AMPLIFICATION))


def flower_epsilon(z: float, m: int, n: int, rounds: int) -> float:
    from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

    acc = flower_accountant(n)
    acc.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=m, population_size=n), count=rounds)
    return acc.get_epsilon(DELTA)


def calibrate_flower(target: float, m: int, n: int, rounds: int, rtol: float = 1e-4) -> float:
    """The smallest z (to `rtol` relative) whose ε by Flower's accountant is ≤ `target`:
    bisection on log z (ε falls as z grows)."""
    lo, hi = 0.1, 1.0
    while flower_epsilon(hi, m, n, rounds) > target:
        lo, hi = hi, hi * 2
    while hi / lo > 1 + rtol:
        mid = math.sqrt(lo * hi)
        if flower_epsilon(mid, m, n, rounds) > target:
            lo = mid
        else:
            hi = mid
    return hi


# -- one training run --------------------------------------------------------------------------


class ServerTimer:
    """Wraps a strategy's configure_train and aggregate_train (instance attributes, which
    ``Strategy.start`` calls) and records the seconds of both per round."""

    def __init__(self, strategy: Any) -> None:
        self.configure: List[float] = []
        self.aggregate: List[float] = []
        conf, agg = strategy.configure_train, strategy.aggregate_train

        def configure_train(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = list(conf(*a, **k))
            self.configure.append(time.perf_counter() - t)
            return out

        def aggregate_train(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = agg(*a, **k)
            self.aggregate.append(time.perf_counter() - t)
            return out

        strategy.configure_train, strategy.aggregate_train = configure_train, aggregate_train

    def per_round(self) -> List[float]:
        return [a + b for a, b in zip(self.configure, self.aggregate)]


def build(method: str, eps: Optional[float], args: argparse.Namespace, zs: Dict[Tuple[str, Optional[float]], float],
          ledger_dir: str) -> Tuple[Any, Dict[str, Any]]:
    """The strategy of (method, ε); the noise multiplier from `zs` when known (else calibrated and stored)."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    import dpcore.flower

    n, m, T = args.clients, args.clients_per_round, args.rounds
    q = m / n
    inner = FedAvg(fraction_train=q, fraction_evaluate=0.0, min_train_nodes=m, min_available_nodes=m)
    info: Dict[str, Any] = {}
    key = (method, eps)
    if method == "non-private FedAvg":
        return inner, info
    if method == "Flower DP (fixed clipping)":
        if key not in zs:
            t = time.perf_counter()
            zs[key] = calibrate_flower(eps, m, n, T)  # type: ignore[arg-type]
            info["calibration_s"] = time.perf_counter() - t
        strat = DifferentialPrivacyServerSideFixedClipping(inner, zs[key], args.clip, m, accountant=flower_accountant(n))
        return strat, info
    ledger = os.path.join(tempfile.mkdtemp(dir=ledger_dir), "ledger.jsonl")
    kw: Dict[str, Any] = dict(population_size=n, max_grad_norm=args.clip, num_rounds=T, ledger=ledger)
    if method == "dpcore BLT DP-FTRL":
        kw.update(noise_mechanism="blt", sampler="cyclic", sample_size=m)
    else:
        kw.update(sampler="poisson", sampling_probability=q)
    if key in zs:
        kw.update(noise_multiplier=zs[key], target_delta=DELTA)
    else:
        kw.update(target_epsilon=eps, target_delta=DELTA)
    t = time.perf_counter()
    strat = dpcore.flower.DifferentialPrivacy(inner, **kw)
    if key not in zs:
        info["calibration_s"] = time.perf_counter() - t
        zs[key] = float(strat.noise_multiplier)
    return strat, info


def train_one(pop: Dict[str, Any], method: str, eps: Optional[float], seed: int, args: argparse.Namespace,
              zs: Dict[Tuple[str, Optional[float]], float], ledger_dir: str) -> Dict[str, Any]:
    from flwr.app import MetricRecord

    from dpcore.flower.testing import LocalGrid

    random.seed(seed)
    np.random.seed(seed)
    out: Dict[str, Any] = {"method": method, "target_epsilon": eps, "seed": seed}
    t0 = time.perf_counter()
    strat, info = build(method, eps, args, zs, ledger_dir)
    out.update(info)
    out["z"] = zs.get((method, eps))
    timer = ServerTimer(strat)
    grid = LocalGrid(digits_clients(pop, args, seed))
    curve: Dict[int, float] = {}

    def evaluate(rnd: int, arrays: Any) -> Any:
        curve[rnd] = accuracy(arrays, pop["x_test"], pop["y_test"])
        return MetricRecord({"accuracy": curve[rnd]})

    res = strat.start(grid, digits_arrays(), num_rounds=args.rounds, evaluate_fn=evaluate)
    out["test_accuracy"] = curve[args.rounds]
    out["curve"] = [curve[r] for r in sorted(curve)]
    out["server_ms_per_round"] = 1e3 * statistics.median(timer.per_round())
    if method.startswith("dpcore"):
        out["epsilon_spent"] = float(strat.epsilon())
        out["sampled_per_round"] = statistics.mean(
            float(v["dpcore.sampled-clients"]) for v in res.train_metrics_clientapp.values())
    elif method.startswith("Flower"):
        out["epsilon_spent"] = float(strat.privacy_spent().epsilon)
    if hasattr(strat, "close"):  # dpcore's ledger
        strat.close()
    out["total_s"] = time.perf_counter() - t0
    return out


def run_accuracy(args: argparse.Namespace, log: Callable[[str], None]) -> Dict[str, Any]:
    pop = population(args.clients, args.per_client)
    zs: Dict[Tuple[str, Optional[float]], float] = {}
    runs: List[Dict[str, Any]] = []
    ledger_dir = tempfile.mkdtemp(prefix="bench-flower-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    t0 = time.perf_counter()
    try:
        for seed in range(args.seeds):
            for method in METHODS:
                for eps in ([None] if method == "non-private FedAvg" else args.epsilons):
                    try:
                        r = train_one(pop, method, eps, seed, args, zs, ledger_dir)
                    except Exception as e:  # shown in the tables, not raised
                        if args.raise_errors:
                            raise
                        first = (str(e).strip().splitlines() or [""])[0]
                        r = {"method": method, "target_epsilon": eps, "seed": seed,
                             "error": f"{type(e).__name__}: {first[:300]}"}
                    runs.append(r)
                    status = r.get("error") or (
                        f"acc {r['test_accuracy']:.3f} z {r['z']} eps {r.get('epsilon_spent')} server "
                        f"{r['server_ms_per_round']:.1f} ms/round ({r['total_s']:.1f} s)")
                    log(f"[{time.perf_counter() - t0:6.0f} s] seed {seed} {method} eps={eps}: {status}")
    finally:
        shutil.rmtree(ledger_dir, ignore_errors=True)
    desc = {"clients": args.clients, "per_client": args.per_client, "examples": int(pop["y"].size),
            "one_label_clients": pop["one_label_clients"], "pool": pop["pool"], "test": int(len(pop["y_test"]))}
    return {"population": desc, "runs": runs, "seconds": time.perf_counter() - t0}


def _cell(v: List[float]) -> str:
    if not v:
        return "failed"
    med = statistics.median(v)
    return f"{med:.3f}" if len(v) == 1 else f"{med:.3f} ({min(v):.3f}–{max(v):.3f})"


def accuracy_tables(res: Dict[str, Any], args: argparse.Namespace) -> str:
    d = res["population"]
    eps = args.epsilons
    m, n = args.clients_per_round, args.clients
    lines = [
        f"Population: {d['clients']} clients x {d['per_client']} examples ({d['examples']} in all, from a "
        f"{d['pool']}-image pool; {d['one_label_clients']} clients hold one label, the others two); server test set "
        f"{d['test']} held-out images. Softmax regression (650 float32 parameters), {args.local_steps} local SGD "
        f"steps of {args.local_batch} at lr {args.client_lr}, server lr 1 (FedAvg), C = {args.clip}, "
        f"T = {args.rounds} rounds, m = {m} clients a round (q = {m / n:g}), δ = {DELTA:g} (user level).",
        "",
    ]
    by: Dict[Tuple[str, Any], List[Dict[str, Any]]] = {}
    for r in res["runs"]:
        by.setdefault((r["method"], r["target_epsilon"]), []).append(r)
    ok = lambda rs: [r for r in rs if "error" not in r]  # noqa: E731
    n_seeds = args.seeds
    lines.append(f"Test accuracy after {args.rounds} rounds, median (min–max) over {n_seeds} seed(s)")
    lines.append("")
    lines += ["| method |" + "".join(f" ε={e:g} |" for e in eps) + " ε=∞ |", "|" + "---|" * (2 + len(eps))]
    for method in METHODS:
        if method == "non-private FedAvg":
            cells = ["-"] * len(eps) + [_cell([r["test_accuracy"] for r in ok(by.get((method, None), []))])]
        else:
            cells = [_cell([r["test_accuracy"] for r in ok(by.get((method, e), []))]) for e in eps] + ["-"]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Noise multiplier z / ε spent (each run's own accountant: dpcore's ledger by PLD, Flower's RDP "
                 "accountant without amplification) / server ms per round (median over the run's rounds, first seed)")
    lines.append("")
    lines += ["| method |" + "".join(f" ε={e:g}: z | ε spent | ms/round |" for e in eps),
              "|" + "---|" * (1 + 3 * len(eps))]
    for method in METHODS[:3]:
        cells = []
        for e in eps:
            rs = ok(by.get((method, e), []))
            if not rs:
                err = (by.get((method, e)) or [{"error": "not run"}])[0].get("error", "")
                cells += ["failed", err[:60], "-"]
                continue
            spent = [r["epsilon_spent"] for r in rs]
            s = f"{max(spent):.3f}" if max(spent) - min(spent) < 1e-6 else f"{min(spent):.3f}–{max(spent):.3f}"
            cells += [f"{rs[0]['z']:.4g}", s, f"{rs[0]['server_ms_per_round']:.1f}"]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    rs = ok(by.get(("non-private FedAvg", None), []))
    if rs:
        lines.append(f"| non-private FedAvg | - | ∞ | {rs[0]['server_ms_per_round']:.1f} |" + " |" * (3 * len(eps) - 3))
    lines.append("")
    z_dp = {e: r[0]["z"] for e in eps if (r := ok(by.get(("dpcore DP-FedAvg", e), [])))}
    z_fl = {e: r[0]["z"] for e in eps if (r := ok(by.get(("Flower DP (fixed clipping)", e), [])))}
    both = [e for e in eps if e in z_dp and e in z_fl]
    if both:
        lines.append("Noise on the released average, stddev per coordinate: dpcore DP-FedAvg zC/(qN), Flower zC/m: "
                     + "; ".join(f"ε={e:g}: {z_dp[e] * args.clip / m:.4f} vs {z_fl[e] * args.clip / m:.4f} "
                                 f"({z_fl[e] / z_dp[e]:.1f}x)" for e in both))
        lines.append("")
    samp = [r["sampled_per_round"] for r in ok(res["runs"]) if r["method"] == "dpcore DP-FedAvg"]
    if samp:
        lines.append(f"dpcore DP-FedAvg sampled {statistics.mean(samp):.1f} clients a round on average (Poisson, "
                     f"expected {m}); BLT and Flower {m} exactly.")
    return "\n".join(lines)


# -- server time per round ---------------------------------------------------------------------


def mlp_arrays(sizes: Tuple[int, ...], seed: int = 0) -> List[Tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        out.append((f"fc{i}.weight", (rng.normal(0, 1 / math.sqrt(a), (b, a))).astype(np.float32)))
        out.append((f"fc{i}.bias", np.zeros(b, np.float32)))
    return out


def canned_clients(n: int, arrays: List[Tuple[str, np.ndarray]], clip: float, kinds: int = 10) -> Dict[int, Any]:
    """n nodes that reply at once with one of `kinds` precomputed models (the initial model plus an
    update of norm about 3·clip), built once: the replies cost the server what real ones would."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    rng = np.random.default_rng(1)
    d = sum(a.size for _, a in arrays)
    scale = 3.0 * clip / math.sqrt(d)
    recs = [ArrayRecord({k: Array((a + rng.normal(0, scale, a.shape)).astype(np.float32)) for k, a in arrays})
            for _ in range(kinds)]

    def client(msg: Any, ctx: Any) -> Any:
        rec = recs[int(ctx.node_id) % kinds]
        return Message(RecordDict({"arrays": rec, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    return {k + 1: client for k in range(n)}


def contenders(n: int, m: int, rounds: int, clip: float, z: float, shm_dir: str) -> Dict[str, Callable[[], Any]]:
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    import dpcore.flower

    q = m / n

    def fedavg() -> Any:
        return FedAvg(fraction_train=q, fraction_evaluate=0.0, min_train_nodes=m, min_available_nodes=m)

    def dp(**kw: Any) -> Any:
        base = dict(population_size=n, max_grad_norm=clip, noise_multiplier=z, target_delta=DELTA)
        base.update(kw)
        if "sampler" not in base:
            base.update(sampler="poisson", sampling_probability=q)
        return dpcore.flower.DifferentialPrivacy(fedavg(), **base)

    return {
        "Flower DP (fixed clipping)": lambda: DifferentialPrivacyServerSideFixedClipping(fedavg(), z, clip, m),
        "Flower DP + its RDP accountant": lambda: DifferentialPrivacyServerSideFixedClipping(
            fedavg(), z, clip, m, accountant=flower_accountant(n)),
        "dpcore DP-FedAvg (default: ledger in a temp file, PLD ε)": lambda: dp(),
        "dpcore DP-FedAvg, ledger in /dev/shm": lambda: dp(ledger=os.path.join(tempfile.mkdtemp(dir=shm_dir), "l.jsonl")),
        "dpcore DP-FedAvg, accountant='rdp'": lambda: dp(accountant="rdp"),
        "dpcore BLT DP-FTRL (cyclic)": lambda: dp(noise_mechanism="blt", sampler="cyclic", sample_size=m,
                                                  num_rounds=rounds + 1),
        "non-private FedAvg": fedavg,
    }


def drive(strategies: Dict[str, Any], grid: Any, initial: Any, rounds: int, profile: Optional[str] = None,
          ) -> Tuple[Dict[str, Dict[str, List[float]]], Optional[cProfile.Profile]]:
    """Rounds as ``Strategy.start`` runs them (configure_train, the grid, aggregate_train), the
    contenders alternated round by round (the order reversed every other round); round 1 of
    each is a warm-up, not kept. Times the server's two calls; `profile`: the contender whose
    server calls after the warm-up run under cProfile."""
    from flwr.app import ConfigRecord

    arrays = {k: initial for k in strategies}
    ts: Dict[str, Dict[str, List[float]]] = {k: {"configure": [], "aggregate": [], "cpu": [], "sampled": []}
                                             for k in strategies}
    prof = cProfile.Profile() if profile else None
    names = list(strategies)
    for rnd in range(1, rounds + 2):
        for name in (names if rnd % 2 else names[::-1]):
            s = strategies[name]
            on = prof is not None and name == profile and rnd > 1
            if on:
                prof.enable()  # type: ignore[union-attr]
            t, c = time.perf_counter(), time.process_time()
            msgs = list(s.configure_train(rnd, arrays[name], ConfigRecord(), grid))
            t1, c1 = time.perf_counter(), time.process_time()
            if on:
                prof.disable()  # type: ignore[union-attr]
            replies = list(grid.send_and_receive(msgs))
            if on:
                prof.enable()  # type: ignore[union-attr]
            t2, c2 = time.perf_counter(), time.process_time()
            new, _ = s.aggregate_train(rnd, replies)
            t3, c3 = time.perf_counter(), time.process_time()
            if on:
                prof.disable()  # type: ignore[union-attr]
            if new is not None:
                arrays[name] = new
            if rnd > 1:
                ts[name]["configure"].append(t1 - t)
                ts[name]["aggregate"].append(t3 - t2)
                ts[name]["cpu"].append((c1 - c) + (c3 - c2))
                ts[name]["sampled"].append(len(msgs))
    return ts, prof


def profile_buckets(prof: cProfile.Profile, rounds: int) -> Dict[str, float]:
    """ms per round of dpcore's server calls by part: the cumulative time of the functions named
    (the ledger's writes taken out of the sampling and the release that call them), the rest as
    'other'."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def ct(suffix: str, name: str) -> float:
        return sum(v[3] for (f, _, fn), v in stats.items() if fn == name and f.replace(os.sep, "/").endswith(suffix))

    total = ct("flower/_strategy.py", "configure_train") + ct("flower/_strategy.py", "aggregate_train")
    rec_sample, rec_release = ct("ledger/__init__.py", "record_sample"), ct("ledger/__init__.py", "record_release")
    parts = {
        "ε for the round's metrics (ledger → PLD accountant)": ct("flower/_strategy.py", "epsilon"),
        "ledger writes (sample + release, fsync)": rec_sample + rec_release,
        "sampling draw (without its ledger write)": ct("dpcore/aggregator.py", "sample") - rec_sample,
        "replies → array views (client_arrays: header, checks)": ct("flower/_records.py", "client_arrays"),
        "query: clip + sum + noise (without the ledger write)": ct("dpcore/aggregator.py", "aggregate") - rec_release,
        "wrapped FedAvg: configure_train (its messages discarded)": ct("flower/_strategy.py", "_content"),
        "wrapped FedAvg: aggregate_train of the release": ct("flower/_strategy.py", "_inner_aggregate"),
        "ModelLayout.of (each configure_train)": ct("flower/_records.py", "of"),
    }
    out = {k: 1e3 * v / rounds for k, v in parts.items()}
    out["other: mostly aggregate_train's inline stacking of the updates into (n, ...) arrays of the model dtype, the released "
        "ArrayRecord, the messages"] = 1e3 * (total - sum(parts.values())) / rounds
    out["total (under cProfile)"] = 1e3 * total / rounds
    return out


def time_model(label: str, grid: Any, initial: Any, n: int, m: int, args: argparse.Namespace,
               log: Callable[[str], None]) -> Dict[str, Any]:
    shm = tempfile.mkdtemp(prefix="bench-flower-t-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    strategies: Dict[str, Any] = {}
    try:
        build = contenders(n, m, args.time_rounds + 1, args.clip, 1.0, shm)
        strategies = {k: f() for k, f in build.items()}
        random.seed(0)
        np.random.seed(0)
        t0 = time.perf_counter()
        ts, _ = drive(strategies, grid, initial, args.time_rounds)
        log(f"{label}: timed {args.time_rounds} rounds of {len(strategies)} contenders in {time.perf_counter() - t0:.0f} s")
        key = "dpcore DP-FedAvg (default: ledger in a temp file, PLD ε)"
        prof_rounds = max(2, args.time_rounds // 2)
        strategies["profiled"] = build[key]()
        _, prof = drive({key: strategies["profiled"]}, grid, initial, prof_rounds, profile=key)
        buckets = profile_buckets(prof, prof_rounds) if prof is not None else {}
        if args.profile_out and prof is not None:
            prof.dump_stats(f"{args.profile_out}.{label.split()[0]}.prof")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        for s in strategies.values():  # the default ledgers' temporary files (dpcore leaves them, by design)
            if hasattr(s, "close") and hasattr(s, "ledger"):
                s.close()
            path = getattr(getattr(s, "ledger", None), "path", None)
            if path and os.path.basename(path).startswith("dpcore-flower-") and os.path.dirname(
                    os.path.abspath(path)) == os.path.abspath(tempfile.gettempdir()):
                try:
                    os.remove(path)
                except OSError:
                    pass
    res = {}
    for k, v in ts.items():
        tot = [a + b for a, b in zip(v["configure"], v["aggregate"])]
        res[k] = {"ms": 1e3 * statistics.median(tot), "configure_ms": 1e3 * statistics.median(v["configure"]),
                  "aggregate_ms": 1e3 * statistics.median(v["aggregate"]), "cpu_ms": 1e3 * statistics.median(v["cpu"]),
                  "clients": statistics.mean(v["sampled"]), "rounds": len(tot), "times_ms": [1e3 * x for x in tot]}
    return {"label": label, "population": n, "clients_per_round": m, "contenders": res, "profile": buckets,
            "profile_rounds": prof_rounds}


def run_time(args: argparse.Namespace, log: Callable[[str], None]) -> List[Dict[str, Any]]:
    from flwr.app import Array, ArrayRecord

    from dpcore.flower.testing import LocalGrid

    out = []
    n, m = (200, 20) if args.quick else (2000, 100)
    pop = population(n, args.per_client)
    a = argparse.Namespace(**vars(args))
    a.clients = n
    out.append(time_model(f"digits softmax regression (650 parameters), N = {n}, {m} a round, real clients",
                          LocalGrid(digits_clients(pop, a, 0)), digits_arrays(), n, m, args, log))
    sizes = (784, 128, 10) if args.quick else (784, 1024, 256, 10)
    n, m = (200, 20) if args.quick else (1000, 100)
    arrays = mlp_arrays(sizes)
    d = sum(x.size for _, x in arrays)
    initial = ArrayRecord({k: Array(v) for k, v in arrays})
    out.append(time_model(f"MLP {'-'.join(map(str, sizes))} ({d:,} float32 parameters), N = {n}, {m} a round, "
                          "canned replies", LocalGrid(canned_clients(n, arrays, args.clip)), initial, n, m, args, log))
    return out


def time_tables(res: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Server time per round (configure_train + aggregate_train), median over {args.time_rounds} alternating "
             "rounds after one warm-up; z = 1.0, C = 1; ratio = this row / Flower's wrapper (goal for dpcore ≤ 1.1x)",
             ""]
    for r in res:
        c = r["contenders"]
        base = c["Flower DP (fixed clipping)"]["ms"]
        base_acc = c["Flower DP + its RDP accountant"]["ms"]
        lines += [r["label"], "",
                  "| strategy | ms/round | configure | aggregate | cpu ms | clients/round | vs Flower DP | "
                  "vs Flower DP + accountant |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, v in c.items():
            lines.append(f"| {k} | {v['ms']:.2f} | {v['configure_ms']:.2f} | {v['aggregate_ms']:.2f} | {v['cpu_ms']:.2f} | "
                         f"{v['clients']:.1f} | {v['ms'] / base:.2f}x | {v['ms'] / base_acc:.2f}x |")
        lines.append("")
        if r["profile"]:
            lines += [f"Where dpcore's default round goes (cProfile, {r['profile_rounds']} rounds, ms per round):", "",
                      "| part | ms/round |", "|---|---|"]
            lines += [f"| {k} | {v:.2f} |" for k, v in r["profile"].items()]
            lines.append("")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=None, help="population N (default 2000; --quick 200)")
    ap.add_argument("--clients-per-round", type=int, default=None, help="m = q·N (default 100; --quick 20)")
    ap.add_argument("--per-client", type=int, default=20, help="examples per client (two shards of half as many)")
    ap.add_argument("--rounds", type=int, default=None, help="T (default 100; --quick 10)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per (method, ε) (default 3; --quick 1)")
    ap.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS))
    ap.add_argument("--clip", type=float, default=1.0, help="C, the clip norm of a client's update")
    ap.add_argument("--client-lr", type=float, default=0.5)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--local-batch", type=int, default=10)
    ap.add_argument("--time-rounds", type=int, default=None, help="timed rounds per contender (default 20; --quick 3)")
    ap.add_argument("--quick", action="store_true", help="a smoke run under a minute")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--profile-out", help="also dump the cProfile stats to PATH.<model>.prof")
    ap.add_argument("--raise-errors", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write every result to this file")
    args = ap.parse_args()
    quick = dict(clients=200, clients_per_round=20, rounds=10, seeds=1, time_rounds=3)
    full = dict(clients=2000, clients_per_round=100, rounds=100, seeds=3, time_rounds=20)
    fill_defaults(args, quick, full)
    warnings.filterwarnings("ignore")

    import flwr

    # after flwr's import, which sets its logger to DEBUG: Flower's INFO lines (one per client and
    # round in its DP wrapper, two a round in dpcore's) and FedAvg's warning about
    # fraction_evaluate=0 are neither printed nor built
    logging.getLogger("flwr").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    print(f"flwr {flwr.__version__ if hasattr(flwr, '__version__') else '?'}, numpy {np.__version__}, load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    out: Dict[str, Any] = {"args": vars(args), "delta": DELTA}
    run_parts(out, [(args.skip_accuracy, "accuracy", run_accuracy, accuracy_tables),
                    (args.skip_time, "time", run_time, time_tables)], args)
    finish(out, t0, args.json)


if __name__ == "__main__":
    main()
