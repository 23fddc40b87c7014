//! The Gaussian sum mechanism over clipped records (McMahan et al. 2018, §1 steps 2–3; Abadi et
//! al. 2016, Algorithm 1): Σ_i clip(x_i, C) + N(0, (z·C)²·I), optionally divided by a fixed
//! denominator (the fixed-expected-denominator estimator f̃ of McMahan et al. 2018, §3).
//!
//! With joint-clipping scales α_j (§2) part j receives noise of stddev α_j·z·C: the mechanism
//! on the scaled record, scaled back. Its privacy tuple is still (C, z·C).

use crate::clip::{check_clip, clip_sum, ClippedSum};
use crate::error::{DpError, DpResult};
use crate::noise::noised_part;
use crate::records::{Column, Records};
use crate::rng::Seed;

/// One output array, in the element type of the matching input.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

pub fn check_noise_multiplier(z: f64) -> DpResult<()> {
    if !(z.is_finite() && z >= 0.0) {
        return Err(DpError::param(
            "noise_multiplier",
            format!("must be finite and >= 0, got {z}"),
        ));
    }
    Ok(())
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

/// Noised (and optionally averaged) clipped sum, one output per part, plus the record norms.
/// All parameters are validated before any work; on error nothing is returned.
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
    // The key is drawn only after the records passed every check.
    let key = seed.key()?;
    let outputs = sums
        .iter()
        .zip(&records.parts)
        .enumerate()
        .map(|(k, (s, p))| {
            Ok(match p.data {
                Column::F32(_) if !f64_out => {
                    Output::F32(noised_part(s, stddev * p.scale, denom, &key, k)?)
                }
                _ => Output::F64(noised_part(s, stddev * p.scale, denom, &key, k)?),
            })
        })
        .collect::<DpResult<_>>()?;
    Ok((outputs, norms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::Part;

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
        assert_eq!(
            gaussian_sum(&rec, 1.0, 1.0, None, Seed::Os).unwrap_err(),
            DpError::NonFiniteRecord { index: 0 }
        );
    }
}
