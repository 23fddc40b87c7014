"""The registry: which rule a module gets (:func:`register_layer`, :func:`rule_for`).

Dispatch is by module type, as Opacus's ``grad_sample/``: the exact type's registered rule, then
a type of an optional library matched by qualified name, then the nearest registered base whose
``forward`` the type inherits unchanged, then T5's relative-bias hosts, ``nn.Embedding``
subclasses with a forward of their own, and Hugging Face's RMS norms by their forward's source;
None otherwise (the engine's generic path). The built-in registrations are at the end.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

import torch.nn.functional as F
from torch import nn

from ._attention import MultiheadAttentionRule, RelativeBiasRule, _is_relative_bias_host
from ._base import LayerRule
from ._conv import ConvRule
from ._embedding import EmbeddingRule, EmbeddingSubclassRule
from ._generic import FunctionRule
from ._linear import LinearRule, TransposedLinearRule
from ._norm import NormRule, _rule_by_source
from ._recurrent import RecurrentRule


_REGISTRY: Dict[type, Type[LayerRule]] = {}


def register_layer(module_type: type, rule: Any) -> None:
    """Registers how dpcore.torch computes per-record gradients for ``module_type``.

    ``rule`` is either a :class:`LayerRule` subclass (factored forms, see the built-in rules in
    ``dpcore/torch/_rules/``) or a function ``rule(module, args, grad_output)`` returning
    ``{parameter_name: per_record_gradient}`` for the module's trainable parameters, each of
    shape (B, *parameter.shape), where ``args`` are the forward's positional arguments and
    ``grad_output`` is ∂L/∂output (records on dim 0), as Opacus's ``register_grad_sampler``.
    The rule applies to ``module_type`` and to subclasses that do not override ``forward``.
    A wrong rule breaks the privacy guarantee silently: test it against per-record autograd.
    """
    if not isinstance(module_type, type) or not issubclass(module_type, nn.Module):
        raise TypeError(f"module_type must be a subclass of torch.nn.Module, got {module_type!r}")
    if isinstance(rule, type) and issubclass(rule, LayerRule):
        _REGISTRY[module_type] = rule
    elif callable(rule):
        _REGISTRY[module_type] = type(f"FunctionRule_{module_type.__name__}", (FunctionRule,), {"fn": staticmethod(rule)})
    else:
        raise TypeError(f"rule must be a LayerRule subclass or a function, got {type(rule).__name__}")


# Types of optional libraries, matched by qualified name so that they need not be imported.
_BY_NAME: Dict[str, Type[LayerRule]] = {"transformers.pytorch_utils.Conv1D": TransposedLinearRule}


def rule_for(module: nn.Module) -> Optional[Type[LayerRule]]:
    """The registered rule of ``module``'s type, or of the nearest registered base type whose
    ``forward`` the type inherits unchanged; an ``nn.Embedding`` subclass with a forward of its
    own gets :class:`EmbeddingSubclassRule`, Hugging Face's RMS norms their fused rules; None
    when there is none (generic path)."""
    t = type(module)
    if t in _REGISTRY:
        return _REGISTRY[t]
    named = _BY_NAME.get(f"{t.__module__}.{t.__qualname__}")
    if named is not None:
        return named
    for base in t.__mro__[1:]:
        if base in _REGISTRY and getattr(t, "forward", None) is getattr(base, "forward", None):
            return _REGISTRY[base]
    if _is_relative_bias_host(module):
        return RelativeBiasRule
    if isinstance(module, nn.Embedding):
        return EmbeddingSubclassRule  # a subclass with a forward of its own (plain ones matched above)
    return _rule_by_source(t)


for _t, _r in (
    (nn.Linear, LinearRule),
    (nn.Embedding, EmbeddingRule),
    (nn.Conv1d, ConvRule),
    (nn.Conv2d, ConvRule),
    (nn.Conv3d, ConvRule),
    (nn.LayerNorm, NormRule),
    (nn.GroupNorm, NormRule),
    (nn.MultiheadAttention, MultiheadAttentionRule),
    (nn.LSTM, RecurrentRule),
    (nn.GRU, RecurrentRule),
    (nn.RNN, RecurrentRule),
):
    _REGISTRY[_t] = _r
if hasattr(nn, "RMSNorm") and hasattr(F, "rms_norm"):
    _REGISTRY[nn.RMSNorm] = NormRule
