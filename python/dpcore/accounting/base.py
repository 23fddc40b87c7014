"""The accountant interface, separate from the events it reads (as in Google's dp_accounting).

An accountant is told what a run released, as events (:mod:`dpcore.events`), with
:meth:`PrivacyAccountant.compose`, and answers with an (ε, δ) guarantee:
:meth:`get_epsilon` (the smallest ε it certifies at δ) or :meth:`get_delta`. Every value it
returns is an upper bound on the true one.

Two accountants implement it: :class:`dpcore.accounting.PldAccountant` (privacy loss
distributions, the tightest, the default everywhere) and :class:`dpcore.accounting.RdpAccountant`
(Rényi DP). Each registers itself under its name (:func:`register_accountant`) when
:mod:`dpcore.accounting` imports it, and :func:`make_accountant` builds one by name: this module
names no implementation, so that they can all import it.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Dict, Type, TypeVar

from .._validate import count as _count
from ..events import Event
from ._params import NEIGHBORING, check_delta, check_epsilon  # noqa: F401 (imported from here by the ledger, study)

#: The accountants by name (``"pld"``, ``"rdp"``): the names every ``accountant=`` argument of the
#: library accepts, each mapped to its class. Filled by :func:`register_accountant`.
ACCOUNTANTS: Dict[str, Type["PrivacyAccountant"]] = {}
#: The default: the tightest certified accountant.
DEFAULT_ACCOUNTANT = "pld"

_Self = TypeVar("_Self", bound="PrivacyAccountant")


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

    def supports(self, event: Event) -> bool:
        """Whether :meth:`compose` can analyse ``event`` (under this accountant's relation). It
        runs the traversal :meth:`compose` runs (:meth:`_tally`), so the two cannot disagree."""
        if not isinstance(event, Event):
            return False
        try:
            self._tally(event, 1)
        except (TypeError, ValueError):
            return False
        return True

    def compose(self: _Self, event: Event, count: int = 1) -> _Self:
        """Records ``count`` runs of ``event``; returns the accountant (for chaining). Raises
        :class:`UnsupportedEventError` (TypeError for an event whose parts are of the wrong
        kind) and records nothing for an event it cannot analyse."""
        if not isinstance(event, Event):
            raise TypeError(f"event must be an Event, got {type(event).__name__}")
        count = _count("count", count)
        self._record(self._tally(event, count))
        return self

    @abc.abstractmethod
    def _tally(self, event: Event, count: int) -> Any:
        """What ``count`` runs of ``event`` would add to this accountant, computed without
        changing it; raises for an event it cannot analyse. The one traversal of events, shared
        by :meth:`supports` and :meth:`compose` (as dp_accounting's ``_maybe_compose``)."""

    @abc.abstractmethod
    def _record(self, tally: Any) -> None:
        """Adds a tally from :meth:`_tally` to what this accountant has composed."""

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """The smallest ε this accountant certifies at ``delta`` (inf if none)."""

    @abc.abstractmethod
    def get_delta(self, epsilon: float) -> float:
        """The smallest δ this accountant certifies at ``epsilon``."""


_Cls = TypeVar("_Cls", bound=Type[PrivacyAccountant])


def register_accountant(name: str) -> Callable[[_Cls], _Cls]:
    """Class decorator: registers an accountant under ``name`` in :data:`ACCOUNTANTS` (and sets
    its :attr:`~PrivacyAccountant.name`), so that :func:`make_accountant` and every
    ``accountant=`` argument reach it. ValueError if another class holds the name already."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"an accountant's name must be a non-empty str, got {name!r}")

    def register(cls: _Cls) -> _Cls:
        if not (isinstance(cls, type) and issubclass(cls, PrivacyAccountant)):
            raise TypeError(f"only a PrivacyAccountant subclass can be registered, got {cls!r}")
        held = ACCOUNTANTS.get(name)
        # The same class defined again (a module reloaded) takes its name back.
        if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"accountant name {name!r} is registered to {held.__module__}.{held.__qualname__}")
        cls.name = name
        ACCOUNTANTS[name] = cls
        return cls

    return register


def check_accountant(accountant: Any) -> str:
    if not isinstance(accountant, str) or accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {tuple(sorted(ACCOUNTANTS))}, got {accountant!r}")
    return accountant


def make_accountant(accountant: str = DEFAULT_ACCOUNTANT, neighboring: str = "add_or_remove", **kw: Any) -> PrivacyAccountant:
    """A fresh accountant by name: ``"pld"`` → :class:`PldAccountant`, ``"rdp"`` →
    :class:`RdpAccountant` (keyword arguments go to its constructor)."""
    return ACCOUNTANTS[check_accountant(accountant)](neighboring=neighboring, **kw)
