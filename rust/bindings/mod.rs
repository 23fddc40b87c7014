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
mod clip;
mod common;
mod discrete;
mod ledger;
mod mf;
mod noise;
mod sampling;

use pyo3::prelude::*;

/// The SIMD tier the kernels dispatch to on this CPU at run time: "avx512", "avx2" or
/// "baseline" (the wheel's smoke test checks it against the CPU's flags).
#[pyfunction]
fn simd_tier() -> &'static str {
    crate::kernels::tier_name()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    clip::register(m)?;
    noise::register(m)?;
    discrete::register(m)?;
    sampling::register(m)?;
    ledger::register(m)?;
    mf::register(m)?;
    accounting::register(m)?;
    add_functions!(m, [simd_tier]);
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
