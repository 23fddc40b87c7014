//! What every binding shares, so that each topic's functions borrow numpy arrays, release the
//! GIL and report errors in the same way.

use crate::error::DpError;
use crate::mechanism::Output;
use crate::records::{Column, Part, Records};
use crate::DpResult;
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

pub(super) fn to_py(e: DpError) -> PyErr {
    match e {
        DpError::OutOfMemory { .. } => PyMemoryError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// Runs core work without the GIL. A panic (a bug, never expected) becomes a RuntimeError
/// instead of crossing into Python as a PanicException.
pub(super) fn detached<T: Send, F: FnOnce() -> DpResult<T> + Send>(py: Python<'_>, f: F) -> PyResult<T> {
    py.detach(|| catch_unwind(AssertUnwindSafe(f)))
        .map_err(|p| {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            PyRuntimeError::new_err(format!("dpcore internal error (please report): {msg}"))
        })?
        .map_err(to_py)
}

enum Held<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    F64(PyReadonlyArrayDyn<'py, f64>),
}

/// The record arrays a binding is given: float32 or float64 numpy arrays sharing their leading
/// (record) axis, borrowed by [`hold`].
pub(super) type Arrays<'py> = Vec<Bound<'py, PyAny>>;

/// Borrows each array read-only; all must share the leading (record) axis.
fn hold<'py>(arrays: &[Bound<'py, PyAny>]) -> PyResult<(usize, Vec<(Held<'py>, usize)>)> {
    let mut held = Vec::with_capacity(arrays.len());
    let mut batch = None;
    for (k, a) in arrays.iter().enumerate() {
        let (h, shape) = if let Ok(x) = a.cast::<PyArrayDyn<f32>>() {
            (Held::F32(x.readonly()), x.shape().to_vec())
        } else if let Ok(x) = a.cast::<PyArrayDyn<f64>>() {
            (Held::F64(x.readonly()), x.shape().to_vec())
        } else {
            return Err(PyTypeError::new_err(format!(
                "array {k}: expected a float32 or float64 numpy array, got {}",
                a.get_type().name()?
            )));
        };
        let Some((&b, rest)) = shape.split_first() else {
            return Err(PyValueError::new_err(format!(
                "array {k}: needs a leading record axis"
            )));
        };
        if *batch.get_or_insert(b) != b {
            return Err(PyValueError::new_err(format!(
                "array {k} has {b} records but array 0 has {}",
                batch.unwrap_or(0)
            )));
        }
        held.push((h, rest.iter().product()));
    }
    Ok((batch.unwrap_or(0), held))
}

fn records<'a>(
    batch: usize,
    held: &'a [(Held<'_>, usize)],
    scales: Option<&[f64]>,
    groups: Option<&[usize]>,
) -> PyResult<Records<'a>> {
    for (what, n) in [("scales", scales.map(|s| s.len())), ("groups", groups.map(|g| g.len()))] {
        if let Some(n) = n.filter(|&n| n != held.len()) {
            return Err(PyValueError::new_err(format!(
                "{what}: {n} values for {} arrays",
                held.len()
            )));
        }
    }
    let not_contig = |_| PyValueError::new_err("arrays must be C-contiguous");
    let parts = held
        .iter()
        .enumerate()
        .map(|(k, (h, w))| {
            let data = match h {
                Held::F32(x) => Column::F32(x.as_slice().map_err(not_contig)?),
                Held::F64(x) => Column::F64(x.as_slice().map_err(not_contig)?),
            };
            Ok(Part::new(data, *w)
                .with_scale(scales.map_or(1.0, |s| s[k]))
                .with_group(groups.map_or(0, |g| g[k])))
        })
        .collect::<PyResult<Vec<_>>>()?;
    Records::new(batch, parts).map_err(to_py)
}

/// Borrows `arrays` as records (array k scaled by `scales[k]` and in group `groups[k]`, where
/// given) and runs `f` on them without the GIL.
pub(super) fn on_records<T, F>(
    py: Python<'_>,
    arrays: &[Bound<'_, PyAny>],
    scales: Option<&[f64]>,
    groups: Option<&[usize]>,
    f: F,
) -> PyResult<T>
where
    T: Send,
    F: FnOnce(&Records<'_>) -> DpResult<T> + Send,
{
    let (batch, held) = hold(arrays)?;
    let rec = records(batch, &held, scales, groups)?;
    detached(py, || f(&rec))
}

/// Views of float64 sums, refused unless each is C-contiguous.
pub(super) fn sum_views<'a>(sums: &'a [PyReadonlyArray1<'_, f64>]) -> PyResult<Vec<&'a [f64]>> {
    sums.iter()
        .map(|a| a.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| PyValueError::new_err("sums must be C-contiguous float64 arrays"))
}

/// A numpy array that takes over `v` (no copy).
pub(super) fn array<T: numpy::Element>(py: Python<'_>, v: Vec<T>) -> Py<PyAny> {
    PyArray1::from_vec(py, v).into_any().unbind()
}

/// Runs `f` without the GIL (as [`detached`]) and hands its values to numpy (no copy).
pub(super) fn detached_array<T, F>(py: Python<'_>, f: F) -> PyResult<Py<PyAny>>
where
    T: numpy::Element + Send,
    F: FnOnce() -> DpResult<Vec<T>> + Send,
{
    Ok(array(py, detached(py, f)?))
}

pub(super) fn f64_arrays(py: Python<'_>, vs: Vec<Vec<f64>>) -> Vec<Py<PyAny>> {
    vs.into_iter().map(|v| array(py, v)).collect()
}

pub(super) fn outputs(py: Python<'_>, outs: Vec<Output>) -> Vec<Py<PyAny>> {
    outs.into_iter()
        .map(|o| match o {
            Output::F32(v) => array(py, v),
            Output::F64(v) => array(py, v),
        })
        .collect()
}
