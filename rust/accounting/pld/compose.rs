//! Composition of discrete privacy loss distributions by FFT (Koskela, Jälkö, Honkela 2020,
//! arXiv:1906.03049, §4): the PLD of a composition is the convolution of the PLDs, and T
//! identical steps are a T-th power in the frequency domain, so the cost does not grow with T.
//!
//! Cyclic convolution wraps mass around. The window kept, [a, b], comes from Chernoff bounds on
//! the composition's cumulant generating function K(λ) = Σ_s c_s·log Σ_k p_{s,k}·e^{λk}:
//! the finite mass above b is at most e^{K(λ) − λ(b+1)}, and it is added to the +∞ atom
//! (pessimistic), so that no mass is lost silently; mass below a wraps upward, which only
//! makes the result more pessimistic (the optimistic bound subtracts it from δ instead).

use super::DiscretePld;
use crate::error::{try_filled, DpError, DpResult};
use rayon::prelude::*;
use realfft::num_complex::Complex64;
use realfft::RealFftPlanner;

/// The composition's result: a PLD whose finite atoms are certified bounds on the exact
/// composition's (from above for a pessimistic composition, from below for an optimistic one),
/// floating-point rounding included.
#[derive(Clone, Debug)]
pub struct Composed {
    pub pld: DiscretePld,
    /// Upper bound on mass that is in the parts but not in the mechanism's PLD (the optimistic
    /// parts' `excess`): subtracted from δ for a lower bound.
    pub wrapped_in: f64,
    /// The certified bound on the rounding error of the transform per atom, in the tilted
    /// measure (diagnostics and tests).
    pub noise_floor: f64,
    /// The tilt t (per grid step) the composition was computed under.
    pub tilt: f64,
    /// Σ_s c_s·log-scale of the tilted parts: an atom J untilted is its tilted value times
    /// e^{log_scale − t·J}.
    pub log_scale: f64,
}

impl Composed {
    /// How much of δ(ε) the rounding bound alone accounts for (pessimistic compositions): the
    /// floor added to every atom above ε, untilted, weighted by (1 − e^{ε − ℓ}).
    pub fn floor_delta(&self, eps: f64) -> f64 {
        let h = self.pld.interval;
        let first = ((eps / h).floor() as i64 + 1).max(self.pld.offset);
        let last = self.pld.offset + self.pld.probs.len() as i64 - 1;
        if first > last {
            return 0.0;
        }
        let t = self.tilt;
        if t > 0.0 {
            // Σ_{J ≥ first} e^{S − tJ}(1 − e^{ε − Jh}) ≤ e^{S − t·first}·(1/(1 − e^{−t}))
            (self.log_scale - t * first as f64).exp() * self.noise_floor / (-(-t).exp_m1())
        } else {
            self.noise_floor * (last - first + 1) as f64
        }
    }
}

/// One part of a composition: a PLD repeated `count` times.
pub struct Part<'a> {
    pub pld: &'a DiscretePld,
    pub count: f64,
}

struct Cgf {
    /// Per part: (absolute index, log mass) of its atoms merged in blocks, and its count.
    logs: Vec<(Vec<(f64, f64)>, f64)>,
}

/// Atoms per block in the Chernoff computation: atoms lighter than 1e-8 of the heaviest are
/// merged in at most ~2048 blocks per part, each block's light mass at its top index (upper
/// tail) or its bottom index (lower tail), which only moves the bounds outward.
fn block(n: usize) -> usize {
    (n / 2048).max(1)
}

impl Cgf {
    fn new(parts: &[Part<'_>], upper: bool) -> Self {
        let logs = parts
            .par_iter()
            .map(|p| {
                let g = block(p.pld.probs.len());
                // Heavy atoms keep their exact index (moving the bulk by a block would shift a
                // T-fold composition by T blocks); the light ones are merged per block.
                let heavy = 1e-8 * p.pld.probs.iter().cloned().fold(0.0f64, f64::max);
                let mut l: Vec<(f64, f64)> = Vec::new();
                for (b, ch) in p.pld.probs.chunks(g).enumerate() {
                    let mut light = 0.0f64;
                    for (j, &x) in ch.iter().enumerate() {
                        if x >= heavy && x > 0.0 {
                            l.push(((p.pld.offset + (b * g + j) as i64) as f64, x.ln()));
                        } else {
                            light += x;
                        }
                    }
                    if light > 0.0 {
                        let k = if upper { b * g + ch.len() - 1 } else { b * g };
                        l.push(((p.pld.offset + k as i64) as f64, light.ln()));
                    }
                }
                (l, p.count)
            })
            .collect();
        Cgf { logs }
    }

    /// K(λ) in index units: Σ_s c_s·log Σ_k p_{s,k}·e^{λ·k}.
    fn k(&self, lambda: f64) -> f64 {
        // Each part's terms in fixed chunks, in parallel (a log-sum-exp per chunk), combined in
        // chunk and part order: the same value whatever the threads do.
        const CHUNK: usize = 2048;
        let per: Vec<f64> = self
            .logs
            .iter()
            .map(|(l, c)| {
                let chunks: Vec<(f64, f64)> = l
                    .par_chunks(CHUNK)
                    .map(|ch| {
                        let m = ch.iter().map(|&(k, v)| v + lambda * k).fold(f64::NEG_INFINITY, f64::max);
                        if m == f64::NEG_INFINITY {
                            return (m, 0.0);
                        }
                        (m, ch.iter().map(|&(k, v)| (v + lambda * k - m).exp()).sum())
                    })
                    .collect();
                let m = chunks.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    return f64::NEG_INFINITY;
                }
                let s: f64 = chunks.iter().filter(|x| x.1 > 0.0).map(|&(mc, sc)| sc * (mc - m).exp()).sum();
                c * (m + s.ln())
            })
            .collect();
        per.iter().sum()
    }

    /// (K(λ), K'(λ), K''(λ)) in index units, as [`Cgf::k`] (indices centred on each part's
    /// first term against cancellation in K'').
    fn k3(&self, lambda: f64) -> (f64, f64, f64) {
        const CHUNK: usize = 8192;
        let mut out = (0.0f64, 0.0f64, 0.0f64);
        for (l, c) in &self.logs {
            if l.is_empty() {
                return (f64::NEG_INFINITY, 0.0, 0.0);
            }
            let r = l[0].0;
            let chunks: Vec<(f64, f64, f64, f64)> = l
                .par_chunks(CHUNK)
                .map(|ch| {
                    let m = ch.iter().map(|&(k, v)| v + lambda * k).fold(f64::NEG_INFINITY, f64::max);
                    let (mut s0, mut s1, mut s2) = (0.0f64, 0.0f64, 0.0f64);
                    if m > f64::NEG_INFINITY {
                        for &(k, v) in ch {
                            let w = (v + lambda * k - m).exp();
                            let d = k - r;
                            s0 += w;
                            s1 += w * d;
                            s2 += w * d * d;
                        }
                    }
                    (m, s0, s1, s2)
                })
                .collect();
            let m = chunks.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                return (f64::NEG_INFINITY, 0.0, 0.0);
            }
            let (mut s0, mut s1, mut s2) = (0.0f64, 0.0f64, 0.0f64);
            for &(mc, a, b, d) in &chunks {
                if a > 0.0 {
                    let e = (mc - m).exp();
                    s0 += a * e;
                    s1 += b * e;
                    s2 += d * e;
                }
            }
            let mean = s1 / s0;
            out.0 += c * (m + s0.ln());
            out.1 += c * (r + mean);
            out.2 += c * (s2 / s0 - mean * mean).max(0.0);
        }
        out
    }

    /// The smallest index b with finite mass above b bounded by ≤ `tau` (upper = true), or the
    /// largest a with mass below a ≤ `tau` (upper = false), and the bound achieved.
    fn bound(&self, tau: f64, upper: bool, trivial: f64) -> (f64, f64) {
        let s = if upper { 1.0 } else { -1.0 };
        // f(λ) = (K(sλ) − log τ)/λ is minimised where G(λ) = λ·s·K'(sλ) − K(sλ) + log τ = 0,
        // G increasing (G' = λ·K''): safeguarded Newton. Any λ gives a valid bound; this one the
        // tightest.
        let lt = tau.ln();
        let lam = increasing_root(1e-9, 30.0, |lam| {
            let (k, k1, k2) = self.k3(s * lam);
            (lam * s * k1 - k + lt, lam * k2)
        });
        let ll = lam.ln();
        let v = (self.k(s * lam) - lt) / lam;
        // The index bound, no further out than the support allows.
        let idx = if upper {
            v.ceil().min(trivial)
        } else {
            (-v).floor().max(trivial)
        };
        let lam = ll.exp();
        // Mass strictly beyond idx: upper: P(S ≥ idx+1) ≤ e^{K(λ) − λ(idx+1)}.
        let beyond = if upper { idx + 1.0 } else { idx - 1.0 };
        let achieved = if (upper && idx >= trivial) || (!upper && idx <= trivial) {
            0.0
        } else {
            (self.k(s * lam) - lam * s * beyond).exp().min(1.0)
        };
        (idx, achieved)
    }
}

/// The root in [lo, hi] of an increasing g (value and derivative), by Newton's method kept
/// inside a shrinking bracket (a geometric bisection where Newton leaves it); lo or hi where g
/// has no sign change there.
fn increasing_root(lo: f64, hi: f64, g: impl Fn(f64) -> (f64, f64)) -> f64 {
    let (mut lo, mut hi) = (lo, hi);
    let (glo, _) = g(lo);
    if !(glo < 0.0) {
        return lo;
    }
    let (ghi, _) = g(hi);
    if !(ghi > 0.0) {
        return hi;
    }
    let mut x = (lo * hi).sqrt();
    for _ in 0..60 {
        let (v, d) = g(x);
        if !v.is_finite() {
            hi = x;
        } else if v < 0.0 {
            lo = x;
        } else {
            hi = x;
        }
        let newton = if d > 0.0 && v.is_finite() { x - v / d } else { f64::NAN };
        let next = if newton > lo && newton < hi { newton } else { (lo * hi).sqrt() };
        if (next - x).abs() <= 1e-10 * x || hi / lo < 1.0 + 1e-12 {
            return next;
        }
        x = next;
    }
    x
}

/// What a composition is for: the tilt is chosen to centre the tilted composition there.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    /// ε at this δ: the tilt of the Chernoff bound on P(L > ε) ≤ δ (its tilted mean is the
    /// Chernoff ε, a little above the answer).
    Delta(f64),
    /// δ at this ε (in loss units): the saddle point, tilted mean at ε.
    Epsilon(f64),
    /// No tilt.
    None,
}

/// The tilt t ≥ 0 (per grid index) for `target` (see [`compose_tilted`]); 0 where the target
/// lies below the composition's mean. Any t gives certified bounds; this one makes them tight.
pub fn choose_tilt(parts: &[Part<'_>], target: Target) -> f64 {
    let interval = parts[0].pld.interval;
    let cgf = Cgf::new(parts, true);
    let t = match target {
        Target::None => return 0.0,
        Target::Epsilon(e) => {
            // The saddle point K'(t) = ε/Δ; none where the mean is already above it.
            let x = e / interval;
            if cgf.k3(0.0).1 >= x {
                0.0
            } else {
                increasing_root(1e-12, 50.0, |t| {
                    let (_, k1, k2) = cgf.k3(t);
                    (k1 - x, k2)
                })
            }
        }
        Target::Delta(d) => {
            // The Chernoff bound's tilt: (K(t) − log δ)/t least, where t·K'(t) − K(t) + log δ = 0;
            // none where that ε is below the mean.
            let ld = d.ln();
            let t = increasing_root(1e-12, 50.0, |t| {
                let (k, k1, k2) = cgf.k3(t);
                (t * k1 - k + ld, t * k2)
            });
            if (cgf.k(t) - ld) / t > cgf.k3(0.0).1 {
                t
            } else {
                0.0
            }
        }
    };
    // Backed off by KAPPA tilted standard deviations: the density at the target falls by about
    // e^{−KAPPA²/2}, while rare large per-step losses (which the full tilt brings forward, and
    // which set the transform's length) lose a factor e^{−KAPPA·J/sd} for a jump J.
    let kappa = KAPPA;
    let t = if t > 0.0 && kappa > 0.0 {
        let k2 = cgf.k3(t).2;
        if k2 > 0.0 && k2.is_finite() {
            (t - kappa / k2.sqrt()).max(0.5 * t)
        } else {
            t
        }
    } else {
        t
    };
    // At the search's cap the loss is bounded where the target lies (its largest value is the
    // Chernoff ε): no tilt.
    if t.is_finite() && t > 1e-11 && t < 25.0 {
        t
    } else {
        0.0
    }
}

/// The smallest 2^i·3^j ≥ n.
fn fast_len(n: usize) -> usize {
    let mut best = n.next_power_of_two();
    let mut p3 = 1usize;
    while p3 < best {
        let mut v = p3;
        while v < n {
            v *= 2;
        }
        best = best.min(v);
        p3 *= 3;
    }
    best
}

/// Composes the parts (all on the same grid interval), untilted. `tail_hi`: the mass budget
/// above the window that moves to +∞; `tail_lo`: below the window. `max_bins` caps the window;
/// beyond it an error tells the caller to coarsen the grid.
pub fn compose(
    parts: &[Part<'_>],
    tail_hi: f64,
    tail_lo: f64,
    max_bins: usize,
    pessimistic: bool,
) -> DpResult<Composed> {
    compose_tilted(parts, 0.0, tail_hi, tail_lo, max_bins, pessimistic, 0)
}

type Plans = (
    std::sync::Arc<dyn realfft::RealToComplex<f64>>,
    std::sync::Arc<dyn realfft::ComplexToReal<f64>>,
);

/// The forward and inverse real transforms of length m, from a small process-wide cache: planning
/// (twiddle tables) costs as much as several transforms at 10⁵–10⁶ points, and a calibration or
/// the two bounds recompose at the same lengths. Least recently used first out, at most 8.
fn plans(m: usize) -> Plans {
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<Vec<(usize, Plans)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = c.iter().position(|(n, _)| *n == m) {
        let hit = c.remove(i);
        let p = hit.1.clone();
        c.push(hit);
        return p;
    }
    let mut planner = RealFftPlanner::<f64>::new();
    let p: Plans = (planner.plan_fft_forward(m), planner.plan_fft_inverse(m));
    if c.len() >= 8 {
        c.remove(0);
    }
    c.push((m, p.clone()));
    p
}

/// The unit roundoff of f64.
const U: f64 = f64::EPSILON / 2.0;

/// Relative ℓ2 error bound of one forward or inverse real transform of length m as realfft and
/// rustfft compute it: ‖ŷ − y‖₂ ≤ η_m·‖y‖₂.
///
/// Higham, *Accuracy and Stability of Numerical Algorithms* (2nd ed. 2002), Theorem 24.2: for
/// the radix-2 Cooley–Tukey FFT, ‖ŷ − y‖₂/‖y‖₂ ≤ log₂n·η/(1 − log₂n·η) with η = μ + γ₄(√2 + μ),
/// μ the error of the computed twiddle factors and γ₄ = 4u/(1 − 4u): each of the log₂n stages
/// is a scaled unitary map computed with relative error η. rustfft's mixed-radix plans (radix
/// 2, 3, 4, 6 butterflies, and realfft's extra pre/post-processing stage of twiddles) are the
/// same product of scaled unitary stages; we bound each by 4η per binary level (a radix-3 stage
/// counts log₂3 levels) and add two levels for realfft, with μ = 4u (twiddles from sin_cos).
/// The tests measure the actual error against compensated direct sums with exactly reduced
/// twiddles: it stays below 1/50 of this bound at every size tried.
pub fn fft_error(m: usize) -> f64 {
    let mu = 4.0 * U;
    let g4 = 4.0 * U / (1.0 - 4.0 * U);
    let eta = 4.0 * (mu + g4 * (2f64.sqrt() + mu));
    let levels = (m.max(2) as f64).log2() + 2.0;
    let x = levels * eta;
    x / (1.0 - x)
}

/// One part tilted by e^{t·j} (j the absolute grid index): its atoms p_j·e^{t·j − c} with
/// c = log Σ p_j·e^{t·j} (so that they sum to about 1), and the bound r on each tilted atom's
/// relative rounding error (the exponent's rounding and exp's).
struct Tilted {
    pld: DiscretePld,
    log_scale: f64,
    rel: f64,
}

fn tilt_part(p: &DiscretePld, t: f64) -> Tilted {
    if t == 0.0 {
        return Tilted {
            pld: DiscretePld {
                inf_mass: 0.0,
                excess: 0.0,
                ..p.clone()
            },
            log_scale: 0.0,
            rel: 0.0,
        };
    }
    let e = |k: usize| t * (p.offset + k as i64) as f64;
    let mx = p
        .probs
        .iter()
        .enumerate()
        .filter(|(_, &x)| x > 0.0)
        .map(|(k, &x)| x.ln() + e(k))
        .fold(f64::NEG_INFINITY, f64::max);
    // log Σ p_j e^{t j}, the terms relative to the largest (any constant is exact: the untilted
    // result is rescaled by the same constant, so only its size matters).
    let mut s = 0.0f64;
    let mut big = 0.0f64;
    for (k, &x) in p.probs.iter().enumerate() {
        if x > 0.0 {
            s += (x.ln() + e(k) - mx).exp();
            big = big.max(e(k).abs());
        }
    }
    let c = if mx.is_finite() { mx + s.ln() } else { 0.0 };
    let probs: Vec<f64> = p
        .probs
        .iter()
        .enumerate()
        .map(|(k, &x)| if x > 0.0 { x * (e(k) - c).exp() } else { 0.0 })
        .collect();
    // The exponent t·j − c is rounded at most twice (relative u each, of |t·j| + |c|), exp adds
    // at most 1 ulp and the product 1 ulp.
    let rel = 4.0 * U * (big + c.abs() + 2.0);
    Tilted {
        pld: DiscretePld {
            interval: p.interval,
            offset: p.offset,
            probs,
            inf_mass: 0.0,
            excess: 0.0,
        },
        log_scale: c,
        rel,
    }
}

/// `compose` under the exponential tilt e^{t·j} (t ≥ 0, per grid index j), with every part
/// placed `jitter` positions further along the cyclic buffer (the same exact result, rounded
/// differently: tests use it).
///
/// Tilting (exponential change of measure): if each part's finite atoms p_{s,j} are replaced by
/// p̃_{s,j} = p_{s,j}·e^{t·j − c_s}, the composition of the p̃ is the composition of the p times
/// e^{t·J − Σ c_s} at every index J, exactly. The transform's rounding is an absolute error of
/// about u·log m relative to the largest atoms of what it composes; untilted, that is an error
/// at the scale of the bulk of the composed PLD, which at δ ≈ 1e-10 and 10⁴–10⁵ steps is as
/// large as the tail that δ sums (it made ε too small by 0.3%). With t at the saddle point of
/// the target (the tilted distribution centred at the ε sought) the tail is the bulk of the
/// tilted composition, and the same absolute error is a relative error of order u·T·log m there.
///
/// The rounding is then bounded, not estimated: `spectrum` carries a certified ℓ2 bound on the
/// error of the powered product of transforms (each transform by [`fft_error`], powers and
/// products by their rounding and by |a^c − b^c| ≤ c·|a − b|·max(|a|, |b|)^{c−1}), the inverse
/// adds its own, and ‖·‖_∞ ≤ ‖·‖₂ gives a bound E on every atom. The atoms returned are
/// (ŷ + E)·e^{Σ c_s − t·J} (pessimistic) or (ŷ − E − wrapped)₊·e^{Σ c_s − t·J} (optimistic),
/// each widened by the relative rounding of the tilt and of the rescaling: certified bounds on
/// the exact composition's atoms, so that δ(ε) computed from them bounds the true δ(ε).
pub(crate) fn compose_tilted(
    parts: &[Part<'_>],
    tilt: f64,
    tail_hi: f64,
    tail_lo: f64,
    max_bins: usize,
    pessimistic: bool,
    jitter: i64,
) -> DpResult<Composed> {
    let interval = parts[0].pld.interval;
    if !(tilt >= 0.0 && tilt.is_finite()) {
        return Err(DpError::param("tilt", "must be finite and >= 0"));
    }
    // The +∞ atom: every step must keep its finite part for the composition to stay finite.
    let log_keep: f64 = parts
        .iter()
        .map(|p| p.count * (-p.pld.inf_mass).ln_1p())
        .sum();
    let mut inf_mass = -log_keep.exp_m1();
    let tilted: Vec<Tilted> = parts.par_iter().map(|p| tilt_part(p.pld, tilt)).collect();
    let tparts: Vec<Part<'_>> = tilted
        .iter()
        .zip(parts)
        .map(|(t, p)| Part {
            pld: &t.pld,
            count: p.count,
        })
        .collect();
    // Σ c_s·log-scale, and the relative error R of a composed atom from the tilted atoms'
    // rounding ((1 + r)^T − 1 over the T atoms of a product).
    let log_total: f64 = tilted.iter().zip(parts).map(|(t, p)| p.count * t.log_scale).sum();
    let log_total_abs: f64 = tilted.iter().zip(parts).map(|(t, p)| (p.count * t.log_scale).abs()).sum();
    let big_r: f64 = tilted
        .iter()
        .zip(parts)
        .map(|(t, p)| p.count * (t.rel + 2.0 * U))
        .sum::<f64>()
        .exp_m1();
    // The window. Below: the tilted Chernoff bound (what lies below is not represented; the
    // callers check that the answer is above it). The transform's buffer holds the tilted
    // measure up to its Chernoff bound at TILTED_TOP, so that what wraps onto the atoms near the
    // target is negligible next to them; the atoms reported stop at the lower of that and the
    // untilted bound at the caller's budget (the untilted mass above goes to +∞).
    let top = if pessimistic { TILTED_TOP_PESSIMISTIC } else { TILTED_TOP };
    let tail_top = if tilt > 0.0 { tail_hi.min(top) } else { tail_hi };
    let tail_bot = if tilt > 0.0 { tail_lo.min(TILTED_TAIL) } else { tail_lo };
    let (cgf_hi, cgf_lo) = (Cgf::new(&tparts, true), Cgf::new(&tparts, false));
    let (tmin, tmax) = tparts.iter().fold((0.0f64, 0.0f64), |(a, b), p| {
        let lo = p.pld.offset as f64;
        let hi = (p.pld.offset + p.pld.probs.len() as i64 - 1) as f64;
        (a + p.count * lo, b + p.count * hi)
    });
    let (a, below) = cgf_lo.bound(tail_bot, false, tmin);
    let (b_buf, above) = cgf_hi.bound(tail_top, true, tmax);
    let b_buf = b_buf.max(a);
    // (the last atom reported, the untilted finite mass above it)
    let (b, above_untilted) = {
        let conv = if above > 0.0 { (above.ln() + log_total - tilt * (b_buf + 1.0)).exp() } else { 0.0 };
        if tilt > 0.0 {
            let (bu, above_u) = Cgf::new(parts, true).bound(tail_hi, true, tmax);
            if bu < b_buf && bu >= a {
                (bu, above_u)
            } else {
                (b_buf, conv)
            }
        } else {
            (b_buf, conv)
        }
    };
    // The Chernoff bounds are computed in floating point: a margin for their rounding.
    let (above, below, above_untilted) = (above * (1.0 + 1e-9), below * (1.0 + 1e-9), above_untilted * (1.0 + 1e-9));
    let buf_width = b_buf - a + 1.0;
    if !(buf_width.is_finite() && buf_width >= 1.0) {
        return Err(DpError::param(
            "events",
            "privacy loss distribution could not be bounded",
        ));
    }
    if buf_width > max_bins as f64 {
        return Err(DpError::GridTooLarge { bins: buf_width });
    }
    let width = (b - a + 1.0) as usize;
    let a = a as i64;
    let m = fast_len(buf_width as usize + 16);
    let inv = plans(m).1;
    let nf = m / 2 + 1;
    // Each part is centred on its mean (an integer shift) so that the phases raised to the
    // count stay small where the transform is large.
    let shifts: Vec<i64> = tparts
        .iter()
        .map(|p| {
            let mass: f64 = p.pld.probs.iter().sum();
            let mean: f64 = p
                .pld
                .probs
                .iter()
                .enumerate()
                .map(|(k, &x)| k as f64 * x)
                .sum::<f64>()
                / mass.max(f64::MIN_POSITIVE);
            p.pld.offset + mean.round() as i64 + jitter
        })
        .collect();
    let Spectrum { mut spec, err, norm } = spectrum(&tparts, &shifts, m)?;
    // The real transform's DC and Nyquist bins must be real (the exact ones are: zeroing the
    // imaginary parts only removes error).
    spec[0].im = 0.0;
    if m % 2 == 0 {
        spec[nf - 1].im = 0.0;
    }
    let mut out = try_filled(m, 0.0f64)?;
    inv.process(&mut spec, &mut out)
        .map_err(|e| DpError::param("fft", e.to_string()))?;
    let scale = 1.0 / m as f64;
    // Index J of the composition sits at (J − Σ c_s·sh_s) mod M.
    let total_shift: i128 = tparts
        .iter()
        .zip(shifts.iter())
        .map(|(p, &s)| p.count as i128 * s as i128)
        .sum();
    let pos = |j: i64| -> usize { ((j as i128 - total_shift).rem_euclid(m as i128)) as usize };
    let raw: Vec<f64> = (0..width).map(|i| out[pos(a + i as i64)] * scale).collect();
    let peak = raw.iter().fold(0.0f64, |x, &y| x.max(y.abs()));
    // The inverse of the half spectrum: ‖ŷ − y‖₂ ≤ (√2/√m)·(‖Ŷ − Y‖₂ + η_m·‖Ŷ‖₂) (both norms
    // over the half spectrum; the full one is at most √2 times as large), plus the scaling.
    let floor = (2f64.sqrt() / (m as f64).sqrt()) * (err + fft_error(m) * norm) * (1.0 + 8.0 * U) + 2.0 * U * peak;
    let floor = floor * (1.0 + 1e-6);
    // Atoms raised to zero by clamping (pessimistic) or by discretisation (optimistic) are
    // extra mass; for the optimistic bound it is subtracted from δ with the wrapped tail.
    let excess: f64 = parts
        .iter()
        .map(|p| p.count * p.pld.excess)
        .sum::<f64>()
        .exp_m1();
    // Untilt: atom J is v·e^{Σ c − t·J}, computed in logs; its relative rounding (the exponent's
    // terms rounded, ln and exp) is bounded by rho.
    let untilt = |v: f64, j: i64, up: bool| -> f64 {
        if !(v > 0.0) {
            return 0.0;
        }
        let tj = tilt * j as f64;
        let x = v.ln() + log_total - tj;
        let rho = 4.0 * U * (v.ln().abs() + log_total_abs + tj.abs() + 4.0) * (1.0 + parts.len() as f64 * U)
            + 4.0 * U;
        let w = x.exp();
        if up {
            (w * (1.0 + rho) * (1.0 + big_r)).min(1.0)
        } else {
            (w * (1.0 - rho) * (1.0 - big_r)).max(0.0)
        }
    };
    let mut probs = try_filled(width, 0.0f64)?;
    if pessimistic {
        probs.par_iter_mut().zip(raw.par_iter()).enumerate().for_each(|(i, (p, &y))| {
            *p = untilt(y + floor, a + i as i64, true);
        });
        // Mass above the window goes to +∞ (its wrapped copy inside the window is extra mass);
        // untilted, the tilted mass `above` at indices > b weighs at most e^{Σ c − t·(b+1)}.
        // Atoms that underflowed to 0 untilted (each below the smallest normal).
        let underflow = width as f64 * f64::MIN_POSITIVE;
        inf_mass = (inf_mass + above_untilted + underflow).min(1.0);
    } else {
        // Mass from outside the window may have wrapped onto any atom: at most `above` and
        // `below` (tilted) on each; removed with the rounding bound.
        // Mass from outside the buffer may have wrapped onto any atom: at most `above` and
        // `below` (tilted) on each; removed with the rounding bound.
        let cut = floor + above + below;
        probs.par_iter_mut().zip(raw.par_iter()).enumerate().for_each(|(i, (p, &y))| {
            *p = untilt(y - cut, a + i as i64, false);
        });
    }
    Ok(Composed {
        pld: DiscretePld {
            interval,
            offset: a,
            probs,
            inf_mass,
            excess: 0.0,
        },
        wrapped_in: excess,
        noise_floor: floor,
        tilt,
        log_scale: log_total,
    })
}

/// Below this magnitude a frequency of the composition's transform is dropped (set to 0): that
/// changes it by less than DEAD (counted in the error bound).
const DEAD: f64 = 1e-60;

/// How far below the saddle point the tilt is set, in tilted standard deviations (see
/// [`choose_tilt`]).
const KAPPA: f64 = 1.0;

/// The tails of the tilted measure cut from a tilted window (its bulk sits at the target; what
/// they weigh untilted is e^{Σc − t·b} smaller).
const TILTED_TAIL: f64 = 1e-14;

/// The tilted mass above the transform's buffer: it may wrap onto any atom (subtracted from each
/// for a lower bound), at most this much.
const TILTED_TOP: f64 = 1e-10;

/// The same for an upper bound, where what wraps is extra mass (pessimistic, never unsafe): its
/// cost is a relative error of about this much over the tilted mass near the target (≥ 1e-3),
/// and a shorter transform.
const TILTED_TOP_PESSIMISTIC: f64 = 1e-7;

/// The composition's transform on the m-point grid (frequencies 0..=m/2) with a certified ℓ2
/// bound on its error over those frequencies, and its ℓ2 norm there.
struct Spectrum {
    spec: Vec<Complex64>,
    err: f64,
    norm: f64,
}

/// The computed transform X̂ of one part (at the frequencies kept), a bound e on ‖X̂ − X‖₂ there,
/// and the part's mass μ = ‖x‖₁ (|X| ≤ μ at every frequency).
struct Transformed {
    x: Vec<Complex64>,
    err: f64,
    mass: f64,
}

/// Raises a part's transform to its count: the computed powers, a bound on their ℓ2 error
/// against the exact X^c, and a bound B on |X̂^c| and |X^c| at every frequency.
///
/// |X̂^c − X^c| ≤ c·|X̂ − X|·max(|X̂|, |X|)^{c−1} (c a whole number; telescoping), with
/// max(|X̂|, |X|) ≤ μ + e; the polar power's own rounding is relative c·u·(8 + 2|log r|) + 4u
/// (log r, its product with c, exp; the angle's atan2 and its product with c).
fn powered(t: &Transformed, c: f64) -> (Vec<Complex64>, f64, f64) {
    let top = t.mass + t.err;
    let grow = if top > 1.0 { ((c - 1.0).max(0.0) * (top - 1.0).ln_1p()).exp() } else { 1.0 };
    // Per frequency in parallel; the error terms summed in order (the same whatever the threads).
    let (z, e): (Vec<Complex64>, Vec<(f64, f64)>) = t
        .x
        .par_iter()
        .map(|&s| {
            if c == 1.0 {
                return (s, (0.0, 0.0));
            }
            // z^c in polar form: |z|^c = e^{c·log|z|} (log|z| = ½·log|z|², one more rounding,
            // within the 8u below), the angle c·arg z.
            let r2 = s.norm_sqr();
            let zero = Complex64::new(0.0, 0.0);
            if r2 == 0.0 {
                return (zero, (0.0, 0.0));
            }
            let lr = 0.5 * r2.ln();
            let mag = (c * lr).exp();
            if mag == 0.0 {
                return (zero, (0.0, 0.0));
            }
            let p = Complex64::from_polar(mag, c * s.im.atan2(s.re));
            let rel = c * U * (8.0 + 2.0 * lr.abs()) + 4.0 * U;
            let e = rel * mag * (1.0 + rel);
            (p, (e * e, rel))
        })
        .unzip();
    let pw2: f64 = e.iter().map(|x| x.0).sum();
    let pmax = e.iter().map(|x| x.1).fold(0.0f64, f64::max);
    // (a power that underflowed to 0 is off by less than 1e-300)
    let err = pw2.sqrt() * (1.0 + 1e-9) + c * grow * t.err + (t.x.len() as f64).sqrt() * 1e-300;
    let bound = top.max(1.0).powf(c) * (1.0 + pmax) * (1.0 + 1e-9);
    (z, err, bound)
}

/// The composition's transform Π_s F_s^{c_s} on the m-point grid (frequencies 0..=m/2), with
/// the certified error bound described at [`compose_tilted`].
///
/// The part whose c-fold composition spreads most (count × variance) is transformed in full
/// first: its power alone already underflows at all but the lowest frequencies (|F|^c decays
/// like a Gaussian of the composed spread), and the magnitudes of the other factors are at most
/// their masses (about 1), so the frequencies it leaves below DEAD stay negligible. The
/// other parts are transformed only at the frequencies left, 0..jn, by Bluestein's chirp-z
/// transform (a convolution of the part's length, not the window's), where that is cheaper.
fn spectrum(parts: &[Part<'_>], shifts: &[i64], m: usize) -> DpResult<Spectrum> {
    let nf = m / 2 + 1;
    let fwd = plans(m).0;
    let eta_m = fft_error(m);
    let spread: Vec<f64> = parts.iter().map(|p| p.count * variance(p.pld)).collect();
    let first = (0..parts.len())
        .max_by(|&a, &b| spread[a].partial_cmp(&spread[b]).unwrap_or(std::cmp::Ordering::Equal))
        .unwrap_or(0);
    let full = |p: &Part<'_>, sh: i64| -> DpResult<Transformed> {
        let mut buf = try_filled(m, 0.0f64)?;
        for (k, &x) in p.pld.probs.iter().enumerate() {
            let pos = (p.pld.offset + k as i64 - sh).rem_euclid(m as i64) as usize;
            buf[pos] += x;
        }
        let l2 = buf.iter().map(|x| x * x).sum::<f64>().sqrt() * (1.0 + 1e-9);
        let mass = buf.iter().sum::<f64>() * (1.0 + 1e-9);
        let mut spec = fwd.make_output_vec();
        fwd.process(&mut buf, &mut spec)
            .map_err(|e| DpError::param("fft", e.to_string()))?;
        // ‖X‖₂ = √m·‖x‖₂ over the full spectrum; the half spectrum's error is at most that.
        Ok(Transformed {
            x: spec,
            err: eta_m * (m as f64).sqrt() * l2,
            mass,
        })
    };
    let t0 = full(&parts[first], shifts[first])?;
    let (mut acc, mut err, mut bound) = powered(&t0, parts[first].count);
    let mut dropped = 0usize;
    for a in acc.iter_mut() {
        if a.norm() < DEAD {
            *a = Complex64::new(0.0, 0.0);
            dropped += 1;
        }
    }
    err += DEAD * (dropped as f64).sqrt();
    let rest: Vec<usize> = (0..parts.len()).filter(|&i| i != first).collect();
    let jn = acc.iter().rposition(|a| a.norm() > 0.0).map_or(0, |i| i + 1);
    let finish = |acc: Vec<Complex64>, err: f64| {
        let norm = acc.iter().map(|z| z.norm_sqr()).sum::<f64>().sqrt() * (1.0 + 1e-9);
        Spectrum { spec: acc, err, norm }
    };
    if rest.is_empty() || jn == 0 {
        return Ok(finish(acc, err));
    }
    let lmax = rest.iter().map(|&i| parts[i].pld.probs.len()).max().unwrap_or(1);
    let p = fast_len(lmax + jn);
    // One transform per part, in fixed chunks computed in parallel and multiplied in part order
    // (the same result whatever the threads do). Four real transforms of size p against one of
    // size m.
    let chirp = if 4 * p < m {
        Some(ChirpZ::new(m, lmax, jn, p)?)
    } else {
        None
    };
    let chunk = if chirp.is_some() { 16 } else { 4 };
    for block in rest.chunks(chunk) {
        let powered_parts: Vec<(Vec<Complex64>, f64, f64)> = block
            .par_iter()
            .map(|&i| -> DpResult<(Vec<Complex64>, f64, f64)> {
                let mut t = match &chirp {
                    Some(cz) => cz.transform(parts[i].pld, shifts[i])?,
                    None => full(&parts[i], shifts[i])?,
                };
                t.x.truncate(jn);
                Ok(powered(&t, parts[i].count))
            })
            .collect::<DpResult<_>>()?;
        for (x, ex, bx) in &powered_parts {
            // ÂX̂ − AX = (Â − A)·X̂ + A·(X̂ − X), and the product's own rounding (√2·γ₂ < 4u).
            let mut prod2 = 0.0f64;
            for (a, b) in acc.iter_mut().zip(x.iter()) {
                *a *= *b;
                prod2 += a.norm_sqr();
            }
            err = err * bx + bound * ex + 4.0 * U * prod2.sqrt() * (1.0 + 1e-9);
            bound *= bx;
        }
    }
    debug_assert!(acc.len() == nf);
    Ok(finish(acc, err))
}

/// Variance of a PLD's atoms, in grid steps² (0 for an empty one).
fn variance(p: &DiscretePld) -> f64 {
    let mass: f64 = p.probs.iter().sum();
    if !(mass > 0.0) {
        return 0.0;
    }
    let mean = p.probs.iter().enumerate().map(|(k, &x)| k as f64 * x).sum::<f64>() / mass;
    p.probs
        .iter()
        .enumerate()
        .map(|(k, &x)| x * (k as f64 - mean) * (k as f64 - mean))
        .sum::<f64>()
        / mass
}

/// e^{−iπ·r/m} for an integer r (reduced mod 2m exactly first).
fn turn(r: i128, m: usize) -> Complex64 {
    let r = r.rem_euclid(2 * m as i128) as f64;
    let (s, c) = (std::f64::consts::PI * r / m as f64).sin_cos();
    Complex64::new(c, -s)
}

/// Bluestein's chirp-z transform (Bluestein 1970; Rabiner, Schafer, Rader 1969) on the m-point
/// grid: for a sequence x of length ≤ l, X_j = Σ_k x_k·W^{jk}, W = e^{−2πi/m}, at j = 0..jn.
/// With jk = (j² + k² − (j − k)²)/2, X_j = w_j·Σ_k (x_k·w_k)·conj(w_{j−k}), w_t = W^{t²/2} =
/// e^{−iπt²/m}: one cyclic convolution of size p ≥ l + jn − 1, done with real transforms (the
/// kernel's once). Every chirp is computed from t² mod 2m exactly.
struct ChirpZ {
    m: usize,
    jn: usize,
    p: usize,
    /// w_t for t = 0..max(l, jn).
    w: Vec<Complex64>,
    /// Transforms of the real and imaginary parts of the kernel conj(w_t), t in (−l, jn).
    br: Vec<Complex64>,
    bi: Vec<Complex64>,
    fwd: std::sync::Arc<dyn realfft::RealToComplex<f64>>,
    inv: std::sync::Arc<dyn realfft::ComplexToReal<f64>>,
}

impl ChirpZ {
    fn new(m: usize, l: usize, jn: usize, p: usize) -> DpResult<Self> {
        let (fwd, inv) = plans(p);
        let n = l.max(jn);
        let w: Vec<Complex64> = (0..n).map(|t| turn((t as i128) * (t as i128), m)).collect();
        let mut kr = try_filled(p, 0.0f64)?;
        let mut ki = try_filled(p, 0.0f64)?;
        for t in 0..jn {
            kr[t] = w[t].re;
            ki[t] = -w[t].im;
        }
        for t in 1..l {
            kr[p - t] = w[t].re;
            ki[p - t] = -w[t].im;
        }
        let mut br = fwd.make_output_vec();
        let mut bi = fwd.make_output_vec();
        let err = |e: realfft::FftError| DpError::param("fft", e.to_string());
        fwd.process(&mut kr, &mut br).map_err(err)?;
        fwd.process(&mut ki, &mut bi).map_err(err)?;
        Ok(ChirpZ {
            m,
            jn,
            p,
            w,
            br,
            bi,
            fwd,
            inv,
        })
    }

    /// The transform at 0..jn of the PLD's atoms placed as the full transform places them (atom k
    /// at position offset + k − sh, mod m).
    ///
    /// Error bound (over the jn frequencies, ℓ2): each real cyclic convolution f⊛g computed by
    /// transforms of size p is off by at most ‖f‖₁·‖g‖₂·(3η_p + 4u + η_p²√p)(1 + 3η_p) per output
    /// (the transforms' errors through (1/p)·‖ΔP‖₁ ≤ (1/p)(‖ΔF‖₂‖Ĝ‖₂ + ‖F‖₂‖ΔG‖₂ + 4u‖F̂‖₂‖Ĝ‖₂),
    /// and the inverse's, with ‖F̂‖_∞ ≤ ‖f‖₁ + η_p√p‖f‖₂); a complex output sums two of them per
    /// component (‖ar‖₁ + ‖ai‖₁ ≤ √2‖x‖₁, ‖g‖₂ ≤ √L for the L kernel entries of modulus 1), and the
    /// chirp and twiddle products add 16u relative.
    fn transform(&self, pld: &DiscretePld, sh: i64) -> DpResult<Transformed> {
        let p = self.p;
        let err = |e: realfft::FftError| DpError::param("fft", e.to_string());
        let mut ar = try_filled(p, 0.0f64)?;
        let mut ai = try_filled(p, 0.0f64)?;
        for (k, &x) in pld.probs.iter().enumerate() {
            let a = self.w[k] * x;
            ar[k] = a.re;
            ai[k] = a.im;
        }
        let mut fr = self.fwd.make_output_vec();
        let mut fi = self.fwd.make_output_vec();
        self.fwd.process(&mut ar, &mut fr).map_err(err)?;
        self.fwd.process(&mut ai, &mut fi).map_err(err)?;
        // (ar + i·ai) ⊛ (br + i·bi): real part ar⊛br − ai⊛bi, imaginary part ar⊛bi + ai⊛br.
        let mut cr: Vec<Complex64> = fr
            .iter()
            .zip(fi.iter())
            .zip(self.br.iter().zip(self.bi.iter()))
            .map(|((a, b), (c, d))| a * c - b * d)
            .collect();
        let mut ci: Vec<Complex64> = fr
            .iter()
            .zip(fi.iter())
            .zip(self.br.iter().zip(self.bi.iter()))
            .map(|((a, b), (c, d))| a * d + b * c)
            .collect();
        for v in [&mut cr, &mut ci] {
            v[0].im = 0.0;
            if p % 2 == 0 {
                let last = v.len() - 1;
                v[last].im = 0.0;
            }
        }
        let mut or = try_filled(p, 0.0f64)?;
        let mut oi = try_filled(p, 0.0f64)?;
        self.inv.process(&mut cr, &mut or).map_err(err)?;
        self.inv.process(&mut ci, &mut oi).map_err(err)?;
        let scale = 1.0 / p as f64;
        // Atom k sits at position a + k, a = offset − sh: a factor W^{j·a} on X_j.
        let a0 = (pld.offset - sh) as i128;
        let x: Vec<Complex64> = (0..self.jn)
            .map(|j| {
                let y = Complex64::new(or[j], oi[j]) * scale * self.w[j];
                y * turn(2 * (j as i128) * a0, self.m)
            })
            .collect();
        let mass = pld.probs.iter().sum::<f64>() * (1.0 + 1e-9);
        let eta = fft_error(p);
        let kappa = (3.0 * eta + 4.0 * U + eta * eta * (p as f64).sqrt()) * (1.0 + 3.0 * eta);
        let l = (pld.probs.len() + self.jn) as f64;
        let norm = x.iter().map(|z| z.norm_sqr()).sum::<f64>().sqrt();
        let err = (self.jn as f64).sqrt() * (2.0 * 2f64.sqrt() * kappa * l.sqrt() * mass + 2.0 * U * mass) * (1.0 + 16.0 * U)
            + 16.0 * U * norm;
        Ok(Transformed {
            x,
            err: err * (1.0 + 1e-9),
            mass,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_len_is_smooth_and_large_enough() {
        for n in [1usize, 7, 100, 1000, 4097, 100_000] {
            let m = fast_len(n);
            assert!(m >= n && m < 2 * n + 2);
            let mut v = m;
            while v % 2 == 0 {
                v /= 2;
            }
            while v % 3 == 0 {
                v /= 3;
            }
            assert_eq!(v, 1);
        }
    }

    #[test]
    fn self_composition_matches_direct_convolution() {
        // Two atoms: binomial distribution after T steps.
        let p = DiscretePld {
            interval: 0.1,
            offset: -1,
            probs: vec![0.7, 0.0, 0.3],
            inf_mass: 0.0,
            excess: 0.0,
        };
        let c = compose(
            &[Part {
                pld: &p,
                count: 20.0,
            }],
            1e-30,
            1e-30,
            1 << 20,
            true,
        )
        .unwrap();
        // Index J = −20 + 2·(number of upper atoms): the certified atoms bracket the binomial.
        let binom = binomial(20, 0.3);
        for k in 0..=20usize {
            let j = -20 + 2 * k as i64;
            let idx = (j - c.pld.offset) as usize;
            assert!(c.pld.probs[idx] >= binom[k] * (1.0 - 1e-13), "{k}");
            assert!((c.pld.probs[idx] - binom[k]).abs() < 1e-11, "{k}");
        }
        let total: f64 = c.pld.probs.iter().sum::<f64>() + c.pld.inf_mass;
        assert!(total >= 1.0 - 1e-12 && total < 1.0 + 1e-9);
    }

    /// log P[Bin(n, p) = k] for k = 0..=n, in log space (exact to ~1e-14 relative).
    fn log_binomial(n: usize, p: f64) -> Vec<f64> {
        let mut lf = vec![0.0f64; n + 1];
        for i in 1..=n {
            lf[i] = lf[i - 1] + (i as f64).ln();
        }
        (0..=n)
            .map(|k| lf[n] - lf[k] - lf[n - k] + k as f64 * p.ln() + (n - k) as f64 * (-p).ln_1p())
            .collect()
    }

    fn binomial(n: usize, p: f64) -> Vec<f64> {
        log_binomial(n, p).into_iter().map(f64::exp).collect()
    }

    #[test]
    fn tilted_compositions_bracket_the_exact_one_far_in_the_tail() {
        // 20 000 steps of a two-atom PLD (losses 0 and 1 grid step): the composition is
        // Bin(20000, 0.01), known in closed form down to 1e-300. Untilted, the transform's
        // rounding (~1e-16 of the bulk) swamps every atom beyond ~12 standard deviations, the
        // regime where the ε at δ ≈ 1e-10 is decided after 10⁴–10⁵ steps. Tilted towards an
        // index, the upper atoms stay above the exact ones everywhere, the lower atoms below,
        // and both are within 1e-6 relative of it near that index.
        let (n, q) = (20_000usize, 0.01);
        let p = DiscretePld {
            interval: 1e-2,
            offset: 0,
            probs: vec![1.0 - q, q],
            inf_mass: 0.0,
            excess: 0.0,
        };
        let exact = log_binomial(n, q);
        let parts = [Part {
            pld: &p,
            count: n as f64,
        }];
        for &centre in &[260usize, 300, 400, 520] {
            let t = choose_tilt(&parts, Target::Epsilon(centre as f64 * p.interval));
            assert!(t > 0.0);
            let up = compose_tilted(&parts, t, 1e-300, 1e-300, 1 << 20, true, 0).unwrap();
            let lo = compose_tilted(&parts, t, 1e-300, 1e-300, 1 << 20, false, 0).unwrap();
            for (c, pess) in [(&up, true), (&lo, false)] {
                for (i, &v) in c.pld.probs.iter().enumerate() {
                    let j = c.pld.offset + i as i64;
                    if j < 0 || j as usize > n {
                        continue;
                    }
                    let e = exact[j as usize];
                    if e < -700.0 {
                        continue;
                    }
                    let e = e.exp();
                    if pess {
                        assert!(v >= e * (1.0 - 1e-12), "centre {centre} atom {j}: {v:e} < {e:e}");
                    } else {
                        assert!(v <= e * (1.0 + 1e-12), "centre {centre} atom {j}: {v:e} > {e:e}");
                    }
                    if (j - centre as i64).abs() <= 20 {
                        assert!((v / e - 1.0).abs() < 1e-6, "centre {centre} atom {j}: {v:e} vs {e:e}");
                    }
                }
            }
            // Untilted, the atom at the centre is lost in the rounding floor (bounded, so the
            // upper atom is still above the exact one, but useless).
            let flat = compose_tilted(&parts, 0.0, 1e-300, 1e-300, 1 << 20, true, 0).unwrap();
            let i = (centre as i64 - flat.pld.offset) as usize;
            let e = exact[centre].exp();
            assert!(flat.pld.probs[i] >= e);
            if centre >= 400 {
                assert!(flat.pld.probs[i] > 1e3 * e, "{centre}");
            }
        }
    }

    #[test]
    fn fft_error_bound_holds_with_room_on_every_size() {
        // The transform's error against compensated direct sums with exactly reduced twiddles,
        // for non-negative inputs (PLD atoms) of sizes with factors 2 and 3: far below
        // `fft_error`, which the certified floor uses.
        let mut planner = RealFftPlanner::<f64>::new();
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        for &m in &[64usize, 96, 243, 512, 729, 1152, 2048, 3072] {
            let fwd = planner.plan_fft_forward(m);
            let x: Vec<f64> = (0..m).map(|k| if k % 5 == 0 { rnd() } else { rnd() * 1e-6 }).collect();
            let mut buf = x.clone();
            let mut spec = fwd.make_output_vec();
            fwd.process(&mut buf, &mut spec).unwrap();
            let mut err2 = 0.0f64;
            let mut norm2 = 0.0f64;
            for j in 0..=m / 2 {
                let (mut sr, mut cr, mut si, mut ci) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
                for (k, &v) in x.iter().enumerate() {
                    let z = turn(2 * ((j * k) % m) as i128, m) * v;
                    let t = sr + z.re;
                    cr += if sr.abs() >= z.re.abs() { (sr - t) + z.re } else { (z.re - t) + sr };
                    sr = t;
                    let t = si + z.im;
                    ci += if si.abs() >= z.im.abs() { (si - t) + z.im } else { (z.im - t) + si };
                    si = t;
                }
                let r = Complex64::new(sr + cr, si + ci);
                err2 += (spec[j] - r).norm_sqr();
                norm2 += r.norm_sqr();
            }
            let rel = (err2 / norm2).sqrt();
            assert!(rel < fft_error(m) / 50.0, "m = {m}: {rel:e} vs bound {:e}", fft_error(m));
        }
    }

    #[test]
    fn infinity_atoms_compose() {
        let p = DiscretePld {
            interval: 0.1,
            offset: 0,
            probs: vec![0.99],
            inf_mass: 0.01,
            excess: 0.0,
        };
        let c = compose(
            &[Part {
                pld: &p,
                count: 10.0,
            }],
            1e-30,
            1e-30,
            1 << 20,
            true,
        )
        .unwrap();
        assert!((c.pld.inf_mass - (1.0 - 0.99f64.powi(10))).abs() < 1e-15);
    }
}

#[cfg(test)]
mod chirp_tests {
    use super::*;
    use crate::accounting::pld::loss::{Bound, Direction, SubsampledGaussianLoss};

    /// X_j by direct, Neumaier-compensated summation with exactly reduced twiddles (reference).
    fn direct(pld: &DiscretePld, sh: i64, m: usize, jn: usize) -> Vec<Complex64> {
        (0..jn)
            .map(|j| {
                let (mut sr, mut cr, mut si, mut ci) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
                let add = |s: &mut f64, c: &mut f64, v: f64| {
                    let t = *s + v;
                    if s.abs() >= v.abs() {
                        *c += (*s - t) + v;
                    } else {
                        *c += (v - t) + *s;
                    }
                    *s = t;
                };
                for (k, &x) in pld.probs.iter().enumerate() {
                    let pos = (pld.offset + k as i64 - sh) as i128;
                    let z = turn(2 * j as i128 * pos, m) * x;
                    add(&mut sr, &mut cr, z.re);
                    add(&mut si, &mut ci, z.im);
                }
                Complex64::new(sr + cr, si + ci)
            })
            .collect()
    }

    #[test]
    fn chirp_z_matches_direct_sums_and_the_full_transform() {
        // A window much wider than each part (the case the chirp-z path is for), parts off
        // centre and with negative offsets: the chirp-z values agree with the direct sums as
        // closely as the full real transform does (both at rounding level).
        let d = 1e-3;
        let m = 3 * (1usize << 14);
        let mut planner = RealFftPlanner::<f64>::new();
        let fwd = planner.plan_fft_forward(m);
        let jn = 300usize;
        let mut plds = Vec::new();
        for i in 0..4 {
            let l = SubsampledGaussianLoss::new(0.002 + 0.01 * i as f64, 1.1, Direction::Remove);
            let (k0, k1) = l.grid(d, 1e-16, 1e-20);
            plds.push(l.discretize(d, k0, k1, Bound::Pessimistic).unwrap());
        }
        let lmax = plds.iter().map(|p| p.probs.len()).max().unwrap();
        let cz = ChirpZ::new(m, lmax, jn, fast_len(lmax + jn)).unwrap();
        for (i, p) in plds.iter().enumerate() {
            let sh = p.offset + 7 * i as i64 - 40;
            let r = direct(p, sh, m, jn);
            let c = cz.transform(p, sh).unwrap().x;
            let mut buf = vec![0.0f64; m];
            for (k, &x) in p.probs.iter().enumerate() {
                buf[(p.offset + k as i64 - sh).rem_euclid(m as i64) as usize] += x;
            }
            let mut full = fwd.make_output_vec();
            fwd.process(&mut buf, &mut full).unwrap();
            for j in 0..jn {
                assert!((c[j] - r[j]).norm() < 1e-13, "part {i} freq {j}: {} vs {}", c[j], r[j]);
                assert!((full[j] - r[j]).norm() < 1e-13, "part {i} freq {j}");
            }
        }
    }
}
