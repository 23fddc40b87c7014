//! Binding of the fast ledger reader (rust/ledger.rs); the Python reader stays the reference and
//! takes over wherever this one refuses a line.

use super::common::detached;
use pyo3::prelude::*;

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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    add_functions!(m, [ledger_scan]);
    Ok(())
}
