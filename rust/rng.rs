//! ChaCha20 keys and streams.
//!
//! Every randomized call draws a fresh 256-bit key from the operating system (getrandom), so no
//! two calls, and no forked child and its parent, ever share a stream. A caller-supplied seed
//! replaces the OS key with a deterministic one: that mode exists for tests and reproductions
//! and gives no privacy, since anyone who knows the seed can subtract the noise.
//!
//! Work is split into fixed chunks, and chunk `c` of purpose `d` reads ChaCha20 stream
//! `stream_id(d, part, c)` of the key. The output therefore depends on the key alone, never on
//! how many threads ran the chunks.

use crate::chacha::ChaCha20;
use crate::error::{require, try_filled, DpError, DpResult};
use rand_core::SeedableRng;

pub type Key = [u8; 32];

/// Where the key of a randomized call comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seed {
    /// A fresh key from the operating system's CSPRNG (the only mode that gives privacy).
    Os,
    /// A deterministic key derived from a user seed: tests and reproductions only.
    Fixed(u64),
}

/// Purposes of random streams, so that one key never feeds two uses with the same stream.
#[derive(Clone, Copy, Debug)]
#[repr(u8)]
pub enum Domain {
    Noise = 1,
    Sampling = 2,
    DiscreteNoise = 3,
}

impl Seed {
    pub fn from_option(seed: Option<u64>) -> Self {
        seed.map_or(Seed::Os, Seed::Fixed)
    }

    /// The 256-bit ChaCha20 key for one call.
    pub fn key(self) -> DpResult<Key> {
        match self {
            Seed::Os => os_key(),
            Seed::Fixed(s) => Ok(ChaCha20::seed_from_u64(s).key_bytes()),
        }
    }
}

pub fn os_key() -> DpResult<Key> {
    let mut k = [0u8; 32];
    getrandom::fill(&mut k)
        .map_err(|e| DpError::param("seed", format!("the OS random source failed: {e}")))?;
    Ok(k)
}

/// Stream number for chunk `chunk` of part `part` in domain `domain`.
#[inline]
pub fn stream_id(domain: Domain, part: usize, chunk: usize) -> u64 {
    debug_assert!(part < (1 << 24) && (chunk as u64) < (1 << 32));
    ((domain as u64) << 56) | ((part as u64) << 32) | chunk as u64
}

/// The generator for one chunk: stream `stream` of `key`, from its start.
#[inline]
pub fn chunk_rng(key: &Key, stream: u64) -> ChaCha20 {
    ChaCha20::new(key, stream)
}

/// The key `Seed::Fixed(seed)` stands for (tests and reproductions only).
pub fn seed_key(seed: u64) -> Key {
    ChaCha20::seed_from_u64(seed).key_bytes()
}

/// Words `[start, start + n)` of stream `stream_id(domain, part, chunk)` of `key`, in the order
/// the core's generators read them (word `16·w + l` of batch `t` is word `w` of block
/// `16·t + l`; see `chacha`). For checking other implementations of the same streams, such as
/// the accelerator noise of the Python package.
pub fn stream_words(
    key: &Key,
    domain: Domain,
    part: usize,
    chunk: u64,
    start: u64,
    n: usize,
) -> DpResult<Vec<u32>> {
    require(part < 1 << 24, "part", "< 2**24", part)?;
    require(chunk < 1 << 32, "chunk", "< 2**32", chunk)?;
    require(
        start.checked_add(n as u64).is_some(),
        "start",
        "such that start + n < 2**64",
        start,
    )?;
    let mut out = try_filled(n, 0u32)?;
    if n > 0 {
        let mut g = chunk_rng(key, stream_id(domain, part, chunk as usize));
        g.seek_word(start);
        g.fill_words(&mut out);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_core::Rng;

    #[test]
    fn os_keys_differ() {
        assert_ne!(os_key().unwrap(), os_key().unwrap());
    }

    #[test]
    fn fixed_seed_is_deterministic_and_streams_differ() {
        let k = Seed::Fixed(7).key().unwrap();
        assert_eq!(k, Seed::Fixed(7).key().unwrap());
        assert_ne!(k, Seed::Fixed(8).key().unwrap());
        let a = chunk_rng(&k, stream_id(Domain::Noise, 0, 0)).next_u64();
        let b = chunk_rng(&k, stream_id(Domain::Noise, 0, 1)).next_u64();
        let c = chunk_rng(&k, stream_id(Domain::Sampling, 0, 0)).next_u64();
        assert!(a != b && a != c && b != c);
    }

    #[test]
    fn seed_key_is_the_fixed_seed_key() {
        for s in [0u64, 7, u64::MAX] {
            assert_eq!(seed_key(s), Seed::Fixed(s).key().unwrap());
        }
    }

    /// `stream_words` against rand_chacha, block-major there, word-major batches here.
    #[test]
    fn stream_words_match_rand_chacha() {
        use rand_chacha::ChaCha20Rng;
        let key = seed_key(11);
        let cases: [(usize, u64, u64, usize); 6] = [
            (0, 0, 0, 1000),
            (3, 1, 5, 300),
            ((1 << 24) - 1, (1 << 32) - 1, 250, 20),
            (2, 7, 16_384 - 3, 9),
            // Blocks just below 2^32: the counter carries into word 13.
            (1, 0, ((1u64 << 32) - 16) * 16, 700),
            (0, 9, 17 * 256 + 1, 0),
        ];
        for (part, chunk, start, n) in cases {
            let got = stream_words(&key, Domain::Noise, part, chunk, start, n).unwrap();
            assert_eq!(got.len(), n);
            let mut r = ChaCha20Rng::from_seed(key);
            r.set_stream(stream_id(Domain::Noise, part, chunk as usize));
            for (i, &g) in got.iter().enumerate() {
                let j = start + i as u64;
                let (batch, w, l) = (j / 256, (j % 256) / 16, j % 16);
                r.set_word_pos(((batch * 16 + l) * 16 + w) as u128);
                assert_eq!(g, r.next_u32(), "part {part} chunk {chunk} word {j}");
            }
        }
        // The words the noise of chunk 1 of part 2 reads.
        let mut g = chunk_rng(&key, stream_id(Domain::Noise, 2, 1));
        let first: Vec<u32> = (0..600).map(|_| g.next_word()).collect();
        assert_eq!(
            stream_words(&key, Domain::Noise, 2, 1, 0, 600).unwrap(),
            first
        );
    }

    #[test]
    fn stream_words_rejects_out_of_range() {
        let key = [0u8; 32];
        assert!(stream_words(&key, Domain::Noise, 1 << 24, 0, 0, 1).is_err());
        assert!(stream_words(&key, Domain::Noise, 0, 1 << 32, 0, 1).is_err());
        assert!(stream_words(&key, Domain::Noise, 0, 0, u64::MAX, 2).is_err());
    }
}
