"""Timing helpers shared by the bench scripts (``python benches/bench_x.py`` puts this folder on
sys.path, so they ``import _timing``).

Only the call being measured lies between the two clock reads: each result is dropped as soon as
the call returns, as a bare ``fn()`` statement would.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def call_times(fn, n):
    """Seconds taken by each of `n` successive calls of `fn`."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def median_time(fn, repeats):
    """Median seconds of `repeats` calls of `fn`."""
    return statistics.median(call_times(fn, repeats))


def median_time_and_result(fn, repeats):
    """(median seconds of `repeats` calls of `fn`, the result of the last call)."""
    last = [None]

    def call():
        last[0] = fn()

    return statistics.median(call_times(call, repeats)), last[0]


def alternating_blocks(fns, blocks, time_block):
    """Seconds per contender, timed in `blocks` rounds that take each contender of the dict `fns` in
    turn, so that a change in the machine's speed part-way falls on every contender alike.
    `time_block(fn)` times one block of calls of `fn` and returns its list of seconds."""
    ts = {k: [] for k in fns}
    for _ in range(blocks):
        for k, fn in fns.items():
            ts[k] += time_block(fn)
    return ts


def child_result(cmd, timeout, marker, ident):
    """Runs one bench child process (``cmd``) and returns the JSON it printed after ``marker``,
    or ``ident`` with an ``error``: a timeout, or the child's last line of stderr."""
    import json
    import subprocess

    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**ident, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    err = [l for l in p.stderr.strip().splitlines() if l.strip()]
    return {**ident, "error": f"child exited with {p.returncode}: {err[-1] if err else 'no output'}"}


def merge_rounds(runs):
    """One configuration's rounds: step times pooled, the largest peak; the first error if any."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return bad[0]
    r = dict(runs[0])
    r["times"] = [t for x in runs for t in x["times"]]
    r["ms"] = statistics.median(r["times"])
    r["steps"] = len(r["times"])
    r["cpu_times"] = [t for x in runs for t in x["cpu_times"]]
    r["cpu_ms"] = statistics.median(r["cpu_times"])
    r["peak_mib"] = max(x["peak_mib"] for x in runs)
    r["notes"] = sorted({n for x in runs for n in x.get("notes", [])})
    return r


def fill_defaults(args, quick, full):
    """The options left unset (None) from the ``--quick`` or the full run's defaults."""
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def log(msg):
    """Progress lines, on stderr (the tables go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def run_parts(out, parts, args):
    """A bench's parts in order, each ``(skip, key, run(args, log), table(result, args))``: the
    result stored in ``out[key]`` and its table printed after a blank line."""
    for skip, key, run, table in parts:
        if skip:
            continue
        res = run(args, log)
        out[key] = res
        print()
        print(table(res, args))


def finish(out, t0, json_path):
    """The end of a bench's main: the total time and load average printed, ``out`` (with its
    seconds) written to ``json_path`` when one was given."""
    out["seconds"] = time.perf_counter() - t0
    print(f"\ntotal {out['seconds']:.0f} s, load average {os.getloadavg()[0]:.2f} (other processes skew the timings)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
