//! ChaCha20 as a random number generator, sixteen blocks at a time.
//!
//! The block function is Bernstein's (2008, "ChaCha, a variant of Salsa20"; RFC 8439 §2.3 gives
//! the same rounds) with 20 rounds and the original layout of words 12–15: a 64-bit block
//! counter and a 64-bit stream number, as in rand_chacha.
//!
//! Why not rand_chacha itself: noise generation is bound by the generator, and rand_chacha
//! computes four blocks per call with 128/256-bit vectors. Here block b of a batch of sixteen
//! lives in lane b of sixteen 16-lane vectors, so one AVX-512 pass (with native rotates)
//! produces all sixteen. The batch is emitted word-major (word w of block b at index 16·w + b),
//! a fixed public permutation of the ChaCha20 keystream and therefore exactly as unpredictable.
//! The tests check it word for word against rand_chacha.
//!
//! Only integer operations are used, so every compiled tier gives the same words.

use crate::kernels::{tier, Tier};
use core::convert::Infallible;
use rand_core::{SeedableRng, TryCryptoRng, TryRng};

/// Words per batch: sixteen 16-word blocks.
pub const BATCH_WORDS: usize = 256;
const LANES: usize = 16;
/// "expand 32-byte k".
const SIGMA: [u32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];

/// The sixteen words of the initial state of block `counter` (RFC 8439 §2.3, with words 12–15
/// holding the 64-bit counter and the 64-bit stream).
#[inline(always)]
fn initial_state(key: &[u32; 8], stream: u64, counter: u64) -> [u32; 16] {
    let mut s = [0u32; 16];
    s[..4].copy_from_slice(&SIGMA);
    s[4..12].copy_from_slice(key);
    s[12] = counter as u32;
    s[13] = (counter >> 32) as u32;
    s[14] = stream as u32;
    s[15] = (stream >> 32) as u32;
    s
}

/// The twenty rounds over a state held in sixteen named words of any type with the given
/// add, xor and rotate-left operations.
macro_rules! rounds {
    ($x:ident, $add:expr, $xor:expr, $rotl:expr) => {{
        let [mut x0, mut x1, mut x2, mut x3, mut x4, mut x5, mut x6, mut x7, mut x8, mut x9, mut x10, mut x11, mut x12, mut x13, mut x14, mut x15] =
            $x;
        macro_rules! qr {
            ($a:ident, $b:ident, $c:ident, $d:ident) => {
                $a = $add($a, $b);
                $d = $rotl($xor($d, $a), 16);
                $c = $add($c, $d);
                $b = $rotl($xor($b, $c), 12);
                $a = $add($a, $b);
                $d = $rotl($xor($d, $a), 8);
                $c = $add($c, $d);
                $b = $rotl($xor($b, $c), 7);
            };
        }
        for _ in 0..10 {
            qr!(x0, x4, x8, x12);
            qr!(x1, x5, x9, x13);
            qr!(x2, x6, x10, x14);
            qr!(x3, x7, x11, x15);
            qr!(x0, x5, x10, x15);
            qr!(x1, x6, x11, x12);
            qr!(x2, x7, x8, x13);
            qr!(x3, x4, x9, x14);
        }
        [x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15]
    }};
}

/// Portable version: the sixteen blocks one after another.
fn batch_generic(key: &[u32; 8], stream: u64, counter: u64, out: &mut [u32; BATCH_WORDS]) {
    for l in 0..LANES {
        let s = initial_state(key, stream, counter.wrapping_add(l as u64));
        let x = rounds!(
            s,
            u32::wrapping_add,
            |a: u32, b: u32| a ^ b,
            u32::rotate_left
        );
        for w in 0..16 {
            out[LANES * w + l] = x[w].wrapping_add(s[w]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use core::arch::x86_64::*;

    /// Block l of the batch in lane l of every vector; one vector per state word.
    #[target_feature(enable = "avx512f")]
    pub fn batch(key: &[u32; 8], stream: u64, counter: u64, out: &mut [u32; BATCH_WORDS]) {
        let first = initial_state(key, stream, counter);
        let mut s: [__m512i; 16] = [_mm512_setzero_si512(); 16];
        for w in 0..16 {
            s[w] = _mm512_set1_epi32(first[w] as i32);
        }
        // The 64-bit counter of lane l is counter + l, carried into word 13.
        let lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        s[12] = _mm512_add_epi32(s[12], lanes);
        let carry = _mm512_cmplt_epu32_mask(s[12], lanes);
        s[13] = _mm512_mask_add_epi32(s[13], carry, s[13], _mm512_set1_epi32(1));
        let x = rounds!(
            s,
            |a, b| _mm512_add_epi32(a, b),
            |a, b| _mm512_xor_si512(a, b),
            |a, r| match r {
                16 => _mm512_rol_epi32::<16>(a),
                12 => _mm512_rol_epi32::<12>(a),
                8 => _mm512_rol_epi32::<8>(a),
                _ => _mm512_rol_epi32::<7>(a),
            }
        );
        for w in 0..16 {
            let v = _mm512_add_epi32(x[w], s[w]);
            // SAFETY: out has 16·16 words; row w is in bounds.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(LANES * w).cast(), v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use core::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2")]
    fn rotl(a: __m256i, r: u32) -> __m256i {
        match r {
            16 => _mm256_or_si256(_mm256_slli_epi32::<16>(a), _mm256_srli_epi32::<16>(a)),
            12 => _mm256_or_si256(_mm256_slli_epi32::<12>(a), _mm256_srli_epi32::<20>(a)),
            8 => _mm256_or_si256(_mm256_slli_epi32::<8>(a), _mm256_srli_epi32::<24>(a)),
            _ => _mm256_or_si256(_mm256_slli_epi32::<7>(a), _mm256_srli_epi32::<25>(a)),
        }
    }

    /// Two passes of eight lanes.
    #[target_feature(enable = "avx2")]
    pub fn batch(key: &[u32; 8], stream: u64, counter: u64, out: &mut [u32; BATCH_WORDS]) {
        for half in 0..2 {
            let first = initial_state(key, stream, counter.wrapping_add(8 * half as u64));
            let mut s: [__m256i; 16] = [_mm256_setzero_si256(); 16];
            for w in 0..16 {
                s[w] = _mm256_set1_epi32(first[w] as i32);
            }
            let lanes = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
            s[12] = _mm256_add_epi32(s[12], lanes);
            // Unsigned s12 < lanes means the add wrapped: add the carry (−(−1)) into word 13.
            let bias = _mm256_set1_epi32(i32::MIN);
            let wrapped =
                _mm256_cmpgt_epi32(_mm256_xor_si256(lanes, bias), _mm256_xor_si256(s[12], bias));
            s[13] = _mm256_sub_epi32(s[13], wrapped);
            let x = rounds!(
                s,
                |a, b| _mm256_add_epi32(a, b),
                |a, b| _mm256_xor_si256(a, b),
                rotl
            );
            for w in 0..16 {
                let v = _mm256_add_epi32(x[w], s[w]);
                // SAFETY: out has 16·16 words; half-row w is in bounds.
                unsafe {
                    _mm256_storeu_si256(out.as_mut_ptr().add(LANES * w + 8 * half).cast(), v)
                };
            }
        }
    }
}

fn batch(key: &[u32; 8], stream: u64, counter: u64, out: &mut [u32; BATCH_WORDS]) {
    match tier() {
        // SAFETY: tier() checked that the CPU supports the tier's instructions.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 => unsafe { avx512::batch(key, stream, counter, out) },
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => unsafe { avx2::batch(key, stream, counter, out) },
        _ => batch_generic(key, stream, counter, out),
    }
}

/// One ChaCha20 stream of a 256-bit key, read as 32-bit words from block 0 on.
#[derive(Clone)]
pub struct ChaCha20 {
    key: [u32; 8],
    stream: u64,
    /// The block counter of the next batch.
    counter: u64,
    buf: [u32; BATCH_WORDS],
    pos: usize,
}

impl ChaCha20 {
    pub fn new(key: &[u8; 32], stream: u64) -> Self {
        let mut k = [0u32; 8];
        for (w, b) in k.iter_mut().zip(key.chunks_exact(4)) {
            *w = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        ChaCha20 {
            key: k,
            stream,
            counter: 0,
            buf: [0; BATCH_WORDS],
            pos: BATCH_WORDS,
        }
    }

    /// The 256-bit key, as bytes.
    pub fn key_bytes(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (b, w) in out.chunks_exact_mut(4).zip(self.key) {
            b.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Positions the generator at word `word` of its stream, in the order `next_word` reads the
    /// words (word-major batches of sixteen blocks, the first batch starting at block 0).
    pub fn seek_word(&mut self, word: u64) {
        self.counter = (word / BATCH_WORDS as u64) * LANES as u64;
        self.refill();
        self.pos = (word % BATCH_WORDS as u64) as usize;
    }

    #[inline(never)]
    fn refill(&mut self) {
        batch(&self.key, self.stream, self.counter, &mut self.buf);
        self.counter = self.counter.wrapping_add(LANES as u64);
        self.pos = 0;
    }

    #[inline]
    pub fn next_word(&mut self) -> u32 {
        if self.pos == BATCH_WORDS {
            self.refill();
        }
        let w = self.buf[self.pos];
        self.pos += 1;
        w
    }

    /// The next `dst.len()` words of the stream.
    pub fn fill_words(&mut self, dst: &mut [u32]) {
        let mut done = 0;
        while done < dst.len() {
            if self.pos == BATCH_WORDS {
                self.refill();
            }
            let n = (BATCH_WORDS - self.pos).min(dst.len() - done);
            dst[done..done + n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            self.pos += n;
            done += n;
        }
    }
}

impl TryRng for ChaCha20 {
    type Error = Infallible;

    #[inline]
    fn try_next_u32(&mut self) -> Result<u32, Infallible> {
        Ok(self.next_word())
    }

    #[inline]
    fn try_next_u64(&mut self) -> Result<u64, Infallible> {
        let lo = self.next_word() as u64;
        Ok(lo | (self.next_word() as u64) << 32)
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Infallible> {
        for c in dst.chunks_mut(4) {
            c.copy_from_slice(&self.next_word().to_le_bytes()[..c.len()]);
        }
        Ok(())
    }
}

impl TryCryptoRng for ChaCha20 {}

impl SeedableRng for ChaCha20 {
    type Seed = [u8; 32];

    fn from_seed(seed: [u8; 32]) -> Self {
        ChaCha20::new(&seed, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::Rng;

    /// rand_chacha's words for blocks [first, first + n) of a stream, block-major.
    fn reference(key: &[u8; 32], stream: u64, first: u64, n: usize) -> Vec<u32> {
        let mut r = ChaCha20Rng::from_seed(*key);
        r.set_stream(stream);
        r.set_word_pos(first as u128 * 16);
        (0..n * 16).map(|_| r.next_u32()).collect()
    }

    #[test]
    fn matches_rand_chacha_up_to_the_word_major_layout() {
        let key: [u8; 32] = core::array::from_fn(|i| (i * 37 + 5) as u8);
        for stream in [0u64, 1, 0x0100_0000_0000_0003, u64::MAX] {
            let mut g = ChaCha20::new(&key, stream);
            let mut got = vec![0u32; 3 * BATCH_WORDS];
            g.fill_words(&mut got);
            let want = reference(&key, stream, 0, 48);
            for (batch, words) in got.chunks(BATCH_WORDS).enumerate() {
                for w in 0..16 {
                    for b in 0..16 {
                        assert_eq!(
                            words[16 * w + b],
                            want[(batch * 16 + b) * 16 + w],
                            "stream {stream}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn counter_carries_into_the_high_word() {
        let key = [9u8; 32];
        for start in [(1u64 << 32) - 8, (1u64 << 32) - 3, (5u64 << 32) - 15] {
            let mut g = ChaCha20::new(&key, 7);
            g.counter = start;
            let mut got = [0u32; BATCH_WORDS];
            g.fill_words(&mut got);
            let want = reference(&key, 7, start, 16);
            for w in 0..16 {
                for b in 0..16 {
                    assert_eq!(got[16 * w + b], want[b * 16 + w], "block {b} word {w}");
                }
            }
        }
    }

    #[test]
    fn tiers_agree() {
        let key: [u32; 8] = core::array::from_fn(|i| (i as u32).wrapping_mul(0x9e37_79b9));
        let (mut a, mut b) = ([0u32; BATCH_WORDS], [0u32; BATCH_WORDS]);
        batch(&key, 3, 1 << 40, &mut a);
        batch_generic(&key, 3, 1 << 40, &mut b);
        assert_eq!(a, b);
        #[cfg(target_arch = "x86_64")]
        for counter in [1u64 << 40, (1 << 32) - 5, u64::MAX - 3] {
            batch_generic(&key, 3, counter, &mut a);
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 checked just above.
                unsafe { avx2::batch(&key, 3, counter, &mut b) };
                assert_eq!(a, b);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F checked just above.
                unsafe { avx512::batch(&key, 3, counter, &mut b) };
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn word_and_bulk_reads_agree() {
        let key = [3u8; 32];
        let mut a = ChaCha20::new(&key, 1);
        let mut b = ChaCha20::new(&key, 1);
        let mut bulk = vec![0u32; 700];
        a.next_word();
        a.fill_words(&mut bulk);
        b.next_word();
        let single: Vec<u32> = (0..700).map(|_| b.next_word()).collect();
        assert_eq!(bulk, single);
        assert_eq!(ChaCha20::from_seed(key).key_bytes(), key);
    }
}
