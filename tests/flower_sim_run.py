"""Runs dpcore's DifferentialPrivacy on Flower's simulation engine (Ray): 4 SuperNodes, 2 rounds,
all clients sampled, noise multiplier 1. Writes result.json and sim.ledger under argv[1]
(tests/test_flower.py::test_simulation_engine runs it in its own process, away from pytest's)."""

import json
import os
import sys

import numpy as np

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

OUT = sys.argv[1]

client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    w = msg.content["arrays"].to_numpy_ndarrays()[0]
    target = np.full_like(w, float(pid + 1))
    new = (w + 0.5 * (target - w)).astype(np.float32)
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(new)}), "metrics": MetricRecord({"num-examples": 5})}),
                   reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    import dpcore.flower as dpf

    dp = dpf.DifferentialPrivacy(FedAvg(fraction_evaluate=0.0), population_size=4, sampling_probability=1.0,
                                 noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5,
                                 ledger=os.path.join(OUT, "sim.ledger"))
    init = ArrayRecord({"w": Array(np.zeros(8, np.float32))})
    res = dp.start(grid, init, num_rounds=2, timeout=120)
    w = res.arrays.to_numpy_ndarrays()[0]
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump({"w": w.tolist(), "moved": float(np.abs(w).sum()),
                   "epsilon": res.train_metrics_clientapp[2]["dpcore.epsilon"]}, f)


if __name__ == "__main__":
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}})
    if not os.path.exists(os.path.join(OUT, "result.json")):
        sys.exit("the ServerApp wrote no result")
