//! Calibration: the noise multiplier, sampling probability or number of steps at which the
//! ε of `steps` Poisson-subsampled Gaussian steps (RDP accounting, see [`super::conversion`])
//! meets a target. Each result satisfies the target (ε ≤ target, verified by evaluation), and
//! lies within 1e-6 relative of the boundary (for steps: the largest integer that fits).

use super::conversion::epsilon;
use super::rdp_poisson::SubsampledGaussian;
use super::{check_orders, Composition, Step};
use crate::error::{require, DpError, DpResult};

/// What a calibration aims at: ε ≤ `epsilon` at δ = `delta`, RDP taken on `orders`.
#[derive(Clone, Copy, Debug)]
pub struct Target<'a> {
    pub epsilon: f64,
    pub delta: f64,
    pub orders: &'a [f64],
}

impl Target<'_> {
    /// Checks the target, then `steps` where the number of steps is given, then the orders.
    fn check(&self, steps: Option<f64>) -> DpResult<()> {
        let (eps, delta) = (self.epsilon, self.delta);
        require(eps > 0.0, "target_epsilon", "> 0", eps)?;
        require(delta > 0.0 && delta < 1.0, "target_delta", "in (0, 1)", delta)?;
        if let Some(s) = steps {
            require(s >= 1.0 && s.is_finite() && s.fract() == 0.0, "steps", "an integer >= 1", s)?;
        }
        check_orders(self.orders)
    }

    /// ε of `steps` Poisson-subsampled Gaussian steps (q, z), measured against this target.
    fn epsilon_of(&self, q: f64, z: f64, steps: f64) -> DpResult<f64> {
        poisson_epsilon(q, z, steps, self.delta, self.orders)
    }

    /// The first of `x`, nudge(x), nudge(nudge(x)), … (eight tries) whose ε (by `eps`) meets the
    /// target: the rounding of exp may have moved a refined value just past the boundary.
    fn verified<E>(&self, mut x: f64, nudge: fn(f64) -> f64, eps: E) -> DpResult<f64>
    where
        E: Fn(f64) -> DpResult<f64>,
    {
        for _ in 0..8 {
            if eps(x)? <= self.epsilon {
                return Ok(x);
            }
            x = nudge(x);
        }
        Err(DpError::param(
            "target_epsilon",
            "calibration failed to verify the target (please report)",
        ))
    }
}

/// ε of `steps` identical Poisson-subsampled Gaussian steps.
pub fn poisson_epsilon(q: f64, z: f64, steps: f64, delta: f64, orders: &[f64]) -> DpResult<f64> {
    let c = Composition {
        steps: vec![(Step::Poisson(SubsampledGaussian::new(q, z)?), steps)],
        non_private: false,
    };
    let grid = c.rdp_grid(orders);
    Ok(epsilon(orders, &grid, |a| c.rdp(a), delta)?.value)
}

/// Given x_bad (ε above target) and x_good (ε within target) on a log scale, narrows the
/// bracket with the Illinois variant of regula falsi on log ε − log target (bisection when
/// that is not finite) until it is `rel_tol` wide; returns the good end.
fn refine<F: FnMut(f64) -> f64>(
    mut f: F,
    mut xb: f64,
    mut fb: f64,
    mut xg: f64,
    mut fg: f64,
    rel_tol: f64,
) -> f64 {
    let mut side = 0i32;
    for _ in 0..200 {
        if (xg - xb).abs() <= rel_tol {
            break;
        }
        let mut x = 0.5 * (xb + xg);
        if fb.is_finite() && fg.is_finite() && fb != fg {
            let s = (xb * fg - xg * fb) / (fg - fb);
            let (lo, hi) = if xb < xg { (xb, xg) } else { (xg, xb) };
            let margin = 1e-3 * (hi - lo);
            if s > lo + margin && s < hi - margin {
                x = s;
            }
        }
        let fx = f(x);
        if fx > 0.0 {
            xb = x;
            fb = fx;
            if side == -1 {
                fg *= 0.5;
            }
            side = -1;
        } else {
            xg = x;
            fg = fx;
            if side == 1 {
                fb *= 0.5;
            }
            side = 1;
        }
    }
    xg
}

/// Smallest noise multiplier with ε ≤ target (to 1e-6 relative).
pub fn noise_multiplier(target: &Target, q: f64, steps: f64) -> DpResult<f64> {
    target.check(Some(steps))?;
    rdp_poisson::check_q(q, "sampling_probability")?;
    if q == 0.0 {
        return Ok(0.0);
    }
    let lt = target.epsilon.ln();
    let eps = |z: f64| target.epsilon_of(q, z, steps);
    let g = |lz: f64| -> DpResult<f64> { Ok(eps(lz.exp())?.ln() - lt) };
    // Rounding of exp could move z down by an ulp; step up until the target is verified met.
    let finish = |lz: f64| target.verified(lz.exp(), |z| z.next_up().next_up(), eps);
    // Bracket on log z: ε decreases in z.
    let (mut lb, mut lg) = (0.0f64, 0.0f64);
    let mut g0 = g(0.0)?;
    if g0 > 0.0 {
        let mut gb = g0;
        loop {
            lg = lb + std::f64::consts::LN_2 * 2.0;
            if lg > 40.0 {
                return Err(DpError::param(
                    "target_epsilon",
                    "unreachable: needs a noise multiplier above 1e17",
                ));
            }
            let gg = g(lg)?;
            if gg <= 0.0 {
                let r = refine(|x| g(x).unwrap_or(f64::INFINITY), lb, gb, lg, gg, 4e-7);
                return finish(r);
            }
            lb = lg;
            gb = gg;
        }
    }
    loop {
        lb = lg - std::f64::consts::LN_2 * 2.0;
        if lb < -40.0 {
            return Ok(lg.exp()); // every noise level down to 1e-17 meets the target
        }
        let gb = g(lb)?;
        if gb > 0.0 {
            let r = refine(|x| g(x).unwrap_or(f64::INFINITY), lb, gb, lg, g0, 4e-7);
            return finish(r);
        }
        lg = lb;
        g0 = gb;
    }
}

/// Largest sampling probability with ε ≤ target (to 1e-6 relative); 1 if even q = 1 fits.
pub fn sampling_probability(target: &Target, z: f64, steps: f64) -> DpResult<f64> {
    target.check(Some(steps))?;
    rdp_poisson::check_z(z, "noise_multiplier")?;
    let lt = target.epsilon.ln();
    let eps = |q: f64| target.epsilon_of(q, z, steps);
    if eps(1.0)? <= target.epsilon {
        return Ok(1.0);
    }
    if z == 0.0 {
        return Ok(0.0);
    }
    let g = |lq: f64| -> DpResult<f64> { Ok(eps(lq.exp())?.ln() - lt) };
    let (mut lb, mut gb) = (0.0f64, g(0.0)?);
    loop {
        let lg = lb - std::f64::consts::LN_2 * 2.0;
        if lg < -700.0 {
            return Ok(0.0);
        }
        let gg = g(lg)?;
        if gg <= 0.0 {
            let r = refine(|x| g(x).unwrap_or(f64::INFINITY), lb, gb, lg, gg, 4e-7);
            return target.verified(r.exp().min(1.0), |q| q.next_down().next_down(), eps);
        }
        lb = lg;
        gb = gg;
    }
}

/// Largest number of steps with ε ≤ target; 0 if not even one step fits. Steps are searched
/// up to 2^53 (exact in f64).
pub fn steps(target: &Target, q: f64, z: f64) -> DpResult<u64> {
    target.check(None)?;
    let (target_eps, delta, orders) = (target.epsilon, target.delta, target.orders);
    let one = SubsampledGaussian::new(q, z)?;
    let grid1: Vec<f64> = Composition {
        steps: vec![(Step::Poisson(one), 1.0)],
        non_private: false,
    }
    .rdp_grid(orders);
    let cache = std::cell::RefCell::new(std::collections::HashMap::<u64, f64>::new());
    let rdp1 = |a: f64| {
        *cache
            .borrow_mut()
            .entry(a.to_bits())
            .or_insert_with(|| one.rdp(a))
    };
    let eps = |s: u64| -> DpResult<f64> {
        let sf = s as f64;
        let grid: Vec<f64> = grid1.iter().map(|r| scale(*r, sf)).collect();
        Ok(epsilon(orders, &grid, |a| scale(rdp1(a), sf), delta)?.value)
    };
    if eps(1)? > target_eps {
        return Ok(0);
    }
    const CAP: u64 = 1 << 53;
    let (mut good, mut bad) = (1u64, 2u64);
    loop {
        if eps(bad)? > target_eps {
            break;
        }
        good = bad;
        if bad >= CAP {
            return Ok(CAP);
        }
        bad = (bad * 2).min(CAP);
    }
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if eps(mid)? <= target_eps {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok(good)
}

fn scale(r: f64, s: f64) -> f64 {
    if r == 0.0 {
        0.0
    } else {
        super::rdp_poisson::round_up(r * s, 2.0 * f64::EPSILON)
    }
}

use super::rdp_poisson;

#[cfg(test)]
mod tests {
    use super::super::default_orders;
    use super::*;

    #[test]
    fn noise_calibration_hits_boundary() {
        let o = default_orders();
        let t = Target { epsilon: 2.0, delta: 1e-5, orders: &o };
        let z = noise_multiplier(&t, 0.01, 1000.0).unwrap();
        assert!(poisson_epsilon(0.01, z, 1000.0, 1e-5, &o).unwrap() <= 2.0);
        assert!(poisson_epsilon(0.01, z * (1.0 - 1e-6), 1000.0, 1e-5, &o).unwrap() > 2.0);
    }

    #[test]
    fn q_calibration_hits_boundary() {
        let o = default_orders();
        let t = Target { epsilon: 2.0, delta: 1e-5, orders: &o };
        let q = sampling_probability(&t, 1.1, 1000.0).unwrap();
        assert!(poisson_epsilon(q, 1.1, 1000.0, 1e-5, &o).unwrap() <= 2.0);
        assert!(poisson_epsilon(q * (1.0 + 1e-6), 1.1, 1000.0, 1e-5, &o).unwrap() > 2.0);
    }

    #[test]
    fn steps_calibration_is_largest() {
        let o = default_orders();
        let s = steps(&Target { epsilon: 1.0, delta: 1e-5, orders: &o }, 0.01, 1.0).unwrap();
        assert!(s > 0);
        assert!(poisson_epsilon(0.01, 1.0, s as f64, 1e-5, &o).unwrap() <= 1.0);
        assert!(poisson_epsilon(0.01, 1.0, (s + 1) as f64, 1e-5, &o).unwrap() > 1.0);
    }
}
