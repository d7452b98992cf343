//! Whether the store can take writes: the failure model of the storage layer.
//!
//! - **Disk full** (free space on a data path below the reserve, or the engine answered
//!   `ENOSPC`): writes are refused with [`WriteError::DiskFull`] before they reach the
//!   engine, reads go on, and writing resumes by itself once the watchdog sees the reserve
//!   free again. The reserve leaves the engine room to flush and compact what it holds.
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
const STATE_FAILED: u8 = 2;

/// The storage state as reported by `/v1/health`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageState {
    Ok,
    /// Free space is below the reserve on the named data path.
    DiskFull { path: usize, free_bytes: u64 },
    /// Read-only until restart; the reason says what failed.
    Failed { reason: String },
}

impl StorageState {
    pub fn as_str(&self) -> &'static str {
        match self {
            StorageState::Ok => "ok",
            StorageState::DiskFull { .. } => "disk_full",
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
            STATE_DISK_FULL => Err(WriteError::DiskFull),
            _ => Err(WriteError::ReadOnly(self.detail.lock().reason.clone())),
        }
    }

    pub fn state(&self) -> StorageState {
        let detail = self.detail.lock();
        match self.state.load(Ordering::Acquire) {
            STATE_OK => StorageState::Ok,
            STATE_DISK_FULL => StorageState::DiskFull { path: detail.full_path, free_bytes: detail.free_bytes },
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
        match self.state.load(Ordering::Acquire) {
            STATE_OK if free_bytes < reserve_bytes => {
                self.state.store(STATE_DISK_FULL, Ordering::Release);
                detail.full_path = path;
                detail.free_bytes = free_bytes;
                tracing::warn!(path, free_bytes, reserve_bytes, "disk full: refusing writes until space is freed");
            }
            STATE_DISK_FULL if detail.full_path == path => {
                detail.free_bytes = free_bytes;
                if free_bytes >= reserve_bytes.saturating_add(reserve_bytes / DISK_HYSTERESIS_DIVISOR) {
                    self.state.store(STATE_OK, Ordering::Release);
                    tracing::info!(path, free_bytes, "disk space is back: writes resume");
                }
            }
            _ => {}
        }
    }

    /// Classifies an engine error met while writing: out of space is a full disk (the
    /// watchdog decides when it is over), anything else fails the store.
    pub(crate) fn engine_error(&self, err: &fjall::Error) {
        if is_out_of_space(err) {
            let mut detail = self.detail.lock();
            if self.state.compare_exchange(STATE_OK, STATE_DISK_FULL, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                detail.free_bytes = 0;
                tracing::warn!(%err, "the storage engine ran out of space: refusing writes until space is freed");
            }
        } else {
            self.fail(format!("storage engine: {err}"));
        }
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
    Ok(u64::from(st.f_bavail).saturating_mul(st.f_frsize))
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
        assert_eq!(h.state(), StorageState::DiskFull { path: 0, free_bytes: 10 });
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
        let h = StorageHealth::default();
        h.engine_error(&fjall::Error::Io(std::io::Error::from_raw_os_error(libc::EIO)));
        assert!(matches!(h.check_writable(), Err(WriteError::ReadOnly(_))));
    }
}
