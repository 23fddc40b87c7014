"""The ε that ``sampler_epsilon`` states for shuffled, fixed-order (``sequential``) and fixed-batch
(``cyclic``) loaders under each neighbouring relation, against the EXACT ε of adversarial
adjacent pairs (issue 35).

Records are 1-D, in [−1, 1] (clip C = 1); each step releases the sum of its batch plus N(0, z²).
The pairs: all records but one identical, so the mixture over permutations reduces to a mixture
over the batch the distinguished record lands in (tests/exact_curves.py computes its privacy
curve with certified rounding: a bracket [ε_lo, ε_hi] ∋ exact ε, no Monte Carlo). A fixed order
is deterministic: the pair is exactly a Gaussian mechanism, μ = |Δ sums|/z.

Every stated ε must be an upper bound: ``sampler_epsilon ≥ ε_hi`` (the upper end of the
bracket, 1e-9 relative for rounding). Where the analysis is tight (fixed order add-or-remove
with many batches, fixed order zero-out and replace-one, fixed batches with one batch and
nothing dropped) the stated ε must also be within 5% of the exact one.
"""

import itertools
import math
import os
import sys
from functools import lru_cache

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import exact_curves as X  # noqa: E402

DELTA = 1e-5
TIGHT = 1.05  # stated/exact where the analysis is tight
REL = 1e-9  # rounding tolerance of the upper-bound assertions


def stated(sampler, z, steps, *, q, relation, k=None):
    from dpcore.accounting import sampler_epsilon

    return sampler_epsilon(sampler, z, steps, DELTA, sampling_probability=q, neighboring=relation, steps_per_epoch=k)


def bracket(pair, width=2e-3):
    """ε(δ) of a lattice pair: the certified bracket, at most ``width`` wide (relative), so that
    its midpoint is the exact ε to 1e-3."""
    e = pair.epsilons(DELTA)
    assert e.lo <= e.hi <= e.lo * (1 + width), (e.lo, e.hi)
    return e


def assert_upper(stated_eps, exact_hi, what):
    assert stated_eps >= exact_hi * (1 - REL), (
        f"{what}: stated ε = {stated_eps:.6g} is BELOW the exact ε of an adjacent pair ({exact_hi:.6g})"
    )


# ------------------------------------------------------------------------------ the pairs


def cyclic_pair(n_mix, batch_size, steps, z, jump, h):
    """Fixed batches: one permutation of the n_mix records of the data set holding the
    distinguished record, cut into b = n_mix // batch_size batches (rest dropped), batch t mod b
    at step t. The record is in batch j with probability batch_size/n_mix (its P_j steps move by
    ``jump``: 2 for a +1 among −1s (added/removed, replaced by −1), 1 for a +1 among 0s zeroed
    out) or dropped; the other data set is deterministic."""
    b = n_mix // batch_size
    parts = [sum(1 for t in range(steps) if t % b == j) for j in range(b)]
    w = batch_size / n_mix
    weights = [w for p in parts if p]
    mus = [jump * math.sqrt(p) / z for p in parts if p]
    return X.orthogonal_pair(weights, mus, h, w0=1.0 - w * len(weights))


def shuffle_orthogonal_pair(n, batch_size, epochs, z, jump, h):
    """Shuffled, n the same on both sides (zero-out: +1 among 0s against 0; replace-one: +1
    among −1s against −1): in each epoch the record is in batch j with probability |B_j|/n, and
    that batch moves by ``jump``; fresh permutation every epoch."""
    sizes = [min(batch_size, n - s) for s in range(0, n, batch_size)]
    return X.orthogonal_pair([s / n for s in sizes], [jump / z] * len(sizes), h).compose(epochs)


def shuffle_add_pair(n, batch_size, epochs, z, h):
    """Shuffled, add-or-remove: n records at −1 against the same plus one at +1, with the same
    number k = ⌈n/b⌉ of batches on both sides (the record displaces a −1 into the short last
    batch, or lands in it)."""
    k = -(-n // batch_size)
    assert -(-(n + 1) // batch_size) == k
    last = n + 1 - (k - 1) * batch_size
    return X.shuffle_insert_pair(k, batch_size / (n + 1), last / (n + 1), z, h).compose(epochs)


@lru_cache(maxsize=None)
def issue_shuffle_pair():
    # n = 1000, batch 900: 2 steps an epoch; the record removed from 1000 (999 at −1)
    return X.shuffle_insert_pair(2, 0.9, 0.1, 1.0, 0.003).compose(10)


# ------------------------------------------------------------------------------ the engine


def test_lattice_lse_matches_brute_force():
    rng = np.random.default_rng(7)
    h = 0.05
    for up in (True, False):
        U = X.Lat(h, up, -7, rng.random(30) / 40, 0.0)
        V = X.Lat(h, up, 3, rng.random(45) / 60, 0.0)
        U.atom, V.atom = 1 - U.p.sum(), 1 - V.p.sum()
        W = X.lse(U, V)
        want = {}
        for (iu, pu), (iv, pv) in itertools.product(enumerate(U.p), enumerate(V.p)):
            a, b = (U.off + iu) * h, (V.off + iv) * h
            val = max(a, b) + math.log1p(math.exp(-abs(a - b)))
            k = math.ceil(val / h - 1e-12) if up else math.floor(val / h + 1e-12)
            want[k] = want.get(k, 0.0) + pu * pv
        if not up:  # −∞ ⊕ v = v
            for iu, pu in enumerate(U.p):
                want[U.off + iu] = want.get(U.off + iu, 0.0) + pu * V.atom
            for iv, pv in enumerate(V.p):
                want[V.off + iv] = want.get(V.off + iv, 0.0) + pv * U.atom
        got = dict(zip(range(W.off, W.off + len(W.p)), W.p))
        assert set(k for k, v in got.items() if v > 0) <= set(want)
        assert max(abs(got.get(k, 0.0) - v) for k, v in want.items()) < 1e-15
        assert W.atom == pytest.approx((1 - (1 - U.atom) * (1 - V.atom)) if up else U.atom * V.atom, abs=1e-16)


@pytest.mark.parametrize("mu", [0.5, 1.0, 3.0])
def test_engine_brackets_the_gaussian_mechanism(mu):
    e = bracket(X.gaussian_pair(mu, 0.001))
    exact = X.gaussian_epsilon(mu, DELTA)
    assert e.lo <= exact <= e.hi
    assert e.hi - e.lo < 2.5e-3


@pytest.mark.parametrize("w", [16 / 21, 0.8])
def test_engine_brackets_the_closed_form_1d_mixture(w):
    pair = X.orthogonal_pair([w], [2.0], 0.001, w0=1 - w)
    for eps in (2.0, 6.0, 9.6):
        lo_m, hi_m, lo_r, hi_r = pair.delta(eps)
        assert lo_m <= X.mixture_1d_delta(w, 2.0, eps, "mix") <= hi_m
        assert lo_r <= X.mixture_1d_delta(w, 2.0, eps, "ref") <= hi_r
    lo_r, hi_r = pair.delta(1.0)[2:]
    assert lo_r <= X.mixture_1d_delta(w, 2.0, 1.0, "ref") <= hi_r and hi_r > 0


def test_engine_brackets_2d_quadrature_of_a_shuffled_epoch():
    """The shared-coordinate loss (k = 2 batches: a_0 = (2, −1), a_L = (0, 1)) against an
    independent computation: analytic in x_0, adaptive quadrature in x_L."""
    wf, wl, z = 16 / 21, 5 / 21, 1.0
    pair = X.shuffle_insert_pair(2, wf, wl, z, 0.004)
    for eps in (2.0, 6.0):
        lo_m, hi_m, lo_r, hi_r = pair.delta(eps)
        qm = X.shuffle2_delta_quad(wf, wl, z, eps, "mix")
        qr = X.shuffle2_delta_quad(wf, wl, z, eps, "ref")
        assert lo_m * (1 - 1e-9) <= qm <= hi_m * (1 + 1e-9)
        assert lo_r * (1 - 1e-9) <= qr <= hi_r * (1 + 1e-9)
        assert hi_m - lo_m < 0.05 * qm


def test_fixed_order_worst_pair_is_the_alternating_one():
    """Removing the first record of a fixed order: over all ±1 data sets (n = 10, batch 4, three
    epochs) no pair moves the sums more than the alternating construction."""
    n, bs, steps = 10, 4, 9
    best = 0.0
    for signs in itertools.product((-1.0, 1.0), repeat=n):
        d = X.fixed_order_sums(signs, bs, steps) - X.fixed_order_sums(signs[1:], bs, steps)
        best = max(best, float(d @ d))
    v = X.alternating_first(n, bs)
    d = X.fixed_order_sums(v, bs, steps) - X.fixed_order_sums(v[1:], bs, steps)
    assert float(d @ d) == best == 3 * (4 * 2 + 1)


# ------------------------------------------------------------------------------ the issue's numbers


def test_issue_fixed_batches_numbers():
    """20 records at −1 and one at +1, fixed batches of 16 (one batch, the rest dropped),
    independent noise, z = 1. The issue's 9.600 (the +1 added to 20) and 9.671 (removed from 20)
    are the exact ε of ONE participation (one step; the library's old 4.377 is the zero-out
    μ = 1); two steps (two epochs of one batch) give 15.008 and 15.089."""
    add1 = bracket(cyclic_pair(21, 16, 1, 1.0, 2, 0.001))
    rem1 = bracket(cyclic_pair(20, 16, 1, 1.0, 2, 0.001))
    assert add1.mid == pytest.approx(9.600, rel=5e-3) and rem1.mid == pytest.approx(9.671, rel=5e-3)
    assert add1.hi - add1.lo < 1e-3 * add1.mid
    assert X.gaussian_epsilon(1.0, DELTA) == pytest.approx(4.377, abs=5e-4)
    add2 = bracket(cyclic_pair(21, 16, 2, 1.0, 2, 0.001))
    rem2 = bracket(cyclic_pair(20, 16, 2, 1.0, 2, 0.001))
    assert add2.mid == pytest.approx(15.008, abs=5e-3) and rem2.mid == pytest.approx(15.089, abs=5e-3)
    for steps, e in ((1, add1), (1, rem1), (2, add2), (2, rem2)):
        s = stated("cyclic", 1.0, steps, q=16 / 20, relation="add_or_remove", k=1)
        assert_upper(s, e.hi, f"cyclic, batch 16 of 20, {steps} steps")


def test_issue_fixed_order_numbers():
    """Removing the first record of a fixed order (n = 1000, batch 10, 2 epochs, z = 1; and
    n = 100, batch 45, 4 epochs, z = 2): 516.2 and 16.675, where one C per step printed 159.4
    and 8.385."""
    v = X.alternating_first(1000, 10)
    mu, e = X.fixed_order_epsilon(v, v[1:], 10, 200, 1.0, DELTA)
    assert mu * mu == pytest.approx(2 * (4 * 99 + 1)) and e == pytest.approx(516.2, rel=5e-3)
    s = stated("sequential", 1.0, 200, q=0.01, relation="add_or_remove")
    assert_upper(s, e, "sequential n=1000")
    assert s <= TIGHT * e
    assert X.gaussian_epsilon(math.sqrt(200), DELTA) == pytest.approx(159.4, abs=0.05)
    v = X.alternating_first(100, 45)
    mu, e = X.fixed_order_epsilon(v, v[1:], 45, 12, 2.0, DELTA)
    assert mu == pytest.approx(3.0) and e == pytest.approx(16.675, rel=5e-3)
    assert_upper(stated("sequential", 2.0, 12, q=0.45, relation="add_or_remove"), e, "sequential n=100")
    assert X.gaussian_epsilon(math.sqrt(12) / 2, DELTA) == pytest.approx(8.385, abs=5e-4)


def test_issue_shuffle_numbers():
    """Shuffled, 2 steps an epoch (n = 1000, batch 900), 10 epochs, z = 1: 51.7 (one C per step
    printed 28.37)."""
    e = bracket(issue_shuffle_pair())
    assert e.mid == pytest.approx(51.7, rel=5e-3)
    assert e.hi - e.lo < 2e-3 * e.mid
    assert X.gaussian_epsilon(math.sqrt(20), DELTA) == pytest.approx(28.37, abs=5e-3)
    assert_upper(stated("shuffle", 1.0, 20, q=0.9, relation="add_or_remove", k=2), e.hi, "shuffle k=2 (issue)")


# ------------------------------------------------------------------------------ fixed batches (cyclic)


@pytest.mark.parametrize("steps", [4, 5])
def test_cyclic_add_or_remove(steps):
    """20 at −1 (+1 added: 21) and 19 at −1 plus +1 (removed: 19), batches of 8: b = 2 on all
    sides, 4 dropped; 4 or 5 steps (P = 2 or 3), z = 2."""
    z = 2.0
    s = stated("cyclic", z, steps, q=8 / 20, relation="add_or_remove", k=2)
    for n_mix in (21, 20):
        e = bracket(cyclic_pair(n_mix, 8, steps, z, 2, 0.002))
        assert_upper(s, e.hi, f"cyclic add_or_remove n_mix={n_mix} steps={steps}")


def _tight_zero_out(e, sampler, z, label):
    """Three steps in which the zeroed record is certain to take part: the Gaussian mechanism
    μ = √3/z, inside the engine's bracket, stated by dpcore within the tight factor."""
    exact = X.gaussian_epsilon(math.sqrt(3) / z, DELTA)
    assert e.lo <= exact <= e.hi
    s = stated(sampler, z, 3, q=1.0, relation="zero_out", k=1)
    assert_upper(s, exact, label)
    assert s <= TIGHT * exact


def test_cyclic_zero_out_tight():
    """One fixed batch holding every record (n = batch = 12), 3 steps: the record's three
    participations are certain, the pair is the Gaussian mechanism μ = √3/z."""
    z = 1.5
    _tight_zero_out(bracket(cyclic_pair(12, 12, 3, z, 1, 0.001)), "cyclic", z, "cyclic zero_out, one batch")


def test_cyclic_zero_out_two_batches():
    """20 records at 0 and one of them +1 against 0, batches of 8 (b = 2, 4 dropped), 4 steps."""
    z = 1.0
    e = bracket(cyclic_pair(20, 8, 4, z, 1, 0.002))
    assert_upper(stated("cyclic", z, 4, q=8 / 20, relation="zero_out", k=2), e.hi, "cyclic zero_out b=2")


def test_cyclic_replace_one():
    """20 at −1, one of them +1 against −1, batches of 8 (b = 2, 4 dropped), 5 steps; and one
    batch of all 8 records, 2 steps (certain participation: the Gaussian mechanism μ = 2√2/z)."""
    z = 2.0
    e = bracket(cyclic_pair(20, 8, 5, z, 2, 0.002))
    assert_upper(stated("cyclic", z, 5, q=8 / 20, relation="replace_one", k=2), e.hi, "cyclic replace_one b=2")
    e = bracket(cyclic_pair(8, 8, 2, z, 2, 0.002))
    exact = X.gaussian_epsilon(2 * math.sqrt(2) / z, DELTA)
    assert e.lo <= exact <= e.hi
    s = stated("cyclic", z, 2, q=1.0, relation="replace_one", k=1)
    assert_upper(s, exact, "cyclic replace_one, one batch")
    assert s <= TIGHT * exact


# ------------------------------------------------------------------------------ shuffled, k ≥ 5 steps an epoch


def test_shuffle_k5_add_or_remove():
    """24 at −1 against 24 at −1 plus +1, batches of 5: k = 5 on both sides (5,5,5,5,4 and
    5,5,5,5,5); 2 epochs, z = 2."""
    z = 2.0
    e = bracket(shuffle_add_pair(24, 5, 2, z, 0.001))
    assert_upper(stated("shuffle", z, 10, q=5 / 24, relation="add_or_remove", k=5), e.hi, "shuffle k=5 add_or_remove")


@pytest.mark.parametrize("relation, jump", [("zero_out", 1), ("replace_one", 2)])
def test_shuffle_k5_zero_out_and_replace_one(relation, jump):
    z = 1.0 if relation == "zero_out" else 2.0
    e = bracket(shuffle_orthogonal_pair(24, 5, 2, z, jump, 0.0012))
    assert_upper(stated("shuffle", z, 10, q=5 / 24, relation=relation, k=5), e.hi, f"shuffle k=5 {relation}")


# ------------------------------------------------------------------------------ shuffled, k < 5


@pytest.mark.parametrize("n, bs, epochs, h", [(20, 16, 3, 0.0012), (13, 5, 2, 0.0012), (19, 5, 2, 0.001)])
def test_shuffle_few_steps_add_or_remove(n, bs, epochs, h):
    """k = 2, 3, 4 steps an epoch: 20 → 21 at batch 16 (16+4 → 16+5), 13 → 14 at batch 5
    (5,5,3 → 5,5,4), 19 → 20 at batch 5 (5,5,5,4 → 5,5,5,5); z = 2."""
    z = 2.0
    k = -(-n // bs)
    e = bracket(shuffle_add_pair(n, bs, epochs, z, h))
    assert_upper(stated("shuffle", z, k * epochs, q=bs / n, relation="add_or_remove", k=k), e.hi,
                 f"shuffle k={k} add_or_remove")


@pytest.mark.parametrize("relation, jump", [("zero_out", 1), ("replace_one", 2)])
def test_shuffle_few_steps_zero_out_and_replace_one(relation, jump):
    z = 1.0 if relation == "zero_out" else 2.0
    e = bracket(shuffle_orthogonal_pair(20, 16, 3, z, jump, 0.002))
    assert_upper(stated("shuffle", z, 6, q=16 / 20, relation=relation, k=2), e.hi, f"shuffle k=2 {relation}")


def test_shuffle_one_batch_zero_out_is_tight():
    """k = 1 (the batch holds the whole data set): the zeroed record is in every step."""
    z = 1.0
    _tight_zero_out(bracket(shuffle_orthogonal_pair(10, 16, 3, z, 1, 0.002)), "shuffle", z, "shuffle k=1 zero_out")


# ------------------------------------------------------------------------------ fixed order (sequential)


@pytest.mark.parametrize("n, bs, epochs, z", [(23, 5, 2, 2.0), (26, 3, 3, 4.0), (1000, 10, 2, 1.0), (100, 45, 4, 2.0)])
def test_sequential_add_or_remove(n, bs, epochs, z):
    """The first record removed (n → n − 1, the same number of batches): every full batch
    swaps a record, the last loses one."""
    k = -(-n // bs)
    assert -(-(n - 1) // bs) == k
    v = X.alternating_first(n, bs)
    mu, e = X.fixed_order_epsilon(v, v[1:], bs, k * epochs, z, DELTA)
    assert mu == pytest.approx(math.sqrt(epochs * (4 * (k - 1) + 1)) / z)
    s = stated("sequential", z, k * epochs, q=bs / n, relation="add_or_remove", k=k)
    assert_upper(s, e, f"sequential add_or_remove n={n}")
    if k >= 50:  # the analysis (2C at every step) is tight up to the short last batch
        assert s <= TIGHT * e


@pytest.mark.parametrize("relation, jump", [("zero_out", 1.0), ("replace_one", 2.0)])
def test_sequential_zero_out_and_replace_one(relation, jump):
    """The first record zeroed out (replaced): its batch moves by C (2C) every epoch; exact."""
    n, bs, epochs, z = 23, 5, 3, 1.5
    a = [0.0] * n if relation == "zero_out" else [-1.0] * n
    b = list(a)
    a[0] = 1.0
    mu, e = X.fixed_order_epsilon(a, b, bs, 5 * epochs, z, DELTA)
    assert mu == pytest.approx(jump * math.sqrt(epochs) / z)
    s = stated("sequential", z, 5 * epochs, q=bs / n, relation=relation, k=5)
    assert_upper(s, e, f"sequential {relation}")
    assert s <= TIGHT * e


def test_unsupported_relation_is_refused():
    from dpcore.accounting import sampler_epsilon

    with pytest.raises(ValueError):
        sampler_epsilon("poisson", 1.0, 10, DELTA, sampling_probability=0.1, neighboring="replace_one")
    with pytest.raises(ValueError):
        sampler_epsilon("shuffle", 1.0, 10, DELTA, sampling_probability=0.1, neighboring="add_one")
