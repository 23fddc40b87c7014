//! Bindings of clipping without noise (rust/clip): the norms, the per-group sums a nested query
//! fuses, and the grid-rounded sums the discrete Gaussian query releases itself.

use super::common::{array, f64_arrays, on_records, Arrays};
use crate::clip;
use pyo3::prelude::*;

/// Clipped sums of several groups in one pass over the records (no noise): array k belongs to
/// group `groups[k]` (numbered 0, 1, … in array order) and group g is clipped to `clips[g]`.
/// Returns one flat float64 sum per array and the norms, group-major (G·B values). A record with
/// a NaN or infinite value in any group adds zero to every sum and has norm NaN in every group.
#[pyfunction]
#[pyo3(signature = (arrays, groups, clips, scales=None))]
fn clip_sum_groups(
    py: Python<'_>,
    arrays: Arrays<'_>,
    groups: Vec<usize>,
    clips: Vec<f64>,
    scales: Option<Vec<f64>>,
) -> PyResult<(Vec<Py<PyAny>>, Py<PyAny>)> {
    let out = on_records(py, &arrays, scales.as_deref(), Some(&groups), |rec| {
        clip::clip_sum_groups(rec, &clips)
    })?;
    Ok((f64_arrays(py, out.sums), array(py, out.norms)))
}

/// Clipped records rounded onto the grid and summed exactly (grid units, float64), the norms,
/// and how many records were rounded toward zero to meet the bound `sens_sq`. A non-finite
/// record adds zero and has norm NaN.
#[pyfunction]
#[pyo3(signature = (arrays, l2_norm_clip, granularity, sens_sq, scales=None))]
fn clip_round_sum(
    py: Python<'_>,
    arrays: Arrays<'_>,
    l2_norm_clip: f64,
    granularity: f64,
    sens_sq: u128,
    scales: Option<Vec<f64>>,
) -> PyResult<(Vec<Py<PyAny>>, Py<PyAny>, usize)> {
    let out = on_records(py, &arrays, scales.as_deref(), None, |rec| {
        clip::clip_round_sum(rec, l2_norm_clip, granularity, sens_sq)
    })?;
    Ok((f64_arrays(py, out.sums), array(py, out.norms), out.truncated))
}

/// The joint L2 norm of every record (parts divided by their scales), float64 of shape (B,);
/// NaN for a record with a NaN or infinite value.
#[pyfunction]
#[pyo3(signature = (arrays, scales=None))]
fn record_norms(
    py: Python<'_>,
    arrays: Arrays<'_>,
    scales: Option<Vec<f64>>,
) -> PyResult<Py<PyAny>> {
    let norms = on_records(py, &arrays, scales.as_deref(), None, |rec| Ok(clip::record_norms(rec)))?;
    Ok(array(py, norms))
}

/// Per array, the sum of squares of every record (float64 of shape (B,)), unscaled. Non-finite
/// values give non-finite sums; the caller treats those records. `parallel=False` keeps the work on the
/// calling thread.
#[pyfunction]
#[pyo3(signature = (arrays, parallel=true))]
fn part_sumsq(py: Python<'_>, arrays: Arrays<'_>, parallel: bool) -> PyResult<Vec<Py<PyAny>>> {
    let sums = on_records(py, &arrays, None, None, |rec| Ok(clip::part_sumsq(rec, parallel)))?;
    Ok(f64_arrays(py, sums))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_functions!(m, [clip_sum_groups, clip_round_sum, record_norms, part_sumsq]);
    Ok(())
}
