//! Users and roles: who may do what (`API.md`, Security). Pure: the log keeps each user's
//! argon2id hash and roles (never a password); the server verifies passwords and asks
//! [`allows`] whether a user's roles grant what a call [`Needs`].
//!
//! Roles are Couchbase's, scoped to one collection or every one (`*`): `admin` (everything),
//! `cluster_admin` (cluster calls, collections, indexes, users other than admins; no
//! document content), `data_reader[c]`, `data_writer[c]` (a reader that also writes) and
//! `metrics_reader` (metrics, the node's and the cluster's state).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Longest user name, in bytes.
pub const USER_NAME_MAX_BYTES: usize = 64;
/// Most users a cluster keeps.
pub const USERS_MAX: usize = 10_000;
/// Most roles one user holds.
pub const ROLES_PER_USER_MAX: usize = 64;
/// Longest stored password hash (a PHC string: argon2id's is about 100 bytes).
pub const HASH_MAX_BYTES: usize = 512;
/// The user the first start of a cluster creates.
pub const ADMIN_USER: &str = "admin";

/// Which collections a data role covers.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// `*`: every collection, present and future.
    All,
    Collection(String),
}

impl Scope {
    fn covers(&self, collection: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Collection(c) => c == collection,
        }
    }
}

/// What a user may do (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Admin,
    ClusterAdmin,
    DataReader(Scope),
    DataWriter(Scope),
    MetricsReader,
}

/// A role name that is not one of [`Role`]'s.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{0:?} is not a role: admin, cluster_admin, data_reader[c], data_writer[c] (c a collection or *), metrics_reader")]
pub struct RoleError(pub String);

impl FromStr for Role {
    type Err = RoleError;

    fn from_str(s: &str) -> Result<Role, RoleError> {
        let scoped = |prefix: &str| -> Option<Scope> {
            let inner = s.strip_prefix(prefix)?.strip_prefix('[')?.strip_suffix(']')?;
            match inner {
                "" => None,
                "*" => Some(Scope::All),
                c => Some(Scope::Collection(c.to_string())),
            }
        };
        match s {
            "admin" => Ok(Role::Admin),
            "cluster_admin" => Ok(Role::ClusterAdmin),
            "metrics_reader" => Ok(Role::MetricsReader),
            _ => {
                if let Some(scope) = scoped("data_reader") {
                    Ok(Role::DataReader(scope))
                } else if let Some(scope) = scoped("data_writer") {
                    Ok(Role::DataWriter(scope))
                } else {
                    Err(RoleError(s.chars().take(80).collect()))
                }
            }
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scoped = |f: &mut fmt::Formatter<'_>, name: &str, scope: &Scope| match scope {
            Scope::All => write!(f, "{name}[*]"),
            Scope::Collection(c) => write!(f, "{name}[{c}]"),
        };
        match self {
            Role::Admin => f.write_str("admin"),
            Role::ClusterAdmin => f.write_str("cluster_admin"),
            Role::MetricsReader => f.write_str("metrics_reader"),
            Role::DataReader(s) => scoped(f, "data_reader", s),
            Role::DataWriter(s) => scoped(f, "data_writer", s),
        }
    }
}

impl Serialize for Role {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Role {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Role, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Role {
    /// The collection this role names, if it names one.
    pub fn collection(&self) -> Option<&str> {
        match self {
            Role::DataReader(Scope::Collection(c)) | Role::DataWriter(Scope::Collection(c)) => Some(c),
            _ => None,
        }
    }
}

/// A user as the log keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    /// The password's argon2id hash as a PHC string (salt and parameters included).
    pub hash: String,
    pub roles: Vec<Role>,
}

impl User {
    pub fn is_admin(&self) -> bool {
        self.roles.contains(&Role::Admin)
    }
}

/// What a call asks of its caller's roles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Any known user (who am I, the partition map smart clients route by, SQL before its
    /// collections are known).
    User,
    /// Metrics and the node's and cluster's state, read-only.
    Monitor,
    /// Cluster operations, DDL, users.
    ClusterAdmin,
    /// Reading the documents of a collection (or its index entries, its changes).
    Read(String),
    /// Changing the documents of a collection.
    Write(String),
    /// The SQL catalog (`information_schema`), which names every collection and its fields:
    /// reading every collection, or administering the cluster.
    Catalog,
}

/// Whether `roles` grant what `needs` asks.
pub fn allows(roles: &[Role], needs: &Needs) -> bool {
    // Any known user, with roles or none, may ask who they are and what they may see.
    *needs == Needs::User
        || roles.iter().any(|r| match (r, needs) {
            (Role::Admin, _) | (_, Needs::User) => true,
            (Role::ClusterAdmin, Needs::ClusterAdmin | Needs::Monitor | Needs::Catalog) => true,
            (Role::DataReader(Scope::All) | Role::DataWriter(Scope::All), Needs::Catalog) => true,
            (Role::MetricsReader, Needs::Monitor) => true,
            (Role::DataReader(s), Needs::Read(c)) => s.covers(c),
            (Role::DataWriter(s), Needs::Read(c) | Needs::Write(c)) => s.covers(c),
            _ => false,
        })
}

/// Checks a user name: 1 to [`USER_NAME_MAX_BYTES`] bytes of letters, digits and `_.-@`
/// (no `:`, which Basic credentials split on, and nothing a log line or a path would mangle).
pub fn check_user_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > USER_NAME_MAX_BYTES {
        return Err(format!("a user name has 1 to {USER_NAME_MAX_BYTES} bytes"));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '@'))) {
        return Err(format!("a user name holds letters, digits and _ . - @ only, not {c:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(list: &[&str]) -> Vec<Role> {
        list.iter().map(|r| r.parse().unwrap()).collect()
    }

    #[test]
    fn role_names_round_trip_and_bad_ones_are_refused() {
        for name in ["admin", "cluster_admin", "metrics_reader", "data_reader[c]", "data_writer[*]", "data_reader[a.b-c]"] {
            let role: Role = name.parse().unwrap();
            assert_eq!(role.to_string(), name);
            let json = serde_json::to_string(&role).unwrap();
            assert_eq!(serde_json::from_str::<Role>(&json).unwrap(), role);
        }
        for bad in ["", "root", "data_reader", "data_reader[]", "data_reader[c", "data_readerx[c]", "Admin", "data_writer*"] {
            assert!(bad.parse::<Role>().is_err(), "{bad:?}");
        }
        assert!(serde_json::from_str::<Role>("\"superuser\"").is_err());
    }

    #[test]
    fn roles_grant_what_the_table_says() {
        use Needs::*;
        let read = |c: &str| Read(c.to_string());
        let write = |c: &str| Write(c.to_string());
        // (roles, needs, allowed)
        let cases: Vec<(&[&str], Needs, bool)> = vec![
            (&[], User, true),
            (&[], Monitor, false),
            (&["metrics_reader"], User, true),
            (&["admin"], write("c"), true),
            (&["admin"], ClusterAdmin, true),
            (&["cluster_admin"], ClusterAdmin, true),
            (&["cluster_admin"], Monitor, true),
            (&["cluster_admin"], read("c"), false),
            (&["cluster_admin"], write("c"), false),
            (&["metrics_reader"], Monitor, true),
            (&["metrics_reader"], ClusterAdmin, false),
            (&["metrics_reader"], read("c"), false),
            (&["data_reader[c]"], read("c"), true),
            (&["data_reader[c]"], read("d"), false),
            (&["data_reader[c]"], write("c"), false),
            (&["data_reader[c]"], Monitor, false),
            (&["data_reader[*]"], read("anything"), true),
            (&["data_writer[c]"], read("c"), true),
            (&["data_writer[c]"], write("c"), true),
            (&["data_writer[c]"], write("d"), false),
            (&["data_writer[*]"], write("d"), true),
            (&["data_writer[*]"], ClusterAdmin, false),
            (&["data_reader[c]", "data_writer[d]"], write("d"), true),
            (&["data_reader[c]", "data_writer[d]"], write("c"), false),
            (&["admin"], Catalog, true),
            (&["cluster_admin"], Catalog, true),
            (&["data_reader[*]"], Catalog, true),
            (&["data_writer[*]"], Catalog, true),
            (&["data_reader[c]"], Catalog, false),
            (&["data_writer[c]", "data_reader[d]"], Catalog, false),
            (&["metrics_reader"], Catalog, false),
            (&[], Catalog, false),
        ];
        for (list, needs, want) in cases {
            assert_eq!(allows(&roles(list), &needs), want, "{list:?} {needs:?}");
        }
    }

    #[test]
    fn user_names_are_checked() {
        for ok in ["admin", "a", "app-1.reader@site", &"x".repeat(USER_NAME_MAX_BYTES)] {
            assert!(check_user_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a:b", "a b", "ü", "a/b", "a\n", &"x".repeat(USER_NAME_MAX_BYTES + 1)] {
            assert!(check_user_name(bad).is_err(), "{bad:?}");
        }
    }
}
