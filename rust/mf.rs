//! Correlated noise of matrix-factorization mechanisms, generated one step at a time.
//!
//! The matrix mechanism for a workload A = B·C releases B(C·x + z) (Denisov et al. 2022;
//! Choquette-Choo et al. 2022, arXiv 2211.06530, Eq. (1)); in training, step t adds
//! w_t = (C⁻¹z)_t to the clipped sum x_t, with z_t ~ N(0, I_d) fresh at every step. For a
//! lower-triangular Toeplitz C with first column c (c_0 = 1 after normalisation) w solves
//! C·w = z row by row:
//!
//! * banded, c_j = 0 for j ≥ bands (Choquette-Choo et al. 2023, arXiv 2306.08153):
//!   w_t = (z_t − Σ_{j=1}^{bands−1} c_j·w_{t−j}) / c_0, keeping the last bands − 1 vectors w;
//! * buffered linear Toeplitz, c_k = Σ_i ω_i θ_i^(k−1) for k ≥ 1 (McMahan et al. 2024, arXiv
//!   2408.08868, Eq. (3) and §2): with buffers s_i(t) = Σ_{j<t} θ_i^(t−1−j) w_j,
//!   w_t = z_t − Σ_i ω_i s_i(t), then s_i(t+1) = θ_i s_i(t) + w_t.
//!
//! Either way the state is `per_coordinate()` values per coordinate (never the n·d history).
//! Chunk `c` of coordinates owns a contiguous slice of it, slot-major within the chunk (slot k of
//! its L coordinates at `k·L ..`), so that each slot's loop vectorises. The
//! fresh z of a step comes from that step's key exactly as `noise::gaussian` draws it: chunk
//! `c` of `NOISE_CHUNK` coordinates reads ChaCha20 stream `stream_id(Noise, 0, c)`, so the
//! result depends on the key alone, never on the number of threads; with C = I the output is
//! bit for bit the independent noise of the same key.

use crate::error::{require, try_with_capacity, DpError, DpResult};
use crate::noise::{check_stddev, NoiseElem, NOISE_CHUNK};
use crate::rng::{chunk_rng, stream_id, Domain, Key};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Samples drawn per batch before they enter the recursion.
const BATCH: usize = 256;

/// A Toeplitz strategy C, by the parameters its recursion needs.
#[derive(Clone, Copy, Debug)]
pub enum Strategy<'a> {
    /// c_0 … c_(bands−1).
    Banded(&'a [f64]),
    /// c_0 = 1, c_k = Σ_i ω_i θ_i^(k−1).
    Blt { theta: &'a [f64], omega: &'a [f64] },
}

impl Strategy<'_> {
    /// Values of state per coordinate: bands − 1, or the number of buffers.
    pub fn per_coordinate(&self) -> usize {
        match self {
            Strategy::Banded(c) => c.len().saturating_sub(1),
            Strategy::Blt { theta, .. } => theta.len(),
        }
    }

    /// Finite parameters, c_0 > 0, and as many ω as θ. (The monotone coefficients that make the
    /// sensitivity exact are the strategy's concern, checked where the strategy is built.)
    pub fn check(&self) -> DpResult<()> {
        match self {
            Strategy::Banded(c) => {
                require(!c.is_empty(), "coefficients", "non-empty", "[]")?;
                require(c[0] > 0.0 && c[0].is_finite(), "coefficients[0]", "finite and > 0", c[0])?;
                for &v in c.iter() {
                    require(v.is_finite(), "coefficients", "finite", v)?;
                }
            }
            Strategy::Blt { theta, omega } => {
                if theta.len() != omega.len() {
                    return Err(DpError::Shape(format!(
                        "{} theta but {} omega",
                        theta.len(),
                        omega.len()
                    )));
                }
                for &t in theta.iter() {
                    require(t.is_finite() && t.abs() < 1.0, "theta", "finite with |theta| < 1", t)?;
                }
                for &w in omega.iter() {
                    require(w.is_finite(), "omega", "finite", w)?;
                }
            }
        }
        Ok(())
    }
}

/// Slots of state per coordinate in a chunk's state slice of `st_len` values over `len`
/// coordinates.
#[inline(always)]
fn slots(st_len: usize, len: usize) -> usize {
    st_len / len.max(1)
}

/// w from z for one batch of coordinates `i0 .. i0 + w.len()` of a chunk, reading the state
/// (not changing it): `w` holds z on entry and w on return. `st` is the chunk's state, `len`
/// values per state slot (slot-major within the chunk, so that each slot's loop runs over
/// contiguous values and vectorises).
#[inline(always)]
fn solve<T: NoiseElem>(s: &Strategy, slot: usize, st: &[T], len: usize, i0: usize, w: &mut [f64]) {
    let n = w.len();
    match *s {
        Strategy::Banded(c) => {
            let m = slots(st.len(), len);
            // w_{t−j} sits in slot (t − j) mod m; t's own slot holds w_{t−m}, the oldest.
            for (j, &cj) in c.iter().enumerate().skip(1) {
                let sl = (slot + m - j) % m;
                for (wi, vi) in w.iter_mut().zip(&st[sl * len + i0..sl * len + i0 + n]) {
                    *wi -= cj * vi.to_f64();
                }
            }
            let c0 = c[0];
            if c0 != 1.0 {
                for wi in w.iter_mut() {
                    *wi /= c0;
                }
            }
        }
        Strategy::Blt { omega, .. } => {
            for (k, &om) in omega.iter().enumerate() {
                for (wi, vi) in w.iter_mut().zip(&st[k * len + i0..k * len + i0 + n]) {
                    *wi -= om * vi.to_f64();
                }
            }
        }
    }
}

/// The state after step t from w_t, for one batch of coordinates (as [`solve`]).
#[inline(always)]
fn update<T: NoiseElem>(s: &Strategy, slot: usize, st: &mut [T], len: usize, i0: usize, w: &[f64]) {
    let n = w.len();
    match *s {
        Strategy::Banded(_) => {
            if !st.is_empty() {
                for (vi, &wi) in st[slot * len + i0..slot * len + i0 + n].iter_mut().zip(w) {
                    *vi = T::from_f64(wi);
                }
            }
        }
        Strategy::Blt { theta, .. } => {
            for (k, &th) in theta.iter().enumerate() {
                for (vi, &wi) in st[k * len + i0..k * len + i0 + n].iter_mut().zip(w) {
                    *vi = T::from_f64(th * vi.to_f64() + wi);
                }
            }
        }
    }
}

/// [`update`] with slot `up` and then [`solve`] with slot `sv` (each where given), compiled for
/// AVX2 where the CPU has it: the loops are simple enough for the compiler to
/// vectorise 4 doubles at a time instead of SSE2's 2. The arithmetic is the same (Rust never
/// fuses a multiply and an add on its own), so the bits do not depend on the CPU.
#[inline(always)]
fn batch<T: NoiseElem>(s: &Strategy, up: Option<usize>, sv: Option<usize>, st: &mut [T], len: usize, i0: usize, w: &mut [f64]) {
    #[inline(always)]
    fn plain<T: NoiseElem>(s: &Strategy, up: Option<usize>, sv: Option<usize>, st: &mut [T], len: usize, i0: usize, w: &mut [f64]) {
        if let Some(slot) = up {
            update(s, slot, st, len, i0, w);
        }
        if let Some(slot) = sv {
            solve(s, slot, st, len, i0, w);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<T: NoiseElem>(s: &Strategy, up: Option<usize>, sv: Option<usize>, st: &mut [T], len: usize, i0: usize, w: &mut [f64]) {
            plain(s, up, sv, st, len, i0, w)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { avx2(s, up, sv, st, len, i0, w) };
        }
    }
    plain(s, up, sv, st, len, i0, w)
}

/// The shared checks: the strategy, the state's size, and any per-coordinate input's.
fn check_shapes(strategy: &Strategy, state_len: usize, dim: usize, inputs: &[(&str, Option<usize>)]) -> DpResult<usize> {
    strategy.check()?;
    let m = strategy.per_coordinate();
    if state_len != dim * m {
        return Err(DpError::Shape(format!(
            "the state holds {state_len} values; {dim} coordinates with {m} state values each need {}",
            dim * m
        )));
    }
    for (what, len) in inputs {
        if let Some(len) = len.filter(|&l| l != dim) {
            return Err(DpError::Shape(format!("{what} has {len} values, expected {dim}")));
        }
    }
    Ok(m)
}

fn check_finite<T: NoiseElem>(name: &'static str, v: Option<&[T]>) -> DpResult<()> {
    if let Some(i) = v.and_then(|v| v.iter().position(|x| !x.to_f64().is_finite())) {
        return Err(DpError::param(name, format!("value {i} is not finite")));
    }
    Ok(())
}

/// Runs `f(chunk, out, state)` over the chunks of `NOISE_CHUNK` coordinates (and their state
/// slices), in parallel when asked and worth it; chunk `c`'s work depends on `c` alone.
fn over_chunks<O: Send, T: Send, F>(out: &mut [O], state: &mut [T], m: usize, parallel: bool, f: F)
where
    F: Fn(usize, &mut [O], &mut [T]) + Sync,
{
    let dim = out.len();
    if m == 0 {
        // C = I: no state (chunks_mut(0) would be meaningless).
        let g = |(c, o): (usize, &mut [O])| f(c, o, &mut []);
        if parallel && dim > NOISE_CHUNK {
            out.par_chunks_mut(NOISE_CHUNK).enumerate().for_each(g);
        } else {
            out.chunks_mut(NOISE_CHUNK).enumerate().for_each(g);
        }
    } else {
        let g = |(c, (o, st)): (usize, (&mut [O], &mut [T]))| f(c, o, st);
        if parallel && dim > NOISE_CHUNK {
            out.par_chunks_mut(NOISE_CHUNK).zip(state.par_chunks_mut(NOISE_CHUNK * m)).enumerate().for_each(g);
        } else {
            out.chunks_mut(NOISE_CHUNK).zip(state.chunks_mut(NOISE_CHUNK * m)).enumerate().for_each(g);
        }
    }
}

/// Fills one batch `w` with step t's z: drawn from the chunk's generator, or read from `fresh`.
#[inline(always)]
fn fresh_batch<T: NoiseElem>(rng: &mut Option<crate::chacha::ChaCha20>, fresh: Option<&[T]>, at: usize, w: &mut [f64]) {
    match (rng, fresh) {
        (Some(r), _) => T::standard_normals(r, w),
        (None, Some(z)) => {
            for (wi, zi) in w.iter_mut().zip(&z[at..]) {
                *wi = zi.to_f64();
            }
        }
        (None, None) => unreachable!("a chunk has either a generator or fresh noise"),
    }
}

fn chunk_generator<T>(key: &Key, fresh: Option<&[T]>, c: usize) -> Option<crate::chacha::ChaCha20> {
    fresh.is_none().then(|| chunk_rng(key, stream_id(Domain::Noise, 0, c)))
}

/// w_t = (C⁻¹z)_t for step `step` without advancing the state: the unit noise of a release
/// whose state update ([`advance_state`]) comes once the release is recorded. Read-only on
/// `state`, so it may run ahead of the release (it depends on no data). z is drawn from `key`
/// (as `correlated_noise` draws it), or taken from `fresh`.
pub fn unit_noise<T: NoiseElem>(
    strategy: &Strategy,
    state: &[T],
    dim: usize,
    step: u64,
    key: &Key,
    fresh: Option<&[T]>,
    parallel: bool,
) -> DpResult<Vec<T>> {
    let m = check_shapes(strategy, state.len(), dim, &[("the fresh noise", fresh.map(|z| z.len()))])?;
    check_finite("fresh", fresh)?;
    let slot = if m == 0 { 0 } else { (step % m as u64) as usize };
    let mut out: Vec<T> = try_with_capacity(dim)?;
    let run = |c: usize, o: &mut [MaybeUninit<T>], st: &[T]| {
        let mut rng = chunk_generator(key, fresh, c);
        let len = o.len();
        let mut w = [0.0f64; BATCH];
        for (b, ob) in o.chunks_mut(BATCH).enumerate() {
            let i0 = b * BATCH;
            let w = &mut w[..ob.len()];
            fresh_batch(&mut rng, fresh, c * NOISE_CHUNK + i0, w);
            solve(strategy, slot, st, len, i0, w);
            for (oj, &wj) in ob.iter_mut().zip(w.iter()) {
                oj.write(T::from_f64(wj));
            }
        }
    };
    let spare = &mut out.spare_capacity_mut()[..dim];
    let chunk_state = |c: usize| &state[(c * NOISE_CHUNK * m).min(state.len())..((c + 1) * NOISE_CHUNK * m).min(state.len())];
    if parallel && dim > NOISE_CHUNK {
        spare.par_chunks_mut(NOISE_CHUNK).enumerate().for_each(|(c, o)| run(c, o, chunk_state(c)));
    } else {
        spare.chunks_mut(NOISE_CHUNK).enumerate().for_each(|(c, o)| run(c, o, chunk_state(c)));
    }
    // SAFETY: the chunks cover 0..dim and `run` writes every value of its chunk.
    unsafe { out.set_len(dim) };
    Ok(out)
}

/// The state after step `step` from that step's unit noise `w` (from [`unit_noise`] on the
/// same state): s_i ← θ_i s_i + w for a BLT, the oldest slot ← w for a banded strategy. On
/// error the state is unchanged.
pub fn advance_state<T: NoiseElem>(
    strategy: &Strategy,
    state: &mut [T],
    dim: usize,
    step: u64,
    w: &[T],
    parallel: bool,
) -> DpResult<()> {
    let m = check_shapes(strategy, state.len(), dim, &[("w", Some(w.len()))])?;
    check_finite("w", Some(w))?;
    if m == 0 {
        return Ok(());
    }
    let slot = (step % m as u64) as usize;
    let run = |c: usize, st: &mut [T]| {
        let len = st.len() / m;
        let mut buf = [0.0f64; BATCH];
        for i0 in (0..len).step_by(BATCH) {
            let n = BATCH.min(len - i0);
            let b = &mut buf[..n];
            for (x, v) in b.iter_mut().zip(&w[c * NOISE_CHUNK + i0..]) {
                *x = v.to_f64();
            }
            batch(strategy, Some(slot), None, st, len, i0, b);
        }
    };
    if parallel && dim > NOISE_CHUNK {
        state.par_chunks_mut(NOISE_CHUNK * m).enumerate().for_each(|(c, st)| run(c, st));
    } else {
        state.chunks_mut(NOISE_CHUNK * m).enumerate().for_each(|(c, st)| run(c, st));
    }
    Ok(())
}

/// [`advance_state`] past step `step` with its unit noise `w`, then [`unit_noise`] of step
/// `step + 1` from the updated state (z drawn from `key`), in one pass over the state: the
/// release's buffer update and the next release's noise, both data-independent work a caller
/// runs in the background. On error the state is unchanged.
#[allow(clippy::too_many_arguments)]
pub fn advance_and_draw<T: NoiseElem>(
    strategy: &Strategy,
    state: &mut [T],
    dim: usize,
    step: u64,
    w: &[T],
    key: &Key,
    parallel: bool,
) -> DpResult<Vec<T>> {
    let m = check_shapes(strategy, state.len(), dim, &[("w", Some(w.len()))])?;
    check_finite("w", Some(w))?;
    let (slot, next) = if m == 0 {
        (0, 0)
    } else {
        ((step % m as u64) as usize, ((step + 1) % m as u64) as usize)
    };
    let mut out: Vec<T> = try_with_capacity(dim)?;
    let run = |c: usize, o: &mut [MaybeUninit<T>], st: &mut [T]| {
        let mut rng = Some(chunk_rng(key, stream_id(Domain::Noise, 0, c)));
        let base = c * NOISE_CHUNK;
        let len = o.len();
        let mut b = [0.0f64; BATCH];
        for (bi, ob) in o.chunks_mut(BATCH).enumerate() {
            let i0 = bi * BATCH;
            let b = &mut b[..ob.len()];
            for (x, v) in b.iter_mut().zip(&w[base + i0..]) {
                *x = v.to_f64();
            }
            batch(strategy, Some(slot), None, st, len, i0, b);
            fresh_batch::<T>(&mut rng, None, 0, b);
            batch(strategy, None, Some(next), st, len, i0, b);
            for (oj, &x) in ob.iter_mut().zip(b.iter()) {
                oj.write(T::from_f64(x));
            }
        }
    };
    over_chunks(&mut out.spare_capacity_mut()[..dim], state, m, parallel, run);
    // SAFETY: the chunks cover 0..dim and `run` writes every value of its chunk.
    unsafe { out.set_len(dim) };
    Ok(out)
}

/// Step `step` of the correlated noise for `dim` coordinates: returns
/// `(sum + stddev·w_step) / denominator` (w alone where `sum` is None) and advances `state`
/// (`dim × per_coordinate()` values, zero before step 0) in place. The fresh z is drawn from
/// `key`, or taken from `fresh` when given (a standard normal vector drawn ahead of the
/// release, e.g. in the background while the clipped sum is formed: z does not depend on the
/// data, only the state must advance at the release itself). Every parameter is checked before
/// anything is drawn or written; on error `state` is unchanged.
#[allow(clippy::too_many_arguments)]
pub fn correlated_noise<T: NoiseElem>(
    strategy: &Strategy,
    state: &mut [T],
    dim: usize,
    step: u64,
    stddev: f64,
    sum: Option<&[f64]>,
    denominator: f64,
    key: &Key,
    fresh: Option<&[T]>,
    parallel: bool,
) -> DpResult<Vec<T>> {
    check_stddev(stddev)?;
    require(denominator.is_finite() && denominator > 0.0, "denominator", "finite and > 0", denominator)?;
    let m = check_shapes(
        strategy,
        state.len(),
        dim,
        &[("sum", sum.map(|s| s.len())), ("the fresh noise", fresh.map(|z| z.len()))],
    )?;
    check_finite("fresh", fresh)?;
    let slot = if m == 0 { 0 } else { (step % m as u64) as usize };
    let mut out: Vec<T> = try_with_capacity(dim)?;
    let run = |c: usize, o: &mut [MaybeUninit<T>], st: &mut [T]| {
        let mut rng = chunk_generator(key, fresh, c);
        let base = c * NOISE_CHUNK;
        let len = o.len();
        let mut w = [0.0f64; BATCH];
        for (b, ob) in o.chunks_mut(BATCH).enumerate() {
            let i0 = b * BATCH;
            let w = &mut w[..ob.len()];
            fresh_batch(&mut rng, fresh, base + i0, w);
            batch(strategy, None, Some(slot), st, len, i0, w);
            batch(strategy, Some(slot), None, st, len, i0, w);
            for (j, (oj, &wj)) in ob.iter_mut().zip(w.iter()).enumerate() {
                let x = sum.map_or(0.0, |s| s[base + i0 + j]);
                oj.write(T::from_f64((x + stddev * wj) / denominator));
            }
        }
    };
    over_chunks(&mut out.spare_capacity_mut()[..dim], state, m, parallel, run);
    // SAFETY: the chunks cover 0..dim and `run` writes every value of its chunk.
    unsafe { out.set_len(dim) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::noise::gaussian;
    use crate::rng::Seed;
    use crate::testing::pool;

    fn key(s: u64) -> Key {
        Seed::Fixed(s).key().unwrap()
    }

    /// w for `steps` steps with fresh keys 0..steps, as rows.
    fn run<T: NoiseElem>(s: &Strategy, dim: usize, steps: u64, parallel: bool) -> Vec<Vec<T>> {
        let mut st = vec![T::from_f64(0.0); dim * s.per_coordinate()];
        (0..steps)
            .map(|t| correlated_noise::<T>(s, &mut st, dim, t, 1.0, None, 1.0, &key(t), None, parallel).unwrap())
            .collect()
    }

    /// z_t re-drawn independently (the same keys), as f64 rows.
    fn fresh(dim: usize, steps: u64) -> Vec<Vec<f64>> {
        (0..steps).map(|t| gaussian::<f64>(dim, 1.0, &key(t), true).unwrap()).collect()
    }

    /// C·w computed from the dense Toeplitz coefficients.
    fn apply_c(c: &[f64], w: &[Vec<f64>]) -> Vec<Vec<f64>> {
        (0..w.len())
            .map(|t| {
                (0..w[0].len())
                    .map(|i| (0..=t).map(|j| c.get(t - j).copied().unwrap_or(0.0) * w[j][i]).sum())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn identity_is_independent_noise() {
        let c = [1.0];
        let w = run::<f64>(&Strategy::Banded(&c), 40_000, 3, true);
        assert_eq!(w, fresh(40_000, 3));
    }

    #[test]
    fn banded_and_blt_solve_c_w_equals_z() {
        let dim = 37;
        let steps = 12;
        let z = fresh(dim, steps);
        let banded = [1.0, 0.5, 0.375, 0.3125];
        let w = run::<f64>(&Strategy::Banded(&banded), dim, steps, true);
        for (a, b) in apply_c(&banded, &w).iter().flatten().zip(z.iter().flatten()) {
            assert!((a - b).abs() < 1e-12, "{a} {b}");
        }
        let (theta, omega) = ([0.9, 0.5], [0.3, 0.2]);
        let mut c = vec![1.0];
        for k in 1..steps as i32 {
            c.push(omega.iter().zip(&theta).map(|(o, t): (&f64, &f64)| o * t.powi(k - 1)).sum::<f64>());
        }
        let w = run::<f64>(&Strategy::Blt { theta: &theta, omega: &omega }, dim, steps, true);
        for (a, b) in apply_c(&c, &w).iter().flatten().zip(z.iter().flatten()) {
            assert!((a - b).abs() < 1e-12, "{a} {b}");
        }
    }

    #[test]
    fn same_bits_whatever_the_thread_count() {
        let (theta, omega) = ([0.99, 0.7, 0.2], [0.4, 0.3, 0.1]);
        let s = Strategy::Blt { theta: &theta, omega: &omega };
        let dim = 3 * NOISE_CHUNK + 11;
        let one = pool(1).install(|| run::<f32>(&s, dim, 4, true));
        let many = pool(4).install(|| run::<f32>(&s, dim, 4, true));
        let serial = run::<f32>(&s, dim, 4, false);
        assert_eq!(one, many);
        assert_eq!(one, serial);
        let c = [1.0, 0.6, 0.2];
        let b = Strategy::Banded(&c);
        assert_eq!(pool(1).install(|| run::<f64>(&b, dim, 5, true)), pool(3).install(|| run::<f64>(&b, dim, 5, true)));
    }

    #[test]
    fn fresh_noise_given_equals_noise_drawn() {
        let (theta, omega) = ([0.9, 0.5], [0.3, 0.2]);
        let c = [1.0, 0.7, 0.3];
        for s in [Strategy::Blt { theta: &theta, omega: &omega }, Strategy::Banded(&c)] {
            let dim = 2 * NOISE_CHUNK + 5;
            let mut a = vec![0.0f32; dim * s.per_coordinate()];
            let mut b = a.clone();
            for t in 0..4u64 {
                let z = gaussian::<f32>(dim, 1.0, &key(t), true).unwrap();
                let x = correlated_noise::<f32>(&s, &mut a, dim, t, 2.0, None, 1.0, &key(t), None, true).unwrap();
                let y = correlated_noise::<f32>(&s, &mut b, dim, t, 2.0, None, 1.0, &key(99), Some(&z), true).unwrap();
                // z rounded to float32 once when drawn ahead: equal to within that rounding
                for (u, v) in x.iter().zip(&y) {
                    assert!((u - v).abs() <= 1e-5 * (1.0 + u.abs()), "{u} {v}");
                }
            }
            let bad = vec![f32::NAN; dim];
            let before = a.clone();
            assert!(correlated_noise::<f32>(&s, &mut a, dim, 4, 1.0, None, 1.0, &key(0), Some(&bad), true).is_err());
            assert!(correlated_noise::<f32>(&s, &mut a, dim, 4, 1.0, None, 1.0, &key(0), Some(&bad[1..]), true).is_err());
            assert_eq!(a, before);
        }
    }

    #[test]
    fn unit_noise_then_advance_equals_the_fused_step() {
        let (theta, omega) = ([0.95, 0.4], [0.35, 0.25]);
        let c = [1.0, 0.6, 0.3, 0.1];
        for s in [Strategy::Blt { theta: &theta, omega: &omega }, Strategy::Banded(&c)] {
            let dim = 2 * NOISE_CHUNK + 9;
            let mut a = vec![0.0f64; dim * s.per_coordinate()];
            let mut b = a.clone();
            for t in 0..6u64 {
                let x = correlated_noise::<f64>(&s, &mut a, dim, t, 1.0, None, 1.0, &key(t), None, true).unwrap();
                let frozen = b.clone();
                let w = unit_noise::<f64>(&s, &b, dim, t, &key(t), None, t % 2 == 0).unwrap();
                assert_eq!(b, frozen, "unit_noise must not touch the state");
                advance_state::<f64>(&s, &mut b, dim, t, &w, t % 3 == 0).unwrap();
                assert_eq!(x, w);
                assert_eq!(a, b);
            }
            // the update and the next step's draw in one pass: the same w and state
            let w6 = unit_noise::<f64>(&s, &b, dim, 6, &key(6), None, true).unwrap();
            let mut fused = b.clone();
            let w7 = advance_and_draw::<f64>(&s, &mut fused, dim, 6, &w6, &key(7), true).unwrap();
            advance_state::<f64>(&s, &mut b, dim, 6, &w6, true).unwrap();
            assert_eq!(w7, unit_noise::<f64>(&s, &b, dim, 7, &key(7), None, false).unwrap());
            assert_eq!(fused, b);
            let before = b.clone();
            assert!(advance_state::<f64>(&s, &mut b, dim, 6, &vec![0.0; dim - 1], true).is_err());
            assert!(advance_state::<f64>(&s, &mut b, dim, 6, &vec![f64::NAN; dim], true).is_err());
            assert_eq!(b, before);
        }
    }

    #[test]
    fn sum_stddev_and_denominator() {
        let c = [1.0, 0.5];
        let s = Strategy::Banded(&c);
        let dim = 5;
        let sum = [1.0, 2.0, 3.0, 4.0, 5.0];
        let mut st1 = vec![0.0; dim];
        let mut st2 = vec![0.0; dim];
        for t in 0..3 {
            let w = correlated_noise::<f64>(&s, &mut st1, dim, t, 1.0, None, 1.0, &key(t), None, true).unwrap();
            let o = correlated_noise::<f64>(&s, &mut st2, dim, t, 2.5, Some(&sum), 4.0, &key(t), None, true).unwrap();
            for i in 0..dim {
                assert!((o[i] - (sum[i] + 2.5 * w[i]) / 4.0).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn bad_input_leaves_the_state_alone() {
        let c = [1.0, 0.5];
        let s = Strategy::Banded(&c);
        let mut st = vec![0.25f64; 4];
        let k = key(1);
        assert!(correlated_noise::<f64>(&s, &mut st, 5, 0, 1.0, None, 1.0, &k, None, true).is_err());
        assert!(correlated_noise::<f64>(&s, &mut st, 4, 0, f64::NAN, None, 1.0, &k, None, true).is_err());
        assert!(correlated_noise::<f64>(&s, &mut st, 4, 0, 1.0, Some(&[0.0; 3]), 1.0, &k, None, true).is_err());
        assert!(correlated_noise::<f64>(&s, &mut st, 4, 0, 1.0, None, 0.0, &k, None, true).is_err());
        let bad = [0.0, 0.5];
        assert!(correlated_noise::<f64>(&Strategy::Banded(&bad), &mut st, 4, 0, 1.0, None, 1.0, &k, None, true).is_err());
        let (th, om) = ([1.0], [0.5]);
        assert!(correlated_noise::<f64>(&Strategy::Blt { theta: &th, omega: &om }, &mut st[..1], 1, 0, 1.0, None, 1.0, &k, None, true).is_err());
        assert_eq!(st, vec![0.25; 4]);
    }
}
