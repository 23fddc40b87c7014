"""Per-layer rules: how one module type hands per-record gradient factors to the engine.

A rule wraps one module's forward while the engine is active. Its forward computes the same
outputs as the module, but through autograd functions whose backward passes return only the
input gradients and hand the factors of each record's parameter gradient to the rule as
:mod:`contributions <dpcore.torch._contrib>`. Autograd never forms the (unclipped) batch
gradient of a parameter that a rule owns.

Built-in rules (dispatch by module type, :func:`register_layer`, as Opacus's ``grad_sample/``),
one module per family (each module's docstring says how its rules form per-record gradients):

* ``_base.py``: :class:`LayerRule`, the protocol every rule implements, and its helpers.
* ``_linear.py``: ``nn.Linear``, Hugging Face's ``Conv1D``.
* ``_embedding.py``: ``nn.Embedding`` and its subclasses.
* ``_conv.py``: ``nn.Conv1d``/``nn.Conv2d``/``nn.Conv3d``.
* ``_norm.py``: ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``, Hugging Face's RMS norms.
* ``_attention.py``: ``nn.MultiheadAttention``, T5's relative attention bias.
* ``_recurrent.py``: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN``.
* ``_generic.py``: any other module with trainable parameters (``torch.func``), and rules
  registered as functions.
* ``_registry.py``: :func:`register_layer`, :func:`rule_for` and the built-in registrations.

This package re-exports the names of the single module it replaced, ``_rules.py``.
"""

from ._attention import (  # noqa: F401
    MultiheadAttentionRule,
    RelativeBiasRule,
    _float_mask,
    _is_relative_bias_host,
    _ParamTapFn,
)
from ._base import (  # noqa: F401
    EMPTY_BATCH,
    LayerRule,
    _Flags,
    _flags,
    _frozen,
    _functorch_active,
    _graph_task,
    _LinearFn,
    _seq_first,
    _sl,
    _TapFn,
    batch_records,
)
from ._conv import ConvRule, _ConvFn  # noqa: F401
from ._embedding import (  # noqa: F401
    _EMBEDDING_FORWARD,
    _SUBCLASS_LOOKUPS,
    EmbeddingRule,
    EmbeddingSubclassRule,
    _embedding_forward,
    _EmbeddingFn,
    _HostedEmbeddingRule,
)
from ._generic import FunctionRule, GenericRule  # noqa: F401
from ._linear import LinearRule, TransposedLinearRule, _TransposedLinearFn  # noqa: F401
from ._norm import (  # noqa: F401
    _HF_NORM_SOURCES,
    _SOURCE_RULES,
    GemmaRMSNormRule,
    NormRule,
    ScaledRMSNormRule,
    T5LayerNormRule,
    _AffineFn,
    _GroupNormFn,
    _hf_norm_sources,
    _LayerNormFn,
    _rule_by_source,
)
from ._recurrent import RecurrentRule  # noqa: F401
from ._registry import _BY_NAME, _REGISTRY, register_layer, rule_for  # noqa: F401

__all__ = ["LayerRule", "register_layer", "rule_for"]
