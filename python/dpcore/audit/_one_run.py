"""One-run privacy audit of dpcore's own mechanism (Steinke, Nasr & Jagielski 2023, "Privacy
auditing with one (1) training run", NeurIPS 2023; white-box gradient canaries), analysed three
ways (:mod:`dpcore.audit._fdp`).

The audit checks the claim from outside the accountant: it runs the mechanism, and counts
how often an adversary who sees only the released noisy sums can tell which canaries were in.

1. m canaries; canary i is the gradient 2C·e_i (a one-hot direction, so canaries do not
   interfere; its norm 2C is clipped to C like any record). Each is included with probability
   1/2, independently (S_i ∈ {0, 1}, from ChaCha20).
2. ``steps`` releases of DP-SGD: a Poisson sample of the included canaries at rate q
   (:func:`dpcore.poisson_sample`), their clipped sum with Gaussian noise of stddev σ·C
   (the core's ChaCha20 noise, :func:`dpcore.gaussian_noise`, once per release), recorded in a
   privacy ledger. Since the clipped canaries are C·e_i, coordinate i of a release is exactly
   c·[i sampled] + noise_i, c the core's clip of one canary record (:func:`dpcore.clip_sum`):
   that is computed directly, O(m) per release. It equals :func:`dpcore.clip_noise` on the
   dense (sampled × m) one-hot records with the same seed, which ``_release_dense`` computes
   and tests/test_audit.py compares.
3. Canary i's score is the sum over releases of coordinate i (its projection on e_i).
4. For each k of :func:`~dpcore.audit._fdp.guess_counts` (10, 20, 50, ... up to m, fixed in
   advance), the auditor guesses "in" for the k/2 highest scores and "out" for the k/2 lowest,
   and abstains on the rest; v_k of its guesses are right.
5. Two lower bounds on ε at δ from the (k, v_k), each at confidence 1 − α/2 (α = 1 −
   ``confidence``), Bonferroni-corrected over the k's, so that both hold at ``confidence``:

   * Steinke et al. 2023, Theorem 3.1 (:func:`~dpcore.audit._fdp.steinke_epsilon_lower_bound`);
   * the f-DP analysis of Mahloujifar, Melis & Chaudhuri 2025
     (:func:`~dpcore.audit._fdp.fdp_rejects`), against the curve the claim is made of: at
     q = 1 every included canary is in every release, the mechanism is exactly μ-GDP with
     μ = √steps/σ (Dong, Roth & Su 2022), and the largest μ rejected becomes ε at δ
     (:func:`~dpcore.audit._fdp.gdp_epsilon`); at q < 1 the claim is not a Gaussian curve, and
     the (ε, δ) curves are tested instead (``fdp_curve``: ``"gaussian"`` or
     ``"epsilon_delta"``). The largest μ rejected (``mu_lower_bound``) is reported in both
     cases; at q < 1 it says only that the mechanism is not μ-GDP.

   Beside them, an *estimate* (not a bound): the Gaussian-DP fit of the scores
   (:func:`~dpcore.audit._fdp.gdp_fit`: μ̂ from the AUROC, its ε at δ, TPR at FPR 1% and 0.1%).

``passed`` is False when either lower bound exceeds the claim, the ledger's ε under the default
accountant. ``actual_noise_multiplier`` runs the mechanism with less (or more) noise than
claimed: with 4× too little noise the audit fails, which shows it has power. With m canaries a
one-run audit can prove at most about ε = ln(m/ln(1/α)) (Steinke et al. 2023), about 10 at
m = 100 000; the f-DP bound at q = 1 reaches further, being a bound on μ.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import numpy as np

from .._validate import count as _int, positive as _positive
from ..ledger import PrivacyLedger
from ..mechanism import clip_noise, clip_sum, gaussian_noise
from .._seeds import derive_seed
from ..sampling import poisson_sample
from ._fdp import (
    count_correct,
    fdp_epsilon_lower_bound,
    gdp_epsilon,
    gdp_fit,
    gdp_mu_lower_bound,
    guess_counts,
    steinke_epsilon_lower_bound,
    steinke_p_value,
)

__all__ = ["AuditResult", "one_run_audit", "analyze_scores", "epsilon_lower_bound", "p_value"]

# The defaults: an honest run passes with a lower bound above 0, and 4× too little noise fails
# (tests/test_audit.py, several seeds); about a second.
DEFAULT_CANARIES = 100_000
DEFAULT_STEPS = 10
DEFAULT_SAMPLING_PROBABILITY = 0.5
_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class AuditResult:
    """The outcome of a one-run audit: the claim, two lower bounds on ε at ``delta`` (each holds
    with probability ≥ 1 − (1 − ``confidence``)/2, so both hold at ``confidence``), and an
    estimate.

    * ``epsilon_lower_bound``: the larger of the two bounds; ``passed`` is
      ``epsilon_lower_bound <= epsilon_claimed``.
    * ``epsilon_lower_bound_steinke``: Steinke, Nasr & Jagielski 2023, Theorem 3.1.
    * ``epsilon_lower_bound_fdp``: Mahloujifar, Melis & Chaudhuri 2025 against the curve named
      by ``fdp_curve``: ``"gaussian"`` (the claim is μ-GDP, ``mu_claimed``: the ε at δ of the
      largest μ rejected) or ``"epsilon_delta"`` (the largest ε whose (ε, δ) curve is rejected).
    * ``mu_lower_bound``: the largest μ for which μ-GDP is rejected.
    * ``gdp_fit``: the Gaussian-DP fit, an estimate: ``mu``, ``mu_interval``, ``epsilon``,
      ``epsilon_interval``, ``auroc``, ``tpr_at_fpr`` (``"0.01"``, ``"0.001"``).
    * ``guesses``: per number of guesses k, the correct guesses and each analysis's bound.
    """

    epsilon_claimed: float
    epsilon_lower_bound: float
    passed: bool
    epsilon_lower_bound_steinke: float
    epsilon_lower_bound_fdp: float
    fdp_curve: str
    mu_lower_bound: float
    mu_claimed: Optional[float]
    gdp_fit: Dict[str, Any]
    delta: float
    confidence: float
    noise_multiplier: float
    actual_noise_multiplier: float
    steps: int
    sampling_probability: float
    canaries: int
    guesses: Dict[int, Dict[str, float]]
    seconds: float
    #: "mechanism" (:func:`one_run_audit`) or "torch" (:func:`dpcore.audit.audit_torch_training`)
    target: str = "mechanism"
    #: "gradient" (white-box gradient canaries) or "input" (black-box input canaries)
    canary_kind: str = "gradient"
    #: the trained model's accuracy on held-out data (torch audits only)
    test_accuracy: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["guesses"] = {str(k): v for k, v in self.guesses.items()}
        return d


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[W ≥ v] bound for r guesses on m canaries under (ε, δ)-DP (Steinke et al. 2023,
    Theorem 3.1 and Algorithm 2; :func:`~dpcore.audit._fdp.steinke_p_value`)."""
    return steinke_p_value(m, r, v, epsilon, delta)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
    """The largest ε that ``v`` correct guesses out of ``r`` reject at ``confidence``: ε < the
    returned value is inconsistent with the observation (p-value < 1 − confidence)."""
    return steinke_epsilon_lower_bound(m, r, v, delta, confidence)


def analyze_scores(
    scores: Any,
    member: Any,
    *,
    delta: float,
    confidence: float,
    mu_claimed: Optional[float] = None,
) -> Dict[str, Any]:
    """The three analyses of one run's canary scores (higher means "in"; ``member`` the coins):
    the guesses of every k of :func:`~dpcore.audit._fdp.guess_counts`, the Steinke and f-DP
    lower bounds (each at 1 − α/2, Bonferroni over the k's), and the Gaussian-DP fit.

    ``mu_claimed``: the claim is μ-GDP with this μ (DP-SGD at q = 1), so the f-DP bound tests
    Gaussian curves and converts the largest μ rejected to ε at δ; None: the (ε, δ) curves."""
    s = np.asarray(scores, dtype=np.float64)
    mem = np.asarray(member, dtype=bool)
    if s.ndim != 1 or s.shape != mem.shape:
        raise ValueError(f"scores and member must be 1-d of one length, got {s.shape} and {mem.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("a canary score is not finite")
    m = len(s)
    ks = guess_counts(m)
    conf_each = 1.0 - (1.0 - confidence) / (2 * len(ks))  # two analyses, Bonferroni over the k's
    order = np.argsort(s, kind="stable")
    gaussian = mu_claimed is not None
    per: Dict[int, Dict[str, float]] = {}
    best_st = best_fdp = best_mu = 0.0
    for k in ks:
        v = count_correct(s, mem, k, order)
        st = steinke_epsilon_lower_bound(m, k, v, delta, conf_each)
        mu = gdp_mu_lower_bound(m, k, v, conf_each)
        fd = gdp_epsilon(mu, delta) if gaussian else fdp_epsilon_lower_bound(m, k, v, delta, conf_each)
        per[k] = {"correct": v, "steinke": st, "fdp": fd, "mu": mu}
        best_st, best_fdp, best_mu = max(best_st, st), max(best_fdp, fd), max(best_mu, mu)
    return {
        "epsilon_lower_bound_steinke": best_st,
        "epsilon_lower_bound_fdp": best_fdp,
        "fdp_curve": "gaussian" if gaussian else "epsilon_delta",
        "mu_lower_bound": best_mu,
        "mu_claimed": None if mu_claimed is None else float(mu_claimed),
        "gdp_fit": _fit(s, mem, delta, confidence),
        "guesses": per,
    }


def _fit(s: np.ndarray, mem: np.ndarray, delta: float, confidence: float) -> Dict[str, Any]:
    if mem.all() or not mem.any():  # no canary in (or none out): nothing to fit
        nan = float("nan")
        return {"mu": nan, "mu_interval": [nan, nan], "epsilon": nan, "epsilon_interval": [nan, nan],
                "auroc": nan, "tpr_at_fpr": {"0.01": nan, "0.001": nan}, "confidence": float(confidence)}
    return gdp_fit(s, mem, delta, confidence)


def _clipped_canary(c: float, m: int) -> float:
    """The core's clip of one canary record, 2C·e_0 in m coordinates (:func:`dpcore.clip_sum`):
    the canaries are one-hot, so the clipped record i is this value times e_i. It is C up to the
    core's rounding margin, which grows with the dimension m, hence a record of the true width."""
    rec = np.zeros((1, m), dtype=np.float64)
    rec[0, 0] = 2.0 * c
    (s,), _ = clip_sum([rec], c)
    return float(s[0])


def _release(ids: np.ndarray, m: int, c: float, z: float, seed: Optional[int], value: Optional[float] = None) -> np.ndarray:
    """One release of the m-coordinate clipped sum of the canaries ``ids`` (one-hot 2C·e_i)
    with N(0, (zC)²) noise: the core's noise, plus the clipped canary value on the sampled
    coordinates. O(m)."""
    out = gaussian_noise(m, z * c, dtype=np.float64, seed=seed)
    out[ids] += _clipped_canary(c, m) if value is None else value
    return out


def _release_dense(ids: np.ndarray, m: int, c: float, z: float, seed: Optional[int]) -> np.ndarray:
    """The same release from the dense (sampled × m) one-hot records through
    :func:`dpcore.clip_noise` (noise once) and :func:`dpcore.clip_sum` (further chunks): the
    reference :func:`_release` is tested against."""
    rows = max(1, _CHUNK_BYTES // (8 * m))
    released = None
    for lo in range(0, max(1, len(ids)), rows):
        part = ids[lo : lo + rows]
        recs = np.zeros((len(part), m), dtype=np.float64)
        recs[np.arange(len(part)), part] = 2.0 * c  # norm 2C: clipped to C
        if released is None:
            (released,) = clip_noise([recs], c, z, seed=seed)
        else:
            (s,), _ = clip_sum([recs], c)
            released = released + s
    assert released is not None
    return released


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
    one). ``seed``: tests only. ``progress(done, total)`` is called after each release.
    100 000 canaries (the default) take about a second; the run is O(m) per release."""
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
    from ..events import SumQueryEvent

    # Step 1: which canaries are in (fair coins from the core's ChaCha20 sampler).
    included = np.sort(poisson_sample(m, 0.5, seed=derive_seed(seed, 0)))
    member = np.zeros(m, dtype=bool)
    member[included] = True
    value = _clipped_canary(c, m)
    scores = np.zeros(m, dtype=np.float64)
    for t in range(steps):
        # Step 2: a Poisson sample of the included canaries, recorded, then released.
        pick = poisson_sample(len(included), q, seed=derive_seed(seed, 1, t))
        led.record_sample(max(1, len(included)), q, "poisson", seeded=seed is not None)
        released = _release(included[pick], m, c, z_act, derive_seed(seed, 2, t), value)
        # The claim: the noise multiplier z (the ledger records what is claimed, so the
        # audit compares the claimed ε with what the released sums reveal).
        led.record_release(SumQueryEvent(c, z * c))
        scores += released  # step 3: canary i's coordinate
        if progress is not None:
            progress(t + 1, steps)

    claimed = led.get_epsilon(delta) if seed is None else _quiet_epsilon(led, delta)
    mu_claimed = math.sqrt(steps) / z if q == 1.0 else None
    return audit_result(
        scores, member, claimed, delta=delta, confidence=confidence, mu_claimed=mu_claimed, noise_multiplier=z,
        actual_noise_multiplier=z_act, steps=steps, sampling_probability=q, canaries=m,
        seconds=time.perf_counter() - t0,
    )


def audit_result(
    scores: np.ndarray, member: np.ndarray, claimed: float, *, delta: float, confidence: float,
    mu_claimed: Optional[float], **fields: Any,
) -> "AuditResult":
    """The :class:`AuditResult` of canary ``scores`` against the ``claimed`` ε: the analyses of
    :func:`analyze_scores`, the larger of the two lower bounds, and whether it stays within the
    claim; ``fields`` are the run's own (noise, steps, canaries, ...)."""
    a = analyze_scores(scores, member, delta=delta, confidence=confidence, mu_claimed=mu_claimed)
    lower = max(a["epsilon_lower_bound_steinke"], a["epsilon_lower_bound_fdp"])
    return AuditResult(
        epsilon_claimed=claimed, epsilon_lower_bound=lower, passed=lower <= claimed, delta=float(delta),
        confidence=float(confidence), **fields, **a,
    )


def _quiet_epsilon(led: PrivacyLedger, delta: float) -> float:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a seeded audit's ledger warns about its seed
        return led.get_epsilon(delta)
