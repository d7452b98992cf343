//! A partition copied as its files (issue 14; `docs/research/file-shipping-moves.md`): the
//! source ships its keyspace's table and blob files byte for byte, as they stood at a
//! snapshot, and the receiver adopts them into its empty keyspace (the vendored lsm-tree's
//! `export_at` / `import`, RocksDB's import model): neither side decodes or re-encodes a
//! record, so the copy runs at what the disks and the link give. The records of
//! [`crate::Store::export_partition`] remain the way when this one cannot be used.
//!
//! On the wire it is a copy stream (`copy_stream`) whose header carries a [`FileManifest`];
//! its records are tagged by their key's first byte:
//! - [`TAG_ITEM`]: one memtable item below the snapshot (none of the files holds it yet):
//!   key = tag + user key; value = value type (`u8`), seqno (`u64` LE), value;
//! - [`TAG_CHUNK`]: a piece of a file: key = tag + the file's index (`u32` BE: the
//!   manifest's tables level by level, then its blob files); value = the bytes.
//!
//! Items come first, then each file's chunks in order, one file after another. Each file is
//! checked against its XXH3-128 (the source's version records it) and fsynced as it ends.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::copy_stream::FrameEncoder;
use crate::error::PartitionError;
use crate::partition::LiveCount;
use crate::store::Store;
use crate::unit::{ExportHeader, IngestStats, PartitionSnapshot};
use crate::PartitionId;

/// Key tag of a memtable item.
pub const TAG_ITEM: u8 = 0;
/// Key tag of a file chunk.
pub const TAG_CHUNK: u8 = 1;
/// Bytes of a file per chunk. A quarter of what a receiver reads at once (1 MiB, the
/// server's `COPY_READ_BYTES`), so that about three chunks in four lie within one read and
/// reach the disk uncopied (`copy_stream::FrameDecoder`); only those that span two reads
/// are gathered.
pub const FILE_CHUNK_BYTES: usize = 256 * 1024;
/// Most files one partition's copy may list (a keyspace holds tens to hundreds).
pub const FILES_MAX: usize = 100_000;
/// A received file's bytes are handed to the disk every this many bytes (`sync_file_range`,
/// not waited for), as RocksDB's `bytes_per_sync`: the kernel would otherwise hold a whole
/// file (up to 64 MiB) in memory until its fsync, leaving the disk idle while it arrives and
/// then stalling the copy on one large flush.
pub const WRITEBACK_BYTES: u64 = 8 * 1024 * 1024;
/// Most bytes of memtable items one copy may carry (they are held in memory until the
/// files are adopted; a keyspace's memtables hold a few tens of MB).
pub const ITEMS_MAX_BYTES: u64 = 512 * 1024 * 1024;
/// Most memtable items a receiver makes room for before they arrive (a few MiB of item
/// handles; a copy with more grows as they come).
const ITEMS_RESERVED_MAX: u64 = 65_536;

/// One file of a [`FileManifest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShippedFile {
    pub id: u64,
    /// XXH3-128 of the whole file, 32 hex digits.
    pub checksum: String,
    /// A table's global seqno (0 for blob files).
    #[serde(default)]
    pub global_seqno: u64,
    pub size: u64,
}

/// One collection's live documents in the copy (a receiver counts nothing itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveDocs {
    pub collection: u32,
    pub count: i64,
    pub bytes: i64,
}

/// What a copy by files carries besides its [`ExportHeader`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileManifest {
    pub blob_tree: bool,
    /// Levels, each level's runs (newest first), each run's tables.
    pub levels: Vec<Vec<Vec<ShippedFile>>>,
    pub blob_files: Vec<ShippedFile>,
    /// Memtable items that come before the files.
    pub items: u64,
    /// XXH3-128 of the items' records as sent ([`ItemsHash`]), 32 hex digits: files carry
    /// their own checksums, the items this one.
    #[serde(default)]
    pub items_checksum: String,
    pub live: Vec<LiveDocs>,
}

impl FileManifest {
    /// The manifest of `export`'s files, and of `items`, its memtable items (hashed as the
    /// records they travel as, without making those records: they are made one by one as
    /// they are sent).
    fn from_export(export: &fjall::TreeExport, live: Vec<LiveDocs>, items: &[fjall::InternalValue]) -> FileManifest {
        let mut hash = ItemsHash::default();
        for item in items {
            hash.add_item(item);
        }
        let table = |t: &fjall::ImportTable| ShippedFile {
            id: t.id,
            checksum: hex128(t.checksum),
            global_seqno: t.global_seqno,
            size: t.file_size,
        };
        let m = &export.manifest;
        FileManifest {
            blob_tree: m.blob_tree,
            levels: m.levels.iter().map(|l| l.iter().map(|r| r.iter().map(table).collect()).collect()).collect(),
            blob_files: m
                .blob_files
                .iter()
                .map(|b| ShippedFile { id: b.id, checksum: hex128(b.checksum), global_seqno: 0, size: b.file_size })
                .collect(),
            items: items.len() as u64,
            items_checksum: hash.hex(),
            live,
        }
    }

    /// Every file in stream order, with whether it is a blob file.
    pub fn files(&self) -> impl Iterator<Item = (&ShippedFile, bool)> {
        self.levels.iter().flatten().flatten().map(|f| (f, false)).chain(self.blob_files.iter().map(|f| (f, true)))
    }

    /// Bytes of every file.
    pub fn file_bytes(&self) -> u64 {
        self.files().map(|(f, _)| f.size).sum()
    }

    fn to_import(&self) -> Result<fjall::ImportManifest, PartitionError> {
        let sum = |f: &ShippedFile| {
            u128::from_str_radix(&f.checksum, 16)
                .ok()
                .filter(|_| f.checksum.len() == 32)
                .ok_or_else(|| PartitionError::Malformed(format!("file {} has a bad checksum {:?}", f.id, f.checksum)))
        };
        let mut levels = Vec::with_capacity(self.levels.len());
        for level in &self.levels {
            let mut runs = Vec::with_capacity(level.len());
            for run in level {
                let mut tables = Vec::with_capacity(run.len());
                for f in run {
                    tables.push(fjall::ImportTable { id: f.id, checksum: sum(f)?, global_seqno: f.global_seqno, file_size: f.size });
                }
                runs.push(tables);
            }
            levels.push(runs);
        }
        let mut blob_files = Vec::with_capacity(self.blob_files.len());
        for f in &self.blob_files {
            blob_files.push(fjall::ImportBlobFile { id: f.id, checksum: sum(f)?, file_size: f.size });
        }
        Ok(fjall::ImportManifest { blob_tree: self.blob_tree, levels, blob_files })
    }
}

/// A partition's export as files: its header and manifest, then its records (see the
/// module's doc) as an iterator. Holds the snapshot's files on disk until dropped.
pub struct PartitionFiles {
    header: ExportHeader,
    files: KeyspaceFiles,
}

/// Any keyspace's export as files at a snapshot (a partition's, or an index partition's):
/// its manifest, then its records (see the module's doc). Holds the snapshot's files on
/// disk until dropped.
pub struct KeyspaceFiles {
    manifest: FileManifest,
    /// Pins the snapshot's files (compaction cannot delete them) until the copy ends.
    _export: fjall::TreeExport,
    /// The memtable's items still to send, each encoded as a record when its turn comes: a
    /// copy begins without first copying a memtable's worth of bytes (up to
    /// `PARTITION_MEMTABLE_MAX_BYTES` per partition, on every source at once as a
    /// rebalance starts).
    items: std::vec::IntoIter<fjall::InternalValue>,
    /// Files still to send: index, path, size.
    todo: VecDeque<(u32, PathBuf, u64)>,
    /// The file being sent: its index, the file, the offset of its next chunk, bytes left.
    open: Option<(u32, Arc<File>, u64, u64)>,
}

/// A piece of an export as files: a record, or a chunk of one of the snapshot's files left
/// on disk, for a caller that sends it without reading it (`sendfile`: the bytes go from
/// the page cache to the socket with no copy through user space, and with no buffer to
/// fill and clear per chunk).
#[derive(Debug)]
pub enum FilePiece {
    Record(Bytes, Bytes),
    /// A memtable item, for [`FilePiece::frame_item`] to write into the stream's buffer
    /// as its record (no record assembled first: an index partition's copy is thousands).
    Item(fjall::InternalValue),
    /// `len` bytes of `file` at `offset`: the value of the record keyed `key`.
    Chunk {
        key: Bytes,
        file: Arc<File>,
        offset: u64,
        len: usize,
    },
}

impl FilePiece {
    /// The piece as a record, a chunk's bytes read from its file.
    pub fn into_record(self) -> Result<(Bytes, Bytes), PartitionError> {
        match self {
            FilePiece::Record(k, v) => Ok((k, v)),
            FilePiece::Item(item) => Ok(encode_item(&item)),
            FilePiece::Chunk { key, file, offset, len } => Ok((key, read_chunk(&file, offset, len).map_err(io)?)),
        }
    }

    /// Writes `item`'s record (as [`FilePiece::into_record`] makes it) into `out`.
    pub fn frame_item(encoder: &mut FrameEncoder, out: &mut BytesMut, item: &fjall::InternalValue) {
        item_record(item, |key, value| encoder.record_pieces(out, key, value));
    }
}

/// `len` bytes of `file` at `offset` (a [`FilePiece::Chunk`]'s value).
pub fn read_chunk(file: &File, offset: u64, len: usize) -> std::io::Result<Bytes> {
    use std::os::unix::fs::FileExt as _;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| std::io::Error::new(e.kind(), format!("reading a chunk of the export at {offset}: {e}")))?;
    Ok(Bytes::from(buf))
}

impl PartitionFiles {
    pub fn header(&self) -> &ExportHeader {
        &self.header
    }

    pub fn manifest(&self) -> &FileManifest {
        &self.files.manifest
    }

    /// The next piece (see [`KeyspaceFiles::next_piece`]).
    pub fn next_piece(&mut self) -> Option<Result<FilePiece, PartitionError>> {
        self.files.next_piece()
    }
}

impl Iterator for PartitionFiles {
    type Item = Result<(Bytes, Bytes), PartitionError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.files.next()
    }
}

impl KeyspaceFiles {
    /// Starts an export of `ks` as its files at `snapshot` (of the keyspace's database);
    /// `live` goes into the manifest as it is.
    pub fn export(ks: &fjall::Keyspace, snapshot: &fjall::Snapshot, live: Vec<LiveDocs>) -> Result<KeyspaceFiles, PartitionError> {
        let mut export = ks.export_files(snapshot)?;
        let items = std::mem::take(&mut export.memtable);
        let manifest = FileManifest::from_export(&export, live, &items);
        let items = items.into_iter();
        let mut todo = VecDeque::new();
        for (index, (f, blob)) in manifest.files().enumerate() {
            let index = u32::try_from(index).map_err(|_| unavailable("too many files"))?;
            todo.push_back((index, if blob { export.blob_file_path(f.id) } else { export.table_path(f.id) }, f.size));
        }
        if todo.len() > FILES_MAX {
            return Err(unavailable("too many files"));
        }
        Ok(KeyspaceFiles { manifest, _export: export, items, todo, open: None })
    }

    pub fn manifest(&self) -> &FileManifest {
        &self.manifest
    }

    /// The next piece: the memtable's items first, then each file's chunks of at most
    /// [`FILE_CHUNK_BYTES`], in order (the file's bytes are not read here).
    pub fn next_piece(&mut self) -> Option<Result<FilePiece, PartitionError>> {
        if let Some(item) = self.items.next() {
            return Some(Ok(FilePiece::Item(item)));
        }
        loop {
            if let Some((index, file, offset, left)) = &mut self.open {
                if *left == 0 {
                    self.open = None;
                    continue;
                }
                let len = usize::try_from(*left).unwrap_or(usize::MAX).min(FILE_CHUNK_BYTES);
                let piece = FilePiece::Chunk { key: chunk_key(*index), file: Arc::clone(file), offset: *offset, len };
                *offset += len as u64;
                *left -= len as u64;
                return Some(Ok(piece));
            }
            let (index, path, size) = self.todo.pop_front()?;
            match File::open(&path) {
                // An empty file is one empty chunk, so that every file has a chunk.
                Ok(_) if size == 0 => return Some(Ok(FilePiece::Record(chunk_key(index), Bytes::new()))),
                Ok(file) => self.open = Some((index, Arc::new(file), 0, size)),
                Err(e) => {
                    self.todo.clear();
                    return Some(Err(io(std::io::Error::new(e.kind(), format!("opening {}: {e}", path.display())))));
                }
            }
        }
    }
}

impl Iterator for KeyspaceFiles {
    type Item = Result<(Bytes, Bytes), PartitionError>;

    fn next(&mut self) -> Option<Self::Item> {
        let piece = self.next_piece()?;
        let record = piece.and_then(FilePiece::into_record);
        if record.is_err() {
            self.open = None;
            self.todo.clear();
        }
        Some(record)
    }
}

/// Why a partition cannot be exported as files now (the records can).
fn unavailable(why: &str) -> PartitionError {
    PartitionError::Malformed(format!("no export as files: {why}"))
}

impl Store {
    /// Starts an export of partition `p` as files: a consistent snapshot of every
    /// collection's part of it (as [`Store::export_partition`]), as the keyspace's files at
    /// that snapshot. Refused while a dropped collection's keys may remain in the keyspace
    /// (they would travel along); [`Store::export_partition`] then serves.
    ///
    /// The memtable's items below the snapshot travel as items, and the receiver writes
    /// them into a table on its copy's (low-priority) thread. Flushing the memtable first
    /// instead would run that table build in the engine's flush workers, at the
    /// foreground's priority, on every source at once: measured, a 0.3 s stall of every
    /// node's requests as a swap started (`bench/results/2026-11-24-issue14-file-shipping.md`).
    pub fn export_partition_files(&self, p: PartitionId) -> Result<PartitionFiles, PartitionError> {
        if self.reclaim_pending() {
            return Err(unavailable("a dropped collection's keys are still being deleted"));
        }
        let PartitionSnapshot { snapshot, ks, header, live } = self.snapshot_partition(p)?;
        let live = live.into_iter().map(|(collection, l)| LiveDocs { collection, count: l.count, bytes: l.bytes }).collect();
        let files = KeyspaceFiles::export(&ks, &snapshot, live)?;
        drop(snapshot);
        Ok(PartitionFiles { header, files })
    }

    /// Loads a copy by files of partition `p` (see the module's doc) into this node's copy,
    /// which must be `pending` and empty, as [`Store::ingest_partition`] does with records:
    /// each file is written under the keyspace's folder, checked against its checksum and
    /// fsynced, then the keyspace adopts them all in one version; then every collection's
    /// copy continues the source's history from the header's positions. On an error
    /// nothing is adopted (files already written stay until the partition is dropped, as
    /// a failed copy's is).
    pub fn import_partition_files<I>(
        &self,
        header: &ExportHeader,
        manifest: &FileManifest,
        records: I,
    ) -> Result<IngestStats, PartitionError>
    where
        I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
    {
        let p = header.partition;
        let (_op, by_id, ks) = self.check_ingest(header)?;
        for c in &manifest.live {
            if !by_id.contains_key(&c.collection) {
                return Err(PartitionError::UnknownCollection(c.collection));
            }
        }
        let stats = import_keyspace_files(&ks, manifest, records)?;
        let live: BTreeMap<u32, LiveCount> =
            manifest.live.iter().map(|c| (c.collection, LiveCount { count: c.count, bytes: c.bytes })).collect();
        self.finish_ingest(header, &by_id, &live)?;
        tracing::info!(partition = p, files = manifest.files().count(), bytes = stats.bytes, "partition copy adopted from files");
        Ok(stats)
    }
}

/// Adopts an export as files (see the module's doc) into `ks`, which must be empty: each
/// file is written under the keyspace's folder, checked against its checksum and fsynced,
/// then the keyspace adopts them all, with the memtable items, in one version. On an error
/// nothing is adopted (files already written stay until the keyspace is dropped).
pub fn import_keyspace_files<I>(ks: &fjall::Keyspace, manifest: &FileManifest, records: I) -> Result<IngestStats, PartitionError>
where
    I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
{
    import_keyspace(ks, manifest, records, None)
}

/// [`import_keyspace_files`] for a keyspace of `db` that many small copies land in (an
/// index's partitions): a copy with no file — all of it in the source's memtables — is
/// written through `db`'s journal in one batch and made durable with one journal fsync,
/// instead of becoming a table of its own and a new version (two folder fsyncs, the
/// table's, the version's and its folder's, and a compaction after). Each key's newest item
/// below the snapshot is its state; a tombstone has nothing under it in an empty keyspace.
/// A copy with files is adopted as [`import_keyspace_files`] does.
pub fn import_small_keyspace<I>(
    db: &fjall::Database,
    ks: &fjall::Keyspace,
    manifest: &FileManifest,
    records: I,
) -> Result<IngestStats, PartitionError>
where
    I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
{
    import_keyspace(ks, manifest, records, Some(db))
}

fn import_keyspace<I>(
    ks: &fjall::Keyspace,
    manifest: &FileManifest,
    records: I,
    journal: Option<&fjall::Database>,
) -> Result<IngestStats, PartitionError>
where
    I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
{
    let received = receive(ks, manifest, records)?;
    match journal {
        Some(db) if !received.files => {
            let values = newest_values(ks, received.items)?;
            write_values(db, vec![(ks.clone(), values)])?;
        }
        _ => ks.import_files(&received.import, received.items)?,
    }
    Ok(received.stats)
}

/// Copies adopted into keyspaces of one database together (a group of index partitions
/// from one source, `shoal_index`'s `PartImports`): as [`import_small_keyspace`] each, but
/// the copies with no file land through the journal in one batch for them all, made durable
/// by one fsync ([`KeyspaceImports::commit`]) — where each copy would write its own behind
/// the others'. Copies with files are adopted as they come. Staged items are held in memory
/// until the commit, at most [`STAGED_ITEMS_MAX_BYTES`] of them: past that, what is staged
/// is written then.
pub struct KeyspaceImports<'db> {
    db: &'db fjall::Database,
    staged: Vec<(fjall::Keyspace, Vec<(fjall::UserKey, fjall::UserValue)>)>,
    staged_bytes: u64,
}

/// Most bytes of memtable items [`KeyspaceImports`] holds before it writes them.
pub const STAGED_ITEMS_MAX_BYTES: u64 = 64 * 1024 * 1024;

impl<'db> KeyspaceImports<'db> {
    pub fn new(db: &'db fjall::Database) -> KeyspaceImports<'db> {
        KeyspaceImports { db, staged: Vec::new(), staged_bytes: 0 }
    }

    /// Receives one copy into `ks` (empty, of this database): its files adopted now, or its
    /// items staged for [`KeyspaceImports::commit`]. On an error nothing of this copy is
    /// adopted or staged.
    pub fn add<I>(&mut self, ks: &fjall::Keyspace, manifest: &FileManifest, records: I) -> Result<IngestStats, PartitionError>
    where
        I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
    {
        let received = receive(ks, manifest, records)?;
        if received.files {
            ks.import_files(&received.import, received.items)?;
            return Ok(received.stats);
        }
        if self.staged.iter().any(|(staged, _)| staged.name() == ks.name()) {
            return Err(PartitionError::Malformed("two copies into one keyspace".into()));
        }
        let values = newest_values(ks, received.items)?;
        self.staged_bytes += values.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum::<u64>();
        self.staged.push((ks.clone(), values));
        if self.staged_bytes > STAGED_ITEMS_MAX_BYTES {
            self.write_staged()?;
        }
        Ok(received.stats)
    }

    /// Writes every staged copy: one batch, one journal fsync. Durable when this returns.
    pub fn commit(mut self) -> Result<(), PartitionError> {
        self.write_staged()
    }

    fn write_staged(&mut self) -> Result<(), PartitionError> {
        let staged = std::mem::take(&mut self.staged);
        self.staged_bytes = 0;
        write_values(self.db, staged)
    }
}

/// A copy received whole and checked (see [`import_keyspace_files`]): its files written,
/// not yet adopted.
struct Received {
    stats: IngestStats,
    items: Vec<fjall::InternalValue>,
    import: fjall::ImportManifest,
    /// The copy has files (not only memtable items).
    files: bool,
}

fn receive<I>(ks: &fjall::Keyspace, manifest: &FileManifest, records: I) -> Result<Received, PartitionError>
where
    I: IntoIterator<Item = Result<(Bytes, Bytes), PartitionError>>,
{
    let import = manifest.to_import()?;
    let files: Vec<(&ShippedFile, bool)> = manifest.files().collect();
    if files.len() > FILES_MAX {
        return Err(PartitionError::Malformed(format!("{} files is over the limit of {FILES_MAX}", files.len())));
    }
    let mut ids = std::collections::HashSet::new();
    if let Some((f, _)) = files.iter().find(|(f, blob)| !ids.insert((*blob, f.id))) {
        return Err(PartitionError::Malformed(format!("file id {} listed twice", f.id)));
    }
    let tables = ks.path().join(fjall::TABLES_FOLDER);
    let blobs = ks.path().join(fjall::BLOBS_FOLDER);
    std::fs::create_dir_all(&tables).map_err(io)?;
    // Only a copy with blob files needs their folder: a new folder is an inode, and most
    // copies (every small index partition's) have none.
    if files.iter().any(|(_, blob)| *blob) {
        std::fs::create_dir_all(&blobs).map_err(io)?;
    }

    let mut stats = IngestStats::default();
    // Room for as many as the manifest says, up to [`ITEMS_RESERVED_MAX`]: a count in a
    // peer's manifest does not make this node set memory aside before the items come.
    let mut items = Vec::with_capacity(usize::try_from(manifest.items.min(ITEMS_RESERVED_MAX)).unwrap_or(0));
    let mut items_bytes = 0u64;
    let mut items_hash = ItemsHash::default();
    let mut writing: Option<FileWriter> = None;
    // One staging buffer for the direct writes of all the files, in turn.
    let mut staging = Vec::new();
    let mut next_file = 0usize;
    for record in records {
        let (k, v) = record?;
        stats.records += 1;
        stats.bytes += (k.len() + v.len()) as u64;
        match k.first().copied() {
            Some(TAG_ITEM) => {
                if next_file > 0 {
                    return Err(PartitionError::Malformed("a memtable item after the files began".into()));
                }
                items_bytes += (k.len() + v.len()) as u64;
                if items_bytes > ITEMS_MAX_BYTES {
                    return Err(PartitionError::Malformed(format!("memtable items over {ITEMS_MAX_BYTES} bytes")));
                }
                items_hash.add(&k, &v);
                items.push(decode_item(&k[1..], &v)?);
            }
            Some(TAG_CHUNK) => {
                let index = k.get(1..5).and_then(|b| b.try_into().ok()).map(u32::from_be_bytes).filter(|_| k.len() == 5);
                let index = index.ok_or_else(|| PartitionError::Malformed("a file chunk with a malformed key".into()))? as usize;
                if writing.as_ref().is_some_and(|w| w.index != index) {
                    return Err(PartitionError::Malformed(format!("file {index} began before file {} ended", next_file - 1)));
                }
                if writing.is_none() {
                    if index != next_file {
                        return Err(PartitionError::Malformed(format!("file {index} came where file {next_file} was due")));
                    }
                    let (f, blob) =
                        files.get(index).ok_or_else(|| PartitionError::Malformed(format!("no file {index} in the manifest")))?;
                    writing = Some(FileWriter::create(index, if *blob { &blobs } else { &tables }, f, &mut staging)?);
                    next_file += 1;
                }
                if let Some(w) = &mut writing {
                    if w.write(&v)? {
                        if let Some(done) = writing.take() {
                            staging = done.out.into_staging();
                        }
                    }
                }
            }
            _ => return Err(PartitionError::Malformed("a record of a copy by files with an unknown tag".into())),
        }
    }
    if writing.is_some() || next_file != files.len() {
        return Err(PartitionError::Malformed(format!("the copy ended after {next_file} of {} files", files.len())));
    }
    if items.len() as u64 != manifest.items {
        return Err(PartitionError::Malformed(format!("{} memtable items came of {}", items.len(), manifest.items)));
    }
    if items_hash.hex() != manifest.items_checksum {
        return Err(PartitionError::Malformed("the memtable items do not match their checksum".into()));
    }
    Ok(Received { stats, items, import, files: !files.is_empty() })
}

/// Each key's newest item of `items` (in the memtable's order: key, then newest first) that
/// holds a value, to be written into the empty `ks`.
fn newest_values(
    ks: &fjall::Keyspace,
    items: Vec<fjall::InternalValue>,
) -> Result<Vec<(fjall::UserKey, fjall::UserValue)>, PartitionError> {
    if !ks.is_empty()? {
        return Err(PartitionError::Malformed("only an empty keyspace adopts a copy".into()));
    }
    if !items.windows(2).all(|w| w[0].key < w[1].key) {
        return Err(PartitionError::Malformed("memtable items out of order".into()));
    }
    let mut values = Vec::with_capacity(items.len());
    let mut last: Option<fjall::UserKey> = None;
    for item in items {
        if last.as_ref() == Some(&item.key.user_key) {
            continue; // an older version of the key just taken
        }
        last = Some(item.key.user_key.clone());
        match item.key.value_type {
            fjall::ValueType::Value => values.push((item.key.user_key, item.value)),
            fjall::ValueType::Tombstone | fjall::ValueType::WeakTombstone => {}
            fjall::ValueType::Indirection => {
                return Err(PartitionError::Malformed("a memtable item pointing into a blob file, with no file".into()))
            }
        }
    }
    Ok(values)
}

/// Writes `values` into their keyspaces by one batch, durable when this returns.
fn write_values(
    db: &fjall::Database,
    keyspaces: Vec<(fjall::Keyspace, Vec<(fjall::UserKey, fjall::UserValue)>)>,
) -> Result<(), PartitionError> {
    let mut batch = db.batch();
    let mut any = false;
    for (ks, values) in keyspaces {
        for (k, v) in values {
            batch.insert(&ks, k, v);
            any = true;
        }
    }
    if !any {
        return Ok(());
    }
    batch.commit()?;
    db.persist(fjall::PersistMode::SyncAll)?;
    Ok(())
}

fn chunk_key(index: u32) -> Bytes {
    let mut key = Vec::with_capacity(5);
    key.push(TAG_CHUNK);
    key.extend_from_slice(&index.to_be_bytes());
    Bytes::from(key)
}

fn io(e: std::io::Error) -> PartitionError {
    PartitionError::Engine(fjall::Error::Io(e))
}

/// A memtable item as a record of a copy by files (see the module's doc), given to `f` as
/// the pieces of its key and of its value: the one place the layout is written, for the
/// record assembled ([`encode_item`]), framed in place ([`FilePiece::frame_item`]) and
/// hashed in place ([`ItemsHash::add_item`]).
fn item_record<R>(item: &fjall::InternalValue, f: impl FnOnce(&[&[u8]], &[&[u8]]) -> R) -> R {
    let head = [u8::from(item.key.value_type)];
    let seqno = item.key.seqno.to_le_bytes();
    f(&[&[TAG_ITEM], &item.key.user_key], &[&head, &seqno, &item.value])
}

/// A memtable item as a record of a copy by files, assembled.
fn encode_item(item: &fjall::InternalValue) -> (Bytes, Bytes) {
    item_record(item, |key, value| (Bytes::from(key.concat()), Bytes::from(value.concat())))
}

/// XXH3-128 over item records: each key's and value's length (`u64` LE) and bytes.
#[derive(Default)]
struct ItemsHash(xxhash_rust::xxh3::Xxh3);

impl ItemsHash {
    fn add(&mut self, k: &[u8], v: &[u8]) {
        self.add_pieces(&[k], &[v]);
    }

    /// Adds `item` as [`ItemsHash::add`] adds its record ([`encode_item`]), piece by piece.
    fn add_item(&mut self, item: &fjall::InternalValue) {
        item_record(item, |k, v| self.add_pieces(k, v));
    }

    /// Adds a record given as the pieces of its key and of its value.
    fn add_pieces(&mut self, key: &[&[u8]], value: &[&[u8]]) {
        for pieces in [key, value] {
            let len: usize = pieces.iter().map(|p| p.len()).sum();
            self.0.update(&(len as u64).to_le_bytes());
            pieces.iter().for_each(|p| self.0.update(p));
        }
    }

    fn hex(&self) -> String {
        hex128(self.0.digest128())
    }
}

/// An XXH3-128 checksum as the manifest writes it: 32 lower-case hex digits.
fn hex128(checksum: u128) -> String {
    format!("{checksum:032x}")
}

fn decode_item(key: &[u8], v: &[u8]) -> Result<fjall::InternalValue, PartitionError> {
    let bad = || PartitionError::Malformed("a malformed memtable item".into());
    if key.is_empty() || key.len() > u16::MAX as usize || v.len() < 9 {
        return Err(bad());
    }
    let value_type = fjall::ValueType::try_from(v[0]).map_err(|()| bad())?;
    let seqno = u64::from_le_bytes(v[1..9].try_into().map_err(|_| bad())?);
    // Each slice copied once, straight into the key's and the value's own storage.
    Ok(fjall::InternalValue::from_components(key, &v[9..], seqno, value_type))
}

/// One file being received: written as its chunks come, hashed, fsynced at its end.
struct FileWriter {
    index: usize,
    path: PathBuf,
    hash: xxhash_rust::xxh3::Xxh3,
    left: u64,
    checksum: String,
    out: FileOut,
}

impl FileWriter {
    fn create(index: usize, folder: &std::path::Path, f: &ShippedFile, staging: &mut Vec<u8>) -> Result<FileWriter, PartitionError> {
        let path = folder.join(f.id.to_string());
        Ok(FileWriter {
            index,
            out: FileOut::create(&path, true, staging)?,
            path,
            hash: xxhash_rust::xxh3::Xxh3::new(),
            left: f.size,
            checksum: f.checksum.clone(),
        })
    }

    /// Writes a chunk; answers whether the file is whole (then checked and fsynced).
    fn write(&mut self, chunk: &[u8]) -> Result<bool, PartitionError> {
        if chunk.len() as u64 > self.left {
            return Err(PartitionError::Malformed(format!("file {} is longer than its manifest says", self.index)));
        }
        self.out.write(chunk)?;
        self.hash.update(chunk);
        self.left -= chunk.len() as u64;
        if self.left > 0 {
            return Ok(false);
        }
        let got = hex128(self.hash.digest128());
        if got != self.checksum {
            return Err(PartitionError::Malformed(format!("{} arrived with checksum {got}, not {}", self.path.display(), self.checksum)));
        }
        self.out.finish()?;
        Ok(true)
    }
}

/// The alignment direct I/O needs of a write's memory, offset and length (the largest
/// logical block size of common disks).
const DIRECT_ALIGN: usize = 4096;
/// Bytes gathered before one direct write (a multiple of `DIRECT_ALIGN`).
const DIRECT_WRITE_BYTES: usize = 1024 * 1024;
const _: () = assert!(DIRECT_WRITE_BYTES.is_multiple_of(DIRECT_ALIGN));

/// Where a received file's bytes go: straight to the disk (`O_DIRECT`) where the file system
/// allows it, through the page cache otherwise.
///
/// Direct: a copy writes hundreds of MB that nobody reads soon, and copying them into the
/// page cache was most of the receiving thread's CPU (perf: `copy_folio_from_iter_atomic`,
/// over half of it, on fresh page-cache pages), CPU taken from the foreground on a small
/// machine; the cache would also push out the pages the foreground reads. As ScyllaDB writes
/// its streamed SSTables and RocksDB can (`use_direct_io_for_flush_and_compaction`).
/// Hand-written: std opens the file with the flag and writes at offsets; what no crate does
/// more simply is the aligned staging buffer below.
enum FileOut {
    Direct {
        file: File,
        /// Staging memory: `buf[start..start + DIRECT_WRITE_BYTES]` is aligned to
        /// `DIRECT_ALIGN` (a `Vec` never moves while it is not grown).
        buf: Vec<u8>,
        start: usize,
        /// Bytes staged, not yet written.
        staged: usize,
        /// Bytes written to the file (a multiple of `DIRECT_ALIGN`).
        offset: u64,
    },
    Buffered {
        file: File,
        /// Bytes written, and how many of them were handed to the disk.
        written: u64,
        handed: u64,
    },
}

impl FileOut {
    /// Creates the file (a new one only: an id already there would be another file's),
    /// directly written if `direct` and the file system takes it, staged in `staging` (taken;
    /// [`FileOut::into_staging`] gives it back for the next file: fresh memory for each file
    /// was pages the kernel zeroed, on the copy's CPU).
    fn create(path: &std::path::Path, direct: bool, staging: &mut Vec<u8>) -> Result<FileOut, PartitionError> {
        if direct {
            if let Some(file) = open_direct(path)? {
                let mut buf = std::mem::take(staging);
                if buf.len() < DIRECT_WRITE_BYTES + DIRECT_ALIGN {
                    buf = vec![0u8; DIRECT_WRITE_BYTES + DIRECT_ALIGN];
                }
                let start = buf.as_ptr().align_offset(DIRECT_ALIGN);
                debug_assert!(start < DIRECT_ALIGN);
                return Ok(FileOut::Direct { file, buf, start, staged: 0, offset: 0 });
            }
        }
        let file = File::options().write(true).create_new(true).open(path).map_err(io)?;
        Ok(FileOut::Buffered { file, written: 0, handed: 0 })
    }

    fn write(&mut self, mut chunk: &[u8]) -> Result<(), PartitionError> {
        match self {
            FileOut::Direct { file, buf, start, staged, offset } => {
                while !chunk.is_empty() {
                    let n = chunk.len().min(DIRECT_WRITE_BYTES - *staged);
                    buf[*start + *staged..*start + *staged + n].copy_from_slice(&chunk[..n]);
                    *staged += n;
                    chunk = &chunk[n..];
                    if *staged == DIRECT_WRITE_BYTES {
                        write_direct(file, &buf[*start..*start + DIRECT_WRITE_BYTES], *offset)?;
                        *offset += DIRECT_WRITE_BYTES as u64;
                        *staged = 0;
                    }
                }
            }
            FileOut::Buffered { file, written, handed } => {
                file.write_all(chunk).map_err(io)?;
                *written += chunk.len() as u64;
                if *written - *handed >= WRITEBACK_BYTES {
                    start_writeback(file, *handed, *written - *handed);
                    *handed = *written;
                }
            }
        }
        Ok(())
    }

    /// The staging buffer, for the next file (empty for a file written through the cache).
    fn into_staging(self) -> Vec<u8> {
        match self {
            FileOut::Direct { buf, .. } => buf,
            FileOut::Buffered { .. } => Vec::new(),
        }
    }

    /// Writes what is staged and makes the file durable. A direct file's last block is
    /// written whole (zero padded, as direct I/O needs) and the file cut back to its length.
    fn finish(&mut self) -> Result<(), PartitionError> {
        match self {
            FileOut::Direct { file, buf, start, staged, offset } => {
                if *staged > 0 {
                    let padded = staged.next_multiple_of(DIRECT_ALIGN);
                    buf[*start + *staged..*start + padded].fill(0);
                    write_direct(file, &buf[*start..*start + padded], *offset)?;
                    file.set_len(*offset + *staged as u64).map_err(io)?;
                    *offset += *staged as u64;
                    *staged = 0;
                }
                file.sync_all().map_err(io)
            }
            FileOut::Buffered { file, .. } => file.sync_all().map_err(io),
        }
    }
}

/// Opens a new file for direct writes; `None` where the file system refuses direct I/O
/// (tmpfs, some network file systems: `EINVAL`), which then writes through the page cache.
#[cfg(target_os = "linux")]
fn open_direct(path: &std::path::Path) -> Result<Option<File>, PartitionError> {
    use std::os::unix::fs::OpenOptionsExt;
    match File::options().write(true).create_new(true).custom_flags(libc::O_DIRECT).open(path) {
        Ok(file) => Ok(Some(file)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            // Some file systems create the file before refusing the flag.
            let _ = std::fs::remove_file(path);
            Ok(None)
        }
        Err(e) => Err(io(e)),
    }
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &std::path::Path) -> Result<Option<File>, PartitionError> {
    Ok(None)
}

fn write_direct(file: &File, block: &[u8], offset: u64) -> Result<(), PartitionError> {
    use std::os::unix::fs::FileExt;
    debug_assert!(block.len().is_multiple_of(DIRECT_ALIGN) && (block.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN));
    file.write_all_at(block, offset).map_err(io)
}

/// Starts writing `len` bytes of `file` from `offset` to the disk without waiting for it
/// (the fsync at the file's end still makes it durable). Hand-written: one libc call
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), which no crate wraps more simply; a failure
/// only loses the head start.
#[cfg(target_os = "linux")]
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (libc::off64_t::try_from(offset), libc::off64_t::try_from(len)) else { return };
    // SAFETY: the descriptor is open for the duration of the call; the call takes no
    // pointers and only schedules writeback of this file's pages.
    let done = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE) };
    if done != 0 {
        tracing::debug!("could not start a received file's writeback");
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_file: &File, _offset: u64, _len: u64) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// An item of each kind a copy carries: a value, a tombstone of an empty value, a long
    /// key with a long value.
    fn items_of_every_kind() -> [fjall::InternalValue; 3] {
        [
            fjall::InternalValue::from_components(b"k".to_vec(), b"v".to_vec(), 7, fjall::ValueType::Value),
            fjall::InternalValue::from_components(b"gone".to_vec(), Vec::new(), u64::MAX >> 1, fjall::ValueType::Tombstone),
            fjall::InternalValue::from_components(vec![0xff; 300], vec![1; 5000], 0, fjall::ValueType::Value),
        ]
    }

    /// The source hashes its memtable items in place; the receiver hashes the records they
    /// travel as. Both must agree, for every kind of item (empty value, tombstone, long key).
    #[test]
    fn an_item_hashes_in_place_as_its_record_does() {
        let items = items_of_every_kind();
        let (mut in_place, mut records) = (ItemsHash::default(), ItemsHash::default());
        for item in &items {
            in_place.add_item(item);
            let (k, v) = encode_item(item);
            records.add(&k, &v);
            let back = decode_item(&k[1..], &v).unwrap();
            assert_eq!(u8::from(back.key.value_type), u8::from(item.key.value_type));
            assert_eq!((back.key, back.value), (item.key.clone(), item.value.clone()));
        }
        assert_eq!(in_place.hex(), records.hex());
        let mut fewer = ItemsHash::default();
        items[..2].iter().for_each(|i| fewer.add_item(i));
        assert_ne!(fewer.hex(), records.hex());
    }

    /// An item framed in place ([`FilePiece::frame_item`], as a copy sends it) is read back
    /// as the record [`encode_item`] makes, and counted as one, for every kind of item.
    #[test]
    fn an_item_framed_in_place_reads_back_as_its_record() {
        use crate::copy_stream::{CopyHeader, Frame, FrameDecoder};
        let items = items_of_every_kind();
        let mut out = BytesMut::new();
        let header = CopyHeader { export: ExportHeader { partition: 0, collections: Vec::new() }, bytes_estimate: 0, files: None };
        FrameEncoder::header(&mut out, &header);
        let mut encoder = FrameEncoder::default();
        for item in &items {
            FilePiece::frame_item(&mut encoder, &mut out, item);
        }
        encoder.end(&mut out);
        let mut decoder = FrameDecoder::default();
        decoder.push(&out);
        assert!(matches!(decoder.next_frame(), Ok(Some(Frame::Header(_)))));
        for item in &items {
            match decoder.next_frame() {
                Ok(Some(Frame::Record(k, v))) => assert_eq!((k, v), encode_item(item)),
                other => panic!("{other:?} in place of an item's record"),
            }
        }
        assert!(matches!(decoder.next_frame(), Ok(Some(Frame::End))), "the end marker counts each item once, with its bytes");
        decoder.finish().unwrap();
    }

    /// A copy with no file lands through the journal ([`import_small_keyspace`]); with
    /// files, as tables. Either way the receiver holds exactly what the source held at the
    /// export's snapshot: each key's newest value, nothing a tombstone removed, nothing
    /// written after the snapshot.
    #[test]
    fn a_small_copy_lands_through_the_journal_with_what_the_snapshot_held() {
        use fjall::Readable as _;
        let dir = tempfile::tempdir().unwrap();
        let open = |name: &str| fjall::Database::builder(dir.path().join(name)).open().unwrap();
        let opts = fjall::KeyspaceCreateOptions::default;
        let src = open("src");
        let ks = src.keyspace("ks", opts).unwrap();
        for flush in [false, true] {
            for i in 0..50u32 {
                ks.insert(format!("k{i:03}"), format!("v{i}")).unwrap();
            }
            for i in (0..50u32).step_by(3) {
                ks.insert(format!("k{i:03}"), format!("again{i}")).unwrap();
            }
            for i in (0..50u32).step_by(7) {
                ks.remove(format!("k{i:03}")).unwrap();
            }
            if flush {
                ks.rotate_memtable_and_wait().unwrap();
                ks.insert("after-flush", "in the memtable").unwrap();
                ks.remove("k001").unwrap();
            }
            let snapshot = src.snapshot();
            let expected: Vec<(Vec<u8>, Vec<u8>)> =
                snapshot.iter(&ks).map(|g| g.into_inner().map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap()).collect();
            ks.insert("k000", "written after the snapshot").unwrap();
            ks.insert("late", "written after the snapshot").unwrap();
            let mut files = KeyspaceFiles::export(&ks, &snapshot, Vec::new()).unwrap();
            assert_eq!(files.manifest().files().next().is_some(), flush);
            let manifest = files.manifest().clone();
            let records: Vec<(Bytes, Bytes)> =
                std::iter::from_fn(|| files.next_piece()).map(|p| p.and_then(FilePiece::into_record).unwrap()).collect();
            let dst = open(if flush { "dst-tables" } else { "dst-journal" });
            let to = dst.keyspace("ks", opts).unwrap();
            import_small_keyspace(&dst, &to, &manifest, records.iter().cloned().map(Ok)).unwrap();
            let got: Vec<(Vec<u8>, Vec<u8>)> = to.iter().map(|g| g.into_inner().map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap()).collect();
            assert_eq!(got, expected, "flushed: {flush}");
            assert!(!expected.is_empty());
            // Only an empty keyspace adopts a copy.
            assert!(import_small_keyspace(&dst, &to, &manifest, records.iter().cloned().map(Ok)).is_err());
            assert_eq!(to.iter().count(), expected.len());
        }
    }

    /// Copies adopted as one group ([`KeyspaceImports`]): a copy of memtable items and a
    /// copy with files land in their keyspaces with what each source held at its snapshot;
    /// the items are written only at the commit; a keyspace twice in one group, or one not
    /// empty, is refused.
    #[test]
    fn a_group_of_copies_lands_at_its_commit_with_what_each_snapshot_held() {
        use fjall::Readable as _;
        let dir = tempfile::tempdir().unwrap();
        let open = |name: &str| fjall::Database::builder(dir.path().join(name)).open().unwrap();
        let opts = fjall::KeyspaceCreateOptions::default;
        let src = open("src");
        let contents = |ks: &fjall::Keyspace| -> Vec<(Vec<u8>, Vec<u8>)> {
            ks.iter().map(|g| g.into_inner().map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap()).collect()
        };
        let mut exports = Vec::new();
        for (name, flush) in [("small", false), ("tables", true), ("small2", false)] {
            let ks = src.keyspace(name, opts).unwrap();
            for i in 0..30u32 {
                ks.insert(format!("{name}{i:03}"), format!("v{i}")).unwrap();
            }
            ks.remove(format!("{name}004")).unwrap();
            if flush {
                ks.rotate_memtable_and_wait().unwrap();
            }
            let snapshot = src.snapshot();
            let expected: Vec<(Vec<u8>, Vec<u8>)> =
                snapshot.iter(&ks).map(|g| g.into_inner().map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap()).collect();
            let mut files = KeyspaceFiles::export(&ks, &snapshot, Vec::new()).unwrap();
            let manifest = files.manifest().clone();
            let records: Vec<(Bytes, Bytes)> =
                std::iter::from_fn(|| files.next_piece()).map(|p| p.and_then(FilePiece::into_record).unwrap()).collect();
            exports.push((name, manifest, records, expected));
        }
        let dst = open("dst");
        let mut group = KeyspaceImports::new(&dst);
        let mut targets = Vec::new();
        for (name, manifest, records, _) in &exports {
            let to = dst.keyspace(name, opts).unwrap();
            group.add(&to, manifest, records.iter().cloned().map(Ok)).unwrap();
            targets.push(to);
        }
        // Staged, not written: the memtable-only copies are not there before the commit.
        assert!(targets[0].is_empty().unwrap() && targets[2].is_empty().unwrap());
        assert!(!targets[1].is_empty().unwrap(), "a copy with files is adopted as it comes");
        let (_, manifest, records, _) = &exports[0];
        assert!(group.add(&targets[0], manifest, records.iter().cloned().map(Ok)).is_err(), "one keyspace twice");
        group.commit().unwrap();
        for (to, (name, _, _, expected)) in targets.iter().zip(&exports) {
            assert_eq!(&contents(to), expected, "{name}");
            assert_eq!(expected.len(), 29);
        }
        // Only an empty keyspace adopts a copy.
        let mut again = KeyspaceImports::new(&dst);
        assert!(again.add(&targets[0], manifest, records.iter().cloned().map(Ok)).is_err());
        again.commit().unwrap();
        assert_eq!(contents(&targets[0]).len(), 29);
    }

    /// Both ways of writing a received file leave exactly its bytes, whatever the sizes of
    /// the chunks and of the file (empty, under a block, across the staging buffer), the
    /// files in turn sharing one staging buffer (each finds the last one's bytes in it).
    #[test]
    fn a_received_file_holds_exactly_its_bytes_written_directly_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut staging = Vec::new();
        let sizes = [0, 1, DIRECT_ALIGN - 1, DIRECT_ALIGN, DIRECT_WRITE_BYTES + 17, 3 * DIRECT_WRITE_BYTES];
        for direct in [true, false] {
            for (i, size) in sizes.into_iter().enumerate() {
                let bytes: Vec<u8> = (0..size).map(|j| (j * 31 + i) as u8).collect();
                let path = dir.path().join(format!("{direct}-{i}"));
                let mut out = FileOut::create(&path, direct, &mut staging).unwrap();
                // Where this file system takes direct I/O, a direct file is written so.
                let probe = dir.path().join("probe");
                let takes_direct = open_direct(&probe).unwrap().is_some();
                let _ = std::fs::remove_file(&probe);
                assert_eq!(matches!(out, FileOut::Direct { .. }), direct && takes_direct);
                for chunk in bytes.chunks(DIRECT_ALIGN * 3 + 5) {
                    out.write(chunk).unwrap();
                }
                out.finish().unwrap();
                staging = out.into_staging();
                assert_eq!(std::fs::read(&path).unwrap(), bytes, "direct {direct}, {size} bytes");
                assert!(FileOut::create(&path, direct, &mut Vec::new()).is_err(), "a file already there is refused");
            }
        }
    }
}
