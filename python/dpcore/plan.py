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
from .accounting.samplers import calibrate_sampler_noise, sampler_epsilon
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

#: The privacy units: one training example, or all the examples of one user (a later issue).
PRIVACY_UNITS = ("example",)
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
    **options: Any,
) -> float:
    """The smallest noise multiplier z (from above; never over the target) such that ``steps``
    steps of ``sampler`` are (``target_epsilon``, ``target_delta``)-DP under ``neighboring``
    (None: the sampler's default relation) by ``accountant`` (None: the sampler's own).

    The one calibration path of dpcore: Poisson sampling under add-or-remove or zero-out by the
    core's calibration of the Poisson-subsampled Gaussian
    (:func:`dpcore.accounting.calibrate_noise_multiplier`), and so the batch schedules without
    amplification under zero-out (one Gaussian of z per epoch: the same routine at q = 1 over the
    epochs begun); every other sampler by a search over its own event (:func:`dpcore.accounting.samplers.calibrate_sampler_noise`)."""
    cls = sampler_class(sampler)
    rel = cls.check_relation(cls.default_relation if neighboring is None else neighboring)
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

    @property
    def sampler_class(self) -> Type[Sampler]:
        return sampler_class(self.sampler)

    def event(self) -> Any:
        """The accountant event of the planned steps (:meth:`dpcore.sampling.Sampler.event`)."""
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
    **options: Any,
) -> Plan:
    """Resolves a run: ``steps`` (or ``epochs``, by :func:`steps_for_epochs`), and
    ``noise_multiplier`` (or ``target_epsilon`` with ``target_delta``, by :func:`calibrate_noise`).
    Every choice is checked here, once, before anything is drawn or recorded."""
    cls = sampler_class(sampler)
    rel = cls.check_relation(cls.default_relation if neighboring is None else neighboring)
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
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
                            neighboring=rel, accountant=acct, steps_per_epoch=steps_per_epoch, **opts)
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
    )
