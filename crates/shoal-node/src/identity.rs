//! Who this node is, kept beside its data: its member id and the cluster it belongs to
//! (`cluster.json`), and the cluster secret (`cluster-secret`).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::ClusterError;

/// The identity file in the node's first data path.
pub const IDENTITY_FILE: &str = "cluster.json";
/// The cluster secret's file, beside the identity (mode 0600).
pub const SECRET_FILE: &str = "cluster-secret";
/// An invitation to join a cluster that this node accepted (`shoal cluster add`): it holds
/// until the node has joined, so a restart in between joins again.
pub const JOIN_REQUEST_FILE: &str = "join-request.json";
/// A secret shorter than this is refused: members authenticate each other with it.
pub const SECRET_MIN_BYTES: usize = 8;
/// And longer than this (it travels in a header).
pub const SECRET_MAX_BYTES: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// This member's id, chosen once at its first start and never reused.
    pub node_id: u64,
    /// The cluster this data belongs to; `None` until the node founded or joined one.
    pub cluster_id: Option<String>,
}

impl Identity {
    /// Reads the identity in `dir`, or makes a new one (a fresh id, no cluster) and stores it.
    pub fn load_or_create(dir: &Path) -> Result<Identity, ClusterError> {
        match std::fs::read(dir.join(IDENTITY_FILE)) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| ClusterError::Identity(format!("{} is not readable: {e}", dir.join(IDENTITY_FILE).display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Ids are small enough to read in logs and tables (n4093881), large enough
                // that two nodes never draw the same one in practice; a collision is refused
                // by the metadata log (`MemberExists`) and the joiner says so.
                let node_id = rand::random_range(1..=u64::from(u32::MAX));
                let identity = Identity { node_id, cluster_id: None };
                identity.store(dir)?;
                Ok(identity)
            }
            Err(e) => Err(ClusterError::Identity(format!("cannot read {}: {e}", dir.join(IDENTITY_FILE).display()))),
        }
    }

    /// Stores the identity atomically (write, fsync, rename).
    pub fn store(&self, dir: &Path) -> Result<(), ClusterError> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| ClusterError::Identity(e.to_string()))?;
        shoal_storage::write_atomically(dir, IDENTITY_FILE, &bytes)
            .map_err(|e| ClusterError::Identity(format!("cannot write {}: {e}", dir.join(IDENTITY_FILE).display())))
    }
}

/// The cluster secret: `given` (from `--cluster-secret`) if any, stored for the next start;
/// else the stored one; else, for a node founding a cluster, a new random one.
pub fn secret(dir: &Path, given: Option<&str>, may_create: bool) -> Result<String, ClusterError> {
    let path = dir.join(SECRET_FILE);
    if let Some(s) = given {
        check_secret(s)?;
        write_secret(dir, s)?;
        return Ok(s.to_string());
    }
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let s = s.trim().to_string();
            check_secret(&s)?;
            Ok(s)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && may_create => {
            let s: String = (0..32).map(|_| char::from(b"abcdefghijkmnpqrstuvwxyz23456789"[rand::random_range(0..32usize)])).collect();
            write_secret(dir, &s)?;
            Ok(s)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ClusterError::Identity(format!(
            "joining needs the cluster's secret: pass --cluster-secret (it is in {SECRET_FILE} beside the data of any member)"
        ))),
        Err(e) => Err(ClusterError::Identity(format!("cannot read {}: {e}", path.display()))),
    }
}

/// A member's invitation to join its cluster: where to join and the cluster's secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Invitation {
    pub join: String,
    pub secret: String,
}

/// What a member sends the lone node it invites: the invitation, and the `Authorization`
/// value of an administrator of the invited node, which the invited node's server checks
/// (an invitation from whoever knows some cluster's secret is not enough). The
/// credentials are never kept: only the [`Invitation`] is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InviteCall {
    pub join: String,
    pub secret: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<String>,
}

/// The invitation this node accepted and has not yet acted on, if any.
pub fn join_request(dir: &Path) -> Result<Option<Invitation>, ClusterError> {
    let path = dir.join(JOIN_REQUEST_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map(Some).map_err(|e| ClusterError::Identity(format!("{} is not readable: {e}", path.display())))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ClusterError::Identity(format!("cannot read {}: {e}", path.display()))),
    }
}

/// Keeps an accepted invitation for the restart that acts on it (mode 0600: it holds the
/// secret).
pub fn store_join_request(dir: &Path, invitation: &Invitation) -> Result<(), ClusterError> {
    check_secret(&invitation.secret)?;
    let bytes = serde_json::to_vec(invitation).map_err(|e| ClusterError::Identity(e.to_string()))?;
    write_private(dir, JOIN_REQUEST_FILE, &bytes)
}

/// Forgets an invitation (joined, or refused for good).
pub fn clear_join_request(dir: &Path) {
    if let Err(e) = std::fs::remove_file(dir.join(JOIN_REQUEST_FILE)) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(error = %e, "cannot remove {JOIN_REQUEST_FILE}");
        }
    }
}

fn check_secret(s: &str) -> Result<(), ClusterError> {
    if s.len() < SECRET_MIN_BYTES || s.len() > SECRET_MAX_BYTES || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ClusterError::Identity(format!(
            "a cluster secret has {SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} printable ASCII characters, no spaces"
        )));
    }
    Ok(())
}

fn write_secret(dir: &Path, s: &str) -> Result<(), ClusterError> {
    write_private(dir, SECRET_FILE, s.as_bytes())
}

/// Writes `name` in `dir` atomically, readable by this user only (mode 0600): it holds the
/// cluster secret.
fn write_private(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), ClusterError> {
    shoal_storage::write_atomically(dir, name, bytes)
        .map_err(|e| ClusterError::Identity(format!("cannot write {}: {e}", dir.join(name).display())))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o600));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_kept_and_secrets_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let a = Identity::load_or_create(dir.path()).unwrap();
        assert!(a.node_id > 0 && a.cluster_id.is_none());
        assert_eq!(Identity::load_or_create(dir.path()).unwrap(), a);
        let joined = Identity { cluster_id: Some("c".into()), ..a };
        joined.store(dir.path()).unwrap();
        assert_eq!(Identity::load_or_create(dir.path()).unwrap(), joined);

        assert!(secret(dir.path(), None, false).is_err(), "no secret and none may be made");
        let made = secret(dir.path(), None, true).unwrap();
        assert_eq!(secret(dir.path(), None, false).unwrap(), made, "a made secret is kept");
        assert!(secret(dir.path(), Some("short"), false).is_err());
        assert!(secret(dir.path(), Some("has a space"), false).is_err());
        assert_eq!(secret(dir.path(), Some("given-secret"), false).unwrap(), "given-secret");
        assert_eq!(secret(dir.path(), None, false).unwrap(), "given-secret");
    }
}
