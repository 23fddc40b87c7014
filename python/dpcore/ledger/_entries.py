"""What a ledger entry is: the policies, the sample and release entries, and their validation.

Every value is validated here before anything is written; the storage layer (:mod:`._storage`)
reads and appends the file, :mod:`._events` turns what is read into accountant events. Nothing
here knows about accountants: a sampling policy is a registered sampler's name
(:mod:`dpcore.sampling`), and a matrix-factorization stream's declaration is parsed by
:mod:`dpcore.matrix_factorization._declaration`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .._validate import count as _int, probability
from ..events import (
    MATRIX_FACTORIZATION,
    ComposedQueryEvent,
    NonPrivateQueryEvent,
    SumQueryEvent,
    effective_noise_multiplier,
    is_discrete,
    is_matrix_factorization,
)


FORMAT = "dpcore-privacy-ledger"
VERSION = 1
POISSON = "poisson"
FIXED_SIZE = "fixed_size_without_replacement"
SHUFFLE = "shuffle"
#: Fixed batches of a partition cut once, batch t mod b at step t (matrix-factorization
#: pipelines): ``sample_size`` is the batch's size, ``sampling_probability`` batch/population.
CYCLIC = "cyclic"
#: Group t mod b of a partition cut once, each of its records with probability p (amplified
#: banded matrix factorization): ``sampling_probability`` is p.
CYCLIC_POISSON = "cyclic_poisson"
#: A Poisson sample at q capped at ``sample_size`` = B records (a uniformly random B of them
#: when more are drawn): ``sampling_probability`` is q.
TRUNCATED_POISSON = "truncated_poisson"
#: One epoch of b steps in which every record takes part in exactly one step, chosen uniformly
#: and independently (Chua et al. 2025, arXiv 2412.16802): ``sampling_probability`` is 1/b.
BALLS_IN_BINS = "balls_in_bins"
#: One round of t steps in which every record takes part in exactly k of them, a uniformly random
#: k-subset chosen independently (Feldman & Shenfeld 2025, arXiv 2502.08202):
#: ``sampling_probability`` is k/t.
RANDOM_ALLOCATION = "random_allocation"
#: Batches of the records in a fixed order (a DataLoader without shuffle): ``sample_size`` is
#: the batch size, ``sampling_probability`` batch/population. Told apart from ``shuffle`` (a fresh
#: permutation every epoch) because adding or removing a record shifts every later batch.
SEQUENTIAL = "sequential"
# Appended, never reordered: the core's fast reader numbers the first three policies (and
# refuses every other one, so that this reader handles them).
POLICIES = (POISSON, FIXED_SIZE, SHUFFLE, CYCLIC, CYCLIC_POISSON, TRUNCATED_POISSON, BALLS_IN_BINS, RANDOM_ALLOCATION,
            SEQUENTIAL)
#: The policies of epochs without amplification: each record in at most one batch of an epoch.
#: Their samples may carry the epoch as a round (:data:`ROUND_KEYS`, round_selected 1), which the
#: accountant then reads per epoch; without it (ledgers written before), per step.
EPOCH_POLICIES = (SHUFFLE, SEQUENTIAL)
#: The policies whose privacy rests on a round of steps rather than on each step: their sample
#: entries carry the round (:data:`ROUND_KEYS`), and the accountant reads one event per round.
ALLOCATION_POLICIES = (BALLS_IN_BINS, RANDOM_ALLOCATION)
#: The keys that the sample entries of an allocation policy add (and no other policy has): the
#: round's index in the ledger (0, 1, 2, ... over all allocation rounds), the step's index within
#: its round, the round's t (steps) and k (steps each record takes part in; 1 for balls-in-bins).
ROUND_KEYS = ("round", "step_in_round", "round_steps", "round_selected")
#: What one record of the ledger's population is (the unit of privacy, Ponomareva et al. 2023,
#: §5.3.3): recorded in the header when a ledger is created. Ledgers written before it was
#: recorded are example-level.
DEFAULT_PRIVACY_UNIT = "example"
#: The privacy unit whose samples may carry a contribution bound (:data:`USER_KEYS`).
USER = "user"
#: The contribution bounds a sample of a user-level ledger may carry (each only when given, so
#: that every other entry keeps the format earlier readers accept): ``examples_per_user`` k,
#: user-level sampling (the sample is of users, each contributing the clipped mean of at most k
#: of its examples); ``max_examples_per_user`` K, example-level sampling with a user-level
#: guarantee (each user's data bounded to at most K examples over the whole run, the sample of
#: examples, Poisson only; the accountant reads a user as a mixture of Gaussians). K is one
#: value over the whole ledger: it bounds the run, not a step.
USER_KEYS = ("examples_per_user", "max_examples_per_user")



class LedgerError(ValueError):
    """A ledger file that cannot be read or written as a ledger (names the file and line)."""


class LedgerWarning(UserWarning):
    """Something the accountant's user must know: a torn last line, a shuffled policy, a seed."""


@dataclass(frozen=True)
class TornTail:
    """An incomplete last line (no newline) left by a process that stopped mid-write."""

    line: int
    fragment: str
    #: True when the fragment is a complete, valid entry that only lacks its newline; such an
    #: entry is counted (over-counting is safe).
    counted: bool


@dataclass(frozen=True)
class LedgerSample:
    """One sampling event and the sum queries released on it."""

    sample: int
    population_size: int
    sampling_probability: float
    policy: str
    sample_size: Optional[int] = None
    seeded: bool = False
    queries: Tuple[SumQueryEvent, ...] = ()
    non_private: bool = False
    #: Allocation policies only (None otherwise): the round, the step within it, t and k.
    round: Optional[int] = None
    step_in_round: Optional[int] = None
    round_steps: Optional[int] = None
    round_selected: Optional[int] = None
    #: User-level ledgers only (None otherwise): the contribution bound of the sample (see
    #: :data:`USER_KEYS`); at most one of the two.
    examples_per_user: Optional[int] = None
    max_examples_per_user: Optional[int] = None

    @property
    def allocation(self) -> bool:
        """Whether the sample is one step of a round: an allocation round (balls-in-bins,
        random allocation) or an epoch of a shuffled or fixed-order loader recorded with its
        epoch; accounted per round, not per step."""
        return self.round is not None

    @property
    def released(self) -> bool:
        return bool(self.queries) or self.non_private

    @property
    def independent_queries(self) -> Tuple[SumQueryEvent, ...]:
        """The sum queries with independent noise (all but the steps of matrix-factorization
        streams): the ones Eq. (1) combines on this sample."""
        if not any(is_matrix_factorization(t) for t in self.queries):
            return self.queries
        return tuple(t for t in self.queries if not is_matrix_factorization(t))

    def stream_queries(self) -> Dict[str, Tuple[SumQueryEvent, ...]]:
        """The steps of matrix-factorization streams released on this sample, by stream id
        (in order of first appearance)."""
        out: Dict[str, Tuple[SumQueryEvent, ...]] = {}
        for t in self.queries:
            if is_matrix_factorization(t) and t.stream is not None:
                out[t.stream] = out.get(t.stream, ()) + (t,)
        return out

    def noise_multiplier(self) -> float:
        """z of the sample's independent sum queries together, Eq. (1); 0 when any release is
        non-private; ∞ when every query on it is a step of a matrix-factorization stream (those
        are accounted per stream, over all their steps: :mod:`dpcore.ledger._events`)."""
        if self.non_private:
            return 0.0
        queries = self.independent_queries
        if not queries and self.queries:
            return math.inf
        return effective_noise_multiplier(queries)

    @property
    def discrete(self) -> bool:
        """Whether a query on this sample used the discrete Gaussian mechanism."""
        return is_discrete(self.queries)


# ----------------------------------------------------------------------------- validation



def _prob(v: Any) -> float:
    return probability("sampling_probability", v)


def _sample_entry(
    sample: int,
    population_size: Any,
    sampling_probability: Any,
    policy: Any,
    sample_size: Any,
    seeded: Any,
    round: Any = None,
    step_in_round: Any = None,
    round_steps: Any = None,
    round_selected: Any = None,
    *,
    examples_per_user: Any = None,
    max_examples_per_user: Any = None,
) -> LedgerSample:
    s = _policy_entry(sample, population_size, sampling_probability, policy, sample_size, seeded, round, step_in_round,
                      round_steps, round_selected)
    if examples_per_user is None and max_examples_per_user is None:
        return s
    if examples_per_user is not None and max_examples_per_user is not None:
        raise ValueError(
            "give examples_per_user (user-level sampling: a bound per step) or max_examples_per_user (example-level "
            "sampling: a bound over the run), not both"
        )
    k = None if examples_per_user is None else _int("examples_per_user", examples_per_user, 1)
    kk = None if max_examples_per_user is None else _int("max_examples_per_user", max_examples_per_user, 1)
    if kk is not None and s.policy != POISSON:
        raise ValueError(
            f"max_examples_per_user (example-level sampling with a user-level guarantee) is accounted for Poisson "
            f"samples of examples only, got policy {s.policy!r}"
        )
    return _with(s, examples_per_user=k, max_examples_per_user=kk)


def _with(s: LedgerSample, **kw: Any) -> LedgerSample:
    d = dict(s.__dict__)
    d.update(kw)
    return LedgerSample(**d)


def check_user_bounds(unit: str, prev: Optional[LedgerSample], s: LedgerSample) -> Optional[str]:
    """Why ``s`` cannot be a sample of a ledger of privacy unit ``unit`` whose last sample is
    ``prev``, or None: a contribution bound needs the unit ``"user"``, and the total bound
    ``max_examples_per_user`` is one value on every sample of the ledger (it bounds a user's
    data over the whole run: a sample with another K, or without it, would not be covered by
    the accounting of the others)."""
    if (s.examples_per_user is not None or s.max_examples_per_user is not None) and unit != USER:
        given = "examples_per_user" if s.examples_per_user is not None else "max_examples_per_user"
        return (
            f"{given} bounds a user's contribution, but the ledger's privacy unit is {unit!r}; record it in a "
            "ledger created with privacy_unit='user' (a ledger's unit is fixed: units are never mixed in one ledger)"
        )
    if prev is not None and prev.max_examples_per_user != s.max_examples_per_user:
        was = "no max_examples_per_user" if prev.max_examples_per_user is None else f"max_examples_per_user={prev.max_examples_per_user}"
        now = "none" if s.max_examples_per_user is None else f"max_examples_per_user={s.max_examples_per_user}"
        return (
            f"the ledger's samples record {was}, this sample {now}: the bound on a user's examples is a total "
            "over the run, one value on every sample of a ledger (start a new ledger for another bound)"
        )
    return None


def _policy_entry(
    sample: int,
    population_size: Any,
    sampling_probability: Any,
    policy: Any,
    sample_size: Any,
    seeded: Any,
    round: Any = None,
    step_in_round: Any = None,
    round_steps: Any = None,
    round_selected: Any = None,
) -> LedgerSample:
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, got {type(policy).__name__}")
    if policy not in POLICIES:
        return _registered_entry(sample, population_size, sampling_probability, policy, sample_size, seeded,
                                 round, step_in_round, round_steps, round_selected)
    if not isinstance(seeded, bool):
        raise TypeError(f"seeded must be a bool, got {type(seeded).__name__}")
    n = _int("population_size", population_size, 1)
    b = None if sample_size is None else _int("sample_size", sample_size, 0)
    if b is not None and b > n:
        raise ValueError(f"sample_size must be <= population_size {n}, got {b}")
    if policy == FIXED_SIZE:
        if b is None:
            raise ValueError("policy fixed_size_without_replacement needs sample_size")
        q = b / n
        if sampling_probability is not None and _prob(sampling_probability) != q:
            raise ValueError(
                f"sampling_probability {sampling_probability} differs from sample_size/population_size = {q}"
            )
    rounds = (round, step_in_round, round_steps, round_selected)
    if policy in ALLOCATION_POLICIES:
        return _allocation_entry(sample, n, sampling_probability, policy, b, seeded, *rounds)
    if policy in EPOCH_POLICIES and any(v is not None for v in rounds):
        return _epoch_entry(sample, n, sampling_probability, policy, b, seeded, *rounds)
    if any(v is not None for v in rounds):
        raise ValueError(
            f"round, step_in_round, round_steps and round_selected belong to allocation and epoch policies, not to {policy}"
        )
    if policy == CYCLIC_POISSON:
        # p is the schema's; a realised batch size says nothing about it.
        if sampling_probability is None:
            raise ValueError("policy cyclic_poisson needs sampling_probability (the p of each record of the group)")
        q = _prob(sampling_probability)
    elif policy == TRUNCATED_POISSON:
        # q is the Poisson rate and B the cap; the accountant needs both (and n).
        if sampling_probability is None or b is None:
            raise ValueError(
                "policy truncated_poisson needs sampling_probability (q) and sample_size (the cap B on the batch)"
            )
        if b < 1:
            raise ValueError("policy truncated_poisson: sample_size (the cap B) must be >= 1")
        q = _prob(sampling_probability)
    else:
        q = _rate(policy, sampling_probability, b, n)
    return LedgerSample(sample, n, q, policy, b, seeded)


def _registered_entry(sample: int, population_size: Any, sampling_probability: Any, policy: str, sample_size: Any,
                      seeded: Any, *rounds: Any) -> LedgerSample:
    """A sample of a sampler registered with :func:`dpcore.sampling.register_sampler` beyond the
    built-in policies: one step, its q read by the sampler class (rounds are the built-in
    policies' alone)."""
    from ..sampling import registered_samplers, sampler_class

    if policy not in registered_samplers():
        raise ValueError(f"policy must be one of {', '.join(registered_samplers())}; got {policy!r}")
    if not isinstance(seeded, bool):
        raise TypeError(f"seeded must be a bool, got {type(seeded).__name__}")
    if any(v is not None for v in rounds):
        raise ValueError(f"round, step_in_round, round_steps and round_selected belong to the built-in round policies, not to {policy}")
    n = _int("population_size", population_size, 1)
    b = None if sample_size is None else _int("sample_size", sample_size, 0)
    if b is not None and b > n:
        raise ValueError(f"sample_size must be <= population_size {n}, got {b}")
    return LedgerSample(sample, n, sampler_class(policy).ledger_rate(n, sampling_probability, b), policy, b, seeded)


def _rate(policy: str, sampling_probability: Any, b: Optional[int], n: int) -> float:
    """q as given, else b/n."""
    if sampling_probability is None:
        if b is None:
            raise ValueError(f"policy {policy} needs sampling_probability or sample_size")
        return b / n
    return _prob(sampling_probability)


def _round_keys(what: str, round: Any, step_in_round: Any, round_steps: Any, round_selected: Any) -> Tuple[int, int, int, int]:
    """(round, step in it, t, k), checked: all given, k ≤ t, the step < t."""
    if any(v is None for v in (round, step_in_round, round_steps, round_selected)):
        raise ValueError(f"{what} needs round, step_in_round, round_steps and round_selected")
    r = _int("round", round, 0)
    t = _int("round_steps", round_steps, 1)
    k = _int("round_selected", round_selected, 1)
    s = _int("step_in_round", step_in_round, 0)
    if k > t:
        raise ValueError(f"round_selected must be <= round_steps = {t}, got {k}")
    if s >= t:
        raise ValueError(f"step_in_round must be < round_steps = {t}, got {s}")
    return r, s, t, k


def _allocation_entry(
    sample: int, n: int, sampling_probability: Any, policy: str, b: Optional[int], seeded: bool,
    round: Any, step_in_round: Any, round_steps: Any, round_selected: Any,
) -> LedgerSample:
    """A sample of an allocation policy: one step of a round of t steps in which every record
    takes part in k of them. q is k/t, the rate at which a record takes part in a step."""
    r, s, t, k = _round_keys(f"policy {policy}", round, step_in_round, round_steps, round_selected)
    if policy == BALLS_IN_BINS and k != 1:
        raise ValueError(f"policy balls_in_bins puts every record in one step of the epoch: round_selected must be 1, got {k}")
    if b is not None:
        raise ValueError(f"policy {policy} has no sample_size (its batches vary in size)")
    q = k / t
    if sampling_probability is not None and _prob(sampling_probability) != q:
        raise ValueError(f"sampling_probability {sampling_probability} differs from round_selected/round_steps = {q}")
    return LedgerSample(sample, n, q, policy, None, seeded, round=r, step_in_round=s, round_steps=t, round_selected=k)


def _epoch_entry(
    sample: int, n: int, sampling_probability: Any, policy: str, b: Optional[int], seeded: bool,
    round: Any, step_in_round: Any, round_steps: Any, round_selected: Any,
) -> LedgerSample:
    """A batch of an epoch of a shuffled or fixed-order loader, with its epoch as a round: the
    round's index, the batch's index in the epoch, the epoch's t batches and k = 1 (each record
    in at most one batch of the epoch). A resumed epoch is a new round (its order is a new one)."""
    r, s, t, k = _round_keys(f"policy {policy} with an epoch", round, step_in_round, round_steps, round_selected)
    if k != 1:
        raise ValueError(f"policy {policy}: every record is in at most one batch of an epoch, round_selected must be 1, got {k}")
    q = _rate(policy, sampling_probability, b, n)
    return LedgerSample(sample, n, q, policy, b, seeded, round=r, step_in_round=s, round_steps=t, round_selected=k)


def check_round(prev: Optional[LedgerSample], last_round: Optional[int], s: LedgerSample) -> Optional[str]:
    """Why ``s`` cannot follow the ledger's samples, or None. ``prev`` is the ledger's last
    sample and ``last_round`` the index of its last allocation round (None: none yet).

    The accountant reads one event per allocation round (:mod:`._events`), which covers that
    round's steps only if they are what the round's analysis assumes: a round's samples are
    consecutive (nothing else released between them), at most t of them, in increasing order of
    their step, with the same t, k, policy and population; round indices increase by one."""
    if not s.allocation:
        return None
    if prev is not None and prev.allocation and prev.round == s.round:
        if (prev.policy, prev.round_steps, prev.round_selected, prev.population_size) != (
            s.policy, s.round_steps, s.round_selected, s.population_size
        ):
            return (
                f"round {s.round} changes its sampler: {prev.policy} with t={prev.round_steps}, k={prev.round_selected} "
                f"over {prev.population_size} records, then {s.policy} with t={s.round_steps}, k={s.round_selected} "
                f"over {s.population_size}"
            )
        if s.step_in_round <= prev.step_in_round:  # type: ignore[operator]
            return (
                f"round {s.round}: step {s.step_in_round} follows step {prev.step_in_round}; a round's steps are "
                "recorded once each, in order"
            )
        return None
    expected = 0 if last_round is None else last_round + 1
    if s.round != expected:
        if s.round == last_round:
            return (
                f"round {s.round} is over (other samples followed its last step): a round's samples are "
                f"consecutive; the next round is {expected}"
            )
        return f"round {s.round} out of sequence: round indices increase by one, the next round is {expected}"
    return None


def last_round_of(samples: Any) -> Optional[int]:
    """The index of the last allocation round among ``samples`` (None: there is none)."""
    runs = samples.runs() if callable(getattr(samples, "runs", None)) else [(s, 1) for s in samples]
    for s, _ in reversed(runs):
        if s.allocation:
            return s.round
    return None


# ----------------------------------------------------------------------------- MF streams


def _declaration(text: Any) -> Any:
    """The :class:`~dpcore.matrix_factorization.StreamDeclaration` of a declaration text, fully
    checked (imported here: a ledger without matrix-factorization streams never loads it)."""
    from ..matrix_factorization._declaration import StreamDeclaration

    return StreamDeclaration.from_json(text)


def _declaration_of_entry(obj: Dict[str, Any]) -> Any:
    from ..matrix_factorization._declaration import StreamDeclaration

    return StreamDeclaration.from_dict({k: obj[k] for k in ("strategy", "participation", "steps")})


def _check_stream_policy(sample: LedgerSample, stream: str, declaration: Any) -> Optional[str]:
    """Why the steps of ``stream`` cannot have been released on ``sample``, or None: its
    sampling policy must be the one the stream's participation schema declares."""
    part = declaration.participation
    if sample.policy != part.kind:
        return (
            f"sample {sample.sample} has policy {sample.policy!r}, but matrix-factorization stream {stream} declares "
            f"{part.kind!r} participation ({part.describe()}); its steps must be released on {part.kind!r} samples"
        )
    if part.kind == CYCLIC_POISSON and sample.sampling_probability != part.sampling_probability:
        return (
            f"sample {sample.sample} was drawn with sampling_probability {sample.sampling_probability!r}, but "
            f"matrix-factorization stream {stream} declares p = {part.sampling_probability!r}"
        )
    return None


def _stream_entries(
    sample: LedgerSample, tuples: List[SumQueryEvent], streams: Dict[str, str]
) -> Tuple[List[SumQueryEvent], Dict[str, str]]:
    """The tuples to record, their declarations replaced by the canonical text of the stream
    (the one already recorded, or the normalised new one), and the streams this release
    declares first (id → canonical text). Raises :class:`LedgerError` for a declaration that
    differs from the stream's recorded one, or a sample whose policy does not match it."""
    new: Dict[str, str] = {}
    out: List[SumQueryEvent] = []
    for t in tuples:
        if not is_matrix_factorization(t):
            out.append(t)
            continue
        sid = t.stream
        assert sid is not None
        known = streams.get(sid, new.get(sid))
        try:
            if known is not None and t.declaration == known:  # the common case: the recorded text itself
                dec, text = _declaration(known), known
            else:
                dec = _declaration(t.declaration)
                text = dec.to_json()
        except (TypeError, ValueError) as e:
            raise LedgerError(f"matrix-factorization stream {sid}: invalid declaration: {e}") from None
        if known is None:
            new[sid] = known = text
        elif known != text:
            raise LedgerError(
                f"matrix-factorization stream {sid}: the declaration changed; the ledger records {known}, this "
                f"release declares {text}. A stream's strategy, participation schema and planned steps are fixed "
                "(start a new query, with a new stream id, for a new schedule)"
            )
        why = _check_stream_policy(sample, sid, dec)
        if why is not None:
            raise LedgerError(why)
        out.append(SumQueryEvent(t.l2_norm_clip, t.stddev, MATRIX_FACTORIZATION, sid, known))
    return out, new


def streams_of(samples: Any) -> Dict[str, str]:
    """The matrix-factorization streams (id → canonical declaration text) of these samples."""
    out: Dict[str, str] = {}
    runs = samples.runs() if callable(getattr(samples, "runs", None)) else [(s, 1) for s in samples]
    for s, _ in runs:
        for t in s.queries:
            if is_matrix_factorization(t) and t.stream not in out:
                out[t.stream] = t.declaration  # type: ignore[index,assignment]
    return out


def _tuples_of(event: Any) -> Tuple[List[SumQueryEvent], bool]:
    """The (re-validated) privacy tuples of a query event, and whether any part is non-private."""
    tuples: List[SumQueryEvent] = []
    non_private = False

    def walk(e: Any, depth: int) -> None:
        nonlocal non_private
        if depth > 1000:
            raise ValueError("event nests too deeply")
        if isinstance(e, SumQueryEvent):
            # Rebuilt so that an event mutated behind the frozen dataclass is checked again.
            tuples.append(SumQueryEvent(e.l2_norm_clip, e.stddev, e.mechanism, e.stream, e.declaration))
        elif isinstance(e, NonPrivateQueryEvent):
            non_private = True
        elif isinstance(e, ComposedQueryEvent):
            for x in e.events:
                walk(x, depth + 1)
        else:
            raise TypeError(
                "event must be a query event (SumQueryEvent, ComposedQueryEvent or NonPrivateQueryEvent), "
                f"got {type(e).__name__}"
            )

    walk(event, 0)
    if not tuples and not non_private:
        raise ValueError("event holds no sum query: nothing to record")
    return tuples, non_private


def _release_entries(
    sample: LedgerSample,
    tuples: List[SumQueryEvent],
    non_private: bool,
    *,
    with_sample: bool,
    new_streams: Optional[Dict[str, str]] = None,
) -> List[Dict[str, Any]]:
    """The entries recording one release on ``sample`` (preceded by the sample's own entry on
    its first release, then by the ``mf_stream`` entry of each stream this release declares
    first)."""
    entries: List[Dict[str, Any]] = []
    if with_sample:
        entries.append(
            {
                "type": "sample",
                "sample": sample.sample,
                "population_size": sample.population_size,
                "sampling_probability": sample.sampling_probability,
                "policy": sample.policy,
                "sample_size": sample.sample_size,
                "seeded": sample.seeded,
            }
        )
        if sample.allocation:  # only then: other entries keep the format every earlier reader accepts
            entries[-1].update({k: getattr(sample, k) for k in ROUND_KEYS})
        for k in USER_KEYS:  # likewise, only when given
            if getattr(sample, k) is not None:
                entries[-1][k] = getattr(sample, k)
    for sid, text in (new_streams or {}).items():
        d = json.loads(text)
        entries.append(
            {"type": "mf_stream", "stream": sid, "strategy": d["strategy"], "participation": d["participation"], "steps": d["steps"]}
        )
    for t in tuples:
        entry = {"type": "sum_query", "sample": sample.sample, "l2_norm_clip": t.l2_norm_clip, "stddev": t.stddev}
        if t.mechanism != "gaussian":
            # Only then: a Gaussian entry keeps the format every earlier reader (and the fast
            # reader in the core) accepts.
            entry["mechanism"] = t.mechanism
        if t.stream is not None:
            entry["stream"] = t.stream
        entries.append(entry)
    if non_private:
        entries.append({"type": "non_private", "sample": sample.sample})
    return entries


def _dumps(entry: Dict[str, Any]) -> str:
    return json.dumps(entry, allow_nan=False, ensure_ascii=True, separators=(", ", ": ")) + "\n"
