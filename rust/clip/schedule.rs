//! How the clip's work is cut among threads: column blocks, tiles of rows, and the two paths
//! (`clip_sum_tiled`: blocks any thread may take; `clip_sum_owned`: each thread owns a column
//! range for the whole call and meets the others at a spin barrier per tile). The clipping math
//! they call (norms from block partials, clip factors) lives in the parent module.

use super::barrier::SpinBarrier;
use super::*;
use std::sync::Mutex;

#[derive(Clone, Copy, Debug)]
pub(super) struct Block {
    pub(super) part: usize,
    pub(super) group: usize,
    pub(super) start: usize,
    pub(super) len: usize,
}

pub(super) fn column_blocks(records: &Records) -> Vec<Block> {
    let mut out = Vec::new();
    for (k, p) in records.parts.iter().enumerate() {
        let mut s = 0;
        while s < p.width {
            let len = BLOCK.min(p.width - s);
            out.push(Block {
                part: k,
                group: p.group,
                start: s,
                len,
            });
            s += len;
        }
    }
    out
}

/// The column blocks of a call, each group's range of them, and their norm weights 1/α².
pub(super) struct Layout {
    pub(super) blocks: Vec<Block>,
    pub(super) groups: Vec<std::ops::Range<usize>>,
    pub(super) weights: Vec<f64>,
}

impl Layout {
    pub(super) fn new(records: &Records) -> Self {
        let blocks = column_blocks(records);
        // Groups are consecutive parts, so their blocks are consecutive; a group of empty parts
        // has none (its norm is 0).
        let groups = (0..records.groups())
            .map(|g| {
                let start = blocks.iter().take_while(|b| b.group < g).count();
                start..start + blocks[start..].iter().take_while(|b| b.group == g).count()
            })
            .collect();
        let weights = block_weights(records, &blocks);
        Layout {
            blocks,
            groups,
            weights,
        }
    }

    /// The norm of every group of record r, from the row's per-block partial sums
    /// (`partial(k)` for block k), handed to `put(g, norm)`. A record that is not finite in some
    /// group gets NaN in every group (it is left out of every group's sums): with several
    /// groups `put` is then called a second time for each, with NaN, so it must let the last
    /// value stand.
    pub(super) fn row_norms(
        &self,
        records: &Records,
        r: usize,
        partial: impl Fn(usize) -> f64,
        mut put: impl FnMut(usize, f64),
    ) {
        let mut finite = true;
        for (g, range) in self.groups.iter().enumerate() {
            let sums = range.clone().map(&partial);
            let n = norm_from_blocks(records, r, g, sums, &self.weights[range.clone()]);
            finite &= !n.is_nan();
            put(g, n);
        }
        if !finite && self.groups.len() > 1 {
            (0..self.groups.len()).for_each(|g| put(g, f64::NAN));
        }
    }
}

/// The norms of every record, one vector per group, filled tile by tile.
pub(super) struct GroupNorms(Vec<Vec<f64>>);

impl GroupNorms {
    pub(super) fn new(records: &Records) -> Self {
        GroupNorms(
            (0..records.groups())
                .map(|_| Vec::with_capacity(records.batch))
                .collect(),
        )
    }
    /// Appends a tile's group-major norms (`rows` per group).
    pub(super) fn extend(&mut self, tile: &[f64], rows: usize) {
        for (g, v) in self.0.iter_mut().enumerate() {
            v.extend_from_slice(&tile[g * rows..(g + 1) * rows]);
        }
    }
    pub(super) fn into_flat(self) -> Vec<f64> {
        self.0.concat()
    }
}

/// Phase 1 for rows [r0, r1): the L2 norm of every group of every row, group-major
/// (norm[g·(r1 − r0) + r − r0]); NaN in every group for a record that is not finite.
pub(super) fn tile_norms(
    records: &Records,
    layout: &Layout,
    r0: usize,
    r1: usize,
    par: bool,
) -> Vec<f64> {
    let blocks = &layout.blocks;
    let nb = blocks.len();
    let rows = r1 - r0;
    let mut partial = vec![0.0f64; rows * nb];
    let fill = |(i, out): (usize, &mut f64)| {
        let (r, b) = (r0 + i / nb.max(1), i % nb.max(1));
        *out = block_sumsq(records, r, &blocks[b]);
    };
    if par {
        partial
            .par_iter_mut()
            .with_min_len(8)
            .enumerate()
            .for_each(fill);
    } else {
        partial.iter_mut().enumerate().for_each(fill);
    }
    let mut norms = vec![0.0f64; rows * layout.groups.len()];
    for r in r0..r1 {
        let row = &partial[(r - r0) * nb..(r - r0 + 1) * nb];
        layout.row_norms(records, r, |k| row[k], |g, n| norms[g * rows + r - r0] = n);
    }
    norms
}

/// Clip factors of a tile's group-major norms, each group to its bound.
pub(super) fn tile_factors(norms: &[f64], rows: usize, clips: &[f64], margins: &[f64]) -> Vec<f64> {
    norms
        .iter()
        .enumerate()
        .map(|(i, &n)| clip_factor(n, clips[i / rows], margins[i / rows]))
        .collect()
}

/// What phase 2 adds into the sums for a tile's clipped rows.
#[derive(Clone, Copy)]
pub(super) enum Accumulate<'a> {
    /// Σ_r f_r·x_r: the clipped sum.
    Scaled,
    /// Σ_r round(f_r·x_r·inv[part]): the clipped rows on the grid (inv[part] = 1/(γ·α_part)), in
    /// grid units; each row's Σ round(·)² is added to its screen value (`rounded`).
    Rounded(&'a [f64]),
}

/// acc += Σ_r f_r·x_r over the columns of `b`, for rows r0, r0 + 1, … (one per factor); rounded
/// onto the grid with `Accumulate::Rounded`, which adds each row's squared norm into `sq`.
///
/// Rows whose factor is NaN ([`left_out`]: non-finite records) are skipped, not multiplied by 0
/// (0·NaN = NaN): the kernels get the runs of rows between them. The kernels sum each coordinate
/// in row order whatever the grouping of the rows, so the result is that of the rows without the
/// skipped ones, bit for bit, and with none skipped it is the one call of before.
#[allow(clippy::too_many_arguments)]
pub(super) fn add_rows<T: Elem>(
    acc: &mut [f64],
    x: &[T],
    width: usize,
    b: &Block,
    r0: usize,
    factors: &[f64],
    mode: Accumulate,
    sq: &mut [f64],
) {
    // Every row kept (the common case): one call. A fold, not `any`, so that it vectorises.
    if !factors.iter().fold(false, |bad, &f| bad | left_out(f)) {
        return add_run(acc, x, width, b, r0, factors, mode, sq);
    }
    let n = factors.len();
    let mut start = 0;
    while start < n {
        if left_out(factors[start]) {
            start += 1;
            continue;
        }
        let end = factors[start..]
            .iter()
            .position(|&f| left_out(f))
            .map_or(n, |k| start + k);
        // The screen `sq` has one slot per row when rounding, none otherwise.
        let run_sq = sq.get_mut(start..end).unwrap_or_default();
        add_run(acc, x, width, b, r0 + start, &factors[start..end], mode, run_sq);
        start = end;
    }
}

/// `add_rows` over a run of rows that are all kept.
#[allow(clippy::too_many_arguments)]
fn add_run<T: Elem>(
    acc: &mut [f64],
    x: &[T],
    width: usize,
    b: &Block,
    r0: usize,
    factors: &[f64],
    mode: Accumulate,
    sq: &mut [f64],
) {
    // ×1.0 is exact: the clipped sum keeps its bits.
    let unit = match mode {
        Accumulate::Scaled => 1.0,
        Accumulate::Rounded(inv) => inv[b.part],
    };
    let one = |i: usize| (factors[i] * unit, row(x, width, r0 + i, b));
    let add = |rows: &[(f64, &[T])], acc: &mut [f64], sq: &mut [f64]| match mode {
        Accumulate::Scaled => kernels::axpy_rows(acc, rows),
        Accumulate::Rounded(_) => kernels::round_rows(acc, rows, sq),
    };
    if factors.len() <= OWNED_TILE_ROWS {
        // The owned path's tiles: no allocation per call.
        let rows: [(f64, &[T]); OWNED_TILE_ROWS] = std::array::from_fn(|i| {
            if i < factors.len() {
                one(i)
            } else {
                (0.0, &x[..0])
            }
        });
        add(&rows[..factors.len()], acc, sq);
    } else {
        let rows: Vec<(f64, &[T])> = (0..factors.len()).map(one).collect();
        add(&rows, acc, sq);
    }
}

/// One block of phase 2 (rows r0.. with the block group's factors).
#[allow(clippy::too_many_arguments)]
fn accumulate_block(
    records: &Records,
    acc: &mut [f64],
    b: &Block,
    r0: usize,
    factors: &[f64],
    mode: Accumulate,
    sq: &mut [f64],
) {
    let p = &records.parts[b.part];
    match p.data {
        Column::F32(x) => add_rows(acc, x, p.width, b, r0, factors, mode, sq),
        Column::F64(x) => add_rows(acc, x, p.width, b, r0, factors, mode, sq),
    }
}

/// Phase 2 for rows [r0, r0 + rows): sums += Σ_r f_r·x_r, block by block, each block with its
/// group's factors (group-major, `rows` per group); with `Accumulate::Rounded`, row r's squared
/// rounded norm is added to sq[r − r0].
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_accumulate(
    records: &Records,
    blocks: &[Block],
    acc: &mut [&mut [f64]],
    r0: usize,
    rows: usize,
    factors: &[f64],
    mode: Accumulate,
    sq: &mut [f64],
    par: bool,
) {
    let rounded = matches!(mode, Accumulate::Rounded(_));
    // Blocks run in parallel, so each keeps its rows' squared norms apart until the end.
    let mut partial = vec![0.0f64; if rounded { rows * blocks.len() } else { 0 }];
    let mut slots: Vec<&mut [f64]> = if rounded {
        partial.chunks_mut(rows.max(1)).collect()
    } else {
        blocks.iter().map(|_| <&mut [f64]>::default()).collect()
    };
    let work = |((a, b), s): ((&mut &mut [f64], &Block), &mut &mut [f64])| {
        let f = &factors[b.group * rows..(b.group + 1) * rows];
        accumulate_block(records, a, b, r0, f, mode, s)
    };
    if par {
        acc.par_iter_mut()
            .zip(blocks.par_iter())
            .zip(slots.par_iter_mut())
            .for_each(work);
    } else {
        acc.iter_mut()
            .zip(blocks.iter())
            .zip(slots.iter_mut())
            .for_each(work);
    }
    if rounded {
        for (k, out) in sq.iter_mut().enumerate().take(rows) {
            *out += (0..blocks.len()).map(|b| partial[b * rows + k]).sum::<f64>();
        }
    }
}

pub(super) fn tile_rows(records: &Records) -> usize {
    (TILE_BYTES / records.record_bytes().max(1)).clamp(1, records.batch.max(1))
}

pub(super) fn use_parallel(records: &Records) -> bool {
    records.batch.saturating_mul(records.dim()) >= PAR_MIN_VALUES
}

pub(super) fn clip_sum_tiled(
    records: &Records,
    layout: &Layout,
    clips: &[f64],
    margins: &[f64],
    mode: Accumulate,
) -> DpResult<(ClippedSum, Vec<f64>)> {
    let (step, par) = (tile_rows(records), use_parallel(records));
    let mut sums = zero_sums(records)?;
    let mut norms = GroupNorms::new(records);
    let mut sq = vec![0.0f64; screen_len(records, mode)];
    {
        let mut acc: Vec<&mut [f64]> = sums.iter_mut().flat_map(|s| s.chunks_mut(BLOCK)).collect();
        debug_assert_eq!(acc.len(), layout.blocks.len());
        let mut r0 = 0;
        while r0 < records.batch {
            let r1 = (r0 + step).min(records.batch);
            let tile = tile_norms(records, layout, r0, r1, par);
            let factors = tile_factors(&tile, r1 - r0, clips, margins);
            let tile_sq = sq.get_mut(r0..r1).unwrap_or_default();
            let blocks = &layout.blocks;
            tile_accumulate(records, blocks, &mut acc, r0, r1 - r0, &factors, mode, tile_sq, par);
            norms.extend(&tile, r1 - r0);
            r0 = r1;
        }
    }
    let sums = ClippedSum {
        sums,
        norms: norms.into_flat(),
    };
    Ok((sums, sq))
}

/// Rows of the squared-norm screen: one per record when rounding, none otherwise.
fn screen_len(records: &Records, mode: Accumulate) -> usize {
    match mode {
        Accumulate::Scaled => 0,
        Accumulate::Rounded(_) => records.batch,
    }
}

pub(super) static OWNED_PATH: Mutex<()> = Mutex::new(());

/// A run of one thread's columns within one part.
pub(super) struct Run<'s> {
    part: usize,
    start: usize,
    acc: &'s mut [f64],
}

/// Splits the sums into each thread's runs: thread t owns blocks [t·nb/T, (t+1)·nb/T).
pub(super) fn owned_runs<'s>(
    sums: &'s mut [Vec<f64>],
    blocks: &[Block],
    threads: usize,
) -> Vec<Mutex<Vec<Run<'s>>>> {
    let nb = blocks.len();
    let owner = |k: usize| {
        (0..threads)
            .find(|&t| k < (t + 1) * nb / threads)
            .unwrap_or(0)
    };
    let mut runs: Vec<Vec<Run<'s>>> = (0..threads).map(|_| Vec::new()).collect();
    let mut k = 0;
    for (part, sum) in sums.iter_mut().enumerate() {
        let mut rest: &'s mut [f64] = sum.as_mut_slice();
        let mut taken = 0;
        while k < nb && blocks[k].part == part {
            let t = owner(k);
            let start = blocks[k].start;
            let mut len = 0;
            while k < nb && blocks[k].part == part && owner(k) == t {
                len += blocks[k].len;
                k += 1;
            }
            let (acc, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            debug_assert_eq!(start, taken);
            taken += len;
            runs[t].push(Run { part, start, acc });
        }
    }
    runs.into_iter().map(Mutex::new).collect()
}

/// The owned-columns path. Thread t of the pool keeps columns blocks [t·nb/T, (t+1)·nb/T) for the
/// whole call. Per tile: it writes its blocks' partial sums of squares (phase 1), all threads meet
/// at a barrier, each one adds up every row's norm from the shared partials in block order (the
/// same bits on every thread), and it adds its slice of the scaled rows into its own sums (phase
/// 2). Partials are double-buffered so that a fast thread may begin the next tile while a slow
/// one still reads the last.
pub(super) fn clip_sum_owned(
    records: &Records,
    layout: &Layout,
    clips: &[f64],
    margins: &[f64],
    threads: usize,
    mode: Accumulate,
) -> DpResult<(ClippedSum, Vec<f64>)> {
    let blocks = &layout.blocks;
    let (batch, nb, ng) = (records.batch, blocks.len(), layout.groups.len());
    let rows = OWNED_TILE_ROWS;
    let mut sums = zero_sums(records)?;
    let partials: Vec<AtomicU64> = (0..2 * rows * nb).map(|_| AtomicU64::new(0)).collect();
    let barrier = SpinBarrier::new(threads);
    let (norms, sq) = {
        let runs = owned_runs(&mut sums, blocks, threads);
        let work = |t: usize| -> (Vec<f64>, Vec<f64>) {
            let mut mine = runs[t].lock().unwrap_or_else(|e| e.into_inner());
            // This thread's columns' share of each row's squared rounded norm.
            let mut sq = vec![0.0f64; screen_len(records, mode)];
            let (k0, k1) = (t * nb / threads, (t + 1) * nb / threads);
            let mut norms = GroupNorms::new(records);
            // Group-major, OWNED_TILE_ROWS per group.
            let mut factors = vec![0.0f64; rows * ng];
            // The tile's norms, group-major with r1 − r0 per group (as `GroupNorms::extend` reads).
            let mut tile_n = vec![0.0f64; rows * ng];
            for (tile, r0) in (0..batch).step_by(rows).enumerate() {
                let r1 = (r0 + rows).min(batch);
                let buf = &partials[(tile % 2) * rows * nb..][..rows * nb];
                for r in r0..r1 {
                    for k in k0..k1 {
                        let v = block_sumsq(records, r, &blocks[k]);
                        buf[(r - r0) * nb + k].store(v.to_bits(), Ordering::Relaxed);
                    }
                }
                if !barrier.wait() {
                    // Another thread panicked; its panic is re-raised below, this value unread.
                    return (Vec::new(), Vec::new());
                }
                for r in r0..r1 {
                    let row = &buf[(r - r0) * nb..][..nb];
                    let partial = |k: usize| f64::from_bits(row[k].load(Ordering::Relaxed));
                    layout.row_norms(records, r, partial, |g, n| {
                        factors[g * rows + r - r0] = clip_factor(n, clips[g], margins[g]);
                        tile_n[g * (r1 - r0) + r - r0] = n;
                    });
                }
                if t == 0 {
                    norms.extend(&tile_n[..ng * (r1 - r0)], r1 - r0);
                }
                for run in mine.iter_mut() {
                    let p = &records.parts[run.part];
                    let b = Block {
                        part: run.part,
                        group: p.group,
                        start: run.start,
                        len: run.acc.len(),
                    };
                    let f = &factors[p.group * rows..][..r1 - r0];
                    let tile_sq = sq.get_mut(r0..r1).unwrap_or_default();
                    accumulate_block(records, run.acc, &b, r0, f, mode, tile_sq);
                }
            }
            (norms.into_flat(), sq)
        };
        let results = rayon::broadcast(|ctx| {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(ctx.index())));
            if out.is_err() {
                barrier.poison();
            }
            out
        });
        let mut outcomes = Vec::with_capacity(results.len());
        for r in results {
            match r {
                Err(panic) => std::panic::resume_unwind(panic),
                Ok(v) => outcomes.push(v),
            }
        }
        // Every thread computed the same norms; thread 0 (a broadcast always has one) kept them.
        // The screen adds the threads' shares in thread order.
        let (norms, mut sq) = outcomes.remove(0);
        for (_, other) in &outcomes {
            sq.iter_mut().zip(other).for_each(|(a, b)| *a += b);
        }
        (norms, sq)
    };
    Ok((ClippedSum { sums, norms }, sq))
}
