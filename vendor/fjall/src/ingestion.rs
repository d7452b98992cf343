// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use crate::{worker_pool::WorkerMessage, Keyspace};
use lsm_tree::{AnyIngestion, UserKey, UserValue};

pub struct Ingestion<'a> {
    keyspace: &'a Keyspace,
    inner: AnyIngestion<'a>,
}

impl<'a> Ingestion<'a> {
    pub fn new(keyspace: &'a Keyspace) -> crate::Result<Self> {
        let inner = keyspace.tree.ingestion()?;
        Ok(Self { keyspace, inner })
    }

    pub fn write<K: Into<UserKey>, V: Into<UserValue>>(
        &mut self,
        key: K,
        value: V,
    ) -> crate::Result<()> {
        self.inner.write(key, value).map_err(Into::into)
    }

    pub fn write_tombstone<K: Into<UserKey>>(&mut self, key: K) -> crate::Result<()> {
        self.inner.write_tombstone(key).map_err(Into::into)
    }

    #[doc(hidden)]
    pub fn write_weak_tombstone<K: Into<UserKey>>(&mut self, key: K) -> crate::Result<()> {
        self.inner.write_weak_tombstone(key).map_err(Into::into)
    }

    pub fn finish(mut self) -> crate::Result<()> {
        // SHOAL-PATCH: the ingest's files are written and fsynced before the journal lock
        // is taken; only their registration (seqno, version) needs it. Upstream writes them
        // under the lock, so every write to every keyspace of the database waits for the
        // ingest's last table and blob files and their fsyncs (vendor/fjall/SHOAL-PATCH.md).
        self.inner.write_files()?;

        // NOTE: We hold to avoid a race condition with concurrent writes:
        //
        // write         ingest
        // lock journal
        // |
        // next seqno=1
        // |
        // --------------finish
        //                 flush
        //                 seqno=2
        //                 register
        //                 |
        // -----------------
        // |
        // insert seqno=1
        let journal_lock = self.keyspace.supervisor.journal.get_writer()?;

        // SHOAL-PATCH: registered under the lock; the new version is made durable (its
        // fsyncs) after the lock is released (vendor/fjall/SHOAL-PATCH.md).
        let registered = self.inner.finish_registered();
        drop(journal_lock);

        registered
            .and_then(|deferred| deferred.map_or(Ok(()), lsm_tree::DeferredVersion::publish))
            .inspect(|()| {
                self.keyspace
                    .worker_messager
                    .try_send(WorkerMessage::Compact(self.keyspace.clone()))
                    .ok();

                self.keyspace.supervisor.snapshot_tracker.gc();
            })
            .map_err(Into::into)
    }
}
