//! Sub-document paths in Couchbase's syntax: `a.b[0].c`, `[-1]` for the last element,
//! backticks to quote a name (`` `a.b`.c ``, a doubled backtick for a literal one).

use std::fmt;

/// Longest path, in bytes.
pub const PATH_MAX_BYTES: usize = 1024;
/// Most components in a path.
pub const PATH_DEPTH_MAX: usize = 32;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Segment {
    /// An object member.
    Key(String),
    /// An array element; negative counts from the end (`-1` is the last).
    Index(i64),
}

/// A parsed path; empty means the whole document.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Path(pub Vec<Segment>);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid path at byte {at}: {why}")]
pub struct PathError {
    pub at: usize,
    pub why: &'static str,
}

impl Path {
    pub fn segments(&self) -> &[Segment] {
        &self.0
    }

    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// The path to the parent and the last segment; `None` for the root.
    pub fn split_last(&self) -> Option<(&[Segment], &Segment)> {
        self.0.split_last().map(|(last, parent)| (parent, last))
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Segment::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    if k.is_empty() || k.contains(['.', '[', ']', '`']) {
                        write!(f, "`{}`", k.replace('`', "``"))?;
                    } else {
                        f.write_str(k)?;
                    }
                }
                Segment::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

pub fn parse(text: &str) -> Result<Path, PathError> {
    let err = |at, why| Err(PathError { at, why });
    if text.len() > PATH_MAX_BYTES {
        return err(PATH_MAX_BYTES, "longer than 1024 bytes");
    }
    let bytes = text.as_bytes();
    let mut segs = Vec::new();
    let mut i = 0;
    if bytes.is_empty() {
        return Ok(Path(segs));
    }
    loop {
        // A component: a name (plain or quoted), unless it starts with an index.
        if bytes.get(i) == Some(&b'`') {
            let mut name = String::new();
            i += 1;
            loop {
                let rest = &text[i..];
                let Some(q) = rest.find('`') else { return err(i, "unterminated backtick") };
                name.push_str(&rest[..q]);
                i += q + 1;
                if bytes.get(i) == Some(&b'`') {
                    name.push('`');
                    i += 1;
                } else {
                    break;
                }
            }
            segs.push(Segment::Key(name));
        } else if bytes.get(i) != Some(&b'[') || !segs.is_empty() || i != 0 {
            let start = i;
            while i < bytes.len() && !matches!(bytes[i], b'.' | b'[' | b']' | b'`') {
                i += 1;
            }
            if i == start {
                return err(i, "empty name");
            }
            segs.push(Segment::Key(text[start..i].to_string()));
        }
        while bytes.get(i) == Some(&b'[') {
            let start = i + 1;
            let Some(close) = text[start..].find(']') else { return err(i, "unterminated [") };
            let inner = &text[start..start + close];
            let valid = !inner.is_empty()
                && inner.bytes().enumerate().all(|(j, b)| b.is_ascii_digit() || (j == 0 && b == b'-' && inner.len() > 1))
                && !(inner.len() > 1 && inner.starts_with('0'));
            let index: i64 = match inner.parse() {
                Ok(n) if valid => n,
                _ => return err(start, "an index is a whole number, or -1"),
            };
            if index < 0 && index != -1 {
                return err(start, "the only negative index is -1");
            }
            segs.push(Segment::Index(index));
            i = start + close + 1;
        }
        if segs.len() > PATH_DEPTH_MAX {
            return err(i, "more than 32 levels");
        }
        match bytes.get(i) {
            None => return Ok(Path(segs)),
            Some(b'.') => {
                i += 1;
                if i == bytes.len() {
                    return err(i, "path ends with a dot");
                }
            }
            Some(_) => return err(i, "unexpected character"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Segment::{Index, Key};

    fn k(s: &str) -> Segment {
        Key(s.to_string())
    }

    #[test]
    fn table() {
        let good: &[(&str, Vec<Segment>)] = &[
            ("", vec![]),
            ("a", vec![k("a")]),
            ("a.b[0].c", vec![k("a"), k("b"), Index(0), k("c")]),
            ("data.items[-1].price", vec![k("data"), k("items"), Index(-1), k("price")]),
            ("[2][3]", vec![Index(2), Index(3)]),
            ("`a.b`.c", vec![k("a.b"), k("c")]),
            ("`a``b`", vec![k("a`b")]),
            ("`[x]`[1]", vec![k("[x]"), Index(1)]),
            ("subkey-000001", vec![k("subkey-000001")]),
            ("ünï.cödé", vec![k("ünï"), k("cödé")]),
        ];
        for (text, want) in good {
            assert_eq!(parse(text).map(|p| p.0), Ok(want.clone()), "{text:?}");
            let round = parse(&parse(text).unwrap().to_string()).unwrap();
            assert_eq!(&round.0, want, "display of {text:?}");
        }
        for bad in ["a.", ".a", "a..b", "a[", "a[x]", "a[-2]", "a[01]", "a[]", "`a", "a]", "a`b`", "a[1]b", "[-]", "a[1.5]"] {
            assert!(parse(bad).is_err(), "{bad:?} should be invalid");
        }
        assert!(parse("a.".repeat(32).trim_end_matches('.')).is_ok());
        assert!(parse("a.".repeat(33).trim_end_matches('.')).is_err());
        assert!(parse(&"a".repeat(1025)).is_err());
    }
}
