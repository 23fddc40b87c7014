"""The plan of a DP run: every axis resolved once, the same way for every front end.

McMahan et al. 2018 separate the training code, the DP mechanism and the accounting; a run's
privacy statement depends on choices made across all three: which sampler draws the batches,
under which neighbouring relation the guarantee is stated, what a record is (the privacy unit),
how records are clipped, which noise is added, which accountant certifies it, for how many steps.
A :class:`Plan` holds those choices, frozen, and answers the two questions every front end asks
before training: how many steps ``epochs`` passes are (:func:`steps_for_epochs`, one formula for
torch, Keras, the HF trainer, the numpy aggregator, the CLI and the demo) and which noise
multiplier meets a target ε (:func:`calibrate_noise`, one calibration path). ``dpcore calibrate``
and every ``target_epsilon=`` therefore give the same σ for the same run.

The plan is not the ledger: what the ledger records is what ran, and ε is always reported from
the ledger (a run longer than its plan spends more than the plan's target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Type

from .accounting.base import check_accountant
from .accounting.calibration import calibrate_noise_multiplier
from .accounting.samplers import calibrate_noise_for, calibrate_sampler_noise, poisson_start, sampler_epsilon
from ._validate import count as _count, positive as _positive, real as _real
from .sampling import Sampler, sampler_class

__all__ = [
    "CLIPPING",
    "NOISE_MECHANISMS",
    "PRIVACY_UNITS",
    "Plan",
    "calibrate_noise",
    "calibration_accountant",
    "make_plan",
    "steps_for_epochs",
]

#: The privacy units: one training example, or all the examples of one user. A user-level plan
#: gives one of two bounds (:func:`make_plan`): ``examples_per_user`` (user-level sampling, ULS:
#: users are the records) or ``max_examples_per_user`` (example-level sampling, ELS: examples are
#: sampled, the user is accounted as a mixture of Gaussians).
PRIVACY_UNITS = ("example", "user")
#: The clipping modes: one norm over the whole gradient, one per layer, or per-layer bounds
#: clipped jointly (torch only).
CLIPPING = ("flat", "per_layer", "joint")
#: The noise mechanisms: independent Gaussian or discrete Gaussian noise per step, or the
#: correlated noise of a banded or BLT matrix factorization.
NOISE_MECHANISMS = ("gaussian", "discrete_gaussian", "banded", "blt")


def steps_for_epochs(sampler: str, epochs: Any, sampling_probability: float, *,
                     steps_per_epoch: Optional[int] = None, **options: Any) -> int:
    """The steps of ``epochs`` passes over the data with ``sampler`` at rate q: ⌈epochs · k⌉ with
    k = round(1/q) for Poisson and truncated Poisson (the length of the DP loaders), ⌈1/q⌉
    batches for shuffled and fixed-order loaders (or ``steps_per_epoch``, a loader's ``len``),
    ⌊1/q⌋ fixed batches for ``cyclic``, b for balls-in-bins, and ⌈epochs/k⌉ whole rounds of t
    steps for random allocation (:meth:`dpcore.sampling.Sampler.steps_for_epochs`)."""
    return sampler_class(sampler).steps_for_epochs(epochs, sampling_probability, steps_per_epoch=steps_per_epoch,
                                                   **options)


def calibration_accountant(sampler: str, accountant: Optional[str]) -> str:
    """``accountant`` for a calibration under ``sampler`` (None: the sampler's own); PLD for an
    allocation sampler is refused (no certified PLD analysis of it is implemented)."""
    cls = sampler_class(sampler)
    if accountant is None:
        return cls.default_accountant
    if accountant == "pld" and cls.rounds == "allocation":
        raise ValueError(
            f"sampler={sampler!r} has no certified PLD analysis (only Monte Carlo estimates are published, which are not "
            "upper bounds); it is calibrated and accounted with accountant='rdp' (the default for it)"
        )
    return check_accountant(accountant)


def calibrate_noise(
    target_epsilon: float,
    target_delta: float,
    *,
    sampler: str,
    sampling_probability: float,
    steps: int,
    population_size: Optional[int] = None,
    neighboring: Optional[str] = None,
    accountant: Optional[str] = None,
    steps_per_epoch: Optional[int] = None,
    max_examples_per_user: Optional[int] = None,
    **options: Any,
) -> float:
    """The smallest noise multiplier z (from above; never over the target) such that ``steps``
    steps of ``sampler`` are (``target_epsilon``, ``target_delta``)-DP under ``neighboring``
    (None: the sampler's default relation) by ``accountant`` (None: the sampler's own).

    ``max_examples_per_user`` = K: example-level sampling with a user-level guarantee (ELS):
    Poisson sampling of examples at ``sampling_probability``, each user's data bounded to at
    most K examples, the target met for a user: z is found by a search over the
    mixture-of-Gaussians event (:func:`dpcore.events.example_level_sampling_event`, accounted by
    PLD; :func:`dpcore.accounting.samplers.calibrate_noise_for`). K = 1 is the example-level
    calibration itself.

    The one calibration path of dpcore: Poisson sampling under add-or-remove or zero-out by the
    core's calibration of the Poisson-subsampled Gaussian
    (:func:`dpcore.accounting.calibrate_noise_multiplier`), and so the batch schedules without
    amplification under zero-out (one Gaussian of z per epoch: the same routine at q = 1 over the
    epochs begun); every other sampler by a search over its own event (:func:`dpcore.accounting.samplers.calibrate_sampler_noise`)."""
    cls = sampler_class(sampler)
    rel = cls.check_relation(cls.default_relation if neighboring is None else neighboring)
    if max_examples_per_user is not None:
        k = _user_bound("max_examples_per_user", max_examples_per_user)
        _check_els(sampler, accountant)
        if k > 1:
            return _calibrate_els(target_epsilon, target_delta, sampling_probability, steps, k, rel)
    acct = calibration_accountant(sampler, accountant)
    if cls.name == "poisson" or (not cls.amplified and rel == "zero_out"):
        cls.event(1.0, steps, sampling_probability=sampling_probability, population_size=population_size,
                  neighboring=rel, steps_per_epoch=steps_per_epoch, **options)  # validates
        if cls.name == "poisson":
            return calibrate_noise_multiplier(target_epsilon, target_delta, sampling_probability, steps, accountant=acct)
        # no amplification, zero-out: C once an epoch (a participation), E Gaussians of z: the
        # Poisson-subsampled Gaussian at q = 1 over the E epochs begun
        k = cls.epoch_length(sampling_probability, steps_per_epoch=steps_per_epoch)
        return calibrate_noise_multiplier(target_epsilon, target_delta, 1.0, -(-_count("steps", steps, 1) // k),
                                          accountant=acct)
    return calibrate_sampler_noise(
        target_epsilon, target_delta, sampler, steps, sampling_probability=sampling_probability,
        population_size=population_size, accountant=acct, neighboring=rel, steps_per_epoch=steps_per_epoch,
        **options,
    )


def _user_bound(name: str, value: Any) -> int:
    """``examples_per_user`` or ``max_examples_per_user``: an int ≥ 1 (bool refused)."""
    return _count(name, value, 1)


def _check_els(sampler: str, accountant: Optional[str]) -> None:
    """What example-level sampling with a user-level guarantee needs: Poisson sampling (the
    mixture-of-Gaussians analysis is that of independently sampled examples) and the PLD
    accountant (no Rényi bound of the mixture is implemented)."""
    if sampler != "poisson":
        raise ValueError(
            f"max_examples_per_user (example-level sampling with a user-level guarantee) is accounted for Poisson "
            f"sampling of examples only, got sampler={sampler!r}; use sampler='poisson', or user-level sampling "
            "(examples_per_user=, users as the records) with this sampler"
        )
    if accountant not in (None, "pld"):
        raise ValueError(
            "max_examples_per_user is accounted by PLD only (the user is a mixture of Gaussians, and no Rényi bound "
            f"of it is implemented); got accountant={accountant!r}"
        )


def els_event(noise_multiplier: float, steps: int, sampling_probability: float, max_examples_per_user: int) -> Any:
    """``steps`` steps of example-level sampling with a user-level guarantee: the
    mixture-of-Gaussians step (:func:`dpcore.events.example_level_sampling_event`) composed
    ``steps`` times."""
    from .events import SelfComposedEvent, example_level_sampling_event

    return SelfComposedEvent(example_level_sampling_event(sampling_probability, noise_multiplier, max_examples_per_user),
                             _count("steps", steps))


def _calibrate_els(target_epsilon: float, target_delta: float, q: float, steps: int, k: int, rel: str) -> float:
    """z for ELS with K = ``k`` ≥ 2 (see :func:`calibrate_noise`); from the example-level
    calibration at the same rate (a lower start: a user costs more than an example)."""
    els_event(1.0, steps, q, k)  # validates q and steps before the search
    if _count("steps", steps) == 0:
        return 0.0
    start = poisson_start(target_epsilon, target_delta, q, steps)
    return calibrate_noise_for(lambda z: els_event(z, steps, q, k), target_epsilon, target_delta, "pld",
                               start=None if start is None else start * math.sqrt(k), neighboring="add_or_remove")


@dataclass(frozen=True)
class Plan:
    """A DP run resolved: every axis chosen, checked against the others, and the noise
    multiplier fixed (given or calibrated). Build it with :func:`make_plan`."""

    sampler: str
    sampling_probability: float
    noise_multiplier: float
    steps: int
    neighboring: str
    accountant: str
    population_size: Optional[int] = None
    sampler_options: Dict[str, Any] = field(default_factory=dict)
    steps_per_epoch: Optional[int] = None
    privacy_unit: str = "example"
    clipping: str = "flat"
    max_grad_norm: Optional[float] = None
    noise_mechanism: str = "gaussian"
    epochs: Optional[float] = None
    target_epsilon: Optional[float] = None
    target_delta: Optional[float] = None
    #: User-level sampling (ULS): each sampled user contributes the clipped mean of at most this
    #: many of its examples per step; the records are users (None: not a ULS plan).
    examples_per_user: Optional[int] = None
    #: Example-level sampling with a user-level guarantee (ELS): each user's data is bounded to at
    #: most this many examples in total, and examples are Poisson-sampled (None: not an ELS plan).
    max_examples_per_user: Optional[int] = None

    @property
    def sampler_class(self) -> Type[Sampler]:
        return sampler_class(self.sampler)

    def event(self) -> Any:
        """The accountant event of the planned steps (:meth:`dpcore.sampling.Sampler.event`);
        for ELS (``max_examples_per_user``), the mixture-of-Gaussians step composed ``steps``
        times (:func:`dpcore.events.example_level_sampling_event`). A ULS plan's event is the
        sampler's, with users as the records."""
        if self.max_examples_per_user is not None:
            return els_event(self.noise_multiplier, self.steps, self.sampling_probability, self.max_examples_per_user)
        return self.sampler_class.event(
            self.noise_multiplier, self.steps, sampling_probability=self.sampling_probability,
            population_size=self.population_size, neighboring=self.neighboring, steps_per_epoch=self.steps_per_epoch,
            **self.sampler_options,
        )

    def epsilon(self, delta: Optional[float] = None) -> float:
        """ε of the planned run at ``delta`` (default: the plan's target δ), under its relation."""
        d = self.target_delta if delta is None else delta
        if d is None:
            raise ValueError("give delta (the plan has no target_delta)")
        if self.max_examples_per_user is not None:
            from .accounting.base import make_accountant

            return make_accountant(self.accountant).compose(self.event()).get_epsilon(d)
        return sampler_epsilon(
            self.sampler, self.noise_multiplier, self.steps, d, sampling_probability=self.sampling_probability,
            population_size=self.population_size, accountant=self.accountant, neighboring=self.neighboring,
            steps_per_epoch=self.steps_per_epoch, **self.sampler_options,
        )


def make_plan(
    *,
    sampler: str = "poisson",
    sampling_probability: float,
    noise_multiplier: Optional[float] = None,
    target_epsilon: Optional[float] = None,
    target_delta: Optional[float] = None,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    population_size: Optional[int] = None,
    neighboring: Optional[str] = None,
    accountant: Optional[str] = None,
    steps_per_epoch: Optional[int] = None,
    privacy_unit: str = "example",
    clipping: str = "flat",
    max_grad_norm: Optional[float] = None,
    noise_mechanism: str = "gaussian",
    examples_per_user: Optional[int] = None,
    max_examples_per_user: Optional[int] = None,
    **options: Any,
) -> Plan:
    """Resolves a run: ``steps`` (or ``epochs``, by :func:`steps_for_epochs`), and
    ``noise_multiplier`` (or ``target_epsilon`` with ``target_delta``, by :func:`calibrate_noise`).
    Every choice is checked here, once, before anything is drawn or recorded.

    ``privacy_unit="user"`` takes exactly one of two bounds (and ``"example"`` neither):

    * ``examples_per_user=k``: user-level sampling (ULS). The sampler draws users (Poisson over
      the user population by default, ``sampling_probability`` the rate of a *user*,
      ``population_size`` the number of users) and each sampled user contributes the clipped mean
      of at most k of its examples: the plan, its ε and its calibration are the example-level
      ones with users as the records.
    * ``max_examples_per_user=K``: example-level sampling with a user-level guarantee (ELS;
      Charles et al. 2024, arXiv:2407.07737): each user's data bounded to at most K examples in
      total, examples Poisson-sampled at ``sampling_probability``; the event is the
      mixture-of-Gaussians step (Ganesh 2024) composed over the steps, accounted and calibrated
      by PLD (:func:`calibrate_noise`). Poisson sampling and Gaussian noise only.
    """
    cls = sampler_class(sampler)
    rel = cls.check_relation(cls.default_relation if neighboring is None else neighboring)
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
    if privacy_unit == "user":
        if (examples_per_user is None) == (max_examples_per_user is None):
            raise ValueError(
                "privacy_unit='user' takes exactly one of examples_per_user= (user-level sampling: users are the records, "
                "each contributes the clipped mean of at most that many examples per step) and max_examples_per_user= "
                "(example-level sampling: each user's data bounded to at most that many examples in total)"
            )
    elif examples_per_user is not None or max_examples_per_user is not None:
        given = "examples_per_user" if examples_per_user is not None else "max_examples_per_user"
        raise ValueError(f"{given} bounds a user's contribution: it needs privacy_unit='user' (got {privacy_unit!r})")
    k_uls = None if examples_per_user is None else _user_bound("examples_per_user", examples_per_user)
    k_els = None if max_examples_per_user is None else _user_bound("max_examples_per_user", max_examples_per_user)
    if k_els is not None:
        _check_els(sampler, accountant)
        if noise_mechanism != "gaussian":
            raise ValueError(
                f"max_examples_per_user is accounted for Gaussian noise (a mixture of Gaussians), got "
                f"noise_mechanism={noise_mechanism!r}"
            )
    if clipping not in CLIPPING:
        raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
    if noise_mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"noise_mechanism must be one of {NOISE_MECHANISMS}, got {noise_mechanism!r}")
    if noise_mechanism != "gaussian" and target_epsilon is not None:
        raise ValueError(
            f"a plan calibrates the Gaussian mechanism; for noise_mechanism={noise_mechanism!r} give noise_multiplier "
            "(matrix-factorization noise: dpcore.matrix_factorization.calibrate_noise_multiplier)"
        )
    opts = cls.check_options(options)
    if (steps is None) == (epochs is None):
        raise TypeError("give steps or epochs (not both)")
    s = _count("steps", steps, 1) if steps is not None else steps_for_epochs(
        sampler, epochs, sampling_probability, steps_per_epoch=steps_per_epoch, **opts)
    if (noise_multiplier is None) == (target_epsilon is None):
        raise TypeError("give noise_multiplier, or target_epsilon with target_delta (not both)")
    acct = calibration_accountant(sampler, accountant)
    if noise_multiplier is None:
        if target_delta is None:
            raise TypeError("target_epsilon needs target_delta")
        z = calibrate_noise(target_epsilon, target_delta, sampler=sampler,  # type: ignore[arg-type]
                            sampling_probability=sampling_probability, steps=s, population_size=population_size,
                            neighboring=rel, accountant=acct, steps_per_epoch=steps_per_epoch,
                            max_examples_per_user=k_els, **opts)
    else:
        z = _positive("noise_multiplier", noise_multiplier, allow_zero=True)
    e = None if epochs is None else _real("epochs", epochs)
    if e is not None and not (math.isfinite(e) and e > 0):
        raise ValueError(f"epochs must be finite and > 0, got {epochs!r}")
    return Plan(
        sampler=sampler, sampling_probability=float(sampling_probability), noise_multiplier=float(z), steps=s,
        neighboring=rel, accountant=acct, population_size=population_size,
        sampler_options={k: v for k, v in opts.items() if v is not None and not (k == "num_selected" and v == 1)},
        steps_per_epoch=steps_per_epoch, privacy_unit=privacy_unit, clipping=clipping, max_grad_norm=max_grad_norm,
        noise_mechanism=noise_mechanism, epochs=e, target_epsilon=target_epsilon, target_delta=target_delta,
        examples_per_user=k_uls, max_examples_per_user=k_els,
    )
