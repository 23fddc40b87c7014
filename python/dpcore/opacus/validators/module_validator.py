"""``ModuleValidator``: Opacus's module checks and fixes, for dpcore's per-record gradients.

dpcore has per-record rules for ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and ``nn.MultiheadAttention``
(Opacus swaps these for its DP versions): they are valid as they are. The one layer that cannot
be made private is one that mixes the records of a batch: BatchNorm (its output for one record
depends on the others), which :meth:`ModuleValidator.fix` replaces with GroupNorm
(:func:`dpcore.torch.replace_batchnorm`).
"""

from __future__ import annotations

import copy
from typing import Any, List

from torch import nn

from ...torch import replace_batchnorm

_MIXING = (nn.modules.batchnorm._BatchNorm,)


class UnsupportedModuleError(ValueError):
    """A module dpcore cannot train with per-record gradients (as Opacus's error of that name)."""


class ModuleValidator:
    """``validate``, ``is_valid``, ``fix`` and ``fix_and_validate`` as Opacus's, with dpcore's rules."""

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> List[UnsupportedModuleError]:
        """The problems of ``module`` (a list, empty when it is valid); ``strict=True`` raises
        the first instead."""
        errors: List[UnsupportedModuleError] = []
        for name, m in module.named_modules():
            if isinstance(m, _MIXING):
                errors.append(UnsupportedModuleError(
                    f"{name or type(module).__name__} ({type(m).__name__}) mixes the records of a batch, so no "
                    "per-record gradient bounds one record's influence: ModuleValidator.fix replaces it with GroupNorm"
                ))
        if strict and errors:
            raise errors[0]
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        return not cls.validate(module, strict=False)

    @classmethod
    def fix(cls, module: nn.Module, **kwargs: Any) -> nn.Module:
        """A copy of ``module`` with every BatchNorm replaced by GroupNorm over the same channels
        (min(32, C) groups, reduced until it divides C; ``num_groups=`` to change 32). As Opacus,
        the original is left as it is."""
        return replace_batchnorm(copy.deepcopy(module), int(kwargs.get("num_groups", 32)))

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs: Any) -> nn.Module:
        fixed = cls.fix(module, **kwargs)
        cls.validate(fixed, strict=True)
        return fixed
