"""One-run privacy audit of dpcore's own mechanism (Steinke, Nasr & Jagielski 2023, "Privacy
auditing with one (1) training run", NeurIPS 2023; white-box gradient canaries).

The audit checks the claim from outside the accountant: it runs the mechanism, and counts
how often an adversary who sees only the released noisy sums can tell which canaries were in.

1. m canaries; canary i is the gradient 2C·e_i (a one-hot direction, so canaries do not
   interfere; its norm 2C is clipped to C like any record). Each is included with probability
   1/2, independently (S_i ∈ {0, 1}, from ChaCha20).
2. ``steps`` releases of DP-SGD: a Poisson sample of the included canaries at rate q
   (:func:`dpcore.poisson_sample`), their clipped sum with Gaussian noise of stddev σ·C
   (:func:`dpcore.clip_noise`, noise added once per release), recorded in a privacy ledger.
3. Canary i's score is the sum over releases of coordinate i (its projection on e_i).
4. The auditor guesses "in" for the k/2 highest scores and "out" for the k/2 lowest, and
   abstains on the rest, for a few k fixed in advance.
5. If the mechanism is (ε, δ)-DP, the number of correct guesses W out of r = k satisfies
   P[W ≥ v] ≤ P[Binom(r, p_ε) ≥ v] + 2mδ · max_{1≤i≤v} P[v − i ≤ Binom(r, p_ε) < v]/i with
   p_ε = e^ε/(1 + e^ε) (Steinke et al. 2023, Theorem 3.1 with δ, and their Algorithm 2 for
   the bound). The ε lower bound is the largest ε that this test rejects at the confidence
   level; the k's share the confidence by a Bonferroni correction, so the reported bound (the
   largest over the k's) holds at the stated confidence.

``passed`` is ``epsilon_lower_bound <= epsilon_claimed``, the claim being the ledger's ε under
the default accountant. ``actual_noise_multiplier`` runs the mechanism with less (or more) noise
than claimed: with 4× too little noise the default audit fails, which shows it has power.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import numpy as np

from ._validate import count as _int, positive as _positive
from .ledger import PrivacyLedger
from .mechanism import clip_noise, clip_sum
from ._seeds import derive_seed
from .sampling import poisson_sample

__all__ = ["AuditResult", "one_run_audit", "epsilon_lower_bound", "p_value"]

# The defaults: an honest run passes with a lower bound above 0, and 4× too little noise fails
# (tests/test_audit.py, several seeds); about 5 s here.
DEFAULT_CANARIES = 20_000
DEFAULT_STEPS = 10
DEFAULT_SAMPLING_PROBABILITY = 0.5
#: Fractions of the canaries guessed on (half "in", half "out"), fixed before the run.
GUESS_FRACTIONS = (0.01, 0.05, 0.2)
_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class AuditResult:
    epsilon_claimed: float
    epsilon_lower_bound: float
    passed: bool
    delta: float
    confidence: float
    noise_multiplier: float
    actual_noise_multiplier: float
    steps: int
    sampling_probability: float
    canaries: int
    #: per guess count k: correct guesses and the lower bound at the corrected confidence
    guesses: Dict[int, Dict[str, float]]
    seconds: float

    def to_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["guesses"] = {str(k): v for k, v in self.guesses.items()}
        return d


def _log_binom_pmf(k: np.ndarray, n: int, p: float) -> np.ndarray:
    k = np.asarray(k, dtype=np.float64)
    lg = np.vectorize(math.lgamma)
    return lg(n + 1.0) - lg(k + 1.0) - lg(n - k + 1.0) + k * math.log(p) + (n - k) * math.log1p(-p)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[W ≥ v] bound for r guesses on m canaries under (ε, δ)-DP (module docstring, step 5;
    Steinke et al. 2023, Theorem 3.1 and Algorithm 2)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if v == 0:
        return 1.0
    p = 1.0 / (1.0 + math.exp(-epsilon))
    pmf = np.exp(_log_binom_pmf(np.arange(r + 1), r, p))
    beta = float(pmf[v:].sum())  # P[Binom(r, p) >= v]
    below = np.cumsum(pmf[v - 1 :: -1])  # below[i-1] = P[v - i <= Binom < v], i = 1..v
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, beta + alpha * delta * 2 * m)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
    """The largest ε that ``v`` correct guesses out of ``r`` reject at ``confidence``: ε < the
    returned value is inconsistent with the observation (p-value < 1 − confidence)."""
    alpha = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < alpha and hi < 200:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) < alpha:
            lo = mid
        else:
            hi = mid
    return lo




def one_run_audit(
    noise_multiplier: float,
    *,
    steps: int = DEFAULT_STEPS,
    sampling_probability: float = DEFAULT_SAMPLING_PROBABILITY,
    canaries: int = DEFAULT_CANARIES,
    actual_noise_multiplier: Optional[float] = None,
    delta: float = 1e-5,
    confidence: float = 0.95,
    l2_norm_clip: float = 1.0,
    ledger: Any = None,
    seed: Optional[int] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> AuditResult:
    """Audits DP-SGD with ``noise_multiplier`` in one run (see the module docstring).

    ``actual_noise_multiplier``: the noise the mechanism really adds (default: the claimed one).
    ``ledger``: a path or :class:`PrivacyLedger` to keep the run's ledger (default: a temporary
    one). ``seed``: tests only. ``progress(done, total)`` is called after each release."""
    t0 = time.perf_counter()
    z = _positive("noise_multiplier", noise_multiplier)
    z_act = z if actual_noise_multiplier is None else _positive("actual_noise_multiplier", actual_noise_multiplier)
    steps = _int("steps", steps, 1)
    m = _int("canaries", canaries, 10)
    q = float(sampling_probability)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_probability must be in (0, 1], got {sampling_probability!r}")
    if not (isinstance(delta, numbers.Real) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if not (isinstance(confidence, numbers.Real) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    c = _positive("l2_norm_clip", l2_norm_clip)
    if ledger is None:
        import os
        import tempfile

        ledger = os.path.join(tempfile.mkdtemp(prefix="dpcore-audit-"), "ledger.jsonl")
    led = ledger if isinstance(ledger, PrivacyLedger) else PrivacyLedger(ledger)

    # Step 1: which canaries are in (fair coins from the core's ChaCha20 sampler).
    included = np.sort(poisson_sample(m, 0.5, seed=derive_seed(seed, 0)))
    member = np.zeros(m, dtype=bool)
    member[included] = True
    scores = np.zeros(m, dtype=np.float64)
    rows = max(1, _CHUNK_BYTES // (4 * m))
    for t in range(steps):
        # Step 2: a Poisson sample of the included canaries, recorded, then released.
        pick = poisson_sample(len(included), q, seed=derive_seed(seed, 1, t))
        led.record_sample(max(1, len(included)), q, "poisson", seeded=seed is not None)
        ids = included[pick]
        released = None
        for lo in range(0, max(1, len(ids)), rows):
            part = ids[lo : lo + rows]
            recs = np.zeros((len(part), m), dtype=np.float32)
            recs[np.arange(len(part)), part] = 2.0 * c  # norm 2C: clipped to C
            if released is None:  # the noise, once per release
                (released,) = clip_noise([recs], c, z_act, seed=derive_seed(seed, 2, t))
                released = released.astype(np.float64)
            else:
                (s,), _ = clip_sum([recs], c)
                released += s
        from .events import SumQueryEvent

        # The claim: the noise multiplier z (the ledger records what is claimed, so the
        # audit compares the claimed ε with what the released sums reveal).
        led.record_release(SumQueryEvent(c, z * c))
        scores += released  # step 3: canary i's coordinate
        if progress is not None:
            progress(t + 1, steps)

    # Steps 4-5: guesses on the extremes, the bound, Bonferroni over the guess counts.
    order = np.argsort(scores, kind="stable")
    ks = sorted({max(2, 2 * int(f * m / 2)) for f in GUESS_FRACTIONS})
    conf_each = 1.0 - (1.0 - confidence) / len(ks)
    per: Dict[int, Dict[str, float]] = {}
    best = 0.0
    for k in ks:
        h = k // 2
        v = int(member[order[-h:]].sum() + (~member[order[:h]]).sum())
        e = epsilon_lower_bound(m, k, v, delta, conf_each)
        per[k] = {"correct": v, "epsilon_lower_bound": e}
        best = max(best, e)
    claimed = led.get_epsilon(delta) if seed is None else _quiet_epsilon(led, delta)
    return AuditResult(
        epsilon_claimed=claimed,
        epsilon_lower_bound=best,
        passed=best <= claimed,
        delta=float(delta),
        confidence=float(confidence),
        noise_multiplier=z,
        actual_noise_multiplier=z_act,
        steps=steps,
        sampling_probability=q,
        canaries=m,
        guesses=per,
        seconds=time.perf_counter() - t0,
    )


def _quiet_epsilon(led: PrivacyLedger, delta: float) -> float:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a seeded audit's ledger warns about its seed
        return led.get_epsilon(delta)
