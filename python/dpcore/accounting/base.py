"""The accountant interface, separate from the events it reads (as in Google's dp_accounting).

An accountant is told what a run released, as events (:mod:`dpcore.events`), with
:meth:`PrivacyAccountant.compose`, and answers with an (ε, δ) guarantee:
:meth:`get_epsilon` (the smallest ε it certifies at δ) or :meth:`get_delta`. Every value it
returns is an upper bound on the true one.

Two accountants implement it: :class:`dpcore.accounting.PldAccountant` (privacy loss
distributions, the tightest, the default everywhere) and :class:`dpcore.accounting.RdpAccountant`
(Rényi DP). :func:`make_accountant` builds one by name.
"""

from __future__ import annotations

import abc
import math
import numbers
from typing import Any

from ..events import Event

#: Accountant names accepted by every ``accountant=`` argument of the library.
ACCOUNTANTS = ("pld", "rdp")
#: The default: the tightest certified accountant.
DEFAULT_ACCOUNTANT = "pld"
NEIGHBORING = ("add_or_remove", "replace_one")


class UnsupportedEventError(ValueError):
    """An accountant was given an event it cannot analyse; the message names the event and an
    accountant that can (if any)."""


class PrivacyAccountant(abc.ABC):
    """Abstract accountant: ``supports``, ``compose``, ``get_epsilon``, ``get_delta``."""

    #: ``"pld"`` or ``"rdp"``.
    name: str = ""

    def __init__(self, neighboring: str = "add_or_remove") -> None:
        if neighboring not in NEIGHBORING:
            raise ValueError(f"neighboring must be one of {NEIGHBORING}, got {neighboring!r}")
        self._neighboring = neighboring

    @property
    def neighboring(self) -> str:
        """The neighbouring relation the guarantee is stated for."""
        return self._neighboring

    @abc.abstractmethod
    def supports(self, event: Event) -> bool:
        """Whether :meth:`compose` can analyse ``event`` (under this accountant's relation)."""

    @abc.abstractmethod
    def compose(self, event: Event, count: int = 1) -> "PrivacyAccountant":
        """Records ``count`` runs of ``event``; returns the accountant. Raises
        :class:`UnsupportedEventError` (and records nothing) for an event it cannot analyse."""

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """The smallest ε this accountant certifies at ``delta`` (inf if none)."""

    @abc.abstractmethod
    def get_delta(self, epsilon: float) -> float:
        """The smallest δ this accountant certifies at ``epsilon``."""


def check_delta(delta: Any) -> float:
    """δ as a float; ValueError unless 0 < δ < 1 (TypeError for a non-number)."""
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real):
        raise TypeError(f"delta must be a real number, got {type(delta).__name__}")
    d = float(delta)
    if not 0.0 < d < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {d}")
    return d


def check_epsilon(epsilon: Any) -> float:
    """ε as a float; ValueError for ε < 0 or NaN (inf is allowed: δ = 0 there)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError(f"epsilon must be a real number, got {type(epsilon).__name__}")
    e = float(epsilon)
    if math.isnan(e) or e < 0:
        raise ValueError(f"epsilon must be >= 0, got {e}")
    return e


def check_accountant(accountant: Any) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    return accountant


def make_accountant(accountant: str = DEFAULT_ACCOUNTANT, neighboring: str = "add_or_remove", **kw: Any) -> PrivacyAccountant:
    """A fresh accountant by name: ``"pld"`` → :class:`PldAccountant`, ``"rdp"`` →
    :class:`RdpAccountant` (keyword arguments go to its constructor)."""
    check_accountant(accountant)
    if accountant == "pld":
        from .pld import PldAccountant

        return PldAccountant(neighboring=neighboring, **kw)
    from .rdp import RdpAccountant

    return RdpAccountant(neighboring=neighboring, **kw)
