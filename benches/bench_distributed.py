"""Data-parallel DP-SGD on torch.distributed: 1 against 2 processes, DP against non-private DDP.

Side by side in one run (gloo on CPU, or NCCL with ``--backend nccl`` on a GPU machine), each
configuration in its own processes, on the MLP 784-1024-256-10 (1.07 M parameters) and a
Conv2d net (4 × (Conv2d 3×3 + GroupNorm + ReLU), 32×32×3 inputs), global batch B (256 and 64):

* ``np-1``: one process, non-private (``--threads`` threads);
* ``dp-1``: one process, ``dpcore.torch.DPOptimizer`` (clipping, noise, ledger fsync);
* ``ddp-2``: two processes, ``DistributedDataParallel``, B/2 records each, one thread each;
* ``dp-2``: two processes, DPOptimizer under torch.distributed (the model wrapped in DDP, whose
  all-reduce dpcore switches off), B/2 records each, one thread each.

Every step uses the same batch sizes (B, or B/2 per rank), so the comparison is of the
mechanism, not of Poisson batch sizes; the sample is recorded in the ledger as in training.

Printed: median step time, throughput (records per second), the speed-up of 2 processes over 1,
the ratio DP/non-private at each world size, and the *communication overhead of DP over DDP*:
(dp-2 / ddp-2) / (dp-1 / np-1), what going data-parallel costs DP beyond what it costs
non-private training (target ≤ 1.2). The seconds per step dpcore spends inside its collectives
are shown beside it.

``python benches/bench_distributed.py [--models mlp cnn] [--steps 30] [--batch B] [--json F]``
(about 5 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

CONFIGS = ("np-1", "dp-1", "ddp-2", "dp-2")


def build(model: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if model == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)), (784,)
    chans = [3, 32, 32, 64, 64]
    layers: List[Any] = []
    for a, b in zip(chans, chans[1:]):
        layers += [nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(8, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)), (3, 32, 32)


def child(model: str, config: str, steps: int, batch: int, threads: int, backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import dpcore
    from dpcore.torch import DPOptimizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank() if world > 1 else 0
    torch.set_num_threads(threads)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    net, shape = build(model)
    net = net.to(dev)
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[rank] if dev.type == "cuda" else None)
    local = batch // world
    n = 50 * batch
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn((local,) + shape, generator=g).to(dev)
    y = torch.randint(0, 10, (local,), generator=g).to(dev)
    sgd = torch.optim.SGD(net.parameters(), lr=0.05)
    dp = config.startswith("dp")
    ledger_dir = tempfile.mkdtemp(prefix="dpcore-bench-")
    opt: Any = sgd
    if dp:
        opt = DPOptimizer(sgd, model=net, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=float(batch),
                          ledger=os.path.join(ledger_dir, "ledger.jsonl"))
    times: List[float] = []
    comm = getattr(opt, "_comm", None)
    comm_s: List[float] = []
    for i in range(steps + 5):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        c0 = comm.seconds if comm is not None else 0.0
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if dp:
            opt.ledger.record_sample(n, batch / n, "poisson")
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - t0)
            if comm is not None:
                comm_s.append(comm.seconds - c0)
    if world > 1:
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "comm": comm_s}, f)
    if world > 1:
        dist.destroy_process_group()


def run(model: str, config: str, args: argparse.Namespace, batch: int) -> Dict[str, Any]:
    world = 2 if config.endswith("-2") else 1
    threads = args.threads if world == 1 else max(1, args.threads // 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, __file__, "--one", model, config, str(args.steps), str(batch), str(threads), args.backend, out]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait(600) != 0:
            raise SystemExit(f"{model} {config}: a rank failed")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        m, c, steps, batch, threads, backend, out = sys.argv[2:9]
        child(m, c, int(steps), int(batch), int(threads), backend, out)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: MLP 256, CNN 64)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="threads of a single process; each of 2 ranks gets half")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--json")
    args = ap.parse_args()
    results: Dict[str, Any] = {}
    for model in args.models:
        b = args.batch or {"mlp": 256, "cnn": 64}[model]
        pooled: Dict[str, List[float]] = {c: [] for c in CONFIGS}
        comm: List[float] = []
        for r in range(args.rounds):
            for c in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                res = run(model, c, args, b)
                pooled[c] += res["times"]
                if c == "dp-2":
                    comm += res["comm"]
        med = {c: statistics.median(v) * 1e3 for c, v in pooled.items()}
        print(f"\n{model}, global batch {b}, {args.backend}")
        print(f"{'config':8} {'median ms':>10} {'records/s':>10}")
        for c in CONFIGS:
            print(f"{c:8} {med[c]:10.2f} {b / med[c] * 1e3:10.0f}")
        over = (med["dp-2"] / med["ddp-2"]) / (med["dp-1"] / med["np-1"])
        print(f"2 processes over 1: non-private {med['np-1'] / med['ddp-2']:.2f}x, DP {med['dp-1'] / med['dp-2']:.2f}x")
        print(f"DP / non-private: 1 process {med['dp-1'] / med['np-1']:.2f}x, 2 processes {med['dp-2'] / med['ddp-2']:.2f}x")
        print(f"communication overhead of DP over DDP: {over:.2f}x (target <= 1.2); "
              f"dpcore's collectives {statistics.median(comm) * 1e3:.2f} ms per step")
        results[model] = {"median_ms": med, "comm_overhead": over, "collectives_ms": statistics.median(comm) * 1e3}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
