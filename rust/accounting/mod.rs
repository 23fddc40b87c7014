//! Privacy accounting: Rényi DP of (sub)sampled Gaussian steps, its composition, conversion to
//! (ε, δ) and calibration of the mechanism to a target ε. Concern (c) of McMahan et al. 2018.
//!
//! * [`rdp_poisson`]: Poisson subsampling, add-or-remove-one adjacency (Mironov, Talwar, Zhang
//!   2019): exact binomial sums at integer orders, quadrature at real orders.
//! * [`rdp_wor`]: fixed-size sampling without replacement, replace-one adjacency (Wang, Balle,
//!   Kasiviswanathan 2019).
//! * [`conversion`]: RDP → (ε, δ) (Canonne, Kamath, Steinke 2020, Prop. 12), minimised over the
//!   grid of orders and continuously.
//! * [`pld`]: privacy loss distributions: tight ε with certified upper and lower bounds.
//! * [`calibration`]: noise multiplier, sampling probability or steps for a target ε.
//!
//! Every value returned is rounded so that the ε it leads to is an upper bound.

pub mod calibration;
pub mod conversion;
pub mod pld;
pub mod quad;
pub mod rdp_poisson;
pub mod rdp_wor;

use crate::error::{require, DpError, DpResult};
use rayon::prelude::*;
use rdp_poisson::{round_up, SubsampledGaussian};
use rdp_wor::WithoutReplacementGaussian;

/// One kind of step of a composition.
#[derive(Clone, Debug)]
pub enum Step {
    /// Poisson-subsampled Gaussian (q = 1: the plain Gaussian mechanism).
    Poisson(SubsampledGaussian),
    /// Gaussian on a fixed-size sample drawn without replacement.
    WithoutReplacement(WithoutReplacementGaussian),
}

impl Step {
    pub fn rdp(&self, alpha: f64) -> f64 {
        match self {
            Step::Poisson(s) => s.rdp(alpha),
            Step::WithoutReplacement(s) => s.rdp(alpha),
        }
    }
}

/// A composition of steps, each kind with its multiplicity. RDP adds up under composition
/// (Mironov 2017, Proposition 1).
#[derive(Clone, Debug, Default)]
pub struct Composition {
    pub steps: Vec<(Step, f64)>,
    /// A non-private event was composed: no finite guarantee at any order.
    pub non_private: bool,
}

fn check_count(c: f64) -> DpResult<()> {
    require(c >= 0.0 && c.is_finite(), "count", "a finite count >= 0", c)
}

/// An ε to convert at (RDP or privacy loss distributions): ≥ 0, +∞ allowed.
pub(crate) fn check_epsilon(eps: f64) -> DpResult<()> {
    require(eps >= 0.0, "epsilon", ">= 0", eps)
}

impl Composition {
    /// `poisson`: (q, z, count); `wor`: (sample/source ratio, z, count). `max_order` sizes the
    /// tables of the without-replacement bound.
    pub fn new(
        poisson: &[(f64, f64, f64)],
        wor: &[(f64, f64, f64)],
        non_private: bool,
        max_order: f64,
    ) -> DpResult<Self> {
        let mut steps = Vec::with_capacity(poisson.len() + wor.len());
        for &(q, z, c) in poisson {
            check_count(c)?;
            steps.push((Step::Poisson(SubsampledGaussian::new(q, z)?), c));
        }
        for &(_, z, c) in wor {
            check_count(c)?;
            rdp_poisson::check_z(z, "noise_multiplier")?;
        }
        let built: Vec<DpResult<(Step, f64)>> = wor
            .par_iter()
            .map(|&(g, z, c)| {
                Ok((
                    Step::WithoutReplacement(WithoutReplacementGaussian::new(g, z, max_order)?),
                    c,
                ))
            })
            .collect();
        for b in built {
            steps.push(b?);
        }
        Ok(Composition { steps, non_private })
    }

    /// Total RDP at one order, rounded up.
    pub fn rdp(&self, alpha: f64) -> f64 {
        if self.non_private {
            return f64::INFINITY;
        }
        let term = |(s, c): &(Step, f64)| if *c == 0.0 { 0.0 } else { c * s.rdp(alpha) };
        let sum: f64 = if self.steps.len() >= 16 {
            self.steps.par_iter().map(term).sum()
        } else {
            self.steps.iter().map(term).sum()
        };
        round_up(sum, (self.steps.len() as f64 + 2.0) * f64::EPSILON)
    }

    /// Total RDP at each order (in parallel over orders).
    pub fn rdp_grid(&self, orders: &[f64]) -> Vec<f64> {
        orders.par_iter().map(|&a| self.rdp(a)).collect()
    }
}

pub fn check_orders(orders: &[f64]) -> DpResult<()> {
    if orders.is_empty() {
        return Err(DpError::param("orders", "need at least one order"));
    }
    for &a in orders {
        rdp_poisson::check_order(a)?;
    }
    Ok(())
}

/// The default orders: dp_accounting's default grid, so that results can be compared as-is.
pub fn default_orders() -> Vec<f64> {
    let mut v: Vec<f64> = (1..100).map(|x| 1.0 + x as f64 / 10.0).collect();
    v.extend((11..64).map(|a| a as f64));
    v.extend([128.0, 256.0, 512.0, 1024.0]);
    v
}
