//! A LazyFS-style fault-injection filesystem for end-to-end tests: an in-memory FUSE
//! filesystem, served by a thread of the test process, that can lose power, fill up and
//! fail fsyncs on command.
//!
//! # Model
//!
//! [`FaultFs::mount`] mounts an empty filesystem at a directory. Programs (the test
//! itself through `std::fs`, or child processes such as a real `shoal serve`) use it as
//! an ordinary local filesystem: directories, regular files, rename, unlink, truncate,
//! `fallocate` (mode 0), `statfs`, `flock`, and reads through `mmap`.
//!
//! File contents live in 4 KiB pages, sparsely. Each file keeps an undo log in the
//! manner of LazyFS: the first change to a page after the file's last `fsync` (or
//! `fdatasync`) records what the page held at that fsync, and the first change of any
//! kind records the file length at that fsync; a successful fsync clears the log.
//! [`MountedFaultFs::power_cut`] plays every log back, so each file holds exactly what it
//! held at its last fsync, as after a power loss with a disk that honours fsync and
//! nothing more.
//!
//! # What is not simulated
//!
//! - **Metadata is durable at once**, as in LazyFS's default mode: creating, renaming and
//!   unlinking files and directories, and file modes and times, survive a power cut
//!   without any fsync. A file created and written but never fsynced survives the cut
//!   empty. Directory fsyncs are answered (and counted) but change nothing.
//! - `sync(2)`, `syncfs(2)`, `sync_file_range(2)` and `close(2)` make nothing durable;
//!   `O_SYNC`/`O_DSYNC` writes do, because the kernel turns them into fsyncs.
//! - Torn pages: a power cut restores whole pages; no page is ever half old, half new.
//! - Symlinks, hard links, device nodes, extended attributes, `fallocate` modes other
//!   than 0 (`EOPNOTSUPP`), `RENAME_EXCHANGE` and `RENAME_WHITEOUT` (`EINVAL`).
//! - Locks: the kernel serves `flock(2)` and `fcntl` locks itself (the FUSE lock
//!   capabilities are not requested), which is exact for processes on this machine.
//!
//! # Space
//!
//! [`MountedFaultFs::set_capacity`] bounds the bytes of allocated pages. Writes that need
//! new pages and `fallocate` fail with `ENOSPC` beyond it, and `statfs` reports the
//! capacity and the free space in 4 KiB blocks. Extending a file with `ftruncate` is
//! sparse, as on ext4 or xfs: it allocates nothing and cannot fail for want of space
//! (fjall, for one, sizes every new journal to 64 MiB with `set_len`). Shrinking frees.
//!
//! # Caching contract
//!
//! Writes reach the filesystem before `write(2)` returns (the FUSE writeback cache is
//! off), so the undo log sees every write that is not still in a program's own buffers.
//! Shared writable `mmap`s are the exception: their dirty pages reach the filesystem
//! only when the kernel writes them back. Reads may be served from the kernel's page
//! cache, and attributes are cached for a second. `power_cut` asks the kernel to drop
//! its caches of every reverted file, and every `open` drops a file's cached pages too.
//!
//! So the contract for a power-cut test is: stop (kill) every process using the mount,
//! call [`MountedFaultFs::power_cut`], then start the processes again. A process that
//! keeps running across the cut may keep state the "machine" lost (its own buffers,
//! open file offsets, mapped pages), which no real power loss allows.
//!
//! # Threads
//!
//! Requests are served one at a time by a background thread of the calling process.
//! Never use the mount from inside that thread (there is no way to, short of a custom
//! filesystem hook). The methods of [`MountedFaultFs`] can be called from any thread at
//! any time. Dropping the handle unmounts (lazily, `MNT_DETACH`), also while a panic
//! unwinds; if a test is killed outright, clean up with `umount -l <dir>`.
//!
//! # Mounting
//!
//! The mount is made with mount(2) on `/dev/fuse`, so it needs root (or `CAP_SYS_ADMIN`)
//! but no `fusermount` and no libfuse.

mod fuse;
mod model;
mod mount;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuser::{BackgroundSession, INodeNo, Notifier, Session, SessionACL};
use parking_lot::Mutex;
use thiserror::Error;

pub use model::PAGE_SIZE;

use model::State;

/// Capacity of a new filesystem unless the options say otherwise: large enough never to
/// matter to a test that does not ask for a full disk (pages are allocated only when
/// written, so the figure costs nothing).
pub const DEFAULT_CAPACITY_BYTES: u64 = 1 << 40;

/// Mode bits of the root directory.
const DEFAULT_ROOT_MODE: u16 = 0o755;

/// How long unmounting waits for the serving thread to end. It ends as soon as the last
/// file open in the mount is closed; a straggler (a child process still holding a file)
/// must not hang the test, so after this the thread is left to end on its own.
const SESSION_END_TIMEOUT: Duration = Duration::from_secs(5);

/// How often unmounting checks whether the serving thread has ended.
const SESSION_END_POLL: Duration = Duration::from_millis(10);

/// Failures to mount or unmount. Faults the filesystem injects reach programs as errno
/// values, never as these.
#[derive(Debug, Error)]
pub enum FaultFsError {
    #[error("mount point {path}: {reason}")]
    BadMountpoint { path: PathBuf, reason: &'static str },
    #[error("mount point {path}: {source}")]
    Mountpoint { path: PathBuf, source: io::Error },
    #[error("cannot open /dev/fuse (FUSE mounts need the fuse module and root): {source}")]
    OpenDevice { source: io::Error },
    #[error("mount(2) at {path} failed (needs root or CAP_SYS_ADMIN): {source}")]
    Mount { path: PathBuf, source: io::Error },
    #[error("FUSE session at {path} did not start: {source}")]
    Session { path: PathBuf, source: io::Error },
    #[error("unmounting {path} failed: {source}")]
    Unmount { path: PathBuf, source: io::Error },
}

/// How to set up a new filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultFsOptions {
    /// Bytes of file data the filesystem may hold (rounded down to whole pages).
    pub capacity_bytes: u64,
    /// Mode bits of the root directory.
    pub root_mode: u16,
    /// Owner of the root directory (default: the calling process's user).
    pub uid: u32,
    /// Group of the root directory (default: the calling process's group).
    pub gid: u32,
}

impl Default for FaultFsOptions {
    fn default() -> Self {
        // SAFETY: getuid and getgid have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        FaultFsOptions { capacity_bytes: DEFAULT_CAPACITY_BYTES, root_mode: DEFAULT_ROOT_MODE, uid, gid }
    }
}

impl FaultFsOptions {
    /// These options with another capacity.
    pub fn with_capacity(mut self, bytes: u64) -> Self {
        self.capacity_bytes = bytes;
        self
    }
}

/// Counters since the mount.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultFsStats {
    /// File fsyncs and fdatasyncs that succeeded (and made data durable).
    pub fsyncs: u64,
    /// File and directory fsyncs answered with `EIO` by [`MountedFaultFs::fail_fsync`].
    pub failed_fsyncs: u64,
    /// Directory fsyncs that succeeded.
    pub dir_fsyncs: u64,
    /// Write requests that succeeded (the kernel may split one write(2) into several).
    pub writes: u64,
    /// Bytes those writes carried.
    pub bytes_written: u64,
    /// Write requests answered with `EIO` by [`MountedFaultFs::fail_writes`].
    pub failed_writes: u64,
    /// Writes and fallocates answered with `ENOSPC`.
    pub enospc_errors: u64,
    /// Power cuts so far.
    pub power_cuts: u64,
}

/// What one power cut reverted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PowerCutReport {
    /// Files that had changed since their last fsync.
    pub files: u64,
    /// Pages put back to their durable content (or dropped, where they were new).
    pub pages: u64,
}

/// Namespace of [`FaultFs::mount`].
#[derive(Debug)]
pub struct FaultFs;

impl FaultFs {
    /// Mounts a new, empty filesystem at `mountpoint` (an existing directory; its own
    /// contents are hidden while mounted) and serves it from a background thread.
    pub fn mount(mountpoint: &Path, options: FaultFsOptions) -> Result<MountedFaultFs, FaultFsError> {
        let path = mountpoint.canonicalize().map_err(|source| FaultFsError::Mountpoint { path: mountpoint.to_owned(), source })?;
        if !path.is_dir() {
            return Err(FaultFsError::BadMountpoint { path, reason: "not a directory" });
        }
        let state = Arc::new(Mutex::new(State::new(&options)));
        let (fd, raw) = mount::mount(&path)?;
        let fs = fuse::FuseFs { state: Arc::clone(&state) };
        let mut config = fuser::Config::default();
        config.acl = SessionACL::All;
        config.n_threads = Some(1);
        // The kernel queued its INIT request at mount time; from_fd answers it.
        let session = Session::from_fd(fs, fd, SessionACL::All, config)
            .and_then(|session| {
                let notifier = session.notifier();
                session.spawn().map(|bg| (notifier, bg))
            })
            .map_err(|source| FaultFsError::Session { path: path.clone(), source });
        let (notifier, session) = match session {
            Ok(started) => started,
            Err(e) => {
                // The mount is useless without a server: take it away again.
                let _ = raw.unmount();
                return Err(e);
            }
        };
        Ok(MountedFaultFs { mountpoint: path, state, notifier, session: Some(session), mount: Some(raw) })
    }
}

/// A mounted filesystem and its fault switches. Dropping it unmounts.
pub struct MountedFaultFs {
    mountpoint: PathBuf,
    state: Arc<Mutex<State>>,
    notifier: Notifier,
    session: Option<BackgroundSession>,
    mount: Option<mount::RawMount>,
}

impl std::fmt::Debug for MountedFaultFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountedFaultFs").field("mountpoint", &self.mountpoint).field("mounted", &self.mount.is_some()).finish()
    }
}

impl MountedFaultFs {
    /// The canonical path of the mount.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Loses power: every file goes back to its content and length at its last fsync.
    /// Names are kept (metadata is not simulated). Stop every process using the mount
    /// first and start them again after (see the crate documentation).
    pub fn power_cut(&self) -> PowerCutReport {
        let (report, changed) = self.state.lock().power_cut();
        // Outside the lock: dropping cached pages may wait for reads the server has yet
        // to answer. An inode the kernel no longer knows has nothing cached (ENOENT).
        for ino in changed {
            let _ = self.notifier.inval_inode(INodeNo(ino), 0, 0);
        }
        report
    }

    /// Makes everything durable, as if every file had been fsynced.
    pub fn sync_all(&self) {
        self.state.lock().sync_all();
    }

    /// Bytes a power cut would revert now, in whole pages.
    pub fn unsynced_bytes(&self) -> u64 {
        self.state.lock().unsynced_bytes()
    }

    /// Bytes of allocated pages.
    pub fn used_bytes(&self) -> u64 {
        self.state.lock().used_bytes()
    }

    /// Sets how many bytes of file data the filesystem may hold (rounded down to whole
    /// pages). Lowering it below what is used fails only new allocations; a power cut
    /// may also bring usage back above it (it restores pages freed by unsynced truncates).
    pub fn set_capacity(&self, bytes: u64) {
        self.state.lock().set_capacity(bytes);
    }

    /// The capacity in bytes (whole pages).
    pub fn capacity(&self) -> u64 {
        self.state.lock().capacity_bytes()
    }

    /// While on, fsync and fdatasync of files and directories answer `EIO`, and the data
    /// stays undurable.
    pub fn fail_fsync(&self, fail: bool) {
        self.state.lock().set_fail_fsync(fail);
    }

    /// While on, writes answer `EIO` and change nothing.
    pub fn fail_writes(&self, fail: bool) {
        self.state.lock().set_fail_writes(fail);
    }

    /// Counters since the mount.
    pub fn stats(&self) -> FaultFsStats {
        self.state.lock().stats()
    }

    /// Successful file fsyncs since the mount.
    pub fn fsyncs(&self) -> u64 {
        self.stats().fsyncs
    }

    /// Unmounts now, reporting failure (dropping unmounts too, silently).
    pub fn unmount(mut self) -> Result<(), FaultFsError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), FaultFsError> {
        let Some(mount) = self.mount.take() else { return Ok(()) };
        if let Err(source) = mount.unmount() {
            // Still mounted: the handle is dropped, which detaches the serving thread
            // (fuser's handle does not stop it), so the mount keeps answering.
            self.session = None;
            return Err(FaultFsError::Unmount { path: self.mountpoint.clone(), source });
        }
        if let Some(session) = self.session.take() {
            let deadline = Instant::now() + SESSION_END_TIMEOUT;
            while !session.guard.is_finished() && Instant::now() < deadline {
                std::thread::sleep(SESSION_END_POLL);
            }
            if session.guard.is_finished() {
                // A session error at this point (the device going away) is the normal end.
                let _ = session.join();
            }
            // Otherwise dropping the handle detaches the thread; it ends with the last
            // file still open in the detached mount.
        }
        Ok(())
    }
}

impl Drop for MountedFaultFs {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
