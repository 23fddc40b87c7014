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
//! Either way the state is `per_coordinate()` values per coordinate (never the n·d history),
//! stored coordinate-major so that a chunk of coordinates owns a contiguous slice of it. The
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

/// One coordinate's recursion: w from z and the state, the state advanced.
#[inline(always)]
fn advance<T: NoiseElem>(s: &Strategy, slot: usize, st: &mut [T], z: f64) -> f64 {
    match *s {
        Strategy::Banded(c) => {
            let m = st.len();
            let mut acc = z;
            // w_{t−j} sits in slot (t − j) mod m; t's own slot holds w_{t−m}, the oldest.
            for (j, &cj) in c.iter().enumerate().skip(1) {
                acc -= cj * st[(slot + m - j) % m].to_f64();
            }
            let w = acc / c[0];
            if m > 0 {
                st[slot] = T::from_f64(w);
            }
            w
        }
        Strategy::Blt { theta, omega } => {
            let mut w = z;
            for (&om, sv) in omega.iter().zip(st.iter()) {
                w -= om * sv.to_f64();
            }
            for (&th, sv) in theta.iter().zip(st.iter_mut()) {
                *sv = T::from_f64(th * sv.to_f64() + w);
            }
            w
        }
    }
}

/// Step `step` of the correlated noise for `dim` coordinates: returns
/// `(sum + stddev·w_step) / denominator` (w alone where `sum` is None) and advances `state`
/// (`dim × per_coordinate()` values, zero before step 0) in place. Every parameter is checked
/// before anything is drawn or written; on error `state` is unchanged.
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
    parallel: bool,
) -> DpResult<Vec<T>> {
    strategy.check()?;
    check_stddev(stddev)?;
    require(denominator.is_finite() && denominator > 0.0, "denominator", "finite and > 0", denominator)?;
    let m = strategy.per_coordinate();
    if state.len() != dim * m {
        return Err(DpError::Shape(format!(
            "the state holds {} values; {dim} coordinates with {m} state values each need {}",
            state.len(),
            dim * m
        )));
    }
    if let Some(s) = sum {
        if s.len() != dim {
            return Err(DpError::Shape(format!("sum has {} values, expected {dim}", s.len())));
        }
    }
    let slot = if m == 0 { 0 } else { (step % m as u64) as usize };
    let mut out: Vec<T> = try_with_capacity(dim)?;
    {
        let spare = &mut out.spare_capacity_mut()[..dim];
        let run = |c: usize, o: &mut [MaybeUninit<T>], st: &mut [T]| {
            let mut rng = chunk_rng(key, stream_id(Domain::Noise, 0, c));
            let base = c * NOISE_CHUNK;
            let mut z = [0.0f64; BATCH];
            for (b, ob) in o.chunks_mut(BATCH).enumerate() {
                let z = &mut z[..ob.len()];
                T::standard_normals(&mut rng, z);
                for (j, (oj, &zj)) in ob.iter_mut().zip(z.iter()).enumerate() {
                    let i = b * BATCH + j;
                    let w = advance(strategy, slot, &mut st[i * m..(i + 1) * m], zj);
                    let x = sum.map_or(0.0, |s| s[base + i]);
                    oj.write(T::from_f64((x + stddev * w) / denominator));
                }
            }
        };
        if m == 0 {
            // C = I: no state (chunks_mut(0) would be meaningless).
            let f = |(c, o): (usize, &mut [MaybeUninit<T>])| run(c, o, &mut []);
            if parallel && dim > NOISE_CHUNK {
                spare.par_chunks_mut(NOISE_CHUNK).enumerate().for_each(f);
            } else {
                spare.chunks_mut(NOISE_CHUNK).enumerate().for_each(f);
            }
        } else {
            let f = |(c, (o, st)): (usize, (&mut [MaybeUninit<T>], &mut [T]))| run(c, o, st);
            if parallel && dim > NOISE_CHUNK {
                spare
                    .par_chunks_mut(NOISE_CHUNK)
                    .zip(state.par_chunks_mut(NOISE_CHUNK * m))
                    .enumerate()
                    .for_each(f);
            } else {
                spare
                    .chunks_mut(NOISE_CHUNK)
                    .zip(state.chunks_mut(NOISE_CHUNK * m))
                    .enumerate()
                    .for_each(f);
            }
        }
    }
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
            .map(|t| correlated_noise::<T>(s, &mut st, dim, t, 1.0, None, 1.0, &key(t), parallel).unwrap())
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
    fn sum_stddev_and_denominator() {
        let c = [1.0, 0.5];
        let s = Strategy::Banded(&c);
        let dim = 5;
        let sum = [1.0, 2.0, 3.0, 4.0, 5.0];
        let mut st1 = vec![0.0; dim];
        let mut st2 = vec![0.0; dim];
        for t in 0..3 {
            let w = correlated_noise::<f64>(&s, &mut st1, dim, t, 1.0, None, 1.0, &key(t), true).unwrap();
            let o = correlated_noise::<f64>(&s, &mut st2, dim, t, 2.5, Some(&sum), 4.0, &key(t), true).unwrap();
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
        assert!(correlated_noise::<f64>(&s, &mut st, 5, 0, 1.0, None, 1.0, &k, true).is_err());
        assert!(correlated_noise::<f64>(&s, &mut st, 4, 0, f64::NAN, None, 1.0, &k, true).is_err());
        assert!(correlated_noise::<f64>(&s, &mut st, 4, 0, 1.0, Some(&[0.0; 3]), 1.0, &k, true).is_err());
        assert!(correlated_noise::<f64>(&s, &mut st, 4, 0, 1.0, None, 0.0, &k, true).is_err());
        let bad = [0.0, 0.5];
        assert!(correlated_noise::<f64>(&Strategy::Banded(&bad), &mut st, 4, 0, 1.0, None, 1.0, &k, true).is_err());
        let (th, om) = ([1.0], [0.5]);
        assert!(correlated_noise::<f64>(&Strategy::Blt { theta: &th, omega: &om }, &mut st[..1], 1, 0, 1.0, None, 1.0, &k, true).is_err());
        assert_eq!(st, vec![0.25; 4]);
    }
}
