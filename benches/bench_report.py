"""Speed of the privacy report and the ε curve on long ledgers (`dpcore report`, `dpcore plot`).

Writes three ledgers in the file format (a 10⁵-step one in two segments, 10⁶-step ones in
one segment and in 100 segments of different q), then times, as the CLI does them: loading the ledger (the core's
fast reader) and building the report (PLD ε, its lower bound and RDP), and loading plus the
ε-vs-steps curve at 200 points (PLD and RDP). Targets: curve of 10⁵ steps ≤ 2 s, report of
10⁶ steps ≤ 5 s. Medians of ``--repeats`` runs. No anchor: no other library reports from a ledger.

``python benches/bench_report.py [--repeats 3]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import dpcore


def write(path: str, steps: int, segments: int) -> None:
    per = steps // segments
    with open(path, "w") as f:
        f.write('{"format": "dpcore-privacy-ledger", "version": 1, "privacy_unit": "example"}\n')
        for i in range(steps):
            q = 0.002 + 0.004 * (i // per) / segments
            f.write(
                f'{{"type": "sample", "sample": {i}, "population_size": 60000, "sampling_probability": {q!r}, '
                f'"policy": "poisson", "sample_size": null, "seeded": false}}\n'
                f'{{"type": "sum_query", "sample": {i}, "l2_norm_clip": 1.0, "stddev": 1.1}}\n'
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="dpcore-bench-report-")
    small, big, many = (os.path.join(d, f) for f in ("l5.jsonl", "l6.jsonl", "l6x100.jsonl"))
    write(small, 10**5, 2)
    write(big, 10**6, 1)
    write(many, 10**6, 100)
    print(f"ledgers: 10^5 steps in 2 segments ({os.path.getsize(small) / 2**20:.0f} MiB), 10^6 steps in 1 and in "
          f"100 segments ({os.path.getsize(big) / 2**20:.0f} MiB)")

    def curve() -> None:
        dpcore.PrivacyLedger.load(small).epsilon_curve(1e-5, points=200)

    def report() -> None:
        dpcore.PrivacyLedger.load(big).report(1e-5)

    def report_many() -> None:
        dpcore.PrivacyLedger.load(many).report(1e-5)

    for name, fn, target in (
        ("ε curve, 10^5 steps, 200 points", curve, 2.0),
        ("report, 10^6 steps, one (q, σ)", report, 5.0),
        ("report, 10^6 steps, 100 segments of different q", report_many, 5.0),
    ):
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        print(f"{name}: median {med:.2f} s over {len(ts)} (min {min(ts):.2f}); target <= {target:g} s: "
              f"{'ok' if med <= target else 'MISSED'}")


if __name__ == "__main__":
    main()
