//! The privacy loss of the Poisson-subsampled Gaussian mechanism, and its discretisation onto a
//! grid of loss values: pessimistic by "connect the dots" (Doroshenko, Ghazi, Kamath, Kumar,
//! Manurangsi 2022, arXiv:2207.04380, Algorithm 1 / §3), optimistic by rounding losses down.
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
    /// Losses rounded down, mass below the grid dropped: every ε it gives is a lower bound.
    Optimistic,
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
            if r <= -1.0 {
                return f64::NEG_INFINITY;
            }
            r.ln_1p()
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
        // (P(I_i), Q(I_i)) and the two component masses.
        let pq = |d0: f64, d1: f64| -> (f64, f64) {
            let mix = (1.0 - q) * d0 + q * d1;
            match self.direction {
                Direction::Remove => (mix, d0),
                Direction::Add => (d0, mix),
            }
        };
        let comp = |i: usize| -> (f64, f64) {
            let (a, b) = ends(i);
            (
                Tail::between(&pts[a].1, &pts[b].1),
                Tail::between(&pts[a].2, &pts[b].2),
            )
        };
        // Masses of the two components beyond the top grid point (losses above ε_n).
        let (t0, t1) = match self.direction {
            Direction::Remove => (pts[n].1.above(), pts[n].2.above()),
            Direction::Add => (pts[n].1.below(), pts[n].2.below()),
        };
        let (p_top, q_top) = pq(t0, t1);
        let y = |i: usize| ((k0 + i as i64) as f64 * interval).exp();
        // N_i = P(I_i) − y_i·Q(I_i) ≥ 0 and Q(I_i), from the components directly: never as
        // differences of δ, which would lose the masses to cancellation.
        let nq: Vec<(f64, f64)> = (0..n)
            .into_par_iter()
            .with_min_len(2048)
            .map(|i| {
                let (d0, d1) = comp(i);
                let yi = y(i);
                let nn = match self.direction {
                    Direction::Remove => (1.0 - q - yi) * d0 + q * d1,
                    Direction::Add => (1.0 - yi * (1.0 - q)) * d0 - yi * q * d1,
                };
                (nn.max(0.0), pq(d0, d1).1)
            })
            .collect();
        let up = 1.0 / interval.exp_m1(); // y_i / (y_{i+1} − y_i)
        let down = 1.0 / -(-interval).exp_m1(); // y_i / (y_i − y_{i−1})
                                                // Connect the dots: p_i = y_i·(S_{i−1} − S_i), S_i the slope of the true curve's chord
                                                // on (y_i, y_{i+1}); p_n = y_n·S_{n−1}; δ(ε_n) goes to +∞.
        let ctd = |i: usize| -> f64 {
            if i < n {
                y(i) * nq[i].1 + nq[i - 1].0 * down - nq[i].0 * up
            } else {
                y(n) * q_top + nq[n - 1].0 * down
            }
        };
        let delta_top = (p_top - y(n) * q_top).max(0.0);
        let mut raw: Vec<f64> = (0..n + 1)
            .into_par_iter()
            .with_min_len(2048)
            .map(|i| if i == 0 { 0.0 } else { ctd(i) })
            .collect();
        let inf_mass;
        match bound {
            Bound::Pessimistic => {
                inf_mass = delta_top;
                raw[0] = 1.0 - (raw[1..].iter().map(|p| p.max(0.0)).sum::<f64>() + inf_mass);
            }
            Bound::Optimistic => {
                // Losses rounded down to the grid (a coupling with L' ≤ L, so every composed
                // δ(ε) is at most the true one); the mass below ε_0 is dropped.
                for i in 0..n {
                    let (d0, d1) = comp(i);
                    raw[i] = pq(d0, d1).0;
                }
                raw[n] = p_top;
                inf_mass = 0.0;
            }
        }
        let excess: f64 = raw.iter().filter(|p| **p < 0.0).map(|p| -p).sum();
        let probs: Vec<f64> = raw.into_iter().map(|p| p.max(0.0)).collect();
        if probs.iter().any(|p| !p.is_finite()) {
            return Err(DpError::param(
                "noise_multiplier",
                "privacy loss distribution is not finite at these parameters",
            ));
        }
        Ok(DiscretePld {
            interval,
            offset: k0,
            probs,
            inf_mass,
            excess,
        })
    }
}
