//! JSON for Shoal: validation of document bodies today; paths, one-pass multi-path lookup
//! and sub-document mutation as the sub-document API arrives.
//!
//! This crate knows nothing of storage or HTTP.

pub mod path;
pub mod subdoc;

use thiserror::Error;

/// Deepest nesting of arrays and objects accepted in a document (serde_json's own limit).
pub const DOC_DEPTH_MAX: usize = 128;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum JsonError {
    #[error("empty body: a document must be a JSON value")]
    Empty,
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Invalid { line: usize, column: usize, message: String },
}

/// Checks that `bytes` hold exactly one JSON value (surrounding white space allowed),
/// without building it.
pub fn validate(bytes: &[u8]) -> Result<(), JsonError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(JsonError::Empty);
    }
    // serde_json skips over strings without checking their UTF-8, and ignores depth when
    // it builds nothing: check both here.
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(JsonError::Invalid { line: 0, column: e.valid_up_to(), message: "invalid UTF-8".into() });
    }
    check_depth(bytes)?;
    serde_json::from_slice::<Validated>(bytes).map(|_| ()).map_err(|e| JsonError::Invalid {
        line: e.line(),
        column: e.column(),
        message: strip_position(&e),
    })
}

/// Walks a document without building it, so that every number is parsed (one out of
/// `f64` range, like `1e999`, is refused as later readers could not use it) and every string
/// is unescaped. `IgnoredAny` would skip both.
struct Validated;

impl<'de> serde::Deserialize<'de> for Validated {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValidatedVisitor)
    }
}

struct ValidatedVisitor;

impl<'de> serde::de::Visitor<'de> for ValidatedVisitor {
    type Value = Validated;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Validated, E> {
        Ok(Validated)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Validated, E> {
        Ok(Validated)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Validated, E> {
        Ok(Validated)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Validated, E> {
        Ok(Validated)
    }
    fn visit_str<E>(self, _: &str) -> Result<Validated, E> {
        Ok(Validated)
    }
    fn visit_unit<E>(self) -> Result<Validated, E> {
        Ok(Validated)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Validated, A::Error> {
        while seq.next_element::<Validated>()?.is_some() {}
        Ok(Validated)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Validated, A::Error> {
        while map.next_entry::<Validated, Validated>()?.is_some() {}
        Ok(Validated)
    }
}

/// Refuses nesting deeper than [`DOC_DEPTH_MAX`], scanning brackets outside strings.
fn check_depth(bytes: &[u8]) -> Result<(), JsonError> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, &b) in bytes.iter().enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > DOC_DEPTH_MAX {
                    return Err(JsonError::Invalid { line: 0, column: i, message: format!("nested deeper than {DOC_DEPTH_MAX} levels") });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

fn strip_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.find(" at line ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_table() {
        let cases: &[(&[u8], bool)] = &[
            (b"{}", true),
            (b" [1, 2.5, \"x\", null, true] \n", true),
            (b"\"just a string\"", true),
            (b"", false),
            (b"   ", false),
            (b"{", false),
            (b"{\"a\":1}{}", false),
            (b"{'a':1}", false),
            (b"\xff\xfe", false),
            (b"[1,]", false),
            (b"6E6161", false),
            (b"[1e308, -2.5e-300, 18446744073709551615, -9223372036854775808]", true),
            (b"\"\xff\"", false),
            (b"{\"a\\\"[[[[\": 1}", true),
        ];
        for (input, ok) in cases {
            assert_eq!(validate(input).is_ok(), *ok, "{:?}", String::from_utf8_lossy(input));
        }
    }

    #[test]
    fn depth_is_limited() {
        let deep = format!("{}{}", "[".repeat(DOC_DEPTH_MAX + 10), "]".repeat(DOC_DEPTH_MAX + 10));
        assert!(validate(deep.as_bytes()).is_err());
        let fine = format!("{}{}", "[".repeat(100), "]".repeat(100));
        assert!(validate(fine.as_bytes()).is_ok());
    }
}
