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

/// The composition's result: the PLD and how far its finite atoms may be off.
#[derive(Clone, Debug)]
pub struct Composed {
    pub pld: DiscretePld,
    /// Upper bound on mass that is in the result but not in the exact composition: the finite
    /// mass below the window that wrapped into it, and the parts' `excess`.
    pub wrapped_in: f64,
    /// Bound on the rounding error of the transform, per atom.
    pub noise_floor: f64,
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
        // Per part in parallel, summed in part order (deterministic).
        let per: Vec<f64> = self
            .logs
            .par_iter()
            .map(|(l, c)| {
                let m = l
                    .iter()
                    .map(|&(k, v)| v + lambda * k)
                    .fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    return f64::NEG_INFINITY;
                }
                let s: f64 = l.iter().map(|&(k, v)| (v + lambda * k - m).exp()).sum();
                c * (m + s.ln())
            })
            .collect();
        per.iter().sum()
    }

    /// The smallest index b with finite mass above b bounded by ≤ `tau` (upper = true), or the
    /// largest a with mass below a ≤ `tau` (upper = false), and the bound achieved.
    fn bound(&self, tau: f64, upper: bool, trivial: f64) -> (f64, f64) {
        let s = if upper { 1.0 } else { -1.0 };
        // f(λ) = (K(sλ) − log τ)/λ is unimodal in λ > 0: golden-section search on log λ.
        let f = |ll: f64| {
            let lam = ll.exp();
            (self.k(s * lam) - tau.ln()) / lam
        };
        let (mut lo, mut hi) = ((1e-9f64).ln(), (30.0f64).ln());
        let g = 0.5 * (5f64.sqrt() - 1.0);
        let mut x1 = hi - g * (hi - lo);
        let mut x2 = lo + g * (hi - lo);
        let (mut f1, mut f2) = (f(x1), f(x2));
        for _ in 0..28 {
            if f1 <= f2 {
                hi = x2;
                x2 = x1;
                f2 = f1;
                x1 = hi - g * (hi - lo);
                f1 = f(x1);
            } else {
                lo = x1;
                x1 = x2;
                f1 = f2;
                x2 = lo + g * (hi - lo);
                f2 = f(x2);
            }
        }
        let (ll, v) = if f1 <= f2 { (x1, f1) } else { (x2, f2) };
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

/// Composes the parts (all on the same grid interval). `tail_hi`: the mass budget above the
/// window that moves to +∞; `tail_lo`: below the window. `max_bins` caps the window; beyond it
/// an error tells the caller to coarsen the grid.
pub fn compose(
    parts: &[Part<'_>],
    tail_hi: f64,
    tail_lo: f64,
    max_bins: usize,
    pessimistic: bool,
) -> DpResult<Composed> {
    compose_shifted(parts, tail_hi, tail_lo, max_bins, pessimistic, 0)
}

/// `compose`, with every part placed `jitter` positions further along the cyclic buffer: the
/// same exact result, rounded differently (tests measure the rounding with it).
pub(crate) fn compose_shifted(
    parts: &[Part<'_>],
    tail_hi: f64,
    tail_lo: f64,
    max_bins: usize,
    pessimistic: bool,
    jitter: i64,
) -> DpResult<Composed> {
    let interval = parts[0].pld.interval;
    // The +∞ atom: every step must keep its finite part for the composition to stay finite.
    let log_keep: f64 = parts
        .iter()
        .map(|p| p.count * (-p.pld.inf_mass).ln_1p())
        .sum();
    let mut inf_mass = -log_keep.exp_m1();
    let (cgf_hi, cgf_lo) = (Cgf::new(parts, true), Cgf::new(parts, false));
    let (tmin, tmax) = parts.iter().fold((0.0f64, 0.0f64), |(a, b), p| {
        let lo = p.pld.offset as f64;
        let hi = (p.pld.offset + p.pld.probs.len() as i64 - 1) as f64;
        (a + p.count * lo, b + p.count * hi)
    });
    let (b, above) = cgf_hi.bound(tail_hi, true, tmax);
    let (a, below) = cgf_lo.bound(tail_lo, false, tmin);
    let width = b - a + 1.0;
    if !(width.is_finite() && width >= 1.0) {
        return Err(DpError::param(
            "events",
            "privacy loss distribution could not be bounded",
        ));
    }
    if width > max_bins as f64 {
        return Err(DpError::GridTooLarge { bins: width });
    }
    let width = width as usize;
    let a = a as i64;
    let m = fast_len(width + 16);
    let mut planner = RealFftPlanner::<f64>::new();
    let inv = planner.plan_fft_inverse(m);
    let nf = m / 2 + 1;
    // Each part is centred on its mean (an integer shift) so that the phases raised to the
    // count stay small where the transform is large.
    let shifts: Vec<i64> = parts
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
    let spec = spectrum(parts, &shifts, m, &mut planner)?;
    let (mut spec, dropped) = spec;
    // The real transform's DC and Nyquist bins must be real.
    spec[0].im = 0.0;
    if m % 2 == 0 {
        spec[nf - 1].im = 0.0;
    }
    let mut out = try_filled(m, 0.0f64)?;
    inv.process(&mut spec, &mut out)
        .map_err(|e| DpError::param("fft", e.to_string()))?;
    let scale = 1.0 / m as f64;
    // Index J of the composition sits at (J − Σ c_s·sh_s) mod M.
    let total_shift: i128 = parts
        .iter()
        .zip(shifts.iter())
        .map(|(p, &s)| p.count as i128 * s as i128)
        .sum();
    let pos = |j: i64| -> usize { ((j as i128 - total_shift).rem_euclid(m as i128)) as usize };
    let mut probs = try_filled(width, 0.0f64)?;
    for (i, p) in probs.iter_mut().enumerate() {
        *p = (out[pos(a + i as i64)] * scale).max(0.0);
    }
    // Rounding noise per atom. The transform's own error is O(log₂M·u·‖f‖₂) per atom; raising
    // a transform to the power c multiplies its relative error by c where |r(ω)| ≈ 1. Measured
    // against the same composition placed one position further (tests), this bound is above
    // the observed difference by 10× to 600× from T = 1 to 10⁶.
    let l2: f64 = probs.iter().map(|x| x * x).sum::<f64>().sqrt();
    let reps: f64 = parts.iter().map(|p| p.count).sum();
    let noise_floor = f64::EPSILON * l2 * (reps + 4.0 * (m as f64).log2());
    // Atoms raised to zero by clamping (pessimistic) or by discretisation (optimistic) are
    // extra mass; for the optimistic bound it is subtracted from δ with the wrapped tail.
    let excess: f64 = parts
        .iter()
        .map(|p| p.count * p.pld.excess)
        .sum::<f64>()
        .exp_m1();
    // Pessimistic: mass above the window goes to +∞ (its wrapped copy inside the window is
    // extra mass). Optimistic: it is dropped or wrapped downward, both of which lower δ.
    // The frequencies dropped as negligible change each atom by at most `dropped`: that much
    // per atom goes to +∞ as well.
    if pessimistic {
        inf_mass = (inf_mass + above * log_keep.exp() + dropped * width as f64).min(1.0);
    }
    Ok(Composed {
        pld: DiscretePld {
            interval,
            offset: a,
            probs,
            inf_mass,
            excess: 0.0,
        },
        wrapped_in: below + excess,
        noise_floor,
    })
}

/// Below this magnitude a frequency of the composition's transform is dropped (set to 0): the
/// inverse transform then moves each atom by at most 2·DEAD (accounted at +∞).
const DEAD: f64 = 1e-60;

/// The composition's transform Π_s F_s^{c_s} on the m-point grid (frequencies 0..=m/2), and the
/// most any atom of its inverse can move from the frequencies dropped (|·| < DEAD).
///
/// The part whose c-fold composition spreads most (count × variance) is transformed in full
/// first: its power alone already underflows at all but the lowest frequencies (|F|^c decays
/// like a Gaussian of the composed spread), and the magnitudes of the other factors are at most
/// 1 (each part's mass is at most 1), so the frequencies it leaves below DEAD stay there. The
/// other parts are transformed only at the frequencies left, 0..jn, by Bluestein's chirp-z
/// transform (a convolution of the part's length, not the window's), where that is cheaper.
fn spectrum(
    parts: &[Part<'_>],
    shifts: &[i64],
    m: usize,
    planner: &mut RealFftPlanner<f64>,
) -> DpResult<(Vec<Complex64>, f64)> {
    let nf = m / 2 + 1;
    let fwd = planner.plan_fft_forward(m);
    let spread: Vec<f64> = parts.iter().map(|p| p.count * variance(p.pld)).collect();
    let first = (0..parts.len())
        .max_by(|&a, &b| spread[a].partial_cmp(&spread[b]).unwrap_or(std::cmp::Ordering::Equal))
        .unwrap_or(0);
    let full = |p: &Part<'_>, sh: i64| -> DpResult<Vec<Complex64>> {
        let mut buf = try_filled(m, 0.0f64)?;
        for (k, &x) in p.pld.probs.iter().enumerate() {
            let pos = (p.pld.offset + k as i64 - sh).rem_euclid(m as i64) as usize;
            buf[pos] += x;
        }
        let mut spec = fwd.make_output_vec();
        fwd.process(&mut buf, &mut spec)
            .map_err(|e| DpError::param("fft", e.to_string()))?;
        Ok(spec)
    };
    let mut acc = full(&parts[first], shifts[first])?;
    let mut dropped = 0.0f64;
    for a in acc.iter_mut() {
        *a = power(*a, parts[first].count);
        if a.norm() < DEAD {
            *a = Complex64::new(0.0, 0.0);
            dropped = 2.0 * DEAD;
        }
    }
    let rest: Vec<usize> = (0..parts.len()).filter(|&i| i != first).collect();
    let jn = acc.iter().rposition(|a| a.norm() > 0.0).map_or(0, |i| i + 1);
    if rest.is_empty() || jn == 0 {
        return Ok((acc, dropped));
    }
    let lmax = rest.iter().map(|&i| parts[i].pld.probs.len()).max().unwrap_or(1);
    let p = fast_len(lmax + jn);
    // One transform per part, in fixed chunks computed in parallel and multiplied in part order
    // (the same result whatever the threads do). Four real transforms of size p against one of
    // size m.
    let chirp = if 4 * p < m {
        Some(ChirpZ::new(m, lmax, jn, p, planner)?)
    } else {
        None
    };
    let chunk = if chirp.is_some() { 16 } else { 4 };
    for block in rest.chunks(chunk) {
        let powered: Vec<Vec<Complex64>> = block
            .par_iter()
            .map(|&i| -> DpResult<Vec<Complex64>> {
                let x = match &chirp {
                    Some(cz) => cz.transform(parts[i].pld, shifts[i])?,
                    None => full(&parts[i], shifts[i])?,
                };
                Ok(x[..jn].iter().map(|s| power(*s, parts[i].count)).collect())
            })
            .collect::<DpResult<_>>()?;
        for x in &powered {
            for (a, b) in acc.iter_mut().zip(x.iter()) {
                *a *= *b;
            }
        }
    }
    debug_assert!(acc.len() == nf);
    Ok((acc, dropped))
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
    fn new(m: usize, l: usize, jn: usize, p: usize, planner: &mut RealFftPlanner<f64>) -> DpResult<Self> {
        let fwd = planner.plan_fft_forward(p);
        let inv = planner.plan_fft_inverse(p);
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
    fn transform(&self, pld: &DiscretePld, sh: i64) -> DpResult<Vec<Complex64>> {
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
        Ok((0..self.jn)
            .map(|j| {
                let y = Complex64::new(or[j], oi[j]) * scale * self.w[j];
                y * turn(2 * (j as i128) * a0, self.m)
            })
            .collect())
    }
}

/// z^c for a real count c ≥ 0, in polar form.
fn power(z: Complex64, c: f64) -> Complex64 {
    if c == 1.0 {
        return z;
    }
    let r = z.norm();
    if r == 0.0 {
        return Complex64::new(0.0, 0.0);
    }
    let mag = (c * r.ln()).exp();
    if mag == 0.0 {
        return Complex64::new(0.0, 0.0);
    }
    let th = c * z.im.atan2(z.re);
    Complex64::from_polar(mag, th)
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
        // Index J = −20 + 2·(number of upper atoms).
        let mut binom = vec![0.0f64; 21];
        for k in 0..=20usize {
            let mut lc = 0.0f64;
            for i in 0..k {
                lc += ((20 - i) as f64).ln() - ((i + 1) as f64).ln();
            }
            binom[k] = (lc + k as f64 * 0.3f64.ln() + (20 - k) as f64 * 0.7f64.ln()).exp();
        }
        for k in 0..=20usize {
            let j = -20 + 2 * k as i64;
            let idx = (j - c.pld.offset) as usize;
            assert!((c.pld.probs[idx] - binom[k]).abs() < 1e-14, "{k}");
        }
        let total: f64 = c.pld.probs.iter().sum::<f64>() + c.pld.inf_mass;
        assert!((total - 1.0).abs() < 1e-12);
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
        let cz = ChirpZ::new(m, lmax, jn, fast_len(lmax + jn), &mut planner).unwrap();
        for (i, p) in plds.iter().enumerate() {
            let sh = p.offset + 7 * i as i64 - 40;
            let r = direct(p, sh, m, jn);
            let c = cz.transform(p, sh).unwrap();
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
