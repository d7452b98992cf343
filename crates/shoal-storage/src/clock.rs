//! Time and ids as the store sees them, and CAS values: a hybrid logical clock, as
//! Couchbase's CAS is nanoseconds since the epoch.
//!
//! Wall-clock time and fresh history UUIDs come from sources given in
//! [`crate::StoreConfig`], so that a test (or a simulation) can drive time — expire
//! documents, age tombstones — and replay ids, without sleeping.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::Cas;

/// Where the store reads wall-clock time.
pub trait TimeSource: Send + Sync + fmt::Debug {
    /// Nanoseconds since the Unix epoch.
    fn now_nanos(&self) -> u64;
}

/// The system's clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl TimeSource for SystemClock {
    fn now_nanos(&self) -> u64 {
        now_nanos()
    }
}

/// A clock that moves only when told to: for tests and simulations.
#[derive(Debug)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock standing at `unix_secs`.
    pub fn at(unix_secs: u64) -> Arc<ManualClock> {
        Arc::new(ManualClock { nanos: AtomicU64::new(unix_secs.saturating_mul(NANOS_PER_SEC)) })
    }

    /// Moves the clock forward (never back: CAS values and expiry only make sense forwards).
    pub fn advance(&self, by: std::time::Duration) {
        self.nanos.fetch_add(u64::try_from(by.as_nanos()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }
}

impl TimeSource for ManualClock {
    fn now_nanos(&self) -> u64 {
        self.nanos.load(Ordering::SeqCst)
    }
}

/// Where the store takes a new history UUID (a partition that starts a new history: a
/// fresh partition, a start after a crash, a copy promoted to active).
pub trait IdSource: Send + Sync + fmt::Debug {
    fn history_uuid(&self) -> u64;
}

/// Random version-4 UUIDs (their first 64 bits).
#[derive(Debug, Default, Clone, Copy)]
pub struct RandomIds;

impl IdSource for RandomIds {
    fn history_uuid(&self) -> u64 {
        // 0 means "no history" in stream positions.
        uuid::Uuid::new_v4().as_u64_pair().0.max(1)
    }
}

/// A reproducible sequence of ids from a seed (splitmix64): for tests and simulations.
#[derive(Debug)]
pub struct SeededIds {
    state: AtomicU64,
}

impl SeededIds {
    pub fn new(seed: u64) -> Arc<SeededIds> {
        Arc::new(SeededIds { state: AtomicU64::new(seed) })
    }
}

impl IdSource for SeededIds {
    fn history_uuid(&self) -> u64 {
        let mut z = self.state.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::SeqCst).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)).max(1)
    }
}

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Hands out strictly increasing CAS values that track wall-clock nanoseconds, so a CAS
/// also tells roughly when a change happened (the purger relies on it). It is also the
/// store's one reader of time and of new ids (see the module documentation).
#[derive(Debug)]
pub struct CasClock {
    last: AtomicU64,
    time: Arc<dyn TimeSource>,
    ids: Arc<dyn IdSource>,
}

impl Default for CasClock {
    fn default() -> Self {
        CasClock::new(Arc::new(SystemClock), Arc::new(RandomIds))
    }
}

impl CasClock {
    pub fn new(time: Arc<dyn TimeSource>, ids: Arc<dyn IdSource>) -> Self {
        CasClock { last: AtomicU64::new(0), time, ids }
    }

    /// Wall-clock nanoseconds since the epoch, from the store's time source.
    pub fn now_nanos(&self) -> u64 {
        self.time.now_nanos()
    }

    /// Wall-clock Unix seconds, from the store's time source.
    pub fn unix_secs(&self) -> u64 {
        self.time.now_nanos() / NANOS_PER_SEC
    }

    /// A new history UUID, from the store's id source.
    pub fn history_uuid(&self) -> u64 {
        self.ids.history_uuid()
    }

    /// Never hands out a value at or below `floor` (the largest CAS found on disk).
    pub fn observe(&self, floor: Cas) {
        self.last.fetch_max(floor, Ordering::SeqCst);
    }

    pub fn next(&self) -> Cas {
        let now = self.time.now_nanos();
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

/// The system's wall clock in nanoseconds since the epoch (0 if it stands before it).
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

    #[test]
    fn a_manual_clock_drives_cas_and_seconds() {
        let time = ManualClock::at(1_000);
        let clock = CasClock::new(time.clone(), SeededIds::new(7));
        assert_eq!(clock.unix_secs(), 1_000);
        let a = clock.next();
        assert_eq!(a, 1_000 * NANOS_PER_SEC);
        // The clock stands still: CAS values still rise.
        assert!(clock.next() > a);
        time.advance(std::time::Duration::from_secs(30));
        assert_eq!(clock.unix_secs(), 1_030);
        assert_eq!(clock.next(), 1_030 * NANOS_PER_SEC);
    }

    #[test]
    fn seeded_ids_repeat_per_seed_and_are_never_zero() {
        let (a, b) = (SeededIds::new(42), SeededIds::new(42));
        let xs: Vec<u64> = (0..100).map(|_| a.history_uuid()).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.history_uuid()).collect();
        assert_eq!(xs, ys);
        assert!(xs.iter().all(|&x| x != 0));
        let distinct: std::collections::BTreeSet<_> = xs.iter().collect();
        assert_eq!(distinct.len(), xs.len());
    }
}
