"""dpcore.transformers: DP-SGD through the Hugging Face Trainer (and TRL's SFTTrainer).

Tiny GPT-2 models built from a config and data made here (no download). Each test trains a few
steps on CPU; the file runs in well under a minute."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

import dpcore  # noqa: E402
from dpcore.queries.base import derive_seed  # noqa: E402
from dpcore.transformers import (  # noqa: E402
    DPTrainer,
    DPTrainerMixin,
    causal_lm_per_record_loss,
    make_private_trainer,
)
from dpcore.transformers import _data as dp_data  # noqa: E402

torch.set_num_threads(1)

# Seeded runs (seed=, tests only) are expected to say so.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*drawn from a test seed:dpcore.ledger.LedgerWarning"),
    pytest.mark.filterwarnings("ignore:DP trainer seed=:UserWarning"),
]

V, T, N = 48, 12, 64  # vocabulary, sequence length, records


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, cfg)


def records(n=N):
    """Sequences of 4 to 12 tokens, right-padded to 12: the records' token counts differ."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, T + 1, (1,), generator=g))
        ids = torch.randint(2, V, (T,), generator=g)
        mask = (torch.arange(T) < length).long()
        ids = ids.masked_fill(mask == 0, 1)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


DATA = records()


def targs(out, **kw):
    base = dict(output_dir=str(out), use_cpu=True, report_to=[], disable_tqdm=True, dataloader_num_workers=0,
                per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, logging_steps=1,
                save_strategy="no", learning_rate=1e-2, seed=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def dp_trainer(out, model=None, dp=None, **kw):
    dp = dict(dict(noise_multiplier=1.0, max_grad_norm=1.0), **(dp or {}))
    return DPTrainer(model=model if model is not None else lora(gpt2()), args=targs(out, **kw), train_dataset=DATA,
                     data_collator=transformers.default_data_collator, **dp)


def one_release_per_sample(ledger, n=N, q=None):
    for s in ledger.samples:
        assert s.population_size == n and s.policy == "poisson" and len(s.queries) == 1
        if q is not None:
            assert s.sampling_probability == pytest.approx(q)


def snapshot(model):
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_lora_twenty_steps_logs_epsilon_and_checkpoints_the_ledger(tmp_path):
    model = lora(gpt2())
    before = snapshot(model)
    tr = dp_trainer(tmp_path, model, max_steps=20, logging_steps=5, save_strategy="steps", save_steps=10)
    assert tr.args.max_grad_norm == 0 and tr.sampling_probability == pytest.approx(8 / N)
    tr.train()
    opt = tr.dp_optimizer
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in opt.engine.params} == trainable  # nothing the optimizer trains escapes capture
    for k, p in model.named_parameters():
        changed = not torch.equal(p, before[k])
        assert changed == p.requires_grad, k
        assert p.requires_grad == ("lora_" in k), k
    logs = [h for h in tr.state.log_history if "loss" in h]
    eps = [h["epsilon"] for h in logs]
    assert [h["step"] for h in logs] == [5, 10, 15, 20]
    assert all(b > a > 0 for a, b in zip(eps, eps[1:]))
    assert tr.state.log_history[-1]["epsilon"] == eps[-1] == tr.get_epsilon()
    led = tr.ledger
    assert led.path == str(tmp_path / "privacy_ledger.jsonl")
    assert led.num_releases == 20 and len(led.samples) == 20
    one_release_per_sample(led, q=8 / N)
    for step in (10, 20):
        ck = tmp_path / f"checkpoint-{step}"
        copy = dpcore.PrivacyLedger.load(ck / "privacy_ledger.jsonl")
        assert copy.num_releases == step
        state = json.loads((ck / "dp_state.json").read_text())
        assert state["releases"] == step and state["noise_multiplier"] == 1.0
        assert state["sampling_probability"] == pytest.approx(8 / N)
        assert state["epsilon"] == pytest.approx(copy.get_epsilon(tr.delta))
    assert (tmp_path / "checkpoint-20" / "privacy_ledger.jsonl").read_bytes() == open(led.path, "rb").read()
    assert state["ledger_path"] == os.path.abspath(led.path)


@pytest.mark.parametrize("order", ["to_then_peft", "peft_then_to"])
def test_lora_trains_adapters_whatever_the_to_order(tmp_path, order):
    # Opacus #820: LoRA weights silently corrupted when the model is moved around get_peft_model.
    model = gpt2()
    if order == "to_then_peft":
        model = lora(model.to("cpu").to(torch.float32))
    else:
        model = lora(model).to("cpu").to(torch.float32)
    before = snapshot(model)
    tr = dp_trainer(tmp_path, model)
    tr.train()
    assert tr.ledger.num_releases == 3
    for k, p in model.named_parameters():
        assert torch.isfinite(p).all(), k
        assert (not torch.equal(p, before[k])) == ("lora_" in k), k
    assert {id(p) for p in tr.dp_optimizer.engine.params} == {id(p) for p in model.parameters() if p.requires_grad}


def test_released_update_is_the_mean_of_each_records_own_loss_gradient(tmp_path):
    """Full fine-tuning, noise 0, no clipping, one SGD step: the update is −lr·Σ_i ∇ℓ_i / (q·n),
    ℓ_i the mean over record i's own target tokens (not over the batch's tokens)."""
    model = gpt2()
    ref = gpt2()
    tr = dp_trainer(tmp_path, model, dp=dict(noise_multiplier=0.0, max_grad_norm=1e6, seed=5), max_steps=1,
                    optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0)
    tr.train()
    idx = dpcore.poisson_sample(N, 8 / N, seed=derive_seed(5, 0))
    assert len(idx) > 0
    batch = transformers.default_data_collator([DATA[i] for i in idx])
    causal_lm_per_record_loss(ref, batch).sum().backward()
    for (k, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        expect = r.detach() - r.grad / 8.0
        assert torch.allclose(p, expect, atol=2e-6, rtol=1e-4), k


@pytest.mark.parametrize("z", [0.0, 1.0])
def test_accumulation_split_gives_the_same_release(tmp_path, z):
    """GA=1 × batch 8 and GA=4 × batch 2: same q, same samples (seeded), one sample and one release
    per optimizer step, the same ledger tuples, the same ε and the same update."""
    runs = []
    for bs, ga in ((8, 1), (2, 4)):
        model = lora(gpt2())
        tr = dp_trainer(tmp_path / f"{bs}x{ga}", model, dp=dict(noise_multiplier=z, seed=11), max_steps=3,
                        per_device_train_batch_size=bs, gradient_accumulation_steps=ga, optim="sgd", learning_rate=0.5)
        tr.train()
        led = tr.ledger
        assert led.num_releases == 3 and len(led.samples) == 3
        one_release_per_sample(led, q=8 / N)
        runs.append((tr, model, [(s.population_size, s.sampling_probability, s.policy, s.queries) for s in led.samples]))
    (a, ma, ta), (b, mb, tb) = runs
    assert ta == tb
    if z > 0:
        assert a.get_epsilon() == b.get_epsilon()
    for (k, p), (_, r) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.allclose(p, r, atol=1e-6, rtol=1e-5), k


def test_a_loader_fetching_ahead_does_not_shift_the_ledger(tmp_path, monkeypatch):
    """accelerate's DataLoaderShard fetches one batch ahead. The sample is recorded when its first
    micro-batch is trained on, not when it is drawn, so a release never lands on the next sample."""
    draws = []
    real = dp_data.poisson_sample
    monkeypatch.setattr(dp_data, "poisson_sample", lambda *a, **k: draws.append(1) or real(*a, **k))

    class Ahead:
        def __init__(self, inner):
            self.inner, self.dataset = inner, inner.dataset

        def __len__(self):
            return len(self.inner)

        def __iter__(self):
            it = iter(self.inner)
            nxt = next(it, None)
            while nxt is not None:
                cur, nxt = nxt, next(it, None)  # the next batch (and maybe sample) before this one trains
                yield cur

    class AheadTrainer(DPTrainer):
        def get_train_dataloader(self):
            return Ahead(super().get_train_dataloader())

    tr = AheadTrainer(model=lora(gpt2()), args=targs(tmp_path, max_steps=4), train_dataset=DATA,
                      data_collator=transformers.default_data_collator, noise_multiplier=1.0, max_grad_norm=1.0)
    tr.train()
    assert len(draws) == 5  # one drawn ahead
    assert tr.ledger.num_releases == len(tr.ledger.samples) == 4
    one_release_per_sample(tr.ledger, q=8 / N)


def test_empty_poisson_batches_are_released(tmp_path, monkeypatch):
    sizes = []
    real = dp_data.poisson_sample

    def spy(*a, **k):
        idx = real(*a, **k)
        sizes.append(len(idx))
        return idx

    monkeypatch.setattr(dp_data, "poisson_sample", spy)
    tr = dp_trainer(tmp_path, gpt2(), per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=8,
                    dp=dict(seed=2))  # full fine-tuning: the embeddings train too
    tr.train()
    # Empty samples (pure noise), a 1-record sample (one empty micro-batch), and 3 records split
    # 2 + 1 (a one-record micro-batch after a larger one: GPT-2's shared position ids must not
    # be expanded to the earlier micro-batch's size).
    assert len(sizes) == 8 and {0, 1, 3} <= set(sizes)
    assert tr.ledger.num_releases == 8
    one_release_per_sample(tr.ledger, q=2 / N)


def test_resume_continues_the_ledger_without_drawing_the_skipped_steps(tmp_path, monkeypatch):
    class StopAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 6:
                control.should_training_stop = True

    def make(callbacks=(), **dp):
        model = gpt2()
        tr = DPTrainer(model=model, args=targs(tmp_path, max_steps=12, save_strategy="steps", save_steps=3,
                                                optim="sgd", learning_rate=0.5),
                       train_dataset=DATA, data_collator=transformers.default_data_collator, callbacks=list(callbacks),
                       noise_multiplier=1.0, max_grad_norm=1.0, seed=4, **dp)
        return tr, model

    def run(resume, callbacks=()):
        tr, model = make(callbacks)
        tr.train(resume_from_checkpoint=resume)
        return tr, model

    first, _ = run(None, [StopAt()])
    assert first.state.global_step == 6 and first.ledger.num_releases == 6
    first.ledger.close()  # the next trainer opens the same ledger file (one writer at a time)

    # checkpoint-3 saw 3 releases; the ledger holds 6: refused unless ledger_ahead="keep"
    early, _ = make()
    with pytest.raises(dpcore.ledger.LedgerError, match="3 release.*more than the checkpoint") as err:
        early.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    # the hint names the keyword of the API the user called, not the optimizer's
    assert 'DPTrainer(..., ledger_ahead="keep")' in str(err.value)
    assert "load_state_dict" not in str(err.value) and "optimizer.ledger_ahead" not in str(err.value)
    early.ledger.close()
    assert dpcore.PrivacyLedger.load(tmp_path / "privacy_ledger.jsonl").num_releases == 6

    draws = []
    real = dp_data.poisson_sample
    monkeypatch.setattr(dp_data, "poisson_sample", lambda *a, **k: draws.append(1) or real(*a, **k))
    resumed, m_resumed = run(str(tmp_path / "checkpoint-6"))
    assert resumed.state.global_step == 12
    assert len(draws) == 6  # the 6 steps skipped on resume drew (and recorded) no sample
    led = resumed.ledger
    assert led.path == str(tmp_path / "privacy_ledger.jsonl")
    assert led.num_releases == 12 and len(led.samples) == 12
    one_release_per_sample(led)
    assert json.loads((tmp_path / "checkpoint-12" / "dp_state.json").read_text())["releases"] == 12
    resumed.ledger.close()

    # ledger_ahead="keep": resuming from checkpoint-3 keeps the 9 later releases counted
    again, _ = make(ledger_ahead="keep")
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert again.ledger.num_releases == 12 + 9
    again.ledger.close()

    # The sampler and the noise resumed where they stopped: the same parameters as a run never
    # interrupted (same seeded samples, same seeded noise).
    monkeypatch.setattr(dp_data, "poisson_sample", real)
    whole_dir = tmp_path / "whole"
    model = gpt2()
    whole = DPTrainer(model=model, args=targs(whole_dir, max_steps=12, optim="sgd", learning_rate=0.5),
                      train_dataset=DATA, data_collator=transformers.default_data_collator,
                      noise_multiplier=1.0, max_grad_norm=1.0, seed=4)
    whole.train()
    for (k, p), (_, r) in zip(model.named_parameters(), m_resumed.named_parameters()):
        assert torch.allclose(p, r, atol=1e-6), k


def test_resumed_run_logs_the_epoch_of_a_run_never_interrupted(tmp_path):
    """The logged epoch is global_step / steps per epoch after a resume too (the resumed loader
    starts mid-epoch: the Trainer's own count would restart at 0)."""
    class StopAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                control.should_training_stop = True

    def trainer(out, callbacks=()):
        return DPTrainer(model=gpt2(), args=targs(out, max_steps=20, save_strategy="steps", save_steps=5),
                         train_dataset=DATA, data_collator=transformers.default_data_collator,
                         callbacks=list(callbacks), noise_multiplier=1.0, max_grad_norm=1.0, seed=4)

    def epochs(tr):
        return {h["step"]: h["epoch"] for h in tr.state.log_history if "loss" in h}

    first = trainer(tmp_path / "r", [StopAt()])
    first.train()
    first.ledger.close()
    resumed = trainer(tmp_path / "r")
    resumed.train(resume_from_checkpoint=str(tmp_path / "r" / "checkpoint-5"))
    resumed.ledger.close()
    whole = trainer(tmp_path / "w")
    whole.train()
    whole.ledger.close()
    spe = resumed._dp().steps_per_epoch
    assert spe == 8  # q = 4 · 2 / 64
    got, want = epochs(resumed), epochs(whole)  # the resumed history holds the first run's steps too
    assert sorted(got) == list(range(1, 21)) and sorted(want) == list(range(1, 21))
    for step, ep in got.items():
        assert ep == pytest.approx(step / spe) and ep == pytest.approx(want[step]), step
    assert resumed.state.epoch == pytest.approx(20 / spe)


def test_make_private_trainer_ledger_ahead_hint_names_its_keyword(tmp_path):
    plain = transformers.Trainer(model=gpt2(), args=targs(tmp_path, max_steps=1), train_dataset=DATA,
                                 data_collator=transformers.default_data_collator)
    tr = make_private_trainer(plain, noise_multiplier=1.0, max_grad_norm=1.0)
    opt = tr.create_optimizer()
    assert 'make_private_trainer(trainer, ..., ledger_ahead="keep")' in opt.ledger_ahead_hint
    tr.ledger.close()
    direct = dp_trainer(tmp_path / "d", max_steps=1)
    assert 'DPTrainer(..., ledger_ahead="keep")' in direct.create_optimizer().ledger_ahead_hint
    direct.ledger.close()


def test_resume_refuses_a_ledger_behind_the_checkpoint(tmp_path):
    tr = dp_trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    tr.train()
    tr.ledger.close()
    fresh = dp_trainer(tmp_path / "elsewhere", max_steps=4)
    with pytest.raises(ValueError, match="holds 0 release.*saved after 2.*copy"):
        fresh.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert fresh.ledger.num_releases == 0


def test_target_epsilon_calibrates_the_noise(tmp_path):
    tr = dp_trainer(tmp_path, dp=dict(noise_multiplier=None, target_epsilon=2.0, target_delta=1e-5), max_steps=-1,
                    num_train_epochs=2, logging_steps=4)
    steps = 2 * round(N / 8)
    assert tr.noise_multiplier == dpcore.accounting.calibrate_noise_multiplier(2.0, 1e-5, 8 / N, steps)
    assert tr.delta == 1e-5
    tr.train()
    assert tr.state.global_step == tr.ledger.num_releases == steps
    eps = tr.state.log_history[-1]["epsilon"]
    assert 1.5 < eps <= 2.0 and eps == tr.get_epsilon(1e-5)


def test_make_private_trainer_on_a_plain_trainer(tmp_path):
    model = lora(gpt2())
    before = snapshot(model)
    plain = transformers.Trainer(model=model, args=targs(tmp_path), train_dataset=DATA,
                                 data_collator=transformers.default_data_collator)
    tr = make_private_trainer(plain, noise_multiplier=1.0, max_grad_norm=0.5, ledger=tmp_path / "run.jsonl")
    assert tr is plain and isinstance(tr, DPTrainerMixin) and isinstance(tr, transformers.Trainer)
    assert type(tr).__name__ == "DPTrainer" and tr.max_grad_norm == 0.5
    with pytest.raises(ValueError, match="already private"):
        make_private_trainer(tr, noise_multiplier=1.0, max_grad_norm=1.0)
    tr.train()
    assert tr.ledger.num_releases == 3 and tr.ledger.path == str(tmp_path / "run.jsonl")
    assert "epsilon" in tr.state.log_history[-1]
    assert any(not torch.equal(p, before[k]) for k, p in model.named_parameters() if "lora_" in k)


def test_poisson_sampling_is_a_deprecated_alias_checked_once(tmp_path):
    # the old keyword still works, warns once (the arguments are checked in one place), means the sampler
    for build in ("DPTrainer", "make_private_trainer"):
        with pytest.warns(DeprecationWarning, match="poisson_sampling= is deprecated") as caught:
            if build == "DPTrainer":
                tr = dp_trainer(tmp_path / build, dp=dict(poisson_sampling=False))
            else:
                plain = transformers.Trainer(model=lora(gpt2()), args=targs(tmp_path / build), train_dataset=DATA,
                                             data_collator=transformers.default_data_collator)
                tr = make_private_trainer(plain, noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
        assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 1
        assert tr._dp_run.sampler == "shuffle" and tr._dp_run.policy == "shuffle"
        tr.ledger.close()
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="give sampler= alone"):
        dp_trainer(tmp_path / "both", dp=dict(poisson_sampling=True, sampler="shuffle"))


def test_samplers_and_noise_the_trainer_cannot_draw_are_refused_with_why(tmp_path):
    for kind in ("truncated_poisson", "balls_in_bins", "random_allocation"):
        with pytest.raises(ValueError, match=rf"Trainer's own dataloader.*make_private\(.*sampler='{kind}'"):
            dp_trainer(tmp_path, dp=dict(sampler=kind))
    with pytest.raises(ValueError, match="sampler must be one of"):
        dp_trainer(tmp_path, dp=dict(sampler="bogus"))
    for mech in ("banded", "blt"):
        with pytest.raises(ValueError, match=rf"cyclic data order.*noise_mechanism='{mech}'"):
            dp_trainer(tmp_path, dp=dict(noise_mechanism=mech))
    with pytest.raises(ValueError, match="calibrates for noise_mechanism='gaussian' only"):
        dp_trainer(tmp_path, dp=dict(noise_multiplier=None, target_epsilon=2.0, target_delta=1e-5,
                                     noise_mechanism="discrete_gaussian"))
    assert not os.path.exists(tmp_path / "privacy_ledger.jsonl")


def test_joint_clipping_and_the_discrete_gaussian(tmp_path):
    # clipping="joint": the DPOptimizer's JointClipQuery over the trainable tensors (the LoRA
    # adapters here), its event (S, z·S) in the ledger
    model = lora(gpt2())
    m = sum(1 for p in model.parameters() if p.requires_grad)
    tr = dp_trainer(tmp_path / "joint", model, dp=dict(clipping="joint", joint_scales=[1.0, 2.0] * (m // 2),
                                                        max_grad_norm=0.5, noise_multiplier=1.2))
    tr.train()
    assert isinstance(tr.dp_optimizer.query, dpcore.queries.JointClipQuery)
    assert tr.ledger.num_releases == 3
    assert [(e.l2_norm_clip, e.stddev) for e in tr.ledger.samples[0].queries] == [(0.5, pytest.approx(0.6))]
    # noise_mechanism="discrete_gaussian": recorded as such (a rounded sum's sensitivity ≥ C)
    tr = dp_trainer(tmp_path / "dg", dp=dict(noise_mechanism="discrete_gaussian", accountant="rdp"))
    tr.train()
    ev = tr.ledger.samples[0].queries[0]
    assert tr.ledger.num_releases == 3 and ev.mechanism == "discrete_gaussian" and ev.l2_norm_clip >= 1.0


def _word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 1, "<s>": 0, **{f"w{i}": i for i in range(2, V)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<s>",
                                                bos_token="<s>", unk_token="<pad>")


def test_make_private_trainer_on_trl_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    g = np.random.default_rng(0)
    text = [" ".join(f"w{t}" for t in g.integers(2, V, size=g.integers(3, 11))) for _ in range(N)]
    ds = datasets.Dataset.from_dict({"text": text})
    model = lora(gpt2())
    before = snapshot(model)
    with warnings.catch_warnings():  # TRL's own deprecation notices
        warnings.simplefilter("ignore")
        cfg = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, max_steps=3,
                            per_device_train_batch_size=4, gradient_accumulation_steps=2, logging_steps=1,
                            save_strategy="no", max_length=T, learning_rate=1e-2, dataloader_num_workers=0)
        sft = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=_word_tokenizer())
    tr = make_private_trainer(sft, noise_multiplier=1.0, max_grad_norm=1.0)
    assert isinstance(tr, trl.SFTTrainer) and type(tr).__name__ == "DPSFTTrainer"
    tr.train()
    assert tr.ledger.num_releases == 3 and len(tr.ledger.samples) == 3
    one_release_per_sample(tr.ledger, q=8 / N)
    assert "epsilon" in tr.state.log_history[-1]
    for k, p in model.named_parameters():
        assert (not torch.equal(p, before[k])) == ("lora_" in k), k

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = trl.SFTConfig(output_dir=str(tmp_path / "p"), use_cpu=True, report_to=[], packing=True, max_length=T)
        sft = trl.SFTTrainer(model=gpt2(), args=packed, train_dataset=ds, processing_class=_word_tokenizer())
    with pytest.raises(ValueError, match="packing"):
        make_private_trainer(sft, noise_multiplier=1.0, max_grad_norm=1.0)


def test_bf16_autocast_on_cpu(tmp_path):
    from dpcore.torch._amp import amp_dtype

    model = lora(gpt2())
    before = snapshot(model)
    seen = []
    model.get_base_model().transformer.h[0].attn.c_attn.register_forward_pre_hook(
        lambda m, a: seen.append(amp_dtype("cpu")))
    tr = dp_trainer(tmp_path, model, bf16=True)
    tr.train()
    assert seen and set(seen) == {torch.bfloat16}  # the forward passes ran under bf16 autocast
    assert tr.ledger.num_releases == 3
    for k, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.isfinite(p).all()
        assert (not torch.equal(p, before[k])) == ("lora_" in k), k


def test_shuffled_batches_are_recorded_as_shuffle(tmp_path):
    tr = dp_trainer(tmp_path, dp=dict(sampler="shuffle"))
    with pytest.warns(dpcore.ledger.LedgerWarning, match="shuffled or fixed-order loader") as caught:
        tr.train()
    assert len([w for w in caught if "shuffle" in str(w.message)]) == 1  # once, not at every log
    led = tr.ledger
    assert led.num_releases == 3 and [s.policy for s in led.samples] == ["shuffle"] * 3
    assert all(s.sample_size == tr.args.per_device_train_batch_size * tr.args.gradient_accumulation_steps
               for s in led.samples)
    # each batch with its epoch (8 batches of 8 of the 64 records): the three steps are one epoch
    assert [s.round for s in led.samples] == [0, 0, 0] and [s.step_in_round for s in led.samples] == [0, 1, 2]
    assert all(s.round_steps == 8 for s in led.samples)
    # no amplification: one Gaussian query for the epoch under the run's relation (zero-out: the
    # number of records public), each record being in one batch of it
    assert led.neighboring == "zero_out"
    want = dpcore.accounting.epsilon(sampling_probability=1.0, noise_multiplier=1.0, steps=1, delta=tr.delta)
    with pytest.warns(dpcore.ledger.LedgerWarning, match="shuffled or fixed-order loader"):
        assert tr.get_epsilon() == pytest.approx(want, rel=1e-3)


def test_shuffled_calibration_counts_epochs(tmp_path):
    # 10 steps of 8-batch epochs: 2 epochs begun, each one Gaussian query (zero-out): σ is
    # calibrated for that, and the ledger's ε meets the target without wasting it
    tr = dp_trainer(tmp_path, dp=dict(sampler="shuffle", noise_multiplier=None, target_epsilon=3.0,
                                      target_delta=1e-5), max_steps=10)
    with pytest.warns(dpcore.ledger.LedgerWarning):
        tr.train()
        eps = tr.get_epsilon()
    assert {s.round for s in tr.ledger.samples} == {0, 1}
    assert 2.99 < eps <= 3.0


def test_bad_arguments(tmp_path):
    def make(**dp):
        return DPTrainer(model=gpt2(), args=targs(tmp_path), train_dataset=DATA,
                         data_collator=transformers.default_data_collator, **dp)

    with pytest.raises(ValueError, match="not both"):
        make(noise_multiplier=1.0, target_epsilon=1.0, target_delta=1e-5, max_grad_norm=1.0)
    with pytest.raises(TypeError, match="noise_multiplier=, or target_epsilon="):
        make(max_grad_norm=1.0)
    with pytest.raises(TypeError, match="target_delta"):
        make(target_epsilon=1.0, max_grad_norm=1.0)
    with pytest.raises(TypeError, match="max_grad_norm"):
        make(noise_multiplier=1.0)
    for c in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_grad_norm"):
            make(noise_multiplier=1.0, max_grad_norm=c)
    with pytest.raises(ValueError, match="noise_multiplier"):
        make(noise_multiplier=-1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="clipping"):
        make(noise_multiplier=1.0, max_grad_norm=1.0, clipping="per_record")
    with pytest.raises(ValueError, match="needs joint_scales"):
        make(noise_multiplier=1.0, max_grad_norm=1.0, clipping="joint")
    with pytest.raises(ValueError, match=r"one scale per trainable parameter tensor \(\d+\), got 2"):
        make(noise_multiplier=1.0, max_grad_norm=1.0, clipping="joint", joint_scales=[1.0, 2.0])
    with pytest.raises(ValueError, match="exceeds the 64 records"):
        DPTrainer(model=gpt2(), args=targs(tmp_path, per_device_train_batch_size=40), train_dataset=DATA,
                  noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="per_record_loss"):
        DPTrainer(model=torch.nn.Linear(2, 2), args=targs(tmp_path), train_dataset=DATA,
                  noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(NotImplementedError, match="auto_find_batch_size"):
        DPTrainer(model=gpt2(), args=targs(tmp_path, auto_find_batch_size=True), train_dataset=DATA,
                  noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="on_nonfinite"):
        make(noise_multiplier=1.0, max_grad_norm=1.0, on_nonfinite="skip")
    assert not os.path.exists(tmp_path / "privacy_ledger.jsonl")  # nothing opened on bad arguments

    tr = make(noise_multiplier=1.0, max_grad_norm=1.0, per_record_loss=lambda m, x: causal_lm_per_record_loss(m, x).mean())
    with pytest.raises(ValueError, match=r"one loss per record.*got \(\)"):
        tr.train()
    assert tr.ledger.num_releases == 0
    tr.ledger.close()

    calls = []

    def fails_second(m, x):  # the logical batch's second micro-batch fails
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return causal_lm_per_record_loss(m, x)

    tr = make(noise_multiplier=1.0, max_grad_norm=1.0, per_record_loss=fails_second, seed=0)
    with pytest.raises(RuntimeError, match="boom"):
        tr.train()
    assert tr.ledger.num_releases == 0 and len(calls) == 2
    assert all(a is None for a in tr.dp_optimizer._batch.acc)  # the first micro-batch's records were dropped


def test_fp16_grad_scaler_overflow_never_skips(tmp_path):
    """fp16 with accelerate's GradScaler (a CUDA feature; here a CPU GradScaler put where
    accelerate keeps it): the loss is scaled and the clip sees unscaled gradients. A scale so
    large that records overflow (2¹⁸: float16 overflows at 65504) skips nothing and never backs
    off: such records contribute zero, every step releases, and accelerate sees no skipped step
    (the skip and the backoff would depend on the data). On CPU accelerate runs fp16=True without
    autocast, so the loss here runs the forward under float16 autocast itself, as CUDA's fp16 would."""
    from dpcore.torch import GradScalerGrowthWarning, OverflowSkipWarning

    def fp16_loss(m, inputs):
        with torch.autocast("cpu", dtype=torch.float16):
            return causal_lm_per_record_loss(m, inputs)

    model = lora(gpt2())
    before = snapshot(model)
    tr = dp_trainer(tmp_path, model, dp=dict(per_record_loss=fp16_loss), fp16=True, max_steps=12)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18)  # accelerate's default growth (×2 every 2000)
    tr.accelerator.scaler = scaler
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.train()
    assert not [w for w in caught if w.category is OverflowSkipWarning]
    assert [w for w in caught if w.category is GradScalerGrowthWarning]  # growth advised against
    dp = tr.dp_optimizer
    assert dp.grad_scaler is scaler
    assert dp.skipped_steps == 0
    assert scaler.get_scale() == 2.0**18  # no backoff
    assert tr.state.global_step == 12
    assert tr.ledger.num_releases == len(tr.ledger.samples) == 12
    one_release_per_sample(tr.ledger)
    assert any(not torch.equal(p, before[k]) for k, p in model.named_parameters() if "lora_" in k)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("on_nonfinite", ["zero", "raise"])
def test_non_finite_record(tmp_path, on_nonfinite):
    """A record whose loss is NaN: by default it contributes zero and every step releases;
    on_nonfinite="raise" names it and releases nothing."""

    def nan_first(m, inputs):
        losses = causal_lm_per_record_loss(m, inputs)
        poison = torch.ones_like(losses)
        poison[0] = float("nan")
        return losses * poison

    model = lora(gpt2())
    dp = dict(per_record_loss=nan_first)
    if on_nonfinite == "raise":
        dp["on_nonfinite"] = "raise"
    tr = dp_trainer(tmp_path, model, dp=dp, max_steps=3, logging_steps=10)
    if on_nonfinite == "raise":
        with pytest.raises(ValueError, match="record 0 of the batch has a non-finite"):
            tr.train()
        assert tr.ledger.num_releases == 0
    else:
        tr.train()
        assert tr.ledger.num_releases == len(tr.ledger.samples) == 3
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lean_memory_trains_as_the_default_mode(tmp_path):
    """memory="lean" on the trainer (two backward passes per micro-batch, with gradient accumulation):
    the same releases as the default mode at the same seed, noise included."""
    out = []
    for memory in ("default", "lean"):
        model = lora(gpt2())
        tr = dp_trainer(tmp_path / memory, model, dp=dict(noise_multiplier=0.5, seed=11, memory=memory), max_steps=2,
                        per_device_train_batch_size=2, gradient_accumulation_steps=4, optim="sgd", learning_rate=0.5)
        tr.train()
        assert tr.ledger.num_releases == 2
        from dpcore.transformers._trainer import _find_dp

        assert _find_dp(tr.optimizer).memory == memory
        out.append(snapshot(model))
    for k in out[0]:
        assert torch.allclose(out[0][k], out[1][k], atol=1e-6, rtol=1e-5), k


@pytest.mark.parametrize("full", [False, True])
def test_padded_micro_batches_train_as_unpadded(tmp_path, full):
    """pad_batches (issue 52): every micro-batch has the same rows (the real ones first, then
    masked copies of the first); at noise 0 with the same samples the model, the ledger and the
    logged losses are the unpadded run's."""
    shapes = []

    class Spy(DPTrainer):
        def training_step(self, model, inputs, *a, **k):
            shapes.append(tuple(inputs["input_ids"].shape))
            return super().training_step(model, inputs, *a, **k)

    runs = []
    for pad in (False, True):
        shapes.clear()
        model = gpt2() if full else lora(gpt2())
        tr = Spy(model=model, args=targs(tmp_path / str(pad), max_steps=6, per_device_train_batch_size=2,
                                         gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5),
                 train_dataset=DATA, data_collator=transformers.default_data_collator, noise_multiplier=0.0,
                 max_grad_norm=1.0, seed=3, pad_batches=pad)
        out = tr.train()
        runs.append((model, [(s.population_size, s.sampling_probability, s.queries) for s in tr.ledger.samples],
                     out.training_loss, list(shapes)))
    (ma, la, lossa, sa), (mb, lb, lossb, sb) = runs
    assert len({s[0] for s in sa}) > 1 and len({s[0] for s in sb}) == 1  # one shape when padded
    assert sb[0][0] == tr._dp_run.pad_rows >= 2
    assert la == lb and lossa == pytest.approx(lossb, rel=1e-5)
    for (k, p), (_, r) in zip(ma.named_parameters(), mb.named_parameters()):
        assert torch.allclose(p, r, atol=1e-6, rtol=1e-5), k


def test_pad_batches_is_checked(tmp_path):
    with pytest.raises(ValueError, match="pad_batches must be"):
        dp_trainer(tmp_path, dp=dict(pad_batches=0))
    with pytest.raises(ValueError, match="privacy_unit='user'"):
        dp_trainer(tmp_path, dp=dict(pad_batches=True, privacy_unit="user", user_id_column="uid", examples_per_user=1))
