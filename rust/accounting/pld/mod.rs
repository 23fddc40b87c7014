//! Privacy loss distributions (PLD): tight (ε, δ) accounting of Poisson-subsampled Gaussian
//! steps, certified from above, with a lower bound beside it.
//!
//! * [`loss`]: the privacy loss of the subsampled Gaussian in both directions of the
//!   add-or-remove relation (Zhu, Dong, Wang 2022, Proposition 30), discretised pessimistically
//!   by "connect the dots" (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022, Algorithm 1) and
//!   optimistically by rounding down.
//! * [`compose`]: composition by FFT (Koskela, Jälkö, Honkela 2020), T identical steps as a
//!   T-th power of the transform, the window chosen by Chernoff bounds, wrapped mass accounted.
//! * [`curve`]: δ(ε) and ε(δ) from the hockey-stick divergence (Sommer, Meiser, Mohammadi
//!   2019, Theorem 1); the analytic Gaussian mechanism (Balle & Wang 2018, Theorem 8).
//!
//! Without subsampling (every group at q = 1) the composition is itself a Gaussian mechanism
//! with σ = (Σ_g c_g/σ_g²)^{−1/2} and ε is computed from the analytic formula, exactly.
//!
//! What makes the upper bound an upper bound: the connect-the-dots PLD dominates the true one
//! (its δ(ε) is at least the true δ(ε) at every ε, Doroshenko et al. Theorem 3.3) and
//! domination survives composition; mass beyond the grid goes to the +∞ atom; the FFT window's
//! lost tail (Chernoff bound) goes to +∞; atoms the FFT rounded below zero are set to zero.
//! Not covered: floating-point rounding inside the transform. Measured (tests: the same
//! composition placed one position further along the buffer), it is about 1e-19 per atom for
//! one step and grows to 1e-15..3e-15 per atom at T = 10⁵..10⁶; it matters only where δ is
//! below ~1e-10 with T ≥ 10⁴. A worst-case model of it (u·‖f‖₂·T per atom, `noise_floor`) is
//! computed but not added: it is 10×–600× above the measured rounding and would make ε at
//! δ = 1e-12 meaningless. dp_accounting and the PRV accountant do not bound it either.
//!
//! The lower bound rounds every loss down to the grid (a coupling with L' ≤ L, so the
//! composed δ(ε) is below the true one). It is loose by up to T·Δ in the loss: it brackets the
//! answer, and the upper bound is the one reported as ε.
//!
//! Grid size: with `interval: None` the loss grid step Δ is 1e-4 (dp_accounting's default),
//! refined for small compositions so that the window holds at least 2^12 atoms, and once more
//! when ε < 1000·Δ (the smaller of the two certified values is kept), and coarsened
//! where the window would exceed `max_bins` atoms (default 2^21, 16 MiB per array): at the
//! cap the ε stays a certified upper bound, only less tight (coarser Δ). Nothing hangs and
//! memory stays below a few hundred MiB for any input.

pub mod compose;
pub mod curve;
pub mod loss;
pub mod normal;

use super::rdp_poisson;
use crate::error::{require, DpError, DpResult};
use compose::{compose, Composed, Part};
use loss::{Bound, Direction, SubsampledGaussianLoss};

/// A discrete PLD: atom k sits at loss (offset + k)·interval; `inf_mass` sits at +∞.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscretePld {
    pub interval: f64,
    pub offset: i64,
    pub probs: Vec<f64>,
    pub inf_mass: f64,
    /// Mass added by clamping negative atoms to zero (extra mass: harmless for an upper bound,
    /// subtracted from δ for a lower bound).
    pub excess: f64,
}

/// `count` Poisson-subsampled Gaussian steps with sampling probability q and noise multiplier
/// σ (q = 1: the Gaussian mechanism).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Group {
    pub q: f64,
    pub sigma: f64,
    pub count: f64,
}

#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// The loss grid step Δ; None chooses it (see the module docs).
    pub interval: Option<f64>,
    /// Cap on the composed window, in atoms.
    pub max_bins: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            interval: None,
            max_bins: 1 << 21,
        }
    }
}

pub const DEFAULT_INTERVAL: f64 = 1e-4;
const TARGET_BINS: f64 = 4096.0;
const MIN_INTERVAL: f64 = 1e-9;
/// An automatic grid is refined when ε < REFINE·Δ.
const REFINE: f64 = 1000.0;

/// A lower and an upper bound, and the grid step used.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    pub lower: f64,
    pub upper: f64,
    pub interval: f64,
}

impl Bounds {
    /// Both bounds at `v`: a value known exactly (nothing released, or no privacy).
    fn exact(v: f64, interval: f64) -> Self {
        Bounds {
            lower: v,
            upper: v,
            interval,
        }
    }
}

fn check_groups(groups: &[Group]) -> DpResult<()> {
    for g in groups {
        rdp_poisson::check_q(g.q, "sampling_probability")?;
        rdp_poisson::check_z(g.sigma, "noise_multiplier")?;
        let c = g.count;
        require(c >= 0.0 && c.is_finite() && c.fract() == 0.0, "count", "a whole number >= 0", c)?;
    }
    Ok(())
}

/// What is left to account after trivial groups are resolved.
enum Plan {
    /// Nothing released about any record: ε = 0, δ = 0.
    Nothing,
    /// A step without noise on a non-empty sample: no finite guarantee.
    NonPrivate,
    /// Only unsampled Gaussian steps: one Gaussian with this σ.
    Gaussian(f64),
    /// Subsampled steps (and at most one merged Gaussian part at q = 1).
    Mixed(Vec<Group>),
}

fn plan(groups: &[Group]) -> DpResult<Plan> {
    check_groups(groups)?;
    let live: Vec<Group> = groups
        .iter()
        .copied()
        .filter(|g| g.count > 0.0 && g.q > 0.0 && g.sigma != f64::INFINITY)
        .collect();
    if live.iter().any(|g| g.sigma == 0.0) {
        return Ok(Plan::NonPrivate);
    }
    // Unsampled Gaussians compose into one: 1/σ² adds up. Rounded down (more noise would
    // understate ε): a few ulps below the computed value.
    let inv: f64 = live
        .iter()
        .filter(|g| g.q == 1.0)
        .map(|g| g.count / (g.sigma * g.sigma))
        .sum();
    let mut sub: Vec<Group> = live.iter().copied().filter(|g| g.q < 1.0).collect();
    if inv > 0.0 {
        let mut s = 1.0 / inv.sqrt();
        for _ in 0..4 {
            s = s.next_down();
        }
        if sub.is_empty() {
            return Ok(Plan::Gaussian(s));
        }
        sub.push(Group {
            q: 1.0,
            sigma: s,
            count: 1.0,
        });
    }
    if sub.is_empty() {
        return Ok(Plan::Nothing);
    }
    Ok(Plan::Mixed(sub))
}

/// Builds the per-step PLDs of one direction on grid Δ and composes them.
fn composed(
    groups: &[Group],
    dir: Direction,
    interval: f64,
    tail: f64,
    bound: Bound,
    max_bins: usize,
) -> DpResult<Composed> {
    let total: f64 = groups.iter().map(|g| g.count).sum();
    let per_step = (tail / total).max(1e-300);
    let mut steps = Vec::with_capacity(groups.len());
    for g in groups {
        let d = if g.q == 1.0 { Direction::Remove } else { dir };
        let l = SubsampledGaussianLoss::new(g.q, g.sigma, d);
        let (k0, k1) = l.grid(interval, per_step, per_step.min(1e-20));
        if (k1 - k0) as f64 > 4.0 * max_bins as f64 {
            return Err(DpError::GridTooLarge {
                bins: (k1 - k0) as f64,
            });
        }
        steps.push(l.discretize(interval, k0, k1, bound)?);
    }
    let parts: Vec<Part<'_>> = steps
        .iter()
        .zip(groups)
        .map(|(p, g)| Part {
            pld: p,
            count: g.count,
        })
        .collect();
    compose(&parts, tail, tail, max_bins, bound == Bound::Pessimistic)
}

/// The loss window of the composition (in loss units), estimated on a coarse grid.
fn window_width(groups: &[Group], dirs: &[Direction], tail: f64) -> DpResult<f64> {
    let mut w = 0.0f64;
    for &dir in dirs {
        let mut coarse = 1e-2;
        loop {
            match composed(groups, dir, coarse, tail, Bound::Pessimistic, 1 << 16) {
                Ok(c) => {
                    w = w.max(c.pld.probs.len() as f64 * coarse);
                    break;
                }
                Err(DpError::GridTooLarge { .. }) if coarse < 1e6 => coarse *= 4.0,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(w)
}

fn directions(groups: &[Group]) -> Vec<Direction> {
    if groups.iter().any(|g| g.q < 1.0) {
        vec![Direction::Remove, Direction::Add]
    } else {
        vec![Direction::Remove]
    }
}

/// The grid step for these groups (see the module docs).
fn choose_interval(groups: &[Group], opts: &Options, tail: f64) -> DpResult<f64> {
    if let Some(d) = opts.interval {
        require(d > 0.0 && d.is_finite(), "value_discretization_interval", "> 0", d)?;
        return Ok(d);
    }
    let w = window_width(groups, &directions(groups), tail)?;
    let mut d = DEFAULT_INTERVAL.min(w / TARGET_BINS).max(MIN_INTERVAL);
    if w / d > 0.9 * opts.max_bins as f64 {
        d = w / (0.9 * opts.max_bins as f64);
    }
    Ok(d)
}

/// Runs `f` on the composed PLDs of both directions, coarsening an automatic grid until the
/// window fits `max_bins`.
fn with_composed<T>(
    groups: &[Group],
    opts: &Options,
    tail: f64,
    bound: Bound,
    f: impl Fn(&[Composed]) -> T,
) -> DpResult<(T, f64)> {
    let mut d = choose_interval(groups, opts, tail)?;
    loop {
        let mut out = Vec::new();
        let mut too_large = false;
        for dir in directions(groups) {
            match composed(groups, dir, d, tail, bound, opts.max_bins) {
                Ok(c) => out.push(c),
                Err(DpError::GridTooLarge { .. }) if opts.interval.is_none() => {
                    too_large = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if !too_large {
            return Ok((f(&out), d));
        }
        d *= 2.0;
    }
}

fn check_delta(delta: f64) -> DpResult<()> {
    require(delta > 0.0 && delta < 1.0, "delta", "in (0, 1)", delta)
}

/// Bounds on the smallest ε with the composition (ε, δ)-DP under add-or-remove (the worse of
/// the two directions). `lower = false` skips the lower bound (reported as 0).
pub fn epsilon_bounds(
    groups: &[Group],
    delta: f64,
    opts: &Options,
    lower: bool,
) -> DpResult<Bounds> {
    check_delta(delta)?;
    let interval = opts.interval.unwrap_or(DEFAULT_INTERVAL);
    match plan(groups)? {
        Plan::Nothing => Ok(Bounds::exact(0.0, interval)),
        Plan::NonPrivate => Ok(Bounds::exact(f64::INFINITY, interval)),
        Plan::Gaussian(s) => {
            let e = curve::gaussian_epsilon(s, delta);
            Ok(Bounds::exact(e, interval))
        }
        Plan::Mixed(g) => {
            // Tails cut from the grids and windows add at most 2·1e-4·δ to δ.
            let tail = 1e-4 * delta;
            let (upper, d) = with_composed(&g, opts, tail, Bound::Pessimistic, |cs| {
                cs.iter()
                    .map(|c| curve::epsilon(&c.pld, delta, 0.0))
                    .fold(0.0f64, f64::max)
            })?;
            // A grid step that is large next to ε itself blurs it: refine once, keep the smaller
            // of the two certified values.
            let (mut upper, mut d) = (upper, d);
            if opts.interval.is_none()
                && upper.is_finite()
                && upper < REFINE * d
                && d > MIN_INTERVAL
            {
                let d2 = (upper / REFINE).max(MIN_INTERVAL);
                let o = Options {
                    interval: Some(d2),
                    ..*opts
                };
                if let Ok((u2, _)) = with_composed(&g, &o, tail, Bound::Pessimistic, |cs| {
                    cs.iter()
                        .map(|c| curve::epsilon(&c.pld, delta, 0.0))
                        .fold(0.0f64, f64::max)
                }) {
                    if u2 < upper {
                        upper = u2;
                        d = d2;
                    }
                }
            }
            let lower = if lower {
                let o = Options {
                    interval: Some(d),
                    ..*opts
                };
                with_composed(&g, &o, tail, Bound::Optimistic, |cs| {
                    cs.iter()
                        .map(|c| {
                            let e = curve::epsilon(&c.pld, delta + c.wrapped_in, -c.noise_floor);
                            (e - 16.0 * f64::EPSILON * (1.0 + e.abs())).max(0.0)
                        })
                        .fold(0.0f64, f64::max)
                })?
                .0
                .min(upper)
            } else {
                0.0
            };
            Ok(Bounds {
                lower,
                upper,
                interval: d,
            })
        }
    }
}

/// Bounds on the smallest δ with the composition (ε, δ)-DP under add-or-remove.
pub fn delta_bounds(
    groups: &[Group],
    epsilon: f64,
    opts: &Options,
    lower: bool,
) -> DpResult<Bounds> {
    super::check_epsilon(epsilon)?;
    let interval = opts.interval.unwrap_or(DEFAULT_INTERVAL);
    match plan(groups)? {
        Plan::Nothing => Ok(Bounds::exact(0.0, interval)),
        Plan::NonPrivate => Ok(Bounds::exact(1.0, interval)),
        Plan::Gaussian(s) => {
            let d = curve::gaussian_delta(s, epsilon);
            Ok(Bounds {
                lower: d * (1.0 - 1e-9),
                upper: (d * (1.0 + 1e-9)).min(1.0),
                interval,
            })
        }
        Plan::Mixed(g) => {
            let run = |tail: f64, bound: Bound, o: &Options| {
                with_composed(&g, o, tail, bound, |cs| {
                    cs.iter()
                        .map(|c| match bound {
                            Bound::Pessimistic => curve::delta(&c.pld, epsilon, 0.0),
                            Bound::Optimistic => (curve::delta(&c.pld, epsilon, -c.noise_floor)
                                - c.wrapped_in)
                                .max(0.0),
                        })
                        .fold(0.0f64, f64::max)
                })
            };
            // The tail budget must be small next to the answer: a second pass when it is not.
            let (mut up, mut d) = run(1e-10, Bound::Pessimistic, opts)?;
            if up < 1e-6 {
                (up, d) = run((up * 1e-4).max(1e-300), Bound::Pessimistic, opts)?;
            }
            if opts.interval.is_none() && epsilon < REFINE * d && d > MIN_INTERVAL {
                let o = Options {
                    interval: Some((epsilon / REFINE).max(MIN_INTERVAL)),
                    ..*opts
                };
                if let Ok((u2, d2)) = run((up * 1e-4).max(1e-300), Bound::Pessimistic, &o) {
                    if u2 < up {
                        (up, d) = (u2, d2);
                    }
                }
            }
            let lo = if lower {
                let o = Options {
                    interval: Some(d),
                    ..*opts
                };
                run((up * 1e-4).max(1e-300), Bound::Optimistic, &o)?
                    .0
                    .min(up)
            } else {
                0.0
            };
            Ok(Bounds {
                lower: lo,
                upper: up.min(1.0),
                interval: d,
            })
        }
    }
}

#[cfg(test)]
mod tests;
