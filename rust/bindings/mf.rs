//! Bindings of matrix-factorization noise (rust/mf.rs). The state array is owned by Python and
//! updated in place, so its dtype picks the element type of the whole call.

use super::common::{detached, detached_array, to_py};
use crate::mf::{correlated_noise, Strategy};
use crate::rng::Seed;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

fn mf_strategy<'a>(kind: &str, coefficients: &'a [f64], theta: &'a [f64], omega: &'a [f64]) -> PyResult<Strategy<'a>> {
    match kind {
        "banded" => Ok(Strategy::Banded(coefficients)),
        "blt" => Ok(Strategy::Blt { theta, omega }),
        _ => Err(PyValueError::new_err(format!("kind must be 'banded' or 'blt', got {kind:?}"))),
    }
}

/// A read-only 1-d view of `a` in the element type `T`, or a TypeError naming `what`.
fn view_as<'py, T: numpy::Element>(a: &Bound<'py, PyAny>, what: &str) -> PyResult<PyReadonlyArray1<'py, T>> {
    a.cast::<PyArray1<T>>()
        .map(|x| x.readonly())
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a C-contiguous 1-d array of the state's dtype")))
}

/// Runs `$body` with `$st` the state (float32 or float64, writable when `$rw`), `$T` its
/// element type, and `$opt` each optional array argument viewed in that type.
macro_rules! on_state {
    ($state:expr, $rw:tt, |$st:ident, $T:ident, [$($opt:ident),*]| $body:expr) => {{
        macro_rules! branch {
            ($ty:ty) => {{
                type $T = $ty;
                $(let $opt = match &$opt { Some(x) => Some(view_as::<$T>(x, stringify!($opt))?), None => None };
                  let $opt = match &$opt { Some(x) => Some(x.as_slice().map_err(|_| PyValueError::new_err(concat!(stringify!($opt), " must be C-contiguous")))?), None => None };)*
                let arr = $state.cast::<PyArray1<$T>>().expect("checked");
                on_state!(@bind arr, $st, $rw, $body)
            }};
        }
        if $state.cast::<PyArray1<f32>>().is_ok() {
            branch!(f32)
        } else if $state.cast::<PyArray1<f64>>().is_ok() {
            branch!(f64)
        } else {
            Err(PyTypeError::new_err(format!(
                "state: expected a 1-d float32 or float64 numpy array, got {}",
                $state.get_type().name()?
            )))
        }
    }};
    (@bind $arr:ident, $st:ident, rw, $body:expr) => {{
        let mut guard = $arr.try_readwrite().map_err(|_| PyValueError::new_err("state is not writable"))?;
        let $st = guard.as_slice_mut().map_err(|_| PyValueError::new_err("state must be C-contiguous"))?;
        $body
    }};
    (@bind $arr:ident, $st:ident, ro, $body:expr) => {{
        let guard = $arr.readonly();
        let $st = guard.as_slice().map_err(|_| PyValueError::new_err("state must be C-contiguous"))?;
        $body
    }};
}

/// Step `step` of a matrix-factorization mechanism's correlated noise (see `crate::mf`):
/// `(sum + stddev·(C⁻¹z)_step) / denominator`, advancing `state` in place. `kind` is "banded"
/// (`coefficients`) or "blt" (`theta`, `omega`); the state's dtype (float32 or float64) is the
/// output's (and `fresh`'s, z drawn ahead); it must be C-contiguous and writable, and is left
/// unchanged on any error.
#[pyfunction]
#[pyo3(signature = (kind, coefficients, theta, omega, state, dim, step, stddev, sum=None, denominator=1.0, seed=None, fresh=None, parallel=true))]
#[allow(clippy::too_many_arguments)]
fn mf_noise(
    py: Python<'_>,
    kind: &str,
    coefficients: Vec<f64>,
    theta: Vec<f64>,
    omega: Vec<f64>,
    state: Bound<'_, PyAny>,
    dim: usize,
    step: u64,
    stddev: f64,
    sum: Option<PyReadonlyArray1<'_, f64>>,
    denominator: f64,
    seed: Option<u64>,
    fresh: Option<Bound<'_, PyAny>>,
    parallel: bool,
) -> PyResult<Py<PyAny>> {
    let strategy = mf_strategy(kind, &coefficients, &theta, &omega)?;
    let sum = match &sum {
        Some(a) => Some(a.as_slice().map_err(|_| PyValueError::new_err("sum must be a C-contiguous float64 array"))?),
        None => None,
    };
    // A key is drawn only when the fresh noise is not given (it would go unused).
    let key = if fresh.is_some() { [0u8; 32] } else { Seed::from_option(seed).key().map_err(to_py)? };
    on_state!(state, rw, |st, T, [fresh]| detached_array(py, || {
        correlated_noise::<T>(&strategy, st, dim, step, stddev, sum, denominator, &key, fresh, parallel)
    }))
}

/// The unit noise w = (C⁻¹z)_step of a step without advancing `state` (read only): see
/// `crate::mf::unit_noise`; `mf_advance` then applies it once the release is recorded.
#[pyfunction]
#[pyo3(signature = (kind, coefficients, theta, omega, state, dim, step, seed=None, fresh=None, parallel=true))]
#[allow(clippy::too_many_arguments)]
fn mf_unit_noise(
    py: Python<'_>,
    kind: &str,
    coefficients: Vec<f64>,
    theta: Vec<f64>,
    omega: Vec<f64>,
    state: Bound<'_, PyAny>,
    dim: usize,
    step: u64,
    seed: Option<u64>,
    fresh: Option<Bound<'_, PyAny>>,
    parallel: bool,
) -> PyResult<Py<PyAny>> {
    let strategy = mf_strategy(kind, &coefficients, &theta, &omega)?;
    let key = if fresh.is_some() { [0u8; 32] } else { Seed::from_option(seed).key().map_err(to_py)? };
    on_state!(state, ro, |st, T, [fresh]| detached_array(py, || {
        crate::mf::unit_noise::<T>(&strategy, st, dim, step, &key, fresh, parallel)
    }))
}

/// Advances `state` (in place) past step `step` with that step's unit noise `w`; unchanged on error.
#[pyfunction]
#[pyo3(signature = (kind, coefficients, theta, omega, state, dim, step, w, parallel=true))]
#[allow(clippy::too_many_arguments)]
fn mf_advance(
    py: Python<'_>,
    kind: &str,
    coefficients: Vec<f64>,
    theta: Vec<f64>,
    omega: Vec<f64>,
    state: Bound<'_, PyAny>,
    dim: usize,
    step: u64,
    w: Bound<'_, PyAny>,
    parallel: bool,
) -> PyResult<()> {
    let strategy = mf_strategy(kind, &coefficients, &theta, &omega)?;
    let w = Some(w);
    on_state!(state, rw, |st, T, [w]| {
        let w = w.expect("given");
        detached(py, || crate::mf::advance_state::<T>(&strategy, st, dim, step, w, parallel))
    })
}

/// `mf_advance` past step `step` with `w`, then the unit noise of step `step + 1` from the
/// updated state (z from `seed`, or the OS), in one pass; unchanged on error.
#[pyfunction]
#[pyo3(signature = (kind, coefficients, theta, omega, state, dim, step, w, seed=None, parallel=true))]
#[allow(clippy::too_many_arguments)]
fn mf_advance_and_draw(
    py: Python<'_>,
    kind: &str,
    coefficients: Vec<f64>,
    theta: Vec<f64>,
    omega: Vec<f64>,
    state: Bound<'_, PyAny>,
    dim: usize,
    step: u64,
    w: Bound<'_, PyAny>,
    seed: Option<u64>,
    parallel: bool,
) -> PyResult<Py<PyAny>> {
    let strategy = mf_strategy(kind, &coefficients, &theta, &omega)?;
    let key = Seed::from_option(seed).key().map_err(to_py)?;
    let w = Some(w);
    on_state!(state, rw, |st, T, [w]| {
        let w = w.expect("given");
        detached_array(py, || crate::mf::advance_and_draw::<T>(&strategy, st, dim, step, w, &key, parallel))
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_functions!(m, [mf_noise, mf_unit_noise, mf_advance, mf_advance_and_draw]);
    Ok(())
}
