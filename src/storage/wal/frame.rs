//! The WAL frame: one group-committed batch of records.
//!
//! ```text
//! WAL file: frame*  (no file header; every frame is self-describing)
//!
//! frame (little-endian)
//!   off  size  field
//!   0    4     magic        b"DWAL"
//!   4    2     version      1
//!   6    2     kind         1 = batch of StoredEvent records, 2 = link
//!   8    4     payload_len  bytes after this 16-byte header
//!   12   4     crc32c       over header bytes 0..12, then the payload
//!   16   n     payload      kind 1: u32 record count, then records (storage::codec)
//!                           kind 2: u64 previous file's seq, u64 its length in bytes
//! ```
//!
//! A link frame opens every WAL file this version creates (never anywhere
//! else): it records where the file before it ended. A sealed file is
//! never written again, so a file that no longer ends there lost its last
//! frames (cut at a frame boundary, or emptied), which nothing in the file
//! itself could show: replay and `verify` check it against the next
//! file's link. The link also names the file before (its seq), so a file
//! removed with the later ones renumbered to close the gap is caught too.
//! Files from before links (their first frame a batch) are
//! read as they always were. Older versions refuse a link frame.
//!
//! One `append` call writes one frame (or several, if the batch exceeds
//! [`MAX_PAYLOAD`]), so a frame is the unit of atomicity: after a crash a
//! frame is either wholly present with a good checksum or it is the torn tail.

use crate::storage::codec::{decode_event, DecodeError, Reader};
use crate::storage::StoredEvent;

pub const MAGIC: [u8; 4] = *b"DWAL";
pub const VERSION: u16 = 1;
pub const KIND_BATCH: u16 = 1;
pub const KIND_LINK: u16 = 2;
pub const HEADER_LEN: usize = 16;
/// Largest payload one frame carries; bigger batches span several frames.
pub const MAX_PAYLOAD: usize = 64 << 20;

/// Appends one frame holding `payload` (already encoded: count + records).
pub(crate) fn write_frame(out: &mut Vec<u8>, payload: &[u8]) {
    write_frame_of(out, KIND_BATCH, payload);
}

/// Appends the link frame that opens a new WAL file: the file before it
/// (`previous_seq`) ended at `previous_len` bytes.
pub(crate) fn write_link_frame(out: &mut Vec<u8>, previous_seq: u64, previous_len: u64) {
    let mut payload = [0u8; 16];
    payload[..8].copy_from_slice(&previous_seq.to_le_bytes());
    payload[8..].copy_from_slice(&previous_len.to_le_bytes());
    write_frame_of(out, KIND_LINK, &payload);
}

fn write_frame_of(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[start..start + 12]), payload);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(payload);
}

/// What was found at one offset of a WAL file.
#[derive(Debug)]
pub(crate) enum FrameRead {
    /// A valid frame: its decoded records and total length.
    Frame { events: Vec<StoredEvent>, len: usize },
    /// A valid link frame: where the file before this one ended.
    Link { previous_seq: u64, previous_len: u64, len: usize },
    /// Fewer bytes left than the header or the declared length: a write cut short.
    Truncated { detail: String },
    /// Bytes that are not a valid frame (bad magic, checksum, version or body).
    Invalid { detail: String },
}

/// Parses the frame starting at `buf[0]`.
pub(crate) fn read_frame(buf: &[u8]) -> FrameRead {
    if buf.len() < HEADER_LEN {
        return FrameRead::Truncated { detail: format!("{} bytes, shorter than a frame header", buf.len()) };
    }
    if buf[0..4] != MAGIC {
        return FrameRead::Invalid { detail: format!("bad magic {:02x?}", &buf[0..4]) };
    }
    let len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
    let expected = u32::from_le_bytes([buf[12], buf[13], buf[14], buf[15]]);
    let end = HEADER_LEN + len;
    if len > MAX_PAYLOAD {
        return FrameRead::Invalid { detail: format!("declared length {len} exceeds the maximum") };
    }
    if buf.len() < end {
        return FrameRead::Truncated {
            detail: format!("frame declares {len} payload bytes, {} present", buf.len() - HEADER_LEN),
        };
    }
    let payload = &buf[HEADER_LEN..end];
    let got = crc32c::crc32c_append(crc32c::crc32c(&buf[0..12]), payload);
    if got != expected {
        return FrameRead::Invalid { detail: format!("checksum mismatch: expected {expected:#010x}, got {got:#010x}") };
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    let kind = u16::from_le_bytes([buf[6], buf[7]]);
    if version == VERSION && kind == KIND_LINK && payload.len() == 16 {
        let word = |at: usize| u64::from_le_bytes(payload[at..at + 8].try_into().unwrap_or([0; 8]));
        return FrameRead::Link { previous_seq: word(0), previous_len: word(8), len: end };
    }
    if version != VERSION || kind != KIND_BATCH {
        return FrameRead::Invalid { detail: format!("unsupported frame version {version} kind {kind}") };
    }
    match decode_payload(payload) {
        Ok(events) => FrameRead::Frame { events, len: end },
        Err(DecodeError(d)) => FrameRead::Invalid { detail: format!("checksummed payload does not decode: {d}") },
    }
}

fn decode_payload(payload: &[u8]) -> Result<Vec<StoredEvent>, DecodeError> {
    let mut r = Reader::new(payload);
    let count = r.u32()? as usize;
    let mut events = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        events.push(decode_event(&mut r)?);
    }
    if !r.is_empty() {
        return Err(DecodeError(format!("{} trailing bytes after {count} records", payload.len() - r.position())));
    }
    Ok(events)
}
