"""accumulate_records of a 3-group NestedQuery vs one clip_noise call on the same bytes.

Issue 4's speed target: accumulating a batch through the query tree (one Rust clip-sum call per
group, float64 sample state) must stay within 1.2x of a single flat ``clip_noise`` call over the
same float32 arrays (10^7 values in total). Both are timed side by side, interleaved, in one run;
medians are printed with their ratio.

    python benches/bench_queries.py [--values 10000000] [--batch 64] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dpcore import clip_noise
from dpcore.queries import GaussianSumQuery, NestedQuery


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    b = args.batch
    per_record = args.values // b
    # Three groups of unequal width, like a conv stack, a dense layer and a head.
    widths = [per_record // 2, per_record * 3 // 10]
    widths.append(per_record - sum(widths))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((b, w), dtype=np.float32) for w in widths]
    total = sum(a.size for a in arrays)

    query = NestedQuery({"conv": GaussianSumQuery(1.0, 1.0), "dense": GaussianSumQuery(0.5, 1.0), "head": GaussianSumQuery(0.1, 1.0)})
    gs = query.initial_global_state()
    params = query.derive_sample_params(gs)
    template = {"conv": arrays[0][0], "dense": arrays[1][0], "head": arrays[2][0]}
    records = {"conv": arrays[0], "dense": arrays[1], "head": arrays[2]}
    state0 = query.initial_sample_state(template)

    def run_query() -> None:
        query.accumulate_records(params, state0, records)

    def run_anchor() -> None:
        clip_noise(arrays, 1.0, 1.0)

    def run_step() -> None:  # for information: the whole step, noise included
        st = query.accumulate_records(params, state0, records)
        query.get_noised_result(st, gs)

    for f in (run_query, run_anchor, run_step):  # warm up page tables and the thread pool
        f()
    tq, ta, ts = [], [], []
    for _ in range(args.repeats):
        for f, acc in ((run_query, tq), (run_anchor, ta), (run_step, ts)):
            t0 = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t0)
    mq, ma = statistics.median(tq), statistics.median(ta)
    gb = total * 4 / 1e9
    print(f"{total} float32 values, B={b}, groups of {widths} values per record, {args.repeats} repeats")
    print(f"anchor  clip_noise (flat, 1 call)           median {ma * 1e3:8.2f} ms  ({gb / ma:6.2f} GB/s)")
    print(f"query   NestedQuery.accumulate_records (3)  median {mq * 1e3:8.2f} ms  ({gb / mq:6.2f} GB/s)")
    print(f"ratio   query / anchor = {mq / ma:.3f}  (target <= 1.2)")
    print(f"(info)  accumulate + get_noised_result       median {statistics.median(ts) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
