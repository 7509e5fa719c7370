//! Reading WAL files back: replay on open, and `verify`.
//!
//! The recovery mode follows RocksDB's `kTolerateCorruptedTailRecords`: in the
//! *last* WAL file, a frame that runs past the end of the file, or a bad frame
//! with nothing but zeros or nothing at all after it, is a torn tail: it is
//! truncated away and everything before it is kept. Anything else that fails
//! to parse — in a sealed file, or with data after it — is mid-log corruption
//! and a hard error naming the file and offset. It is never skipped: skipping
//! would silently lose accepted events.

use std::path::{Path, PathBuf};

use super::frame::{read_frame, FrameRead};
use crate::storage::error::IoContext;
use crate::storage::{StorageError, StoredEvent};

/// The outcome of scanning one WAL file.
#[derive(Debug)]
pub(crate) struct WalScan {
    pub frames: usize,
    /// Where valid data ends; equals the file length unless a tail is torn.
    pub valid_len: u64,
    pub file_len: u64,
    /// Set when a torn tail was found: what it looked like.
    pub torn: Option<String>,
}

/// Scans `path`, calling `on_frame` for each valid frame in order.
/// `is_last` allows a torn tail; otherwise any bad frame is an error.
pub(crate) fn scan_file(
    path: &Path,
    is_last: bool,
    mut on_frame: impl FnMut(Vec<StoredEvent>) -> Result<(), StorageError>,
) -> Result<WalScan, StorageError> {
    let buf = std::fs::read(path).at(path)?;
    let mut off = 0usize;
    let mut frames = 0usize;
    while off < buf.len() {
        match read_frame(&buf[off..]) {
            FrameRead::Frame { events, len } => {
                on_frame(events)?;
                frames += 1;
                off += len;
            }
            FrameRead::Truncated { detail } => {
                return tail_or_error(path, &buf, off, frames, is_last, detail);
            }
            FrameRead::Invalid { detail, .. } => {
                return tail_or_error(path, &buf, off, frames, is_last, detail);
            }
        }
    }
    Ok(WalScan { frames, valid_len: buf.len() as u64, file_len: buf.len() as u64, torn: None })
}

fn tail_or_error(
    path: &Path,
    buf: &[u8],
    off: usize,
    frames: usize,
    is_last: bool,
    detail: String,
) -> Result<WalScan, StorageError> {
    // A torn write leaves the bad frame last. If any valid frame can be found
    // after it (searching byte by byte for a magic that starts a frame with a
    // good checksum), the damage is in the middle: a flipped length field must
    // not pass for a torn tail and swallow the fsynced frames after it.
    if is_last && !valid_frame_after(buf, off + 1) {
        return Ok(WalScan {
            frames,
            valid_len: off as u64,
            file_len: buf.len() as u64,
            torn: Some(format!("{detail}; {} bytes from offset {off} dropped", buf.len() - off)),
        });
    }
    Err(StorageError::WalMidLogCorruption { file: PathBuf::from(path), offset: off as u64, detail })
}

fn valid_frame_after(buf: &[u8], from: usize) -> bool {
    let mut i = from;
    while i + super::frame::HEADER_LEN <= buf.len() {
        if buf[i..i + 4] == super::frame::MAGIC && matches!(read_frame(&buf[i..]), FrameRead::Frame { .. }) {
            return true;
        }
        i += 1;
    }
    false
}
