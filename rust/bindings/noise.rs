//! Bindings of the Gaussian mechanism and its noise (rust/noise.rs, rust/rng.rs), with what the
//! accelerator noise is checked against: the raw ChaCha20 stream, a seed's key, the chunk size.

use super::common::{array, detached, detached_array, on_records, outputs, sum_views, to_py, Arrays};
use crate::mechanism::gaussian_sum_as;
use crate::noise::gaussian;
use crate::rng::{Domain, Seed};
use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Noised clipped sum; returns flat arrays (reshaped by the Python layer) and the norms (NaN for
/// a record with a NaN or infinite value, which adds zero to the sum).
#[pyfunction]
#[pyo3(signature = (arrays, l2_norm_clip, noise_multiplier, denominator=None, seed=None, scales=None, f64_out=false))]
fn gaussian_sum_flat(
    py: Python<'_>,
    arrays: Arrays<'_>,
    l2_norm_clip: f64,
    noise_multiplier: f64,
    denominator: Option<f64>,
    seed: Option<u64>,
    scales: Option<Vec<f64>>,
    f64_out: bool,
) -> PyResult<(Vec<Py<PyAny>>, Py<PyAny>)> {
    let seed = Seed::from_option(seed);
    let (outs, norms) = on_records(py, &arrays, scales.as_deref(), None, |rec| {
        gaussian_sum_as(rec, l2_norm_clip, noise_multiplier, denominator, seed, f64_out)
    })?;
    Ok((outputs(py, outs), array(py, norms)))
}

/// The Gaussian release of flat float64 sums: (sums[k] + N(0, stddevs[k]²)) / denominators[k],
/// float32 where `f32_out[k]`, all parts in one parallel call.
#[pyfunction]
#[pyo3(signature = (sums, stddevs, denominators, f32_out, seed=None))]
fn gaussian_release(
    py: Python<'_>,
    sums: Vec<PyReadonlyArray1<'_, f64>>,
    stddevs: Vec<f64>,
    denominators: Vec<f64>,
    f32_out: Vec<bool>,
    seed: Option<u64>,
) -> PyResult<Vec<Py<PyAny>>> {
    let views = sum_views(&sums)?;
    let seed = Seed::from_option(seed);
    let outs = detached(py, || {
        crate::mechanism::gaussian_release(&views, &stddevs, &denominators, &f32_out, seed)
    })?;
    Ok(outputs(py, outs))
}

/// `n` values of N(0, stddev²), flat; `parallel=False` keeps the work on the calling thread.
#[pyfunction]
#[pyo3(signature = (n, stddev, double, seed=None, parallel=true))]
fn gaussian_flat(
    py: Python<'_>,
    n: usize,
    stddev: f64,
    double: bool,
    seed: Option<u64>,
    parallel: bool,
) -> PyResult<Py<PyAny>> {
    let key = Seed::from_option(seed).key().map_err(to_py)?;
    if double {
        detached_array(py, || gaussian::<f64>(n, stddev, &key, parallel))
    } else {
        detached_array(py, || gaussian::<f32>(n, stddev, &key, parallel))
    }
}

/// Words `[start, start + n)` (uint32) of the noise stream of chunk `chunk` of part `part` of
/// the 32-byte `key`, in the order the core reads them: for checking the accelerator noise.
#[pyfunction]
#[pyo3(signature = (key, part, chunk, n, start=0))]
fn chacha_stream_words(
    py: Python<'_>,
    key: &[u8],
    part: usize,
    chunk: u64,
    n: usize,
    start: u64,
) -> PyResult<Py<PyAny>> {
    let key: crate::rng::Key = key
        .try_into()
        .map_err(|_| PyValueError::new_err(format!("key: must be 32 bytes, got {}", key.len())))?;
    detached_array(py, || crate::rng::stream_words(&key, Domain::Noise, part, chunk, start, n))
}

/// The 32-byte ChaCha20 key an integer `seed` stands for in every seeded call (tests and
/// reproductions only: anyone who knows the seed knows the noise).
#[pyfunction]
fn seed_key(py: Python<'_>, seed: u64) -> Bound<'_, PyBytes> {
    PyBytes::new(py, &crate::rng::seed_key(seed))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_functions!(m, [gaussian_sum_flat, gaussian_release, gaussian_flat, chacha_stream_words, seed_key]);
    m.add("NOISE_CHUNK", crate::noise::NOISE_CHUNK)?;
    Ok(())
}
