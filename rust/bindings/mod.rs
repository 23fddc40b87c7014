//! The one module that knows Python: converts numpy arrays to borrowed slices (no copies),
//! releases the GIL around the work, and maps core errors and panics onto Python exceptions.
//! Structure and dtype normalisation happens in `python/dpcore/mechanism.py`; this layer
//! still refuses anything it cannot read in place.

/// Adds each named `#[pyfunction]` to the module `m`, in order.
macro_rules! add_functions {
    ($m:expr, [$($f:ident),* $(,)?]) => {
        $($m.add_function(wrap_pyfunction!($f, $m)?)?;)*
    };
}

mod accounting;

use crate::error::DpError;
use crate::discrete::{DiscreteParams, Rounding};
use crate::mechanism::{discrete_gaussian_sum, discrete_release as release, gaussian_sum_as, Output};
use crate::mf::{correlated_noise, Strategy};
use crate::noise::gaussian;
use crate::records::{Column, Part, Records};
use crate::rng::{Domain, Seed};
use crate::{clip, sampling, DpResult};
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::panic::{catch_unwind, AssertUnwindSafe};

fn to_py(e: DpError) -> PyErr {
    match e {
        DpError::OutOfMemory { .. } => PyMemoryError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// Runs core work without the GIL. A panic (a bug, never expected) becomes a RuntimeError
/// instead of crossing into Python as a PanicException.
fn detached<T: Send, F: FnOnce() -> DpResult<T> + Send>(py: Python<'_>, f: F) -> PyResult<T> {
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
type Arrays<'py> = Vec<Bound<'py, PyAny>>;

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
fn on_records<T, F>(
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
fn sum_views<'a>(sums: &'a [PyReadonlyArray1<'_, f64>]) -> PyResult<Vec<&'a [f64]>> {
    sums.iter()
        .map(|a| a.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| PyValueError::new_err("sums must be C-contiguous float64 arrays"))
}

/// A numpy array that takes over `v` (no copy).
fn array<T: numpy::Element>(py: Python<'_>, v: Vec<T>) -> Py<PyAny> {
    PyArray1::from_vec(py, v).into_any().unbind()
}

/// Runs `f` without the GIL (as [`detached`]) and hands its values to numpy (no copy).
fn detached_array<T, F>(py: Python<'_>, f: F) -> PyResult<Py<PyAny>>
where
    T: numpy::Element + Send,
    F: FnOnce() -> DpResult<Vec<T>> + Send,
{
    Ok(array(py, detached(py, f)?))
}

fn f64_arrays(py: Python<'_>, vs: Vec<Vec<f64>>) -> Vec<Py<PyAny>> {
    vs.into_iter().map(|v| array(py, v)).collect()
}

fn outputs(py: Python<'_>, outs: Vec<Output>) -> Vec<Py<PyAny>> {
    outs.into_iter()
        .map(|o| match o {
            Output::F32(v) => array(py, v),
            Output::F64(v) => array(py, v),
        })
        .collect()
}

/// Noised clipped sum; returns flat arrays (reshaped by the Python layer) and the norms.
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

/// Clipped sums of several groups in one pass over the records (no noise): array k belongs to
/// group `groups[k]` (numbered 0, 1, … in array order) and group g is clipped to `clips[g]`.
/// Returns one flat float64 sum per array and the norms, group-major (G·B values).
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

/// Discrete Gaussian noised clipped sum (float64 outputs), the norms, and the parameters.
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

/// Clipped records rounded onto the grid and summed exactly (grid units, float64), the norms,
/// and how many records were rounded toward zero to meet the bound `sens_sq`.
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

/// The joint L2 norm of every record (parts divided by their scales), float64 of shape (B,).
#[pyfunction]
#[pyo3(signature = (arrays, scales=None))]
fn record_norms(
    py: Python<'_>,
    arrays: Arrays<'_>,
    scales: Option<Vec<f64>>,
) -> PyResult<Py<PyAny>> {
    let norms = on_records(py, &arrays, scales.as_deref(), None, clip::record_norms)?;
    Ok(array(py, norms))
}

/// Per array, the sum of squares of every record (float64 of shape (B,)), unscaled. Non-finite
/// values give non-finite sums; the caller reports them. `parallel=False` keeps the work on the
/// calling thread.
#[pyfunction]
#[pyo3(signature = (arrays, parallel=true))]
fn part_sumsq(py: Python<'_>, arrays: Arrays<'_>, parallel: bool) -> PyResult<Vec<Py<PyAny>>> {
    let sums = on_records(py, &arrays, None, None, |rec| Ok(clip::part_sumsq(rec, parallel)))?;
    Ok(f64_arrays(py, sums))
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

/// The SIMD tier the kernels dispatch to on this CPU at run time: "avx512", "avx2" or
/// "baseline" (the wheel's smoke test checks it against the CPU's flags).
#[pyfunction]
fn simd_tier() -> &'static str {
    crate::kernels::tier_name()
}

/// Sorted indices of a Poisson sample (uint64).
#[pyfunction]
#[pyo3(signature = (n, q, seed=None))]
fn poisson_sample(py: Python<'_>, n: u64, q: f64, seed: Option<u64>) -> PyResult<Py<PyAny>> {
    detached_array(py, || sampling::poisson_sample(n, q, Seed::from_option(seed)))
}

type RunTuple = (
    u64,
    u64,
    u64,
    f64,
    u8,
    Option<u64>,
    bool,
    bool,
    Vec<(f64, f64)>,
);

/// The complete lines of a ledger file as runs of identical samples, or the first line the
/// fast reader refuses (``(None, line)``; the Python reader then reads the file).
/// Returns ``(lines, valid_bytes, privacy_unit, runs)``; a run is ``(first_sample, count,
/// population_size, sampling_probability, policy index, sample_size, seeded, non_private,
/// [(l2_norm_clip, stddev), ...])``.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn ledger_scan(
    py: Python<'_>,
    data: &[u8],
) -> PyResult<(Option<(u64, u64, Option<String>, Vec<RunTuple>)>, u64)> {
    let r = detached(py, || Ok(crate::ledger::scan(data)))?;
    Ok(match r {
        Err(line) => (None, line),
        Ok(s) => {
            let runs = s
                .runs
                .into_iter()
                .map(|r| {
                    (
                        r.first_sample,
                        r.count,
                        r.population_size,
                        r.sampling_probability,
                        r.policy,
                        r.sample_size,
                        r.seeded,
                        r.non_private,
                        r.queries,
                    )
                })
                .collect();
            (Some((s.lines, s.valid_bytes, s.privacy_unit, runs)), 0)
        }
    })
}

/// Sorted indices of a uniform sample of fixed size without replacement (uint64).
#[pyfunction]
#[pyo3(signature = (n, b, seed=None))]
fn fixed_size_sample(py: Python<'_>, n: u64, b: u64, seed: Option<u64>) -> PyResult<Py<PyAny>> {
    detached_array(py, || sampling::fixed_size_sample(n, b, Seed::from_option(seed)))
}

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

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_functions!(m, [
        gaussian_sum_flat, record_norms, clip_sum_groups, gaussian_release, discrete_params,
        discrete_gaussian_sum_flat, clip_round_sum, discrete_release, part_sumsq, gaussian_flat,
        poisson_sample, fixed_size_sample, ledger_scan, mf_noise, mf_unit_noise, mf_advance, mf_advance_and_draw,
        chacha_stream_words, seed_key, simd_tier,
    ]);
    accounting::register(m)?;
    m.add("NOISE_CHUNK", crate::noise::NOISE_CHUNK)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
