"""The DP trainer's keyword arguments, checked once before the Trainer is built: the sampler,
the clipping, the noise (or a target ε), the ledger and the accountant, with the old names mapped
(:mod:`dpcore._names`)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .._adapters import check_noise_or_target, check_privacy_unit
from .._names import MF_NOISE, memory as check_memory, noise_mechanism as noise_mechanism_name
from .._validate import positive as _positive
from ..ledger import PrivacyLedger
from ..sampling import registered_samplers


#: The samplers the DP trainer draws its batches with (``sampler=``).
SAMPLERS = ("poisson", "shuffle")
#: What a record with a non-finite gradient does (``on_nonfinite=``): those of
#: :class:`dpcore.torch.DPOptimizer` ("zero", the default, DP; "raise", a debugging aid).
ON_NONFINITE = ("zero", "raise")
#: The clipping modes of the DP trainer (``clipping=``): those of :class:`dpcore.torch.DPOptimizer`.
CLIPPING = ("flat", "per_layer", "joint")


@dataclass(frozen=True)
class _DPOptions:
    """The DP trainer's keyword arguments, checked once (:func:`_dp_options`), old names mapped."""

    noise_multiplier: Optional[float]
    target_epsilon: Optional[float]
    target_delta: Optional[float]
    max_grad_norm: Any
    ledger: Any
    sampler: str
    clipping: str
    joint_scales: Optional[Tuple[float, ...]]
    noise_mechanism: str
    delta: Optional[float]
    per_record_loss: Any
    accountant: str
    ledger_ahead: str
    seed: Optional[int]
    on_nonfinite: str = "zero"
    population_size: Optional[int] = None
    #: "example" or "user" (:data:`PRIVACY_UNITS`); the three below are set with "user" only
    privacy_unit: str = "example"
    user_id_column: Optional[str] = None
    examples_per_user: Optional[int] = None
    max_examples_per_user: Optional[int] = None
    #: "default" or "lean" (:data:`dpcore.torch.MEMORY`): the per-record gradients' memory mode
    memory: str = "default"
    #: static shapes: False, or the rows every micro-batch is padded to (True: chosen by the
    #: trainer from the expected micro-batch, see DPRun.pad_rows)
    pad_batches: Any = False


#: The privacy units of the DP trainer (``privacy_unit=``): one example (a row of
#: train_dataset), or all the rows of one user (``user_id_column=``).
PRIVACY_UNITS = ("example", "user")


def _check_privacy_unit(
    privacy_unit: Any, user_id_column: Any, examples_per_user: Any, max_examples_per_user: Any, sampler: str
) -> bool:
    """Whether the unit is the user, after checking the unit's keywords together
    (:func:`dpcore._adapters.check_privacy_unit`, with the trainer's ``user_id_column=`` for
    ``user_ids=``)."""
    users = check_privacy_unit(
        privacy_unit, user_id_column, examples_per_user, max_examples_per_user, ids_name="user_id_column",
        ids_what="the name of the train_dataset column that holds each example's user id")
    if not users:
        return False
    if not isinstance(user_id_column, str) or not user_id_column:
        raise TypeError(f"user_id_column must be a column name (a non-empty str), got {user_id_column!r}")
    if sampler != "poisson":
        raise ValueError(
            f"privacy_unit='user' samples users (or the examples kept per user) with Poisson sampling; "
            f"sampler={sampler!r} is not available with it"
        )
    return True


def _dp_options(
    *,
    noise_multiplier: Optional[float] = None,
    target_epsilon: Optional[float] = None,
    target_delta: Optional[float] = None,
    max_grad_norm: Any = None,
    ledger: Any = None,
    sampler: Optional[str] = None,
    clipping: str = "flat",
    joint_scales: Any = None,
    noise_mechanism: Optional[str] = None,
    delta: Optional[float] = None,
    per_record_loss: Any = None,
    accountant: str = "pld",
    ledger_ahead: str = "refuse",
    seed: Optional[int] = None,
    poisson_sampling: Optional[bool] = None,
    on_nonfinite: str = "zero",
    population_size: Optional[int] = None,
    privacy_unit: str = "example",
    user_id_column: Optional[str] = None,
    examples_per_user: Optional[int] = None,
    max_examples_per_user: Optional[int] = None,
    memory: str = "default",
    pad_batches: Any = False,
    _stacklevel: int = 3,
) -> _DPOptions:
    """The checks that need neither the model nor the data, made once, before the Trainer is
    built or changed (by :class:`DPTrainer`, :func:`make_private_trainer`, or
    :meth:`DPTrainerMixin._dp_setup` when called with keywords); ``poisson_sampling=`` (True:
    ``sampler="poisson"``, False: ``"shuffle"``) is a deprecated alias."""
    check_noise_or_target(noise_multiplier, target_epsilon, target_delta, "the DP trainer")
    if target_delta is not None:
        d = _positive("target_delta", target_delta)
        if d >= 1:
            raise ValueError(f"target_delta must be in (0, 1), got {d}")
    if delta is not None:
        d = _positive("delta", delta)
        if d >= 1:
            raise ValueError(f"delta must be in (0, 1), got {d}")
    if poisson_sampling is not None:
        warnings.warn("poisson_sampling= is deprecated: give sampler='poisson' (True) or sampler='shuffle' (False)",
                      DeprecationWarning, stacklevel=_stacklevel)
        same = "poisson" if poisson_sampling else "shuffle"
        if sampler is not None and sampler != same:
            raise ValueError(
                f"poisson_sampling={bool(poisson_sampling)} means sampler={same!r}, but sampler={sampler!r} was given: "
                "give sampler= alone (poisson_sampling is its older form)"
            )
        sampler = same
    sampler = "poisson" if sampler is None else sampler
    if sampler not in SAMPLERS:
        if sampler in registered_samplers(selectable=True):
            raise ValueError(
                f"sampler={sampler!r} is not available in the DP trainer: the Trainer's own dataloader "
                "(get_train_dataloader) draws the batches, one Poisson sample or one shuffled batch of "
                "per_device_train_batch_size × gradient_accumulation_steps records per optimizer step, so it takes "
                f"sampler='poisson' or 'shuffle' only. For {sampler!r} sampling train in a torch loop with "
                f"dpcore.torch.make_private(model, optimizer, data_loader, sampler={sampler!r}, ...)"
            )
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    nm = noise_mechanism_name(noise_mechanism, None, stacklevel=_stacklevel + 1)
    if nm in MF_NOISE:
        raise ValueError(
            f"noise_mechanism={nm!r} is not available in the DP trainer: matrix-factorization noise needs the fixed "
            "cyclic data order its strategy is planned for (dpcore's CyclicDataLoader), while the Trainer's own "
            "dataloader draws a fresh sample every step. Train in a torch loop with "
            f"dpcore.torch.make_private(model, optimizer, data_loader, noise_mechanism={nm!r}, epochs=..., ...)"
        )
    if nm == "discrete_gaussian" and target_epsilon is not None:
        raise ValueError(
            "target_epsilon calibrates for noise_mechanism='gaussian' only; for the discrete Gaussian give "
            "noise_multiplier and read trainer.get_epsilon()"
        )
    if max_grad_norm is None:
        raise TypeError("the DP trainer needs max_grad_norm= (the per-record clipping bound C)")
    if clipping not in CLIPPING:
        raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
    if isinstance(max_grad_norm, (list, tuple)):
        if clipping != "per_layer":
            raise ValueError("a list of max_grad_norm values needs clipping='per_layer'")
        for k, c in enumerate(max_grad_norm):
            _positive(f"max_grad_norm[{k}]", c)
    else:
        _positive("max_grad_norm", max_grad_norm)
    scales = None
    if clipping == "joint":
        if joint_scales is None or isinstance(joint_scales, (str, bytes)) or not hasattr(joint_scales, "__len__"):
            raise ValueError("clipping='joint' needs joint_scales: one scale α_p per trainable parameter tensor")
        scales = tuple(_positive(f"joint_scales[{k}]", a) for k, a in enumerate(joint_scales))
    elif joint_scales is not None:
        raise ValueError("joint_scales are the scales of clipping='joint'")
    if per_record_loss is not None and not callable(per_record_loss):
        raise TypeError("per_record_loss must be a callable (model, inputs) -> (B,) tensor")
    if accountant not in ("pld", "rdp"):
        raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    check_memory(memory)
    if population_size is not None:
        if isinstance(population_size, bool) or not isinstance(population_size, int) or population_size < 1:
            raise ValueError(f"population_size must be an int >= 1, got {population_size!r}")
        if sampler != "poisson":
            raise ValueError("population_size= declares the public N of Poisson sampling (q = batch/N, denominator q·N)")
    users = _check_privacy_unit(privacy_unit, user_id_column, examples_per_user, max_examples_per_user, sampler)
    if not isinstance(pad_batches, (bool, int)) or (not isinstance(pad_batches, bool) and pad_batches < 1):
        raise ValueError(f"pad_batches must be True, False or the rows of a padded micro-batch (an int >= 1), got {pad_batches!r}")
    if pad_batches is not False and users:
        raise ValueError(
            "pad_batches is not yet available with privacy_unit='user' (a padded row would join a user's rows); "
            "use pad_batches=False"
        )
    if ledger_ahead not in ("refuse", "keep"):
        raise ValueError(f"ledger_ahead must be 'refuse' or 'keep', got {ledger_ahead!r}")
    if ledger is not None and not isinstance(ledger, (PrivacyLedger, str, os.PathLike)):
        raise TypeError(f"ledger must be a dpcore.PrivacyLedger or a path, got {type(ledger).__name__}")
    return _DPOptions(
        noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, target_delta=target_delta,
        max_grad_norm=max_grad_norm, ledger=ledger, sampler=sampler, clipping=clipping, joint_scales=scales,
        noise_mechanism=nm, delta=delta, per_record_loss=per_record_loss, accountant=accountant,
        ledger_ahead=ledger_ahead, seed=seed, on_nonfinite=on_nonfinite, population_size=population_size,
        privacy_unit="user" if users else "example", user_id_column=user_id_column if users else None,
        examples_per_user=None if examples_per_user is None else int(examples_per_user),
        max_examples_per_user=None if max_examples_per_user is None else int(max_examples_per_user),
        memory=memory, pad_batches=pad_batches,
    )
