//! Inner loops over contiguous slices, with runtime dispatch to AVX-512 or AVX2 on x86-64.
//!
//! Every kernel performs the same sequence of IEEE operations whatever the instruction set (no
//! fused multiply-add, fixed lane structure), so results are bit-identical across the dispatched
//! paths and across thread counts.

use crate::records::Elem;

const LANES: usize = 8;

#[inline(always)]
fn sumsq_generic<T: Elem>(x: &[T]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let v = c[l].to_f64();
            acc[l] += v * v;
        }
    }
    for (l, v) in rem.iter().enumerate() {
        let v = v.to_f64();
        acc[l] += v * v;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Accumulate `acc[j] += f_r * x_r[j]` for each row r in order. Rows are taken up to four at a
/// time so `acc` is loaded and stored once per group; the sum order per coordinate is still
/// r = 0, 1, 2, ... so grouping does not change the bits.
#[inline(always)]
fn axpy_rows_generic<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])]) {
    let n = acc.len();
    let mut groups = rows.chunks_exact(4);
    for g in &mut groups {
        let (f0, x0) = (g[0].0, &g[0].1[..n]);
        let (f1, x1) = (g[1].0, &g[1].1[..n]);
        let (f2, x2) = (g[2].0, &g[2].1[..n]);
        let (f3, x3) = (g[3].0, &g[3].1[..n]);
        for j in 0..n {
            let mut a = acc[j];
            a += f0 * x0[j].to_f64();
            a += f1 * x1[j].to_f64();
            a += f2 * x2[j].to_f64();
            a += f3 * x3[j].to_f64();
            acc[j] = a;
        }
    }
    for &(f, x) in groups.remainder() {
        let x = &x[..n];
        for j in 0..n {
            acc[j] += f * x[j].to_f64();
        }
    }
}

#[inline(always)]
fn all_finite_generic<T: Elem>(x: &[T]) -> bool {
    // x - x is 0 for finite x and NaN otherwise; a running sum keeps the loop branch-free.
    let mut acc = [0.0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let v = c[l].to_f64();
            acc[l] += v - v;
        }
    }
    let mut ok = acc.iter().all(|a| *a == 0.0);
    for v in rem {
        ok &= v.to_f64().is_finite();
    }
    ok
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
        }
    };
}
simd_tier!(avx512, "avx512f");
simd_tier!(avx2, "avx2");

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
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Tier::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Tier::Avx2;
        }
    }
    Tier::Baseline
}

/// Calls the widest compiled tier of kernel `$f` that this CPU supports.
macro_rules! dispatch {
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

/// Σ x_j², accumulated in f64 over eight fixed lanes.
pub fn sumsq<T: Elem>(x: &[T]) -> f64 {
    dispatch!(sumsq, sumsq_generic(x))
}

/// acc += Σ_r f_r x_r, rows in order. Each row must be at least `acc.len()` long.
pub fn axpy_rows<T: Elem>(acc: &mut [f64], rows: &[(f64, &[T])]) {
    dispatch!(axpy_rows, axpy_rows_generic(acc, rows))
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
    x.iter().fold(0.0f64, |a, v| {
        let t = v.to_f64() * inv;
        a + t * t
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 checked just above.
            assert_eq!(unsafe { avx2::sumsq(&x) }, sumsq_generic(&x));
        }
    }

    #[test]
    fn axpy_grouping_is_bit_identical_to_one_row_at_a_time() {
        let rows: Vec<Vec<f64>> = (0..7)
            .map(|r| {
                (0..33)
                    .map(|j| ((r * 31 + j) as f64 * 0.113).cos() * 1e3)
                    .collect()
            })
            .collect();
        let f = [0.3, 1.0, 0.77, 1e-3, 0.5, 0.9, 0.1];
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
