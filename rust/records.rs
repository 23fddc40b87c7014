//! A batch of records, read in place.
//!
//! A record is one row of every array taken together (McMahan et al. 2018, §2: the per-example
//! vectors of all parameter tensors of a model). The arrays are never concatenated: each `Part`
//! borrows one caller's buffer, row-major with `width` values per record.

use crate::error::{DpError, DpResult};

pub use crate::elem::Elem;

/// One caller buffer of `batch * width` values.
#[derive(Clone, Copy, Debug)]
pub enum Column<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
}

impl Column<'_> {
    pub fn len(&self) -> usize {
        match self {
            Column::F32(x) => x.len(),
            Column::F64(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn elem_size(&self) -> usize {
        match self {
            Column::F32(_) => 4,
            Column::F64(_) => 8,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Part<'a> {
    pub data: Column<'a>,
    /// Values per record in this part (the product of the array's non-batch dimensions).
    pub width: usize,
    /// Joint-clipping scale α of this part (McMahan et al. 2018, §2): the record is clipped as
    /// if this part were divided by α, and the part's noise is multiplied by α. 1 for flat clipping.
    pub scale: f64,
    /// The group this part belongs to (McMahan et al. 2018, §2, "per-layer clipping"): each group
    /// of a record is clipped on its own, to its own bound. 0 when the whole record is one group.
    pub group: usize,
}

impl<'a> Part<'a> {
    pub fn new(data: Column<'a>, width: usize) -> Self {
        Part {
            data,
            width,
            scale: 1.0,
            group: 0,
        }
    }
    pub fn with_scale(self, scale: f64) -> Self {
        Part { scale, ..self }
    }
    pub fn with_group(self, group: usize) -> Self {
        Part { group, ..self }
    }
}

/// A batch of `batch` records spread over one or more parts.
#[derive(Clone, Debug)]
pub struct Records<'a> {
    pub batch: usize,
    pub parts: Vec<Part<'a>>,
}

impl<'a> Records<'a> {
    /// Checks that every buffer holds exactly `batch * width` values.
    pub fn new(batch: usize, parts: Vec<Part<'a>>) -> DpResult<Self> {
        if parts.is_empty() {
            return Err(DpError::Shape(
                "at least one array of records is required".into(),
            ));
        }
        let mut group = 0;
        for (k, p) in parts.iter().enumerate() {
            // Groups are runs of consecutive parts numbered 0, 1, 2, …: each is one range of
            // column blocks, so a group's norm is a sum over consecutive blocks.
            if p.group != group && p.group != group + 1 || (k == 0 && p.group != 0) {
                return Err(DpError::Shape(format!(
                    "array {k}: group {} out of order (groups must be numbered 0, 1, 2, … in array order)",
                    p.group
                )));
            }
            group = p.group;
            if !(p.scale.is_finite() && p.scale > 0.0) {
                return Err(DpError::param(
                    "scales",
                    format!("scale {k} must be finite and > 0, got {}", p.scale),
                ));
            }
            let expected = batch.checked_mul(p.width).ok_or_else(|| {
                DpError::Shape(format!(
                    "array {k}: batch {batch} x width {} overflows",
                    p.width
                ))
            })?;
            if p.data.len() != expected {
                return Err(DpError::Shape(format!(
                    "array {k} holds {} values but {batch} records of width {} need {expected}",
                    p.data.len(),
                    p.width
                )));
            }
        }
        Ok(Records { batch, parts })
    }

    /// Total values per record over all parts (D in the paper).
    pub fn dim(&self) -> usize {
        self.parts.iter().map(|p| p.width).sum()
    }

    /// Number of groups, each clipped on its own.
    pub fn groups(&self) -> usize {
        self.parts.last().map_or(0, |p| p.group + 1)
    }

    /// The parts of group `g`.
    pub fn group_parts(&self, g: usize) -> impl Iterator<Item = &Part<'a>> + '_ {
        self.parts.iter().filter(move |p| p.group == g)
    }

    /// Bytes one record occupies over all parts.
    pub fn record_bytes(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.width * p.data.elem_size())
            .sum()
    }
}
