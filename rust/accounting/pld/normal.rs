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

/// ln √(2π), √(2π) and 1/√(2π).
const LN_SQRT_2PI: f64 = 0.918_938_533_204_672_8;
const SQRT_2PI: f64 = 2.506_628_274_631_000_5;
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// Where [`mills`] switches from erfc to the continued fraction (both are at about one ulp
/// there; the fraction needs ≤ 40 terms from here on, fewer further out).
const MILLS_CF_FROM: f64 = 5.0;

/// x²/2 as an unevaluated sum hi + lo, exact (an FMA gives the rounding error of x·x): e^{−x²/2}
/// and e^{s − x²/2} keep their relative precision when x²/2 is in the hundreds or thousands,
/// where rounding x·x alone would already cost |x²|·u of relative precision.
fn half_square(x: f64) -> (f64, f64) {
    let hi = x * x;
    if !hi.is_finite() {
        return (0.5 * hi, 0.0); // |x| > 1.3e154: x²/2 is +∞ (and e^{−x²/2} is 0)
    }
    let lo = x.mul_add(x, -hi);
    (0.5 * hi, 0.5 * lo)
}

/// The standard normal density φ(x) = e^{−x²/2}/√(2π), to a few ulps (0 once it underflows).
pub fn density(x: f64) -> f64 {
    let (h, l) = half_square(x);
    (-h).exp() * (-l).exp() * FRAC_1_SQRT_2PI
}

/// The Mills ratio M(x) = Φ̄(x)/φ(x) for x ≥ 0, to a few ulps for every x (M(+∞) = 0).
///
/// Φ̄(x) = φ(x)·M(x) is how a tail that underflows as a number (Φ̄(38.5) < 1e-308) is carried:
/// M is between 1/(x + 1/x) and 1/x, so φ's exponent −x²/2 can be kept apart from it and
/// combined with e^ε in log space. Below [`MILLS_CF_FROM`], erfc (one ulp) times e^{x²/2} (from
/// the exact split of x²/2); above it Laplace's continued fraction
/// M(x) = 1/(x + 1/(x + 2/(x + 3/(x + ⋯)))) (Abramowitz & Stegun 26.2.14), evaluated from the
/// bottom up (measured against 50-digit values: within 1.3e-16 relative from x = 5 on with the
/// term counts below).
pub fn mills(x: f64) -> f64 {
    if x.is_nan() {
        return f64::NAN;
    }
    if x < MILLS_CF_FROM {
        let (h, l) = half_square(x);
        return upper(x) * h.exp() * l.exp() * SQRT_2PI;
    }
    let terms = if x < 10.0 {
        40
    } else if x < 20.0 {
        20
    } else {
        12
    };
    let mut t = x;
    for k in (1..=terms).rev() {
        t = x + k as f64 / t;
    }
    1.0 / t
}

/// log Φ̄(x) = log P(Z > x) for any x, to full relative precision: for x < 0 as
/// log1p(−Φ̄(|x|)); for large x as −x²/2 − log √(2π) + log M(x), so that it stays exact where
/// Φ̄(x) itself underflows (x > 38.5; log Φ̄(100) = −5005.52…).
pub fn log_upper(x: f64) -> f64 {
    if x < 0.0 {
        (-upper(-x)).ln_1p()
    } else if x < MILLS_CF_FROM {
        upper(x).ln()
    } else {
        let (h, l) = half_square(x);
        ((-h - LN_SQRT_2PI) - l) + mills(x).ln()
    }
}

/// e^s·(Φ̄(x) − Φ̄(y)) for 0 ≤ x ≤ y ≤ +∞, without forming e^s or the tails alone where
/// either is out of range: φ(x)·(M(x) − e^{−(y−x)(y+x)/2}·M(y)), with φ's exponent −x²/2
/// added to s before anything is exponentiated. The difference of the two ratios has the same
/// conditioning as the difference of the two tails (the cancellation is the interval's own).
fn exp_times_upper_diff(s: f64, x: f64, y: f64) -> f64 {
    if x.is_nan() || x == f64::INFINITY {
        return 0.0;
    }
    let far = if y < f64::INFINITY {
        (-0.5 * (y - x) * (y + x)).exp() * mills(y)
    } else {
        0.0
    };
    let m = mills(x) - far;
    if m.is_nan() || m <= 0.0 {
        return 0.0;
    }
    let (h, l) = half_square(x);
    let e = ((s - h) - l) - LN_SQRT_2PI;
    if e < 700.0 {
        e.exp() * m
    } else {
        (e + m.ln()).exp()
    }
}

/// Above this, e^s is not formed directly (e^709.78 overflows).
const DIRECT_EXP: f64 = 700.0;
/// Below this, a tail is not used as a number (subnormal tails lose their precision).
const DIRECT_TAIL: f64 = 1e-280;

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

    /// e^s·P(Z > t) for any s, where e^s overflows or the tail underflows too (the privacy
    /// loss at ε > 709.78 weighs a tail below e^{−ε}: the product is at most 1, its factors
    /// are not representable). Where both are in range: e^s times the tail, as before.
    pub fn exp_times_above(&self, s: f64) -> f64 {
        if self.t >= 0.0 {
            if s < DIRECT_EXP && self.small >= DIRECT_TAIL {
                return s.exp() * self.small;
            }
            exp_times_upper_diff(s, self.t, f64::INFINITY)
        } else {
            exp_times(s, 1.0 - self.small)
        }
    }

    /// e^s·P(Z < t), as [`Tail::exp_times_above`] (the mirror image).
    pub fn exp_times_below(&self, s: f64) -> f64 {
        Tail {
            t: -self.t,
            small: self.small,
        }
        .exp_times_above(s)
    }

    /// e^s·P(Z between a.t and b.t), in either order, for any s (see
    /// [`Tail::exp_times_above`]); equal to e^s·[`Tail::between`] where both are in range.
    pub fn exp_times_between(s: f64, a: &Tail, b: &Tail) -> f64 {
        let (lo, hi) = if a.t <= b.t { (a, b) } else { (b, a) };
        // The end nearer 0 (the larger tail) and the far one, mirrored onto the upper side.
        let (near, x, y) = if lo.t >= 0.0 {
            (lo, lo.t, hi.t)
        } else if hi.t <= 0.0 {
            (hi, -hi.t, -lo.t)
        } else {
            // Across 0 the mass is not a deep tail: only e^s can be out of range.
            return exp_times(s, Tail::between(a, b));
        };
        if s < DIRECT_EXP && near.small >= DIRECT_TAIL {
            return s.exp() * Tail::between(a, b);
        }
        exp_times_upper_diff(s, x, y)
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

/// e^s·v for a mass v in [0, 1] that is not a deep tail, through logs where e^s overflows.
fn exp_times(s: f64, v: f64) -> f64 {
    if s < DIRECT_EXP {
        s.exp() * v
    } else if v > 0.0 {
        (s + v.ln()).exp()
    } else {
        0.0
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
    fn log_tail_has_full_relative_precision_everywhere() {
        // log Φ̄(x), 60-digit mpmath: log(erfc(x/√2)/2). From x ≈ 38.5 on Φ̄ underflows.
        let refs: [(f64, f64); 12] = [
            (-5.0, -2.866516129637636e-07),
            (-1.0, -0.17275377902344988),
            (0.0, -0.6931471805599453),
            (1.0, -1.8410216450092636),
            (5.0, -15.064998393988725),
            (10.0, -53.23128515051247),
            (26.0, -342.17850892992783),
            (38.0, -726.5572160188201),
            (40.0, -804.6084420137538),
            (100.0, -5005.524208694205),
            (1e3, -500007.82669481216),
            (1e6, -500000000014.73444),
        ];
        for &(x, r) in &refs {
            let v = log_upper(x);
            // Below 0 the value is −Φ̄(|x|) to erfc's precision, whose argument x/√2 is rounded
            // (x²·u relative: 25 ulps at x = −5); from x = 5 on the continued fraction, 1 ulp.
            let tol = if x < 0.0 { 32.0 } else { 4.0 } * f64::EPSILON;
            assert!((v / r - 1.0).abs() < tol, "{x}: {v} vs {r}");
        }
        assert_eq!(log_upper(-40.0), 0.0);
        assert_eq!(log_upper(f64::INFINITY), f64::NEG_INFINITY);
        assert_eq!(log_upper(1e200), f64::NEG_INFINITY);
        // Continuous across the switch to the continued fraction.
        let (a, b) = (log_upper(MILLS_CF_FROM.next_down()), log_upper(MILLS_CF_FROM));
        assert!((a - b).abs() < 1e-14, "{a} {b}");
    }

    #[test]
    fn mills_ratio_matches_references() {
        let refs: [(f64, f64); 7] = [
            (0.0, 1.2533141373155003),
            (0.5, 0.8763644564536923),
            (4.999, 0.1928440706982449),
            (5.0, 0.19280810471531576),
            (7.0, 0.14010418345305023),
            (30.0, 0.03329641907249721),
            (1e3, 0.0009999990000029999),
        ];
        for &(x, r) in &refs {
            let v = mills(x);
            assert!((v / r - 1.0).abs() < 8.0 * f64::EPSILON, "{x}: {v} vs {r}");
        }
        assert_eq!(mills(f64::INFINITY), 0.0);
        // φ·M = Φ̄ where Φ̄ is representable (60-digit values; erfc itself is off by x²·u here).
        for &(x, r) in &[(20.0, 2.7536241186062337e-89), (37.0, 5.725571222524577e-300)] {
            assert!((density(x) * mills(x) / r - 1.0).abs() < 8.0 * f64::EPSILON, "{x}");
        }
    }

    #[test]
    fn scaled_tails_do_not_overflow() {
        // In range: the same as e^s times the tail.
        let (a, b) = (normal_tail(3.0), normal_tail(3.1));
        let direct = 2f64.exp() * Tail::between(&a, &b);
        assert_eq!(Tail::exp_times_between(2.0, &a, &b), direct);
        assert_eq!(a.exp_times_above(2.0), 2f64.exp() * a.above());
        // e^s·Φ̄(x) with s = x²/2 + log x: → 1/√(2π) as x grows (Φ̄(x) ~ φ(x)/x); both factors
        // out of range. Against e^{s + log Φ̄(x)} with the exact log tail (60-digit values).
        for &(x, lt) in &[(40.0, -804.6084420137538), (100.0, -5005.524208694205)] {
            let s: f64 = 0.5 * x * x + f64::ln(x);
            let v = normal_tail(x).exp_times_above(s);
            let r = (s + lt).exp();
            assert!(v.is_finite() && (v / r - 1.0).abs() < 1e-12, "{x}: {v} vs {r}");
            // The lower tail mirrors the upper one.
            let lo = Tail::exp_times_between(s, &normal_tail(-x), &normal_tail(f64::NEG_INFINITY));
            assert!((lo / v - 1.0).abs() < 1e-15, "{x}");
            // An interval: the difference of two such tails, e^s·(Φ̄(x) − Φ̄(x + h)).
            let h = 1e-3;
            let w = Tail::exp_times_between(s, &normal_tail(x), &normal_tail(x + h));
            let far = normal_tail(x + h).exp_times_above(s);
            assert!((w / (v - far) - 1.0).abs() < 1e-9, "{x}: {w} vs {}", v - far);
        }
        // Across 0 with an overflowing e^s: e^s·mass through logs.
        let v = Tail::exp_times_between(710.0, &normal_tail(-0.1), &normal_tail(0.1));
        assert!((v / 1.779503600488461e+307 - 1.0).abs() < 1e-13, "{v}");
        assert_eq!(normal_tail(f64::INFINITY).exp_times_above(1e4), 0.0);
        let (x, s) = (50.0, 1250.0 + f64::ln(50.0));
        assert_eq!(normal_tail(-x).exp_times_below(s), normal_tail(x).exp_times_above(s));
        assert_eq!(normal_tail(-3.0).exp_times_below(2.0), 2f64.exp() * normal_tail(-3.0).below());
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
