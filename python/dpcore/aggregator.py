"""PrivateAggregator: the three concerns of McMahan et al. 2018 wired together (§1, §6).

Training code (a) calls :meth:`PrivateAggregator.sample` for the indices of the next sample and
:meth:`PrivateAggregator.aggregate` with those records' per-record arrays; the query (b) clips
and noises them; the ledger records the sampling event and the released sum queries and makes
them durable *before* the noised result is returned, so that the accountant (c) can never miss a
released step, even after a crash.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from .ledger import FIXED_SIZE, POISSON, PrivacyLedger
from .mechanism import check_on_nonfinite, nonfinite_error
from ._attrs import readonly
from ._names import renamed
from ._validate import count, integer, probability
from .queries.base import DPQuery
from .sampling import (
    CyclicPoissonSampler,
    CyclicSampler,
    Sampler,
    check_examples_per_user,
    fixed_size_sample,
    poisson_sample,
    registered_samplers,
    sampler_class,
)

#: The samplers of the matrix-factorization participation schemas.
_CYCLIC = (CyclicSampler, CyclicPoissonSampler)

__all__ = ["PrivateAggregator", "RecordSpec"]


class RecordSpec:
    """Shape and dtype of one record's array (a template for ``initial_sample_state``)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Any, dtype: Any) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    def __repr__(self) -> str:
        return f"RecordSpec({self.shape}, {self.dtype})"


def _arrays(nest: Any, out: List[np.ndarray]) -> Any:
    """The template of a batch nest, collecting its arrays into ``out``."""
    if isinstance(nest, dict):
        return {k: _arrays(v, out) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        t = [_arrays(v, out) for v in nest]
        return tuple(t) if isinstance(nest, tuple) else t
    a = nest if isinstance(nest, np.ndarray) else np.asarray(nest)
    if a.ndim == 0:
        raise ValueError("records need a leading record axis, got a 0-d array")
    out.append(a)
    return RecordSpec(a.shape[1:], a.dtype)


class PrivateAggregator:
    """Samples records, privatizes their aggregate with a query, and ledgers every release.

    * ``query``: any :class:`dpcore.queries.DPQuery` (a :class:`NestedQuery` for several groups).
    * ``ledger``: a :class:`dpcore.ledger.PrivacyLedger` open for writing.
    * ``population_size``: n, the number of records (examples, users) sampled from.
    * ``sampling_probability``: q for ``sampler="poisson"`` (the default; the sampling the
      subsampled-Gaussian accountant assumes, §5). For ``sampler="fixed_size_without_replacement"``
      give ``sample_size`` = b instead. Those two the aggregator draws itself, by name.
    * ``sampler``: one of those two names, or a sampler object of :mod:`dpcore.sampling`
      recording into ``ledger``: :class:`~dpcore.sampling.TruncatedPoissonSampler` (Poisson with a cap on the
      batch), :class:`~dpcore.sampling.RandomAllocationSampler` or
      :class:`~dpcore.sampling.BallsInBinsSampler` (every record in exactly k of a round's t
      steps), or :class:`~dpcore.sampling.CyclicSampler` /
      :class:`~dpcore.sampling.CyclicPoissonSampler`, the participation schemas of
      matrix-factorization queries (:class:`dpcore.queries.MatrixFactorizationQuery`, whose
      ``participation`` must be the sampler's; such a query takes no other sampler).
      ``population_size`` must be the sampler's. (``policy=``, the name of the aggregator's own
      draws before, is a deprecated alias of ``sampler=``.)

    ``sample()`` draws the indices from ChaCha20 and records the sampling event; ``aggregate``
    takes the records of exactly those indices (leading axis = sample size), runs the query's
    lifecycle, writes the release to the ledger (fsync) and only then returns the noised result.
    ``seed`` arguments are for tests only and void the privacy guarantee.

    ``on_nonfinite``: ``"zero"`` (the default) hands every record to the query, whose clip gives a
    record with a NaN or ±∞ value zero contribution (the clipping queries do unless built with
    ``on_nonfinite="raise"``): the release goes ahead, and whether it does reveals nothing about
    that record. ``"raise"`` checks the records first and raises ``ValueError`` naming the first
    non-finite one, releasing nothing (the sample stays open): a debugging aid whose behaviour
    depends on the data, **not differentially private**.

    The privacy unit (issue 40): a record may be one example or **all the data of one user**
    (federated averaging, McMahan et al. 2018 §1: each record is one user's model update, clipped
    and noised as one). ``privacy_unit``: ``"example"`` or ``"user"``, which must be the
    ledger's unit (open it with ``PrivacyLedger(path, privacy_unit="user")``; None, the
    default: whatever the ledger records). ``population_size`` and ``sampling_probability`` are
    then the number of users and each user's rate, and the ledger's ε is user-level.
    ``examples_per_user``: the most examples that went into one user's record at a step (the
    bound of user-level sampling), recorded with every sample of the aggregator's own draws
    (``"poisson"`` or ``"fixed_size_without_replacement"``); user unit only.
    """

    def __init__(
        self,
        query: DPQuery,
        ledger: PrivacyLedger,
        population_size: int,
        sampling_probability: Optional[float] = None,
        *,
        sample_size: Optional[int] = None,
        sampler: Any = None,
        policy: Optional[str] = None,
        on_nonfinite: str = "zero",
        privacy_unit: Optional[str] = None,
        examples_per_user: Optional[int] = None,
    ) -> None:
        self._on_nonfinite = check_on_nonfinite(on_nonfinite)
        if not isinstance(query, DPQuery):
            raise TypeError(f"query must be a dpcore.queries.DPQuery, got {type(query).__name__}")
        if not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"ledger must be a dpcore.ledger.PrivacyLedger, got {type(ledger).__name__}")
        unit = _privacy_unit(privacy_unit, ledger, examples_per_user)
        k = None if examples_per_user is None else check_examples_per_user("examples_per_user", examples_per_user)
        if k is not None and sampler is not None and not isinstance(sampler, str):
            raise ValueError(
                "examples_per_user is recorded with the samples the aggregator draws itself (sampler='poisson' or "
                "'fixed_size_without_replacement'); a sampler object records its own samples"
            )
        population_size = count("population_size", population_size, 1)
        if policy is not None:
            if isinstance(sampler, Sampler):
                raise TypeError("give sampler= only (policy= is its old name, for the aggregator's own draws)")
            sampler = renamed("sampler", sampler, "policy", policy, stacklevel=3)
        policy = POISSON
        if isinstance(sampler, str):
            policy, sampler = _own_draws(sampler), None
        self._sampler = None
        if sampler is not None:
            _check_sampler(sampler, query, ledger, population_size, sampling_probability, sample_size)
            self._sampler = sampler
            policy = sampler.kind
        elif policy == POISSON:
            if sampling_probability is None:
                raise ValueError("sampler 'poisson' needs sampling_probability")
            if sample_size is not None:
                raise ValueError("sample_size is for sampler 'fixed_size_without_replacement'; poisson samples vary in size")
            probability("sampling_probability", sampling_probability)
        elif policy == FIXED_SIZE:
            if sample_size is None:
                raise ValueError("sampler 'fixed_size_without_replacement' needs sample_size")
            if not 0 <= integer("sample_size", sample_size) <= population_size:
                raise ValueError(f"sample_size must be in [0, population_size={population_size}], got {sample_size}")
            if sampling_probability is not None and float(sampling_probability) != sample_size / population_size:
                raise ValueError("sampling_probability must be None or sample_size/population_size")
        self._query = query
        self._ledger = ledger
        self._n = int(population_size)
        self._q = None if sampling_probability is None or sampler is not None else float(sampling_probability)
        self._b = None if sample_size is None else int(sample_size)
        self._policy = policy
        self._unit = unit
        self._k = k
        self._global_state = query.initial_global_state()
        self._open: Optional[int] = None  # size of the drawn, not yet aggregated sample

    query = readonly[DPQuery]("_query", "The query whose releases this aggregator makes.")
    privacy_unit = readonly[str]("_unit", 'What one record is: "example" or "user" (the ledger\'s unit).')
    examples_per_user = readonly[Optional[int]]("_k", "The bound recorded with each sample (user unit), or None.")
    ledger = readonly[PrivacyLedger]("_ledger", "The ledger every sample and release is written to.")
    global_state = readonly[Any]("_global_state", "The query's global state for the next sample.")

    def load_global_state(self, global_state: Any) -> None:
        """Continues from a saved :attr:`global_state` (a server restart: adaptive clipping's clip
        norm, a correlated-noise stream's buffers). Refused while a sample is open, or for a state
        of another class than the query's."""
        if self._open is not None:
            raise RuntimeError("a sample is open: aggregate it before restoring a global state")
        want = type(self._query.initial_global_state())
        if type(global_state) is not want:
            raise TypeError(f"the query's global state is a {want.__name__}, got {type(global_state).__name__}")
        self._global_state = global_state

    def metrics(self) -> dict:
        """The query's metrics of the current global state (e.g. an adaptive clip norm)."""
        return self._query.derive_metrics(self._global_state)

    def sample(self, *, seed: Optional[int] = None) -> np.ndarray:
        """Sorted int64 indices of the next sample; records its sampling event in the ledger."""
        if self._sampler is not None:
            if seed is not None:
                raise ValueError("a sampler object is seeded (tests only) when it is built, not per sample")
            idx = self._sampler.draw()
        elif self._k is not None:
            # drawn first, then recorded with the bound on the examples behind each user's record
            if self._policy == POISSON:
                idx = poisson_sample(self._n, self._q, seed=seed)  # type: ignore[arg-type]
                self._ledger.record_sample(self._n, self._q, POISSON, seeded=seed is not None, examples_per_user=self._k)
            else:
                idx = fixed_size_sample(self._n, self._b, seed=seed)  # type: ignore[arg-type]
                self._ledger.record_sample(self._n, None, FIXED_SIZE, sample_size=self._b, seeded=seed is not None,
                                           examples_per_user=self._k)
        elif self._policy == POISSON:
            idx = poisson_sample(self._n, self._q, seed=seed, ledger=self._ledger)  # type: ignore[arg-type]
        else:
            idx = fixed_size_sample(self._n, self._b, seed=seed, ledger=self._ledger)  # type: ignore[arg-type]
        self._open = int(idx.shape[0])
        return idx

    sampler = readonly[Any]("_sampler", "The sampler object drawing the samples, or None.")
    on_nonfinite = readonly[str](
        "_on_nonfinite", "'zero' (non-finite records contribute zero, via the query) or 'raise' (debugging only)."
    )

    def aggregate(self, records: Any, *, seed: Optional[int] = None, missing: int = 0) -> Any:
        """The query's noised aggregate of the sample's records; durable in the ledger on return.

        ``records`` has the structure the query expects, every array with a leading axis equal
        to the size of the sample that :meth:`sample` just returned, less ``missing``: sampled
        participants that never delivered a record (a federated client that dropped out). A
        missing participant contributes nothing at all, as if it were not in the population: no
        vector, and no term in an adaptive clip's count (where even a zero record would count
        as unclipped); the denominator and the noise do not change. Raises before anything is
        released if no sample is open or the sizes differ.
        """
        if self._open is None:
            raise RuntimeError("call sample() before aggregate(): every release must belong to a recorded sample")
        if isinstance(missing, bool) or not isinstance(missing, (int, np.integer)) or not 0 <= missing <= self._open:
            raise ValueError(f"missing must be an int in [0, {self._open}] (the sample's size), got {missing!r}")
        arrays: List[np.ndarray] = []
        template = _arrays(records, arrays)
        for k, a in enumerate(arrays):
            if a.shape[0] != self._open - missing:
                raise ValueError(
                    f"records array {k} has {a.shape[0]} records but the sample has {self._open}"
                    + (f" ({missing} missing)" if missing else "")
                    + ": pass the records at the indices sample() returned"
                )
        if self._on_nonfinite == "raise":
            _raise_on_nonfinite(arrays, self._open)
        q, gs = self._query, self._global_state
        params = q.derive_sample_params(gs)
        state = q.initial_sample_state(template)
        state = q.accumulate_records(params, state, records)
        result, new_gs, event = q.get_noised_result(state, gs, seed=seed)
        self._ledger.record_release(event)  # durable before the result leaves this function
        self._global_state = new_gs
        self._open = None
        return result


def _raise_on_nonfinite(arrays: List[np.ndarray], batch: int) -> None:
    """``on_nonfinite="raise"``: the error naming the first record with a NaN or infinite value in
    any of ``arrays`` (each with ``batch`` records); non-float arrays are left to the query."""
    bad = np.zeros(batch, bool)
    for a in arrays:
        if a.dtype.kind in "fc" and a.size:
            bad |= ~np.isfinite(a.reshape(batch, -1)).all(axis=1)
    if bad.any():
        raise nonfinite_error(int(np.argmax(bad)))


#: The privacy units of the aggregator's records.
PRIVACY_UNITS = ("example", "user")


def _privacy_unit(privacy_unit: Optional[str], ledger: PrivacyLedger, examples_per_user: Any) -> str:
    """The unit of the aggregator's records: ``privacy_unit`` (checked against the ledger's, which
    cannot change once written) or, when None, the ledger's."""
    have = ledger.privacy_unit
    if privacy_unit is not None:
        if privacy_unit not in PRIVACY_UNITS:
            raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
        if privacy_unit != have:
            raise ValueError(
                f"privacy_unit={privacy_unit!r} but the ledger {ledger.path} records unit {have!r} (mixing units in one "
                f"ledger is refused): open it with PrivacyLedger(path, privacy_unit={privacy_unit!r})"
            )
    unit = have if privacy_unit is None else privacy_unit
    if examples_per_user is not None and unit != "user":
        raise ValueError(
            f"examples_per_user bounds the examples behind one user's record: it needs privacy_unit='user' and a "
            f"ledger of unit 'user' (this one records {have!r})"
        )
    return unit


#: The samplers a PrivateAggregator draws by name (``sampler="..."``), from its own arguments.
OWN_DRAWS = (POISSON, FIXED_SIZE)


def _own_draws(name: str) -> str:
    """The policy of ``sampler=name``: one the aggregator draws itself, or a refusal that says
    how to use another registered sampler."""
    if name in OWN_DRAWS:
        return name
    if name in registered_samplers():
        raise ValueError(
            f"sampler={name!r} by name: the aggregator draws 'poisson' (with sampling_probability) and "
            "'fixed_size_without_replacement' (with sample_size) itself; for any other sampler build its object, "
            f"recording into this ledger (dpcore.sampling.{sampler_class(name).__name__}"
            "(..., ledger=ledger)), and pass it as sampler= (for shuffled epochs, record samples with "
            "PrivacyLedger.record_sample(..., policy='shuffle'))"
        )
    raise ValueError(f"sampler must be one of {OWN_DRAWS} by name, or a dpcore.sampling.Sampler; got {name!r}")


def _check_sampler(
    sampler: Any, query: DPQuery, ledger: PrivacyLedger, n: int, q: Optional[float], b: Optional[int]
) -> None:
    """A sampler fit for this aggregator: recording into its ledger, over its population, and,
    for a matrix-factorization query, cyclic in the participation schema the query declares."""
    if not isinstance(sampler, Sampler) or type(sampler).name not in registered_samplers():
        raise TypeError(
            "sampler must be a registered dpcore.sampling.Sampler (TruncatedPoissonSampler, RandomAllocationSampler, "
            f"BallsInBinsSampler, CyclicSampler, CyclicPoissonSampler, ...), got {type(sampler).__name__}"
        )
    if q is not None or b is not None:
        raise ValueError("give sampling_probability/sample_size or a sampler, not both (the sampler has its own)")
    if sampler.ledger is not ledger:
        raise ValueError("the sampler must record into the aggregator's ledger: build it with ledger=ledger")
    if sampler.population_size != n:
        raise ValueError(f"population_size is {n} but the sampler draws from {sampler.population_size} records")
    part = getattr(query, "participation", None)
    if not isinstance(sampler, _CYCLIC):
        if part is not None:
            raise ValueError(
                f"the query is a matrix-factorization query ({part.describe()}): its noise's sensitivity holds for "
                f"cyclic participation only, not for {type(sampler).__name__}; draw with CyclicSampler or "
                "CyclicPoissonSampler"
            )
        return
    have = sampler.participation
    # The planned participations (max_participations) are the query's alone: the accountant
    # counts those actually run.
    if part is not None and (part.kind, part.min_separation, part.sampling_probability) != (
        have.kind, have.min_separation, have.sampling_probability
    ):
        raise ValueError(
            f"the query declares {part.describe()}, but the sampler follows {have.describe()}: "
            "the noise's sensitivity would not hold for the samples drawn"
        )
