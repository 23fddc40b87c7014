//! Errors of the pure core. The bindings map each variant onto a Python exception type.
use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum DpError {
    /// A parameter is out of its valid range (mapped to `ValueError`).
    InvalidParameter { name: &'static str, message: String },
    /// Arrays disagree on shape, or a buffer is not the size its shape says (`ValueError`).
    Shape(String),
    /// An output could not be allocated (`MemoryError`), instead of aborting the process.
    OutOfMemory { bytes: u128 },
    /// A privacy loss grid would need more atoms than its cap (`ValueError`; the automatic grid
    /// coarsens itself instead of raising this).
    GridTooLarge { bins: f64 },
}

pub type DpResult<T> = Result<T, DpError>;

impl DpError {
    pub fn param(name: &'static str, message: impl Into<String>) -> Self {
        DpError::InvalidParameter {
            name,
            message: message.into(),
        }
    }
}

/// `Ok(())` where `ok` holds, else the parameter error "`name`: must be `rule`, got `value`".
/// Write `ok` so that NaN fails it (e.g. `x >= 0.0`, not `!(x < 0.0)`).
pub fn require(ok: bool, name: &'static str, rule: &str, value: impl fmt::Display) -> DpResult<()> {
    if ok {
        Ok(())
    } else {
        Err(DpError::param(name, format!("must be {rule}, got {value}")))
    }
}

impl fmt::Display for DpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DpError::InvalidParameter { name, message } => write!(f, "{name}: {message}"),
            DpError::Shape(m) => f.write_str(m),
            DpError::OutOfMemory { bytes } => write!(f, "cannot allocate {bytes} bytes for the result"),
            DpError::GridTooLarge { bins } => write!(
                f,
                "value_discretization_interval: the privacy loss grid would need {bins:.3e} atoms, above the cap; \
                 use a larger interval (or None to choose it automatically)"
            ),
        }
    }
}

impl std::error::Error for DpError {}

/// A vector of `n` copies of `v`, or `OutOfMemory` where the allocator refuses (a plain `vec!`
/// would abort the whole Python process).
pub fn try_filled<T: Clone>(n: usize, v: T) -> DpResult<Vec<T>> {
    let mut out = try_with_capacity(n)?;
    out.resize(n, v);
    Ok(out)
}

/// An empty vector with room for `n` values, or `OutOfMemory`.
pub fn try_with_capacity<T>(n: usize) -> DpResult<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| DpError::OutOfMemory {
        bytes: n as u128 * std::mem::size_of::<T>() as u128,
    })?;
    Ok(out)
}
