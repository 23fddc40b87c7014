//! dpcore: the pure-Rust core of a differentially private aggregation library.
//!
//! The architecture follows McMahan et al. 2018, "A General Approach to Adding Differential
//! Privacy to Iterative Training Procedures": training code asks for sums (or averages) of
//! per-record vectors; the privacy mechanism clips each record and adds Gaussian noise; an
//! accountant turns the recorded events into (ε, δ).
//!
//! Everything here is plain Rust and knows nothing of Python; `bindings` (behind the `python`
//! feature) is the one module that does.

pub mod accounting;
pub mod chacha;
pub mod clip;
pub mod discrete;
pub mod elem;
pub mod error;
pub mod kernels;
pub mod ledger;
pub mod mechanism;
pub mod mf;
pub mod noise;
pub mod records;
pub mod rng;
pub mod sampling;
pub mod ziggurat;

#[cfg(feature = "python")]
mod bindings;
#[cfg(test)]
mod testing;

pub use error::{DpError, DpResult};
