"""From ledger entries to one accountant event (McMahan et al. 2018, §6).

The storage layer (:mod:`._storage`) knows what was recorded; this module knows how an
accountant must read it: which event each sampling policy becomes, what the recorded S_g mean
under each neighbouring relation, and which samples deserve a warning.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Sequence

from ._storage import FIXED_SIZE, POISSON, LedgerSample, LedgerWarning

NEIGHBORING = ("add_or_remove", "replace_one")


def check_neighboring(neighboring: Any) -> str:
    if neighboring not in NEIGHBORING:
        raise ValueError(f"neighboring must be 'add_or_remove' or 'replace_one', got {neighboring!r}")
    return neighboring


def _runs(samples: Any) -> Any:
    """(sample, count) pairs: the ledger's runs of identical samples, or each sample once."""
    runs = getattr(samples, "runs", None)
    return runs() if runs is not None else [(s, 1) for s in samples]


def samples_to_event(
    samples: Sequence[LedgerSample], path: str, neighboring: str = "add_or_remove", *, stacklevel: int = 3
) -> Any:
    """The samples of the ledger at ``path`` as one accountant event; see
    :meth:`dpcore.ledger.PrivacyLedger.to_event`. ``stacklevel`` (as for :func:`warnings.warn`
    from here) attributes the shuffle and seed warnings; the default names the caller of
    ``PrivacyLedger.to_event``."""
    # Looked up at call time, not imported with the module: the accountant's event classes are
    # what dpcore.accounting exports when the ledger is accounted (the ledger's tests put a
    # stand-in for that contract there to test this conversion on its own).
    from .. import accounting as acc

    check_neighboring(neighboring)
    scale = 1.0 if neighboring == "add_or_remove" else 0.5
    events: List[Any] = []
    shuffled = seeded = 0
    for s, count in _runs(samples):
        if not s.released:
            continue
        z = s.noise_multiplier() * scale
        # A sample with any discrete Gaussian query is one discrete Gaussian mechanism with the
        # z of Eq. (1): Gaussian groups beside it have the same Rényi curve α/(2z_g²), so the
        # product's curve is α/(2z²) either way (CKS 2020, Theorem 14).
        base = acc.DiscreteGaussianEvent(z) if s.discrete else acc.GaussianEvent(z) if z else None
        if z == 0.0:
            ev: Any = acc.NonPrivateEvent()
        elif s.policy == POISSON:
            ev = acc.PoissonSampledEvent(s.sampling_probability, base)
        elif s.policy == FIXED_SIZE:
            ev = acc.SampledWithoutReplacementEvent(s.population_size, s.sample_size, base)
        else:
            shuffled += count
            ev = base
        seeded += s.seeded * count
        if events and events[-1][0] == ev:
            events[-1][1] += count
        else:
            events.append([ev, count])
    if shuffled:
        warnings.warn(
            f"{path}: {shuffled} sample(s) used the shuffle policy; they are accounted without "
            "sampling amplification (each as a full Gaussian query on the whole data set), because a "
            "shuffled epoch is not a random sample and has no tight analysis (McMahan et al. 2018, §5). "
            "Use poisson sampling to get amplification.",
            LedgerWarning,
            stacklevel=stacklevel,
        )
    if seeded:
        warnings.warn(
            f"{path}: {seeded} sample(s) were drawn from a test seed; a seeded sample is predictable, "
            "so the amplification counted for it does not hold. Seeds are for tests only.",
            LedgerWarning,
            stacklevel=stacklevel,
        )
    parts = [e if k == 1 else acc.SelfComposedEvent(e, k) for e, k in events]
    return acc.ComposedEvent(tuple(parts))


def rdp_relation_error(samples: Sequence[LedgerSample], path: str, neighboring: str) -> "str | None":
    """Why the RDP accountant cannot account these samples under ``neighboring``, or None.

    Its analyses exist for Poisson samples under add-or-remove and for fixed-size samples
    without replacement under replace-one only; a ledger is accounted under one relation.
    """
    policies = {s.policy for s, _ in _runs(samples) if s.released and s.noise_multiplier() > 0}
    if neighboring == "add_or_remove" and FIXED_SIZE in policies:
        return (
            f"{path}: the ledger holds fixed_size_without_replacement samples, which the RDP "
            "accountant analyses only under neighboring='replace_one'"
            + ("; it also holds poisson samples (add_or_remove only), so it cannot be accounted as one"
               if POISSON in policies else "")
        )
    if neighboring == "replace_one" and POISSON in policies:
        return (
            f"{path}: the ledger holds poisson samples, which the RDP accountant analyses only "
            "under neighboring='add_or_remove'"
        )
    return None
