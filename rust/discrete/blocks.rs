//! The exact sampler of N_ℤ(0, σ²), σ² = num/den: rejection from a proposal of uniform blocks.
//!
//! Magnitudes k ≥ 0 are cut into blocks of W integers, [bW, (b + 1)W) for b < B (Y = BW ≥ 12σ),
//! and one tail past Y. A proposal picks block b with probability w_b/(n·2³²) from an alias
//! table (Walker 1977, Vose 1991; integer weights, so exactly), k uniform in the block and a
//! uniform sign; −0 is rejected, so that every signed y has proposal mass q(|y|)/2. It is
//! accepted with probability T(k) = f(k)·Λ/w_b, f(k) = exp(−k²/2σ²), for an integer Λ and
//! weights w_b ≥ Λ·f(bW) (so T ≤ 1; f is largest at the block's start). Then
//! P[y] ∝ q(|y|)·T(|y|) = f(y)·Λ/(n·2³²·W) ∝ f(y): the output is N_ℤ(0, σ²) exactly, whatever
//! the (integer) weights; they only set the acceptance rate. With W ≈ σ/64 a block's f falls
//! by at most 17% across it in the far blocks (exp(−12σ·W/σ²)) and by under 1% where the mass
//! is: 98.8% of proposals to the first 200 blocks at σ = 2²⁰ were accepted in a test run.
//!
//! The tail: k = Y + g·W_T + j with P[g] = 2^−(g+1) (counted zero bits) and j uniform below W_T,
//! accepted with probability f(k)·Λ·2^(g+1)·W_T/(W·w_T). Since Y·W_T ≥ σ², f falls by more than
//! half from one tail block to the next, so this is ≤ 2·f(Y)·Λ·W_T/(W·w_T) ≤ 1 by the choice of
//! w_T; the tail is proposed with probability about 2⁻⁴² and then (f(Y) < e⁻⁷²) all but always
//! rejected.
//!
//! Every acceptance is the comparison of a uniform U with the real T(k), decided lazily by
//! `super::exact` (63 bits and a fixed-point exp almost always; exact big integers otherwise).
//! No step uses floating point. Compared with Canonne, Kamath & Steinke 2020's Algorithm 3
//! (discrete Laplace proposals and Bernoulli(exp(−γ)) coins, about twenty data-dependent
//! branches per sample), this makes one proposal per sample in 99% of draws.

use super::exact::*;
use crate::chacha::ChaCha20;
use crate::error::{DpError, DpResult};
use num_bigint::BigUint;
use rand_core::Rng;

/// Height of an alias column: the weights sum to n·2³².
const H: u64 = 1 << 32;

#[derive(Clone, Debug, PartialEq)]
pub(super) struct BlockSampler {
    /// σ² = num/den.
    num: u64,
    den: u64,
    /// W, B, Y = B·W, W_T, Λ.
    width: u64,
    blocks: u64,
    y_max: u64,
    tail_width: u64,
    lam: u64,
    /// w_b for b < B, then w_T.
    weights: Vec<u64>,
    /// Alias table over the B + 1 entries: column c keeps itself when a 32-bit uniform is below
    /// prob[c], else gives alias[c].
    prob: Vec<u64>,
    alias: Vec<u32>,
    /// Bounds on C_b = f(bW)·Λ/w_b (2⁻⁶³ units), the acceptance at the block's start.
    c_lo: Vec<u64>,
    c_hi: Vec<u64>,
    /// δ = j(2bW + j)/2σ² in 2⁻⁶³ units is (j(2bW + j)·inv) >> shift, short by at most `slack`.
    inv: u64,
    shift: u32,
    slack: u64,
    /// Tests only: send every acceptance down the exact path.
    #[cfg(test)]
    pub(super) force_exact: bool,
}

/// ⌊√(num/den)⌋, by bisection on integers (no float even in the setup).
pub(super) fn isqrt_ratio(num: u64, den: u64) -> u64 {
    let fits = |s: u64| (s as u128).pow(2) * den as u128 <= num as u128;
    let (mut lo, mut hi) = (0u64, 1u64 << 32);
    // Invariant: fits(lo), !fits(hi) (num/den < 2⁶⁴).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

impl BlockSampler {
    /// The sampler for σ² = num/den (num, den ≥ 1; σ ≤ 2³⁰). The errors are invariants of the
    /// construction that `DiscreteGaussian::at_least`'s range guarantees; they are reported, not
    /// panicked, should that ever change.
    pub(super) fn new(num: u64, den: u64) -> DpResult<Self> {
        let broken = |what: &str| {
            DpError::param("noise_multiplier", format!("σ² = {num}/{den}: {what} (please report)"))
        };
        if num == 0 || den == 0 {
            return Err(broken("the variance must be a positive ratio"));
        }
        let s = isqrt_ratio(num, den);
        let (width, blocks) = if s < 128 {
            (1, 12 * s + 12)
        } else {
            let w = s / 64;
            (w, (12 * (s + 1)).div_ceil(w) + 1)
        };
        let y_max = blocks * width;
        let tail_width = (num as u128)
            .div_ceil(den as u128 * y_max as u128)
            .max(1) as u64;
        let mut me = BlockSampler {
            num,
            den,
            width,
            blocks,
            y_max,
            tail_width,
            lam: 0,
            weights: Vec::new(),
            prob: Vec::new(),
            alias: Vec::new(),
            c_lo: Vec::new(),
            c_hi: Vec::new(),
            inv: 0,
            shift: 63,
            slack: 0,
            #[cfg(test)]
            force_exact: false,
        };
        // Bounds on f at each block's start; the floor in `a_q63` costs one ulp of a.
        let f: Vec<(u64, u64)> = (0..blocks)
            .map(|b| exp_neg_q63_bounds(me.a_q63(b * width), 1))
            .collect();
        // The tail's weight must cover 2·f(Y)·W_T/W.
        let f_tail = exp_neg_q63_bounds(me.a_q63(y_max), 1).1 as u128;
        let f_tail = (2 * f_tail * tail_width as u128).div_ceil(width as u128);
        let n = blocks + 1;
        let total = n as u128 * H as u128;
        let mass: u128 = f.iter().map(|&(_, hi)| hi as u128).sum::<u128>() + f_tail;
        // Σ ⌈F_i·Λ/2⁶³⌉ ≤ Λ·mass/2⁶³ + n ≤ total − 2.
        let lam = ((total - n as u128 - 2) << 63) / mass;
        let lam = u64::try_from(lam).map_err(|_| broken("Λ exceeds 2⁶⁴"))?;
        let up = |x: u128| (x * lam as u128).div_ceil(ONE as u128) as u64;
        let mut weights: Vec<u64> = f.iter().map(|&(_, hi)| up(hi as u128)).collect();
        weights.push(up(f_tail));
        let used: u128 = weights.iter().map(|&w| w as u128).sum();
        // The rest goes to block 0, which only lowers its acceptance C_0 (still exact).
        let rest = total.checked_sub(used).ok_or_else(|| broken("the weights exceed their total"))?;
        weights[0] += u64::try_from(rest).map_err(|_| broken("the weights' remainder exceeds 2⁶⁴"))?;
        me.c_lo = f
            .iter()
            .zip(&weights)
            .map(|(&(lo, _), &w)| ((lo as u128 * lam as u128) / w as u128) as u64)
            .collect();
        me.c_hi = f
            .iter()
            .zip(&weights)
            .map(|(&(_, hi), &w)| (hi as u128 * lam as u128).div_ceil(w as u128).min(ONE as u128) as u64)
            .collect();
        let (prob, alias) = alias_table(&weights);
        me.lam = lam;
        me.weights = weights;
        me.prob = prob;
        me.alias = alias;
        if width > 1 {
            // inv ≈ 2^shift/2σ², with 63 significant bits; σ ≥ 128 puts shift above 63.
            let two_num = BigUint::from(2 * num as u128);
            let mut shift = 63 + (two_num.bits() as u32).saturating_sub(64 - den.leading_zeros());
            loop {
                let inv = (BigUint::from(den) << shift) / &two_num;
                match inv.bits() {
                    b if b > 63 => shift -= 1,
                    b if b < 63 => shift += 1,
                    _ => {
                        me.inv = u64::try_from(inv).map_err(|_| broken("1/2σ² has no 63-bit form"))?;
                        break;
                    }
                }
            }
            if shift < 63 {
                return Err(broken("block widths above 1 need σ ≥ 128"));
            }
            me.shift = shift;
            // inv is short of 2^shift/2σ² by less than 1, so the product by n_k is short by less
            // than n_k/2^(shift − 63) ulps, plus one for the final floor.
            let max_nk = (width - 1) * (2 * y_max + width);
            me.slack = (max_nk >> (shift - 63)) + 2;
        }
        Ok(me)
    }

    /// a = k²/2σ² in 2⁻⁶³ units, rounded down (integer part capped at 64, where exp(−a) is 0
    /// to 63 bits).
    fn a_q63(&self, k: u64) -> u128 {
        let n = (k as u128).pow(2) * self.den as u128;
        let d = 2 * self.num as u128;
        let (q, r) = (n / d, n % d);
        // r < d ≤ 2⁶⁵, so r·2⁶³ < 2¹²⁸.
        (q.min(64) << 63) | ((r << 63) / d)
    }

    /// Bounds at p bits on f(k)·factor_num/factor_den.
    fn bounds(&self, k: u128, fnum: &BigUint, fden: &BigUint, p: u32) -> (BigUint, BigUint) {
        let n = BigUint::from(k) * BigUint::from(k) * BigUint::from(self.den);
        let d = BigUint::from(2 * self.num as u128);
        let (lo, hi) = exp_neg_bounds(&n, &d, p);
        let hi = hi * fnum;
        let down = &hi / fden;
        let hi = if &down * fden == hi { down } else { down + 1u32 };
        (lo * fnum / fden, hi)
    }

    /// Tests may send every acceptance down the exact path.
    #[inline(always)]
    fn exact_only(&self) -> bool {
        #[cfg(test)]
        return self.force_exact;
        #[cfg(not(test))]
        false
    }

    #[cfg(test)]
    pub(super) fn width_for_tests(&self) -> u64 {
        self.width
    }

    /// One draw of N_ℤ(0, σ²).
    pub(super) fn sample(&self, rng: &mut ChaCha20) -> i64 {
        let n = self.blocks + 1;
        loop {
            let col = below(rng, n) as usize;
            let b = if (rng.next_u32() as u64) < self.prob[col] {
                col
            } else {
                self.alias[col] as usize
            };
            // One word gives the sign (bit 0) and the first 63 bits of the acceptance uniform.
            let word = rng.next_u64();
            let (negative, u) = (word & 1 == 1, word >> 1);
            let (k, accept) = if (b as u64) < self.blocks {
                let j = if self.width == 1 { 0 } else { below(rng, self.width) };
                let k = b as u64 * self.width + j;
                if k == 0 && negative {
                    continue;
                }
                (k, self.accept_body(rng, u, b, j, k))
            } else {
                match self.tail(rng, u) {
                    Some(k) => (k, true),
                    None => continue,
                }
            };
            if accept {
                return if negative { -(k as i64) } else { k as i64 };
            }
        }
    }

    /// Bernoulli(f(k)·Λ/w_b) for k = bW + j, from the uniform whose first 63 bits are `u`.
    #[inline]
    fn accept_body(&self, rng: &mut ChaCha20, u: u64, b: usize, j: u64, k: u64) -> bool {
        let (lo, hi) = if j == 0 {
            (self.c_lo[b], self.c_hi[b] as u128)
        } else {
            // T = exp(−δ)·C_b with δ = (k² − (bW)²)/2σ² < 1/4.
            let nk = j * (2 * b as u64 * self.width + j);
            let d = (nk as u128 * self.inv as u128) >> (self.shift - 63);
            // The squeeze T ≥ (1 − δ)·C_b decides most draws without the exp: δ is short by at
            // most `slack`, so 1 − d − slack is a lower bound on 1 − δ.
            let squeeze = (ONE as u128).saturating_sub(d + self.slack as u128) as u64;
            if u + 1 <= mul_q63(squeeze, self.c_lo[b]) && !self.exact_only() {
                return true;
            }
            let (e_lo, e_hi) = exp_neg_q63_bounds(d, self.slack);
            (mul_q63(e_lo, self.c_lo[b]), mul_q63_up(e_hi, self.c_hi[b]))
        };
        let (lo, hi) = if self.exact_only() { (0, ONE as u128) } else { (lo, hi) };
        if u + 1 <= lo {
            return true;
        }
        if u as u128 >= hi {
            return false;
        }
        let (fnum, fden) = (BigUint::from(self.lam), BigUint::from(self.weights[b]));
        lazy_below(rng, u, |p| self.bounds(k as u128, &fnum, &fden, p))
    }

    /// A tail proposal, accepted (Some(k)) with probability f(k)·Λ·2^(g+1)·W_T/(W·w_T).
    #[cold]
    fn tail(&self, rng: &mut ChaCha20, u: u64) -> Option<u64> {
        let mut g = 0u64;
        loop {
            let z = rng.next_u64();
            if z != 0 {
                g += z.trailing_zeros() as u64;
                break;
            }
            g += 64;
        }
        let j = below(rng, self.tail_width);
        let k = self.y_max as u128 + g as u128 * self.tail_width as u128 + j as u128;
        // Past i64 (g ≥ 2³³ zero bits in a row, probability 2^(−2³³)) the proposal is treated
        // as rejected; its acceptance probability would be below exp(−2⁶⁰).
        if k > i64::MAX as u128 {
            return None;
        }
        let fnum = BigUint::from(self.lam) * BigUint::from(self.tail_width) << (g + 1);
        let fden = BigUint::from(self.width) * BigUint::from(self.weights[self.blocks as usize]);
        lazy_below(rng, u, |p| self.bounds(k, &fnum, &fden, p)).then_some(k as u64)
    }
}

/// Vose's alias table for integer weights summing to n·2³² (exact: every column is filled to
/// 2³² by integer parts).
fn alias_table(weights: &[u64]) -> (Vec<u64>, Vec<u32>) {
    let n = weights.len();
    let mut w: Vec<u64> = weights.to_vec();
    let mut prob = vec![H; n];
    let mut alias: Vec<u32> = (0..n as u32).collect();
    let (mut small, mut large): (Vec<usize>, Vec<usize>) = (0..n).partition(|&i| w[i] < H);
    while let (Some(s), Some(&l)) = (small.pop(), large.last()) {
        prob[s] = w[s];
        alias[s] = l as u32;
        w[l] -= H - w[s];
        if w[l] < H {
            large.pop();
            small.push(l);
        }
    }
    // With integer weights summing to n·2³², whatever remains is exactly full.
    debug_assert!(small.iter().chain(&large).all(|&i| w[i] == H));
    (prob, alias)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alias_table_gives_each_entry_its_weight() {
        let weights = [H / 2, 3 * H, H / 4, H / 4, H];
        let (prob, alias) = alias_table(&weights);
        let mut mass = vec![0u64; weights.len()];
        for c in 0..weights.len() {
            mass[c] += prob[c];
            mass[alias[c] as usize] += H - prob[c];
        }
        assert_eq!(mass, weights);
    }

    #[test]
    fn each_proposal_is_accepted_with_probability_t() {
        // σ = 1000.5 (blocks of 15): T(k) = f(k)·Λ/w_b, measured where it is far from 1 too.
        let s = BlockSampler::new(1_001_001, 1).unwrap();
        let mut r = crate::rng::chunk_rng(&crate::rng::Seed::Fixed(11).key().unwrap(), 0);
        let s2 = 1_001_001f64;
        assert!(s.width > 1);
        for (b, j) in [(0usize, 0u64), (0, 14), (133, 0), (133, 7), (133, 14), (260, 3), (400, 14)] {
            let k = b as u64 * s.width + j;
            let t = (-((k * k) as f64) / (2.0 * s2)).exp() * s.lam as f64 / s.weights[b] as f64;
            let n = 200_000;
            let hits = (0..n)
                .filter(|_| {
                    let u = r.next_u64() >> 1;
                    s.accept_body(&mut r, u, b, j, k)
                })
                .count();
            let got = hits as f64 / n as f64;
            let se = (t * (1.0 - t) / n as f64).sqrt().max(1.0 / n as f64);
            assert!((got - t).abs() < 5.0 * se, "b = {b}, j = {j}: {got} vs {t}");
        }
    }

    #[test]
    fn acceptance_never_exceeds_one_and_rarely_rejects() {
        for (num, den) in [(1u64, 1u64 << 40), (9, 4), (123_456_789, 1 << 10), (1 << 58, 1)] {
            let s = BlockSampler::new(num, den).unwrap();
            assert!(s.c_hi.iter().all(|&c| c <= ONE));
            assert!(s.c_lo.iter().zip(&s.c_hi).all(|(l, h)| l <= h));
            let total: u128 = s.weights.iter().map(|&w| w as u128).sum();
            assert_eq!(total, (s.blocks as u128 + 1) * H as u128);
            // Y·W_T ≥ σ², so the tail's acceptance stays ≤ 1.
            assert!(s.y_max as u128 * s.tail_width as u128 * den as u128 >= num as u128);
            assert!(s.y_max as f64 >= 12.0 * ((num as f64) / (den as f64)).sqrt());
            // Where the mass is, blocks accept almost surely at their start.
            assert!(s.c_lo[0] as f64 / ONE as f64 > 0.98, "{num}/{den}: {}", s.c_lo[0]);
        }
    }
}
