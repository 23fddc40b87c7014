"""clip_noise right after a multithreaded BLAS call, the way a numpy (or torch) training loop runs it.

A training step computes with BLAS (here: a float32 matmul (512×2048)·(2048×2048), ~20 ms on two
cores, standing for the products of a forward/backward pass) and then calls
``dpcore.clip_noise`` on the per-example gradients, float32 (256, 100_000). Only the clip_noise
call is timed. Rows:

* quiet: clip_noise back to back, nothing else in the process.
* numpy: BLAS call, clip_noise, BLAS call, ... with OpenBLAS as numpy ships it. Its idle worker
  busy-waits 2**28 cycles (~0.1 s) after every call, on a core dpcore's threads need.
* remedies: OPENBLAS_THREAD_TIMEOUT=4 / =20 in the environment (read at numpy import), the same
  applied at run time by dpcore's helper (``limit_blas_spin``), and threadpoolctl limiting BLAS to
  one thread around the BLAS call (for comparison; it doubles the BLAS call).
* torch: the same with torch.matmul (MKL on libgomp's OpenMP pool, whose threads spin for
  GOMP_SPINCOUNT iterations after each parallel region), default and with GOMP_SPINCOUNT=10000
  or OMP_WAIT_POLICY=passive (read at torch import). Skipped when torch is not installed (and the
  threadpoolctl row when threadpoolctl is not).

Target: clip_noise after BLAS ≤ 1.2× the quiet time. A remedy's own cost is printed beside it:
the median time of a small back-to-back call (sgemm 256³, torch matmul 256³), which pays a
wake-up when the workers park at once.

Every row runs in its own process (the variables must be set before numpy or torch is loaded).
Rows are run in alternating blocks and each median is over all blocks, so that a change in the
machine's speed part-way falls on every row alike. "others" is the CPU (in cores) that other
processes on the machine used while the row ran: a row with others ≥ 0.3 on a two-core machine
ran on a core short; such a run is repeated (twice at most, in the first 45 s) and the row is
flagged if its median stays loaded.

Run: python benches/bench_blas.py [--quick] [--blocks N] [--iters N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

SHAPE = (256, 100_000)
M, K, N = 512, 2048, 2048
SMALL = 256
C, Z = 1.0, 1.1
# Cleared in every child unless its row sets them, so that "default" means OpenBLAS's and libgomp's.
SPIN_VARS = ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")

# A row run during which other processes used more than this many cores is run again (twice at
# most); the medians keep whatever the last run gave, and the table flags loaded rows.
LOADED = 0.3

# (label, kind, environment)
ROWS = [
    ("quiet (clip_noise back to back)", "quiet", {}),
    ("numpy matmul, default", "numpy", {}),
    ("numpy, OPENBLAS_THREAD_TIMEOUT=4", "numpy", {"OPENBLAS_THREAD_TIMEOUT": "4"}),
    ("numpy, OPENBLAS_THREAD_TIMEOUT=20", "numpy", {"OPENBLAS_THREAD_TIMEOUT": "20"}),
    ("numpy, dpcore limit_blas_spin() at run time", "numpy-helper", {}),
    ("numpy, threadpoolctl 1 thread around matmul", "numpy-tpc", {}),
    ("torch matmul, default", "torch", {}),
    ("torch, GOMP_SPINCOUNT=10000", "torch", {"GOMP_SPINCOUNT": "10000"}),
    ("torch, OMP_WAIT_POLICY=passive", "torch", {"OMP_WAIT_POLICY": "passive"}),
]


# ---------------------------------------------------------------------------------------------
# child: one row


def _limit_blas_spin():
    import dpcore

    fn = getattr(dpcore, "limit_blas_spin", None)
    if fn is None:
        from dpcore._threads import limit_blas_spin as fn
    return fn()


def _small_call(fn, seconds=0.15):
    """Median seconds of fn called back to back, in groups of ~5 ms."""
    import numpy as np

    for _ in range(20):
        fn()
    t = time.perf_counter()
    fn()
    k = max(1, int(0.005 / max(time.perf_counter() - t, 1e-7)))
    ts, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(ts) < 5:
        t = time.perf_counter()
        for _ in range(k):
            fn()
        ts.append((time.perf_counter() - t) / k)
    return float(np.median(ts))


def child(kind, iters):
    import numpy as np

    import dpcore

    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    x[::3] *= 0.001  # a mix of clipped and unclipped records
    a = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((K, N), dtype=np.float32)
    out = np.empty((M, N), np.float32)
    sa = rng.standard_normal((SMALL, SMALL), dtype=np.float32)
    sout = np.empty_like(sa)
    note = ""

    def blas():
        np.matmul(a, w, out=out)

    def small():
        np.matmul(sa, sa, out=sout)

    if kind == "numpy-helper":
        note = f"limit_blas_spin changed {len(_limit_blas_spin())} lib(s)"
    elif kind == "numpy-tpc":
        import threadpoolctl

        ctl = threadpoolctl.ThreadpoolController()

        def blas():
            with ctl.limit(limits=1, user_api="blas"):
                np.matmul(a, w, out=out)

    elif kind == "torch":
        import torch

        ta, tw, to = (torch.from_numpy(v) for v in (a, w, out))
        tsa, tso = torch.from_numpy(sa), torch.from_numpy(sout)

        def blas():
            torch.matmul(ta, tw, out=to)

        def small():
            torch.matmul(tsa, tsa, out=tso)

    def clip():
        dpcore.clip_noise(x, C, Z)

    for _ in range(3):  # warm-up: pools, page faults
        if kind != "quiet":
            blas()
        clip()
    tb, tc = [], []
    for _ in range(iters):
        if kind != "quiet":
            t = time.perf_counter()
            blas()
            tb.append(time.perf_counter() - t)
        t = time.perf_counter()
        clip()
        tc.append(time.perf_counter() - t)
    res = {"clip": tc, "blas": tb, "note": note}
    if kind in ("numpy", "numpy-helper", "torch"):
        res["small"] = _small_call(small)
    print(json.dumps(res))


# ---------------------------------------------------------------------------------------------
# parent: rows in alternating blocks


def _busy_jiffies():
    with open("/proc/stat") as f:
        v = [int(t) for t in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]  # all but idle and iowait


def run_row(kind, env, iters):
    e = {k: v for k, v in os.environ.items() if k not in SPIN_VARS}
    e.update(env)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        j0 = _busy_jiffies()
    except OSError:
        j0 = None
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", kind, "--iters", str(iters)],
        env=e,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"child {kind} failed:\n{p.stderr}")
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    if j0 is not None:
        ours = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        hz = os.sysconf("SC_CLK_TCK")
        res["others"] = max(0.0, ((_busy_jiffies() - j0) / hz - ours) / wall)
    return res


def available(module):
    try:
        import importlib.util

        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def blas_description():
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "import numpy, json\n"
            "try:\n"
            "    import threadpoolctl; print(json.dumps(threadpoolctl.threadpool_info()))\n"
            "except ImportError:\n"
            "    print('[]')",
        ],
        env={k: v for k, v in os.environ.items() if k not in SPIN_VARS},
        capture_output=True,
        text=True,
    )
    try:
        info = json.loads(p.stdout)
    except ValueError:
        info = []
    if not info:
        return "numpy's BLAS: unknown (install threadpoolctl to see it)"
    return "; ".join(
        f"{d.get('internal_api')} {d.get('version')} ({d.get('threading_layer', '?')}, {d.get('num_threads')} threads)"
        for d in info
    )


def main():
    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one block of fewer iterations (~20 s)")
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.iters or 30)
        return
    blocks = args.blocks or (1 if args.quick else 3)
    iters = args.iters or (15 if args.quick else 30)
    needs = {"torch": "torch", "numpy-tpc": "threadpoolctl"}
    rows = [r for r in ROWS if r[1] not in needs or available(needs[r[1]])]
    print(
        f"clip_noise float32 {SHAPE} after a float32 matmul ({M}x{K})·({K}x{N}); cpus={os.cpu_count()}, "
        f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'all')}; {blocks} block(s) x {iters} steps per row"
    )
    print(blas_description())
    for m in sorted({needs[r[1]] for r in ROWS if r not in rows}):
        print(f"{m} not installed: its rows skipped")
    res = {label: {"clip": [], "blas": [], "small": [], "others": [], "note": ""} for label, _, _ in rows}
    retry_until = time.perf_counter() + (20 if args.quick else 45)  # keeps a loaded run near 2 min
    for _ in range(blocks):
        for label, kind, env in rows:
            r = run_row(kind, env, iters)
            for _ in range(2):  # another process took a core: run the row again, twice at most
                if r.get("others", 0.0) < LOADED or time.perf_counter() > retry_until:
                    break
                r = run_row(kind, env, iters)
            acc = res[label]
            acc["clip"] += r["clip"]
            acc["blas"] += r["blas"]
            if "small" in r:
                acc["small"].append(r["small"])
            if "others" in r:
                acc["others"].append(r["others"])
            acc["note"] = r.get("note", "")
    med = lambda v: float(np.median(v)) if v else float("nan")  # noqa: E731
    quiet = med(res[rows[0][0]]["clip"])
    print(
        f"\n{'row':46s} {'clip_noise':>10s} {'ratio':>6s} {'target':>7s} {'BLAS call':>10s} "
        f"{'small call':>10s} {'others':>6s}"
    )
    for label, kind, _ in rows:
        r = res[label]
        c = med(r["clip"])
        ratio = c / quiet
        target = "" if kind == "quiet" else ("met" if ratio <= 1.2 else "MISSED")
        b = f"{med(r['blas']) * 1e3:8.2f}ms" if r["blas"] else ""
        s = f"{med(r['small']) * 1e6:8.1f}us" if r["small"] else ""
        o = f"{med(r['others']):6.2f}" if r["others"] else ""
        if r["others"] and med(r["others"]) >= LOADED:
            o += "  (loaded: a core short)"
        print(f"{label:46s} {c * 1e3:8.2f}ms {ratio:5.2f}x {target:>7s} {b:>10s} {s:>10s} {o}")
        if r["note"]:
            print(f"    ({r['note']})")
    print(
        "\nratio: clip_noise median / quiet median (target <= 1.2x). BLAS call: the matmul's own median. "
        f"small call: a back-to-back {SMALL}^3 matmul (numpy rows: sgemm; torch rows: torch.matmul), "
        "the price of parking workers at once."
    )


if __name__ == "__main__":
    main()
