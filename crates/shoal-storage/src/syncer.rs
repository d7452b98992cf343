//! Group commit for `persist` writes: one fsync thread per database; every writer waiting
//! for durability is released by the first fsync that began after its write was committed,
//! so concurrent `persist` writes share fsyncs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use tokio::sync::watch;

use crate::error::WriteError;
use crate::health::StorageHealth;

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
                    self.synced.send_modify(|s| *s = (*s).max(target));
                }
                Err(err) => {
                    // The node goes read-only: see `health` for why nothing written after a
                    // failed fsync is acknowledged again.
                    self.health.fail(format!("fsync of the journal failed: {err}"));
                    self.failed.store(true, Ordering::SeqCst);
                    self.synced.send_replace(u64::MAX);
                    return;
                }
            }
        }
    }
}
