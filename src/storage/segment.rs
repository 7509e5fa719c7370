//! Immutable columnar segments: what the memtable flushes to and compaction
//! rewrites.
//!
//! ```text
//! segments/<id:020>.seg  (little-endian), version 2: row groups
//!   header   8 bytes: magic b"DSEG", version u16 = 2, reserved u16 = 0
//!   groups   back to back, each a complete version-1 image (below) of
//!            GROUP_ROWS rows or fewer, in row order (a flush writes full
//!            groups and a short last one; compaction copies full groups
//!            as they are and packs the rest into full groups again, so a
//!            merged segment keeps a short group only before a copied one)
//!   index    row_count u64, min_first_seen_ms i64, max_first_seen_ms i64,
//!            group_count u32, then per group 32 bytes: offset u64 (from
//!            file start), len u32, rows u32, min_first_seen_ms i64,
//!            max_first_seen_ms i64
//!   trailer  12 bytes: index_len u32, index crc32c u32, magic b"DSEG"
//!
//! a version-1 image (a whole segment file before version 2, a group now)
//!   header   8 bytes: magic b"DSEG", version u16 = 1, reserved u16 = 0
//!   blocks   one per column, zstd-compressed, back to back
//!   footer   row_count u64, min_first_seen_ms i64, max_first_seen_ms i64,
//!            column_count u16, then per column 22 bytes:
//!              column id u8, encoding u8, offset u64 (from image start),
//!              stored_len u32, raw_len u32, crc32c u32 (of the stored bytes)
//!   trailer  12 bytes: footer_len u32, footer crc32c u32, magic b"DSEG"
//!
//! encodings (before zstd):
//!   0 fixed(w)  w bytes per row
//!   1 delta     per row zigzag(value - previous) as varint, previous starts at 0
//!   2 bytes     per value varint(len) + bytes; optional columns use
//!               varint(len + 1), 0 meaning absent
//!   3 varint    per row an unsigned varint
//!
//! columns (id encoding name)
//!   0 delta out_partition   1 delta out_offset    2 delta src_partition
//!   3 delta src_offset      4 delta first_seen_ms 5 fixed(16) id_hash
//!   6 fixed(16) payload_hash 7 delta timestamp_ms 8 fixed(16) quantity
//!   9 fixed(1) kind code | event_id_derived << 4
//!   10..13 bytes event_id, tenant_id, customer_id, meter
//!   14..18 bytes(opt) resource_id, unit, source, corr_original_id, corr_reason
//!   19 varint dimension count   20 bytes dim keys   21 bytes dim values
//! ```
//!
//! Rows keep append order (ingest order), so `first_seen_ms` and offsets are
//! nearly monotonic and delta-encode to a byte or two. Every column block and
//! the footer carry their own CRC32C: `verify` checks them all; readers check
//! the footer and each column they decompress.
//!
//! Why row groups: a conflict's original is one row of a segment that may
//! hold millions. In version 1 finding it read the whole file and
//! decompressed whole columns, per batch, which all but stopped a partition
//! in a conflict storm (#14). The first-seen time the classifier remembers
//! picks the group (groups are in ingest order, so their first-seen ranges
//! barely overlap), and a lookup reads that group alone: the index (kept by
//! the store), one positioned read, its key columns to find the row, and the
//! row's values. Version-1 files are still read (whole, as before) until
//! compaction merges them (only segments under its target size are merged).

use std::path::{Path, PathBuf};

use rust_decimal::Decimal;

use super::codec::{
    correction_ref, kind_from_code, put_opt_str, put_str, put_varint, unzigzag, zigzag, DecodeError, Reader,
};
use super::error::IoContext;
use super::fs::{FileSystem, RangeReader};
use super::{StorageError, StoredEvent};
use crate::classify::SeenKey;
use crate::event::{EventKind, IdHash, PayloadHash, Position, UsageEvent};

pub const MAGIC: [u8; 4] = *b"DSEG";
/// The version written: row groups.
pub const VERSION: u16 = 2;
/// The version of one group's image, and of whole files written before row
/// groups.
const IMAGE_VERSION: u16 = 1;
/// Rows per group: small enough that a lookup's read and decompression are
/// a few kilobytes, large enough that zstd still finds the repetition of a
/// column (tenants, meters, delta-encoded offsets). Measured on the test
/// events: 35.4 bytes a row in one image, 38.3 in groups of 1,024, 39.7 of
/// 512, 42.7 of 256, 48.4 of 128; a conflict storm's batch p50 fell from
/// 21 ms (512) to 17–18 ms (128).
pub(crate) const GROUP_ROWS: usize = 256;
const GROUP_ENTRY_LEN: usize = 32;
const HEADER_LEN: usize = 8;
const TRAILER_LEN: usize = 12;
const COLUMN_ENTRY_LEN: usize = 22;
const ZSTD_LEVEL: i32 = 1;

const ENC_FIXED: u8 = 0;
const ENC_DELTA: u8 = 1;
const ENC_BYTES: u8 = 2;
const ENC_VARINT: u8 = 3;

/// Column ids, in file order.
mod col {
    pub const OUT_PARTITION: u8 = 0;
    pub const OUT_OFFSET: u8 = 1;
    pub const SRC_PARTITION: u8 = 2;
    pub const SRC_OFFSET: u8 = 3;
    pub const FIRST_SEEN: u8 = 4;
    pub const ID_HASH: u8 = 5;
    pub const PAYLOAD_HASH: u8 = 6;
    pub const TIMESTAMP: u8 = 7;
    pub const QUANTITY: u8 = 8;
    pub const KIND_FLAGS: u8 = 9;
    pub const EVENT_ID: u8 = 10;
    pub const TENANT_ID: u8 = 11;
    pub const CUSTOMER_ID: u8 = 12;
    pub const METER: u8 = 13;
    pub const RESOURCE_ID: u8 = 14;
    pub const UNIT: u8 = 15;
    pub const SOURCE: u8 = 16;
    pub const CORR_ORIGINAL: u8 = 17;
    pub const CORR_REASON: u8 = 18;
    pub const DIM_COUNT: u8 = 19;
    pub const DIM_KEY: u8 = 20;
    pub const DIM_VALUE: u8 = 21;
    pub const COUNT: usize = 22;
}

const ENCODINGS: [u8; col::COUNT] = [
    ENC_DELTA, ENC_DELTA, ENC_DELTA, ENC_DELTA, ENC_DELTA, ENC_FIXED, ENC_FIXED, ENC_DELTA, ENC_FIXED, ENC_FIXED,
    ENC_BYTES, ENC_BYTES, ENC_BYTES, ENC_BYTES, ENC_BYTES, ENC_BYTES, ENC_BYTES, ENC_BYTES, ENC_BYTES, ENC_VARINT,
    ENC_BYTES, ENC_BYTES,
];

// One zstd context per thread, reused: creating one per column (22 per
// group written or read) was the largest single cost of a conflict's
// original lookup, ahead of the decompression itself.
thread_local! {
    static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

fn compress(raw: &[u8]) -> std::io::Result<Vec<u8>> {
    COMPRESSOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = Some(zstd::bulk::Compressor::new(ZSTD_LEVEL)?);
        }
        c.as_mut().map_or_else(|| zstd::bulk::compress(raw, ZSTD_LEVEL), |c| c.compress(raw))
    })
}

fn decompress(stored: &[u8], raw_len: usize) -> std::io::Result<Vec<u8>> {
    DECOMPRESSOR.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new()?);
        }
        d.as_mut().map_or_else(|| zstd::bulk::decompress(stored, raw_len), |d| d.decompress(stored, raw_len))
    })
}

pub(crate) fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:020}.seg"))
}

/// Summary of a segment, recorded in the manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentMeta {
    pub id: u64,
    pub rows: u64,
    pub min_first_seen_ms: i64,
    pub max_first_seen_ms: i64,
}

struct DeltaCol {
    out: Vec<u8>,
    prev: i64,
}

impl DeltaCol {
    fn new() -> DeltaCol {
        DeltaCol { out: Vec::new(), prev: 0 }
    }
    fn push(&mut self, v: i64) {
        put_varint(&mut self.out, zigzag(v.wrapping_sub(self.prev)));
        self.prev = v;
    }
}

/// Encodes `rows` into a complete segment file: row groups and their index.
pub(crate) fn encode(id: u64, rows: &[&StoredEvent]) -> Result<(Vec<u8>, SegmentMeta), StorageError> {
    let mut w = SegmentWriter::with_capacity(rows.len() * 48 + 64);
    w.push_rows(rows)?;
    Ok(w.finish(id))
}

/// A version-2 segment built group by group: groups encoded from rows, or
/// copied whole from another segment's file. Compaction copies: a group is
/// a self-contained image (its offsets count from its own start), so a
/// merge of segments whose groups all stay needs no decoding of their
/// rows, only of their keys for the sidecar. Decoding and re-encoding every
/// row was about 2.3 µs of CPU a row, as much as ingest's own main thread
/// on a 2-core machine (#14).
pub(crate) struct SegmentWriter {
    file: Vec<u8>,
    groups: Vec<GroupEntry>,
}

/// Where a [`SegmentWriter`] stood, to go back to.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WriterMark {
    len: usize,
    groups: usize,
}

impl SegmentWriter {
    pub(crate) fn with_capacity(bytes: usize) -> SegmentWriter {
        let mut file = Vec::with_capacity(bytes.max(HEADER_LEN + TRAILER_LEN));
        file.extend_from_slice(&MAGIC);
        file.extend_from_slice(&VERSION.to_le_bytes());
        file.extend_from_slice(&0u16.to_le_bytes());
        SegmentWriter { file, groups: Vec::new() }
    }

    /// Bytes of groups written so far (and the header).
    pub(crate) fn len(&self) -> usize {
        self.file.len()
    }

    pub(crate) fn mark(&self) -> WriterMark {
        WriterMark { len: self.file.len(), groups: self.groups.len() }
    }

    /// Forgets every group pushed since `mark`.
    pub(crate) fn truncate(&mut self, mark: WriterMark) {
        self.file.truncate(mark.len);
        self.groups.truncate(mark.groups);
    }

    /// Encodes `rows` as groups of [`GROUP_ROWS`].
    pub(crate) fn push_rows(&mut self, rows: &[&StoredEvent]) -> Result<(), StorageError> {
        for chunk in rows.chunks(GROUP_ROWS) {
            let (image, min, max) = encode_image(chunk)?;
            self.push_image(&image, chunk.len(), min, max);
        }
        Ok(())
    }

    /// Copies `group` (a group of another segment, or a whole version-1
    /// file) as it is stored, after checking every column's checksum: a
    /// copy must not carry a damaged column into a new segment unnoticed.
    pub(crate) fn push_group(&mut self, group: &SegmentFile) -> Result<(), StorageError> {
        group.check_columns()?;
        let (min, max) = group.first_seen_range;
        self.push_image(&group.bytes, group.rows, min, max);
        Ok(())
    }

    fn push_image(&mut self, image: &[u8], rows: usize, min: i64, max: i64) {
        self.groups.push(GroupEntry {
            offset: self.file.len() as u64,
            len: image.len() as u32,
            rows: rows as u32,
            min_first_seen_ms: min,
            max_first_seen_ms: max,
        });
        self.file.extend_from_slice(image);
    }

    /// The whole file (index and trailer appended) and its meta.
    pub(crate) fn finish(mut self, id: u64) -> (Vec<u8>, SegmentMeta) {
        let rows: u64 = self.groups.iter().map(|g| u64::from(g.rows)).sum();
        let (min_fs, max_fs) = match (
            self.groups.iter().map(|g| g.min_first_seen_ms).min(),
            self.groups.iter().map(|g| g.max_first_seen_ms).max(),
        ) {
            (Some(min), Some(max)) => (min, max),
            _ => (0, 0),
        };
        let mut index = Vec::with_capacity(28 + self.groups.len() * GROUP_ENTRY_LEN);
        index.extend_from_slice(&rows.to_le_bytes());
        index.extend_from_slice(&min_fs.to_le_bytes());
        index.extend_from_slice(&max_fs.to_le_bytes());
        index.extend_from_slice(&(self.groups.len() as u32).to_le_bytes());
        for g in &self.groups {
            index.extend_from_slice(&g.offset.to_le_bytes());
            index.extend_from_slice(&g.len.to_le_bytes());
            index.extend_from_slice(&g.rows.to_le_bytes());
            index.extend_from_slice(&g.min_first_seen_ms.to_le_bytes());
            index.extend_from_slice(&g.max_first_seen_ms.to_le_bytes());
        }
        let index_crc = crc32c::crc32c(&index);
        self.file.extend_from_slice(&index);
        self.file.extend_from_slice(&(index.len() as u32).to_le_bytes());
        self.file.extend_from_slice(&index_crc.to_le_bytes());
        self.file.extend_from_slice(&MAGIC);
        (self.file, SegmentMeta { id, rows, min_first_seen_ms: min_fs, max_first_seen_ms: max_fs })
    }
}

/// Encodes `rows` into a version-1 image (one group): the image and its
/// first-seen range.
pub(crate) fn encode_image(rows: &[&StoredEvent]) -> Result<(Vec<u8>, i64, i64), StorageError> {
    let mut deltas: [DeltaCol; 6] = std::array::from_fn(|_| DeltaCol::new());
    let mut cols: Vec<Vec<u8>> = vec![Vec::new(); col::COUNT];
    let (mut min_fs, mut max_fs) = (i64::MAX, i64::MIN);
    for e in rows {
        let (k, ev) = (&e.key, &e.event);
        deltas[0].push(i64::from(k.output.partition));
        deltas[1].push(k.output.offset);
        deltas[2].push(i64::from(k.source.partition));
        deltas[3].push(k.source.offset);
        deltas[4].push(k.first_seen_ms);
        deltas[5].push(ev.timestamp_ms);
        min_fs = min_fs.min(k.first_seen_ms);
        max_fs = max_fs.max(k.first_seen_ms);
        cols[col::ID_HASH as usize].extend_from_slice(&k.id_hash.0);
        cols[col::PAYLOAD_HASH as usize].extend_from_slice(&k.payload_hash.0);
        cols[col::QUANTITY as usize].extend_from_slice(&ev.quantity.serialize());
        cols[col::KIND_FLAGS as usize].push(ev.kind.code() | (u8::from(ev.event_id_derived) << 4));
        put_str(&mut cols[col::EVENT_ID as usize], &ev.event_id);
        put_str(&mut cols[col::TENANT_ID as usize], &ev.tenant_id);
        put_str(&mut cols[col::CUSTOMER_ID as usize], &ev.customer_id);
        put_str(&mut cols[col::METER as usize], &ev.meter);
        put_opt_str(&mut cols[col::RESOURCE_ID as usize], ev.resource_id.as_deref());
        put_opt_str(&mut cols[col::UNIT as usize], ev.unit.as_deref());
        put_opt_str(&mut cols[col::SOURCE as usize], ev.source.as_deref());
        let corr = ev.correction_ref.as_ref();
        put_opt_str(&mut cols[col::CORR_ORIGINAL as usize], corr.map(|c| c.original_event_id.as_str()));
        put_opt_str(&mut cols[col::CORR_REASON as usize], corr.and_then(|c| c.reason.as_deref()));
        put_varint(&mut cols[col::DIM_COUNT as usize], ev.dimensions.len() as u64);
        for (key, value) in &ev.dimensions {
            put_str(&mut cols[col::DIM_KEY as usize], key);
            put_str(&mut cols[col::DIM_VALUE as usize], value);
        }
    }
    let delta_ids =
        [col::OUT_PARTITION, col::OUT_OFFSET, col::SRC_PARTITION, col::SRC_OFFSET, col::FIRST_SEEN, col::TIMESTAMP];
    for (d, id) in deltas.into_iter().zip(delta_ids) {
        cols[id as usize] = d.out;
    }
    if rows.is_empty() {
        (min_fs, max_fs) = (0, 0);
    }

    let mut file = Vec::with_capacity(rows.len() * 64);
    file.extend_from_slice(&MAGIC);
    file.extend_from_slice(&IMAGE_VERSION.to_le_bytes());
    file.extend_from_slice(&0u16.to_le_bytes());
    let mut footer = Vec::with_capacity(26 + col::COUNT * COLUMN_ENTRY_LEN);
    footer.extend_from_slice(&(rows.len() as u64).to_le_bytes());
    footer.extend_from_slice(&min_fs.to_le_bytes());
    footer.extend_from_slice(&max_fs.to_le_bytes());
    footer.extend_from_slice(&(col::COUNT as u16).to_le_bytes());
    for (id, raw) in cols.iter().enumerate() {
        let stored = compress(raw).map_err(|e| StorageError::io("<zstd>", e))?;
        footer.push(id as u8);
        footer.push(ENCODINGS[id]);
        footer.extend_from_slice(&(file.len() as u64).to_le_bytes());
        footer.extend_from_slice(&(stored.len() as u32).to_le_bytes());
        footer.extend_from_slice(&(raw.len() as u32).to_le_bytes());
        footer.extend_from_slice(&crc32c::crc32c(&stored).to_le_bytes());
        file.extend_from_slice(&stored);
    }
    let footer_crc = crc32c::crc32c(&footer);
    file.extend_from_slice(&footer);
    file.extend_from_slice(&(footer.len() as u32).to_le_bytes());
    file.extend_from_slice(&footer_crc.to_le_bytes());
    file.extend_from_slice(&MAGIC);
    Ok((file, min_fs, max_fs))
}

#[derive(Clone, Copy, Debug)]
struct ColumnEntry {
    encoding: u8,
    offset: u64,
    stored_len: u32,
    raw_len: u32,
    crc: u32,
}

/// One version-1 image with a verified footer: a group of a version-2
/// segment, or a whole version-1 segment.
pub(crate) struct SegmentFile {
    path: PathBuf,
    /// Where the image starts in its file, for the offsets errors report.
    base: u64,
    bytes: Vec<u8>,
    rows: usize,
    /// The footer's first-seen range of the rows.
    first_seen_range: (i64, i64),
    columns: Vec<ColumnEntry>,
    /// Decompressed columns, and an index of each, kept for more reads of
    /// this file (see [`SegmentFile::keeping_columns`]); `None`: each read
    /// decompresses and walks its column.
    kept: Option<std::cell::RefCell<Kept>>,
}

/// What a [`SegmentFile::keeping_columns`] file keeps, by column id.
#[derive(Default)]
struct Kept {
    /// Whether to build the indexes: worth it when several rows will be
    /// read; for one row, walking its columns up to it is cheaper.
    indexed: bool,
    raw: Vec<Option<std::rc::Rc<Vec<u8>>>>,
    /// Per column: delta columns' values, string columns' entry start
    /// offsets, the dimension count column's prefix sums.
    index: Vec<Option<std::rc::Rc<Vec<i64>>>>,
    /// Per column: whether it has been walked once. The index is built on
    /// the second use, not the first: a group asked for several originals
    /// often holds one of them (the others' candidates are groups of the
    /// same batch), and then walking was cheaper. (A row found by
    /// `find_row` uses its partition and first-seen columns twice, so
    /// those two are indexed for the first row anyway.)
    walked: Vec<bool>,
}

impl SegmentFile {
    /// Parses the image `bytes`, found at `base` in `path`: header, trailer
    /// and footer checksum.
    fn from_image(path: &Path, bytes: Vec<u8>, base: u64) -> Result<SegmentFile, StorageError> {
        let corrupt = |offset: usize, detail: String| StorageError::corrupt(path, base + offset as u64, detail);
        if bytes.len() < HEADER_LEN + TRAILER_LEN {
            return Err(corrupt(0, format!("{} bytes, too short for a segment", bytes.len())));
        }
        if bytes[0..4] != MAGIC {
            return Err(corrupt(0, "bad header magic".into()));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != IMAGE_VERSION {
            return Err(corrupt(4, format!("a group of version {version}, expected {IMAGE_VERSION}")));
        }
        let t = bytes.len() - TRAILER_LEN;
        let footer_len = u32::from_le_bytes([bytes[t], bytes[t + 1], bytes[t + 2], bytes[t + 3]]);
        let footer_crc = u32::from_le_bytes([bytes[t + 4], bytes[t + 5], bytes[t + 6], bytes[t + 7]]);
        if bytes[t + 8..] != MAGIC {
            return Err(corrupt(t + 8, "bad trailer magic".into()));
        }
        let footer_len = footer_len as usize;
        if footer_len > t - HEADER_LEN {
            return Err(corrupt(t, format!("footer length {footer_len} exceeds the file")));
        }
        let f = t - footer_len;
        let footer = &bytes[f..t];
        let got = crc32c::crc32c(footer);
        if got != footer_crc {
            return Err(StorageError::ChecksumMismatch {
                file: path.into(),
                offset: base + f as u64,
                expected: footer_crc,
                got,
            });
        }
        let parse = |r: &mut Reader<'_>| -> Result<(u64, i64, i64, Vec<ColumnEntry>), DecodeError> {
            let rows = r.u64()?;
            let min = r.i64()?;
            let max = r.i64()?;
            let n = r.u16()? as usize;
            let mut columns = Vec::with_capacity(n);
            for i in 0..n {
                let id = r.u8()?;
                if id as usize != i {
                    return Err(DecodeError(format!("column {i} has id {id}")));
                }
                columns.push(ColumnEntry {
                    encoding: r.u8()?,
                    offset: r.u64()?,
                    stored_len: r.u32()?,
                    raw_len: r.u32()?,
                    crc: r.u32()?,
                });
            }
            Ok((rows, min, max, columns))
        };
        let (rows, min_first_seen_ms, max_first_seen_ms, columns) =
            parse(&mut Reader::new(footer)).map_err(|e| corrupt(f, format!("footer: {}", e.0)))?;
        if columns.len() != col::COUNT {
            return Err(corrupt(f, format!("{} columns, expected {}", columns.len(), col::COUNT)));
        }
        for (i, c) in columns.iter().enumerate() {
            let end = c.offset.checked_add(u64::from(c.stored_len));
            if c.encoding != ENCODINGS[i] || c.offset < HEADER_LEN as u64 || end.is_none_or(|e| e > f as u64) {
                return Err(corrupt(f, format!("column {i} entry out of bounds or with unknown encoding")));
            }
        }
        let rows = usize::try_from(rows).map_err(|_| corrupt(f, "row count overflow".into()))?;
        Ok(SegmentFile {
            path: path.into(),
            base,
            bytes,
            rows,
            first_seen_range: (min_first_seen_ms, max_first_seen_ms),
            columns,
            kept: None,
        })
    }

    /// The same file, keeping each column it decompresses for the next
    /// read: several rows of one segment (a batch's conflict originals)
    /// cost one decompression per column, not one per row. Holds the
    /// decompressed columns until dropped, so only for short lookups, never
    /// for whole-segment passes.
    pub(crate) fn keeping_columns(mut self) -> SegmentFile {
        let n = self.columns.len();
        self.kept = Some(std::cell::RefCell::new(Kept {
            indexed: true,
            raw: vec![None; n],
            index: vec![None; n],
            walked: vec![false; n],
        }));
        self
    }

    /// The same file, keeping each column it decompresses but building no
    /// index of it: for reading one row (and finding it first).
    pub(crate) fn keeping_raw_columns(mut self) -> SegmentFile {
        let n = self.columns.len();
        self.kept = Some(std::cell::RefCell::new(Kept {
            indexed: false,
            raw: vec![None; n],
            index: vec![None; n],
            walked: vec![false; n],
        }));
        self
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// The smallest and largest first-seen time of its rows (its footer's).
    pub(crate) fn first_seen_range(&self) -> (i64, i64) {
        self.first_seen_range
    }

    /// Checks every column's stored bytes against its checksum, without
    /// decompressing any.
    pub(crate) fn check_columns(&self) -> Result<(), StorageError> {
        for c in &self.columns {
            self.stored(c)?;
        }
        Ok(())
    }

    /// A column's stored (compressed) bytes, checksummed.
    fn stored(&self, c: &ColumnEntry) -> Result<&[u8], StorageError> {
        let start = c.offset as usize;
        let stored = &self.bytes[start..start + c.stored_len as usize];
        let got = crc32c::crc32c(stored);
        if got != c.crc {
            return Err(StorageError::ChecksumMismatch {
                file: self.path.clone(),
                offset: self.base + c.offset,
                expected: c.crc,
                got,
            });
        }
        Ok(stored)
    }

    /// One column, checksummed and decompressed (or as kept, see
    /// [`SegmentFile::keeping_columns`]).
    fn column(&self, id: u8) -> Result<std::rc::Rc<Vec<u8>>, StorageError> {
        if let Some(kept) = &self.kept {
            if let Some(raw) = &kept.borrow().raw[id as usize] {
                return Ok(raw.clone());
            }
            let raw = std::rc::Rc::new(self.decompress(id)?);
            kept.borrow_mut().raw[id as usize] = Some(raw.clone());
            return Ok(raw);
        }
        Ok(std::rc::Rc::new(self.decompress(id)?))
    }

    /// The kept index of column `id` (built by `build` on the column's
    /// second use, see [`Kept::walked`]), or `None` when this file builds
    /// no indexes or this is the column's first use: the caller walks it.
    fn kept_index(
        &self,
        id: u8,
        build: impl FnOnce(&mut Reader<'_>) -> Result<Vec<i64>, DecodeError>,
    ) -> Result<Option<std::rc::Rc<Vec<i64>>>, StorageError> {
        let Some(kept) = self.kept.as_ref().filter(|k| k.borrow().indexed) else { return Ok(None) };
        if let Some(index) = &kept.borrow().index[id as usize] {
            return Ok(Some(index.clone()));
        }
        if !std::mem::replace(&mut kept.borrow_mut().walked[id as usize], true) {
            return Ok(None);
        }
        let raw = self.column(id)?;
        let mut r = Reader::new(&raw);
        let index = std::rc::Rc::new(build(&mut r).map_err(|e| self.err(id, e))?);
        kept.borrow_mut().index[id as usize] = Some(index.clone());
        Ok(Some(index))
    }

    /// Start offsets of every entry of a string column, `skip` passing one.
    fn entry_starts(
        r: &mut Reader<'_>,
        skip: fn(&mut Reader<'_>) -> Result<(), DecodeError>,
    ) -> Result<Vec<i64>, DecodeError> {
        let mut starts = Vec::new();
        while !r.is_empty() {
            starts.push(r.position() as i64);
            skip(r)?;
        }
        starts.push(r.position() as i64);
        Ok(starts)
    }

    /// Checksums and decompresses one column.
    fn decompress(&self, id: u8) -> Result<Vec<u8>, StorageError> {
        let c = self.columns[id as usize];
        let stored = self.stored(&c)?;
        let at = self.base + c.offset;
        let raw = decompress(stored, c.raw_len as usize)
            .map_err(|e| StorageError::corrupt(&self.path, at, format!("column {id} does not decompress: {e}")))?;
        if raw.len() != c.raw_len as usize {
            return Err(StorageError::corrupt(&self.path, at, format!("column {id} length differs from footer")));
        }
        Ok(raw)
    }

    fn err(&self, id: u8, e: DecodeError) -> StorageError {
        StorageError::corrupt(&self.path, self.base + self.columns[id as usize].offset, format!("column {id}: {}", e.0))
    }

    fn deltas(&self, id: u8) -> Result<Vec<i64>, StorageError> {
        let raw = self.column(id)?;
        let mut r = Reader::new(&raw);
        let mut out = Vec::with_capacity(self.rows);
        let mut prev = 0i64;
        for _ in 0..self.rows {
            prev = prev.wrapping_add(unzigzag(r.varint().map_err(|e| self.err(id, e))?));
            out.push(prev);
        }
        self.finished(id, &r)?;
        Ok(out)
    }

    fn fixed<const N: usize>(&self, id: u8) -> Result<Vec<[u8; N]>, StorageError> {
        let raw = self.column(id)?;
        if raw.len() != self.rows * N {
            return Err(self.err(id, DecodeError(format!("{} bytes for {} rows of {N}", raw.len(), self.rows))));
        }
        Ok(raw
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                a
            })
            .collect())
    }

    fn strings(&self, id: u8, n: usize) -> Result<Vec<String>, StorageError> {
        let raw = self.column(id)?;
        let mut r = Reader::new(&raw);
        let out = (0..n).map(|_| r.str()).collect::<Result<Vec<_>, _>>().map_err(|e| self.err(id, e))?;
        self.finished(id, &r)?;
        Ok(out)
    }

    fn opt_strings(&self, id: u8) -> Result<Vec<Option<String>>, StorageError> {
        let raw = self.column(id)?;
        let mut r = Reader::new(&raw);
        let out = (0..self.rows).map(|_| r.opt_str()).collect::<Result<Vec<_>, _>>().map_err(|e| self.err(id, e))?;
        self.finished(id, &r)?;
        Ok(out)
    }

    fn finished(&self, id: u8, r: &Reader<'_>) -> Result<(), StorageError> {
        if r.is_empty() {
            Ok(())
        } else {
            Err(self.err(id, DecodeError(format!("trailing bytes at {}", r.position()))))
        }
    }

    /// The keys of every row, decoding only the key columns (the fallback
    /// when a sidecar is missing or corrupt).
    pub(crate) fn read_keys(&self) -> Result<Vec<SeenKey>, StorageError> {
        let out_p = self.deltas(col::OUT_PARTITION)?;
        let out_o = self.deltas(col::OUT_OFFSET)?;
        let src_p = self.deltas(col::SRC_PARTITION)?;
        let src_o = self.deltas(col::SRC_OFFSET)?;
        let first_seen = self.deltas(col::FIRST_SEEN)?;
        let ids = self.fixed::<16>(col::ID_HASH)?;
        let payloads = self.fixed::<16>(col::PAYLOAD_HASH)?;
        Ok((0..self.rows)
            .map(|i| SeenKey {
                id_hash: IdHash(ids[i]),
                payload_hash: PayloadHash(payloads[i]),
                first_seen_ms: first_seen[i],
                source: Position::new(src_p[i] as i32, src_o[i]),
                output: Position::new(out_p[i] as i32, out_o[i]),
            })
            .collect())
    }

    /// The value of a delta-encoded column at `row`.
    fn delta_at(&self, id: u8, row: usize) -> Result<i64, StorageError> {
        let rows = self.rows;
        let values = self.kept_index(id, |r| {
            let mut out = Vec::with_capacity(rows);
            let mut prev = 0i64;
            for _ in 0..rows {
                prev = prev.wrapping_add(unzigzag(r.varint()?));
                out.push(prev);
            }
            Ok(out)
        })?;
        if let Some(values) = values {
            return values.get(row).copied().ok_or_else(|| self.err(id, DecodeError(format!("no row {row}"))));
        }
        let raw = self.column(id)?;
        let mut r = Reader::new(&raw);
        let mut v = 0i64;
        for _ in 0..=row {
            v = v.wrapping_add(unzigzag(r.varint().map_err(|e| self.err(id, e))?));
        }
        Ok(v)
    }

    fn fixed_at<const N: usize>(&self, id: u8, row: usize) -> Result<[u8; N], StorageError> {
        let raw = self.column(id)?;
        if raw.len() != self.rows * N {
            return Err(self.err(id, DecodeError(format!("{} bytes for {} rows of {N}", raw.len(), self.rows))));
        }
        let mut a = [0u8; N];
        a.copy_from_slice(&raw[row * N..(row + 1) * N]);
        Ok(a)
    }

    /// Entries `skip..skip + take` of a string column, the others passed over.
    fn strings_at(&self, id: u8, skip: usize, take: usize) -> Result<Vec<String>, StorageError> {
        let raw = self.column(id)?;
        let starts = self.kept_index(id, |r| Self::entry_starts(r, |r| r.skip_str()))?;
        if let Some(starts) = starts {
            let start =
                starts.get(skip).copied().ok_or_else(|| self.err(id, DecodeError(format!("no entry {skip}"))))?;
            let mut r = Reader::new(&raw[start as usize..]);
            return (0..take).map(|_| r.str()).collect::<Result<Vec<_>, _>>().map_err(|e| self.err(id, e));
        }
        let mut r = Reader::new(&raw);
        (|| {
            for _ in 0..skip {
                r.skip_str()?;
            }
            (0..take).map(|_| r.str()).collect::<Result<Vec<_>, _>>()
        })()
        .map_err(|e| self.err(id, e))
    }

    fn opt_string_at(&self, id: u8, row: usize) -> Result<Option<String>, StorageError> {
        let raw = self.column(id)?;
        let starts = self.kept_index(id, |r| Self::entry_starts(r, |r| r.skip_opt_str()))?;
        if let Some(starts) = starts {
            let start = starts.get(row).copied().ok_or_else(|| self.err(id, DecodeError(format!("no row {row}"))))?;
            return Reader::new(&raw[start as usize..]).opt_str().map_err(|e| self.err(id, e));
        }
        let mut r = Reader::new(&raw);
        (|| {
            for _ in 0..row {
                r.skip_opt_str()?;
            }
            r.opt_str()
        })()
        .map_err(|e| self.err(id, e))
    }

    /// One row, decoded alone: every column it touches is checksummed and
    /// decompressed, but only this row's values are built, so a conflict's
    /// original costs no allocation per row of its segment. Equal to
    /// `read_all()[row]`.
    pub(crate) fn read_row(&self, row: usize) -> Result<StoredEvent, StorageError> {
        if row >= self.rows {
            return Err(self.err(col::ID_HASH, DecodeError(format!("row {row} of a segment of {}", self.rows))));
        }
        let key = SeenKey {
            id_hash: IdHash(self.fixed_at::<16>(col::ID_HASH, row)?),
            payload_hash: PayloadHash(self.fixed_at::<16>(col::PAYLOAD_HASH, row)?),
            first_seen_ms: self.delta_at(col::FIRST_SEEN, row)?,
            source: Position::new(self.delta_at(col::SRC_PARTITION, row)? as i32, self.delta_at(col::SRC_OFFSET, row)?),
            output: Position::new(self.delta_at(col::OUT_PARTITION, row)? as i32, self.delta_at(col::OUT_OFFSET, row)?),
        };
        let one = |id: u8| -> Result<String, StorageError> {
            self.strings_at(id, row, 1)?
                .pop()
                .ok_or_else(|| self.err(id, DecodeError("column shorter than row count".into())))
        };
        let rows = self.rows;
        let prefix = self.kept_index(col::DIM_COUNT, |r| {
            let mut sums = Vec::with_capacity(rows + 1);
            let mut total = 0i64;
            sums.push(0);
            for _ in 0..rows {
                let n = i64::try_from(r.varint()?).map_err(|_| DecodeError("dimension count overflow".into()))?;
                total = total.checked_add(n).ok_or_else(|| DecodeError("dimension count overflow".into()))?;
                sums.push(total);
            }
            Ok(sums)
        })?;
        let (dims_before, dims_here) = if let Some(sums) = prefix {
            let (a, b) = (sums[row], sums[row + 1]);
            (a as usize, (b - a) as usize)
        } else {
            let raw = self.column(col::DIM_COUNT)?;
            let mut r = Reader::new(&raw);
            let mut before = 0usize;
            for _ in 0..row {
                let n = r.varint().map_err(|e| self.err(col::DIM_COUNT, e))?;
                before = before
                    .checked_add(usize::try_from(n).unwrap_or(usize::MAX))
                    .ok_or_else(|| self.err(col::DIM_COUNT, DecodeError("dimension count overflow".into())))?;
            }
            let here = r.varint().map_err(|e| self.err(col::DIM_COUNT, e))?;
            (before, usize::try_from(here).unwrap_or(usize::MAX))
        };
        let dim_keys = self.strings_at(col::DIM_KEY, dims_before, dims_here)?;
        let dim_values = self.strings_at(col::DIM_VALUE, dims_before, dims_here)?;
        let kf = self.fixed_at::<1>(col::KIND_FLAGS, row)?[0];
        let kind: EventKind = kind_from_code(kf & 0x0f).map_err(|e| self.err(col::KIND_FLAGS, e))?;
        Ok(StoredEvent {
            key,
            event: UsageEvent {
                event_id: one(col::EVENT_ID)?,
                event_id_derived: kf & 0x10 != 0,
                tenant_id: one(col::TENANT_ID)?,
                customer_id: one(col::CUSTOMER_ID)?,
                meter: one(col::METER)?,
                quantity: Decimal::deserialize(self.fixed_at::<16>(col::QUANTITY, row)?),
                timestamp_ms: self.delta_at(col::TIMESTAMP, row)?,
                kind,
                correction_ref: correction_ref(
                    self.opt_string_at(col::CORR_ORIGINAL, row)?,
                    self.opt_string_at(col::CORR_REASON, row)?,
                ),
                resource_id: self.opt_string_at(col::RESOURCE_ID, row)?,
                unit: self.opt_string_at(col::UNIT, row)?,
                source: self.opt_string_at(col::SOURCE, row)?,
                dimensions: dim_keys.into_iter().zip(dim_values).collect(),
            },
        })
    }

    /// Every row, fully decoded, in file order.
    pub(crate) fn read_all(&self) -> Result<Vec<StoredEvent>, StorageError> {
        let keys = self.read_keys()?;
        let timestamps = self.deltas(col::TIMESTAMP)?;
        let quantities = self.fixed::<16>(col::QUANTITY)?;
        let kind_flags = self.fixed::<1>(col::KIND_FLAGS)?;
        let event_ids = self.strings(col::EVENT_ID, self.rows)?;
        let tenants = self.strings(col::TENANT_ID, self.rows)?;
        let customers = self.strings(col::CUSTOMER_ID, self.rows)?;
        let meters = self.strings(col::METER, self.rows)?;
        let resources = self.opt_strings(col::RESOURCE_ID)?;
        let units = self.opt_strings(col::UNIT)?;
        let sources = self.opt_strings(col::SOURCE)?;
        let corr_originals = self.opt_strings(col::CORR_ORIGINAL)?;
        let corr_reasons = self.opt_strings(col::CORR_REASON)?;
        let dim_counts = {
            let raw = self.column(col::DIM_COUNT)?;
            let mut r = Reader::new(&raw);
            let v = (0..self.rows)
                .map(|_| r.varint())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| self.err(col::DIM_COUNT, e))?;
            self.finished(col::DIM_COUNT, &r)?;
            v
        };
        let total_dims = dim_counts.iter().try_fold(0usize, |acc, &n| acc.checked_add(n as usize));
        let total_dims =
            total_dims.ok_or_else(|| self.err(col::DIM_COUNT, DecodeError("dimension count overflow".into())))?;
        let mut dim_keys = self.strings(col::DIM_KEY, total_dims)?.into_iter();
        let mut dim_values = self.strings(col::DIM_VALUE, total_dims)?.into_iter();

        let mut out = Vec::with_capacity(self.rows);
        let mut it =
            (keys.into_iter(), event_ids.into_iter(), tenants.into_iter(), customers.into_iter(), meters.into_iter());
        let mut opts = (
            resources.into_iter(),
            units.into_iter(),
            sources.into_iter(),
            corr_originals.into_iter(),
            corr_reasons.into_iter(),
        );
        for i in 0..self.rows {
            let (Some(key), Some(event_id), Some(tenant_id), Some(customer_id), Some(meter)) =
                (it.0.next(), it.1.next(), it.2.next(), it.3.next(), it.4.next())
            else {
                return Err(self.err(col::EVENT_ID, DecodeError("column shorter than row count".into())));
            };
            let (Some(resource_id), Some(unit), Some(source), Some(corr_original), Some(corr_reason)) =
                (opts.0.next(), opts.1.next(), opts.2.next(), opts.3.next(), opts.4.next())
            else {
                return Err(self.err(col::RESOURCE_ID, DecodeError("column shorter than row count".into())));
            };
            let kf = kind_flags[i][0];
            let kind: EventKind = kind_from_code(kf & 0x0f).map_err(|e| self.err(col::KIND_FLAGS, e))?;
            let mut dimensions = Vec::with_capacity(dim_counts[i] as usize);
            for _ in 0..dim_counts[i] {
                match (dim_keys.next(), dim_values.next()) {
                    (Some(k), Some(v)) => dimensions.push((k, v)),
                    _ => return Err(self.err(col::DIM_KEY, DecodeError("fewer dimensions than counted".into()))),
                }
            }
            out.push(StoredEvent {
                key,
                event: UsageEvent {
                    event_id,
                    event_id_derived: kf & 0x10 != 0,
                    tenant_id,
                    customer_id,
                    meter,
                    quantity: Decimal::deserialize(quantities[i]),
                    timestamp_ms: timestamps[i],
                    kind,
                    correction_ref: correction_ref(corr_original, corr_reason),
                    resource_id,
                    unit,
                    source,
                    dimensions,
                },
            });
        }
        Ok(out)
    }
}

impl SegmentFile {
    /// The row of `id` on output `partition`, first seen at `first_seen_ms`
    /// (an id accepted again after its horizon has two rows: the one asked
    /// for is the one its key remembers).
    pub(crate) fn find_row(
        &self,
        partition: i32,
        id: &IdHash,
        first_seen_ms: i64,
    ) -> Result<Option<usize>, StorageError> {
        let ids = self.column(col::ID_HASH)?;
        if ids.len() != self.rows * 16 {
            return Err(
                self.err(col::ID_HASH, DecodeError(format!("{} bytes for {} rows of 16", ids.len(), self.rows)))
            );
        }
        for (row, candidate) in ids.chunks_exact(16).enumerate() {
            if candidate == id.0
                && self.delta_at(col::OUT_PARTITION, row)? == i64::from(partition)
                && self.delta_at(col::FIRST_SEEN, row)? == first_seen_ms
            {
                return Ok(Some(row));
            }
        }
        Ok(None)
    }
}

/// One group of a version-2 segment, as its index describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GroupEntry {
    pub offset: u64,
    pub len: u32,
    pub rows: u32,
    pub min_first_seen_ms: i64,
    pub max_first_seen_ms: i64,
}

impl GroupEntry {
    pub(crate) fn holds_first_seen(&self, first_seen_ms: i64) -> bool {
        (self.min_first_seen_ms..=self.max_first_seen_ms).contains(&first_seen_ms)
    }
}

/// A version-2 segment's index of groups, read without the groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SegmentIndex {
    pub rows: u64,
    pub groups: Vec<GroupEntry>,
    /// Group numbers by their smallest first-seen time, and the running
    /// largest first-seen time in that order: the groups holding a time
    /// are found by a binary search and a short walk back, not a pass over
    /// every group (a compacted segment has thousands).
    by_min: Vec<usize>,
    running_max: Vec<i64>,
}

impl SegmentIndex {
    fn new(rows: u64, groups: Vec<GroupEntry>) -> SegmentIndex {
        let mut by_min: Vec<usize> = (0..groups.len()).collect();
        by_min.sort_by_key(|&g| groups[g].min_first_seen_ms);
        let mut running_max = Vec::with_capacity(by_min.len());
        let mut max = i64::MIN;
        for &g in &by_min {
            max = max.max(groups[g].max_first_seen_ms);
            running_max.push(max);
        }
        SegmentIndex { rows, groups, by_min, running_max }
    }

    /// The groups whose first-seen range holds `first_seen_ms`.
    pub(crate) fn groups_holding(&self, first_seen_ms: i64) -> Vec<usize> {
        // Groups sorted by min; those with min <= t are a prefix, and going
        // back from its end the running max says when none further back can
        // reach t.
        let end = self.by_min.partition_point(|&g| self.groups[g].min_first_seen_ms <= first_seen_ms);
        let mut out = Vec::new();
        for k in (0..end).rev() {
            if self.running_max[k] < first_seen_ms {
                break;
            }
            let g = self.by_min[k];
            if self.groups[g].holds_first_seen(first_seen_ms) {
                out.push(g);
            }
        }
        out.sort_unstable();
        out
    }
}

/// Parses and checks a version-2 index (`file_len` bytes in all): every
/// group inside the file, rows adding up.
fn parse_index(path: &Path, index: &[u8], at: u64, file_len: u64) -> Result<SegmentIndex, StorageError> {
    let corrupt = |detail: String| StorageError::corrupt(path, at, detail);
    let mut r = Reader::new(index);
    let parsed = (|| -> Result<(u64, Vec<GroupEntry>), DecodeError> {
        let rows = r.u64()?;
        let _min = r.i64()?;
        let _max = r.i64()?;
        let n = r.u32()? as usize;
        let mut groups = Vec::with_capacity(n.min(index.len() / GROUP_ENTRY_LEN));
        for _ in 0..n {
            groups.push(GroupEntry {
                offset: r.u64()?,
                len: r.u32()?,
                rows: r.u32()?,
                min_first_seen_ms: r.i64()?,
                max_first_seen_ms: r.i64()?,
            });
        }
        Ok((rows, groups))
    })();
    let (rows, groups) = parsed.map_err(|e| corrupt(format!("index: {}", e.0)))?;
    if !r.is_empty() {
        return Err(corrupt("index: trailing bytes".into()));
    }
    let mut next = HEADER_LEN as u64;
    for (i, g) in groups.iter().enumerate() {
        if g.offset != next || g.offset + u64::from(g.len) > at {
            return Err(corrupt(format!("group {i} is not where the previous one ends, or runs past the index")));
        }
        next = g.offset + u64::from(g.len);
    }
    if next != at || at > file_len {
        return Err(corrupt("the groups do not end where the index starts".into()));
    }
    if groups.iter().map(|g| u64::from(g.rows)).sum::<u64>() != rows {
        return Err(corrupt("the groups' rows do not add up to the segment's".into()));
    }
    Ok(SegmentIndex::new(rows, groups))
}

/// Checks `trailer` (the file's last 12 bytes) and returns the index's
/// length and checksum.
fn parse_trailer(path: &Path, trailer: &[u8], file_len: u64) -> Result<(u64, u32), StorageError> {
    let t = file_len - TRAILER_LEN as u64;
    if trailer[8..12] != MAGIC {
        return Err(StorageError::corrupt(path, t + 8, "bad trailer magic"));
    }
    let len = u64::from(u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]));
    let crc = u32::from_le_bytes([trailer[4], trailer[5], trailer[6], trailer[7]]);
    if len > t - HEADER_LEN as u64 {
        return Err(StorageError::corrupt(path, t, format!("index length {len} exceeds the file")));
    }
    Ok((len, crc))
}

fn check_header(path: &Path, header: &[u8]) -> Result<u16, StorageError> {
    if header[0..4] != MAGIC {
        return Err(StorageError::corrupt(path, 0, "bad header magic"));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != VERSION && version != IMAGE_VERSION {
        return Err(StorageError::UnsupportedVersion {
            file: path.into(),
            what: "segment",
            found: version,
            supported: VERSION,
        });
    }
    Ok(version)
}

/// The index of the version-2 segment at `path`, read alone (header,
/// trailer, index: three small reads); `None` for a version-1 file, which
/// has no groups to read one at a time.
pub(crate) fn read_index(fs: &dyn FileSystem, path: &Path) -> Result<Option<SegmentIndex>, StorageError> {
    let file_len = fs.file_len(path).at(path)?;
    if file_len < (HEADER_LEN + TRAILER_LEN) as u64 {
        return Err(StorageError::corrupt(path, 0, format!("{file_len} bytes, too short for a segment")));
    }
    if check_header(path, &fs.read_range(path, 0, HEADER_LEN).at(path)?)? == IMAGE_VERSION {
        return Ok(None);
    }
    let trailer = fs.read_range(path, file_len - TRAILER_LEN as u64, TRAILER_LEN).at(path)?;
    let (len, crc) = parse_trailer(path, &trailer, file_len)?;
    let at = file_len - TRAILER_LEN as u64 - len;
    let index = fs.read_range(path, at, len as usize).at(path)?;
    let got = crc32c::crc32c(&index);
    if got != crc {
        return Err(StorageError::ChecksumMismatch { file: path.into(), offset: at, expected: crc, got });
    }
    parse_index(path, &index, at, file_len).map(Some)
}

/// One group of a version-2 segment, read alone, keeping the columns it
/// decompresses for the next lookup in the same group (and indexing them
/// when `several` rows will be read).
pub(crate) fn read_group(
    file: &dyn RangeReader,
    path: &Path,
    group: &GroupEntry,
    several: bool,
) -> Result<SegmentFile, StorageError> {
    let bytes = file.read_range(group.offset, group.len as usize).at(path)?;
    let image = SegmentFile::from_image(path, bytes, group.offset)?;
    let image = if several { image.keeping_columns() } else { image.keeping_raw_columns() };
    image.matches(group)?;
    Ok(image)
}

impl SegmentFile {
    /// Whether this group image holds what its index entry says: its rows
    /// and its first-seen range (an index that disagreed would send lookups
    /// to the wrong group and miss an original without a word).
    fn matches(&self, group: &GroupEntry) -> Result<(), StorageError> {
        if self.rows != group.rows as usize {
            return Err(StorageError::corrupt(&self.path, group.offset, "a group's rows differ from the index"));
        }
        if self.first_seen_range != (group.min_first_seen_ms, group.max_first_seen_ms) {
            return Err(StorageError::corrupt(
                &self.path,
                group.offset,
                "a group's first-seen range differs from the index",
            ));
        }
        Ok(())
    }
}

/// A whole segment of either version: its groups, in row order.
pub(crate) struct Segment {
    path: PathBuf,
    groups: Vec<SegmentFile>,
    /// The segment's row number of each group's first row.
    starts: Vec<usize>,
    rows: usize,
    len_bytes: usize,
}

impl Segment {
    /// Reads the whole file at `path` and checks its header, trailer and
    /// index (each group's footer too).
    pub(crate) fn open(fs: &dyn FileSystem, path: &Path) -> Result<Segment, StorageError> {
        let mut bytes = fs.read(path).at(path)?;
        let len_bytes = bytes.len();
        if len_bytes < HEADER_LEN + TRAILER_LEN {
            return Err(StorageError::corrupt(path, 0, format!("{len_bytes} bytes, too short for a segment")));
        }
        let groups = if check_header(path, &bytes[..HEADER_LEN])? == IMAGE_VERSION {
            vec![SegmentFile::from_image(path, bytes, 0)?]
        } else {
            let file_len = len_bytes as u64;
            let t = len_bytes - TRAILER_LEN;
            let (len, crc) = parse_trailer(path, &bytes[t..], file_len)?;
            let at = t - len as usize;
            let got = crc32c::crc32c(&bytes[at..t]);
            if got != crc {
                return Err(StorageError::ChecksumMismatch {
                    file: path.into(),
                    offset: at as u64,
                    expected: crc,
                    got,
                });
            }
            let index = parse_index(path, &bytes[at..t], at as u64, file_len)?;
            bytes.truncate(at);
            let mut groups = Vec::with_capacity(index.groups.len());
            for g in index.groups.iter().rev() {
                let image = bytes.split_off(g.offset as usize);
                let image = SegmentFile::from_image(path, image, g.offset)?;
                image.matches(g)?;
                groups.push(image);
            }
            groups.reverse();
            groups
        };
        let mut starts = Vec::with_capacity(groups.len());
        let mut rows = 0;
        for g in &groups {
            starts.push(rows);
            rows += g.rows();
        }
        Ok(Segment { path: path.into(), groups, starts, rows, len_bytes })
    }

    /// The same segment, keeping each column it decompresses (see
    /// [`SegmentFile::keeping_columns`]).
    pub(crate) fn keeping_columns(self) -> Segment {
        Segment { groups: self.groups.into_iter().map(SegmentFile::keeping_columns).collect(), ..self }
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    pub(crate) fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Its groups, in row order (a version-1 file is one group).
    pub(crate) fn groups(&self) -> &[SegmentFile] {
        &self.groups
    }

    /// Row `row` of the segment.
    pub(crate) fn read_row(&self, row: usize) -> Result<StoredEvent, StorageError> {
        let g = self.starts.partition_point(|&start| start <= row).saturating_sub(1);
        match self.groups.get(g) {
            Some(group) => group.read_row(row - self.starts[g]),
            None => Err(StorageError::corrupt(&self.path, 0, format!("row {row} of a segment of {} rows", self.rows))),
        }
    }

    /// The keys of every row, in row order.
    pub(crate) fn read_keys(&self) -> Result<Vec<SeenKey>, StorageError> {
        let mut out = Vec::with_capacity(self.rows);
        for g in &self.groups {
            out.extend(g.read_keys()?);
        }
        Ok(out)
    }

    /// Every row, fully decoded, in row order.
    pub(crate) fn read_all(&self) -> Result<Vec<StoredEvent>, StorageError> {
        let mut out = Vec::with_capacity(self.rows);
        for g in &self.groups {
            out.extend(g.read_all()?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::fs::RealFs;
    use crate::storage::testutil::sample_event;

    fn rows(n: u64) -> Vec<StoredEvent> {
        (0..n).map(|i| sample_event(i, (i % 3) as i32, i as i64)).collect()
    }

    /// [`read_group`] of the segment at `path` on the real filesystem.
    fn read_group_of(path: &Path, group: &GroupEntry, several: bool) -> Result<SegmentFile, StorageError> {
        read_group(RealFs.open_ranges(path).expect("open").as_ref(), path, group, several)
    }

    #[test]
    fn a_segment_of_several_groups_reads_back_whole_and_row_by_row() {
        let events = rows(GROUP_ROWS as u64 * 3 + 7);
        let refs: Vec<&StoredEvent> = events.iter().collect();
        let (bytes, meta) = encode(9, &refs).expect("encode");
        assert_eq!(meta.rows, events.len() as u64);
        assert_eq!(meta.min_first_seen_ms, events[0].key.first_seen_ms);
        let dir = tempfile::tempdir().expect("tmp");
        let path = segment_path(dir.path(), 9);
        std::fs::write(&path, &bytes).expect("write");
        let segment = Segment::open(&RealFs, &path).expect("open");
        assert_eq!(segment.read_all().expect("all"), events);
        assert_eq!(segment.read_keys().expect("keys"), events.iter().map(|e| e.key).collect::<Vec<_>>());
        for row in [0, GROUP_ROWS - 1, GROUP_ROWS, 2 * GROUP_ROWS + 1, events.len() - 1] {
            assert_eq!(segment.read_row(row).expect("row"), events[row]);
        }
        assert!(segment.read_row(events.len()).is_err());
        // The index alone says where each group is and what it holds, and a
        // group read alone finds its rows by id.
        let index = read_index(&RealFs, &path).expect("index").expect("version 2");
        assert_eq!(index.groups.len(), 4);
        assert_eq!(
            index.groups.iter().map(|g| g.rows).collect::<Vec<_>>(),
            [GROUP_ROWS as u32, GROUP_ROWS as u32, GROUP_ROWS as u32, 7]
        );
        let target = &events[GROUP_ROWS + 100];
        let g = index.groups.iter().position(|g| g.holds_first_seen(target.key.first_seen_ms)).expect("a group");
        assert_eq!(g, 1);
        let group = read_group_of(&path, &index.groups[g], false).expect("group");
        let row = group
            .find_row(target.key.output.partition, &target.key.id_hash, target.key.first_seen_ms)
            .expect("find")
            .expect("found");
        assert_eq!(group.read_row(row).expect("row"), *target);
        let group = read_group_of(&path, &index.groups[g], true).expect("group");
        let row = group
            .find_row(target.key.output.partition, &target.key.id_hash, target.key.first_seen_ms)
            .expect("find")
            .expect("found");
        assert_eq!(group.read_row(row).expect("row"), *target);
        let other = (target.key.output.partition + 1) % 3;
        assert_eq!(group.find_row(other, &target.key.id_hash, target.key.first_seen_ms).expect("find"), None);
        assert_eq!(group.find_row(target.key.output.partition, &target.key.id_hash, 1).expect("find"), None);
    }

    /// Files written before row groups are still read, whole, and have no
    /// index to read groups from.
    #[test]
    fn a_version_1_segment_is_still_read() {
        let events = rows(600);
        let refs: Vec<&StoredEvent> = events.iter().collect();
        let (image, _, _) = encode_image(&refs).expect("encode");
        assert_eq!(u16::from_le_bytes([image[4], image[5]]), 1, "a version-1 file");
        let dir = tempfile::tempdir().expect("tmp");
        let path = segment_path(dir.path(), 1);
        std::fs::write(&path, &image).expect("write");
        assert_eq!(read_index(&RealFs, &path).expect("index"), None);
        let segment = Segment::open(&RealFs, &path).expect("open");
        assert_eq!(segment.read_all().expect("all"), events);
        assert_eq!(segment.read_row(599).expect("row"), events[599]);
    }

    /// A flipped byte anywhere in the index, or in a group, is an error
    /// naming the file, never a shorter or different segment.
    #[test]
    fn a_damaged_index_or_group_is_an_error() {
        let events = rows(GROUP_ROWS as u64 * 2);
        let refs: Vec<&StoredEvent> = events.iter().collect();
        let (bytes, _) = encode(3, &refs).expect("encode");
        let dir = tempfile::tempdir().expect("tmp");
        let path = segment_path(dir.path(), 3);
        let index_at = bytes.len() - TRAILER_LEN - (28 + 2 * GROUP_ENTRY_LEN);
        for at in [index_at, index_at + 30, bytes.len() - 5, HEADER_LEN + 40] {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x40;
            std::fs::write(&path, &damaged).expect("write");
            let whole = Segment::open(&RealFs, &path).and_then(|s| s.read_all());
            assert!(whole.is_err(), "a flip at {at} read back as a segment");
            if at >= index_at {
                assert!(read_index(&RealFs, &path).is_err(), "a flip at {at} in the index went unnoticed");
            }
        }
        // A version from the future is refused as such.
        let mut future = bytes.clone();
        future[4] = 9;
        std::fs::write(&path, &future).expect("write");
        assert!(matches!(Segment::open(&RealFs, &path), Err(StorageError::UnsupportedVersion { found: 9, .. })));
    }

    /// An index whose checksum is right but whose contents are not (a
    /// writer bug, or a crafted file) is an error, never a panic or a
    /// segment read from the wrong bytes.
    #[test]
    fn an_index_that_lies_under_a_good_checksum_is_an_error() {
        let events = rows(GROUP_ROWS as u64 * 2 + 3);
        let refs: Vec<&StoredEvent> = events.iter().collect();
        let (bytes, _) = encode(4, &refs).expect("encode");
        let t = bytes.len() - TRAILER_LEN;
        let len = u32::from_le_bytes(bytes[t..t + 4].try_into().expect("4 bytes")) as usize;
        let at = t - len;
        let dir = tempfile::tempdir().expect("tmp");
        let path = segment_path(dir.path(), 4);
        // Field offsets inside the index: 28 bytes of totals, then 32 per
        // group (offset 0, len 8, rows 12, min 16, max 24).
        let group = move |g: usize, field: usize| at + 28 + g * GROUP_ENTRY_LEN + field;
        type Damage = Box<dyn Fn(&mut Vec<u8>)>;
        let cases: Vec<(&str, Damage)> = vec![
            ("a group not where the previous ends", Box::new(move |b| b[group(1, 0)] ^= 1)),
            ("a group longer than the file", Box::new(move |b| b[group(2, 8) + 3] = 0x7f)),
            ("rows that do not add up", Box::new(move |b| b[group(0, 12)] ^= 1)),
            ("a total row count that differs", Box::new(move |b| b[at] ^= 1)),
            ("a huge group count", Box::new(move |b| b[at + 24..at + 28].copy_from_slice(&u32::MAX.to_le_bytes()))),
            ("an index length past the file", Box::new(move |b| b[t..t + 4].copy_from_slice(&u32::MAX.to_le_bytes()))),
        ];
        for (what, damage) in cases {
            let mut lying = bytes.clone();
            damage(&mut lying);
            // The index's checksum made right again: only the structure can
            // catch the lie.
            let len = u32::from_le_bytes(lying[t..t + 4].try_into().expect("4 bytes")) as usize;
            if len == (t - at) {
                let crc = crc32c::crc32c(&lying[at..t]);
                lying[t + 4..t + 8].copy_from_slice(&crc.to_le_bytes());
            }
            std::fs::write(&path, &lying).expect("write");
            assert!(read_index(&RealFs, &path).is_err(), "{what}: read_index took it");
            assert!(Segment::open(&RealFs, &path).is_err(), "{what}: Segment::open took it");
        }
        // An index entry whose first-seen range is not its group's: lookups
        // would go to the wrong group; the group read and the whole read refuse.
        let mut shifted = bytes.clone();
        let min = i64::from_le_bytes(shifted[group(1, 16)..group(1, 16) + 8].try_into().expect("8 bytes"));
        shifted[group(1, 16)..group(1, 16) + 8].copy_from_slice(&(min + 1).to_le_bytes());
        let crc = crc32c::crc32c(&shifted[at..t]);
        shifted[t + 4..t + 8].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&path, &shifted).expect("write");
        let index = read_index(&RealFs, &path).expect("the index itself is well formed").expect("version 2");
        assert!(read_group_of(&path, &index.groups[1], false).is_err(), "group 1's range differs");
        assert!(Segment::open(&RealFs, &path).is_err());
        // A group's image holding other rows than the index says.
        let mut other = bytes.clone();
        other[group(2, 12)] = 2; // the last group holds 3 rows; say 2 and keep the sum by adding one to group 0
        other[group(0, 12)..group(0, 12) + 4].copy_from_slice(&(GROUP_ROWS as u32 + 1).to_le_bytes());
        let crc = crc32c::crc32c(&other[at..t]);
        other[t + 4..t + 8].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&path, &other).expect("write");
        let index = read_index(&RealFs, &path).expect("the index itself adds up").expect("version 2");
        assert!(read_group_of(&path, &index.groups[0], false).is_err(), "group 0 has 256 rows, not 257");
        assert!(Segment::open(&RealFs, &path).is_err());
    }

    /// The groups holding a time, found by binary search, are exactly those
    /// a pass over every group finds, with overlapping and out-of-order
    /// ranges too.
    #[test]
    fn groups_holding_a_time_are_those_a_full_pass_finds() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..200 {
            let n = (next() % 40) as usize;
            let groups: Vec<GroupEntry> = (0..n)
                .map(|_| {
                    let min = (next() % 1000) as i64;
                    GroupEntry {
                        offset: 0,
                        len: 0,
                        rows: 1,
                        min_first_seen_ms: min,
                        max_first_seen_ms: min + (next() % 80) as i64,
                    }
                })
                .collect();
            let index = SegmentIndex::new(n as u64, groups.clone());
            for t in -5..1100 {
                let all: Vec<usize> = (0..n).filter(|&g| groups[g].holds_first_seen(t)).collect();
                assert_eq!(index.groups_holding(t), all, "t = {t}, groups {groups:?}");
            }
        }
    }
}
