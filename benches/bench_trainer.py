"""Hugging Face Trainer step time: ``dpcore.transformers.DPTrainer`` vs the plain ``transformers.Trainer``.

The model is a tiny GPT-2 built from ``transformers.GPT2Config`` (no download): vocabulary 512,
n_embd 128, 2 layers, 4 heads, 64 positions, no dropout (0.47M parameters). The data are
synthetic: 50·B sequences of 64 random token ids (labels = input ids, no padding), batch B = 16,
so the DP trainer's Poisson samples (q = 1/50) have expected size B and neither trainer reaches an
epoch boundary in a run. Two modes, each with the same model, seed and data in both trainers:

* ``lora``: peft LoRA, r = 8, alpha 16, on ``c_attn`` (``fan_in_fan_out=True``), no dropout;
  only the adapters train (8192 parameters).
* ``full``: every parameter trains.

Configurations: ``trainer`` (the anchor: ``transformers.Trainer``, the model's own mean
next-token loss) and ``dptrainer`` (``DPTrainer``, noise multiplier 1.0, max grad norm 1.0:
Poisson sample per step, per-record loss, per-record clipping and noise through
``dpcore.torch.DPOptimizer``, ledger fsync every step). Both use the Trainer's default AdamW,
``gradient_accumulation_steps=1``, ``use_cpu=True`` (``--device cuda`` lets the Trainer take the
GPU), ``report_to=[]``, ``disable_tqdm=True``, ``save_strategy="no"``, ``logging_strategy="no"``.

Timing: each configuration runs in its own process (``--one MODE CONFIG``), which trains
``--warmup`` + ``--steps`` optimizer steps in one ``train()`` call. A ``TrainerCallback`` reads
``time.perf_counter`` (and the process CPU time) at every ``on_step_end``; a step's time is the
interval between two consecutive ``on_step_end`` calls, so it covers everything the Trainer does
for one optimizer step: drawing and collating the batch (the Trainer fetches it before
``on_step_begin``), forward, backward, clipping and noise, the optimizer and scheduler step, and
the callbacks. The warm-up steps are not timed; both configurations time the same number of
steps. The child prints one JSON line: per-step times, median ms, and peak memory (RSS from
getrusage on CPU, ``torch.cuda.max_memory_allocated`` on CUDA). The parent runs the children mode
by mode in ``--rounds`` rounds, the order reversed every other round (the machine's load drifts,
and alternating spreads the drift over both), pools each configuration's step times and prints,
per mode: median ms per step, the ratio DPTrainer / Trainer against the goal (at most 1.3x), the
median CPU ms per step (a CPU ratio far from the wall ratio flags a run disturbed by other
processes' load), the steps timed and the peak memory. A configuration that fails shows the first
line of its error.

Opacus is not involved: it has no Trainer integration to compare with, so the anchor is the
non-private Trainer, and this bench needs only torch, transformers, peft and accelerate (the
``transformers`` extra), not the ``bench`` extra's Opacus.

``python benches/bench_trainer.py [--modes lora full] [--steps 30] [--warmup 5] [--rounds 3]
[--threads 2] [--device cpu|cuda] [--quick] [--json out.json]``. The default run takes about
3 minutes on 2 CPU cores (``--quick``: about 1); most of a child's time is importing
transformers. ``--threads`` (default 2, as in bench_torch.py) sets torch's threads in each child:
on a 2-core machine where another process keeps one core busy, two threads stall each other at
every parallel region (steps of 40 ms stretched to over a second, CPU time too), so there use
``--threads 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Dict, List

from _timing import child_result, merge_rounds

MODES = ("lora", "full")
CONFIGS = ("trainer", "dptrainer")
LABELS = {"trainer": "transformers.Trainer", "dptrainer": "dpcore DPTrainer"}
DESCRIPTION = {
    "lora": "LoRA r=8 on c_attn (fan_in_fan_out), adapters only",
    "full": "full fine-tuning, every parameter",
}
TARGET_VS_TRAINER = 1.3  # DPTrainer's step time at most this multiple of the plain Trainer's
RESULT = "BENCH-RESULT "
VOCAB, EMBD, LAYERS, HEADS, SEQ, BATCH = 512, 128, 2, 4, 64, 16
# --size small: GPT-2 small's shape (124M parameters with its 50257-token vocabulary), for a GPU
SIZES = {"tiny": (512, 128, 2, 4, 64, 16), "small": (50257, 768, 12, 12, 128, 16)}


def _set_size(size: str) -> None:
    global VOCAB, EMBD, LAYERS, HEADS, SEQ, BATCH
    VOCAB, EMBD, LAYERS, HEADS, SEQ, BATCH = SIZES[size]
RECORDS_PER_BATCH = 50  # 50·B records: q = 1/50 for the DP trainer, 50 batches per epoch for the Trainer
SEED = 0


# -- one configuration, in its own process -------------------------------------------------------


def _model(mode: str) -> Any:
    import torch
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(SEED)
    model: Any = transformers.GPT2LMHeadModel(cfg)
    if mode == "lora":
        import peft

        lcfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
        model = peft.get_peft_model(model, lcfg)
    elif mode != "full":
        raise ValueError(f"unknown mode {mode!r}")
    return model


def _data() -> List[Dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(2, VOCAB, (RECORDS_PER_BATCH * BATCH, SEQ), generator=g)
    ones = torch.ones(SEQ, dtype=torch.long)
    return [{"input_ids": r, "attention_mask": ones, "labels": r} for r in ids]


def _peak_mib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_one(mode: str, config: str, args: argparse.Namespace) -> Dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    out: Dict[str, Any] = {"mode": mode, "config": config, "device": args.device, "torch": torch.__version__,
                           "threads": torch.get_num_threads()}
    tmp = tempfile.mkdtemp(prefix="bench_trainer_")
    try:
        import transformers

        out["transformers"] = transformers.__version__
        model = _model(mode)
        out["params"] = sum(p.numel() for p in model.parameters())
        out["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        data = _data()
        marks: List[tuple] = []
        cuda = args.device == "cuda"

        class Clock(transformers.TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
                if cuda:
                    torch.cuda.synchronize()
                marks.append((time.perf_counter(), time.process_time()))

        targs = transformers.TrainingArguments(
            output_dir=tmp, use_cpu=args.device == "cpu", report_to=[], disable_tqdm=True, save_strategy="no",
            logging_strategy="no", per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
            max_steps=args.warmup + args.steps, dataloader_num_workers=0, seed=SEED, bf16=args.bf16)
        kw = dict(model=model, args=targs, train_dataset=data, data_collator=transformers.default_data_collator,
                  callbacks=[Clock()])
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with warnings.catch_warnings(record=True) as caught:  # dpcore's notices are shown
            warnings.simplefilter("always")
            trainer: Any
            if config == "trainer":
                trainer = transformers.Trainer(**kw)
            elif config == "dptrainer":
                from dpcore.transformers import DPTrainer

                trainer = DPTrainer(**kw, noise_multiplier=1.0, max_grad_norm=1.0,
                                    ledger=os.path.join(tmp, "ledger.jsonl"))
            else:
                raise ValueError(f"unknown configuration {config!r}")
            trainer.train()
        out["notes"] = sorted({str(w.message).strip().splitlines()[0] for w in caught
                               if w.category.__module__.startswith("dpcore") and str(w.message).strip()})
        if config == "dptrainer":
            out["releases"] = trainer.ledger.num_releases
            out["epsilon"] = trainer.get_epsilon()
        if len(marks) != args.warmup + args.steps:
            raise RuntimeError(f"{len(marks)} on_step_end calls for {args.warmup + args.steps} steps")
        timed = marks[args.warmup - 1:]  # from the last warm-up step's end: `steps` intervals
        times = [(b[0] - a[0]) * 1e3 for a, b in zip(timed, timed[1:])]
        cpu = [(b[1] - a[1]) * 1e3 for a, b in zip(timed, timed[1:])]
        out.update(times=times, ms=statistics.median(times), steps=len(times), cpu_times=cpu,
                   cpu_ms=statistics.median(cpu), peak_mib=_peak_mib(args.device),
                   mem="cuda" if args.device == "cuda" else "rss")
    except Exception as e:  # reported in the table, not raised
        traceback.print_exc(file=sys.stderr)
        first = (str(e).strip().splitlines() or [""])[0]
        out["error"] = f"{type(e).__name__}: {first}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- the parent ----------------------------------------------------------------------------------


def _child(mode: str, config: str, args: argparse.Namespace) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", mode, config, "--device", args.device,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads), "--size", args.size] + (["--bf16"] if args.bf16 else [])
    timeout = 300 + 10 * (args.steps + args.warmup)
    return child_result(cmd, timeout, RESULT, {"mode": mode, "config": config})


_merge = merge_rounds


def report(mode: str, res: Dict[str, Dict[str, Any]], device: str) -> None:
    any_ok = next((r for r in res.values() if "error" not in r), {})
    extra = ""
    if any_ok.get("params"):
        extra = f", {any_ok['params'] / 1e6:.2f}M parameters, {any_ok['trainable'] / 1e6:.3f}M trained"
    print(f"\n{mode}: {DESCRIPTION[mode]}{extra}")
    mem = "peak GPU MiB" if device == "cuda" else "peak RSS MiB"
    print(f"  {'configuration':22s} {'ms/step':>9s} {'vs Trainer':>11s} {'cpu ms':>8s} {'(ratio)':>8s} {'steps':>6s} "
          f"{mem:>13s}  target")
    base: Dict[str, Any] = res.get("trainer") or {"error": "not run"}
    base_ok = "error" not in base
    for cfg, r in res.items():
        if "error" in r:
            print(f"  {LABELS[cfg]:22s} failed: {r['error'][:200]}")
            continue
        ratio = f"{r['ms'] / base['ms']:.2f}x" if base_ok else "-"
        cpu_ratio = f"{r['cpu_ms'] / base['cpu_ms']:.2f}x" if base_ok else "-"
        target = ""
        if cfg == "dptrainer" and base_ok:
            ok = r["ms"] / base["ms"] <= TARGET_VS_TRAINER
            target = f"<= {TARGET_VS_TRAINER}x Trainer: {'ok' if ok else 'MISSED'}"
        print(f"  {LABELS[cfg]:22s} {r['ms']:9.1f} {ratio:>11s} {r['cpu_ms']:8.1f} {cpu_ratio:>8s} {r['steps']:6d} "
              f"{r['peak_mib']:13.0f}  {target}")
    dp = res.get("dptrainer")
    if dp is not None and "error" not in dp:
        print(f"  DPTrainer ledger: {dp['releases']} releases per round, epsilon {dp['epsilon']:.3g} at its delta")
        for n in dp.get("notes", []):
            print(f"  dpcore note: {n[:200]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", nargs=2, metavar=("MODE", "CONFIG"), help=argparse.SUPPRESS)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu (use_cpu=True, the default) or cuda (the Trainer's own device choice)")
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps per configuration and round")
    ap.add_argument("--warmup", type=int, default=None, help="untimed optimizer steps before them")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a few steps each: a smoke test")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="tiny (the default) or small: GPT-2 small's shape (768 wide, 12 layers, length 128)")
    ap.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): bfloat16 autocast, both trainers")
    ap.add_argument("--json", help="also write every configuration's result to this file")
    args = ap.parse_args()
    _set_size(args.size)
    quick = dict(steps=5, warmup=2, rounds=1)
    full = dict(steps=30, warmup=5, rounds=3)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the first step's interval starts at its own on_step_end)")
    if args.one:
        print(RESULT + json.dumps(run_one(args.one[0], args.one[1], args)), flush=True)
        return

    import torch
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}, {args.threads} "
          f"threads; GPT-2 vocab {VOCAB}, n_embd {EMBD}, {LAYERS} layers, {HEADS} heads, length {SEQ}, batch {BATCH}; "
          f"{'bf16 autocast; ' if args.bf16 else ''}per configuration and round: {args.warmup} warm-up + {args.steps} timed optimizer steps; {args.rounds} "
          f"round(s), order reversed every other round; own process each; load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores")
    t0 = time.perf_counter()
    all_res: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for m in args.modes:
        runs: Dict[str, List[Dict[str, Any]]] = {c: [] for c in args.configs}
        for rnd in range(args.rounds):
            order = args.configs if rnd % 2 == 0 else args.configs[::-1]
            for c in order:
                r = _child(m, c, args)
                runs[c].append(r)
                status = r.get("error") or f"{r['ms']:.1f} ms/step median over {r['steps']} steps"
                print(f"  [{time.perf_counter() - t0:6.0f} s] {m} {c} round {rnd + 1}: {status}", file=sys.stderr,
                      flush=True)
        all_res[m] = {c: _merge(runs[c]) for c in args.configs}
        report(m, all_res[m], args.device)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.2f} (other processes skew the "
          f"timings)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_res, f, indent=1)


if __name__ == "__main__":
    main()
