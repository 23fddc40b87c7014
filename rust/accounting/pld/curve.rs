//! The privacy curve of a PLD: δ(ε) = P(L = ∞) + E[(1 − e^{ε−L})₊] (the hockey-stick
//! divergence H_{e^ε}(P‖Q); Sommer, Meiser, Mohammadi 2019, Theorem 1), and its inverse ε(δ).

use super::normal::{density, mills, normal_tail};
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
///
/// With a = ε/μ − μ/2 and b = ε/μ + μ/2 this is Φ̄(a) − e^ε·Φ̄(b). The second term is not
/// formed as written: above ε ≈ 709.78 e^ε overflows while Φ̄(b) underflows (b ≥ 38.5), and
/// the product of ∞ and 0 made δ = 0 at every such ε, so ε was capped at 709.78 (μ = 37 gave
/// 709.78 against 841.35 at δ = 1e-5). Instead ε − b²/2 = −a²/2 exactly, hence
/// e^ε·φ(b) = φ(a) and e^ε·Φ̄(b) = φ(a)·M(b), M = Φ̄/φ the Mills ratio ([`mills`]): every factor
/// is in range for any ε, and for a ≥ 0 δ = φ(a)·(M(a) − M(b)) keeps its relative precision
/// down to δ ≈ 1e-300 (measured against 60-digit values, tests).
pub fn gaussian_delta(sigma: f64, eps: f64) -> f64 {
    let mu = 1.0 / sigma;
    let a = eps / mu - mu / 2.0;
    let b = eps / mu + mu / 2.0;
    let v = if b < 0.0 {
        // ε < −μ²/2 (not reached from ε ≥ 0): e^ε < 1, the formula as written.
        normal_tail(a).above() - eps.exp() * normal_tail(b).above()
    } else if a >= 0.0 {
        density(a) * (mills(a) - mills(b))
    } else {
        normal_tail(a).above() - density(a) * mills(b)
    };
    v.max(0.0)
}

/// The smallest ε ≥ 0 with the analytic Gaussian δ(ε) ≤ δ (bisection to 1e-12 relative,
/// returning the upper end; δ is evaluated with a 1e-9 relative margin against rounding).
/// +∞ only where no ε up to 1e300 is found (δ(ε) is exact at any ε, see [`gaussian_delta`]).
pub fn gaussian_epsilon(sigma: f64, delta: f64) -> f64 {
    let ok = |e: f64| gaussian_delta(sigma, e) * (1.0 + 1e-9) <= delta;
    if ok(0.0) {
        return 0.0;
    }
    let mut hi = 1.0f64;
    while !ok(hi) {
        hi *= 2.0;
        if hi > 1e300 {
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
    fn analytic_gaussian_is_exact_above_709() {
        // 60-digit mpmath values of Φ̄(ε/μ − μ/2) − e^ε·Φ̄(ε/μ + μ/2) (Balle & Wang 2018,
        // Theorem 8). Before: δ = 0 from ε ≈ 709.78 on (e^ε·Φ̄ = ∞·0).
        for &(mu, e, r) in &[
            (1.0, 1.0, 0.12693673750664394),
            (0.1, 0.5, 6.856582455838737e-09),
            (2.0, 0.01, 0.6811010599164893),
            (37.0, 841.355, 9.999633401025903e-06),
            (63.0, 2252.22, 1.000041580841503e-05),
            (100.0, 5000.0, 0.4960109760186432),
            (100.0, 5500.0, 2.7249362234044254e-07),
        ] {
            let d = gaussian_delta(1.0 / mu, e);
            assert!((d / r - 1.0).abs() < 1e-12, "μ = {mu}, ε = {e}: {d} vs {r}");
        }
        // ε(δ), 60-digit values: never below, above by the 1e-9 margin on δ (about 1e-11).
        for &(mu, d, r) in &[
            (37.0, 1e-3, 797.8783632962732),
            (37.0, 1e-5, 841.3546970421057),
            (37.0, 1e-12, 943.860558982541),
            (63.0, 1e-3, 2178.208461313149),
            (63.0, 1e-5, 2252.2205849519),
            (63.0, 1e-12, 2426.724537398492),
            (100.0, 1e-3, 5308.038401421484),
            (100.0, 1e-5, 5425.50984614743),
            (100.0, 1e-12, 5702.482015738906),
        ] {
            let e = gaussian_epsilon(1.0 / mu, d);
            assert!(e >= r && e <= r * (1.0 + 1e-10), "μ = {mu}, δ = {d}: {e} vs {r}");
        }
        // Far beyond: finite, and δ falls through the whole range.
        let e = gaussian_epsilon(1e-4, 1e-10);
        assert!(e.is_finite() && e > 5e7, "{e}");
        assert!(gaussian_delta(1e-4, e) <= 1e-10 && gaussian_delta(1e-4, 0.999 * e) > 1e-10);
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
