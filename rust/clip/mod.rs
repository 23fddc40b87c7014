//! Per-record L2 clipping and the clipped sum: McMahan et al. 2018, §1 step 2 and §2 ("flat
//! clipping"): each record x_i is scaled by min(1, C / ‖x_i‖), with ‖·‖ the joint L2 norm over
//! all its parts, and the scaled records are summed.
//!
//! Joint clipping with scales (§2): with part scales α_j the norm is that of the scaled record
//! (x_i1/α_1, …, x_iK/α_K); the factor multiplies the unscaled parts, so the sum returned is
//! already "scaled back". With all α_j = 1 this is flat clipping, bit for bit.
//!
//! One pass over memory. Records are processed in tiles of a few rows: the norms of a tile are
//! computed first (phase 1), then the tile's scaled rows are added into the f64 sums while they
//! are still cached (phase 2). When the records are wide enough, each worker thread owns a fixed
//! range of columns for the whole call (`clip_sum_owned`): it reads its slice of each tile from
//! memory in phase 1 and finds it in its own L2 cache in phase 2, with the sums of its columns
//! beside it. Otherwise (`clip_sum_tiled`) both phases are split into column blocks that any
//! thread may take. Every sum is taken in a fixed order either way (the norm's per-block partial
//! sums in block order, each coordinate's sum in record order), so the result is the same bits
//! whatever the path or the number of threads.
//!
//! Groups (§2, per-layer clipping; the leaves of a nested query): the parts of a record may be
//! split into groups, each clipped on its own to its own bound, still in the one pass. A group is
//! a run of consecutive parts, hence of consecutive column blocks; its norm adds its blocks'
//! partial sums in block order, so a group gives the same bits as a call on that group alone.
//!
//! Non-finite records. A record with a NaN or ±∞ value anywhere (for groups: in any of its
//! groups) contributes exactly zero to every sum, and its norm is reported as NaN in every group
//! (so that callers can count such records, or refuse them). Nothing is raised: an error would
//! make whether a call succeeds depend on one record, which an adversary who plants a NaN record
//! could observe (whether training stops tells whether that record was sampled; Cebere et al.,
//! PETS 2026). Zero is within the sensitivity the release accounts for: the clip of McMahan et
//! al. 2018, §2, bounds each record's contribution by ‖π_C(x)‖ ≤ C, and the zero vector has norm
//! 0 ≤ C; replacing a record by zero is the change of one record, which is what the
//! neighbouring relation (and hence the privacy analysis) already covers. The rows are left out
//! of the sums, not multiplied by a factor 0 (0·NaN = NaN): phase 2 hands the kernels the runs of
//! rows between them, and as every coordinate is summed in record order, the sums are those of
//! the batch without the non-finite records, bit for bit (for every path and thread count).
//! Huge finite records (whose squares overflow f64) and tiny ones (whose squares underflow) are
//! finite records: they are re-measured with scaling (`careful_norm`) and clipped as usual.

use crate::error::{require, DpError, DpResult};
use crate::kernels;
use crate::records::{Column, Elem, Records};
use rayon::prelude::*;

mod barrier;
mod rounded;
mod schedule;
pub use rounded::{clip_round_sum, RoundedSum};
use schedule::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// Values per column block. Fixes the order of the norm's partial sums.
pub const BLOCK: usize = 4096;
/// Bytes of records per tile: half of a 32 MiB L3, leaving room for the f64 sums (measured
/// best among 4–24 MiB on the (256, 1e5) and (64, 1e6) benchmarks).
const TILE_BYTES: usize = 16 << 20;
/// Rows per tile in the owned-columns path: a multiple of four (the row grouping of the sum) that
/// keeps a thread's slice of the tile about L2-sized on the widths this path serves.
const OWNED_TILE_ROWS: usize = 4;
/// Below this many values a call runs on the calling thread.
const PAR_MIN_VALUES: usize = 1 << 16;
/// Sums of squares below this may have lost bits to underflow; such records are re-measured
/// with scaling (only f64 records can get here).
const SUMSQ_TINY: f64 = 1e-280;

pub fn check_clip(l2_norm_clip: f64) -> DpResult<()> {
    let c = l2_norm_clip;
    require(c.is_finite() && c > 0.0, "l2_norm_clip", "finite and > 0", c)
}

/// The clipped sum Σ_i min(1, C/‖x_i‖)·x_i per part, in f64, and the unclipped norms ‖x_i‖,
/// group-major (the norm of group g of record r at g·batch + r; just the records' norms for
/// one group).
#[derive(Debug, Clone)]
pub struct ClippedSum {
    pub sums: Vec<Vec<f64>>,
    pub norms: Vec<f64>,
}

/// Relative slack subtracted from every clip factor so that the clipped record's norm stays
/// ≤ C after all rounding: the f64 norm's summation error (at most about D·2⁻⁵³), the
/// divisions and products (a few 2⁻⁵³), and the final rounding to the output type. Per group.
fn clip_margin(records: &Records, g: usize) -> f64 {
    let out_roundoff = records
        .group_parts(g)
        .map(|p| match p.data {
            Column::F32(_) => f32::UNIT_ROUNDOFF,
            Column::F64(_) => f64::UNIT_ROUNDOFF,
        })
        .fold(0.0, f64::max);
    let dim: usize = records.group_parts(g).map(|p| p.width).sum();
    2.0 * ((dim as f64 + 32.0) * f64::UNIT_ROUNDOFF + out_roundoff)
}

/// min(1, C / ‖x‖), shrunk by `margin` so that rounding can never push the clipped norm past C.
///
/// For a NaN norm (a non-finite record) the factor is NaN, the mark of a row that phase 2 leaves
/// out of the sums ([`left_out`]): its clip factor is in effect 0, without the 0·NaN = NaN that
/// multiplying by 0 would give.
#[inline]
pub fn clip_factor(norm: f64, clip: f64, margin: f64) -> f64 {
    let inflated = norm * (1.0 + margin);
    if inflated <= clip {
        return 1.0;
    }
    // Here inflated > C, or NaN (then C/NaN = NaN, the mark of a row left out).
    let f = clip / inflated;
    if f < f64::MIN_POSITIVE {
        // A subnormal factor (‖x‖ > C·2¹⁰²², f64 records only) has fewer bits than the margin
        // assumes: its rounding alone could exceed it (C = 10⁻³, ‖x‖ ≈ 8·10³⁰⁷ gave a clipped
        // norm of (1 + 1.3·10⁻¹³)·C). Rounded down instead, it never exceeds C/‖x‖.
        f.next_down().max(0.0)
    } else {
        f
    }
}

/// Whether a row with clip factor `f` is left out of the sums: a non-finite record (NaN norm,
/// NaN factor), whose contribution is exactly zero.
#[inline]
pub fn left_out(f: f64) -> bool {
    f.is_nan()
}

fn row<'a, T: Elem>(x: &'a [T], width: usize, r: usize, b: &Block) -> &'a [T] {
    &x[r * width + b.start..r * width + b.start + b.len]
}

fn block_sumsq(records: &Records, r: usize, b: &Block) -> f64 {
    let p = &records.parts[b.part];
    match p.data {
        Column::F32(x) => kernels::sumsq(row(x, p.width, r, b)),
        Column::F64(x) => kernels::sumsq(row(x, p.width, r, b)),
    }
}

/// Re-examines group g of record r, whose sum of squares is non-finite or tiny: NaN when the group
/// holds a NaN or ∞ (a non-finite record), else the norm recomputed with scaling, for squares that
/// overflowed or underflowed (huge or subnormal values: finite records, clipped as usual).
fn careful_norm(records: &Records, r: usize, g: usize) -> f64 {
    fn part_row<T: Elem>(x: &[T], w: usize, r: usize) -> &[T] {
        &x[r * w..(r + 1) * w]
    }
    let mut m = 0.0f64;
    for p in records.group_parts(g) {
        let (ok, mx) = match p.data {
            Column::F32(x) => {
                let s = part_row(x, p.width, r);
                (kernels::all_finite(s), kernels::max_abs(s))
            }
            Column::F64(x) => {
                let s = part_row(x, p.width, r);
                (kernels::all_finite(s), kernels::max_abs(s))
            }
        };
        if !ok {
            return f64::NAN;
        }
        m = m.max(mx / p.scale);
    }
    if m == 0.0 {
        return 0.0;
    }
    let mut s = 0.0;
    for p in records.group_parts(g) {
        s += match p.data {
            Column::F32(x) => kernels::sumsq_scaled(part_row(x, p.width, r), m * p.scale),
            Column::F64(x) => kernels::sumsq_scaled(part_row(x, p.width, r), m * p.scale),
        };
    }
    m * s.sqrt()
}

/// 1/α² per block; exactly 1 for flat clipping, so flat results do not depend on the scales path.
fn block_weights(records: &Records, blocks: &[Block]) -> Vec<f64> {
    blocks
        .iter()
        .map(|b| 1.0 / records.parts[b.part].scale.powi(2))
        .collect()
}

/// The norm of group g of record r from the per-block sums of squares of the group's blocks,
/// added in block order (the one summation order every path uses, so all paths give the same
/// norms). Non-finite or tiny sums are re-examined; NaN for a non-finite group.
fn norm_from_blocks(
    records: &Records,
    r: usize,
    g: usize,
    sums: impl Iterator<Item = f64>,
    weights: &[f64],
) -> f64 {
    let s: f64 = sums.zip(weights).map(|(p, w)| p * w).sum();
    if s.is_finite() && s >= SUMSQ_TINY {
        s.sqrt()
    } else {
        careful_norm(records, r, g)
    }
}

/// The L2 norm of every record (joint over its parts, each part divided by its scale), in f64;
/// group-major with several groups, as in [`ClippedSum`]. A non-finite record's norm is NaN in
/// every group.
pub fn record_norms(records: &Records) -> Vec<f64> {
    let layout = Layout::new(records);
    let (step, par) = (tile_rows(records), use_parallel(records));
    let mut norms = GroupNorms::new(records);
    let mut r0 = 0;
    while r0 < records.batch {
        let r1 = (r0 + step).min(records.batch);
        norms.extend(&tile_norms(records, &layout, r0, r1, par), r1 - r0);
        r0 = r1;
    }
    norms.into_flat()
}

/// Σ_j x_ij² of every record of every part separately, in f64 and unscaled: the factors of a
/// factored per-record norm (‖g_i a_iᵀ‖² = ‖g_i‖²‖a_i‖², Goodfellow 2015), which the torch
/// adapter combines. Each sum is `kernels::sumsq` (squares exact for f32 inputs; summation error
/// within the (width + 32)·2⁻⁵³ that `clip_margin` allows). A NaN or ∞ in a record makes its sum
/// non-finite; the caller treats that record (as the clip does: zero contribution, see the module
/// docs). `parallel` false keeps the work on the calling thread
/// (for callers between the parallel regions of another runtime, whose threads would compete).
pub fn part_sumsq(records: &Records, parallel: bool) -> Vec<Vec<f64>> {
    let par = parallel && use_parallel(records);
    let b = records.batch;
    records
        .parts
        .iter()
        .map(|p| {
            let w = p.width;
            let one = |r: usize| match p.data {
                Column::F32(x) => kernels::sumsq(&x[r * w..(r + 1) * w]),
                Column::F64(x) => kernels::sumsq(&x[r * w..(r + 1) * w]),
            };
            if par {
                (0..b).into_par_iter().map(one).collect()
            } else {
                (0..b).map(one).collect()
            }
        })
        .collect()
}

/// Clips every record to L2 norm `l2_norm_clip` and sums them, in one pass over the records
/// (each group to that bound on its own when there are several; McMahan et al. 2018, §2). A
/// non-finite record contributes zero and has norm NaN (see the module docs). On error (a bound
/// out of range, an allocation that fails) nothing is returned.
pub fn clip_sum(records: &Records, l2_norm_clip: f64) -> DpResult<ClippedSum> {
    clip_sum_groups(records, &vec![l2_norm_clip; records.groups()])
}

/// Clips group g of every record to L2 norm `clips[g]` and sums the clipped records, all groups
/// in one pass over the records and one parallel region (McMahan et al. 2018, §2: separate
/// clipping parameters per group). Group g's sums and norms are the bits `clip_sum` gives for
/// that group alone, except that a record non-finite in any group contributes zero to every
/// group's sums and has norm NaN in every group (the record, not the group, is what the release
/// protects). On error (a bound out of range) nothing is returned.
pub fn clip_sum_groups(records: &Records, clips: &[f64]) -> DpResult<ClippedSum> {
    Ok(clip_accumulate(records, clips, Accumulate::Scaled)?.0)
}

/// The one pass of `clip_sum_groups`, with phase 2 as `mode` says; returns the sums, the norms
/// and (for `Accumulate::Rounded`) each record's squared rounded norm as screened in f64.
fn clip_accumulate(
    records: &Records,
    clips: &[f64],
    mode: Accumulate,
) -> DpResult<(ClippedSum, Vec<f64>)> {
    if clips.len() != records.groups() {
        return Err(DpError::param(
            "l2_norm_clip",
            format!("{} bounds for {} groups", clips.len(), records.groups()),
        ));
    }
    for &c in clips {
        check_clip(c)?;
    }
    let layout = Layout::new(records);
    let margins: Vec<f64> = (0..clips.len()).map(|g| clip_margin(records, g)).collect();
    let threads = rayon::current_num_threads();
    if use_parallel(records) && threads > 1 && layout.blocks.len() >= 2 * threads {
        // Only one owned-columns call runs its barrier at a time; a caller that finds it busy
        // takes the tiled path instead of waiting (waiting could deadlock a caller that is
        // itself a pool thread the running call needs).
        if let Ok(_only_one) = OWNED_PATH.try_lock() {
            return clip_sum_owned(records, &layout, clips, &margins, threads, mode);
        }
    }
    clip_sum_tiled(records, &layout, clips, &margins, mode)
}

fn zero_sums(records: &Records) -> DpResult<Vec<Vec<f64>>> {
    records
        .parts
        .iter()
        .map(|p| crate::error::try_filled(p.width, 0.0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::pool;

    #[test]
    fn part_sumsq_is_each_parts_squared_row_norm() {
        let a: Vec<f32> = (0..3 * 5).map(|i| i as f32 - 4.0).collect();
        let b: Vec<f64> = (0..3 * 2).map(|i| 0.5 * i as f64).collect();
        let rec = Records::new(
            3,
            vec![Part::new(Column::F32(&a), 5), Part::new(Column::F64(&b), 2)],
        )
        .unwrap();
        let s = part_sumsq(&rec, true);
        assert_eq!(s, part_sumsq(&rec, false));
        for r in 0..3 {
            let ra: f64 = a[r * 5..r * 5 + 5]
                .iter()
                .map(|v| (*v as f64).powi(2))
                .sum();
            let rb: f64 = b[r * 2..r * 2 + 2].iter().map(|v| v * v).sum();
            assert_eq!(s[0][r], ra);
            assert_eq!(s[1][r], rb);
        }
        let mut bad = a.clone();
        bad[7] = f32::NAN;
        let rec = Records::new(3, vec![Part::new(Column::F32(&bad), 5)]).unwrap();
        assert!(part_sumsq(&rec, true)[0][1].is_nan());
    }
    use crate::records::Part;

    fn f32_records(batch: usize, widths: &[usize], data: &[Vec<f32>]) -> Records<'static> {
        let parts = widths
            .iter()
            .zip(data)
            .map(|(&w, d)| Part::new(Column::F32(Box::leak(d.clone().into_boxed_slice())), w))
            .collect();
        Records::new(batch, parts).unwrap()
    }

    fn pseudo(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 + 1) * 2654435761 + seed) % 1000) as f32 / 100.0 - 5.0)
            .collect()
    }

    fn reference(
        batch: usize,
        widths: &[usize],
        data: &[Vec<f32>],
        c: f64,
    ) -> (Vec<Vec<f64>>, Vec<f64>) {
        let norms: Vec<f64> = (0..batch)
            .map(|r| {
                widths
                    .iter()
                    .zip(data)
                    .map(|(&w, d)| {
                        d[r * w..(r + 1) * w]
                            .iter()
                            .map(|v| (*v as f64).powi(2))
                            .sum::<f64>()
                    })
                    .sum::<f64>()
                    .sqrt()
            })
            .collect();
        let sums = widths
            .iter()
            .zip(data)
            .map(|(&w, d)| {
                (0..w)
                    .map(|j| {
                        (0..batch)
                            .map(|r| (c / norms[r]).min(1.0) * d[r * w + j] as f64)
                            .sum()
                    })
                    .collect()
            })
            .collect();
        (sums, norms)
    }

    #[test]
    fn matches_reference_over_shapes() {
        for (batch, widths) in [
            (1, vec![3]),
            (5, vec![1, 7]),
            (33, vec![5000, 3, 9000]),
            (3, vec![0, 4]),
        ] {
            let data: Vec<Vec<f32>> = widths
                .iter()
                .enumerate()
                .map(|(k, &w)| pseudo(batch * w, k as u64))
                .collect();
            let rec = f32_records(batch, &widths, &data);
            let out = clip_sum(&rec, 3.0).unwrap();
            let (sums, norms) = reference(batch, &widths, &data, 3.0);
            for (a, b) in out.norms.iter().zip(&norms) {
                assert!((a - b).abs() <= 1e-12 * b, "{a} vs {b}");
            }
            for (s, t) in out.sums.iter().zip(&sums) {
                for (a, b) in s.iter().zip(t) {
                    assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn clipped_norm_never_exceeds_clip() {
        for scale in [1e-3f32, 1.0, 7.0, 1e6] {
            let w = 10_000;
            let d: Vec<f32> = pseudo(w, 9).iter().map(|v| v * scale).collect();
            let rec = f32_records(1, &[w], &[d]);
            for c in [1e-6, 0.1, 1.0, 3.3] {
                let out = clip_sum(&rec, c).unwrap();
                let as_f32: Vec<f32> = out.sums[0].iter().map(|v| *v as f32).collect();
                let n = as_f32
                    .iter()
                    .map(|v| (*v as f64).powi(2))
                    .sum::<f64>()
                    .sqrt();
                assert!(n <= c, "norm {n} > clip {c}");
            }
        }
    }

    /// Rows `keep` of a row-major batch of `width` values per record.
    fn rows_of<T: Copy>(x: &[T], width: usize, keep: &[usize]) -> Vec<T> {
        keep.iter()
            .flat_map(|&r| x[r * width..(r + 1) * width].iter().copied())
            .collect()
    }

    /// The records of 0..batch other than `bad`.
    fn kept(batch: usize, bad: &[usize]) -> Vec<usize> {
        (0..batch).filter(|r| !bad.contains(r)).collect()
    }

    /// The sums and the norms of the kept records must be those of the batch without the bad
    /// ones, bit for bit; the bad records' norms NaN in every group.
    fn assert_left_out(with: &ClippedSum, without: &ClippedSum, batch: usize, bad: &[usize], what: &str) {
        assert_eq!(with.sums, without.sums, "{what}: sums");
        let groups = with.norms.len() / batch.max(1);
        let keep = kept(batch, bad);
        for g in 0..groups {
            let norms = &with.norms[g * batch..(g + 1) * batch];
            for &r in bad {
                assert!(norms[r].is_nan(), "{what}: norm of bad record {r} in group {g}");
            }
            let good: Vec<f64> = keep.iter().map(|&r| norms[r]).collect();
            assert_eq!(good, without.norms[g * keep.len()..(g + 1) * keep.len()], "{what}: norms");
        }
    }

    #[test]
    fn non_finite_record_adds_zero_and_has_nan_norm() {
        let mut d = pseudo(56, 1);
        d[3 * 8 + 2] = f32::NAN;
        d[6 * 8] = f32::INFINITY;
        let rec = f32_records(7, &[8], &[d.clone()]);
        let out = clip_sum(&rec, 1.0).unwrap();
        let keep = kept(7, &[3, 6]);
        let clean = f32_records(5, &[8], &[rows_of(&d, 8, &keep)]);
        assert_left_out(&out, &clip_sum(&clean, 1.0).unwrap(), 7, &[3, 6], "small");
        assert!(out.sums[0].iter().all(|v| v.is_finite()));
        let n = record_norms(&rec);
        assert!(n[3].is_nan() && n[6].is_nan() && n[0].is_finite());
        // A batch of nothing but non-finite records sums to exactly zero.
        let all_bad = f32_records(2, &[3], &[vec![f32::NAN, 1.0, 2.0, 0.0, f32::NEG_INFINITY, 1.0]]);
        let out = clip_sum(&all_bad, 1.0).unwrap();
        assert!(out.sums[0].iter().all(|v| v.to_bits() == 0));
        assert!(out.norms.iter().all(|v| v.is_nan()));
    }

    /// Huge finite values (squares that overflow f64, or f32 values near f32::MAX) and subnormal
    /// ones are finite records: measured with scaling, clipped to ≤ C, never left out.
    #[test]
    fn huge_and_subnormal_records_are_clipped_not_left_out() {
        let f32s: Vec<f32> = [
            [1e30f32, -1e30, 3e30, 0.0],
            [f32::MAX, f32::MAX, -f32::MAX, 1.0],
            [1e-40f32, -3e-42, 1e-45, 0.0],
            [0.5, 0.25, -0.5, 0.125],
        ]
        .concat();
        let rec = f32_records(4, &[4], &[f32s]);
        let f64s: Vec<f64> = [
            [1e200f64, -1e300, 1e307, -1e308],
            [f64::MAX / 4.0, f64::MAX / 4.0, -f64::MAX / 4.0, 0.0],
            [5e-324f64, 1e-310, -2e-320, 0.0],
        ]
        .concat();
        let rec64 = Records::new(3, vec![Part::new(Column::F64(&f64s), 4)]).unwrap();
        for ((rec, b), c) in [(&rec, 4usize), (&rec64, 3)].into_iter().flat_map(|x| [(x, 2.5), (x, 1e-3)]) {
            let norms = record_norms(rec);
            assert!(norms.iter().all(|n| !n.is_nan()), "{norms:?}");
            for r in 0..b {
                // Each record alone: its clipped contribution has norm ≤ C and is not zero.
                let one: Records = match rec.parts[0].data {
                    Column::F32(x) => Records::new(1, vec![Part::new(Column::F32(&x[r * 4..r * 4 + 4]), 4)]),
                    Column::F64(x) => Records::new(1, vec![Part::new(Column::F64(&x[r * 4..r * 4 + 4]), 4)]),
                }
                .unwrap();
                let s = clip_sum(&one, c).unwrap();
                let n = s.sums[0].iter().map(|v| v * v).sum::<f64>().sqrt();
                assert!(n <= c, "record {r}: clipped norm {n} > {c}");
                assert!(s.sums[0].iter().any(|v| *v != 0.0), "record {r} was left out");
                assert!(s.sums[0].iter().all(|v| v.is_finite()));
            }
        }
    }

    #[test]
    fn huge_and_tiny_f64_records_are_measured_with_scaling() {
        let big = vec![1e200f64, -1e200, 1e200];
        let tiny = vec![3e-170f64, 4e-170, 0.0];
        let zero = vec![0.0f64; 3];
        let data: Vec<f64> = [big, tiny, zero].concat();
        let rec = Records::new(3, vec![Part::new(Column::F64(&data), 3)]).unwrap();
        let n = record_norms(&rec);
        assert!((n[0] / (3f64.sqrt() * 1e200) - 1.0).abs() < 1e-15);
        assert!((n[1] / 5e-170 - 1.0).abs() < 1e-15);
        assert_eq!(n[2], 0.0);
        let s = clip_sum(&rec, 1e-171).unwrap();
        let tiny_out = (s.sums[0][0].powi(2) + s.sums[0][1].powi(2)).sqrt();
        assert!(tiny_out.is_finite() && s.sums[0][2].abs() < 1e-171);
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let widths = [70_000usize, 123, 100_000];
        let data: Vec<Vec<f32>> = widths
            .iter()
            .enumerate()
            .map(|(k, &w)| pseudo(200 * w, k as u64))
            .collect();
        let rec = f32_records(200, &widths, &data);
        let one = pool(1);
        let four = pool(4);
        let a = one.install(|| clip_sum(&rec, 2.0).unwrap());
        let b = four.install(|| clip_sum(&rec, 2.0).unwrap());
        assert_eq!(a.sums, b.sums);
        assert_eq!(a.norms, b.norms);
    }

    /// Both paths, every thread count, the same bits: several parts of both dtypes and scales,
    /// batches that are not a multiple of the tile, and the same first bad record.
    #[test]
    fn owned_columns_path_matches_tiled_path_bit_for_bit() {
        let widths = [9_000usize, 5, 20_000];
        let batch = 23;
        let f32s: Vec<Vec<f32>> = widths
            .iter()
            .enumerate()
            .map(|(k, &w)| pseudo(batch * w, k as u64))
            .collect();
        let f64s: Vec<f64> = pseudo(batch * 7_000, 5)
            .iter()
            .map(|v| *v as f64 * 1e3)
            .collect();
        let mut parts: Vec<Part> = widths
            .iter()
            .zip(&f32s)
            .map(|(&w, d)| Part::new(Column::F32(d), w))
            .collect();
        parts.push(Part::new(Column::F64(&f64s), 7_000).with_scale(30.0));
        let rec = Records::new(batch, parts).unwrap();
        let layout = Layout::new(&rec);
        let margin = [clip_margin(&rec, 0)];
        let tiled = clip_sum_tiled(&rec, &layout, &[40.0], &margin, Accumulate::Scaled).unwrap().0;
        for threads in [1usize, 2, 3, 7] {
            let pool = pool(threads);
            let owned = pool
                .install(|| clip_sum_owned(&rec, &layout, &[40.0], &margin, threads, Accumulate::Scaled))
                .unwrap()
                .0;
            assert_eq!(owned.sums, tiled.sums, "{threads} threads");
            assert_eq!(owned.norms, tiled.norms, "{threads} threads");
        }
        // Non-finite records 17 and 21: left out on both paths at every thread count, the bits
        // of the batch without them.
        let mut bad = f32s[2].clone();
        bad[17 * 20_000 + 5] = f32::NAN;
        bad[21 * 20_000] = f32::INFINITY;
        let keep = kept(batch, &[17, 21]);
        let (a, b) = (rows_of(&f32s[0], 9_000, &keep), rows_of(&bad, 20_000, &keep));
        let clean = Records::new(
            keep.len(),
            vec![Part::new(Column::F32(&a), 9_000), Part::new(Column::F32(&b), 20_000)],
        )
        .unwrap();
        let parts = vec![
            Part::new(Column::F32(&f32s[0]), 9_000),
            Part::new(Column::F32(&bad), 20_000),
        ];
        let rec = Records::new(batch, parts).unwrap();
        let layout = Layout::new(&rec);
        let clean_layout = Layout::new(&clean);
        let margin = [clip_margin(&rec, 0)];
        let without = clip_sum_tiled(&clean, &clean_layout, &[1.0], &margin, Accumulate::Scaled).unwrap().0;
        let tiled = clip_sum_tiled(&rec, &layout, &[1.0], &margin, Accumulate::Scaled).unwrap().0;
        assert_left_out(&tiled, &without, batch, &[17, 21], "tiled");
        for threads in [1usize, 2, 3, 7] {
            let pool = pool(threads);
            let owned = pool
                .install(|| clip_sum_owned(&rec, &layout, &[1.0], &margin, threads, Accumulate::Scaled))
                .unwrap()
                .0;
            assert_left_out(&owned, &without, batch, &[17, 21], &format!("owned, {threads} threads"));
            let clean_owned = pool
                .install(|| clip_sum_owned(&clean, &clean_layout, &[1.0], &margin, threads, Accumulate::Scaled))
                .unwrap()
                .0;
            assert_eq!(clean_owned.sums, without.sums, "{threads} threads");
        }
    }

    /// Groups clipped in one call give, group by group, the bits of a call on that group alone,
    /// on both paths and at any thread count (the nested query's one call rests on this).
    #[test]
    fn groups_match_separate_calls_bit_for_bit() {
        let batch = 19;
        let widths = [7_000usize, 3, 0, 12_000, 5_000, 9];
        let groups = [0usize, 0, 1, 2, 2, 3];
        let clips = [2.0, 0.5, 30.0, 1e-3];
        let data: Vec<Vec<f32>> = widths
            .iter()
            .enumerate()
            .map(|(k, &w)| pseudo(batch * w, k as u64 + 11))
            .collect();
        let parts: Vec<Part> = widths
            .iter()
            .zip(&data)
            .zip(groups)
            .map(|((&w, d), g)| {
                Part::new(Column::F32(d), w)
                    .with_group(g)
                    .with_scale(1.0 + g as f64)
            })
            .collect();
        let rec = Records::new(batch, parts.clone()).unwrap();
        assert_eq!(rec.groups(), 4);
        let alone: Vec<ClippedSum> = (0..4)
            .map(|g| {
                let own = parts
                    .iter()
                    .filter(|p| p.group == g)
                    .map(|p| p.with_group(0))
                    .collect();
                clip_sum(&Records::new(batch, own).unwrap(), clips[g]).unwrap()
            })
            .collect();
        let check = |out: &ClippedSum, what: &str| {
            let sums: Vec<Vec<f64>> = alone.iter().flat_map(|a| a.sums.clone()).collect();
            let norms: Vec<f64> = alone.iter().flat_map(|a| a.norms.clone()).collect();
            assert_eq!(out.sums, sums, "{what}");
            assert_eq!(out.norms, norms, "{what}");
        };
        let layout = Layout::new(&rec);
        let margins: Vec<f64> = (0..4).map(|g| clip_margin(&rec, g)).collect();
        check(&clip_sum_groups(&rec, &clips).unwrap(), "dispatch");
        check(&clip_sum_tiled(&rec, &layout, &clips, &margins, Accumulate::Scaled).unwrap().0, "tiled");
        for threads in [1usize, 2, 3] {
            let pool = pool(threads);
            let owned = pool
                .install(|| clip_sum_owned(&rec, &layout, &clips, &margins, threads, Accumulate::Scaled))
                .unwrap()
                .0;
            check(&owned, &format!("owned, {threads} threads"));
        }
        let norms = record_norms(&rec);
        assert_eq!(norms, clip_sum_groups(&rec, &clips).unwrap().norms);
        assert!(clip_sum_groups(&rec, &clips[..3]).is_err());
        assert!(clip_sum_groups(&rec, &[1.0, 1.0, f64::NAN, 1.0]).is_err());
        // Groups must be numbered in order.
        let shuffled = vec![parts[0].with_group(1), parts[1].with_group(0)];
        assert!(Records::new(batch, shuffled).is_err());
        let skipped = vec![parts[0], parts[1].with_group(2)];
        assert!(Records::new(batch, skipped).is_err());
    }

    #[test]
    fn joint_clipping_uses_scaled_norm() {
        // Paper §2 example: ‖v1‖ ≤ 1, ‖v2‖ ≤ 100, α = (1, 100), S = 1.
        let v1 = [0.6f64, 0.8, 0.0, 0.0]; // records: (v1=(0.6,0.8), v2=0), (v1=0, v2=(60,80))
        let v2 = [0.0f64, 0.0, 60.0, 80.0];
        let parts = vec![
            Part::new(Column::F64(&v1), 2).with_scale(1.0),
            Part::new(Column::F64(&v2), 2).with_scale(100.0),
        ];
        let rec = Records::new(2, parts).unwrap();
        let n = record_norms(&rec);
        assert!((n[0] - 1.0).abs() < 1e-15 && (n[1] - 1.0).abs() < 1e-15);
        let out = clip_sum(&rec, 0.5).unwrap();
        assert!((out.sums[0][0] - 0.3).abs() < 1e-9 && (out.sums[1][1] - 40.0).abs() < 1e-6);
        let bad = vec![Part::new(Column::F64(&v1), 2).with_scale(0.0)];
        assert!(Records::new(2, bad).is_err());
    }

    /// A record non-finite in one group is left out of every group (the record is the unit of
    /// privacy), and has norm NaN in every group; on both paths, at any thread count.
    #[test]
    fn a_record_bad_in_one_group_is_left_out_of_every_group() {
        let batch = 13;
        let widths = [7_000usize, 3, 12_000, 5];
        let groups = [0usize, 0, 1, 2];
        let clips = [2.0, 30.0, 1e-3];
        let mut data: Vec<Vec<f32>> = widths
            .iter()
            .enumerate()
            .map(|(k, &w)| pseudo(batch * w, k as u64 + 3))
            .collect();
        data[1][4 * 3 + 1] = f32::NAN; // record 4, group 0
        data[2][9 * 12_000 + 11_999] = f32::NEG_INFINITY; // record 9, group 1
        data[3][12 * 5] = f32::INFINITY; // record 12 (the last), group 2
        let bad = [4usize, 9, 12];
        let keep = kept(batch, &bad);
        let clean: Vec<Vec<f32>> = data.iter().zip(widths).map(|(d, w)| rows_of(d, w, &keep)).collect();
        let parts = |d: &'static [Vec<f32>]| -> Vec<Part<'static>> {
            widths
                .iter()
                .zip(d)
                .zip(groups)
                .map(|((&w, x), g)| Part::new(Column::F32(x), w).with_group(g).with_scale(0.5 + g as f64))
                .collect()
        };
        let data: &'static [Vec<f32>] = Box::leak(data.into_boxed_slice());
        let clean: &'static [Vec<f32>] = Box::leak(clean.into_boxed_slice());
        let rec = Records::new(batch, parts(data)).unwrap();
        let rec_clean = Records::new(keep.len(), parts(clean)).unwrap();
        let without = clip_sum_groups(&rec_clean, &clips).unwrap();
        assert_left_out(&clip_sum_groups(&rec, &clips).unwrap(), &without, batch, &bad, "dispatch");
        let layout = Layout::new(&rec);
        let margins: Vec<f64> = (0..3).map(|g| clip_margin(&rec, g)).collect();
        let tiled = clip_sum_tiled(&rec, &layout, &clips, &margins, Accumulate::Scaled).unwrap().0;
        assert_left_out(&tiled, &without, batch, &bad, "tiled");
        for threads in [1usize, 2, 3] {
            let pool = pool(threads);
            let owned = pool
                .install(|| clip_sum_owned(&rec, &layout, &clips, &margins, threads, Accumulate::Scaled))
                .unwrap()
                .0;
            assert_left_out(&owned, &without, batch, &bad, &format!("owned, {threads} threads"));
        }
        assert_eq!(
            record_norms(&rec).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            tiled.norms.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// Narrow and wide records, several tiles, NaN and ±∞ anywhere: the sums are those of the
    /// batch without the bad records, bit for bit, whatever the thread count (both dispatch paths).
    #[test]
    fn non_finite_records_are_left_out_for_small_and_large_records() {
        for (width, batch, bad) in [
            (8usize, 300usize, vec![97usize, 250, 280]),
            (200_000, 60, vec![0, 23, 24, 59]),
        ] {
            let mut d = pseudo(batch * width, 2);
            let kinds = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY];
            for (i, &r) in bad.iter().enumerate() {
                d[r * width + (i * 7919) % width] = kinds[i % 3];
            }
            let keep = kept(batch, &bad);
            let clean = f32_records(keep.len(), &[width], &[rows_of(&d, width, &keep)]);
            let rec = f32_records(batch, &[width], &[d]);
            let without = pool(1).install(|| clip_sum(&clean, 1.0).unwrap());
            for threads in [1usize, 2, 4] {
                let out = pool(threads).install(|| clip_sum(&rec, 1.0).unwrap());
                assert_left_out(&out, &without, batch, &bad, &format!("width {width}, {threads} threads"));
            }
            let norms = record_norms(&rec);
            assert!(bad.iter().all(|&r| norms[r].is_nan()));
            assert_eq!(norms.iter().filter(|n| n.is_nan()).count(), bad.len());
        }
    }

    /// Many random batches with NaN/±∞ at random places, in f32 and f64 parts and two groups: the
    /// clipped sum with the bad records equals, bit for bit, the one without them.
    #[test]
    fn random_non_finite_positions_are_left_out() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..200 {
            let batch = 1 + (next() % 40) as usize;
            let (w0, w1) = (1 + (next() % 9) as usize, (next() % 6) as usize);
            let mut a = pseudo(batch * w0, next() % 1000);
            let mut b: Vec<f64> = pseudo(batch * w1, next() % 1000).iter().map(|v| *v as f64 * 1e3).collect();
            let mut bad = Vec::new();
            for _ in 0..(next() % 4) {
                let r = (next() % batch as u64) as usize;
                let v = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][(next() % 3) as usize];
                if w1 > 0 && next() % 2 == 0 {
                    b[r * w1 + (next() % w1 as u64) as usize] = v;
                } else {
                    a[r * w0 + (next() % w0 as u64) as usize] = v as f32;
                }
                bad.push(r);
            }
            bad.sort_unstable();
            bad.dedup();
            let keep = kept(batch, &bad);
            let (ca, cb) = (rows_of(&a, w0, &keep), rows_of(&b, w1, &keep));
            let grouped = next() % 2 == 0;
            let g1 = usize::from(grouped);
            let clips = if grouped { vec![0.7, 40.0] } else { vec![0.7] };
            let mk = |n: usize, x: &'static [f32], y: &'static [f64]| {
                Records::new(
                    n,
                    vec![
                        Part::new(Column::F32(x), w0),
                        Part::new(Column::F64(y), w1).with_group(g1).with_scale(3.0),
                    ],
                )
                .unwrap()
            };
            let leak32 = |v: Vec<f32>| -> &'static [f32] { Box::leak(v.into_boxed_slice()) };
            let leak64 = |v: Vec<f64>| -> &'static [f64] { Box::leak(v.into_boxed_slice()) };
            let with = clip_sum_groups(&mk(batch, leak32(a), leak64(b)), &clips).unwrap();
            let without = clip_sum_groups(&mk(keep.len(), leak32(ca), leak64(cb)), &clips).unwrap();
            assert_left_out(&with, &without, batch, &bad, "random");
        }
    }

    #[test]
    fn rejects_bad_clip_and_shapes() {
        let d = [1.0f32; 6];
        let rec = Records::new(2, vec![Part::new(Column::F32(&d), 3)]).unwrap();
        for c in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                clip_sum(&rec, c),
                Err(DpError::InvalidParameter { .. })
            ));
        }
        assert!(Records::new(3, vec![Part::new(Column::F32(&d), 3)]).is_err());
    }
}
