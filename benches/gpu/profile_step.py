"""Where a DP step's time goes on a GPU: bench_torch.py's models, dpcore against non-private, with
a long warm-up (the device noise's block function compiles on first use), then the median of
timed steps, the host-device synchronisations per step (``torch.cuda.set_sync_debug_mode``) and
the torch profiler's top operations by self CPU time and by self CUDA time.

    python benches/gpu/profile_step.py [--models transformer cnn] [--bf16] [--steps 20] [--json out.json]

CPU runs work too (``--device cpu``), for the dry run; the profiler tables are then CPU-only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import bench_torch as bt  # noqa: E402


def profile(model_name: str, config: str, device: torch.device, steps: int, warmup: int, top: int) -> dict:
    model, b, make = bt._build(model_name)
    x, y = make(bt.RECORDS_PER_BATCH * b)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=b, shuffle=True, drop_last=True)
    step, loader = bt._setup(config, model, loader, device)
    batches = bt._forever(loader)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step(next(batches))
    sync()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(next(batches))
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    syncs = []
    if cuda:
        for _ in range(3):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step(next(batches))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchroniz" in str(w.message).lower() for w in seen))
        sync()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            step(next(batches))
        sync()
    ka = prof.key_averages()
    # Python-level wall time, which the torch profiler does not attribute: Rust calls that release
    # the GIL, torch.compile guards and recompilations, Python loops between operators.
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        step(next(batches))
    sync()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    recompiles = None
    try:
        from torch._dynamo.utils import counters
        recompiles = {k: dict(v) for k, v in counters.items() if k in ("recompiles", "stats", "frames")}
    except Exception:  # noqa: BLE001
        pass
    out = {"model": model_name, "config": config, "device": str(device), "warmup_s": warm_s,
           "ms": statistics.median(times), "times": times, "syncs_per_step": syncs,
           "dynamo": recompiles, "top_python": "\n".join(buf.getvalue().splitlines()[:top + 12]),
           "top_cpu": ka.table(sort_by="self_cpu_time_total", row_limit=top)}
    if cuda:
        out["top_cuda"] = ka.table(sort_by="self_cuda_time_total", row_limit=top)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["transformer", "cnn"])
    ap.add_argument("--configs", nargs="+", default=["non-private", "dpcore"])
    ap.add_argument("--bf16", action="store_true", help="also the configurations under bfloat16 autocast")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(a.device)
    configs = a.configs + ([c + bt.BF16 for c in a.configs] if a.bf16 else [])
    res = []
    for m in a.models:
        for c in configs:
            r = profile(m, c, device, a.steps, a.warmup, a.top)
            res.append(r)
            print(f"\n### {m} {c}: {r['ms']:.2f} ms/step median of {len(r['times'])} (warm-up {r['warmup_s']:.1f} s), "
                  f"syncs per step {r['syncs_per_step']}")
            print(f"dynamo counters: {r['dynamo']}")
            print("Python wall time by function (cProfile, 5 steps, tottime):")
            print(r["top_python"])
            print(r["top_cpu"])
            if "top_cuda" in r:
                print(r["top_cuda"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if not k.startswith("top")} for r in res], f, indent=1)


if __name__ == "__main__":
    main()
