//! A 32-bit ziggurat for standard normal samples destined for float32 outputs.
//!
//! Marsaglia & Tsang (2000), "The Ziggurat Method for Generating Random Variables", J. Stat.
//! Softw. 5(8), with 128 layers, and with Doornik's (2005) correction: the layer index and the
//! value come from disjoint bits of the draw (7 bits for the layer, 25 signed bits for the
//! value), so they are independent. One 32-bit draw yields a sample in about 97.3% of cases
//! (measured: 2.75% of draws fall outside their layer's rectangle), half the ChaCha20 output the
//! 64-bit sampler needs; 24 bits of magnitude exceed the 24-bit float32 significand the sample
//! ends in. float64 outputs keep the 64-bit sampler. The wedge test avoids the exponential in
//! about 98.5% of cases with a chord-and-tangent squeeze (as in McFarland 2016, "A modified
//! ziggurat algorithm for generating exponentially and normally distributed pseudorandom
//! numbers", J. Stat. Comput. Simul. 86(7)).

use crate::chacha::ChaCha20;
#[cfg(target_arch = "x86_64")]
use crate::kernels::{tier, Tier};
use std::sync::OnceLock;

const LAYERS: usize = 128;
/// Right edge of the base layer and the area of each layer (Marsaglia & Tsang, Table 1).
const R: f64 = 3.442619855899;
const V: f64 = 9.91256303526217e-3;
const SCALE: f64 = (1u32 << 24) as f64;

struct Tables {
    /// Acceptance thresholds on |u| (u a signed 25-bit integer).
    k: [u32; LAYERS],
    /// x-scale per layer: sample = u · w[i]. Each w[i] is rounded to 48 significant bits, so
    /// that it is exactly w_hi[i] + w_lo[i] with both halves float32 (see `split_scales`).
    w: [f64; LAYERS],
    w_hi: [f32; LAYERS],
    w_lo: [f32; LAYERS],
    /// Density f(x_i) = exp(−x_i²/2) at each layer's edge.
    f: [f64; LAYERS],
    /// The edges x_i themselves (x_0 = 0, the top of layer 1), for the wedge's squeeze.
    x: [f64; LAYERS],
}

fn tables() -> &'static Tables {
    static T: OnceLock<Tables> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = Tables {
            k: [0; LAYERS],
            w: [0.0; LAYERS],
            w_hi: [0.0; LAYERS],
            w_lo: [0.0; LAYERS],
            f: [0.0; LAYERS],
            x: [0.0; LAYERS],
        };
        let mut dn = R;
        let mut tn = dn;
        let q = V / (-0.5 * dn * dn).exp();
        t.k[0] = ((dn / q) * SCALE) as u32;
        t.k[1] = 0;
        t.w[0] = q / SCALE;
        t.w[LAYERS - 1] = dn / SCALE;
        t.f[0] = 1.0;
        t.f[LAYERS - 1] = (-0.5 * dn * dn).exp();
        t.x[LAYERS - 1] = dn;
        for i in (1..LAYERS - 1).rev() {
            dn = (-2.0 * (V / dn + (-0.5 * dn * dn).exp()).ln()).sqrt();
            t.k[i + 1] = ((dn / tn) * SCALE) as u32;
            tn = dn;
            t.f[i] = (-0.5 * dn * dn).exp();
            t.w[i] = dn / SCALE;
            t.x[i] = dn;
        }
        split_scales(&mut t);
        t
    })
}

/// Splits every scale into two float32 halves and keeps their exact sum as the scale.
///
/// Why: the vector path looks the halves up with in-register permutes, which are much faster
/// than gathers, and forms u·w as u·w_hi + u·w_lo. Both products are exact in f64 (25 by 24
/// significant bits), so their sum, rounded once, is the correctly rounded u·w, the same bits
/// the scalar path gets. Moving w by a relative 2⁻⁴⁸ is far below the 2⁻²⁴ resolution of u.
fn split_scales(t: &mut Tables) {
    for i in 0..LAYERS {
        let hi = t.w[i] as f32;
        let lo = (t.w[i] - hi as f64) as f32;
        t.w_hi[i] = hi;
        t.w_lo[i] = lo;
        t.w[i] = hi as f64 + lo as f64;
    }
}

/// A uniform double in (0, 1) from 32 fresh bits.
#[inline]
fn uniform01(rng: &mut ChaCha20) -> f64 {
    unit(rng.next_word())
}

/// The uniform double in (0, 1) that one 32-bit word stands for.
#[inline(always)]
fn unit(word: u32) -> f64 {
    (word as f64 + 0.5) * (1.0 / 4294967296.0)
}

/// A draw's disjoint bit fields: the signed 25-bit value and the 7-bit layer.
#[inline(always)]
fn split(b: u32) -> (i32, usize) {
    ((b as i32) >> 7, (b & 127) as usize)
}

/// Samples per group: a group's draws are read from the stream in bulk.
const GROUP: usize = 256;

/// Fills `z` with independent standard normal samples (in f64; meant to be rounded to f32).
///
/// Each group of up to 256 samples reads, from its stream, in this order:
/// 1. one 32-bit draw per sample. Draws inside their layer's rectangle are samples (about 97.3%;
///    sixteen lanes at a time where AVX-512 is present);
/// 2. one word per rejected draw, in index order: the uniform height of its wedge point. A point
///    under the density is the sample; a base-layer draw (the tail) skips its word;
/// 3. for every draw still unfinished, in index order, fresh words for the exact slow path:
///    the tail by Marsaglia's exponential method, or a new draw after a wedge rejection.
///
/// Samples never share randomness, and the words each sample uses are a fixed function of the
/// stream, so every tier gives the same bits (tested against a plain scalar version). Stage 2
/// has no data-dependent branch but the rare exponential, which is where a one-draw-at-a-time
/// ziggurat spends much of its time on mispredictions.
pub fn fill_standard_normal(rng: &mut ChaCha20, z: &mut [f64]) {
    let t = tables();
    let mut draws = [0u32; GROUP];
    let mut heights = [0u32; GROUP];
    let mut rejected = [0u64; GROUP / 64];
    let mut list = [0u16; GROUP];
    for zc in z.chunks_mut(GROUP) {
        let draws = &mut draws[..zc.len()];
        rng.fill_words(draws);
        rectangles(t, draws, zc, &mut rejected);
        let mut m = 0;
        for (word, bits) in rejected.iter().enumerate() {
            let mut bits = *bits;
            while bits != 0 {
                list[m] = (64 * word + bits.trailing_zeros() as usize) as u16;
                m += 1;
                bits &= bits - 1;
            }
        }
        if m == 0 {
            continue;
        }
        let heights = &mut heights[..m];
        rng.fill_words(heights);
        let mut left = 0;
        for k in 0..m {
            let j = list[k] as usize;
            let (u, i) = split(draws[j]);
            let x = zc[j];
            // i = 0 (the tail) is decided in stage 3; its index 1 here only keeps this in bounds.
            let under = wedge_accepts(t, i.max(1), x.abs(), height(t, i.max(1), heights[k]));
            list[left] = j as u16;
            left += usize::from(i == 0 || !under);
            debug_assert!(u.unsigned_abs() >= t.k[i]);
        }
        for &j in &list[..left] {
            let j = j as usize;
            zc[j] = finish(rng, t, split(draws[j]));
        }
    }
}

/// A uniform height in layer i's wedge, [f_i, f_{i-1}), from one word.
#[inline(always)]
fn height(t: &Tables, i: usize, word: u32) -> f64 {
    t.f[i] + unit(word) * (t.f[i - 1] - t.f[i])
}

/// `z[j] = u_j · w[i_j]` for every draw, and bit j of `rejected` set where the draw falls
/// outside its layer's rectangle (those `z[j]` are to be overwritten).
#[inline]
fn rectangles(t: &Tables, draws: &[u32], z: &mut [f64], rejected: &mut [u64; GROUP / 64]) {
    *rejected = [0; GROUP / 64];
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if tier() == Tier::Avx512 {
        // SAFETY: tier() checked that the CPU has AVX-512F.
        done = unsafe { avx512::rectangles(t, draws, z, rejected) };
    }
    for j in done..draws.len() {
        let (u, i) = split(draws[j]);
        z[j] = u as f64 * t.w[i];
        if u.unsigned_abs() >= t.k[i] {
            rejected[j / 64] |= 1 << (j % 64);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Tables, GROUP};
    use core::arch::x86_64::*;

    /// One 128-entry table lookup per lane, from eight registers: four two-register permutes
    /// on the low five index bits, then blends on bits 5 and 6.
    macro_rules! lookup {
        ($tab:expr, $i:expr, $b5:expr, $b6:expr, $perm:ident, $blend:ident) => {{
            let t = &$tab;
            let c0 = $perm(t[0], $i, t[1]);
            let c1 = $perm(t[2], $i, t[3]);
            let c2 = $perm(t[4], $i, t[5]);
            let c3 = $perm(t[6], $i, t[7]);
            $blend($b6, $blend($b5, c0, c1), $blend($b5, c2, c3))
        }};
    }

    /// The rectangle test for the leading multiple of 16 draws; returns how many it did. The
    /// products are the scalar ones: u·w_hi and u·w_lo are exact, their sum is rounded once.
    #[target_feature(enable = "avx512f")]
    pub fn rectangles(
        t: &Tables,
        draws: &[u32],
        z: &mut [f64],
        rejected: &mut [u64; GROUP / 64],
    ) -> usize {
        let n = draws.len().min(z.len()) / 16 * 16;
        let mut k = [_mm512_setzero_si512(); 8];
        let mut hi = [_mm512_setzero_ps(); 8];
        let mut lo = [_mm512_setzero_ps(); 8];
        for r in 0..8 {
            // SAFETY: each table has 128 = 8·16 entries.
            unsafe {
                k[r] = _mm512_loadu_si512(t.k.as_ptr().add(16 * r).cast());
                hi[r] = _mm512_loadu_ps(t.w_hi.as_ptr().add(16 * r));
                lo[r] = _mm512_loadu_ps(t.w_lo.as_ptr().add(16 * r));
            }
        }
        let low7 = _mm512_set1_epi32(127);
        let (bit5, bit6) = (_mm512_set1_epi32(32), _mm512_set1_epi32(64));
        for j in (0..n).step_by(16) {
            // SAFETY: j + 16 <= n <= the lengths of draws and z.
            let d = unsafe { _mm512_loadu_si512(draws.as_ptr().add(j).cast()) };
            let u = _mm512_srai_epi32::<7>(d);
            let i = _mm512_and_si512(d, low7);
            let b5 = _mm512_test_epi32_mask(i, bit5);
            let b6 = _mm512_test_epi32_mask(i, bit6);
            let kj = lookup!(
                k,
                i,
                b5,
                b6,
                _mm512_permutex2var_epi32,
                _mm512_mask_blend_epi32
            );
            let out = _mm512_cmpge_epu32_mask(_mm512_abs_epi32(u), kj);
            rejected[j / 64] |= (out as u64) << (j % 64);
            let hj = lookup!(hi, i, b5, b6, _mm512_permutex2var_ps, _mm512_mask_blend_ps);
            let lj = lookup!(lo, i, b5, b6, _mm512_permutex2var_ps, _mm512_mask_blend_ps);
            let halves = |v: __m512| {
                (
                    _mm512_cvtps_pd(_mm512_castps512_ps256(v)),
                    _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                        _mm512_castps_pd(v),
                    ))),
                )
            };
            let (h0, h1) = halves(hj);
            let (l0, l1) = halves(lj);
            let u0 = _mm512_cvtepi32_pd(_mm512_castsi512_si256(u));
            let u1 = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(u));
            let z0 = _mm512_add_pd(_mm512_mul_pd(u0, h0), _mm512_mul_pd(u0, l0));
            let z1 = _mm512_add_pd(_mm512_mul_pd(u1, h1), _mm512_mul_pd(u1, l1));
            // SAFETY: as for the load.
            unsafe {
                _mm512_storeu_pd(z.as_mut_ptr().add(j), z0);
                _mm512_storeu_pd(z.as_mut_ptr().add(j + 8), z1);
            }
        }
        n
    }
}

/// Whether the point (ax, y) of layer i's wedge (x_{i-1} ≤ ax ≤ x_i, f_i ≤ y ≤ f_{i-1}) lies
/// under the density, i.e. y < exp(−ax²/2).
///
/// Most points are decided without the exponential by a squeeze between the wedge's chord and
/// its two end tangents (f'(x) = −x·f(x)): where f is convex (x ≥ 1) it lies under the chord and
/// over the tangents, where it is concave (x ≤ 1) the other way round. The bounds are widened
/// by `SQUEEZE_SLACK`, far more than their rounding error, so a squeezed decision is the exact
/// test's unless y is within that slack of the curve. The layer that straddles x = 1 always
/// takes the exponential.
#[inline(always)]
fn wedge_accepts(t: &Tables, i: usize, ax: f64, y: f64) -> bool {
    match squeeze(t, i, ax, y) {
        Some(d) => d,
        None => y < (-0.5 * ax * ax).exp(),
    }
}

/// The squeeze's decision, or None where it cannot tell; computed without branches on the data.
#[inline(always)]
fn squeeze(t: &Tables, i: usize, ax: f64, y: f64) -> Option<bool> {
    let (x0, x1, f0, f1) = (t.x[i - 1], t.x[i], t.f[i - 1], t.f[i]);
    let chord = f0 + (f1 - f0) * ((ax - x0) / (x1 - x0));
    let tan0 = f0 * (1.0 - x0 * (ax - x0));
    let tan1 = f1 * (1.0 - x1 * (ax - x1));
    let convex = x0 >= 1.0;
    let curved = convex || x1 <= 1.0;
    let (below, above) = if convex {
        (tan0.max(tan1), chord)
    } else {
        (chord, tan0.min(tan1))
    };
    let yes = curved & (y < below - SQUEEZE_SLACK);
    let no = curved & (y > above + SQUEEZE_SLACK);
    if yes | no {
        Some(yes)
    } else {
        None
    }
}

/// Absolute slack on the squeeze's bounds (the densities are ≤ 1; their rounding is ~1e-16).
const SQUEEZE_SLACK: f64 = 1e-12;

/// The tail beyond R, by Marsaglia's exponential method, with the sign of the draw `u`.
#[cold]
fn tail(rng: &mut ChaCha20, u: i32) -> f64 {
    loop {
        let x = -uniform01(rng).ln() / R;
        let y = -uniform01(rng).ln();
        if y + y >= x * x {
            return if u > 0 { R + x } else { -R - x };
        }
    }
}

/// Stage 3: a base-layer draw goes to the tail; a draw whose wedge point was rejected starts
/// over with fresh draws (each tested as in stages 1 and 2, its height read right after it).
#[cold]
fn finish(rng: &mut ChaCha20, t: &Tables, (u, i): (i32, usize)) -> f64 {
    if i == 0 {
        return tail(rng, u);
    }
    loop {
        let (u, i) = split(rng.next_word());
        let x = u as f64 * t.w[i];
        if u.unsigned_abs() < t.k[i] {
            return x;
        }
        if i == 0 {
            return tail(rng, u);
        }
        if wedge_accepts(t, i, x.abs(), height(t, i, rng.next_word())) {
            return x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{chunk_rng, Seed};

    fn phi(x: f64) -> f64 {
        // Φ via erfc from the complementary error function's continued fraction is overkill here;
        // a 1e-7-accurate rational approximation (Abramowitz & Stegun 26.2.17) suffices for a KS bound.
        let t = 1.0 / (1.0 + 0.2316419 * x.abs());
        let d = 0.3989422804014327 * (-0.5 * x * x).exp();
        let p = d
            * t
            * (0.319381530
                + t * (-0.356563782 + t * (1.781477937 + t * (-1.821255978 + t * 1.330274429))));
        if x >= 0.0 {
            1.0 - p
        } else {
            p
        }
    }

    /// The same three stages, written plainly: scalar, with branches, exponential always.
    fn plain(rng: &mut ChaCha20, z: &mut [f64]) {
        let t = tables();
        let mut draws = [0u32; GROUP];
        for zc in z.chunks_mut(GROUP) {
            let draws = &mut draws[..zc.len()];
            rng.fill_words(draws);
            let mut rejected = Vec::new();
            for (j, d) in draws.iter().enumerate() {
                let (u, i) = split(*d);
                zc[j] = u as f64 * t.w[i];
                if u.unsigned_abs() >= t.k[i] {
                    rejected.push(j);
                }
            }
            let mut left = Vec::new();
            for &j in &rejected {
                let word = rng.next_word();
                let (_, i) = split(draws[j]);
                if i == 0 {
                    left.push(j);
                    continue;
                }
                let y = t.f[i] + (word as f64 + 0.5) / 4294967296.0 * (t.f[i - 1] - t.f[i]);
                if y >= (-0.5 * zc[j] * zc[j]).exp() {
                    left.push(j);
                }
            }
            for j in left {
                zc[j] = finish(rng, t, split(draws[j]));
            }
        }
    }

    #[test]
    fn squeezed_wedge_test_agrees_with_the_exponential() {
        let t = tables();
        let key = Seed::Fixed(9).key().unwrap();
        let mut rng = chunk_rng(&key, 0);
        let (mut decided, mut total) = (0usize, 0usize);
        for i in 1..LAYERS {
            let (x0, x1, f0, f1) = (t.x[i - 1], t.x[i], t.f[i - 1], t.f[i]);
            for _ in 0..4000 {
                let ax = x0 + uniform01(&mut rng) * (x1 - x0);
                let y = f1 + uniform01(&mut rng) * (f0 - f1);
                let exact = y < (-0.5 * ax * ax).exp();
                assert_eq!(
                    wedge_accepts(t, i, ax, y),
                    exact,
                    "layer {i}, x {ax}, y {y}"
                );
                if let Some(d) = squeeze(t, i, ax, y) {
                    assert_eq!(d, exact, "layer {i}, x {ax}, y {y}");
                    decided += 1;
                }
                total += 1;
            }
        }
        // The point of the squeeze: most wedge points never need the exponential.
        let share = decided as f64 / total as f64;
        assert!(share > 0.95, "squeeze decided {share}");
    }

    #[test]
    fn grouped_stages_give_the_plain_versions_bits() {
        let key = Seed::Fixed(5).key().unwrap();
        // Lengths that end mid-vector and mid-group; every stream position stays aligned.
        for n in [1, 15, 16, 17, 255, 256, 300, 100_003] {
            let (mut a, mut b) = (chunk_rng(&key, n as u64), chunk_rng(&key, n as u64));
            let (mut x, mut y) = (vec![0.0; n], vec![0.0; n]);
            fill_standard_normal(&mut a, &mut x);
            plain(&mut b, &mut y);
            assert_eq!(x, y, "n = {n}");
            assert_eq!(a.next_word(), b.next_word(), "n = {n}");
        }
    }

    #[test]
    fn kolmogorov_smirnov_and_moments() {
        let key = Seed::Fixed(11).key().unwrap();
        let mut rng = chunk_rng(&key, 0);
        let n = 200_000;
        let mut x = vec![0.0; n];
        fill_standard_normal(&mut rng, &mut x);
        let mean = x.iter().sum::<f64>() / n as f64;
        let var = x.iter().map(|v| v * v).sum::<f64>() / n as f64 - mean * mean;
        let kurt = x.iter().map(|v| v.powi(4)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 5.0 / (n as f64).sqrt(), "{mean}");
        assert!((var - 1.0).abs() < 5.0 * (2.0 / n as f64).sqrt(), "{var}");
        assert!(
            (kurt - 3.0).abs() < 5.0 * (96.0 / n as f64).sqrt(),
            "{kurt}"
        );
        x.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let d = x
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let c = phi(*v);
                (c - i as f64 / n as f64)
                    .abs()
                    .max(((i + 1) as f64 / n as f64 - c).abs())
            })
            .fold(0.0, f64::max);
        // The 0.1% critical value of the KS statistic is 1.95/sqrt(n) = 0.0044.
        assert!(d < 1.95 / (n as f64).sqrt(), "KS statistic {d}");
        // The tail beyond R must be populated at its true rate 2·(1 − Φ(R)) ≈ 5.76e-4.
        let tail = x.iter().filter(|v| v.abs() > R).count() as f64 / n as f64;
        assert!(
            (tail - 5.76e-4).abs() < 5.0 * (5.76e-4 / n as f64).sqrt(),
            "{tail}"
        );
    }
}
