"""Record sampling from ChaCha20 (McMahan et al. 2018, §5; Abadi et al. 2016, "lots").

The sampling probability feeds privacy amplification in the accountant, so the sample must come
from a cryptographically secure generator: every sampler is keyed from the OS on every call (a
step, for the sampler classes). ``seed`` is for tests and reproductions only; a seeded sample is
predictable and gives no amplification in truth (the ledger marks it ``seeded`` and the
accountant warns).

Given ``ledger=`` (a :class:`dpcore.ledger.PrivacyLedger`), a sampler records the sampling event
with the policy it actually used (§6); the entry becomes durable with the sample's first release.
The accountant then analyses the sampling that was run, not another one:

========================  =======================  ==================================================  ==========================================
sampler                   ledger policy            what the accountant assumes                         event
========================  =======================  ==================================================  ==========================================
poisson_sample            ``poisson``              each record in each step independently with         ``PoissonSampledEvent(q, ·)`` per step
                                                   probability q
TruncatedPoissonSampler   ``truncated_poisson``    Poisson at q, then, when more than B records were   ``TruncatedPoissonSampledEvent(q, B, n,
                                                   drawn, a uniformly random B of them (one such       ·)`` per step
                                                   step: truncated_poisson_sample)
fixed_size_sample         ``fixed_size_without_    b of the n records uniformly without replacement    ``SampledWithoutReplacementEvent(n, b,
                          replacement``            (replace-one: n is public)                          ·)`` per step
RandomAllocationSampler   ``random_allocation``    every record in exactly k of each round's t steps,  ``RandomAllocationSampledEvent(t, k, ·)``
                                                   a uniformly random k-subset, independently of the   per round (Feldman & Shenfeld 2025,
                                                   other records                                       arXiv 2502.08202)
BallsInBinsSampler        ``balls_in_bins``        every record in exactly one of each epoch's b       ``BallsInBinsSampledEvent(b, ·)`` per
                                                   steps, uniformly and independently                  epoch (Chua et al. 2025, arXiv 2412.16802)
CyclicSampler             ``cyclic``               fixed batches cut once, batch t mod b: no           accounted per matrix-factorization stream
                                                   amplification
CyclicPoissonSampler      ``cyclic_poisson``       group t mod b of a partition cut once, each of its  accounted per matrix-factorization stream
                                                   records with probability p
ShuffleSampler            ``shuffle``              a fresh permutation every epoch cut into batches    one Gaussian per epoch (no amplification)
SequentialSampler         ``sequential``           the records in order, cut into batches              one Gaussian per epoch (no amplification)
========================  =======================  ==================================================  ==========================================

Every sampler is a class of the :class:`Sampler` protocol, registered by its name
(:func:`register_sampler`; :mod:`._base` describes what a sampler owns), one module per variant.
The ledger, the accountants' defaults, the report, the CLI and the adapters ask the registry
(:func:`sampler_class`), so a new sampler is one class and one registration.

Each sampler class has :meth:`accountant_event`: the event of its next ``steps`` steps with a
Gaussian of a given noise multiplier, for calibrating the noise before a run
(:func:`poisson_accountant_event` for :func:`poisson_sample`).
"""

from __future__ import annotations

from ._base import NEIGHBORING, Sampler, register_sampler, registered_samplers, sampler_class

# The built-in samplers, registered in this order (the order of every listing of them).
from ._poisson import PoissonSampler, poisson_accountant_event, poisson_sample
from ._truncated_poisson import TruncatedPoissonSampler, truncated_poisson_sample
from ._allocation import BallsInBinsSampler, RandomAllocationSampler, steps_per_round
from ._shuffle import ShuffleSampler
from ._sequential import SequentialSampler
from ._cyclic import CyclicPoissonSampler, CyclicSampler
from ._fixed_size import FixedSizeSampler, fixed_size_sample
from ._users import UserIndex, check_examples_per_user
from ._padding import padded_size, physical_chunks

__all__ = [
    "NEIGHBORING",
    "BallsInBinsSampler",
    "CyclicSampler",
    "CyclicPoissonSampler",
    "FixedSizeSampler",
    "PoissonSampler",
    "RandomAllocationSampler",
    "Sampler",
    "SequentialSampler",
    "ShuffleSampler",
    "TruncatedPoissonSampler",
    "UserIndex",
    "check_examples_per_user",
    "fixed_size_sample",
    "padded_size",
    "physical_chunks",
    "poisson_accountant_event",
    "poisson_sample",
    "register_sampler",
    "registered_samplers",
    "sampler_class",
    "steps_per_round",
    "truncated_poisson_sample",
]


def __getattr__(name: str) -> object:
    # CyclicBatches was the sampler's name before the samplers were named *Sampler (the Keras
    # dataset dpcore.tensorflow.CyclicBatches keeps its name, like the other *Batches datasets)
    if name == "CyclicBatches":
        import warnings

        warnings.warn("dpcore.sampling.CyclicBatches is deprecated; it is called CyclicSampler now",
                      DeprecationWarning, stacklevel=2)
        return CyclicSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
