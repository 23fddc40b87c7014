"""A NestedQuery of G groups vs one flat clip_noise call on the same bytes.

Issue 17's target: a 10-group NestedQuery step (accumulate_records then get_noised_result: one
Rust call clips every group to its own bound, one more draws every group's noise) within 1.2x of
a single flat ``clip_noise`` over the same float32 arrays. Both are timed side by side,
interleaved, in one run, for several sizes; medians are printed with their ratios.
``accumulate`` alone (no noise) is printed beside it for information.

    python benches/bench_queries.py [--repeats 21] [--sizes 10000000x64x10,1000000x256x10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dpcore import clip_noise
from dpcore.queries import GaussianSumQuery, NestedQuery

SIZES = "10000000x64x10,10000000x64x3,1000000x256x10,100000x32x10"


def bench(values: int, b: int, groups: int, repeats: int) -> None:
    per_record = values // b
    # Groups of unequal width, like the layers of a network: widths ∝ 1, 2, …, G.
    weights = np.arange(1, groups + 1)
    widths = [int(w) for w in per_record * weights // weights.sum()]
    widths[-1] += per_record - sum(widths)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((b, w), dtype=np.float32) for w in widths]
    total = sum(a.size for a in arrays)
    query = NestedQuery({f"layer{k}": GaussianSumQuery(1.0 + k, 1.0 + k) for k in range(groups)})
    gs = query.initial_global_state()
    params = query.derive_sample_params(gs)
    records = {f"layer{k}": a for k, a in enumerate(arrays)}
    state0 = query.initial_sample_state({f"layer{k}": a[0] for k, a in enumerate(arrays)})

    def run_step() -> None:
        query.get_noised_result(query.accumulate_records(params, state0, records), gs)

    def run_accumulate() -> None:
        query.accumulate_records(params, state0, records)

    def run_anchor() -> None:
        clip_noise(arrays, 1.0, 1.0)

    fs = (run_step, run_accumulate, run_anchor)
    for f in fs:  # warm up page tables and the thread pool
        f()
    times: list = [[] for _ in fs]
    for _ in range(repeats):
        for f, acc in zip(fs, times):
            t0 = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t0)
    ms = [statistics.median(t) * 1e3 for t in times]
    print(
        f"{total:>9} values  B={b:<4} G={groups:<3} step {ms[0]:8.3f} ms  accumulate {ms[1]:8.3f} ms  "
        f"flat clip_noise {ms[2]:8.3f} ms   step/flat {ms[0] / ms[2]:5.2f}  (accumulate/flat {ms[1] / ms[2]:4.2f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--sizes", default=SIZES, help="values x batch x groups, comma separated")
    args = ap.parse_args()
    print("NestedQuery step (1 clip call + 1 noise call) vs flat clip_noise; target step/flat <= 1.2 at G=10")
    for size in args.sizes.split(","):
        values, b, g = (int(x) for x in size.split("x"))
        bench(values, b, g, args.repeats)


if __name__ == "__main__":
    main()
