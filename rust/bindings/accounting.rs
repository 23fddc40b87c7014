//! Bindings of the accountant (rust/accounting). Validation errors map to ValueError naming
//! the parameter; the work runs without the GIL.

use super::detached;
use crate::accounting::{calibration, conversion, default_orders, pld, rdp_poisson, Composition};
use numpy::PyArray1;
use pyo3::prelude::*;
use rayon::prelude::*;

type Groups = Vec<(f64, f64, f64)>;

fn max_order(orders: &[f64]) -> f64 {
    orders
        .iter()
        .copied()
        .filter(|a| a.is_finite())
        .fold(2.0, f64::max)
}

/// One step's RDP of the Poisson-subsampled Gaussian at each order.
#[pyfunction]
fn rdp_poisson_subsampled_gaussian(
    py: Python<'_>,
    q: f64,
    z: f64,
    orders: Vec<f64>,
) -> PyResult<Py<PyAny>> {
    let v = detached(py, || {
        crate::accounting::check_orders(&orders)?;
        let c = Composition::new(&[(q, z, 1.0)], &[], false, max_order(&orders))?;
        Ok(c.rdp_grid(&orders))
    })?;
    Ok(PyArray1::from_vec(py, v).into_any().unbind())
}

/// Total RDP of a composition at each order. `poisson`: (q, z, count); `wor`: (m/n, z, count).
#[pyfunction]
fn rdp_composition(
    py: Python<'_>,
    poisson: Groups,
    wor: Groups,
    non_private: bool,
    orders: Vec<f64>,
) -> PyResult<Py<PyAny>> {
    let v = detached(py, || {
        crate::accounting::check_orders(&orders)?;
        let c = Composition::new(&poisson, &wor, non_private, max_order(&orders))?;
        Ok(c.rdp_grid(&orders))
    })?;
    Ok(PyArray1::from_vec(py, v).into_any().unbind())
}

/// One row per group (Poisson groups first, then without-replacement ones), flattened:
/// RDP of a single step of each group at each order. Counts are ignored.
#[pyfunction]
fn rdp_per_group(
    py: Python<'_>,
    poisson: Groups,
    wor: Groups,
    orders: Vec<f64>,
) -> PyResult<Py<PyAny>> {
    let v = detached(py, || {
        crate::accounting::check_orders(&orders)?;
        let c = Composition::new(&poisson, &wor, false, max_order(&orders))?;
        let n = orders.len();
        let cells: Vec<f64> = (0..c.steps.len() * n)
            .into_par_iter()
            .map(|i| c.steps[i / n].0.rdp(orders[i % n]))
            .collect();
        Ok(cells)
    })?;
    Ok(PyArray1::from_vec(py, v).into_any().unbind())
}

/// Builds the composition, takes its RDP on the grid (unless given), and runs one conversion.
fn convert<C>(
    py: Python<'_>,
    poisson: Groups,
    wor: Groups,
    non_private: bool,
    orders: Vec<f64>,
    rdp: Option<Vec<f64>>,
    conv: C,
) -> PyResult<(f64, f64, bool)>
where
    C: FnOnce(&[f64], &[f64], &dyn Fn(f64) -> f64) -> crate::DpResult<conversion::Optimum> + Send,
{
    detached(py, || {
        crate::accounting::check_orders(&orders)?;
        let c = Composition::new(&poisson, &wor, non_private, max_order(&orders))?;
        let grid = rdp.unwrap_or_else(|| c.rdp_grid(&orders));
        let o = conv(&orders, &grid, &|a| c.rdp(a))?;
        Ok((o.value, o.order, o.at_edge))
    })
}

/// (ε, best order, best order at the grid's edge) for a composition. `rdp`: the composition's
/// values on `orders` if already known (else computed).
#[pyfunction]
#[pyo3(signature = (poisson, wor, non_private, orders, delta, rdp=None))]
fn epsilon_composition(
    py: Python<'_>,
    poisson: Groups,
    wor: Groups,
    non_private: bool,
    orders: Vec<f64>,
    delta: f64,
    rdp: Option<Vec<f64>>,
) -> PyResult<(f64, f64, bool)> {
    convert(py, poisson, wor, non_private, orders, rdp, |o, g, f| {
        conversion::epsilon(o, g, f, delta)
    })
}

/// (δ, best order, at edge) for a composition at `epsilon`.
#[pyfunction]
#[pyo3(signature = (poisson, wor, non_private, orders, epsilon, rdp=None))]
fn delta_composition(
    py: Python<'_>,
    poisson: Groups,
    wor: Groups,
    non_private: bool,
    orders: Vec<f64>,
    epsilon: f64,
    rdp: Option<Vec<f64>>,
) -> PyResult<(f64, f64, bool)> {
    convert(py, poisson, wor, non_private, orders, rdp, |o, g, f| {
        conversion::delta(o, g, f, epsilon)
    })
}

/// (ε, best order) from RDP values on a grid alone: no continuous search (nothing is known
/// between the orders).
#[pyfunction]
fn epsilon_from_rdp(
    py: Python<'_>,
    orders: Vec<f64>,
    rdp: Vec<f64>,
    delta: f64,
) -> PyResult<(f64, f64)> {
    detached(py, || {
        let o = conversion::epsilon(&orders, &rdp, |_| f64::INFINITY, delta)?;
        Ok((o.value, o.order))
    })
}

#[pyfunction]
fn calibrate_noise_multiplier(
    py: Python<'_>,
    target_epsilon: f64,
    target_delta: f64,
    q: f64,
    steps: f64,
    orders: Vec<f64>,
) -> PyResult<f64> {
    detached(py, || {
        calibration::noise_multiplier(target_epsilon, target_delta, q, steps, &orders)
    })
}

#[pyfunction]
fn calibrate_sampling_probability(
    py: Python<'_>,
    target_epsilon: f64,
    target_delta: f64,
    z: f64,
    steps: f64,
    orders: Vec<f64>,
) -> PyResult<f64> {
    detached(py, || {
        calibration::sampling_probability(target_epsilon, target_delta, z, steps, &orders)
    })
}

#[pyfunction]
fn calibrate_steps(
    py: Python<'_>,
    target_epsilon: f64,
    target_delta: f64,
    q: f64,
    z: f64,
    orders: Vec<f64>,
) -> PyResult<u64> {
    detached(py, || {
        calibration::steps(target_epsilon, target_delta, q, z, &orders)
    })
}

/// log A_α by quadrature at any real α > 1 (tests compare it with the exact integer sums).
#[pyfunction]
fn _log_a_quadrature(py: Python<'_>, q: f64, z: f64, alpha: f64) -> PyResult<f64> {
    detached(py, || {
        rdp_poisson::check_order(alpha)?;
        let s = rdp_poisson::SubsampledGaussian::new(q, z)?;
        Ok(s.log_a_frac(alpha))
    })
}

#[pyfunction]
fn default_rdp_orders() -> Vec<f64> {
    default_orders()
}

fn pld_groups(groups: &[(f64, f64, f64)]) -> Vec<pld::Group> {
    groups
        .iter()
        .map(|&(q, sigma, count)| pld::Group { q, sigma, count })
        .collect()
}

fn pld_options(interval: Option<f64>) -> pld::Options {
    pld::Options {
        interval,
        ..pld::Options::default()
    }
}

/// (lower, upper, grid interval) of ε at δ for Poisson-subsampled Gaussian groups (q, z, count)
/// under add-or-remove, by privacy loss distributions. `lower = false` skips the lower bound.
#[pyfunction]
#[pyo3(signature = (groups, delta, interval=None, lower=true))]
fn pld_epsilon_bounds(
    py: Python<'_>,
    groups: Groups,
    delta: f64,
    interval: Option<f64>,
    lower: bool,
) -> PyResult<(f64, f64, f64)> {
    detached(py, || {
        let b = pld::epsilon_bounds(&pld_groups(&groups), delta, &pld_options(interval), lower)?;
        Ok((b.lower, b.upper, b.interval))
    })
}

/// (lower, upper, grid interval) of δ at ε, as [`pld_epsilon_bounds`].
#[pyfunction]
#[pyo3(signature = (groups, epsilon, interval=None, lower=true))]
fn pld_delta_bounds(
    py: Python<'_>,
    groups: Groups,
    epsilon: f64,
    interval: Option<f64>,
    lower: bool,
) -> PyResult<(f64, f64, f64)> {
    detached(py, || {
        let b = pld::delta_bounds(&pld_groups(&groups), epsilon, &pld_options(interval), lower)?;
        Ok((b.lower, b.upper, b.interval))
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(pld_epsilon_bounds, m)?)?;
    m.add_function(wrap_pyfunction!(pld_delta_bounds, m)?)?;
    m.add_function(wrap_pyfunction!(rdp_poisson_subsampled_gaussian, m)?)?;
    m.add_function(wrap_pyfunction!(rdp_composition, m)?)?;
    m.add_function(wrap_pyfunction!(rdp_per_group, m)?)?;
    m.add_function(wrap_pyfunction!(epsilon_composition, m)?)?;
    m.add_function(wrap_pyfunction!(delta_composition, m)?)?;
    m.add_function(wrap_pyfunction!(epsilon_from_rdp, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate_noise_multiplier, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate_sampling_probability, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate_steps, m)?)?;
    m.add_function(wrap_pyfunction!(_log_a_quadrature, m)?)?;
    m.add_function(wrap_pyfunction!(default_rdp_orders, m)?)?;
    Ok(())
}
