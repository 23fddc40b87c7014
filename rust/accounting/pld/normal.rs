//! The standard normal distribution, with full relative precision in both tails (the masses of
//! a privacy loss distribution far from its centre are tail probabilities of 1e-30 and less).

/// Φ at a point t, kept as the smaller of Φ(t) and Φ̄(t) = 1 − Φ(t) so that tail masses
/// and differences of tail masses keep their relative precision.
#[derive(Clone, Copy, Debug)]
pub struct Tail {
    pub t: f64,
    /// Φ̄(|t|) = min(Φ(t), Φ̄(t)).
    small: f64,
}

/// Φ̄(x) = P(Z > x) for x ≥ 0, by erfc (musl's, through `libm`: about one ulp).
fn upper(x: f64) -> f64 {
    0.5 * libm::erfc(x * std::f64::consts::FRAC_1_SQRT_2)
}

pub fn normal_tail(t: f64) -> Tail {
    let small = if t.is_nan() { 0.5 } else { upper(t.abs()) };
    Tail { t, small }
}

impl Tail {
    /// P(Z > t).
    pub fn above(&self) -> f64 {
        if self.t >= 0.0 {
            self.small
        } else {
            1.0 - self.small
        }
    }

    /// P(Z < t).
    pub fn below(&self) -> f64 {
        if self.t <= 0.0 {
            self.small
        } else {
            1.0 - self.small
        }
    }

    /// P(Z between a.t and b.t), in either order: a difference of the two tails on the same
    /// side when both points are on one side of 0, so that deep-tail masses stay exact.
    pub fn between(a: &Tail, b: &Tail) -> f64 {
        let (lo, hi) = if a.t <= b.t { (a, b) } else { (b, a) };
        let v = if lo.t >= 0.0 {
            lo.small - hi.small
        } else if hi.t <= 0.0 {
            hi.small - lo.small
        } else {
            1.0 - lo.small - hi.small
        };
        v.max(0.0)
    }
}

/// k ≥ 0 with Φ̄(k) ≤ τ, within a few percent of the smallest such k (τ in (0, 0.5]).
pub fn tail_inverse(tau: f64) -> f64 {
    if !(tau > 0.0) {
        return 40.0;
    }
    if tau >= 0.5 {
        return 0.0;
    }
    // Start from the asymptotic expansion, then Newton on log Φ̄ (Mills ratio as derivative).
    let l = -2.0 * tau.ln();
    let mut k = (l - (l.max(1.0)).ln() - (2.0 * std::f64::consts::PI).ln())
        .max(0.0)
        .sqrt();
    for _ in 0..50 {
        let t = upper(k);
        if t <= 0.0 {
            break;
        }
        let dens = (-0.5 * k * k).exp() / (2.0 * std::f64::consts::PI).sqrt();
        let step = (t.ln() - tau.ln()) * t / dens;
        k += step;
        if step.abs() < 1e-10 {
            break;
        }
    }
    // Step up until the tail is verified below τ.
    while upper(k) > tau && k < 40.0 {
        k += 1e-6 + 1e-9 * k;
    }
    k.min(40.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tails_are_accurate_far_out() {
        // Φ̄(10) = 7.619853024160526e-24, Φ̄(30) = 4.906713927148187e-198.
        assert!((normal_tail(10.0).above() / 7.619853024160526e-24 - 1.0).abs() < 1e-13);
        assert!((normal_tail(-30.0).below() / 4.906713927148187e-198 - 1.0).abs() < 1e-12);
        let d = Tail::between(&normal_tail(10.0), &normal_tail(10.5));
        let d2 = normal_tail(10.0).above() - normal_tail(10.5).above();
        assert!(d > 0.0 && (d / d2 - 1.0).abs() < 1e-15);
    }

    #[test]
    fn tail_inverse_brackets() {
        for &tau in &[0.4, 1e-3, 1e-10, 1e-30, 1e-100, 1e-300] {
            let k = tail_inverse(tau);
            assert!(upper(k) <= tau);
            assert!(upper(k * 0.99) > tau, "{tau} {k}");
        }
    }
}
