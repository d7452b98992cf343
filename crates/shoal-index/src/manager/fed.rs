//! Indexes fed by partitions this node does not hold (the index service, issue 41).
//!
//! An index node keeps index partitions whose entries come from every data partition, on
//! whichever node its active copy lives. A [`ChangeFetcher`] fetches what follows the
//! indexes' positions from those actives (the cluster does it over the network); each round
//! then applies what was fetched with the same consumer as local changes
//! ([`shoal_storage::Fetched`] is the change source), so positions are committed with the
//! entries they cover and a partition whose history changed (a failover) is rolled back
//! and read again. There is no key-order build: a new index follows every stream from the
//! start. It is ready once it reaches the highs of its first fetch; `request_plus` waits
//! until the parts it reads reach the actives' positions at the scan's start
//! ([`ChangeFetcher::highs`]: seqno and history), not for replicas and not for other
//! indexes.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use shoal_storage::{follow, Collection, Fetched, FollowLimits, PartitionId, SeqNo, StreamPosition};

use super::{lowest, Index, IndexFeed, IndexManager};
use crate::{IndexError, BATCH_CHANGES};

/// What a [`ChangeFetcher`] answers, later.
pub type FetchFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, IndexError>> + Send + 'a>>;

/// Where an index node gets the change streams of the partitions: their active copies,
/// wherever they live.
pub trait ChangeFetcher: Send + Sync {
    /// What follows each asked `(partition, position)` of `coll`'s streams, waiting up to
    /// `wait` when nothing does. Every asked partition is answered.
    fn fetch<'a>(&'a self, coll: &'a Collection, asks: Vec<(PartitionId, StreamPosition)>, wait: Duration) -> FetchFuture<'a, Fetched>;

    /// Every partition's position at its active now (its high seqno, on its history), in
    /// partition order. An index has everything of a partition once its position
    /// [`reaches`](StreamPosition::reaches) this one: past a failover, the new active's
    /// history differs, and the index must first roll back what the old one lost.
    fn highs<'a>(&'a self, coll: &'a Collection) -> FetchFuture<'a, Vec<StreamPosition>>;

    /// Whether every partition of `coll` is active on this node now (a cluster of one, or
    /// a node that holds every active): its placed indexes then follow its own partitions'
    /// streams as unplaced ones do, key-order build included, with no fetch. `None` while
    /// the fetcher cannot tell (not connected to its cluster yet): placed indexes wait.
    fn all_here(&self, coll: &Collection) -> Option<bool> {
        let _ = coll;
        Some(false)
    }
}

/// How long a fetch that finds nothing new may wait for news.
pub(super) const FETCH_WAIT: Duration = Duration::from_millis(500);

/// One round of a fed collection's indexes: fetch what follows their positions, apply it
/// on the worker pool, and mark ready the indexes that reached the highs of their first
/// fetch. True if any position moved, or if parts were adopted (`adopted` told) while the
/// fetch waited for news: that fetch is given up, nothing of it applied, and the next
/// round asks from the new parts' positions too — rather than the new parts waiting out
/// the actives' quiet (up to [`FETCH_WAIT`]) before they can catch up.
pub(super) async fn fed_round(
    mgr: &Arc<IndexManager>,
    fetcher: &Arc<dyn ChangeFetcher>,
    coll: &Arc<Collection>,
    active: Vec<Arc<Index>>,
    round: Arc<Mutex<()>>,
    adopted: &tokio::sync::Notify,
) -> Result<bool, IndexError> {
    let live: Vec<Arc<Index>> = active.into_iter().filter(|i| !i.dropped.load(Ordering::Acquire)).collect();
    if live.is_empty() {
        return Ok(false);
    }
    let asks: Vec<(PartitionId, StreamPosition)> = (0..coll.partition_count()).map(|p| (p, lowest(&live, p))).collect();
    let before: Vec<StreamPosition> = asks.iter().map(|a| a.1).collect();
    let started = std::time::Instant::now();
    let Some(fetched) = unless_adopted(fetcher.fetch(coll, asks, FETCH_WAIT), adopted).await else { return Ok(true) };
    let fetched = fetched?;
    let fetched_at = started.elapsed();
    let positions = shoal_storage::ChangeSource::positions(&fetched);
    let highs: Vec<SeqNo> = positions.iter().map(|p| p.seqno).collect();
    // A build's target is the highs of its first fetch that answered every partition
    // (unknown until then).
    let answered = fetched.partitions();
    let whole = answered.len() == usize::from(coll.partition_count());
    for index in &live {
        index.seen(answered.iter().map(|&p| (p, positions[usize::from(p)].uuid)));
    }
    for index in live.iter().filter(|_| whole) {
        let mut target = index.target.lock();
        if target.as_ref().is_some_and(Vec::is_empty) {
            *target = Some(highs.clone());
        }
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (m, indexes) = (Arc::clone(mgr), live.clone());
    let partitions = coll.partition_count();
    mgr.pool.spawn(move || {
        let _round = round.lock();
        let limits = FollowLimits {
            batch_changes: BATCH_CHANGES,
            partition_changes_max: usize::MAX,
            total_changes_max: usize::MAX,
            include_docs: true,
        };
        let mut feed = IndexFeed { mgr: &m, active: &indexes, partitions };
        let _ = tx.send(follow(&fetched, &fetched.partitions(), limits, &mut feed));
    });
    rx.await.map_err(|_| IndexError::Invalid("index worker pool stopped".into()))??;
    tracing::debug!(
        fetch_ms = fetched_at.as_millis() as u64,
        apply_ms = started.elapsed().saturating_sub(fetched_at).as_millis() as u64,
        indexes = live.len(),
        "fed round"
    );
    let moved = (0..partitions).any(|p| lowest(&live, p) != before[usize::from(p)]);
    // Parts rebuilt from the streams serve once they reach this fetch's highs.
    if whole {
        for index in &live {
            index.serve_caught_up(&highs);
        }
    }
    for index in &live {
        let done = index.target.lock().as_ref().is_some_and(|t| !t.is_empty() && index.caught_up(t));
        if done {
            *index.target.lock() = None;
            index.bump();
            tracing::info!(index = %index.def.name, "index ready");
        }
    }
    Ok(moved)
}

/// `fetch`'s answer, or `None` once parts are adopted (`adopted` told, or told before and
/// not yet heard) while it is pending: the fetch is dropped unanswered.
async fn unless_adopted<T>(fetch: impl Future<Output = T>, adopted: &tokio::sync::Notify) -> Option<T> {
    tokio::select! {
        biased;
        answer = fetch => Some(answer),
        () = adopted.notified() => None,
    }
}

#[cfg(test)]
mod tests {
    use super::unless_adopted;
    use std::time::Duration;
    use tokio::sync::Notify;

    /// A fetch waiting on quiet actives is given up as soon as parts are adopted (told
    /// before or while it waits), so the new parts catch up by the next round; a fetch
    /// that answers first is taken; one told adoption gives up one fetch, not the next.
    #[tokio::test(start_paused = true)]
    async fn a_fetch_waiting_for_news_is_given_up_when_parts_are_adopted() {
        let adopted = Notify::new();
        let quiet = || async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            "news after the wait"
        };
        // Told while it waits.
        let start = tokio::time::Instant::now();
        let (got, ()) = tokio::join!(unless_adopted(quiet(), &adopted), async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            adopted.notify_one();
        });
        assert_eq!((got, start.elapsed()), (None, Duration::from_millis(30)));
        // Told before it began (between rounds): given up at once.
        adopted.notify_one();
        let start = tokio::time::Instant::now();
        assert_eq!(unless_adopted(quiet(), &adopted).await, None);
        assert_eq!(start.elapsed(), Duration::ZERO);
        // Nothing told: the fetch's own answer, after its wait.
        let start = tokio::time::Instant::now();
        assert_eq!(unless_adopted(quiet(), &adopted).await, Some("news after the wait"));
        assert_eq!(start.elapsed(), Duration::from_millis(500));
        // An answer ready at once is taken even when told.
        adopted.notify_one();
        assert_eq!(unless_adopted(async { "ready" }, &adopted).await, Some("ready"));
    }
}
