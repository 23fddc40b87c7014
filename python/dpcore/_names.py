"""One name per concept across the API (the core's vocabulary: ``sampling_probability``,
``l2_norm_clip``; ``max_grad_norm`` in the torch and Keras wrappers, as users know it from
Opacus; ``sampler=``, ``noise_mechanism=``, ``clipping=`` in every front end: docs/names.md).
Old spellings are still accepted for a while, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

_MISSING = object()


def renamed(new: str, value: Any, old: str, old_value: Any, *, required: bool = True, stacklevel: int = 3) -> Any:
    """The value given as ``new`` or, deprecated, as ``old`` (never both)."""
    if old_value is not None:
        if value is not None:
            raise TypeError(f"give {new}= only ({old}= is its old name)")
        warnings.warn(f"{old}= is deprecated; it is called {new}= now", DeprecationWarning, stacklevel=stacklevel)
        return old_value
    if value is None and required:
        raise TypeError(f"missing required keyword argument: {new}")
    return value


#: The values of ``memory=`` (torch, the Hugging Face trainer, Lightning): ``"default"`` (norms and
#: clipped sums from one backward pass, every layer's factors held to the step) and ``"lean"``
#: (ghost clipping: norms in a first backward pass, the clipped sums in a second one).
MEMORY = ("default", "lean")


def memory(value: Any) -> str:
    """``memory=`` checked: one of :data:`MEMORY`."""
    if value not in MEMORY:
        raise ValueError(f"memory must be one of {MEMORY}, got {value!r}")
    return str(value)


#: The values of ``noise_mechanism=`` (every front end; :data:`dpcore.plan.NOISE_MECHANISMS`):
#: independent Gaussian or discrete Gaussian noise per step (DP-SGD), or the correlated noise of
#: a banded or BLT matrix factorization.
NOISE_MECHANISMS = ("gaussian", "discrete_gaussian", "banded", "blt")
#: The matrix-factorization values (with the deprecated ``"independent"``, C = I over the cyclic order).
MF_NOISE = ("banded", "blt", "independent")
#: Old values of ``noise_mechanism=`` / ``mechanism=`` and what they are called now.
_OLD_NOISE = {"discrete": "discrete_gaussian"}


def noise_mechanism(value: Any, mechanism: Any = None, *, stacklevel: int = 3) -> str:
    """The one noise mechanism of a run from ``noise_mechanism=`` and the older ``mechanism=``
    (``"gaussian"`` | ``"discrete_gaussian"``; deprecated), old values mapped with a
    DeprecationWarning: ``"discrete"`` → ``"discrete_gaussian"``. ``"independent"`` (C = I
    over the cyclic fixed batches of the matrix-factorization path) warns, naming its new
    spelling, and is returned as is for :func:`legacy_independent`; None is ``"gaussian"``.
    ``stacklevel``: the user's frame as seen from this function's caller's caller (3: the
    caller of a public function that calls this directly)."""
    if mechanism is not None:
        warnings.warn(
            "mechanism= is deprecated; it is called noise_mechanism= now (values 'gaussian', 'discrete_gaussian', "
            "'banded', 'blt')", DeprecationWarning, stacklevel=stacklevel,
        )
        mechanism = _old_value(mechanism, stacklevel + 1)
        if mechanism not in ("gaussian", "discrete_gaussian"):
            raise ValueError(f"mechanism must be 'gaussian' or 'discrete_gaussian' (give noise_mechanism=), got {mechanism!r}")
        if value is not None:
            value = _check_noise(_old_value(value, stacklevel + 1))
            if mechanism == "discrete_gaussian" and value != "discrete_gaussian":
                raise ValueError(
                    f"noise_mechanism={value!r} with mechanism='discrete_gaussian': one run has one noise mechanism; "
                    "give noise_mechanism= alone (the discrete Gaussian is not combined with matrix-factorization noise)"
                )
            return value  # mechanism='gaussian' is the old default: any Gaussian mechanism
        return mechanism
    if value is None:
        return "gaussian"
    return _check_noise(_old_value(value, stacklevel + 1))


def _check_noise(value: Any) -> str:
    if not isinstance(value, str) or (value not in NOISE_MECHANISMS and value != "independent"):
        raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS}, got {value!r}")
    return value


def _old_value(value: Any, stacklevel: int) -> Any:
    if value == "independent":
        warnings.warn(
            "noise_mechanism='independent' is deprecated: independent noise is noise_mechanism='gaussian' (DP-SGD with "
            "a sampler); over the cyclic fixed batches of the matrix-factorization path it is noise_mechanism='banded' "
            "with strategy=dpcore.matrix_factorization.IDENTITY (C = I)", DeprecationWarning, stacklevel=stacklevel,
        )
    elif isinstance(value, str) and value in _OLD_NOISE:
        new = _OLD_NOISE[value]
        warnings.warn(f"noise_mechanism={value!r} is deprecated; it is called {new!r} now", DeprecationWarning,
                      stacklevel=stacklevel)
        return new
    return value



def legacy_independent(noise_mechanism: Any, strategy: Any) -> "tuple[Any, Any]":
    """``(noise_mechanism, strategy)`` with the deprecated ``"independent"`` (already warned
    about by :func:`noise_mechanism`) spelled as it is now: ``"banded"`` with the strategy
    C = I (:data:`dpcore.matrix_factorization.IDENTITY`), the same noise over the same cyclic
    order."""
    if noise_mechanism != "independent":
        return noise_mechanism, strategy
    from .matrix_factorization import IDENTITY

    if strategy is not None and strategy != IDENTITY:
        raise ValueError(
            f"noise_mechanism='independent' is C = I (BandedStrategy([1.0])); got strategy {strategy!r}: give "
            "noise_mechanism='banded' or 'blt' for correlated noise"
        )
    return "banded", IDENTITY
