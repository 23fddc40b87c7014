"""Keras 3 DP-SGD step time on CPU, side by side in one run: plain Keras vs jax_privacy's keras_api vs dpcore.keras.

Four models, built with the functional API from code (no downloads), each trained at batch 64
with SGD(0.1) and sparse softmax cross-entropy on logits; the data are synthetic (fixed seed), the
same in every column:

* ``mlp``: Dense 784-256-256-10, ReLU; inputs 784 floats, 10 classes.
* ``cnn``: 32x32x3 -> 3 x Conv2D 3x3 stride 2 "same" + ReLU (32-64-128 channels) ->
  GlobalAveragePooling2D -> Dense(10).
* ``lstm``: 32 token ids -> Embedding(1000, 64) -> LSTM(64) -> Dense(2).
* ``transformer``: 32 token ids -> Embedding(1000, 64) + a learned positional embedding (32 x 64)
  -> 2 post-norm blocks [MultiHeadAttention(4 heads, key_dim 16) + residual + LayerNormalization,
  Dense(256, ReLU) -> Dense(64) + residual + LayerNormalization] -> GlobalAveragePooling1D ->
  Dense(2).

Columns (noise multiplier 1.0, clipping norm 1.0 wherever DP):

* ``keras`` (the anchor): ``model.compile(optimizer, loss, jit_compile=...)`` and ``model.fit(x, y,
  batch_size=64, shuffle=True)``. ``--jit-compile auto`` (the default) is Keras's own default:
  XLA on JAX, no XLA on TensorFlow without a GPU, eager on torch; ``true`` forces it (torch.compile
  on torch). The table header says what each backend got.
* ``jax_privacy``: ``jax_privacy.keras_api.make_private(model, DPKerasConfig(epsilon=1e3,
  delta=1e-5, clipping_norm=1.0, batch_size=64, gradient_accumulation_steps=1, train_steps=...,
  train_size=n, noise_multiplier=1.0))``, then compile and fit as ``keras``. Its default mode:
  fixed batches of exactly 64 from Keras's shuffle (``poisson_sampling_in_fit=False``). JAX
  backend only. (epsilon only bounds the check DPKerasConfig makes of the noise it is given: the
  noise multiplier is set, not calibrated.)
* ``jax_privacy-poisson``: the same with ``poisson_sampling_in_fit=True``: its own Poisson
  sampler (q = 64/n) over the arrays, each batch padded with masked dummy records to a multiple of
  32 (so a batch of 65 records is computed as 96), one XLA compilation per padded shape.
* ``dpcore``: ``dpcore.keras.make_private(model, SGD(0.1), noise_multiplier=1.0,
  max_grad_norm=1.0, population_size=n, sampling_probability=64/n, ledger=PrivacyLedger(...))``,
  ``compile(loss, metrics=[])`` and ``fit(dpcore.keras.PoissonBatches(x, y,
  sampling_probability=64/n), steps_per_epoch=...)``: Poisson batches of expected size 64, the
  ledger written every step.
* ``dpcore-fixed``: the same model, ``fit(x, y, batch_size=64, shuffle=True)``: fixed batches of
  64 (the ledger records shuffle sampling; dpcore warns).

While ``dpcore.keras`` does not exist (or lacks a name this bench uses) the dpcore columns show
"n/a" and the rest of the run is unaffected.

Timing: every (backend, model, column) runs in its own process (the bench re-invokes itself with
``--worker BACKEND MODEL COLUMN``; ``KERAS_BACKEND`` is read when keras is imported, and a fresh
process also has its own memory and compilation caches). The child builds the model (seeded: the
same initial weights in every column), compiles, runs one warm-up ``fit`` of up to ``--warmup``
steps, then one timed ``fit`` of up to ``--steps`` + 1 steps, both with ``verbose=0``. A callback
reads ``time.perf_counter`` and the process CPU time at each ``on_train_batch_end``, after
``float(logs["loss"])`` (in every column alike: on JAX this waits for the step's result, so
asynchronous dispatch hides nothing); a step's time is the interval between two consecutive
ends, so it covers drawing (and padding) the batch, the step, and Keras's per-step bookkeeping.
The same callback stops a slow column early (``model.stop_training``): the timed fit once its
steps have taken ``--budget`` seconds (but not before ``--min-steps`` steps); the warm-up of a
fixed-batch column after half a budget (at least 5 steps: the first compiles); a Poisson column
takes all ``--warmup`` warm-up steps (each new padded batch shape compiles) unless they pass five
budgets. Timed steps over 3x the column's median are counted as "spikes" (a batch shape the
warm-up did not compile, or other processes' load). Each fit is a single epoch over
n = 64 x max(50, steps + 1, warmup) records (q = 64/n), so no epoch boundary falls in the timed
steps.

The parent runs the children model by model in ``--rounds`` rounds, the columns' order reversed
every other round (the machine's load drifts), and prints a table per backend: per model and
column the median over rounds of each round's median ms/step, its ratio to ``keras`` and, for
the dpcore columns, to jax_privacy (``dpcore`` / ``jax_privacy-poisson``, both Poisson, or
/ ``jax_privacy`` when the Poisson column did not run; ``dpcore-fixed`` / ``jax_privacy``); also
the median process CPU ms per step (a CPU ratio far from the wall ratio flags a run disturbed by
other processes), the steps timed, the spikes and the child's peak RSS. A column that fails shows
the first line of its error; one that cannot run shows "n/a" and why. No timing is asserted.

``python benches/bench_keras.py [--backends jax,tensorflow,torch] [--models mlp cnn lstm transformer]
[--columns keras jax_privacy jax_privacy-poisson dpcore dpcore-fixed | all] [--steps 30]
[--warmup 30] [--budget 6] [--min-steps 5] [--rounds 1] [--jit-compile auto|true|false]
[--quick | --full] [--json out.json]``. ``--quick`` is the default: columns keras, jax_privacy
and dpcore, 30 warm-up + 30 timed steps, a 6 s budget, 1 round; ``--full``: all five columns,
40 + 100 steps, a 30 s budget, 3 rounds. The quick jax run takes about 5 minutes on 2 CPU cores
(most of a child's time is importing keras and compiling); the five columns of ``--columns all``
about 9 with the machine shared (load average 3-4); ``--full`` several times that per backend.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import child_result, fill_defaults, finish, log, merge_rounds

BACKENDS = ("jax", "tensorflow", "torch")
MODELS = ("mlp", "cnn", "lstm", "transformer")
COLUMNS = ("keras", "jax_privacy", "jax_privacy-poisson", "dpcore", "dpcore-fixed")
JAX_ONLY = ("jax_privacy", "jax_privacy-poisson")
POISSON = ("jax_privacy-poisson", "dpcore")
# dpcore's column -> jax_privacy's columns to compare it with, the first that ran: the same sampling first
VS_JAX_PRIVACY = {"dpcore": ("jax_privacy-poisson", "jax_privacy"), "dpcore-fixed": ("jax_privacy",)}
QUICK_COLUMNS = ("keras", "jax_privacy", "dpcore")
DESCRIPTION = {
    "mlp": "Dense 784-256-256-10, ReLU",
    "cnn": "32x32x3 -> 3 x Conv2D 3x3 stride 2 (32-64-128) -> GlobalAveragePooling2D -> Dense(10)",
    "lstm": "Embedding(1000, 64) -> LSTM(64) -> Dense(2), length 32",
    "transformer": "Embedding(1000, 64) + positions -> 2 x [MHA(4 heads, key_dim 16) + LayerNorm, FFN 256 + LayerNorm] "
                   "-> mean -> Dense(2), length 32",
}
BATCH = 64
RECORDS_PER_BATCH = 50  # at least 50·B records: q = 1/50 at most
NOISE, CLIP, DELTA = 1.0, 1.0, 1e-5
RESULT = "BENCH-RESULT "
SEED = 0
SPIKE = 3.0  # a timed step over SPIKE x the median counts as a spike (a compilation, or the machine's load)


# -- models and data (in the child, after keras is imported) ----------------------------------------


def _build(name: str, keras: Any) -> Any:
    """The model `name`, its weights initialised from SEED."""
    L = keras.layers
    keras.utils.set_random_seed(SEED)
    if name == "mlp":
        inp = keras.Input((784,))
        h = L.Dense(256, activation="relu")(inp)
        h = L.Dense(256, activation="relu")(h)
        out = L.Dense(10)(h)
    elif name == "cnn":
        inp = keras.Input((32, 32, 3))
        h = inp
        for ch in (32, 64, 128):
            h = L.Conv2D(ch, 3, strides=2, padding="same", activation="relu")(h)
        out = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    elif name == "lstm":
        inp = keras.Input((32,), dtype="int32")
        out = L.Dense(2)(L.LSTM(64)(L.Embedding(1000, 64)(inp)))
    elif name == "transformer":

        class AddPositions(L.Layer):
            """x + a learned (length, width) positional embedding."""

            def build(self, shape: Any) -> None:
                self.pos = self.add_weight(shape=tuple(shape[1:]), initializer="random_normal", name="pos")

            def call(self, x: Any) -> Any:
                return x + self.pos

        inp = keras.Input((32,), dtype="int32")
        h = AddPositions()(L.Embedding(1000, 64)(inp))
        for _ in range(2):
            h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=4, key_dim=16)(h, h))
            f = L.Dense(64)(L.Dense(256, activation="relu")(h))
            h = L.LayerNormalization()(h + f)
        out = L.Dense(2)(L.GlobalAveragePooling1D()(h))
    else:
        raise ValueError(f"unknown model {name!r}")
    return keras.Model(inp, out, name=name)


def _data(name: str, n: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(SEED + 1)
    if name == "mlp":
        return rng.standard_normal((n, 784), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32)
    if name == "cnn":
        return rng.standard_normal((n, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32)
    return rng.integers(0, 1000, (n, 32)).astype(np.int32), rng.integers(0, 2, n).astype(np.int32)


def _records(args: argparse.Namespace) -> int:
    """n: whole batches of 64, enough for either fit to stay within one epoch."""
    return BATCH * max(RECORDS_PER_BATCH, args.steps + 1, args.warmup)


def _jit(args: argparse.Namespace) -> Any:
    return {"auto": "auto", "true": True, "false": False}[args.jit_compile]


# -- one (backend, model, column), in its own process -----------------------------------------------


class _NotAvailable(Exception):
    """A column this process cannot run (dpcore.keras missing, jax_privacy off JAX): "n/a"."""


def run_one(backend: str, model_name: str, column: str, args: argparse.Namespace) -> Dict[str, Any]:
    os.environ["KERAS_BACKEND"] = backend  # the parent sets it too; keras reads it at import
    warnings.filterwarnings("ignore")
    out: Dict[str, Any] = {"backend": backend, "model": model_name, "column": column}
    tmp = tempfile.mkdtemp(prefix="bench_keras_")
    try:
        import keras
        import numpy as np

        if keras.backend.backend() != backend:
            raise RuntimeError(f"keras imported with backend {keras.backend.backend()}, not {backend}")
        out["keras"] = keras.__version__
        model = _build(model_name, keras)
        out["params"] = int(model.count_params())
        out["init_sum"] = float(sum(np.asarray(w, dtype=np.float64).sum() for w in model.get_weights()))
        n = _records(args)
        x, y = _data(model_name, n)
        q = BATCH / n
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        marks: List[tuple] = []

        class Clock(keras.callbacks.Callback):
            """Marks each step's end; stops the fit once `budget` seconds have passed since the first
            step's end and at least `least` steps have ended."""

            def __init__(self, budget: float, least: int) -> None:
                super().__init__()
                self.budget, self.least = budget, least

            def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
                float((logs or {})["loss"])  # waits for the step's result (JAX dispatches asynchronously)
                marks.append((time.perf_counter(), time.process_time()))
                if len(marks) >= self.least and marks[-1][0] - marks[0][0] > self.budget:
                    self.model.stop_training = True

        with warnings.catch_warnings(record=True) as caught:  # dpcore's and jax_privacy's notices are shown
            warnings.simplefilter("always")
            fit = _setup(column, model, keras, loss, x, y, n, q, tmp, args, out)
            # warm-up: the first step compiles. A fixed-batch column stops after half the budget (5 steps at
            # least); a Poisson column takes every warm-up step (each new padded batch shape compiles) unless
            # they pass five budgets.
            if column in POISSON:
                fit(args.warmup, [Clock(5 * args.budget, args.warmup)])
            else:
                fit(args.warmup, [Clock(args.budget / 2, min(args.warmup, 5))])
            out["warmup_steps"] = len(marks)
            marks.clear()
            fit(args.steps + 1, [Clock(args.budget, args.min_steps + 1)])
        out["notes"] = sorted({str(w.message).strip().splitlines()[0][:300] for w in caught
                               if w.category.__module__.split(".")[0] in ("dpcore", "jax_privacy")
                               and str(w.message).strip()})
        if len(marks) < min(args.min_steps, args.steps) + 1:
            raise RuntimeError(f"{len(marks)} on_train_batch_end calls for at least {args.min_steps + 1} steps")
        times = [(b[0] - a[0]) * 1e3 for a, b in zip(marks, marks[1:])]
        cpu = [(b[1] - a[1]) * 1e3 for a, b in zip(marks, marks[1:])]
        out["spikes"] = sum(t > SPIKE * statistics.median(times) for t in times)
        out.update(times=times, ms=statistics.median(times), steps=len(times), cpu_times=cpu,
                   cpu_ms=statistics.median(cpu), peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    except _NotAvailable as e:
        out["na"] = str(e)
    except Exception as e:  # reported in the table, not raised
        traceback.print_exc(file=sys.stderr)
        first = (str(e).strip().splitlines() or [""])[0]
        out["error"] = f"{type(e).__name__}: {first}"
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _setup(column: str, model: Any, keras: Any, loss: Any, x: Any, y: Any, n: int, q: float, tmp: str,
           args: argparse.Namespace, out: Dict[str, Any]) -> Any:
    """fit(steps, callbacks) for one column: one single-epoch fit of `steps` steps."""
    opt = keras.optimizers.SGD(0.1)
    if column in ("keras", "jax_privacy", "jax_privacy-poisson"):
        if column != "keras":
            if keras.backend.backend() != "jax":
                raise _NotAvailable("jax_privacy's keras_api runs on the JAX backend only")
            from jax_privacy import keras_api

            out["jax_privacy"] = importlib.metadata.version("jax-privacy")
            params = keras_api.DPKerasConfig(
                epsilon=1e3, delta=DELTA, clipping_norm=CLIP, batch_size=BATCH, gradient_accumulation_steps=1,
                train_steps=args.warmup + args.steps + 1, train_size=n, noise_multiplier=NOISE,
                poisson_sampling_in_fit=column == "jax_privacy-poisson", seed=SEED)
            model = keras_api.make_private(model, params)  # in place
        model.compile(optimizer=opt, loss=loss, jit_compile=_jit(args))
        out["jit_compile"] = model.jit_compile

        def fit(steps: int, callbacks: List[Any]) -> None:
            # jax_privacy-poisson: its fit() swaps the arrays for its padded Poisson PyDataset
            model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps, shuffle=True, verbose=0,
                      callbacks=callbacks)

        return fit
    if column in ("dpcore", "dpcore-fixed"):
        try:
            import dpcore
            import dpcore.keras as dpk

            out["dpcore"] = importlib.metadata.version("dpcore")
            dp = dpk.make_private(model, opt, noise_multiplier=NOISE, max_grad_norm=CLIP, population_size=n,
                                  sampling_probability=q, ledger=dpcore.PrivacyLedger(os.path.join(tmp, "ledger")))
            dp.compile(loss=loss, metrics=[])
            batches = dpk.PoissonBatches(x, y, sampling_probability=q) if column == "dpcore" else None
        except (ImportError, AttributeError) as e:
            raise _NotAvailable(f"dpcore.keras: {type(e).__name__}: {e}") from e
        out["jit_compile"] = getattr(dp, "jit_compile", None)

        def fit(steps: int, callbacks: List[Any]) -> None:
            if batches is not None:
                dp.fit(batches, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
            else:
                dp.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=steps, shuffle=True, verbose=0,
                       callbacks=callbacks)

        return fit
    raise ValueError(f"unknown column {column!r}")


# -- the parent ----------------------------------------------------------------------------------


def _child(backend: str, model_name: str, column: str, args: argparse.Namespace) -> Dict[str, Any]:
    ident = {"backend": backend, "model": model_name, "column": column}
    if column in JAX_ONLY and backend != "jax":
        return {**ident, "na": "JAX backend only"}
    if column.startswith("dpcore") and args.dpcore_missing:
        return {**ident, "na": args.dpcore_missing}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", backend, model_name, column,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--budget", str(args.budget),
           "--min-steps", str(args.min_steps), "--jit-compile", args.jit_compile]
    os.environ["KERAS_BACKEND"] = backend  # the child inherits it
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return child_result(cmd, 600, RESULT, ident)


def _merge(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """merge_rounds, then the median over rounds of each round's median (wall and CPU)."""
    na = [r for r in runs if "na" in r]
    if na:
        return na[0]
    r = merge_rounds(runs)
    if "error" not in r:
        r["ms"] = statistics.median(x["ms"] for x in runs)
        r["cpu_ms"] = statistics.median(x["cpu_ms"] for x in runs)
        r["round_ms"] = [x["ms"] for x in runs]
        r["spikes"] = sum(x.get("spikes", 0) for x in runs)
    return r


def _ratio(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]], key: str = "ms") -> str:
    if a is None or b is None or key not in a or key not in b:
        return "-"
    v = a[key] / b[key]
    return f"{v:.3f}x" if v < 0.1 else f"{v:.2f}x"


def table(backend: str, res: Dict[str, Dict[str, Dict[str, Any]]], args: argparse.Namespace) -> str:
    """One backend's table: a block per model, a row per column."""
    jit: Dict[str, List[str]] = {}  # column -> the jit_compile its compiled model reported
    for cols in res.values():
        for c, r in cols.items():
            if "jit_compile" in r and str(r["jit_compile"]) not in jit.setdefault(c, []):
                jit[c].append(str(r["jit_compile"]))
    jits = ", ".join(f"{c} {'/'.join(v)}" for c, v in jit.items())
    lines = [f"backend {backend} (jit_compile: {jits or '?'}): ms per training step at batch {BATCH}, "
             f"median over {args.rounds} round(s) of each round's median (steps: timed steps, all rounds)"]
    for m, cols in res.items():
        params = next((r["params"] for r in cols.values() if "params" in r), None)
        lines.append(f"  {m}: {DESCRIPTION[m]}" + (f", {params:,} parameters" if params else ""))
    lines.append(f"  {'model':12s} {'column':21s} {'ms/step':>9s} {'vs keras':>9s} {'vs jax_privacy*':>16s} "
                 f"{'cpu ms':>8s} {'(ratio)':>8s} {'steps':>6s} {'spikes**':>8s} {'peak RSS MiB':>13s}")
    for m, cols in res.items():
        base = cols.get("keras")
        base = base if base is not None and "ms" in base else None
        first = True
        for c, r in cols.items():
            name = m if first else ""
            first = False
            if "na" in r:
                lines.append(f"  {name:12s} {c:21s} {'n/a':>9s}  ({r['na'][:150]})")
                continue
            if "error" in r:
                lines.append(f"  {name:12s} {c:21s} failed: {r['error'][:200]}")
                continue
            vs_jxp = ""
            if c in VS_JAX_PRIVACY:
                other = next((o for o in VS_JAX_PRIVACY[c] if "ms" in cols.get(o, {})), None)
                vs_jxp = "-" if other is None else _ratio(r, cols[other]) + (" (fixed)" if c == "dpcore" and other ==
                                                                             "jax_privacy" else "")
            lines.append(f"  {name:12s} {c:21s} {r['ms']:9.2f} {_ratio(r, base):>9s} {vs_jxp:>16s} "
                         f"{r['cpu_ms']:8.2f} {_ratio(r, base, 'cpu_ms'):>8s} {r['steps']:6d} "
                         f"{str(r.get('spikes', '-')):>8s} {r['peak_mib']:13.0f}")
        sums = {round(r["init_sum"], 3) for r in cols.values() if "init_sum" in r}
        if len(sums) > 1:
            lines.append(f"  {'':12s} warning: the columns' initial weights differ (sums {sorted(sums)})")
    notes: Dict[str, List[str]] = {}
    for cols in res.values():
        for c, r in cols.items():
            notes.setdefault(c, [])
            notes[c] += [n for n in r.get("notes", []) if n not in notes[c]]
    for c, ns in notes.items():
        for n in ns:
            lines.append(f"  {c} warned: {n[:300]}")
    if any(c in VS_JAX_PRIVACY for cols in res.values() for c in cols):
        lines.append("  * dpcore / jax_privacy-poisson (both Poisson, q = 64/n; when jax_privacy-poisson did not run: "
                     "dpcore / jax_privacy's fixed batches, marked (fixed));\n"
                     "    dpcore-fixed / jax_privacy (both fixed batches of 64)")
    lines.append(f"  ** timed steps over {SPIKE:.0f}x the column's median: compilations (a Poisson batch shape not "
                 f"seen in the warm-up) or other processes' load")
    return "\n".join(lines)


def _versions() -> str:
    def v(d: str) -> str:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    return (f"keras {v('keras')}, numpy {v('numpy')}, jax {v('jax')}, jaxlib {v('jaxlib')}, jax-privacy "
            f"{v('jax-privacy')}, tensorflow {v('tensorflow-cpu') if v('tensorflow') == '-' else v('tensorflow')}, "
            f"torch {v('torch')}, dpcore {v('dpcore')}")


def _split(values: List[str], choices: tuple, what: str, ap: argparse.ArgumentParser) -> List[str]:
    """Space- or comma-separated names, checked against `choices`."""
    out = [v for s in values for v in s.split(",") if v]
    bad = [v for v in out if v not in choices]
    if bad:
        ap.error(f"unknown {what} {', '.join(bad)} (choose from {', '.join(choices)})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=3, metavar=("BACKEND", "MODEL", "COLUMN"), help=argparse.SUPPRESS)
    ap.add_argument("--backends", nargs="+", default=["jax,tensorflow"],
                    help=f"comma- or space-separated, of {', '.join(BACKENDS)} (default jax,tensorflow)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help=f"of {', '.join(MODELS)} (default all)")
    ap.add_argument("--columns", nargs="+", default=None,
                    help=f"of {', '.join(COLUMNS)}, or all (default {' '.join(QUICK_COLUMNS)}; --full: all); keras "
                         f"is the anchor of the ratios")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per child (default 30; --full 100)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first, one fit (default 30; --full 40): enough for the Poisson columns' "
                         "batch shapes to compile")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timed steps per child, after which a slow column stops early (default 6; "
                         "--full 30); its warm-up stops after half as long")
    ap.add_argument("--min-steps", type=int, default=None,
                    help="timed steps however long they take (default 5; --full 10)")
    ap.add_argument("--rounds", type=int, default=None, help="fresh processes per column (default 1; --full 3)")
    ap.add_argument("--jit-compile", choices=("auto", "true", "false"), default="auto",
                    help="the keras and jax_privacy columns' compile(jit_compile=...); auto: Keras's default")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: about 5 minutes for the jax backend")
    mode.add_argument("--full", action="store_true", help="more steps and rounds")
    ap.add_argument("--json", help="also write every result to this file")
    args = ap.parse_args()
    args.quick = not args.full
    fill_defaults(args, dict(steps=30, warmup=30, rounds=1, budget=6.0, min_steps=5, columns=list(QUICK_COLUMNS)),
                  dict(steps=100, warmup=40, rounds=3, budget=30.0, min_steps=10, columns=list(COLUMNS)))
    if min(args.steps, args.warmup, args.min_steps) < 1:
        ap.error("--steps, --warmup and --min-steps must be at least 1")
    if args.worker:
        print(RESULT + json.dumps(run_one(*args.worker, args)), flush=True)
        return
    args.backends = _split(args.backends, BACKENDS, "backend", ap)
    args.models = _split(args.models, MODELS, "model", ap)
    args.columns = list(COLUMNS) if args.columns == ["all"] else _split(args.columns, COLUMNS, "column", ap)
    args.dpcore_missing = ""
    if any(c.startswith("dpcore") for c in args.columns):
        try:
            if importlib.util.find_spec("dpcore.keras") is None:
                args.dpcore_missing = "dpcore.keras does not exist yet"
        except ImportError as e:
            args.dpcore_missing = f"dpcore: {e}"

    t0 = time.perf_counter()
    print(f"{_versions()}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"batch {BATCH}, n = {_records(args)} records (q = {BATCH / _records(args):.4f}), SGD(0.1), noise multiplier "
          f"{NOISE}, clipping norm {CLIP}; per child: {args.warmup} warm-up + {args.steps} timed steps (fewer once the "
          f"timed steps pass {args.budget:g} s, at least {args.min_steps}; fixed-batch warm-ups stop after "
          f"{args.budget / 2:g} s); {args.rounds} "
          f"round(s), order reversed every other round; own process each" +
          (f"; dpcore columns n/a: {args.dpcore_missing}" if args.dpcore_missing else ""))
    out: Dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "versions": _versions(), "results": {}}
    for backend in args.backends:
        res: Dict[str, Dict[str, Dict[str, Any]]] = {}
        for m in args.models:
            runs: Dict[str, List[Dict[str, Any]]] = {c: [] for c in args.columns}
            for rnd in range(args.rounds):
                for c in (args.columns if rnd % 2 == 0 else args.columns[::-1]):
                    r = _child(backend, m, c, args)
                    runs[c].append(r)
                    status = (f"n/a ({r['na']})" if "na" in r else r.get("error")
                              or f"{r['ms']:.2f} ms/step median over {r['steps']} steps")
                    log(f"  [{time.perf_counter() - t0:6.0f} s] {backend} {m} {c} round {rnd + 1}: {status}")
            res[m] = {c: _merge(runs[c]) for c in args.columns}
        out["results"][backend] = res
        print()
        print(table(backend, res, args), flush=True)
    finish(out, t0, args.json)


if __name__ == "__main__":
    main()
