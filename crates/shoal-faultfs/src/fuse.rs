//! The FUSE face of the model: each request locks the state, calls the model and replies.
//!
//! Every reply is sent after the lock is released, and nothing here ever touches the
//! mount itself, so the serving thread can never wait on its own requests.

use std::ffi::OsStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileHandle, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;

use crate::model::{Caller, SetAttr, State, NAME_MAX, PAGE_SIZE};

/// How long the kernel may trust attributes and names without asking again. Short, so a
/// missed invalidation heals by itself; `power_cut` also invalidates changed inodes.
const TTL: Duration = Duration::from_secs(1);

/// Inode numbers are never reused, so every inode keeps generation 0.
const GENERATION: Generation = Generation(0);

/// The model keeps no per-open state: every handle is 0.
const NO_HANDLE: FileHandle = FileHandle(0);

/// No `FOPEN_DIRECT_IO` (mmap must work through the page cache) and no
/// `FOPEN_KEEP_CACHE` (each open drops the kernel's cached pages of the file, so a process
/// started after a power cut reads what the model holds).
const OPEN_FLAGS: FopenFlags = FopenFlags::empty();

pub(crate) struct FuseFs {
    pub(crate) state: Arc<Mutex<State>>,
}

fn caller(req: &Request) -> Caller {
    Caller { uid: req.uid(), gid: req.gid() }
}

fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

fn empty(reply: ReplyEmpty, result: Result<(), Errno>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

fn entry(reply: ReplyEntry, result: Result<fuser::FileAttr, Errno>) {
    match result {
        Ok(attr) => reply.entry(&TTL, &attr, GENERATION),
        Err(e) => reply.error(e),
    }
}

impl Filesystem for FuseFs {
    // `init` keeps fuser's defaults on purpose: no FUSE_WRITEBACK_CACHE (every write reaches
    // the model before write(2) returns), and neither FUSE_FLOCK_LOCKS nor FUSE_POSIX_LOCKS,
    // so the kernel serves flock(2) and fcntl locks itself, correctly for one machine.

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let result = self.state.lock().lookup(parent.0, name);
        entry(reply, result);
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.state.lock().forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let result = self.state.lock().attr(ino.0);
        match result {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let change = SetAttr { mode, uid, gid, size, atime: atime.map(time), mtime: mtime.map(time) };
        let result = self.state.lock().setattr(ino.0, change);
        match result {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, _rdev: u32, reply: ReplyEntry) {
        // Only regular files: device nodes, fifos and sockets are not simulated.
        if mode & libc::S_IFMT != libc::S_IFREG {
            reply.error(Errno::EPERM);
            return;
        }
        let result = self.state.lock().create_file(parent.0, name, mode, umask, caller(req));
        entry(reply, result);
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        let result = self.state.lock().mkdir(parent.0, name, mode, umask, caller(req));
        entry(reply, result);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let result = self.state.lock().unlink(parent.0, name);
        empty(reply, result);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let result = self.state.lock().rmdir(parent.0, name);
        empty(reply, result);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        // RENAME_EXCHANGE and RENAME_WHITEOUT are not simulated.
        if !(flags - RenameFlags::RENAME_NOREPLACE).is_empty() {
            reply.error(Errno::EINVAL);
            return;
        }
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let result = self.state.lock().rename(parent.0, name, newparent.0, newname, no_replace);
        empty(reply, result);
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let result = {
            let mut state = self.state.lock();
            state.check_file(ino.0).inspect(|()| state.opened(ino.0))
        };
        match result {
            Ok(()) => reply.opened(NO_HANDLE, OPEN_FLAGS),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let result = self.state.lock().read(ino.0, offset, size);
        match result {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let result = self.state.lock().write(ino.0, offset, data);
        match result {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        // close(2) makes nothing durable; there is nothing buffered to hand on.
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.state.lock().released(ino.0);
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        // fdatasync is fsync here: metadata is not simulated, so only data differs.
        let result = self.state.lock().fsync(ino.0);
        empty(reply, result);
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let result = self.state.lock().check_dir(ino.0);
        match result {
            Ok(()) => reply.opened(NO_HANDLE, FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let result = self.state.lock().readdir(ino.0, offset, |l| reply.add(INodeNo(l.ino), l.offset, l.kind, &l.name));
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let result = self.state.lock().fsyncdir(ino.0);
        empty(reply, result);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let (blocks, free, files, ffree) = self.state.lock().statfs();
        reply.statfs(blocks, free, free, files, ffree, PAGE_SIZE as u32, NAME_MAX as u32, PAGE_SIZE as u32);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // Mounted with `default_permissions`: the kernel checks modes before asking.
        reply.ok();
    }

    fn create(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, _flags: i32, reply: ReplyCreate) {
        let result = {
            let mut state = self.state.lock();
            state.create_file(parent.0, name, mode, umask, caller(req)).inspect(|attr| state.opened(attr.ino.0))
        };
        match result {
            Ok(attr) => reply.created(&TTL, &attr, GENERATION, NO_HANDLE, OPEN_FLAGS),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, length: u64, mode: i32, reply: ReplyEmpty) {
        let result = self.state.lock().fallocate(ino.0, offset, length, mode);
        empty(reply, result);
    }
}
