//! Manifest generations: the one durable statement of what the store holds.
//!
//! ```text
//! manifest/MANIFEST-<generation:020>  (little-endian)
//!   header  16 bytes: magic b"DMAN", version u16 = 1, reserved u16 = 0,
//!           body_len u32, body crc32c u32
//!   body    generation u64
//!           next_segment_id u64
//!           wal_start u64            first WAL file not yet captured by a segment
//!           segment_count u32, then per live segment 32 bytes:
//!             id u64, rows u64, min_first_seen_ms i64, max_first_seen_ms i64
//!           checkpoint_count u32, then per partition 12 bytes:
//!             partition i32, output offset i64 (highest stored, durable)
//! ```
//!
//! A generation is written to `MANIFEST-<g>.tmp`, fsynced, renamed into place,
//! and the directory fsynced. Open takes the newest generation whose checksum
//! holds; a newer one that fails is skipped (and reported). Files are deleted
//! only when neither the current nor the previous generation names them, so
//! falling back one generation never finds its segments or WAL gone.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::codec::{DecodeError, Reader};
use super::error::IoContext;
use super::fs::FileSystem;
use super::segment::SegmentMeta;
use super::{fsutil, StorageError};

pub const MAGIC: [u8; 4] = *b"DMAN";
pub const VERSION: u16 = 1;
const HEADER_LEN: usize = 16;

/// One manifest generation.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Manifest {
    pub generation: u64,
    pub next_segment_id: u64,
    pub wal_start: u64,
    pub segments: Vec<SegmentMeta>,
    pub checkpoints: BTreeMap<i32, i64>,
}

pub(crate) fn manifest_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("MANIFEST-{generation:020}"))
}

impl Manifest {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(40 + self.segments.len() * 32 + self.checkpoints.len() * 12);
        body.extend_from_slice(&self.generation.to_le_bytes());
        body.extend_from_slice(&self.next_segment_id.to_le_bytes());
        body.extend_from_slice(&self.wal_start.to_le_bytes());
        body.extend_from_slice(&(self.segments.len() as u32).to_le_bytes());
        for s in &self.segments {
            body.extend_from_slice(&s.id.to_le_bytes());
            body.extend_from_slice(&s.rows.to_le_bytes());
            body.extend_from_slice(&s.min_first_seen_ms.to_le_bytes());
            body.extend_from_slice(&s.max_first_seen_ms.to_le_bytes());
        }
        body.extend_from_slice(&(self.checkpoints.len() as u32).to_le_bytes());
        for (p, o) in &self.checkpoints {
            body.extend_from_slice(&p.to_le_bytes());
            body.extend_from_slice(&o.to_le_bytes());
        }
        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    pub(crate) fn decode(path: &Path, bytes: &[u8]) -> Result<Manifest, StorageError> {
        let corrupt = |offset: usize, detail: String| StorageError::corrupt(path, offset as u64, detail);
        if bytes.len() < HEADER_LEN || bytes[0..4] != MAGIC {
            return Err(corrupt(0, "bad magic or shorter than a header".into()));
        }
        let mut h = Reader::new(&bytes[4..HEADER_LEN]);
        let parse_header = |h: &mut Reader<'_>| -> Result<(u16, u32, u32), DecodeError> {
            let v = h.u16()?;
            h.u16()?;
            Ok((v, h.u32()?, h.u32()?))
        };
        let (version, body_len, expected) = parse_header(&mut h).map_err(|e| corrupt(4, e.0))?;
        if bytes.len() - HEADER_LEN != body_len as usize {
            return Err(corrupt(8, format!("body length {body_len} but {} bytes follow", bytes.len() - HEADER_LEN)));
        }
        let body = &bytes[HEADER_LEN..];
        let got = crc32c::crc32c(body);
        if got != expected {
            return Err(StorageError::ChecksumMismatch { file: path.into(), offset: HEADER_LEN as u64, expected, got });
        }
        if version != VERSION {
            return Err(StorageError::UnsupportedVersion {
                file: path.into(),
                what: "manifest",
                found: version,
                supported: VERSION,
            });
        }
        let parse_body = |r: &mut Reader<'_>| -> Result<Manifest, DecodeError> {
            let mut m = Manifest {
                generation: r.u64()?,
                next_segment_id: r.u64()?,
                wal_start: r.u64()?,
                ..Manifest::default()
            };
            for _ in 0..r.u32()? {
                m.segments.push(SegmentMeta {
                    id: r.u64()?,
                    rows: r.u64()?,
                    min_first_seen_ms: r.i64()?,
                    max_first_seen_ms: r.i64()?,
                });
            }
            for _ in 0..r.u32()? {
                let p = r.i32()?;
                m.checkpoints.insert(p, r.i64()?);
            }
            if !r.is_empty() {
                return Err(DecodeError("trailing bytes".into()));
            }
            Ok(m)
        };
        parse_body(&mut Reader::new(body)).map_err(|e| corrupt(HEADER_LEN, e.0))
    }

    /// Writes this generation durably (temp, fsync, rename, fsync dir).
    pub(crate) fn write(&self, fs: &dyn FileSystem, dir: &Path, crash_at: Option<&str>) -> Result<(), StorageError> {
        let path = manifest_path(dir, self.generation);
        fsutil::write_atomic(fs, &path, &self.encode(), Some("manifest_after_temp"), crash_at)?;
        super::failpoint::check("manifest_after_rename", crash_at)
    }
}

/// The manifest files in `dir`, newest generation first (temp files excluded).
pub(crate) fn list(fs: &dyn FileSystem, dir: &Path) -> Result<Vec<(u64, PathBuf)>, StorageError> {
    let mut out = super::fsutil::list_numbered(fs, dir, |name| {
        name.strip_prefix("MANIFEST-").and_then(|s| s.parse::<u64>().ok())
    })?;
    out.reverse();
    Ok(out)
}

/// What open found in `manifest/`.
pub(crate) struct Loaded {
    pub current: Manifest,
    /// The next older readable generation: its files are kept too.
    pub previous: Option<Manifest>,
    /// Newer generations that failed to read, with why.
    pub skipped: Vec<(PathBuf, String)>,
    /// Highest generation number present on disk, readable or not.
    pub highest_generation: u64,
}

/// Loads the newest readable generation. `Ok(None)` when there is no
/// manifest file at all; an error when files exist but none reads.
pub(crate) fn load(fs: &dyn FileSystem, dir: &Path) -> Result<Option<Loaded>, StorageError> {
    let files = list(fs, dir)?;
    let Some(&(highest_generation, _)) = files.first() else { return Ok(None) };
    let mut skipped = Vec::new();
    let mut good: Vec<Manifest> = Vec::new();
    for (g, path) in &files {
        let bytes = fs.read(path).at(path)?;
        match Manifest::decode(path, &bytes) {
            Ok(m) if m.generation == *g => good.push(m),
            Ok(m) => skipped.push((path.clone(), format!("names generation {} inside", m.generation))),
            Err(e) if good.is_empty() => skipped.push((path.clone(), e.to_string())),
            Err(_) => {}
        }
        if good.len() == 2 {
            break;
        }
    }
    let mut good = good.into_iter();
    match good.next() {
        Some(current) => Ok(Some(Loaded { current, previous: good.next(), skipped, highest_generation })),
        None => Err(StorageError::NoValidManifest { dir: dir.into(), tried: files.len() }),
    }
}
