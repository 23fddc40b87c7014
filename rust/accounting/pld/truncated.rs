//! Truncated Poisson sampling: each of n records joins the batch independently with probability
//! q, and when more than B joined, a uniformly random B of them are kept. The analysis is that of
//! dp_accounting's `from_truncated_subsampled_gaussian_mechanism` (Google's DP library; the
//! truncated-Poisson paper arXiv:2508.15089), made certified and tighter in one place. Here is why
//! it holds, for a Gaussian sum query of sensitivity 1 (clipped records) and noise multiplier σ.
//!
//! Neighbours D ∋ x and D' = D \ {x}; m = |D'| other records, K ~ Bin(m, q) of them drawn.
//! * K < B: the batch of D' is the K drawn; that of D adds x with probability q and is never
//!   truncated (K + 1 ≤ B). Given the drawn set, the pair is the Poisson-subsampled Gaussian
//!   pair (q, σ) of the add-or-remove relation (Zhu, Dong, Wang 2022, Proposition 30).
//! * K ≥ B: the batch S' of D' is a uniform B-subset of the others, whatever K is (exchangeable
//!   records). That of D is S' unless x was drawn (probability q) and kept (B/(K + 1)); then it is
//!   S' with a uniform y ∈ S' replaced by x. Given S', mixing over K: x replaces a record with
//!   probability q'_m = q·E[B/(K + 1) | K ≥ B] = P[Bin(m + 1, q) ≥ B + 1]·B/((m + 1)·w_m), with
//!   w_m = P[K ≥ B]. The sum moves by x − y, of norm ≤ 2: by joint convexity over y this is
//!   dominated by the Poisson-subsampled Gaussian pair at rate q'_m and noise σ/2 (sensitivity 2),
//!   in both directions.
//! * Revealing which case occurred only helps the adversary, so the step is dominated by the
//!   mixture of the two pairs with weights 1 − w_m and w_m (the mixture of privacy curves):
//!   δ(ε) ≤ (1 − w_m)·δ_{q,σ}(ε) + w_m·δ_{q'_m,σ/2}(ε) at every ε.
//!
//! dp_accounting takes the second pair under the replace-one relation, which it calls "a
//! (slightly loose) upper bound in all cases"; the add-or-remove pair above is the exact
//! dominating pair of that case, so ε here is at or below dp_accounting's.
//!
//! Which m: `population_size` n is the size of the data set the run sampled. For a record in it,
//! the neighbour without it has m = n − 1 others; for a record not in it, the neighbour with it
//! has n + 1 records and m = n. Both must hold (add-or-remove), and they differ (w_n ≥ w_{n−1}).
//! One dominating mixture covers both, and the floating-point uncertainty of w: with
//! a ≤ 1 − w_m and b ≤ w_m for both m, x = 1 − a − b, and q_B ≥ q'_m for both m (q_B ≤ q),
//!     a·(q, σ) + b·(q_B, σ/2) + x·max[(q, σ), (q_B, σ/2)]
//! dominates each, where max[·] is a PLD whose curve is at or above both pairs' curves (their
//! upper envelope, `loss::envelope`): the pair (q_B, σ/2) dominates (q'_m, σ/2) (a lower rate is
//! the higher one mixed with the null output), and
//! (1 − w_m)·A + w_m·B_m ≤ a·A + b·B + (1 − w_m − a)·A + (w_m − b)·B ≤ a·A + b·B + x·max[A, B].
//! x is w_n − w_{n−1} = q·P[Bin(n − 1, q) = B − 1] plus rounding. The weights add up to 1 (a few
//! ulps more): the composition's curve is monotone in each step's curve for any nonnegative
//! masses, so extra weight is safe, but it compounds over T steps as (1 + extra)^T.
//!
//! A lower bound: the data set whose other records are 0 and x = 1 (in the sum's direction).
//! Its outputs are N(0, σ²) and N(1, σ²) with x in the batch with probability
//! q_eff = q·(1 − w) + P[Bin(n, q) ≥ B + 1]·B/n (m = n − 1): exactly the Poisson pair at rate q_eff.
//! Its ε is a lower bound on the mechanism's (loose where B ≪ n·q: the upper bound's second pair
//! has sensitivity 2).

use crate::error::{require, DpResult};

/// The dominating mixture of one truncated-Poisson step (see the module docs), as weights of
/// its three pairs, and the rate of the Poisson step it dominates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mixture {
    /// Weight of the pair (q, σ): ≤ 1 − w_m for m = n − 1 and m = n.
    pub a: f64,
    /// Weight of the pair (q_B, σ/2): ≤ w_m for both m.
    pub b: f64,
    /// Weight of the upper envelope of the two pairs' curves: ≥ 1 − a − b.
    pub x: f64,
    /// q_B ≥ q'_m for both m, and ≤ q.
    pub q_b: f64,
    /// A rate the step dominates as a Poisson step (≤ q).
    pub q_eff: f64,
}

const U: f64 = f64::EPSILON;

/// Bounds on the two tails of Bin(m, q) at k: ((lo, hi) of P[X ≥ k], (lo, hi) of P[X < k]),
/// each computed as a sum of terms, so that a tail near 0 keeps its precision whichever it is.
pub type Tails = ((f64, f64), (f64, f64));

/// [`Tails`] of Bin(m, q) at k: binomial terms relative to the mode, by the ratio recurrence in
/// log space (never lgamma differences), with a running bound on the rounding of each log term
/// and on the sums' truncation (log-concave terms: past the last term summed, the rest is below
/// a geometric series).
pub fn binom_tails(m: u64, q: f64, k: u64) -> Tails {
    if k == 0 {
        return ((1.0, 1.0), (0.0, 0.0));
    }
    if k > m || q <= 0.0 {
        return ((0.0, 0.0), (1.0, 1.0));
    }
    if q >= 1.0 {
        return ((1.0, 1.0), (0.0, 0.0));
    }
    let mf = m as f64;
    let mode = (((m + 1) as f64 * q).floor() as u64).min(m);
    let far = k.abs_diff(mode) as f64;
    // Very far from the mode: the Chernoff–Hoeffding bound exp(−m·KL(a‖q)), a = k/m (or
    // (k − 1)/m for the lower tail); the tail beyond is below 1e-300 for any m ≤ 2^53 here.
    if far > 5e7 {
        let kl = |a: f64| -> f64 {
            let t1 = if a > 0.0 { a * (a / q).ln() } else { 0.0 };
            let t2 = if a < 1.0 { (1.0 - a) * ((1.0 - a) / (1.0 - q)).ln() } else { 0.0 };
            t1 + t2
        };
        if k > mode {
            let b = (-mf * kl(k as f64 / mf) * (1.0 - 1e-9)).exp().max(1e-300);
            return ((0.0, b.min(1.0)), ((1.0 - b).max(0.0), 1.0));
        }
        let b = (-mf * kl((k - 1) as f64 / mf) * (1.0 - 1e-9)).exp().max(1e-300);
        return (((1.0 - b).max(0.0), 1.0), (0.0, b.min(1.0)));
    }
    let lqr = q.ln() - (-q).ln_1p();
    let lm = (mf + 1.0).ln();
    // ln of the ratio of term j + 1 to term j, and a bound on its rounding.
    let step = |j: u64| -> f64 { ((m - j) as f64).ln() - ((j + 1) as f64).ln() + lqr };
    let step_err = 4.0 * U * (2.0 * lm + lqr.abs());
    // Below the mode, the ratio of term j − 1 to term j is e^{−step(j − 1)}.
    const CUT: f64 = -46.0; // terms below e^{-46} ≈ 1e-20 of the running sum end the walk
    // Sums (lo, hi) of the terms at and above k (up), and below k (down).
    let (mut up_lo, mut up_hi, mut dn_lo, mut dn_hi) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let mut nterms = 0.0f64;
    let mut add = |j: u64, l: f64, e: f64, up_lo: &mut f64, up_hi: &mut f64, dn_lo: &mut f64, dn_hi: &mut f64| {
        let (a, b) = ((l - e).exp(), (l + e).exp());
        nterms += 1.0;
        if j >= k {
            *up_lo += a;
            *up_hi += b;
        } else {
            *dn_lo += a;
            *dn_hi += b;
        }
    };
    // Upward from the mode.
    {
        let (mut j, mut l, mut e) = (mode, 0.0f64, 0.0f64);
        loop {
            add(j, l, e, &mut up_lo, &mut up_hi, &mut dn_lo, &mut dn_hi);
            if j == m {
                break;
            }
            let s = step(j);
            if j >= k {
                // Deep in the tail (past the mode, the terms only fall): the rest is below
                // e^{-700}·2^53, far below the floor kept.
                if l + e < -700.0 {
                    up_hi = up_hi.max(1e-280);
                    break;
                }
                // Once the terms are negligible next to their own sum, bound the rest.
                if l - up_hi.ln() < CUT && s + step_err < 0.0 {
                    let r = (s + step_err).exp();
                    up_hi += (l + e).exp() * r / (1.0 - r);
                    break;
                }
            }
            e += step_err + 2.0 * U * (l.abs() + s.abs());
            l += s;
            j += 1;
        }
    }
    // Downward from the mode.
    if mode > 0 {
        let (mut j, mut l, mut e) = (mode, 0.0f64, 0.0f64);
        loop {
            let s = step(j - 1);
            e += step_err + 2.0 * U * (l.abs() + s.abs());
            l -= s;
            j -= 1;
            add(j, l, e, &mut up_lo, &mut up_hi, &mut dn_lo, &mut dn_hi);
            if j == 0 {
                break;
            }
            let s_next = step(j - 1); // ratio of term j − 1 to term j is e^{−s_next}
            if j < k {
                if l + e < -700.0 {
                    dn_hi = dn_hi.max(1e-280);
                    break;
                }
                if l - dn_hi.ln() < CUT && s_next - step_err > 0.0 {
                    let r = (-s_next + step_err).exp();
                    dn_hi += (l + e).exp() * r / (1.0 - r);
                    break;
                }
            }
        }
    }
    // The sums' own rounding: relative (terms + 2)·u.
    let f = (nterms + 2.0) * U;
    let (up_lo, up_hi) = (up_lo * (1.0 - f), up_hi * (1.0 + f));
    let (dn_lo, dn_hi) = (dn_lo * (1.0 - f), dn_hi * (1.0 + f));
    let share = |a_lo: f64, a_hi: f64, b_lo: f64, b_hi: f64| -> (f64, f64) {
        let lo = (a_lo / (a_lo + b_hi) * (1.0 - 4.0 * U)).max(0.0);
        let hi = (a_hi / (a_hi + b_lo) * (1.0 + 4.0 * U)).min(1.0);
        (lo, hi)
    };
    (share(up_lo, up_hi, dn_lo, dn_hi), share(dn_lo, dn_hi, up_lo, up_hi))
}

/// Bounds [lo, hi] on P[Bin(m, q) ≥ k].
pub fn binom_sf(m: u64, q: f64, k: u64) -> (f64, f64) {
    binom_tails(m, q, k).0
}

/// The mixture for sampling probability q, cap B (max_sample_size) and population n.
pub fn mixture(q: f64, b: u64, n: u64) -> DpResult<Mixture> {
    crate::accounting::rdp_poisson::check_q(q, "sampling_probability")?;
    require(b >= 1, "max_sample_size", ">= 1", b)?;
    require(n >= b, "population_size", ">= max_sample_size", n)?;
    require(n as f64 <= 9.007_199_254_740_992e15, "population_size", "<= 2**53", n)?;
    let bf = b as f64;
    let (mut a, mut w_lo, mut q_b, mut q_eff) = (1.0f64, 1.0f64, 0.0f64, q);
    for m in [n - 1, n] {
        let ((wl, wh), (cl, _)) = binom_tails(m, q, b);
        let (nl, nh) = binom_sf(m + 1, q, b + 1);
        a = a.min(cl);
        w_lo = w_lo.min(wl);
        // q'_m = P[Bin(m + 1, q) ≥ B + 1]·B/((m + 1)·w_m), from above; q where w_m may be 0.
        let qm = if wl > 0.0 {
            (nh * bf / ((m + 1) as f64 * wl) * (1.0 + 8.0 * U)).min(q)
        } else if wh > 0.0 {
            q
        } else {
            0.0
        };
        q_b = q_b.max(qm);
        if m == n - 1 {
            // The rate at which x is in the batch, from below: q·P[K < B] + P[Bin(n, q) ≥ B + 1]·B/n.
            q_eff = ((q * cl + nl * bf / n as f64) * (1.0 - 8.0 * U)).clamp(0.0, q);
        }
    }
    // The weights add up to 1 (up to a few ulps above): a + b + x ≥ 1 exactly. Weight above 1
    // would compound over the steps, (1 + x)^T.
    let x = ((1.0 - a) - w_lo).max(0.0) * (1.0 + 4.0 * U) + 4.0 * U;
    Ok(Mixture {
        a,
        b: w_lo,
        x: x.min(1.0),
        q_b,
        q_eff,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// P[Bin(m, q) ≥ k] by exact summation of terms computed by log-gamma (small m only).
    fn direct(m: u64, q: f64, k: u64) -> f64 {
        let lg = |x: f64| -> f64 {
            // ln Γ(x) for integer x by summing logs (exact enough for m ≤ 200).
            (1..(x as u64)).map(|i| (i as f64).ln()).sum()
        };
        let mut s = 0.0;
        for j in k..=m {
            let lc = lg((m + 1) as f64) - lg((j + 1) as f64) - lg((m - j + 1) as f64);
            s += (lc + j as f64 * q.ln() + (m - j) as f64 * (1.0 - q).ln()).exp();
        }
        s
    }

    #[test]
    fn tails_bracket_direct_sums() {
        for &(m, q, k) in &[
            (10u64, 0.3, 3u64),
            (10, 0.3, 0),
            (10, 0.3, 11),
            (50, 0.01, 1),
            (50, 0.01, 5),
            (200, 0.5, 100),
            (200, 0.5, 150),
            (200, 0.9, 150),
            (199, 0.004, 2),
        ] {
            let (lo, hi) = binom_sf(m, q, k);
            let d = direct(m, q, k);
            assert!(lo <= d * (1.0 + 1e-12) && d <= hi * (1.0 + 1e-12), "{m} {q} {k}: {lo} {d} {hi}");
            assert!(hi - lo <= 1e-10 * d.max(1e-300) + 1e-300, "{m} {q} {k}: {lo} {hi}");
        }
    }

    #[test]
    fn large_populations_are_fast_and_consistent() {
        // Bin(60000, 0.004): mean 240, sd 15.5.
        let (lo, hi) = binom_sf(60_000, 0.004, 240);
        assert!(lo > 0.45 && hi < 0.56 && hi - lo < 1e-12);
        let (lo, hi) = binom_sf(60_000, 0.004, 400);
        assert!(hi < 1e-20 && lo > 0.0 && hi / lo < 1.0 + 1e-9, "{lo} {hi}");
        let (lo, hi) = binom_sf(1_000_000_000, 0.5, 1);
        assert!(lo == 1.0 && hi == 1.0 || (1.0 - lo) < 1e-15, "{lo} {hi}");
        let (lo, hi) = binom_sf(1_000_000_000_000, 1e-6, 999_999_000_000);
        assert!(lo == 0.0 && hi <= 1e-300, "{lo} {hi}");
    }

    #[test]
    fn mixture_limits() {
        // B = n: the record in the data set never triggers truncation (w_{n−1} = 0); the added
        // record does only when everyone is drawn (w_n = q^n).
        let x = mixture(0.5, 10, 10).unwrap();
        assert_eq!(x.b, 0.0);
        assert!((1.0 - x.a) / 0.5f64.powi(10) - 1.0 < 1e-12 && x.a + x.b + x.x >= 1.0, "{x:?}");
        assert!((x.x / 0.5f64.powi(10) - 1.0).abs() < 1e-9, "{x:?}");
        assert!((x.q_eff - 0.5).abs() < 1e-15, "{x:?}");
        // B far below n·q: truncation nearly always, x kept at about B/n.
        let x = mixture(0.5, 10, 100_000).unwrap();
        assert!(x.a < 1e-250 && x.b > 1.0 - 1e-12 && x.x < 1e-12 && x.a + x.b + x.x >= 1.0, "{x:?}");
        assert!((x.q_b / (10.0 / 100_000.0) - 1.0).abs() < 1e-3, "{x:?}");
        assert!((x.q_eff / (10.0 / 100_000.0) - 1.0).abs() < 1e-3, "{x:?}");
        assert!(mixture(1.5, 1, 2).is_err() && mixture(0.5, 0, 2).is_err() && mixture(0.5, 3, 2).is_err());
    }
}
