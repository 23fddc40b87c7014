//! The discrete Gaussian mechanism: floating-point-safe noise (Canonne, Kamath & Steinke 2020,
//! "The Discrete Gaussian for Differential Privacy", NeurIPS).
//!
//! Textbook Gaussian noise sampled in floating point leaks the input through the set of floats
//! the output can take (Mironov 2012; Jin et al. 2022 recover members this way). Here records
//! are instead moved onto the integer grid γ·ℤ^d, summed exactly, and noised with integers drawn
//! from the discrete Gaussian N_ℤ(0, σ²) (P[Y = y] ∝ exp(−y²/2σ²)) by CKS 2020's Algorithms 1–3
//! with integer arithmetic only: every decision compares a uniform integer from ChaCha20 words
//! with a rational threshold, and no float enters the sampler. σ² is a rational n/2^k ≥ the
//! requested variance; the stddev reported for accounting is rounded down from it.
//!
//! Privacy (CKS 2020, Theorem 14): an integer-valued query with L2 sensitivity Δ plus independent
//! N_ℤ(0, σ²) noise per coordinate satisfies ½(Δ/σ)²-concentrated DP, the Rényi curve
//! ε(α) = α·Δ²/(2σ²) of the continuous Gaussian. The accountant reads Δ and σ from the ledger.
//!
//! Rounding (the "deterministic rounding with the norm inflation accounted" option of Kairouz,
//! Liu & Steinke 2021, "The Distributed Discrete Gaussian Mechanism for Federated Learning with
//! Secure Aggregation", §4): a clipped record y ∈ ℝ^d with ‖y‖ ≤ c (grid units) is rounded to the
//! nearest point of ℤ^d, so ‖round(y)‖ ≤ c + √d/2 by the triangle inequality. The bound used is
//! an integer S ≥ (c + √d/2)², and every rounded record is checked against it exactly.
//! A caller that can only round the *sum* of the records (the torch adapter forms the sum from
//! factored gradients) gets Δ = c + √d instead: |round(a + b) − round(a)| < |b| + 1 per coordinate.

use crate::chacha::ChaCha20;
use crate::error::{DpError, DpResult};
use num_bigint::BigUint;
use rand_core::Rng;

/// How the records reach the grid, which fixes the sensitivity bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Every clipped record is rounded before summing: Δ ≤ c + √d/2.
    PerRecord,
    /// Only the sum is rounded: Δ ≤ c + √d.
    Sum,
}

/// Limits that keep every integer of the sampler within u128 on its common paths.
const MAX_SIGMA: f64 = (1u64 << 29) as f64;
const MIN_SIGMA: f64 = 1.0 / 64.0;
/// The clip norm in grid units stays below this, so that rounding by adding 1.5·2⁵² is exact
/// and the squared norms are exact in u128.
pub const MAX_GRID_CLIP: f64 = (1u64 << 40) as f64;
/// Relative inflation Δ/c − 1 of the default granularity.
const DEFAULT_INFLATION: f64 = 1e-4;

// ------------------------------------------------------------------- uniform integers and coins

#[inline]
fn below_u64(rng: &mut ChaCha20, n: u64) -> u64 {
    // Lemire's multiply-and-reject: exactly uniform on [0, n). Small ranges (most coins) read
    // one 32-bit word, halving the ChaCha20 output the sampler consumes.
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

#[inline]
fn below_u128(rng: &mut ChaCha20, n: u128) -> u128 {
    if n <= u64::MAX as u128 {
        return below_u64(rng, n as u64) as u128;
    }
    let bits = 128 - (n - 1).leading_zeros();
    let mask = if bits == 128 {
        u128::MAX
    } else {
        (1u128 << bits) - 1
    };
    loop {
        let x = (((rng.next_u64() as u128) << 64) | rng.next_u64() as u128) & mask;
        if x < n {
            return x;
        }
    }
}

/// Bernoulli(num / (den·k)), num ≤ den, k ≥ 1.
#[inline]
fn bernoulli_over(rng: &mut ChaCha20, num: u128, den: u128, k: u128) -> bool {
    match den.checked_mul(k) {
        Some(dk) if num >= dk => true,
        Some(dk) => below_u128(rng, dk) < num,
        // num/(den·k) = (num/den)·(1/k): two independent coins.
        None => below_u128(rng, den) < num && below_u128(rng, k) == 0,
    }
}

/// Bernoulli(exp(−num/den)) for 0 ≤ num ≤ den: CKS 2020, Algorithm 1 (γ ∈ [0, 1]).
fn bernoulli_exp_unit(rng: &mut ChaCha20, num: u128, den: u128) -> bool {
    let mut k: u128 = 1;
    while bernoulli_over(rng, num, den, k) {
        k += 1;
    }
    k % 2 == 1
}

/// Bernoulli(exp(−num/den)) for any num ≥ 0, den ≥ 1: CKS 2020, Algorithm 1 (γ > 1 as a product
/// of ⌊γ⌋ coins exp(−1) and one exp(−(γ − ⌊γ⌋))).
fn bernoulli_exp(rng: &mut ChaCha20, num: u128, den: u128) -> bool {
    // u64 division where the operands allow (the common case): u128 division is a library call.
    let (q, r) = if (num | den) <= u64::MAX as u128 {
        let (n, d) = (num as u64, den as u64);
        ((n / d) as u128, (n % d) as u128)
    } else {
        (num / den, num % den)
    };
    let mut i = 0u128;
    while i < q {
        if !bernoulli_exp_unit(rng, 1, 1) {
            return false;
        }
        i += 1;
    }
    bernoulli_exp_unit(rng, r, den)
}

/// As `bernoulli_exp` with num = w² too large for u128 (a far tail of the Laplace proposal).
fn bernoulli_exp_big(rng: &mut ChaCha20, w: &BigUint, den: u128) -> bool {
    let w2 = w * w;
    let d = BigUint::from(den);
    let q = &w2 / &d;
    let r: u128 = (&w2 % &d).try_into().expect("remainder below a u128 divisor");
    let mut i = BigUint::ZERO;
    while i < q {
        if !bernoulli_exp_unit(rng, 1, 1) {
            return false;
        }
        i += 1u32;
    }
    bernoulli_exp_unit(rng, r, den)
}

/// The discrete Laplace distribution P[X = x] ∝ exp(−|x|/t) for an integer t ≥ 1: CKS 2020,
/// Algorithm 2.
fn discrete_laplace(rng: &mut ChaCha20, t: u64) -> i64 {
    loop {
        let u = below_u64(rng, t);
        if !bernoulli_exp_unit(rng, u as u128, t as u128) {
            continue;
        }
        let mut v: u64 = 0;
        while bernoulli_exp_unit(rng, 1, 1) {
            v += 1;
        }
        // x = u + t·v. Past i64 (v ≥ 2^63/t, probability below exp(−2^30)) the proposal is
        // treated as rejected: the Gaussian step would accept it with probability below
        // exp(−2^90), so the output distribution moves by less than that in total variation.
        let Some(x) = t
            .checked_mul(v)
            .and_then(|tv| tv.checked_add(u))
            .filter(|&x| x <= i64::MAX as u64)
        else {
            continue;
        };
        let negative = rng.next_u32() & 1 == 1;
        if negative && x == 0 {
            continue;
        }
        return if negative { -(x as i64) } else { x as i64 };
    }
}

// ------------------------------------------------------------------- the discrete Gaussian

/// N_ℤ(0, σ²) with σ² = num/den exactly (den a power of two): CKS 2020, Algorithm 3.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscreteGaussian {
    num: u64,
    den: u64,
    /// t = ⌊σ⌋ + 1, the scale of the Laplace proposal.
    t: u64,
    /// t·den, and 2·num·den·t² (the acceptance exponent is (|y|·t·den − num)² / that).
    td: u128,
    accept_den: u128,
    /// When σ² = m·t exactly (den = 1): m = σ²/t and 2σ², so that the acceptance exponent is
    /// (|y| − m)²/2σ² with a small integer numerator and denominator.
    fast: Option<(u64, u64)>,
}

/// From this σ on, σ² is rounded up to a multiple of t (a relative change below 2⁻¹⁶ of σ).
const FAST_SIGMA: f64 = 65536.0;

impl DiscreteGaussian {
    /// The discrete Gaussian whose variance parameter is the smallest n/2^k ≥ `sigma`² on a
    /// grid fine enough for a relative precision of 2⁻⁴⁰.
    pub fn at_least(sigma: f64) -> DpResult<Self> {
        if !(sigma.is_finite() && (MIN_SIGMA..=MAX_SIGMA).contains(&sigma)) {
            return Err(DpError::param(
                "granularity",
                format!(
                    "the noise would be {sigma:.6e} grid steps; it must be between 2^-6 and 2^29 \
                     (choose a {} granularity)",
                    if sigma > 1.0 { "coarser" } else { "finer" }
                ),
            ));
        }
        let s2 = sigma * sigma;
        if sigma >= FAST_SIGMA {
            // Any integer t > 0 gives the exact distribution (CKS 2020, Algorithm 3); t near σ
            // keeps the acceptance rate high. s2 ≥ 2^32 is an integer-valued float.
            let t = sigma.floor() as u64 + 1;
            let need = s2.ceil() as u128;
            let m = need.div_ceil(t as u128) as u64;
            return Ok(Self::with_t(m * t, 1, t));
        }
        let k = (40 - s2.log2().floor() as i32).clamp(0, 52);
        let den = 1u64 << k;
        // s2·2^k is exact (a power-of-two scaling); its ceiling is ≥ s2·2^k.
        let num = (s2 * den as f64).ceil() as u64;
        Ok(Self::exact(num, den))
    }

    /// σ² = num/den exactly.
    pub fn exact(num: u64, den: u64) -> Self {
        assert!(num > 0 && den > 0);
        // ⌊√(num/den)⌋: the largest s with s²·den ≤ num.
        let mut s = ((num as f64) / (den as f64)).sqrt() as u64;
        while (s as u128 + 1).pow(2) * den as u128 <= num as u128 {
            s += 1;
        }
        while s > 0 && (s as u128).pow(2) * den as u128 > num as u128 {
            s -= 1;
        }
        Self::with_t(num, den, s + 1)
    }

    /// σ² = num/den with Laplace proposals of scale t.
    fn with_t(num: u64, den: u64, t: u64) -> Self {
        let td = t as u128 * den as u128;
        let accept_den = 2 * num as u128 * den as u128 * (t as u128).pow(2);
        let fast = (den == 1 && num % t == 0 && num < 1 << 62).then(|| (num / t, 2 * num));
        DiscreteGaussian {
            num,
            den,
            t,
            td,
            accept_den,
            fast,
        }
    }

    /// σ² as (num, den).
    pub fn variance_ratio(&self) -> (u64, u64) {
        (self.num, self.den)
    }

    /// σ, rounded down (the value the accountant may use).
    pub fn sigma_lower(&self) -> f64 {
        let mut s = (self.num as f64 / self.den as f64).sqrt();
        for _ in 0..4 {
            s = s.next_down();
        }
        s
    }

    /// One sample.
    pub fn sample(&self, rng: &mut ChaCha20) -> i64 {
        loop {
            let y = discrete_laplace(rng, self.t);
            if let Some((m, two_n)) = self.fast {
                let w = y.unsigned_abs().abs_diff(m) as u128;
                if bernoulli_exp(rng, w * w, two_n as u128) {
                    return y;
                }
                continue;
            }
            let a = y.unsigned_abs() as u128;
            // exp(−(|y| − σ²/t)² / 2σ²) = exp(−(|y|·t·den − num)² / (2·num·den·t²)).
            let accept = match a.checked_mul(self.td) {
                Some(atd) => {
                    let w = atd.abs_diff(self.num as u128);
                    match w.checked_mul(w) {
                        Some(w2) => bernoulli_exp(rng, w2, self.accept_den),
                        None => bernoulli_exp_big(rng, &BigUint::from(w), self.accept_den),
                    }
                }
                None => {
                    let atd = BigUint::from(a) * BigUint::from(self.td);
                    let n = BigUint::from(self.num);
                    let w = if atd >= n { atd - n } else { n - atd };
                    bernoulli_exp_big(rng, &w, self.accept_den)
                }
            };
            if accept {
                return y;
            }
        }
    }
}

// ------------------------------------------------------------------- the mechanism's parameters

/// Everything a discrete Gaussian release needs, fixed before any record is read.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscreteParams {
    /// γ: the grid step, in the units of the (scaled) records.
    pub granularity: f64,
    /// c = C/γ: the clip norm in grid units.
    pub grid_clip: f64,
    /// S: an integer bound on ‖round(y)‖², enforced exactly on every record.
    pub sens_sq: u128,
    /// The noise; None for noise_multiplier 0 (no noise, no privacy).
    pub noise: Option<DiscreteGaussian>,
    /// √S·γ rounded up: the L2 sensitivity after rounding, in the records' units (S_g of the
    /// privacy tuple).
    pub sensitivity: f64,
    /// σ·γ rounded down: the noise stddev parameter, in the records' units (σ̃_g).
    pub stddev: f64,
}

fn up(mut x: f64, ulps: usize) -> f64 {
    for _ in 0..ulps {
        x = x.next_up();
    }
    x
}

fn down(mut x: f64, ulps: usize) -> f64 {
    for _ in 0..ulps {
        x = x.next_down();
    }
    x
}

impl DiscreteParams {
    /// The parameters for records of `dim` coordinates clipped to `l2_norm_clip`, with noise
    /// σ = `noise_multiplier`·C (the grid makes it z·c grid steps). `granularity` None picks the
    /// largest power of two whose sensitivity inflation Δ/c − 1 is at most 10⁻⁴ (coarser if the
    /// noise would otherwise exceed 2^29 grid steps).
    pub fn new(
        l2_norm_clip: f64,
        noise_multiplier: f64,
        dim: usize,
        granularity: Option<f64>,
        rounding: Rounding,
    ) -> DpResult<Self> {
        crate::clip::check_clip(l2_norm_clip)?;
        crate::mechanism::check_noise_multiplier(noise_multiplier)?;
        let root_d = (dim.max(1) as f64).sqrt();
        let slack = match rounding {
            Rounding::PerRecord => 0.5 * root_d,
            Rounding::Sum => root_d,
        };
        let g = match granularity {
            Some(g) => {
                if !(g.is_finite() && g > 0.0) {
                    return Err(DpError::param(
                        "granularity",
                        format!("must be finite and > 0, got {g}"),
                    ));
                }
                g
            }
            None => {
                // c ≥ slack/inflation, and z·c ≤ 2^29 if possible.
                let mut g = (l2_norm_clip * DEFAULT_INFLATION / slack).log2().floor().exp2();
                while noise_multiplier * l2_norm_clip / g > MAX_SIGMA {
                    g *= 2.0;
                }
                while l2_norm_clip / g > MAX_GRID_CLIP {
                    g *= 2.0;
                }
                g
            }
        };
        let c = l2_norm_clip / g;
        if !(c <= MAX_GRID_CLIP) {
            return Err(DpError::param(
                "granularity",
                format!("l2_norm_clip/granularity = {c:.3e} grid steps; at most 2^40 are supported (use a coarser granularity)"),
            ));
        }
        // (c + slack)² rounded up to an integer: the bound each rounded record is held to.
        let bound = up(c + slack, 2);
        let sens_sq = up(bound * bound, 2).ceil() as u128;
        let sensitivity = up((sens_sq as f64).sqrt(), 4) * g;
        let sensitivity = up(sensitivity, 2);
        let noise = if noise_multiplier == 0.0 {
            None
        } else {
            Some(DiscreteGaussian::at_least(noise_multiplier * c)?)
        };
        let stddev = noise
            .as_ref()
            .map_or(0.0, |n| down(n.sigma_lower() * g, 2));
        Ok(DiscreteParams {
            granularity: g,
            grid_clip: c,
            sens_sq,
            noise,
            sensitivity,
            stddev,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{chunk_rng, Seed};

    fn rng(s: u64) -> ChaCha20 {
        chunk_rng(&Seed::Fixed(s).key().unwrap(), 0)
    }

    #[test]
    fn bernoulli_exp_has_its_probability() {
        let mut r = rng(1);
        for &(num, den) in &[(1u128, 1u128), (1, 3), (5, 2), (0, 7), (7, 7)] {
            let n = 200_000;
            let hits = (0..n).filter(|_| bernoulli_exp(&mut r, num, den)).count();
            let p = (-(num as f64) / den as f64).exp();
            let se = (p * (1.0 - p) / n as f64).sqrt();
            let got = hits as f64 / n as f64;
            assert!((got - p).abs() <= 5.0 * se + 1e-12, "{num}/{den}: {got} vs {p}");
        }
    }

    #[test]
    fn big_path_agrees_with_u128_path() {
        // Same exponent through both paths: the same decision from the same bits.
        let (mut a, mut b) = (rng(3), rng(3));
        for w in [0u128, 1, 5, 1000, 123456] {
            for _ in 0..200 {
                assert_eq!(
                    bernoulli_exp(&mut a, w * w, 97),
                    bernoulli_exp_big(&mut b, &BigUint::from(w), 97)
                );
            }
        }
    }

    fn pmf(sigma2: f64, y: i64) -> f64 {
        let z: f64 = (-200..=200)
            .map(|k: i64| (-(k * k) as f64 / (2.0 * sigma2)).exp())
            .sum();
        (-(y * y) as f64 / (2.0 * sigma2)).exp() / z
    }

    #[test]
    fn small_sigma_matches_the_pmf() {
        // σ² = 9/4 exactly; a chi-square statistic over the cells |y| ≤ 5 and the tails.
        let dg = DiscreteGaussian::exact(9, 4);
        let mut r = rng(5);
        let n = 400_000usize;
        let mut counts = [0usize; 12];
        for _ in 0..n {
            let y = dg.sample(&mut r);
            let cell = if y.abs() > 5 { 11 } else { (y + 5) as usize };
            counts[cell] += 1;
        }
        let mut chi2 = 0.0;
        for (cell, &c) in counts.iter().enumerate() {
            let p = if cell == 11 {
                1.0 - (-5..=5).map(|y| pmf(2.25, y)).sum::<f64>()
            } else {
                pmf(2.25, cell as i64 - 5)
            };
            let e = p * n as f64;
            chi2 += (c as f64 - e).powi(2) / e;
        }
        // 11 degrees of freedom: the 0.999 quantile is 31.3.
        assert!(chi2 < 31.3, "chi2 = {chi2}, counts {counts:?}");
    }

    #[test]
    fn large_sigma_has_variance_sigma2() {
        for sigma in [3.7, 1234.5, 3.0e6, 7.0e7] {
            let dg = DiscreteGaussian::at_least(sigma).unwrap();
            let mut r = rng(9);
            let n = 100_000;
            let xs: Vec<f64> = (0..n).map(|_| dg.sample(&mut r) as f64).collect();
            let mean = xs.iter().sum::<f64>() / n as f64;
            let var = xs.iter().map(|x| x * x).sum::<f64>() / n as f64;
            let s2 = sigma * sigma;
            assert!(mean.abs() < 5.0 * sigma / (n as f64).sqrt(), "{sigma}: mean {mean}");
            // The variance estimate's standard error is σ²·√(2/n) ≈ 0.45%.
            assert!((var / s2 - 1.0).abs() < 0.025, "{sigma}: var {var} vs {s2}");
        }
    }

    #[test]
    fn variance_parameter_is_never_below_the_request() {
        for sigma in [MIN_SIGMA, 0.3, 1.0, 7.77, 1e3, 123456.789, MAX_SIGMA] {
            let dg = DiscreteGaussian::at_least(sigma).unwrap();
            let (n, d) = dg.variance_ratio();
            assert!(n as f64 / d as f64 >= sigma * sigma);
            let tol = if sigma >= FAST_SIGMA { 2.0 / sigma } else { 1e-11 };
            assert!((n as f64 / d as f64) / (sigma * sigma) - 1.0 < tol);
            assert!(dg.sigma_lower() <= sigma * (1.0 + tol));
        }
        assert!(DiscreteGaussian::at_least(MAX_SIGMA * 2.0).is_err());
        assert!(DiscreteGaussian::at_least(0.001).is_err());
        assert!(DiscreteGaussian::at_least(f64::NAN).is_err());
    }

    #[test]
    fn params_bound_the_rounded_norm() {
        let p = DiscreteParams::new(1.0, 1.0, 10_000, None, Rounding::PerRecord).unwrap();
        assert_eq!(p.granularity.log2().fract(), 0.0, "the default grid is a power of two");
        let c = p.grid_clip;
        assert!(p.sens_sq as f64 >= (c + 50.0).powi(2));
        assert!(p.sensitivity / 1.0 - 1.0 <= 1e-4 * 1.001);
        assert!(p.sensitivity >= (p.sens_sq as f64).sqrt() * p.granularity);
        assert!(p.stddev <= 1.0 + 1e-6 && p.stddev > 0.999_999);
        let s = DiscreteParams::new(1.0, 1.0, 10_000, Some(1.0 / 1024.0), Rounding::Sum).unwrap();
        assert!(s.sens_sq as f64 >= (1024.0f64 + 100.0).powi(2));
        let none = DiscreteParams::new(1.0, 0.0, 5, None, Rounding::PerRecord).unwrap();
        assert!(none.noise.is_none() && none.stddev == 0.0);
        assert!(DiscreteParams::new(1.0, 1.0, 5, Some(-1.0), Rounding::Sum).is_err());
        assert!(DiscreteParams::new(1.0, 1.0, 5, Some(1e-15), Rounding::Sum).is_err());
    }
}
