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
use crate::storage::fs::FileSystem;
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
    /// The link frame opening the file, if it has one: the seq of the file
    /// before it and that file's length (see [`super::frame`]).
    pub link: Option<(u64, u64)>,
}

/// Checks a file's own link (`link`, as [`WalScan::link`]) against its
/// number: a file is always created right after the one before it, so its
/// link names `seq - 1`. Naming another means the file was renamed, the
/// files after a removed one numbered down to close the gap (or a file of
/// another store put in its place): the file it followed is gone with its
/// events, which is mid-log corruption. A file without a link (a store's
/// first, or written before links) is not checked.
pub(crate) fn check_own_link(seq: u64, path: &Path, link: Option<(u64, u64)>) -> Result<(), StorageError> {
    match link {
        Some((linked_seq, _)) if linked_seq.checked_add(1) != Some(seq) => Err(StorageError::WalMidLogCorruption {
            file: PathBuf::from(path),
            offset: 0,
            detail: format!(
                "its link names file {linked_seq} as the one before it, but it is file {seq}: it was renamed, and \
                 the WAL file it followed is gone, with its events"
            ),
        }),
        _ => Ok(()),
    }
}

/// Checks `previous` (seq, scanned length) against the link recorded by
/// the file after it (`next`): a sealed file that no longer ends where the
/// next one recorded lost frames, and that loss is mid-log corruption.
pub(crate) fn check_link(previous: (u64, &Path, u64), next: Option<(u64, u64)>) -> Result<(), StorageError> {
    let (seq, path, len) = previous;
    match next {
        Some((linked_seq, linked_len)) if linked_seq == seq && linked_len != len => {
            Err(StorageError::WalMidLogCorruption {
                file: PathBuf::from(path),
                offset: len.min(linked_len),
                detail: format!(
                    "the file is {len} bytes, but the next WAL file recorded it as ending at {linked_len}: \
                     frames of a sealed file are gone"
                ),
            })
        }
        _ => Ok(()),
    }
}

/// Scans `path`, calling `on_frame` for each valid frame in order.
/// `is_last` allows a torn tail; otherwise any bad frame is an error.
pub(crate) fn scan_file(
    fs: &dyn FileSystem,
    path: &Path,
    is_last: bool,
    mut on_frame: impl FnMut(Vec<StoredEvent>) -> Result<(), StorageError>,
) -> Result<WalScan, StorageError> {
    let buf = fs.read(path).at(path)?;
    let mut off = 0usize;
    let mut frames = 0usize;
    let mut link = None;
    while off < buf.len() {
        match read_frame(&buf[off..]) {
            FrameRead::Frame { events, len } => {
                on_frame(events)?;
                frames += 1;
                off += len;
            }
            FrameRead::Link { previous_seq, previous_len, len } if off == 0 => {
                link = Some((previous_seq, previous_len));
                off += len;
            }
            FrameRead::Link { .. } => {
                let detail = "a link frame past the start of the file".to_string();
                return Err(StorageError::WalMidLogCorruption {
                    file: PathBuf::from(path),
                    offset: off as u64,
                    detail,
                });
            }
            FrameRead::Truncated { detail } => {
                return tail_or_error(path, &buf, (off, frames, link), is_last, detail);
            }
            FrameRead::Invalid { detail, .. } => {
                return tail_or_error(path, &buf, (off, frames, link), is_last, detail);
            }
        }
    }
    Ok(WalScan { frames, valid_len: buf.len() as u64, file_len: buf.len() as u64, torn: None, link })
}

/// Whether `path` may hold stored events: a frame of them, or bytes that
/// are no frame a crash leaves (mid-log damage could hide events). Empty
/// files and files holding only a link frame, or a torn one, hold none.
pub(crate) fn holds_events(fs: &dyn FileSystem, path: &Path) -> bool {
    let mut events = false;
    match scan_file(fs, path, true, |batch| {
        events |= !batch.is_empty();
        Ok(())
    }) {
        Ok(_) => events,
        Err(_) => true,
    }
}

/// `at`: where the bad frame starts, the good frames before it, and the
/// file's link frame if it had one.
fn tail_or_error(
    path: &Path,
    buf: &[u8],
    at: (usize, usize, Option<(u64, u64)>),
    is_last: bool,
    detail: String,
) -> Result<WalScan, StorageError> {
    let (off, frames, link) = at;
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
            link,
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

#[cfg(test)]
mod tests {
    use super::super::frame::{write_frame, HEADER_LEN};
    use super::*;
    use crate::storage::codec::encode_event;
    use crate::storage::testutil::sample_event;

    /// A file's link names the file created just before it; any other
    /// number is a renamed file (the first live one included, whose
    /// predecessor a flush removed), and no link is not checked.
    #[test]
    fn a_files_own_link_names_the_file_just_before_it() {
        let path = Path::new("wal/00000000000000000005.wal");
        assert!(check_own_link(5, path, Some((4, 100))).is_ok());
        assert!(check_own_link(5, path, None).is_ok());
        for linked in [5, 3, 6, u64::MAX] {
            let e = check_own_link(5, path, Some((linked, 100)));
            assert!(
                matches!(&e, Err(StorageError::WalMidLogCorruption { file, .. }) if file == path),
                "{linked}: {e:?}"
            );
        }
    }

    /// Three frames of two events each; returns the file bytes and frame starts.
    fn three_frames() -> (Vec<u8>, Vec<usize>) {
        let mut file = Vec::new();
        let mut starts = Vec::new();
        for f in 0..3u64 {
            let mut payload = 2u32.to_le_bytes().to_vec();
            for i in 0..2 {
                encode_event(&sample_event(f * 2 + i, 0, (f * 2 + i) as i64), &mut payload);
            }
            starts.push(file.len());
            write_frame(&mut file, &payload);
        }
        (file, starts)
    }

    fn scan(bytes: &[u8], is_last: bool) -> Result<WalScan, StorageError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x.wal");
        std::fs::write(&path, bytes).expect("write");
        scan_file(&crate::storage::fs::RealFs, &path, is_last, |_| Ok(()))
    }

    #[test]
    fn a_frame_cut_short_at_the_end_of_the_last_file_is_a_torn_tail() {
        let (file, starts) = three_frames();
        for cut in [starts[2] + 1, starts[2] + HEADER_LEN, file.len() - 1] {
            let r = scan(&file[..cut], true);
            assert!(
                matches!(&r, Ok(s) if s.frames == 2 && s.valid_len == starts[2] as u64 && s.torn.is_some()),
                "{r:?}"
            );
        }
    }

    #[test]
    fn zero_fill_after_the_last_frame_is_a_torn_tail() {
        let (mut file, _) = three_frames();
        let len = file.len();
        file.extend_from_slice(&[0u8; 4096]);
        assert!(matches!(scan(&file, true), Ok(s) if s.frames == 3 && s.valid_len == len as u64));
    }

    #[test]
    fn a_flipped_length_field_mid_log_is_not_mistaken_for_a_torn_tail() {
        let (mut file, starts) = three_frames();
        // Declares a payload running past the end of the file.
        file[starts[1] + 10] = 0x7f;
        let r = scan(&file, true);
        assert!(matches!(r, Err(StorageError::WalMidLogCorruption { offset, .. }) if offset == starts[1] as u64));
    }

    #[test]
    fn any_bad_frame_in_a_sealed_file_is_a_hard_error() {
        let (file, starts) = three_frames();
        let r = scan(&file[..file.len() - 1], false);
        assert!(matches!(r, Err(StorageError::WalMidLogCorruption { offset, .. }) if offset == starts[2] as u64));
    }
}
