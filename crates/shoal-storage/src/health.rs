//! Whether the store can take writes: the failure model of the storage layer.
//!
//! - **Disk full** (free space on a data path below the reserve, or the engine answered
//!   `ENOSPC`): writes are refused with [`WriteError::DiskFull`] before they reach the
//!   engine, reads go on, and writing resumes by itself once the watchdog sees the reserve
//!   free again. The reserve leaves the engine room to flush and compact what it holds.
//! - **Disk full, engine poisoned**: the engine met `ENOSPC` itself (the disk filled faster
//!   than the watchdog looks, say by another process), and it then refuses every write
//!   until it is reopened (fjall poisons itself on a failed journal write or flush). Writes
//!   are refused as for a full disk; once the space is back the state becomes **restart**:
//!   the server restarts the process (as PostgreSQL's postmaster restarts after a PANIC),
//!   recovering everything acknowledged from the journal.
//! - **Failed** (an fsync failed, or the engine refused a write for an I/O error and is now
//!   poisoned): the node becomes read-only until it is restarted. After a failed fsync the
//!   kernel may have dropped dirty pages that it will never report again (PostgreSQL's
//!   "fsyncgate"), so nothing written since can be trusted to be durable: no write is
//!   acknowledged from then on, not even at `durability=none`.

use std::path::Path;
use std::sync::atomic::{AtomicU8, Ordering};

use parking_lot::Mutex;

use crate::error::WriteError;

const STATE_OK: u8 = 0;
const STATE_DISK_FULL: u8 = 1;
const STATE_DISK_FULL_POISONED: u8 = 2;
const STATE_RESTART: u8 = 3;
const STATE_FAILED: u8 = 4;

/// The storage state as reported by `/v1/health`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageState {
    Ok,
    /// Free space is below the reserve on the named data path (`poisoned`: the engine met
    /// the full disk itself and needs a restart once space is back).
    DiskFull {
        path: usize,
        free_bytes: u64,
        poisoned: bool,
    },
    /// Space is back after the engine was poisoned by a full disk: the process restarts.
    Restart,
    /// Read-only until restart; the reason says what failed.
    Failed {
        reason: String,
    },
}

impl StorageState {
    pub fn as_str(&self) -> &'static str {
        match self {
            StorageState::Ok => "ok",
            StorageState::DiskFull { .. } => "disk_full",
            StorageState::Restart => "restarting",
            StorageState::Failed { .. } => "failed",
        }
    }

    pub fn writable(&self) -> bool {
        matches!(self, StorageState::Ok)
    }
}

/// Shared by the store, its partitions and its syncers.
#[derive(Debug, Default)]
pub struct StorageHealth {
    state: AtomicU8,
    detail: Mutex<Detail>,
    /// The data paths and the reserve (bytes) the watchdog looks at, also when the engine
    /// answers `Poisoned` without saying why ([`StorageHealth::engine_error`]).
    disks: Mutex<(Vec<std::path::PathBuf>, u64)>,
}

#[derive(Debug, Default)]
struct Detail {
    full_path: usize,
    free_bytes: u64,
    reason: String,
}

impl StorageHealth {
    /// Refuses a write the store cannot take now. Cheap: one atomic load when healthy.
    pub fn check_writable(&self) -> Result<(), WriteError> {
        match self.state.load(Ordering::Acquire) {
            STATE_OK => Ok(()),
            STATE_DISK_FULL | STATE_DISK_FULL_POISONED => Err(WriteError::DiskFull),
            STATE_RESTART => Err(WriteError::Restarting),
            _ => Err(WriteError::ReadOnly(self.detail.lock().reason.clone())),
        }
    }

    /// Whether the engine must be reopened (the process restarted) to take writes again.
    pub fn restart_needed(&self) -> bool {
        self.state.load(Ordering::Acquire) == STATE_RESTART
    }

    pub fn state(&self) -> StorageState {
        let detail = self.detail.lock();
        match self.state.load(Ordering::Acquire) {
            STATE_OK => StorageState::Ok,
            s @ (STATE_DISK_FULL | STATE_DISK_FULL_POISONED) => {
                StorageState::DiskFull { path: detail.full_path, free_bytes: detail.free_bytes, poisoned: s == STATE_DISK_FULL_POISONED }
            }
            STATE_RESTART => StorageState::Restart,
            _ => StorageState::Failed { reason: detail.reason.clone() },
        }
    }

    /// Marks the store read-only for good (until restart). The first reason wins.
    pub fn fail(&self, reason: impl Into<String>) {
        let mut detail = self.detail.lock();
        if self.state.swap(STATE_FAILED, Ordering::AcqRel) != STATE_FAILED {
            detail.reason = reason.into();
            tracing::error!(reason = %detail.reason, "storage failed: the node is read-only until it is restarted");
        }
    }

    /// The watchdog's reading of one data path: full below the reserve, writable again once
    /// the reserve plus the hysteresis is free (so that a node at the edge does not flap).
    pub(crate) fn observe_free(&self, path: usize, free_bytes: u64, reserve_bytes: u64) {
        let mut detail = self.detail.lock();
        let state = self.state.load(Ordering::Acquire);
        match state {
            STATE_OK if free_bytes < reserve_bytes => {
                self.state.store(STATE_DISK_FULL, Ordering::Release);
                detail.full_path = path;
                detail.free_bytes = free_bytes;
                tracing::warn!(path, free_bytes, reserve_bytes, "disk full: refusing writes until space is freed");
            }
            STATE_DISK_FULL | STATE_DISK_FULL_POISONED if detail.full_path == path => {
                detail.free_bytes = free_bytes;
                if free_bytes >= reserve_bytes.saturating_add(reserve_bytes / DISK_HYSTERESIS_DIVISOR) {
                    if state == STATE_DISK_FULL {
                        self.state.store(STATE_OK, Ordering::Release);
                        tracing::info!(path, free_bytes, "disk space is back: writes resume");
                    } else {
                        self.state.store(STATE_RESTART, Ordering::Release);
                        tracing::warn!(path, free_bytes, "disk space is back: restarting to reopen the storage engine");
                    }
                }
            }
            _ => {}
        }
    }

    /// The data paths the watchdog looks at, and the reserve each must keep free.
    pub(crate) fn set_disks(&self, paths: Vec<std::path::PathBuf>, reserve_bytes: u64) {
        *self.disks.lock() = (paths, reserve_bytes);
    }

    /// The watchdog's look: every data path's free space against the reserve
    /// ([`StorageHealth::observe_free`]).
    pub(crate) fn watch_disks(&self) {
        let disks = self.disks.lock();
        for (i, path) in disks.0.iter().enumerate() {
            match free_bytes(path) {
                Ok(free) => self.observe_free(i, free, disks.1),
                Err(err) => tracing::warn!(%err, path = i, "cannot read the free space of a data path"),
            }
        }
    }

    /// Classifies an engine error met while writing. Out of space poisons the engine (it
    /// refuses writes until reopened): a full disk that needs a restart once space is back.
    /// A poisoned engine while the disk is full is the same case: a background flush met
    /// the full disk, or another writer's commit did and this one only saw the poison. So a
    /// poison met while all looked well first has the watchdog look now (under load, the
    /// disk filled between two of its looks and the node stayed read-only for good: a CI
    /// failure of `tests/disk_full.rs`). Anything else fails the store.
    pub(crate) fn engine_error(&self, err: &fjall::Error) {
        let poisoned = matches!(err, fjall::Error::Poisoned);
        if poisoned && self.state.load(Ordering::Acquire) == STATE_OK {
            self.watch_disks();
        }
        let mut detail = self.detail.lock();
        let state = self.state.load(Ordering::Acquire);
        let out_of_space = is_out_of_space(err) || (poisoned && state != STATE_OK);
        match state {
            STATE_OK | STATE_DISK_FULL if out_of_space => {
                self.state.store(STATE_DISK_FULL_POISONED, Ordering::Release);
                if state == STATE_OK {
                    detail.free_bytes = 0;
                }
                tracing::warn!(%err, "the storage engine ran out of space: refusing writes; it restarts once space is freed");
            }
            STATE_DISK_FULL_POISONED | STATE_RESTART | STATE_FAILED => {}
            _ => {
                drop(detail);
                self.fail(format!("storage engine: {err}"));
            }
        }
    }
}

/// How a family of background tasks (index maintainers, analytics maintainers) is doing,
/// for `/v1/health`: how many run, and the last error if the latest round failed.
#[derive(Debug, Default)]
pub struct TaskHealth {
    running: std::sync::atomic::AtomicUsize,
    errors: std::sync::atomic::AtomicU64,
    last_error: Mutex<Option<String>>,
    failing: std::sync::atomic::AtomicBool,
}

/// What [`TaskHealth`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskReport {
    pub running: usize,
    /// The latest round of some task failed (and none has succeeded since).
    pub failing: bool,
    pub errors: u64,
    pub last_error: Option<String>,
}

impl TaskHealth {
    /// Counts a task as running until the guard drops.
    pub fn running(&self) -> RunningTask<'_> {
        self.running.fetch_add(1, Ordering::AcqRel);
        RunningTask(self)
    }

    pub fn round_failed(&self, error: &dyn std::fmt::Display) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *self.last_error.lock() = Some(error.to_string());
        self.failing.store(true, Ordering::Release);
    }

    pub fn round_succeeded(&self) {
        self.failing.store(false, Ordering::Release);
    }

    pub fn report(&self) -> TaskReport {
        TaskReport {
            running: self.running.load(Ordering::Acquire),
            failing: self.failing.load(Ordering::Acquire),
            errors: self.errors.load(Ordering::Relaxed),
            last_error: self.last_error.lock().clone(),
        }
    }
}

/// See [`TaskHealth::running`].
pub struct RunningTask<'a>(&'a TaskHealth);

impl Drop for RunningTask<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Free space above the reserve needed to leave the disk-full state: the reserve / this.
pub const DISK_HYSTERESIS_DIVISOR: u64 = 4;

/// Whether an engine error is the disk running out of space.
pub fn is_out_of_space(err: &fjall::Error) -> bool {
    match err {
        fjall::Error::Io(e) => e.raw_os_error() == Some(libc::ENOSPC),
        _ => false,
    }
}

/// Free bytes for unprivileged writers on the file system of `path` (`statvfs`).
#[cfg(unix)]
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // fsblkcnt_t and c_ulong are narrower than u64 on some targets.
    #[allow(clippy::useless_conversion)]
    let (avail, frsize) = (u64::from(st.f_bavail), u64::from(st.f_frsize));
    Ok(avail.saturating_mul(frsize))
}

#[cfg(not(unix))]
pub fn free_bytes(_: &Path) -> std::io::Result<u64> {
    Ok(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_full_comes_and_goes_with_hysteresis() {
        let h = StorageHealth::default();
        h.observe_free(0, 100, 64);
        assert!(h.check_writable().is_ok());
        h.observe_free(0, 10, 64);
        assert!(matches!(h.check_writable(), Err(WriteError::DiskFull)));
        assert_eq!(h.state(), StorageState::DiskFull { path: 0, free_bytes: 10, poisoned: false });
        h.observe_free(0, 70, 64); // above the reserve, below reserve + hysteresis
        assert!(matches!(h.check_writable(), Err(WriteError::DiskFull)));
        h.observe_free(1, 1000, 64); // another path's reading does not end it
        assert!(matches!(h.check_writable(), Err(WriteError::DiskFull)));
        h.observe_free(0, 80, 64);
        assert!(h.check_writable().is_ok());
    }

    #[test]
    fn failure_is_for_good() {
        let h = StorageHealth::default();
        h.fail("fsync failed");
        h.fail("second reason");
        h.observe_free(0, u64::MAX, 1);
        match h.check_writable() {
            Err(WriteError::ReadOnly(r)) => assert_eq!(r, "fsync failed"),
            other => panic!("{other:?}"),
        }
        assert_eq!(h.state().as_str(), "failed");
    }

    #[test]
    fn out_of_space_is_told_apart() {
        let h = StorageHealth::default();
        h.engine_error(&fjall::Error::Io(std::io::Error::from_raw_os_error(libc::ENOSPC)));
        assert!(matches!(h.check_writable(), Err(WriteError::DiskFull)));
        // Later writes meet the poisoned engine: still a full disk, not a failure.
        h.engine_error(&fjall::Error::Poisoned);
        assert!(matches!(h.state(), StorageState::DiskFull { poisoned: true, .. }));
        h.observe_free(0, 1000, 64);
        assert!(h.restart_needed());
        assert!(matches!(h.check_writable(), Err(WriteError::Restarting)));
        h.engine_error(&fjall::Error::Poisoned);
        assert!(h.restart_needed(), "a poisoned write while restarting changes nothing");
        // A full disk the watchdog saw first, then a flush poisoned the engine.
        let h = StorageHealth::default();
        h.observe_free(0, 10, 64);
        h.engine_error(&fjall::Error::Poisoned);
        assert!(matches!(h.state(), StorageState::DiskFull { poisoned: true, .. }));
        let h = StorageHealth::default();
        h.engine_error(&fjall::Error::Io(std::io::Error::from_raw_os_error(libc::EIO)));
        assert!(matches!(h.check_writable(), Err(WriteError::ReadOnly(_))));
    }

    #[test]
    fn a_poisoned_engine_on_a_disk_found_full_is_a_full_disk() {
        let dir = tempfile::tempdir().unwrap();
        // The watchdog has not looked yet; the disk is full now (every byte under the reserve).
        let h = StorageHealth::default();
        h.set_disks(vec![dir.path().to_path_buf()], u64::MAX);
        h.engine_error(&fjall::Error::Poisoned);
        assert!(matches!(h.state(), StorageState::DiskFull { poisoned: true, .. }), "{:?}", h.state());
        h.observe_free(0, 1000, 64);
        assert!(h.restart_needed(), "space back: the engine is reopened");
        // The disk has room: a poisoned engine is a failure, for good.
        let h = StorageHealth::default();
        h.set_disks(vec![dir.path().to_path_buf()], 0);
        h.engine_error(&fjall::Error::Poisoned);
        assert!(matches!(h.check_writable(), Err(WriteError::ReadOnly(_))));
        // No paths known: as before.
        let h = StorageHealth::default();
        h.engine_error(&fjall::Error::Poisoned);
        assert_eq!(h.state().as_str(), "failed");
    }
}
