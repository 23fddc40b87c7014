//! RDP → (ε, δ), over a grid of orders and continuously between them.
//!
//! For a mechanism that is (α, r)-RDP, Canonne, Kamath, Steinke 2020 (arXiv:2004.00010,
//! Proposition 12; also Balle et al. 2020, arXiv:1905.09982, Theorem 21) give (ε, δ)-DP with
//!
//!   ε = r + log1p(−1/α) − (log δ + log α)/(α − 1),
//!   log δ = (α − 1)(r − ε + log1p(−1/α)) − log α.
//!
//! Since Rényi divergences grow with the order, r also bounds the KL divergence, and the
//! Bretagnolle–Huber inequality TV ≤ √(1 − e^{−KL}) gives (0, δ)-DP once δ ≥ √(1 − e^{−r}).
//! Both are taken at every order; the grid minimum is then refined by Brent's method on the
//! bracket around it (the RDP of the composition can be evaluated at any real order), and the
//! reported value is never above the grid's.

use super::rdp_poisson::round_up;
use crate::error::{require, DpError, DpResult};

/// ε at one order (not yet rounded).
pub fn eps_at(alpha: f64, rdp: f64, log_delta: f64) -> f64 {
    if rdp.is_nan() || rdp == f64::INFINITY || !(alpha > 1.0) {
        return f64::INFINITY;
    }
    if rdp <= 0.0 {
        // A composition of zero-RDP events; nothing to pay, whatever δ.
        return 0.0;
    }
    // (0, δ)-DP through the KL bound, with a margin against rounding.
    if (2.0 * log_delta).exp() > -(-rdp).exp_m1() * (1.0 + 1e-12) {
        return 0.0;
    }
    if alpha.is_infinite() {
        return rdp.max(0.0);
    }
    let e = rdp + (-1.0 / alpha).ln_1p() - (log_delta + alpha.ln()) / (alpha - 1.0);
    e.max(0.0)
}

/// log δ at one order (not yet rounded); at most 0.
pub fn log_delta_at(alpha: f64, rdp: f64, eps: f64) -> f64 {
    if rdp.is_nan() || rdp == f64::INFINITY || !(alpha > 1.0) {
        return 0.0;
    }
    if rdp <= 0.0 {
        return f64::NEG_INFINITY;
    }
    let kl = 0.5 * (-(-rdp).exp_m1()).ln();
    let imp = if alpha.is_infinite() {
        if rdp <= eps {
            f64::NEG_INFINITY
        } else {
            0.0
        }
    } else {
        (alpha - 1.0) * (rdp - eps + (-1.0 / alpha).ln_1p()) - alpha.ln()
    };
    kl.min(imp).min(0.0)
}

/// The best bound found and where.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Optimum {
    pub value: f64,
    pub order: f64,
    /// The best grid order is the first or last one and the continuous search stayed there.
    pub at_edge: bool,
}

/// Brent's minimisation (golden section + parabolic interpolation) of `f` on [a, b], started at
/// x0 with f(x0) = fx0. Returns the best point seen.
/// `fa`, `fb`: f at the ends (known from the grid), which seed the first parabolic step.
#[allow(clippy::too_many_arguments)]
fn brent_min<F: FnMut(f64) -> f64>(
    mut f: F,
    mut a: f64,
    mut b: f64,
    fa: f64,
    fb: f64,
    x0: f64,
    fx0: f64,
    rel_tol: f64,
) -> (f64, f64) {
    const CGOLD: f64 = 0.381_966_011_250_105_1;
    let (mut x, mut w, mut v) = (x0, a, b);
    let (mut fx, mut fw, mut fv) = (fx0, fa, fb);
    if fw > fv {
        (w, fw, v, fv) = (v, fv, w, fw);
    }
    let (mut d, mut e) = (0.0f64, b - a);
    for _ in 0..60 {
        let m = 0.5 * (a + b);
        let tol = rel_tol * x.abs() + 1e-12;
        let t2 = 2.0 * tol;
        if (x - m).abs() <= t2 - 0.5 * (b - a) {
            break;
        }
        let mut golden = true;
        if e.abs() > tol && fx.is_finite() && fw.is_finite() && fv.is_finite() {
            let r = (x - w) * (fx - fv);
            let mut q = (x - v) * (fx - fw);
            let mut p = (x - v) * q - (x - w) * r;
            q = 2.0 * (q - r);
            if q > 0.0 {
                p = -p;
            } else {
                q = -q;
            }
            let e_old = e;
            if p.abs() < (0.5 * q * e_old).abs() && p > q * (a - x) && p < q * (b - x) {
                e = d;
                d = p / q;
                let u = x + d;
                if u - a < t2 || b - u < t2 {
                    d = if x < m { tol } else { -tol };
                }
                golden = false;
            }
        }
        if golden {
            e = if x < m { b - x } else { a - x };
            d = CGOLD * e;
        }
        let u = if d.abs() >= tol {
            x + d
        } else {
            x + tol.copysign(d)
        };
        let fu = f(u);
        // A parabolic step that changes f by < 1e-9 relative: converged in value (the
        // remaining gap shrinks superlinearly), which is what ε needs.
        let flat = !golden && (fu - fx).abs() <= 1e-9 * fx.abs();
        if fu <= fx {
            if u < x {
                b = x
            } else {
                a = x
            }
            (v, fv, w, fw, x, fx) = (w, fw, x, fx, u, fu);
        } else {
            if u < x {
                a = u
            } else {
                b = u
            }
            if fu <= fw || w == x {
                (v, fv, w, fw) = (w, fw, u, fu);
            } else if fu <= fv || v == x || v == w {
                (v, fv) = (u, fu);
            }
        }
        if flat {
            break;
        }
    }
    (x, fx)
}

fn sorted(orders: &[f64], vals: &[f64]) -> DpResult<Vec<(f64, f64)>> {
    if orders.len() != vals.len() {
        return Err(DpError::param(
            "orders",
            "orders and rdp must have the same length",
        ));
    }
    super::check_orders(orders)?;
    let mut p: Vec<(f64, f64)> = orders.iter().copied().zip(vals.iter().copied()).collect();
    p.sort_by(|x, y| x.0.total_cmp(&y.0));
    Ok(p)
}

/// Shared driver: minimise `at(α, r(α))` over the grid, then continuously around its argmin.
fn optimise<F: Fn(f64) -> f64, G: Fn(f64, f64) -> f64>(
    grid: &[(f64, f64)],
    rdp_fn: &F,
    at: G,
) -> Optimum {
    let vals: Vec<f64> = grid.iter().map(|&(a, r)| at(a, r)).collect();
    let mut i = 0;
    for (k, v) in vals.iter().enumerate() {
        if *v < vals[i] {
            i = k;
        }
    }
    let (best_a, best_v) = (grid[i].0, vals[i]);
    let n = grid.len();
    if !best_v.is_finite() || n < 2 || best_v == 0.0 || best_v == f64::NEG_INFINITY {
        return Optimum {
            value: best_v,
            order: best_a,
            at_edge: false,
        };
    }
    let (ia, ib) = (i.saturating_sub(1), (i + 1).min(n - 1));
    let (a, fa) = (grid[ia].0, vals[ia]);
    let (b, fb) = if grid[ib].0.is_finite() {
        (grid[ib].0, vals[ib])
    } else {
        (best_a, best_v)
    };
    let rel_tol = 1e-4;
    let (x, fx) = if b > a {
        brent_min(
            |al| at(al, rdp_fn(al)),
            a,
            b,
            fa,
            fb,
            best_a,
            best_v,
            rel_tol,
        )
    } else {
        (best_a, best_v)
    };
    let (order, value) = if fx < best_v {
        (x, fx)
    } else {
        (best_a, best_v)
    };
    let edge = if i == 0 {
        Some(grid[0].0)
    } else if i == n - 1 {
        Some(grid[n - 1].0)
    } else {
        None
    };
    let at_edge = edge.is_some_and(|e| (order - e).abs() <= 10.0 * rel_tol * e);
    Optimum {
        value,
        order,
        at_edge,
    }
}

fn check_delta(delta: f64) -> DpResult<()> {
    require((0.0..=1.0).contains(&delta), "delta", "in [0, 1]", delta)
}

/// Smallest ε for `delta`, given the composition's RDP on the grid (`rdp`) and at any order
/// (`rdp_fn`). Rounded up.
pub fn epsilon<F: Fn(f64) -> f64>(
    orders: &[f64],
    rdp: &[f64],
    rdp_fn: F,
    delta: f64,
) -> DpResult<Optimum> {
    check_delta(delta)?;
    let grid = sorted(orders, rdp)?;
    if delta == 0.0 {
        let zero = grid.iter().all(|&(_, r)| r == 0.0);
        let value = if zero { 0.0 } else { f64::INFINITY };
        return Ok(Optimum {
            value,
            order: grid[0].0,
            at_edge: false,
        });
    }
    if delta == 1.0 {
        return Ok(Optimum {
            value: 0.0,
            order: grid[0].0,
            at_edge: false,
        });
    }
    let ld = delta.ln();
    let mut o = optimise(&grid, &rdp_fn, |a, r| eps_at(a, r, ld));
    o.value = round_up(o.value, 8.0 * f64::EPSILON);
    Ok(o)
}

/// Smallest δ for `eps`, as [`epsilon`]. Rounded up, at most 1.
pub fn delta<F: Fn(f64) -> f64>(
    orders: &[f64],
    rdp: &[f64],
    rdp_fn: F,
    eps: f64,
) -> DpResult<Optimum> {
    super::check_epsilon(eps)?;
    let grid = sorted(orders, rdp)?;
    if eps == f64::INFINITY {
        return Ok(Optimum {
            value: 0.0,
            order: grid[0].0,
            at_edge: false,
        });
    }
    let mut o = optimise(&grid, &rdp_fn, |a, r| log_delta_at(a, r, eps));
    o.value = if o.value == f64::NEG_INFINITY {
        0.0
    } else {
        round_up(o.value.exp(), 1e-13).min(1.0)
    };
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaussian_continuous_beats_grid() {
        // Gaussian mechanism, r(α) = c·α: the continuous optimum lies between grid points.
        let c = 0.01;
        let orders: Vec<f64> = (2..=64).map(|a| a as f64).collect();
        let rdp: Vec<f64> = orders.iter().map(|a| c * a).collect();
        let o = epsilon(&orders, &rdp, |a| c * a, 1e-5).unwrap();
        let grid_best = orders
            .iter()
            .map(|&a| eps_at(a, c * a, 1e-5f64.ln()))
            .fold(f64::INFINITY, f64::min);
        assert!(o.value <= grid_best);
        // Fine scan confirms the optimum.
        let fine = (0..200000)
            .map(|i| 2.0 + i as f64 * 3e-4)
            .map(|a| eps_at(a, c * a, 1e-5f64.ln()))
            .fold(f64::INFINITY, f64::min);
        assert!(
            o.value >= fine * (1.0 - 1e-9) && o.value <= fine * (1.0 + 1e-8),
            "{} vs {}",
            o.value,
            fine
        );
        assert!(!o.at_edge);
    }

    #[test]
    fn edge_flag() {
        let orders = [2.0, 3.0, 4.0];
        let c = 1e-4; // optimum far above 4
        let rdp: Vec<f64> = orders.iter().map(|a| c * a).collect();
        let o = epsilon(&orders, &rdp, |a| c * a, 1e-5).unwrap();
        assert!(o.at_edge && o.order == 4.0);
    }

    #[test]
    fn delta_roundtrip() {
        let c = 0.05;
        let orders: Vec<f64> = (1..200).map(|i| 1.0 + i as f64 * 0.25).collect();
        let rdp: Vec<f64> = orders.iter().map(|a| c * a).collect();
        let e = epsilon(&orders, &rdp, |a| c * a, 1e-6).unwrap();
        let d = delta(&orders, &rdp, |a| c * a, e.value).unwrap();
        assert!(d.value <= 1e-6 * (1.0 + 1e-6), "{}", d.value);
        assert!(d.value >= 1e-6 * (1.0 - 1e-4), "{}", d.value);
    }

    #[test]
    fn degenerate() {
        let o = epsilon(&[2.0], &[f64::INFINITY], |_| f64::INFINITY, 1e-5).unwrap();
        assert_eq!(o.value, f64::INFINITY);
        let o = epsilon(&[2.0, 3.0], &[0.0, 0.0], |_| 0.0, 0.0).unwrap();
        assert_eq!(o.value, 0.0);
        let o = epsilon(&[2.0, 3.0], &[0.1, 0.2], |a| 0.1 * (a - 1.0), 0.0).unwrap();
        assert_eq!(o.value, f64::INFINITY);
        assert!(epsilon(&[2.0], &[0.1], |_| 0.1, 1.5).is_err());
        assert!(epsilon(&[1.0], &[0.1], |_| 0.1, 0.5).is_err());
    }
}
