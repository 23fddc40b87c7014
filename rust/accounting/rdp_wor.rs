//! Rényi DP of the Gaussian mechanism on a uniformly random subset of fixed size m drawn
//! without replacement from n records, under replace-one adjacency (n public).
//!
//! Wang, Balle, Kasiviswanathan 2019, "Subsampled Rényi Differential Privacy and Analytical
//! Moments Accountant" (arXiv:1808.00087), Theorem 9 with the Gaussian refinement of its
//! Theorem 27 (via Proposition 11's ternary-|χ|^j divergences). For integer α ≥ 2 and γ = m/n:
//!
//!   A = 1 + γ² C(α,2) min{4(e^{ε(2)} − 1), 2e^{ε(2)}}
//!         + Σ_{j=3}^{α} γ^j C(α,j) min{4·B_j, 2e^{(j−1)ε(j)}},       ε'(α) = log A / (α − 1),
//!
//! where ε(j) = j/(2σ²) is the Gaussian mechanism's RDP, B_j = M_j for even j and
//! B_j = √(M_{j−1} M_{j+1}) for odd j, and M_j = E_{x∼N(0,σ²)}[(L(x) − 1)^j] with
//! L(x) = exp((2x − 1)/(2σ²)) (the j-th forward difference of e^{(x−1)ε(x)} at 0). M_j is
//! computed by quadrature in log space, which avoids the catastrophic cancellation of the
//! alternating difference table. For real α the cumulant (α−1)ε'(α) is convex (WBK Cor. 10),
//! so interpolating it linearly between ⌊α⌋ and ⌈α⌉ gives an upper bound.

use super::quad::{gaussian_moment, log_add, LN_SQRT_2PI};
use super::rdp_poisson::{check_z, ln1p_exp, ln_expm1, rdp_trivial, round_up};
use crate::error::{DpError, DpResult};

/// Beyond this j the 2e^{(j−1)ε(j)} branch (itself a valid bound on the term) is used alone.
const MAX_EXACT_J: u64 = 2048;

#[derive(Clone, Debug)]
pub struct WithoutReplacementGaussian {
    pub gamma: f64,
    pub sigma: f64,
    /// log M_j for even j = 2, 4, …, up to the largest order prepared (index j/2 − 1).
    log_m_even: Vec<f64>,
}

impl WithoutReplacementGaussian {
    /// `max_order`: the largest order that will be asked for (tables are built up to it).
    pub fn new(gamma: f64, sigma: f64, max_order: f64) -> DpResult<Self> {
        if !(0.0..=1.0).contains(&gamma) {
            return Err(DpError::param(
                "sample_size",
                format!("sample_size/source_size must be in [0, 1], got {gamma}"),
            ));
        }
        check_z(sigma, "noise_multiplier")?;
        let mut s = WithoutReplacementGaussian {
            gamma,
            sigma,
            log_m_even: Vec::new(),
        };
        if gamma > 0.0 && gamma < 1.0 && sigma > 0.0 {
            let jmax = if max_order.is_finite() {
                (max_order.ceil() as u64 + 1).min(MAX_EXACT_J)
            } else {
                MAX_EXACT_J
            };
            s.log_m_even = (1..=jmax.div_ceil(2))
                .map(|h| log_chi_moment(sigma, 2 * h))
                .collect();
        }
        Ok(s)
    }

    fn log_m(&self, j: u64) -> Option<f64> {
        debug_assert!(j % 2 == 0 && j >= 2);
        self.log_m_even.get((j / 2 - 1) as usize).copied()
    }

    /// log A of the bound at integer α ≥ 2 (before division by α − 1).
    fn log_a_int(&self, alpha: u64) -> f64 {
        let s2 = self.sigma * self.sigma;
        let lg = self.gamma.ln();
        let a = alpha as f64;
        let mut acc = f64::NEG_INFINITY;
        let mut lc = (a * (a - 1.0) / 2.0).ln(); // log C(α, 2)
        for j in 2..=alpha {
            let jf = j as f64;
            // 2e^{(j−1)ε(j)} = 2 exp(j(j−1)/(2σ²)).
            let second = std::f64::consts::LN_2 + jf * (jf - 1.0) / (2.0 * s2);
            let first = if j == 2 {
                // 4(e^{1/σ²} − 1), exactly.
                Some(4f64.ln() + ln_expm1(1.0 / s2))
            } else if j % 2 == 0 {
                self.log_m(j).map(|m| 4f64.ln() + m)
            } else {
                match (self.log_m(j - 1), self.log_m(j + 1)) {
                    (Some(lo), Some(hi)) => Some(4f64.ln() + 0.5 * (lo + hi)),
                    _ => None,
                }
            };
            let t = first.map_or(second, |f| f.min(second));
            acc = log_add(acc, lc + jf * lg + t);
            lc += ((a - jf) / (jf + 1.0)).ln();
        }
        let acc = acc + (a + 8.0) * 4.0 * f64::EPSILON * (1.0 + acc.abs());
        ln1p_exp(acc)
    }

    /// ε'(α), rounded up; +∞ where no finite bound exists.
    pub fn rdp(&self, alpha: f64) -> f64 {
        if let Some(e) = rdp_trivial(self.gamma, self.sigma, alpha) {
            return e;
        }
        let s = self.sigma;
        if alpha > 1e6 {
            return f64::INFINITY; // beyond any useful order; refuse to spend O(α) work
        }
        let cgf = |k: u64| if k <= 1 { 0.0 } else { self.log_a_int(k) };
        let lo = alpha.floor();
        let t = alpha - lo;
        let k = if t == 0.0 {
            cgf(lo as u64)
        } else {
            (1.0 - t) * cgf(lo as u64) + t * cgf(lo as u64 + 1)
        };
        // Subsampling never hurts: the sampled mechanism is the Gaussian mechanism applied to a
        // subset that changes in at most one record, so α/(2σ²) bounds it too.
        let base = alpha / (2.0 * s * s);
        round_up((k / (alpha - 1.0)).min(base), 8.0 * f64::EPSILON)
    }
}

/// log E_{x∼N(0,σ²)}[(L(x) − 1)^j] for even j ≥ 2, by quadrature (safe-side error added).
fn log_chi_moment(sigma: f64, j: u64) -> f64 {
    let s2 = sigma * sigma;
    let inv2s2 = 1.0 / (2.0 * s2);
    let jf = j as f64;
    if j == 2 {
        return ln_expm1(1.0 / s2);
    }
    let logf = |x: f64| {
        let t = (2.0 * x - 1.0) * inv2s2;
        let l = if t > 0.0 {
            ln_expm1(t)
        } else if t < 0.0 {
            (-t.exp_m1()).ln()
        } else {
            f64::NEG_INFINITY
        };
        -x * x * inv2s2 + jf * l
    };
    let h0 = (0.5 * sigma).min(0.7 * s2).max(1e-4 * jf);
    // Left: |L − 1| ≤ 1 for x ≤ 1/2, so the tail is at most Φ(lo/σ) ≤ φ(s)/s.
    let tail_lo = |lo: f64| {
        let s_lo = -lo / sigma;
        -0.5 * s_lo * s_lo - LN_SQRT_2PI - s_lo.ln()
    };
    // Right: (L − 1)^j ≤ L^j and φ_σ(x)L^j = e^{j(j−1)/(2σ²)} φ_σ(x − j).
    let tail_hi = |hi: f64| {
        let s_hi = (hi - jf) / sigma;
        jf * (jf - 1.0) * inv2s2 - 0.5 * s_hi * s_hi - LN_SQRT_2PI - s_hi.ln()
    };
    let v = gaussian_moment(logf, 0.5, sigma, jf, h0, tail_lo, tail_hi);
    v + 1e-12 * (1.0 + v.abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact M_j by the alternating sum in f64, usable where it does not cancel (small σ).
    fn m_direct(sigma: f64, j: u64) -> f64 {
        let mut s = 0.0;
        let mut c = 1.0;
        for i in 0..=j {
            let sign = if (j - i) % 2 == 0 { 1.0 } else { -1.0 };
            s += sign * c * ((i * i - i) as f64 / (2.0 * sigma * sigma)).exp();
            c = c * (j - i) as f64 / (i + 1) as f64;
        }
        s
    }

    #[test]
    fn chi_moments_match_direct_sum() {
        for &s in &[0.5, 0.8, 1.0] {
            for j in [2u64, 4, 6, 8] {
                let d = m_direct(s, j).ln();
                let q = log_chi_moment(s, j);
                assert!(
                    (d - q).abs() < 1e-9 * d.abs().max(1.0),
                    "s={s} j={j}: {d} vs {q}"
                );
            }
        }
    }

    #[test]
    fn edges_and_sanity() {
        let w = WithoutReplacementGaussian::new(0.0, 1.0, 10.0).unwrap();
        assert_eq!(w.rdp(2.0), 0.0);
        let w = WithoutReplacementGaussian::new(1.0, 2.0, 10.0).unwrap();
        assert!((w.rdp(3.0) - 3.0 / 8.0).abs() < 1e-14);
        let w = WithoutReplacementGaussian::new(0.01, 1.0, 64.0).unwrap();
        let g = 1.0 / (2.0 * 1.0);
        for a in [2.0, 2.5, 3.0, 10.0, 32.0] {
            let r = w.rdp(a);
            assert!(r > 0.0 && r <= a * g, "a={a} r={r}");
        }
        assert!(WithoutReplacementGaussian::new(1.5, 1.0, 2.0).is_err());
    }
}
