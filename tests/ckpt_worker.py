"""A DP training process for tests/test_torch_checkpoint.py's SIGKILL test (run with
sys.executable; not collected by pytest).

    python ckpt_worker.py train  DIR STEPS [PAUSE_AT]
    python ckpt_worker.py resume DIR STEPS

``train`` trains a tiny model with ``make_private`` and the ledger DIR/ledger.jsonl for STEPS
steps. After every applied step it saves the model and the optimizer (``torch.save`` to a
temporary file, then ``os.replace``: atomic) to DIR/ckpt.pt and only then appends the line
``applied <n>`` to DIR/progress. With PAUSE_AT = k, after the k-th release is recorded in the
ledger and applied, and before its checkpoint, it appends ``released <k>`` and sleeps: the parent
kills it there (the ledger is then one release ahead of the checkpoint).

``resume`` rebuilds everything from DIR/ckpt.pt (with ``ledger_ahead="keep"`` when the ledger
holds one release more than the checkpoint, after checking that the default refuses it), trains
the remaining steps and writes DIR/result.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpcore
from dpcore.torch import make_private

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 4))
        # updates applied to the parameters so far (saved with the model's state dict)
        self.register_buffer("applied", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build(d: str):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(40, 7, generator=g), torch.randint(0, 4, (40,), generator=g))
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return make_private(
        model, inner, DataLoader(ds, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        ledger=os.path.join(d, "ledger.jsonl"),
    )


def save(d: str, model: Net, opt) -> None:
    tmp = os.path.join(d, "ckpt.pt.tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, os.path.join(d, "ckpt.pt"))


def train(model: Net, opt, loader, steps: int, d: str, pause_at: int = -1) -> int:
    done = 0
    with open(os.path.join(d, "progress"), "a") as progress:
        while done < steps:
            for x, y in loader:
                opt.zero_grad()
                if len(x):
                    nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                model.applied += 1
                done += 1
                if int(model.applied) == pause_at:
                    progress.write(f"released {int(model.applied)}\n")
                    progress.flush()
                    time.sleep(60)  # killed here: recorded and applied, not checkpointed
                save(d, model, opt)
                progress.write(f"applied {int(model.applied)}\n")
                progress.flush()
                if done == steps:
                    return done
    return done


def main() -> None:
    mode, d, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "train":
        model, opt, loader = build(d)
        train(model, opt, loader, steps, d, int(sys.argv[4]) if len(sys.argv) > 4 else -1)
        return
    ckpt = torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)
    model, opt, loader = build(d)
    model.load_state_dict(ckpt["model"])
    saved = ckpt["optimizer"]["dpcore"]
    ahead = opt.ledger.num_releases - saved["ledger"]["num_releases"]
    ledger_at_start = opt.ledger.num_releases
    refused = None
    if ahead:
        try:
            opt.load_state_dict(ckpt["optimizer"])
            refused = False
        except dpcore.ledger.LedgerError:
            refused = True
        opt.load_state_dict(ckpt["optimizer"], ledger_ahead="keep")
    else:
        opt.load_state_dict(ckpt["optimizer"])
    releases_after_load = opt._releases
    ckpt_steps = int(ckpt["model"]["applied"])
    resumed = train(model, opt, loader, steps - ckpt_steps, d)
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump(
            {
                "ckpt_steps": ckpt_steps,
                "ckpt_releases": saved["releases"],
                "ahead": ahead,
                "refused_without_keep": refused,
                "releases_after_load": releases_after_load,
                "ledger_at_start": ledger_at_start,
                "resumed_steps": resumed,
                "final_releases": opt._releases,
                "final_ledger": opt.ledger.num_releases,
                "final_applied": int(model.applied),
            },
            f,
        )


if __name__ == "__main__":
    main()
