"""The ClientApp: local training on the SuperNode's partition (``--node-config partition-id=k``).

The victim partition, in the victim round, leaves a marker file and sleeps instead of replying:
the test kills its SuperNode when the marker appears, so the node dies mid-run at a known
point (while the server is waiting for it in that round) and stays dead for the rest of the run."""

from __future__ import annotations

import os
import time

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .task import EXAMPLES, local_train

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    cfg = context.run_config
    server_round = int(msg.content["config"]["server-round"])
    if pid == int(cfg["victim-partition"]) and server_round == int(cfg["victim-round"]):
        marker = os.path.join(str(cfg["out-dir"]), f"victim-waiting-round-{server_round}")
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(float(cfg["victim-sleep"]))  # the test kills this node long before
    sent = msg.content["arrays"]
    model = {k: sent[k].numpy() for k in sent.keys()}
    new = local_train(model, pid, int(cfg["local-steps"]))
    # partition-id lets the server's record of the replies say which partition each node holds.
    reply = RecordDict({
        "arrays": ArrayRecord({k: Array(new[k]) for k in model}),
        "metrics": MetricRecord({"num-examples": EXAMPLES, "partition-id": pid}),
    })
    return Message(reply, reply_to=msg)
