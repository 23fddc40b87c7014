"""One rank of the FSDP2 tests (tests/test_torch_fsdp.py starts two of these).

Usage: python fsdp_worker.py SCENARIO OUTDIR [key=value ...]; RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT come from the environment, as torchrun sets them. Each rank writes OUTDIR/rank{r}.pt.

The model is sharded with ``torch.distributed.fsdp.fully_shard`` (FSDP2): each block, then the
root. Every rank builds it from the same seed (FSDP2 shards each rank's copy; it does not
broadcast), so that a two-rank run starts where the one-process reference does.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, TensorDataset

from dpcore.torch import DistributedError, make_private

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_worker import adaptive_query, empty_steps, finish, greybox, start  # noqa: E402
from dist_worker import model as mlp  # noqa: E402

N, D, K, V, T = 240, 12, 5, 50, 6


class Net(torch.nn.Module):
    """Embedding + LayerNorm + two Linear blocks: rows of dims 7 and 5 shard unevenly on 2 ranks."""

    def __init__(self, width: int = 7) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.norm = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, width)
        self.fc2 = torch.nn.Linear(width, K)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(idx)).mean(1)
        return self.fc2(torch.tanh(self.fc1(h)))


class Encoder(torch.nn.Module):
    """Embedding + a TransformerEncoderLayer (attention, LayerNorms, feed-forward) + a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, 16)
        self.block = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=30, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, K)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(idx)).mean(1))


class ConvNet(torch.nn.Module):
    """Embedding + Conv1d + GroupNorm + a head: the rules an empty batch crashed."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, 8)
        self.conv = torch.nn.Conv1d(8, 32, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 32)
        self.head = torch.nn.Linear(32, K)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(self.emb(idx).transpose(1, 2)))
        return self.head(torch.tanh(h).mean(2))


def model(init_seed: int = 0, width: int = 7, kind: str = "net") -> torch.nn.Module:
    torch.manual_seed(init_seed)
    if kind == "conv":
        return ConvNet()
    return Encoder() if kind == "encoder" else Net(width)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (N, T), generator=g)
    y = torch.randint(0, K, (N,), generator=g)
    return TensorDataset(x, y)


def shard(net: torch.nn.Module, mp: str) -> torch.nn.Module:
    kw = {}
    if mp == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if isinstance(net, ConvNet):
        blocks: tuple = (net.emb, net.conv, net.head)
    else:
        blocks = (net.emb, net.block, net.head) if isinstance(net, Encoder) else (net.emb, net.fc1, net.fc2)
    for m in blocks:
        fully_shard(m, **kw)
    fully_shard(net, **kw)
    return net


def sharded_mlp() -> torch.nn.Module:
    net = mlp(0)  # the same initial weights on every rank (FSDP2 does not broadcast)
    for m in (net[0], net[2]):
        fully_shard(m)
    fully_shard(net)
    return net


def main() -> None:
    scenario, out, opts, rank, steps, batch, z, clip, seed, ledger = start(4)
    if scenario == "greybox":
        return greybox(out, opts, rank, sharded_mlp)
    net = shard(model(0, int(opts.get("width", 7)), opts.get("model", "net")), opts.get("mp", "none"))
    kw: dict = {}
    if opts.get("adaptive") == "1":
        kw["query"] = adaptive_query(clip, z, batch, N)
    else:
        kw["noise_multiplier"], kw["max_grad_norm"] = z, clip
    if "physical" in opts:
        kw["max_physical_batch_size"] = int(opts["physical"])
    if "on_nonfinite" in opts:
        kw["on_nonfinite"] = opts["on_nonfinite"]
    ds = dataset()
    opt_cls = torch.optim.Adam if opts.get("optim") == "adam" else torch.optim.SGD
    opt = opt_cls(net.parameters(), lr=float(opts.get("lr", 0.05)))
    reduction = opts.get("reduction", "mean")
    net, opt, loader = make_private(net, opt, DataLoader(ds, batch_size=batch), ledger=ledger, seed=seed,
                                    loss_reduction=reduction, **kw)
    loader.steps = steps
    result: dict = {"indices": [], "errors": None, "completed": 0, "clips": []}
    emptied = empty_steps(opts, rank)
    nan_at = int(opts.get("nan_at", -1))
    cur: list = []
    die_after = int(opts.get("die_after", -1))
    grads: list = []
    try:
        for x, y in loader:
            idx = loader.last_indices.copy()
            if result["completed"] in emptied:
                x, y, idx = x[:0], y[:0], idx[:0]
            cur.append(idx)
            opt.zero_grad()
            # Under FSDP2 every rank runs every forward and backward pass (they gather the
            # weights together), also on an empty batch.
            if True:
                out_ = net(x)
                if rank == 1 and result["completed"] == nan_at:
                    bad = torch.ones(len(x), 1)
                    bad[0] = float("nan")
                    out_ = out_ * bad  # a non-finite record on one rank only
                if scenario == "noise":
                    loss = (out_ * 0.0).sum()
                else:
                    loss = torch.nn.functional.cross_entropy(out_, y, reduction=reduction)
                loss.backward()
            opt.step()
            if not opt.last_step_released:  # between micro-batches: what the optimizer holds
                held = sum(a.numel() for a in opt._batch.acc if a is not None)
                result["held_numel"] = max(result.get("held_numel", 0), held)
            if opt.last_step_released:
                import numpy as np

                result["indices"].append(np.concatenate(cur) if cur else np.zeros(0, np.int64))
                cur = []
                result["completed"] += 1
                result["clips"].append(opt._groups[0].plan().l2_norm_clip)
                if scenario == "noise":
                    grads.append([p.grad.full_tensor().detach().clone() for p in net.parameters()])
                if rank == 1 and result["completed"] == die_after:
                    os._exit(3)
    except (DistributedError, ValueError) as e:
        result["errors"] = f"{type(e).__name__}: {e}"
    result["params"] = [p.full_tensor().detach().clone() for p in net.parameters()]
    result["local_numel"] = sum(p.to_local().numel() for p in net.parameters())
    result["full_numel"] = sum(p.numel() for p in net.parameters())
    result["state_local_numel"] = sum(
        v.to_local().numel() if hasattr(v, "to_local") else 0 for s in opt.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    result["grads"] = grads
    finish(result, opt, out, rank, z * clip / batch)


if __name__ == "__main__":
    main()
