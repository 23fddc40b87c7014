"""Participation schemas: how often, and how far apart, one record takes part in the releases.

Matrix-factorization mechanisms need no random sampling; their sensitivity is taken over every
participation pattern the data pipeline allows (Choquette-Choo et al. 2022, arXiv 2211.06530,
§2 "(k, b)-participation"; Choquette-Choo et al. 2023, "Amplified banded matrix factorization",
arXiv 2306.08153, §3 for cyclic Poisson sampling).

* **cyclic** (``min_separation`` b): the records are cut once into b fixed batches and batch
  t mod b is used at step t (shuffle once, then repeat the same order each epoch). A record takes
  part at most ⌈n/b⌉ times in n steps, exactly b steps apart. One epoch (b ≥ n) is the
  single-participation schema of streaming data.
* **cyclic_poisson** (b, ``sampling_probability`` p): the records are cut once into b groups;
  at step t each record of group t mod b is included independently with probability p (amplified
  banded MF). Needs a banded strategy with at most b bands.

This module is pure math and imports nothing above :mod:`dpcore._validate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .._validate import count, probability

CYCLIC = "cyclic"
CYCLIC_POISSON = "cyclic_poisson"


@dataclass(frozen=True)
class Participation:
    """A participation schema (see the module docstring).

    ``min_separation`` is b, the cycle length: the number of batches (or groups) the records are
    cut into, and the steps between two participations of one record. ``max_participations`` is
    k, the participations the strategy was optimised for (None: as many as the steps allow); it
    never lowers the accounted count, which is ⌈steps/b⌉ for what actually ran.
    ``sampling_probability`` is p for cyclic Poisson sampling, None for fixed batches.
    """

    min_separation: int
    max_participations: Optional[int] = None
    sampling_probability: Optional[float] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_separation", count("min_separation", self.min_separation, 1))
        if self.max_participations is not None:
            object.__setattr__(self, "max_participations", count("max_participations", self.max_participations, 1))
        if self.sampling_probability is not None:
            p = probability("sampling_probability", self.sampling_probability)
            if p == 0.0:
                raise ValueError("sampling_probability must be > 0 for cyclic Poisson sampling")
            object.__setattr__(self, "sampling_probability", p)

    # -- constructors ----------------------------------------------------------------------

    @staticmethod
    def single_epoch(steps: int) -> "Participation":
        """Each record takes part once in ``steps`` steps (one pass over a stream)."""
        return Participation(count("steps", steps, 1), 1)

    @staticmethod
    def cyclic(batches_per_epoch: int, epochs: Optional[int] = None) -> "Participation":
        """Fixed batches cycled in the same order: a record every ``batches_per_epoch`` steps."""
        return Participation(batches_per_epoch, epochs)

    @staticmethod
    def cyclic_poisson(cycle_length: int, sampling_probability: float, cycles: Optional[int] = None) -> "Participation":
        """Amplified banded MF's sampling: group t mod b, each of its records with probability p."""
        return Participation(cycle_length, cycles, sampling_probability)

    # -- what the schema implies -------------------------------------------------------------

    @property
    def kind(self) -> str:
        return CYCLIC if self.sampling_probability is None else CYCLIC_POISSON

    def participations(self, steps: int) -> int:
        """The most times one record takes part in the first ``steps`` steps: ⌈steps/b⌉.

        ``max_participations`` is not used here: a loader that ran past the planned epochs must
        be accounted for what it did."""
        s = count("steps", steps, 0)
        return -(-s // self.min_separation)

    def planned_participations(self, steps: int) -> int:
        """Participations the strategy is optimised for in ``steps`` steps."""
        k = self.participations(steps)
        return k if self.max_participations is None else min(k, self.max_participations)

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"kind": self.kind, "min_separation": self.min_separation}
        if self.max_participations is not None:
            d["max_participations"] = self.max_participations
        if self.sampling_probability is not None:
            d["sampling_probability"] = self.sampling_probability
        return d

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "Participation":
        if not isinstance(d, dict) or d.get("kind") not in (CYCLIC, CYCLIC_POISSON):
            raise ValueError(f"not a participation schema: {d!r}")
        extra = set(d) - {"kind", "min_separation", "max_participations", "sampling_probability"}
        if extra:
            raise ValueError(f"participation schema: unexpected keys {sorted(extra)}")
        p = Participation(d.get("min_separation"), d.get("max_participations"), d.get("sampling_probability"))  # type: ignore[arg-type]
        if p.kind != d["kind"]:
            raise ValueError(f"participation schema: kind {d['kind']!r} does not match its fields")
        return p

    def describe(self) -> str:
        b = self.min_separation
        if self.kind == CYCLIC_POISSON:
            return f"cyclic Poisson sampling: {b} groups, group t mod {b} at step t, each record with probability {self.sampling_probability:g}"
        k = "" if self.max_participations is None else f", planned for {self.max_participations} participation(s)"
        return f"cyclic fixed batches: each record at most once every {b} steps{k}"


def canonical_json(d: Dict[str, Any]) -> str:
    """The one JSON text of a dict (sorted keys, exact floats), for hashing and comparing."""
    return json.dumps(d, sort_keys=True, allow_nan=False, separators=(",", ":"))


__all__ = ["Participation", "CYCLIC", "CYCLIC_POISSON", "canonical_json"]
