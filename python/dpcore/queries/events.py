"""What a query released, as privacy tuples: the sum-query events of McMahan et al. 2018, §6.

Defined in :mod:`dpcore.events` (the one event vocabulary of the package, shared with the ledger
and the accountants); re-exported here so that ``dpcore.queries.events`` keeps working.

A Gaussian sum query over one group of vectors is fully described, for privacy, by its privacy
tuple (S_g, σ̃_g): the L2 bound of one record's contribution to the sum and the stddev of the
noise added to the sum (§1 and §2 of the paper). The queries return these events from
``get_noised_result``; the ledger stores them and converts each sample's tuples into one
Gaussian event with Eq. (1).
"""

from ..events import *  # noqa: F401,F403 (the query events named below)
from ..events import QUERY_EVENTS

__all__ = list(QUERY_EVENTS)
