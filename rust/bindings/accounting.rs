//! Bindings of the accountant (rust/accounting). Validation errors map to ValueError naming
//! the parameter; the work runs without the GIL.

use super::common::{detached, detached_array};
use crate::accounting::{calibration, conversion, default_orders, pld, rdp_poisson, Composition};
use crate::DpResult;
use pyo3::prelude::*;
use rayon::prelude::*;

type Groups = Vec<(f64, f64, f64)>;

/// Checks the orders and builds the composition, its tables sized for the largest finite order.
fn composition(
    poisson: &[(f64, f64, f64)],
    wor: &[(f64, f64, f64)],
    non_private: bool,
    orders: &[f64],
) -> DpResult<Composition> {
    crate::accounting::check_orders(orders)?;
    let max_order = orders.iter().copied().filter(|a| a.is_finite()).fold(2.0, f64::max);
    Composition::new(poisson, wor, non_private, max_order)
}

/// RDP of each group's single step (rows, in the composition's order) at each order (columns),
/// flattened. Counts are ignored.
fn per_group(c: &Composition, orders: &[f64]) -> Vec<f64> {
    let n = orders.len();
    (0..c.steps.len() * n)
        .into_par_iter()
        .map(|i| c.steps[i / n].0.rdp(orders[i % n]))
        .collect()
}

/// RDP values on the grid `orders`, one binding a row: its name and parameters (besides
/// `orders`), the composition they describe (Poisson groups, without-replacement groups,
/// non-private), and the values taken from it.
macro_rules! rdp_values {
    ($($(#[doc = $doc:literal])* $name:ident($($arg:ident: $ty:ty),*)
        => ($poisson:expr, $wor:expr, $non_private:expr), $values:path;)*) => {$(
        #[pyfunction]
        $(#[doc = $doc])*
        fn $name(py: Python<'_>, $($arg: $ty,)* orders: Vec<f64>) -> PyResult<Py<PyAny>> {
            detached_array(py, || {
                let c = composition(&$poisson, &$wor, $non_private, &orders)?;
                Ok($values(&c, &orders))
            })
        }
    )*};
}

rdp_values! {
    /// One step's RDP of the Poisson-subsampled Gaussian at each order.
    rdp_poisson_subsampled_gaussian(q: f64, z: f64)
        => ([(q, z, 1.0)], [], false), Composition::rdp_grid;
    /// Total RDP of a composition at each order. `poisson`: (q, z, count); `wor`: (m/n, z, count).
    rdp_composition(poisson: Groups, wor: Groups, non_private: bool)
        => (poisson, wor, non_private), Composition::rdp_grid;
    /// One row per group (Poisson groups first, then without-replacement ones), flattened:
    /// RDP of a single step of each group at each order. Counts are ignored.
    rdp_per_group(poisson: Groups, wor: Groups) => (poisson, wor, false), per_group;
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
        let c = composition(&poisson, &wor, non_private, &orders)?;
        let grid = rdp.unwrap_or_else(|| c.rdp_grid(&orders));
        let o = conv(&orders, &grid, &|a| c.rdp(a))?;
        Ok((o.value, o.order, o.at_edge))
    })
}

/// The conversions of a composition, one binding a row: its name, the parameter it converts at,
/// and the conversion.
macro_rules! conversions {
    ($($(#[doc = $doc:literal])* $name:ident($at:ident) = $conv:path;)*) => {$(
        #[pyfunction]
        $(#[doc = $doc])*
        #[pyo3(signature = (poisson, wor, non_private, orders, $at, rdp=None))]
        fn $name(
            py: Python<'_>,
            poisson: Groups,
            wor: Groups,
            non_private: bool,
            orders: Vec<f64>,
            $at: f64,
            rdp: Option<Vec<f64>>,
        ) -> PyResult<(f64, f64, bool)> {
            convert(py, poisson, wor, non_private, orders, rdp, |o, g, f| $conv(o, g, f, $at))
        }
    )*};
}

conversions! {
    /// (ε, best order, best order at the grid's edge) for a composition. `rdp`: the composition's
    /// values on `orders` if already known (else computed).
    epsilon_composition(delta) = conversion::epsilon;
    /// (δ, best order, at edge) for a composition at `epsilon`.
    delta_composition(epsilon) = conversion::delta;
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

/// The calibrations to a target (ε, δ) on `orders`, one binding a row: its name, the two
/// parameters it is given, the type of the one it finds, and the calibration.
macro_rules! calibrations {
    ($($name:ident($a:ident, $b:ident) -> $ret:ty = $calibrate:path;)*) => {$(
        #[pyfunction]
        fn $name(
            py: Python<'_>,
            target_epsilon: f64,
            target_delta: f64,
            $a: f64,
            $b: f64,
            orders: Vec<f64>,
        ) -> PyResult<$ret> {
            detached(py, || {
                let target = calibration::Target {
                    epsilon: target_epsilon,
                    delta: target_delta,
                    orders: &orders,
                };
                $calibrate(&target, $a, $b)
            })
        }
    )*};
}

calibrations! {
    calibrate_noise_multiplier(q, steps) -> f64 = calibration::noise_multiplier;
    calibrate_sampling_probability(z, steps) -> f64 = calibration::sampling_probability;
    calibrate_steps(q, z) -> u64 = calibration::steps;
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

/// Truncated-Poisson groups as given from Python: (q, z, max_sample_size, population_size, count).
type TruncatedGroups = Vec<(f64, f64, u64, u64, f64)>;

fn pld_truncated(groups: &[(f64, f64, u64, u64, f64)]) -> Vec<pld::TruncatedGroup> {
    groups
        .iter()
        .map(|&(q, sigma, max_sample_size, population_size, count)| pld::TruncatedGroup {
            q,
            sigma,
            max_sample_size,
            population_size,
            count,
        })
        .collect()
}

fn pld_options(interval: Option<f64>) -> pld::Options {
    pld::Options {
        interval,
        ..pld::Options::default()
    }
}

/// The bounds by privacy loss distributions, one binding a row: its name, the parameter the
/// bounds are taken at, and the bounds.
macro_rules! pld_bounds {
    ($($(#[doc = $doc:literal])* $name:ident($at:ident) = $bounds:path;)*) => {$(
        #[pyfunction]
        $(#[doc = $doc])*
        #[pyo3(signature = (groups, $at, interval=None, lower=true, truncated=Vec::new()))]
        fn $name(
            py: Python<'_>,
            groups: Groups,
            $at: f64,
            interval: Option<f64>,
            lower: bool,
            truncated: TruncatedGroups,
        ) -> PyResult<(f64, f64, f64)> {
            detached(py, || {
                let b = $bounds(
                    &pld_groups(&groups),
                    &pld_truncated(&truncated),
                    $at,
                    &pld_options(interval),
                    lower,
                )?;
                Ok((b.lower, b.upper, b.interval))
            })
        }
    )*};
}

pld_bounds! {
    /// (lower, upper, grid interval) of ε at δ for Poisson-subsampled Gaussian groups (q, z, count)
    /// and truncated-Poisson ones (q, z, max_sample_size, population_size, count) under
    /// add-or-remove, by privacy loss distributions. `lower = false` skips the lower bound.
    pld_epsilon_bounds(delta) = pld::epsilon_bounds_mixed;
    /// (lower, upper, grid interval) of δ at ε, as [`pld_epsilon_bounds`].
    pld_delta_bounds(epsilon) = pld::delta_bounds_mixed;
}

/// One part of a composition as given from Python: (offset, atoms, mass at +∞, excess, count).
type PldPart<'py> = (i64, numpy::PyReadonlyArray1<'py, f64>, f64, f64, f64);

/// The certified composition of discrete PLDs (rust/accounting/pld/compose.rs: tilted towards
/// `target`, ("delta", δ) or ("epsilon", ε), the transform's rounding bounded; `halve`: a
/// tilted buffer above `max_bins` is retried with weaker tilts instead of refused):
/// (offset, atoms, mass at +∞, mass to subtract from δ for a lower bound).
#[pyfunction]
#[pyo3(signature = (parts, interval, tail, max_bins, pessimistic, target=None, halve=true))]
fn pld_compose(
    py: Python<'_>,
    parts: Vec<PldPart<'_>>,
    interval: f64,
    tail: f64,
    max_bins: usize,
    pessimistic: bool,
    target: Option<(String, f64)>,
    halve: bool,
) -> PyResult<(i64, Py<PyAny>, f64, f64)> {
    let target = match target {
        None => pld::Target::None,
        Some((k, v)) if k == "delta" => pld::Target::Delta(v),
        Some((k, v)) if k == "epsilon" => pld::Target::Epsilon(v),
        Some((k, _)) => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "target must be ('delta', δ) or ('epsilon', ε), got {k:?}"
            )))
        }
    };
    let plds: Vec<(pld::DiscretePld, f64)> = parts
        .iter()
        .map(|(offset, probs, inf_mass, excess, count)| {
            Ok((
                pld::DiscretePld {
                    interval,
                    offset: *offset,
                    probs: probs.as_slice()?.to_vec(),
                    inf_mass: *inf_mass,
                    excess: *excess,
                },
                *count,
            ))
        })
        .collect::<PyResult<_>>()?;
    let c = detached(py, || pld::compose_parts(&plds, tail, max_bins, pessimistic, target, halve))?;
    if matches!(c.pld.probs.len(), 0) {
        return Err(pyo3::exceptions::PyValueError::new_err("empty composition"));
    }
    Ok((c.pld.offset, super::common::array(py, c.pld.probs), c.pld.inf_mass, c.wrapped_in))
}

/// The dominating mixture of one truncated-Poisson-sampled Gaussian step (rust/accounting/pld/
/// truncated.rs): (a, b, x, q_b, q_eff): weights of the pairs (q, z) and (q_b, z/2) and of the
/// upper envelope of their curves, and the Poisson rate the step dominates.
#[pyfunction]
fn truncated_poisson_mixture(
    py: Python<'_>,
    q: f64,
    max_sample_size: u64,
    population_size: u64,
) -> PyResult<(f64, f64, f64, f64, f64)> {
    detached(py, || {
        let m = pld::truncated::mixture(q, max_sample_size, population_size)?;
        Ok((m.a, m.b, m.x, m.q_b, m.q_eff))
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_functions!(m, [
        pld_epsilon_bounds, pld_delta_bounds, pld_compose, truncated_poisson_mixture, rdp_poisson_subsampled_gaussian, rdp_composition,
        rdp_per_group, epsilon_composition, delta_composition, epsilon_from_rdp,
        calibrate_noise_multiplier, calibrate_sampling_probability, calibrate_steps,
        _log_a_quadrature, default_rdp_orders,
    ]);
    Ok(())
}
