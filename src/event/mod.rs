//! Events: wire decoding, validation and identity (DESIGN §2–§4).
//!
//! Pure: no I/O, no clock (callers pass `now_ms`). The path of one record:
//!
//! ```text
//! bytes ─► wire::decode ─► Validator::validate ─► UsageEvent ─► id_hash / payload_hash
//!            (JSON shape)     (reason codes)        (normalised)   (identity)
//! ```
//!
//! [`Partitioner`] says which input partition an identity belongs on, and
//! [`Validator::placement_of`] finds the identity a record is placed by (its
//! own, or a correction's original's) without judging the rest of it (what
//! `dedupd route` needs).

mod canonical;
mod identity;
mod model;
mod position;
mod quantity;
mod reason;
mod routing;
mod validate;
pub mod wire;

pub use canonical::{format_timestamp_ms, push_json_str, push_timestamp_ms, to_canonical_json, write_canonical_json};
pub use identity::{
    id_hash, payload_hash, payload_hash_with, CanonicalPayload, IdDeriver, IdHash, PayloadHash, BINCODE_CONFIG,
    DERIVED_ID_PREFIX,
};
pub use model::{CorrectionRef, EventKind, UsageEvent};
pub use position::Position;
pub use quantity::{parse_decimal, QuantityError};
pub use reason::{RejectReason, Rejection};
pub use routing::{crc32, identity_key, murmur2, Partitioner};
pub use validate::{
    parse_timestamp, ClosedPeriod, ClosedPeriods, Limits, UnknownFields, Validator, DAY_MS, OUTPUT_READ_CEILING_BYTES,
};

/// A byte table of what ends a plain run of a JSON string's content: the
/// control characters (JSON refuses them raw), the quote, the backslash,
/// and `also`. The canonical writer looks every byte of a string up in
/// one; the reader's [`plain_run_len`] reads ASCII a word at a time and
/// the rest by the table.
///
/// # Panics
///
/// When `also` holds an ASCII byte (a build error for the `const` tables):
/// [`plain_run_len`] skips eight ASCII bytes at a time without the table,
/// so a table may mark no ASCII byte beyond the ones built in here.
const fn json_string_stops(also: &[u8]) -> [bool; 256] {
    let mut stops = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        stops[b] = true;
        b += 1;
    }
    stops[b'"' as usize] = true;
    stops[b'\\' as usize] = true;
    let mut i = 0;
    while i < also.len() {
        assert!(also[i] >= 0x80, "plain_run_len's word test covers only non-ASCII extra stops");
        stops[also[i] as usize] = true;
        i += 1;
    }
    stops
}

/// How many bytes of `bytes` come before the first one `stops` (a table of
/// [`json_string_stops`]) marks; all of them when none is marked.
///
/// Eight bytes at a time while they are ASCII: there the only stops are
/// control characters, the quote and the backslash, found with bit tricks
/// on the word. From the first word holding a byte of 0x80 or above, and
/// for the last few bytes, a byte at a time by the table. Ids and names
/// are mostly ASCII of ten or twenty bytes, where a lookup per byte was 8%
/// of the offline path's instructions. `stops` must come from
/// [`json_string_stops`], whose ASCII part the word test assumes.
fn plain_run_len(bytes: &[u8], stops: &[bool; 256]) -> usize {
    let mut at = 0;
    for chunk in bytes.chunks_exact(8) {
        // Always eight bytes; were it not, the high bits would only send
        // the scan on to the table.
        let word = <[u8; 8]>::try_from(chunk).map_or(HIGH, u64::from_le_bytes);
        if word & HIGH != 0 {
            break;
        }
        let marked =
            below(word, 0x20) | below(word ^ (ONES * u64::from(b'"')), 1) | below(word ^ (ONES * u64::from(b'\\')), 1);
        if marked != 0 {
            // Little-endian: the lowest marked byte comes first, and it is
            // exact (a false mark only ever sits above a true one).
            return at + (marked.trailing_zeros() / 8) as usize;
        }
        at += 8;
    }
    at + bytes[at..].iter().position(|&b| stops[b as usize]).unwrap_or(bytes.len() - at)
}

const ONES: u64 = u64::from_le_bytes([1; 8]);
const HIGH: u64 = u64::from_le_bytes([0x80; 8]);

/// The high bit of each byte of an ASCII `word` that is below `n` (at most
/// 0x80), and perhaps of bytes above such a byte: the borrow of the
/// subtraction runs upward from a true one (the "has less" bit trick), so
/// the lowest mark is exact and no mark appears without one.
fn below(word: u64, n: u8) -> u64 {
    word.wrapping_sub(ONES * u64::from(n)) & !word & HIGH
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{json_string_stops, plain_run_len};

    /// Pinned cases the random ones reach rarely: a NUL whose borrow runs
    /// into the bytes above it (space, `#`, `]`), several stops in one
    /// word, a stop on the last byte of the second word, and none at all.
    #[test]
    fn pinned_plain_runs_end_where_the_table_says() {
        let table = json_string_stops(&[]);
        for (bytes, want) in [
            (&b"\0 #]aaaa"[..], 0),
            (b"a\0 #]aaa", 1),
            (b"ab\"\\\x1faaa", 2),
            (b"abcdefgh#]!~[ ^\"", 15),
            (b"abcdefghijklmnop", 16),
            (b"", 0),
        ] {
            assert_eq!(plain_run_len(bytes, &table), want, "{bytes:?}");
        }
    }

    proptest! {
        /// The word-at-a-time scan stops where a byte-at-a-time scan by the
        /// same table stops, for both tables, wherever the stops fall in a
        /// word: mostly plain ASCII with none, one or a few stops and high
        /// bytes among it.
        #[test]
        fn a_plain_run_ends_where_the_table_says(
            plain in proptest::collection::vec(0x20u8..0x7f, 0..40),
            marks in proptest::collection::vec(
                (
                    any::<prop::sample::Index>(),
                    prop_oneof![(0u8..0x20), Just(b'"'), Just(b'\\'), Just(0x7f), Just(0xe2), (0x80u8..=0xff)],
                ),
                0..3,
            ),
        ) {
            let mut bytes = plain;
            for (at, b) in marks {
                let i = at.index(bytes.len() + 1);
                bytes.insert(i, b);
            }
            for table in [json_string_stops(&[]), json_string_stops(&[0xE2])] {
                let by_byte = bytes.iter().position(|&b| table[b as usize]).unwrap_or(bytes.len());
                prop_assert_eq!(plain_run_len(&bytes, &table), by_byte, "{:?}", bytes);
            }
        }
    }
}
