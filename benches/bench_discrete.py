"""Issue 17 speed target: the discrete Gaussian mechanism against the continuous one.

``clip_noise(..., mechanism="discrete_gaussian")`` (records rounded onto the grid and summed
exactly, integer noise from the exact sampler of Canonne, Kamath & Steinke 2020) against
``clip_noise`` with float Gaussian noise, on the same input, timed in alternating blocks so that a
change in this shared VM's speed falls on both alike. Also each part alone: the rounded clipped
sum (noise multiplier 0) and the noise alone (an empty batch). Target: discrete ≤ 2× continuous.

Run: python benches/bench_discrete.py [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse

import numpy as np

import dpcore
from _timing import alternating_blocks, call_times

C, Z = 1.0, 1.1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    shapes = [(256, 100_000)] if a.quick else [(256, 100_000), (64, 1_000_000)]
    for shape in shapes:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        empty = np.zeros((0, shape[1]), np.float32)
        runs = {
            "continuous": lambda: dpcore.clip_noise(x, C, Z),
            "discrete": lambda: dpcore.clip_noise(x, C, Z, mechanism="discrete_gaussian"),
            "discrete, rounded sum only (z = 0)": lambda: dpcore.clip_noise(x, C, 0.0, mechanism="discrete_gaussian"),
            "discrete, noise only (B = 0)": lambda: dpcore.clip_noise(empty, C, Z, mechanism="discrete_gaussian"),
            "continuous, noise only (B = 0)": lambda: dpcore.clip_noise(empty, C, Z),
        }
        for f in runs.values():
            f()
        times = alternating_blocks(runs, a.repeats, lambda f: call_times(f, 5))
        med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
        p = dpcore.discrete_gaussian_params(C, Z, shape[1])
        print(f"\nclip_noise float32 {shape}, C={C}, z={Z}; grid γ = 2^{np.log2(p.granularity):.0f}, "
              f"sensitivity after rounding {p.sensitivity:.6f}, noise σ = {p.stddev:.6f}")
        for k, v in med.items():
            print(f"  {k:38s} {v:8.2f} ms")
        r = med["discrete"] / med["continuous"]
        print(f"  discrete / continuous: {r:.2f}x  (target <= 2x: {'met' if r <= 2 else 'MISSED'})")


if __name__ == "__main__":
    main()
