"""DP-SGD step time and peak memory, side by side in one run: dpcore.torch vs plain torch vs Opacus.

Four models, each in four configurations (SGD, noise multiplier 1.0, max grad norm 1.0):

* transformer: Embedding(8000, 256) -> 2 x TransformerEncoderLayer(256, 4 heads, ff 1024, no
  dropout) -> mean over positions -> Linear(256, 2); batch 32, length 128, random token ids.
* cnn: 4 x (Conv2d 3x3 + GroupNorm(8, ch) + ReLU), channels 3-32-32-64-64 -> mean pool ->
  Linear(64, 10); 32x32x3 inputs, batch 64.
* lstm: Embedding(5000, 128) -> LSTM(128, 256, 2 layers) -> last output -> Linear(256, 2);
  batch 32, length 64.
* mlp: 784-1024-256-10 at batch 256 (the model of the first torch issue, kept as a regression check).

Configurations: ``non-private`` (the anchor: zero_grad, forward, loss, backward, step over a
shuffled DataLoader), ``dpcore`` (``dpcore.torch.make_private``: Poisson batches from the core's
sampler, clipping, noise from the core, ledger fsync every step), ``opacus-hooks`` and
``opacus-ghost`` (``PrivacyEngine.make_private`` after ``ModuleValidator.fix``, which swaps in
DPMultiheadAttention and DPLSTM; ghost computes the loss with the criterion wrapper Opacus
returns). Every model starts from the same seed in every configuration, and every timed step
includes drawing its batch from the configuration's loader (a DataLoader over 50·B records with
batch size B, so the DP loaders' expected batch is B).

Each configuration runs in its own subprocess (``--one MODEL CONFIG``), so peak memory is its
own: the child does warm-up steps, then timed steps until ``--steps`` or its time budget
(``--budget`` seconds, so that Opacus hooks on the LSTM, seconds per step, takes fewer steps),
and prints one JSON line: per-step times, median ms, and peak memory (RSS from getrusage on CPU,
``torch.cuda.max_memory_allocated`` on CUDA). The parent runs the children model by model in
``--rounds`` rounds, the configurations' order reversed every other round (the machine's load
drifts, and alternating spreads the drift over all of them), pools each configuration's step
times and prints a table per model: median ms, ratio to non-private, peak memory, and dpcore
against the faster Opacus mode, beside the targets (judged on wall time). The median process CPU
time per step is shown too: on a shared machine other processes' load stretches wall time much
more than it stretches CPU time, so a CPU ratio far from the wall ratio flags a disturbed run.
A configuration that fails (dpcore refusing a layer, an Opacus error) shows the first line of its
error in the table. Peak RSS of the DP configurations grows with the number of steps (Poisson
batches vary in size), and slower configurations take fewer steps in their budget: compare
memory with that in mind.

bfloat16 (``--bf16``, or by name in ``--configs``): ``non-private-bf16`` (the anchor of these
rows), ``dpcore-bf16``, ``opacus-hooks-bf16`` and ``opacus-ghost-bf16`` are the four
configurations above with the forward pass under ``torch.autocast(device_type,
dtype=torch.bfloat16)`` (parameters, gradients and optimizer stay float32; the loss is computed
in float32 from the float32-cast output; the backward pass runs outside autocast, as usual).
They run for the transformer and the CNN only (other models skip them), in the same rounds as the
float32 configurations, and get a table of their own under each model's: median ms, ratio to
non-private-bf16, peak memory, and dpcore-bf16 against the faster Opacus bf16 mode (with the
float32 targets beside them, for reference). They are off by default, to keep the default run
near 7 minutes. On CPU, bfloat16 matrix products are fast only where the processor has
bfloat16 instructions (AVX512-BF16, AMX); elsewhere torch takes a fallback path (on the 2-core
AVX2 VM a bf16 matrix product takes 40-90x the float32 one, and a bf16 transformer step
15-30 s against 0.4-1.7 s in float32), the run prints a note saying so, and the bf16 rows then
time that fallback more than anything DP: compare them with each other, not with the float32
rows, and prefer a GPU (``--device cuda``) or a CPU with bf16 instructions for them.

``python benches/bench_torch.py [--models cnn lstm] [--configs ...] [--bf16] [--steps 40] [--budget 12]
[--rounds 2] [--device auto|cpu|cuda] [--quick] [--json out.json]``. The default run takes about
7 minutes on 2 CPU cores (``--quick``: about 1.5). The bf16 rows alone,
``python benches/bench_torch.py --models transformer cnn --configs non-private-bf16 dpcore-bf16
opacus-hooks-bf16 opacus-ghost-bf16``, take about 15 minutes on the 2-core AVX2 VM (``--quick``:
about 6), where a bf16 child gets only 2 or 3 timed steps in its budget (1 with ``--quick``).
``--bf16`` adds them to the default run (about 22 minutes on that VM).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Tuple

from _timing import child_result, merge_rounds

import torch
from torch import nn

MODELS = ("transformer", "cnn", "lstm", "mlp", "llama", "llama-lora", "wrn16-4", "resnet18")
CONFIGS = ("non-private", "dpcore", "opacus-hooks", "opacus-ghost")
# Not run by default: the floating-point-safe noise of issue 17 (--configs ... dpcore-discrete), and
# the memory-lean mode (memory="lean": a second backward pass; its memory in bench_memory.py).
EXTRA_CONFIGS = ("dpcore-discrete", "dpcore-lean")
# The forward pass under torch.autocast(dtype=torch.bfloat16): --bf16, for BF16_MODELS only.
BF16 = "-bf16"
BF16_CONFIGS = tuple(c + BF16 for c in CONFIGS)
BF16_MODELS = ("transformer", "cnn")
LABELS = {"non-private": "non-private torch", "dpcore": "dpcore.torch", "opacus-hooks": "Opacus hooks",
          "opacus-ghost": "Opacus ghost", "dpcore-discrete": "dpcore discrete", "dpcore-lean": "dpcore lean"}
LABELS.update({c + BF16: LABELS[c] + " bf16" for c in CONFIGS})
DESCRIPTION = {
    "transformer": "Embedding(8000,256) + 2 x TransformerEncoderLayer(256, 4 heads, ff 1024) + Linear(256,2), "
                   "batch 32, length 128",
    "cnn": "4 x (Conv2d 3x3 + GroupNorm + ReLU) 3-32-32-64-64 + Linear(64,10), 32x32x3, batch 64",
    "lstm": "Embedding(5000,128) + LSTM(128, 256, 2 layers) + Linear(256,2), batch 32, length 64",
    "mlp": "MLP 784-1024-256-10 (1.07M parameters), batch 256 (the first torch issue's model)",
    "llama": "tiny Llama from a config (vocab 8000, hidden 256, 2 layers, 4 heads, 2 KV heads, MLP 688, RMSNorm, "
             "RoPE, sdpa) + mean-pooled Linear(256,2), full fine-tuning, batch 32, length 128",
    "llama-lora": "the same tiny Llama with peft LoRA r=8 on q_proj and v_proj (only the adapters and the head train)",
    "wrn16-4": "WRN-16-4 with GroupNorm(16) (De et al. 2022's CIFAR-10 model), 32x32x3, batch 64",
    "resnet18": "ResNet-18 (CIFAR stem: 3x3 conv, no max-pool) with GroupNorm(32), 32x32x3, batch 64",
}
# dpcore's targets: step time at most this multiple of non-private torch
TARGET_VS_PLAIN = {"transformer": 1.4, "cnn": 1.5, "lstm": 3.0, "mlp": 1.5, "llama": 1.3, "llama-lora": 1.3,
                   "wrn16-4": 1.3, "resnet18": 1.3}
# ... and at least this many times faster than Opacus on DPLSTM (the faster of its two modes)
TARGET_VS_OPACUS = {"lstm": 10.0}
RESULT = "BENCH-RESULT "
RECORDS_PER_BATCH = 50  # dataset of 50·B records with batch size B: q = 1/50, expected batch B
SEED = 0


# -- models and data ---------------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8000, 256)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(256, nhead=4, dim_feedforward=1024, batch_first=True, dropout=0.0)
            for _ in range(2)
        )
        self.fc = nn.Linear(256, 2)

    def forward(self, x: Any) -> Any:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.fc(h.mean(dim=1))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        chans = (3, 32, 32, 64, 64)
        blocks: List[nn.Module] = []
        for a, b in zip(chans, chans[1:]):
            blocks += [nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(8, b), nn.ReLU()]
        self.features = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: Any) -> Any:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5000, 128)
        self.lstm = nn.LSTM(128, 256, num_layers=2, batch_first=True)
        self.fc = nn.Linear(256, 2)

    def forward(self, x: Any) -> Any:
        out, _ = self.lstm(self.emb(x))
        return self.fc(out[:, -1])


class _Block(nn.Module):
    """A pre-activation (WRN) or post-activation (ResNet) residual block with GroupNorm; a
    strided 3x3 conv when it downsamples, a strided 1x1 shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int, pre: bool) -> None:
        super().__init__()
        self.pre = pre
        self.n1 = nn.GroupNorm(min(groups, cin if pre else cout), cin if pre else cout)
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n2 = nn.GroupNorm(min(groups, cout), cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.short = None if stride == 1 and cin == cout else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: Any) -> Any:
        if self.pre:
            o = torch.relu(self.n1(x))
            y = self.c1(o)
            y = self.c2(torch.relu(self.n2(y)))
            return y + (x if self.short is None else self.short(o))
        y = torch.relu(self.n1(self.c1(x)))
        y = self.n2(self.c2(y))
        return torch.relu(y + (x if self.short is None else self.short(x)))


class ResNetGN(nn.Module):
    """``wrn``: WRN-16-4 (3 groups of 2 pre-activation blocks, widths 64-128-256, GroupNorm 16);
    else ResNet-18 (4 stages of 2 blocks, 64-128-256-512, GroupNorm 32). Both downsample by
    strided convolutions, as the CNNs people train do."""

    def __init__(self, wrn: bool) -> None:
        super().__init__()
        if wrn:
            widths, first, groups, pre = [64, 128, 256], 16, 16, True
        else:
            widths, first, groups, pre = [64, 128, 256, 512], 64, 32, False
        self.stem = nn.Conv2d(3, first, 3, 1, 1, bias=False)
        self.stem_norm = None if pre else nn.GroupNorm(groups, first)
        blocks, cin = [], first
        for i, w in enumerate(widths):
            for j in range(2):
                blocks.append(_Block(cin, w, 2 if (i > 0 and j == 0) else 1, groups, pre))
                cin = w
        self.blocks = nn.Sequential(*blocks)
        self.out_norm = nn.GroupNorm(groups, cin) if pre else None
        self.fc = nn.Linear(cin, 10)

    def forward(self, x: Any) -> Any:
        h = self.stem(x)
        if self.stem_norm is not None:
            h = torch.relu(self.stem_norm(h))
        h = self.blocks(h)
        if self.out_norm is not None:
            h = torch.relu(self.out_norm(h))
        return self.fc(h.mean((2, 3)))


class Llama(nn.Module):
    """A tiny Llama (transformers.LlamaModel from a config, no download) with a mean-pooled
    classification head; ``lora``: peft LoRA r=8 on q_proj and v_proj, the base frozen."""

    def __init__(self, lora: bool = False) -> None:
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       attn_implementation="sdpa")
        body: Any = transformers.LlamaModel(cfg)
        if lora:
            import peft

            body = peft.get_peft_model(body, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                             lora_dropout=0.0))
        self.body, self.head = body, nn.Linear(256, 2)

    def forward(self, x: Any) -> Any:
        return self.head(self.body(input_ids=x).last_hidden_state.mean(1))


def _build(name: str) -> Tuple[Any, int, Callable[[int], Tuple[Any, Any]]]:
    """(model, batch size B, make_data(n) -> (inputs, labels)), the model initialised from SEED."""
    g = torch.Generator().manual_seed(SEED + 1)
    if name == "transformer":
        ctor, b = Transformer, 32
        make = lambda n: (torch.randint(0, 8000, (n, 128), generator=g), torch.randint(0, 2, (n,), generator=g))
    elif name == "cnn":
        ctor, b = CNN, 64
        make = lambda n: (torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    elif name == "mlp":
        ctor, b = (lambda: nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))), 256
        make = lambda n: (torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))
    elif name in ("wrn16-4", "resnet18"):
        ctor, b = (lambda: ResNetGN(wrn=name == "wrn16-4")), 64
        make = lambda n: (torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    elif name in ("llama", "llama-lora"):
        ctor, b = (lambda: Llama(lora=name == "llama-lora")), 32
        make = lambda n: (torch.randint(0, 8000, (n, 128), generator=g), torch.randint(0, 2, (n,), generator=g))
    elif name == "lstm":
        ctor, b = LSTM, 32
        make = lambda n: (torch.randint(0, 5000, (n, 64), generator=g), torch.randint(0, 2, (n,), generator=g))
    else:
        raise ValueError(f"unknown model {name!r}")
    torch.manual_seed(SEED)
    return ctor(), b, make


# -- one configuration, in its own process -------------------------------------------------------


def _forever(loader: Any):
    while True:
        yield from loader


def _setup(config: str, model: Any, loader: Any, device: Any) -> Tuple[Callable[[Any], None], Any]:
    """(step(batch), the loader to draw batches from) for one configuration."""
    bf16 = config.endswith(BF16)
    if bf16:
        config = config[: -len(BF16)]
    crit: Any = nn.CrossEntropyLoss()
    if config == "non-private":
        model = model.to(device)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.01)
    elif config in ("dpcore", "dpcore-discrete", "dpcore-lean"):
        import dpcore.torch

        model = model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mech = "discrete_gaussian" if config == "dpcore-discrete" else "gaussian"
        model, opt, loader = dpcore.torch.make_private(
            model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism=mech,
            memory="lean" if config == "dpcore-lean" else "default")
    elif config in ("opacus-hooks", "opacus-ghost"):
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        model = ModuleValidator.fix(model).to(device)  # DPMultiheadAttention, DPLSTM (weights copied)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        pe = PrivacyEngine()
        if config == "opacus-ghost":
            model, opt, crit, loader = pe.make_private(
                module=model, optimizer=opt, data_loader=loader, criterion=crit,
                noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost")
        else:
            model, opt, loader = pe.make_private(
                module=model, optimizer=opt, data_loader=loader,
                noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="hooks")
    else:
        raise ValueError(f"unknown configuration {config!r}")
    model.train()

    def step(batch: Any) -> None:
        x, y = batch
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad()
        if bf16:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(x)
            loss = crit(out.float(), y)  # the loss in float32, outside autocast
        else:
            loss = crit(model(x), y)  # Opacus ghost: its criterion wrapper, whose backward() clips
        loss.backward()
        opt.step()

    return step, loader


def _peak_mib(device: Any) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_one(model_name: str, config: str, args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")
    out: Dict[str, Any] = {"model": model_name, "config": config, "device": str(device),
                           "torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        model, b, make = _build(model_name)
        out["params"] = sum(p.numel() for p in model.parameters())
        out["init_sum"] = float(sum(p.detach().double().sum() for p in model.parameters()))  # same in every config
        x, y = make(RECORDS_PER_BATCH * b)
        ds = torch.utils.data.TensorDataset(x, y)
        loader = torch.utils.data.DataLoader(ds, batch_size=b, shuffle=True, drop_last=True)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with warnings.catch_warnings(record=True) as caught:  # dpcore's notices (e.g. FallbackWarning) are shown
            warnings.simplefilter("always")
            step, loader = _setup(config, model, loader, device)
            batches = _forever(loader)
            for _ in range(args.warmup):  # the first steps allocate, pick kernels, start dpcore's noise pipeline
                t = time.perf_counter()
                step(next(batches))
                sync()
                if time.perf_counter() - t > args.budget / 4:
                    break  # a slow configuration: one warm-up step is enough
        out["notes"] = sorted({str(w.message).strip().splitlines()[0] for w in caught
                               if w.category.__module__.startswith("dpcore") and str(w.message).strip()})
        if config.startswith("opacus"):
            import opacus

            out["opacus"] = opacus.__version__
        times: List[float] = []
        cpu: List[float] = []
        t_end = time.perf_counter() + args.budget
        while len(times) < args.steps and (len(times) < args.min_steps or time.perf_counter() < t_end):
            t, c = time.perf_counter(), time.process_time()
            step(next(batches))  # the batch is drawn inside the timed step
            sync()
            times.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.process_time() - c) * 1e3)
        out.update(times=times, ms=statistics.median(times), steps=len(times), cpu_times=cpu,
                   cpu_ms=statistics.median(cpu),
                   peak_mib=_peak_mib(device), mem="cuda" if device.type == "cuda" else "rss")
    except Exception as e:  # reported in the table, not raised
        traceback.print_exc(file=sys.stderr)
        first = (str(e).strip().splitlines() or [""])[0]
        out["error"] = f"{type(e).__name__}: {first}"
    return out


# -- the parent ----------------------------------------------------------------------------------


def _child(model_name: str, config: str, args: argparse.Namespace) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", model_name, config, "--device", args.device,
           "--steps", str(args.steps), "--min-steps", str(args.min_steps), "--warmup", str(args.warmup),
           "--budget", str(args.budget), "--threads", str(args.threads)]
    # generous: warm-up and the minimum steps may overrun the budget (Opacus hooks on the LSTM)
    timeout = 120 + 4 * args.budget
    return child_result(cmd, timeout, RESULT, {"model": model_name, "config": config})


_merge = merge_rounds


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _table(model_name: str, res: Dict[str, Dict[str, Any]], device: str, suffix: str = "") -> None:
    """One group's table: the configurations whose names end in `suffix` ("" for float32, BF16),
    with ratios to that group's non-private anchor and dpcore against that group's faster Opacus mode."""
    mem = "peak GPU MiB" if device.startswith("cuda") else "peak RSS MiB"
    print(f"  {'configuration':23s} {'median ms':>10s} {'vs non-private':>15s} {'cpu ms':>8s} {'(ratio)':>8s} "
          f"{'steps':>6s} {mem:>13s}  target")
    base = res.get("non-private" + suffix)
    base_ok = base is not None and "error" not in base
    for cfg, r in res.items():
        if "error" in r:
            print(f"  {LABELS[cfg]:23s} failed: {r['error'][:200]}")
            continue
        ratio = f"{r['ms'] / base['ms']:.2f}x" if base_ok else "-"
        cpu_ratio = f"{r['cpu_ms'] / base['cpu_ms']:.2f}x" if base_ok else "-"
        target = ""
        if cfg == "dpcore" + suffix and base_ok:
            lim = TARGET_VS_PLAIN[model_name]
            target = (f"<= {lim}x non-private{suffix}: {_mark(r['ms'] / base['ms'] <= lim)}"
                      + (" (the float32 target)" if suffix else ""))
        print(f"  {LABELS[cfg]:23s} {r['ms']:10.1f} {ratio:>15s} {r['cpu_ms']:8.1f} {cpu_ratio:>8s} {r['steps']:6d} "
              f"{r['peak_mib']:13.0f}  {target}")
    dp = res.get("dpcore" + suffix)
    disc = res.get("dpcore-discrete" + suffix)
    if dp is not None and disc is not None and "error" not in dp and "error" not in disc:
        print(f"  discrete Gaussian / Gaussian step: {disc['ms'] / dp['ms']:.2f}x")
    lean = res.get("dpcore-lean" + suffix)
    if dp is not None and lean is not None and "error" not in dp and "error" not in lean:
        print(f"  memory-lean / default step: {lean['ms'] / dp['ms']:.2f}x (peak {lean['peak_mib']:.0f} against "
              f"{dp['peak_mib']:.0f} MiB)")
    ops = [(c, res[c]) for c in ("opacus-hooks" + suffix, "opacus-ghost" + suffix)
           if c in res and "error" not in res[c]]
    if dp is not None and "error" not in dp and ops:
        c, fast = min(ops, key=lambda cr: cr[1]["ms"])
        ratio = dp["ms"] / fast["ms"]
        line = (f"  {LABELS['dpcore' + suffix]} vs the faster Opacus mode ({LABELS[c]}): {ratio:.2f}x its time "
                f"({1 / ratio:.1f}x faster); target faster: {_mark(ratio < 1)}")
        if model_name in TARGET_VS_OPACUS:
            lim = TARGET_VS_OPACUS[model_name]
            line += f"; target >= {lim:.0f}x faster than DPLSTM: {_mark(1 / ratio >= lim)}"
        print(line)
    elif dp is not None and ops:
        print(f"  dpcore vs Opacus: - ({LABELS['dpcore' + suffix]} failed)")
    elif dp is not None and "error" not in dp and any(c.startswith("opacus") for c in res):
        print(f"  dpcore vs Opacus: - (every Opacus{' bf16' if suffix else ''} mode failed)")
    for n in (dp or {}).get("notes", []):
        print(f"  dpcore note: {n[:200]}")


def report(model_name: str, res: Dict[str, Dict[str, Any]], device: str) -> None:
    any_ok = next((r for r in res.values() if "error" not in r), {})
    params = any_ok.get("params")
    print(f"\n{model_name}: {DESCRIPTION[model_name]}" + (f", {params / 1e6:.2f}M parameters" if params else ""))
    fp32 = {c: r for c, r in res.items() if not c.endswith(BF16)}
    bf16 = {c: r for c, r in res.items() if c.endswith(BF16)}
    if fp32:
        _table(model_name, fp32, device)
    if bf16:
        print(f"  {model_name}, forward pass under torch.autocast(bfloat16); ratios against non-private bf16:")
        _table(model_name, bf16, device, BF16)
        a, b = res.get("non-private"), res.get("non-private" + BF16)
        if a is not None and b is not None and "error" not in a and "error" not in b:
            print(f"  non-private bf16 / float32 step: {b['ms'] / a['ms']:.2f}x")
        a, b = res.get("dpcore"), res.get("dpcore" + BF16)
        if a is not None and b is not None and "error" not in a and "error" not in b:
            print(f"  dpcore bf16 / float32 step: {b['ms'] / a['ms']:.2f}x")


def _bf16_cpu_note() -> str:
    """A warning when the CPU lacks bfloat16 instructions (its bf16 matrix products then take a slow
    fallback path, which the bf16 rows would mostly measure), with the measured bf16/float32 ratio
    of a small matrix product; "" when it has them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((l for l in f if l.startswith("flags")), "").split())
    except OSError:
        flags = set()
    if flags & {"avx512_bf16", "amx_bf16"}:
        return ""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    ts = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a second one stalls whenever another process holds a core
    try:
        for dt in (torch.float32, torch.bfloat16):
            x, y = a.to(dt), b.to(dt)
            x @ y
            ts[dt] = min(_timed(lambda: x @ y) for _ in range(5))
    finally:
        torch.set_num_threads(threads)
    return (f"note: this CPU has no bfloat16 instructions (no avx512_bf16/amx_bf16 flag): a 256x256 bfloat16 matrix "
            f"product takes {ts[torch.bfloat16] / ts[torch.float32]:.0f}x the float32 one here (one thread), so the "
            f"bf16 rows mostly time torch's bfloat16 fallback kernels")


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS[:4]),
                    help="default: the first four; llama and llama-lora by name")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS + EXTRA_CONFIGS + BF16_CONFIGS, default=None,
                    help=f"default: {' '.join(CONFIGS)} (and with --bf16 {' '.join(BF16_CONFIGS)}); the bf16 "
                         f"configurations run on {' and '.join(BF16_MODELS)} only")
    ap.add_argument("--bf16", action="store_true",
                    help=f"add the bf16 configurations ({', '.join(BF16_CONFIGS)}) for {' and '.join(BF16_MODELS)}")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--steps", type=int, default=None, help="at most this many timed steps per configuration and round")
    ap.add_argument("--min-steps", type=int, default=None, help="at least this many, whatever the budget")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timed steps per configuration and round")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a few steps each: a smoke test")
    ap.add_argument("--json", help="also write every configuration's result to this file")
    args = ap.parse_args()
    quick = dict(steps=3, min_steps=1, budget=3.0, warmup=1, rounds=1)
    full = dict(steps=40, min_steps=2, budget=12.0, warmup=2, rounds=2)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.configs is None:
        args.configs = list(CONFIGS)
    if args.bf16:
        args.configs += [c for c in BF16_CONFIGS if c not in args.configs]
    if args.one:
        print(RESULT + json.dumps(run_one(args.one[0], args.one[1], args)), flush=True)
        return

    print(f"torch {torch.__version__}, device {args.device}, {args.threads} threads; per configuration and round: "
          f"{args.warmup} warm-up + up to {args.steps} timed steps in {args.budget:.0f} s (at least {args.min_steps}); "
          f"{args.rounds} round(s), order reversed every other round; own process each; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    bf16_runs = any(c.endswith(BF16) for c in args.configs) and any(m in BF16_MODELS for m in args.models)
    if args.device == "cpu" and bf16_runs:
        note = _bf16_cpu_note()
        if note:
            print(note)
    t0 = time.perf_counter()
    all_res: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for m in args.models:
        configs = [c for c in args.configs if m in BF16_MODELS or not c.endswith(BF16)]
        if not configs:
            print(f"  {m}: skipped (the bf16 configurations run on {' and '.join(BF16_MODELS)} only)", file=sys.stderr)
            continue
        runs: Dict[str, List[Dict[str, Any]]] = {c: [] for c in configs}
        for rnd in range(args.rounds):
            order = configs if rnd % 2 == 0 else configs[::-1]
            for c in order:
                r = _child(m, c, args)
                runs[c].append(r)
                status = r.get("error") or f"{r['ms']:.1f} ms median over {r['steps']} steps"
                print(f"  [{time.perf_counter() - t0:6.0f} s] {m} {c} round {rnd + 1}: {status}", file=sys.stderr,
                      flush=True)
        all_res[m] = {c: _merge(runs[c]) for c in configs}
        report(m, all_res[m], args.device)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.2f} (other processes skew the "
          f"timings)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_res, f, indent=1)


if __name__ == "__main__":
    main()
