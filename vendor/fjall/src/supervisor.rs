// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use lsm_tree::SequenceNumberCounter;

use crate::{
    db::Keyspaces,
    flush::manager::FlushManager,
    journal::{manager::JournalManager, Journal},
    snapshot_tracker::SnapshotTracker,
    write_buffer_manager::WriteBufferManager,
};
use std::sync::{Arc, Mutex, RwLock};

pub struct SupervisorInner {
    pub db_config: crate::Config,

    /// Dictionary of all keyspaces
    #[doc(hidden)]
    pub keyspaces: Arc<RwLock<Keyspaces>>,

    pub(crate) write_buffer_size: WriteBufferManager,
    pub(crate) flush_manager: FlushManager,

    pub seqno: SequenceNumberCounter,

    pub snapshot_tracker: SnapshotTracker,

    pub(crate) journal: Arc<Journal>,

    /// Tracks journal size and garbage collects sealed journals when possible
    pub(crate) journal_manager: Arc<RwLock<JournalManager>>,

    pub(crate) backpressure_lock: Mutex<()>,
}

#[derive(Clone)]
pub struct Supervisor(Arc<SupervisorInner>);

impl std::ops::Deref for Supervisor {
    type Target = SupervisorInner;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Supervisor {
    pub fn new(inner: SupervisorInner) -> Self {
        Self(Arc::new(inner))
    }

    pub fn build_seqno_map(
        &self,
        keyspaces: &Keyspaces,
    ) -> Vec<crate::journal::manager::EvictionWatermark> {
        use crate::AbstractTree;

        let mut seqnos = Vec::with_capacity(keyspaces.len());

        for keyspace in keyspaces.values() {
            if let Some(lsn) = keyspace.tree.get_highest_memtable_seqno() {
                seqnos.push(crate::journal::manager::EvictionWatermark {
                    lsn,
                    keyspace: keyspace.clone(),
                });
            }
        }

        seqnos
    }

    /// SHOAL-PATCH: the version GC every rotation runs, for every keyspace (moved here from
    /// `Keyspace::inner_rotate_memtable` so that `Database::release_versions` runs the
    /// same): pulls the snapshot watermark up, then drops each keyspace's tree versions no
    /// snapshot can read any more, and with them the memtables only those versions hold.
    /// A failure for one keyspace is logged and the others go on. Answers how many
    /// versions were dropped.
    pub(crate) fn release_versions(&self) -> usize {
        use crate::AbstractTree;

        // NOTE: If the difference between watermark is too large, and
        // we never opened a snapshot, we need to pull the watermark up
        //
        // https://github.com/fjall-rs/fjall/discussions/85
        self.snapshot_tracker.pullup();
        self.snapshot_tracker.gc();
        let watermark = self.snapshot_tracker.get_seqno_safe_to_gc();

        let mut dropped = 0;
        #[expect(clippy::expect_used)]
        for keyspace in self.keyspaces.read().expect("lock is poisoned").values() {
            if keyspace.tree.version_free_list_len() == 0 {
                continue;
            }
            let mut history = keyspace.tree.get_version_history_lock();
            let before = history.len();
            if let Err(e) = history.maintenance(keyspace.path(), watermark) {
                log::warn!("Version history GC failed for keyspace {:?}: {e:?}", keyspace.name);
            }
            dropped += before - history.len();
        }
        dropped
    }
}
