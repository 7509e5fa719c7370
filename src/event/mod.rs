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
/// and `also`. A lookup per byte: the reader and the canonical writer scan
/// every string with one.
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
        stops[also[i] as usize] = true;
        i += 1;
    }
    stops
}
