//! Inner loops over contiguous slices, with runtime dispatch to AVX-512 or AVX2 on x86-64.
//!
//! Every kernel performs the same sequence of IEEE operations whatever the instruction set (fixed
//! lane structure; products are fused into their sums, by the FMA unit in the SIMD tiers and by
//! `f64::mul_add` in the portable one), so results are bit-identical across the dispatched paths
//! and across thread counts. Fusing saves a quarter of the floating-point work of both passes of
//! the clip, which are compute-bound once the data is in cache.

use crate::elem::Elem;

const LANES: usize = 8;
/// Lanes of the sum of squares: four vectors of eight, so that the adds of one vector do not wait
/// on the latency of the previous one (one vector made the norm pass compute-bound).
const SUMSQ_LANES: usize = 32;

/// Folds the whole chunks of `N` values of `x` into `N` lanes, `acc[l] = step(acc[l], v)` with
/// lane l taking values l, l + N, l + 2N, … in order; returns the lanes and the partial chunk.
#[inline(always)]
fn fold_lanes<T: Elem, const N: usize>(x: &[T], step: impl Fn(f64, f64) -> f64) -> ([f64; N], &[T]) {
    let mut acc = [0.0f64; N];
    let chunks = x.chunks_exact(N);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..N {
            acc[l] = step(acc[l], c[l].to_f64());
        }
    }
    (acc, rem)
}

#[inline(always)]
fn sumsq_generic<T: Elem>(x: &[T]) -> f64 {
    let (acc, rem) = fold_lanes::<T, SUMSQ_LANES>(x, |a, v| v.mul_add(v, a));
    sumsq_finish(acc, rem)
}

/// The partial chunk and the fixed tree that end every tier's sum of squares.
#[inline(always)]
fn sumsq_finish<T: Elem>(mut acc: [f64; SUMSQ_LANES], rem: &[T]) -> f64 {
    for (l, v) in rem.iter().enumerate() {
        let v = v.to_f64();
        acc[l] = v.mul_add(v, acc[l]);
    }
    // A fixed pairwise tree over the lanes.
    let mut w = SUMSQ_LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// The factors of one group of G rows, and its rows cut to the `n` columns of the sum.
#[inline(always)]
fn group<'a, T: Elem, const G: usize>(g: &[(f64, &'a [T])], n: usize) -> ([f64; G], [&'a [T]; G]) {
    (std::array::from_fn(|i| g[i].0), std::array::from_fn(|i| &g[i].1[..n]))
}

/// `acc[j] += f_i * x_i[j]` for the rows of one group, in row order, over the columns `from..`:
/// all of them in the generic kernel, those past the last whole vector in the explicit one.
#[inline(always)]
fn axpy_columns<T: Elem, const G: usize>(acc: &mut [f64], f: &[f64; G], x: &[&[T]; G], from: usize) {
    for j in from..acc.len() {
        let mut a = acc[j];
        for i in 0..G {
            a = f[i].mul_add(x[i][j].to_f64(), a);
        }
        acc[j] = a;
    }
}

/// `acc[j] += f_r * x_r[j]` for the rows of one group, in row order, loading and storing `acc`
/// once per group.
#[inline(always)]
fn axpy_group<T: Elem, const G: usize>(acc: &mut [f64], g: &[(f64, &[T])]) {
    let (f, x) = group::<T, G>(g, acc.len());
    axpy_columns(acc, &f, &x, 0);
}

/// Runs a row-group kernel over rows taken eight, then four, then one at a time, so that `acc`
/// moves through the load/store ports once per group; the sum order per coordinate is still
/// r = 0, 1, 2, ... so grouping does not change the bits. Shared by the generic and explicit axpy.
macro_rules! by_row_groups {
    ($group:ident, $acc:expr, $rows:expr) => {{
        let mut eights = $rows.chunks_exact(8);
        for g in &mut eights {
            $group::<T, 8>($acc, g);
        }
        let mut fours = eights.remainder().chunks_exact(4);
        for g in &mut fours {
            $group::<T, 4>($acc, g);
        }
        for g in fours.remainder().chunks_exact(1) {
            $group::<T, 1>($acc, g);
        }
    }};
}

/// Runs a rounding kernel over rows four at a time (fewer at the end), each group adding its
/// rows' squared norms into its slots of `sq`.
macro_rules! by_fours {
    ($group:ident, $acc:expr, $rows:expr, $sq:expr) => {{
        for (g, q) in $rows.chunks(4).zip($sq.chunks_mut(4)) {
            match g.len() {
                4 => $group::<T, 4>($acc, g, q),
                3 => $group::<T, 3>($acc, g, q),
                2 => $group::<T, 2>($acc, g, q),
                _ => $group::<T, 1>($acc, g, q),
            }
        }
    }};
}

/// Accumulate `acc[j] += f_r * x_r[j]` for each row r in order.
#[inline(always)]
fn axpy_rows_generic<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])]) {
    by_row_groups!(axpy_group, acc, rows)
}

#[inline(always)]
fn all_finite_generic<T: Elem>(x: &[T]) -> bool {
    // x - x is 0 for finite x and NaN otherwise; a running sum keeps the loop branch-free.
    let (acc, rem) = fold_lanes::<T, LANES>(x, |a, v| a + (v - v));
    let mut ok = acc.iter().all(|a| *a == 0.0);
    for v in rem {
        ok &= v.to_f64().is_finite();
    }
    ok
}

/// The clip's two inner loops over f32 records written with 256-bit intrinsics, for both x86
/// tiers. The compiler turned the generic 32-lane sum of squares into 128-bit shuffles, and on
/// Zen 4 a 512-bit f32→f64 conversion has half the throughput of two 256-bit ones, which made
/// both passes compute-bound (measured in L2 on one core: sum of squares 0.103 → 0.041 ns per
/// f32, four-row axpy 0.069 → 0.058). The lanes and the order of every operation are those of
/// the generic kernels, so the bits are too (tested below).
#[cfg(target_arch = "x86_64")]
mod explicit {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub fn sumsq<T: Elem>(x: &[T]) -> f64 {
        // Lane l of the 32 is lane l % 4 of vector l / 4, as in the generic kernel.
        let mut a = [_mm256_setzero_pd(); SUMSQ_LANES / 4];
        let chunks = x.chunks_exact(SUMSQ_LANES);
        let rem = chunks.remainder();
        for c in chunks {
            for (k, ak) in a.iter_mut().enumerate() {
                // SAFETY: c holds 32 values; AVX is enabled on this function.
                let v = unsafe { T::load4(c.as_ptr().add(4 * k)) };
                *ak = _mm256_fmadd_pd(v, v, *ak);
            }
        }
        let mut acc = [0.0f64; SUMSQ_LANES];
        for (k, ak) in a.iter().enumerate() {
            // SAFETY: acc holds 32 values.
            unsafe { _mm256_storeu_pd(acc.as_mut_ptr().add(4 * k), *ak) };
        }
        sumsq_finish(acc, rem)
    }

    /// One group of G rows over eight columns at a time; the rest of the columns one by one.
    #[target_feature(enable = "avx2,fma")]
    fn axpy_group<T: Elem, const G: usize>(acc: &mut [f64], g: &[(f64, &[T])]) {
        let n = acc.len();
        let (f, x) = group::<T, G>(g, n);
        let fv: [__m256d; G] = std::array::from_fn(|i| _mm256_set1_pd(f[i]));
        let main = n / 8 * 8;
        let a = acc.as_mut_ptr();
        for j in (0..main).step_by(8) {
            // SAFETY: j + 8 <= n = acc.len() <= every row's length; AVX is enabled.
            unsafe {
                let mut s0 = _mm256_loadu_pd(a.add(j));
                let mut s1 = _mm256_loadu_pd(a.add(j + 4));
                for i in 0..G {
                    let p = x[i].as_ptr().add(j);
                    s0 = _mm256_fmadd_pd(fv[i], T::load4(p), s0);
                    s1 = _mm256_fmadd_pd(fv[i], T::load4(p.add(4)), s1);
                }
                _mm256_storeu_pd(a.add(j), s0);
                _mm256_storeu_pd(a.add(j + 4), s1);
            }
        }
        axpy_columns(acc, &f, &x, main);
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn axpy_rows<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])]) {
        by_row_groups!(axpy_group, acc, rows)
    }

    /// `round_group` with four columns to a vector: the generic lanes (lane l of every fourth
    /// column) and operation order, written out because the compiler kept the generic one
    /// scalar (the rounded clipped sum ran at twice the time of the clipped sum).
    #[target_feature(enable = "avx2,fma")]
    fn round_group<T: Elem, const G: usize>(acc: &mut [f64], g: &[(f64, &[T])], sq: &mut [f64]) {
        let n = acc.len();
        let (fs, xs) = group::<T, G>(g, n);
        let fv: [__m256d; G] = std::array::from_fn(|r| _mm256_set1_pd(fs[r]));
        let magic = _mm256_set1_pd(ROUND_MAGIC);
        let mut s = [_mm256_setzero_pd(); G];
        let main = n / 4 * 4;
        let a = acc.as_mut_ptr();
        for j in (0..main).step_by(4) {
            // SAFETY: j + 4 <= n = acc.len() <= every row's length; AVX is enabled.
            unsafe {
                let mut t = _mm256_loadu_pd(a.add(j));
                for r in 0..G {
                    let x = T::load4(xs[r].as_ptr().add(j));
                    let v = _mm256_sub_pd(_mm256_fmadd_pd(x, fv[r], magic), magic);
                    t = _mm256_add_pd(t, v);
                    s[r] = _mm256_fmadd_pd(v, v, s[r]);
                }
                _mm256_storeu_pd(a.add(j), t);
            }
        }
        let mut lanes = [[0.0f64; 4]; G];
        for r in 0..G {
            // SAFETY: lanes[r] holds four values.
            unsafe { _mm256_storeu_pd(lanes[r].as_mut_ptr(), s[r]) };
        }
        round_tail(acc, &xs, &fs, &mut lanes, main, sq);
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn round_rows<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])], sq: &mut [f64]) {
        by_fours!(round_group, acc, rows, sq)
    }
}

/// The generic kernels compiled again with wider vector instructions enabled. Same source, same
/// IEEE operation order, hence the same bits.
macro_rules! simd_tier {
    ($name:ident, $feat:literal) => {
        #[cfg(target_arch = "x86_64")]
        mod $name {
            use super::*;
            #[target_feature(enable = $feat)]
            pub fn sumsq<T: Elem>(x: &[T]) -> f64 {
                sumsq_generic(x)
            }
            #[target_feature(enable = $feat)]
            pub fn axpy_rows<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])]) {
                axpy_rows_generic(acc, rows)
            }
            #[target_feature(enable = $feat)]
            pub fn all_finite<T: Elem>(x: &[T]) -> bool {
                all_finite_generic(x)
            }
            #[target_feature(enable = $feat)]
            pub fn round_rows<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])], sq: &mut [f64]) {
                round_rows_generic(acc, rows, sq)
            }
        }
    };
}
simd_tier!(avx512, "avx512f,fma");
simd_tier!(avx2, "avx2,fma");

/// The widest instruction set compiled kernels may use on this CPU.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Tier {
    Avx512,
    Avx2,
    Baseline,
}

#[inline(always)]
pub(crate) fn tier() -> Tier {
    #[cfg(target_arch = "x86_64")]
    {
        let fma = std::arch::is_x86_feature_detected!("fma");
        if fma && std::arch::is_x86_feature_detected!("avx512f") {
            return Tier::Avx512;
        }
        if fma && std::arch::is_x86_feature_detected!("avx2") {
            return Tier::Avx2;
        }
    }
    Tier::Baseline
}

/// The name of the tier [`tier`] picks on this CPU ("avx512", "avx2" or "baseline"): what a
/// build (a manylinux wheel, say) dispatches to at run time.
pub fn tier_name() -> &'static str {
    match tier() {
        Tier::Avx512 => "avx512",
        Tier::Avx2 => "avx2",
        Tier::Baseline => "baseline",
    }
}

/// Calls the widest compiled tier of kernel `$f` that this CPU supports. With `explicit`, the
/// kernel of `mod explicit` serves every x86 tier for element types that have one.
macro_rules! dispatch {
    (explicit $f:ident, $generic:ident ($($arg:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        if T::EXPLICIT && tier() != Tier::Baseline {
            // SAFETY: both x86 tiers imply AVX2 and FMA.
            return unsafe { explicit::$f($($arg),*) };
        }
        dispatch!($f, $generic($($arg),*))
    }};
    ($f:ident, $generic:ident ($($arg:expr),*)) => {{
        match tier() {
            // SAFETY: tier() checked that the CPU supports the tier's instructions.
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => unsafe { avx512::$f($($arg),*) },
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => unsafe { avx2::$f($($arg),*) },
            _ => $generic($($arg),*),
        }
    }};
}

/// 1.5·2⁵²: adding and subtracting it rounds an f64 of magnitude below 2⁵¹ to the nearest
/// integer (ties to even) with two exact-by-construction operations that vectorise.
const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;

/// The integer nearest to x·s (ties to even), for |x·s| < 2⁵¹: the fused multiply-add rounds the
/// exact product once, so no intermediate rounding of x·s can move it across a boundary.
#[inline(always)]
pub fn round_product(x: f64, s: f64) -> f64 {
    x.mul_add(s, ROUND_MAGIC) - ROUND_MAGIC
}

#[inline(always)]
fn round_group<T: Elem, const G: usize>(acc: &mut [f64], g: &[(f64, &[T])], sq: &mut [f64]) {
    let n = acc.len();
    let (fs, xs) = group::<T, G>(g, n);
    let mut s = [[0.0f64; 4]; G];
    let main = n / 4 * 4;
    for (c, a) in acc[..main].chunks_exact_mut(4).enumerate() {
        for r in 0..G {
            let x = &xs[r][c * 4..c * 4 + 4];
            for l in 0..4 {
                let v = round_product(x[l].to_f64(), fs[r]);
                a[l] += v;
                s[r][l] = v.mul_add(v, s[r][l]);
            }
        }
    }
    round_tail(acc, &xs, &fs, &mut s, main, sq);
}

/// The columns past the last whole four of `round_group` (every tier), and the rows' squared
/// norms from their four lanes.
#[inline(always)]
fn round_tail<T: Elem, const G: usize>(
    acc: &mut [f64],
    xs: &[&[T]; G],
    fs: &[f64; G],
    s: &mut [[f64; 4]; G],
    main: usize,
    sq: &mut [f64],
) {
    for j in main..acc.len() {
        for r in 0..G {
            let v = round_product(xs[r][j].to_f64(), fs[r]);
            acc[j] += v;
            s[r][0] += v * v;
        }
    }
    for r in 0..G {
        sq[r] += (s[r][0] + s[r][1]) + (s[r][2] + s[r][3]);
    }
}

#[inline(always)]
fn round_rows_generic<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])], sq: &mut [f64]) {
    by_fours!(round_group, acc, rows, sq)
}

/// acc += Σ_r round(f_r·x_r) coordinate-wise (nearest integer, ties to even; |f_r·x_r| < 2⁵¹),
/// and sq[r] += Σ round(f_r·x_r)² in f64 (with rounding error; a screen, not an exact value).
/// The sums are of integers, exact below 2⁵³, so every tier gives the same acc.
pub fn round_rows<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])], sq: &mut [f64]) {
    dispatch!(explicit round_rows, round_rows_generic(acc, rows, sq))
}

/// Σ x_j², accumulated in f64 over 32 fixed lanes and added up by a fixed tree.
pub fn sumsq<T: Elem>(x: &[T]) -> f64 {
    dispatch!(explicit sumsq, sumsq_generic(x))
}

/// acc += Σ_r f_r x_r, rows in order. Each row must be at least `acc.len()` long.
pub fn axpy_rows<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])]) {
    dispatch!(explicit axpy_rows, axpy_rows_generic(acc, rows))
}

/// True when no value is NaN or ±∞.
pub fn all_finite<T: Elem>(x: &[T]) -> bool {
    dispatch!(all_finite, all_finite_generic(x))
}

/// max_j |x_j| in f64 (NaN-free input assumed).
pub fn max_abs<T: Elem>(x: &[T]) -> f64 {
    x.iter().fold(0.0f64, |m, v| m.max(v.to_f64().abs()))
}

/// Σ (x_j / s)², for the rescaled norm of records whose squares overflow or underflow.
pub fn sumsq_scaled<T: Elem>(x: &[T], s: f64) -> f64 {
    let inv = 1.0 / s;
    if !inv.is_finite() {
        // s is subnormal: its reciprocal overflows, so divide (a slow path for tiny records).
        return x.iter().fold(0.0f64, |a, v| {
            let t = v.to_f64() / s;
            a + t * t
        });
    }
    x.iter().fold(0.0f64, |a, v| {
        let t = v.to_f64() * inv;
        a + t * t
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sumsq_scaled_by_a_subnormal_max() {
        // ‖(1e-310, ..., 1e-310)‖ over 4 entries: the max is subnormal and 1/max overflows.
        let x = [1e-310f64; 4];
        assert_eq!(sumsq_scaled(&x, 1e-310), 4.0);
        let y = [5e-324f64, 0.0];
        assert_eq!(sumsq_scaled(&y, 5e-324), 1.0);
    }

    #[test]
    fn sumsq_matches_reference() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let r: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
        assert!((sumsq(&x) - r).abs() <= 1e-12 * r);
        assert_eq!(
            sumsq(&x),
            sumsq_generic(&x),
            "dispatch must not change bits"
        );
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: AVX2 and FMA checked just above.
            assert_eq!(unsafe { avx2::sumsq(&x) }, sumsq_generic(&x));
            let rows = [(0.3, &x[..500]), (0.7, &x[500..])];
            let (mut a, mut b) = (vec![1.0; 500], vec![1.0; 500]);
            unsafe { avx2::axpy_rows(&mut a, &rows) };
            axpy_rows_generic(&mut b, &rows);
            assert_eq!(a, b, "the fused product-sum must round alike in every tier");
        }
    }

    #[test]
    fn explicit_f32_kernels_give_the_generic_bits() {
        #[cfg(target_arch = "x86_64")]
        if tier() != Tier::Baseline {
            for n in [0usize, 1, 7, 8, 31, 32, 33, 100, 4096, 4099] {
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i as f32 * 0.731).sin() * 1e3).exp2().min(1e30))
                    .collect();
                // SAFETY: a non-baseline tier has AVX2 and FMA.
                assert_eq!(unsafe { explicit::sumsq(&x) }, sumsq_generic(&x), "n = {n}");
                let rows: Vec<Vec<f32>> = (0..13)
                    .map(|r| {
                        (0..n)
                            .map(|j| ((r * 17 + j) as f32 * 0.37).cos() * 50.0)
                            .collect()
                    })
                    .collect();
                for g in [1usize, 3, 4, 5, 8, 9, 13] {
                    let rr: Vec<(f64, &[f32])> = rows[..g]
                        .iter()
                        .enumerate()
                        .map(|(i, r)| (0.1 + i as f64 / 7.0, r.as_slice()))
                        .collect();
                    let (mut a, mut b) = (vec![0.25; n], vec![0.25; n]);
                    // SAFETY: as above.
                    unsafe { explicit::axpy_rows(&mut a, &rr) };
                    axpy_rows_generic(&mut b, &rr);
                    assert_eq!(a, b, "n = {n}, rows = {g}");
                    // Rounding onto a grid of 2^-12: sums and squared-norm screens alike.
                    let grid: Vec<(f64, &[f32])> = rr.iter().map(|(f, r)| (f * 4096.0, *r)).collect();
                    let (mut sa, mut sb) = (vec![0.5; g], vec![0.5; g]);
                    let (mut a, mut b) = (vec![3.0; n], vec![3.0; n]);
                    // SAFETY: as above.
                    unsafe { explicit::round_rows(&mut a, &grid, &mut sa) };
                    round_rows_generic(&mut b, &grid, &mut sb);
                    assert_eq!((&a, &sa), (&b, &sb), "rounded: n = {n}, rows = {g}");
                    assert!(a.iter().all(|v| v.fract() == 0.0));
                }
            }
        }
    }

    #[test]
    fn axpy_grouping_is_bit_identical_to_one_row_at_a_time() {
        let rows: Vec<Vec<f64>> = (0..15)
            .map(|r| {
                (0..33)
                    .map(|j| ((r * 31 + j) as f64 * 0.113).cos() * 1e3)
                    .collect()
            })
            .collect();
        let f = [
            0.3, 1.0, 0.77, 1e-3, 0.5, 0.9, 0.1, 0.2, 0.6, 1.0, 0.01, 0.3, 0.4, 0.5, 0.7,
        ];
        let refs: Vec<(f64, &[f64])> = rows.iter().zip(f).map(|(x, f)| (f, x.as_slice())).collect();
        let mut a = vec![0.0; 33];
        axpy_rows(&mut a, &refs);
        let mut b = vec![0.0; 33];
        for r in &refs {
            axpy_rows_generic(&mut b, std::slice::from_ref(r));
        }
        assert_eq!(a, b);
    }

    #[test]
    fn finiteness() {
        assert!(all_finite(&[
            1.0f32, 2.0, -3.0, 0.0, 5.0, 6.0, 7.0, 8.0, 9.0
        ]));
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            for pos in [0, 5, 8, 10] {
                let mut x = vec![1.0f64; 11];
                x[pos] = bad;
                assert!(!all_finite(&x), "{bad} at {pos}");
            }
        }
    }
}
