"""The ServerApp: dpcore.flower.DifferentialPrivacy around FedAvg, run for ``num-server-rounds``.

It writes what the test checks into ``out-dir`` (a folder of the test's tmp_path):
``dp.ledger`` (the strategy's ledger), ``models.npz`` (the global model before round 1 and after
every round), and last ``result.json`` (the per-round dpcore metrics, and for every round the
nodes sent a training message, the replies received (node id, error or partition-id), and
when the server sent them and stopped waiting). The replies are recorded by a thin proxy of
the Grid, so the test knows which clients the server really heard from within the round's
timeout. On an exception it writes ``server-error.txt`` (the traceback) so that the test fails
at once with it instead of waiting for its timeout."""

from __future__ import annotations

import io
import json
import os
import time
import traceback
from typing import Any, Dict, Iterable, List, Optional

import numpy as np

from flwr.app import Array, ArrayRecord, Context, Message, MessageType
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from .task import initial_model

app = ServerApp()


class RecordingGrid(Grid):
    """Passes everything to the engine's grid and records, per round, the training messages'
    destinations and the replies."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.rounds: Dict[int, Dict[str, List[Any]]] = {}

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:
        messages = list(messages)
        started = time.time()
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
        if train:
            rnd = int(train[0].content["config"]["server-round"])
            got = []
            for r in replies:
                err = r.has_error()
                pid = None if err else int(r.content["metrics"]["partition-id"])
                got.append({"node": int(r.metadata.src_node_id), "error": err, "partition": pid})
            self.rounds[rnd] = {"sent": [int(m.metadata.dst_node_id) for m in train], "replies": got,
                                "started": started, "finished": time.time()}
        return replies


def _atomic_write(path: str, data: bytes) -> None:
    """Write then rename: the test polls for these files and must never read half of one."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    out = str(cfg["out-dir"])
    try:
        _run(grid, cfg, out)
    except BaseException:
        with open(os.path.join(out, "server-error.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _run(grid: Grid, cfg: Dict[str, Any], out: str) -> None:
    import dpcore.flower as dpf  # here, so that an import failure lands in server-error.txt

    rounds = int(cfg["num-server-rounds"])
    dp = dpf.DifferentialPrivacy(
        FedAvg(fraction_evaluate=0.0),
        population_size=int(cfg["population-size"]),
        sampling_probability=1.0,
        noise_multiplier=float(cfg["noise-multiplier"]),
        max_grad_norm=float(cfg["max-grad-norm"]),
        target_delta=float(cfg["target-delta"]),
        num_rounds=rounds,
        ledger=os.path.join(out, "dp.ledger"),
        wait_for_clients=30.0,
        seed=int(cfg["seed"]),  # the test replays the noise with the same seed
    )
    models: Dict[str, np.ndarray] = {}

    def keep_model(server_round: int, arrays: ArrayRecord) -> None:  # the server-side "evaluation"
        for k in arrays.keys():
            models[f"round{server_round}/{k}"] = np.asarray(arrays[k].numpy())

    recorder = RecordingGrid(grid)
    init = ArrayRecord({k: Array(v) for k, v in initial_model().items()})
    result = dp.start(recorder, init, num_rounds=rounds, timeout=float(cfg["round-timeout"]),
                      evaluate_fn=keep_model)
    for k in result.arrays.keys():
        models[f"final/{k}"] = np.asarray(result.arrays[k].numpy())
    buf = io.BytesIO()
    np.savez(buf, **models)
    _atomic_write(os.path.join(out, "models.npz"), buf.getvalue())
    metrics = {str(r): {k: m[k] for k in m.keys()} for r, m in result.train_metrics_clientapp.items()}
    summary = {"metrics": metrics, "rounds": {str(r): v for r, v in recorder.rounds.items()}}
    _atomic_write(os.path.join(out, "result.json"), json.dumps(summary, indent=1).encode())
