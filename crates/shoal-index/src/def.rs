//! Index definitions and what a document contributes to an index.
//!
//! Missing keys follow Couchbase: a document whose leading key is missing is not indexed;
//! a missing non-leading key is indexed as MISSING, which sorts before `null`. A key
//! `path[*]` (or `path[*].sub`) indexes each distinct element of the array at `path` (or
//! each element's `sub`); an index has at most one such key. A leading array key whose array
//! is missing or empty contributes nothing; a non-leading one contributes MISSING.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use shoal_json::path::{self, Segment};

use crate::filter::Filter;
use crate::keycode;
use crate::IndexError;

/// Most keys in one index.
pub const INDEX_KEYS_MAX: usize = 16;
/// Longest index name, in bytes (as collection names).
pub const INDEX_NAME_MAX_BYTES: usize = 251;
/// Longest encoded composite key; larger entries are not indexed (logged), as Couchbase
/// skips items beyond its key-size limit.
pub const ENTRY_KEY_MAX_BYTES: usize = 4096;

/// What a user asks for; stored as given.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct IndexDef {
    pub name: String,
    pub keys: Vec<String>,
    #[serde(rename = "where", default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    #[serde(default)]
    pub defer_build: bool,
    /// Index partitions, by a hash of the leading key's value ([`crate::partition`]),
    /// 1..=[`INDEX_PARTITIONS_MAX`], fixed at creation (default [`INDEX_PARTITIONS_DEFAULT`]):
    /// the units the index service places, copies and drops (issue 41).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<u16>,
    /// Copies of each index partition beyond the first, 0..=[`INDEX_REPLICAS_MAX`], fewer
    /// than the cluster's index nodes (the cluster checks that).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replicas: u8,
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

/// Most partitions an index is split into (API.md: 1–256; the same bound as
/// `shoal_cluster::index_placement::INDEX_PARTITIONS_MAX`, which places them).
pub const INDEX_PARTITIONS_MAX: u16 = 256;
/// Partitions of an index whose definition does not say.
pub const INDEX_PARTITIONS_DEFAULT: u16 = 8;
/// Most replicas of an index partition (API.md: 0–3).
pub const INDEX_REPLICAS_MAX: u8 = 3;

/// One key of an index, parsed.
#[derive(Clone, Debug)]
struct KeySpec {
    path: Vec<Segment>,
    /// `Some(sub)` for `path[*].sub` (`sub` empty for `path[*]`).
    each: Option<Vec<Segment>>,
}

/// A definition ready to evaluate documents.
#[derive(Clone, Debug)]
pub struct Compiled {
    keys: Vec<KeySpec>,
    filter: Option<Filter>,
}

impl IndexDef {
    /// The partitions the index is split into: as defined, else [`INDEX_PARTITIONS_DEFAULT`].
    pub fn part_count(&self) -> u16 {
        self.partitions.unwrap_or(INDEX_PARTITIONS_DEFAULT)
    }

    pub fn compile(&self) -> Result<Compiled, IndexError> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= INDEX_NAME_MAX_BYTES
            && !self.name.starts_with(['_', '%'])
            && self.name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'%'));
        if !name_ok {
            return Err(IndexError::Invalid(format!(
                "index name must be 1-{INDEX_NAME_MAX_BYTES} characters of A-Z a-z 0-9 _ - %, not starting with _ or %"
            )));
        }
        if self.keys.is_empty() || self.keys.len() > INDEX_KEYS_MAX {
            return Err(IndexError::Invalid(format!("an index has 1 to {INDEX_KEYS_MAX} keys")));
        }
        let keys = self.keys.iter().map(|k| parse_key(k)).collect::<Result<Vec<_>, _>>()?;
        if keys.iter().filter(|k| k.each.is_some()).count() > 1 {
            return Err(IndexError::Invalid("at most one array key (`path[*]`) per index".into()));
        }
        if self.partitions.is_some_and(|n| n == 0 || n > INDEX_PARTITIONS_MAX) {
            return Err(IndexError::Invalid(format!("an index has 1 to {INDEX_PARTITIONS_MAX} partitions")));
        }
        if self.replicas > INDEX_REPLICAS_MAX {
            return Err(IndexError::Invalid(format!("an index has 0 to {INDEX_REPLICAS_MAX} replicas")));
        }
        let filter = self.filter.as_deref().map(Filter::parse).transpose()?;
        Ok(Compiled { keys, filter })
    }
}

fn parse_key(text: &str) -> Result<KeySpec, IndexError> {
    let bad = |why: String| IndexError::Invalid(format!("key `{text}`: {why}"));
    let (base, each) = match text.split_once("[*]") {
        None => (text, None),
        Some((base, rest)) => {
            let sub = match rest {
                "" => Vec::new(),
                r => match r.strip_prefix('.') {
                    Some(sub) => path::parse(sub).map_err(|e| bad(e.to_string()))?.0,
                    None => return Err(bad("`[*]` must end the key or be followed by `.field`".into())),
                },
            };
            if sub.is_empty() && !rest.is_empty() {
                return Err(bad("empty path after `[*].`".into()));
            }
            (base, Some(sub))
        }
    };
    if base.is_empty() {
        return Err(bad("empty path".into()));
    }
    let path = path::parse(base).map_err(|e| bad(e.to_string()))?.0;
    Ok(KeySpec { path, each })
}

impl Compiled {
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// The encoded composite keys `doc` contributes (sorted, distinct); empty when the
    /// document is filtered out or its leading key is missing.
    pub fn entries(&self, doc: &Value) -> Vec<Vec<u8>> {
        if self.filter.as_ref().is_some_and(|f| !f.matches(doc)) {
            return Vec::new();
        }
        let mut prefixes: Vec<Vec<u8>> = vec![Vec::new()];
        for (i, key) in self.keys.iter().enumerate() {
            let leading = i == 0;
            match &key.each {
                None => {
                    let v = shoal_json::subdoc::navigate(doc, &key.path).ok();
                    if leading && v.is_none() {
                        return Vec::new();
                    }
                    for p in &mut prefixes {
                        keycode::encode(v, p);
                    }
                }
                Some(sub) => {
                    let mut parts: Vec<Vec<u8>> = match shoal_json::subdoc::navigate(doc, &key.path) {
                        Ok(Value::Array(items)) => items
                            .iter()
                            .filter_map(|item| shoal_json::subdoc::navigate(item, sub).ok())
                            .map(|v| {
                                let mut e = Vec::new();
                                keycode::encode(Some(v), &mut e);
                                e
                            })
                            .collect(),
                        _ => Vec::new(),
                    };
                    parts.sort_unstable();
                    parts.dedup();
                    if parts.is_empty() {
                        if leading {
                            return Vec::new();
                        }
                        parts.push(vec![]);
                        keycode::encode(None, &mut parts[0]);
                    }
                    prefixes = prefixes
                        .iter()
                        .flat_map(|p| {
                            parts.iter().map(move |e| {
                                let mut x = p.clone();
                                x.extend_from_slice(e);
                                x
                            })
                        })
                        .collect();
                }
            }
        }
        prefixes.retain(|p| p.len() <= ENTRY_KEY_MAX_BYTES);
        prefixes.sort_unstable();
        prefixes.dedup();
        prefixes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn def(keys: &[&str], filter: Option<&str>) -> Compiled {
        IndexDef {
            name: "i".into(),
            keys: keys.iter().map(|k| k.to_string()).collect(),
            filter: filter.map(str::to_string),
            defer_build: false,
            partitions: None,
            replicas: 0,
        }
        .compile()
        .unwrap()
    }

    fn decoded(c: &Compiled, doc: Value) -> Vec<Vec<Value>> {
        c.entries(&doc).iter().map(|e| keycode::decode_components(e, c.key_count()).unwrap().0).collect()
    }

    #[test]
    fn missing_keys_follow_couchbase() {
        let c = def(&["user", "date"], None);
        assert_eq!(decoded(&c, json!({"user": "u1", "date": 5})), vec![vec![json!("u1"), json!(5)]]);
        assert!(decoded(&c, json!({"date": 5})).is_empty(), "leading key missing: not indexed");
        // A missing non-leading key is MISSING, decoded as null for display.
        assert_eq!(decoded(&c, json!({"user": "u1"})), vec![vec![json!("u1"), json!(null)]]);
    }

    #[test]
    fn array_keys_index_each_distinct_element() {
        let c = def(&["tags[*]"], None);
        assert_eq!(decoded(&c, json!({"tags": ["b", "a", "b"]})), vec![vec![json!("a")], vec![json!("b")]]);
        assert!(decoded(&c, json!({"tags": []})).is_empty());
        let c = def(&["type", "items[*].sku"], Some("type = 'order'"));
        assert_eq!(
            decoded(&c, json!({"type": "order", "items": [{"sku": 2}, {"sku": 1}, {"x": 0}]})),
            vec![vec![json!("order"), json!(1)], vec![json!("order"), json!(2)]]
        );
        assert!(decoded(&c, json!({"type": "user", "items": [{"sku": 2}]})).is_empty());
    }

    #[test]
    fn bad_definitions() {
        for (keys, name) in [
            (vec![], "i"),
            (vec!["a[*]", "b[*]"], "i"),
            (vec!["a[*]x"], "i"),
            (vec![""], "i"),
            (vec!["a..b"], "i"),
            (vec!["a"], "_x"),
            (vec!["a"], ""),
        ] {
            let d = IndexDef {
                name: name.into(),
                keys: keys.iter().map(|k| k.to_string()).collect(),
                filter: None,
                defer_build: false,
                partitions: None,
                replicas: 0,
            };
            assert!(d.compile().is_err(), "{keys:?} {name}");
        }
    }
}
