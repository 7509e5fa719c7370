//! The key store's own memtable: keys applied and not yet in RocksDB's
//! files, with a log of their own.
//!
//! Why not RocksDB's memtable: the keys are random 128-bit ids. RocksDB
//! kept them in a hash-linked-list memtable (cheap lookups and inserts),
//! and its flush rebuilt the whole memtable as a skip list, one random
//! insert per key, before writing it out. Profiled on `dedupd dedupe
//! --state-dir --fsync always` over 1M new events (2026-11-29), that flush
//! was 30% of the process's CPU samples (`MemTable::KeyComparator` and
//! `SkipList::FindLessThan`), about 3 µs a key. A RocksDB skip-list
//! memtable moves the same sort onto the batch's thread (tried: less CPU,
//! slower runs). Here the keys sit in a hash map per partition until a
//! layer is full, then are sorted once, as a vector, and written as one SST
//! file that RocksDB ingests: the same file a flush would have written.
//!
//! Durability is RocksDB's WAL's, with a log of our own: every apply
//! writes one checksummed frame (its partition, checkpoint and new keys,
//! or a partition's drop) to the active layer's log before the keys become
//! visible, fsynced only with `sync_writes` (a process crash loses nothing;
//! a host crash may lose the last frames, and the checkpoint goes back
//! with them, so repair applies them again from the output topic). Open
//! replays every log into a layer, frames at or below the partition's
//! stored checkpoint skipped, and writes that layer out before serving. A
//! frame that does not check ends the log it is in: what follows it, and
//! any later log, was written after it, so the replayed frames are still
//! a prefix of the applies, checkpoints included.
//!
//! Layers: one active (applies write it), at most one frozen (being
//! written out on a thread of its own, still read by lookups). A frozen
//! layer's log is deleted once its keys are ingested and its checkpoints
//! and histogram counts are in the meta column family (written synced).
//!
//! ```text
//! log file   recent/<seq>.log, frames appended
//! frame      len u32 LE | crc32c u32 LE (over len, then payload) | payload
//! payload    kind u8 (1 apply, 2 drop) | partition i32 LE
//!            apply: checkpoint i64 LE | count u32 LE | count x (id 16 | value_len u8 | value)
//! ```
//!
//! The value is the keys column family's own encoding (`codec.rs`), so a
//! frame's key is written to its SST without decoding it again.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use hashbrown::HashMap;

use crate::classify::{IdBuildHasher, SeenKey};
use crate::event::IdHash;

use super::codec::{decode_value, MAX_VALUE_LEN};
use super::error::KeystoreError;
use super::histogram::{BucketStats, Histogram};

/// The directory of the logs, inside the key store's.
pub(crate) const RECENT_DIR: &str = "recent";

const KIND_APPLY: u8 = 1;
const KIND_DROP: u8 = 2;
const HEADER: usize = 8;
/// Largest frame payload a reader accepts: a frame is one apply, a batch
/// of keys (about 50 bytes each), so 256 MiB is far past any batch and
/// still refuses a garbage length before allocating it.
const MAX_PAYLOAD: usize = 256 << 20;

/// Bytes a slot of a layer's table takes: the id and its `SeenKey`, and
/// the table's control byte. Layers are sized in bytes by their tables'
/// slots (a table is a power of two of them, at most 7/8 full), not by
/// their keys.
const SLOT_BYTES: usize = std::mem::size_of::<(IdHash, SeenKey)>() + 1;

/// Bytes of a table with room for `capacity` keys without growing, as
/// hashbrown sizes it.
fn table_bytes(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let slots = if capacity < 8 {
        if capacity < 4 {
            4
        } else {
            8
        }
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    slots * SLOT_BYTES
}

/// One apply or drop, read back from a log.
#[derive(Debug, PartialEq)]
pub(crate) enum Frame {
    Apply { partition: i32, checkpoint: i64, keys: Vec<SeenKey> },
    Drop { partition: i32 },
}

/// Appends the frame of one apply to `out`: `keys` are the new keys with
/// their encoded values (`values[start..end]`).
pub(crate) fn encode_apply(partition: i32, checkpoint: i64, keys: &[(IdHash, &[u8])], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER]);
    out.push(KIND_APPLY);
    out.extend_from_slice(&partition.to_le_bytes());
    out.extend_from_slice(&checkpoint.to_le_bytes());
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for (id, value) in keys {
        out.extend_from_slice(&id.0);
        out.push(value.len() as u8);
        out.extend_from_slice(value);
    }
    seal(out, start);
}

pub(crate) fn encode_drop(partition: i32, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER]);
    out.push(KIND_DROP);
    out.extend_from_slice(&partition.to_le_bytes());
    seal(out, start);
}

/// Fills in the header of the frame that starts at `start`.
fn seal(out: &mut [u8], start: usize) {
    let len = (out.len() - start - HEADER) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&len.to_le_bytes()), &out[start + HEADER..]);
    out[start + 4..start + HEADER].copy_from_slice(&crc.to_le_bytes());
}

/// The frames of one log, in order, up to the first that does not check
/// (torn or damaged): `(frames, bytes of the log they fill, whether the
/// log went on past them)`.
pub(crate) fn read_log(path: &Path) -> Result<(Vec<Frame>, u64, bool), KeystoreError> {
    let io = |source| KeystoreError::Io { path: path.to_path_buf(), source };
    let mut bytes = Vec::new();
    File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(io)?;
    let mut frames = Vec::new();
    let mut pos = 0usize;
    while pos < bytes.len() {
        match parse_frame(&bytes[pos..]) {
            Some((frame, used)) => {
                frames.push(frame);
                pos += used;
            }
            None => return Ok((frames, pos as u64, true)),
        }
    }
    Ok((frames, pos as u64, false))
}

/// One frame at the start of `buf`, and its length; `None` if it is short,
/// fails its checksum or does not parse.
fn parse_frame(buf: &[u8]) -> Option<(Frame, usize)> {
    let len = u32::from_le_bytes(buf.get(0..4)?.try_into().ok()?) as usize;
    if len > MAX_PAYLOAD {
        return None;
    }
    let crc = u32::from_le_bytes(buf.get(4..HEADER)?.try_into().ok()?);
    let payload = buf.get(HEADER..HEADER + len)?;
    if crc32c::crc32c_append(crc32c::crc32c(&(len as u32).to_le_bytes()), payload) != crc {
        return None;
    }
    let mut r = Reader { buf: payload, pos: 0 };
    let kind = r.take(1)?[0];
    let partition = i32::from_le_bytes(r.take(4)?.try_into().ok()?);
    let frame = match kind {
        KIND_DROP => Frame::Drop { partition },
        KIND_APPLY => {
            let checkpoint = i64::from_le_bytes(r.take(8)?.try_into().ok()?);
            let count = u32::from_le_bytes(r.take(4)?.try_into().ok()?) as usize;
            let mut keys = Vec::with_capacity(count.min(len / 18));
            for _ in 0..count {
                let id = IdHash(r.take(16)?.try_into().ok()?);
                let vlen = usize::from(r.take(1)?[0]);
                if vlen > MAX_VALUE_LEN {
                    return None;
                }
                keys.push(decode_value(partition, id, r.take(vlen)?).ok()?);
            }
            Frame::Apply { partition, checkpoint, keys }
        }
        _ => return None,
    };
    (r.pos == payload.len()).then_some((frame, HEADER + len))
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.buf.get(self.pos..self.pos + n)?;
        self.pos += n;
        Some(s)
    }
}

/// The logs in `dir`, oldest first, by the number in their name.
pub(crate) fn list_logs(dir: &Path) -> Result<Vec<(u64, PathBuf)>, KeystoreError> {
    let io = |source| KeystoreError::Io { path: dir.to_path_buf(), source };
    let mut logs = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let seq = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(seq) = seq {
            logs.push((seq, path));
        }
    }
    logs.sort_unstable();
    Ok(logs)
}

pub(crate) fn log_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:020}.log"))
}

/// The log of the active layer.
pub(crate) struct Log {
    pub path: PathBuf,
    file: File,
    sync: bool,
}

impl Log {
    /// Creates log `seq` in `dir` (and makes its name durable).
    pub(crate) fn create(dir: &Path, seq: u64, sync: bool) -> Result<Log, KeystoreError> {
        let path = log_path(dir, seq);
        let io = |source| KeystoreError::Io { path: path.clone(), source };
        let file = OpenOptions::new().create_new(true).append(true).open(&path).map_err(io)?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| KeystoreError::Io { path: dir.to_path_buf(), source })?;
        Ok(Log { path, file, sync })
    }

    pub(crate) fn append(&mut self, frames: &[u8]) -> Result<(), KeystoreError> {
        let io = |source| KeystoreError::Io { path: self.path.clone(), source };
        self.file.write_all(frames).map_err(io)?;
        if self.sync {
            self.file.sync_data().map_err(io)?;
        }
        Ok(())
    }

    pub(crate) fn sync(&self) -> Result<(), KeystoreError> {
        self.file.sync_data().map_err(|source| KeystoreError::Io { path: self.path.clone(), source })
    }
}

/// Keys applied and not yet in RocksDB's files, with each partition's
/// checkpoint and histogram counts as of its last apply here.
#[derive(Default)]
pub(crate) struct Layer {
    keys: HashMap<i32, HashMap<IdHash, SeenKey, IdBuildHasher>>,
    pub checkpoints: HashMap<i32, i64>,
    pub cells: HashMap<(i64, i32), BucketStats>,
    pub len: usize,
    /// The log holding this layer's frames.
    pub log_seq: u64,
}

impl Layer {
    pub(crate) fn new(log_seq: u64) -> Layer {
        Layer { log_seq, ..Layer::default() }
    }

    /// Adds one apply: `keys` new to the store, the partition's checkpoint.
    pub(crate) fn apply(&mut self, partition: i32, checkpoint: i64, keys: &[SeenKey], bucket_ms: i64) {
        if !keys.is_empty() {
            let held = self.keys.entry(partition).or_default();
            held.reserve(keys.len());
            for k in keys {
                if held.insert(k.id_hash, *k).is_none() {
                    self.len += 1;
                }
                let bucket = Histogram::bucket_of_ms(bucket_ms, k.first_seen_ms);
                let one = BucketStats::one(k.first_seen_ms);
                self.cells.entry((bucket, partition)).and_modify(|s| s.absorb(&one)).or_insert(one);
            }
        }
        self.checkpoints.insert(partition, checkpoint);
    }

    pub(crate) fn drop_partition(&mut self, partition: i32) {
        if let Some(held) = self.keys.remove(&partition) {
            self.len -= held.len();
        }
        self.checkpoints.remove(&partition);
        self.cells.retain(|(_, p), _| *p != partition);
    }

    #[cfg(test)]
    pub(crate) fn get(&self, partition: i32, id: &IdHash) -> Option<&SeenKey> {
        self.keys.get(&partition)?.get(id)
    }

    /// Bytes the layer's tables would take once `more` keys of `partition`
    /// are added (a table that must grow doubles).
    pub(crate) fn bytes_with(&self, partition: i32, more: usize) -> usize {
        self.keys
            .iter()
            .map(|(p, held)| {
                let wanted = if *p == partition { held.len() + more } else { 0 };
                table_bytes(held.capacity().max(wanted))
            })
            .sum::<usize>()
            + if self.keys.contains_key(&partition) { 0 } else { table_bytes(more) }
    }

    pub(crate) fn holds_keys_of(&self, partition: i32) -> bool {
        self.keys.get(&partition).is_some_and(|k| !k.is_empty())
    }

    pub(crate) fn keys_of(&self, partition: i32) -> impl Iterator<Item = &SeenKey> {
        self.keys.get(&partition).into_iter().flat_map(|k| k.values())
    }

    /// Every key, with its partition.
    pub(crate) fn all_keys(&self) -> impl Iterator<Item = (i32, &SeenKey)> {
        self.keys.iter().flat_map(|(p, k)| k.values().map(move |s| (*p, s)))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0 && self.checkpoints.is_empty()
    }
}

/// The layers and their log, behind one lock: held to append an apply's
/// frame and add its keys, to answer a lookup from memory, and to swap
/// layers; never across a RocksDB write.
pub(crate) struct Layers {
    pub active: Layer,
    pub log: Log,
    pub frozen: Option<std::sync::Arc<Layer>>,
    /// The first failure writing a frozen layer out: the store then
    /// refuses applies (lookups still see the layer).
    pub failed: Option<String>,
    pub next_log_seq: u64,
}

impl Layers {
    /// Appends frames to the active log. A failure may leave part of them
    /// in it, and a frame appended after that garbage would be lost to
    /// replay with it: the store takes no more (restart to recover).
    pub(crate) fn append(&mut self, frames: &[u8]) -> Result<(), KeystoreError> {
        let appended = self.log.append(frames);
        if let Err(e) = &appended {
            self.failed.get_or_insert_with(|| e.to_string());
        }
        appended
    }

    /// Refuses work once a write-out or an append has failed.
    pub(crate) fn refused(&self) -> Result<(), KeystoreError> {
        match &self.failed {
            Some(cause) => Err(KeystoreError::LayerWrite { cause: cause.clone() }),
            None => Ok(()),
        }
    }

    /// The partition's checkpoint as the layers know it.
    pub(crate) fn checkpoint(&self, partition: i32) -> Option<i64> {
        self.active.checkpoints.get(&partition).or_else(|| self.frozen.as_ref()?.checkpoints.get(&partition)).copied()
    }

    /// The key of `id` if a layer holds it (newest layer first), above
    /// the floor or not: `Some(None)` is a key the floor hides.
    pub(crate) fn get(&self, partition: i32, id: &IdHash, floor: i64) -> Option<Option<SeenKey>> {
        self.partition_keys(partition).get(id, floor)
    }

    /// `partition`'s tables in each layer, looked up once for many ids.
    fn partition_keys(&self, partition: i32) -> PartitionKeys<'_> {
        PartitionKeys {
            active: self.active.keys.get(&partition),
            frozen: self.frozen.as_ref().and_then(|f| f.keys.get(&partition)),
        }
    }

    pub(crate) fn holds_keys_of(&self, partition: i32) -> bool {
        self.active.holds_keys_of(partition) || self.frozen.as_ref().is_some_and(|f| f.holds_keys_of(partition))
    }
}

/// One partition's tables in the active and the frozen layer.
struct PartitionKeys<'a> {
    active: Option<&'a HashMap<IdHash, SeenKey, IdBuildHasher>>,
    frozen: Option<&'a HashMap<IdHash, SeenKey, IdBuildHasher>>,
}

impl PartitionKeys<'_> {
    fn get(&self, id: &IdHash, floor: i64) -> Option<Option<SeenKey>> {
        let k = self.active.and_then(|t| t.get(id)).or_else(|| self.frozen?.get(id))?;
        Some(Some(*k).filter(|k| k.first_seen_ms > floor))
    }
}

/// The layers, and the signal that a frozen one is written out (or failed).
pub(crate) struct Recent {
    layers: std::sync::Mutex<Layers>,
    pub spilled: std::sync::Condvar,
}

impl Recent {
    pub(crate) fn new(layers: Layers) -> Recent {
        Recent { layers: std::sync::Mutex::new(layers), spilled: std::sync::Condvar::new() }
    }

    /// Waits until no layer is being written out; fails if one failed.
    pub(crate) fn frozen_written<'a>(
        &'a self,
        mut layers: std::sync::MutexGuard<'a, Layers>,
    ) -> Result<std::sync::MutexGuard<'a, Layers>, KeystoreError> {
        while layers.frozen.is_some() && layers.failed.is_none() {
            layers = self.spilled.wait(layers).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        layers.refused()?;
        Ok(layers)
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Layers> {
        // Every change under the lock is one statement or an append whose
        // failure is returned before anything is added: carrying on after a
        // panic is safe.
        self.layers.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Answers `ids` from the layers into `out` (cleared first, one answer
    /// per id); returns the positions of the ids no layer holds, for
    /// RocksDB to answer.
    pub(crate) fn lookup(
        &self,
        partition: i32,
        ids: &[IdHash],
        floor: i64,
        out: &mut Vec<Option<SeenKey>>,
    ) -> Vec<usize> {
        out.clear();
        let mut misses = Vec::new();
        let layers = self.lock();
        let held = layers.partition_keys(partition);
        for (i, id) in ids.iter().enumerate() {
            match held.get(id, floor) {
                Some(answer) => out.push(answer),
                None => {
                    out.push(None);
                    misses.push(i);
                }
            }
        }
        misses
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::PayloadHash;
    use crate::event::Position;

    fn key(n: u8, offset: i64) -> SeenKey {
        SeenKey {
            id_hash: IdHash([n; 16]),
            payload_hash: PayloadHash([n ^ 0x55; 16]),
            first_seen_ms: 1_700_000_000_000 + i64::from(n),
            source: Position { partition: 3, offset: offset + 100 },
            output: Position { partition: 3, offset },
        }
    }

    fn frame_of(partition: i32, checkpoint: i64, keys: &[SeenKey]) -> Vec<u8> {
        let mut values = Vec::new();
        let spans: Vec<(IdHash, usize, usize)> = keys
            .iter()
            .map(|k| {
                let start = values.len();
                super::super::codec::encode_value(partition, k, &mut values);
                (k.id_hash, start, values.len())
            })
            .collect();
        let with: Vec<(IdHash, &[u8])> = spans.iter().map(|(id, s, e)| (*id, &values[*s..*e])).collect();
        let mut out = Vec::new();
        encode_apply(partition, checkpoint, &with, &mut out);
        out
    }

    #[test]
    fn frames_read_back_as_written_and_a_damaged_one_ends_the_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut log = Log::create(dir.path(), 1, false).expect("create");
        let first = frame_of(3, 10, &[key(1, 9), key(2, 10)]);
        let mut drop = Vec::new();
        encode_drop(3, &mut drop);
        let third = frame_of(3, 12, &[key(4, 12)]);
        log.append(&first).expect("append");
        log.append(&drop).expect("append");
        log.append(&third).expect("append");
        let (frames, used, more) = read_log(&log.path).expect("read");
        assert_eq!(
            frames,
            vec![
                Frame::Apply { partition: 3, checkpoint: 10, keys: vec![key(1, 9), key(2, 10)] },
                Frame::Drop { partition: 3 },
                Frame::Apply { partition: 3, checkpoint: 12, keys: vec![key(4, 12)] },
            ]
        );
        assert_eq!((used, more), ((first.len() + drop.len() + third.len()) as u64, false));

        // Each byte of the middle frame flipped, and the log cut anywhere
        // inside the last: the frames before the damage, nothing after.
        let whole = std::fs::read(&log.path).expect("read");
        for i in first.len()..first.len() + drop.len() {
            let mut bad = whole.clone();
            bad[i] ^= 0x01;
            std::fs::write(&log.path, &bad).expect("write");
            let (frames, used, more) = read_log(&log.path).expect("read");
            assert_eq!((frames.len(), used, more), (1, first.len() as u64, true), "byte {i} flipped");
        }
        for cut in first.len() + drop.len() + 1..whole.len() {
            std::fs::write(&log.path, &whole[..cut]).expect("write");
            let (frames, _, more) = read_log(&log.path).expect("read");
            assert_eq!((frames.len(), more), (2, true), "cut at {cut}");
        }
    }

    #[test]
    fn a_layer_counts_keys_and_cells_and_forgets_a_dropped_partition() {
        let mut layer = Layer::new(1);
        layer.apply(3, 10, &[key(1, 9), key(2, 10)], 3_600_000);
        layer.apply(4, 5, &[key(1, 5)], 3_600_000);
        assert_eq!(layer.len, 3);
        assert_eq!(layer.get(3, &IdHash([2; 16])), Some(&key(2, 10)));
        assert_eq!(layer.cells.values().map(|s| s.count).sum::<i64>(), 3);
        layer.drop_partition(3);
        assert_eq!((layer.len, layer.checkpoints.get(&3), layer.get(3, &IdHash([2; 16]))), (1, None, None));
        assert_eq!(layer.cells.values().map(|s| s.count).sum::<i64>(), 1);
        assert!(layer.holds_keys_of(4) && !layer.is_empty());
    }
}
