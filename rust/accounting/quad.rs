//! Integrals ∫ exp(f(x)) dx over the real line where only the logarithm f can be evaluated
//! without overflow or underflow (the moment integrals of the accountant span hundreds of
//! orders of magnitude: e^{±10^5} is routine at small noise and large order).
//!
//! The integrands here are analytic in a strip around the real axis and decay like a Gaussian,
//! so the trapezoidal rule converges geometrically in the inverse step (Trefethen & Weideman
//! 2014, "The exponentially convergent trapezoidal rule", SIAM Review 56(3), Thm 5.1). The step
//! is halved until two successive sums agree to the requested tolerance; the difference, which
//! overestimates the finer sum's error by orders of magnitude once the rule converges, is
//! returned as the error so that callers can add it (safe side).

/// Result of [`trapezoid_exp`]: log of the estimate and log of its error bound.
#[derive(Clone, Copy, Debug)]
pub struct LogIntegral {
    pub log_value: f64,
    pub log_err: f64,
    /// False if the node budget ran out before the tolerance was met (the error is then the
    /// last difference measured, which callers still add).
    pub converged: bool,
}

impl LogIntegral {
    /// log(value + err): the safe-side (upper) value of the integral.
    pub fn log_upper(&self) -> f64 {
        log_add(self.log_value, self.log_err)
    }
}

/// log(e^x + e^y) without overflow.
pub fn log_add(x: f64, y: f64) -> f64 {
    let (hi, lo) = if x >= y { (x, y) } else { (y, x) };
    if lo == f64::NEG_INFINITY {
        hi
    } else {
        hi + (lo - hi).exp().ln_1p()
    }
}

/// Σ exp(v) kept as exp(scale)·mant.
#[derive(Clone, Copy)]
struct Acc {
    scale: f64,
    mant: f64,
}

impl Acc {
    const ZERO: Acc = Acc {
        scale: f64::NEG_INFINITY,
        mant: 0.0,
    };
    #[inline]
    fn push(&mut self, v: f64) {
        if v <= self.scale {
            self.mant += (v - self.scale).exp();
        } else if v > f64::NEG_INFINITY {
            self.mant = self.mant * (self.scale - v).exp() + 1.0;
            self.scale = v;
        }
    }
    fn ln(&self) -> f64 {
        if self.mant > 0.0 {
            self.scale + self.mant.ln()
        } else {
            f64::NEG_INFINITY
        }
    }
}

/// log |e^a − e^b|.
fn log_abs_diff(a: f64, b: f64) -> f64 {
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    if hi == f64::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    if lo == f64::NEG_INFINITY {
        return hi;
    }
    hi + (-(lo - hi).exp()).ln_1p()
}

/// Trapezoidal rule for ∫_{lo}^{hi} exp(f(x)) dx on the lattice anchor + k·h, starting at step
/// `h0` and halving until successive sums differ by at most `rel_tol` relative (or the lattice
/// would exceed `max_nodes`). `f` may return −∞ (zero integrand) but never NaN. The caller
/// accounts for the mass outside [lo, hi] (the end-point values are added to the error).
pub fn trapezoid_exp<F: Fn(f64) -> f64>(
    f: F,
    anchor: f64,
    lo: f64,
    hi: f64,
    h0: f64,
    rel_tol: f64,
    max_nodes: usize,
) -> LogIntegral {
    let mut h = h0;
    let k_lo = ((lo - anchor) / h).ceil() as i64;
    let k_hi = ((hi - anchor) / h).floor() as i64;
    let mut acc = Acc::ZERO;
    let mut ends = f64::NEG_INFINITY;
    for k in k_lo..=k_hi {
        let v = f(anchor + k as f64 * h);
        acc.push(v);
        if k == k_lo || k == k_hi {
            ends = log_add(ends, v);
        }
    }
    let mut nodes = (k_hi - k_lo + 1).max(0) as usize;
    // log T(h) = log h + log Σ.
    let mut log_t = h.ln() + acc.ln();
    loop {
        // Midpoints of the current lattice.
        let k_lo = ((lo - anchor) / h - 0.5).ceil() as i64;
        let k_hi = ((hi - anchor) / h - 0.5).floor() as i64;
        for k in k_lo..=k_hi {
            acc.push(f(anchor + (k as f64 + 0.5) * h));
        }
        nodes += (k_hi - k_lo + 1).max(0) as usize;
        h *= 0.5;
        let log_t_new = h.ln() + acc.ln();
        let log_diff = log_abs_diff(log_t_new, log_t);
        let log_err = log_add(log_diff, h.ln() + 1.0 + ends);
        let done = log_t_new == f64::NEG_INFINITY || log_diff <= log_t_new + rel_tol.ln();
        if done || 2 * nodes > max_nodes {
            return LogIntegral {
                log_value: log_t_new,
                log_err,
                converged: done,
            };
        }
        log_t = log_t_new;
    }
}

/// log √(2π).
pub const LN_SQRT_2PI: f64 = 0.918_938_533_204_672_8;

/// log E_{x∼N(0,s²)}[e^{h(x)}] for a moment whose bulk lies in [0, top], as an upper bound.
/// `logf(x)` = h(x) − x²/(2s²) (the density's constant −log(s√(2π)) is added here). The
/// trapezoidal rule (anchored at `anchor`, first step `h0`) covers [lo, hi] = [min(−k·s, −1),
/// top + k·s], and `tail_lo(lo)`, `tail_hi(hi)` bound the log mass beyond each end analytically.
/// k starts at 8.5 and grows by 1.6 while the tails are above e⁻³⁰ of the body (until k > 60);
/// the tails are added either way. Returns log(body + tails), the body with its quadrature
/// error.
pub fn gaussian_moment<F, L, H>(
    logf: F,
    anchor: f64,
    s: f64,
    top: f64,
    h0: f64,
    tail_lo: L,
    tail_hi: H,
) -> f64
where
    F: Fn(f64) -> f64,
    L: Fn(f64) -> f64,
    H: Fn(f64) -> f64,
{
    let norm = -(s.ln() + LN_SQRT_2PI);
    let mut kz = 8.5;
    loop {
        let lo = (-kz * s).min(-1.0);
        let hi = top + kz * s;
        let r = trapezoid_exp(&logf, anchor, lo, hi, h0, 1e-11, 1 << 22);
        let body = r.log_upper() + norm;
        let tails = log_add(tail_lo(lo), tail_hi(hi));
        if tails <= body - 30.0 || kz > 60.0 {
            return log_add(body, tails);
        }
        kz *= 1.6;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaussian_integral_at_a_huge_scale() {
        let r = trapezoid_exp(
            |x| 5000.0 - 0.5 * x * x,
            0.3,
            -40.0,
            40.0,
            1.0,
            1e-13,
            1 << 20,
        );
        let want = 5000.0 + (2.0 * std::f64::consts::PI).sqrt().ln();
        assert!((r.log_value - want).abs() < 1e-13 * want, "{r:?}");
        assert!(r.converged && r.log_upper() >= r.log_value);
    }

    #[test]
    fn narrow_peak_needs_halving() {
        let s = 0.01;
        let r = trapezoid_exp(
            |x: f64| -0.5 * ((x - 3.3) / s).powi(2),
            0.0,
            0.0,
            10.0,
            1.0,
            1e-12,
            1 << 22,
        );
        let want = (s * (2.0 * std::f64::consts::PI).sqrt()).ln();
        assert!((r.log_value - want).abs() < 1e-11, "{r:?} vs {want}");
        assert!(r.converged);
    }

    #[test]
    fn zero_integrand() {
        let r = trapezoid_exp(|_| f64::NEG_INFINITY, 0.0, 0.0, 1.0, 0.5, 1e-12, 100);
        assert_eq!(r.log_value, f64::NEG_INFINITY);
    }
}
