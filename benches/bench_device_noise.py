"""Gaussian noise on the parameters' device: dpcore.torch._device_noise against the core + copy,
and against torch.randn (not a CSPRNG; the floor).

For each device (CPU always; CUDA when available, else "no GPU here") and size n, median seconds
of each contender, timed in alternating blocks (see _timing.alternating_blocks):

* ``device``: ``device_gaussian_noise(n, 1.0, device=dev)``, OS-keyed (the private path): ChaCha20
  in torch ops on ``dev`` + Box-Muller;
* ``core+copy``: ``torch.from_numpy(dpcore.gaussian_noise(n, 1.0)).to(dev)`` (ChaCha20 + ziggurat
  in the Rust core on the host, then the copy; no copy on CPU);
* ``randn``: ``torch.randn(n, device=dev)``.

float32 throughout; CUDA calls are synchronized inside the timed call. Ratios are device / other.
Then the peak memory of one ``device`` draw of ``--peak-n`` values (CPU: peak RSS above the
process's RSS before the call, in a fresh child process; CUDA: torch.cuda.max_memory_allocated
above the memory allocated before the call).

    python benches/bench_device_noise.py [--sizes 100000 1000000 10000000] [--blocks 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import dpcore  # noqa: E402
from _timing import alternating_blocks, call_times  # noqa: E402
from dpcore.torch._device_noise import device_gaussian_noise  # noqa: E402


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def peak_child(n: int) -> None:
    """Run in a fresh process: peak RSS of one CPU draw of n float32 values, above the RSS before."""
    device_gaussian_noise(1 << 16, 1.0, device="cpu", seed=1)  # load libraries, warm the allocator
    base = _rss_kib()
    t = time.perf_counter()
    x = device_gaussian_noise(n, 1.0, device="cpu")
    el = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out = x.numel() * x.element_size() / 2**20
    print(f"PEAK {n} {el:.3f} {out:.1f} {(peak - base) / 1024:.1f}")


def contenders(n: int, dev: torch.device):
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def device():
        device_gaussian_noise(n, 1.0, device=dev)
        sync()

    def core_copy():
        torch.from_numpy(dpcore.gaussian_noise(n, 1.0)).to(dev)
        sync()

    def randn():
        torch.randn(n, device=dev)
        sync()

    return {"device": device, "core+copy": core_copy, "randn": randn}


def bench(dev: torch.device, sizes, blocks: int) -> list:
    print(f"\n== {dev.type}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else f" ({torch.get_num_threads()} torch threads)"))
    print(f"{'n':>10} {'device ms':>11} {'core+copy ms':>13} {'randn ms':>10} {'dev/core':>9} {'dev/randn':>10}")
    rows = []
    for n in sizes:
        fns = contenders(n, dev)
        for fn in fns.values():
            fn()  # warm-up
        # Calls per block: about 0.5 s of the slowest contender, at least 1.
        per = max(1, min(20, int(0.5 / max(min(call_times(fns["device"], 1)), 1e-6))))
        ts = alternating_blocks(fns, blocks, lambda fn: call_times(fn, per))
        med = {k: statistics.median(v) for k, v in ts.items()}
        print(
            f"{n:>10} {med['device'] * 1e3:>11.2f} {med['core+copy'] * 1e3:>13.2f} {med['randn'] * 1e3:>10.2f}"
            f" {med['device'] / med['core+copy']:>9.1f} {med['device'] / med['randn']:>10.1f}"
        )
        rows.append({"device": dev.type, "name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                     "n": n, **{f"{k}_ms": v * 1e3 for k, v in med.items()}})
    return rows


def peak(dev: torch.device, n: int) -> None:
    if dev.type == "cuda":
        device_gaussian_noise(1 << 16, 1.0, device=dev, seed=1)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        x = device_gaussian_noise(n, 1.0, device=dev)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
        print(f"peak CUDA memory of a {n:.0e} draw: {extra:.1f} MiB above before "
              f"(output {x.numel() * x.element_size() / 2**20:.1f} MiB)")
        return
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak-child", str(n)], capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("PEAK ")]
    if not line:
        print("peak measurement failed:", p.stderr[-500:])
        return
    _, n_, el, out, extra = line[0].split()
    print(f"peak RSS of a {int(n_):.0e} CPU draw: {float(extra):.1f} MiB above before (output {float(out):.1f} MiB, "
          f"temporaries ~{float(extra) - float(out):.1f} MiB; took {float(el):.2f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--peak-n", type=int, default=10_000_000)
    ap.add_argument("--peak-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=None,
                    help="default: cpu, and cuda when available")
    ap.add_argument("--json", help="also write the timings to this file")
    a = ap.parse_args()
    if a.peak_child is not None:
        peak_child(a.peak_child)
        return
    names = a.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    devs = [torch.device(d) for d in names if d == "cpu" or torch.cuda.is_available()]
    rows = []
    for dev in devs:
        rows += bench(dev, a.sizes, a.blocks)
        peak(dev, a.peak_n)
    if "cuda" not in [d.type for d in devs]:
        print("\n== cuda: no GPU here")
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
