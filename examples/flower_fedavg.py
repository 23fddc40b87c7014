"""User-level DP-FedAvg on Flower (1.42, the Message API) with dpcore.

scikit-learn's digits are split across the clients (one client = one person's data; the privacy
unit), each client trains a numpy softmax regression locally and sends back its model, and the
server wraps Flower's ``FedAvg`` in :class:`dpcore.flower.DifferentialPrivacy`: every round it
Poisson-samples clients from the roster of N with ChaCha20, clips each client's update
Δ = w_client − w to C, adds N(0, (zC)²) to the sum, divides by the fixed q·N and records the
release in a durable ledger (privacy unit "user"). ε (adding or removing one client with all its
data) is in Flower's metrics every round; the ledger's report (what ``dpcore report LEDGER
--delta 1e-5`` prints) closes the run.

The apps are written as Flower users write them (``@app.main()``, ``@app.train()``) and run on
Flower's simulation engine (``flwr.simulation.run_simulation``, Ray; one CPU per client actor),
or with ``--local`` on :class:`dpcore.flower.testing.LocalGrid`, which runs the same ClientApp in
this process (no Ray; fast). ``--client-clipping`` clips on the clients instead
(``dpcore.flower.clipping_mod``), so that no raw update ever leaves a client.

``python examples/flower_fedavg.py [--small] [--local] [--client-clipping]``
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded from its file by another program (the tests): _common.py is beside it
    sys.path.insert(0, _HERE)

import numpy as np  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

import dpcore.flower  # noqa: E402
from _common import parser  # noqa: E402

FEATURES, CLASSES = 64, 10
DELTA = 1e-5


# --- the data and the model (plain numpy) ------------------------------------------------------

_DATA: dict = {}  # one load a process (a plain dict: the engine pickles the ClientApp to its actors)


def load_data():
    """The digits split 75/25 with a fixed seed, features in [0, 1] (as examples/_common.py):
    (x_train, x_test, y_train, y_test)."""
    if "split" not in _DATA:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        _DATA["split"] = train_test_split((x / 16.0).astype(np.float32), y, test_size=0.25, random_state=0)
    return _DATA["split"]


def client_data(partition_id: int, num_partitions: int):
    """The training examples of one client: a fixed random split of the training part into
    `num_partitions` disjoint shards (about 13 to 27 examples each for 50 to 100 clients)."""
    xtr, _, ytr, _ = load_data()
    shards = np.array_split(np.random.default_rng(0).permutation(len(ytr)), num_partitions)
    idx = shards[partition_id]
    return xtr[idx], ytr[idx]


def initial_model() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros((FEATURES, CLASSES), np.float32)),
                        "b": Array(np.zeros(CLASSES, np.float32))})


def local_sgd(w, b, x, y, lr: float, epochs: int, batch_size: int = 8, seed: int = 0):
    """`epochs` of mini-batch SGD on the cross-entropy of a softmax regression."""
    rng = np.random.default_rng(seed)
    onehot = np.eye(CLASSES, dtype=np.float32)[y]
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for s in range(0, len(y), batch_size):
            i = order[s:s + batch_size]
            logits = x[i] @ w + b
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            g = (p - onehot[i]) / len(i)
            w = w - lr * x[i].T @ g
            b = b - lr * g.sum(axis=0)
    return w.astype(np.float32), b.astype(np.float32)


def accuracy(arrays: ArrayRecord, x, y) -> float:
    a = arrays.to_numpy_ndarrays()
    return float(((x @ a[0] + a[1]).argmax(axis=1) == y).mean())


# --- the ClientApp ----------------------------------------------------------------------------

# Server-side clipping: a plain ClientApp. Client-side clipping: the same training behind
# dpcore's mod, which clips the update to the bound the server sends (and refuses to train
# without one).
client_app = ClientApp()
clipping_client_app = ClientApp(mods=[dpcore.flower.clipping_mod])


@client_app.train()
@clipping_client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training on this client's shard; the reply is the local model (dpcore makes the
    update from it). The example count is sent as Flower apps do, and dpcore never uses it."""
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = client_data(pid, parts)
    arrays = msg.content["arrays"]
    cfg = msg.content["config"]
    w, b = (np.asarray(a) for a in arrays.to_numpy_ndarrays())
    w, b = local_sgd(w, b, x, y, lr=float(cfg["lr"]), epochs=int(cfg["local-epochs"]),
                     seed=int(cfg["server-round"]) * 100003 + pid)
    content = RecordDict({"arrays": ArrayRecord({"w": Array(w), "b": Array(b)}),
                          "metrics": MetricRecord({"num-examples": len(y)})})
    return Message(content=content, reply_to=msg)


# --- the ServerApp ----------------------------------------------------------------------------

def make_server_app(settings: dict, out: dict) -> ServerApp:
    """The ServerApp of a run; what it measured lands in `out` (it runs in a thread of this
    process on both engines)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        _, xte, _, yte = load_data()
        strategy = dpcore.flower.DifferentialPrivacy(
            FedAvg(fraction_evaluate=0.0),                # no federated evaluation: it is not private
            population_size=settings["clients"],          # N, the roster
            sampling_probability=settings["q"],           # Poisson, each client with probability q
            noise_multiplier=settings["noise_multiplier"],
            max_grad_norm=settings["clip"],               # C, the bound on one client's update
            clipping_mode=settings["clipping_mode"],
            target_delta=DELTA,
            ledger=settings["ledger"],
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=initial_model(),
            num_rounds=settings["rounds"],
            train_config=ConfigRecord({"lr": settings["lr"], "local-epochs": settings["local_epochs"]}),
            # server-side evaluation on held-out data: the model is already private
            evaluate_fn=lambda rnd, arrays: MetricRecord({"accuracy": accuracy(arrays, xte, yte)}),
        )
        out["epsilon"] = {r: float(m["dpcore.epsilon"]) for r, m in result.train_metrics_clientapp.items()}
        out["accuracy"] = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
        out["sampled"] = {r: int(m["dpcore.sampled-clients"]) for r, m in result.train_metrics_clientapp.items()}
        out["final_accuracy"] = accuracy(result.arrays, xte, yte)
        out["report"] = strategy.report(DELTA)
        out["ledger"] = strategy.ledger.path

    return app


def run_local(server_app: ServerApp, client: ClientApp, clients: int) -> None:
    """The same apps on LocalGrid: every node's ClientApp runs in this process, in turn."""
    from dpcore.flower.testing import LocalGrid

    grid = LocalGrid({nid: client for nid in range(1, clients + 1)},
                     node_config={nid: {"partition-id": nid - 1, "num-partitions": clients}
                                  for nid in range(1, clients + 1)})
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))


def run_engine(server_app: ServerApp, client: ClientApp, clients: int) -> None:
    """Flower's simulation engine (Ray): one virtual SuperNode per client, one CPU per actor,
    so two client actors on a two-core machine."""
    from flwr.simulation import run_simulation

    run_simulation(server_app=server_app, client_app=client, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": min(2, os.cpu_count() or 1),
                                                 "logging_level": logging.ERROR}})


def baseline_accuracy(settings: dict) -> float:
    """Non-private FedAvg over the same clients (q·N of them a round, chosen by Flower's own
    sampling, weighted by example counts, no clipping, no noise) on LocalGrid."""
    _, xte, _, yte = load_data()
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        result = FedAvg(fraction_train=settings["q"], fraction_evaluate=0.0).start(
            grid=grid, initial_arrays=initial_model(), num_rounds=settings["rounds"],
            train_config=ConfigRecord({"lr": settings["lr"], "local-epochs": settings["local_epochs"]}))
        out["accuracy"] = accuracy(result.arrays, xte, yte)

    run_local(app, client_app, settings["clients"])
    return out["accuracy"]


def main(small: bool = False, local: bool = False, client_clipping: bool = False, verbose: bool = False) -> dict:
    """One DP-FedAvg run; `local`: on LocalGrid instead of the simulation engine. Returns the
    per-round ε and accuracy, the final accuracy (and a non-private baseline's), the ledger."""
    if not verbose:  # Flower logs every round and the whole history; the lines below say what matters
        logging.getLogger("flwr").setLevel(logging.WARNING)
    clients = 50 if small else 100
    settings = dict(
        clients=clients, q=0.3 if small else 0.2, noise_multiplier=1.0 if small else 1.2, clip=1.0, lr=0.5,
        local_epochs=5, rounds=10 if small else 30, clipping_mode="client" if client_clipping else "server",
        ledger=os.path.join(tempfile.mkdtemp(prefix="dpcore-flower-"), "ledger.jsonl"),
    )
    out: dict = {}
    server_app = make_server_app(settings, out)
    client = clipping_client_app if client_clipping else client_app
    t0 = time.perf_counter()
    (run_local if local else run_engine)(server_app, client, clients)
    out["seconds"] = time.perf_counter() - t0
    if "final_accuracy" not in out:
        raise RuntimeError("the ServerApp did not finish (see Flower's log above)")
    out["baseline_accuracy"] = baseline_accuracy(settings)
    for r in sorted(out["epsilon"]):
        print(f"round {r:3d}: {out['sampled'][r]:3d} clients sampled, user-level eps = {out['epsilon'][r]:.3f} "
              f"(delta = {DELTA:g}), test accuracy {out['accuracy'][r]:.3f}")
    eps = out["epsilon"][max(out["epsilon"])]
    print(f"{clients} clients, {settings['rounds']} rounds, {settings['clipping_mode']}-side clipping, on "
          f"{'LocalGrid' if local else 'the simulation engine'} in {out['seconds']:.1f} s: DP-FedAvg accuracy "
          f"{out['final_accuracy']:.3f} (non-private FedAvg {out['baseline_accuracy']:.3f}) | "
          f"user-level eps = {eps:.3f} at delta = {DELTA:g}")
    print(f"\nThe ledger's report (`dpcore report {out['ledger']} --delta {DELTA:g}`):\n")
    print(out["report"].to_markdown())
    return {**out, **{k: settings[k] for k in ("clients", "q", "noise_multiplier", "clip", "rounds", "clipping_mode")},
            "delta": DELTA, "final_epsilon": eps}


if __name__ == "__main__":
    ap = parser()
    ap.add_argument("--local", action="store_true",
                    help="run on dpcore.flower.testing.LocalGrid (this process) instead of the simulation engine")
    ap.add_argument("--client-clipping", action="store_true", help="clip on the clients (dpcore.flower.clipping_mod)")
    ap.add_argument("--verbose", action="store_true", help="Flower's own log (every round, the history)")
    args = ap.parse_args()
    main(args.small, local=args.local, client_clipping=args.client_clipping, verbose=args.verbose)
