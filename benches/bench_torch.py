"""DP-SGD step time on CPU, side by side in one run: dpcore.torch vs plain torch vs Opacus.

MLP 784-1024-256-10 (1.07M parameters) at batch 256: non-private torch (the anchor), dpcore.torch
(factored fast path, flat clipping, noise from the core, ledger fsync every step), Opacus
grad_sample_mode="hooks" and "ghost" (skipped when opacus is not installed). Then the generic
vmap path on a small conv net against Opacus hooks. Ratios to the anchor.

The contenders run in alternating blocks of --block steps (--rounds rounds), and each one's time
per step is the median over its blocks: the machine's load drifts within a run, and alternating
spreads the drift over all of them. A block's time ends only once dpcore's background work (the
next release's noise, drawn while torch computes) has finished, so that work is counted in
dpcore's time and never in the next contender's. Opacus hooks is ~70x slower and is timed in
shorter blocks. ``python benches/bench_torch.py [--rounds 9] [--block 8]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

import dpcore
from dpcore.torch import DPOptimizer

torch.set_num_threads(2)
warnings.filterwarnings("ignore")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 7 * 7, 10),
    )


def block_time(step, n: int) -> float:
    """Seconds per step over n consecutive steps, background work of the last one included."""
    t = time.perf_counter()
    for _ in range(n):
        step()
    settle = getattr(step, "settle", None)
    if settle is not None:
        settle()
    return (time.perf_counter() - t) / n


def timed(rows, rounds: int, block: int) -> dict:
    """Median ms per step of each (name, step) row, the rows run in alternating blocks."""
    live = [(name, s) for name, s in rows if s is not None]
    for _, s in live:
        block_time(s, 3)
    per = {name: [] for name, _ in live}
    for _ in range(rounds):
        for name, s in live:
            n = max(1, block // getattr(s, "slow", 1))
            per[name].append(block_time(s, n))
    return {name: statistics.median(v) * 1e3 for name, v in per.items()}


def report(rows, times) -> None:
    base = None
    for name, s in rows:
        if s is None:
            print(f"  {name:28s}  skipped (opacus not installed)")
            continue
        ms = times[name]
        base = base or ms
        print(f"  {name:28s} {ms:8.2f} ms   {ms / base:6.2f}x non-private")


def plain_step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def dpcore_step(model, x, y, mode="auto"):
    led = dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(prefix="bench-"), "ledger.jsonl"))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model, noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=len(x), ledger=led, grad_sample_mode=mode)
    n = 60_000

    def step():
        led.record_sample(n, len(x) / n)  # what DPDataLoader does; the sampling itself is not timed
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def settle():
        pending = opt._next_noise
        if pending is not None:
            pending[2].result()

    step.settle = settle
    return step


def opacus_step(model, x, y, mode):
    try:
        from opacus import PrivacyEngine
    except ImportError:
        return None
    ds = torch.utils.data.TensorDataset(x, y)
    dl = torch.utils.data.DataLoader(ds, batch_size=len(x))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pe = PrivacyEngine()
    crit = nn.CrossEntropyLoss()
    if mode == "ghost":
        model, opt, crit, dl = pe.make_private(module=model, optimizer=opt, data_loader=dl, criterion=crit,
                                               noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost",
                                               poisson_sampling=False)
    else:
        model, opt, dl = pe.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
                                         max_grad_norm=1.0, grad_sample_mode=mode, poisson_sampling=False)

    def step():
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()

    if mode == "hooks":
        step.slow = 8  # shorter blocks: ~70x the others' step time
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--block", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(256, 784), torch.randint(0, 10, (256,))
    rows = [("non-private torch", plain_step(mlp(), x, y)), ("dpcore.torch (fast path)", dpcore_step(mlp(), x, y))]
    for mode in ("hooks", "ghost"):
        rows.append((f"Opacus {mode}", opacus_step(mlp(), x, y, mode)))
    print(f"MLP 784-1024-256-10, batch 256, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"medians of {args.rounds} alternating blocks of {args.block} steps")
    report(rows, timed(rows, args.rounds, args.block))
    xc, yc = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    print("small conv net (2 conv + linear), batch 64")
    conv_rows = [("non-private torch", plain_step(convnet(), xc, yc)),
                 ("dpcore.torch generic vmap", dpcore_step(convnet(), xc, yc, mode="generic")),
                 ("dpcore.torch auto", dpcore_step(convnet(), xc, yc)),
                 ("Opacus hooks", opacus_step(convnet(), xc, yc, "hooks"))]
    for name, s in conv_rows:
        if name == "Opacus hooks" and s is not None:
            s.slow = 1  # the conv net is small: same block length as the others
    report(conv_rows, timed(conv_rows, args.rounds, args.block))


if __name__ == "__main__":
    main()
