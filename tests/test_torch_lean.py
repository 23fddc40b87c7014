"""The memory-lean mode (``memory="lean"``): norms in a first backward pass, clipped sums in a
second (dpcore/torch/_lean.py). Every layer family of test_torch_layers.py again, exact against
brute force, with the optimizer in lean mode and a check at each step that no factor was held
to it (the lean mode did run, and did not fall back to holding the factors)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import test_torch_layers as L  # noqa: E402

from dpcore.torch import DPOptimizer  # noqa: E402


class LeanDPOptimizer(DPOptimizer):
    """DPOptimizer in lean mode, checking at each step that the factors were not held."""

    steps_checked = 0

    def __init__(self, *a, **kw):
        kw.setdefault("memory", "lean")
        super().__init__(*a, **kw)

    def step(self, closure=None):
        held = [r.name for r in self.engine.rules if r.contributions]
        assert not held, f"lean mode held the factors of {held} to the step"
        lean = self.engine.lean
        assert lean is not None and lean.phase == "sums"
        assert not lean.pending
        type(self).steps_checked += 1
        return super().step(closure)


@pytest.fixture(autouse=True)
def _lean(monkeypatch):
    monkeypatch.setattr(L, "DPOptimizer", LeanDPOptimizer)
    before = LeanDPOptimizer.steps_checked
    yield
    assert LeanDPOptimizer.steps_checked > before, "the test made no lean step"


test_transformer_encoder = L.test_transformer_encoder
test_transformer_decoder_cross_attention = L.test_transformer_decoder_cross_attention
test_multihead_attention_forms = L.test_multihead_attention_forms
test_recurrent_layers = L.test_recurrent_layers
test_rnn_relu = L.test_rnn_relu
test_conv_and_norm_layers = L.test_conv_and_norm_layers
test_conv_paths_and_fused_norms = L.test_conv_paths_and_fused_norms
test_deep_convs_through_factored_products = L.test_deep_convs_through_factored_products
test_tied_and_reused_parameters = L.test_tied_and_reused_parameters
test_frozen_parameters_do_not_move = L.test_frozen_parameters_do_not_move
test_register_layer_function_rule = L.test_register_layer_function_rule
test_adaptive_clipping_from_torch = L.test_adaptive_clipping_from_torch
test_microbatches_from_torch = L.test_microbatches_from_torch
test_nested_query_by_module_prefix_from_torch = L.test_nested_query_by_module_prefix_from_torch
test_generic_path_batches_keyword_tensors = L.test_generic_path_batches_keyword_tensors


import test_torch_amp as A  # noqa: E402

test_low_precision_release_equals_brute_force = A.test_low_precision_release_equals_brute_force
test_bf16_autocast_gpt2_tied_embedding = A.test_bf16_autocast_gpt2_tied_embedding

import test_torch_hf_archs as H  # noqa: E402

test_llama_gqa_with_padding = H.test_llama_gqa_with_padding
test_llama_lora_with_gradient_checkpointing = H.test_llama_lora_with_gradient_checkpointing  # both re-entrant modes
test_gemma_rmsnorm_one_plus_w = H.test_gemma_rmsnorm_one_plus_w
test_t5_encoder_decoder_with_relative_bias = H.test_t5_encoder_decoder_with_relative_bias
test_bart_learned_positions_and_scaled_embeddings = H.test_bart_learned_positions_and_scaled_embeddings
test_vit_exact = H.test_vit_exact
