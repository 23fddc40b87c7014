"""What a DP step asks of the device, counted on any machine: aten operators per step (each one
kernel launch or more on a GPU) and the operators among them that force a device→host
synchronisation on CUDA (:mod:`dpcore.torch.opcount`), dpcore against non-private torch and
Opacus ghost clipping, per model and memory mode, side by side in one run.

On a GPU a DP step of a small or medium model is bound by the host: it launches kernels faster
than the device runs them only if it launches few and never waits. So the counts predict the
GPU ratio where no GPU is lent (issue 52's targets: ≤ 1.5× non-private operators for the
transformer and GPT-2 + LoRA, ≤ 2.0× for the strided CNN in the default mode; ≤ 2.2× and ≤ 2.6×
lean; no synchronisation).

Models (the issue's):

* ``transformer``: bench_torch's (Embedding 8000×256, 2 encoder layers, B = 32, T = 128).
* ``cnn``: a strided GroupNorm CNN: 6 Conv2d 3×3 (3→32→64→64→128→128→256, stride 2 at the
  second, fourth and sixth), GroupNorm(8) + ReLU after each, mean pool, Linear(256, 10); B = 64.
* ``gpt2-lora``: GPT-2 from a config (4 layers, 256 wide, 4 heads, vocabulary 8000) with peft
  LoRA r = 8 on c_attn and c_proj; B = 16, T = 64; the loss is each sequence's mean token loss,
  averaged over the batch.
* ``trainer-lora``, ``trainer-full``: the Hugging Face ``Trainer`` against dpcore's ``DPTrainer``
  on bench_trainer.py's tiny GPT-2 (LoRA on c_attn, or every weight), counted from each
  optimizer step's begin to its end (the Trainer's callbacks).

Configurations: ``non-private`` (zero_grad, forward, loss, backward, SGD step), ``dpcore``,
``dpcore-lean`` and ``dpcore-padded`` (``pad_batches=True``, physical batches of 1.3 B rows)
(``make_private`` with Poisson sampling, σ = 1, C = 1, noise drawn on the
parameters' device by torch's ChaCha20 path: ``optimizer.noise_device = "device"``, as on a
GPU), ``opacus-ghost`` (``PrivacyEngine.make_private(grad_sample_mode="ghost")`` after
``ModuleValidator.fix``, which swaps in Opacus's DPMultiheadAttention). Each step is
counted after 3 warm-up steps; the batch is drawn from the loader outside the count (loading is
host work either way); the median of 5 counted steps is printed (Poisson batches vary in size,
the counts should not).

    python benches/bench_step_ops.py [--models transformer cnn gpt2-lora] [--configs ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
import warnings
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dpcore.torch.opcount import OpCounter  # noqa: E402

MODELS = ("transformer", "cnn", "gpt2-lora", "trainer-lora", "trainer-full")
CONFIGS = ("non-private", "dpcore", "dpcore-lean", "dpcore-padded", "opacus-ghost")
# issue 52's targets: dpcore's operators per step at most this multiple of non-private's
TARGET = {("transformer", "dpcore"): 1.5, ("gpt2-lora", "dpcore"): 1.5, ("cnn", "dpcore"): 2.0,
          ("transformer", "dpcore-lean"): 2.2, ("gpt2-lora", "dpcore-lean"): 2.2, ("cnn", "dpcore-lean"): 2.6}
SEED = 0


class StridedCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        chans, strides = (3, 32, 64, 64, 128, 128, 256), (1, 2, 1, 2, 1, 2)
        layers: List[nn.Module] = []
        for a, b, s in zip(chans, chans[1:], strides):
            layers += [nn.Conv2d(a, b, 3, stride=s, padding=1), nn.GroupNorm(8, b), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(256, 10)

    def forward(self, x: Any) -> Any:
        return self.fc(self.features(x).mean(dim=(2, 3)))


class GPT2LoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import peft
        import transformers

        cfg = transformers.GPT2Config(vocab_size=8000, n_positions=128, n_embd=256, n_layer=4, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        base = transformers.GPT2LMHeadModel(cfg)
        self.body = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"],
                                                              lora_dropout=0.0, fan_in_fan_out=True))

    def forward(self, x: Any) -> Any:
        return self.body(input_ids=x).logits


def seq_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean next-token loss, averaged over the batch (a per-record mean)."""
    b, t, v = logits.shape
    per = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v).float(), y[:, 1:].reshape(-1), reduction="none")
    return per.view(b, t - 1).mean(1).mean()


def build(name: str) -> Tuple[nn.Module, int, Callable[[int], Tuple[Any, Any]], Any]:
    """(model, B, make_data(n), criterion)."""
    g = torch.Generator().manual_seed(SEED + 1)
    torch.manual_seed(SEED)
    if name == "transformer":
        import bench_torch as bt

        return (bt.Transformer(), 32,
                lambda n: (torch.randint(0, 8000, (n, 128), generator=g), torch.randint(0, 2, (n,), generator=g)),
                nn.CrossEntropyLoss())
    if name == "cnn":
        return (StridedCNN(), 64,
                lambda n: (torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)),
                nn.CrossEntropyLoss())
    if name == "gpt2-lora":
        def make(n: int) -> Tuple[Any, Any]:
            x = torch.randint(0, 8000, (n, 64), generator=g)
            return x, x.clone()

        return GPT2LoRA(), 16, make, seq_loss
    raise ValueError(f"unknown model {name!r}")


def setup(config: str, model: nn.Module, loader: Any, crit: Any) -> Tuple[Callable[[Any], None], Any, Any]:
    """(step(batch), loader, optimizer) for one configuration."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config == "non-private":
        opt: Any = torch.optim.SGD(params, lr=0.01)
    elif config in ("dpcore", "dpcore-lean", "dpcore-padded"):
        import dpcore.torch

        opt = torch.optim.SGD(params, lr=0.01)
        # a test seed: the same Poisson samples in every run, so that counts that depend on the
        # batch size (chunked layers) repeat exactly (never for training: no privacy)
        pad = {}
        if config == "dpcore-padded":  # static shapes: batches padded to 1.3x the expected size
            pad = dict(max_physical_batch_size=-(-13 * loader.batch_size // 10), pad_batches=True)
        model, opt, loader = dpcore.torch.make_private(
            model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0, seed=SEED,
            memory="lean" if config == "dpcore-lean" else "default", **pad)
        opt.noise_device = "device"
        # counted on the step's own thread (a dispatch mode is thread-local): the noise drawn in the step
        opt._noise.gaussian.ahead = False
    elif config == "opacus-ghost":
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        # as bench_torch.py: DPMultiheadAttention for nn.MultiheadAttention (weights copied)
        model = ModuleValidator.fix(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.01)
        crit_in = crit if isinstance(crit, nn.Module) else _ModuleLoss(crit)
        model, opt, crit, loader = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=crit_in, noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode="ghost")
    else:
        raise ValueError(f"unknown configuration {config!r}")
    model.train()

    def step(batch: Any) -> None:
        x, y = batch
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()

    return step, loader, opt


class _ModuleLoss(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn
        self.reduction = "mean"

    def forward(self, a: Any, b: Any) -> Any:
        return self.fn(a, b)


def count(model_name: str, config: str, warmup: int = 3, steps: int = 5) -> Dict[str, Any]:
    out: Dict[str, Any] = {"model": model_name, "config": config}
    try:
        model, b, make, crit = build(model_name)
        x, y = make(50 * b)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=b, shuffle=True,
                                             drop_last=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step, loader, _ = setup(config, model, loader, crit)
            it = iter(loader)
            for _ in range(warmup):
                step(next(it))
            totals, kernels, syncs, sync_ops = [], [], [], []
            for _ in range(steps):
                batch = next(it)
                with OpCounter() as c:
                    step(batch)
                totals.append(c.total)
                kernels.append(c.kernels)
                syncs.append(c.syncs)
                sync_ops.append(dict(c.sync_ops))
        out.update(ops=statistics.median(totals), ops_all=totals, kernels=statistics.median(kernels), syncs=statistics.median(syncs), syncs_all=syncs,
                   sync_ops=sync_ops[len(sync_ops) // 2], top=c.ops.most_common(12))
    except Exception as e:  # reported in the table
        traceback.print_exc(file=sys.stderr)
        out["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}"
    return out


def count_trainer(mode: str, config: str, warmup: int = 3, steps: int = 5) -> Dict[str, Any]:
    """Operators per optimizer step of the Hugging Face Trainer (``trainer``) and dpcore's
    DPTrainer (``dptrainer``) on bench_trainer.py's tiny GPT-2 (``lora`` or ``full``), counted
    from each step's begin to its end (callbacks: the training step, the clip, noise, release
    and update; the Trainer's own bookkeeping in both)."""
    import shutil
    import tempfile

    import transformers

    import bench_trainer as btr

    out: Dict[str, Any] = {"model": f"trainer-{mode}", "config": config}
    tmp = tempfile.mkdtemp(prefix="bench_step_ops_")
    try:
        model = btr._model(mode)
        counts: List[OpCounter] = []

        class Count(transformers.TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                opt = getattr(kw.get("optimizer"), "optimizer", kw.get("optimizer"))
                if hasattr(opt, "noise_device"):
                    opt.noise_device = "device"
                    opt._noise.gaussian.ahead = False
                c = OpCounter()
                c.__enter__()
                counts.append(c)

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                counts[-1].__exit__(None, None, None)

        targs = transformers.TrainingArguments(
            output_dir=tmp, use_cpu=True, report_to=[], disable_tqdm=True, save_strategy="no", logging_strategy="no",
            per_device_train_batch_size=btr.BATCH, gradient_accumulation_steps=1, max_steps=warmup + steps,
            dataloader_num_workers=0, seed=SEED)
        kw = dict(model=model, args=targs, train_dataset=btr._data(), data_collator=transformers.default_data_collator,
                  callbacks=[Count()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if config == "trainer":
                trainer: Any = transformers.Trainer(**kw)
            else:
                from dpcore.transformers import DPTrainer

                trainer = DPTrainer(**kw, noise_multiplier=1.0, max_grad_norm=1.0, seed=SEED,
                                    ledger=os.path.join(tmp, "ledger.jsonl"))
            trainer.train()
        done = counts[warmup:]
        out.update(ops=statistics.median(c.total for c in done), kernels=statistics.median(c.kernels for c in done),
                   syncs=statistics.median(c.syncs for c in done), sync_ops=dict(done[len(done) // 2].sync_ops),
                   top=done[-1].ops.most_common(12))
    except Exception as e:  # reported in the table
        traceback.print_exc(file=sys.stderr)
        out["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", action="store_true", help="print each configuration's most frequent operators")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = []
    for m in a.models:
        if m.startswith("trainer-"):
            rows = [count_trainer(m.split("-", 1)[1], c) for c in ("trainer", "dptrainer")]
            for r in rows:  # the plain Trainer is this table's anchor
                r["config"] = "non-private" if r["config"] == "trainer" else "dpcore (DPTrainer)"
        else:
            rows = [count(m, c) for c in a.configs]
        res += rows
        base = next((r.get("ops") for r in rows if r["config"] == "non-private"), None)
        kbase = next((r.get("kernels") for r in rows if r["config"] == "non-private"), None)
        print(f"\n### {m}: aten operators and CUDA-synchronising operators per step (median of 5)")
        print(f"| configuration | ops / step | × non-private | target | kernels / step | × non-private | syncs / step | sync operators |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['config']} | {r['error']} | | | | | | |")
                continue
            ratio = f"{r['ops'] / base:.2f}×" if base else "-"
            t = TARGET.get((m, r["config"]))
            mark = "" if t is None else (f"≤ {t}× " + ("met" if base and r["ops"] / base <= t else "missed"))
            so = ", ".join(f"{k} {v}" for k, v in sorted(r["sync_ops"].items())) or "-"
            kr = f"{r['kernels'] / kbase:.2f}×" if kbase else "-"
            print(f"| {r['config']} | {r['ops']:.0f} | {ratio} | {mark} | {r['kernels']:.0f} | {kr} | {r['syncs']:.0f} | {so} |")
            if a.top:
                print("|  | " + ", ".join(f"{k} {v}" for k, v in r["top"]) + " | | | | |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
