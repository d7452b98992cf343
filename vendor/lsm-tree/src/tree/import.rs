// SHOAL-PATCH: a whole tree's files exported at a snapshot and adopted by another, empty
// tree (RocksDB's `ExportColumnFamily` / `CreateColumnFamilyWithImport` model; Shoal's
// `docs/research/file-shipping-moves.md`). Nothing here changes a read path or a file
// format: the adopted tables keep their ids, their levels and runs and their seqnos (item
// seqnos and global seqno alike), the blob files keep their ids (tables' indirections name
// them), and the receiving tree's seqno counter is raised above them all, so later writes
// win over adopted versions, as a Lamport clock's. The source's blob GC statistics do not
// travel: the receiver's start empty, so blob bytes that were already dead before the move
// do not count towards its blob GC (space, not correctness).

use super::Tree;
use crate::{
    blob_tree::FragmentationMap,
    file::{fsync_directory, BLOBS_FOLDER, TABLES_FOLDER},
    version::{BlobFileList, Level, Run, SuperVersion, Version},
    vlog::BlobFileId,
    AbstractTree, Checksum, InternalValue, SeqNo, Table, TableId,
};
use std::path::PathBuf;
use std::sync::Arc;

/// One table of an exported tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportTable {
    /// The table's id (its file's name; also inside the file).
    pub id: TableId,
    /// The whole file's XXH3-128, as the source's version records it.
    pub checksum: u128,
    /// What the source adds to the table's item seqnos (an ingested table's).
    pub global_seqno: SeqNo,
    /// The file's length in bytes.
    pub file_size: u64,
}

/// One blob file of an exported tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportBlobFile {
    /// The blob file's id (its file's name; tables' indirections name it).
    pub id: BlobFileId,
    /// The whole file's XXH3-128, as the source's version records it.
    pub checksum: u128,
    /// The file's length in bytes.
    pub file_size: u64,
}

/// The shape of an exported tree: its levels, each level's runs (newest first, as the
/// source reads them), each run's tables in key order; and its blob files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportManifest {
    /// Whether the tree keeps large values in blob files (the receiver's must too).
    pub blob_tree: bool,
    /// Levels, runs, tables.
    pub levels: Vec<Vec<Vec<ImportTable>>>,
    /// By id.
    pub blob_files: Vec<ImportBlobFile>,
}

impl ImportManifest {
    /// Every table, level by level.
    pub fn tables(&self) -> impl Iterator<Item = &ImportTable> {
        self.levels.iter().flatten().flatten()
    }
}

/// A tree's files as they stood at a snapshot, kept on disk (compaction cannot delete them)
/// until this is dropped; and the items its memtables held below the snapshot, which no
/// file holds yet.
pub struct TreeExport {
    /// The files and their places.
    pub manifest: ImportManifest,
    /// Every version of every key the memtables held below the snapshot, tombstones
    /// included, in the tree's order (key ascending, then seqno descending).
    pub memtable: Vec<InternalValue>,
    folder: PathBuf,
    _pinned: SuperVersion,
}

impl TreeExport {
    /// Where table `id` lies on the source.
    pub fn table_path(&self, id: TableId) -> PathBuf {
        self.folder.join(TABLES_FOLDER).join(id.to_string())
    }

    /// Where blob file `id` lies on the source.
    pub fn blob_file_path(&self, id: BlobFileId) -> PathBuf {
        self.folder.join(BLOBS_FOLDER).join(id.to_string())
    }
}

fn refused(what: String) -> crate::Error {
    crate::Error::Io(std::io::Error::other(what))
}

impl Tree {
    /// The tree as a reader at snapshot `seqno` sees it: the files of the version the
    /// snapshot reads from, and its memtables' items below the snapshot.
    ///
    /// # Errors
    ///
    /// Refuses a version holding an item at or above `seqno` (it cannot happen: the
    /// snapshot's version predates it; checked because a receiver would otherwise adopt
    /// changes the snapshot does not hold).
    pub fn export_at(&self, seqno: SeqNo) -> crate::Result<TreeExport> {
        #[expect(clippy::expect_used, reason = "lock is expected to not be poisoned")]
        let pinned = self.version_history.read().expect("lock is poisoned").get_version_for_snapshot(seqno);
        let version = &pinned.version;
        let mut levels = Vec::with_capacity(version.level_count());
        for level in version.iter_levels() {
            let mut runs = Vec::new();
            for run in level.iter() {
                let mut tables = Vec::with_capacity(run.len());
                for table in run.iter() {
                    if table.get_highest_seqno() >= seqno {
                        return Err(refused(format!(
                            "table {} holds seqno {} at or above the snapshot's {seqno}",
                            table.id(),
                            table.get_highest_seqno()
                        )));
                    }
                    tables.push(ImportTable {
                        id: table.id(),
                        checksum: table.checksum().into_u128(),
                        global_seqno: table.global_seqno(),
                        // The file's length on disk: the table's `file_size` property is
                        // written before its meta block and trailer.
                        file_size: std::fs::metadata(&*table.path)?.len(),
                    });
                }
                runs.push(tables);
            }
            levels.push(runs);
        }
        let mut blob_files = Vec::with_capacity(version.blob_files.len());
        for bf in version.blob_files.iter() {
            blob_files.push(ImportBlobFile {
                id: bf.id(),
                checksum: bf.checksum().into_u128(),
                file_size: std::fs::metadata(bf.path())?.len(),
            });
        }
        blob_files.sort_by_key(|bf| bf.id);
        let mut memtable: Vec<InternalValue> = std::iter::once(&pinned.active_memtable)
            .chain(pinned.sealed_memtables.iter())
            .flat_map(|m| m.iter())
            .filter(|item| item.key.seqno < seqno)
            .collect();
        // The tree's order (`InternalKey`: user key ascending, seqno descending); a key
        // and seqno is one write, so duplicates cannot differ.
        memtable.sort_by(|a, b| a.key.cmp(&b.key));
        memtable.dedup_by(|a, b| a.key.user_key == b.key.user_key && a.key.seqno == b.key.seqno);
        let manifest = ImportManifest { blob_tree: version.tree_type() == crate::TreeType::Blob, levels, blob_files };
        Ok(TreeExport { manifest, memtable, folder: self.config.path.clone(), _pinned: pinned })
    }

    /// Adopts an exported tree: the manifest's table and blob files, already written (and
    /// fsynced) under this tree's `tables/` and `blobs/` folders by their ids, and the
    /// exported memtable items, written here into one table on top of level 0. The tree
    /// must be empty and of the manifest's type and level count; every blob file a table
    /// points into must be in the manifest. The seqno and id counters are raised above
    /// everything adopted, then one version registers it all (not yet durable: see
    /// [`super::ingest::DeferredVersion`]). This reads and writes files;
    /// [`PreparedImport::register`] is the quick part, for under a lock writers wait on.
    ///
    /// # Errors
    ///
    /// Refuses a tree that is not empty, a manifest that does not fit, or files that do not
    /// read back; on any error nothing is registered (files written stay orphans, which
    /// recovery removes).
    pub fn import(
        &self,
        manifest: &ImportManifest,
        memtable: Vec<InternalValue>,
    ) -> crate::Result<Option<PreparedImport>> {
        let current = self.current_version();
        let is_blob = current.tree_type() == crate::TreeType::Blob;
        if is_blob != manifest.blob_tree {
            return Err(refused(format!("a {} tree cannot adopt a {} tree's files", kind(is_blob), kind(manifest.blob_tree))));
        }
        if manifest.levels.len() != current.level_count() {
            return Err(refused(format!("{} levels cannot adopt {}", current.level_count(), manifest.levels.len())));
        }
        if current.table_count() > 0 || current.blob_file_count() > 0 || !self.active_memtable().is_empty() || self.sealed_memtable_count() > 0 {
            return Err(refused("only an empty tree adopts files".into()));
        }
        if manifest.tables().next().is_none() && manifest.blob_files.is_empty() && memtable.is_empty() {
            return Ok(None);
        }
        if !memtable.windows(2).all(|w| w[0].key < w[1].key) {
            return Err(refused("memtable items out of order".into()));
        }

        // New ids (the memtable's table below) must not meet adopted ones: a blob file
        // writer would truncate a file of the same id.
        if let Some(max) = manifest.tables().map(|t| t.id).max() {
            self.table_id_counter.fetch_max(max + 1);
        }
        if let Some(max) = manifest.blob_files.iter().map(|b| b.id).max() {
            self.blob_file_id_counter.fetch_max(max + 1);
        }

        let tables_folder = self.config.path.join(TABLES_FOLDER);
        let blobs_folder = self.config.path.join(BLOBS_FOLDER);
        for folder in [&tables_folder, &blobs_folder] {
            if folder.try_exists()? {
                fsync_directory(folder)?;
            }
        }

        let mut levels: Vec<Vec<Vec<Table>>> = Vec::with_capacity(manifest.levels.len());
        for (idx, level) in manifest.levels.iter().enumerate() {
            let pin_filter = self.config.filter_block_pinning_policy.get(idx);
            let pin_index = self.config.index_block_pinning_policy.get(idx);
            let mut runs = Vec::with_capacity(level.len());
            for run in level {
                let mut tables = Vec::with_capacity(run.len());
                for t in run {
                    let table = Table::recover(
                        tables_folder.join(t.id.to_string()),
                        Checksum::from_raw(t.checksum),
                        t.global_seqno,
                        self.id,
                        self.config.cache.clone(),
                        self.config.descriptor_table.clone(),
                        pin_filter,
                        pin_index,
                        #[cfg(feature = "metrics")]
                        self.metrics.clone(),
                    )?;
                    if table.id() != t.id {
                        return Err(refused(format!("table file {} names table {}", t.id, table.id())));
                    }
                    tables.push(table);
                }
                runs.push(tables);
            }
            levels.push(runs);
        }
        for table in levels.iter().flatten().flatten() {
            if let Some(linked) = table.list_blob_file_references()? {
                if let Some(missing) = linked.iter().find(|l| !manifest.blob_files.iter().any(|b| b.id == l.blob_file_id)) {
                    return Err(refused(format!("table {} points into blob file {}, which is not adopted", table.id(), missing.blob_file_id)));
                }
            }
        }

        let ids: Vec<(BlobFileId, Checksum)> = manifest.blob_files.iter().map(|b| (b.id, Checksum::from_raw(b.checksum))).collect();
        let blob_files = if ids.is_empty() {
            Vec::new()
        } else {
            let (found, _orphans) = crate::vlog::recover_blob_files(&blobs_folder, &ids, self.id, self.config.descriptor_table.as_ref())?;
            if found.len() != ids.len() {
                return Err(refused(format!("{} of {} blob files found", found.len(), ids.len())));
            }
            found
        };

        let mut top_seqno = levels.iter().flatten().flatten().map(Table::get_highest_seqno).max().unwrap_or(0);
        top_seqno = top_seqno.max(memtable.iter().map(|i| i.key.seqno).max().unwrap_or(0));

        // The memtable items: one table, newest of all, with their own seqnos. Its data
        // blocks are not compressed: the table sits on top of level 0, so the tree's next
        // compaction rewrites it (compressed then), and compressing it here was a quarter of
        // a receiving node's copy CPU (perf, a rebalance by files), spent while the copies
        // share the cores with the foreground. (fjall's default policy leaves levels 0 and 1
        // uncompressed for the same reason; Shoal compresses them, `partition_block_compression`.)
        let mut l0_top = Vec::new();
        if !memtable.is_empty() {
            if let Some((tables, _)) = self.write_l0_tables(memtable.into_iter().map(Ok), crate::CompressionType::None)? {
                l0_top = tables;
            }
        }

        Ok(Some(PreparedImport { tree: self.clone(), levels, l0_top, blob_files, top_seqno }))
    }
}

/// An import whose files are read and checked, to be registered (see [`Tree::import`]).
#[must_use = "an import is not in its tree until registered"]
pub struct PreparedImport {
    tree: Tree,
    levels: Vec<Vec<Vec<Table>>>,
    l0_top: Vec<Table>,
    blob_files: Vec<crate::BlobFile>,
    top_seqno: SeqNo,
}

impl PreparedImport {
    /// Registers the adopted files in one version, above a seqno every adopted item is
    /// below; the tree must still be empty.
    ///
    /// # Errors
    ///
    /// Refuses a tree written to meanwhile; I/O errors of the version file.
    #[expect(clippy::significant_drop_tightening)]
    pub fn register(self) -> crate::Result<super::ingest::DeferredVersion> {
        let PreparedImport { tree, levels, mut l0_top, blob_files, top_seqno } = self;
        let flush_lock = tree.get_flush_lock();
        #[expect(clippy::expect_used, reason = "lock is expected to not be poisoned")]
        let _compaction_state = tree.compaction_state.lock().expect("lock is poisoned");
        #[expect(clippy::expect_used, reason = "lock is expected to not be poisoned")]
        let mut version_lock = tree.version_history.write().expect("lock is poisoned");
        let current = version_lock.latest_version();
        if current.version.table_count() > 0 || current.version.blob_file_count() > 0 || !current.active_memtable.is_empty() || current.sealed_memtables.len() > 0 {
            return Err(refused("the tree was written to during its import".into()));
        }

        tree.config.seqno.fetch_max(top_seqno + 1);
        let seqno = tree.config.seqno.next();

        let mut built: Vec<Level> = Vec::with_capacity(levels.len());
        for (idx, runs) in levels.into_iter().enumerate() {
            let mut level_runs: Vec<Arc<Run<Table>>> = Vec::with_capacity(runs.len() + 1);
            if idx == 0 {
                if let Some(run) = Run::new(std::mem::take(&mut l0_top)) {
                    level_runs.push(Arc::new(run));
                }
            }
            level_runs.extend(runs.into_iter().filter_map(Run::new).map(Arc::new));
            built.push(Level::from_runs(level_runs));
        }
        let blob_list = BlobFileList::new(blob_files.into_iter().map(|bf| (bf.id(), bf)).collect());

        let (id, checksum) = version_lock.upgrade_version_deferred(
            &tree.config.path,
            |cur| {
                let mut copy = cur.clone();
                copy.version = Version::from_levels(cur.version.id() + 1, cur.version.tree_type(), built, blob_list, FragmentationMap::default());
                Ok(copy)
            },
            seqno,
            &tree.config.visible_seqno,
        )?;
        drop(flush_lock);
        Ok(super::ingest::DeferredVersion::new(tree.clone(), id, checksum))
    }
}

fn kind(blob: bool) -> &'static str {
    if blob {
        "blob"
    } else {
        "standard"
    }
}
