//! Group commit for `persist` writes: one fsync thread per database; every writer waiting
//! for durability is released by the first fsync that began after its write was committed,
//! so concurrent `persist` writes share fsyncs.
//!
//! The syncer also keeps each partition copy's persisted seqno ([`PersistedSeqno`]): the
//! copy notes `(ticket, seqno)` after each commit, and the fsync that covers the ticket
//! moves the copy's watch to the seqno. It is what majority durability and replica
//! acknowledgements wait on. Only an fsync moves it: a `none` write shows up after the next
//! fsync of its data path, the one some `persist` write (or any awaited
//! [`crate::collection::DurableWait`]) asks for.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use tokio::sync::watch;

use crate::error::WriteError;
use crate::health::StorageHealth;
use crate::SeqNo;

/// Commits of one copy remembered until an fsync covers them. Past this, the newest entry
/// is overwritten by the next commit: the watch then moves at the fsync that covers the
/// newer commit — late for the older one, never early — and the memory of a copy that is
/// written at `none` with no fsync in sight stays bounded.
const PERSIST_PENDING_MAX: usize = 64;

pub struct Syncer {
    db: fjall::Database,
    health: Arc<StorageHealth>,
    /// Number of batches committed to the journal buffer so far.
    committed: AtomicU64,
    /// Largest ticket a writer is waiting for.
    wanted: Mutex<u64>,
    wake: Condvar,
    /// Largest ticket known to be on disk (`u64::MAX` once the syncer failed).
    synced: watch::Sender<u64>,
    failed: AtomicBool,
    stop: AtomicBool,
    /// fsyncs done so far, for metrics.
    pub fsyncs: AtomicU64,
    /// Copies with commits no fsync has covered yet (each at most once).
    watched: Mutex<Vec<Arc<PersistedSeqno>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Syncer {
    pub fn start(db: fjall::Database, health: Arc<StorageHealth>) -> std::io::Result<Arc<Syncer>> {
        let syncer = Arc::new(Syncer {
            db,
            health,
            committed: AtomicU64::new(0),
            wanted: Mutex::new(0),
            wake: Condvar::new(),
            synced: watch::channel(0).0,
            failed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            fsyncs: AtomicU64::new(0),
            watched: Mutex::new(Vec::new()),
            thread: Mutex::new(None),
        });
        let worker = Arc::clone(&syncer);
        let handle = std::thread::Builder::new().name("shoal-fsync".into()).spawn(move || worker.run())?;
        *syncer.thread.lock() = Some(handle);
        Ok(syncer)
    }

    /// Called right after a batch was committed; the ticket names that batch.
    pub fn ticket(&self) -> u64 {
        self.committed.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Waits until the batch behind `ticket` is fsynced.
    pub async fn wait_durable(&self, ticket: u64) -> Result<(), WriteError> {
        let mut rx = self.synced.subscribe();
        if *rx.borrow() < ticket {
            let mut wanted = self.wanted.lock();
            if *wanted < ticket {
                *wanted = ticket;
            }
            self.wake.notify_one();
        }
        let result = rx.wait_for(|synced| *synced >= ticket).await;
        if result.is_err() || self.failed.load(Ordering::SeqCst) {
            return Err(WriteError::NotDurable);
        }
        Ok(())
    }

    /// The ticket known to be on disk, if the syncer has not failed.
    fn synced_ticket(&self) -> Option<u64> {
        let synced = *self.synced.borrow();
        (!self.failed.load(Ordering::SeqCst)).then_some(synced)
    }

    /// Moves every watched copy's persisted seqno to what the fsync up to `ticket` covered.
    fn advance_watched(&self, ticket: u64) {
        let copies = std::mem::take(&mut *self.watched.lock());
        let still: Vec<_> = copies.into_iter().filter(|copy| copy.advance(ticket)).collect();
        self.watched.lock().extend(still);
    }

    /// Stops the fsync thread and waits for it, releasing its handle on the database.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        {
            let _guard = self.wanted.lock();
            self.wake.notify_all();
        }
        if let Some(handle) = self.thread.lock().take() {
            let _ = handle.join();
        }
    }

    fn run(&self) {
        loop {
            {
                let mut wanted = self.wanted.lock();
                while *wanted <= *self.synced.borrow() && !self.stop.load(Ordering::SeqCst) {
                    self.wake.wait(&mut wanted);
                }
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            // Everything committed before this load is covered by the fsync below.
            let target = self.committed.load(Ordering::SeqCst);
            match self.db.persist(fjall::PersistMode::SyncData) {
                Ok(()) => {
                    self.fsyncs.fetch_add(1, Ordering::Relaxed);
                    // The watches first: a `persist` writer released below finds its seqno
                    // in its copy's persisted seqno.
                    self.advance_watched(target);
                    self.synced.send_modify(|s| *s = (*s).max(target));
                }
                Err(err) => {
                    // The node goes read-only: see `health` for why nothing written after a
                    // failed fsync is acknowledged again.
                    self.health.fail(format!("fsync of the journal failed: {err}"));
                    self.failed.store(true, Ordering::SeqCst);
                    self.synced.send_replace(u64::MAX);
                    // Nothing becomes durable any more: the watchers are told (their
                    // channels close) instead of waiting forever.
                    for copy in std::mem::take(&mut *self.watched.lock()) {
                        copy.close();
                    }
                    return;
                }
            }
        }
    }
}

/// Moves a watch forward only: a persisted seqno never goes back within one copy.
fn raise(tx: &watch::Sender<SeqNo>, seqno: SeqNo) {
    tx.send_if_modified(|s| {
        let moved = *s < seqno;
        if moved {
            *s = seqno;
        }
        moved
    });
}

/// A partition copy's persisted seqno: every change of the copy at or below it is fsynced.
/// Its channel closes when the copy is replaced (a rollback, drop, ingest or promotion) or
/// when fsyncs fail: a seqno names a change only within one copy's history.
pub(crate) struct PersistedSeqno {
    inner: Mutex<PersistedInner>,
}

struct PersistedInner {
    /// `None` once closed.
    tx: Option<watch::Sender<SeqNo>>,
    /// `(ticket, seqno)` of commits no fsync has covered yet, both rising.
    pending: VecDeque<(u64, SeqNo)>,
    /// Whether the syncer's list holds this copy.
    registered: bool,
}

impl PersistedSeqno {
    /// A copy whose every change up to `seqno` is already on disk.
    pub(crate) fn new(seqno: SeqNo) -> Arc<PersistedSeqno> {
        let inner = PersistedInner { tx: Some(watch::channel(seqno).0), pending: VecDeque::new(), registered: false };
        Arc::new(PersistedSeqno { inner: Mutex::new(inner) })
    }

    /// A receiver of the persisted seqno; `None` once closed.
    pub(crate) fn subscribe(&self) -> Option<watch::Receiver<SeqNo>> {
        self.inner.lock().tx.as_ref().map(watch::Sender::subscribe)
    }

    /// Notes that the commit behind `ticket` holds the copy's changes up to `seqno`. Call
    /// under the copy's sequencer, after [`Syncer::ticket`].
    pub(crate) fn note(self: &Arc<Self>, syncer: &Syncer, ticket: u64, seqno: SeqNo) {
        let mut inner = self.inner.lock();
        let Some(tx) = &inner.tx else { return };
        // An fsync that already covers the ticket (one that began after this commit).
        if syncer.synced_ticket().is_some_and(|synced| synced >= ticket) {
            raise(tx, seqno);
            return;
        }
        debug_assert!(inner.pending.back().is_none_or(|&(t, s)| t <= ticket && s <= seqno), "commits of a copy rise");
        if inner.pending.len() >= PERSIST_PENDING_MAX {
            inner.pending.pop_back();
        }
        inner.pending.push_back((ticket, seqno));
        if !inner.registered {
            inner.registered = true;
            drop(inner);
            syncer.watched.lock().push(Arc::clone(self));
        } else {
            drop(inner);
        }
        // An fsync that ended between the check above and the registration would leave the
        // commit for the next one: look again.
        if let Some(synced) = syncer.synced_ticket() {
            self.advance(synced);
        }
    }

    /// Takes in an fsync that covered every ticket up to `ticket`. Returns whether commits
    /// are still pending (the syncer keeps the copy on its list).
    fn advance(&self, ticket: u64) -> bool {
        let mut inner = self.inner.lock();
        let mut reached = None;
        while let Some(&(t, seqno)) = inner.pending.front() {
            if t > ticket {
                break;
            }
            reached = Some(seqno);
            inner.pending.pop_front();
        }
        if let (Some(seqno), Some(tx)) = (reached, &inner.tx) {
            raise(tx, seqno);
        }
        let pending = inner.tx.is_some() && !inner.pending.is_empty();
        inner.registered = pending;
        pending
    }

    /// Closes the channel: its receivers see the sender gone.
    pub(crate) fn close(&self) {
        let mut inner = self.inner.lock();
        inner.tx = None;
        inner.pending.clear();
    }
}
