"""Hugging Face models through dpcore.torch (config only, no download): GPT-2 (Conv1D layers,
embedding tied to the LM head) and BERT shapes, fully trained and with LoRA through peft.
At noise 0 the released update equals the brute-force per-record clipped sum."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from torch import nn  # noqa: E402

import dpcore  # noqa: E402
from dpcore.torch import FallbackWarning, make_private  # noqa: E402
from test_torch_layers import check  # noqa: E402

torch.set_num_threads(1)


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def lora(model, targets):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                          fan_in_fan_out=targets == ["c_attn"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, cfg)


ids = torch.randint(0, 40, (5, 8), generator=torch.Generator().manual_seed(1))
mask = torch.ones(5, 8, dtype=torch.long)
mask[1, -3:] = 0
labels = torch.tensor([0, 1, 2, 1, 0])


def lm_loss(m, i):
    logits = m(input_ids=ids[i]).logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[i][:, 1:].reshape(-1), reduction="sum")


def cls_loss(m, i):
    return nn.functional.cross_entropy(m(input_ids=ids[i], attention_mask=mask[i]).logits, labels[i], reduction="sum")


def test_gpt2_full_tied_head():
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    check(model, lm_loss, 5)


def test_bert_full():
    check(bert(), cls_loss, 5)


def test_gpt2_lora():
    check(lora(gpt2(), ["c_attn"]), lm_loss, 5)


def test_bert_lora():
    check(lora(bert(), ["query", "value"]), cls_loss, 5)


def test_make_private_trains_lora_and_freezes_the_base():
    model = lora(bert(), ["query", "value"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = torch.utils.data.TensorDataset(ids.repeat(8, 1), mask.repeat(8, 1), labels.repeat(8))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ledger = dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(), "hf.jsonl"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        model, opt, loader = make_private(model, opt, loader, noise_multiplier=0.5, max_grad_norm=1.0, ledger=ledger)
    steps = 0
    for x, mk, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(input_ids=x, attention_mask=mk).logits, y).backward()
        opt.step()
        steps += 1
    assert steps == 5 and ledger.num_releases == 5
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != p.requires_grad, n
    assert 0 < opt.get_epsilon(1e-5) < float("inf")


def test_one_record_batch_after_a_larger_one_counts_that_record_once():
    """GPT-2's position ids are one row shared by the batch; the engine expands such a row to the
    batch's record count. That count belongs to one forward pass: a one-record batch after a
    two-record one must not be expanded to two copies of the record (influence 2C)."""
    model = gpt2()
    ref = copy.deepcopy(model)
    ref.zero_grad()
    lm_loss(ref, [2]).backward()
    ledger = dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(), "hint.jsonl"))
    opt = dpcore.torch.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model=model, noise_multiplier=0.0,
                                   max_grad_norm=1e9, expected_batch_size=1.0, loss_reduction="sum", ledger=ledger)
    for batch in ([0, 1], [2]):
        ledger.record_sample(100, 0.01)
        opt.zero_grad()
        lm_loss(model, batch).backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
