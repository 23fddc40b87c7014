"""The declaration of a matrix-factorization stream (strategy, participation schema, planned
steps): what a matrix-factorization query writes into its ledger entries and what the ledger reads
back. Kept apart from :mod:`._accounting` so that the ledger's storage layer can parse a
declaration without the accountants (Choquette-Choo et al. 2022, arXiv 2211.06530, §2: the
sensitivity is a function of the strategy and the participation schema alone)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .._validate import count
from ._participation import CYCLIC_POISSON, Participation, canonical_json
from ._strategies import ToeplitzStrategy, strategy_from_dict


def _check_pair(strategy: Any, participation: Any) -> None:
    if not isinstance(strategy, ToeplitzStrategy):
        raise TypeError(f"strategy must be a ToeplitzStrategy (BandedStrategy, BLTStrategy), got {type(strategy).__name__}")
    if not isinstance(participation, Participation):
        raise TypeError(f"participation must be a Participation, got {type(participation).__name__}")
    if participation.kind == CYCLIC_POISSON:
        strategy.check_cyclic_poisson(participation)


@dataclass(frozen=True)
class StreamDeclaration:
    """What a matrix-factorization query declares about its stream: the strategy C, the
    participation schema the data pipeline follows, and the steps it plans.

    It is the ``declaration`` of a ``SumQueryEvent(mechanism="matrix_factorization")``
    (:meth:`to_json`) and the ``mf_stream`` entry of the ledger; the ledger's accountant
    rebuilds it from there (:meth:`from_json`) and recomputes the sensitivity for the steps that
    actually ran (:meth:`sensitivity`)."""

    strategy: ToeplitzStrategy
    participation: Participation
    steps: int

    def __post_init__(self) -> None:
        _check_pair(self.strategy, self.participation)
        object.__setattr__(self, "steps", count("steps", self.steps, 1))

    def to_dict(self) -> Dict[str, Any]:
        return {"strategy": self.strategy.to_dict(), "participation": self.participation.to_dict(), "steps": self.steps}

    def to_json(self) -> str:
        """The canonical JSON text (sorted keys, exact floats): equal declarations give equal texts."""
        return canonical_json(self.to_dict())

    @staticmethod
    def from_dict(d: Any) -> "StreamDeclaration":
        if not isinstance(d, dict) or set(d) != {"strategy", "participation", "steps"}:
            raise ValueError(f"not a stream declaration (keys strategy, participation, steps): {d!r}"[:300])
        try:
            return StreamDeclaration(strategy_from_dict(d["strategy"]), Participation.from_dict(d["participation"]), d["steps"])
        except TypeError as e:  # a field of the wrong type: still "not a declaration"
            raise ValueError(f"stream declaration: {e}") from None

    @staticmethod
    def from_json(text: Any) -> "StreamDeclaration":
        """Rebuilds a declaration from its JSON text; ValueError (TypeError for a non-str) if it
        is not one, or if its strategy cannot serve its participation schema."""
        if not isinstance(text, str):
            raise TypeError(f"declaration must be a JSON str, got {type(text).__name__}")
        return _from_json(text)

    def sensitivity(self, steps: Optional[int] = None) -> float:
        """sens(C) for ``steps`` steps (default: the planned ones) under the schema, per unit of
        clip norm: exact, rounded up (:meth:`ToeplitzStrategy.sensitivity`)."""
        n = self.steps if steps is None else count("steps", steps, 1)
        return _sensitivity(self.to_json(), n)

    def describe(self) -> str:
        return f"{self.strategy.describe()}; {self.participation.describe()}; {self.steps} planned steps"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid value")


@functools.lru_cache(maxsize=256)
def _from_json(text: str) -> StreamDeclaration:
    try:
        d = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise ValueError(f"declaration is not valid JSON: {e}") from None
    return StreamDeclaration.from_dict(d)


@functools.lru_cache(maxsize=1024)
def _sensitivity(text: str, steps: int) -> float:
    dec = _from_json(text)
    return dec.strategy.sensitivity(steps, dec.participation)
