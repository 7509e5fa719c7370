//! The sidecar index of a segment: its keys, without the event bodies, so
//! recovery rebuilds the hot cache without decompressing segments.
//!
//! ```text
//! segments/<id:020>.idx  (little-endian)
//!   header   24 bytes: magic b"DSIX", version u16 = 1, reserved u16 = 0,
//!            segment_id u64, entry_count u64
//!   entries  entry_count * 68 bytes, in row order (= ingest order, so
//!            nearly sorted by first_seen_ms, which recovery sorts by):
//!              id_hash [16], payload_hash [16], first_seen_ms i64,
//!              output partition i32, output offset i64,
//!              source partition i32, source offset i64,
//!              row u32 (index of the row in the segment)
//!   trailer  8 bytes: crc32c u32 over header and entries, magic b"DSIX"
//! ```
//!
//! A sidecar is derived data: when it is missing or fails its checksum the
//! segment itself is scanned instead (counted as the `fallback` recovery path).

use std::path::{Path, PathBuf};

use super::error::IoContext;
use super::fs::FileSystem;
use super::StorageError;
use crate::classify::SeenKey;
use crate::event::{IdHash, PayloadHash, Position};

pub const MAGIC: [u8; 4] = *b"DSIX";
pub const VERSION: u16 = 1;
const HEADER_LEN: usize = 24;
const ENTRY_LEN: usize = 68;
const TRAILER_LEN: usize = 8;

pub(crate) fn sidecar_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:020}.idx"))
}

/// One key of a segment and the row holding its event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SidecarEntry {
    pub key: SeenKey,
    pub row: u32,
}

/// Encodes the sidecar of segment `segment_id` whose rows have `keys`, in row order.
pub(crate) fn encode(segment_id: u64, keys: &[SeenKey]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + keys.len() * ENTRY_LEN + TRAILER_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&segment_id.to_le_bytes());
    out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for (row, k) in keys.iter().enumerate() {
        let row = row as u32;
        out.extend_from_slice(&k.id_hash.0);
        out.extend_from_slice(&k.payload_hash.0);
        out.extend_from_slice(&k.first_seen_ms.to_le_bytes());
        out.extend_from_slice(&k.output.partition.to_le_bytes());
        out.extend_from_slice(&k.output.offset.to_le_bytes());
        out.extend_from_slice(&k.source.partition.to_le_bytes());
        out.extend_from_slice(&k.source.offset.to_le_bytes());
        out.extend_from_slice(&row.to_le_bytes());
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&MAGIC);
    out
}

fn le_i64(b: &[u8]) -> i64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    i64::from_le_bytes(a)
}

fn le_i32(b: &[u8]) -> i32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    i32::from_le_bytes(a)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

/// Reads and checks the sidecar at `path`, which must belong to `segment_id`,
/// and calls `visit` on each entry in row order. Nothing is visited unless the
/// whole file's checksum holds.
pub(crate) fn read_each(
    fs: &dyn FileSystem,
    path: &Path,
    segment_id: u64,
    mut visit: impl FnMut(SidecarEntry),
) -> Result<(), StorageError> {
    let bytes = fs.read(path).at(path)?;
    let corrupt = |offset: usize, detail: String| StorageError::corrupt(path, offset as u64, detail);
    if bytes.len() < HEADER_LEN + TRAILER_LEN {
        return Err(corrupt(0, format!("{} bytes, too short for a sidecar", bytes.len())));
    }
    let t = bytes.len() - TRAILER_LEN;
    if bytes[0..4] != MAGIC || bytes[t + 4..] != MAGIC {
        return Err(corrupt(0, "bad magic".into()));
    }
    let expected = le_u32(&bytes[t..]);
    let got = crc32c::crc32c(&bytes[..t]);
    if got != expected {
        return Err(StorageError::ChecksumMismatch { file: path.into(), offset: t as u64, expected, got });
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != VERSION {
        return Err(StorageError::UnsupportedVersion {
            file: path.into(),
            what: "sidecar",
            found: version,
            supported: VERSION,
        });
    }
    let owner = le_i64(&bytes[8..]) as u64;
    let count = le_i64(&bytes[16..]) as u64;
    if owner != segment_id {
        return Err(corrupt(8, format!("sidecar belongs to segment {owner}, not {segment_id}")));
    }
    if (t - HEADER_LEN) as u64 != count.saturating_mul(ENTRY_LEN as u64) {
        return Err(corrupt(16, format!("entry count {count} does not match the file length")));
    }
    for e in bytes[HEADER_LEN..t].chunks_exact(ENTRY_LEN) {
        let mut id = [0u8; 16];
        let mut payload = [0u8; 16];
        id.copy_from_slice(&e[0..16]);
        payload.copy_from_slice(&e[16..32]);
        visit(SidecarEntry {
            key: SeenKey {
                id_hash: IdHash(id),
                payload_hash: PayloadHash(payload),
                first_seen_ms: le_i64(&e[32..]),
                output: Position::new(le_i32(&e[40..]), le_i64(&e[44..])),
                source: Position::new(le_i32(&e[52..]), le_i64(&e[56..])),
            },
            row: le_u32(&e[64..]),
        });
    }
    Ok(())
}

/// [`read_each`] collected into a vector, in row order.
pub(crate) fn read(fs: &dyn FileSystem, path: &Path, segment_id: u64) -> Result<Vec<SidecarEntry>, StorageError> {
    let mut out = Vec::new();
    read_each(fs, path, segment_id, |e| out.push(e))?;
    Ok(out)
}
