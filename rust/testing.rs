//! Helpers shared by the unit tests (compiled for tests only).

/// A rayon pool of exactly `threads` threads, for checking that results do not depend on it.
pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a test thread pool")
}
