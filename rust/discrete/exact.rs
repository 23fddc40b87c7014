//! Exact decisions against values of exp: the arithmetic under the discrete Gaussian sampler
//! (`super::blocks`). Integers only.
//!
//! A decision "U < x" for a uniform U ∈ [0, 1) and a real x = exp(−a)·(rational) is taken from
//! the first 63 bits of U and 63-bit bounds on x (`exp_neg_q63`, a table and a short series with
//! a proven error bound) whenever U's bits fall clear of the bounds; in the rare case they do
//! not (about 2⁻⁵³ of decisions), U is extended with fresh bits and x is bounded again with
//! exact big-integer arithmetic at doubling precision (`exp_neg_bounds`) until the bounds decide
//! (`lazy_below`). Either way the decision is true with probability exactly x: it is the
//! comparison of U with x, computed lazily. This is the exact comparison of a lazily generated
//! uniform with a computable real (Knuth & Yao 1976; Karney 2016, "Sampling exactly from the
//! normal distribution", §2), applied to the bounds below.

use crate::chacha::ChaCha20;
use num_bigint::BigUint;
use rand_core::Rng;
use std::sync::OnceLock;

/// Fixed-point scale of the fast path: 1.0 is 2⁶³.
pub(super) const ONE: u64 = 1 << 63;
/// Ulps (2⁻⁶³) by which `exp_neg_q63` may miss exp(−a): the proof in its docs gives 13; the
/// margin makes the bound robust to a miscount. Tested against exact bounds.
pub(super) const FAST_ERR: u64 = 256;

/// (a·b) / 2⁶³, rounded down.
#[inline(always)]
pub(super) fn mul_q63(a: u64, b: u64) -> u64 {
    ((a as u128 * b as u128) >> 63) as u64
}

/// (a·b) / 2⁶³, rounded up.
#[inline(always)]
pub(super) fn mul_q63_up(a: u64, b: u64) -> u128 {
    (a as u128 * b as u128).div_ceil(ONE as u128)
}

fn ceil_shift(v: BigUint, s: u32) -> BigUint {
    let down = &v >> s;
    if (&down << s) == v {
        down
    } else {
        down + 1u32
    }
}

/// Bounds (lo, hi) with lo ≤ exp(−r/den)·2^p ≤ hi, for 0 ≤ r ≤ den, p ≥ 16: the alternating
/// Taylor series Σ (−x)^j/j! with every term rounded down. Term j is then short by less than j
/// ulps (induction: (j−1)·x/j + 1 ≤ j), the first term rounded to 0 (index J) bounds the
/// series' tail by J ulps (alternating, decreasing), so the sum misses by at most J²/2 + J
/// ≤ (J + 2)² ulps.
fn series_bounds(r: &BigUint, den: &BigUint, p: u32) -> (BigUint, BigUint) {
    let one = BigUint::from(1u32) << p;
    let (mut pos, mut neg) = (one.clone(), BigUint::ZERO);
    let mut t = one;
    let mut j = 0u64;
    loop {
        j += 1;
        t = t * r / (den * j);
        if t == BigUint::ZERO {
            break;
        }
        if j % 2 == 1 {
            neg += &t;
        } else {
            pos += &t;
        }
    }
    let err = BigUint::from((j + 2) * (j + 2));
    // pos − neg ≥ e⁻¹·2^p − err > err for p ≥ 16; the guards keep even a misuse from panicking.
    let s = if pos > neg { pos - neg } else { BigUint::ZERO };
    let lo = if s > err { &s - &err } else { BigUint::ZERO };
    (lo, s + err)
}

/// Bounds (lo, hi) with lo ≤ exp(−num/den)·2^p ≤ hi, exact big-integer arithmetic: e^(−⌊a⌋) as
/// a power of the bounds on e⁻¹ (products of lower bounds rounded down, of upper bounds up),
/// times the series for the fraction; 64 guard bits. Any precision p ≥ 1 can be asked for.
pub(super) fn exp_neg_bounds(num: &BigUint, den: &BigUint, p: u32) -> (BigUint, BigUint) {
    let g = p + 64;
    let q = num / den;
    let r = num % den;
    // e^(−q) < 2^(−1.44·q) < 2^(−p) once q > 2g: the value is below one unit of 2^(−p).
    if q > BigUint::from(2 * g as u64) {
        return (BigUint::ZERO, BigUint::from(1u32));
    }
    let q = u64::try_from(&q).unwrap_or(0);
    let one = BigUint::from(1u32) << g;
    let (mut lo, mut hi) = (one.clone(), one);
    let (mut b_lo, mut b_hi) = series_bounds(&BigUint::from(1u32), &BigUint::from(1u32), g);
    let mut k = q;
    while k > 0 {
        if k & 1 == 1 {
            lo = (&lo * &b_lo) >> g;
            hi = ceil_shift(&hi * &b_hi, g);
        }
        k >>= 1;
        if k > 0 {
            b_lo = (&b_lo * &b_lo) >> g;
            b_hi = ceil_shift(&b_hi * &b_hi, g);
        }
    }
    let (x_lo, x_hi) = series_bounds(&r, den, g);
    ((lo * x_lo) >> (g + 64), ceil_shift(hi * x_hi, g + 64))
}

/// exp(−i) for i < 64, exp(−h/64) and exp(−h/4096) for h < 64, in 2⁻⁶³ units rounded down
/// from exact bounds (each within one ulp of the true value).
struct Tables {
    int: [u64; 64],
    coarse: [u64; 64],
    fine: [u64; 64],
}

fn tables() -> &'static Tables {
    static T: OnceLock<Tables> = OnceLock::new();
    T.get_or_init(|| {
        let at = |num: u64, den: u64| {
            let (lo, _) = exp_neg_bounds(&BigUint::from(num), &BigUint::from(den), 127);
            u64::try_from(lo >> 64u32).unwrap_or(ONE)
        };
        Tables {
            int: std::array::from_fn(|i| at(i as u64, 1)),
            coarse: std::array::from_fn(|h| at(h as u64, 64)),
            fine: std::array::from_fn(|h| at(h as u64, 4096)),
        }
    })
}

/// exp(−a) in 2⁻⁶³ units for a ≥ 0 given in 2⁻⁶³ units, within `FAST_ERR` ulps of the truth.
/// a = i + h/64 + h'/4096 + x with x < 2⁻¹²: three table values (one ulp each) times
/// 1 − x + x²/2 − x³/6 + x⁴/24, whose powers are formed side by side rather than by Horner's
/// chain of dependent products (the sampler's latency). The powers and quotients miss by at
/// most 6 ulps together and the series' remainder x⁵/120 is below one ulp; the three products
/// add one ulp each: at most 13 ulps in all. For i ≥ 64 the value is below 2⁻⁹², returned as 0.
#[inline]
pub(super) fn exp_neg_q63(a: u128) -> u64 {
    let i = (a >> 63) as usize;
    if i >= 64 {
        return 0;
    }
    let t = tables();
    let f = (a as u64) & (ONE - 1);
    let x = f & ((1 << 51) - 1);
    let x2 = mul_q63(x, x);
    let x3 = mul_q63(x2, x);
    let x4 = mul_q63(x2, x2);
    // Each partial sum stays in (0, 1]: x < 2⁻¹² keeps the subtrahends far below the sums.
    let p = (ONE - x + x2 / 2 - x3 / 6) + x4 / 24;
    let table = mul_q63(t.coarse[(f >> 57) as usize], t.fine[((f >> 51) & 63) as usize]);
    let v = mul_q63(table, p);
    if i == 0 {
        v
    } else {
        mul_q63(t.int[i], v)
    }
}

/// Bounds (lo, hi) in 2⁻⁶³ units on exp(−a) for a known to lie in [a_lo, a_lo + slack] (2⁻⁶³
/// units): exp is 1-Lipschitz on a ≥ 0.
#[inline]
pub(super) fn exp_neg_q63_bounds(a_lo: u128, slack: u64) -> (u64, u64) {
    let v = exp_neg_q63(a_lo);
    (
        v.saturating_sub(FAST_ERR + slack),
        (v + FAST_ERR).min(ONE),
    )
}

/// Whether U < x, for U uniform on [0, 1) of which `u` holds the first 63 bits
/// (U·2⁶³ ∈ [u, u + 1)), x given by `bounds(p)` = (lo, hi) with lo ≤ x·2^p ≤ hi. Draws further
/// bits of U, 32 at a time, and doubles the precision until the bounds decide (with probability
/// one: the bounds close on x as p grows).
pub(super) fn lazy_below(
    rng: &mut ChaCha20,
    u: u64,
    bounds: impl Fn(u32) -> (BigUint, BigUint),
) -> bool {
    let mut bits = BigUint::from(u);
    let mut p = 63u32;
    loop {
        let target = 2 * p;
        while p < target {
            bits = (bits << 32u32) | BigUint::from(rng.next_u32());
            p += 32;
        }
        let (lo, hi) = bounds(p);
        if &bits + 1u32 <= lo {
            return true;
        }
        if bits >= hi {
            return false;
        }
    }
}

/// A uniform integer on [0, n), n ≥ 1: Lemire's multiply-and-reject, exactly uniform. Ranges
/// up to 2³² read one 32-bit word.
#[inline]
pub(super) fn below(rng: &mut ChaCha20, n: u64) -> u64 {
    if n <= u32::MAX as u64 {
        let n32 = n as u32;
        let mut m = (rng.next_u32() as u64) * n;
        if (m as u32) < n32 {
            let t = n32.wrapping_neg() % n32;
            while (m as u32) < t {
                m = (rng.next_u32() as u64) * n;
            }
        }
        return m >> 32;
    }
    let mut m = (rng.next_u64() as u128) * (n as u128);
    if (m as u64) < n {
        let t = n.wrapping_neg() % n;
        while (m as u64) < t {
            m = (rng.next_u64() as u128) * (n as u128);
        }
    }
    (m >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{chunk_rng, Seed};

    fn big(v: u128) -> BigUint {
        BigUint::from(v)
    }

    #[test]
    fn exact_bounds_enclose_known_values_and_close_in() {
        // e^(−1/2) = 0.60653065971263342360…, e^(−10) = 4.539992976248485e-5.
        for (num, den, want) in [(1u128, 2u128, 0.6065306597126334f64), (10, 1, 4.539992976248485e-5)] {
            for p in [20u32, 64, 200] {
                let (lo, hi) = exp_neg_bounds(&big(num), &big(den), p);
                assert!(lo <= hi);
                let scale = 2f64.powi(p as i32);
                let (l, h) = (lo.to_string().parse::<f64>().unwrap(), hi.to_string().parse::<f64>().unwrap());
                assert!(l / scale <= want * (1.0 + 1e-15) && h / scale >= want * (1.0 - 1e-15), "{num}/{den} at {p}");
                // The interval is a few ulps wide at any precision.
                assert!(&hi - &lo <= big(4), "{num}/{den} at {p}: width {}", &hi - &lo);
            }
        }
        assert_eq!(exp_neg_bounds(&big(10_000), &big(1), 64), (BigUint::ZERO, big(1)));
    }

    #[test]
    fn fast_exp_is_within_its_error_bound() {
        let mut r = chunk_rng(&Seed::Fixed(1).key().unwrap(), 0);
        let mut worst = 0u64;
        for k in 0..8000u64 {
            // Integer parts 0..70 and arbitrary fractions, plus the table's grid points.
            let a: u128 = if k < 4096 {
                (k as u128) << 51
            } else {
                ((r.next_u64() % 70) as u128) << 63 | (r.next_u64() >> 1) as u128
            };
            let (lo, hi) = exp_neg_bounds(&big(a), &big(1u128 << 63), 63 + 32);
            let (lo, hi) = (u128::try_from(lo >> 32u32).unwrap(), u128::try_from(hi >> 32u32).unwrap() + 1);
            let v = exp_neg_q63(a) as u128;
            let miss = if v < lo { lo - v } else { v.saturating_sub(hi) } as u64;
            worst = worst.max(miss);
        }
        // The proof allows 13 ulps; FAST_ERR, which the sampler uses, is larger still.
        assert!(worst <= 13, "worst miss {worst} ulps");
    }

    #[test]
    fn lazy_comparison_has_probability_x() {
        // Every decision here takes the exact path (the fast one is never consulted).
        let mut r = chunk_rng(&Seed::Fixed(2).key().unwrap(), 0);
        let x = (-1.0f64 / 3.0).exp();
        let n = 40_000;
        let hits = (0..n)
            .filter(|_| {
                let u = r.next_u64() >> 1;
                lazy_below(&mut r, u, |p| exp_neg_bounds(&big(1), &big(3), p))
            })
            .count();
        let got = hits as f64 / n as f64;
        let se = (x * (1.0 - x) / n as f64).sqrt();
        assert!((got - x).abs() < 5.0 * se, "{got} vs {x}");
    }
}
