"""The Hugging Face architectures people fine-tune, built from tiny configs (no download), against
brute force at noise 0 (one backward per record; each record's loss its own mean over its
tokens; flat clipping at the median per-record norm): Llama with grouped-query attention (sdpa
and eager, with a padding mask), Mistral with a sliding window, Qwen2, T5 and BART (encoder and
decoder, at lengths equal to the batch size and not), LoRA with gradient checkpointing (both
re-entrant modes) and bfloat16 autocast. Then the property that a wrong record axis broke: the
clipped sum moves by at most C when one record is replaced, with lengths drawn to collide with
the batch size, for every rule these models use."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from torch import nn  # noqa: E402

from dpcore.torch import FallbackWarning  # noqa: E402
from test_torch_layers import brute_force, dp_update  # noqa: E402

torch.set_num_threads(1)
B = 5
V = 30


def _cfg_common(**kw):
    return dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=32, **kw)


def llama(attn="sdpa"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**_cfg_common(num_key_value_heads=2), attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


def mistral():
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**_cfg_common(num_key_value_heads=2, sliding_window=4), attn_implementation="eager")
    return transformers.MistralForCausalLM(cfg)


def qwen2():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**_cfg_common(num_key_value_heads=2), attn_implementation="eager")
    return transformers.Qwen2ForCausalLM(cfg)


def gemma():
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(**_cfg_common(num_key_value_heads=2, head_dim=4), attn_implementation="eager")
    m = transformers.GemmaForCausalLM(cfg)
    with torch.no_grad():  # the (1 + w) scales start at w = 0: move them so their gradients are not trivial
        for mod in m.modules():
            if type(mod).__name__ == "GemmaRMSNorm":
                mod.weight.normal_(0.0, 0.3)
    return m


def t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def bart():
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                  max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                  scale_embedding=True, decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(cfg)


def lora(model, targets):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


def per_record_mean(logits, labels, mask=None):
    """Σ over records of each record's mean token loss (the reduction 'sum' over records)."""
    ce = nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
    if mask is None:
        mask = torch.ones_like(ce)
    return ((ce * mask).sum(1) / mask.sum(1)).sum()


def causal_loss(ids, mask=None, bf16=False):
    def loss_of(m, i):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = m(input_ids=ids[i], attention_mask=None if mask is None else mask[i]).logits
        mk = None if mask is None else mask[i][:, 1:].float()
        return per_record_mean(out[:, :-1], ids[i][:, 1:], mk)

    return loss_of


def seq2seq_loss(src, tgt):
    def loss_of(m, i):
        return per_record_mean(m(input_ids=src[i], labels=tgt[i]).logits, tgt[i])

    return loss_of


def compare(model, loss_of, n=B, rtol=1e-4, u=None, fallback_ok=False):
    clip, ref, norms = brute_force(model, loss_of, n)
    assert (norms > clip).any() and (norms < clip).any()
    with warnings.catch_warnings():
        if not fallback_ok:
            warnings.simplefilter("error", FallbackWarning)
        got, opt, m = dp_update(model, loss_of, n, clip, 7.0)
    scale = max(float(r.abs().max()) for r in ref) / 7.0
    names = [nm for nm, p in m.named_parameters() if p.requires_grad]
    for name, g, r in zip(names, got, ref):
        assert g is not None, name
        if u is None:
            np.testing.assert_allclose(g.double().numpy(), (r / 7.0).numpy(), rtol=rtol, atol=rtol * scale, err_msg=name)
        else:
            assert float((g.double() - r / 7.0).abs().max()) <= 4 * u * scale, name
    kinds = {r.kind for r in opt.engine.rules}
    opt.engine.remove()
    return kinds


IDS = torch.randint(1, V, (B, 10), generator=torch.Generator().manual_seed(1))
PAD = torch.ones(B, 10, dtype=torch.long)
PAD[1, -3:] = 0
PAD[3, -5:] = 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_gqa_with_padding(attn):
    kinds = compare(llama(attn), causal_loss(IDS, PAD))
    assert "norm" in kinds and "generic" not in kinds  # RMSNorm by its fused rule, no fallback


@pytest.mark.parametrize("make", [mistral, qwen2])
def test_mistral_sliding_window_and_qwen2(make):
    compare(make(), causal_loss(IDS))


@pytest.mark.parametrize("reentrant", [True, False])
def test_llama_lora_with_gradient_checkpointing(reentrant):
    m = llama()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    m.config.use_cache = False
    m = lora(m, ["q_proj", "v_proj"])
    if reentrant:
        m.enable_input_require_grads()
    m.train()
    compare(m, causal_loss(IDS))


def test_llama_bf16_autocast():
    compare(llama(), causal_loss(IDS, bf16=True), u=2.0**-8)


@pytest.mark.parametrize("bf16", [False, True])
def test_gemma_rmsnorm_one_plus_w(bf16):
    kinds = compare(gemma(), causal_loss(IDS, bf16=bf16), u=2.0**-8 if bf16 else None)
    assert "norm" in kinds and "generic" not in kinds


def test_t5_bf16_autocast():
    src = torch.randint(1, V, (B, B), generator=torch.Generator().manual_seed(2))
    tgt = torch.randint(1, V, (B, 7), generator=torch.Generator().manual_seed(3))

    def loss_of(m, i):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(input_ids=src[i], labels=tgt[i]).logits
        return per_record_mean(logits, tgt[i])

    compare(t5(), loss_of, u=2.0**-8)


@pytest.mark.parametrize("src_len,tgt_len", [(B, B), (10, 8), (B, 7)])
def test_t5_encoder_decoder_with_relative_bias(src_len, tgt_len):
    src = torch.randint(1, V, (B, src_len), generator=torch.Generator().manual_seed(2))
    tgt = torch.randint(1, V, (B, tgt_len), generator=torch.Generator().manual_seed(3))
    kinds = compare(t5(), seq2seq_loss(src, tgt))
    assert "generic" not in kinds


@pytest.mark.parametrize("src_len,tgt_len", [(B, B), (10, 8)])
def test_bart_learned_positions_and_scaled_embeddings(src_len, tgt_len):
    src = torch.randint(3, V, (B, src_len), generator=torch.Generator().manual_seed(2))
    tgt = torch.randint(3, V, (B, tgt_len), generator=torch.Generator().manual_seed(3))
    compare(bart(), seq2seq_loss(src, tgt))


def test_vit_exact():
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    m = transformers.ViTForImageClassification(cfg)
    x = torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    y = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(5))
    compare(m, lambda mm, i: nn.functional.cross_entropy(mm(pixel_values=x[i]).logits, y[i], reduction="sum"),
            fallback_ok=True)  # the class token and position table are the embeddings module's own


def test_an_unknown_shared_lookup_is_refused_with_guidance():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.table, self.h = nn.Embedding(V, 8), nn.Embedding(6, 8), nn.Linear(8, 3)

        def forward(self, ids):
            tok = self.tok(ids).mean(1)
            pos = torch.arange(6)[None, :] - torch.arange(4)[:, None] + 3  # (4, 6): no record axis
            shared = self.table(pos.clamp(0, 5)).mean((0, 1))
            return self.h(tok + shared)

    from dpcore.torch import DPOptimizer
    import os
    import tempfile

    import dpcore

    m = Shared()
    opt = DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), model=m, noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=5.0, ledger=dpcore.PrivacyLedger(os.path.join(tempfile.mkdtemp(), "l.jsonl")))
    with pytest.raises(ValueError, match=r"layer 'table'.*no axis of the batch's 5 records.*Freeze it"):
        m(IDS[:, :3])
    opt.engine.clear()
    opt.engine.remove()


# ----------------------------------------------------------------------------- replace one record


@pytest.mark.parametrize("make,kind", [(t5, "t5"), (bart, "bart"), (llama, "llama")])
@pytest.mark.parametrize("seed", range(3))
def test_one_record_moves_the_clipped_sum_by_at_most_c(make, kind, seed):
    """Lengths drawn to collide with the batch size (n or n − 1); the other records repeat one
    token. The released sum (noise 0, denominator 1) of a batch and of the batch without its
    first record differ by at most C (+ rounding), the add-or-remove sensitivity the accountant
    assumes; with the record replaced by another, by at most 2C. T5's shared relative bias,
    looked up once for the batch, broke this."""
    g = torch.Generator().manual_seed(100 + seed)
    n = B
    length = int(torch.randint(n - 1, n + 1, (1,), generator=g))
    base = torch.full((n, length), 7, dtype=torch.long)
    base[0] = torch.randint(1, V, (length,), generator=g)
    other = base.clone()
    other[0] = torch.randint(1, V, (length,), generator=g)
    tgt = torch.full((n, length), 5, dtype=torch.long)

    def loss(ids, t):
        return causal_loss(ids) if kind == "llama" else seq2seq_loss(ids, t)

    model = make()
    c = 0.05

    def released(ids, t):
        got, opt, _ = dp_update(model, loss(ids, t), len(ids), c, 1.0)
        opt.engine.remove()
        return torch.cat([x.double().reshape(-1) for x in got])

    full = released(base, tgt)
    assert float((full - released(base[1:], tgt[1:])).norm()) <= c * (1 + 1e-5)
    assert float((full - released(other, tgt)).norm()) <= 2 * c * (1 + 1e-5)
