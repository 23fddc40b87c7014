"""From ledger entries to one accountant event (McMahan et al. 2018, §6).

The storage layer (:mod:`._storage`) knows what was recorded; this module knows how an
accountant must read it: which event each sampling policy becomes, what the recorded S_g mean
under each neighbouring relation, and which samples deserve a warning.

**Matrix-factorization streams** (:func:`account_streams`). The steps of a correlated-noise
stream are not independent Gaussian queries: they are accounted together, per stream, and are
left out of the per-sample Eq. (1) of the other queries on their samples (composition: the
stream's event and the other queries' events are composed). For a stream with m recorded steps:

* z_t = Eq. (1) over the stream's tuples on its t-th sample (several query groups of one stream
  on one sample are one MF mechanism with the combined sensitivity), and z = min_t z_t;
* the strategy C and the participation schema are rebuilt from the declaration the ledger
  recorded, and sens = sens(C, m, participation) is recomputed for the m steps that ran (never
  taken from the query; a run beyond its planned steps costs more);
* the stream is ``GaussianEvent(z/sens)`` for cyclic fixed batches (the whole stream is one
  Gaussian mechanism: Choquette-Choo et al. 2022, arXiv 2211.06530, §2 and Theorem 2; its ε is
  the analytic Gaussian mechanism's, Balle & Wang 2018, arXiv 1805.06530, Theorem 8), and
  ``SelfComposedEvent(PoissonSampledEvent(p, GaussianEvent(z/sens)), ⌈m/b⌉)`` for cyclic
  Poisson sampling, where sens is the largest column norm (amplified banded MF, Choquette-Choo
  et al. 2023, arXiv 2306.08153, Theorem 4).

*Why the minimum is a valid bound when σ_t and S_t vary per step.* Step t releases
x_t + σ_t·(C⁻¹Z)_t. Dividing step t by σ_t (post-processing) gives x'_t + (C⁻¹Z)_t with
x'_t = x_t/σ_t, and multiplying by C gives C·x' + Z: a Gaussian mechanism with unit noise. One
record adds u_t to x'_t at its steps π, ‖u_t‖ ≤ S_t/σ_t = 1/z_t ≤ 1/z. Its effect on C·x' has
squared norm Σ_{s,t∈π} (CᵀC)_{st}⟨u_s, u_t⟩ ≤ Σ_{s,t∈π} (CᵀC)_{st}‖u_s‖‖u_t‖ ≤
(1/z²)·‖C·1_π‖², because every (CᵀC)_{st} ≥ 0: the strategies here have non-negative
coefficients (:mod:`dpcore.matrix_factorization._strategies`). So the sensitivity is at most
sens/z, whatever the directions and sizes of the per-step contributions, and the noise
multiplier of the stream at least z/sens. (With negative entries in CᵀC the bound would fail.)

Neighbouring (:data:`NEIGHBORING`). The MF papers' analyses are under zero-out adjacency (a
record's contribution replaced by zero, n public), and so is the stream's event under
``zero_out``: the recorded S is the sensitivity of the record's step. Under ``add_or_remove``
the fixed batches change: adding a record to the permutation the batches are cut from, at a
uniformly random position, and moving the record it displaces to the dropped rest is a coupling
of the two uniform permutations in which one batch changes by a swap (≤ 2S at each of its
participations) and no other batch changes, provided the number of batches ⌊n/b⌋ is the same
(n is treated as public): the stream is then ``GaussianEvent(z/(2·sens))``. Cyclic Poisson
streams under ``add_or_remove`` are refused (the displaced record joins another group, which
this analysis does not bound). ``replace_one`` halves z, as for every other query.

**Allocation rounds** (policies ``"balls_in_bins"`` and ``"random_allocation"``). Their
amplification rests on the whole round (every record in exactly k of its t steps), not on any
one step, so a round's released steps become one event: ``RandomAllocationSampledEvent(t, k,
GaussianEvent(z_min))`` (Feldman & Shenfeld 2025, arXiv 2502.08202) or
``BallsInBinsSampledEvent(t, GaussianEvent(z_min))`` (Chua et al. 2025, arXiv 2412.16802), with
z_min the smallest Eq. (1) noise multiplier over the round's released steps. That is a bound for
the round as run: a step released with z ≥ z_min is a post-processing of the same step with
z_min (add independent Gaussian noise of variance (z² − z_min²)·S² to it), and a round of which
only some steps were released (cut short by a restart, or steps drawn but never released) is a
post-processing of the whole round (the allocation event's analysis is over all t steps). A
round with a non-private release is ``NonPrivateEvent``. The allocation analyses are under
add-or-remove-one only (one record's k steps added or removed): under replace-one these
policies are refused.

**Epochs without amplification** (policies ``"shuffle"`` and ``"sequential"``, and ``"cyclic"``
samples carrying queries outside any stream). A record is in at most one batch of an epoch.
Samples recorded with their epoch as a round (round_selected 1) are read one event per epoch,
z_min the smallest Eq. (1) noise multiplier of its released steps, m of them:
``zero_out``: ``GaussianEvent(z_min)`` (C once); ``replace_one``: ``GaussianEvent(z_min/2)``;
``add_or_remove``: ``GaussianEvent(z_min/√5)`` for a shuffled epoch of t ≥ 5 steps (the
insertion coupling of :mod:`dpcore.accounting.samplers`: a swap in one batch and one record in
the short last one), else m steps of ``GaussianEvent(z/2)`` (removing a record shifts every
later batch by one record: a swap each). Samples without an epoch (ledgers written before,
and cyclic samples) are read per step: ``GaussianEvent(z)`` under zero-out, ``GaussianEvent(z/2)``
otherwise. The epoch's step count depends on n, which add-or-remove changes: n is treated as
public there (the report says so).

**Example-level sampling with a user-level guarantee** (ELS: Poisson samples recorded with
``max_examples_per_user`` K in a user-level ledger; Charles et al. 2024, arXiv:2407.07737). Each
user's data is bounded to at most K examples over the run, the examples are Poisson-sampled at q
and clipped to C one by one. Removing (or zeroing) a user changes up to K examples, each in the
sample independently with probability q: the step is the mixture-of-Gaussians mechanism with
sensitivities 0..K (in units of the C of Eq. (1)) and weights Binom(K, q) at the z of Eq. (1)
(Ganesh 2024, arXiv:2401.10294): ``example_level_sampling_event(q, z, K)``, K = 1 the Poisson
event itself. Analysed under add-or-remove (zero-out reads the same pair); refused under
replace-one and for the discrete Gaussian. Samples recorded with ``examples_per_user`` (user-level
sampling) are samples of users, accounted as every other sample with users as the records.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

from ..events import effective_noise_multiplier
from ..sampling import sampler_class
from ._entries import (
    ALLOCATION_POLICIES,
    CYCLIC,
    CYCLIC_POISSON,
    EPOCH_POLICIES,
    FIXED_SIZE,
    POISSON,
    SEQUENTIAL,
    SHUFFLE,
    TRUNCATED_POISSON,
    LedgerError,
    LedgerSample,
    LedgerWarning,
    _check_stream_policy,
    _declaration,
)

NEIGHBORING = ("add_or_remove", "zero_out", "replace_one")
#: Policies whose batches are not random samples: a run using them is stated under zero-out by
#: default (their add-or-remove bounds pay for a record shifting the batches).
UNAMPLIFIED_POLICIES = (SHUFFLE, SEQUENTIAL, CYCLIC, CYCLIC_POISSON)


def check_neighboring(neighboring: Any) -> str:
    if neighboring not in NEIGHBORING:
        raise ValueError(f"neighboring must be one of {', '.join(map(repr, NEIGHBORING))}, got {neighboring!r}")
    return neighboring


def run_relation(samples: Any) -> str:
    """The relation a run is stated under by default: ``zero_out`` when any of its releases used
    shuffled, fixed-order or fixed batches (or a matrix-factorization stream), else
    ``add_or_remove``."""
    for s, _ in _runs(samples):
        if s.released and (not sampler_class(s.policy).amplified or s.stream_queries()):
            return "zero_out"
    return "add_or_remove"


def analysis_relation(neighboring: str) -> str:
    """The relation the accountants analyse the events of ``neighboring`` under (zero-out
    events are the add-or-remove pair's: a zeroed record contributes what a removed one does)."""
    return "replace_one" if neighboring == "replace_one" else "add_or_remove"


def _runs(samples: Any) -> Any:
    """(sample, count) pairs: the ledger's runs of identical samples, or each sample once."""
    runs = getattr(samples, "runs", None)
    return runs() if runs is not None else [(s, 1) for s in samples]


def _down(x: float, ulps: int = 2) -> float:
    for _ in range(ulps):
        x = math.nextafter(x, 0.0)
    return max(x, 0.0)


@dataclass(frozen=True)
class StreamAccount:
    """What the ledger holds of one matrix-factorization stream, as its accountant reads it
    (see the module docstring).

    ``declaration``: the :class:`~dpcore.matrix_factorization.StreamDeclaration` rebuilt from
    the ledger; ``steps``: m, the samples carrying the stream's steps; ``noise_multiplier``: z =
    min_t z_t (σ/S of the step, Eq. (1) over the stream's groups on one sample);
    ``sensitivity``: sens(C, m, participation), recomputed; ``effective_noise_multiplier``:
    z/sens under zero-out (rounded down), the noise multiplier of the Gaussian mechanism the
    stream is (per participation, for cyclic Poisson sampling); half of it under add-or-remove
    (fixed batches) and replace-one."""

    stream: str
    declaration: Any
    steps: int
    first_sample: int
    last_sample: int
    noise_multiplier: float
    sensitivity: float
    effective_noise_multiplier: float

    @property
    def participations(self) -> int:
        """⌈m/b⌉: the most times one record took part in the steps that ran."""
        return self.declaration.participation.participations(self.steps)

    def event(self, neighboring: str = "add_or_remove", acc: Any = None) -> Any:
        """The stream's accountant event under ``neighboring`` (``acc``: the module whose event
        classes to use, :mod:`dpcore.accounting` by default)."""
        if acc is None:
            from .. import accounting as acc
        part = self.declaration.participation
        if check_neighboring(neighboring) == "add_or_remove" and part.kind == CYCLIC_POISSON:
            raise ValueError(
                f"matrix-factorization stream {self.stream} uses cyclic Poisson sampling, which is analysed under "
                "neighboring='zero_out' only (adding a record moves another to a different group); account it "
                "under zero_out"
            )
        z = self.effective_noise_multiplier * (1.0 if neighboring == "zero_out" else 0.5)
        if z == 0.0:
            return acc.NonPrivateEvent()
        if part.kind == CYCLIC_POISSON:
            return acc.SelfComposedEvent(acc.PoissonSampledEvent(part.sampling_probability, acc.GaussianEvent(z)), self.participations)
        return acc.GaussianEvent(z)


def account_streams(samples: Sequence[LedgerSample], path: str) -> List[StreamAccount]:
    """The matrix-factorization streams of ``samples`` (in order of their first step), each
    accounted as the module docstring says. Raises :class:`LedgerError` naming the sample when a
    step lies on a sample whose policy does not match the stream's participation schema, or
    when the steps of one stream carry different declarations."""
    tallies: Dict[str, List[Any]] = {}  # id -> [declaration text, m, first, last, z]
    for s, count in _runs(samples):
        if not s.released:
            continue
        for sid, ts in s.stream_queries().items():
            text = ts[0].declaration
            if any(t.declaration != text for t in ts):
                raise LedgerError(f"{path}: sample {s.sample}: the steps of stream {sid} carry different declarations")
            z = effective_noise_multiplier(ts)
            last = s.sample + count - 1
            tally = tallies.get(sid)
            if tally is None:
                try:
                    dec = _declaration(text)
                except (TypeError, ValueError) as e:
                    raise LedgerError(f"{path}: matrix-factorization stream {sid}: invalid declaration: {e}") from None
                tallies[sid] = tally = [text, dec, 0, s.sample, last, math.inf]
            elif tally[0] != text:
                raise LedgerError(
                    f"{path}: sample {s.sample}: stream {sid} carries another declaration than its earlier steps"
                )
            why = _check_stream_policy(s, sid, tally[1])
            if why is not None:
                raise LedgerError(f"{path}: {why}; it cannot be accounted as that stream")
            tally[2] += count
            tally[4] = last
            tally[5] = min(tally[5], z)
    out = []
    for sid, (_, dec, m, first, last, z) in tallies.items():
        sens = dec.sensitivity(m)
        out.append(StreamAccount(sid, dec, m, first, last, z, sens, _down(z / sens) if z > 0 else 0.0))
    return out


def samples_to_event(
    samples: Sequence[LedgerSample], path: str, neighboring: str = "add_or_remove", *, stacklevel: int = 3
) -> Any:
    """The samples of the ledger at ``path`` as one accountant event; see
    :meth:`dpcore.ledger.PrivacyLedger.to_event`. ``stacklevel`` (as for :func:`warnings.warn`
    from here) attributes the shuffle and seed warnings; the default names the caller of
    ``PrivacyLedger.to_event``.

    The steps of matrix-factorization streams are accounted per stream
    (:func:`account_streams`); the stream events follow the per-sample ones. Other queries on
    ``"cyclic"`` and ``"cyclic_poisson"`` samples are accounted like shuffled ones: a bare
    Gaussian event each, without amplification (conservative). The released steps of an
    allocation round become one event (see the module docstring); ValueError under
    ``neighboring="replace_one"`` for these policies."""
    # Looked up at call time, not imported with the module: the accountant's event classes are
    # what dpcore.accounting exports when the ledger is accounted (the ledger's tests put a
    # stand-in for that contract there to test this conversion on its own).
    from .. import accounting as acc

    check_neighboring(neighboring)
    events: List[Any] = []
    shuffled = cyclic = seeded = 0

    def add(ev: Any, count: int) -> None:
        if events and events[-1][0] == ev:
            events[-1][1] += count
        else:
            events.append([ev, count])

    def gaussian(z: float, discrete: bool) -> Any:
        return acc.DiscreteGaussianEvent(z) if discrete else acc.GaussianEvent(z)

    # The round being read: [first sample, smallest z, non-private, discrete, released steps].
    open_round: List[Any] = []

    def close_round() -> None:
        if not open_round:
            return
        first, z_min, non_private, discrete, m = open_round
        open_round.clear()
        if non_private or z_min == 0.0:
            add(acc.NonPrivateEvent(), 1)
            return
        if math.isinf(z_min):
            return  # only steps of matrix-factorization streams (refused on these policies anyway)
        ev, n = sampler_class(first.policy).round_event(first, z_min, m, neighboring, lambda z: gaussian(z, discrete), acc)
        add(ev, n)

    for s, count in _runs(samples):
        if not s.released:
            continue
        seeded += s.seeded * count
        if s.allocation:
            if s.policy in ALLOCATION_POLICIES and neighboring == "replace_one":
                raise ValueError(_ALLOCATION_REPLACE_ONE.format(path=path, policy=s.policy))
            if open_round and (open_round[0].round != s.round or open_round[0].policy != s.policy):
                close_round()
            z = s.noise_multiplier()
            if not open_round:
                open_round.extend([s, z, s.non_private, s.discrete, count])
            else:
                open_round[1] = min(open_round[1], z)
                open_round[2] = open_round[2] or s.non_private
                open_round[3] = open_round[3] or s.discrete
                open_round[4] += count
            if s.policy in EPOCH_POLICIES:
                shuffled += count
            # A run of one sample each (a round's steps differ in step_in_round), but a run of
            # several would be several steps of the same round: nothing more to add.
            continue
        close_round()
        z = s.noise_multiplier()
        if math.isinf(z):
            continue  # every query on it is a step of a matrix-factorization stream
        # A sample with any discrete Gaussian query is one discrete Gaussian mechanism with the
        # z of Eq. (1): Gaussian groups beside it have the same Rényi curve α/(2z_g²), so the
        # product's curve is α/(2z²) either way (CKS 2020, Theorem 14).
        if z == 0.0:
            ev: Any = acc.NonPrivateEvent()
        elif s.max_examples_per_user is not None and s.max_examples_per_user > 1:
            ev = _els_event(s, z, neighboring, path, acc)
        else:
            cls = sampler_class(s.policy)
            if not cls.amplified:
                if cls.rounds == "epoch":
                    shuffled += count
                else:
                    cyclic += count
            ev = cls.step_event(s, z, neighboring, lambda z, d=s.discrete: gaussian(z, d), acc)
        add(ev, count)
    close_round()
    for stream in account_streams(samples, path):
        try:
            add(stream.event(neighboring, acc), 1)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    if shuffled:
        warnings.warn(
            f"{path}: {shuffled} sample(s) are batches of a shuffled or fixed-order loader; they get no sampling "
            "amplification (a shuffled epoch is not a random sample: McMahan et al. 2018, §5): each epoch is one "
            f"Gaussian query (accounted under neighboring={neighboring!r}, with the number of steps per epoch treated "
            "as public). Use Poisson sampling to get amplification.",
            LedgerWarning,
            stacklevel=stacklevel,
        )
    if cyclic:
        warnings.warn(
            f"{path}: {cyclic} sample(s) of cyclic batches (the policies of matrix-factorization streams) carry "
            "sum queries outside any stream; those queries are accounted without sampling amplification (each "
            "as a full Gaussian query on the whole data set), because a batch of a fixed partition is not a "
            "random sample. Release them through the stream's matrix-factorization query to account them with it.",
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


def _els_event(s: LedgerSample, z: float, neighboring: str, path: str, acc: Any) -> Any:
    """The mixture-of-Gaussians step of an ELS sample (see the module docstring)."""
    if neighboring == "replace_one":
        raise ValueError(
            f"{path}: sample {s.sample} is example-level sampling with a user-level guarantee "
            f"(max_examples_per_user={s.max_examples_per_user}), whose mixture-of-Gaussians analysis is under "
            "neighboring='add_or_remove' (or zero_out) only"
        )
    if s.discrete:
        raise ValueError(
            f"{path}: sample {s.sample} used the discrete Gaussian with max_examples_per_user="
            f"{s.max_examples_per_user}: the mixture-of-Gaussians analysis of a user is for continuous Gaussian noise "
            "only"
        )
    return acc.example_level_sampling_event(s.sampling_probability, z, s.max_examples_per_user)


_ALLOCATION_REPLACE_ONE = (
    "{path}: the ledger holds {policy} samples (random allocation: every record in exactly k of a round's t "
    "steps), whose analysis (Feldman & Shenfeld 2025; Chua et al. 2025) is under neighboring='add_or_remove' "
    "only; account this ledger under add_or_remove"
)


def rdp_relation_error(samples: Sequence[LedgerSample], path: str, neighboring: str) -> "str | None":
    """Why the RDP accountant cannot account these samples under ``neighboring``, or None.

    Its analyses exist for Poisson samples (truncated or not) and allocation rounds under
    add-or-remove and for fixed-size samples without replacement under replace-one only; a
    ledger is accounted under one relation.
    """
    policies = {s.policy for s, _ in _runs(samples) if s.released and s.noise_multiplier() > 0}
    if neighboring == "zero_out":
        return None  # every policy's zero-out event is an add-or-remove one (samples_to_event)
    if neighboring == "replace_one":
        for p in ALLOCATION_POLICIES:
            if p in policies:
                return _ALLOCATION_REPLACE_ONE.format(path=path, policy=p)
        if TRUNCATED_POISSON in policies:
            return (
                f"{path}: the ledger holds truncated_poisson samples, which the RDP accountant analyses only "
                "under neighboring='add_or_remove'"
            )
    sampled_streams = any(
        s.policy == CYCLIC_POISSON and s.stream_queries() for s, _ in _runs(samples) if s.released
    )
    if neighboring == "add_or_remove" and FIXED_SIZE in policies:
        others = [p for p in (POISSON, TRUNCATED_POISSON, *ALLOCATION_POLICIES) if p in policies]
        return (
            f"{path}: the ledger holds fixed_size_without_replacement samples, which the RDP "
            "accountant analyses only under neighboring='replace_one'"
            + (f"; it also holds {' and '.join(others)} samples (add_or_remove only), so it cannot be accounted as one"
               if others else "")
        )
    if neighboring == "replace_one" and POISSON in policies:
        return (
            f"{path}: the ledger holds poisson samples, which the RDP accountant analyses only "
            "under neighboring='add_or_remove'"
        )
    if neighboring == "replace_one" and sampled_streams:
        return (
            f"{path}: the ledger holds matrix-factorization streams with cyclic Poisson sampling, which the "
            "RDP accountant analyses only under neighboring='add_or_remove'"
        )
    return None
