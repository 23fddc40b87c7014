//! The Gaussian sum mechanism over clipped records (McMahan et al. 2018, §1 steps 2–3; Abadi et
//! al. 2016, Algorithm 1): Σ_i clip(x_i, C) + N(0, (z·C)²·I), optionally divided by a fixed
//! denominator (the fixed-expected-denominator estimator f̃ of McMahan et al. 2018, §3).
//!
//! With joint-clipping scales α_j (§2) part j receives noise of stddev α_j·z·C: the mechanism
//! on the scaled record, scaled back. Its privacy tuple is still (C, z·C).
//!
//! A record with a NaN or ±∞ value contributes zero to the sum and its norm is NaN (see
//! `crate::clip`); the release goes ahead. Zero has norm 0 ≤ C, and replacing a record by zero is
//! the change of one record, so the tuple (C, z·C) still holds; raising instead would reveal,
//! through whether the call fails, whether that record was in the batch.

use crate::clip::{check_clip, clip_round_sum, clip_sum, ClippedSum};
use crate::discrete::{DiscreteParams, Rounding};
use crate::error::{require, DpError, DpResult};
use crate::noise::{check_stddev, noised_parts};
use rayon::prelude::*;
pub use crate::noise::Output;
use crate::records::{Column, Records};
use crate::rng::{chunk_rng, stream_id, Domain, Key, Seed};

pub fn check_noise_multiplier(z: f64) -> DpResult<()> {
    require(z.is_finite() && z >= 0.0, "noise_multiplier", "finite and >= 0", z)
}

pub fn check_denominator(d: Option<f64>) -> DpResult<f64> {
    match d {
        None => Ok(1.0),
        Some(d) if d.is_finite() && d > 0.0 => Ok(d),
        Some(d) => Err(DpError::param(
            "denominator",
            format!("must be finite and > 0, got {d}"),
        )),
    }
}

/// Noised (and optionally averaged) clipped sum, one output per part, plus the record norms
/// (NaN for a non-finite record, which contributes zero). All parameters are validated before
/// any work; on error nothing is returned.
pub fn gaussian_sum(
    records: &Records,
    l2_norm_clip: f64,
    noise_multiplier: f64,
    denominator: Option<f64>,
    seed: Seed,
) -> DpResult<(Vec<Output>, Vec<f64>)> {
    gaussian_sum_as(
        records,
        l2_norm_clip,
        noise_multiplier,
        denominator,
        seed,
        false,
    )
}

/// As `gaussian_sum`; with `f64_out` every output is f64 whatever the input type (for callers
/// that keep accumulating, such as a query's sample state).
pub fn gaussian_sum_as(
    records: &Records,
    l2_norm_clip: f64,
    noise_multiplier: f64,
    denominator: Option<f64>,
    seed: Seed,
    f64_out: bool,
) -> DpResult<(Vec<Output>, Vec<f64>)> {
    check_clip(l2_norm_clip)?;
    check_noise_multiplier(noise_multiplier)?;
    let denom = check_denominator(denominator)?;
    let stddev = noise_multiplier * l2_norm_clip;
    let max_scale = records.parts.iter().map(|p| p.scale).fold(0.0, f64::max);
    if !(stddev * max_scale).is_finite() {
        return Err(DpError::param(
            "noise_multiplier",
            "noise_multiplier * l2_norm_clip overflows",
        ));
    }
    let ClippedSum { sums, norms } = clip_sum(records, l2_norm_clip)?;
    // The key is drawn only after every parameter passed its check (records cannot fail one).
    let key = seed.key()?;
    let views: Vec<&[f64]> = sums.iter().map(|s| s.as_slice()).collect();
    let stddevs: Vec<f64> = records.parts.iter().map(|p| stddev * p.scale).collect();
    let f32_out: Vec<bool> = records
        .parts
        .iter()
        .map(|p| matches!(p.data, Column::F32(_)) && !f64_out)
        .collect();
    let outputs = noised_parts(&views, &stddevs, &vec![denom; views.len()], &f32_out, &key)?;
    Ok((outputs, norms))
}

/// The Gaussian release of sums already clipped (the last step of McMahan et al. 2018, §1
/// step 3, for every group of a nested query at once): part k of the output is
/// (sums[k] + N(0, stddevs[k]²·I)) / denominators[k], float32 where `f32_out[k]`. The noise of
/// part k comes from its own streams, so parts never share noise. Every parameter is checked
/// before the key is drawn; on error nothing is returned.
pub fn gaussian_release(
    sums: &[&[f64]],
    stddevs: &[f64],
    denominators: &[f64],
    f32_out: &[bool],
    seed: Seed,
) -> DpResult<Vec<Output>> {
    let n = sums.len();
    if stddevs.len() != n || denominators.len() != n || f32_out.len() != n {
        return Err(DpError::Shape(format!(
            "{n} sums but {} stddevs, {} denominators and {} output types",
            stddevs.len(),
            denominators.len(),
            f32_out.len()
        )));
    }
    for (&sd, &d) in stddevs.iter().zip(denominators) {
        check_stddev(sd)?;
        check_denominator(Some(d))?;
    }
    let key = seed.key()?;
    noised_parts(sums, stddevs, denominators, f32_out, &key)
}

/// Values per ChaCha20 stream of discrete noise: smaller than `NOISE_CHUNK` because each value
/// costs about forty times as much, so that the chunks balance across threads. Part of the
/// output's definition for a given seed.
const DISCRETE_CHUNK: usize = 2048;

/// Integers up to this magnitude are exact in f64 (with room for the noise).
const GRID_SUM_LIMIT: f64 = (1u64 << 52) as f64;

/// The discrete Gaussian release of sums already on the grid: part k of the output is
/// (sums[k] + Y)·grids[k] / denominator with Y_j ~ N_ℤ(0, σ²) i.i.d. (Canonne, Kamath & Steinke
/// 2020, Theorem 14), as float64. With `round_sums` the sums are in the records' units and are
/// first divided by their grid step and rounded to the nearest integer (the sensitivity of
/// `Rounding::Sum`); otherwise they must already be integers (grid units). Every value is
/// checked before the key is drawn; on error nothing is returned.
pub fn discrete_release(
    sums: &[&[f64]],
    grids: &[f64],
    params: &DiscreteParams,
    denominator: Option<f64>,
    seed: Seed,
    round_sums: bool,
) -> DpResult<Vec<Vec<f64>>> {
    let denom = check_denominator(denominator)?;
    if sums.len() != grids.len() {
        return Err(DpError::Shape(format!(
            "{} sums but {} grid steps",
            sums.len(),
            grids.len()
        )));
    }
    for (k, (s, &g)) in sums.iter().zip(grids).enumerate() {
        if !(g.is_finite() && g > 0.0) {
            return Err(DpError::param("granularity", format!("part {k}: grid step {g} is not finite and > 0")));
        }
        // An integer below 2⁵² survives the trip through i64 (a libm-free test: `fract` and
        // `round` are library calls on baseline x86-64, and this loop runs over every value).
        let bad = s.iter().position(|&v| {
            if round_sums {
                !((v / g).round().abs() <= GRID_SUM_LIMIT)
            } else {
                !(v.abs() <= GRID_SUM_LIMIT && (v as i64) as f64 == v)
            }
        });
        if let Some(j) = bad {
            return Err(DpError::param(
                "sums",
                format!(
                    "part {k}, coordinate {j}: {} is not {} within 2^52 grid steps",
                    s[j],
                    if round_sums { "finite and" } else { "an integer" }
                ),
            ));
        }
    }
    let key = seed.key()?;
    let mut outs = Vec::with_capacity(sums.len());
    for s in sums {
        let mut v = crate::error::try_with_capacity(s.len())?;
        v.extend_from_slice(s);
        outs.push(v);
    }
    noise_in_place(&mut outs, grids, params, denom, &key, round_sums);
    Ok(outs)
}

/// `discrete_release` over sums the caller owns, overwritten with the outputs (no check: the
/// caller vouches that they are integers within range, or finite when `round_sums`).
fn noise_in_place(
    sums: &mut [Vec<f64>],
    grids: &[f64],
    params: &DiscreteParams,
    denom: f64,
    key: &Key,
    round_sums: bool,
) {
    for (part, (sum, &grid)) in sums.iter_mut().zip(grids).enumerate() {
        let work = |(c, out): (usize, &mut [f64])| {
            let mut rng = chunk_rng(key, stream_id(Domain::DiscreteNoise, part, c));
            for o in out.iter_mut() {
                let k = if round_sums { (*o / grid).round() } else { *o } as i64;
                let y = params.noise.as_ref().map_or(0, |n| n.sample(&mut rng));
                *o = (k + y) as f64 * grid / denom;
            }
        };
        if sum.len() > DISCRETE_CHUNK {
            sum.par_chunks_mut(DISCRETE_CHUNK).enumerate().for_each(work);
        } else {
            sum.chunks_mut(DISCRETE_CHUNK).enumerate().for_each(work);
        }
    }
}

/// The discrete Gaussian sum mechanism: records clipped to C, rounded onto γ·ℤ^d, summed exactly,
/// plus N_ℤ(0, σ²) noise with σ·γ ≥ z·C (see `crate::discrete`); the output is float64 in the
/// records' units (multiples of γ·α_j, divided by `denominator` if given). A non-finite record
/// contributes zero (`clip_round_sum`). Returns the outputs,
/// the records' norms (NaN for non-finite records) and the parameters (granularity, sensitivity after rounding, σ) that the
/// ledger must record.
pub fn discrete_gaussian_sum(
    records: &Records,
    l2_norm_clip: f64,
    noise_multiplier: f64,
    granularity: Option<f64>,
    denominator: Option<f64>,
    seed: Seed,
) -> DpResult<(Vec<Vec<f64>>, Vec<f64>, DiscreteParams)> {
    let params = DiscreteParams::new(
        l2_norm_clip,
        noise_multiplier,
        records.dim(),
        granularity,
        Rounding::PerRecord,
    )?;
    let grids: Vec<f64> = records
        .parts
        .iter()
        .map(|p| params.granularity * p.scale)
        .collect();
    let denom = check_denominator(denominator)?;
    let mut rounded = clip_round_sum(records, l2_norm_clip, params.granularity, params.sens_sq)?;
    let key = seed.key()?;
    // The rounded sums are integers below 2⁵² by construction (`clip_round_sum` checks the
    // batch and grid against that range before summing).
    noise_in_place(&mut rounded.sums, &grids, &params, denom, &key, false);
    Ok((rounded.sums, rounded.norms, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::Part;

    #[test]
    fn discrete_release_is_on_the_grid_with_variance_zc_squared() {
        let x = vec![0.3f64; 3 * 40_000];
        let rec = Records::new(3, vec![Part::new(Column::F64(&x), 40_000)]).unwrap();
        let (out, norms, p) =
            discrete_gaussian_sum(&rec, 2.0, 1.5, None, None, Seed::Fixed(4)).unwrap();
        assert_eq!(norms.len(), 3);
        let g = p.granularity;
        let exact = (3.0 * 0.3 * (2.0 / norms[0]) / g).round_ties_even();
        let mut var = 0.0;
        for v in &out[0] {
            let k = v / g;
            assert_eq!(k.fract(), 0.0, "{v} is not on the grid {g}");
            var += ((k - exact) * g).powi(2);
        }
        var /= out[0].len() as f64;
        // (z·C)² = 9; standard error 9·√(2/40000) ≈ 0.064.
        assert!((var - 9.0).abs() < 0.35, "{var}");
        // Same seed, same bits; another seed, other noise.
        let (again, _, _) = discrete_gaussian_sum(&rec, 2.0, 1.5, None, None, Seed::Fixed(4)).unwrap();
        assert_eq!(again, out);
        let (other, _, _) = discrete_gaussian_sum(&rec, 2.0, 1.5, None, None, Seed::Fixed(5)).unwrap();
        assert_ne!(other, out);
    }

    #[test]
    fn discrete_release_checks_before_drawing() {
        let p = DiscreteParams::new(1.0, 1.0, 4, Some(0.5), Rounding::Sum).unwrap();
        let half = [0.5f64, 1.0];
        assert!(discrete_release(&[&half], &[0.5], &p, None, Seed::Os, false).is_err());
        assert!(discrete_release(&[&[f64::NAN]], &[0.5], &p, None, Seed::Os, true).is_err());
        let out = discrete_release(&[&half], &[0.5], &p, Some(2.0), Seed::Fixed(1), true).unwrap();
        for v in &out[0] {
            assert_eq!((v * 2.0 / 0.5).fract(), 0.0);
        }
    }

    #[test]
    fn empty_batch_is_pure_noise() {
        let d: [f32; 0] = [];
        let rec = Records::new(0, vec![Part::new(Column::F32(&d), 50_000)]).unwrap();
        let (out, norms) = gaussian_sum(&rec, 2.0, 1.5, None, Seed::Fixed(1)).unwrap();
        assert!(norms.is_empty());
        let Output::F32(v) = &out[0] else {
            panic!("dtype must be preserved")
        };
        let var = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64;
        // σ² = 9; the standard error of the variance estimate is 9·sqrt(2/50000) ≈ 0.057.
        assert!((var - 9.0).abs() < 0.3, "{var}");
    }

    #[test]
    fn denominator_divides_sum_and_noise() {
        let d = [3.0f64, 4.0];
        let rec = Records::new(1, vec![Part::new(Column::F64(&d), 2)]).unwrap();
        let (a, _) = gaussian_sum(&rec, 10.0, 1.0, None, Seed::Fixed(5)).unwrap();
        let (b, _) = gaussian_sum(&rec, 10.0, 1.0, Some(4.0), Seed::Fixed(5)).unwrap();
        let (Output::F64(a), Output::F64(b)) = (&a[0], &b[0]) else {
            panic!()
        };
        for (x, y) in a.iter().zip(b) {
            assert!((x / 4.0 - y).abs() < 1e-12);
        }
    }

    #[test]
    fn joint_clipping_noise_is_scaled_per_part() {
        let z = [0.0f64; 2 * 20_000];
        let parts = vec![
            Part::new(Column::F64(&z[..20_000]), 10_000),
            Part::new(Column::F64(&z[20_000..]), 10_000).with_scale(100.0),
        ];
        let rec = Records::new(2, parts).unwrap();
        let (out, _) = gaussian_sum(&rec, 1.0, 0.01, None, Seed::Fixed(2)).unwrap();
        let sd = |o: &Output| match o {
            Output::F64(v) => (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt(),
            _ => unreachable!(),
        };
        // Expected 0.01 and 1.0; relative standard error sqrt(1/(2·10⁴)) ≈ 0.7%.
        assert!((sd(&out[0]) / 0.01 - 1.0).abs() < 0.04, "{}", sd(&out[0]));
        assert!((sd(&out[1]) / 1.0 - 1.0).abs() < 0.04, "{}", sd(&out[1]));
    }

    #[test]
    fn parameters_are_checked_before_work() {
        let d = [f32::NAN; 2];
        let rec = Records::new(1, vec![Part::new(Column::F32(&d), 2)]).unwrap();
        let e = gaussian_sum(&rec, 1.0, -1.0, None, Seed::Os).unwrap_err();
        assert!(matches!(
            e,
            DpError::InvalidParameter {
                name: "noise_multiplier",
                ..
            }
        ));
        let e = gaussian_sum(&rec, 1.0, 1.0, Some(0.0), Seed::Os).unwrap_err();
        assert!(matches!(
            e,
            DpError::InvalidParameter {
                name: "denominator",
                ..
            }
        ));
        let e = gaussian_sum(&rec, 1e300, 1e10, None, Seed::Os).unwrap_err();
        assert!(matches!(
            e,
            DpError::InvalidParameter {
                name: "noise_multiplier",
                ..
            }
        ));
        // A non-finite record is not an error: it adds zero, and the release is the one of the
        // batch without it (here: of no record, pure noise), bit for bit for a seed.
        let (out, norms) = gaussian_sum(&rec, 1.0, 1.0, None, Seed::Fixed(7)).unwrap();
        assert!(norms[0].is_nan());
        let empty: [f32; 0] = [];
        let none = Records::new(0, vec![Part::new(Column::F32(&empty), 2)]).unwrap();
        let (pure, _) = gaussian_sum(&none, 1.0, 1.0, None, Seed::Fixed(7)).unwrap();
        assert_eq!(out, pure);
    }

    /// Both mechanisms release the sum without the non-finite records, bit for bit for a seed.
    #[test]
    fn non_finite_records_add_zero_to_both_mechanisms() {
        let (batch, w) = (9usize, 5000usize);
        let mut x: Vec<f64> = (0..batch * w).map(|i| ((i * 7919 % 1000) as f64 - 500.0) / 300.0).collect();
        x[2 * w + 17] = f64::NAN;
        x[6 * w] = f64::INFINITY;
        x[8 * w + w - 1] = f64::NEG_INFINITY;
        let keep: Vec<usize> = (0..batch).filter(|r| ![2, 6, 8].contains(r)).collect();
        let clean: Vec<f64> = keep.iter().flat_map(|&r| x[r * w..(r + 1) * w].iter().copied()).collect();
        let rec = Records::new(batch, vec![Part::new(Column::F64(&x), w)]).unwrap();
        let rec_clean = Records::new(keep.len(), vec![Part::new(Column::F64(&clean), w)]).unwrap();
        let (a, na) = gaussian_sum(&rec, 1.5, 0.7, Some(4.0), Seed::Fixed(3)).unwrap();
        let (b, nb) = gaussian_sum(&rec_clean, 1.5, 0.7, Some(4.0), Seed::Fixed(3)).unwrap();
        assert_eq!(a, b);
        assert_eq!(na.iter().filter(|n| n.is_nan()).count(), 3);
        assert_eq!(keep.iter().map(|&r| na[r]).collect::<Vec<_>>(), nb);
        let (a, na, pa) = discrete_gaussian_sum(&rec, 1.5, 0.7, None, None, Seed::Fixed(3)).unwrap();
        let (b, _, pb) = discrete_gaussian_sum(&rec_clean, 1.5, 0.7, None, None, Seed::Fixed(3)).unwrap();
        assert_eq!(a, b);
        assert_eq!((pa.granularity, pa.sens_sq), (pb.granularity, pb.sens_sq));
        assert!(na[2].is_nan() && na[6].is_nan() && na[8].is_nan());
    }
}
