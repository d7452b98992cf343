//! The copies' elastic budget: foreground requests first, as measured.
//!
//! Copies run on threads at the idle priority, so a waking request takes the core from them,
//! but only in user space: a copy thread inside a system call (a loopback send that carries
//! the receiver's TCP work, an `O_DIRECT` write, a page-cache read) keeps its core until the
//! call returns on a kernel without full preemption. On 2 shared cores that cost the
//! foreground's p99 3.7–5.3× its value before a swap (bench/results/
//! 2026-11-25-issue14-held-pulls-and-p99.md). No priority fixes that; only doing less of it
//! while requests wait does.
//!
//! So, as CockroachDB's elastic admission control throttles background work by the
//! scheduling latency the foreground sees, a probe thread at the requests' priority sleeps
//! [`PROBE_SLEEP`] again and again while copies run and measures how late it wakes: the wait
//! for a core that a request would have had. [`Budget`] (a pure state machine, tested by
//! tables) turns each window of those lateness samples into the rate copies may move:
//! halved when a window saw a late wake-up, grown again step by step when windows are calm.
//! A source's exports move at the lower of its budget and `rebalance_mb_per_s`; a
//! receiver hands on what arrives at its own budget (its probe sees its own cores).
//!
//! The bench (2 cores shared by 4 nodes and the load, 400 requests/s, 4 paired swaps):
//! unpaced, copies at 314–452 MB/s and the foreground's p99 3.5–7.0× its value before;
//! paced by this budget, 160–231 MB/s and 1.4–2.2× (median 1.8×)
//! (bench/results/2026-11-25-issue14-elastic-budget.md). Measured since: that pace came
//! mostly from the probe's reset of the budget whenever no copy runs for an instant (at
//! every wave of copies), not from late wake-ups, which the probe hardly ever sees; with the
//! budget kept through short pauses copies reach 285–422 MB/s and the p99 2.4–4.5×
//! (bench/results/2026-11-25-issue14-budget-reset.md). Needed: a signal that tracks what
//! requests wait on.
//!
//! Hand-written: no crate measures scheduling latency or runs such a controller.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the probe sleeps between wake-ups.
pub const PROBE_SLEEP: Duration = Duration::from_millis(1);
/// Wake-ups judged together.
pub const PROBE_WINDOW: usize = 20;
/// A wake-up later than this (beyond its sleep) counts as a request kept waiting. On the
/// bench's 2 shared cores, under 0.1 % of wake-ups came this late before a swap and 0.8–0.9 %
/// during an unpaced one; a millisecond is about the foreground's p99 there, the most the target
/// (p99 within 2× during a rebalance) leaves to spend.
pub const LATE_WAKE: Duration = Duration::from_millis(1);
/// The budget never falls below this (MB/s): a busy foreground slows a copy, never stops it.
pub const ELASTIC_MIN_MB_PER_S: f64 = 16.0;
/// The budget never rises above this (MB/s): it is "no limit" in practice on one node.
pub const ELASTIC_MAX_MB_PER_S: f64 = 4_000.0;
/// Each calm window raises the budget by this share of what it is (and at least by the minimum).
const GROWTH: f64 = 0.1;
/// A late window cuts the budget to this share of what it is.
const CUT: f64 = 0.5;
/// With no copy running for this long, the probe thread sleeps (and measures nothing).
const PROBE_IDLE: Duration = Duration::from_millis(100);

/// The rate copies may move at, from windows of wake-up lateness: an AIMD controller.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    mb_per_s: f64,
}

impl Default for Budget {
    /// Starts cautious: a copy on a busy machine does not begin with a burst.
    fn default() -> Budget {
        Budget { mb_per_s: ELASTIC_MIN_MB_PER_S * 4.0 }
    }
}

impl Budget {
    pub fn mb_per_s(&self) -> f64 {
        self.mb_per_s
    }

    /// One window's wake-ups (their lateness beyond the sleep) observed: the new budget.
    pub fn observe(&mut self, lateness: &[Duration]) -> f64 {
        let late = lateness.iter().any(|l| *l > LATE_WAKE);
        self.mb_per_s = if late {
            (self.mb_per_s * CUT).max(ELASTIC_MIN_MB_PER_S)
        } else {
            (self.mb_per_s + (self.mb_per_s * GROWTH).max(ELASTIC_MIN_MB_PER_S)).min(ELASTIC_MAX_MB_PER_S)
        };
        debug_assert!((ELASTIC_MIN_MB_PER_S..=ELASTIC_MAX_MB_PER_S).contains(&self.mb_per_s));
        self.mb_per_s
    }
}

/// A node's elastic budget as the copies read it, and the probe that keeps it.
#[derive(Debug)]
pub struct Elastic {
    /// The budget in bytes per second (an `f64`'s bits would do; whole bytes are plenty).
    bytes_per_s: AtomicU64,
    /// Copies running on this node (as source or receiver): the probe runs while any do.
    running: AtomicUsize,
    /// Off: copies move as fast as they can (`serve --copy-unpaced`, for the benchmark's
    /// comparison).
    off: bool,
}

impl Default for Elastic {
    fn default() -> Elastic {
        Elastic { bytes_per_s: AtomicU64::new(to_bytes(Budget::default().mb_per_s())), running: AtomicUsize::new(0), off: false }
    }
}

fn to_bytes(mb_per_s: f64) -> u64 {
    (mb_per_s * 1_000_000.0) as u64
}

impl Elastic {
    /// No budget: copies move as fast as they can, with no probe.
    pub fn off() -> Arc<Elastic> {
        Arc::new(Elastic { off: true, ..Elastic::default() })
    }

    /// The budget now, in MB/s; `None` when it is off.
    pub fn limit(&self) -> Option<f64> {
        (!self.off).then(|| self.bytes_per_s.load(Ordering::Relaxed) as f64 / 1_000_000.0)
    }

    /// A budget kept by its probe thread, which ends when the budget is dropped. Call it on
    /// a thread at the requests' priority: a thread inherits its creator's scheduling policy,
    /// and a probe started from an idle copy thread woke late whenever anything ran (a
    /// source's budget then sat at its floor).
    pub fn start() -> Arc<Elastic> {
        let elastic = Arc::new(Elastic::default());
        let weak = Arc::downgrade(&elastic);
        let spawned = std::thread::Builder::new().name("shoal-probe".into()).spawn(move || probe(weak));
        if let Err(e) = spawned {
            // Without the probe the budget stays where it starts: copies still run.
            tracing::warn!(error = %e, "cannot start the copies' latency probe");
        }
        elastic
    }

    /// A copy starts: the probe measures until the guard, and every other, is dropped.
    pub fn copying(self: &Arc<Self>) -> CopyGuard {
        self.running.fetch_add(1, Ordering::Relaxed);
        CopyGuard(Arc::clone(self))
    }
}

/// Held while a copy runs (see [`Elastic::copying`]).
#[derive(Debug)]
pub struct CopyGuard(Arc<Elastic>);

impl Drop for CopyGuard {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The probe: at the requests' priority, it sleeps and measures how late it wakes, a window
/// at a time, while copies run; it ends with its node.
fn probe(elastic: std::sync::Weak<Elastic>) {
    let mut budget = Budget::default();
    let mut window = Vec::with_capacity(PROBE_WINDOW);
    loop {
        let Some(e) = elastic.upgrade() else { return };
        if e.running.load(Ordering::Relaxed) == 0 {
            // A later copy starts cautious again: the budget the copies read, too (it kept
            // the last copy's rate before, at 4,000 MB/s after a calm one).
            budget = Budget::default();
            e.bytes_per_s.store(to_bytes(budget.mb_per_s()), Ordering::Relaxed);
            drop(e);
            window.clear();
            std::thread::sleep(PROBE_IDLE);
            continue;
        }
        let asleep = Instant::now();
        std::thread::sleep(PROBE_SLEEP);
        let late = asleep.elapsed().saturating_sub(PROBE_SLEEP);
        if late > LATE_WAKE {
            metrics::counter!("shoal_rebalance_probe_late_total").increment(1);
        }
        window.push(late);
        if window.len() == PROBE_WINDOW {
            let mb_per_s = budget.observe(&window);
            e.bytes_per_s.store(to_bytes(mb_per_s), Ordering::Relaxed);
            metrics::gauge!("shoal_rebalance_elastic_mb_per_s").set(mb_per_s);
            window.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALM: Duration = Duration::from_micros(60);
    const LATE: Duration = Duration::from_millis(2);

    #[test]
    fn the_budget_halves_on_a_late_window_and_grows_on_calm_ones() {
        // (budget before, one window's lateness, budget after)
        let table: &[(f64, &[Duration], f64)] = &[
            (400.0, &[CALM, CALM], 440.0),
            (400.0, &[CALM, LATE], 200.0),
            (100.0, &[CALM], 116.0),
            (20.0, &[LATE], ELASTIC_MIN_MB_PER_S),
            (ELASTIC_MAX_MB_PER_S, &[CALM], ELASTIC_MAX_MB_PER_S),
            (400.0, &[LATE_WAKE], 440.0),
            (400.0, &[], 440.0),
        ];
        for (before, window, after) in table {
            let mut b = Budget { mb_per_s: *before };
            assert_eq!(b.observe(window), *after, "from {before} MB/s after {window:?}");
        }
    }

    #[test]
    fn the_probe_moves_the_budget_only_while_a_copy_runs() {
        let elastic = Elastic::start();
        let start = Budget::default().mb_per_s();
        // Idle: the probe measures nothing, and the budget stays where it starts.
        std::thread::sleep(PROBE_IDLE * 2);
        assert_eq!(elastic.limit(), Some(start));
        let copying = elastic.copying();
        // Its first window either halves the budget or raises it; either way it moves.
        let moved = (0..500).any(|_| {
            std::thread::sleep(PROBE_SLEEP * 10);
            elastic.limit() != Some(start)
        });
        assert!(moved, "the budget never left {start} MB/s while a copy ran");
        drop(copying);
        // With no copy running, the budget goes back to where a copy starts.
        let reset = (0..500).any(|_| {
            std::thread::sleep(PROBE_SLEEP * 10);
            elastic.limit() == Some(start)
        });
        assert!(reset, "the budget stayed at {:?} MB/s after the copy", elastic.limit());
        assert_eq!(Elastic::off().limit(), None, "an unpaced node has no budget");
    }

    #[test]
    fn calm_windows_reach_the_top_and_late_ones_the_floor() {
        let mut b = Budget::default();
        for _ in 0..200 {
            b.observe(&[CALM; PROBE_WINDOW]);
        }
        assert_eq!(b.mb_per_s(), ELASTIC_MAX_MB_PER_S);
        for _ in 0..40 {
            b.observe(&[LATE]);
        }
        assert_eq!(b.mb_per_s(), ELASTIC_MIN_MB_PER_S);
    }
}
