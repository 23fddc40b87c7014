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
from .accounting.samplers import DEFAULT_ACCOUNTANTS, SAMPLERS

#: The samplers of :mod:`dpcore.sampling` that the adapters drive through their ``draw()``.
DRAWN = ("truncated_poisson", "balls_in_bins", "random_allocation")
#: The samplers whose steps come in rounds (an epoch of balls-in-bins, a round of allocation).
ALLOCATION = ("balls_in_bins", "random_allocation")


def default_accountant(kind: str) -> str:
    """The tightest certified accountant of ``kind``: RDP for the allocation samplers (the only
    certified analysis implemented), PLD otherwise (:data:`dpcore.accounting.samplers.DEFAULT_ACCOUNTANTS`)."""
    return DEFAULT_ACCOUNTANTS[kind]


def resolve_sampler(sampler: Any, poisson_sampling: Optional[bool]) -> str:
    """The sampler of a run from ``sampler=`` and the older ``poisson_sampling=`` (True is
    ``"poisson"``, False ``"shuffle"``); both given and disagreeing: ValueError."""
    if sampler is None:
        return "shuffle" if poisson_sampling is not None and not poisson_sampling else "poisson"
    if not isinstance(sampler, str) or sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(map(repr, SAMPLERS))} or None, got {sampler!r}")
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


def shape(kind: str, n: int, batch_size: float, max_batch_size: Any = None, num_selected: Any = 1) -> dict:
    """The constructor arguments (after the population) of :mod:`dpcore.sampling`'s sampler of
    ``kind`` for n records and an expected batch of ``batch_size``:

    * ``truncated_poisson``: q = min(1, bs/n), B = ``max_batch_size`` (B ≥ n: never binds; it
      is recorded as n, the same mechanism);
    * ``balls_in_bins``: b = max(1, round(n/bs)) batches per epoch (expected batch n/b);
    * ``random_allocation``: t = max(k, round(n·k/bs)) steps per round, each record in k of them
      (expected batch n·k/t, the nearest to bs a whole t gives)."""
    n = count("population_size", n, 1)
    bs = float(batch_size)
    if not (math.isfinite(bs) and bs > 0):
        raise ValueError(f"the batch size must be finite and > 0, got {batch_size!r}")
    check_options(kind, max_batch_size, num_selected, n, bs)
    if kind == "truncated_poisson":
        cap = count("max_batch_size", max_batch_size, 1)
        return {"sampling_probability": min(1.0, bs / n), "max_batch_size": min(cap, n)}
    if kind == "balls_in_bins":
        return {"num_batches": max(1, min(n, round(n / bs)))}
    if kind == "random_allocation":
        k = count("num_selected", num_selected, 1)
        return {"num_steps": max(k, round(n * k / bs)), "num_selected": k}
    raise ValueError(f"sampler {kind!r} is not drawn by a dpcore.sampling sampler")


def build(kind: str, n: int, batch_size: float, *, max_batch_size: Any = None, num_selected: Any = 1,
          seed: Optional[int] = None, ledger: Any = None) -> Any:
    """The :mod:`dpcore.sampling` sampler of ``kind`` (see :func:`shape`), recording in ``ledger``."""
    from . import sampling

    cls = {
        "truncated_poisson": "TruncatedPoissonSampler",
        "balls_in_bins": "BallsInBinsSampler",
        "random_allocation": "RandomAllocationSampler",
    }
    args = shape(kind, n, batch_size, max_batch_size, num_selected)
    return getattr(sampling, cls[kind])(n, *args.values(), seed=seed, ledger=ledger)


def config(sampler: Any) -> dict:
    """What identifies a built sampler's mechanism: its policy, population and arguments."""
    out = {"policy": sampler.policy, "population_size": int(sampler.population_size)}
    if sampler.policy == "truncated_poisson":
        out.update(sampling_probability=float(sampler.sampling_probability), max_batch_size=int(sampler.max_batch_size))
    elif sampler.policy == "balls_in_bins":
        out.update(num_batches=int(sampler.steps_per_epoch))
    else:
        out.update(num_steps=int(sampler.steps_per_epoch), num_selected=int(getattr(sampler, "num_selected", 1)))
    return out


def calibration_accountant(kind: str, accountant: Optional[str]) -> str:
    """``accountant`` for a calibration of ``kind`` (None: :func:`default_accountant`); PLD for
    an allocation sampler is refused (no certified PLD analysis of it is implemented)."""
    if accountant is None:
        return default_accountant(kind)
    if accountant == "pld" and kind in ALLOCATION:
        raise ValueError(
            f"sampler={kind!r} has no certified PLD analysis (only Monte Carlo estimates are published, which are not "
            "upper bounds); it is calibrated and accounted with accountant='rdp' (the default for it)"
        )
    return accountant


def planned_steps(sampler: Any, epochs: Any) -> int:
    """The steps of ``epochs`` passes over the data with ``sampler``: ``epochs`` × round(1/q)
    Poisson steps for truncated Poisson, ``epochs`` epochs of b batches for balls-in-bins, and
    for random allocation (each round of t steps is k passes) ⌈epochs/k⌉ whole rounds: the
    ledger counts a round cut short as a whole round, so that is what ``epochs`` costs."""
    e = count("epochs", epochs, 1)
    t = int(sampler.steps_per_epoch)
    if sampler.policy == "random_allocation":
        k = int(getattr(sampler, "num_selected", 1))
        return -(-e // k) * t
    return e * t


def calibrate(sampler: Any, target_epsilon: Any, target_delta: Any, steps: int, accountant: Optional[str],
              rel: float = 1e-5) -> float:
    """The smallest noise multiplier z, to ``rel`` relative and from above, such that ``steps``
    steps of ``sampler`` — its own :meth:`accountant_event`, the event its ledger entries
    become — are (``target_epsilon``, ``target_delta``)-DP under ``accountant`` (None: the
    sampler's own, :func:`default_accountant`).

    The search (:func:`dpcore.accounting.samplers.calibrate_noise_for`) starts from the Poisson
    calibration at the sampler's rate and returns only a z whose ε was evaluated and met the
    target, with the margin the ledger's rounding of z needs."""
    from .accounting.samplers import calibrate_noise_for, poisson_start

    acct = calibration_accountant(sampler.policy, accountant)
    s = count("steps", steps, 1)
    start = poisson_start(target_epsilon, target_delta, float(sampler.sampling_probability), s)
    return calibrate_noise_for(
        lambda z: sampler.accountant_event(z, s), target_epsilon, target_delta, acct, start=start, rel=rel
    )


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
