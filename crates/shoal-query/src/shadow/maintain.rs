//! Maintenance: one task per collection applying the change streams to every analytics
//! partition (one blocking round each, in parallel) and checkpointing when due.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use shoal_storage::{follow, ChangeConsumer, ChangesError, FollowLimits, PartitionBatch, PartitionId, SeqNo, StreamPosition};
use tokio::sync::watch;

use crate::rows::ParsedDoc;

use super::{Ap, Shadow, ShadowError, ShadowManager, APPLY_BATCH, CHECKPOINT_INTERVAL, IDLE_POLL, QUIET_CHECKPOINT, ROUND_CHANGES_MAX};

impl Shadow {
    /// Applies the news of analytics partition `i`; checkpoints when due. True if
    /// anything was applied.
    pub(super) fn round(&self, i: usize) -> Result<bool, ShadowError> {
        let ap = &self.aps[i];
        let cursors = ap.state.lock().cursors.clone();
        let now = self.coll.positions();
        let held = self.coll.held_here();
        let mut feed = ApFeed { shadow: self, ap, moved: false };
        let mut budget = ROUND_CHANGES_MAX;
        for (p, from) in &cursors {
            if self.incoming.contains(*p) {
                // Being copied in: its rows come with the copy (`transfer`).
                continue;
            }
            if !held.get(usize::from(*p)).copied().unwrap_or(false) {
                // Left this node (or is being copied in anew): its rows go, so that they
                // neither leak nor count.
                if from.seqno > 0 {
                    let mut st = ap.state.lock();
                    st.reset_partition(*p);
                    st.dirty = true;
                    self.applied[usize::from(*p)].store(0, Ordering::Release);
                    tracing::info!(collection = %self.coll.name(), partition = p, "analytics rows of a partition no longer on this node dropped");
                }
                continue;
            }
            if budget == 0 {
                break;
            }
            // Caught up: at the high seqno, on the copy's history (a copy rolled back below
            // the cursor after a failover has a lower high; `follow` finds where they part).
            if now.get(usize::from(*p)).is_some_and(|at| from.reaches(*at)) {
                continue;
            }
            // One storage partition at a time, within what is left of the round's budget.
            let limits =
                FollowLimits { batch_changes: APPLY_BATCH, partition_changes_max: budget, total_changes_max: budget, include_docs: true };
            let handed = follow(&*self.coll, &[*p], limits, &mut feed)?;
            debug_assert!(handed <= budget);
            budget = budget.saturating_sub(handed);
        }
        let moved = feed.moved;
        let mut st = ap.state.lock();
        let quiet = !moved && st.last_change.elapsed() >= QUIET_CHECKPOINT;
        if st.dirty && (quiet || st.last_checkpoint.elapsed() >= CHECKPOINT_INTERVAL) {
            st.checkpoint(&ap.dir, self.aps.len())?;
        }
        Ok(moved)
    }
}

/// One analytics partition as a consumer of the change streams that feed it: its
/// positions are its cursors, and a batch lands in its state, cursors included, under one
/// hold of its lock (a checkpoint then writes both to disk together).
struct ApFeed<'a> {
    shadow: &'a Shadow,
    ap: &'a Ap,
    /// Whether any change was applied.
    moved: bool,
}

impl ChangeConsumer for ApFeed<'_> {
    type Error = ShadowError;

    fn position(&self, p: PartitionId) -> StreamPosition {
        self.ap.state.lock().cursor(p)
    }

    /// Forgets every row of the partition; it is read again from the start.
    fn rollback(&mut self, p: PartitionId, _shared: SeqNo) -> Result<(), ShadowError> {
        self.ap.state.lock().reset_partition(p);
        Ok(())
    }

    fn apply(&mut self, batch: &[PartitionBatch]) -> Result<(), ShadowError> {
        for part in batch {
            let newest_cas = part.changes.last().map(|c| c.cas);
            // Parse outside the lock: scans of this partition are not held up.
            let parsed: Vec<(String, Option<ParsedDoc<'_>>)> = part
                .changes
                .iter()
                .map(|c| {
                    let key = String::from_utf8_lossy(&c.key).into_owned();
                    (key, (!c.deleted).then(|| c.value.as_deref().map(ParsedDoc::parse).unwrap_or_default()))
                })
                .collect();
            {
                let mut st = self.ap.state.lock();
                for (key, doc) in parsed {
                    match doc {
                        Some(doc) => st.upsert(key, doc, &self.ap.dir)?,
                        None => st.remove(&key),
                    }
                }
                if st.cursor(part.partition) != part.position {
                    st.set_cursor(part.partition, part.position);
                    st.dirty = true;
                    st.last_change = Instant::now();
                }
            }
            self.shadow.applied[usize::from(part.partition)].store(part.position.seqno, Ordering::Release);
            metrics::counter!("shoal_analytics_changes_applied_total").increment(part.changes.len() as u64);
            if let Some(cas) = newest_cas {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
                let lag = now.saturating_sub(cas);
                metrics::histogram!("shoal_analytics_lag_seconds").record(lag as f64 / 1e9);
                self.moved = true;
            }
        }
        Ok(())
    }
}

/// One collection's maintainer: a round on every analytics partition in parallel while
/// there is news, then waits for a change or the idle poll (checkpoints come due).
pub(super) async fn maintain(mgr: Arc<ShadowManager>, shadow: Arc<Shadow>, mut stop: watch::Receiver<bool>) {
    let mut changed = shadow.coll.changed();
    let _running = mgr.health.running();
    loop {
        if *stop.borrow() {
            return;
        }
        if shadow.coll.is_dropped() {
            mgr.shadows.lock().remove(&shadow.coll.id());
            let s = Arc::clone(&shadow);
            let _ = tokio::task::spawn_blocking(move || s.remove_files()).await;
            return;
        }
        if mgr.is_held(shadow.coll.id()) {
            tokio::select! {
                _ = tokio::time::sleep(IDLE_POLL) => {}
                _ = stop.changed() => {}
            }
            continue;
        }
        changed.borrow_and_update();
        let rounds: Vec<_> = (0..shadow.aps.len())
            .map(|i| {
                let s = Arc::clone(&shadow);
                tokio::task::spawn_blocking(move || s.round(i))
            })
            .collect();
        let mut moved = false;
        let mut failed = false;
        for r in futures::future::join_all(rounds).await {
            match r {
                Ok(Ok(m)) => moved |= m,
                Ok(Err(ShadowError::Changes(ChangesError::CollectionDropped))) => {}
                Ok(Err(e)) => {
                    tracing::warn!(collection = %shadow.coll.name(), error = %e, "analytics shadow maintenance failed; retrying");
                    mgr.health.round_failed(&format!("collection {}: {e}", shadow.coll.name()));
                    failed = true;
                }
                Err(e) => {
                    tracing::error!(collection = %shadow.coll.name(), error = %e, "analytics shadow maintenance panicked");
                    mgr.health.round_failed(&format!("collection {}: maintenance panicked", shadow.coll.name()));
                    failed = true;
                }
            }
        }
        if !failed {
            mgr.health.round_succeeded();
        }
        shadow.progress.send_modify(|v| *v = v.wrapping_add(1));
        if failed {
            tokio::time::sleep(IDLE_POLL).await;
        } else if !moved {
            tokio::select! {
                r = changed.changed() => if r.is_err() { tokio::time::sleep(IDLE_POLL).await },
                _ = tokio::time::sleep(IDLE_POLL) => {}
                _ = stop.changed() => {}
            }
        }
    }
}
