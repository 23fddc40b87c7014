//! Bindings of the samplers (rust/sampling.rs).

use super::common::detached_array;
use crate::rng::Seed;
use crate::sampling;
use pyo3::prelude::*;

/// Sorted indices of a Poisson sample (uint64).
#[pyfunction]
#[pyo3(signature = (n, q, seed=None))]
fn poisson_sample(py: Python<'_>, n: u64, q: f64, seed: Option<u64>) -> PyResult<Py<PyAny>> {
    detached_array(py, || sampling::poisson_sample(n, q, Seed::from_option(seed)))
}

/// Sorted indices of a uniform sample of fixed size without replacement (uint64).
#[pyfunction]
#[pyo3(signature = (n, b, seed=None))]
fn fixed_size_sample(py: Python<'_>, n: u64, b: u64, seed: Option<u64>) -> PyResult<Py<PyAny>> {
    detached_array(py, || sampling::fixed_size_sample(n, b, Seed::from_option(seed)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_functions!(m, [poisson_sample, fixed_size_sample]);
    Ok(())
}
