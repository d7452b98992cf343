// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use crate::{db::Keyspaces, keyspace::InternalKeyspaceId, Keyspace};
use byteview::StrView;
use lsm_tree::{AbstractTree, AnyTree, SeqNo, SequenceNumberCounter, UserValue};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

pub fn encode_config_key(keyspace_id: InternalKeyspaceId, name: &str) -> crate::UserKey {
    use byteorder::{WriteBytesExt, BE};
    use std::io::Write;

    #[expect(unsafe_code)]
    let mut key = unsafe {
        crate::UserKey::builder_unzeroed(1 + std::mem::size_of::<InternalKeyspaceId>() + name.len())
    };

    #[expect(
        clippy::unwrap_used,
        reason = "writing into preallocated buffer should not trigger IO or EOF error"
    )]
    {
        let mut writer = &mut key[..];
        writer.write_u8(b'c').unwrap();
        writer.write_u64::<BE>(keyspace_id).unwrap();
        writer.write_all(name.as_bytes()).unwrap();
    }

    key.freeze().into()
}

/// The meta keyspace keeps mappings of keyspace names to their internal IDs and configurations
///
/// The meta keyspace is always keyspace #0.
///
/// The schema looks roughtly like this:
///
/// ```md
/// 'c' + <keyspace_id> + <config_key> -> <serialized config parameter>
/// 'n' + <keyspace_id>                -> <name as UTF-8 bytes>
/// ```
#[derive(Clone)]
pub struct MetaKeyspace {
    /// The actual backing LSM-tree
    ///
    /// We never commit data through the WAL but write tables directly using
    /// lsm-tree's ingestion API.
    inner: AnyTree,

    /// Dictionary of all keyspaces
    #[doc(hidden)]
    pub keyspaces: Arc<RwLock<Keyspaces>>,

    seqno_generator: SequenceNumberCounter,
    visible_seqno: SequenceNumberCounter,

    /// SHOAL-PATCH: serializes keyspace creation and removal, so their file writes, the
    /// meta keyspace's fsynced ingestion and its maintenance run *without* the keyspace
    /// map's write lock (see `create_keyspace`).
    ddl: Arc<Mutex<()>>,

    /// SHOAL-PATCH: keyspaces whose trees exist, waiting for their names and configs in
    /// this keyspace (see `create_keyspace`): whoever holds the DDL lock next writes them
    /// all in one ingestion.
    pending: Arc<Mutex<Vec<PendingCreate>>>,
}

/// SHOAL-PATCH: one keyspace waiting in `MetaKeyspace::pending`, and where its creator
/// finds the outcome when another creator wrote it.
struct PendingCreate {
    keyspace_id: InternalKeyspaceId,
    keyspace: Keyspace,
    done: Arc<Mutex<Option<Result<(), String>>>>,
}

impl MetaKeyspace {
    pub(crate) fn new(
        inner: AnyTree,
        keyspaces: Arc<RwLock<Keyspaces>>,
        seqno_generator: SequenceNumberCounter,
        visible_seqno: SequenceNumberCounter,
    ) -> Self {
        Self {
            inner,
            keyspaces,
            seqno_generator,
            visible_seqno,
            ddl: Arc::default(),
            pending: Arc::default(),
        }
    }

    /// SHOAL-PATCH: held across a keyspace's creation or removal (see `create_keyspace`).
    pub(crate) fn lock_ddl(&self) -> MutexGuard<'_, ()> {
        self.ddl.lock().expect("lock is poisoned")
    }

    #[cfg(test)]
    fn len(&self) -> crate::Result<usize> {
        self.inner.len(SeqNo::MAX, None).map_err(Into::into)
    }

    pub(crate) fn get_kv_for_config(
        &self,
        keyspace_id: InternalKeyspaceId,
        name: &str,
    ) -> crate::Result<Option<UserValue>> {
        let key = encode_config_key(keyspace_id, name);
        self.inner.get(key, SeqNo::MAX).map_err(Into::into)
    }

    fn maintenance(&self) -> crate::Result<()> {
        self.inner
            .compact(
                Arc::new(
                    crate::compaction::Leveled::default()
                        // SHOAL-PATCH: 8, not upstream's 2. Every keyspace created or
                        // removed is one L0 table here; merging them every second one
                        // rewrote the whole meta keyspace (and fsynced it, its folder and a
                        // new version) on every other creation.
                        .with_l0_threshold(8)
                        .with_level_ratio_policy(vec![20.0]),
                ),
                0,
            )
            .map_err(Into::into)
    }

    /// SHOAL-PATCH: records keyspaces whose trees `created` already exist (made outside
    /// the DDL lock by `Database::keyspace` or `Database::keyspaces`) in this keyspace, and
    /// makes them visible in the keyspace map. Creations group-commit: each creator queues
    /// its keyspaces, then takes the DDL lock; the first to get it writes every queued
    /// keyspace's names and configs in one fsynced ingestion (upstream wrote one ingestion,
    /// and ran maintenance, per keyspace, all under the lock), and the others find theirs
    /// written. A creation is durable when this returns, as upstream.
    pub(crate) fn create_keyspaces(&self, created: Vec<(InternalKeyspaceId, Keyspace)>) -> crate::Result<()> {
        if created.is_empty() {
            return Ok(());
        }
        // One outcome for all of this creator's keyspaces: they are queued under one lock,
        // so whoever writes the queue writes them all.
        let done = Arc::new(Mutex::new(None));
        {
            let mut pending = self.pending.lock().expect("lock is poisoned");
            for (keyspace_id, keyspace) in created {
                pending.push(PendingCreate { keyspace_id, keyspace, done: Arc::clone(&done) });
            }
        }

        let _ddl = self.lock_ddl();
        // Written by an earlier holder of the lock (it took the queue after our push).
        if let Some(outcome) = done.lock().expect("lock is poisoned").take() {
            return outcome.map_err(|e| crate::Error::Io(std::io::Error::other(e)));
        }
        let batch = std::mem::take(&mut *self.pending.lock().expect("lock is poisoned"));
        debug_assert!(batch.iter().any(|p| Arc::ptr_eq(&p.done, &done)));
        let outcome = self.write_created(&batch);
        for p in batch.iter().filter(|p| !Arc::ptr_eq(&p.done, &done)) {
            *p.done.lock().expect("lock is poisoned") = Some(outcome.as_ref().map(|()| ()).map_err(|e| format!("{e:?}")));
        }
        outcome
    }

    /// SHOAL-PATCH: the names and configs of `batch` in one ingestion, then each keyspace
    /// in the map. Call with the DDL lock held.
    fn write_created(&self, batch: &[PendingCreate]) -> crate::Result<()> {
        let mut kvs = Vec::new();
        for p in batch {
            kvs.extend(p.keyspace.config.encode_kvs(p.keyspace_id));
            kvs.push({
                let mut key: Vec<u8> = Vec::with_capacity(std::mem::size_of::<InternalKeyspaceId>() + 1);
                key.push(b'n');
                key.extend(p.keyspace_id.to_be_bytes());

                let value = UserValue::new(p.keyspace.name.as_bytes());

                (key.into(), value)
            });
        }

        kvs.sort_by(|(a, _), (b, _)| a.cmp(b));

        let mut ingestion = self.inner.ingestion()?;

        for kv in kvs {
            ingestion.write(kv.0, kv.1)?;
        }

        ingestion.finish()?;

        // SHOAL-PATCH: upstream holds the keyspace map's write lock from before the
        // keyspace's folder is created until after this maintenance. Every batch commit
        // reads that map while it holds the journal writer, so each keyspace creation
        // stalled every write to the database for its fsyncs (10-33 ms measured, per
        // partition a rebalance drops). Callers hold the DDL lock instead, and the map is
        // locked only to insert.
        {
            let mut map = self.keyspaces.write().expect("lock is poisoned");
            for p in batch {
                map.insert(p.keyspace.name.clone(), p.keyspace.clone());
            }
        }

        self.maintenance()
            .inspect_err(|e| {
                log::warn!("Meta keyspace maintenance failed: {e:?}");
            })
            .ok();

        Ok(())
    }

    pub(crate) fn remove_keyspace(&self, name: &str) -> crate::Result<()> {
        // SHOAL-PATCH: as in `create_keyspace`, the DDL lock, not the keyspace map's write
        // lock, is held across the fsynced ingestion; the map is locked only to remove.
        let _ddl = self.lock_ddl();

        let Some(keyspace_id) = self
            .keyspaces
            .read()
            .expect("lock is poisoned")
            .get(name)
            .map(|keyspace| keyspace.id)
        else {
            return Ok(());
        };

        let seqno = self.seqno_generator.next();

        let mut ingestion = self.inner.ingestion()?;
        {
            // Remove all config KVs
            let pfx: Vec<u8> = {
                let mut v = vec![];
                v.push(b'c');
                v.extend(keyspace_id.to_be_bytes());
                v
            };

            for config_kv in self.inner.prefix(pfx, SeqNo::MAX, None) {
                use lsm_tree::Guard;

                let key = config_kv.key()?;
                ingestion.write_tombstone(key)?;
            }

            // Remove ID -> name mapping
            let mut key: Vec<u8> =
                Vec::with_capacity(std::mem::size_of::<InternalKeyspaceId>() + 1);
            key.push(b'n');
            key.extend(keyspace_id.to_be_bytes());
            ingestion.write_tombstone(key)?;
        }
        ingestion.finish()?;

        self.visible_seqno.fetch_max(seqno + 1);

        self.keyspaces.write().expect("lock is poisoned").remove(name);

        self.maintenance()
            .inspect_err(|e| {
                log::warn!("Meta keyspace maintenance failed: {e:?}");
            })
            .ok();

        Ok(())
    }

    pub(crate) fn resolve_id(&self, id: InternalKeyspaceId) -> crate::Result<Option<StrView>> {
        #[expect(unsafe_code, clippy::indexing_slicing)]
        let key = {
            let mut builder = unsafe {
                lsm_tree::Slice::builder_unzeroed(std::mem::size_of::<InternalKeyspaceId>() + 1)
            };
            builder[0] = b'n';
            builder[1..].copy_from_slice(&id.to_be_bytes());
            builder.freeze()
        };

        Ok(self.inner.get(key, SeqNo::MAX)?.map(|v| {
            #[expect(clippy::expect_used, reason = "keyspace open only accepts &str")]
            let name = std::str::from_utf8(&v).expect("should be utf-8");

            name.into()
        }))
    }

    pub(crate) fn keyspace_exists(&self, name: &str) -> bool {
        self.keyspaces
            .read()
            .expect("lock is poisoned")
            .contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Database, Guard, KeyspaceCreateOptions, Readable, SingleWriterTxDatabase};
    use test_log::test;

    const ITEM_COUNT: usize = 10;

    #[test]
    fn meta_keyspace_smoke_test() -> crate::Result<()> {
        use crate::AbstractTree;
        use lsm_tree::SeqNo;

        let folder = tempfile::tempdir()?;

        {
            let db = Database::builder(&folder).open()?;

            assert_eq!(
                None,
                db.meta_keyspace
                    .inner
                    .get(&['n' as u8, 0, 0, 0, 0, 0, 0, 0, 1], SeqNo::MAX)?
                    .as_deref(),
            );

            let _ks = db.keyspace("items", Default::default)?;

            assert_eq!(
                Some(b"items".as_slice()),
                db.meta_keyspace
                    .inner
                    .get(&['n' as u8, 0, 0, 0, 0, 0, 0, 0, 1], SeqNo::MAX)?
                    .as_deref(),
            );
            assert_eq!(
                Some([3u8].as_slice()),
                db.meta_keyspace
                    .inner
                    .get(
                        &[
                            'c' as u8, 0, 0, 0, 0, 0, 0, 0, 1, 'v' as u8, 'e' as u8, 'r' as u8,
                            's' as u8, 'i' as u8, 'o' as u8, 'n' as u8
                        ],
                        SeqNo::MAX
                    )?
                    .as_deref(),
            );
        }

        // Config should still exists after recovery, even without opening the keyspace
        {
            let db = Database::builder(&folder).open()?;

            assert_eq!(
                Some(b"items".as_slice()),
                db.meta_keyspace
                    .inner
                    .get(&['n' as u8, 0, 0, 0, 0, 0, 0, 0, 1], SeqNo::MAX)?
                    .as_deref(),
            );
            assert_eq!(
                Some([3u8].as_slice()),
                db.meta_keyspace
                    .inner
                    .get(
                        &[
                            'c' as u8, 0, 0, 0, 0, 0, 0, 0, 1, 'v' as u8, 'e' as u8, 'r' as u8,
                            's' as u8, 'i' as u8, 'o' as u8, 'n' as u8
                        ],
                        SeqNo::MAX
                    )?
                    .as_deref(),
            );
        }

        Ok(())
    }

    #[test]
    fn keyspace_delete() -> crate::Result<()> {
        let folder = tempfile::tempdir()?;

        let path;

        {
            let db = Database::builder(&folder).open()?;

            assert_eq!(0, db.meta_keyspace.len()?);

            let tree = db.keyspace("default", KeyspaceCreateOptions::default)?;
            path = tree.path().to_path_buf();

            assert!(path.try_exists()?);
            assert!(db.meta_keyspace.len()? > 0);

            for x in 0..ITEM_COUNT as u64 {
                let key = x.to_be_bytes();
                let value = nanoid::nanoid!();
                tree.insert(key, value.as_bytes())?;
            }

            for x in 0..ITEM_COUNT as u64 {
                let key: [u8; 8] = (x + ITEM_COUNT as u64).to_be_bytes();
                let value = nanoid::nanoid!();
                tree.insert(key, value.as_bytes())?;
            }

            assert_eq!(tree.len()?, ITEM_COUNT * 2);
            assert_eq!(tree.iter().flat_map(Guard::key).count(), ITEM_COUNT * 2);
            assert_eq!(
                tree.iter().rev().flat_map(Guard::key).count(),
                ITEM_COUNT * 2,
            );
        }

        for _ in 0..3 {
            let db = Database::builder(&folder).open()?;

            let tree = db.keyspace("default", KeyspaceCreateOptions::default)?;

            assert!(path.try_exists()?);
            assert!(db.meta_keyspace.len()? > 0);

            assert_eq!(tree.len()?, ITEM_COUNT * 2);
            assert_eq!(tree.iter().flat_map(Guard::key).count(), ITEM_COUNT * 2);
            assert_eq!(
                tree.iter().rev().flat_map(Guard::key).count(),
                ITEM_COUNT * 2,
            );
        }

        {
            let db = Database::builder(&folder).open()?;

            let tree = db.keyspace("default", KeyspaceCreateOptions::default)?;
            assert!(path.try_exists()?);
            assert!(db.meta_keyspace.len()? > 0);

            db.delete_keyspace(tree)?;
            assert!(!path.try_exists()?);
            assert_eq!(0, db.meta_keyspace.len()?);
        }

        {
            let db = Database::builder(&folder).open()?;
            assert!(!path.try_exists()?);
            assert_eq!(0, db.meta_keyspace.len()?);
        }

        Ok(())
    }

    #[test]
    fn tx_keyspace_delete() -> crate::Result<()> {
        let folder = tempfile::tempdir()?;

        let path;

        {
            let db = SingleWriterTxDatabase::builder(&folder).open()?;

            let tree = db.keyspace("default", KeyspaceCreateOptions::default)?;
            path = tree.path();

            assert!(path.try_exists()?);

            for x in 0..ITEM_COUNT as u64 {
                let key = x.to_be_bytes();
                let value = nanoid::nanoid!();
                tree.insert(key, value.as_bytes())?;
            }

            for x in 0..ITEM_COUNT as u64 {
                let key: [u8; 8] = (x + ITEM_COUNT as u64).to_be_bytes();
                let value = nanoid::nanoid!();
                tree.insert(key, value.as_bytes())?;
            }

            assert_eq!(db.read_tx().len(&tree)?, ITEM_COUNT * 2);
            assert_eq!(
                db.read_tx().iter(&tree).flat_map(Guard::key).count(),
                ITEM_COUNT * 2,
            );
            assert_eq!(
                db.read_tx().iter(&tree).rev().flat_map(Guard::key).count(),
                ITEM_COUNT * 2,
            );
        }

        for _ in 0..3 {
            let db = SingleWriterTxDatabase::builder(&folder).open()?;

            let tree = db.keyspace("default", KeyspaceCreateOptions::default)?;

            assert_eq!(db.read_tx().len(&tree)?, ITEM_COUNT * 2);
            assert_eq!(
                db.read_tx().iter(&tree).flat_map(Guard::key).count(),
                ITEM_COUNT * 2,
            );
            assert_eq!(
                db.read_tx().iter(&tree).rev().flat_map(Guard::key).count(),
                ITEM_COUNT * 2,
            );

            assert!(path.try_exists()?);
        }

        {
            let db = SingleWriterTxDatabase::builder(&folder).open()?;

            {
                let tree = db.keyspace("default", KeyspaceCreateOptions::default)?;

                assert!(path.try_exists()?);

                db.inner().delete_keyspace(tree.inner().clone())?;
            }

            assert!(!path.try_exists()?);
        }

        {
            let _db = Database::builder(&folder).open()?;
            assert!(!path.try_exists()?);
        }

        Ok(())
    }

    #[test]
    fn keyspace_delete_and_reopening_behavior() -> crate::Result<()> {
        let keyspace_name = "default";
        let folder = tempfile::tempdir()?;

        let keyspace_exists = |id: u64| -> std::io::Result<bool> {
            folder
                .path()
                .join("keyspaces")
                .join(id.to_string())
                .try_exists()
        };

        let db = Database::builder(&folder).open()?;
        assert!(!keyspace_exists(1)?);

        let keyspace = db.keyspace(keyspace_name, KeyspaceCreateOptions::default)?;
        assert!(keyspace_exists(1)?);

        db.delete_keyspace(keyspace)?;
        assert!(!keyspace_exists(1)?);

        assert!(db
            .keyspace("default", KeyspaceCreateOptions::default)
            .is_ok());
        assert!(keyspace_exists(2)?);

        Ok(())
    }
}
