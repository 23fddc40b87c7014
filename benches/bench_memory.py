"""Peak memory of one DP-SGD step: dpcore.torch against the same model non-private and against
Opacus ghost clipping, at several batch sizes.

Models:

* ``transformer``: Embedding(8000, 256) -> 2 x TransformerEncoderLayer(256, 4 heads, ff 1024,
  batch_first, no dropout) -> mean over positions -> Linear(256, 2); length ``--seq`` (default 64:
  half of ``bench_torch.py``'s 128, so that B = 1024 fits the 2-core VM's time; pass
  ``--seq 128`` for that model exactly), random token ids.
* ``lora``: a tiny GPT-2 (``transformers.GPT2Config``: vocab 512, n_embd 128, 2 layers, 2 heads,
  positions 64) with ``peft`` LoRA r=8 on ``c_attn`` (only the adapters train), length 64, the
  language-modelling loss (per-token cross-entropy averaged per sequence, then over the batch).

Configurations (SGD, lr 0.01; the DP ones with noise multiplier 1.0 and max grad norm 1.0):
``non-private`` (fixed batches of B), ``dpcore`` (``dpcore.torch.make_private``: Poisson batches
of expected size B from a dataset of 50·B records), ``opacus-ghost`` (``PrivacyEngine().
make_private(..., grad_sample_mode="ghost")`` after ``ModuleValidator.fix``, Poisson batches, the
loss through Opacus's criterion wrapper). Opacus is an optional dependency (``pip install
--no-deps opacus``); without it its rows read "opacus not installed".

Each (model, configuration, B) runs in a fresh subprocess, ``--repeats`` times (default 2); the
table shows medians. On CPU the child reads its RSS after imports, model, optimizer, data and
the DP wrapping (``base``), runs ``--steps`` training steps (default 2: the first allocates its
workspace, the second runs with the pipeline state a real loop has, e.g. dpcore's next noise
being drawn), and reports ``ru_maxrss`` (its absolute peak) and ``ru_maxrss - base`` (what the
steps added: the step's memory). On CUDA (code path untested on the 2-core development VM) it
reports ``torch.cuda.max_memory_allocated`` over the steps minus ``memory_allocated`` before them.
Poisson batch sizes vary around B (±√B): so that the DP rows measure B records, as the
non-private row does, not a lucky or unlucky draw, the DP children skip (draw and drop) Poisson
batches until one of exactly B records (about √(2πB) draws), and step on that one (the records stepped on are still a Poisson sample
of the dataset, only its size is conditioned; this is a memory bench, not a private run);
the largest batch a child stepped on is printed beside the table. Children run with
``MALLOC_MMAP_THRESHOLD_=131072`` unless ``--glibc-default``, so that RSS follows the live
tensors (see ``_child``). ``--merge earlier.json`` fills the configurations not run now from
an earlier run's ``--json`` (e.g. to rerun only ``--configs dpcore`` after a change).

``python benches/bench_memory.py [--models transformer lora] [--batches 32 128 512 1024]
[--seq 64] [--repeats 2] [--steps 2] [--configs ...] [--device auto|cpu|cuda] [--glibc-default]
[--merge earlier.json] [--json out.json]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import child_result

RESULT = "MEM-RESULT "
MODELS = ("transformer", "lora")
CONFIGS = ("non-private", "dpcore", "dpcore-lean", "opacus-ghost")
RECORDS_PER_BATCH = 50
SEED = 0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


import torch
from torch import nn


# The transformer of bench_torch.py (module level: Opacus pickles the model classes).
from bench_torch import Transformer  # noqa: E402


class LM(nn.Module):
    """Tiny GPT-2 with LoRA r=8 on c_attn; returns the logits (B, T, V) (the loss is formed
    outside, per configuration)."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=2, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.net = get_peft_model(GPT2LMHeadModel(cfg), LoraConfig(
            r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True))

    def forward(self, x: Any) -> Any:
        return self.net(input_ids=x).logits


def _build(name: str, seq: int) -> Tuple[Any, Any, bool]:
    """(model, make_data(n) -> (x, y), is_lm), the model initialised from SEED."""
    g = torch.Generator().manual_seed(SEED + 1)
    torch.manual_seed(SEED)
    if name == "transformer":
        make = lambda n: (torch.randint(0, 8000, (n, seq), generator=g), torch.randint(0, 2, (n,), generator=g))
        return Transformer(), make, False
    if name == "lora":
        t = min(seq, 64)

        def make(n: int) -> Tuple[Any, Any]:
            ids = torch.randint(0, 512, (n, t), generator=g)
            return ids, ids

        return LM(), make, True
    raise ValueError(name)


class _LMLoss:
    """Per-token cross-entropy averaged per sequence, then reduced over the batch (``reduction``:
    "mean" or "sum"; "none" gives one loss per token, flattened, for Opacus's ghost wrapper)."""

    def __init__(self) -> None:
        self.reduction = "mean"

    def __call__(self, logits: Any, y: Any) -> Any:
        import torch.nn.functional as F

        if self.reduction == "none":  # Opacus passes the (B·T, V) view and shape= itself
            return F.cross_entropy(logits, y, reduction="none")
        per = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)
        return per.mean() if self.reduction == "mean" else per.sum()


def run_one(model_name: str, config: str, b: int, args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    out: Dict[str, Any] = {"model": model_name, "config": config, "B": b, "device": str(device)}
    try:
        model, make, is_lm = _build(model_name, args.seq)
        model = model.to(device)
        x, y = make(RECORDS_PER_BATCH * b)
        ds = torch.utils.data.TensorDataset(x, y)
        loader: Any = torch.utils.data.DataLoader(ds, batch_size=b, shuffle=True, drop_last=True)
        params = [p for p in model.parameters() if p.requires_grad]
        opt: Any = torch.optim.SGD(params, lr=0.01)
        crit: Any = _LMLoss() if is_lm else nn.CrossEntropyLoss()
        if config in ("dpcore", "dpcore-lean"):
            import dpcore.torch

            model, opt, loader = dpcore.torch.make_private(
                model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                memory="lean" if config == "dpcore-lean" else "default")
        elif config == "opacus-ghost":
            try:
                from opacus import PrivacyEngine
                from opacus.validators import ModuleValidator
            except ImportError:
                out["error"] = "opacus not installed"
                return out
            model = ModuleValidator.fix(model).to(device)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
            model, opt, crit, loader = PrivacyEngine().make_private(
                module=model, optimizer=opt, data_loader=loader, criterion=crit,
                noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost")
        elif config != "non-private":
            raise ValueError(config)
        model.train()
        it = iter(loader)
        dp = config != "non-private"
        if dp:  # draw (and drop) Poisson batches until one of exactly B records: see the docstring
            hi = b
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) / 2**20
        else:
            base = _rss_mib()
        out["base_mib"] = base
        sizes: List[int] = []
        t0 = time.perf_counter()
        drawn = 0
        for _ in range(args.steps):
            while True:
                try:
                    xb, yb = next(it)
                except StopIteration:  # a new pass over the Poisson loader
                    it = iter(loader)
                    xb, yb = next(it)
                drawn += 1
                if not dp or b <= len(xb) <= hi or drawn > 200 * RECORDS_PER_BATCH:
                    break
            xb, yb = xb.to(device), yb.to(device)
            sizes.append(int(xb.shape[0]))
            opt.zero_grad()
            if len(xb):
                logits = model(xb)
                if is_lm and config == "opacus-ghost":
                    loss = crit(logits.flatten(0, 1), yb.flatten(), shape=logits.shape)
                else:
                    loss = crit(logits, yb)
                loss.backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            peak = _maxrss_mib()
        out.update(peak_mib=peak, step_mib=peak - base, sizes=sizes, drawn=drawn, seconds=time.perf_counter() - t0,
                   mem="cuda" if device.type == "cuda" else "rss")
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        first = (str(e).strip().splitlines() or [""])[0]
        out["error"] = f"{type(e).__name__}: {first}"
    return out


def _child(cmd: List[str], args: argparse.Namespace) -> Dict[str, Any]:
    env = dict(os.environ)
    if not args.glibc_default:
        # A fixed mmap threshold: glibc then serves every allocation of 128 KiB or more (every
        # tensor that matters here) from its own mapping and unmaps it when freed, so that peak
        # RSS follows the live tensors (as max_memory_allocated does on CUDA) instead of what
        # glibc's heaps happen to retain (its default threshold rises to 32 MiB as tensors are
        # freed, and freed heap memory stays resident).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    old = os.environ.copy()
    os.environ.clear()
    os.environ.update(env)
    try:
        return child_result(cmd, args.timeout, RESULT, {"model": cmd[3], "config": cmd[4], "B": int(cmd[5])})
    finally:
        os.environ.clear()
        os.environ.update(old)


def _opacus_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("opacus") is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "CONFIG", "B"), help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 128, 512, 1024])
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    ap.add_argument("--glibc-default", action="store_true",
                    help="leave glibc's dynamic mmap threshold (peak RSS then includes freed heap memory glibc retains)")
    ap.add_argument("--merge", help="JSON of an earlier run (--json): its rows fill in the configurations not run now")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.one:
        print(RESULT + json.dumps(run_one(args.one[0], args.one[1], int(args.one[2]), args)), flush=True)
        return
    have_opacus = _opacus_installed()
    metric = "torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "peak RSS (ru_maxrss)"
    malloc = "glibc default malloc" if args.glibc_default else "MALLOC_MMAP_THRESHOLD_=131072"
    print(f"device {args.device}, {args.threads} threads, {metric} ({malloc}); {args.steps} steps per child, "
          f"{args.repeats} fresh processes per cell, medians; transformer length {args.seq}, GPT-2 LoRA length "
          f"{min(args.seq, 64)}")
    earlier = {}
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
    t0 = time.perf_counter()
    allres: Dict[str, Any] = {}
    for m in args.models:
        res: Dict[Tuple[str, int], List[Dict[str, Any]]] = {}
        for b in args.batches:
            for rep in range(args.repeats):
                order = args.configs if rep % 2 == 0 else args.configs[::-1]
                for c in order:
                    if c == "opacus-ghost" and not have_opacus:
                        r = {"model": m, "config": c, "B": b, "error": "opacus not installed"}
                    else:
                        cmd = [sys.executable, os.path.abspath(__file__), "--one", m, c, str(b), "--seq", str(args.seq),
                               "--steps", str(args.steps), "--threads", str(args.threads), "--device", args.device]
                        r = _child(cmd, args)
                    res.setdefault((c, b), []).append(r)
                    st = r.get("error") or f"step {r['step_mib']:.0f} MiB, peak {r['peak_mib']:.0f} MiB, batches {r['sizes']}"
                    print(f"  [{time.perf_counter() - t0:5.0f} s] {m} B={b} {c} #{rep + 1}: {st}", file=sys.stderr, flush=True)
        for key, v in earlier.get(m, {}).items():
            c, b = key.split("/")
            if c not in args.configs:
                res[(c, int(b))] = v
        allres[m] = {f"{c}/{b}": v for (c, b), v in res.items()}
        _table(m, args, res)
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(allres, f, indent=1)


def _cell(runs: List[Dict[str, Any]]) -> Tuple[Any, Any, str]:
    """(median step MiB, median absolute peak MiB, error text)."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return None, None, bad[0]["error"]
    return (statistics.median(r["step_mib"] for r in runs), statistics.median(r["peak_mib"] for r in runs), "")


def _table(m: str, args: argparse.Namespace, res: Dict[Tuple[str, int], List[Dict[str, Any]]]) -> None:
    print(f"\n{m}: memory added by the training steps, MiB (absolute peak in parentheses); ratios of the added "
          "memory, and of the absolute peak in parentheses; lean: memory='lean'")
    print(f"  {'B':>5s} {'non-private':>17s} {'dpcore':>17s} {'dpcore lean':>17s} {'Opacus ghost':>17s} "
          f"{'dpcore/np':>15s} {'lean/np':>15s} {'dpcore/Opacus':>14s} {'lean/Opacus':>12s}"
          f"  {'lean goal <= 1.05x':>18s}  largest Poisson batch dpcore / lean / Opacus")
    errors = []
    for b in args.batches:
        cells = {c: _cell(res.get((c, b), [])) if (c, b) in res else (None, None, "not run") for c in CONFIGS}

        def fmt(c: str) -> str:
            s, p, e = cells[c]
            if s is None:
                if e not in errors and e != "not run":
                    errors.append(e)
                return "opacus not installed" if e == "opacus not installed" else ("-" if e == "not run" else "failed")
            return f"{s:7.0f} ({p:6.0f})"

        (snp, pnp, _), (sop, _, _) = cells["non-private"], cells["opacus-ghost"]

        def vs_np(c: str) -> str:
            s, p, _ = cells[c]
            return f"{s / snp:.2f}x ({p / pnp:.2f}x)" if snp and s is not None else "-"

        def vs_op(c: str) -> str:
            s = cells[c][0]
            return f"{s / sop:.2f}x" if sop and s is not None else "-"

        sl = cells["dpcore-lean"][0]
        goal = ("ok" if sl / snp <= 1.05 else "MISSED") if snp and sl is not None else "-"
        big = lambda c: max((max(r.get("sizes") or [0]) for r in res.get((c, b), []) if "error" not in r), default=None)
        print(f"  {b:5d} {fmt('non-private'):>17s} {fmt('dpcore'):>17s} {fmt('dpcore-lean'):>17s} "
              f"{fmt('opacus-ghost'):>17s} {vs_np('dpcore'):>15s} {vs_np('dpcore-lean'):>15s} {vs_op('dpcore'):>14s} "
              f"{vs_op('dpcore-lean'):>12s}  {goal:>18s}  {big('dpcore')} / {big('dpcore-lean')} / {big('opacus-ghost')}")
    for e in errors:
        print(f"  failed: {e[:300]}")


if __name__ == "__main__":
    main()
