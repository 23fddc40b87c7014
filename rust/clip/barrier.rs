//! A spin barrier for the threads of one `rayon::broadcast` (the owned-columns clip path).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// A barrier for the threads of one `rayon::broadcast`. They spin (the wait is a few µs), and a
/// thread that panicked poisons it so that the others leave instead of waiting for ever.
pub(super) struct SpinBarrier {
    arrived: AtomicUsize,
    generation: AtomicUsize,
    poisoned: AtomicBool,
    threads: usize,
}

impl SpinBarrier {
    /// Marks a thread's panic, so that the others leave their wait.
    pub(super) fn poison(&self) {
        self.poisoned.store(true, Ordering::Relaxed);
    }

    pub(super) fn new(threads: usize) -> Self {
        SpinBarrier {
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            threads,
        }
    }

    /// False when another thread panicked.
    pub(super) fn wait(&self) -> bool {
        let g = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.store(g + 1, Ordering::Release);
        } else {
            let mut spins = 0u32;
            while self.generation.load(Ordering::Acquire) == g {
                if self.poisoned.load(Ordering::Relaxed) {
                    return false;
                }
                spins = spins.wrapping_add(1);
                if spins % 1024 == 0 {
                    // More threads than cores (or a descheduled one): let the others run.
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        !self.poisoned.load(Ordering::Relaxed)
    }
}
