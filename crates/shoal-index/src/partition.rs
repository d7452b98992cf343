//! Index partitions: an index of the index service is split by a hash of its leading key's
//! value into `partitions` parts, fixed at creation, each a unit placed, copied and dropped
//! on its own (`shoal_cluster::index_placement`). An entry's part follows from its leading
//! key alone, so every document's entries for one leading value are in one part, and an
//! `eq` on the leading key reads one part; any other scan reads every part and merges.
//!
//! The hash is of the leading component's key encoding ([`crate::keycode`]), so values equal
//! in the index's order (`1` and `1.0`) fall in the same part.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::keycode::{self, CorruptKey};
use crate::ScanBounds;

/// Seed of the hash of leading keys. Changing it moves every index entry to another part:
/// never, once an index exists.
const PARTITION_SEED: u64 = 0x1DE7_5EED_0000_0041;

/// The part of an entry whose leading key component encodes as `leading`.
pub fn part_of_leading(leading: &[u8], partitions: u16) -> u16 {
    debug_assert!(partitions >= 1);
    (xxh3_64_with_seed(leading, PARTITION_SEED) % u64::from(partitions.max(1))) as u16
}

/// The part of an encoded entry (composite key followed by the document key).
pub fn part_of_entry(entry: &[u8], partitions: u16) -> Result<u16, CorruptKey> {
    let (_, rest) = keycode::decode(entry)?;
    Ok(part_of_leading(&entry[..entry.len() - rest.len()], partitions))
}

/// The part that holds entries whose leading key is `value` (`None`: MISSING).
pub fn part_of_value(value: Option<&serde_json::Value>, partitions: u16) -> u16 {
    let mut leading = Vec::new();
    keycode::encode(value, &mut leading);
    part_of_leading(&leading, partitions)
}

/// The parts a scan with `bounds` reads: the one part of its leading value when the scan
/// fixes it (an `eq`, or a range whose two bounds share an inclusive leading value), else
/// every part.
pub fn parts_of_scan(bounds: &ScanBounds, partitions: u16) -> Vec<u16> {
    let fixed = match bounds {
        ScanBounds::Eq(values) => values.first(),
        ScanBounds::Range { low: Some(low), high: Some(high), .. } if low.len() > 1 || high.len() > 1 => {
            // Longer bounds: the leading component is fixed when both start with it.
            match (low.first(), high.first()) {
                (Some(l), Some(h)) if keycode::compare(l, h).is_eq() => Some(l),
                _ => None,
            }
        }
        ScanBounds::Range { low: Some(low), high: Some(high), inclusive_low: true, inclusive_high: true } => {
            match (low.first(), high.first()) {
                (Some(l), Some(h)) if keycode::compare(l, h).is_eq() => Some(l),
                _ => None,
            }
        }
        _ => None,
    };
    match fixed {
        Some(v) => vec![part_of_value(Some(v), partitions)],
        None => (0..partitions).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn equal_values_fall_in_one_part_and_parts_spread() {
        assert_eq!(part_of_value(Some(&json!(1)), 8), part_of_value(Some(&json!(1.0)), 8), "equal in the index's order");
        let mut counts = [0usize; 8];
        for i in 0..8_000 {
            counts[usize::from(part_of_value(Some(&json!(i)), 8))] += 1;
        }
        assert!(counts.iter().all(|c| (800..1_200).contains(c)), "{counts:?}");
        assert_eq!(part_of_value(Some(&json!("x")), 1), 0, "one part holds everything");
    }

    #[test]
    fn an_entry_is_in_the_part_of_its_leading_value() {
        let mut entry = Vec::new();
        keycode::encode(Some(&json!("tokyo")), &mut entry);
        keycode::encode(Some(&json!(42)), &mut entry);
        entry.extend_from_slice(b"doc-7");
        assert_eq!(part_of_entry(&entry, 16), Ok(part_of_value(Some(&json!("tokyo")), 16)));
        assert!(part_of_entry(&[0x99], 16).is_err(), "not an encoded key");
    }

    #[test]
    fn a_scan_fixing_the_leading_value_reads_one_part_and_any_other_reads_all() {
        let one = |v: serde_json::Value| vec![part_of_value(Some(&v), 8)];
        let all: Vec<u16> = (0..8).collect();
        let range = |low: Option<Vec<serde_json::Value>>, high: Option<Vec<serde_json::Value>>, il: bool, ih: bool| ScanBounds::Range {
            low,
            high,
            inclusive_low: il,
            inclusive_high: ih,
        };
        let cases = [
            ("eq on the leading key", ScanBounds::Eq(vec![json!(3)]), one(json!(3))),
            ("eq on a prefix of two", ScanBounds::Eq(vec![json!(3), json!("a")]), one(json!(3))),
            ("all", ScanBounds::All, all.clone()),
            ("a range of leading values", range(Some(vec![json!(1)]), Some(vec![json!(5)]), true, true), all.clone()),
            ("an inclusive point range", range(Some(vec![json!(4)]), Some(vec![json!(4)]), true, true), one(json!(4))),
            (
                "an exclusive point range is empty, and reads all",
                range(Some(vec![json!(4)]), Some(vec![json!(4)]), false, true),
                all.clone(),
            ),
            (
                "a range inside one leading value",
                range(Some(vec![json!(4), json!(1)]), Some(vec![json!(4), json!(9)]), false, false),
                one(json!(4)),
            ),
            ("open low", range(None, Some(vec![json!(4)]), true, true), all.clone()),
        ];
        for (name, bounds, want) in cases {
            assert_eq!(parts_of_scan(&bounds, 8), want, "{name}");
        }
    }
}
