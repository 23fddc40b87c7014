//! The discrete Gaussian mechanism: floating-point-safe noise (Canonne, Kamath & Steinke 2020,
//! "The Discrete Gaussian for Differential Privacy", NeurIPS).
//!
//! Textbook Gaussian noise sampled in floating point leaks the input through the set of floats
//! the output can take (Mironov 2012; Jin et al. 2022 recover members this way). Here records
//! are instead moved onto the integer grid γ·ℤ^d, summed exactly, and noised with integers drawn
//! from the discrete Gaussian N_ℤ(0, σ²) (P[Y = y] ∝ exp(−y²/2σ²)), sampled exactly with
//! integer arithmetic only (`blocks`: rejection from uniform blocks, every acceptance an exact
//! comparison of ChaCha20 bits with exp of a rational, `exact`); no float enters the sampler.
//! σ² is a rational n/2^k ≥ the requested variance; the stddev reported for accounting is
//! rounded down from it.
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

mod blocks;
mod exact;

/// How the records reach the grid, which fixes the sensitivity bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Every clipped record is rounded before summing: Δ ≤ c + √d/2.
    PerRecord,
    /// Only the sum is rounded: Δ ≤ c + √d.
    Sum,
}

/// Limits that keep every integer of the sampler's fast path within u64/u128.
const MAX_SIGMA: f64 = (1u64 << 29) as f64;
const MIN_SIGMA: f64 = 1.0 / 64.0;
/// The clip norm in grid units stays below this, so that rounding by adding 1.5·2⁵² is exact
/// and the squared norms are exact in u128.
pub const MAX_GRID_CLIP: f64 = (1u64 << 40) as f64;
/// Relative inflation Δ/c − 1 of the default granularity.
const DEFAULT_INFLATION: f64 = 1e-4;

// ------------------------------------------------------------------- the discrete Gaussian

/// N_ℤ(0, σ²) with σ² = num/den exactly (den a power of two): P[Y = y] ∝ exp(−y²/2σ²)
/// (Canonne, Kamath & Steinke 2020, Definition 1), sampled exactly by `blocks::BlockSampler`.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscreteGaussian {
    num: u64,
    den: u64,
    sampler: blocks::BlockSampler,
}

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
        let k = (40 - s2.log2().floor() as i32).clamp(0, 52);
        let den = 1u64 << k;
        // s2·2^k is exact (a power-of-two scaling); its ceiling is ≥ s2·2^k.
        let num = (s2 * den as f64).ceil() as u64;
        Self::exact(num, den)
    }

    /// σ² = num/den exactly (num, den ≥ 1, σ ≤ 2³⁰).
    pub fn exact(num: u64, den: u64) -> DpResult<Self> {
        Ok(DiscreteGaussian {
            num,
            den,
            sampler: blocks::BlockSampler::new(num, den)?,
        })
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
        self.sampler.sample(rng)
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

    /// Pearson's statistic of `n` draws against the exact pmf of N_ℤ(0, σ²), σ² = num/den, over
    /// cells of `width` integers covering ±`cells`·width, plus the two tails.
    fn chi2(dg: &DiscreteGaussian, r: &mut ChaCha20, n: usize, width: i64, cells: i64) -> (f64, usize) {
        let (num, den) = dg.variance_ratio();
        let s2 = num as f64 / den as f64;
        let reach = (40.0 * s2.sqrt()) as i64 + 50;
        let w = |y: i64| (-((y * y) as f64) / (2.0 * s2)).exp();
        let z: f64 = (-reach..=reach).map(w).sum();
        let cell = |y: i64| ((y + width / 2).div_euclid(width)).clamp(-cells - 1, cells + 1);
        let k = (2 * cells + 3) as usize;
        let mut expect = vec![0.0; k];
        for y in -reach..=reach {
            expect[(cell(y) + cells + 1) as usize] += w(y) / z * n as f64;
        }
        let mut got = vec![0usize; k];
        for _ in 0..n {
            got[(cell(dg.sample(r)) + cells + 1) as usize] += 1;
        }
        let stat = got
            .iter()
            .zip(&expect)
            .filter(|(_, &e)| e > 5.0)
            .map(|(&g, &e)| (g as f64 - e).powi(2) / e)
            .sum();
        let dof = expect.iter().filter(|&&e| e > 5.0).count() - 1;
        (stat, dof)
    }

    #[test]
    fn small_sigma_matches_the_pmf() {
        // σ² = 9/4 exactly: cells of one integer over |y| ≤ 5 and the tails.
        let dg = DiscreteGaussian::exact(9, 4).unwrap();
        let (stat, dof) = chi2(&dg, &mut rng(5), 400_000, 1, 5);
        assert_eq!(dof, 12);
        // The 0.999 quantile of χ²(12) is 32.9.
        assert!(stat < 32.9, "chi2 = {stat}");
    }

    #[test]
    fn blocks_wider_than_one_match_the_pmf() {
        // σ = 1000.5: blocks of 15 integers, acceptance inside a block below 1. Cells of 97 (not
        // aligned with the blocks) over ±4σ.
        let dg = DiscreteGaussian::at_least(1000.5).unwrap();
        assert!(dg.sampler.width_for_tests() > 1);
        let (stat, dof) = chi2(&dg, &mut rng(6), 400_000, 97, 41);
        // χ²(dof) at 0.999 is below dof + 4.9·√(2·dof) for these sizes.
        let limit = dof as f64 + 4.9 * (2.0 * dof as f64).sqrt();
        assert!(stat < limit, "chi2 = {stat} over {dof} dof (limit {limit})");
    }

    #[test]
    fn the_exact_path_alone_matches_the_pmf() {
        // Every acceptance through big-integer bounds and lazily extended bits.
        for (dg, width, cells) in [
            (DiscreteGaussian::exact(9, 4).unwrap(), 1i64, 5i64),
            (DiscreteGaussian::at_least(700.0).unwrap(), 61, 23),
        ] {
            let mut dg = dg;
            dg.sampler.force_exact = true;
            let (stat, dof) = chi2(&dg, &mut rng(7), 30_000, width, cells);
            let limit = dof as f64 + 4.9 * (2.0 * dof as f64).sqrt();
            assert!(stat < limit, "chi2 = {stat} over {dof} dof (limit {limit})");
        }
    }

    #[test]
    fn tiny_sigma_is_almost_always_zero() {
        // σ = 2⁻⁶: P[|Y| ≥ 1] = 2·e^(−2048)/Z, nothing but 0 in any feasible run.
        let dg = DiscreteGaussian::at_least(MIN_SIGMA).unwrap();
        let mut r = rng(8);
        assert!((0..10_000).all(|_| dg.sample(&mut r) == 0));
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
            let tol = 1e-11;
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
