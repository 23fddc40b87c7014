"""dpcore.transformers: DP-SGD for the Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``).

::

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=4,
                             num_train_epochs=3, logging_steps=10)
    trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                        target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0)
    trainer.train()                          # "epsilon" in every log; ledger: out/privacy_ledger.jsonl

    trainer = make_private_trainer(SFTTrainer(...), noise_multiplier=1.0, max_grad_norm=1.0)

Each optimizer step is one Poisson sample at q = per_device_train_batch_size ×
gradient_accumulation_steps / len(train_dataset), trained in ``gradient_accumulation_steps``
micro-batches and released once (clip each record, add noise, record it in the privacy ledger,
update) by :class:`dpcore.torch.DPOptimizer`. Each record's loss is its own (the mean over its own
target tokens for causal language models), never normalised by the other records' tokens.

Sits above :mod:`dpcore.torch`; requires the ``transformers`` extra
(``pip install 'dpcore[transformers]'``: torch, transformers, peft, accelerate).
"""

from __future__ import annotations

from ._data import BatchTag
from ._loss import (
    IGNORE_INDEX,
    causal_lm_per_record_loss,
    default_per_record_loss,
    sequence_classification_per_record_loss,
)
from ._trainer import LEDGER_NAME, STATE_NAME, DPTrainer, DPTrainerMixin, make_private_trainer

__all__ = [
    "DPTrainer",
    "DPTrainerMixin",
    "make_private_trainer",
    "causal_lm_per_record_loss",
    "sequence_classification_per_record_loss",
    "default_per_record_loss",
    "IGNORE_INDEX",
    "LEDGER_NAME",
    "STATE_NAME",
    "BatchTag",
]
