"""The ``sampler=`` argument of the torch and Keras adapters: which sampler a run uses, built
from the arguments a user gives (a batch size), and the accountant that certifies it.

Shared by :mod:`dpcore.torch` and :mod:`dpcore.tensorflow`; it imports neither framework.

=====================  =================================================  =====================
``sampler``            built from the data set's n and the batch size bs  ε by (``get_epsilon``)
=====================  =================================================  =====================
``poisson``            q = bs/n (:func:`dpcore.poisson_sample`)           PLD
``truncated_poisson``  q = bs/n, capped at ``max_batch_size`` B           PLD
``balls_in_bins``      b = round(n/bs) batches per epoch                  RDP
``random_allocation``  t = round(n·k/bs) steps per round, k = num_sel.    RDP
``shuffle``            the DataLoader's own batches (no amplification)    PLD
=====================  =================================================  =====================

The allocation samplers (balls-in-bins, Chua et al. 2025, arXiv 2412.16802; random allocation,
Feldman & Shenfeld 2025, arXiv 2502.08202) have a certified Rényi-DP analysis only
(:mod:`dpcore.accounting.allocation`): a ledger holding them is accounted by RDP whatever the
accountant asked for (the PLD accountant refuses them and the ledger falls back, with a
``LedgerWarning``). The adapters ask for RDP directly for these samplers, so that the answer is
the same and nothing warns.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ._validate import count, integer, positive as _positive
from .plan import calibration_accountant as plan_accountant
from .sampling import registered_samplers, sampler_class


def __getattr__(name: str) -> Any:
    # views of the sampler registry, computed when read (a sampler registered later is in them)
    if name == "DRAWN":  # the samplers the adapters drive through their draw()
        return registered_samplers(selectable=True, drawn=True)
    if name == "ALLOCATION":  # the samplers whose steps come in rounds
        return tuple(n for n in registered_samplers() if sampler_class(n).rounds == "allocation")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def drawn(kind: str) -> bool:
    """Whether the adapters draw ``kind``'s batches through a :mod:`dpcore.sampling` sampler."""
    return kind in registered_samplers(selectable=True, drawn=True)


def default_accountant(kind: str) -> str:
    """The tightest certified accountant of ``kind`` (the sampler class's own)."""
    return sampler_class(kind).default_accountant


def resolve_sampler(sampler: Any, poisson_sampling: Optional[bool]) -> str:
    """The sampler of a run from ``sampler=`` and the older ``poisson_sampling=`` (True is
    ``"poisson"``, False ``"shuffle"``; deprecated); both given and disagreeing: ValueError."""
    if poisson_sampling is not None:
        import warnings

        warnings.warn(
            "poisson_sampling= is deprecated: give sampler='poisson' (True) or sampler='shuffle' (False)",
            DeprecationWarning, stacklevel=3,
        )
    if sampler is None:
        return "shuffle" if poisson_sampling is not None and not poisson_sampling else "poisson"
    choices = registered_samplers(selectable=True)
    if not isinstance(sampler, str) or sampler not in choices:
        raise ValueError(f"sampler must be one of {', '.join(map(repr, choices))} or None, got {sampler!r}")
    if poisson_sampling is not None:
        same = "poisson" if poisson_sampling else "shuffle"
        if sampler != same:
            raise ValueError(
                f"poisson_sampling={bool(poisson_sampling)} means sampler={same!r}, but sampler={sampler!r} was given: "
                "give sampler= alone (poisson_sampling is its older form)"
            )
    return sampler


def check_options(kind: str, max_batch_size: Any, num_selected: Any, n: Optional[int] = None,
                  batch_size: Optional[float] = None) -> None:
    """Refuses the options of another sampler (a cap without truncation, k without allocation)
    and a truncated Poisson sampler without its cap (with a suggested cap when n and the batch
    size are known)."""
    if max_batch_size is not None and kind != "truncated_poisson":
        raise ValueError(f"max_batch_size is the cap of sampler='truncated_poisson'; sampler={kind!r} takes none")
    if kind == "truncated_poisson" and max_batch_size is None:
        e_g = "ceil(q·n + 4·sqrt(q·n·(1 − q)))"
        if n and batch_size:
            e_g = f"{e_g} = {suggested_cap(n, min(1.0, batch_size / n))} here"
        raise ValueError(
            "sampler='truncated_poisson' needs max_batch_size (the cap B on a batch). The batch size is Binomial(n, q); "
            f"a cap a few standard deviations above its mean, e.g. {e_g}, binds rarely and costs almost no privacy"
        )
    if integer("num_selected", num_selected) != 1 and kind != "random_allocation":
        raise ValueError(f"num_selected is the k of sampler='random_allocation'; sampler={kind!r} takes none")


def suggested_cap(n: int, q: float) -> int:
    """ceil(q·n + 4·sqrt(q·n·(1 − q))), capped at n: a cap that a Binomial(n, q) batch exceeds
    with probability about 3e-5 (the normal tail at 4 standard deviations)."""
    m = q * n
    return int(min(n, math.ceil(m + 4.0 * math.sqrt(m * (1.0 - q)))))


def build(kind: str, n: int, batch_size: float, *, max_batch_size: Any = None, num_selected: Any = 1,
          seed: Optional[int] = None, ledger: Any = None) -> Any:
    """The :mod:`dpcore.sampling` sampler of ``kind`` for n records and an expected batch of
    ``batch_size`` (:meth:`~dpcore.sampling.Sampler.for_batch_size`), recording in ``ledger``."""
    n = count("population_size", n, 1)
    bs = float(batch_size)
    if not (math.isfinite(bs) and bs > 0):
        raise ValueError(f"the batch size must be finite and > 0, got {batch_size!r}")
    check_options(kind, max_batch_size, num_selected, n, bs)
    cls = sampler_class(kind)
    opts = {k: v for k, v in (("max_batch_size", max_batch_size), ("num_selected", num_selected)) if k in cls.options}
    return cls.for_batch_size(n, bs, seed=seed, ledger=ledger, **opts)


def shape(kind: str, n: int, batch_size: float, max_batch_size: Any = None, num_selected: Any = 1) -> dict:
    """The constructor arguments (after the population) of ``kind``'s sampler for n records and
    an expected batch of ``batch_size``: what :func:`build` would give it."""
    cfg = build(kind, n, batch_size, max_batch_size=max_batch_size, num_selected=num_selected).config()
    cfg.pop("policy"), cfg.pop("population_size")
    return cfg


def config(sampler: Any) -> dict:
    """What identifies a built sampler's mechanism: its policy, population and arguments."""
    return sampler.config()


def calibration_accountant(kind: str, accountant: Optional[str]) -> str:
    """``accountant`` for a calibration of ``kind`` (:func:`dpcore.plan.calibration_accountant`)."""
    return plan_accountant(kind, accountant)


def planned_steps(sampler: Any, epochs: Any) -> int:
    """The steps of ``epochs`` passes over the data with ``sampler``: its class's
    :meth:`~dpcore.sampling.Sampler.steps_for_epochs`, the formula every front end plans with."""
    count("epochs", epochs, 1)
    return sampler.steps_for(epochs)


def check_noise_or_target(noise_multiplier: Any, target_epsilon: Any, target_delta: Any, who: str) -> None:
    """One of ``noise_multiplier`` or ``target_epsilon`` (with ``target_delta``), checked: the
    same rule for every front end that takes either (``who`` names it in the error)."""
    if noise_multiplier is not None and target_epsilon is not None:
        raise ValueError("give noise_multiplier or target_epsilon (with target_delta), not both")
    if noise_multiplier is None and target_epsilon is None:
        raise TypeError(f"{who} needs noise_multiplier=, or target_epsilon= and target_delta= to calibrate it")
    if noise_multiplier is not None:
        _positive("noise_multiplier", noise_multiplier, allow_zero=True)
    else:
        _positive("target_epsilon", target_epsilon)
        if target_delta is None:
            raise TypeError("target_epsilon needs target_delta")


def wants_target(noise_multiplier: Any, target_epsilon: Any, target_delta: Any, epochs: Any, who: str) -> bool:
    """Whether a ``make_private`` was given a target ε (with δ and the planned epochs) to
    calibrate the noise for instead of ``noise_multiplier``; the arguments checked."""
    if target_epsilon is None and target_delta is None:
        return False
    if target_epsilon is None:
        raise TypeError("target_delta goes with target_epsilon (σ calibrated to (target_epsilon, target_delta))")
    check_noise_or_target(noise_multiplier, target_epsilon, target_delta, who)
    if epochs is None:
        raise TypeError("target_epsilon needs epochs= (the planned epochs the noise multiplier is calibrated for)")
    return True


def check_privacy_unit(privacy_unit: Any, user_ids: Any, examples_per_user: Any, max_examples_per_user: Any, *,
                       ids_name: str = "user_ids", ids_what: str = "one id per training example") -> bool:
    """Whether the privacy unit is the user, after checking the unit's arguments together (the
    same rule in every adapter): ``"example"`` takes none of them; ``"user"`` needs ``user_ids``
    (``ids_name``: the HF trainer's ``user_id_column``) and exactly one of ``examples_per_user``
    (user-level sampling) and ``max_examples_per_user`` (example-level sampling, user-level
    guarantee)."""
    from .sampling import check_examples_per_user

    if privacy_unit not in ("example", "user"):
        raise ValueError(f"privacy_unit must be one of ('example', 'user'), got {privacy_unit!r}")
    if privacy_unit == "example":
        given = [k for k, v in ((ids_name, user_ids), ("examples_per_user", examples_per_user),
                                ("max_examples_per_user", max_examples_per_user)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need privacy_unit='user' (the default unit is one example)")
        return False
    if user_ids is None:
        raise TypeError(f"privacy_unit='user' needs {ids_name}: {ids_what}")
    if (examples_per_user is None) == (max_examples_per_user is None):
        raise ValueError(
            "privacy_unit='user' needs exactly one of examples_per_user=k (users are sampled; each gives the mean "
            "of at most k of its examples) and max_examples_per_user=K (each user bounded to K examples; examples "
            "are sampled)"
        )
    if examples_per_user is not None:
        check_examples_per_user("examples_per_user", examples_per_user)
    else:
        check_examples_per_user("max_examples_per_user", max_examples_per_user)
    return True
