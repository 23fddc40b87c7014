"""Per-record losses for the DP Trainer.

A Hugging Face model's own loss averages over every token of the batch (and, with gradient
accumulation, over ``num_items_in_batch``, the tokens of the whole accumulated batch), so the
gradient of one record depends on how many tokens the *other* records have. DP-SGD clips each
record's gradient to bound one record's influence, which needs the loss of the batch to be a sum
of terms that each depend on one record only. These functions return that term for every record
of the batch, a (B,) tensor; the trainer backpropagates their sum.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "causal_lm_per_record_loss",
    "sequence_classification_per_record_loss",
    "default_per_record_loss",
    "IGNORE_INDEX",
]

#: Label value that marks a position without a target (Hugging Face's convention).
IGNORE_INDEX = -100

# Keys of a batch that are targets, not model inputs.
_TARGET_KEYS = ("labels", "shift_labels", "num_items_in_batch")


def _model_inputs(model: Any, inputs: Dict[str, Any]) -> Dict[str, Any]:
    fwd = {k: v for k, v in inputs.items() if k not in _TARGET_KEYS}
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", None) is not None and "use_cache" not in fwd:
        fwd["use_cache"] = False  # no key/value cache while training
    return fwd


def _logits(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out["logits"] if isinstance(out, dict) else out[0]
    return logits


def causal_lm_per_record_loss(model: Any, inputs: Dict[str, Any]) -> torch.Tensor:
    """Each record's mean next-token cross-entropy over its own target tokens.

    Targets are ``labels`` shifted by one position (or ``shift_labels`` as given), positions
    labelled ``-100`` are ignored; without ``labels`` the targets are ``input_ids``, with the
    padding of ``attention_mask`` ignored. A record with no target token has loss 0 (and so no
    gradient). Cross-entropy is computed in float32 whatever the logits' dtype."""
    shift = inputs.get("shift_labels")
    labels = inputs.get("labels")
    if shift is None and labels is None:
        labels = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    logits = _logits(model(**_model_inputs(model, inputs)))
    if shift is None:
        logits, target = logits[:, :-1], labels[:, 1:]
    else:
        target = shift
    b, v = logits.shape[0], logits.shape[-1]
    ce = F.cross_entropy(
        logits.reshape(-1, v).float(), target.reshape(-1).long(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(b, -1)
    tokens = (target != IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return ce.sum(dim=1) / tokens.to(ce.dtype)


def sequence_classification_per_record_loss(model: Any, inputs: Dict[str, Any]) -> torch.Tensor:
    """Each record's loss for ``*ForSequenceClassification`` models, as the model's own loss
    chooses it (``config.problem_type``): cross-entropy (single label), squared error
    (regression, ``num_labels == 1``; mean over outputs), or binary cross-entropy with logits
    averaged over the labels (multi-label)."""
    labels = inputs["labels"]
    logits = _logits(model(**_model_inputs(model, inputs))).float()
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "problem_type", None)
    num_labels = getattr(cfg, "num_labels", logits.shape[-1])
    if kind is None:
        if num_labels == 1:
            kind = "regression"
        elif labels.dtype in (torch.long, torch.int, torch.int16, torch.int8, torch.uint8):
            kind = "single_label_classification"
        else:
            kind = "multi_label_classification"
    b = logits.shape[0]
    if kind == "regression":
        return (logits.reshape(b, -1) - labels.reshape(b, -1).to(logits.dtype)).pow(2).mean(dim=1)
    if kind == "multi_label_classification":
        bce = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        return bce.reshape(b, -1).mean(dim=1)
    return F.cross_entropy(logits.reshape(b, -1), labels.reshape(-1).long(), reduction="none")


def _class_names(mapping_name: str) -> set:
    from transformers.models.auto import modeling_auto

    names: set = set()
    for v in getattr(modeling_auto, mapping_name, {}).values():
        names.update(v if isinstance(v, (list, tuple)) else (v,))
    return names


def default_per_record_loss(model: Any) -> Optional[Callable[[Any, Dict[str, Any]], torch.Tensor]]:
    """The per-record loss for ``model``'s task, from its class (through a peft ``PeftModel``
    to the model it adapts): causal language models and sequence classifiers; None otherwise."""
    base = model
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        base = get_base()
    name = type(base).__name__
    if name in _class_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):
        return causal_lm_per_record_loss
    if name in _class_names("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"):
        return sequence_classification_per_record_loss
    return None
