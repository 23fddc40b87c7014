//! Bindings of the discrete Gaussian mechanism (rust/discrete). The parameters go back to Python
//! as a tuple so that a release can be rebuilt from the same inputs after the sums are taken.

use super::common::{array, detached, f64_arrays, on_records, sum_views, to_py, Arrays};
use crate::discrete::{DiscreteParams, Rounding};
use crate::mechanism::{discrete_gaussian_sum, discrete_release as release};
use crate::rng::Seed;
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

type ParamsTuple = (f64, u128, u64, u64, f64, f64);

fn params_tuple(p: &DiscreteParams) -> ParamsTuple {
    let (n, d) = p.noise.as_ref().map_or((0, 1), |n| n.variance_ratio());
    (p.granularity, p.sens_sq, n, d, p.sensitivity, p.stddev)
}

fn rounding(per_record: bool) -> Rounding {
    if per_record {
        Rounding::PerRecord
    } else {
        Rounding::Sum
    }
}

/// The discrete Gaussian mechanism's parameters: (granularity, S, σ² numerator, σ² denominator,
/// sensitivity after rounding, noise stddev), all fixed before any record is read.
#[pyfunction]
#[pyo3(signature = (l2_norm_clip, noise_multiplier, dim, granularity=None, per_record=true))]
fn discrete_params(
    l2_norm_clip: f64,
    noise_multiplier: f64,
    dim: usize,
    granularity: Option<f64>,
    per_record: bool,
) -> PyResult<ParamsTuple> {
    let p = DiscreteParams::new(l2_norm_clip, noise_multiplier, dim, granularity, rounding(per_record))
        .map_err(to_py)?;
    Ok(params_tuple(&p))
}

/// Discrete Gaussian noised clipped sum (float64 outputs), the norms (NaN for a non-finite
/// record, which adds zero), and the parameters.
#[pyfunction]
#[pyo3(signature = (arrays, l2_norm_clip, noise_multiplier, granularity=None, denominator=None, seed=None, scales=None))]
fn discrete_gaussian_sum_flat(
    py: Python<'_>,
    arrays: Arrays<'_>,
    l2_norm_clip: f64,
    noise_multiplier: f64,
    granularity: Option<f64>,
    denominator: Option<f64>,
    seed: Option<u64>,
    scales: Option<Vec<f64>>,
) -> PyResult<(Vec<Py<PyAny>>, Py<PyAny>, ParamsTuple)> {
    let seed = Seed::from_option(seed);
    let (outs, norms, p) = on_records(py, &arrays, scales.as_deref(), None, |rec| {
        discrete_gaussian_sum(rec, l2_norm_clip, noise_multiplier, granularity, denominator, seed)
    })?;
    Ok((f64_arrays(py, outs), array(py, norms), params_tuple(&p)))
}

/// The discrete Gaussian release of sums (one flat float64 array per part): grid units when
/// `round_sums` is false, the records' units (rounded here) when true. The parameters are
/// rebuilt from (l2_norm_clip, noise_multiplier, dim, granularity, per_record).
#[pyfunction]
#[pyo3(signature = (sums, part_scales, l2_norm_clip, noise_multiplier, dim, granularity, per_record, denominator=None, seed=None, round_sums=false))]
fn discrete_release(
    py: Python<'_>,
    sums: Vec<PyReadonlyArray1<'_, f64>>,
    part_scales: Vec<f64>,
    l2_norm_clip: f64,
    noise_multiplier: f64,
    dim: usize,
    granularity: f64,
    per_record: bool,
    denominator: Option<f64>,
    seed: Option<u64>,
    round_sums: bool,
) -> PyResult<Vec<Py<PyAny>>> {
    let p = DiscreteParams::new(l2_norm_clip, noise_multiplier, dim, Some(granularity), rounding(per_record))
        .map_err(to_py)?;
    let views = sum_views(&sums)?;
    let grids: Vec<f64> = part_scales.iter().map(|a| a * p.granularity).collect();
    let seed = Seed::from_option(seed);
    let outs = detached(py, || release(&views, &grids, &p, denominator, seed, round_sums))?;
    Ok(f64_arrays(py, outs))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_functions!(m, [discrete_params, discrete_gaussian_sum_flat, discrete_release]);
    Ok(())
}
