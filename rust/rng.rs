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
use crate::error::{DpError, DpResult};
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
}
