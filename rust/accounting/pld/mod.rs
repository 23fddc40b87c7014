//! Privacy loss distributions (PLD): tight (ε, δ) accounting of Poisson-subsampled and
//! truncated-Poisson-subsampled Gaussian steps, certified from above, with a lower bound beside it.
//!
//! * [`loss`]: the privacy loss of the subsampled Gaussian in both directions of the
//!   add-or-remove relation (Zhu, Dong, Wang 2022, Proposition 30), discretised pessimistically
//!   by "connect the dots" (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022, Algorithm 1) and
//!   optimistically by its mirror image (the lowered lower convex hull, `loss::tight_lower`).
//! * [`truncated`]: truncated Poisson sampling (a Poisson sample capped at B records), dominated
//!   by a mixture of three subsampled Gaussian pairs (after dp_accounting and arXiv:2508.15089;
//!   the reasoning, and where it is tighter, in that module). A step's pessimistic PLD is then the
//!   mixture of the pessimistic PLDs of its pairs on one grid: a mixture of dominating PLDs
//!   dominates the mixture.
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
//! lost tail (Chernoff bound) goes to +∞; and the transform's floating-point rounding is bounded,
//! not estimated (`compose::compose_tilted`: Higham's FFT error bound, 2002 Theorem 24.2, carried
//! through the powers and products) and added to every atom. Untilted, that bound is about
//! u·T·log m of the bulk per atom: as large as δ itself below δ ≈ 1e-9 after 10⁴ steps (before
//! issue 51 it was neither bounded nor added, and ε fell 0.3% below a certified lower bound at
//! δ = 1e-10, T = 44 045). So every composition runs under an exponential tilt e^{t·J} centred on
//! the ε (or δ) sought ([`compose::choose_tilt`]): the same absolute error is then a relative
//! error of the tail δ sums. A step with a narrow bulk and rare large losses (tiny q) has no tilt
//! that serves both; there the composition is split by the number of large losses
//! ([`split_by_jumps`]), each term tilted on its own, and the smaller certified value is kept.
//!
//! The lower bound composes PLDs whose curves lie below the true ones at every ε (`loss`); the
//! composition's curve is monotone in each step's curve, so it stays below the true one. Its gap
//! to the upper bound is of second order in Δ where a step's loss spreads over many grid
//! intervals; where it does not (small q, a loss narrower than a few Δ), no grid PLD can be
//! tighter than rounding down, which loses up to Δ per step, and the lower bound is recomputed on
//! grids 4×, 16× and 64× finer while the gap is above 1% and the grid fits (any grid's lower
//! bound is one; the largest is kept). The upper bound is the one reported as ε.
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
pub mod truncated;

use super::rdp_poisson;
use crate::error::{require, DpError, DpResult};
pub use compose::{Composed, Target};
use compose::{choose_tilt, compose_tilted, Part};
use loss::{Bound, Direction, SubsampledGaussianLoss};
use rayon::prelude::*;

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

/// `count` Gaussian steps (noise multiplier σ) on truncated Poisson samples: each of
/// `population_size` records drawn with probability q, a uniform `max_sample_size` of them kept
/// when more were drawn (see [`truncated`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TruncatedGroup {
    pub q: f64,
    pub sigma: f64,
    pub max_sample_size: u64,
    pub population_size: u64,
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
/// The lower bound is recomputed on finer grids while it is more than this fraction below the
/// upper one (automatic grids only), at most `LOWER_REFINES` times, each 4× finer.
const LOWER_GAP: f64 = 0.01;
const LOWER_REFINES: usize = 3;
/// An automatic grid is refined to this fraction of the dominant step's loss scale (tiny q and
/// large σ: a loss narrower than the default grid step).
const LOSS_STEPS: f64 = 8.0;

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

/// A weighted Poisson-subsampled Gaussian pair (q, σ) in a step's dominating mixture.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Component {
    weight: f64,
    q: f64,
    sigma: f64,
}

/// One kind of step, run `count` times: a mixture of pairs (and, with weight `envelope`, of the
/// upper envelope of the first two pairs' curves) whose privacy curve is at or above the step's at
/// every ε (upper bound), and a Poisson pair (q, σ) whose curve is at or below the mechanism's
/// worst case (lower bound).
#[derive(Clone, Debug, PartialEq)]
struct Kind {
    upper: Vec<Component>,
    envelope: f64,
    lower: (f64, f64),
    count: f64,
}

impl Kind {
    fn poisson(q: f64, sigma: f64, count: f64) -> Self {
        Kind {
            upper: vec![Component {
                weight: 1.0,
                q,
                sigma,
            }],
            envelope: 0.0,
            lower: (q, sigma),
            count,
        }
    }

    /// The truncated-Poisson step (see [`truncated`] for the mixture and why it dominates).
    fn truncated(g: &TruncatedGroup) -> DpResult<Self> {
        let m = truncated::mixture(g.q, g.max_sample_size, g.population_size)?;
        // The weight of uncertain attribution (w_hi − w_lo: which neighbour size, and rounding)
        // sits on the upper envelope of the two pairs' curves (truncated.rs).
        let half = 0.5 * g.sigma; // exact
        Ok(Kind {
            upper: vec![
                Component {
                    weight: m.a,
                    q: g.q,
                    sigma: g.sigma,
                },
                Component {
                    weight: m.b,
                    q: m.q_b,
                    sigma: half,
                },
            ],
            envelope: m.x,
            lower: (m.q_eff, g.sigma),
            count: g.count,
        })
    }

    /// One pair, the same for both bounds.
    fn is_plain(&self) -> bool {
        self.upper.len() == 1
            && self.envelope == 0.0
            && self.upper[0].weight == 1.0
            && (self.upper[0].q, self.upper[0].sigma) == self.lower
    }

    fn subsampled(&self) -> bool {
        self.lower.0 < 1.0 || self.upper.iter().any(|c| c.q < 1.0)
    }
}

fn check_groups(groups: &[Group], truncated: &[TruncatedGroup]) -> DpResult<()> {
    let count = |c: f64| require(c >= 0.0 && c.is_finite() && c.fract() == 0.0, "count", "a whole number >= 0", c);
    for g in groups {
        rdp_poisson::check_q(g.q, "sampling_probability")?;
        rdp_poisson::check_z(g.sigma, "noise_multiplier")?;
        count(g.count)?;
    }
    for g in truncated {
        rdp_poisson::check_q(g.q, "sampling_probability")?;
        rdp_poisson::check_z(g.sigma, "noise_multiplier")?;
        count(g.count)?;
        require(g.max_sample_size >= 1, "max_sample_size", ">= 1", g.max_sample_size)?;
        require(
            g.population_size >= g.max_sample_size,
            "population_size",
            "at least max_sample_size",
            g.population_size,
        )?;
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
    /// Subsampled steps (and at most one merged Gaussian kind at q = 1).
    Mixed(Vec<Kind>),
}

fn plan(groups: &[Group], truncated: &[TruncatedGroup]) -> DpResult<Plan> {
    check_groups(groups, truncated)?;
    let releases = |c: f64, q: f64, s: f64| c > 0.0 && q > 0.0 && s != f64::INFINITY;
    let live: Vec<Group> = groups
        .iter()
        .copied()
        .filter(|g| releases(g.count, g.q, g.sigma))
        .collect();
    let live_t: Vec<TruncatedGroup> = truncated
        .iter()
        .copied()
        .filter(|g| releases(g.count, g.q, g.sigma))
        .collect();
    if live.iter().any(|g| g.sigma == 0.0) || live_t.iter().any(|g| g.sigma == 0.0) {
        return Ok(Plan::NonPrivate);
    }
    // Unsampled Gaussians compose into one: 1/σ² adds up. Rounded down (more noise would
    // understate ε): a few ulps below the computed value.
    let inv: f64 = live
        .iter()
        .filter(|g| g.q == 1.0)
        .map(|g| g.count / (g.sigma * g.sigma))
        .sum();
    let mut kinds: Vec<Kind> = live
        .iter()
        .filter(|g| g.q < 1.0)
        .map(|g| Kind::poisson(g.q, g.sigma, g.count))
        .collect();
    for g in &live_t {
        kinds.push(Kind::truncated(g)?);
    }
    if inv > 0.0 {
        let mut s = 1.0 / inv.sqrt();
        for _ in 0..4 {
            s = s.next_down();
        }
        if kinds.is_empty() {
            return Ok(Plan::Gaussian(s));
        }
        kinds.push(Kind::poisson(1.0, s, 1.0));
    }
    if kinds.is_empty() {
        return Ok(Plan::Nothing);
    }
    // A canonical order: the certified rounding bound (and the rounding) depends on the order
    // of the products, the result must not depend on the order of the groups.
    let key = |k: &Kind| {
        let mut v = vec![k.lower.0, k.lower.1, k.envelope, k.count];
        for c in &k.upper {
            v.extend([c.weight, c.q, c.sigma]);
        }
        v
    };
    kinds.sort_by(|x, y| key(x).partial_cmp(&key(y)).unwrap_or(std::cmp::Ordering::Equal));
    Ok(Plan::Mixed(kinds))
}

/// The PLD of "nothing released": all mass at loss 0.
fn identity(interval: f64) -> DiscretePld {
    DiscretePld {
        interval,
        offset: 0,
        probs: vec![1.0],
        inf_mass: 0.0,
        excess: 0.0,
    }
}

/// One step of `kind` in direction `dir` on grid Δ: its pessimistic PLD (the mixture of its
/// pairs' connect-the-dots PLDs on one grid) and its optimistic one, each if asked for. A pair
/// whose weight is below a thousandth of the per-step tail budget goes to the +∞ atom instead
/// (it dominates anything).
fn discretize_kind(
    kind: &Kind,
    dir: Direction,
    interval: f64,
    per_step: f64,
    max_bins: usize,
    pessimistic: bool,
    optimistic: bool,
) -> DpResult<(Option<DiscretePld>, Option<DiscretePld>)> {
    let loss = |q: f64, sigma: f64| {
        let d = if q == 1.0 { Direction::Remove } else { dir };
        SubsampledGaussianLoss::new(q, sigma, d)
    };
    // Grid bounds holding all but per_step/weight of the pair's mass (the mixture's tail stays
    // within the per-step budget).
    let grid = |l: &SubsampledGaussianLoss, w: f64| -> DpResult<(i64, i64)> {
        let t = (per_step / w).min(1e-3);
        let (k0, k1) = l.grid(interval, t, t.min(1e-20));
        if (k1 - k0) as f64 > 4.0 * max_bins as f64 {
            return Err(DpError::GridTooLarge {
                bins: (k1 - k0) as f64,
            });
        }
        Ok((k0, k1))
    };
    if kind.is_plain() {
        let l = loss(kind.lower.0, kind.lower.1);
        let (k0, k1) = grid(&l, 1.0)?;
        return l.discretize_both(interval, k0, k1, pessimistic, optimistic);
    }
    let p = if pessimistic {
        let small = 1e-3 * per_step;
        let env = kind.envelope > small;
        // Pairs too light to matter go to +∞; the first two are built whenever the envelope is.
        let mut inf_mass = if env { 0.0 } else { kind.envelope };
        let mut comps = Vec::new();
        let mut env_parts = Vec::new();
        for (i, c) in kind.upper.iter().enumerate() {
            let weight = if c.weight > small {
                c.weight
            } else {
                inf_mass += c.weight;
                0.0
            };
            if weight > 0.0 || (env && i < 2) {
                let l = loss(c.q, c.sigma);
                let budget = weight.max(if env { kind.envelope } else { 0.0 });
                if env && i < 2 {
                    env_parts.push(comps.len());
                }
                comps.push((weight, l, grid(&l, budget)?));
            }
        }
        let k0 = comps.iter().map(|c| c.2 .0).min().unwrap_or(0);
        let k1 = comps.iter().map(|c| c.2 .1).max().unwrap_or(1);
        if (k1 - k0) as f64 > 4.0 * max_bins as f64 {
            return Err(DpError::GridTooLarge {
                bins: (k1 - k0) as f64,
            });
        }
        let mut acc = DiscretePld {
            interval,
            offset: k0,
            probs: vec![0.0; (k1 - k0 + 1) as usize],
            inf_mass,
            excess: 0.0,
        };
        if comps.is_empty() {
            acc.probs[0] = 0.0;
        }
        let mut built = Vec::with_capacity(comps.len());
        for (w, l, _) in &comps {
            let d = l.discretize(interval, k0, k1, Bound::Pessimistic)?;
            for (a, b) in acc.probs.iter_mut().zip(d.probs.iter()) {
                *a += w * b;
            }
            acc.inf_mass += w * d.inf_mass;
            acc.excess += w * d.excess;
            built.push(d);
        }
        if let [i, j] = env_parts[..] {
            let e = loss::envelope(&built[i], &built[j]);
            for (a, b) in acc.probs.iter_mut().zip(e.probs.iter()) {
                *a += kind.envelope * b;
            }
            acc.inf_mass += kind.envelope * e.inf_mass;
        }
        acc.inf_mass = acc.inf_mass.min(1.0);
        Some(acc)
    } else {
        None
    };
    // The lower bound's pair has its own grid; where it is too large, no lower bound (the upper
    // one must not depend on whether a lower bound was asked for).
    let o = if optimistic {
        let (q, sigma) = kind.lower;
        if q == 0.0 {
            Some(identity(interval))
        } else {
            let l = loss(q, sigma);
            match grid(&l, 1.0) {
                Ok((k0, k1)) => Some(l.discretize(interval, k0, k1, Bound::Optimistic)?),
                Err(DpError::GridTooLarge { .. }) => None,
                Err(e) => return Err(e),
            }
        }
    } else {
        None
    };
    Ok((p, o))
}

/// The compositions of one direction on grid Δ: (pessimistic, optimistic), each if asked for,
/// and the number of per-step atoms built.
struct Pass {
    upper: Option<Composed>,
    lower: Option<Composed>,
    step_bins: usize,
}

/// Builds the per-step PLDs of one direction on grid Δ and composes them, each composition
/// tilted towards `target` (see [`compose::compose_tilted`]).
fn composed(
    kinds: &[Kind],
    dir: Direction,
    interval: f64,
    tail: f64,
    (pessimistic, optimistic): (bool, bool),
    max_bins: usize,
    target: Target,
    fixed: bool,
) -> DpResult<Pass> {
    let total: f64 = kinds.iter().map(|k| k.count).sum();
    let per_step = (tail / total).max(1e-300);
    let steps: Vec<(Option<DiscretePld>, Option<DiscretePld>)> = kinds
        .par_iter()
        .map(|k| discretize_kind(k, dir, interval, per_step, max_bins, pessimistic, optimistic))
        .collect::<DpResult<_>>()?;
    let step_bins = steps
        .iter()
        .map(|(p, o)| p.as_ref().map_or(0, |x| x.probs.len()) + o.as_ref().map_or(0, |x| x.probs.len()))
        .sum();
    let run = |pick: fn(&(Option<DiscretePld>, Option<DiscretePld>)) -> Option<&DiscretePld>, pess: bool| {
        let parts: Vec<Part<'_>> = steps
            .iter()
            .zip(kinds)
            .filter_map(|(s, k)| {
                pick(s).map(|pld| Part {
                    pld,
                    count: k.count,
                })
            })
            .collect();
        tilted(&parts, tail, max_bins, pess, target, fixed || !pess)
    };
    let upper = if pessimistic {
        let c = run(|s| s.0.as_ref(), true)?;
        // One kind of step and ε asked for: where the rounding bound carries δ (a single tilt
        // cannot serve both the bulk and the rare large losses), the composition split by the
        // number of large losses may be tighter; the smaller certified value is kept.
        match (target, &steps[..]) {
            (Target::Delta(d), [(Some(step), _)]) if kinds[0].is_plain() => {
                let e1 = curve::epsilon(&c.pld, d, 0.0);
                // What the rounding bound costs in ε: at most ε(δ) − ε(δ + its share of δ).
                let cost = |e: f64| e - curve::epsilon(&c.pld, d + c.floor_delta(e), 0.0);
                if e1.is_finite() && e1 > 0.0 && cost(e1) > 5e-2 * e1 {
                    match split_by_jumps(step, kinds[0].count, tail, max_bins, Target::Delta(d), e1) {
                        Some(s) if curve::epsilon(&s.pld, d, 0.0) < e1 => Some(s),
                        _ => Some(c),
                    }
                } else {
                    Some(c)
                }
            }
            (Target::Epsilon(e), [(Some(step), _)]) if kinds[0].is_plain() && e > 0.0 => {
                // The same for δ at ε: where the rounding bound carries more than 5% of δ.
                let d1 = curve::delta(&c.pld, e, 0.0);
                if d1 > 0.0 && c.floor_delta(e) > 5e-2 * d1 {
                    match split_by_jumps(step, kinds[0].count, tail, max_bins, Target::Epsilon(e), d1) {
                        Some(s) if curve::delta(&s.pld, e, 0.0) < d1 => Some(s),
                        _ => Some(c),
                    }
                } else {
                    Some(c)
                }
            }
            _ => Some(c),
        }
    } else {
        None
    };
    // Likewise a lower bound whose window is too large is skipped, never an error.
    let lower = if optimistic && steps.iter().all(|s| s.1.is_some()) {
        match run(|s| s.1.as_ref(), false) {
            Ok(c) => Some(c),
            Err(DpError::GridTooLarge { .. }) => None,
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    Ok(Pass {
        upper,
        lower,
        step_bins,
    })
}

/// The T-fold composition of one step split by its large losses: with B the step's atoms up to
/// a cut and J those above it (sub-measures, w = J's mass), (B + J)^{*T} = Σ_k C(T, k)·B^{*(T−k)}
/// * J^{*k} exactly. Each term is composed by [`compose_tilted`] with its own tilt (B alone has
/// no rare large losses: a strong tilt serves it), the terms k ≤ K are added atom by atom (each
/// an upper bound), and the rest, at most C(T, K+1)·w^{K+1} ≤ (T·w)^{K+1}/(K+1)!, goes to +∞.
/// Cuts at ε₁/4, ε₁/16 and ε₁/64 (ε₁ the single-tilt value) are tried; None if no cut gives a
/// valid composition (K ≤ 4 terms, the answer above every term's window).
fn split_by_jumps(step: &DiscretePld, count: f64, tail: f64, max_bins: usize, want: Target, e1: f64) -> Option<Composed> {
    // ε at δ (the cuts and terms' tilts follow the answer), or δ at a fixed ε (one pass, the
    // terms tilted to it; the remainder's budget then taken from a first untilted estimate).
    // (`e1`: the single-tilt ε for ε at δ; the single-tilt δ for δ at ε.)
    let (delta, fixed_eps, scale) = match want {
        Target::Delta(d) => (d, None, e1),
        Target::Epsilon(e) => (e1, Some(e), e),
        Target::None => return None,
    };
    let h = step.interval;
    let n = step.probs.len() as i64;
    let mut best: Option<(f64, Composed)> = None;
    for frac in [0.25, 1.0 / 16.0, 1.0 / 64.0] {
        let ci = ((scale * frac / h).floor() as i64 - step.offset).clamp(0, n);
        if ci <= 0 || ci >= n - 1 {
            continue;
        }
        let cut = ci as usize;
        let b = DiscretePld {
            interval: h,
            offset: step.offset,
            probs: step.probs[..cut].to_vec(),
            inf_mass: 0.0,
            excess: 0.0,
        };
        let j = DiscretePld {
            interval: h,
            offset: step.offset + ci,
            probs: step.probs[cut..].to_vec(),
            inf_mass: 0.0,
            excess: 0.0,
        };
        let w: f64 = j.probs.iter().sum::<f64>() * (1.0 + 1e-12);
        if !(w > 0.0) {
            continue;
        }
        // K: the fewest terms whose remainder (T·w)^{K+1}/(K+1)! is below 1e-3·δ.
        let ltw = (count * w).ln();
        let mut lf = 0.0f64;
        let mut kk = None;
        for k in 0..=4usize {
            lf += ((k + 1) as f64).ln();
            let rem = (k + 1) as f64 * ltw - lf;
            if rem <= (1e-3 * delta).ln() {
                kk = Some((k, rem.exp() * (1.0 + 1e-9)));
                break;
            }
        }
        let Some((kmax, rest)) = kk else { continue };
        // First each term tilted to where it alone would carry δ (term k weighs C(T, k)), then
        // all tilted to the combined answer.
        let mut guess = fixed_eps.unwrap_or(f64::NAN);
        for _ in 0..2 {
            let mut terms = Vec::new();
            let mut ok = true;
            for k in 0..=kmax {
                let kf = k as f64;
                if kf > count {
                    break;
                }
                let mut parts = Vec::new();
                if count - kf > 0.0 {
                    parts.push(Part { pld: &b, count: count - kf });
                }
                if k > 0 {
                    parts.push(Part { pld: &j, count: kf });
                }
                // C(T, k), exactly enough (k ≤ 4), rounded up.
                let mut binom = 1.0f64;
                for i in 0..k {
                    binom *= (count - i as f64) / (i + 1) as f64;
                }
                let target = if guess.is_finite() { Target::Epsilon(guess) } else { Target::Delta(delta / binom) };
                let t = choose_tilt(&parts, target);
                // The term's tails weigh C(T, k) times: their budget is divided by it.
                let tt = (tail / binom).max(1e-300);
                let Ok(c) = compose_tilted(&parts, t, tt, tt, max_bins, true, 0) else {
                    ok = false;
                    break;
                };
                terms.push((c, binom * (1.0 + 1e-12)));
            }
            if !ok || terms.is_empty() {
                break;
            }
            let lo = terms.iter().map(|(c, _)| c.pld.offset).min().unwrap_or(0);
            let hi = terms.iter().map(|(c, _)| c.pld.offset + c.pld.probs.len() as i64).max().unwrap_or(1);
            if hi - lo > 2 * max_bins as i64 {
                break;
            }
            let mut probs = vec![0.0f64; (hi - lo) as usize];
            let mut inf = -((-step.inf_mass).ln_1p() * count).exp_m1() + rest;
            for (c, s) in &terms {
                for (i, &v) in c.pld.probs.iter().enumerate() {
                    probs[(c.pld.offset - lo) as usize + i] += v * s;
                }
                inf += c.pld.inf_mass * s;
            }
            for p in probs.iter_mut() {
                *p = (*p * (1.0 + 1e-12)).min(1.0);
            }
            let pld = DiscretePld {
                interval: h,
                offset: lo,
                probs,
                inf_mass: inf.min(1.0),
                excess: 0.0,
            };
            if let Some(fe) = fixed_eps {
                // δ at the given ε: every tilted term must hold the atoms above it.
                let valid = terms.iter().all(|(c, _)| c.tilt == 0.0 || fe >= (c.pld.offset + 1) as f64 * h);
                let dv = curve::delta(&pld, fe, 0.0);
                if valid && best.as_ref().map_or(true, |(b, _)| dv < *b) {
                    best = Some((
                        dv,
                        Composed { pld, wrapped_in: 0.0, noise_floor: 0.0, tilt: 0.0, log_scale: 0.0 },
                    ));
                }
                break;
            }
            let e = curve::epsilon(&pld, delta, 0.0);
            // Every term must hold the atoms the answer reads (those above it).
            if !e.is_finite() {
                break;
            }
            if !terms.iter().all(|(c, _)| c.tilt == 0.0 || e >= (c.pld.offset + 1) as f64 * h) {
                guess = e;
                continue;
            }
            if best.as_ref().map_or(true, |(b, _)| e < *b) {
                best = Some((
                    e,
                    Composed {
                        pld,
                        wrapped_in: 0.0,
                        noise_floor: terms.iter().map(|(c, _)| c.noise_floor).fold(0.0, f64::max),
                        tilt: 0.0,
                        log_scale: 0.0,
                    },
                ));
            }
            if guess.is_finite() && (e - guess).abs() <= 1e-3 * guess {
                break;
            }
            guess = e;
        }
    }
    best.map(|(_, c)| c)
}

/// One composition, tilted towards `target`. A pessimistic composition whose answer falls
/// below its window (the tilt too strong: atoms below the window are not represented) is
/// recomputed with a quarter of the tilt, and untilted at last.
fn tilted(
    parts: &[Part<'_>],
    tail: f64,
    max_bins: usize,
    pessimistic: bool,
    target: Target,
    halve: bool,
) -> DpResult<Composed> {
    let mut t = choose_tilt(parts, target);
    // A strong tilt can make rare large losses the bulk of the tilted measure, and its buffer
    // too large. With `halve` the tilt is halved (less tight, still certified) up to three
    // times, then dropped; otherwise the error goes back to the caller, which coarsens an automatic grid
    // (at the same ε, a coarser grid costs less tightness than a weaker tilt).
    let mut halvings = 0;
    for attempt in 0..=8 {
        if attempt == 8 {
            t = 0.0;
        }
        let c = match compose_tilted(parts, t, tail, tail, max_bins, pessimistic, 0) {
            Ok(c) => c,
            Err(DpError::GridTooLarge { .. }) if halve && t > 0.0 => {
                // then untilted, whose window is the smallest
                halvings += 1;
                t = if halvings > 3 { 0.0 } else { t / 2.0 };
                continue;
            }
            Err(e) => return Err(e),
        };
        if t == 0.0 {
            return Ok(c);
        }
        let lowest = (c.pld.offset + 1) as f64 * c.pld.interval;
        let answer = match target {
            Target::Delta(d) => curve::epsilon(&c.pld, d + if pessimistic { 0.0 } else { c.wrapped_in }, 0.0),
            Target::Epsilon(e) => e,
            Target::None => f64::INFINITY,
        };
        if answer >= lowest || !answer.is_finite() {
            return Ok(c);
        }
        t /= 4.0;
    }
    unreachable!()
}

/// The certified composition of PLDs given atom by atom (`count` copies of each, all on one
/// grid): the path of steps that are not Poisson-subsampled Gaussians (the mixture-of-Gaussians
/// steps discretised in Python), composed as every other (tilted towards `target`, rounding
/// bounded; see [`compose::compose_tilted`]).
pub fn compose_parts(
    parts: &[(DiscretePld, f64)],
    tail: f64,
    max_bins: usize,
    pessimistic: bool,
    target: Target,
    halve: bool,
) -> DpResult<Composed> {
    require(!parts.is_empty(), "parts", "at least one", 0)?;
    let interval = parts[0].0.interval;
    for (p, c) in parts {
        require(p.interval == interval, "interval", "the same for every part", p.interval)?;
        require(*c >= 0.0 && c.is_finite() && c.fract() == 0.0, "count", "a whole number >= 0", *c)?;
        require(p.probs.iter().all(|x| *x >= 0.0 && x.is_finite()) && !p.probs.is_empty(), "probs", "finite, >= 0, not empty", 0)?;
        require((0.0..=1.0).contains(&p.inf_mass), "inf_mass", "in [0, 1]", p.inf_mass)?;
    }
    require(tail > 0.0 && tail < 1.0, "tail", "in (0, 1)", tail)?;
    let ps: Vec<Part<'_>> = parts.iter().map(|(pld, count)| Part { pld, count: *count }).collect();
    tilted(&ps, tail, max_bins, pessimistic, target, halve)
}

/// The loss window of the composition (in loss units), estimated on a coarse grid.
fn window_width(kinds: &[Kind], dirs: &[Direction], tail: f64) -> DpResult<f64> {
    let mut w = 0.0f64;
    for &dir in dirs {
        let mut coarse = 1e-2;
        loop {
            match composed(kinds, dir, coarse, tail, (true, false), 1 << 16, Target::None, false) {
                Ok(c) => {
                    let n = c.upper.map_or(0, |c| c.pld.probs.len());
                    w = w.max(n as f64 * coarse);
                    break;
                }
                Err(DpError::GridTooLarge { .. }) if coarse < 1e6 => coarse *= 4.0,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(w)
}

fn directions(kinds: &[Kind]) -> Vec<Direction> {
    if kinds.iter().any(Kind::subsampled) {
        vec![Direction::Remove, Direction::Add]
    } else {
        vec![Direction::Remove]
    }
}

/// The standard deviation of one step's privacy loss (remove direction, under P), by the
/// trapezoid rule over the output: the scale a grid must resolve. Connect the dots inflates a
/// step's loss variance by about Δ·E|L|, so the composed ε is off by a fraction of order Δ/s.
fn loss_std(q: f64, sigma: f64) -> f64 {
    if q == 0.0 {
        return 0.0;
    }
    let l = SubsampledGaussianLoss::new(q, sigma, Direction::Remove);
    let (a, b, n) = (-12.0 * sigma, 1.0 + 12.0 * sigma, 4000usize);
    let h = (b - a) / n as f64;
    let c = 1.0 / (sigma * (2.0 * std::f64::consts::PI).sqrt());
    let (mut m0, mut m1, mut m2) = (0.0f64, 0.0f64, 0.0f64);
    for i in 0..=n {
        let x = a + i as f64 * h;
        let w = if i == 0 || i == n { 0.5 } else { 1.0 };
        let g = |mu: f64| (-(x - mu) * (x - mu) / (2.0 * sigma * sigma)).exp() * c;
        let p = w * ((1.0 - q) * g(0.0) + q * g(1.0));
        let v = l.loss(x);
        if v.is_finite() {
            m0 += p;
            m1 += p * v;
            m2 += p * v * v;
        }
    }
    if !(m0 > 0.0) {
        return 0.0;
    }
    let mean = m1 / m0;
    (m2 / m0 - mean * mean).max(0.0).sqrt()
}

/// The per-step loss scale of the kind that carries most of the composition's variance
/// (count × std²): an automatic grid is refined to a LOSS_STEPS-th of it.
fn dominant_scale(kinds: &[Kind]) -> f64 {
    kinds
        .iter()
        .map(|k| {
            let s = loss_std(k.lower.0, k.lower.1);
            (k.count * s * s, s)
        })
        .fold((0.0, 0.0), |a, b| if b.0 > a.0 { b } else { a })
        .1
}

/// The grid step for these kinds (see the module docs).
fn choose_interval(kinds: &[Kind], dirs: &[Direction], opts: &Options, tail: f64) -> DpResult<f64> {
    if let Some(d) = opts.interval {
        require(d > 0.0 && d.is_finite(), "value_discretization_interval", "> 0", d)?;
        return Ok(d);
    }
    let w = window_width(kinds, dirs, tail)?;
    // A step's loss narrower than a few grid steps (small q, large σ) is blurred by connect the
    // dots, by a fraction of order Δ/s of ε: at most s/LOSS_STEPS.
    let s = dominant_scale(kinds) / LOSS_STEPS;
    let mut d = DEFAULT_INTERVAL.min(w / TARGET_BINS).min(if s > 0.0 { s } else { f64::INFINITY }).max(MIN_INTERVAL);
    if w / d > 0.9 * opts.max_bins as f64 {
        d = w / (0.9 * opts.max_bins as f64);
    }
    Ok(d)
}

/// Runs `f` at grid Δ = `d`, doubling an automatic Δ while the window exceeds `max_bins`.
fn coarsened<T>(opts: &Options, mut d: f64, f: impl Fn(f64) -> DpResult<T>) -> DpResult<(T, f64)> {
    loop {
        match f(d) {
            Ok(v) => return Ok((v, d)),
            Err(DpError::GridTooLarge { .. }) if opts.interval.is_none() => d *= 2.0,
            Err(e) => return Err(e),
        }
    }
}

fn check_delta(delta: f64) -> DpResult<()> {
    require(delta > 0.0 && delta < 1.0, "delta", "in (0, 1)", delta)
}

/// The lower bound on ε from a composed optimistic PLD: its δ(ε) is below the true one but for
/// the mass that wrapped into the window (added to δ) and the transform's rounding (taken off
/// every atom); a few ulps off the result.
fn lower_epsilon(c: &Composed, delta: f64) -> f64 {
    let e = curve::epsilon(&c.pld, delta + c.wrapped_in, 0.0);
    (e - 16.0 * f64::EPSILON * (1.0 + e.abs())).max(0.0)
}

/// Both directions at grid Δ: (upper, lower, per-step atoms built), the upper value the worse
/// of the directions' `upper(composed)`, the lower the worse of their `lower(composed)`; either
/// bound only if asked for (else 0).
#[allow(clippy::too_many_arguments)]
fn bounds_pass(
    kinds: &[Kind],
    dirs: &[Direction],
    d: f64,
    tail: f64,
    max_bins: usize,
    want: (bool, bool),
    target: Target,
    fixed: bool,
    upper: impl Fn(&Composed) -> f64 + Sync,
    lower: impl Fn(&Composed) -> f64 + Sync,
) -> DpResult<(f64, f64, usize)> {
    let (mut up, mut lo, mut bins) = (0.0f64, 0.0f64, 0usize);
    // The directions are independent: composed side by side (results taken in order).
    let passes: Vec<DpResult<Pass>> = dirs
        .par_iter()
        .map(|&dir| composed(kinds, dir, d, tail, want, max_bins, target, fixed))
        .collect();
    for p in passes {
        let p = p?;
        if let Some(c) = &p.upper {
            up = up.max(upper(c));
        }
        if let Some(c) = &p.lower {
            lo = lo.max(lower(c));
        }
        bins += p.step_bins;
    }
    Ok((up, lo, bins))
}

/// Lower bounds on finer grids while the gap to `upper` is above LOWER_GAP (see the module
/// docs): the largest of `lower` and theirs. `bins`: the per-step atoms of the pass at `d`; a
/// finer grid is tried only while its per-step atoms (4× as many) stay within 4·max_bins.
fn refine_lower(
    lower: f64,
    upper: f64,
    mut d: f64,
    mut bins: usize,
    max_bins: usize,
    pass: impl Fn(f64) -> DpResult<(f64, usize)>,
) -> f64 {
    let mut lo = lower;
    for _ in 0..LOWER_REFINES {
        if !(upper.is_finite() && upper - lo > LOWER_GAP * upper)
            || d / 4.0 < MIN_INTERVAL
            || 4 * bins > 4 * max_bins
        {
            break;
        }
        d /= 4.0;
        match pass(d) {
            Ok((l, b)) => {
                lo = lo.max(l);
                bins = b;
            }
            Err(_) => break,
        }
    }
    lo
}

/// Bounds on the smallest ε with the composition (ε, δ)-DP under add-or-remove (the worse of
/// the two directions). `lower = false` skips the lower bound (reported as 0).
pub fn epsilon_bounds(
    groups: &[Group],
    delta: f64,
    opts: &Options,
    lower: bool,
) -> DpResult<Bounds> {
    epsilon_bounds_mixed(groups, &[], delta, opts, lower)
}

/// [`epsilon_bounds`] for Poisson and truncated-Poisson groups together.
pub fn epsilon_bounds_mixed(
    groups: &[Group],
    truncated: &[TruncatedGroup],
    delta: f64,
    opts: &Options,
    lower: bool,
) -> DpResult<Bounds> {
    check_delta(delta)?;
    let interval = opts.interval.unwrap_or(DEFAULT_INTERVAL);
    match plan(groups, truncated)? {
        Plan::Nothing => Ok(Bounds::exact(0.0, interval)),
        Plan::NonPrivate => Ok(Bounds::exact(f64::INFINITY, interval)),
        Plan::Gaussian(s) => {
            let e = curve::gaussian_epsilon(s, delta);
            Ok(Bounds::exact(e, interval))
        }
        Plan::Mixed(k) => {
            // Tails cut from the grids and windows add at most 2·1e-4·δ to δ.
            let tail = 1e-4 * delta;
            let dirs = directions(&k);
            let d0 = choose_interval(&k, &dirs, opts, tail)?;
            let pass = |d: f64, want| {
                bounds_pass(&k, &dirs, d, tail, opts.max_bins, want, Target::Delta(delta), opts.interval.is_some(), |c| curve::epsilon(&c.pld, delta, 0.0), |c| {
                    lower_epsilon(c, delta)
                })
            };
            let ((mut upper, mut lo, mut bins), mut d) = coarsened(opts, d0, |d| pass(d, (true, lower)))?;
            // A grid step that is large next to ε itself blurs it: refine once, keep the smaller
            // of the two certified values (and the larger lower bound).
            if opts.interval.is_none() && upper.is_finite() && upper < REFINE * d && d > MIN_INTERVAL {
                let d2 = (upper / REFINE).max(MIN_INTERVAL);
                if let Ok((u2, l2, b2)) = pass(d2, (true, lower)) {
                    lo = lo.max(l2);
                    if u2 < upper {
                        (upper, d, bins) = (u2, d2, b2);
                    }
                }
            }
            // Finer grids close only the discretisation's part of the gap: not where a kind's
            // lower bound is another pair than its upper one (truncated Poisson).
            let refinable = opts.interval.is_none() && k.iter().all(Kind::is_plain);
            let lo = if lower {
                if refinable {
                    lo = refine_lower(lo, upper, d, bins, opts.max_bins, |dl| {
                        pass(dl, (false, true)).map(|(_, l, b)| (l, b))
                    });
                }
                lo.min(upper)
            } else {
                0.0
            };
            Ok(Bounds {
                lower: lo,
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
    delta_bounds_mixed(groups, &[], epsilon, opts, lower)
}

/// [`delta_bounds`] for Poisson and truncated-Poisson groups together.
pub fn delta_bounds_mixed(
    groups: &[Group],
    truncated: &[TruncatedGroup],
    epsilon: f64,
    opts: &Options,
    lower: bool,
) -> DpResult<Bounds> {
    super::check_epsilon(epsilon)?;
    let interval = opts.interval.unwrap_or(DEFAULT_INTERVAL);
    match plan(groups, truncated)? {
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
        Plan::Mixed(k) => {
            let dirs = directions(&k);
            // Both directions at grid Δ with this tail budget: (upper δ, lower δ, step atoms).
            let pass = |tail: f64, d: f64, want: (bool, bool)| {
                bounds_pass(&k, &dirs, d, tail, opts.max_bins, want, Target::Epsilon(epsilon), opts.interval.is_some(), |c| curve::delta(&c.pld, epsilon, 0.0), |c| {
                    (curve::delta(&c.pld, epsilon, 0.0) - c.wrapped_in).max(0.0)
                })
            };
            let run = |tail: f64, o: &Options, want: (bool, bool)| -> DpResult<((f64, f64, usize), f64)> {
                let d0 = choose_interval(&k, &dirs, o, tail)?;
                coarsened(o, d0, |d| pass(tail, d, want))
            };
            // The tail budget must be small next to the answer: a second pass when it is not.
            let ((mut up, mut lo, mut bins), mut d) = run(1e-10, opts, (true, lower))?;
            if up < 1e-6 {
                let ((u, l, b), d2) = run((up * 1e-4).max(1e-300), opts, (true, lower))?;
                (up, d, bins) = (u, d2, b);
                lo = lo.max(l);
            }
            let tail = (up * 1e-4).max(1e-300);
            if opts.interval.is_none() && epsilon < REFINE * d && d > MIN_INTERVAL {
                let o = Options {
                    interval: Some((epsilon / REFINE).max(MIN_INTERVAL)),
                    ..*opts
                };
                if let Ok(((u2, l2, b2), d2)) = run(tail, &o, (true, lower)) {
                    lo = lo.max(l2);
                    if u2 < up {
                        (up, d, bins) = (u2, d2, b2);
                    }
                }
            }
            let refinable = opts.interval.is_none() && k.iter().all(Kind::is_plain);
            let lo = if lower {
                if refinable {
                    lo = refine_lower(lo, up, d, bins, opts.max_bins, |dl| {
                        pass(tail, dl, (false, true)).map(|(_, l, b)| (l, b))
                    });
                }
                lo.min(up)
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
