//! The audit trail: one JSON line per security-relevant event in `<first data path>/audit.log`
//! — failed and paused logins, calls refused as forbidden, and every call that changes the
//! cluster (users and roles, collection and index DDL, cluster operations) with who made it
//! and how it was answered. Never a password or a credential.
//!
//! The file is appended to under a lock (events are rare: a login flood is paused per source
//! by `auth`) and rotated by size: past [`AUDIT_FILE_MAX_BYTES`] it becomes `audit.log.1`,
//! the older ones shift up, and the oldest beyond [`AUDIT_FILES_KEPT`] goes.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

/// The audit file's name under the node's first data path.
pub const AUDIT_FILE: &str = "audit.log";
/// Size past which the audit file is rotated.
pub const AUDIT_FILE_MAX_BYTES: u64 = 16 * 1024 * 1024;
/// Rotated audit files kept (`audit.log.1` … `audit.log.N`).
pub const AUDIT_FILES_KEPT: usize = 4;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Wrong or unknown credentials.
    LoginFailed,
    /// An attempt refused with `429` inside a pause after failures.
    LoginPaused,
    /// A known user refused with `403`.
    Forbidden,
    /// A call that changes users, collections, indexes or the cluster, with its status.
    Change,
}

impl Event {
    fn name(self) -> &'static str {
        match self {
            Event::LoginFailed => "login_failed",
            Event::LoginPaused => "login_paused",
            Event::Forbidden => "forbidden",
            Event::Change => "change",
        }
    }
}

/// One line of the trail.
pub struct Record<'a> {
    pub event: Event,
    /// The user named (for a failed login, the name given; `None` when none was).
    pub user: Option<&'a str>,
    pub source: IpAddr,
    pub method: &'a str,
    pub path: &'a str,
    pub status: u16,
}

/// The node's audit trail (see the module documentation).
pub struct Audit {
    path: PathBuf,
    max_bytes: u64,
    file: Mutex<Option<(File, u64)>>,
}

impl Audit {
    /// The trail in `dir`; the file is opened at the first event.
    pub fn new(dir: &Path) -> Audit {
        Audit::with_limit(dir, AUDIT_FILE_MAX_BYTES)
    }

    fn with_limit(dir: &Path, max_bytes: u64) -> Audit {
        Audit { path: dir.join(AUDIT_FILE), max_bytes, file: Mutex::new(None) }
    }

    /// Appends one event. A trail that cannot be written is said in the log, and the call
    /// it records goes on.
    pub fn record(&self, r: &Record<'_>) {
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let user: String = r.user.map(|u| u.chars().take(crate::auth::AUDIT_NAME_MAX_CHARS).collect()).unwrap_or_default();
        let path: String = r.path.chars().take(crate::auth::AUDIT_NAME_MAX_CHARS * 4).collect();
        let line = serde_json::json!({
            "ts_ms": ts, "event": r.event.name(), "user": user, "source": r.source.to_string(),
            "method": r.method, "path": path, "status": r.status,
        })
        .to_string()
            + "\n";
        if let Err(e) = self.append(line.as_bytes()) {
            tracing::warn!(error = %e, file = %self.path.display(), "cannot write the audit trail");
        }
    }

    fn append(&self, line: &[u8]) -> std::io::Result<()> {
        let mut guard = self.file.lock();
        if guard.as_ref().is_some_and(|(_, size)| *size + line.len() as u64 > self.max_bytes) {
            *guard = None;
            self.rotate()?;
        }
        if guard.is_none() {
            let mut options = OpenOptions::new();
            options.create(true).append(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                options.mode(0o600);
            }
            let file = options.open(&self.path)?;
            let size = file.metadata()?.len();
            *guard = Some((file, size));
        }
        if let Some((file, size)) = guard.as_mut() {
            file.write_all(line)?;
            *size += line.len() as u64;
        }
        Ok(())
    }

    /// `audit.log` → `audit.log.1`, each older one a number up, the last dropped.
    fn rotate(&self) -> std::io::Result<()> {
        let numbered = |n: usize| PathBuf::from(format!("{}.{n}", self.path.display()));
        let _ = std::fs::remove_file(numbered(AUDIT_FILES_KEPT));
        for n in (1..AUDIT_FILES_KEPT).rev() {
            let from = numbered(n);
            if from.exists() {
                std::fs::rename(&from, numbered(n + 1))?;
            }
        }
        std::fs::rename(&self.path, numbered(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(audit: &Audit, n: u16) {
        audit.record(&Record {
            event: Event::Change,
            user: Some("admin"),
            source: IpAddr::from([127, 0, 0, 1]),
            method: "PUT",
            path: "/v1/collections/c",
            status: n,
        });
    }

    #[test]
    fn events_are_json_lines_rotated_by_size_keeping_the_newest_files() {
        let dir = tempfile::tempdir().unwrap();
        let audit = Audit::with_limit(dir.path(), 1024);
        for n in 0..200 {
            record(&audit, n);
        }
        let current = std::fs::read_to_string(dir.path().join(AUDIT_FILE)).unwrap();
        let last: serde_json::Value = serde_json::from_str(current.lines().last().unwrap()).unwrap();
        assert_eq!((last["event"].as_str(), last["user"].as_str(), last["status"].as_u64()), (Some("change"), Some("admin"), Some(199)));
        assert!(current.len() as u64 <= 1024);
        for n in 1..=AUDIT_FILES_KEPT {
            let rotated = std::fs::read_to_string(dir.path().join(format!("{AUDIT_FILE}.{n}"))).unwrap();
            assert!(rotated.len() as u64 <= 1024 && !rotated.is_empty(), "{n}");
            for line in rotated.lines() {
                serde_json::from_str::<serde_json::Value>(line).unwrap();
            }
        }
        assert!(!dir.path().join(format!("{AUDIT_FILE}.{}", AUDIT_FILES_KEPT + 1)).exists());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.path().join(AUDIT_FILE)).unwrap().permissions().mode() & 0o777, 0o600);
    }
}
