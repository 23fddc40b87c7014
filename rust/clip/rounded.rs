//! Clipping onto the integer grid, for the discrete Gaussian mechanism (`crate::discrete`):
//! each record is clipped as in `clip_sum` (the same pass, with a rounding phase 2), divided by
//! the grid step γ (times its part's scale α
//! for joint clipping), rounded to the nearest integer per coordinate, and summed exactly.
//!
//! The sums are held in f64, where integers up to 2⁵³ are exact; the caller's batch and grid are
//! checked to stay below 2⁵². Each rounded record's squared norm is held to the integer bound S
//! of `DiscreteParams` (Kairouz, Liu & Steinke 2021, §4): a fast f64 check with the summation
//! error allowed for, then an exact u128 recount for the records it cannot clear. A record that
//! fails the exact check (only possible when rounding meets the triangle-inequality worst case)
//! is rounded toward zero instead, whose norm never exceeds the clipped one.
//!
//! A non-finite record (a NaN or ±∞ value) is left out of the sums as in `clip_sum` (see the
//! parent module): it adds exactly zero (the zero vector is on the grid, with norm 0 ≤ √S), its
//! norm is NaN, its screen value 0 (never re-examined) and it is not counted as truncated.

use super::*;

use crate::kernels::round_product;
use schedule::Accumulate;

const EXACT_LIMIT: f64 = (1u64 << 52) as f64;

/// Σ_i round(f_i·x_i/(γ·α)) per part (grid units, exact integers in f64), and the records' norms.
#[derive(Debug, Clone)]
pub struct RoundedSum {
    pub sums: Vec<Vec<f64>>,
    pub norms: Vec<f64>,
    /// Records whose nearest-point rounding exceeded the bound and were rounded toward zero.
    pub truncated: usize,
}

/// The exact squared norm of record r after rounding with factor `f`, and (for the fix-up) the
/// per-part scales.
fn exact_sq(records: &Records, r: usize, f: f64, inv: &[f64], trunc: bool) -> u128 {
    fn part<T: Elem>(x: &[T], w: usize, r: usize, s: f64, trunc: bool) -> u128 {
        x[r * w..(r + 1) * w]
            .iter()
            .map(|v| {
                let x = v.to_f64();
                let k = if trunc { (x * s).trunc() } else { round_product(x, s) } as i64;
                (k.unsigned_abs() as u128).pow(2)
            })
            .sum()
    }
    records
        .parts
        .iter()
        .zip(inv)
        .map(|(p, &i)| match p.data {
            Column::F32(x) => part(x, p.width, r, f * i, trunc),
            Column::F64(x) => part(x, p.width, r, f * i, trunc),
        })
        .sum()
}

/// Replaces record r's nearest-point rounding in the sums by rounding toward zero (or removes it
/// when `drop`).
fn retrunc(records: &Records, sums: &mut [Vec<f64>], r: usize, f: f64, inv: &[f64], drop: bool) {
    fn part<T: Elem>(acc: &mut [f64], x: &[T], w: usize, r: usize, s: f64, drop: bool) {
        for (a, v) in acc.iter_mut().zip(&x[r * w..(r + 1) * w]) {
            let x = v.to_f64();
            *a -= round_product(x, s);
            if !drop {
                *a += (x * s).trunc();
            }
        }
    }
    for ((p, acc), &i) in records.parts.iter().zip(sums.iter_mut()).zip(inv) {
        match p.data {
            Column::F32(x) => part(acc, x, p.width, r, f * i, drop),
            Column::F64(x) => part(acc, x, p.width, r, f * i, drop),
        }
    }
}

/// Clips every record to `l2_norm_clip`, rounds it onto the grid of step `granularity` (part j:
/// granularity·α_j) and sums exactly; every rounded record's squared norm is at most `sens_sq`
/// (grid units). Tiled like `clip_sum`: a tile's norms, then its rounded rows while cached.
/// Non-finite records contribute zero and have norm NaN, as in `clip_sum`.
pub fn clip_round_sum(
    records: &Records,
    l2_norm_clip: f64,
    granularity: f64,
    sens_sq: u128,
) -> DpResult<RoundedSum> {
    check_clip(l2_norm_clip)?;
    let grid_clip = l2_norm_clip / granularity;
    if !(granularity > 0.0
        && (records.batch as f64 + 1.0) * (grid_clip + 2.0) <= EXACT_LIMIT
        && grid_clip <= crate::discrete::MAX_GRID_CLIP)
    {
        return Err(DpError::param(
            "granularity",
            format!(
                "{} records of up to {grid_clip:.3e} grid steps each would leave the exact integer \
                 range of the sum (2^52); use a coarser granularity",
                records.batch
            ),
        ));
    }
    let inv: Vec<f64> = records
        .parts
        .iter()
        .map(|p| 1.0 / (granularity * p.scale))
        .collect();
    if records.groups() != 1 {
        return Err(DpError::Shape(
            "the rounded clipped sum takes records of one group".into(),
        ));
    }
    // Column blocks per call (the screen's error bound counts one partial sum per block).
    let nb: usize = records.parts.iter().map(|p| p.width.div_ceil(BLOCK)).sum();
    let (clipped, sq) = clip_accumulate(records, &[l2_norm_clip], Accumulate::Rounded(&inv))?;
    let ClippedSum { mut sums, norms } = clipped;
    // ŝ ≤ s·(1 + (n+1)·2⁻⁵³) for a sum of n non-negative terms each rounded once, in any order
    // (the screen adds per-block or per-thread shares); n ≤ d + nb.
    let err = 2.0 * (records.dim() as f64 + nb as f64 + 8.0) * f64::EPSILON;
    let bound = (sens_sq as f64).next_down().next_down();
    let margin = clip_margin(records, 0);
    // A record left out (non-finite) has screen value 0: never doubtful.
    let doubtful: Vec<(usize, f64)> = sq
        .iter()
        .enumerate()
        .filter(|(_, &s)| s * (1.0 + err) > bound)
        .map(|(r, _)| (r, clip_factor(norms[r], l2_norm_clip, margin)))
        .collect();
    let mut truncated = 0;
    for (r, f) in doubtful {
        if exact_sq(records, r, f, &inv, false) <= sens_sq {
            continue;
        }
        // ‖trunc(y)‖ ≤ ‖y‖ ≤ c < √S; the exact recount guards even that.
        let ok = exact_sq(records, r, f, &inv, true) <= sens_sq;
        retrunc(records, &mut sums, r, f, &inv, !ok);
        truncated += 1;
    }
    Ok(RoundedSum {
        sums,
        norms,
        truncated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::Part;
    use crate::testing::pool;

    fn reference(x: &[f32], batch: usize, w: usize, c: f64, g: f64) -> Vec<f64> {
        let mut out = vec![0.0; w];
        for r in 0..batch {
            let row = &x[r * w..(r + 1) * w];
            let n = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            let f = if n > c { c / n } else { 1.0 };
            for (o, v) in out.iter_mut().zip(row) {
                *o += (*v as f64 * f / g).round_ties_even();
            }
        }
        out
    }

    /// Values in [−1, 1] from a multiplicative hash (i·7919 mod `m`, over `half`), every
    /// `every`-th one scaled by `small`.
    fn hashed(n: usize, m: usize, half: f32, every: usize, small: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % m) as f32 / half - 1.0) * if i % every == 0 { small } else { 1.0 })
            .collect()
    }

    #[test]
    fn sums_the_rounded_clipped_records() {
        let (batch, w) = (37, 9000);
        let x = hashed(batch * w, 1000, 500.0, 3, 0.01);
        let rec = Records::new(batch, vec![Part::new(Column::F32(&x), w)]).unwrap();
        let g = 1.0 / 4096.0;
        let out = clip_round_sum(&rec, 2.0, g, u128::MAX >> 1).unwrap();
        let want = reference(&x, batch, w, 2.0, g);
        let mut differ = 0;
        for (a, b) in out.sums[0].iter().zip(&want) {
            assert_eq!(a.fract(), 0.0);
            // The clip factor's margin may move a value across a rounding boundary.
            assert!((a - b).abs() <= batch as f64, "{a} vs {b}");
            differ += (a != b) as usize;
        }
        assert!(differ < w / 10, "{differ}");
        assert_eq!(out.truncated, 0);
    }

    #[test]
    fn owned_and_tiled_paths_give_the_same_bits() {
        let (batch, w) = (23, 40_000);
        let x = hashed(batch * w, 1013, 506.0, 5, 0.03);
        let rec = Records::new(batch, vec![Part::new(Column::F32(&x), w)]).unwrap();
        let inv = [4096.0];
        let layout = Layout::new(&rec);
        let margins = [clip_margin(&rec, 0)];
        let mode = Accumulate::Rounded(&inv);
        let (tiled, tiled_sq) = clip_sum_tiled(&rec, &layout, &[30.0], &margins, mode).unwrap();
        assert_eq!(tiled_sq.len(), batch);
        for threads in [1usize, 2, 3] {
            let pool = pool(threads);
            let (owned, sq) = pool
                .install(|| clip_sum_owned(&rec, &layout, &[30.0], &margins, threads, mode))
                .unwrap();
            assert_eq!(owned.sums, tiled.sums, "{threads} threads");
            assert_eq!(owned.norms, tiled.norms, "{threads} threads");
            for (a, b) in sq.iter().zip(&tiled_sq) {
                // The screen's order of addition may differ; its value may not, beyond rounding.
                assert!((a - b).abs() <= 1e-12 * b, "{a} vs {b}");
            }
            let via_pool = pool.install(|| clip_round_sum(&rec, 30.0, 1.0 / 4096.0, u128::MAX >> 1));
            assert_eq!(via_pool.unwrap().sums, tiled.sums, "{threads} threads");
        }
        // The screen is each rounded record's squared norm.
        let f = clip_factor(tiled.norms[3], 30.0, margins[0]);
        let exact: f64 = x[3 * w..4 * w]
            .iter()
            .map(|v| round_product(*v as f64, f * 4096.0).powi(2))
            .sum();
        assert!((tiled_sq[3] - exact).abs() <= 1e-12 * exact);
    }

    #[test]
    fn a_record_over_the_bound_is_rounded_toward_zero() {
        // y = (0.5, 0.5, 0.5, 0.5)·3 … rounds to 2 each: norm² 16 > 9·… ; bound S = 12.
        let x = [1.5f64, 1.5, 1.5, 1.5, 0.2, 0.2, 0.2, 0.2];
        let rec = Records::new(2, vec![Part::new(Column::F64(&x), 4)]).unwrap();
        let out = clip_round_sum(&rec, 10.0, 1.0, 12).unwrap();
        assert_eq!(out.truncated, 1);
        // trunc(1.5) = 1 for record 0, round(0.2) = 0 for record 1.
        assert_eq!(out.sums[0], vec![1.0; 4]);
        let fine = clip_round_sum(&rec, 10.0, 1.0, 16).unwrap();
        assert_eq!(fine.truncated, 0);
        assert_eq!(fine.sums[0], vec![2.0; 4]);
    }

    /// A non-finite record adds zero to the rounded sum: the sums, the kept norms and the count
    /// of truncated records are those of the batch without it, on both paths at any thread count.
    #[test]
    fn non_finite_records_are_left_out_of_the_rounded_sum() {
        let (batch, w) = (23, 40_000);
        let mut x = hashed(batch * w, 1013, 506.0, 5, 0.03);
        let bad = [0usize, 5, 6, 22];
        for (i, &r) in bad.iter().enumerate() {
            x[r * w + i * 9973 % w] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN][i];
        }
        let keep: Vec<usize> = (0..batch).filter(|r| !bad.contains(r)).collect();
        let clean: Vec<f32> = keep.iter().flat_map(|&r| x[r * w..(r + 1) * w].iter().copied()).collect();
        let rec = Records::new(batch, vec![Part::new(Column::F32(&x), w)]).unwrap();
        let rec_clean = Records::new(keep.len(), vec![Part::new(Column::F32(&clean), w)]).unwrap();
        let g = 1.0 / 4096.0;
        let without = pool(1).install(|| clip_round_sum(&rec_clean, 30.0, g, u128::MAX >> 1)).unwrap();
        for threads in [1usize, 2, 3] {
            let with = pool(threads).install(|| clip_round_sum(&rec, 30.0, g, u128::MAX >> 1)).unwrap();
            assert_eq!(with.sums, without.sums, "{threads} threads");
            assert_eq!(with.truncated, without.truncated);
            assert!(bad.iter().all(|&r| with.norms[r].is_nan()));
            assert_eq!(keep.iter().map(|&r| with.norms[r]).collect::<Vec<_>>(), without.norms);
        }
        let inv = [4096.0];
        let layout = Layout::new(&rec);
        let margins = [clip_margin(&rec, 0)];
        let mode = Accumulate::Rounded(&inv);
        let (tiled, sq) = clip_sum_tiled(&rec, &layout, &[30.0], &margins, mode).unwrap();
        assert_eq!(tiled.sums, without.sums);
        assert!(bad.iter().all(|&r| sq[r] == 0.0), "the screen of a left-out record is 0");
        // A record over the bound is still truncated when a bad one sits beside it.
        let y = [1.5f64, 1.5, 1.5, 1.5, f64::NAN, 0.2, 0.2, 0.2];
        let rec = Records::new(2, vec![Part::new(Column::F64(&y), 4)]).unwrap();
        let out = clip_round_sum(&rec, 10.0, 1.0, 12).unwrap();
        assert_eq!((out.truncated, out.sums[0].clone()), (1, vec![1.0; 4]));
    }

    #[test]
    fn refuses_sums_past_exact_integers() {
        let x = [1.0f32; 4];
        let rec = Records::new(1, vec![Part::new(Column::F32(&x), 4)]).unwrap();
        assert!(clip_round_sum(&rec, 1.0, 1e-20, u128::MAX).is_err());
    }
}
