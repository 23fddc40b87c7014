//! Sampling of records, fed by ChaCha20 (McMahan et al. 2018, §5; Abadi et al. 2016 "lots").
//!
//! * Poisson sampling: each of n records joins independently with probability q. The indices
//!   are drawn with geometric skips, so the work is O(q·n) expected rather than O(n).
//! * Fixed-size sampling: b of the n records uniformly without replacement.

use crate::error::{DpError, DpResult};
use crate::rng::{chunk_rng, stream_id, Domain, Seed};
use rand::seq::index;
use rand_core::Rng;

pub fn check_probability(q: f64) -> DpResult<()> {
    if !(0.0..=1.0).contains(&q) {
        return Err(DpError::param(
            "sampling_probability",
            format!("must be in [0, 1], got {q}"),
        ));
    }
    Ok(())
}

/// A uniform double in (0, 1]: 53 random bits, never 0 (so its log is finite).
#[inline]
fn uniform_open0(rng: &mut impl Rng) -> f64 {
    ((rng.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Sorted indices of a Poisson sample of {0, …, n−1} with probability q.
pub fn poisson_sample(n: u64, q: f64, seed: Seed) -> DpResult<Vec<u64>> {
    check_probability(q)?;
    if q == 0.0 || n == 0 {
        return Ok(Vec::new());
    }
    if q == 1.0 {
        return Ok((0..n).collect());
    }
    let key = seed.key()?;
    let mut rng = chunk_rng(&key, stream_id(Domain::Sampling, 0, 0));
    // Gap G ~ Geometric(q) on {0, 1, …}: P(G ≥ k) = (1−q)^k, G = ⌊ln U / ln(1−q)⌋.
    let log1mq = (-q).ln_1p();
    // Room for the mean plus ten standard deviations, reserved fallibly so that an impossible
    // sample size is an error rather than an abort.
    let expected = (n as f64) * q;
    let room = (expected + 10.0 * expected.sqrt() + 16.0).min(n as f64);
    let mut out: Vec<u64> = Vec::new();
    out.try_reserve_exact(room as usize)
        .map_err(|_| DpError::OutOfMemory {
            bytes: room as u128 * 8,
        })?;
    let mut i: u64 = 0;
    loop {
        let gap = (uniform_open0(&mut rng).ln() / log1mq).floor();
        // A gap past the end (or an astronomically large one) ends the sample.
        if !(gap < (n - i) as f64) {
            break;
        }
        i += gap as u64;
        out.push(i);
        i += 1;
        if i >= n {
            break;
        }
    }
    Ok(out)
}

/// Sorted indices of `b` records drawn uniformly without replacement from n.
pub fn fixed_size_sample(n: u64, b: u64, seed: Seed) -> DpResult<Vec<u64>> {
    if b > n {
        return Err(DpError::param(
            "sample_size",
            format!("must be <= the population size {n}, got {b}"),
        ));
    }
    let (n, b) = (
        usize::try_from(n)
            .map_err(|_| DpError::param("population_size", "too large for this platform"))?,
        b as usize,
    );
    let key = seed.key()?;
    let mut rng = chunk_rng(&key, stream_id(Domain::Sampling, 1, 0));
    let mut out: Vec<u64> = index::sample(&mut rng, n, b)
        .into_iter()
        .map(|i| i as u64)
        .collect();
    out.sort_unstable();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_sizes_and_uniformity() {
        let n = 100_000u64;
        let mut counts = vec![0u32; 10];
        let mut sizes = Vec::new();
        for s in 0..50 {
            let v = poisson_sample(n, 0.01, Seed::Fixed(s)).unwrap();
            assert!(v.windows(2).all(|w| w[0] < w[1]) && v.iter().all(|&i| i < n));
            sizes.push(v.len() as f64);
            for i in v {
                counts[(i * 10 / n) as usize] += 1;
            }
        }
        let mean = sizes.iter().sum::<f64>() / 50.0;
        // E = 1000, sd of the mean of 50 = sqrt(990/50) ≈ 4.45.
        assert!((mean - 1000.0).abs() < 5.0 * 4.45, "{mean}");
        let total: u32 = counts.iter().sum();
        for c in counts {
            let e = total as f64 / 10.0;
            assert!((c as f64 - e).abs() < 5.0 * e.sqrt(), "{c} vs {e}");
        }
    }

    #[test]
    fn poisson_edges() {
        assert!(poisson_sample(10, 0.0, Seed::Os).unwrap().is_empty());
        assert_eq!(poisson_sample(4, 1.0, Seed::Os).unwrap(), vec![0, 1, 2, 3]);
        assert!(poisson_sample(0, 0.5, Seed::Os).unwrap().is_empty());
        for q in [-0.1, 1.1, f64::NAN] {
            assert!(poisson_sample(10, q, Seed::Os).is_err());
        }
    }

    #[test]
    fn fixed_size() {
        let v = fixed_size_sample(1000, 100, Seed::Fixed(1)).unwrap();
        assert_eq!(v.len(), 100);
        assert!(v.windows(2).all(|w| w[0] < w[1]) && v[99] < 1000);
        assert!(fixed_size_sample(3, 4, Seed::Os).is_err());
        assert_eq!(fixed_size_sample(3, 3, Seed::Os).unwrap(), vec![0, 1, 2]);
    }
}
