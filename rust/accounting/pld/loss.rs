//! The privacy loss of the Poisson-subsampled Gaussian mechanism, and its discretisation onto a
//! grid of loss values: pessimistic by "connect the dots" (Doroshenko, Ghazi, Kamath, Kumar,
//! Manurangsi 2022, arXiv:2207.04380, Algorithm 1 / §3), optimistic by its mirror image: the
//! lower convex hull of the grid values lowered by the chords' largest gap ([`tight_lower`]).
//!
//! Sensitivity 1 and noise σ (the noise multiplier), sampling probability q. Dominating pairs
//! (Zhu, Dong, Wang 2022, arXiv:2106.08567, Proposition 30; Koskela et al. 2020):
//! * remove: P = (1−q)·N(0, σ²) + q·N(1, σ²), Q = N(0, σ²);
//!   L(x) = log(1 − q + q·e^{(2x−1)/(2σ²)}), increasing in x, bounded below by log(1 − q);
//! * add: P = N(0, σ²), Q = (1−q)·N(0, σ²) + q·N(1, σ²); L(x) = −(the above), decreasing in
//!   x, bounded above by −log(1 − q).
//!
//! At q = 1 both directions are the Gaussian mechanism, L ~ N(1/(2σ²), 1/σ²).

use super::normal::{normal_tail, tail_inverse, Tail};
use super::DiscretePld;
use crate::error::{DpError, DpResult};
use rayon::prelude::*;

/// Add direction: above this loss y = e^ε is not formed (reached only at q = 1).
const ADD_DIRECT: f64 = 700.0;

/// Below 1 + r = NEAR_FLOOR the inverse of the loss switches to the form without cancellation
/// ([`SubsampledGaussianLoss::x_of_log_mix`]); above it ln_1p(r) loses at most u/1e-3.
const NEAR_FLOOR: f64 = 1e-3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The record is in P's data set and not in Q's.
    Remove,
    /// The record is in Q's data set and not in P's.
    Add,
}

/// The privacy loss of one Poisson-subsampled Gaussian step in one direction.
#[derive(Clone, Copy, Debug)]
pub struct SubsampledGaussianLoss {
    pub q: f64,
    pub sigma: f64,
    pub direction: Direction,
}

/// Where a discretisation puts the mass it cannot place exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// Connect the dots: a dominating PLD (every ε it gives is an upper bound).
    Pessimistic,
    /// A PLD whose curve lies below the true one at every ε, as tight as the grid allows (see
    /// [`tight_lower`]): every ε it gives is a lower bound.
    Optimistic,
    /// Losses rounded down, mass below the grid dropped: a lower bound too, loose by up to Δ per
    /// step (the fallback of `Optimistic`; tests compare the two).
    RoundedDown,
}

impl SubsampledGaussianLoss {
    pub fn new(q: f64, sigma: f64, direction: Direction) -> Self {
        SubsampledGaussianLoss {
            q,
            sigma,
            direction,
        }
    }

    /// log(1 − q + q·e^t), t = (2x − 1)/(2σ²), without overflow or cancellation.
    fn log_mix(&self, x: f64) -> f64 {
        let t = (2.0 * x - 1.0) / (2.0 * self.sigma * self.sigma);
        if self.q == 1.0 {
            return t;
        }
        if t > 0.0 {
            t + (self.q + (1.0 - self.q) * (-t).exp()).ln()
        } else {
            (self.q * t.exp_m1()).ln_1p()
        }
    }

    /// The privacy loss at output x.
    pub fn loss(&self, x: f64) -> f64 {
        match self.direction {
            Direction::Remove => self.log_mix(x),
            Direction::Add => -self.log_mix(x),
        }
    }

    /// The x with log_mix(x) = u (−∞ below log(1 − q)).
    fn x_of_log_mix(&self, u: f64) -> f64 {
        let s2 = self.sigma * self.sigma;
        if self.q == 1.0 {
            return s2 * u + 0.5;
        }
        let l = if u > 30.0 {
            u + (-(1.0 - self.q) * (-u).exp()).ln_1p() - self.q.ln()
        } else {
            let r = u.exp_m1() / self.q;
            if r < NEAR_FLOOR - 1.0 {
                // u within about 1e-3·q/(1 − q) of its floor log(1 − q): 1 + r = (e^u − (1 − q))/q
                // has cancelled. With v = u − log(1 − q) (exact, the two are close),
                // e^u − (1 − q) = (1 − q)·expm1(v). Small σ puts all of P's mass here in the add
                // direction (loss ≈ −log(1 − q)); with q = 1 − 1e-12, 1 + r rounded to 0 and a
                // whole grid cell's mass was lost.
                let lf = (-self.q).ln_1p();
                let v = u - lf;
                if v.is_nan() || v <= 0.0 {
                    return f64::NEG_INFINITY;
                }
                lf + v.exp_m1().ln() - self.q.ln()
            } else {
                r.ln_1p()
            }
        };
        s2 * l + 0.5
    }

    /// Grid bounds (in multiples of Δ) holding all but `tail_hi` of P's mass above and all but
    /// about `tail_lo` below.
    pub fn grid(&self, interval: f64, tail_hi: f64, tail_lo: f64) -> (i64, i64) {
        let (khi, klo) = (tail_inverse(tail_hi), tail_inverse(tail_lo));
        let (lo, hi) = match self.direction {
            Direction::Remove => {
                // P's mass above x = 1 + σ·k is at most Φ̄(k); below −σ·k at most Φ̄(k).
                let lo = self.loss(-self.sigma * klo);
                let hi = self.loss(1.0 + self.sigma * khi);
                (lo, hi)
            }
            Direction::Add => {
                // P = N(0, σ²); large losses come from small x.
                let mut hi = self.loss(-self.sigma * khi);
                if self.q < 1.0 {
                    hi = hi.min(-(-self.q).ln_1p());
                }
                (self.loss(self.sigma * klo), hi)
            }
        };
        let a = (lo / interval).floor();
        let mut b = (hi / interval).ceil();
        if b <= a {
            b = a + 1.0;
        }
        (a as i64, b as i64)
    }

    /// Discretises this loss onto the grid k·Δ, k = k0..=k1.
    pub fn discretize(
        &self,
        interval: f64,
        k0: i64,
        k1: i64,
        bound: Bound,
    ) -> DpResult<DiscretePld> {
        if bound == Bound::RoundedDown {
            let g = self.grid_masses(interval, k0, k1);
            return finite(round_down(&g, interval, k0));
        }
        let pess = bound == Bound::Pessimistic;
        let (p, o) = self.discretize_both(interval, k0, k1, pess, !pess)?;
        p.or(o)
            .ok_or_else(|| DpError::param("bound", "no discretisation was computed"))
    }

    /// The pessimistic and the optimistic discretisations on the grid k·Δ, k = k0..=k1 (each
    /// only if asked for): they share the grid's normal tails, the costly part.
    pub fn discretize_both(
        &self,
        interval: f64,
        k0: i64,
        k1: i64,
        pessimistic: bool,
        optimistic: bool,
    ) -> DpResult<(Option<DiscretePld>, Option<DiscretePld>)> {
        let g = self.grid_masses(interval, k0, k1);
        let p = if pessimistic {
            Some(finite(connect_the_dots(&g, interval, k0))?)
        } else {
            None
        };
        let o = if optimistic {
            let t = tight_lower(&g, interval, k0).unwrap_or_else(|| round_down(&g, interval, k0));
            Some(finite(t)?)
        } else {
            None
        };
        Ok((p, o))
    }

    /// Per grid interval I_i = (ε_i, ε_{i+1}] the masses that both discretisations are built
    /// from, computed from the two Gaussian components directly (never as differences of δ,
    /// which would lose the small masses to cancellation).
    ///
    /// Q's masses are kept multiplied by y_i = e^{ε_i} (R_i = y_i·Q(I_i) ≤ P(I_i), since the loss
    /// is above ε_i on I_i): above ε ≈ 709.78 y_i overflows while Q(I_i) ≤ e^{−ε_i}·P(I_i)
    /// underflows, and their product, formed directly, was ∞ or NaN (a Gaussian step with
    /// σ ≤ 1/37 had no PLD). In the remove direction Q is N(0, σ²) and R_i is e^{ε_i}·Φ̄
    /// between two points, formed by [`Tail::exp_times_between`] (in log space where needed,
    /// bit for bit e^{ε_i}·Q(I_i) where both are in range). In the add direction the loss is at
    /// most −log(1 − q) < 37 for q < 1 (the accountant takes q = 1 in the remove direction) and
    /// y_i is in range; an add-direction loss at q = 1 built directly is handled the same way
    /// above ε = [`ADD_DIRECT`].
    fn grid_masses(&self, interval: f64, k0: i64, k1: i64) -> GridMasses {
        let n = (k1 - k0) as usize; // intervals; grid points 0..=n
        let sigma = self.sigma;
        // x at every grid point, and the two components' masses on the far side of it.
        let pts: Vec<(f64, Tail, Tail)> = (0..n + 1)
            .into_par_iter()
            .with_min_len(2048)
            .map(|i| {
                let eps = (k0 + i as i64) as f64 * interval;
                let x = match self.direction {
                    Direction::Remove => self.x_of_log_mix(eps),
                    Direction::Add => self.x_of_log_mix(-eps),
                };
                (x, normal_tail(x / sigma), normal_tail((x - 1.0) / sigma))
            })
            .collect();
        // Interval i is (ε_i, ε_{i+1}]; its x range runs upward (remove) or downward (add).
        let ends = |i: usize| -> (usize, usize) {
            match self.direction {
                Direction::Remove => (i, i + 1),
                Direction::Add => (i + 1, i),
            }
        };
        let q = self.q;
        // (P(I_i), Q(I_i)) from the two component masses.
        let pq = |d0: f64, d1: f64| -> (f64, f64) {
            let mix = (1.0 - q) * d0 + q * d1;
            match self.direction {
                Direction::Remove => (mix, d0),
                Direction::Add => (d0, mix),
            }
        };
        // Masses of the two components beyond the top grid point (losses above ε_n).
        let eps_n = (k0 + n as i64) as f64 * interval;
        let (t0, t1) = match self.direction {
            Direction::Remove => (pts[n].1.above(), pts[n].2.above()),
            Direction::Add => (pts[n].1.below(), pts[n].2.below()),
        };
        let (p_top, q_top) = pq(t0, t1);
        let r_top = match self.direction {
            Direction::Remove => pts[n].1.exp_times_above(eps_n),
            Direction::Add if eps_n < ADD_DIRECT => eps_n.exp() * q_top,
            Direction::Add => add_mix(q, pts[n].2.exp_times_below(eps_n), || pts[n].1.exp_times_below(eps_n)),
        };
        // (P(I_i), N_i = P(I_i) − y_i·Q(I_i) ≥ 0, R_i = y_i·Q(I_i)).
        let cells: Vec<(f64, f64, f64)> = (0..n)
            .into_par_iter()
            .with_min_len(2048)
            .map(|i| {
                let (a, b) = ends(i);
                let d0 = Tail::between(&pts[a].1, &pts[b].1);
                let d1 = Tail::between(&pts[a].2, &pts[b].2);
                let eps = (k0 + i as i64) as f64 * interval;
                let yi = eps.exp();
                let (pp, qq) = pq(d0, d1);
                let (nn, rr) = match self.direction {
                    Direction::Remove => {
                        let rr = Tail::exp_times_between(eps, &pts[a].1, &pts[b].1);
                        // Where y_i and Q(I_i) are both in range rr is y_i·d0 and N_i is formed
                        // as before ((1 − q − y_i) is exact near y_i = 1 − q); else from rr.
                        let nn = if rr == yi * d0 {
                            (1.0 - q - yi) * d0 + q * d1
                        } else {
                            ((1.0 - q) * d0 + q * d1) - rr
                        };
                        (nn, rr)
                    }
                    Direction::Add if eps < ADD_DIRECT => ((1.0 - yi * (1.0 - q)) * d0 - yi * q * d1, yi * qq),
                    Direction::Add => {
                        // Only an add-direction loss built directly at q = 1 gets here.
                        let rr = add_mix(q, Tail::exp_times_between(eps, &pts[a].2, &pts[b].2), || {
                            Tail::exp_times_between(eps, &pts[a].1, &pts[b].1)
                        });
                        (d0 - rr, rr)
                    }
                };
                (pp, nn.max(0.0), rr)
            })
            .collect();
        GridMasses {
            cells,
            p_top,
            r_top,
        }
    }
}

/// (1 − q)·e^ε·N(0)-mass + q·e^ε·N(1)-mass, the first term only where its weight is nonzero
/// (e^ε times an N(0)-mass may overflow at q = 1, and 0·∞ is NaN).
fn add_mix(q: f64, one: f64, zero: impl Fn() -> f64) -> f64 {
    if q < 1.0 {
        (1.0 - q) * zero() + q * one
    } else {
        q * one
    }
}

/// The masses of one loss on a grid (see [`SubsampledGaussianLoss::grid_masses`]). Q-masses
/// are carried as y·Q (y = e^ε at the cell's lower end): y and Q are out of range above
/// ε ≈ 709.78, their product never is (it is at most the P-mass).
struct GridMasses {
    /// Per interval I_i: (P(I_i), N_i = P(I_i) − y_i·Q(I_i), R_i = y_i·Q(I_i)).
    cells: Vec<(f64, f64, f64)>,
    /// P of the losses above the top grid point, and y_n times their Q.
    p_top: f64,
    r_top: f64,
}

fn finite(p: DiscretePld) -> DpResult<DiscretePld> {
    if p.probs.iter().any(|x| !x.is_finite()) || !p.inf_mass.is_finite() {
        return Err(DpError::param(
            "noise_multiplier",
            "privacy loss distribution is not finite at these parameters",
        ));
    }
    Ok(p)
}

/// The pessimistic discretisation: connect the dots (Doroshenko et al. 2022, Algorithm 1).
/// With y_i = e^{ε_i}, its hockey-stick curve δ(y) = E[(1 − y·e^{−L})₊] is the linear
/// interpolation (in y) of the true curve's values at the grid points, which lies above the true
/// (convex) curve: p_i = y_i·(S_{i−1} − S_i), S_i the slope of the chord on (y_i, y_{i+1}),
/// p_n = y_n·S_{n−1}, δ(ε_n) goes to +∞, and the rest of the mass to the bottom atom.
fn connect_the_dots(g: &GridMasses, interval: f64, k0: i64) -> DiscretePld {
    let n = g.cells.len();
    let up = 1.0 / interval.exp_m1(); // y_i / (y_{i+1} − y_i)
    let down = 1.0 / -(-interval).exp_m1(); // y_i / (y_i − y_{i−1})
    let c = &g.cells;
    // y_i·Q(I_i) is the cell's R_i (y_i alone is never formed: it overflows above ε ≈ 709.78).
    let mut raw: Vec<f64> = (0..n + 1)
        .into_par_iter()
        .with_min_len(2048)
        .map(|i| {
            if i == 0 {
                0.0
            } else if i < n {
                c[i].2 + c[i - 1].1 * down - c[i].1 * up
            } else {
                g.r_top + c[n - 1].1 * down
            }
        })
        .collect();
    let inf_mass = (g.p_top - g.r_top).max(0.0);
    raw[0] = 1.0 - (raw[1..].iter().map(|p| p.max(0.0)).sum::<f64>() + inf_mass);
    let excess: f64 = raw.iter().filter(|p| **p < 0.0).map(|p| -p).sum();
    DiscretePld {
        interval,
        offset: k0,
        probs: raw.into_iter().map(|p| p.max(0.0)).collect(),
        inf_mass,
        excess,
    }
}

/// The former optimistic discretisation, kept as the fallback of [`tight_lower`]: every loss
/// rounded down to the grid (a coupling with L' ≤ L, so every composed δ(ε) is at most the true
/// one); the mass below ε_0 is dropped. Loose by up to Δ per step in the loss.
fn round_down(g: &GridMasses, interval: f64, k0: i64) -> DiscretePld {
    let mut probs: Vec<f64> = g.cells.iter().map(|c| c.0).collect();
    probs.push(g.p_top);
    DiscretePld {
        interval,
        offset: k0,
        probs,
        inf_mass: 0.0,
        excess: 0.0,
    }
}

/// The optimistic discretisation: a PLD on the grid whose curve D(y) = Σ_i p_i·(1 − y/y_i)₊ lies
/// below the true curve δ(y) = E[(1 − y·e^{−L})₊] at every y > 0 (every ε, negative ones too),
/// as tight as the grid allows: the counterpart of connect the dots (Doroshenko et al. 2022,
/// §3–4), which lies above it by the same second-order amount. None where the construction
/// does not apply (the caller then rounds losses down).
///
/// Why composing such curves gives a lower bound: the composition's curve is
/// δ(y) = E_S[D_1(y·e^{−S})], S the sum of the other steps' losses, so lowering D_1 pointwise
/// lowers δ whatever the other steps are; step by step, the composition of lower curves is
/// below the true composition (no validity of the lower PLD as a pair of distributions is needed:
/// only its nonnegative masses).
///
/// Construction. δ is convex in y, with δ(y_i) = δ_i and slope −c_i at y_i, c_i = Q(L > ε_i).
/// On [y_i, y_{i+1}] (width h_i) its chord exceeds it by at most
/// g_i = N_i·(1 − N_i/(h_i·Q(I_i))) (the chord minus the larger of the two end tangents, at
/// their crossing; N_i = P(I_i) − y_i·Q(I_i), so that the chord's slope is −(c_{i+1} + N_i/h_i)).
/// Lowering the grid values to D_i = δ_i − max(g_{i−1}, g_i) puts each interpolated segment
/// under the chord lowered by g_i, hence under δ. Left of y_0 the curve continues along the
/// tangent's slope −c_0 (mass below ε_0 is dropped); from the top point y_K on, D = 0, with K
/// the highest point where that stays below δ. Where the lowered points are not convex (a
/// negative atom), the vertex is removed (its neighbours' chord is lower: the lower convex hull)
/// or, at y_0, lowered. The atoms are computed as Q-masses m_i = p_i/y_i from the cell masses,
/// never from differences of δ: m_i = Q(I_i) + t_{i−1} − t_i with t_i = (N_i − G_i + G_{i+1})/h_i.
///
/// Every Q-quantity is carried multiplied by its point's y (as the cells carry R_i = y_i·Q(I_i)):
/// y_i·m_i = p_i, y_i·t_i = (N_i − G_i + G_{i+1})/(e^Δ − 1), y_i·c_i by the recurrence
/// y_i·c_i = R_i + e^{−Δ}·y_{i+1}·c_{i+1}, and ratios of y's as exponentials of index
/// differences: y alone overflows above ε ≈ 709.78, these products do not.
fn tight_lower(g: &GridMasses, interval: f64, k0: i64) -> Option<DiscretePld> {
    let n = g.cells.len();
    if n < 2 {
        return None;
    }
    let c = &g.cells;
    let em1 = interval.exp_m1(); // h_i = y_i·(e^Δ − 1)
    let fall = -(-interval).exp_m1(); // 1 − e^{−Δ} = h_i/y_{i+1}
    let (rise, decay) = (interval.exp(), (-interval).exp()); // y_{i+1}/y_i and its inverse
    // y_a/y_b = e^{(a − b)Δ} for grid indices.
    let ratio = |a: usize, b: usize| ((a as f64 - b as f64) * interval).exp();
    // Rounding in N_i (a difference where y_i is near 1 − q) is about u/Δ relative: the gaps
    // are widened by far more than that.
    let widen = 1.0 + 64.0 * f64::EPSILON / interval.min(1.0);
    let gap: Vec<f64> = (0..n)
        .map(|i| {
            let (_, nn, rr) = c[i];
            let hq = em1 * rr; // h_i·Q(I_i)
            let v = if hq > 0.0 {
                nn * (1.0 - nn / hq).max(0.0)
            } else {
                nn
            };
            v.min(nn) * widen
        })
        .collect();
    // y_i times the Q-mass above each grid point, and δ at each grid point, summed from the top
    // (all terms nonnegative): δ_i = δ_{i+1} + N_i + h_i·c_{i+1}, h_i·c_{i+1} = (1 − e^{−Δ})·y_{i+1}·c_{i+1}.
    let mut cy = vec![0.0f64; n + 1];
    let mut dl = vec![0.0f64; n + 1];
    cy[n] = g.r_top;
    dl[n] = (g.p_top - g.r_top).max(0.0);
    for i in (0..n).rev() {
        cy[i] = c[i].2 + decay * cy[i + 1];
        dl[i] = dl[i + 1] + c[i].1 + fall * cy[i + 1];
    }
    let lowered = |i: usize| -> f64 {
        let left = if i > 0 { gap[i - 1] } else { 0.0 };
        let right = if i < n { gap[i] } else { 0.0 };
        left.max(right)
    };
    // K: the first point where the lowered value would be negative, or one below it.
    let mut kk = n;
    for i in 1..=n {
        if dl[i] < lowered(i) {
            kk = if dl[i] >= gap[i - 1] { i } else { i - 1 };
            break;
        }
    }
    if kk < 1 {
        return None;
    }
    // G_i: the lowering at each point; at K the whole of δ_K (D_K = 0).
    let lower_at = |i: usize| -> f64 {
        if i == kk {
            dl[kk]
        } else {
            lowered(i)
        }
    };
    // y_i·t_i.
    let t: Vec<f64> = (0..kk)
        .map(|i| (c[i].1 - lower_at(i) + lower_at(i + 1)) / em1)
        .collect();
    // m[i] holds y_i·m_i, the atom p_i (y_i·t_{i−1} = e^Δ·y_{i−1}·t_{i−1}).
    let mut m = vec![0.0f64; kk + 1];
    m[0] = c[0].2 - t[0];
    for i in 1..kk {
        m[i] = c[i].2 + rise * t[i - 1] - t[i];
    }
    m[kk] = cy[kk] + rise * t[kk - 1];
    // Lower convex hull: remove concave vertices (negative atoms), lower y_0 if its atom is
    // negative. Each operation only lowers the curve.
    let mut st: Vec<usize> = Vec::with_capacity(kk + 1);
    for i in 0..=kk {
        st.push(i);
        while st.len() >= 2 {
            let l = st.len();
            let v = st[l - 2];
            if m[v] >= 0.0 {
                break;
            }
            let w = st[l - 1];
            let mv = m[v];
            m[v] = 0.0;
            if l == 2 {
                // y_0: lowering D_0 moves its Q-mass deficit onto the next vertex.
                m[w] += ratio(w, v) * mv;
                break;
            }
            // Q-masses: m_u += m_v·(y_w − y_v)/(y_w − y_u), m_w += m_v·(y_v − y_u)/(y_w − y_u);
            // times y_u and y_w, with every y ratio at most 1.
            let u = st[l - 3];
            let span = (-((w - u) as f64) * interval).exp_m1();
            m[u] += mv * ratio(u, v) * ((-((w - v) as f64) * interval).exp_m1() / span);
            m[w] += mv * ((-((v - u) as f64) * interval).exp_m1() / span);
            st.remove(l - 2);
        }
    }
    if !(m[kk] >= 0.0) {
        return None;
    }
    let mut probs = vec![0.0f64; kk + 1];
    for &i in &st {
        probs[i] = m[i].max(0.0);
    }
    Some(DiscretePld {
        interval,
        offset: k0,
        probs,
        inf_mass: 0.0,
        excess: 0.0,
    })
}

/// A PLD whose curve lies at or above both `a`'s and `b`'s at every ε: the linear interpolation
/// (in y = e^ε) of the larger of their curves at the grid points. Both are on one grid with total
/// mass 1 (as connect the dots makes them), so that below y_0 both curves are lines from (0, 1)
/// and the larger is the one larger at y_0; above the grid both are constant (their +∞ atoms).
/// The max of two convex curves is convex, hence so is its interpolation: the atoms
/// p_i = y_i·(S_{i−1} − S_i) (S: negated slopes) are nonnegative. Where both ends of a grid
/// interval take the same curve, S is that curve's Q-mass above the interval (a suffix sum,
/// exact), so its atoms come out unchanged; only intervals where the larger curve changes take a
/// difference of curve values. An atom that rounding made negative is dropped (that raises the
/// curve).
pub fn envelope(a: &DiscretePld, b: &DiscretePld) -> DiscretePld {
    // Slopes (Q-masses) are carried times their point's y, as in `tight_lower`: y_i alone
    // overflows above ε ≈ 709.78. Where the same curve is taken on both sides of a point its
    // atom is copied (y_i·(S_{i−1} − S_i) = p_i exactly).
    let n = a.probs.len().min(b.probs.len()) - 1;
    let (interval, k0) = (a.interval, a.offset);
    let em1 = interval.exp_m1();
    let fall = -(-interval).exp_m1(); // 1 − e^{−Δ}
    let (rise, decay) = (interval.exp(), (-interval).exp()); // y_{i+1}/y_i and its inverse
    // Per PLD: qs[i] = y_i·Σ_{j>i} p_j/y_j = e^{−Δ}·(qs[i+1] + p_{i+1}), and the curve d[i] at
    // y_i, from the top (all terms ≥ 0): d_i = d_{i+1} + (1 − e^{−Δ})·(qs_{i+1} + p_{i+1}).
    let curve = |p: &DiscretePld| -> (Vec<f64>, Vec<f64>) {
        let mut qs = vec![0.0f64; n + 1];
        let mut d = vec![0.0f64; n + 1];
        d[n] = p.inf_mass;
        for i in (0..n).rev() {
            qs[i] = decay * (qs[i + 1] + p.probs[i + 1]);
            d[i] = d[i + 1] + fall * (qs[i + 1] + p.probs[i + 1]);
        }
        (qs, d)
    };
    let (qa, da) = curve(a);
    let (qb, db) = curve(b);
    let pick_a: Vec<bool> = (0..=n).map(|i| da[i] >= db[i]).collect();
    let value = |i: usize| if pick_a[i] { da[i] } else { db[i] };
    // y_i times the negated slope on (y_i, y_{i+1}).
    let slope = |i: usize| -> f64 {
        match (pick_a[i], pick_a[i + 1]) {
            (true, true) => qa[i],
            (false, false) => qb[i],
            _ => ((value(i) - value(i + 1)) / em1).max(0.0),
        }
    };
    // The atom at i where both neighbouring intervals (those that exist) take one curve.
    let kept = |i: usize| -> Option<f64> {
        let same = (i == 0 || pick_a[i - 1] == pick_a[i]) && (i == n || pick_a[i + 1] == pick_a[i]);
        same.then(|| if pick_a[i] { a.probs[i] } else { b.probs[i] })
    };
    let left = if pick_a[0] {
        qa[0] + a.probs[0]
    } else {
        qb[0] + b.probs[0]
    };
    let mut probs = vec![0.0f64; n + 1];
    if n == 0 {
        probs[0] = 1.0 - a.inf_mass.max(b.inf_mass);
    } else {
        probs[0] = kept(0).unwrap_or_else(|| left - slope(0));
        for (i, p) in probs.iter_mut().enumerate().take(n).skip(1) {
            *p = kept(i).unwrap_or_else(|| rise * slope(i - 1) - slope(i));
        }
        probs[n] = kept(n).unwrap_or_else(|| rise * slope(n - 1));
    }
    DiscretePld {
        interval,
        offset: k0,
        probs: probs.into_iter().map(|p| p.max(0.0)).collect(),
        inf_mass: a.inf_mass.max(b.inf_mass),
        excess: 0.0,
    }
}
