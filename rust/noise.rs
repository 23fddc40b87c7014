//! Gaussian noise from ChaCha20: the noise of the Gaussian mechanism (McMahan et al. 2018, §1,
//! step 3; Abadi et al. 2016, Algorithm 1, "add noise").
//!
//! Coordinates are generated in fixed chunks of `NOISE_CHUNK` values; chunk `c` of part `p`
//! reads its own ChaCha20 stream (see `rng`), so the bits depend on the key alone and not on the
//! number of threads.
//!
//! Samplers: float64 outputs use rand_distr's 64-bit ziggurat; float32 outputs use the 32-bit
//! ziggurat of `ziggurat.rs` (half the ChaCha20 output per sample, with 24 bits of magnitude,
//! as many as a float32 significand holds).
//!
//! Floating-point caveat (Mironov 2012): a Gaussian sampled in floating point is not exactly the
//! continuous distribution the accountant assumes. dpcore states its guarantee for the
//! continuous mechanism, as TF Privacy and Opacus do.

use crate::chacha::ChaCha20;
use crate::error::{require, try_with_capacity, DpResult};
use crate::elem::Elem;
use crate::rng::{chunk_rng, stream_id, Domain, Key};
use crate::ziggurat;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Element types that noise can be generated for, each with the sampler that suits its precision.
pub trait NoiseElem: Elem {
    /// Fills `z` with standard normal samples from `rng`.
    fn standard_normals(rng: &mut ChaCha20, z: &mut [f64]);
}

impl NoiseElem for f32 {
    fn standard_normals(rng: &mut ChaCha20, z: &mut [f64]) {
        ziggurat::fill_standard_normal(rng, z)
    }
}

impl NoiseElem for f64 {
    fn standard_normals(rng: &mut ChaCha20, z: &mut [f64]) {
        for v in z {
            *v = StandardNormal.sample(rng);
        }
    }
}

/// Samples generated per batch before they are mapped into the output.
const BATCH: usize = 256;

/// Values per independent ChaCha20 stream. Part of the output's definition: changing it changes
/// the noise a given seed produces.
pub const NOISE_CHUNK: usize = 1 << 14;

pub fn check_stddev(stddev: f64) -> DpResult<()> {
    require(stddev.is_finite() && stddev >= 0.0, "stddev", "finite and >= 0", stddev)
}

/// Writes `out[j] = map(j, σ·ξ_j)` for one chunk, ξ standard normal from stream `stream`.
#[inline]
fn fill_chunk<T: NoiseElem, F: Fn(usize, f64) -> f64>(
    key: &Key,
    stream: u64,
    stddev: f64,
    out: &mut [MaybeUninit<T>],
    map: F,
) {
    if stddev == 0.0 {
        for (j, o) in out.iter_mut().enumerate() {
            o.write(T::from_f64(map(j, 0.0)));
        }
        return;
    }
    let mut rng = chunk_rng(key, stream);
    let mut z = [0.0f64; BATCH];
    for (b, ob) in out.chunks_mut(BATCH).enumerate() {
        let z = &mut z[..ob.len()];
        T::standard_normals(&mut rng, z);
        for (j, (o, z)) in ob.iter_mut().zip(z.iter()).enumerate() {
            o.write(T::from_f64(map(b * BATCH + j, stddev * z)));
        }
    }
}

/// A vector of `n` values, chunk `c` written by `fill(c, chunk)`, in parallel when `parallel`
/// and there is more than one chunk. The memory is first touched by the workers, so its page
/// faults are taken in parallel too.
pub(crate) fn build<T: Send, F: Fn(usize, &mut [MaybeUninit<T>]) + Sync>(
    n: usize,
    chunk: usize,
    parallel: bool,
    fill: F,
) -> DpResult<Vec<T>> {
    let mut out: Vec<T> = try_with_capacity(n)?;
    let spare = &mut out.spare_capacity_mut()[..n];
    if parallel && n > chunk {
        spare
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, o)| fill(c, o));
    } else {
        spare
            .chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, o)| fill(c, o));
    }
    // SAFETY: the chunks cover 0..n and `fill` (fill_chunk) writes every value of its chunk.
    unsafe { out.set_len(n) };
    Ok(out)
}

/// `n` independent N(0, stddev²) values of type T, computed in f64 and rounded once. With
/// `parallel` false, all the work stays on the calling thread (for callers that generate noise
/// in the background of other parallel work); the values are the same either way.
pub fn gaussian<T: NoiseElem>(
    n: usize,
    stddev: f64,
    key: &Key,
    parallel: bool,
) -> DpResult<Vec<T>> {
    check_stddev(stddev)?;
    build(n, NOISE_CHUNK, parallel, |c, o| {
        fill_chunk(key, stream_id(Domain::Noise, 0, c), stddev, o, |_, e| e)
    })
}

/// The last step of the Gaussian sum mechanism for one part: `out = (sum + N(0, σ²)) / denom`,
/// rounded once from f64 to T. `part` selects the streams, so parts never share noise.
pub fn noised_part<T: NoiseElem>(
    sum: &[f64],
    stddev: f64,
    denominator: f64,
    key: &Key,
    part: usize,
) -> DpResult<Vec<T>> {
    build(sum.len(), NOISE_CHUNK, true, |c, o| {
        let s = &sum[c * NOISE_CHUNK..];
        fill_chunk(key, stream_id(Domain::Noise, part, c), stddev, o, |j, e| {
            (s[j] + e) / denominator
        })
    })
}

/// One output array, in the element type the caller asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

enum Slot<'a> {
    F32(&'a mut [MaybeUninit<f32>]),
    F64(&'a mut [MaybeUninit<f64>]),
}

/// `noised_part` for many parts at once, in one parallel region over all their chunks (parts
/// smaller than a chunk, such as the groups of a nested query, would otherwise each run alone on
/// one thread). Part k gets σ = `stddevs[k]`, is divided by `denominators[k]` and is float32 when
/// `f32_out[k]`; its values are the bits `noised_part` gives it. The caller validates the
/// parameters.
pub fn noised_parts(
    sums: &[&[f64]],
    stddevs: &[f64],
    denominators: &[f64],
    f32_out: &[bool],
    key: &Key,
) -> DpResult<Vec<Output>> {
    let mut outs = sums
        .iter()
        .zip(f32_out)
        .map(|(s, &f)| {
            Ok(if f {
                Output::F32(try_with_capacity(s.len())?)
            } else {
                Output::F64(try_with_capacity(s.len())?)
            })
        })
        .collect::<DpResult<Vec<_>>>()?;
    let total: usize = sums.iter().map(|s| s.len()).sum();
    {
        let mut tasks: Vec<(usize, usize, Slot)> = Vec::new();
        for (k, (o, s)) in outs.iter_mut().zip(sums).enumerate() {
            match o {
                Output::F32(v) => tasks.extend(
                    v.spare_capacity_mut()[..s.len()]
                        .chunks_mut(NOISE_CHUNK)
                        .enumerate()
                        .map(|(c, o)| (k, c, Slot::F32(o))),
                ),
                Output::F64(v) => tasks.extend(
                    v.spare_capacity_mut()[..s.len()]
                        .chunks_mut(NOISE_CHUNK)
                        .enumerate()
                        .map(|(c, o)| (k, c, Slot::F64(o))),
                ),
            }
        }
        let run = |(k, c, slot): (usize, usize, Slot)| {
            let s = &sums[k][c * NOISE_CHUNK..];
            let (sd, d) = (stddevs[k], denominators[k]);
            let stream = stream_id(Domain::Noise, k, c);
            let map = |j: usize, e: f64| (s[j] + e) / d;
            match slot {
                Slot::F32(o) => fill_chunk(key, stream, sd, o, map),
                Slot::F64(o) => fill_chunk(key, stream, sd, o, map),
            }
        };
        if total > NOISE_CHUNK {
            tasks.into_par_iter().with_max_len(1).for_each(run);
        } else {
            tasks.into_iter().for_each(run);
        }
    }
    for (o, s) in outs.iter_mut().zip(sums) {
        // SAFETY: the tasks covered every chunk of 0..len, and fill_chunk writes every value.
        match o {
            Output::F32(v) => unsafe { v.set_len(s.len()) },
            Output::F64(v) => unsafe { v.set_len(s.len()) },
        }
    }
    Ok(outs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::DpError;
    use crate::rng::Seed;
    use crate::testing::pool;

    #[test]
    fn noised_parts_gives_each_part_the_bits_of_noised_part() {
        let key = Seed::Fixed(9).key().unwrap();
        let a: Vec<f64> = (0..3 * NOISE_CHUNK + 5).map(|i| i as f64 * 0.25).collect();
        let b: Vec<f64> = vec![1.5; 7];
        let c: Vec<f64> = vec![];
        let outs = noised_parts(
            &[&a, &b, &c, &a],
            &[2.0, 0.0, 1.0, 0.5],
            &[1.0, 3.0, 1.0, 4.0],
            &[false, true, false, true],
            &key,
        )
        .unwrap();
        assert_eq!(outs[0], Output::F64(noised_part(&a, 2.0, 1.0, &key, 0).unwrap()));
        assert_eq!(outs[1], Output::F32(vec![0.5; 7]));
        assert_eq!(outs[2], Output::F64(vec![]));
        assert_eq!(outs[3], Output::F32(noised_part(&a, 0.5, 4.0, &key, 3).unwrap()));
    }

    #[test]
    fn moments_of_standard_noise() {
        let key = Seed::Fixed(1).key().unwrap();
        let x: Vec<f64> = gaussian(400_000, 2.0, &key, true).unwrap();
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
        // Standard errors: 2/sqrt(n) = 0.0032 for the mean, 4*sqrt(2/n) = 0.0089 for the variance.
        assert!(mean.abs() < 5.0 * 0.0032, "mean {mean}");
        assert!((var - 4.0).abs() < 5.0 * 0.0089, "var {var}");
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let key = Seed::Fixed(3).key().unwrap();
        let one = pool(1);
        let three = pool(3);
        let a: Vec<f32> = one.install(|| gaussian(100_003, 1.0, &key, true).unwrap());
        let b: Vec<f32> = three.install(|| gaussian(100_003, 1.0, &key, true).unwrap());
        assert_eq!(a, b);
        assert_eq!(a, gaussian::<f32>(100_003, 1.0, &key, false).unwrap());
    }

    #[test]
    fn parts_get_independent_streams() {
        let key = Seed::Fixed(3).key().unwrap();
        let zeros = vec![0.0; 10];
        let a: Vec<f64> = noised_part(&zeros, 1.0, 1.0, &key, 0).unwrap();
        let b: Vec<f64> = noised_part(&zeros, 1.0, 1.0, &key, 1).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn impossible_allocation_is_an_error_not_an_abort() {
        let key = Seed::Fixed(3).key().unwrap();
        assert!(matches!(
            gaussian::<f64>(usize::MAX / 16, 1.0, &key, true),
            Err(DpError::OutOfMemory { .. })
        ));
    }

    #[test]
    fn rejects_bad_stddev() {
        let key = Seed::Fixed(3).key().unwrap();
        for s in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(gaussian::<f64>(3, s, &key, true).is_err());
        }
    }
}
