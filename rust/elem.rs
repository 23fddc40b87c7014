//! The element types a record may hold (f32, f64): their conversions and the SIMD loads the
//! kernels use. At the bottom of the core: `kernels` and `records` both build on it, so neither
//! imports the other's types.

/// Element types a record may hold. Arithmetic is always done in `f64`.
pub trait Elem: Copy + Send + Sync + 'static + Lanes {
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    /// Unit roundoff of the type (half an ulp at 1.0).
    const UNIT_ROUNDOFF: f64;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    const UNIT_ROUNDOFF: f64 = 5.960464477539063e-8; // 2^-24
}

impl Elem for f64 {
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
    const UNIT_ROUNDOFF: f64 = 1.1102230246251565e-16; // 2^-53
}

/// Reads four values of an element type as the four f64 lanes of a 256-bit vector: the one step
/// in which the explicit x86 kernels differ by element type.
pub trait Lanes: Sized {
    /// Whether the explicit kernels serve this type. Not for f64: with no conversion to do, the
    /// compiler's 512-bit code for the generic axpy was faster (clip of f64 (128, 1e5): 3.5 ms
    /// against 4.0 ms), and the sums of squares ran at the same speed.
    const EXPLICIT: bool;
    /// # Safety
    /// The CPU must support AVX, and four values must be readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load4(p: *const Self) -> std::arch::x86_64::__m256d;
}

impl Lanes for f32 {
    const EXPLICIT: bool = true;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load4(p: *const f32) -> std::arch::x86_64::__m256d {
        use std::arch::x86_64::*;
        _mm256_cvtps_pd(_mm_loadu_ps(p))
    }
}

impl Lanes for f64 {
    const EXPLICIT: bool = false;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load4(p: *const f64) -> std::arch::x86_64::__m256d {
        std::arch::x86_64::_mm256_loadu_pd(p)
    }
}
