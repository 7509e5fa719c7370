//! The durable usage store (DESIGN §7): every accepted, published event is
//! persisted here, and the hot cache is rebuilt from here after a restart.
//!
//! Synchronous and single-writer; no tokio, no rdkafka. Every file operation
//! goes through [`FileSystem`] ([`RealFs`] in `dedupd`; the simulator's
//! faulty disk in tests, see `faulty_disk_tests.rs`).
//!
//! ```text
//! append ─► WAL frame (CRC32C, group commit) ─► memtable ─flush─► segment + sidecar ─► manifest
//!                                                                   └─ compaction / retention ─┘
//! <state-dir>/usage/
//!   wal/<seq>.wal            frames, see wal::frame
//!   segments/<id>.seg        columnar segment, see segment
//!   segments/<id>.idx        sidecar index, see sidecar
//!   manifest/MANIFEST-<gen>  generations, see manifest
//! ```
//!
//! # Durability and the loss window
//!
//! - `FsyncPolicy::Always` (`--fsync always`): `append` writes the whole batch
//!   as one frame and fdatasyncs before returning. Nothing `append`
//!   acknowledged is lost by a crash or power loss. `append_deferred` writes
//!   the frame and hands back the fsync as a `PendingSync`, waited for after
//!   the caller lets go of the store's lock: a group commit, where one fsync
//!   covers every batch written when it starts (`wal::writer`). The batch is
//!   acknowledged when that wait returns; a failed fsync fails every batch
//!   it would have covered and poisons the store.
//! - `FsyncPolicy::Interval(d)` (`--fsync interval:<ms>`): `append` fsyncs
//!   only when `d` has passed since the last fsync; `maintain`, `flush`, WAL
//!   rotation and `close` also fsync. A process crash loses nothing (the bytes
//!   are in the page cache); a power loss or kernel crash loses the events
//!   appended since the last fsync: at most `d` plus the gap until the next
//!   `append`/`maintain` call. `checkpoint` then moves back accordingly and
//!   repair from the output topic (or the offline output file) re-applies them.
//!
//! Segments, sidecars and manifests are always written temp + fsync + rename
//! + directory fsync, whatever the policy.
//!
//! # Failure rules
//!
//! - A torn WAL tail (last frame cut short or failing its checksum, with no
//!   valid frame after it, in the newest WAL file) is truncated on open; every
//!   frame before it is kept. Corruption anywhere else in the WAL is
//!   [`StorageError::WalMidLogCorruption`] naming file and offset.
//! - The newest manifest failing its checksum: the previous generation is used
//!   (its files are kept until a newer generation supersedes it) and
//!   [`RecoveryReport::skipped_manifests`] says so. No readable manifest while
//!   data exists: [`StorageError::NoValidManifest`]; the store never starts
//!   empty by accident.
//! - Segments are not read by `open` (only their existence is checked). A
//!   corrupt segment is reported by [`verify`]; `get` and the fallback scan
//!   return an error naming the file; compaction leaves it in place, untouched,
//!   and lists it in [`MaintainReport::corrupt_segments`].
//! - A missing or corrupt sidecar: `recent_keys`/`get` scan the segment instead
//!   and report [`RecoveryPath::Fallback`] to the observer.
//! - Any failed write or fsync poisons the store: every later call fails with
//!   [`StorageError::Poisoned`]. The fsync is never retried (after a failed
//!   fsync the kernel may have dropped the dirty pages); the process must
//!   restart and recover from disk.
//! - Replay is idempotent: an event whose output offset is at or below its
//!   partition's checkpoint is skipped, on `append` and on WAL replay alike.
//!
//! # Flushes and compactions beside appends
//!
//! With [`StoreOptions::write_in_background`] (what `LocalState` uses) the
//! two long writes are jobs, each in three steps: started under the
//! store's lock, written without it, installed under it again.
//! - A flush ([`UsageStore::start_flush`]) seals the WAL file, freezes the
//!   memtable and gives it a segment id; appends go on into a fresh
//!   memtable. [`FlushJob::write`] writes the segment and sidecar;
//!   [`UsageStore::finish_flush`] installs the manifest naming them, with
//!   the checkpoints of the moment the memtable froze, and drops the WAL
//!   files only it needed. Until then the frozen events are read as the
//!   memtable's and are still in the WAL, so a crash at any step replays
//!   them. One flush at a time; appends wait for it only when the frozen
//!   and the live memtable together reach three times the bound
//!   (`memtable_max_events`, `memtable_max_bytes`).
//! - A compaction ([`UsageStore::start_compaction`]) picks the segments
//!   past retention and the small ones to merge; [`CompactionJob::run`]
//!   reads and merges them, copying full row groups as stored and packing
//!   the rest into full groups again (it stops reading inputs once the
//!   merged segment and its keys hold `compaction_max_bytes`, after two
//!   inputs at least, so it may pass the bound by one input) and writes the
//!   merged segment;
//!   [`UsageStore::finish_compaction`] puts it in the place of its oldest
//!   input in the manifest of that moment. One at a time, so its inputs
//!   stay in the manifest until then; a flush may install meanwhile.
//! - Every job's segment id is reserved when it starts, and garbage
//!   collection keeps the files (finished or temp) of a job still out.
//! - A failed job poisons the store, as a failed inline write does.
//!
//! Without it (the store alone) `append` flushes inline and `maintain`
//! compacts inline, through the same three steps. The simulator sets it,
//! and its schedule decides when each job is written and when installed
//! (`LocalState::run_store_jobs`, `write_store_jobs`), so a crash can find
//! one out, or written and not installed.

mod codec;
mod error;
pub mod failpoint;
#[cfg(test)]
mod faulty_disk_tests;
pub mod fs;
pub(crate) mod fsutil;
mod lock;
mod manifest;
mod memtable;
mod segment;
mod sidecar;
mod store;
#[doc(hidden)]
pub mod testutil;
mod verify;
mod wal;

use std::time::Duration;

pub use error::StorageError;
pub use fs::{AppendFile, FileSystem, RealFs};

/// Creates a state directory (and missing parents) so that it survives a
/// power loss: each new entry's parent directory is fsynced.
pub fn create_dir_durable(dir: &std::path::Path) -> Result<(), StorageError> {
    fsutil::create_dir_durable(&RealFs, dir)
}

/// Replaces `path` with `bytes` atomically and durably (temporary file,
/// fsync, rename, fsync of the directory): a crash leaves the old file or
/// the new one, never half of either.
pub fn write_file_atomic(path: &std::path::Path, bytes: &[u8]) -> Result<(), StorageError> {
    fsutil::write_atomic(&RealFs, path, bytes, None, None)
}
pub use lock::StateDirLock;
pub use manifest::Manifest;
pub use segment::SegmentMeta;
pub use store::{
    CompactionJob, FirstSeenLookup, FlushJob, MaintainReport, ReadCores, RecoveryReport, TornTail, UsageMarks,
    UsageStore,
};
pub use verify::{stored_checkpoints, verify, verify_on, FileKind, FileReport, FileStatus, VerifyReport};
pub use wal::writer::PendingSync;

use crate::classify::SeenKey;
use crate::event::UsageEvent;

/// What gets persisted for one accepted, published event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredEvent {
    pub key: SeenKey,
    pub event: UsageEvent,
}

/// A copy, for [`UsageStore::append_deferred`] given events by reference.
impl From<&StoredEvent> for StoredEvent {
    fn from(e: &StoredEvent) -> StoredEvent {
        e.clone()
    }
}

/// When the WAL is fsynced. See the module doc for the loss window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// fsync every batch before it is acknowledged (group commit).
    Always,
    /// fsync at most once per interval.
    Interval(Duration),
}

impl std::str::FromStr for FsyncPolicy {
    type Err = StorageError;

    /// Parses `always` or `interval:<ms>` (milliseconds, > 0).
    fn from_str(s: &str) -> Result<FsyncPolicy, StorageError> {
        let bad = |detail: String| StorageError::InvalidOption { key: "fsync", detail };
        if s == "always" {
            return Ok(FsyncPolicy::Always);
        }
        let ms =
            s.strip_prefix("interval:").ok_or_else(|| bad(format!("{s:?}: expected `always` or `interval:<ms>`")))?;
        match ms.parse::<u64>() {
            Ok(0) => Err(bad("interval must be at least 1 ms".into())),
            Ok(ms) => Ok(FsyncPolicy::Interval(Duration::from_millis(ms))),
            Err(_) => Err(bad(format!("{ms:?} is not a whole number of milliseconds"))),
        }
    }
}

impl std::fmt::Display for FsyncPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FsyncPolicy::Always => f.write_str("always"),
            FsyncPolicy::Interval(d) => write!(f, "interval:{}", d.as_millis()),
        }
    }
}

const DAY_MS: i64 = 24 * 60 * 60 * 1000;

/// Tuning of the store. `Default` gives the documented defaults.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Default `Always`.
    pub fsync: FsyncPolicy,
    /// The active WAL file is sealed and a new one started past this size. Default 64 MiB.
    pub wal_rotate_bytes: u64,
    /// The memtable is flushed to a segment at this many events. Default 262,144.
    pub memtable_max_events: usize,
    /// ... or at this many bytes of events in memory, whichever comes
    /// first. Default 128 MiB. With `write_in_background`, one memtable may
    /// be frozen and being written while the next fills: appends wait
    /// for that write when the two together reach three times either
    /// bound, so they stay under it plus one batch.
    pub memtable_max_bytes: usize,
    /// Flushes are started by the caller ([`UsageStore::start_flush`])
    /// and written without the store's lock ([`FlushJob::write`]), not
    /// inline in the append that fills the memtable. Default false (the
    /// store alone); `LocalState` sets it and runs the writes on a thread
    /// of their own (on the simulator's disk, when its schedule says).
    pub write_in_background: bool,
    /// Data whose `first_seen_ms` is older than this is dropped by compaction. Default 35 days.
    pub retention_ms: i64,
    /// Window of keys `recovery_hot_keys` returns. Default 7 days.
    pub hot_ttl_ms: i64,
    /// Most keys `recovery_hot_keys` returns per partition (newest kept). Default 1,000,000.
    pub hot_capacity: usize,
    /// Segments with fewer rows than this are "small" and merge. Default 1,048,576.
    pub compaction_target_rows: u64,
    /// Merge when at least this many small segments exist. Default 4.
    pub compaction_min_segments: usize,
    /// A merge writes at most this many input rows. Default 4,194,304.
    pub compaction_max_rows: u64,
    /// ... and holds at most about this many bytes in memory: the merged
    /// segment as stored and its rows' keys (it stops reading inputs once
    /// past it, after two at least; inputs are read one at a time, and
    /// their groups are copied as stored). Default 256 MiB.
    pub compaction_max_bytes: usize,
    /// Test seam: the failpoint name at which the store fails and poisons
    /// itself (see [`failpoint`]). `None` in production.
    pub crash_at: Option<String>,
    /// Deliberate bugs for the simulator to catch; always none outside test builds.
    pub mutations: crate::pipeline::Mutations,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            fsync: FsyncPolicy::Always,
            wal_rotate_bytes: 64 << 20,
            memtable_max_events: 262_144,
            memtable_max_bytes: 128 << 20,
            write_in_background: false,
            retention_ms: 35 * DAY_MS,
            hot_ttl_ms: 7 * DAY_MS,
            hot_capacity: 1_000_000,
            compaction_target_rows: 1 << 20,
            compaction_min_segments: 4,
            compaction_max_rows: 4 << 20,
            compaction_max_bytes: 256 << 20,
            crash_at: None,
            mutations: crate::pipeline::Mutations::NONE,
        }
    }
}

/// Which path rebuilt a segment's keys on recovery (`dedupd_recovery_segments_total{path}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecoveryPath {
    Sidecar,
    Fallback,
}

impl RecoveryPath {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryPath::Sidecar => "sidecar",
            RecoveryPath::Fallback => "fallback",
        }
    }
}

/// Callbacks for metrics, so storage never depends on the metrics layer.
pub trait StorageObserver: Send + Sync {
    fn wal_fsync(&self, _took: Duration) {}
    fn recovery_segment(&self, _path: RecoveryPath) {}
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopObserver;

impl StorageObserver for NoopObserver {}
