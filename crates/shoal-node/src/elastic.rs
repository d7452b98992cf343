//! The copies' elastic budget: foreground requests first, as measured.
//!
//! Copies run on threads at the idle priority, so a waking request takes the core from them,
//! but only in user space: a copy thread inside a system call (a loopback send that carries
//! the receiver's TCP work, an `O_DIRECT` write, a socket read) keeps its core until the
//! call returns on a kernel without full preemption. On 2 shared cores that cost the
//! foreground's p99 3.7–5.3× its value before a swap (bench/results/
//! 2026-11-25-issue14-held-pulls-and-p99.md). No priority fixes that; only doing less of it
//! while requests wait does.
//!
//! So, as CockroachDB's elastic admission control throttles background work by the
//! scheduling latency the foreground sees, a probe thread at the requests' priority sleeps
//! [`PROBE_SLEEP`] again and again while copies run and measures how late it wakes: the wait
//! for a core that a request would have had. [`Budget`] (a pure state machine, tested by
//! tables) turns each window of those samples into the rate copies may move: halved when
//! [`LATE_TO_CUT`] wake-ups of a window came later than the bar (at most [`LATE_WAKE`]; lower
//! on a machine that was calm before the copies, [`Baseline`]), grown step by step
//! when at most [`CALM_LATE`] did, held between. A source's exports move at the lower of its
//! budget and `rebalance_mb_per_s`; a receiver hands on what arrives at its own budget (its
//! probe sees its own cores).
//!
//! The signal is the share of wake-ups a quarter of a millisecond late, not the rare one a
//! whole millisecond late: a request crosses several threads (client, the node it asks, the
//! active, a replica), so many small waits add up to its p99. Measured beside a swap by a
//! probe outside the nodes (bench/results/2026-11-25-issue14-sendfile.md): over 250 µs
//! late, 1.5 % of wake-ups before it, 6 % during a paced one (p99 1.8×) and 10 % during an
//! unpaced one (4.1×); over 1 ms, 0.1 %, 0.3 % and 1.1 %. The budget also outlives pauses
//! between copies shorter than [`BUDGET_KEPT`]: it used to go back to its start whenever no
//! copy ran for an instant (at every wave of copies), and that, not the probe, held copies
//! near 190 MB/s (bench/results/2026-11-25-issue14-budget-reset.md). With both, and the
//! sources sending with `sendfile`, swaps moved 1.37× faster at the same p99 ratio (median
//! 1.85×, four pairs, same results file).
//!
//! Hand-written: no crate measures scheduling latency or runs such a controller.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the probe sleeps between wake-ups.
pub const PROBE_SLEEP: Duration = Duration::from_millis(1);
/// Wake-ups judged together.
pub const PROBE_WINDOW: usize = 20;
/// A wake-up later than this (beyond its sleep) counts as late on a busy machine: a core was
/// not there when a request would have wanted it (see the module's doc for the shares
/// measured). The most the bar ever is; on a calmer machine it is lower ([`Baseline`]).
pub const LATE_WAKE: Duration = Duration::from_micros(250);
/// The lowest the bar for a late wake-up goes, however calm the machine was before the
/// copies: a thread's timer slack alone (50 µs by default) makes wake-ups this late.
pub const LATE_WAKE_MIN: Duration = Duration::from_micros(100);
/// Wake-ups measured while no copy runs that set the bar: the last few seconds before a copy.
pub const BASELINE_SAMPLES: usize = 400;
/// Fewer samples than this (a node just started) and the bar is [`LATE_WAKE`].
pub const BASELINE_MIN_SAMPLES: usize = 100;
/// The bar is this quantile of the wake-ups before the copies. If copies changed nothing, 3
/// of a window of 20 ([`LATE_TO_CUT`]) would pass it once in about 50 windows. On a calm
/// machine (quantiles 50/90/95/98.5 %: about 67/100/120–145/170–200 µs), a remove moved
/// 123–147 MB/s with the p99 1.7–2.1× its value before at this quantile; 72–101 MB/s at
/// 1.3–1.5× at the 95th; 346 MB/s at 4.1× at the 98.5th
/// (bench/results/2026-11-25-issue14-relative-bar.md).
const BASELINE_QUANTILE: f64 = 0.97;
/// A window with at least this many late wake-ups halves the budget. Before a swap, 1.5 %
/// of wake-ups are late: 3 of a window of 20 then come once in 300 windows.
pub const LATE_TO_CUT: usize = 3;
/// A window with at most this many late wake-ups grows the budget (between the two, it holds).
pub const CALM_LATE: usize = 1;
/// The budget never falls below this (MB/s): a busy foreground slows a copy, never stops it.
pub const ELASTIC_MIN_MB_PER_S: f64 = 16.0;
/// The budget never rises above this (MB/s): it is "no limit" in practice on one node.
pub const ELASTIC_MAX_MB_PER_S: f64 = 4_000.0;
/// Each calm window raises the budget by this share of what it is (and at least by the minimum).
const GROWTH: f64 = 0.1;
/// A late window cuts the budget to this share of what it is.
const CUT: f64 = 0.5;
/// With no copy running, the probe thread sleeps this long between looks (each a measured
/// [`PROBE_SLEEP`] for the [`Baseline`] once the budget is reset); [`PROBE_IDLE_STEP`] until
/// then.
const PROBE_IDLE: Duration = Duration::from_millis(20);
/// How often an idle probe looks for a new copy while it still keeps the budget.
const PROBE_IDLE_STEP: Duration = Duration::from_millis(5);
/// A copy that starts within this of the last one's end goes on at the budget reached; after
/// it, the budget goes back to where a copy starts. Copies come one partition after another:
/// the budget used to go back to its start (64 MB/s) whenever no copy ran for an instant —
/// at every wave of a rebalance's copies, which all end together — so the copies spent most
/// of their time climbing back from it (the gauge, polled during a swap: 80–1,184 MB/s,
/// with next to no late wake-ups).
pub const BUDGET_KEPT: Duration = Duration::from_secs(1);

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

    /// No copy has run for `idle`: the budget a copy starting now gets (see [`BUDGET_KEPT`]).
    pub fn after_idle(&self, idle: Duration) -> Budget {
        if idle >= BUDGET_KEPT {
            Budget::default()
        } else {
            self.clone()
        }
    }

    /// One window's wake-ups (their lateness beyond the sleep) observed, each late past `bar`
    /// ([`Baseline::bar`]): the new budget.
    pub fn observe(&mut self, lateness: &[Duration], bar: Duration) -> f64 {
        let late = lateness.iter().filter(|l| **l > bar).count();
        if late >= LATE_TO_CUT {
            self.mb_per_s = (self.mb_per_s * CUT).max(ELASTIC_MIN_MB_PER_S);
        } else if late <= CALM_LATE {
            self.mb_per_s = (self.mb_per_s + (self.mb_per_s * GROWTH).max(ELASTIC_MIN_MB_PER_S)).min(ELASTIC_MAX_MB_PER_S);
        }
        debug_assert!((ELASTIC_MIN_MB_PER_S..=ELASTIC_MAX_MB_PER_S).contains(&self.mb_per_s));
        self.mb_per_s
    }
}

/// How late the probe woke while no copy ran, which sets the bar for a late wake-up during
/// copies: the target is the foreground's p99 against its value before a rebalance, so the
/// signal is lateness against lateness before.
///
/// A fixed bar of 250 µs suited a busy machine (1.5 % of wake-ups over it before a swap) but
/// not a calm one: there, with the foreground's p99 at 0.6–0.8 ms before, removes moved at
/// 360–410 MB/s with a p99 3.4–5.5× (copies added a few hundred µs per hop, under the bar),
/// and with a bar of 120 µs at 110–150 MB/s within 2×
/// (bench/results/2026-11-25-issue14-relative-bar.md).
#[derive(Debug, Clone, Default)]
pub struct Baseline {
    /// The last [`BASELINE_SAMPLES`] wake-ups' lateness, oldest first.
    samples: std::collections::VecDeque<Duration>,
}

impl Baseline {
    pub fn add(&mut self, lateness: Duration) {
        if self.samples.len() == BASELINE_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(lateness);
    }

    /// The bar: the [`BASELINE_QUANTILE`] of the samples, within
    /// [`LATE_WAKE_MIN`]..=[`LATE_WAKE`]; [`LATE_WAKE`] with too few samples.
    pub fn bar(&self) -> Duration {
        if self.samples.len() < BASELINE_MIN_SAMPLES {
            return LATE_WAKE;
        }
        let mut sorted: Vec<Duration> = self.samples.iter().copied().collect();
        sorted.sort_unstable();
        let at = ((sorted.len() as f64 * BASELINE_QUANTILE) as usize).min(sorted.len() - 1);
        sorted[at].clamp(LATE_WAKE_MIN, LATE_WAKE)
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
    let mut idle_since: Option<Instant> = None;
    let mut baseline = Baseline::default();
    // The bar of the copies under way, set when the first of them starts.
    let mut bar = LATE_WAKE;
    loop {
        let Some(e) = elastic.upgrade() else { return };
        if e.running.load(Ordering::Relaxed) == 0 {
            // The budget reached is kept through a short pause; after `BUDGET_KEPT` a later
            // rebalance's copies start cautious again, the budget the copies read too (a
            // kept budget could sit at 4,000 MB/s after a calm copy).
            let idle = idle_since.get_or_insert_with(Instant::now).elapsed();
            let kept = budget != Budget::default();
            budget = budget.after_idle(idle);
            e.bytes_per_s.store(to_bytes(budget.mb_per_s()), Ordering::Relaxed);
            drop(e);
            window.clear();
            if kept {
                std::thread::sleep(PROBE_IDLE_STEP);
            } else {
                // Long enough after the last copy for the machine to be itself again.
                baseline.add(sleep_lateness());
                std::thread::sleep(PROBE_IDLE);
            }
            continue;
        }
        if idle_since.take().is_some_and(|idle| idle.elapsed() >= BUDGET_KEPT) {
            bar = baseline.bar();
            metrics::gauge!("shoal_rebalance_probe_bar_us").set(bar.as_secs_f64() * 1e6);
            tracing::info!(bar_us = bar.as_micros() as u64, "copies start; a wake-up later than the bar is late");
        }
        let late = sleep_lateness();
        if late > bar {
            metrics::counter!("shoal_rebalance_probe_late_total").increment(1);
        }
        window.push(late);
        if window.len() == PROBE_WINDOW {
            let mb_per_s = budget.observe(&window, bar);
            e.bytes_per_s.store(to_bytes(mb_per_s), Ordering::Relaxed);
            metrics::gauge!("shoal_rebalance_elastic_mb_per_s").set(mb_per_s);
            window.clear();
        }
    }
}

/// Sleeps [`PROBE_SLEEP`]; how much later than that it woke.
fn sleep_lateness() -> Duration {
    let asleep = Instant::now();
    std::thread::sleep(PROBE_SLEEP);
    asleep.elapsed().saturating_sub(PROBE_SLEEP)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALM: Duration = Duration::from_micros(60);
    const LATE: Duration = Duration::from_millis(2);

    #[test]
    fn the_budget_halves_on_a_late_window_grows_on_a_calm_one_and_holds_between() {
        const ONE_LATE: &[Duration] = &[CALM, LATE, CALM];
        const TWO_LATE: &[Duration] = &[LATE, CALM, LATE];
        const THREE_LATE: &[Duration] = &[LATE, LATE, CALM, LATE];
        // (budget before, one window's lateness, budget after)
        let table: &[(f64, &[Duration], f64)] = &[
            (400.0, &[CALM, CALM], 440.0),
            (400.0, ONE_LATE, 440.0),
            (400.0, TWO_LATE, 400.0),
            (400.0, THREE_LATE, 200.0),
            (100.0, &[CALM], 116.0),
            (20.0, THREE_LATE, ELASTIC_MIN_MB_PER_S),
            (ELASTIC_MAX_MB_PER_S, &[CALM], ELASTIC_MAX_MB_PER_S),
            // Exactly `LATE_WAKE` late is not late.
            (400.0, &[LATE_WAKE, LATE_WAKE, LATE_WAKE], 440.0),
            (400.0, &[], 440.0),
        ];
        for (before, window, after) in table {
            let mut b = Budget { mb_per_s: *before };
            assert_eq!(b.observe(window, LATE_WAKE), *after, "from {before} MB/s after {window:?}");
        }
    }

    #[test]
    fn a_wake_up_is_late_against_the_bar_it_is_given() {
        // The same window: calm against the busy machine's bar, late against a calm one's.
        let window = [Duration::from_micros(180); 3];
        let mut b = Budget { mb_per_s: 400.0 };
        assert_eq!(b.observe(&window, LATE_WAKE), 440.0);
        assert_eq!(b.observe(&window, LATE_WAKE_MIN), 220.0);
    }

    #[test]
    fn the_bar_is_a_high_quantile_of_the_wake_ups_before_within_its_bounds() {
        let us = Duration::from_micros;
        // (samples: (lateness µs, how many), the bar)
        let table: &[(&[(u64, usize)], Duration)] = &[
            // Too few to judge by: the busy machine's bar.
            (&[(10, BASELINE_MIN_SAMPLES - 1)], LATE_WAKE),
            // Calm: never below the floor.
            (&[(10, BASELINE_MIN_SAMPLES)], LATE_WAKE_MIN),
            // 5 % of them at 150 µs: the 97th percentile is 150 µs.
            (&[(60, 380), (150, 20)], us(150)),
            // 2 % at 150 µs: past the quantile, so the floor.
            (&[(60, 392), (150, 8)], LATE_WAKE_MIN),
            // Busy: never above the fixed bar.
            (&[(60, 300), (900, 100)], LATE_WAKE),
            // Only the last `BASELINE_SAMPLES` count: a busy past is forgotten.
            (&[(900, 1_000), (60, BASELINE_SAMPLES)], LATE_WAKE_MIN),
        ];
        for (samples, bar) in table {
            let mut b = Baseline::default();
            for (late, n) in *samples {
                (0..*n).for_each(|_| b.add(us(*late)));
            }
            assert_eq!(b.bar(), *bar, "{samples:?}");
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
        // With no copy running for `BUDGET_KEPT`, the budget goes back to where a copy starts.
        let reset = (0..500).any(|_| {
            std::thread::sleep(PROBE_SLEEP * 10);
            elastic.limit() == Some(start)
        });
        assert!(reset, "the budget stayed at {:?} MB/s after the copy", elastic.limit());
        assert_eq!(Elastic::off().limit(), None, "an unpaced node has no budget");
    }

    #[test]
    fn the_budget_outlives_a_short_pause_between_copies_but_not_a_long_one() {
        let reached = Budget { mb_per_s: 900.0 };
        // (idle since the last copy ended, the budget the next copy gets)
        let table = [
            (Duration::ZERO, 900.0),
            (PROBE_IDLE, 900.0),
            (BUDGET_KEPT - Duration::from_millis(1), 900.0),
            (BUDGET_KEPT, Budget::default().mb_per_s()),
            (BUDGET_KEPT * 10, Budget::default().mb_per_s()),
        ];
        for (idle, after) in table {
            assert_eq!(reached.after_idle(idle).mb_per_s(), after, "after {idle:?} idle");
        }
    }

    #[test]
    fn calm_windows_reach_the_top_and_late_ones_the_floor() {
        let mut b = Budget::default();
        for _ in 0..200 {
            b.observe(&[CALM; PROBE_WINDOW], LATE_WAKE_MIN);
        }
        assert_eq!(b.mb_per_s(), ELASTIC_MAX_MB_PER_S);
        for _ in 0..40 {
            b.observe(&[LATE; LATE_TO_CUT], LATE_WAKE);
        }
        assert_eq!(b.mb_per_s(), ELASTIC_MIN_MB_PER_S);
    }
}
