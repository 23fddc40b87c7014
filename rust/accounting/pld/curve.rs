//! The privacy curve of a PLD: δ(ε) = P(L = ∞) + E[(1 − e^{ε−L})₊] (the hockey-stick
//! divergence H_{e^ε}(P‖Q); Sommer, Meiser, Mohammadi 2019, Theorem 1), and its inverse ε(δ).

use super::normal::normal_tail;
use super::DiscretePld;

/// Suffix sums over the atoms, from the top: for each index j, A_j = Σ_{k ≥ j} p_k and
/// D_j = Σ_{k ≥ j} p_k·e^{−(k−j)Δ}, so that for ε in (ε_{j−1}, ε_j]
/// δ(ε) = p_∞ + A_j − e^{ε − ε_j}·D_j. Summed from the smallest terms up.
struct Suffix {
    a: Vec<f64>,
    d: Vec<f64>,
}

fn suffix(p: &DiscretePld, add_per_atom: f64) -> Suffix {
    let n = p.probs.len();
    let mut a = vec![0.0; n + 1];
    let mut d = vec![0.0; n + 1];
    let decay = (-p.interval).exp();
    for j in (0..n).rev() {
        let x = (p.probs[j] + add_per_atom).max(0.0);
        a[j] = a[j + 1] + x;
        d[j] = d[j + 1] * decay + x;
    }
    Suffix { a, d }
}

fn loss(p: &DiscretePld, j: usize) -> f64 {
    (p.offset + j as i64) as f64 * p.interval
}

/// δ(ε) for the PLD with `add_per_atom` added to every atom (the rounding noise floor: added
/// for an upper bound, subtracted for a lower one).
pub fn delta(p: &DiscretePld, eps: f64, add_per_atom: f64) -> f64 {
    let s = suffix(p, add_per_atom);
    delta_with(p, &s, eps)
}

fn delta_with(p: &DiscretePld, s: &Suffix, eps: f64) -> f64 {
    let n = p.probs.len();
    // First atom strictly above ε.
    let jf = ((eps / p.interval) - p.offset as f64).floor() + 1.0;
    let j = if jf <= 0.0 {
        0
    } else if jf >= n as f64 {
        n
    } else {
        jf as usize
    };
    if j >= n {
        return p.inf_mass;
    }
    let v = p.inf_mass + s.a[j] - (eps - loss(p, j)).exp() * s.d[j];
    v.clamp(p.inf_mass, 1.0)
}

/// The smallest ε ≥ 0 with δ(ε) ≤ `delta` (+∞ if the +∞ atom alone exceeds it).
pub fn epsilon(p: &DiscretePld, delta: f64, add_per_atom: f64) -> f64 {
    if p.inf_mass > delta {
        return f64::INFINITY;
    }
    let s = suffix(p, add_per_atom);
    if delta_with(p, &s, 0.0) <= delta {
        return 0.0;
    }
    let n = p.probs.len();
    // δ at the atoms decreases with the index: find the first atom j with δ(ε_j) ≤ delta;
    // the answer lies in (ε_{j−1}, ε_j], where δ(ε) = p_∞ + A_j − e^{ε−ε_j}·D_j.
    let at = |j: usize| -> f64 {
        if j + 1 >= n {
            p.inf_mass
        } else {
            p.inf_mass + s.a[j + 1] - (-p.interval).exp() * s.d[j + 1]
        }
    };
    let (mut lo, mut hi) = (0usize, n - 1);
    if at(0) <= delta {
        hi = 0;
    } else {
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if at(mid) <= delta {
                hi = mid;
            } else {
                lo = mid;
            }
        }
    }
    let j = hi;
    let e = if s.d[j] > 0.0 {
        let r = (p.inf_mass + s.a[j] - delta) / s.d[j];
        loss(p, j) + r.ln()
    } else {
        loss(p, j)
    };
    // Round up (a few ulps for the log), then never above the atom itself, never below 0.
    let e = e + 8.0 * f64::EPSILON * (1.0 + e.abs());
    e.min(loss(p, j)).max(0.0)
}

/// δ(ε) of the Gaussian mechanism with sensitivity 1 and noise σ: Φ(−ε/μ + μ/2) −
/// e^ε·Φ(−ε/μ − μ/2) with μ = 1/σ (Balle & Wang 2018, arXiv:1805.06530, Theorem 8).
pub fn gaussian_delta(sigma: f64, eps: f64) -> f64 {
    let mu = 1.0 / sigma;
    let a = normal_tail(eps / mu - mu / 2.0).above();
    let b = normal_tail(eps / mu + mu / 2.0).above();
    (a - eps.exp() * b).max(0.0)
}

/// The smallest ε ≥ 0 with the analytic Gaussian δ(ε) ≤ δ (bisection to 1e-12 relative,
/// returning the upper end; δ is evaluated with a 1e-9 relative margin against rounding).
pub fn gaussian_epsilon(sigma: f64, delta: f64) -> f64 {
    let ok = |e: f64| gaussian_delta(sigma, e) * (1.0 + 1e-9) <= delta;
    if ok(0.0) {
        return 0.0;
    }
    let mut hi = 1.0f64;
    while !ok(hi) {
        hi *= 2.0;
        if hi > 1e12 {
            return f64::INFINITY;
        }
    }
    let mut lo = 0.0f64;
    while hi - lo > 1e-12 * hi {
        let mid = 0.5 * (lo + hi);
        if ok(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curve_of_two_atoms() {
        // Randomised response-like PLD: losses ±1 with masses e/(1+e), 1/(1+e).
        let e1 = 1f64.exp();
        let p = DiscretePld {
            interval: 1.0,
            offset: -1,
            probs: vec![1.0 / (1.0 + e1), 0.0, e1 / (1.0 + e1)],
            inf_mass: 0.0,
            excess: 0.0,
        };
        // δ(0) = p_1·(1 − e^{−1}).
        let d0 = e1 / (1.0 + e1) * (1.0 - (-1f64).exp());
        assert!((delta(&p, 0.0, 0.0) - d0).abs() < 1e-15);
        assert_eq!(delta(&p, 1.0, 0.0), 0.0);
        let e9 = epsilon(&p, 1e-9, 0.0);
        assert!(
            e9 <= 1.0 && e9 > 1.0 - 1e-8 && delta(&p, e9, 0.0) <= 1e-9,
            "{e9}"
        );
        let e = epsilon(&p, d0 / 2.0, 0.0);
        assert!((delta(&p, e, 0.0) - d0 / 2.0).abs() < 1e-14);
    }

    #[test]
    fn analytic_gaussian_inverts() {
        for &(s, d) in &[(1.0, 1e-5), (0.5, 1e-10), (10.0, 1e-3), (3.0, 1e-12)] {
            let e = gaussian_epsilon(s, d);
            assert!(gaussian_delta(s, e) <= d);
            assert!(gaussian_delta(s, e * (1.0 - 1e-9)) > d * (1.0 - 1e-6));
        }
    }
}
