"""Privacy events: an immutable description of what a training run did, to be accounted.

Defined in :mod:`dpcore.events` (the one event vocabulary of the package, shared with the
queries and the ledger); re-exported here so that ``dpcore.accounting.events`` keeps working.
The vocabulary mirrors Google's ``dp_accounting`` (see :mod:`dpcore.accounting.interop`).
"""

from ..events import *  # noqa: F401,F403 (the accountant events named below)
from ..events import ACCOUNTANT_EVENTS

__all__ = list(ACCOUNTANT_EVENTS)
