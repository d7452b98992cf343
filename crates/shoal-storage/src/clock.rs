//! CAS values: a hybrid logical clock, as Couchbase's CAS is nanoseconds since the epoch.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::Cas;

/// Hands out strictly increasing CAS values that track wall-clock nanoseconds, so a CAS
/// also tells roughly when a change happened (the purger relies on it).
#[derive(Debug, Default)]
pub struct CasClock {
    last: AtomicU64,
}

impl CasClock {
    /// Never hands out a value at or below `floor` (the largest CAS found on disk).
    pub fn observe(&self, floor: Cas) {
        self.last.fetch_max(floor, Ordering::SeqCst);
    }

    pub fn next(&self) -> Cas {
        let now = now_nanos();
        let mut prev = self.last.load(Ordering::Relaxed);
        loop {
            let next = now.max(prev + 1);
            match self.last.compare_exchange_weak(prev, next, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => return next,
                Err(actual) => prev = actual,
            }
        }
    }
}

pub fn now_nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strictly_increasing_even_below_floor_of_clock() {
        let clock = CasClock::default();
        clock.observe(u64::MAX / 2);
        let a = clock.next();
        let b = clock.next();
        assert!(a > u64::MAX / 2);
        assert!(b > a);
    }
}
