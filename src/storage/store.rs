//! [`UsageStore`]: open/recovery, append, flush, compaction and retention.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use super::error::IoContext;
use super::fs::{FileSystem, RangeReader, RealFs};
use super::manifest::{self, Manifest};
use super::memtable::Memtable;
use super::segment::{self, GroupEntry, Segment, SegmentIndex, SegmentMeta, SegmentWriter};
use super::sidecar::{self, SidecarEntry};
use super::wal::{
    self, reader,
    writer::{GroupCommit, PendingSync, WalWriter},
};
use super::{failpoint, fsutil, RecoveryPath, StorageError, StorageObserver, StoreOptions, StoredEvent};
use crate::classify::SeenKey;
use crate::event::IdHash;
use crate::pipeline::Mutation;

/// Keeps the newest `limit` of keys sorted oldest first.
fn keep_newest(keys: &mut Vec<SeenKey>, limit: usize) {
    if keys.len() > limit {
        keys.drain(..keys.len() - limit);
    }
}

/// A torn WAL tail found and truncated on open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TornTail {
    pub file: PathBuf,
    /// Where valid data ends (the file was truncated to this length).
    pub offset: u64,
    pub dropped_bytes: u64,
    pub detail: String,
}

/// What `open` found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// True when the directory held no store and a new one was created.
    pub created: bool,
    pub manifest_generation: u64,
    /// Newer manifest generations that failed to read (file, why): the
    /// previous good generation was used instead.
    pub skipped_manifests: Vec<(PathBuf, String)>,
    pub segments: usize,
    pub segment_rows: u64,
    pub wal_files_replayed: usize,
    pub wal_frames: usize,
    /// Events re-applied to the memtable from the WAL.
    pub wal_events_replayed: usize,
    /// WAL events at or below their partition's checkpoint (already in a segment).
    pub wal_events_skipped: usize,
    pub torn_tail: Option<TornTail>,
    /// Unreferenced files removed (leftovers of an interrupted flush or compaction).
    pub removed_files: usize,
}

/// What one `maintain` call did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MaintainReport {
    pub flushed_events: usize,
    /// Segments merged by compaction, and the segment they became (if any rows survived).
    pub compacted_segments: usize,
    pub compacted_into: Option<u64>,
    /// Whole segments dropped because all their rows were past retention.
    pub expired_segments: usize,
    /// Rows dropped by retention (whole segments plus rows filtered while merging).
    pub expired_rows: u64,
    /// Segments that failed to read during compaction; left in place untouched.
    pub corrupt_segments: Vec<PathBuf>,
}

/// The durable usage store. Single writer: `&mut self` on every mutation.
pub struct UsageStore {
    fs: Arc<dyn FileSystem>,
    wal_dir: PathBuf,
    seg_dir: PathBuf,
    man_dir: PathBuf,
    opts: StoreOptions,
    observer: Arc<dyn StorageObserver>,
    /// The newest durable manifest generation.
    manifest: Manifest,
    /// The generation before it: its files are kept so open can fall back to it.
    previous: Option<Manifest>,
    /// Highest generation number seen on disk, readable or not; the next one is above it.
    highest_generation: u64,
    memtable: Memtable,
    /// A memtable being written to a segment by a [`FlushJob`] without the
    /// store's lock: still read as the memtable is, until the manifest that
    /// names its segment is installed. Older than `memtable`.
    frozen: Option<Arc<Memtable>>,
    /// The last flushed memtable, emptied, with its allocations: the next
    /// freeze starts the live memtable from it instead of from nothing.
    /// Only while no memtable is frozen, so it adds no memory to a flush.
    spare: Option<Memtable>,
    /// Highest output offset per partition in segments + memtable (= written to the WAL).
    checkpoints: BTreeMap<i32, i64>,
    /// The checkpoints and the next segment id, also readable without the
    /// store's lock (see [`UsageMarks`]); moved with the fields above.
    marks: Arc<UsageMarks>,
    wal: WalWriter,
    /// Shared with batches waiting for their fsync outside the store's
    /// lock (see `wal::writer`).
    commits: Arc<GroupCommit>,
    /// Set by the first failed write/fsync; every later call fails.
    poisoned: Option<String>,
    /// The id the next segment gets. Ahead of the manifest's while a
    /// job holds the id it was given.
    next_segment_id: u64,
    /// Segment ids a [`FlushJob`] or [`CompactionJob`] is writing: their
    /// files (and temp files) are in no manifest yet, and garbage
    /// collection must not take them for leftovers.
    in_flight: HashSet<u64>,
    /// A [`CompactionJob`] is out: one at a time, so its inputs stay in
    /// the manifest until it installs.
    compacting: bool,
    /// The group index of each segment a lookup has touched (`None`: a
    /// version-1 file, read whole). Segments are immutable, so an index
    /// stays right until its segment leaves the manifest; 32 bytes per
    /// group of up to 256 rows, about 125 KB per million stored events
    /// (more where compaction kept a flush's short last group).
    indexes: std::sync::Mutex<HashMap<u64, Option<Arc<SegmentIndex>>>>,
    /// Segments a lookup planned under the store's lock is reading without
    /// it ([`FirstSeenLookup`]), with how many lookups: garbage collection
    /// leaves their files (a compaction may have just replaced them) to
    /// the next collection after the last lookup is done.
    being_read: Arc<std::sync::Mutex<HashMap<u64, usize>>>,
}

/// What a tier that writes behind the usage store (the ledger) reads of
/// it before each fold: its checkpoints and its next segment id, each
/// moved under the store's lock and read here without it. Applies fold a
/// batch while the batch before it is appended (`dedupd dedupe` makes the
/// append on a thread of its own), and waiting for the store's lock made
/// the fold wait for that append, its WAL write included. Both values
/// only rise within a process, so a value read a moment late is low. For
/// the segment id that is the safe side: an older id is a lower floor for
/// where folds not yet written may be found. The checkpoint it cannot
/// mislead: the ledger asks whether the store already holds the batch it
/// folds, and during a run only the partition's earlier batches move the
/// checkpoint, all of them below that batch (a store ahead of the ledger
/// is one recovered at open, where these values start).
#[derive(Debug)]
pub struct UsageMarks {
    next_segment_id: AtomicU64,
    checkpoints: RwLock<BTreeMap<i32, i64>>,
}

impl UsageMarks {
    /// See [`UsageStore::next_segment_id`].
    pub fn next_segment_id(&self) -> u64 {
        self.next_segment_id.load(Ordering::SeqCst)
    }

    /// See [`UsageStore::checkpoint`].
    pub fn checkpoint(&self, partition: i32) -> Option<i64> {
        self.checkpoints.read().unwrap_or_else(PoisonError::into_inner).get(&partition).copied()
    }
}

impl std::fmt::Debug for UsageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageStore")
            .field("wal_dir", &self.wal_dir)
            .field("generation", &self.manifest.generation)
            .field("segments", &self.manifest.segments.len())
            .field("memtable", &self.memtable.len())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

fn ensure_dirs(fs: &dyn FileSystem, dir: &Path) -> Result<(PathBuf, PathBuf, PathBuf), StorageError> {
    let (w, s, m) = (dir.join("wal"), dir.join("segments"), dir.join("manifest"));
    fsutil::create_dir_durable(fs, dir)?;
    for d in [&w, &s, &m] {
        fsutil::create_dir_durable(fs, d)?;
    }
    Ok((w, s, m))
}

fn has_segment_files(fs: &dyn FileSystem, seg_dir: &Path) -> Result<bool, StorageError> {
    for p in fs.list_dir(seg_dir).at(seg_dir)? {
        if matches!(p.extension().and_then(|e| e.to_str()), Some("seg" | "idx")) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Writes segment `id` and its sidecar (each temp + fsync + rename),
/// checking the two failpoints named after each file.
fn write_segment_files(
    fs: &dyn FileSystem,
    seg_dir: &Path,
    crash_at: Option<&str>,
    id: u64,
    rows: &[&StoredEvent],
    failpoints: [&'static str; 2],
) -> Result<SegmentMeta, StorageError> {
    let (bytes, meta) = segment::encode(id, rows)?;
    let keys: Vec<SeenKey> = rows.iter().map(|e| e.key).collect();
    write_encoded_segment(fs, seg_dir, crash_at, (&bytes, meta), &keys, failpoints)
}

/// [`write_segment_files`] of a segment already encoded, with its rows' keys.
fn write_encoded_segment(
    fs: &dyn FileSystem,
    seg_dir: &Path,
    crash_at: Option<&str>,
    (bytes, meta): (&[u8], SegmentMeta),
    keys: &[SeenKey],
    [after_segment, after_sidecar]: [&'static str; 2],
) -> Result<SegmentMeta, StorageError> {
    fsutil::write_atomic(fs, &segment::segment_path(seg_dir, meta.id), bytes, None, crash_at)?;
    failpoint::check(after_segment, crash_at)?;
    fsutil::write_atomic(
        fs,
        &sidecar::sidecar_path(seg_dir, meta.id),
        &sidecar::encode(meta.id, keys),
        None,
        crash_at,
    )?;
    failpoint::check(after_sidecar, crash_at)?;
    Ok(meta)
}

/// A memtable frozen for a flush ([`UsageStore::start_flush`]): its
/// segment and sidecar are written by [`write`](Self::write) without the
/// store's lock, so every partition goes on appending meanwhile; the
/// store installs the result ([`UsageStore::finish_flush`]).
pub struct FlushJob {
    fs: Arc<dyn FileSystem>,
    seg_dir: PathBuf,
    crash_at: Option<String>,
    id: u64,
    rows: Arc<Memtable>,
    /// The store's checkpoints when the memtable froze: what the
    /// manifest that names the segment says is flushed.
    checkpoints: BTreeMap<i32, i64>,
    /// The first WAL file written after the freeze.
    wal_start: u64,
    written: Option<Result<SegmentMeta, StorageError>>,
}

impl std::fmt::Debug for FlushJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlushJob").field("segment", &self.id).field("events", &self.rows.len()).finish()
    }
}

impl FlushJob {
    /// Events frozen for this flush.
    pub fn events(&self) -> usize {
        self.rows.len()
    }

    /// Encodes and writes the segment and its sidecar (durably). The
    /// outcome is kept for `finish_flush`, which poisons the store on a
    /// failure.
    pub fn write(&mut self) {
        let written = self.write_files();
        self.written = Some(written);
    }

    fn write_files(&self) -> Result<SegmentMeta, StorageError> {
        let rows: Vec<&StoredEvent> = self.rows.events().iter().collect();
        write_segment_files(
            self.fs.as_ref(),
            &self.seg_dir,
            self.crash_at.as_deref(),
            self.id,
            &rows,
            ["flush_after_segment", "flush_after_sidecar"],
        )
    }
}

/// A compaction planned by [`UsageStore::start_compaction`]: its merge
/// reads the input segments and writes the merged one without the store's
/// lock; segments are immutable and stay in the manifest until the store
/// installs the result ([`UsageStore::finish_compaction`]).
pub struct CompactionJob {
    fs: Arc<dyn FileSystem>,
    seg_dir: PathBuf,
    crash_at: Option<String>,
    /// The merged segment's id; `None` when only whole segments expire.
    id: Option<u64>,
    /// Rows first seen before this are past retention and dropped.
    cutoff: i64,
    /// Whole segments past retention.
    expired: HashSet<u64>,
    /// Small segments to merge, oldest first.
    inputs: Vec<SegmentMeta>,
    /// Bound on the bytes a merge holds (see `StoreOptions`).
    max_bytes: usize,
    outcome: Option<Result<Merged, StorageError>>,
}

/// What a compaction's merge did.
struct Merged {
    /// Inputs merged (fewer than planned when the memory bound was reached
    /// or an input was corrupt; none when fewer than two were readable).
    merged: Vec<u64>,
    new_meta: Option<SegmentMeta>,
    /// Rows of merged inputs dropped as past retention.
    filtered_rows: u64,
    corrupt: Vec<PathBuf>,
}

impl std::fmt::Debug for CompactionJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompactionJob")
            .field("segment", &self.id)
            .field("inputs", &self.inputs.len())
            .field("expired", &self.expired.len())
            .finish()
    }
}

impl CompactionJob {
    /// Reads and merges the inputs and writes the merged segment
    /// (durably). The outcome is kept for `finish_compaction`.
    pub fn run(&mut self) {
        let merged = self.merge();
        self.outcome = Some(merged);
    }

    fn merge(&self) -> Result<Merged, StorageError> {
        let mut done = Merged { merged: Vec::new(), new_meta: None, filtered_rows: 0, corrupt: Vec::new() };
        let planned_rows = usize::try_from(self.inputs.iter().map(|s| s.rows).sum::<u64>()).unwrap_or(0);
        let mut merging = MergedSegment::with_capacity(planned_rows);
        for s in &self.inputs {
            // The working set is bounded in bytes as well as in rows: the
            // merged file and its keys, which grow input by input (one
            // input is held at a time besides). It stops at the first input
            // past the bound (two at least, or nothing would ever merge);
            // the rest wait for the next round.
            if done.merged.len() >= 2 && merging.held_bytes() >= self.max_bytes {
                break;
            }
            let path = segment::segment_path(&self.seg_dir, s.id);
            let mark = merging.mark();
            let copied = Segment::open(self.fs.as_ref(), &path).and_then(|seg| merging.add(&seg, self.cutoff));
            match copied {
                Ok(filtered) => {
                    done.filtered_rows += filtered;
                    done.merged.push(s.id);
                }
                Err(StorageError::Io { source, .. }) if source.kind() != std::io::ErrorKind::InvalidData => {
                    return Err(StorageError::Io { path, source });
                }
                Err(_) => {
                    // A corrupt input stays where it is, reported; nothing
                    // of it goes into the merged segment.
                    merging.reset(mark);
                    done.corrupt.push(path);
                }
            }
        }
        if done.merged.len() < 2 {
            // Nothing left worth merging (e.g. a corrupt segment dropped out).
            done.merged.clear();
            done.filtered_rows = 0;
            return Ok(done);
        }
        if let Some(id) = self.id {
            done.new_meta = merging.write(self, id)?;
        }
        Ok(done)
    }
}

/// A compaction's merged segment as it is built, input by input, in row
/// order. A full group wholly within retention is copied as stored (its
/// columns' checksums checked, its keys decoded for the sidecar). Any
/// other group (a flush's last, short one; one retention cuts through; a
/// version-1 file's single image) is decoded, and its rows wait in
/// `pending` until a full group follows or 256 of them fill one: merging
/// small segments packs their rows into full groups again instead of
/// keeping each input's short tail.
struct MergedSegment {
    out: SegmentWriter,
    /// The rows written to `out`, in row order.
    keys: Vec<SeenKey>,
    /// Decoded rows after everything in `out`, fewer than a group.
    pending: Vec<StoredEvent>,
}

/// Where a [`MergedSegment`] stood before an input, to go back to if the
/// input turns out corrupt.
struct MergeMark {
    out: segment::WriterMark,
    keys: usize,
    pending: Vec<StoredEvent>,
}

impl MergedSegment {
    fn with_capacity(rows: usize) -> MergedSegment {
        MergedSegment {
            out: SegmentWriter::with_capacity(rows.saturating_mul(48)),
            keys: Vec::with_capacity(rows),
            pending: Vec::new(),
        }
    }

    fn held_bytes(&self) -> usize {
        self.out.len()
            + self.keys.len() * std::mem::size_of::<SeenKey>()
            + self.pending.iter().map(super::memtable::event_bytes).sum::<usize>()
    }

    fn mark(&self) -> MergeMark {
        MergeMark { out: self.out.mark(), keys: self.keys.len(), pending: self.pending.clone() }
    }

    fn reset(&mut self, mark: MergeMark) {
        self.out.truncate(mark.out);
        self.keys.truncate(mark.keys);
        self.pending = mark.pending;
    }

    /// Adds `seg`'s rows first seen at or after `cutoff`, and returns how
    /// many were before it.
    fn add(&mut self, seg: &Segment, cutoff: i64) -> Result<u64, StorageError> {
        let mut filtered = 0u64;
        for group in seg.groups() {
            let (min, max) = group.first_seen_range();
            if max < cutoff {
                // Dropped unread, but checked: a damaged input is reported
                // whichever of its groups is damaged.
                group.check_columns()?;
                filtered += group.rows() as u64;
            } else if min >= cutoff && group.rows() == segment::GROUP_ROWS {
                self.write_pending(0)?;
                let keys = group.read_keys()?;
                // The footer's range decides retention and goes into the
                // index unread: it must be the rows'.
                let got = keys
                    .iter()
                    .map(|k| k.first_seen_ms)
                    .fold((i64::MAX, i64::MIN), |(lo, hi), t| (lo.min(t), hi.max(t)));
                if got != (min, max) {
                    return Err(StorageError::corrupt(
                        seg.path(),
                        0,
                        "a group's first-seen range differs from its rows'",
                    ));
                }
                self.keys.extend(keys);
                self.out.push_group(group)?;
            } else {
                let rows = group.read_all()?;
                let (read, waiting) = (rows.len(), self.pending.len());
                self.pending.extend(rows.into_iter().filter(|e| e.key.first_seen_ms >= cutoff));
                filtered += (read - (self.pending.len() - waiting)) as u64;
                self.write_pending(segment::GROUP_ROWS)?;
            }
        }
        Ok(filtered)
    }

    /// Writes the pending rows as groups, keeping fewer than `keep` back
    /// (0: all of them).
    fn write_pending(&mut self, keep: usize) -> Result<(), StorageError> {
        let n = if keep == 0 { self.pending.len() } else { self.pending.len() - self.pending.len() % keep };
        if n == 0 {
            return Ok(());
        }
        let rows: Vec<&StoredEvent> = self.pending[..n].iter().collect();
        self.out.push_rows(&rows)?;
        self.keys.extend(rows.iter().map(|e| e.key));
        self.pending.drain(..n);
        Ok(())
    }

    /// Writes the merged segment `id` and its sidecar for `job`; `None`
    /// (and nothing written) when no row stayed.
    fn write(mut self, job: &CompactionJob, id: u64) -> Result<Option<SegmentMeta>, StorageError> {
        self.write_pending(0)?;
        if self.keys.is_empty() {
            return Ok(None);
        }
        let (bytes, meta) = self.out.finish(id);
        write_encoded_segment(
            job.fs.as_ref(),
            &job.seg_dir,
            job.crash_at.as_deref(),
            (&bytes, meta),
            &self.keys,
            ["compact_after_segment", "compact_after_segment"],
        )
        .map(Some)
    }
}

impl UsageStore {
    /// Opens (or creates) the store in `dir` (`<state-dir>/usage`) and recovers:
    /// manifest → WAL replay (torn tail truncated) → leftover files removed.
    /// Rebuilding the hot cache is [`UsageStore::recovery_hot_keys_of`], for
    /// every partition assigned together in one pass over the sidecars.
    pub fn open(
        dir: &Path,
        opts: StoreOptions,
        observer: Arc<dyn StorageObserver>,
    ) -> Result<(UsageStore, RecoveryReport), StorageError> {
        UsageStore::open_on(Arc::new(RealFs), dir, opts, observer)
    }

    /// [`open`](Self::open) on any [`FileSystem`]: the simulator's faulty
    /// disk in tests, [`RealFs`] otherwise.
    pub fn open_on(
        fs: Arc<dyn FileSystem>,
        dir: &Path,
        opts: StoreOptions,
        observer: Arc<dyn StorageObserver>,
    ) -> Result<(UsageStore, RecoveryReport), StorageError> {
        let (wal_dir, seg_dir, man_dir) = ensure_dirs(fs.as_ref(), dir)?;
        let crash_at = opts.crash_at.clone();
        let skip_dir_fsync = opts.mutations.has(Mutation::WalCreatedWithoutDirFsync);
        let mut report = RecoveryReport::default();
        let wal_files = wal::list(fs.as_ref(), &wal_dir)?;

        let (manifest, previous, highest_generation) = match manifest::load(fs.as_ref(), &man_dir)? {
            Some(loaded) => {
                report.skipped_manifests = loaded.skipped;
                (loaded.current, loaded.previous, loaded.highest_generation)
            }
            None => {
                // WAL files with no events and no manifest are what a crash
                // during the very first open leaves behind (empty, or only a
                // link frame): nothing was ever stored.
                let mut stored_events = false;
                for (_, path) in &wal_files {
                    stored_events |= reader::holds_events(fs.as_ref(), path);
                }
                if stored_events || has_segment_files(fs.as_ref(), &seg_dir)? {
                    return Err(StorageError::NoValidManifest { dir: man_dir, tried: 0 });
                }
                for (_, path) in &wal_files {
                    fsutil::remove_if_exists(fs.as_ref(), path)?;
                }
                // Fresh store: WAL 1 exists before the manifest that names it,
                // so a live manifest always finds its first WAL file.
                drop(WalWriter::create(fs.as_ref(), &wal_dir, 1, None, skip_dir_fsync, &GroupCommit::new())?);
                let m = Manifest { generation: 1, next_segment_id: 1, wal_start: 1, ..Manifest::default() };
                m.write(fs.as_ref(), &man_dir, crash_at.as_deref())?;
                report.created = true;
                (m, None, 1)
            }
        };
        report.manifest_generation = manifest.generation;
        report.segments = manifest.segments.len();
        report.segment_rows = manifest.segments.iter().map(|s| s.rows).sum();
        for s in &manifest.segments {
            let path = segment::segment_path(&seg_dir, s.id);
            if !fs.is_file(&path) {
                return Err(StorageError::MissingSegment { file: path, generation: manifest.generation });
            }
        }

        // WAL replay: files from wal_start on, contiguous, the last may be torn.
        let wal_files = wal::list(fs.as_ref(), &wal_dir)?;
        let live: Vec<&(u64, PathBuf)> = wal_files.iter().filter(|(seq, _)| *seq >= manifest.wal_start).collect();
        for (i, (seq, _)) in live.iter().enumerate() {
            if *seq != manifest.wal_start + i as u64 {
                let missing = manifest.wal_start + i as u64;
                return Err(StorageError::MissingWal {
                    file: wal::wal_path(&wal_dir, missing),
                    expected_first: manifest.wal_start,
                });
            }
        }
        if live.is_empty() {
            return Err(StorageError::MissingWal {
                file: wal::wal_path(&wal_dir, manifest.wal_start),
                expected_first: manifest.wal_start,
            });
        }
        let mut checkpoints = manifest.checkpoints.clone();
        let mut memtable = Memtable::sized_for(opts.memtable_max_events, opts.memtable_max_bytes);
        // The file before, its length as scanned: checked against the link
        // the next file recorded (see `wal::frame`).
        let mut before: Option<(u64, &Path, u64)> = None;
        // Where the newest live file ends once replayed, for the next
        // file's link.
        let mut newest_len = None;
        for (i, (seq, path)) in live.iter().enumerate() {
            let is_last = i + 1 == live.len();
            let scan = reader::scan_file(fs.as_ref(), path, is_last, |events| {
                for e in events {
                    let cp = checkpoints.entry(e.key.output.partition).or_insert(i64::MIN);
                    if e.key.output.offset > *cp {
                        *cp = e.key.output.offset;
                        memtable.push(e);
                        report.wal_events_replayed += 1;
                    } else {
                        report.wal_events_skipped += 1;
                    }
                }
                Ok(())
            })?;
            reader::check_own_link(*seq, path, scan.link)?;
            if let Some(previous) = before {
                reader::check_link(previous, scan.link)?;
            }
            before = Some((*seq, path.as_path(), scan.valid_len));
            newest_len = Some((*seq, scan.valid_len));
            report.wal_files_replayed += 1;
            report.wal_frames += scan.frames;
            // fsync what was replayed: the crashed process may have left it in
            // the page cache only (interval policy), and from now on it counts
            // as stored. A torn tail is cut off first, durably, so a later
            // append never sits behind garbage the next recovery would call mid-log.
            if scan.torn.is_some() {
                fs.truncate(path, scan.valid_len).at(path)?;
            }
            fs.sync_file(path).at(path)?;
            if let Some(detail) = scan.torn {
                report.torn_tail = Some(TornTail {
                    file: (*path).clone(),
                    offset: scan.valid_len,
                    dropped_bytes: scan.file_len - scan.valid_len,
                    detail,
                });
            }
        }
        checkpoints.retain(|_, o| *o != i64::MIN);
        let next_wal = live.last().map(|(seq, _)| seq + 1).unwrap_or(manifest.wal_start);
        let commits = GroupCommit::new();
        let wal = WalWriter::create(fs.as_ref(), &wal_dir, next_wal, newest_len, skip_dir_fsync, &commits)?;

        let manifest_next_segment_id = manifest.next_segment_id;
        let marks = Arc::new(UsageMarks {
            next_segment_id: AtomicU64::new(manifest_next_segment_id),
            checkpoints: RwLock::new(checkpoints.clone()),
        });
        let mut store = UsageStore {
            fs,
            wal_dir,
            seg_dir,
            man_dir,
            opts,
            observer,
            manifest,
            previous,
            highest_generation,
            memtable,
            frozen: None,
            spare: None,
            commits,
            checkpoints,
            marks,
            wal,
            poisoned: None,
            next_segment_id: manifest_next_segment_id,
            in_flight: HashSet::new(),
            compacting: false,
            indexes: Default::default(),
            being_read: Default::default(),
        };
        // The manifests just loaded may not be durable: a write whose
        // directory fsync failed leaves its rename in the page cache, where
        // this open reads it and a power loss undoes it. Garbage collection
        // deletes what they no longer name (WAL files, segments), so they
        // are made durable first; otherwise the manifest that comes back
        // after the power loss names files that are gone.
        fsutil::fsync_dir(store.fs.as_ref(), &store.man_dir)?;
        report.removed_files = store.collect_garbage()?;
        Ok((store, report))
    }

    fn check_poison(&self) -> Result<(), StorageError> {
        match self.poisoned.clone().or_else(|| self.commits.failure()) {
            Some(cause) => Err(StorageError::Poisoned { cause }),
            None => Ok(()),
        }
    }

    /// Records the first failure; the store refuses all work afterwards.
    fn poison_on_err<T>(&mut self, r: Result<T, StorageError>) -> Result<T, StorageError> {
        if let Err(e) = &r {
            if self.poisoned.is_none() {
                self.poisoned = Some(e.to_string());
            }
        }
        r
    }

    fn crash_at(&self) -> Option<&str> {
        self.opts.crash_at.as_deref()
    }

    /// Persists a batch; see the module doc for durability. Events at or
    /// below their partition's checkpoint are skipped. Returns how many were
    /// stored. Takes the events by value or by reference: they are copied
    /// once, into the memtable.
    pub fn append<E: std::borrow::Borrow<StoredEvent>>(&mut self, batch: &[E]) -> Result<usize, StorageError> {
        let (n, pending) = self.append_deferred(batch.iter().map(std::borrow::Borrow::borrow).collect::<Vec<_>>())?;
        if let Some(pending) = pending {
            let r = pending.wait();
            self.poison_on_err(r)?;
        }
        Ok(n)
    }

    /// [`append`](Self::append), except that with `--fsync always` the
    /// batch's fsync is left to the caller: it waits on the returned
    /// [`PendingSync`] after letting go of whatever lock guards the store,
    /// so other batches append meanwhile and one fsync covers them all
    /// (group commit). The batch is durable only once that wait returns;
    /// until then it is readable here, as events already published are.
    ///
    /// Events given by value move into the memtable; by reference, they are
    /// copied there: a caller that holds a lock around the store copies them
    /// before taking it.
    pub fn append_deferred<E: std::borrow::Borrow<StoredEvent> + Into<StoredEvent>>(
        &mut self,
        batch: Vec<E>,
    ) -> Result<(usize, Option<PendingSync>), StorageError> {
        self.check_poison()?;
        let mut fresh: Vec<&StoredEvent> = Vec::with_capacity(batch.len());
        let mut kept: Vec<bool> = Vec::with_capacity(batch.len());
        let mut advanced: BTreeMap<i32, i64> = BTreeMap::new();
        for e in &batch {
            let e = e.borrow();
            let p = e.key.output.partition;
            let cp = advanced.get(&p).copied().or_else(|| self.checkpoints.get(&p).copied());
            let keep = cp.is_none_or(|cp| e.key.output.offset > cp);
            if keep {
                advanced.insert(p, e.key.output.offset);
                fresh.push(e);
            }
            kept.push(keep);
        }
        if fresh.is_empty() {
            // A batch that comes again after a failure between its write and
            // its wait: the WAL holds it, maybe not durably yet. It is
            // acknowledged only once an fsync covers it.
            let unsynced = self.wal.synced_len() < self.wal.len();
            let pending = (self.opts.fsync == super::FsyncPolicy::Always && unsynced)
                .then(|| self.wal.pending(&self.observer, self.crash_at()));
            return Ok((0, pending));
        }
        let r = self.wal.write(&fresh, self.opts.crash_at.as_deref());
        self.poison_on_err(r)?;
        let n = fresh.len();
        let pending = match self.opts.fsync {
            super::FsyncPolicy::Always => Some(self.wal.pending(&self.observer, self.crash_at())),
            super::FsyncPolicy::Interval(_) => {
                if self.wal.sync_due_after_write(&self.opts.fsync) {
                    let r = self.wal.sync(self.observer.as_ref());
                    self.poison_on_err(r)?;
                }
                None
            }
        };
        for (e, keep) in batch.into_iter().zip(kept) {
            if keep {
                self.memtable.push(e.into());
            }
        }
        self.marks.checkpoints.write().unwrap_or_else(PoisonError::into_inner).extend(&advanced);
        self.checkpoints.extend(advanced);
        // Rotation and a flush fsync the WAL inline, covering this batch.
        if self.wal.len() >= self.opts.wal_rotate_bytes {
            let r = self.rotate_wal();
            self.poison_on_err(r)?;
        }
        if !self.opts.write_in_background && self.memtable_full() {
            self.flush()?;
        }
        Ok((n, pending))
    }

    /// Seals the active WAL file (fsync) and starts the next one.
    fn rotate_wal(&mut self) -> Result<(), StorageError> {
        self.wal.sync(self.observer.as_ref())?;
        let skip_dir_fsync = self.opts.mutations.has(Mutation::WalCreatedWithoutDirFsync);
        let sealed = (self.wal.seq(), self.wal.len());
        self.wal = WalWriter::create(
            self.fs.as_ref(),
            &self.wal_dir,
            sealed.0 + 1,
            Some(sealed),
            skip_dir_fsync,
            &self.commits,
        )?;
        Ok(())
    }

    /// Highest output offset stored for `partition` (durable per the fsync policy).
    pub fn checkpoint(&self, partition: i32) -> Option<i64> {
        self.checkpoints.get(&partition).copied()
    }

    /// Every partition with stored data, ascending.
    pub fn partitions(&self) -> Vec<i32> {
        self.checkpoints.keys().copied().collect()
    }

    /// Events not yet in a segment (the memtable, and one being flushed).
    pub fn memtable_len(&self) -> usize {
        self.unflushed().map(Memtable::len).sum()
    }

    /// The memtables not yet in a segment, oldest first: the one a
    /// [`FlushJob`] is writing, then the live one.
    fn unflushed(&self) -> impl Iterator<Item = &Memtable> {
        self.frozen.as_deref().into_iter().chain(std::iter::once(&self.memtable))
    }

    /// The first stored copy of `id` not yet in a segment.
    fn unflushed_get(&self, partition: Option<i32>, id: &IdHash) -> Option<StoredEvent> {
        self.unflushed().find_map(|m| m.get(partition, id)).cloned()
    }

    fn memtable_full(&self) -> bool {
        self.memtable.len() >= self.opts.memtable_max_events || self.memtable.bytes() >= self.opts.memtable_max_bytes
    }

    /// Whether the next `append` of `incoming`, or the next `maintain`
    /// (`incoming` empty), moves the memtable into a segment (without
    /// `write_in_background`; with it, see [`flush_wanted`](Self::flush_wanted)).
    pub fn flush_due(&self, incoming: &[StoredEvent]) -> bool {
        !self.opts.write_in_background
            && (self.memtable.len() + incoming.len() >= self.opts.memtable_max_events
                || self.memtable.bytes() + incoming.iter().map(super::memtable::event_bytes).sum::<usize>()
                    >= self.opts.memtable_max_bytes)
    }

    /// With `write_in_background`: the memtable is full and no flush is
    /// under way, so the caller should [`start_flush`](Self::start_flush).
    pub fn flush_wanted(&self) -> bool {
        self.opts.write_in_background && self.frozen.is_none() && self.poisoned.is_none() && self.memtable_full()
    }

    /// With `write_in_background`: a flush is still being written and the
    /// frozen and live memtables together have reached three times the
    /// bound; appends should wait for that flush to finish, so memory stays
    /// bounded however slow the disk is.
    pub fn must_wait_for_flush(&self) -> bool {
        // The frozen memtable and the live one together: a memtable frozen
        // after such a wait may itself be past its bound, and the next one
        // must not grow to the same size again beside it.
        self.frozen.as_ref().is_some_and(|frozen| {
            self.poisoned.is_none()
                && (frozen.len() + self.memtable.len() >= self.opts.memtable_max_events.saturating_mul(3)
                    || frozen.bytes() + self.memtable.bytes() >= self.opts.memtable_max_bytes.saturating_mul(3))
        })
    }

    /// A job started here will never be finished (no thread could be
    /// started for it, or its thread died): the store can neither install
    /// it nor start another, and poisons itself with `cause`. What a flush
    /// held is in the WAL and a compaction's inputs are untouched; the
    /// restart replays and cleans up.
    pub fn abandon_job(&mut self, cause: &str) {
        if self.poisoned.is_none() {
            self.poisoned = Some(cause.to_owned());
        }
    }

    /// Whether a [`FlushJob`] has been started and not finished.
    pub fn flush_in_flight(&self) -> bool {
        self.frozen.is_some()
    }

    /// Every stored event of `partition` above output offset `after`, in
    /// output order, when they are all still in the memtable (rebuilt from
    /// the WAL after a crash); `None` when a segment may hold some of them.
    /// What a tier that writes behind (the ledger) catches up from locally.
    pub fn unflushed_after(&self, partition: i32, after: Option<i64>) -> Option<Vec<&StoredEvent>> {
        // The manifest's checkpoint is the highest offset ever flushed for
        // the partition: everything above it is in the memtable.
        if let Some(flushed) = self.manifest.checkpoints.get(&partition) {
            if after.is_none_or(|a| a < *flushed) {
                return None;
            }
        }
        Some(
            self.unflushed()
                .flat_map(|m| m.events().iter())
                .filter(|e| e.key.output.partition == partition && after.is_none_or(|a| e.key.output.offset > a))
                .collect(),
        )
    }

    /// The id the next segment will take. Every event appended from now on
    /// reaches a segment whose id is at least this (a memtable takes its
    /// segment's id when it is frozen, and a compaction's output takes a
    /// new id): what a tier that writes behind (the ledger) records with
    /// each write, so a restart knows which segments may hold what it had
    /// not written.
    pub fn next_segment_id(&self) -> u64 {
        self.next_segment_id
    }

    /// Makes the next segment's id at least `id`: a tier recorded `id` as
    /// [`next_segment_id`](Self::next_segment_id) before a crash lost ids
    /// taken after the last manifest, and a segment written from now on
    /// must not take an id below what it recorded.
    pub fn skip_segment_ids_to(&mut self, id: u64) {
        self.next_segment_id = self.next_segment_id.max(id);
        self.marks.next_segment_id.store(self.next_segment_id, Ordering::SeqCst);
    }

    /// The checkpoints and the next segment id, for a reader that must not
    /// wait for this store's lock.
    pub fn marks(&self) -> Arc<UsageMarks> {
        Arc::clone(&self.marks)
    }

    /// Every stored event of each partition of `after` above its offset
    /// there, in output order, read from the memtables and the segments
    /// whose id is `first_segment` or more (see
    /// [`next_segment_id`](Self::next_segment_id)); each segment is read
    /// once for all partitions. What the ledger catches up from at open.
    pub fn stored_after(
        &self,
        first_segment: u64,
        after: &BTreeMap<i32, Option<i64>>,
    ) -> Result<BTreeMap<i32, Vec<StoredEvent>>, StorageError> {
        self.check_poison()?;
        let wanted = |e: &StoredEvent| {
            after.get(&e.key.output.partition).is_some_and(|a| a.is_none_or(|a| e.key.output.offset > a))
        };
        let mut found: BTreeMap<i32, Vec<StoredEvent>> = after.keys().map(|p| (*p, Vec::new())).collect();
        let mut keep = |e: StoredEvent| {
            if let Some(events) = found.get_mut(&e.key.output.partition) {
                events.push(e);
            }
        };
        for meta in self.manifest.segments.iter().filter(|s| s.id >= first_segment) {
            let path = segment::segment_path(&self.seg_dir, meta.id);
            Segment::open(self.fs.as_ref(), &path)?.read_all()?.into_iter().filter(|e| wanted(e)).for_each(&mut keep);
        }
        self.unflushed().flat_map(|m| m.events().iter()).filter(|e| wanted(e)).cloned().for_each(keep);
        for events in found.values_mut() {
            // A compaction places its output where its oldest input was, so
            // segment order is not output order.
            events.sort_by_key(|e| e.key.output.offset);
            events.dedup_by_key(|e| e.key.output.offset);
        }
        Ok(found)
    }

    /// WAL bytes written but not yet fsynced (always 0 with `FsyncPolicy::Always`
    /// once `append` returned, or `append_deferred`'s pending fsync was
    /// waited for): what a power loss could take.
    pub fn unsynced_wal_bytes(&self) -> u64 {
        self.wal.unsynced_bytes()
    }

    /// The live segments, oldest first.
    pub fn segments(&self) -> &[SegmentMeta] {
        &self.manifest.segments
    }

    /// The current manifest generation.
    pub fn generation(&self) -> u64 {
        self.manifest.generation
    }

    /// The keys to seed `partition`'s hot cache with after a restart:
    /// `recent_keys(partition, now_ms - hot_ttl_ms, hot_capacity)`.
    pub fn recovery_hot_keys(&self, partition: i32, now_ms: i64) -> Result<Vec<SeenKey>, StorageError> {
        self.recent_keys(partition, now_ms.saturating_sub(self.opts.hot_ttl_ms), self.opts.hot_capacity)
    }

    /// Keys of `partition` whose `first_seen_ms > since_ms`, from the sidecars
    /// of segments whose first-seen range reaches past `since_ms` (a segment
    /// scan when a sidecar is missing or corrupt; each segment read is reported
    /// to the observer with its path) plus the memtable. At most `limit`, the
    /// newest kept; sorted by `first_seen_ms` ascending.
    pub fn recent_keys(&self, partition: i32, since_ms: i64, limit: usize) -> Result<Vec<SeenKey>, StorageError> {
        let mut out = self.collect_recent(since_ms, |k| k.output.partition == partition)?;
        keep_newest(&mut out, limit);
        Ok(out)
    }

    /// [`UsageStore::recent_keys`] for every partition in one pass over the
    /// sidecars (a start-up with many partitions reads each segment once).
    pub fn recent_keys_all(
        &self,
        since_ms: i64,
        limit_per_partition: usize,
    ) -> Result<BTreeMap<i32, Vec<SeenKey>>, StorageError> {
        self.recent_keys_where(since_ms, limit_per_partition, |_| true)
    }

    /// [`UsageStore::recovery_hot_keys`] for each of `partitions`, from one
    /// pass over the sidecars: a rebalance that brings several partitions
    /// reads each segment once, not once per partition.
    pub fn recovery_hot_keys_of(
        &self,
        partitions: &std::collections::BTreeSet<i32>,
        now_ms: i64,
    ) -> Result<BTreeMap<i32, Vec<SeenKey>>, StorageError> {
        let since = now_ms.saturating_sub(self.opts.hot_ttl_ms);
        self.recent_keys_where(since, self.opts.hot_capacity, |p| partitions.contains(&p))
    }

    fn recent_keys_where(
        &self,
        since_ms: i64,
        limit_per_partition: usize,
        partition: impl Fn(i32) -> bool,
    ) -> Result<BTreeMap<i32, Vec<SeenKey>>, StorageError> {
        let mut by_partition: BTreeMap<i32, Vec<SeenKey>> = BTreeMap::new();
        for k in self.collect_recent(since_ms, |k| partition(k.output.partition))? {
            by_partition.entry(k.output.partition).or_default().push(k);
        }
        for keys in by_partition.values_mut() {
            keep_newest(keys, limit_per_partition);
        }
        Ok(by_partition)
    }

    /// Keys first seen after `since_ms` that pass `keep`, sorted by first-seen time.
    fn collect_recent(&self, since_ms: i64, keep: impl Fn(&SeenKey) -> bool) -> Result<Vec<SeenKey>, StorageError> {
        self.check_poison()?;
        let mut out: Vec<SeenKey> = Vec::new();
        let wanted = |k: &SeenKey| k.first_seen_ms > since_ms && keep(k);
        for meta in &self.manifest.segments {
            if meta.max_first_seen_ms <= since_ms {
                continue;
            }
            out.reserve(usize::try_from(meta.rows).unwrap_or(0));
            let mark = out.len();
            let read =
                sidecar::read_each(self.fs.as_ref(), &sidecar::sidecar_path(&self.seg_dir, meta.id), meta.id, |e| {
                    if wanted(&e.key) {
                        out.push(e.key);
                    }
                });
            match read {
                Ok(()) => self.observer.recovery_segment(RecoveryPath::Sidecar),
                Err(_) => {
                    // Nothing was visited (the checksum covers the whole file),
                    // but stay exact even if that ever changes.
                    out.truncate(mark);
                    self.observer.recovery_segment(RecoveryPath::Fallback);
                    let seg = Segment::open(self.fs.as_ref(), &segment::segment_path(&self.seg_dir, meta.id))?;
                    out.extend(seg.read_keys()?.into_iter().filter(|k| wanted(k)));
                }
            }
        }
        for m in self.unflushed() {
            out.extend(m.keys().copied().filter(|k| wanted(k)));
        }
        // Rows are in ingest order, so this is nearly sorted already and cheap.
        out.sort_by_key(|k| (k.first_seen_ms, k.output.offset));
        Ok(out)
    }

    /// The stored event for `id` (on `partition`, if given): the first stored
    /// copy. Scans one segment's sidecar at a time (or the segment itself if
    /// the sidecar is unreadable), then the matching segment: memory is bounded
    /// by the largest segment, not by the store.
    pub fn get(&self, partition: Option<i32>, id: &IdHash) -> Result<Option<StoredEvent>, StorageError> {
        self.check_poison()?;
        for meta in &self.manifest.segments {
            if let Some(hit) = self.find_in_segment(meta, partition, id)? {
                return Ok(Some(hit));
            }
        }
        Ok(self.unflushed_get(partition, id))
    }

    /// The event with this id, first seen at `first_seen_ms` (what the hot
    /// cache and the key store remember): only segments whose first-seen
    /// range holds that instant are read, usually one, so a conflict's
    /// original costs one segment whatever the length of the history
    /// (issue #14). `None` when no such segment holds it (aged out).
    pub fn get_first_seen(
        &self,
        partition: i32,
        id: &IdHash,
        first_seen_ms: i64,
    ) -> Result<Option<StoredEvent>, StorageError> {
        self.check_poison()?;
        for meta in &self.manifest.segments {
            if !(meta.min_first_seen_ms..=meta.max_first_seen_ms).contains(&first_seen_ms) {
                continue;
            }
            let hit = match self.segment_index(meta)? {
                Some(index) => {
                    let asked = [(*id, first_seen_ms)];
                    let reads = self.group_reads(meta, &index, &asked, [0]);
                    read_groups(self.fs.as_ref(), partition, &asked, &reads)?.pop().map(|(_, hit)| hit)
                }
                None => self.find_in_segment(meta, Some(partition), id)?,
            };
            if hit.is_some() {
                return Ok(hit);
            }
        }
        Ok(self.unflushed_get(Some(partition), id))
    }

    /// [`get_first_seen`](Self::get_first_seen) for many events at once (a
    /// batch's conflict originals). In a version-2 segment each group
    /// holding some of them is read once (a positioned read of one group,
    /// its columns decompressed once), however many of them it holds; in a
    /// version-1 segment its sidecar and the file are read once. Answers in
    /// the order asked. Many groups to read (a conflict storm's batch) are
    /// read on several threads (see `read_groups_on`).
    pub fn get_first_seen_many(
        &self,
        partition: i32,
        wanted: &[(IdHash, i64)],
    ) -> Result<Vec<Option<StoredEvent>>, StorageError> {
        let mut lookup = self.plan_first_seen_many(partition, wanted)?;
        lookup.read(ReadCores::All)?;
        self.finish_first_seen_many(lookup)
    }

    /// The first half of [`get_first_seen_many`](Self::get_first_seen_many),
    /// under the store's lock: which groups of which segments to read. The
    /// reads, most of a conflict storm's cost, are the lookup's
    /// ([`FirstSeenLookup::read`]) and need no lock, so other partitions'
    /// appends go on meanwhile (and, in `dedupd dedupe`, the partition's own
    /// apply); what they miss
    /// is looked up by [`finish_first_seen_many`](Self::finish_first_seen_many).
    pub fn plan_first_seen_many(
        &self,
        partition: i32,
        wanted: &[(IdHash, i64)],
    ) -> Result<FirstSeenLookup, StorageError> {
        self.check_poison()?;
        // Each event, by the first segment whose first-seen range holds it.
        let mut by_segment: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        let mut elsewhere = Vec::new();
        for (i, (_, first_seen_ms)) in wanted.iter().enumerate() {
            match self
                .manifest
                .segments
                .iter()
                .position(|m| (m.min_first_seen_ms..=m.max_first_seen_ms).contains(first_seen_ms))
            {
                Some(s) => by_segment.entry(s).or_default().push(i),
                None => elsewhere.push(i),
            }
        }
        // Every group of an indexed segment that may hold one of them, to be
        // read first (by the lookup, without the lock; on several threads
        // when there are many).
        let mut reads = Vec::new();
        let mut in_groups = Vec::new();
        let mut unindexed = Vec::new();
        let mut read_segments = Vec::new();
        for (s, asked) in by_segment {
            let meta = &self.manifest.segments[s];
            match self.segment_index(meta)? {
                Some(index) => {
                    reads.extend(self.group_reads(meta, &index, wanted, asked.iter().copied()));
                    in_groups.extend(asked);
                    read_segments.push(meta.id);
                }
                None => unindexed.push((meta.id, asked)),
            }
        }
        Ok(FirstSeenLookup {
            fs: Arc::clone(&self.fs),
            partition,
            wanted: wanted.to_vec(),
            found: vec![None; wanted.len()],
            reads,
            in_groups,
            unindexed,
            elsewhere,
            _reading: SegmentsBeingRead::hold(&self.being_read, read_segments),
        })
    }

    /// The second half of [`get_first_seen_many`](Self::get_first_seen_many),
    /// under the store's lock again: each event the lookup's reads did not
    /// find, looked up in the store as it is now (a flush or a compaction
    /// may have moved it since the plan). Answers in the order asked.
    pub fn finish_first_seen_many(&self, lookup: FirstSeenLookup) -> Result<Vec<Option<StoredEvent>>, StorageError> {
        self.check_poison()?;
        let FirstSeenLookup { partition, wanted, mut found, in_groups, unindexed, elsewhere, .. } = lookup;
        let look_again = |found: &mut Vec<Option<StoredEvent>>, i: usize| -> Result<(), StorageError> {
            if found[i].is_none() {
                found[i] = self.get_first_seen(partition, &wanted[i].0, wanted[i].1)?;
            }
            Ok(())
        };
        // Not in its first candidate: every candidate and the memtable, as
        // the one-at-a-time path does.
        for i in in_groups {
            look_again(&mut found, i)?;
        }
        for (id, asked) in unindexed {
            // A version-1 segment: its sidecar and the file read once. Gone
            // from the manifest since the plan, its rows are elsewhere now.
            if let Some(meta) = self.manifest.segments.iter().find(|m| m.id == id) {
                let ids: HashSet<IdHash> = asked.iter().map(|&i| wanted[i].0).collect();
                let rows = self.rows_in_segment(meta, partition, &ids)?;
                if !rows.is_empty() {
                    let seg_path = segment::segment_path(&self.seg_dir, meta.id);
                    let segment = Segment::open(self.fs.as_ref(), &seg_path)?.keeping_columns();
                    for &i in &asked {
                        if let Some(&row) = rows.get(&wanted[i].0) {
                            found[i] = Some(self.row_of(&segment, &seg_path, row)?);
                        }
                    }
                }
            }
            for &i in &asked {
                look_again(&mut found, i)?;
            }
        }
        // In no segment when planned: the memtable, or the segment a flush
        // has made of it since.
        for i in elsewhere {
            look_again(&mut found, i)?;
        }
        Ok(found)
    }

    /// The rows of `ids` (of `partition`) in one segment, from its sidecar
    /// (or its key columns when the sidecar cannot be read).
    fn rows_in_segment(
        &self,
        meta: &SegmentMeta,
        partition: i32,
        ids: &HashSet<IdHash>,
    ) -> Result<std::collections::HashMap<IdHash, u32>, StorageError> {
        let entries = self.sidecar_entries(meta)?;
        Ok(entries
            .into_iter()
            .filter(|e| e.key.output.partition == partition && ids.contains(&e.key.id_hash))
            .map(|e| (e.key.id_hash, e.row))
            .collect())
    }

    /// A segment's sidecar entries, or, when the sidecar cannot be read,
    /// the same built from the segment's key columns.
    fn sidecar_entries(&self, meta: &SegmentMeta) -> Result<Vec<SidecarEntry>, StorageError> {
        match sidecar::read(self.fs.as_ref(), &sidecar::sidecar_path(&self.seg_dir, meta.id), meta.id) {
            Ok(entries) => Ok(entries),
            Err(_) => {
                let seg_path = segment::segment_path(&self.seg_dir, meta.id);
                let keys = Segment::open(self.fs.as_ref(), &seg_path)?.read_keys()?;
                Ok(keys.into_iter().enumerate().map(|(row, key)| SidecarEntry { key, row: row as u32 }).collect())
            }
        }
    }

    /// One row of an opened segment, refusing a row the sidecar names
    /// beyond the segment's end.
    fn row_of(&self, segment: &Segment, seg_path: &Path, row: u32) -> Result<StoredEvent, StorageError> {
        if row as usize >= segment.rows() {
            return Err(StorageError::corrupt(seg_path, 0, format!("sidecar names row {row} beyond the segment")));
        }
        segment.read_row(row as usize)
    }

    /// Looks `id` up in one segment: its sidecar (or, when the sidecar
    /// cannot be read, the segment's key columns), then the one row.
    fn find_in_segment(
        &self,
        meta: &SegmentMeta,
        partition: Option<i32>,
        id: &IdHash,
    ) -> Result<Option<StoredEvent>, StorageError> {
        let entries = self.sidecar_entries(meta)?;
        // A linear pass over 68-byte entries of one segment.
        let hit =
            entries.iter().find(|e| e.key.id_hash == *id && partition.is_none_or(|p| e.key.output.partition == p));
        let Some(hit) = hit else { return Ok(None) };
        let seg_path = segment::segment_path(&self.seg_dir, meta.id);
        let segment = Segment::open(self.fs.as_ref(), &seg_path)?;
        Ok(Some(self.row_of(&segment, &seg_path, hit.row)?))
    }

    /// Calls `f` on every stored event: segments in order (oldest first), then
    /// the memtable. Reads one segment at a time.
    pub fn for_each_event(&self, mut f: impl FnMut(&StoredEvent)) -> Result<(), StorageError> {
        self.check_poison()?;
        for meta in &self.manifest.segments {
            for e in Segment::open(self.fs.as_ref(), &segment::segment_path(&self.seg_dir, meta.id))?.read_all()? {
                f(&e);
            }
        }
        self.unflushed().flat_map(|m| m.events().iter()).for_each(f);
        Ok(())
    }

    /// Memtable → segment + sidecar → new manifest generation → old WAL dropped.
    /// Crash-safe at every step: until the manifest is renamed into place the
    /// new files are unreferenced leftovers and the WAL still holds the events.
    pub fn flush(&mut self) -> Result<(), StorageError> {
        self.check_poison()?;
        let r = self.flush_inner();
        self.poison_on_err(r)
    }

    fn flush_inner(&mut self) -> Result<(), StorageError> {
        // A flush under way keeps its events in the WAL until its manifest
        // is installed: an inline flush (close, upkeep) then only syncs.
        match self.start_flush_inner()? {
            None => self.wal.sync(self.observer.as_ref()),
            Some(mut job) => {
                job.write();
                self.finish_flush_inner(job)
            }
        }
    }

    /// With `write_in_background`: freezes the memtable for a flush whose
    /// segment is written without the store's lock, and hands back the
    /// job (`None` when the memtable is empty or a flush is already
    /// under way). The frozen events stay readable here, and stay in the
    /// WAL, until [`finish_flush`](Self::finish_flush) installs the
    /// manifest naming their segment; appends go on into a fresh memtable
    /// meanwhile. Upkeep neither flushes nor compacts while a job is out.
    pub fn start_flush(&mut self) -> Result<Option<FlushJob>, StorageError> {
        self.check_poison()?;
        let r = self.start_flush_inner();
        self.poison_on_err(r)
    }

    fn start_flush_inner(&mut self) -> Result<Option<FlushJob>, StorageError> {
        if self.frozen.is_some() || self.memtable.is_empty() {
            return Ok(None);
        }
        // Everything in the memtable is in WAL files <= the current one;
        // rotating makes the next file the first one the new manifest needs.
        self.rotate_wal()?;
        let id = self.take_segment_id();
        let fresh = self
            .spare
            .take()
            .unwrap_or_else(|| Memtable::sized_for(self.opts.memtable_max_events, self.opts.memtable_max_bytes));
        let rows = Arc::new(std::mem::replace(&mut self.memtable, fresh));
        self.frozen = Some(Arc::clone(&rows));
        Ok(Some(FlushJob {
            fs: Arc::clone(&self.fs),
            seg_dir: self.seg_dir.clone(),
            crash_at: self.opts.crash_at.clone(),
            id,
            rows,
            checkpoints: self.checkpoints.clone(),
            wal_start: self.wal.seq(),
            written: None,
        }))
    }

    /// Installs the manifest naming a [`FlushJob`]'s segment (writing it
    /// first if the job was not written) and lets go of its frozen
    /// memtable and of the WAL files only it needed. A job whose write
    /// failed poisons the store: its events are still in the WAL, and the
    /// restart that follows replays them.
    pub fn finish_flush(&mut self, job: FlushJob) -> Result<(), StorageError> {
        self.check_poison()?;
        let r = self.finish_flush_inner(job);
        self.poison_on_err(r)
    }

    fn finish_flush_inner(&mut self, mut job: FlushJob) -> Result<(), StorageError> {
        if !self.frozen.as_ref().is_some_and(|f| Arc::ptr_eq(f, &job.rows)) {
            return Err(StorageError::Poisoned {
                cause: format!("flush of segment {} was not started by this store", job.id),
            });
        }
        self.in_flight.remove(&job.id);
        let meta = match job.written.take() {
            Some(written) => written?,
            None => job.write_files()?,
        };
        let mut next = self.next_manifest();
        next.wal_start = job.wal_start;
        next.segments.push(meta);
        // What the frozen memtable held: later appends are in the WAL
        // files from `wal_start` on, which the next open replays.
        next.checkpoints = job.checkpoints;
        self.install_manifest(next)?;
        failpoint::check("flush_after_manifest", self.crash_at())?;
        self.frozen = None;
        // Unique once `frozen` lets go; the job was the other holder.
        self.spare = Arc::try_unwrap(job.rows).ok().map(Memtable::recycled);
        self.collect_garbage()?;
        Ok(())
    }

    /// A new segment id, kept out of garbage collection until its job
    /// installs it (or the store is poisoned and the restart cleans up).
    fn take_segment_id(&mut self) -> u64 {
        let id = self.next_segment_id;
        self.next_segment_id += 1;
        self.marks.next_segment_id.store(self.next_segment_id, Ordering::SeqCst);
        self.in_flight.insert(id);
        id
    }

    fn next_manifest(&self) -> Manifest {
        let mut m = self.manifest.clone();
        m.generation = self.highest_generation.max(self.manifest.generation) + 1;
        m.next_segment_id = self.next_segment_id;
        m
    }

    fn install_manifest(&mut self, next: Manifest) -> Result<(), StorageError> {
        next.write(self.fs.as_ref(), &self.man_dir, self.crash_at())?;
        self.highest_generation = next.generation;
        let live: HashSet<u64> = next.segments.iter().map(|m| m.id).collect();
        self.indexes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|id, _| live.contains(id));
        self.previous = Some(std::mem::replace(&mut self.manifest, next));
        Ok(())
    }

    /// The group index of segment `meta` (read once, then kept); `None`
    /// for a version-1 file.
    fn segment_index(&self, meta: &SegmentMeta) -> Result<Option<Arc<SegmentIndex>>, StorageError> {
        let cached = self.indexes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&meta.id).cloned();
        if let Some(index) = cached {
            return Ok(index);
        }
        let path = segment::segment_path(&self.seg_dir, meta.id);
        let index = segment::read_index(self.fs.as_ref(), &path)?.map(Arc::new);
        if index.as_ref().is_some_and(|i| i.rows != meta.rows) {
            return Err(StorageError::corrupt(
                &path,
                0,
                format!("{} rows, the manifest says {}", index.map_or(0, |i| i.rows), meta.rows),
            ));
        }
        self.indexes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(meta.id, index.clone());
        Ok(index)
    }

    /// The groups of a version-2 segment to read to look `asked[i]` up, for
    /// each `i` of `which`: each group whose first-seen range holds one of
    /// them, once, in group order, with the ones it may hold.
    fn group_reads(
        &self,
        meta: &SegmentMeta,
        index: &Arc<SegmentIndex>,
        asked: &[(IdHash, i64)],
        which: impl IntoIterator<Item = usize>,
    ) -> Vec<GroupRead> {
        let mut by_group: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for i in which {
            for g in index.groups_holding(asked[i].1) {
                by_group.entry(g).or_default().push(i);
            }
        }
        let path: Arc<Path> = segment::segment_path(&self.seg_dir, meta.id).into();
        by_group
            .into_iter()
            .map(|(group, asked)| GroupRead { path: Arc::clone(&path), index: Arc::clone(index), group, asked })
            .collect()
    }

    /// Between batches: fsync when the interval is due, flush a full memtable,
    /// drop segments past retention, merge small segments.
    pub fn maintain(&mut self, now_ms: i64) -> Result<MaintainReport, StorageError> {
        self.check_poison()?;
        let r = self.maintain_inner(now_ms);
        self.poison_on_err(r)
    }

    fn maintain_inner(&mut self, now_ms: i64) -> Result<MaintainReport, StorageError> {
        let mut report = MaintainReport::default();
        if self.wal.sync_due(&self.opts.fsync) {
            self.wal.sync(self.observer.as_ref())?;
        }
        if self.opts.write_in_background {
            // Flushes and compactions are the caller's jobs.
            return Ok(report);
        }
        if self.memtable_full() {
            report.flushed_events = self.memtable.len();
            self.flush_inner()?;
        }
        if let Some(mut job) = self.start_compaction_inner(now_ms) {
            job.run();
            let compacted = self.finish_compaction_inner(job)?;
            report = MaintainReport { flushed_events: report.flushed_events, ..compacted };
        }
        Ok(report)
    }

    /// Plans a compaction: the segments past retention (dropped whole)
    /// and the small segments to merge, oldest first. `None` when there is
    /// nothing to do or a compaction is already out. With
    /// `write_in_background` the caller runs the job
    /// ([`CompactionJob::run`], without the store's lock) and installs it
    /// ([`finish_compaction`](Self::finish_compaction)); flushes go on
    /// meanwhile. Without `write_in_background`, `maintain` compacts
    /// inline and this is always `None`.
    pub fn start_compaction(&mut self, now_ms: i64) -> Result<Option<CompactionJob>, StorageError> {
        self.check_poison()?;
        if !self.opts.write_in_background {
            return Ok(None);
        }
        Ok(self.start_compaction_inner(now_ms))
    }

    fn start_compaction_inner(&mut self, now_ms: i64) -> Option<CompactionJob> {
        if self.compacting {
            return None;
        }
        let cutoff = now_ms.saturating_sub(self.opts.retention_ms);
        let segs = &self.manifest.segments;
        let expired: HashSet<u64> = segs.iter().filter(|s| s.max_first_seen_ms < cutoff).map(|s| s.id).collect();
        let mut merge: Vec<SegmentMeta> = Vec::new();
        let mut merge_rows = 0u64;
        for s in segs.iter().filter(|s| !expired.contains(&s.id) && s.rows < self.opts.compaction_target_rows) {
            if merge_rows + s.rows > self.opts.compaction_max_rows && merge.len() >= 2 {
                break;
            }
            merge_rows += s.rows;
            merge.push(*s);
        }
        if merge.len() < self.opts.compaction_min_segments.max(2) {
            merge.clear();
        }
        if expired.is_empty() && merge.is_empty() {
            return None;
        }
        let id = if merge.is_empty() { None } else { Some(self.take_segment_id()) };
        self.compacting = true;
        Some(CompactionJob {
            fs: Arc::clone(&self.fs),
            seg_dir: self.seg_dir.clone(),
            crash_at: self.opts.crash_at.clone(),
            id,
            cutoff,
            expired,
            inputs: merge,
            max_bytes: self.opts.compaction_max_bytes,
            outcome: None,
        })
    }

    /// Installs a [`CompactionJob`] (running it first if it was not run):
    /// the merged segment takes the place of its oldest input, and
    /// segments past retention leave the manifest. A job whose run failed
    /// on I/O poisons the store; a corrupt input is left in place and
    /// reported instead.
    pub fn finish_compaction(&mut self, job: CompactionJob) -> Result<MaintainReport, StorageError> {
        self.check_poison()?;
        let r = self.finish_compaction_inner(job);
        self.poison_on_err(r)
    }

    fn finish_compaction_inner(&mut self, mut job: CompactionJob) -> Result<MaintainReport, StorageError> {
        self.compacting = false;
        if let Some(id) = job.id {
            self.in_flight.remove(&id);
        }
        let done = match job.outcome.take() {
            Some(done) => done?,
            None => job.merge()?,
        };
        let mut report = MaintainReport {
            expired_rows: done.filtered_rows,
            corrupt_segments: done.corrupt,
            ..MaintainReport::default()
        };
        if job.expired.is_empty() && done.merged.is_empty() {
            return Ok(report);
        }
        let mut next = self.next_manifest();
        let mut new_meta = done.new_meta;
        report.compacted_into = new_meta.map(|m| m.id);
        // The merged segment takes the place of the oldest input, so segment
        // order stays "older data first" for `get`.
        let mut segments = Vec::with_capacity(next.segments.len());
        for s in &next.segments {
            if job.expired.contains(&s.id) {
                report.expired_segments += 1;
                report.expired_rows += s.rows;
            } else if done.merged.contains(&s.id) {
                if let Some(m) = new_meta.take() {
                    segments.push(m);
                }
            } else {
                segments.push(*s);
            }
        }
        next.segments = segments;
        report.compacted_segments = done.merged.len();
        self.install_manifest(next)?;
        failpoint::check("compact_after_manifest", self.crash_at())?;
        self.collect_garbage()?;
        Ok(report)
    }

    /// Deletes files neither the current nor the previous generation needs:
    /// segments and sidecars, WAL files below both `wal_start`s, manifests
    /// older than the previous generation, and temp files. Returns how many.
    fn collect_garbage(&mut self) -> Result<usize, StorageError> {
        let mut keep: HashSet<u64> = self.manifest.segments.iter().map(|s| s.id).collect();
        let mut wal_keep_from = self.manifest.wal_start;
        let mut manifest_keep_from = self.manifest.generation;
        if let Some(prev) = &self.previous {
            keep.extend(prev.segments.iter().map(|s| s.id));
            wal_keep_from = wal_keep_from.min(prev.wal_start);
            manifest_keep_from = prev.generation;
        }
        let mut doomed: Vec<PathBuf> = Vec::new();
        let being_read = self.being_read.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        for path in self.fs.list_dir(&self.seg_dir).at(&self.seg_dir)? {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let temp = name.strip_suffix(".tmp");
            let base = temp.unwrap_or(name);
            let id =
                base.strip_suffix(".seg").or_else(|| base.strip_suffix(".idx")).and_then(|s| s.parse::<u64>().ok());
            // A job being written (flush or compaction) keeps its files,
            // finished or temp, until it installs them; a segment a lookup
            // is reading keeps its files until the lookup is done.
            let writing = id.is_some_and(|id| self.in_flight.contains(&id) || being_read.contains_key(&id));
            match (id, temp.is_some()) {
                _ if writing => {}
                (Some(id), false) if keep.contains(&id) => {}
                (Some(_), _) | (None, true) => doomed.push(path),
                (None, false) => {}
            }
        }
        for (seq, path) in wal::list(self.fs.as_ref(), &self.wal_dir)? {
            if seq < wal_keep_from {
                doomed.push(path);
            }
        }
        for (generation, path) in manifest::list(self.fs.as_ref(), &self.man_dir)? {
            if generation < manifest_keep_from {
                doomed.push(path);
            }
        }
        for path in self.fs.list_dir(&self.man_dir).at(&self.man_dir)? {
            if path.extension().and_then(|e| e.to_str()) == Some("tmp") {
                doomed.push(path);
            }
        }
        for (i, path) in doomed.iter().enumerate() {
            fsutil::remove_if_exists(self.fs.as_ref(), path)?;
            if i == 0 {
                failpoint::check("gc_mid_delete", self.crash_at())?;
            }
        }
        Ok(doomed.len())
    }

    /// Flushes the memtable and fsyncs everything; the next open replays
    /// nothing, unless a flush job was left out (then only fsyncs: that
    /// job's events are replayed from the WAL).
    pub fn close(mut self) -> Result<(), StorageError> {
        self.flush()
    }

    /// Test seam: drops the store as a crash would (no flush, no fsync), then
    /// simulates a power loss by truncating the active WAL file to its last
    /// fsynced length plus `unsynced_bytes_kept` of what followed (which may
    /// leave a torn frame). Sealed WAL files, segments and manifests are always
    /// fsynced before use, so they survive as they are.
    #[doc(hidden)]
    pub fn simulate_crash(self, unsynced_bytes_kept: u64) -> Result<(), StorageError> {
        let keep = self.wal.synced_len() + unsynced_bytes_kept.min(self.wal.unsynced_bytes());
        let path = self.wal.path().to_path_buf();
        let fs = Arc::clone(&self.fs);
        drop(self);
        fs.truncate(&path, keep).at(&path)
    }
}

/// One group of a version-2 segment a lookup reads, and which of the
/// lookup's events (indexes into what it asked) it may hold. Owns what the
/// read needs, so another thread can do it without the store.
struct GroupRead {
    /// Shared by the segment's reads: a storm plans hundreds a batch.
    path: Arc<Path>,
    index: Arc<SegmentIndex>,
    group: usize,
    asked: Vec<usize>,
}

/// A batch's conflict originals being looked up: planned under the
/// store's lock ([`UsageStore::plan_first_seen_many`]), its group reads
/// done without it ([`read`](Self::read)), and what they missed looked up
/// under it again ([`UsageStore::finish_first_seen_many`]). It owns what
/// its reads need, and the segments it reads are kept on disk until it is
/// dropped.
pub struct FirstSeenLookup {
    fs: Arc<dyn FileSystem>,
    partition: i32,
    wanted: Vec<(IdHash, i64)>,
    found: Vec<Option<StoredEvent>>,
    reads: Vec<GroupRead>,
    /// Events of `wanted` that an indexed segment's groups may hold.
    in_groups: Vec<usize>,
    /// Version-1 segments (by id) that may hold events of `wanted`: read
    /// whole, under the lock.
    unindexed: Vec<(u64, Vec<usize>)>,
    /// Events in no segment's first-seen range when planned.
    elsewhere: Vec<usize>,
    _reading: SegmentsBeingRead,
}

impl std::fmt::Debug for FirstSeenLookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FirstSeenLookup")
            .field("partition", &self.partition)
            .field("wanted", &self.wanted.len())
            .field("group_reads", &self.reads.len())
            .finish()
    }
}

impl FirstSeenLookup {
    /// Reads the planned groups (on several threads when there are many)
    /// and keeps what they hold of the events asked. Needs no lock: the
    /// segments are immutable and kept on disk while this lookup lives.
    pub fn read(&mut self, cores: ReadCores) -> Result<(), StorageError> {
        let reads = std::mem::take(&mut self.reads);
        let most = match cores {
            ReadCores::All => reader_cores(),
            ReadCores::BesideTheBatch => reader_cores().saturating_sub(1).max(1),
        };
        let threads = group_readers(reads.len()).min(most);
        let hits = read_groups_on(threads, self.fs.as_ref(), self.partition, &self.wanted, &reads)?;
        for (i, hit) in hits {
            self.found[i].get_or_insert(hit);
        }
        Ok(())
    }
}

/// The cores a [`FirstSeenLookup`]'s reads may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadCores {
    /// One per core, at most four: the batch waits for the reads.
    All,
    /// One core fewer, one at least: the batch's thread goes on beside
    /// the reads (`dedupd dedupe` writes and applies the batch meanwhile).
    BesideTheBatch,
}

/// The segments one [`FirstSeenLookup`] reads, counted in the store's
/// `being_read` while it lives.
struct SegmentsBeingRead {
    counts: Arc<std::sync::Mutex<HashMap<u64, usize>>>,
    ids: Vec<u64>,
}

impl SegmentsBeingRead {
    fn hold(counts: &Arc<std::sync::Mutex<HashMap<u64, usize>>>, ids: Vec<u64>) -> SegmentsBeingRead {
        let mut held = counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for id in &ids {
            *held.entry(*id).or_default() += 1;
        }
        SegmentsBeingRead { counts: Arc::clone(counts), ids }
    }
}

impl Drop for SegmentsBeingRead {
    fn drop(&mut self) {
        let mut held = self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for id in &self.ids {
            if let Some(n) = held.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    held.remove(id);
                }
            }
        }
    }
}

/// Reads the groups of `reads` in order (one positioned read each, its
/// columns decompressed once) and finds in each the events of `asked` it
/// may hold: (index into `asked`, event), in the order of `reads`. An event
/// several groups may hold is looked for only until one of them has it, and
/// a group whose events are all found is not read at all.
fn read_groups(
    fs: &dyn FileSystem,
    partition: i32,
    asked: &[(IdHash, i64)],
    reads: &[GroupRead],
) -> Result<Vec<(usize, StoredEvent)>, StorageError> {
    let mut hits = Vec::new();
    let mut found = HashSet::new();
    // Reads come in segment order: one open file serves a segment's run.
    let mut open: Option<(&Path, Box<dyn RangeReader + '_>)> = None;
    for r in reads {
        // A batch's events share one first-seen time, so its run spans
        // several groups and each of its originals has several candidates:
        // once every event a group was asked for is found, the rest of the
        // run is not read (most of a conflict storm's reads, before).
        if r.asked.iter().all(|i| found.contains(i)) {
            continue;
        }
        let group: &GroupEntry = &r.index.groups[r.group];
        let file = match open.take() {
            Some((path, file)) if path == &*r.path => file,
            _ => fs.open_ranges(&r.path).at(&r.path)?,
        };
        let file = &open.insert((&*r.path, file)).1;
        let image = segment::read_group(file.as_ref(), &r.path, group, r.asked.len() > 1)?;
        for &i in &r.asked {
            if found.contains(&i) {
                continue;
            }
            if let Some(row) = image.find_row(partition, &asked[i].0, asked[i].1)? {
                hits.push((i, image.read_row(row)?));
                found.insert(i);
            }
        }
    }
    Ok(hits)
}

/// Fewest group reads worth a second thread: a read is tens of
/// microseconds (mostly decompression); a thread's start, with the zstd
/// decompression context it then makes for itself, is less than one read.
const GROUP_READS_TO_SHARE: usize = 8;
/// Most threads one lookup's reads are spread over.
const MOST_GROUP_READERS: usize = 4;

/// How many threads a lookup's `reads` group reads are spread over (this
/// one included): one per [`GROUP_READS_TO_SHARE`] reads, at most one per
/// core. A conflict storm's batch reads a few groups per original, and on its
/// own thread that was most of the time the storm added to a batch.
fn group_readers(reads: usize) -> usize {
    let wanted = reads / GROUP_READS_TO_SHARE;
    if wanted > 1 {
        wanted.min(reader_cores())
    } else {
        1
    }
}

/// The cores a lookup's reads may use, at most [`MOST_GROUP_READERS`].
/// Asked of the system once: `available_parallelism` reads the affinity
/// mask and cgroup files, too slow to ask per lookup.
fn reader_cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get).min(MOST_GROUP_READERS)
    })
}

/// `reads` cut into at most `threads` runs of about equal length, each cut
/// only where no event is asked of groups on both sides. A part then reads
/// exactly the groups one thread would have read for its events (one found
/// early leaves its later candidates unread in the same part), so which
/// groups are read, and so which errors are met, never depends on the
/// number of threads. One run when no such cut exists.
fn parts_of(reads: &[GroupRead], threads: usize) -> Vec<&[GroupRead]> {
    let mut last_asked: HashMap<usize, usize> = HashMap::new();
    for (k, r) in reads.iter().enumerate() {
        for &i in &r.asked {
            last_asked.insert(i, k);
        }
    }
    let share = reads.len().div_ceil(threads.max(1));
    let mut parts = Vec::new();
    let (mut start, mut reach) = (0, 0);
    for (k, r) in reads.iter().enumerate() {
        reach = r.asked.iter().fold(reach, |reach, i| reach.max(last_asked[i]));
        if reach == k && k + 1 - start >= share && k + 1 < reads.len() && parts.len() + 1 < threads {
            parts.push(&reads[start..=k]);
            start = k + 1;
        }
    }
    parts.push(&reads[start..]);
    parts
}

/// [`read_groups`] on up to `threads` threads (this one included; 0 or 1:
/// this one alone), each taking one of [`parts_of`] `reads`; the others are
/// scoped threads. The caller need not hold the usage store's lock: a
/// [`FirstSeenLookup`] keeps the files on disk while it reads. A thread that cannot be started leaves its part to this
/// one; a panic in one is raised again here. Results keep the order of
/// `reads`, and hits and the first error are those of one thread.
fn read_groups_on(
    threads: usize,
    fs: &dyn FileSystem,
    partition: i32,
    asked: &[(IdHash, i64)],
    reads: &[GroupRead],
) -> Result<Vec<(usize, StoredEvent)>, StorageError> {
    let parts = parts_of(reads, threads);
    if parts.len() <= 1 {
        return read_groups(fs, partition, asked, reads);
    }
    std::thread::scope(|scope| {
        let mut parts = parts.into_iter();
        let mine = parts.next().unwrap_or_default();
        let others: Vec<_> = parts
            .map(|part| {
                let started = std::thread::Builder::new()
                    .name("dedupd-originals".into())
                    .spawn_scoped(scope, move || read_groups(fs, partition, asked, part));
                (part, started)
            })
            .collect();
        // Every part is read and every thread joined before any error is
        // returned, so a panic in one is raised with its own message (an
        // unjoined one would surface as the scope's generic panic), and the
        // first error in the order of `reads` is the answer, as on one thread.
        let mut results = vec![read_groups(fs, partition, asked, mine)];
        let mut panicked = None;
        for (part, started) in others {
            results.push(match started {
                Ok(handle) => match handle.join() {
                    Ok(result) => result,
                    Err(panic) => {
                        panicked.get_or_insert(panic);
                        Ok(Vec::new())
                    }
                },
                Err(_) => read_groups(fs, partition, asked, part),
            });
        }
        if let Some(panic) = panicked {
            std::panic::resume_unwind(panic);
        }
        let mut hits = Vec::new();
        for result in results {
            hits.extend(result?);
        }
        Ok(hits)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_can_move_to_a_blocking_thread() {
        fn is_send<T: Send>() {}
        is_send::<UsageStore>();
    }

    fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The real filesystem, counting reads (whole files and ranges) and
    /// the bytes they return; a range read at `fail_at` fails, one at
    /// `panic_at` panics.
    #[derive(Debug, Default)]
    struct CountingFs {
        reads: std::sync::atomic::AtomicUsize,
        opens: std::sync::atomic::AtomicUsize,
        bytes: std::sync::atomic::AtomicUsize,
        fail_at: std::sync::Mutex<Option<u64>>,
        panic_at: std::sync::Mutex<Option<u64>>,
    }

    impl FileSystem for CountingFs {
        fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
            RealFs.create_dir_all(dir)
        }
        fn is_dir(&self, path: &Path) -> bool {
            RealFs.is_dir(path)
        }
        fn is_file(&self, path: &Path) -> bool {
            RealFs.is_file(path)
        }
        fn list_dir(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
            RealFs.list_dir(dir)
        }
        fn file_len(&self, path: &Path) -> std::io::Result<u64> {
            RealFs.file_len(path)
        }
        fn read(&self, path: &Path) -> std::io::Result<Vec<u8>> {
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let bytes = RealFs.read(path)?;
            self.bytes.fetch_add(bytes.len(), std::sync::atomic::Ordering::SeqCst);
            Ok(bytes)
        }
        fn read_range(&self, path: &Path, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
            if *locked(&self.panic_at) == Some(offset) {
                panic!("the read at {offset} panics on purpose");
            }
            if *locked(&self.fail_at) == Some(offset) {
                return Err(std::io::Error::other("the read fails on purpose"));
            }
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.bytes.fetch_add(len, std::sync::atomic::Ordering::SeqCst);
            RealFs.read_range(path, offset, len)
        }
        fn open_ranges(&self, path: &Path) -> std::io::Result<Box<dyn RangeReader + '_>> {
            self.opens.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            RealFs.file_len(path)?;
            Ok(Box::new(CountingRanges { fs: self, path: path.to_path_buf() }))
        }
        fn write_file(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
            RealFs.write_file(path, bytes)
        }
        fn write_file_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
            RealFs.write_file_synced(path, bytes)
        }
        fn create_append(&self, path: &Path) -> std::io::Result<Box<dyn super::super::fs::AppendFile>> {
            RealFs.create_append(path)
        }
        fn truncate(&self, path: &Path, len: u64) -> std::io::Result<()> {
            RealFs.truncate(path, len)
        }
        fn sync_file(&self, path: &Path) -> std::io::Result<()> {
            RealFs.sync_file(path)
        }
        fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
            RealFs.sync_dir(dir)
        }
        fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
            RealFs.rename(from, to)
        }
        fn remove_file(&self, path: &Path) -> std::io::Result<()> {
            RealFs.remove_file(path)
        }
    }

    /// A file of [`CountingFs`] opened once, each read counted as a range read.
    struct CountingRanges<'a> {
        fs: &'a CountingFs,
        path: PathBuf,
    }

    impl RangeReader for CountingRanges<'_> {
        fn read_range(&self, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
            self.fs.read_range(&self.path, offset, len)
        }
    }

    #[test]
    fn a_conflicts_original_is_read_from_the_one_segment_of_its_first_seen_time() {
        use crate::storage::testutil::sample_event_at;
        let dir = tempfile::tempdir().expect("tmp");
        let fs = Arc::new(CountingFs::default());
        // Twenty segments of ten events, each segment a minute apart.
        let opts = StoreOptions {
            memtable_max_events: 10,
            compaction_min_segments: usize::MAX,
            retention_ms: i64::MAX / 4,
            ..StoreOptions::default()
        };
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let (mut store, _) = UsageStore::open_on(fs.clone(), dir.path(), opts, observer).expect("open");
        let minute = 60_000;
        let mut events = Vec::new();
        for seg in 0..20u64 {
            let batch: Vec<StoredEvent> = (0..10u64)
                .map(|i| {
                    let n = seg * 10 + i;
                    sample_event_at(n, 0, n as i64, 1_700_000_000_000 + seg as i64 * minute + i as i64)
                })
                .collect();
            store.append(&batch).expect("append");
            store.flush().expect("flush");
            events.extend(batch);
        }
        assert_eq!(store.segments().len(), 20);
        let late = &events[187];
        let reads = |f: &dyn Fn() -> Option<StoredEvent>| {
            let before = fs.reads.load(std::sync::atomic::Ordering::SeqCst);
            let found = f();
            (found, fs.reads.load(std::sync::atomic::Ordering::SeqCst) - before)
        };
        let (found, n) = reads(&|| store.get_first_seen(0, &late.key.id_hash, late.key.first_seen_ms).expect("lookup"));
        assert_eq!(found.as_ref().map(|e| &e.event), Some(&late.event));
        assert_eq!(n, 4, "the segment's header, trailer and index, then its one group: not a scan of the history");
        let (found, n) = reads(&|| {
            store.get_first_seen(0, &events[181].key.id_hash, events[181].key.first_seen_ms).expect("lookup")
        });
        assert_eq!(found.as_ref().map(|e| &e.event), Some(&events[181].event));
        assert_eq!(n, 1, "the index is kept: one read of the group");
        // The full scan `inspect` uses reads every sidecar up to the hit.
        let (scanned, n) = reads(&|| store.get(Some(0), &late.key.id_hash).expect("lookup"));
        assert_eq!(scanned.map(|e| e.event), Some(late.event.clone()));
        assert!(n > 10, "{n}");
        // Every row reads back whole from its segment alone (optional fields,
        // corrections, dimensions before and at the row all vary).
        for e in &events {
            let got = store.get_first_seen(0, &e.key.id_hash, e.key.first_seen_ms).expect("lookup");
            assert_eq!(got.as_ref(), Some(e));
        }
        // Another partition, or a time no segment covers: nothing, cheaply.
        assert!(store.get_first_seen(1, &late.key.id_hash, late.key.first_seen_ms).expect("lookup").is_none());
        let (none, n) = reads(&|| store.get_first_seen(0, &late.key.id_hash, 1).expect("lookup"));
        assert!(none.is_none());
        assert_eq!(n, 0);

        // A batch's originals at once: the same answers as one at a time, in
        // the order asked, and each segment read once however many it holds.
        let mut memtable_event = sample_event_at(999, 0, 999, 1_700_000_000_000 + 30 * minute);
        memtable_event.event.event_id = "in-the-memtable".into();
        memtable_event.key.id_hash = crate::event::id_hash(&memtable_event.event.tenant_id, "in-the-memtable");
        store.append(std::slice::from_ref(&memtable_event)).expect("append");
        let mut wanted: Vec<(IdHash, i64)> =
            events[180..190].iter().map(|e| (e.key.id_hash, e.key.first_seen_ms)).collect();
        wanted.push((events[3].key.id_hash, events[3].key.first_seen_ms));
        wanted.push((events[185].key.id_hash, events[185].key.first_seen_ms)); // asked twice
        wanted.push((memtable_event.key.id_hash, memtable_event.key.first_seen_ms));
        wanted.push((IdHash([7; 16]), late.key.first_seen_ms)); // unknown id, in a segment's range
        wanted.push((late.key.id_hash, 1)); // a time no segment covers
        let one_at_a_time: Vec<Option<StoredEvent>> =
            wanted.iter().map(|(id, t)| store.get_first_seen(0, id, *t).expect("lookup")).collect();
        let (many, n) = {
            let before = fs.reads.load(std::sync::atomic::Ordering::SeqCst);
            let many = store.get_first_seen_many(0, &wanted).expect("lookup");
            (many, fs.reads.load(std::sync::atomic::Ordering::SeqCst) - before)
        };
        assert_eq!(many, one_at_a_time);
        assert_eq!(many[12].as_ref(), Some(&memtable_event));
        assert!(many[13].is_none() && many[14].is_none());
        // Segment 18 (ten originals and the unknown id) and segment 0: one
        // group each (their indexes are kept), plus the unknown id's retry
        // of its one candidate group.
        assert_eq!(n, 3, "one read of each group, not one per original");
        assert!(store.get_first_seen_many(1, &wanted).expect("lookup").iter().all(Option::is_none));
        // Every row of every segment at once, through the kept columns and
        // their indexes: each reads back whole.
        let all: Vec<(IdHash, i64)> = events.iter().map(|e| (e.key.id_hash, e.key.first_seen_ms)).collect();
        let got = store.get_first_seen_many(0, &all).expect("lookup");
        assert_eq!(got, events.iter().cloned().map(Some).collect::<Vec<_>>());
    }

    /// A batch's originals are planned under the store's lock and read
    /// without it: a flush and a compaction may come between, and then
    /// the segments planned are still read (garbage collection leaves them
    /// until the lookup is done) and an original a flush moved out of the
    /// memtable is found where it went. The compaction also drops the two
    /// planned segments past retention, so only the lookup's own reads of
    /// their kept files can answer for them.
    #[test]
    fn a_lookup_reads_what_it_planned_though_a_compaction_replaced_it() {
        use crate::storage::testutil::sample_event_at;
        let dir = tempfile::tempdir().expect("tmp");
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let (mut store, _) = UsageStore::open_on(Arc::new(RealFs), dir.path(), jobs_options(), observer).expect("open");
        let t0 = 1_700_000_000_000;
        let minute = 60_000;
        // Three segments of ten, a minute apart, and five in the memtable.
        let events: Vec<StoredEvent> =
            (0..35u64).map(|n| sample_event_at(n, 0, n as i64, t0 + (n / 10) as i64 * minute)).collect();
        let flush = |store: &mut UsageStore| {
            let mut job = store.start_flush().expect("start").expect("a flush");
            job.write();
            store.finish_flush(job).expect("finish");
        };
        for chunk in events[..30].chunks(10) {
            store.append(chunk).expect("append");
            flush(&mut store);
        }
        store.append(&events[30..]).expect("append");
        let planned: Vec<u64> = store.segments().iter().map(|s| s.id).collect();
        let wanted: Vec<(IdHash, i64)> =
            [3usize, 14, 32].iter().map(|&i| (events[i].key.id_hash, events[i].key.first_seen_ms)).collect();
        let mut lookup = store.plan_first_seen_many(0, &wanted).expect("plan");

        // The memtable becomes a segment; with a minute's retention the
        // first two segments expire and the last two merge; a third
        // manifest leaves the replaced segments in neither of the two
        // garbage collection keeps.
        flush(&mut store);
        store.opts.retention_ms = minute;
        let mut job = store.start_compaction(t0 + 3 * minute - 1).expect("plan").expect("a compaction");
        job.run();
        store.finish_compaction(job).expect("install");
        store.append(&[sample_event_at(99, 0, 99, t0 + 9 * minute)]).expect("append");
        flush(&mut store);
        assert!(store.segments().iter().all(|s| !planned.contains(&s.id)), "{:?}", store.segments());
        let seg_dir = store.seg_dir.clone();
        let on_disk = |id: u64| segment::segment_path(&seg_dir, id).exists();
        // Segments 1 and 2 hold the planned groups; segment 3 was not to be read.
        assert!(on_disk(planned[0]) && on_disk(planned[1]), "a planned segment was removed under the lookup");
        assert!(!on_disk(planned[2]));

        lookup.read(ReadCores::All).expect("read without the lock");
        let found = store.finish_first_seen_many(lookup).expect("finish");
        let expected: Vec<Option<StoredEvent>> = [3usize, 14, 32].iter().map(|&i| Some(events[i].clone())).collect();
        assert_eq!(found, expected);
        // Done with them, the lookup lets the next collection take them.
        store.collect_garbage().expect("collect");
        assert!(!on_disk(planned[0]) && !on_disk(planned[1]));
        assert_verifies(dir.path());
    }

    /// A version-1 segment, which a lookup reads whole under the lock at
    /// its finish, may be merged away between the plan and the finish: its
    /// originals are then found where the merge put them.
    #[test]
    fn an_original_in_a_version_1_segment_merged_before_the_lookup_finishes_is_found() {
        let dir = tempfile::tempdir().expect("tmp");
        let (store, events) = segments_of(dir.path(), &jobs_options(), 2, 10);
        let planned: Vec<SegmentMeta> = store.segments().to_vec();
        drop(store);
        // The same rows as version-1 files (what dedupd wrote before row
        // groups), under the same sidecars.
        for (meta, rows) in planned.iter().zip(events.chunks(10)) {
            let refs: Vec<&StoredEvent> = rows.iter().collect();
            let (v1, _, _) = segment::encode_image(&refs).expect("encode");
            std::fs::write(segment::segment_path(&dir.path().join("segments"), meta.id), v1).expect("write v1");
        }
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let (mut store, _) = UsageStore::open_on(Arc::new(RealFs), dir.path(), jobs_options(), observer).expect("open");
        let wanted: Vec<(IdHash, i64)> =
            [2usize, 15].iter().map(|&i| (events[i].key.id_hash, events[i].key.first_seen_ms)).collect();
        let mut lookup = store.plan_first_seen_many(0, &wanted).expect("plan");
        assert_eq!(lookup.unindexed.len(), 2, "both segments are read whole, at the finish");
        let mut job = store.start_compaction(events[0].key.first_seen_ms).expect("plan").expect("the two merge");
        job.run();
        store.finish_compaction(job).expect("install");
        assert!(store.segments().iter().all(|s| planned.iter().all(|p| p.id != s.id)), "{:?}", store.segments());
        lookup.read(ReadCores::All).expect("read");
        let found = store.finish_first_seen_many(lookup).expect("finish");
        assert_eq!(found, vec![Some(events[2].clone()), Some(events[15].clone())]);
    }

    /// A conflict's original in a large segment costs one group, not the
    /// file; a version-1 file left by an older dedupd is still found (its
    /// sidecar and the whole file, as before) until compaction rewrites it.
    #[test]
    fn an_original_in_a_large_segment_reads_one_group_and_version_1_files_still_answer() {
        let dir = tempfile::tempdir().expect("tmp");
        let fs = Arc::new(CountingFs::default());
        let (store, events) = one_large_segment(fs.clone(), dir.path(), 5_000);
        let meta = store.segments()[0];
        let file_len = std::fs::metadata(segment::segment_path(&store.seg_dir, meta.id)).expect("stat").len() as usize;
        let bytes = |f: &dyn Fn() -> Vec<Option<StoredEvent>>| {
            let before = fs.bytes.load(std::sync::atomic::Ordering::SeqCst);
            let found = f();
            (found, fs.bytes.load(std::sync::atomic::Ordering::SeqCst) - before)
        };
        let wanted: Vec<(IdHash, i64)> =
            [4_321usize, 4_322, 4_400].iter().map(|&i| (events[i].key.id_hash, events[i].key.first_seen_ms)).collect();
        let (found, read) = bytes(&|| store.get_first_seen_many(0, &wanted).expect("lookup"));
        assert_eq!(found, [4_321usize, 4_322, 4_400].iter().map(|&i| Some(events[i].clone())).collect::<Vec<_>>());
        assert!(read * 5 < file_len, "read {read} bytes of a {file_len}-byte segment for three originals of one group");

        // The same rows as a version-1 file (what dedupd wrote before row
        // groups), under the same sidecar.
        let refs: Vec<&StoredEvent> = events.iter().collect();
        let (v1, _, _) = segment::encode_image(&refs).expect("encode");
        drop(store);
        std::fs::write(segment::segment_path(&dir.path().join("segments"), meta.id), v1).expect("write v1");
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let (store, _) = UsageStore::open_on(fs.clone(), dir.path(), one_segment_options(), observer).expect("open");
        assert_eq!(store.get_first_seen_many(0, &wanted).expect("lookup"), found);
        let e = &events[17];
        assert_eq!(store.get_first_seen(0, &e.key.id_hash, e.key.first_seen_ms).expect("lookup").as_ref(), Some(e));
        assert_eq!(every_event(&store), events);
        drop(store);
        assert_verifies(dir.path());
    }

    /// A batch's originals over many groups, read on one to four threads:
    /// the same events in the same order, each found once, the absent ones
    /// and the other partition's not at all; and the store's own lookup
    /// (which spreads them over this machine's cores) answers as one at a
    /// time does.
    #[test]
    fn originals_read_on_several_threads_are_those_one_thread_finds() {
        let dir = tempfile::tempdir().expect("tmp");
        let (store, events) = one_large_segment(Arc::new(RealFs), dir.path(), 6_000);
        let t0 = events[0].key.first_seen_ms;
        // Every seventeenth event, two unknown ids inside the segment's
        // range, one event asked twice. First-seen times are distinct and
        // groups do not overlap, so each event is in one group and every
        // split finds it once: the results must be equal as lists.
        let mut wanted: Vec<(IdHash, i64)> =
            events.iter().step_by(17).map(|e| (e.key.id_hash, e.key.first_seen_ms)).collect();
        wanted.push((IdHash([9; 16]), t0 + 100));
        wanted.push((IdHash([8; 16]), t0 + 5_900));
        wanted.push(wanted[3]);
        let meta = store.segments()[0];
        let index = store.segment_index(&meta).expect("index").expect("a version-2 segment");
        let reads = store.group_reads(&meta, &index, &wanted, 0..wanted.len());
        assert!(reads.len() >= 20, "the originals span {} groups", reads.len());
        let one = read_groups_on(1, &RealFs, 0, &wanted, &reads).expect("read");
        assert_eq!(one.len(), wanted.len() - 2, "every known original once");
        for threads in 2..=4 {
            assert_eq!(read_groups_on(threads, &RealFs, 0, &wanted, &reads).expect("read"), one, "{threads} threads");
        }
        assert!(read_groups_on(3, &RealFs, 1, &wanted, &reads).expect("read").is_empty());
        let one_at_a_time: Vec<Option<StoredEvent>> =
            wanted.iter().map(|(id, t)| store.get_first_seen(0, id, *t).expect("lookup")).collect();
        assert_eq!(store.get_first_seen_many(0, &wanted).expect("lookup"), one_at_a_time);
    }

    /// A batch's thousand events share one first-seen time and span four
    /// groups: an original is looked for group by group and the groups
    /// after the one holding it are not read.
    #[test]
    fn an_original_found_in_one_group_of_its_batch_leaves_the_others_unread() {
        let dir = tempfile::tempdir().expect("tmp");
        let fs = Arc::new(CountingFs::default());
        let (store, mut batches) = batches_of_a_thousand(fs.clone(), dir.path(), 1);
        let events = batches.remove(0);
        let t0 = events[0].key.first_seen_ms;
        let meta = store.segments()[0];
        let index = store.segment_index(&meta).expect("index").expect("a version-2 segment");
        assert_eq!(index.groups_holding(t0).len(), 4);
        let group_reads = |k: usize| {
            let before = fs.reads.load(std::sync::atomic::Ordering::SeqCst);
            let found = store.get_first_seen_many(0, &[(events[k].key.id_hash, t0)]).expect("lookup");
            assert_eq!(found, vec![Some(events[k].clone())], "event {k}");
            fs.reads.load(std::sync::atomic::Ordering::SeqCst) - before
        };
        assert_eq!(group_reads(10), 1, "the first group holds it");
        assert_eq!(group_reads(300), 2);
        let opened = fs.opens.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(group_reads(990), 4, "the last group holds it");
        assert_eq!(
            fs.opens.load(std::sync::atomic::Ordering::SeqCst) - opened,
            1,
            "one open for the segment's four reads"
        );
        // Two originals in the first and third groups: three groups read,
        // the fourth not.
        let before = fs.reads.load(std::sync::atomic::Ordering::SeqCst);
        let wanted = [(events[600].key.id_hash, t0), (events[5].key.id_hash, t0)];
        let found = store.get_first_seen_many(0, &wanted).expect("lookup");
        assert_eq!(found, vec![Some(events[600].clone()), Some(events[5].clone())]);
        assert_eq!(fs.reads.load(std::sync::atomic::Ordering::SeqCst) - before, 3);
    }

    /// Ten batches of a thousand events, each its own segment of four
    /// groups, two originals asked of each (in its first and third group):
    /// whichever read fails, one to four threads give the answer one thread
    /// gives. A fourth group left unread on one thread (both originals found
    /// before it) is not read on several either, so its failure is no error
    /// on any number of threads, and a split never cuts a batch's run.
    #[test]
    fn which_read_fails_matters_the_same_on_any_number_of_threads() {
        let dir = tempfile::tempdir().expect("tmp");
        let fs = Arc::new(CountingFs::default());
        let (store, batches) = batches_of_a_thousand(fs.clone(), dir.path(), 10);
        let wanted: Vec<(IdHash, i64)> = batches
            .iter()
            .flat_map(|events| [10, 600].map(|k| (events[k].key.id_hash, events[k].key.first_seen_ms)))
            .collect();
        let mut reads = Vec::new();
        for (s, meta) in store.segments().iter().enumerate() {
            let index = store.segment_index(meta).expect("index").expect("a version-2 segment");
            reads.extend(store.group_reads(meta, &index, &wanted, [2 * s, 2 * s + 1]));
        }
        assert_eq!(reads.len(), 40);
        for (k, part) in parts_of(&reads, 4).iter().enumerate() {
            assert!(part.len() % 4 == 0 && !part.is_empty(), "part {k} cuts a batch's run: {} reads", part.len());
        }
        let answer = |threads: usize| match read_groups_on(threads, fs.as_ref(), 0, &wanted, &reads) {
            Ok(hits) => Ok(hits.into_iter().map(|(i, _)| i).collect::<Vec<_>>()),
            Err(e) => Err(e.to_string()),
        };
        for failing in &reads {
            *locked(&fs.fail_at) = Some(failing.index.groups[failing.group].offset);
            let on_one = answer(1);
            assert_eq!(on_one.is_ok(), failing.group == 3, "group {} of a batch", failing.group);
            for threads in 2..=4 {
                assert_eq!(answer(threads), on_one, "{threads} threads, group {} failing", failing.group);
            }
        }
    }

    /// One part of a lookup's reads fails while another thread's panics:
    /// every reader is joined before the error is looked at, so the panic
    /// comes back with its own message (not as the scope's "a scoped thread
    /// panicked"); without the panic, the first error is the answer.
    #[test]
    fn a_reader_threads_panic_comes_back_with_its_message_even_beside_an_error() {
        let dir = tempfile::tempdir().expect("tmp");
        let fs = Arc::new(CountingFs::default());
        let (store, events) = one_large_segment(fs.clone(), dir.path(), 6_000);
        let wanted: Vec<(IdHash, i64)> =
            events.iter().step_by(17).map(|e| (e.key.id_hash, e.key.first_seen_ms)).collect();
        let meta = store.segments()[0];
        let index = store.segment_index(&meta).expect("index").expect("a version-2 segment");
        let reads = store.group_reads(&meta, &index, &wanted, 0..wanted.len());
        let offset = |r: &GroupRead| r.index.groups[r.group].offset;
        *locked(&fs.fail_at) = reads.first().map(offset);
        *locked(&fs.panic_at) = reads.last().map(offset);
        let on_two = || read_groups_on(2, fs.as_ref(), 0, &wanted, &reads);
        let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(on_two)).expect_err("a panic");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        assert!(message.contains("panics on purpose"), "{message}");
        *locked(&fs.panic_at) = None;
        let err = on_two().expect_err("the failed read");
        assert!(err.to_string().contains("fails on purpose"), "{err}");
    }

    /// A store on `fs` in `dir` of `batches` segments, each one batch of a
    /// thousand sample events of partition 0 sharing a first-seen time
    /// (`1_700_000_000_000 + b` for batch `b`), as a worker's batch is
    /// stored; and each batch's events.
    fn batches_of_a_thousand(fs: Arc<dyn FileSystem>, dir: &Path, batches: u64) -> (UsageStore, Vec<Vec<StoredEvent>>) {
        use crate::storage::testutil::sample_event_at;
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let (mut store, _) = UsageStore::open_on(fs, dir, one_segment_options(), observer).expect("open");
        let t0 = 1_700_000_000_000;
        let batches = (0..batches)
            .map(|b| {
                let events: Vec<StoredEvent> = (0..1_000)
                    .map(|k| sample_event_at(b * 1_000 + k, 0, (b * 1_000 + k) as i64, t0 + b as i64))
                    .collect();
                store.append(&events).expect("append");
                store.flush().expect("flush");
                events
            })
            .collect();
        (store, batches)
    }

    /// Options under which what is appended stays in the memtable until a
    /// flush is asked for, and segments are never merged or aged out.
    fn one_segment_options() -> StoreOptions {
        StoreOptions {
            memtable_max_events: usize::MAX,
            compaction_min_segments: usize::MAX,
            retention_ms: i64::MAX / 4,
            ..StoreOptions::default()
        }
    }

    /// A store on `fs` in `dir` whose one segment holds sample events
    /// `0..n` of partition 0, event `k` at output offset `k`, first seen
    /// `k` ms after 1_700_000_000_000.
    fn one_large_segment(fs: Arc<dyn FileSystem>, dir: &Path, n: u64) -> (UsageStore, Vec<StoredEvent>) {
        use crate::storage::testutil::sample_event_at;
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let (mut store, _) = UsageStore::open_on(fs, dir, one_segment_options(), observer).expect("open");
        let t0 = 1_700_000_000_000;
        let events: Vec<StoredEvent> = (0..n).map(|k| sample_event_at(k, 0, k as i64, t0 + k as i64)).collect();
        store.append(&events).expect("append");
        store.flush().expect("flush");
        (store, events)
    }

    /// Every stored event, oldest first.
    fn every_event(store: &UsageStore) -> Vec<StoredEvent> {
        let mut all = Vec::new();
        store.for_each_event(|e| all.push(e.clone())).expect("scan");
        all
    }

    /// `dedupd verify` finds nothing wrong in the store at `dir`.
    fn assert_verifies(dir: &Path) {
        let report = crate::storage::verify(dir).expect("verify");
        assert!(report.is_clean(), "{report:?}");
    }

    /// A store at `dir` holding `segments` flushed segments of `rows`
    /// events each (first seen 1_700_000_000_000 + n), and those events.
    fn segments_of(dir: &Path, opts: &StoreOptions, segments: u64, rows: u64) -> (UsageStore, Vec<StoredEvent>) {
        use crate::storage::testutil::sample_event;
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let (mut store, _) = UsageStore::open_on(Arc::new(RealFs), dir, opts.clone(), observer).expect("open");
        let events: Vec<StoredEvent> = (0..segments * rows).map(|n| sample_event(n, 0, n as i64)).collect();
        for chunk in events.chunks(rows as usize) {
            store.append(chunk).expect("append");
            let mut job = store.start_flush().expect("start").expect("a flush");
            job.write();
            store.finish_flush(job).expect("finish");
        }
        (store, events)
    }

    /// Each group of the segment at `path`, as stored.
    fn group_images(path: &Path) -> Vec<Vec<u8>> {
        let bytes = std::fs::read(path).expect("read");
        let index = segment::read_index(&RealFs, path).expect("index").expect("version 2");
        index.groups.iter().map(|g| bytes[g.offset as usize..(g.offset + u64::from(g.len)) as usize].to_vec()).collect()
    }

    /// Compaction copies the groups of its inputs as they are stored
    /// (their rows are never decoded and encoded again) when every row
    /// stays; across a retention cutoff it drops exactly the rows first
    /// seen before it, whichever group they are in, and what it writes
    /// reads back and verifies.
    #[test]
    fn a_compaction_copies_its_inputs_groups_as_stored_and_drops_exactly_the_expired_rows() {
        let rows = segment::GROUP_ROWS as u64 + 44;
        let opts = StoreOptions { memtable_max_events: usize::MAX, ..jobs_options() };
        let dir = tempfile::tempdir().expect("tmp");
        let (mut store, events) = segments_of(dir.path(), &opts, 4, rows);
        let seg_dir = dir.path().join("segments");
        let inputs: Vec<Vec<u8>> =
            store.segments().iter().flat_map(|m| group_images(&segment::segment_path(&seg_dir, m.id))).collect();
        assert_eq!(inputs.len(), 8, "each input is a full group and a short one");
        let mut job = store.start_compaction(1).expect("plan").expect("four small segments");
        job.run();
        let report = store.finish_compaction(job).expect("install");
        assert_eq!((report.compacted_segments, report.expired_rows), (4, 0), "{report:?}");
        let merged = segment::segment_path(&seg_dir, report.compacted_into.expect("merged"));
        let merged = group_images(&merged);
        assert_eq!(merged.len(), inputs.len(), "a group for each input group");
        assert!(merged == inputs, "the merged segment is its inputs' groups, byte for byte");
        assert_eq!(every_event(&store), events);
        drop(store);
        assert_verifies(dir.path());

        // Cutoffs inside a full group, on a group's edge, inside a short
        // group, and past a whole input (which then expires unread).
        let first_seen = |n: u64| events[n as usize].key.first_seen_ms;
        for cut in [100, segment::GROUP_ROWS as u64, rows - 10, rows + 3, 2 * rows + 1] {
            let retention = StoreOptions { retention_ms: 1_000, ..opts.clone() };
            let dir = tempfile::tempdir().expect("tmp");
            let (mut store, events) = segments_of(dir.path(), &retention, 4, rows);
            let mut job = store.start_compaction(first_seen(cut) + 1_000).expect("plan").expect("a compaction");
            job.run();
            let report = store.finish_compaction(job).expect("install");
            assert_eq!(report.expired_rows, cut, "cut at {cut}: {report:?}");
            assert_eq!(every_event(&store), events[cut as usize..], "cut at {cut}");
            drop(store);
            assert_verifies(dir.path());
        }
    }

    /// An input compaction cannot trust leaves that input where it is,
    /// reported, and none of its rows in the merged segment: a damaged
    /// column in a group it would copy as stored (a column no key read
    /// touches), the same in a group it would skip as past retention, and
    /// a group whose footer (checksummed, and matching the index) says a
    /// first-seen range its rows do not have.
    #[test]
    fn a_compaction_leaves_an_input_it_cannot_trust_in_place_and_out_of_the_merge() {
        let rows = segment::GROUP_ROWS as u64 + 44;
        // Group 0 of the segment at `path`: where its image ends.
        let group_end = |path: &Path| {
            let g = segment::read_index(&RealFs, path).expect("index").expect("version 2").groups[0];
            (g.offset + u64::from(g.len)) as usize
        };
        // Footers are 510 bytes here (22 columns), before a 12-byte trailer.
        let footer_at = |end: usize| end - 12 - 510;
        let damage_last_column = |path: &Path| {
            let mut bytes = std::fs::read(path).expect("read");
            bytes[footer_at(group_end(path)) - 1] ^= 0x40;
            std::fs::write(path, &bytes).expect("write");
        };
        let shift_first_seen_min = |path: &Path| {
            let end = group_end(path);
            let mut bytes = std::fs::read(path).expect("read");
            let f = footer_at(end);
            let min = i64::from_le_bytes(bytes[f + 8..f + 16].try_into().expect("8 bytes")) + 1;
            bytes[f + 8..f + 16].copy_from_slice(&min.to_le_bytes());
            let crc = crc32c::crc32c(&bytes[f..end - 12]);
            bytes[end - 8..end - 4].copy_from_slice(&crc.to_le_bytes());
            let t = bytes.len() - 12;
            let at = t - u32::from_le_bytes(bytes[t..t + 4].try_into().expect("4 bytes")) as usize;
            bytes[at + 28 + 16..at + 28 + 24].copy_from_slice(&min.to_le_bytes());
            let crc = crc32c::crc32c(&bytes[at..t]);
            bytes[t + 4..t + 8].copy_from_slice(&crc.to_le_bytes());
            std::fs::write(path, &bytes).expect("write");
        };
        type Damage<'a> = &'a dyn Fn(&Path);
        // (case, damage to segment 1, the first row kept by retention)
        let cases: [(&str, Damage<'_>, u64); 3] = [
            ("a copied group's column", &damage_last_column, 0),
            ("an expired group's column", &damage_last_column, rows + segment::GROUP_ROWS as u64),
            ("a footer's first-seen range", &shift_first_seen_min, 0),
        ];
        for (case, damage, kept_from) in cases {
            let opts = StoreOptions { memtable_max_events: usize::MAX, retention_ms: 1_000, ..jobs_options() };
            let dir = tempfile::tempdir().expect("tmp");
            let (mut store, events) = segments_of(dir.path(), &opts, 4, rows);
            let seg_dir = dir.path().join("segments");
            let damaged = segment::segment_path(&seg_dir, store.segments()[1].id);
            damage(&damaged);
            let now = events[kept_from as usize].key.first_seen_ms + 1_000;
            let mut job = store.start_compaction(now).expect("plan").expect("a compaction");
            job.run();
            let report = store.finish_compaction(job).expect("install");
            assert_eq!(report.corrupt_segments, vec![damaged.clone()], "{case}");
            assert!(damaged.exists(), "{case}: the input stays where it is");
            let merged =
                Segment::open(&RealFs, &segment::segment_path(&seg_dir, report.compacted_into.expect("merged")))
                    .expect("open merged")
                    .read_all()
                    .expect("read merged");
            let r = rows as usize;
            let expected: Vec<StoredEvent> = events[..r]
                .iter()
                .chain(&events[2 * r..])
                .filter(|e| e.key.first_seen_ms >= now - 1_000)
                .cloned()
                .collect();
            assert_eq!(merged, expected, "{case}");
        }
    }

    /// Segments of a few rows each (small flushes) merge into full groups,
    /// not into one short group per input.
    #[test]
    fn a_compaction_packs_small_segments_rows_into_full_groups() {
        let opts = StoreOptions { memtable_max_events: usize::MAX, ..jobs_options() };
        let dir = tempfile::tempdir().expect("tmp");
        let (mut store, events) = segments_of(dir.path(), &opts, 8, 40);
        let mut job = store.start_compaction(1).expect("plan").expect("eight small segments");
        job.run();
        let report = store.finish_compaction(job).expect("install");
        assert_eq!(report.compacted_segments, 8, "{report:?}");
        let merged = segment::segment_path(&dir.path().join("segments"), report.compacted_into.expect("merged"));
        let index = segment::read_index(&RealFs, &merged).expect("index").expect("version 2");
        let group_rows: Vec<u32> = index.groups.iter().map(|g| g.rows).collect();
        assert_eq!(group_rows, [segment::GROUP_ROWS as u32, 320 - segment::GROUP_ROWS as u32]);
        assert_eq!(every_event(&store), events);
        drop(store);
        assert_verifies(dir.path());
    }

    /// Small memtables, flushes and compactions left to jobs, nothing
    /// past retention.
    fn jobs_options() -> StoreOptions {
        StoreOptions {
            memtable_max_events: 10,
            write_in_background: true,
            compaction_min_segments: 2,
            compaction_target_rows: 1_000,
            retention_ms: i64::MAX / 4,
            ..StoreOptions::default()
        }
    }

    /// What the ledger catches up from at open: every event of the asked
    /// partitions above their offsets, from the segments at or past a
    /// recorded id and the memtable, in output order, even after a
    /// compaction put newer events in a segment placed before older ones.
    /// Segments below the id are not read; ids a crash lost are not taken
    /// again once skipped past.
    #[test]
    fn stored_after_reads_the_memtable_and_the_segments_from_an_id_on() {
        use crate::storage::testutil::sample_event;
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let dir = tempfile::tempdir().expect("tmp");
        let (mut store, _) =
            UsageStore::open_on(Arc::new(RealFs), dir.path(), jobs_options(), observer.clone()).expect("open");
        let events: Vec<StoredEvent> = (0..45u64).map(|n| sample_event(n, (n % 3) as i32, (n / 3) as i64)).collect();
        let flush = |store: &mut UsageStore| {
            let job = store.start_flush().expect("start").expect("a job");
            store.finish_flush(job).expect("finish");
        };
        // Segment 1 (small) and 2 (large), then the id the ledger would
        // record, then segment 3 (small) and 4 (large), and five events left
        // in the memtable. Upkeep merges the small ones into segment 5,
        // placed where segment 1 was: before segment 2, whose events are
        // older than segment 3's.
        for range in [0..5, 5..20] {
            store.append(&events[range]).expect("append");
            flush(&mut store);
        }
        let recorded = store.next_segment_id();
        for range in [20..27, 27..40] {
            store.append(&events[range]).expect("append");
            flush(&mut store);
        }
        store.append(&events[40..]).expect("append");
        store.opts.compaction_target_rows = 9;
        let mut job = store.start_compaction(1).expect("plan").expect("the small segments merge");
        job.run();
        store.finish_compaction(job).expect("install");
        store.opts.compaction_target_rows = 1_000;
        let ids: Vec<u64> = store.segments().iter().map(|s| s.id).collect();
        assert_eq!(ids, [5, 2, 4], "the merged segment takes the oldest input's place");
        // Partition 1 above offset 6; partition 2 whole, as far as the
        // segments read hold it: segment 2 is below the recorded id and not
        // read, segment 5 is read whole (segment 1's events with it).
        // Partition 0 is not asked for.
        let after = BTreeMap::from([(1, Some(6)), (2, None)]);
        let found = store.stored_after(recorded, &after).expect("read");
        let of = |p: i32, above: i64, from: &[StoredEvent]| -> Vec<StoredEvent> {
            from.iter().filter(|e| e.key.output.partition == p && e.key.output.offset > above).cloned().collect()
        };
        assert_eq!(found.keys().copied().collect::<Vec<_>>(), [1, 2]);
        assert_eq!(found[&1], of(1, 6, &events[20..]));
        assert_eq!(found[&2], [of(2, -1, &events[..5]), of(2, -1, &events[20..])].concat());
        // From the first segment on, partition 1 gets every event above 6.
        let all = store.stored_after(0, &BTreeMap::from([(1, Some(6))])).expect("read");
        let whole: Vec<StoredEvent> =
            events.iter().filter(|e| e.key.output.partition == 1 && e.key.output.offset > 6).cloned().collect();
        assert_eq!(all[&1], whole);
        // Ids taken after the last manifest are lost with the process:
        // a skip keeps the next segment at or past a recorded id.
        let taken = store.take_segment_id();
        drop(store);
        let (mut store, _) = UsageStore::open_on(Arc::new(RealFs), dir.path(), jobs_options(), observer).expect("open");
        assert!(store.next_segment_id() <= taken, "the id taken before the crash is not in the manifest");
        let marks = store.marks();
        store.skip_segment_ids_to(taken + 1);
        assert_eq!(marks.next_segment_id(), taken + 1, "the ledger reads the skip without the lock");
        flush(&mut store);
        assert_eq!(store.segments().last().map(|s| s.id), Some(taken + 1));
    }

    /// A flush written without the store's lock: appends go on into a
    /// fresh memtable, every frozen event stays readable until the
    /// segment is installed, and a process death at any point of the job
    /// (frozen, written, or failed) loses nothing and doubles nothing on
    /// reopen.
    #[test]
    fn a_flush_written_beside_appends_keeps_every_event_readable_and_recoverable() {
        use crate::storage::testutil::sample_event;
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let opts = jobs_options();
        let all = every_event;
        // How the job ends: installed, the process dies before the install
        // (segment written or not), or the write fails.
        for ending in ["installed", "died_frozen", "died_written", "write_failed"] {
            let dir = tempfile::tempdir().expect("tmp");
            let mut opts = opts.clone();
            // Only the flush under test fails: the store is reopened with
            // this after the first two segments.
            if ending == "write_failed" {
                opts.crash_at = Some("flush_after_sidecar".into());
            }
            let plain = StoreOptions { crash_at: None, ..opts.clone() };
            let (mut store, _) =
                UsageStore::open_on(Arc::new(RealFs), dir.path(), plain.clone(), observer.clone()).expect("open");
            let events: Vec<StoredEvent> = (0..35u64).map(|n| sample_event(n, (n % 2) as i32, n as i64)).collect();
            // Two segments first, so upkeep has something it could merge.
            for chunk in events[..20].chunks(10) {
                store.append(chunk).expect("append");
                assert!(
                    store.flush_wanted(),
                    "{ending}: a full memtable asks for a flush, and the append did not do it"
                );
                let job = store.start_flush().expect("start").expect("a job");
                store.finish_flush(job).expect("finish");
            }
            assert_eq!(store.segments().len(), 2, "{ending}");
            drop(store);
            let (mut store, _) =
                UsageStore::open_on(Arc::new(RealFs), dir.path(), opts.clone(), observer.clone()).expect("open");
            store.append(&events[20..30]).expect("append");
            let mut job = store.start_flush().expect("start").expect("a job");
            assert_eq!(job.events(), 10);
            assert!(store.start_flush().expect("start").is_none(), "one flush at a time");
            assert!(!store.flush_wanted());
            // Appends go on while the job is out; every event reads back.
            store.append(&events[30..]).expect("append");
            assert_eq!(store.memtable_len(), 15);
            assert_eq!(all(&store), events, "{ending}: frozen events read as the memtable's");
            let e = &events[25];
            assert_eq!(
                store
                    .get_first_seen(e.key.output.partition, &e.key.id_hash, e.key.first_seen_ms)
                    .expect("get")
                    .as_ref(),
                Some(e)
            );
            assert_eq!(store.recent_keys(1, 0, usize::MAX).expect("keys").len(), 17);
            assert_eq!(
                store.unflushed_after(1, Some(23)).map(|v| v.len()),
                Some(5),
                "the frozen and the live memtable"
            );
            let report = store.maintain(i64::MAX / 8).expect("maintain");
            assert_eq!(report, MaintainReport::default(), "{ending}: upkeep leaves flushes and compactions to jobs");
            match ending {
                "installed" => {
                    job.write();
                    store.finish_flush(job).expect("finish");
                    assert_eq!(store.memtable_len(), 5);
                    assert_eq!(all(&store), events);
                    let mut compaction = store.start_compaction(1).expect("plan").expect("three small segments");
                    compaction.run();
                    let report = store.finish_compaction(compaction).expect("install");
                    assert_eq!(report.compacted_segments, 3, "the flushed segment merges with the rest");
                    assert_eq!(all(&store), events);
                    store.simulate_crash(0).expect("crash");
                }
                "died_frozen" => store.simulate_crash(0).expect("crash"),
                "died_written" => {
                    job.write();
                    store.simulate_crash(0).expect("crash");
                }
                _ => {
                    job.write();
                    let err = store.finish_flush(job).expect_err("a failed write");
                    assert!(matches!(err, StorageError::Failpoint { .. }), "{err}");
                    assert!(store.append(&events[..1]).is_err(), "the store is poisoned");
                    store.simulate_crash(0).expect("crash");
                }
            }
            let (store, recovery) =
                UsageStore::open_on(Arc::new(RealFs), dir.path(), plain, observer.clone()).expect("reopen");
            let mut got = all(&store);
            got.sort_by_key(|e| (e.key.output.offset, e.key.output.partition));
            assert_eq!(got, events, "{ending}: every acknowledged event once, after {recovery:?}");
            drop(store);
            let report = crate::storage::verify(dir.path()).expect("verify");
            assert!(report.is_clean(), "{ending}: {report:?}");
        }
    }

    /// A compaction merged without the store's lock while flushes come and
    /// go: a flush's garbage collection leaves the compaction's unfinished
    /// files alone, both install into the manifest, ids never collide, and
    /// the merge's working set stops at its byte bound.
    #[test]
    fn a_compaction_merged_beside_flushes_installs_and_keeps_to_its_memory_bound() {
        use crate::storage::testutil::sample_event;
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let opts = jobs_options();
        let dir = tempfile::tempdir().expect("tmp");
        let (mut store, _) =
            UsageStore::open_on(Arc::new(RealFs), dir.path(), opts.clone(), observer.clone()).expect("open");
        let events: Vec<StoredEvent> = (0..60u64).map(|n| sample_event(n, 0, n as i64)).collect();
        let flush = |store: &mut UsageStore, chunk: &[StoredEvent]| {
            store.append(chunk).expect("append");
            let mut job = store.start_flush().expect("start").expect("a flush");
            job.write();
            store.finish_flush(job).expect("finish");
        };
        for chunk in events[..40].chunks(10) {
            flush(&mut store, chunk);
        }
        assert_eq!(store.maintain(1).expect("maintain"), MaintainReport::default(), "upkeep leaves compaction to jobs");
        let mut compaction = store.start_compaction(1).expect("plan").expect("four small segments");
        assert!(store.start_compaction(1).expect("plan").is_none(), "one compaction at a time");
        compaction.run();
        // Two flushes install (each collecting garbage) while the merged
        // segment waits, written but in no manifest.
        for chunk in events[40..60].chunks(10) {
            flush(&mut store, chunk);
        }
        let report = store.finish_compaction(compaction).expect("install");
        assert_eq!(report.compacted_segments, 4);
        let ids: Vec<u64> = store.segments().iter().map(|m| m.id).collect();
        assert_eq!(ids.len(), 3, "the merged segment and the two flushed beside it: {ids:?}");
        assert_eq!(Some(ids[0]), report.compacted_into, "in the place of its oldest input");
        assert_eq!(every_event(&store), events);
        drop(store);
        assert_verifies(dir.path());

        // A bound of one byte: each merge takes two inputs, never more.
        let tight = StoreOptions { compaction_max_bytes: 1, ..opts };
        let (mut store, _) = UsageStore::open_on(Arc::new(RealFs), dir.path(), tight, observer).expect("reopen");
        let mut compaction = store.start_compaction(1).expect("plan").expect("three small segments");
        compaction.run();
        let report = store.finish_compaction(compaction).expect("install");
        assert_eq!(report.compacted_segments, 2, "{report:?}");
        assert_eq!(store.segments().len(), 2);
        assert_eq!(every_event(&store), events);
    }

    /// The group commit on the real filesystem: four partitions append
    /// from four threads and wait for their fsyncs without the store's
    /// lock, through WAL rotations and memtable flushes. Then a power loss
    /// (everything past the last fsync of the active WAL file cut off):
    /// every batch an append acknowledged is there after reopening, once.
    #[test]
    fn batches_acknowledged_by_a_shared_fsync_on_disk_survive_a_power_loss() {
        use crate::storage::testutil::sample_event;
        let dir = tempfile::tempdir().expect("tmp");
        let opts = StoreOptions {
            memtable_max_events: 40,
            wal_rotate_bytes: 8 << 10,
            fsync: super::super::FsyncPolicy::Always,
            ..StoreOptions::default()
        };
        let observer: Arc<dyn StorageObserver> = Arc::new(super::super::NoopObserver);
        let (store, _) =
            UsageStore::open_on(Arc::new(RealFs), dir.path(), opts.clone(), observer.clone()).expect("open");
        let store = std::sync::Mutex::new(store);
        let acknowledged: Vec<Vec<StoredEvent>> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4i32)
                .map(|p| {
                    let store = &store;
                    scope.spawn(move || {
                        let mut done = Vec::new();
                        for b in 0..25i64 {
                            let batch: Vec<StoredEvent> = (0..5i64)
                                .map(|i| sample_event((p as u64) * 1_000 + (b * 5 + i) as u64, p, b * 5 + i))
                                .collect();
                            let (n, pending) = store
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .append_deferred(batch.iter().collect::<Vec<_>>())
                                .expect("append");
                            assert_eq!(n, 5);
                            pending.expect("fsync always leaves the fsync to the caller").wait().expect("fsync");
                            done.extend(batch);
                        }
                        done
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().expect("thread")).collect()
        });
        let store = store.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
        assert!(store.segments().len() > 1, "the memtable moved into segments along the way");
        store.simulate_crash(0).expect("power loss");
        let (store, _) = UsageStore::open_on(Arc::new(RealFs), dir.path(), opts, observer).expect("reopen");
        for (p, events) in acknowledged.iter().enumerate() {
            let mut stored = Vec::new();
            store
                .for_each_event(|e| {
                    if e.key.output.partition == p as i32 {
                        stored.push(e.clone());
                    }
                })
                .expect("scan");
            let offsets = |v: &[StoredEvent]| v.iter().map(|e| e.key.output.offset).collect::<Vec<_>>();
            assert_eq!(offsets(&stored), offsets(events), "partition {p}: every acknowledged batch, once, in order");
            assert!(stored == *events, "partition {p}: the events read back as appended");
        }
    }
}
