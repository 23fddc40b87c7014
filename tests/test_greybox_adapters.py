"""The grey-box neighbour harness on the framework adapters' release paths: torch (flat,
per-layer and joint clipping; the ghost, mixed and fallback rules; micro-batches; bfloat16;
float16 with a GradScaler; matrix-factorization noise; adaptive clipping; empty samples), Keras
and the Hugging Face trainer. Each path runs on D and on every neighbour with identical
randomness; no divergence may be found (dpcore.audit.neighbour_audit). The planted bugs of
the torch path (an unclipped sum, a raise on NaN, a skipped step) must be caught and named."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dpcore.audit import neighbour_audit  # noqa: E402
from dpcore.torch import make_private  # noqa: E402

from greybox_cases import FEW, KINDS, classification, ledger_path  # noqa: E402

torch.set_num_threads(1)
N, B = 48, 16


class Scale(nn.Module):
    """A layer no rule knows: its per-record gradients come from the torch.func fallback."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.w


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def seq_model():
    """Features read as 2 positions of 4: Linear over positions (ghost norms), LayerNorm."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.ln, self.h = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)

        def forward(self, x):
            return self.h(self.ln(torch.tanh(self.l(x.reshape(len(x), 2, 4)))).mean(1))

    return M()


def blocks_model():
    """Two blocks of one shape over 2 positions: their weights' ghost norms and their biases' sums
    are taken as one stack (the engine's stacked path)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.i = nn.Linear(4, 8)
            self.b1, self.b2 = nn.Linear(8, 8), nn.Linear(8, 8)
            self.h = nn.Linear(8, 3)

        def forward(self, x):
            z = torch.tanh(self.i(x.reshape(len(x), 2, 4)))
            return self.h(torch.tanh(self.b2(torch.tanh(self.b1(z)))).mean(1))

    return M()


def conv_model():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv1d(1, 4, 3, stride=2, padding=1)
            self.g = nn.GroupNorm(2, 4)
            self.h = nn.Linear(16, 3)

        def forward(self, x):
            return self.h(torch.relu(self.g(self.c(x[:, None, :]))).flatten(1))

    return M()


def fallback_model():
    return nn.Sequential(Scale(8), nn.Linear(8, 3))


def attention_model():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.att = nn.MultiheadAttention(8, 2, batch_first=True)
            self.h = nn.Linear(8, 3)

        def forward(self, x):
            z = self.inp(x.reshape(len(x), 2, 4))
            return self.h(self.att(z, z, z, need_weights=False)[0].mean(1))

    return M()


def lstm_model():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 6, batch_first=True)
            self.h = nn.Linear(6, 3)

        def forward(self, x):
            return self.h(self.rnn(x.reshape(len(x), 2, 4))[0][:, -1])

    return M()


def torch_train(model_fn, *, amp=None, scaler=False, loop_bug=None, **kw):
    """DP-SGD over the columns (x float32, y int64) with make_private: one epoch of 3 Poisson
    steps, the population size declared (public), the harness's seed."""

    def train(cols, seed):
        x, y = cols
        torch.manual_seed(0)
        model = model_fn()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dl = DataLoader(TensorDataset(torch.tensor(x), torch.tensor(y)), batch_size=B)
        extra = dict(kw)
        gs = None
        if scaler:
            gs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**9)
            extra["grad_scaler"] = gs
        extra.setdefault("noise_multiplier", 1.0)
        extra.setdefault("population_size", N)
        if extra["population_size"] is None:  # read from the dataset
            del extra["population_size"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, dl = make_private(model, opt, dl, max_grad_norm=1.0, ledger=ledger_path(), seed=seed, **extra)
            for xb, yb in dl:
                opt.zero_grad()
                ctx = torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext()
                with ctx:
                    loss = nn.functional.cross_entropy(model(xb), yb)  # a mean: loss_reduction="mean"
                if loop_bug is not None and loop_bug(loss):
                    continue
                if gs is not None:
                    gs.scale(loss).backward()
                    gs.step(opt)
                    gs.update()
                else:
                    loss.backward()
                    opt.step()

    return train


def _check(train, kinds=KINDS, data=None, **kw):
    res = neighbour_audit(train, classification(N) if data is None else data, kinds, **kw)
    res.raise_for_findings()
    for r in res.runs:
        assert r.releases >= 3 and r.ledger_entries >= 6, r
    return res


TORCH_PATHS = {
    "flat": dict(model_fn=mlp),
    "per_layer": dict(model_fn=mlp, clipping="per_layer"),
    "joint": dict(model_fn=mlp, clipping="joint", joint_scales=[1.0, 0.5, 1.0, 0.5]),
    "ghost": dict(model_fn=seq_model),
    "conv": dict(model_fn=conv_model),
    "fallback": dict(model_fn=fallback_model),
    "attention": dict(model_fn=attention_model),
    "lstm": dict(model_fn=lstm_model),
    "micro_batches": dict(model_fn=mlp, max_physical_batch_size=5),
    "bf16": dict(model_fn=mlp, amp=torch.bfloat16),
    "fp16_grad_scaler": dict(model_fn=mlp, amp=torch.float16, scaler=True),
    # the memory-lean mode's two backward passes (norms, then the reweighted sums)
    "lean": dict(model_fn=seq_model, memory="lean"),
    "lean_micro_batches_fp16": dict(model_fn=mlp, max_physical_batch_size=5, amp=torch.float16, scaler=True,
                                    memory="lean"),
    # layers of one shape normed as one stack
    "stacked_blocks": dict(model_fn=blocks_model),
    # static shapes (issue 52): every physical batch padded to 12 rows with copies of record 0
    "padded": dict(model_fn=mlp, max_physical_batch_size=12, pad_batches=True),
    "padded_conv_lean": dict(model_fn=conv_model, max_physical_batch_size=12, pad_batches=True, memory="lean"),
    "padded_attention_split": dict(model_fn=attention_model, max_physical_batch_size=7, pad_batches=True),
}


#: Reduced precision: the records D and D′ share are computed in batches of another size, and
#: their bfloat16/float16 products can round differently (the kernels block by batch shape); the
#: mixed-precision bound of docs/pytorch.md allows 4u per record, u = 2⁻⁸ (bfloat16) or 2⁻¹¹.
RTOL = {"bf16": 4 * 2.0**-8, "fp16_grad_scaler": 4 * 2.0**-11, "lean_micro_batches_fp16": 4 * 2.0**-11}


@pytest.mark.parametrize("path", sorted(TORCH_PATHS))
def test_torch_release_paths_pass_every_neighbour(path):
    kw = dict(TORCH_PATHS[path])
    model_fn = kw.pop("model_fn")
    res = _check(torch_train(model_fn, **kw), rtol=RTOL.get(path, 1e-3))
    # the added, removed or replaced record was sampled in some step: the bound was met there
    assert max(r.max_ratio for r in res.runs if r.neighbour in ("add", "remove", "replace", "duplicate")) > 0.05
    for r in res.runs:
        if r.neighbour in ("nan", "inf", "-inf"):
            # a non-finite record contributes nothing (up to the rounding of the others, above)
            assert r.max_ratio < RTOL.get(path, 1e-6), r


def conv2d_model():
    """Strided Conv2d layers of a downsampling CNN: a first layer of fan-in 9 (the unfolded path)
    and a stride-2 layer of fan-in 72 (ghost norms of its factors, or the folded convolution)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(1, 8, 3, padding=1)
            self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
            self.g = nn.GroupNorm(2, 8)
            self.h = nn.Linear(16, 3)

        def forward(self, x):
            z = torch.relu(self.c1(x.reshape(len(x), 1, 2, 4)))
            return self.h(torch.relu(self.g(self.c2(z))).flatten(1))

    return M()


@pytest.mark.parametrize("ghost,memory", [(True, "default"), (False, "default"), (True, "lean")])
def test_torch_strided_conv_paths_pass_every_neighbour(monkeypatch, ghost, memory):
    """Both per-record paths of a deep strided convolution (forced), in both memory modes."""
    from dpcore.torch._rules._conv import ConvRule

    monkeypatch.setattr(ConvRule, "GHOST_NORMS", ghost)
    res = _check(torch_train(conv2d_model, memory=memory))
    assert max(r.max_ratio for r in res.runs if r.neighbour in ("add", "remove", "replace", "duplicate")) > 0.05
    for r in res.runs:
        if r.neighbour in ("nan", "inf", "-inf"):
            assert r.max_ratio < 1e-6, r


def test_torch_adaptive_clipping_passes():
    from dpcore.queries import QuantileAdaptiveClipQuery

    def query():
        return QuantileAdaptiveClipQuery(1.0, 1.0, 0.5, 0.2, 2.0, B, denominator=B)

    def train(cols, seed):
        x, y = cols
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dl = DataLoader(TensorDataset(torch.tensor(x), torch.tensor(y)), batch_size=B)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, dl = make_private(model, opt, dl, query=query(), ledger=ledger_path(), seed=seed, population_size=N)
            for xb, yb in dl:
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()

    res = _check(train)
    # the clipped count is a release of its own, compared like the sums
    assert all(r.releases == 6 for r in res.runs)


def test_torch_matrix_factorization_noise_passes_on_replace_neighbours():
    # fixed cyclic batches: the number of batches is public (it depends on n), so the
    # neighbours keep n: a record replaced, by an ordinary one or by NaN
    res = _check(torch_train(mlp, noise_mechanism="banded", epochs=1, population_size=None),
                 kinds=("replace", "replace_nan", "replace_inf", "replace_huge", "replace_zero", "replace_duplicate"))
    assert all(r.relation == "replace" for r in res.runs)


def test_torch_empty_samples_release_noise_and_pass():
    # q small: most samples are empty; every step still releases (pure noise), identically
    def train(cols, seed):
        x, y = cols
        torch.manual_seed(0)
        model = conv_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dl = DataLoader(TensorDataset(torch.tensor(x), torch.tensor(y)), batch_size=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, dl = make_private(model, opt, dl, noise_multiplier=1.0, max_grad_norm=1.0,
                                          ledger=ledger_path(), seed=seed, population_size=N)
            for t, (xb, yb) in enumerate(dl):
                if t == 6:
                    break
                opt.zero_grad()
                (nn.functional.cross_entropy(model(xb), yb, reduction="sum")).backward()
                opt.step()

    res = _check(train, kinds=("remove", "add", "nan", "huge", "zero"))
    assert all(r.releases == 6 for r in res.runs)


# -- planted bugs in the torch path ---------------------------------------------------------


def test_torch_planted_unclipped_sum_is_caught(monkeypatch):
    import dpcore.torch._clip as clip_mod

    monkeypatch.setattr(clip_mod, "clip_factors", lambda sq, clip, margin, **kw: torch.ones_like(sq))
    res = neighbour_audit(torch_train(mlp), classification(N), ("add", "huge"))
    assert "sensitivity exceeded" in {f.kind for f in res.findings}
    assert any("torch.SingleProcess" in f.where for f in res.findings)


def test_torch_planted_raise_on_nan_is_caught():
    res = neighbour_audit(torch_train(mlp, on_nonfinite="raise"), classification(N), ("nan", "add"))
    nan, add = res.runs
    assert not nan.passed and add.passed
    assert nan.findings[0].kind == "control flow" and "ValueError" in nan.findings[0].detail


def test_torch_planted_skip_on_overflow_is_caught():
    # a loop that skips the step when the loss is not finite (what a GradScaler skip did)
    res = neighbour_audit(torch_train(mlp, loop_bug=lambda loss: not bool(torch.isfinite(loss))), classification(N), ("nan",))
    assert {f.kind for f in res.findings} & {"control flow", "branch"}


def test_torch_population_read_from_the_dataset_is_found():
    res = neighbour_audit(torch_train(mlp, population_size=None), classification(N), ("add",))
    kinds = {f.kind for f in res.findings}
    assert "ledger" in kinds  # q = batch_size/len(dataset): q and n read from the data


# -- Keras (its own process) ----------------------------------------------------------------


def test_keras_greybox_in_subprocess():
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow not installed")
    cases = os.path.join(os.path.dirname(__file__), "tf_greybox_cases.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsx", "-p", "no:cacheprovider", cases],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert "3 passed" in summary and not any(w in summary for w in ("skipped", "xfail", "error")), summary


# -- the Hugging Face trainer ---------------------------------------------------------------


def test_hf_trainer_release_path_passes(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dpcore.audit import Neighbour, neighbours
    from dpcore.transformers import DPTrainer

    V, T, n = 32, 8, 24
    g = np.random.default_rng(0)
    lengths = g.integers(2, T + 1, n)
    ids = g.integers(2, V, (n, T))
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, ids, 1)

    def empty(cols):  # a record of padding only: no token, an empty (zero) gradient
        i, m = cols
        return (np.concatenate([i, np.ones((1, T), i.dtype)]), np.concatenate([m, np.zeros((1, T), m.dtype)]))

    def longest(cols):  # a record of T tokens, all the same
        i, m = cols
        return (np.concatenate([i, np.full((1, T), 3, i.dtype)]), np.concatenate([m, np.ones((1, T), m.dtype)]))

    def train(cols, seed):
        i, m = cols
        data = [{"input_ids": torch.tensor(a), "attention_mask": torch.tensor(b),
                 "labels": torch.tensor(np.where(b == 1, a, -100))} for a, b in zip(i, m)]
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=1)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, dataloader_num_workers=0,
            per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, logging_steps=1,
            save_strategy="no", learning_rate=1e-2, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            DPTrainer(model=model, args=args, train_dataset=data, data_collator=transformers.default_data_collator,
                      noise_multiplier=1.0, max_grad_norm=1.0, ledger=ledger_path(), seed=seed,
                      population_size=n).train()

    kinds = neighbours(["remove", "replace", "duplicate"]) + [
        Neighbour("empty", "add_or_remove", empty), Neighbour("longest", "add_or_remove", longest)]
    res = _check(train, kinds=kinds, data=(ids, mask))
    assert max(r.max_ratio for r in res.runs) > 0.05


def test_torch_planted_unmasked_padding_is_caught(monkeypatch):
    # padded rows are copies of record 0: counted as records, they would add it several times
    from dpcore.torch._engine import PerRecordGradients

    inner = torch_train(mlp, max_physical_batch_size=12, pad_batches=True)

    def train(cols, seed):  # the records reversed: the neighbours' changed (last) record is the padding's
        return inner(tuple(np.ascontiguousarray(c[::-1]) for c in cols), seed)

    assert neighbour_audit(train, classification(N), ("replace_huge", "replace")).passed
    monkeypatch.setattr(PerRecordGradients, "with_padding", lambda self, bad: bad)
    res = neighbour_audit(train, classification(N), ("replace_huge",))
    assert "sensitivity exceeded" in {f.kind for f in res.findings}, res.findings


def test_torch_planted_understated_stacked_norms_are_caught(monkeypatch):
    # the stacked norms of layers of one shape, understated: records clipped to more than C
    from dpcore.torch import _engine
    from dpcore.torch._contrib import Tail

    real = _engine.ghost_sq_many
    monkeypatch.setattr(_engine, "ghost_sq_many",
                        lambda cs: [Tail(t.form, t.w * 1e-4, t.s * 1e-2, t.k, t.cap) for t in real(cs)])
    res = neighbour_audit(torch_train(blocks_model), classification(N), ("huge", "add"))
    assert "sensitivity exceeded" in {f.kind for f in res.findings}
