"""CPU step overhead of dpcore.torch against plain torch, both built in ONE process and timed
step by step in alternation, so that the shared machine's drift falls on both alike.

Models (those of ``bench_torch.py``): ``cnn`` (4 x (Conv2d 3x3 + GroupNorm + ReLU), 32x32x3,
B=64) and ``mlp`` (784-1024-256-10, B=256); by name ``wrn16-4`` and ``resnet18`` (GroupNorm,
strided downsampling, 32x32x3, B=64). For each model two copies start from the same seed:
``non-private`` (SGD; zero_grad, forward, loss, backward, step) and ``dpcore``
(``dpcore.torch.make_private``, noise multiplier 1.0, max grad norm 1.0). Both draw a fixed batch
of B records from their own loader (a DataLoader over the same 50·B records, in order, with batch
size B; dpcore's with ``sampler="shuffle"``, so both see the same B records at the same step;
``--poisson`` gives dpcore its Poisson loader, expected batch B, instead). After ``--warmup`` steps of each, ``--rounds``
rounds each time one step of every configuration, the order flipped every round; the table shows
the medians of the per-step times (wall and process CPU) and the ratio dpcore / non-private,
plus the median of the per-round ratios (each round's two steps ran next to each other).

``--profile`` runs cProfile (or ``--torch-profile``, torch.profiler) over extra dpcore steps
after the timing and prints the top entries.

``python benches/bench_step_overhead.py [--models cnn mlp] [--rounds 200] [--warmup 10]
[--threads 2] [--noise 1.0] [--poisson] [--profile | --torch-profile]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from torch import nn

from bench_torch import RECORDS_PER_BATCH, _build  # the same models and data

CONFIGS = ("non-private", "dpcore")


def _forever(loader: Any):
    while True:
        yield from loader


def _make(model_name: str, config: str, noise: float, poisson: bool) -> Callable[[], None]:
    model, b, make = _build(model_name)  # same seed every time: identical initial weights
    # 50·B records visited in order, B at a time: the same batches in both configurations (one
    # batch trained on over and over is memorised, and the tiny gradients that follow turn
    # denormal, which slows float32 arithmetic many times over).
    x, y = make(RECORDS_PER_BATCH * b)
    ds = torch.utils.data.TensorDataset(x, y)
    loader: Any = torch.utils.data.DataLoader(ds, batch_size=b, shuffle=False, drop_last=True)
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.01)
    if config == "dpcore":
        import dpcore.torch

        model, opt, loader = dpcore.torch.make_private(
            model, opt, loader, noise_multiplier=noise, max_grad_norm=1.0,
            sampler="poisson" if poisson else "shuffle")
    model.train()
    crit = nn.CrossEntropyLoss()
    batches = _forever(loader)

    def step() -> None:
        xb, yb = next(batches)
        opt.zero_grad()
        crit(model(xb), yb).backward()
        opt.step()

    return step


def run(model_name: str, args: argparse.Namespace) -> Dict[str, Any]:
    steps = {c: _make(model_name, c, args.noise, args.poisson) for c in CONFIGS}
    for _ in range(args.warmup):
        for c in CONFIGS:
            steps[c]()
    wall: Dict[str, List[float]] = {c: [] for c in CONFIGS}
    cpu: Dict[str, List[float]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        for c in order:
            t, p = time.perf_counter(), time.process_time()
            steps[c]()
            wall[c].append((time.perf_counter() - t) * 1e3)
            cpu[c].append((time.process_time() - p) * 1e3)
    pair = [d / n for d, n in zip(wall["dpcore"], wall["non-private"])]
    out = {"wall": {c: statistics.median(v) for c, v in wall.items()},
           "cpu": {c: statistics.median(v) for c, v in cpu.items()},
           "pair_ratio": statistics.median(pair),
           "q": {c: (statistics.quantiles(v, n=4)[0], statistics.quantiles(v, n=4)[2]) for c, v in wall.items()}}
    if args.profile or args.torch_profile:
        _profile(steps["dpcore"], args)
    return out


def _profile(step: Callable[[], None], args: argparse.Namespace) -> None:
    n = max(10, args.rounds // 4)
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    else:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            step()
        pr.disable()
        print(f"cProfile over {n} dpcore steps (tottime):")
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=("cnn", "mlp", "wrn16-4", "resnet18"), default=["cnn", "mlp"],
                    help="wrn16-4 and resnet18: bench_torch.py's GroupNorm ResNets (the CNNs people train)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--poisson", action="store_true", help="dpcore draws Poisson batches (expected size B)")
    ap.add_argument("--profile", action="store_true", help="cProfile extra dpcore steps")
    ap.add_argument("--torch-profile", action="store_true", help="torch.profiler over extra dpcore steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, noise {args.noise}, {args.rounds} alternating "
          f"rounds after {args.warmup} warm-up steps each, {'Poisson' if args.poisson else 'fixed'} dpcore batches; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'model':6s} {'non-private ms':>15s} {'dpcore ms':>10s} {'ratio':>7s} {'cpu np':>8s} {'cpu dp':>8s} "
          f"{'cpu ratio':>9s} {'paired ratio':>12s}  IQR np / dp (ms)")
    for m in args.models:
        r = run(m, args)
        w, c = r["wall"], r["cpu"]
        qn, qd = r["q"]["non-private"], r["q"]["dpcore"]
        print(f"{m:6s} {w['non-private']:15.2f} {w['dpcore']:10.2f} {w['dpcore'] / w['non-private']:6.2f}x "
              f"{c['non-private']:8.2f} {c['dpcore']:8.2f} {c['dpcore'] / c['non-private']:8.2f}x "
              f"{r['pair_ratio']:11.2f}x  {qn[0]:.1f}-{qn[1]:.1f} / {qd[0]:.1f}-{qd[1]:.1f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
