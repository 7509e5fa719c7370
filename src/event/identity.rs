//! Event identity: the tenant-scoped id hash, derived event ids, and the
//! canonical payload hash (DESIGN §3).
//!
//! Both hashes are the first 128 bits of blake3 output. They are domain
//! separated (`ID_DOMAIN`, `PAYLOAD_DOMAIN`) so no id hash can equal a payload
//! hash by construction, and every variable-length input is length-prefixed so
//! `("ab", "c")` and `("a", "bc")` never hash alike.
//!
//! The payload hash is computed over one pinned bincode configuration
//! ([`BINCODE_CONFIG`]) of [`CanonicalPayload`]. Changing either changes every
//! payload hash ever stored, which would turn every retry after an upgrade into a
//! false conflict: both are frozen, and the unit tests pin known values.

use super::model::UsageEvent;

/// The one bincode configuration used for canonical encodings. Fixed-width
/// little-endian integers: simple to reason about and stable across versions.
pub const BINCODE_CONFIG: bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Fixint,
    bincode::config::NoLimit,
> = bincode::config::standard().with_little_endian().with_fixed_int_encoding().with_no_limit();

const ID_DOMAIN: &[u8] = b"dedupd/id/v1\0";
const PAYLOAD_DOMAIN: &[u8] = b"dedupd/payload/v1\0";
const DERIVE_CONTEXT: &str = "dedupd 2026-11 derived event id v1";

/// Prefix of every derived event id, so a reader of the output can tell them apart.
pub const DERIVED_ID_PREFIX: &str = "drv_";

/// 128-bit, tenant-scoped identity of an event: `(tenant_id, event_id)`.
///
/// Stored as bytes (alignment 1) so records holding it pack tightly.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct IdHash(pub [u8; 16]);

/// 128-bit hash of the canonical payload: equal payloads, equal hashes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PayloadHash(pub [u8; 16]);

macro_rules! hash_common {
    ($t:ident) => {
        impl $t {
            /// Lower-case hex, 32 characters.
            pub fn to_hex(&self) -> String {
                // Two table lookups per byte: this runs twice per accepted
                // event (the output record's headers), where a `format!`
                // per byte was a tenth of a batch's time.
                const DIGITS: &[u8; 16] = b"0123456789abcdef";
                let mut s = String::with_capacity(32);
                for b in self.0 {
                    s.push(char::from(DIGITS[usize::from(b >> 4)]));
                    s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
                }
                s
            }

            /// Parses the 32-character hex form.
            pub fn from_hex(s: &str) -> Option<$t> {
                if s.len() != 32 || !s.is_ascii() {
                    return None;
                }
                let mut out = [0u8; 16];
                for (i, slot) in out.iter_mut().enumerate() {
                    *slot = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
                }
                Some($t(out))
            }

            /// The first 8 bytes as a little-endian u64. The bytes are blake3
            /// output, so this is already a well-mixed hash for tables.
            pub fn low_u64(&self) -> u64 {
                let mut b = [0u8; 8];
                b.copy_from_slice(&self.0[..8]);
                u64::from_le_bytes(b)
            }
        }

        impl std::fmt::Debug for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({})", stringify!($t), self.to_hex())
            }
        }

        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.to_hex())
            }
        }
    };
}
hash_common!(IdHash);
hash_common!(PayloadHash);

fn truncate128(h: blake3::Hash) -> [u8; 16] {
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.as_bytes()[..16]);
    out
}

fn update_len_prefixed(h: &mut blake3::Hasher, s: &str) {
    h.update(&(s.len() as u64).to_le_bytes());
    h.update(s.as_bytes());
}

/// The identity of `event_id` within `tenant_id`.
///
/// One-shot hashing of a small buffer: a streaming `blake3::Hasher` carries
/// ~2 KB of state to set up per call, which dominated the hot path. The bytes
/// hashed are the same either way (domain, then length-prefixed fields).
/// The buffer is on the stack for the usual lengths, so hashing an id
/// allocates nothing (an allocation and a free per event before).
pub fn id_hash(tenant_id: &str, event_id: &str) -> IdHash {
    let len = ID_DOMAIN.len() + 16 + tenant_id.len() + event_id.len();
    let mut on_stack = [0u8; ID_ON_STACK];
    let mut on_heap = Vec::new();
    let buf: &mut [u8] = if len <= ID_ON_STACK {
        &mut on_stack[..len]
    } else {
        on_heap.resize(len, 0);
        &mut on_heap
    };
    let (domain, rest) = buf.split_at_mut(ID_DOMAIN.len());
    domain.copy_from_slice(ID_DOMAIN);
    let (tenant_len, rest) = rest.split_at_mut(8);
    tenant_len.copy_from_slice(&(tenant_id.len() as u64).to_le_bytes());
    let (tenant, rest) = rest.split_at_mut(tenant_id.len());
    tenant.copy_from_slice(tenant_id.as_bytes());
    let (event_len, event) = rest.split_at_mut(8);
    event_len.copy_from_slice(&(event_id.len() as u64).to_le_bytes());
    event.copy_from_slice(event_id.as_bytes());
    IdHash(truncate128(blake3::hash(buf)))
}

/// The longest id buffer [`id_hash`] keeps on the stack: the domain, two
/// lengths and 131 bytes of tenant and event id together, room for the
/// usual ids; longer ones take the heap. Not the whole default limit
/// (`max_id_bytes`, 256 each): the buffer is zeroed on every call.
const ID_ON_STACK: usize = 160;

/// Derives event ids for events sent without one. Keyed by the configured
/// salt so ids cannot be predicted or collided on purpose by a producer that
/// does not know it.
#[derive(Clone)]
pub struct IdDeriver {
    key: [u8; 32],
}

impl std::fmt::Debug for IdDeriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdDeriver { key: <redacted> }")
    }
}

impl IdDeriver {
    pub fn new(salt: &str) -> IdDeriver {
        IdDeriver { key: blake3::derive_key(DERIVE_CONTEXT, salt.as_bytes()) }
    }

    /// `drv_` + 32 hex characters over the business tuple
    /// `(tenant_id, customer_id, meter, resource_id, timestamp_ms)`: a retry of
    /// the same logical event derives the same id.
    pub fn derive(
        &self,
        tenant_id: &str,
        customer_id: &str,
        meter: &str,
        resource_id: Option<&str>,
        timestamp_ms: i64,
    ) -> String {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        update_len_prefixed(&mut h, tenant_id);
        update_len_prefixed(&mut h, customer_id);
        update_len_prefixed(&mut h, meter);
        match resource_id {
            // The presence byte keeps "absent" distinct from every string.
            Some(r) => {
                h.update(&[1]);
                update_len_prefixed(&mut h, r);
            }
            None => {
                h.update(&[0]);
            }
        }
        h.update(&timestamp_ms.to_le_bytes());
        let mut id = String::with_capacity(DERIVED_ID_PREFIX.len() + 32);
        id.push_str(DERIVED_ID_PREFIX);
        id.push_str(&IdHash(truncate128(h.finalize())).to_hex());
        id
    }
}

/// The canonical binary form of a normalised event, the input of the payload
/// hash. Field order and types are part of the format: never reorder.
///
/// Excluded: `event_id_derived` (how the id came to be is not payload) and
/// server-side stamps such as ingest time.
#[derive(bincode::Encode)]
pub struct CanonicalPayload<'a> {
    pub tenant_id: &'a str,
    pub event_id: &'a str,
    pub customer_id: &'a str,
    pub meter: &'a str,
    /// Normalised decimal as (mantissa, scale): `1.50` and `1.5` are `(15, 1)`.
    pub quantity_mantissa: i128,
    pub quantity_scale: u32,
    pub timestamp_ms: i64,
    pub kind: u8,
    pub correction_original_event_id: Option<&'a str>,
    pub correction_reason: Option<&'a str>,
    pub resource_id: Option<&'a str>,
    pub unit: Option<&'a str>,
    pub source: Option<&'a str>,
    /// Encoded exactly as a `Vec<(&str, &str)>` would be (length, then
    /// pairs): borrowing the event's own vector avoids an allocation per event.
    pub dimensions: &'a [(String, String)],
}

impl<'a> CanonicalPayload<'a> {
    pub fn of(e: &'a UsageEvent) -> CanonicalPayload<'a> {
        // The event is normalised at validation, but normalising again is
        // cheap and keeps the hash correct for events built by hand.
        let q = e.quantity.normalize();
        CanonicalPayload {
            tenant_id: &e.tenant_id,
            event_id: &e.event_id,
            customer_id: &e.customer_id,
            meter: &e.meter,
            quantity_mantissa: q.mantissa(),
            quantity_scale: q.scale(),
            timestamp_ms: e.timestamp_ms,
            kind: e.kind.code(),
            correction_original_event_id: e.correction_ref.as_ref().map(|c| c.original_event_id.as_str()),
            correction_reason: e.correction_ref.as_ref().and_then(|c| c.reason.as_deref()),
            resource_id: e.resource_id.as_deref(),
            unit: e.unit.as_deref(),
            source: e.source.as_deref(),
            dimensions: &e.dimensions,
        }
    }
}

/// Hash of the canonical payload. `buf` is scratch space reused across calls
/// so the hot path does not allocate per event.
///
/// # Panics
///
/// Never in practice: encoding into a `Vec` has no I/O error and the
/// configuration sets no size limit, which are bincode's only failure causes.
pub fn payload_hash_with(e: &UsageEvent, buf: &mut Vec<u8>) -> PayloadHash {
    buf.clear();
    buf.extend_from_slice(PAYLOAD_DOMAIN);
    #[allow(clippy::expect_used)]
    bincode::encode_into_writer(CanonicalPayload::of(e), AppendTo(buf), BINCODE_CONFIG)
        .expect("bincode encoding into a Vec without a size limit cannot fail");
    // One-shot: the same bytes as domain-then-encoding through a streaming
    // hasher, without its per-call setup.
    PayloadHash(truncate128(blake3::hash(buf)))
}

/// bincode's output appended to a `Vec`, with no `std::io` layer between:
/// bincode's own `std::io::Write` adapter wraps every field's bytes in an
/// I/O result it counts and maps (5% of the offline path's instructions
/// went to encoding). The bytes are the same: `payload_hash_is_pinned`
/// (tests/) pins one event's, and `the_payload_is_encoded_as_bincode_encodes_it`
/// compares every optional field against bincode's own `Vec` encoding.
struct AppendTo<'a>(&'a mut Vec<u8>);

impl bincode::enc::write::Writer for AppendTo<'_> {
    #[inline]
    fn write(&mut self, bytes: &[u8]) -> Result<(), bincode::error::EncodeError> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }
}

/// Hash of the canonical payload.
pub fn payload_hash(e: &UsageEvent) -> PayloadHash {
    payload_hash_with(e, &mut Vec::with_capacity(256))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{CorrectionRef, EventKind};

    /// Events with every optional field on and off and up to three
    /// dimensions, for the encoding tests (the event layer builds its own:
    /// it does not depend on the storage layer's builders).
    fn varied_event(n: u64) -> UsageEvent {
        let kind = [EventKind::Usage, EventKind::Correction, EventKind::Retraction][(n % 3) as usize];
        UsageEvent {
            event_id: format!("evt_{n}"),
            tenant_id: format!("tenant_{}", n % 5),
            customer_id: format!("cus_{}", n % 7),
            meter: "api_calls".into(),
            quantity: rust_decimal::Decimal::new(n as i64 * 37 - 900, (n % 5) as u32),
            timestamp_ms: 1_700_000_000_000 + n as i64,
            kind,
            correction_ref: (kind != EventKind::Usage).then(|| CorrectionRef {
                original_event_id: format!("evt_{}", n / 2),
                reason: (n % 2 == 0).then(|| "late fix".to_string()),
            }),
            resource_id: (n % 3 != 0).then(|| format!("req-{n}")),
            unit: (n % 4 == 0).then(|| "requests".to_string()),
            source: (n % 5 != 1).then(|| "edge".to_string()),
            dimensions: (0..(n % 4)).map(|i| (format!("k{i}"), format!("v{}", n % (i + 2)))).collect(),
            ..UsageEvent::blank()
        }
    }

    /// The stack buffer and the heap one hash what a streaming hasher over
    /// the domain and the length-prefixed ids hashes, on either side of
    /// the stack buffer's size.
    #[test]
    fn ids_on_either_side_of_the_stack_buffer_hash_as_the_streaming_definition() {
        let room = ID_ON_STACK - ID_DOMAIN.len() - 16;
        for (tenant_len, event_len) in
            [(0, 0), (4, 12), (30, room - 31), (30, room - 30), (30, room - 29), (256, 256), (5, 2000)]
        {
            let (tenant, event) = ("t".repeat(tenant_len), "e".repeat(event_len));
            let mut h = blake3::Hasher::new();
            h.update(ID_DOMAIN);
            update_len_prefixed(&mut h, &tenant);
            update_len_prefixed(&mut h, &event);
            assert_eq!(id_hash(&tenant, &event), IdHash(truncate128(h.finalize())), "{tenant_len} and {event_len}");
        }
    }

    /// The appending writer gives bincode's own bytes: every optional field,
    /// correction and dimension count of the sample events, with the buffer
    /// reused as the hot path reuses it.
    #[test]
    fn the_payload_is_encoded_as_bincode_encodes_it() {
        let mut buf = Vec::new();
        for n in 0..84 {
            let e = varied_event(n);
            let hash = payload_hash_with(&e, &mut buf);
            let mut want = PAYLOAD_DOMAIN.to_vec();
            want.extend(bincode::encode_to_vec(CanonicalPayload::of(&e), BINCODE_CONFIG).expect("encode"));
            assert_eq!(buf, want, "event {n}");
            assert_eq!(hash, PayloadHash(truncate128(blake3::hash(&want))), "event {n}");
        }
    }
}
