//! The in-memory filesystem: inodes, directories, page-granular file contents and the
//! per-file undo log that gives LazyFS's power-loss semantics.
//!
//! Everything here is plain data behind one mutex; the FUSE layer (`fuse.rs`) only
//! translates requests into these calls, so the model is unit-tested without a mount.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::time::SystemTime;

use fuser::{Errno, FileAttr, FileType, INodeNo};

use crate::{FaultFsOptions, FaultFsStats, PowerCutReport};

/// Size of one page of file data, and the block size statfs and stat report. Contents,
/// capacity and the undo log all work in whole pages, as LazyFS's page cache does.
pub const PAGE_SIZE: u64 = 4096;

/// Longest file name accepted, the same as ext4's, so programs see familiar limits.
pub(crate) const NAME_MAX: usize = 255;

/// Largest file length accepted (the largest offset FUSE and `off_t` can express).
const FILE_SIZE_MAX: u64 = i64::MAX as u64;

/// Number of inodes statfs reports as the total: the model has no inode table to fill,
/// so report a large, fixed figure from which the inodes in use are subtracted.
const STATFS_FILES: u64 = 1 << 32;

/// `st_blocks` counts 512-byte units whatever the block size.
const STAT_BLOCK_UNIT: u64 = 512;

/// Size directories report in `st_size`; any value works, ext4 shows one block.
const DIR_SIZE: u64 = PAGE_SIZE;

const PAGE_LEN: usize = PAGE_SIZE as usize;

type Page = Box<[u8; PAGE_LEN]>;

fn zero_page() -> Page {
    Box::new([0; PAGE_LEN])
}

/// What a file looked like at its last fsync, kept only for the pages changed since.
#[derive(Debug)]
struct Undo {
    /// The file length at the last fsync.
    len: u64,
    /// For each page changed since the last fsync, its durable content (`None`: it was a
    /// hole, or beyond the end of the file).
    pages: HashMap<u64, Option<Page>>,
}

/// A regular file. Invariant: no page lies wholly at or beyond `len`, and the bytes of
/// the last page past `len` are zero, so extending a file never exposes stale bytes.
#[derive(Debug, Default)]
struct FileData {
    len: u64,
    pages: BTreeMap<u64, Page>,
    /// `None` while everything is durable (nothing changed since the last fsync).
    undo: Option<Undo>,
}

impl FileData {
    /// Starts the undo log at the current (durable) length if it is not running yet.
    fn undo(&mut self) -> &mut Undo {
        let len = self.len;
        self.undo.get_or_insert_with(|| Undo { len, pages: HashMap::new() })
    }

    /// Remembers page `idx`'s durable content before its first change since the last fsync.
    fn remember(&mut self, idx: u64) {
        let len = self.len;
        let undo = self.undo.get_or_insert_with(|| Undo { len, pages: HashMap::new() });
        undo.pages.entry(idx).or_insert_with(|| self.pages.get(&idx).cloned());
    }

    fn holes_in(&self, first: u64, last: u64) -> u64 {
        let present = self.pages.range(first..=last).count() as u64;
        (last - first + 1) - present
    }
}

#[derive(Debug)]
struct DirEntry {
    ino: u64,
    /// The readdir offset of this entry: assigned once, never reused, so a reader that
    /// deletes entries while it lists the directory neither skips nor repeats any.
    cookie: u64,
}

#[derive(Debug)]
struct Dir {
    parent: u64,
    entries: BTreeMap<OsString, DirEntry>,
    by_cookie: BTreeMap<u64, OsString>,
    next_cookie: u64,
}

/// Readdir offsets 1 and 2 are "." and ".."; entries start after them.
const FIRST_COOKIE: u64 = 3;

impl Dir {
    fn new(parent: u64) -> Dir {
        Dir { parent, entries: BTreeMap::new(), by_cookie: BTreeMap::new(), next_cookie: FIRST_COOKIE }
    }

    fn insert(&mut self, name: OsString, ino: u64) {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        self.by_cookie.insert(cookie, name.clone());
        if let Some(old) = self.entries.insert(name, DirEntry { ino, cookie }) {
            self.by_cookie.remove(&old.cookie);
        }
    }

    fn remove(&mut self, name: &OsStr) -> Option<u64> {
        let entry = self.entries.remove(name)?;
        self.by_cookie.remove(&entry.cookie);
        Some(entry.ino)
    }

    fn get(&self, name: &OsStr) -> Option<u64> {
        self.entries.get(name).map(|e| e.ino)
    }
}

#[derive(Debug)]
enum Kind {
    File(FileData),
    Dir(Dir),
}

#[derive(Debug)]
struct Node {
    kind: Kind,
    perm: u16,
    uid: u32,
    gid: u32,
    nlink: u32,
    /// References the kernel holds (each entry reply adds one, forget removes them): an
    /// unlinked node lives until the kernel forgets it, so open files keep working.
    nlookup: u64,
    /// Open handles (including memory maps: the kernel releases after the last munmap).
    /// An unlinked file's data is freed when the last one goes, as ext4 frees its blocks,
    /// without waiting for the kernel's forget, which comes whenever the kernel likes.
    opens: u64,
    atime: SystemTime,
    mtime: SystemTime,
    ctime: SystemTime,
    crtime: SystemTime,
}

impl Node {
    fn new(kind: Kind, perm: u16, uid: u32, gid: u32) -> Node {
        let now = SystemTime::now();
        let nlink = if matches!(kind, Kind::Dir(_)) { 2 } else { 1 };
        Node { kind, perm, uid, gid, nlink, nlookup: 0, opens: 0, atime: now, mtime: now, ctime: now, crtime: now }
    }

    fn file_mut(&mut self) -> Result<&mut FileData, Errno> {
        match &mut self.kind {
            Kind::File(f) => Ok(f),
            Kind::Dir(_) => Err(Errno::EISDIR),
        }
    }

    fn file(&self) -> Result<&FileData, Errno> {
        match &self.kind {
            Kind::File(f) => Ok(f),
            Kind::Dir(_) => Err(Errno::EISDIR),
        }
    }

    fn dir(&self) -> Result<&Dir, Errno> {
        match &self.kind {
            Kind::Dir(d) => Ok(d),
            Kind::File(_) => Err(Errno::ENOTDIR),
        }
    }

    fn dir_mut(&mut self) -> Result<&mut Dir, Errno> {
        match &mut self.kind {
            Kind::Dir(d) => Ok(d),
            Kind::File(_) => Err(Errno::ENOTDIR),
        }
    }

    fn is_dir(&self) -> bool {
        matches!(self.kind, Kind::Dir(_))
    }

    fn touch_modified(&mut self) {
        let now = SystemTime::now();
        self.mtime = now;
        self.ctime = now;
    }
}

/// Who creates a node: the caller's ids become its owner.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// Attribute changes of one setattr request.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SystemTime>,
    pub mtime: Option<SystemTime>,
}

/// One readdir entry.
#[derive(Debug)]
pub(crate) struct Listed {
    pub ino: u64,
    pub offset: u64,
    pub kind: FileType,
    pub name: OsString,
}

/// The whole filesystem, including its fault switches and counters.
#[derive(Debug)]
pub(crate) struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    /// Capacity in whole pages.
    capacity_pages: u64,
    /// Pages holding data, across all files (unlinked but still open ones too).
    allocated_pages: u64,
    fail_fsync: bool,
    fail_writes: bool,
    stats: FaultFsStats,
}

pub(crate) const ROOT: u64 = INodeNo::ROOT.0;

impl State {
    pub(crate) fn new(options: &FaultFsOptions) -> State {
        let mut nodes = HashMap::new();
        let mut root = Node::new(Kind::Dir(Dir::new(ROOT)), options.root_mode, options.uid, options.gid);
        // The kernel holds the root from mount to unmount and never forgets it.
        root.nlookup = 1;
        nodes.insert(ROOT, root);
        State {
            nodes,
            next_ino: ROOT + 1,
            capacity_pages: options.capacity_bytes / PAGE_SIZE,
            allocated_pages: 0,
            fail_fsync: false,
            fail_writes: false,
            stats: FaultFsStats::default(),
        }
    }

    // ---- fault switches and observations ----

    pub(crate) fn set_capacity(&mut self, bytes: u64) {
        self.capacity_pages = bytes / PAGE_SIZE;
    }

    pub(crate) fn capacity_bytes(&self) -> u64 {
        self.capacity_pages * PAGE_SIZE
    }

    pub(crate) fn used_bytes(&self) -> u64 {
        self.allocated_pages * PAGE_SIZE
    }

    pub(crate) fn set_fail_fsync(&mut self, fail: bool) {
        self.fail_fsync = fail;
    }

    pub(crate) fn set_fail_writes(&mut self, fail: bool) {
        self.fail_writes = fail;
    }

    pub(crate) fn stats(&self) -> FaultFsStats {
        self.stats
    }

    pub(crate) fn unsynced_bytes(&self) -> u64 {
        self.files().filter_map(|f| f.undo.as_ref()).map(|u| u.pages.len() as u64 * PAGE_SIZE).sum()
    }

    fn files(&self) -> impl Iterator<Item = &FileData> {
        self.nodes.values().filter_map(|n| match &n.kind {
            Kind::File(f) => Some(f),
            Kind::Dir(_) => None,
        })
    }

    /// Reverts every file to its content and length at its last fsync. Returns what was
    /// reverted and the inodes whose kernel caches must be dropped.
    pub(crate) fn power_cut(&mut self) -> (PowerCutReport, Vec<u64>) {
        let mut report = PowerCutReport::default();
        let mut changed = Vec::new();
        let mut allocated = self.allocated_pages;
        for (&ino, node) in &mut self.nodes {
            let Kind::File(file) = &mut node.kind else { continue };
            let Some(undo) = file.undo.take() else { continue };
            report.files += 1;
            report.pages += undo.pages.len() as u64;
            for (idx, page) in undo.pages {
                match page {
                    Some(page) => {
                        if file.pages.insert(idx, page).is_none() {
                            allocated += 1;
                        }
                    }
                    None => {
                        if file.pages.remove(&idx).is_some() {
                            allocated -= 1;
                        }
                    }
                }
            }
            file.len = undo.len;
            debug_assert!(file.pages.range(file.len.div_ceil(PAGE_SIZE)..).next().is_none());
            changed.push(ino);
        }
        self.allocated_pages = allocated;
        self.stats.power_cuts += 1;
        (report, changed)
    }

    /// Marks every file durable, as a clean `sync` followed by a clean shutdown would.
    pub(crate) fn sync_all(&mut self) {
        for node in self.nodes.values_mut() {
            if let Kind::File(file) = &mut node.kind {
                file.undo = None;
            }
        }
    }

    // ---- lookups and attributes ----

    fn node(&self, ino: u64) -> Result<&Node, Errno> {
        self.nodes.get(&ino).ok_or(Errno::ENOENT)
    }

    fn node_mut(&mut self, ino: u64) -> Result<&mut Node, Errno> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    pub(crate) fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        let node = self.node(ino)?;
        let (kind, size, blocks) = match &node.kind {
            Kind::File(f) => (FileType::RegularFile, f.len, f.pages.len() as u64 * (PAGE_SIZE / STAT_BLOCK_UNIT)),
            Kind::Dir(_) => (FileType::Directory, DIR_SIZE, DIR_SIZE / STAT_BLOCK_UNIT),
        };
        Ok(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks,
            atime: node.atime,
            mtime: node.mtime,
            ctime: node.ctime,
            crtime: node.crtime,
            kind,
            perm: node.perm,
            nlink: node.nlink,
            uid: node.uid,
            gid: node.gid,
            rdev: 0,
            blksize: PAGE_SIZE as u32,
            flags: 0,
        })
    }

    /// Looks `name` up in `parent` and takes a kernel reference on what it finds.
    pub(crate) fn lookup(&mut self, parent: u64, name: &OsStr) -> Result<FileAttr, Errno> {
        check_name(name)?;
        let ino = self.node(parent)?.dir()?.get(name).ok_or(Errno::ENOENT)?;
        self.node_mut(ino)?.nlookup += 1;
        self.attr(ino)
    }

    pub(crate) fn forget(&mut self, ino: u64, nlookup: u64) {
        if ino == ROOT {
            return;
        }
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.nlookup = node.nlookup.saturating_sub(nlookup);
        }
        self.free_if_unreferenced(ino);
    }

    /// Drops a node that has no name left and that the kernel no longer references, and
    /// the data of a file that has no name and no open handle left.
    fn free_if_unreferenced(&mut self, ino: u64) {
        let Some(node) = self.nodes.get_mut(&ino) else { return };
        if node.nlink != 0 {
            return;
        }
        if node.opens == 0 {
            if let Kind::File(f) = &mut node.kind {
                self.allocated_pages -= f.pages.len() as u64;
                *f = FileData::default();
            }
        }
        if node.nlookup == 0 {
            self.nodes.remove(&ino);
        }
    }

    /// A file was opened (open or create).
    pub(crate) fn opened(&mut self, ino: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.opens += 1;
        }
    }

    /// A file handle was released.
    pub(crate) fn released(&mut self, ino: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.opens = node.opens.saturating_sub(1);
        }
        self.free_if_unreferenced(ino);
    }

    pub(crate) fn setattr(&mut self, ino: u64, change: SetAttr) -> Result<FileAttr, Errno> {
        if let Some(size) = change.size {
            self.set_len(ino, size)?;
        }
        let node = self.node_mut(ino)?;
        let now = SystemTime::now();
        if let Some(mode) = change.mode {
            node.perm = (mode & 0o7777) as u16;
            node.ctime = now;
        }
        if let Some(uid) = change.uid {
            node.uid = uid;
            node.ctime = now;
        }
        if let Some(gid) = change.gid {
            node.gid = gid;
            node.ctime = now;
        }
        if let Some(atime) = change.atime {
            node.atime = atime;
            node.ctime = now;
        }
        if let Some(mtime) = change.mtime {
            node.mtime = mtime;
            node.ctime = now;
        }
        self.attr(ino)
    }

    /// Truncates or extends a file. Extending is sparse (as on ext4 or xfs): it allocates
    /// no pages, so it never fails for want of space.
    pub(crate) fn set_len(&mut self, ino: u64, new_len: u64) -> Result<(), Errno> {
        if new_len > FILE_SIZE_MAX {
            return Err(Errno::EFBIG);
        }
        let node = self.node_mut(ino)?;
        let file = node.file_mut()?;
        if new_len == file.len {
            node.touch_modified();
            return Ok(());
        }
        file.undo();
        let mut freed = 0;
        if new_len < file.len {
            let removed = file.pages.split_off(&new_len.div_ceil(PAGE_SIZE));
            freed = removed.len() as u64;
            if let Some(undo) = file.undo.as_mut() {
                for (idx, page) in removed {
                    undo.pages.entry(idx).or_insert(Some(page));
                }
            }
            let tail = (new_len % PAGE_SIZE) as usize;
            let last = new_len / PAGE_SIZE;
            if tail != 0 && file.pages.contains_key(&last) {
                file.remember(last);
                if let Some(page) = file.pages.get_mut(&last) {
                    page[tail..].fill(0);
                }
            }
        }
        file.len = new_len;
        node.touch_modified();
        self.allocated_pages -= freed;
        Ok(())
    }

    // ---- namespace ----

    fn new_node(&mut self, parent: u64, name: &OsStr, node: Node) -> Result<FileAttr, Errno> {
        check_name(name)?;
        let is_dir = node.is_dir();
        if self.node(parent)?.dir()?.get(name).is_some() {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.node_mut(parent)?.dir_mut()?.insert(name.to_owned(), ino);
        let parent_node = self.node_mut(parent)?;
        parent_node.touch_modified();
        if is_dir {
            parent_node.nlink += 1;
        }
        let mut node = node;
        node.nlookup = 1;
        self.nodes.insert(ino, node);
        self.attr(ino)
    }

    pub(crate) fn create_file(&mut self, parent: u64, name: &OsStr, mode: u32, umask: u32, caller: Caller) -> Result<FileAttr, Errno> {
        let perm = (mode & !umask & 0o7777) as u16;
        self.new_node(parent, name, Node::new(Kind::File(FileData::default()), perm, caller.uid, caller.gid))
    }

    pub(crate) fn mkdir(&mut self, parent: u64, name: &OsStr, mode: u32, umask: u32, caller: Caller) -> Result<FileAttr, Errno> {
        let perm = (mode & !umask & 0o7777) as u16;
        self.new_node(parent, name, Node::new(Kind::Dir(Dir::new(parent)), perm, caller.uid, caller.gid))
    }

    pub(crate) fn unlink(&mut self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        check_name(name)?;
        let ino = self.node(parent)?.dir()?.get(name).ok_or(Errno::ENOENT)?;
        if self.node(ino)?.is_dir() {
            return Err(Errno::EISDIR);
        }
        self.node_mut(parent)?.dir_mut()?.remove(name);
        self.node_mut(parent)?.touch_modified();
        let node = self.node_mut(ino)?;
        node.nlink = node.nlink.saturating_sub(1);
        node.ctime = SystemTime::now();
        self.free_if_unreferenced(ino);
        Ok(())
    }

    pub(crate) fn rmdir(&mut self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        check_name(name)?;
        let ino = self.node(parent)?.dir()?.get(name).ok_or(Errno::ENOENT)?;
        if !self.node(ino)?.dir()?.entries.is_empty() {
            return Err(Errno::ENOTEMPTY);
        }
        self.node_mut(parent)?.dir_mut()?.remove(name);
        let parent_node = self.node_mut(parent)?;
        parent_node.touch_modified();
        parent_node.nlink = parent_node.nlink.saturating_sub(1);
        self.node_mut(ino)?.nlink = 0;
        self.free_if_unreferenced(ino);
        Ok(())
    }

    /// Renames with the semantics of rename(2), and of renameat2 with `RENAME_NOREPLACE`.
    pub(crate) fn rename(&mut self, parent: u64, name: &OsStr, new_parent: u64, new_name: &OsStr, no_replace: bool) -> Result<(), Errno> {
        check_name(name)?;
        check_name(new_name)?;
        let ino = self.node(parent)?.dir()?.get(name).ok_or(Errno::ENOENT)?;
        let target = self.node(new_parent)?.dir()?.get(new_name);
        if target == Some(ino) {
            return Ok(());
        }
        let moving_dir = self.node(ino)?.is_dir();
        if let Some(target) = target {
            if no_replace {
                return Err(Errno::EEXIST);
            }
            let target_node = self.node(target)?;
            match (moving_dir, target_node.is_dir()) {
                (true, false) => return Err(Errno::ENOTDIR),
                (false, true) => return Err(Errno::EISDIR),
                (true, true) if !target_node.dir()?.entries.is_empty() => return Err(Errno::ENOTEMPTY),
                _ => {}
            }
        }
        if moving_dir && parent != new_parent {
            // A directory must not move into itself or below itself.
            let mut at = new_parent;
            loop {
                if at == ino {
                    return Err(Errno::EINVAL);
                }
                if at == ROOT {
                    break;
                }
                at = self.node(at)?.dir()?.parent;
            }
        }
        if let Some(target) = target {
            self.node_mut(new_parent)?.dir_mut()?.remove(new_name);
            if moving_dir {
                self.node_mut(target)?.nlink = 0;
                let np = self.node_mut(new_parent)?;
                np.nlink = np.nlink.saturating_sub(1);
            } else {
                let t = self.node_mut(target)?;
                t.nlink = t.nlink.saturating_sub(1);
                t.ctime = SystemTime::now();
            }
            self.free_if_unreferenced(target);
        }
        self.node_mut(parent)?.dir_mut()?.remove(name);
        self.node_mut(new_parent)?.dir_mut()?.insert(new_name.to_owned(), ino);
        self.node_mut(parent)?.touch_modified();
        self.node_mut(new_parent)?.touch_modified();
        if moving_dir && parent != new_parent {
            let p = self.node_mut(parent)?;
            p.nlink = p.nlink.saturating_sub(1);
            self.node_mut(new_parent)?.nlink += 1;
            self.node_mut(ino)?.dir_mut()?.parent = new_parent;
        }
        self.node_mut(ino)?.ctime = SystemTime::now();
        Ok(())
    }

    /// Lists `ino` from readdir offset `offset` on, calling `add` for each entry until it
    /// answers that the reply buffer is full.
    pub(crate) fn readdir(&self, ino: u64, offset: u64, mut add: impl FnMut(Listed) -> bool) -> Result<(), Errno> {
        let dir = self.node(ino)?.dir()?;
        let dots = [(1, ino, "."), (2, dir.parent, "..")];
        for (off, entry_ino, name) in dots {
            if offset < off && add(Listed { ino: entry_ino, offset: off, kind: FileType::Directory, name: name.into() }) {
                return Ok(());
            }
        }
        for (&cookie, name) in dir.by_cookie.range(offset.max(FIRST_COOKIE - 1) + 1..) {
            let Some(entry) = dir.entries.get(name) else { continue };
            let kind = if self.node(entry.ino)?.is_dir() { FileType::Directory } else { FileType::RegularFile };
            if add(Listed { ino: entry.ino, offset: cookie, kind, name: name.clone() }) {
                break;
            }
        }
        Ok(())
    }

    pub(crate) fn check_dir(&self, ino: u64) -> Result<(), Errno> {
        self.node(ino)?.dir().map(|_| ())
    }

    pub(crate) fn check_file(&self, ino: u64) -> Result<(), Errno> {
        self.node(ino)?.file().map(|_| ())
    }

    // ---- data ----

    pub(crate) fn read(&mut self, ino: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        let node = self.node_mut(ino)?;
        let file = node.file()?;
        if offset >= file.len || size == 0 {
            return Ok(Vec::new());
        }
        let end = file.len.min(offset.saturating_add(u64::from(size)));
        let mut out = vec![0; (end - offset) as usize];
        let mut pos = offset;
        while pos < end {
            let idx = pos / PAGE_SIZE;
            let in_page = (pos % PAGE_SIZE) as usize;
            let n = ((PAGE_SIZE - pos % PAGE_SIZE).min(end - pos)) as usize;
            let at = (pos - offset) as usize;
            if let Some(page) = file.pages.get(&idx) {
                out[at..at + n].copy_from_slice(&page[in_page..in_page + n]);
            }
            pos += n as u64;
        }
        node.atime = SystemTime::now();
        Ok(out)
    }

    pub(crate) fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<u32, Errno> {
        if self.fail_writes {
            self.stats.failed_writes += 1;
            return Err(Errno::EIO);
        }
        let written = u32::try_from(data.len()).map_err(|_| Errno::EINVAL)?;
        if data.is_empty() {
            return Ok(0);
        }
        let end = offset.checked_add(data.len() as u64).filter(|&e| e <= FILE_SIZE_MAX).ok_or(Errno::EFBIG)?;
        let capacity = self.capacity_pages;
        let allocated = self.allocated_pages;
        let node = self.node_mut(ino)?;
        let file = node.file_mut()?;
        let (first, last) = (offset / PAGE_SIZE, (end - 1) / PAGE_SIZE);
        let new_pages = file.holes_in(first, last);
        if allocated + new_pages > capacity {
            self.stats.enospc_errors += 1;
            return Err(Errno::ENOSPC);
        }
        let mut pos = offset;
        while pos < end {
            let idx = pos / PAGE_SIZE;
            let in_page = (pos % PAGE_SIZE) as usize;
            let n = ((PAGE_SIZE - pos % PAGE_SIZE).min(end - pos)) as usize;
            let at = (pos - offset) as usize;
            file.remember(idx);
            let page = file.pages.entry(idx).or_insert_with(zero_page);
            page[in_page..in_page + n].copy_from_slice(&data[at..at + n]);
            pos += n as u64;
        }
        file.len = file.len.max(end);
        node.touch_modified();
        self.allocated_pages += new_pages;
        self.stats.writes += 1;
        self.stats.bytes_written += data.len() as u64;
        Ok(written)
    }

    /// fallocate(2) mode 0: allocates (zero-filled) every page of the range, extending
    /// the file if the range ends past it. Other modes are not simulated.
    pub(crate) fn fallocate(&mut self, ino: u64, offset: u64, length: u64, mode: i32) -> Result<(), Errno> {
        if mode != 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        if length == 0 {
            return Err(Errno::EINVAL);
        }
        let end = offset.checked_add(length).filter(|&e| e <= FILE_SIZE_MAX).ok_or(Errno::EFBIG)?;
        let capacity = self.capacity_pages;
        let allocated = self.allocated_pages;
        let node = self.node_mut(ino)?;
        let file = node.file_mut()?;
        let (first, last) = (offset / PAGE_SIZE, (end - 1) / PAGE_SIZE);
        let new_pages = file.holes_in(first, last);
        if allocated + new_pages > capacity {
            self.stats.enospc_errors += 1;
            return Err(Errno::ENOSPC);
        }
        if new_pages > 0 {
            for idx in first..=last {
                if !file.pages.contains_key(&idx) {
                    file.remember(idx);
                    file.pages.insert(idx, zero_page());
                }
            }
        }
        if end > file.len {
            file.undo();
            file.len = end;
            node.touch_modified();
        }
        self.allocated_pages += new_pages;
        Ok(())
    }

    /// fsync and fdatasync: the file's current content becomes its durable content.
    pub(crate) fn fsync(&mut self, ino: u64) -> Result<(), Errno> {
        if self.fail_fsync {
            self.stats.failed_fsyncs += 1;
            return Err(Errno::EIO);
        }
        self.node_mut(ino)?.file_mut()?.undo = None;
        self.stats.fsyncs += 1;
        Ok(())
    }

    /// fsync of a directory: names are durable at once, so this only answers (and fails
    /// while fsyncs are switched to fail, as a failing disk would).
    pub(crate) fn fsyncdir(&mut self, ino: u64) -> Result<(), Errno> {
        self.check_dir(ino)?;
        if self.fail_fsync {
            self.stats.failed_fsyncs += 1;
            return Err(Errno::EIO);
        }
        self.stats.dir_fsyncs += 1;
        Ok(())
    }

    /// statfs figures: (total blocks, free blocks, total inodes, free inodes).
    pub(crate) fn statfs(&self) -> (u64, u64, u64, u64) {
        let free = self.capacity_pages.saturating_sub(self.allocated_pages);
        let inodes = self.nodes.len() as u64;
        (self.capacity_pages, free, STATFS_FILES, STATFS_FILES.saturating_sub(inodes))
    }
}

fn check_name(name: &OsStr) -> Result<(), Errno> {
    if name.len() > NAME_MAX {
        return Err(Errno::ENAMETOOLONG);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: Caller = Caller { uid: 0, gid: 0 };

    fn state() -> State {
        State::new(&FaultFsOptions::default())
    }

    fn file(s: &mut State, name: &str) -> u64 {
        s.create_file(ROOT, OsStr::new(name), 0o644, 0o022, ME).unwrap().ino.0
    }

    fn content(s: &mut State, ino: u64) -> Vec<u8> {
        s.read(ino, 0, u32::MAX).unwrap()
    }

    #[test]
    fn unsynced_write_to_new_file_is_reverted() {
        let mut s = state();
        let f = file(&mut s, "a");
        s.write(f, 0, b"hello").unwrap();
        assert_eq!(s.unsynced_bytes(), PAGE_SIZE);
        let (report, changed) = s.power_cut();
        assert_eq!((report.files, report.pages, changed), (1, 1, vec![f]));
        assert_eq!(s.attr(f).unwrap().size, 0);
        assert_eq!(s.used_bytes(), 0);
    }

    #[test]
    fn synced_pages_survive_and_overwrites_are_undone() {
        let mut s = state();
        let f = file(&mut s, "a");
        let first = vec![1u8; 3 * PAGE_LEN + 10];
        s.write(f, 0, &first).unwrap();
        s.fsync(f).unwrap();
        assert_eq!(s.unsynced_bytes(), 0);
        s.write(f, PAGE_SIZE + 5, &[2; 100]).unwrap();
        s.write(f, 10 * PAGE_SIZE, &[3; 10]).unwrap();
        s.set_len(f, 2).unwrap();
        s.power_cut();
        assert_eq!(content(&mut s, f), first);
        assert_eq!(s.used_bytes(), 4 * PAGE_SIZE);
    }

    #[test]
    fn truncate_zeroes_the_tail_so_extension_reads_zeros() {
        let mut s = state();
        let f = file(&mut s, "a");
        s.write(f, 0, &[7; 100]).unwrap();
        s.set_len(f, 10).unwrap();
        s.set_len(f, 100).unwrap();
        let c = content(&mut s, f);
        assert_eq!(&c[..10], &[7; 10]);
        assert!(c[10..].iter().all(|&b| b == 0));
    }

    #[test]
    fn capacity_counts_allocated_pages_and_sparse_extension_is_free() {
        let mut s = state();
        s.set_capacity(2 * PAGE_SIZE);
        let f = file(&mut s, "a");
        s.set_len(f, 64 << 20).unwrap();
        s.write(f, 0, &[1; PAGE_LEN + 1]).unwrap();
        assert_eq!(s.write(f, 5 * PAGE_SIZE, b"x"), Err(Errno::ENOSPC));
        // Overwriting allocated pages needs no space.
        s.write(f, 1, b"abc").unwrap();
        assert_eq!(s.fallocate(f, 0, 3 * PAGE_SIZE, 0), Err(Errno::ENOSPC));
        assert_eq!(s.statfs().1, 0);
        s.set_len(f, 0).unwrap();
        assert_eq!(s.statfs().1, 2);
        assert_eq!(s.stats().enospc_errors, 2);
    }

    #[test]
    fn failing_fsync_keeps_the_undo_log() {
        let mut s = state();
        let f = file(&mut s, "a");
        s.write(f, 0, b"data").unwrap();
        s.set_fail_fsync(true);
        assert_eq!(s.fsync(f), Err(Errno::EIO));
        s.power_cut();
        assert_eq!(s.attr(f).unwrap().size, 0);
    }

    #[test]
    fn readdir_cookies_survive_deletion_while_listing() {
        let mut s = state();
        for i in 0..10 {
            file(&mut s, &format!("f{i}"));
        }
        let mut seen = Vec::new();
        let mut offset = 0;
        loop {
            let mut batch = Vec::new();
            s.readdir(ROOT, offset, |l| {
                batch.push(l);
                batch.len() == 3
            })
            .unwrap();
            let Some(last) = batch.last() else { break };
            offset = last.offset;
            for l in batch {
                if l.name != "." && l.name != ".." {
                    s.unlink(ROOT, &l.name).unwrap();
                }
                seen.push(l.name);
            }
        }
        assert_eq!(seen.len(), 12);
    }

    #[test]
    fn unlinked_file_lives_until_forgotten() {
        let mut s = state();
        let f = file(&mut s, "a");
        s.write(f, 0, b"x").unwrap();
        s.opened(f);
        s.unlink(ROOT, OsStr::new("a")).unwrap();
        assert_eq!(content(&mut s, f), b"x");
        assert_eq!(s.used_bytes(), PAGE_SIZE);
        s.released(f);
        assert_eq!(s.used_bytes(), 0);
        assert_eq!(s.attr(f).unwrap().nlink, 0);
        s.forget(f, 1);
        assert_eq!(s.attr(f), Err(Errno::ENOENT));
    }

    #[test]
    fn rename_rules() {
        let mut s = state();
        let d = s.mkdir(ROOT, OsStr::new("d"), 0o755, 0, ME).unwrap().ino.0;
        let sub = s.mkdir(d, OsStr::new("sub"), 0o755, 0, ME).unwrap().ino.0;
        assert_eq!(s.attr(ROOT).unwrap().nlink, 3);
        assert_eq!(s.rename(ROOT, OsStr::new("d"), sub, OsStr::new("x"), false), Err(Errno::EINVAL));
        file(&mut s, "a");
        file(&mut s, "b");
        assert_eq!(s.rename(ROOT, OsStr::new("a"), ROOT, OsStr::new("b"), true), Err(Errno::EEXIST));
        s.rename(ROOT, OsStr::new("a"), ROOT, OsStr::new("b"), false).unwrap();
        assert_eq!(s.lookup(ROOT, OsStr::new("a")), Err(Errno::ENOENT));
        s.rename(d, OsStr::new("sub"), ROOT, OsStr::new("sub2"), false).unwrap();
        assert_eq!(s.attr(ROOT).unwrap().nlink, 4);
        assert_eq!(s.attr(d).unwrap().nlink, 2);
        assert_eq!(s.rename(ROOT, OsStr::new("d"), ROOT, OsStr::new("b"), false), Err(Errno::ENOTDIR));
        assert_eq!(s.rmdir(ROOT, OsStr::new("d")), Ok(()));
        assert_eq!(s.attr(ROOT).unwrap().nlink, 3);
    }
}
