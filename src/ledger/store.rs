//! The ledger's durable tier: rollups, counter watermarks, adjustments and a
//! checkpoint per partition, in RocksDB under `<state-dir>/ledger` (sync).
//!
//! Folded changes are written behind, many batches at a time, with the
//! checkpoint in the same write batch, so after any crash the ledger is
//! exactly the fold of its partition's output up to its checkpoint. What
//! follows is folded again on the next start: from the usage store, which
//! holds it after a process crash (see the segment id below), else by
//! repair from the output topic (the source of truth). Writes go through
//! RocksDB's WAL without an fsync each.
//!
//! Keys (strings length-prefixed, integers big-endian with the sign bit
//! flipped so byte order is numeric order):
//!
//! ```text
//! H tenant customer meter hour partition   -> rollup      (a tenant's or customer's
//!                                                          usage is one range scan)
//! W partition tenant customer meter        -> watermark
//! A tenant period partition offset         -> adjustment
//! C partition                              -> checkpoint (last output offset folded)
//! S partition                              -> the usage store's next segment id
//!                                             when the checkpoint was written
//! ```
//!
//! The segment id says where a restart finds what the ledger had folded
//! and not written: every event the usage store took after that write is
//! in its memtable (rebuilt from its WAL) or in a segment with that id or
//! a later one (see `UsageStore::stored_after`). So the ledger need not
//! write before each memtable flush, only every [`WRITE_BEHIND`].

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Instant;

use hashbrown::{HashMap, HashSet};

use rocksdb::{Direction, IteratorMode, Options, WriteBatch, DB};
use rust_decimal::Decimal;

use crate::event::{EventKind, UsageEvent};

use super::rollup::{
    fold_into, hour_of, hour_order, Adjustment, AdjustmentReason, CounterKey, CounterRef, FoldError, Folded, HourKey,
    HourRef, Lateness, Listing, Rollup, Tally,
};
use super::Period;

/// Failure of the ledger store. Any of them stops the batch, like every
/// other tier's: a total that silently skipped an event would misbill.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("ledger store at {dir}: {source}")]
    Rocks { dir: String, source: rocksdb::Error },
    #[error("ledger store: undecodable {what}: {detail}")]
    Corrupt { what: &'static str, detail: String },
    #[error(transparent)]
    Fold(#[from] FoldError),
    #[error("no ledger at {dir}: the state directory was never used with the ledger on")]
    Missing { dir: String },
    #[error(
        "the ledger at {dir} holds {found} but no CURRENT file: opened, RocksDB would start an empty ledger and \
         delete every table as obsolete, losing every total; {advice}",
        advice = crate::storage::fsutil::LOST_CURRENT_ADVICE
    )]
    LostCurrent { dir: String, found: String },
    #[error("{0}")]
    Query(String),
    /// A write the tests made fail (see `LedgerStore::fail_next_write`).
    #[cfg(test)]
    #[error("ledger store: injected write failure")]
    InjectedWriteFailure,
}

const ROLLUP_VERSION: u8 = 1;
const ADJUSTMENT_VERSION: u8 = 1;

/// Cached hours and watermarks past which clean entries are dropped.
const CACHE_MAX_ENTRIES: usize = 1_000_000;

/// The longest folded changes wait unwritten while batches keep coming: a
/// read-only query of the state directory (`dedupd usage --state-dir`)
/// sees the ledger up to this far behind a process applying batches. When
/// batches stop, the next write comes from the worker's maintenance tick
/// (every 5 s), so an idle worker's last folds can wait up to twice that.
/// The same as the tick: each write puts every hour changed since the
/// last, so this sets how often a busy hour is written again (at 1 s the
/// write was 38% of the ledger's cost in a 200k-event `dedupd dedupe`, at
/// 5 s 30%), and the worker's own queries write first.
pub const WRITE_BEHIND: std::time::Duration = std::time::Duration::from_secs(5);

/// A batch folded by [`LedgerStore::preview`] into its partition's cache,
/// in place, and not applied yet: its apply keeps the fold; anything else
/// undoes it.
struct Previewed {
    /// The partition's checkpoint when it was folded.
    checkpoint: Option<i64>,
    /// Which events, in which order (see [`fingerprint`]).
    fingerprint: [u8; 32],
    folded: Folded,
    undo: Undo,
}

/// What a fold in place overwrote in the cache: each hour's and counter's
/// value before the batch's first change to it, each once (the slots'
/// stamps say which change is the first, see [`HourSlot`]).
#[derive(Default)]
struct Undo {
    hours: Vec<(HourKey, Option<Rollup>)>,
    watermarks: Vec<(Arc<CounterKey>, Option<i64>)>,
}

/// A cached hour: its rollup (`None`: known absent from the store) and the
/// last fold to change it (perhaps one undone since: later folds' stamps are
/// larger, so that does not matter). The stamp is how a fold knows its first
/// change to an hour, the one it records in its [`Undo`], without a lookup
/// of its own. The undo was a hash map, probed twice per event: a fresh
/// table of a thousand entries each batch, out of the CPU's caches (perf:
/// the preview fell from 8.9% to 7.8% of a batch's CPU without it).
#[derive(Default)]
struct HourSlot {
    rollup: Option<Box<Rollup>>,
    /// [`Cache::folds`] of the fold that last changed it (0: none).
    fold: u64,
}

/// A cached counter watermark (`None`: known absent), stamped like
/// [`HourSlot`].
#[derive(Default, Clone, Copy)]
struct WatermarkSlot {
    ms: Option<i64>,
    fold: u64,
}

/// One partition's cached hours and watermarks as a fold sees them. Every
/// counter and hour of the batch is loaded first (see `LedgerStore::load`),
/// which also found each event's counter (`resolved`, by position), so the
/// fold neither hashes names nor reads the store.
struct CacheTally<'c> {
    hours: &'c mut HashMap<HourKey, HourSlot>,
    watermarks: &'c mut HashMap<Arc<CounterKey>, WatermarkSlot>,
    resolved: &'c [Arc<CounterKey>],
    /// This fold's stamp: never 0, never a stamp an earlier fold left.
    fold: u64,
    undo: &'c mut Undo,
}

impl Tally for CacheTally<'_> {
    fn counter(&mut self, i: usize, _: &UsageEvent) -> (Arc<CounterKey>, Option<i64>) {
        let counter = self.resolved[i].clone();
        let watermark = self.watermarks.get(&counter).and_then(|w| w.ms);
        (counter, watermark)
    }

    fn set_watermark(&mut self, counter: &Arc<CounterKey>, ms: i64) {
        // Loaded before the fold, so found (an absent one as `None`).
        if let Some(slot) = self.watermarks.get_mut(counter) {
            if slot.fold != self.fold {
                self.undo.watermarks.push((counter.clone(), slot.ms));
                slot.fold = self.fold;
            }
            slot.ms = Some(ms);
            return;
        }
        self.undo.watermarks.push((counter.clone(), None));
        self.watermarks.insert(counter.clone(), WatermarkSlot { ms: Some(ms), fold: self.fold });
    }

    fn hour(&mut self, counter: &Arc<CounterKey>, hour_ms: i64) -> (&mut Rollup, bool) {
        // Loaded before the fold, so found (an absent hour as `None`).
        let slot = self.hours.entry_ref(&HourRef { counter, hour_ms }).or_default();
        let first = slot.fold != self.fold;
        if first {
            self.undo.hours.push((HourKey { counter: counter.clone(), hour_ms }, slot.rollup.as_deref().cloned()));
            slot.fold = self.fold;
        }
        (slot.rollup.get_or_insert_with(Box::default), first)
    }
}

/// Names a sequence of events by identity and order: blake3 over each
/// event's length-prefixed tenant and id. Equal fingerprints are the same
/// events in the same order (an event's fields are fixed by its identity
/// once accepted).
fn fingerprint(events: &[(&UsageEvent, i64)]) -> [u8; 32] {
    // Gathered first and hashed in one call: blake3 per short field costs
    // more in calls than in hashing.
    let mut bytes = Vec::with_capacity(8 + events.len() * 48);
    bytes.extend_from_slice(&(events.len() as u64).to_le_bytes());
    for (e, _) in events {
        for s in [&e.tenant_id, &e.event_id] {
            bytes.extend_from_slice(&(s.len() as u64).to_le_bytes());
            bytes.extend_from_slice(s.as_bytes());
        }
    }
    *blake3::hash(&bytes).as_bytes()
}

/// The durable ledger of every partition this state directory has seen.
///
/// [`apply`](Self::apply) folds into an in-memory cache of hours and
/// watermarks; [`write_pending`](Self::write_pending) writes every change
/// since the last write, each partition's in one key-ordered write batch
/// with its checkpoint. Local state calls it at the first apply or
/// maintenance tick once [`WRITE_BEHIND`] has passed (and every query
/// does), so a counter-hour that many batches touch is written once, not
/// once per batch: the write was half the ledger's cost when every batch
/// wrote, and still most of it when every usage-store flush wrote. A
/// restart folds the unwritten batches again from the usage store (see
/// the module doc), so it still repairs only the batches in flight. Reads go to the cache first: the
/// hours a batch touches are mostly the hours the batch before touched.
///
/// Each partition's cache has a lock of its own, so partitions fold side by
/// side: a partition's ledger is its own (every key but a rollup's starts
/// with, and a rollup's ends with, the partition), and nothing one
/// partition folds reads another's. One lock for the whole ledger made it
/// the one place two partitions' applies waited for each other.
pub struct LedgerStore {
    db: DB,
    dir: String,
    /// By partition. The map is locked for writing only when a partition is
    /// first seen; each cache is then locked alone.
    partitions: RwLock<HashMap<i32, Arc<Mutex<Cache>>>>,
    /// When folded changes were last written (`None`: never, this process).
    written_at: Mutex<Option<Instant>>,
    /// Hours and watermarks cached over every partition, as each counted
    /// its own at its last write (see [`Cache::counted`]).
    cached_entries: AtomicUsize,
    /// [`CACHE_MAX_ENTRIES`], smaller in tests.
    cache_max_entries: usize,
    /// The usage store's next segment id as last told
    /// ([`note_usage_segment`](Self::note_usage_segment)), written with
    /// each partition's checkpoint. Told before the folds a write covers,
    /// so it is never past the segment of an event the write misses.
    usage_segment: AtomicU64,
    /// Tests: the next write fails as a full disk would make RocksDB's.
    #[cfg(test)]
    fail_next_write: std::sync::atomic::AtomicBool,
}

/// One partition's ledger as this process holds it: what the store holds
/// (clean) and what waits to be written (dirty). A known absence is cached
/// as `None`.
#[derive(Default)]
struct Cache {
    /// Looked up by reference, no key built. Rollups boxed: the table stays
    /// small enough to sit in cache while each event's hour is probed (a
    /// rollup is about a hundred bytes).
    hours: HashMap<HourKey, HourSlot>,
    watermarks: HashMap<Arc<CounterKey>, WatermarkSlot>,
    /// Folds made in this cache: the last one's stamp (see [`HourSlot`]).
    /// 64 bits, so a stamp never comes round again.
    folds: u64,
    dirty_hours: HashSet<HourKey>,
    dirty_watermarks: HashSet<Arc<CounterKey>>,
    /// The last preview, folded in place and kept by the apply of the same
    /// events (the worker previews a batch to publish its rollups, then
    /// applies it); undone before anything else reads or writes the cache.
    previewed: Option<Previewed>,
    adjustments: Vec<Adjustment>,
    /// Last output offset folded, written or not; `None` until the first
    /// fold of this process (the store is asked then).
    checkpoint: Option<i64>,
    /// Whether anything was folded since the last write.
    dirty: bool,
    /// Whether this process wrote the checkpoint with a segment id (see
    /// [`LedgerStore::set_anchored`]).
    segment_recorded: bool,
    /// Whether the usage store holds nothing of the partition past what
    /// is folded here (see [`LedgerStore::set_anchored`]); a write records
    /// a segment id only then.
    unanchored: bool,
    /// This partition's share of [`LedgerStore::cached_entries`]: its
    /// hours and watermarks at its last write.
    counted: usize,
}

impl std::fmt::Debug for LedgerStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerStore").field("dir", &self.dir).finish()
    }
}

/// One tenant's rollups, each with its hour, and its adjustments, as of one
/// moment ([`LedgerStore::tenant_ledger`]).
pub type TenantLedger = (Vec<(HourKey, Rollup)>, Vec<Adjustment>);

/// What folding a batch would change: the rollups and adjustments it
/// publishes in its own transaction.
#[derive(Debug, Default)]
pub struct Preview {
    /// The changed hours with their new rollups, and the hours of the
    /// batch's replays with their current ones, each once.
    pub rollups: Vec<(HourKey, Rollup)>,
    pub folded: Folded,
    /// The adjustments the batch's replays became when they were first
    /// folded: published again, not new (see [`Replays`]).
    pub republished: Vec<Adjustment>,
}

/// Accepted events a batch meets again at the same source position, with
/// the output offsets they were published at: their earlier publication
/// reached the output topic, but at least once, nothing says its rollups
/// and adjustments reached theirs (a publish can fail between the two, and
/// its retry finds the events replayed, not accepted). So the batch
/// publishes their hours' current totals and their adjustments again;
/// both are latest-value records on a compacted topic, so once more is
/// harmless.
pub type Replays<'a> = [(&'a UsageEvent, i64)];

/// The replays that may have become adjustments: those late against their
/// counter's watermark now (`watermark`). Watermarks only rise, so a
/// replay on time now was on time when it was folded, and is not looked up.
pub(crate) fn late_replays<'r, 'e>(
    replays: &'r Replays<'e>,
    lateness: &'r Lateness,
    watermark: impl Fn(&UsageEvent) -> Option<i64> + 'r,
) -> impl Iterator<Item = &'r (&'e UsageEvent, i64)> + 'r {
    replays.iter().filter(move |(e, _)| lateness.is_late(e, watermark(e)))
}

impl Preview {
    /// `folded` with the new rollups of its hours, and the current rollups
    /// of `replays`' hours, read from `hours`.
    pub(crate) fn of<'h>(
        folded: Folded,
        replays: &Replays<'_>,
        hours: impl Fn(&HourKey) -> Option<&'h Rollup>,
    ) -> Preview {
        let rollups = if replays.is_empty() {
            folded.hours.iter().filter_map(|k| Some((k.clone(), hours(k)?.clone()))).collect()
        } else {
            let mut keys: Vec<HourKey> = folded.hours.clone();
            keys.extend(
                replays
                    .iter()
                    .map(|(e, _)| HourKey { counter: Arc::new(CounterKey::of(e)), hour_ms: hour_of(e.timestamp_ms) }),
            );
            // The fold's order, so a retry publishes as its first attempt did.
            keys.sort_unstable_by(hour_order);
            keys.dedup();
            keys.into_iter().filter_map(|k| hours(&k).cloned().map(|r| (k, r))).collect()
        };
        Preview { rollups, folded, republished: Vec::new() }
    }

    /// The rollups to publish with their new values, each hour once.
    pub fn rollups(&self) -> impl Iterator<Item = (&HourKey, &Rollup)> {
        self.rollups.iter().map(|(k, r)| (k, r))
    }

    /// Records published again for the replays: their hours' rollups (every
    /// hour the batch changed has a rollup; the others are replays') and
    /// their adjustments.
    pub fn republished_records(&self) -> usize {
        self.rollups.len().saturating_sub(self.folded.hours.len()) + self.republished.len()
    }
}

/// A lock whose holder panicked: what it guards is left as the panic left
/// it, which every path here tolerates (a fold or write either finished or
/// left its changes pending).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Refuses a ledger directory that lost its `CURRENT` file but holds data
/// (see [`crate::storage::fsutil::rocksdb_data_without_current`]).
fn refuse_lost_current(dir: &Path) -> Result<(), LedgerError> {
    let dir_name = || dir.display().to_string();
    match crate::storage::fsutil::rocksdb_data_without_current(dir) {
        Ok(None) => Ok(()),
        Ok(Some(found)) => Err(LedgerError::LostCurrent { dir: dir_name(), found }),
        Err(e) => Err(LedgerError::Query(format!("cannot list the ledger at {}: {e}", dir_name()))),
    }
}

impl LedgerStore {
    pub fn open(dir: &Path) -> Result<LedgerStore, LedgerError> {
        refuse_lost_current(dir)?;
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        opts.set_max_background_jobs(1);
        opts.set_keep_log_file_num(2);
        let name = dir.display().to_string();
        let db = DB::open(&opts, dir).map_err(|source| LedgerError::Rocks { dir: name.clone(), source })?;
        Ok(LedgerStore::over(db, name))
    }

    /// Opens a ledger for queries only, without its lock: a worker may be
    /// writing it, and the reader sees what it had written at open.
    pub fn open_read_only(dir: &Path) -> Result<LedgerStore, LedgerError> {
        let name = dir.display().to_string();
        refuse_lost_current(dir)?;
        if !dir.join("CURRENT").exists() {
            return Err(LedgerError::Missing { dir: name });
        }
        let db = DB::open_for_read_only(&Options::default(), dir, false)
            .map_err(|source| LedgerError::Rocks { dir: name.clone(), source })?;
        Ok(LedgerStore::over(db, name))
    }

    fn over(db: DB, dir: String) -> LedgerStore {
        LedgerStore {
            db,
            dir,
            partitions: RwLock::default(),
            written_at: Mutex::default(),
            cached_entries: AtomicUsize::new(0),
            cache_max_entries: CACHE_MAX_ENTRIES,
            usage_segment: AtomicU64::new(0),
            #[cfg(test)]
            fail_next_write: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn rocks(&self) -> impl Fn(rocksdb::Error) -> LedgerError + '_ {
        |source| LedgerError::Rocks { dir: self.dir.clone(), source }
    }

    /// `partition`'s cache, made empty the first time it is asked for.
    fn cache(&self, partition: i32) -> Arc<Mutex<Cache>> {
        let known = self.partitions.read().unwrap_or_else(PoisonError::into_inner).get(&partition).cloned();
        known.unwrap_or_else(|| {
            self.partitions.write().unwrap_or_else(PoisonError::into_inner).entry(partition).or_default().clone()
        })
    }

    /// Every partition's cache, in partition order.
    fn caches(&self) -> Vec<(i32, Arc<Mutex<Cache>>)> {
        let held = self.partitions.read().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<_> = held.iter().map(|(p, c)| (*p, c.clone())).collect();
        all.sort_unstable_by_key(|(p, _)| *p);
        all
    }

    /// The last output offset of `partition` folded in (written or not:
    /// within this process, what is folded is what counts; after a restart,
    /// what was written).
    pub fn checkpoint(&self, partition: i32) -> Result<Option<i64>, LedgerError> {
        let cache = self.cache(partition);
        let cache = lock(&cache);
        self.checkpoint_of(partition, &cache)
    }

    /// Tells the store the usage store's next segment id, read before
    /// the folds the next writes cover (it only rises within a process).
    pub fn note_usage_segment(&self, next_segment_id: u64) {
        self.usage_segment.fetch_max(next_segment_id, Ordering::SeqCst);
    }

    /// Says whether the usage store may hold events of `partition` past
    /// what the ledger has folded (`false`: the ledger is being repaired
    /// behind the usage store, whose older segments hold part of the gap).
    /// Told before each fold. The segment id a write records is only a
    /// floor for what the write misses when the usage store held nothing
    /// past the ledger when the id was told, so an unanchored partition's
    /// write removes its id instead, and a restart leaves its gap to the
    /// memtable or to repair.
    ///
    /// Returns whether this process has written the partition's checkpoint
    /// with a segment id yet. Until it has, a restart may find no segment
    /// id for what the partition folds (a partition first folded since the
    /// last write, last written by a version that recorded none, or last
    /// written unanchored), so local state writes at once. One lock for
    /// both, taken once per batch.
    pub fn set_anchored(&self, partition: i32, anchored: bool) -> bool {
        let cache = self.cache(partition);
        let mut cache = lock(&cache);
        cache.unanchored = !anchored;
        cache.segment_recorded
    }

    /// [`set_anchored`](Self::set_anchored) `false`, and the segment id
    /// written for `partition` removed now: a restart that could not catch
    /// it up leaves it to repair, and the next restart must not try again
    /// from that id.
    pub fn unanchor_written(&self, partition: i32) -> Result<(), LedgerError> {
        self.set_anchored(partition, false);
        self.db.delete(encoded(|out| push_segment_key(out, partition))).map_err(self.rocks())
    }

    /// Every partition's written checkpoint, in partition order (what a
    /// reader opening the store sees: `verify` compares them with the usage
    /// store's).
    pub fn written_checkpoints(&self) -> Result<BTreeMap<i32, i64>, LedgerError> {
        let mut checkpoints = BTreeMap::new();
        self.each_of_kind(b'C', |k, v| {
            let mut key = Reader { bytes: k.get(1..).unwrap_or_default(), what: "checkpoint key" };
            let partition = key.i32()?;
            key.end()?;
            checkpoints.insert(partition, read_i64(v, "checkpoint")?);
            Ok(())
        })?;
        Ok(checkpoints)
    }

    /// For each partition written with one, the usage store's next segment
    /// id at its last write: from there on, the usage store holds every
    /// event folded after that write. Partitions last written by a version
    /// that did not record it have none.
    pub fn written_usage_segments(&self) -> Result<BTreeMap<i32, u64>, LedgerError> {
        let mut marks = BTreeMap::new();
        self.each_of_kind(b'S', |k, v| {
            let (partition, segment) = decode_segment_entry(k, v)?;
            marks.insert(partition, segment);
            Ok(())
        })?;
        Ok(marks)
    }

    /// Calls `f` with every key of one kind (its first byte) and its value,
    /// in key order.
    fn each_of_kind(
        &self,
        kind: u8,
        mut f: impl FnMut(&[u8], &[u8]) -> Result<(), LedgerError>,
    ) -> Result<(), LedgerError> {
        for item in self.db.iterator(IteratorMode::From(&[kind], Direction::Forward)) {
            let (k, v) = item.map_err(self.rocks())?;
            if k.first() != Some(&kind) {
                break;
            }
            f(&k, &v)?;
        }
        Ok(())
    }

    fn checkpoint_of(&self, partition: i32, cache: &Cache) -> Result<Option<i64>, LedgerError> {
        if cache.checkpoint.is_some() {
            return Ok(cache.checkpoint);
        }
        let v = self.db.get(checkpoint_key(partition)).map_err(self.rocks())?;
        v.map(|b| read_i64(&b, "checkpoint")).transpose()
    }

    /// Folds `events` (accepted, in output order, each with its output
    /// offset) against what the store holds, without writing: the rollups a
    /// batch will produce, for publishing them in its transaction. The fold
    /// is made in the cache and kept there for the apply of the same events
    /// (see [`Previewed`]); to every other reader it is as if it had not
    /// happened.
    ///
    /// `replays` (see [`Replays`]) are not folded again: their hours'
    /// current rollups and their adjustments are added to the preview.
    pub fn preview(
        &self,
        partition: i32,
        lateness: &Lateness,
        events: &[(&UsageEvent, i64)],
        replays: &Replays<'_>,
    ) -> Result<Preview, LedgerError> {
        let cache = self.cache(partition);
        let mut cache = lock(&cache);
        let checkpoint = self.checkpoint_of(partition, &cache)?;
        Self::undo_preview(&mut cache);
        let republished = if replays.is_empty() {
            Vec::new()
        } else {
            self.load(&mut cache, partition, replays)?;
            self.adjustments_of(&cache, partition, lateness, replays)?
        };
        let (folded, undo) = self.fold_in_cache(&mut cache, partition, lateness, events)?;
        let held = &cache.hours;
        let mut preview = Preview::of(folded.clone(), replays, |k| held.get(k).and_then(|s| s.rollup.as_deref()));
        preview.republished = republished;
        cache.previewed = Some(Previewed { checkpoint, fingerprint: fingerprint(events), folded, undo });
        Ok(preview)
    }

    /// The adjustments `replays` became, if any: each is found by its key
    /// (tenant, its event's period, partition, output offset), among the
    /// folded ones not written yet, then in the store; only
    /// [`late_replays`] against the watermarks `load` brought in.
    fn adjustments_of(
        &self,
        cache: &Cache,
        partition: i32,
        lateness: &Lateness,
        replays: &Replays<'_>,
    ) -> Result<Vec<Adjustment>, LedgerError> {
        let mut found = Vec::new();
        let mut stored_keys = Vec::new();
        let watermark = |e: &UsageEvent| cache.watermarks.get(&CounterRef::of(e)).and_then(|w| w.ms);
        for (e, offset) in late_replays(replays, lateness, watermark) {
            match cache.adjustments.iter().find(|a| a.made_of(e, *offset)) {
                Some(a) => found.push(a.clone()),
                None => stored_keys.push(encoded(|out| {
                    push_adjustment_key_of(out, &e.tenant_id, Period::of_ms(e.timestamp_ms), partition, *offset)
                })),
            }
        }
        for v in self.db.multi_get(&stored_keys) {
            if let Some(v) = v.map_err(self.rocks())? {
                found.push(decode_adjustment(&v)?);
            }
        }
        Ok(found)
    }

    /// Folds `events` in; those at or below the checkpoint are skipped
    /// (idempotent by output offset). Not written yet: see the type's doc.
    pub fn apply(
        &self,
        partition: i32,
        lateness: &Lateness,
        events: &[(&UsageEvent, i64)],
    ) -> Result<Folded, LedgerError> {
        let cache = self.cache(partition);
        let mut cache = lock(&cache);
        let checkpoint = self.checkpoint_of(partition, &cache)?;
        let fresh: Vec<(&UsageEvent, i64)> =
            events.iter().copied().filter(|(_, o)| checkpoint.is_none_or(|c| *o > c)).collect();
        let Some(last) = fresh.last().map(|(_, o)| *o) else {
            return Ok(Folded::default());
        };
        let folded = match cache.previewed.take() {
            // The batch just previewed, against the same state: its fold,
            // already in the cache, is this fold, but for the output
            // offsets it did not know.
            Some(p) if p.checkpoint == checkpoint && p.fingerprint == fingerprint(&fresh) => {
                let mut folded = p.folded;
                if !folded.adjustments.is_empty() {
                    // By identity: two tenants may use the same event id.
                    let offsets: HashMap<(&str, &str), i64> =
                        fresh.iter().map(|(e, o)| ((e.tenant_id.as_str(), e.event_id.as_str()), *o)).collect();
                    for a in &mut folded.adjustments {
                        let identity = (a.counter.tenant_id.as_str(), a.event_id.as_str());
                        a.output_offset = offsets.get(&identity).copied().unwrap_or(a.output_offset);
                    }
                }
                folded
            }
            other => {
                // Another batch's preview, or none: undone, then this fold.
                if let Some(p) = other {
                    Self::restore(&mut cache, p.undo);
                }
                self.fold_in_cache(&mut cache, partition, lateness, &fresh)?.0
            }
        };
        cache.dirty_hours.extend(folded.hours.iter().cloned());
        cache.dirty_watermarks.extend(folded.counters.iter().cloned());
        cache.adjustments.extend(folded.adjustments.iter().cloned());
        cache.checkpoint = Some(last);
        cache.dirty = true;
        Ok(folded)
    }

    /// Folds `events` into the cached hours and watermarks of `partition`,
    /// loading what they touch first. Returns what changed and what it
    /// overwrote; a fold that fails (an overflowing sum) is undone.
    fn fold_in_cache(
        &self,
        cache: &mut Cache,
        partition: i32,
        lateness: &Lateness,
        events: &[(&UsageEvent, i64)],
    ) -> Result<(Folded, Undo), LedgerError> {
        let resolved = self.load(cache, partition, events)?;
        let mut undo = Undo { hours: Vec::with_capacity(events.len()), watermarks: Vec::new() };
        cache.folds += 1;
        let mut tally = CacheTally {
            hours: &mut cache.hours,
            watermarks: &mut cache.watermarks,
            resolved: &resolved,
            fold: cache.folds,
            undo: &mut undo,
        };
        match fold_into(&mut tally, lateness, events.iter().copied(), Listing::Changes) {
            Ok(folded) => Ok((folded, undo)),
            Err(e) => {
                Self::restore(cache, undo);
                Err(e.into())
            }
        }
    }

    /// Undoes the fold of a preview that was not applied, if there is one.
    fn undo_preview(cache: &mut Cache) {
        if let Some(p) = cache.previewed.take() {
            Self::restore(cache, p.undo);
        }
    }

    fn restore(cache: &mut Cache, undo: Undo) {
        for (k, v) in undo.hours {
            cache.hours.entry(k).or_default().rollup = v.map(Box::new);
        }
        for (c, w) in undo.watermarks {
            cache.watermarks.entry(c).or_default().ms = w;
        }
    }

    /// Writes what is folded but not yet written, each partition's in one
    /// write batch with its checkpoint. A partition's fold waits only for
    /// its own partition's write.
    pub fn write_pending(&self) -> Result<(), LedgerError> {
        *lock(&self.written_at) = Some(Instant::now());
        for (partition, cache) in self.caches() {
            let mut cache = lock(&cache);
            self.write(partition, &mut cache)?;
            self.bound(&mut cache);
        }
        Ok(())
    }

    /// Writes what `partition` has pending and forgets its cache (the
    /// partition was revoked: another worker folds it now, and this
    /// process's copy would only hold memory and its share of the bound).
    /// A later fold of it starts from what is written.
    pub fn release(&self, partition: i32) -> Result<(), LedgerError> {
        let Some(cache) = self.partitions.read().unwrap_or_else(PoisonError::into_inner).get(&partition).cloned()
        else {
            return Ok(());
        };
        let mut held = lock(&cache);
        self.write(partition, &mut held)?;
        self.cached_entries.fetch_sub(held.counted, Ordering::Relaxed);
        *held = Cache::default();
        drop(held);
        self.partitions.write().unwrap_or_else(PoisonError::into_inner).remove(&partition);
        Ok(())
    }

    /// Whether folded changes have waited [`WRITE_BEHIND`] or longer.
    pub fn write_due(&self) -> bool {
        // The clock first: only once a write is due are the partitions'
        // caches asked whether they hold anything to write.
        let waited = lock(&self.written_at).is_none_or(|t| t.elapsed() >= WRITE_BEHIND);
        waited && self.partitions.read().unwrap_or_else(PoisonError::into_inner).values().any(|c| lock(c).dirty)
    }

    fn write(&self, partition: i32, cache: &mut Cache) -> Result<(), LedgerError> {
        if !cache.dirty {
            return Ok(());
        }
        // Only applied batches are written.
        Self::undo_preview(cache);
        let mut puts = Puts::default();
        for key in &cache.dirty_hours {
            if let Some(r) = cache.hours.get(key).and_then(|s| s.rollup.as_deref()) {
                puts.add(|out| push_hour_key(out, key, partition), |out| push_rollup(out, r));
            }
        }
        for counter in &cache.dirty_watermarks {
            if let Some(w) = cache.watermarks.get(counter).and_then(|s| s.ms) {
                puts.add(|out| push_watermark_key(out, partition, counter), |out| out.extend_from_slice(&flip(w)));
            }
        }
        for a in &cache.adjustments {
            puts.add(|out| push_adjustment_key(out, a, partition), |out| push_adjustment(out, a));
        }
        if let Some(c) = cache.checkpoint {
            puts.add(|out| push_checkpoint_key(out, partition), |out| out.extend_from_slice(&flip(c)));
            if !cache.unanchored {
                let segment = self.usage_segment.load(Ordering::SeqCst);
                puts.add(|out| push_segment_key(out, partition), |out| out.extend_from_slice(&segment.to_be_bytes()));
            }
        }
        let recorded = cache.checkpoint.is_some() && !cache.unanchored;
        let mut batch = puts.into_batch();
        if cache.unanchored {
            // Older segments hold some of what this checkpoint does not
            // cover: a restart must not look for it from any segment id.
            batch.delete(encoded(|out| push_segment_key(out, partition)));
        }
        // What is pending stays pending until RocksDB has taken it: a
        // failed write (a full disk, say) must not drop folded hours and
        // adjustments while a later write stores a checkpoint past them.
        // The next write puts them again (each put is the latest value, so
        // writing twice is harmless).
        #[cfg(test)]
        if self.fail_next_write.swap(false, Ordering::Relaxed) {
            return Err(LedgerError::InjectedWriteFailure);
        }
        self.db.write(batch).map_err(self.rocks())?;
        // An unanchored write removed the id: the next anchored fold must
        // write at once again (see `set_anchored`).
        cache.segment_recorded = recorded;
        cache.dirty_hours.clear();
        cache.dirty_watermarks.clear();
        cache.adjustments.clear();
        cache.dirty = false;
        Ok(())
    }

    /// Bounds the memory the caches take, called for each partition at
    /// each [`write_pending`](Self::write_pending), once the partition is
    /// clean: its entries are dropped whole when every partition's together
    /// have grown past the bound (its next batches reload the hours they
    /// touch), so past the bound each partition drops its own in turn.
    /// Entries loaded since a partition's last write count from its next.
    /// A partition with a preview outstanding keeps its entries: the apply
    /// of the same events keeps the preview's fold, which lives in them.
    fn bound(&self, cache: &mut Cache) {
        if cache.dirty || cache.previewed.is_some() {
            return;
        }
        let entries = cache.hours.len() + cache.watermarks.len();
        let before = self.cached_entries.fetch_add(entries, Ordering::Relaxed);
        self.cached_entries.fetch_sub(cache.counted, Ordering::Relaxed);
        let total = (before + entries).saturating_sub(cache.counted);
        cache.counted = entries;
        if total > self.cache_max_entries {
            cache.hours.clear();
            cache.watermarks.clear();
            self.cached_entries.fetch_sub(entries, Ordering::Relaxed);
            cache.counted = 0;
        }
    }

    /// Brings into `partition`'s cache every hour and counter `events` can
    /// touch (read from the store when the cache does not know them; a
    /// known absence is cached as `None`) and returns each event's shared
    /// counter, in event order. Each counter is found by reference (see
    /// [`CounterRef`]); one is built only for a counter the cache has never
    /// seen.
    fn load(
        &self,
        cache: &mut Cache,
        partition: i32,
        events: &[(&UsageEvent, i64)],
    ) -> Result<Vec<Arc<CounterKey>>, LedgerError> {
        let mut resolved = Vec::with_capacity(events.len());
        let mut missing_hours: Vec<HourKey> = Vec::new();
        let mut missing_counters: Vec<Arc<CounterKey>> = Vec::new();
        let (hours_held, watermarks_held) = (&mut cache.hours, &mut cache.watermarks);
        for (e, _) in events {
            let counter = match watermarks_held.get_key_value(&CounterRef::of(e)) {
                Some((counter, _)) => counter.clone(),
                None => {
                    // Absent until the read below says otherwise, so an
                    // event of the same counter later in the batch does not
                    // ask again.
                    let counter = Arc::new(CounterKey::of(e));
                    watermarks_held.insert(counter.clone(), WatermarkSlot::default());
                    missing_counters.push(counter.clone());
                    counter
                }
            };
            let hour_ms = hour_of(e.timestamp_ms);
            if !hours_held.contains_key(&HourRef { counter: &counter, hour_ms }) {
                let hour = HourKey { counter: counter.clone(), hour_ms };
                hours_held.insert(hour.clone(), HourSlot::default());
                missing_hours.push(hour);
            }
            resolved.push(counter);
        }
        if missing_hours.is_empty() && missing_counters.is_empty() {
            return Ok(resolved);
        }
        // Sorted: RocksDB reads a sorted batch of keys block by block.
        missing_hours.sort_unstable();
        missing_counters.sort_unstable();
        match self.read_missing(partition, &missing_hours, &missing_counters) {
            Ok((hours, watermarks)) => {
                for (key, value) in missing_hours.into_iter().zip(hours) {
                    hours_held.insert(key, HourSlot { rollup: value.map(Box::new), fold: 0 });
                }
                for (counter, value) in missing_counters.into_iter().zip(watermarks) {
                    watermarks_held.insert(counter, WatermarkSlot { ms: value, fold: 0 });
                }
                Ok(resolved)
            }
            Err(e) => {
                // The placeholders say "absent" without having asked.
                for key in &missing_hours {
                    hours_held.remove(key);
                }
                for counter in &missing_counters {
                    watermarks_held.remove(counter);
                }
                Err(e)
            }
        }
    }

    /// The stored rollups of `hours` and watermarks of `counters`, in order.
    #[allow(clippy::type_complexity)]
    fn read_missing(
        &self,
        partition: i32,
        hours: &[HourKey],
        counters: &[Arc<CounterKey>],
    ) -> Result<(Vec<Option<Rollup>>, Vec<Option<i64>>), LedgerError> {
        let rollups = self
            .db
            .multi_get(hours.iter().map(|k| hour_key(k, partition)))
            .into_iter()
            .map(|v| v.map_err(self.rocks())?.map(|v| decode_rollup(&v)).transpose())
            .collect::<Result<_, _>>()?;
        let watermarks = self
            .db
            .multi_get(counters.iter().map(|c| watermark_key(partition, c)))
            .into_iter()
            .map(|v| v.map_err(self.rocks())?.map(|v| read_i64(&v, "watermark")).transpose())
            .collect::<Result<_, _>>()?;
        Ok((rollups, watermarks))
    }

    /// Every rollup of `tenant` (and `customer`, when given), of every
    /// partition, in key order: one range scan.
    pub fn rollups(
        &self,
        tenant_id: &str,
        customer_id: Option<&str>,
        f: impl FnMut(HourKey, i32, Rollup),
    ) -> Result<(), LedgerError> {
        let mut prefix = vec![b'H'];
        push_str(&mut prefix, tenant_id);
        if let Some(c) = customer_id {
            push_str(&mut prefix, c);
        }
        self.rollups_under(&prefix, f)
    }

    /// Every rollup of every tenant and partition.
    pub fn all_rollups(&self, f: impl FnMut(HourKey, i32, Rollup)) -> Result<(), LedgerError> {
        self.rollups_under(b"H", f)
    }

    /// One tenant's rollups (of `customer`, when given) and adjustments as
    /// of one moment: read from one snapshot, after writing what is
    /// pending. Two reads at two moments could pair one batch's late
    /// adjustments with hours from before its on-time events.
    pub fn tenant_ledger(&self, tenant_id: &str, customer_id: Option<&str>) -> Result<TenantLedger, LedgerError> {
        self.write_pending()?;
        let snapshot = self.db.snapshot();
        let mut prefix = vec![b'H'];
        push_str(&mut prefix, tenant_id);
        if let Some(c) = customer_id {
            push_str(&mut prefix, c);
        }
        let mut rollups = Vec::new();
        self.scan_rollups(&snapshot, &prefix, |k, _, r| rollups.push((k, r)))?;
        let mut prefix = vec![b'A'];
        push_str(&mut prefix, tenant_id);
        let adjustments = self.scan_adjustments(&snapshot, &prefix)?.into_iter().map(|(_, a)| a).collect();
        Ok((rollups, adjustments))
    }

    fn rollups_under(&self, prefix: &[u8], f: impl FnMut(HourKey, i32, Rollup)) -> Result<(), LedgerError> {
        self.write_pending()?;
        self.scan_rollups(&self.db.snapshot(), prefix, f)
    }

    fn scan_rollups(
        &self,
        snapshot: &rocksdb::Snapshot<'_>,
        prefix: &[u8],
        mut f: impl FnMut(HourKey, i32, Rollup),
    ) -> Result<(), LedgerError> {
        for item in snapshot.iterator(IteratorMode::From(prefix, Direction::Forward)) {
            let (k, v) = item.map_err(self.rocks())?;
            if !k.starts_with(prefix) {
                break;
            }
            let (key, partition) = decode_hour_key(&k)?;
            f(key, partition, decode_rollup(&v)?);
        }
        Ok(())
    }

    /// Every adjustment of `tenant`, in period order.
    pub fn adjustments(&self, tenant_id: &str) -> Result<Vec<Adjustment>, LedgerError> {
        let mut prefix = vec![b'A'];
        push_str(&mut prefix, tenant_id);
        Ok(self.adjustments_under(&prefix)?.into_iter().map(|(_, a)| a).collect())
    }

    /// Every adjustment of every tenant, with its partition.
    pub fn all_adjustments(&self) -> Result<Vec<(i32, Adjustment)>, LedgerError> {
        self.adjustments_under(b"A")
    }

    fn adjustments_under(&self, prefix: &[u8]) -> Result<Vec<(i32, Adjustment)>, LedgerError> {
        self.write_pending()?;
        self.scan_adjustments(&self.db.snapshot(), prefix)
    }

    fn scan_adjustments(
        &self,
        snapshot: &rocksdb::Snapshot<'_>,
        prefix: &[u8],
    ) -> Result<Vec<(i32, Adjustment)>, LedgerError> {
        let mut out = Vec::new();
        for item in snapshot.iterator(IteratorMode::From(prefix, Direction::Forward)) {
            let (k, v) = item.map_err(self.rocks())?;
            if !k.starts_with(prefix) {
                break;
            }
            let partition = decode_adjustment_partition(&k)?;
            out.push((partition, decode_adjustment(&v)?));
        }
        Ok(out)
    }

    /// Reads every entry with block checksums verified and decodes it:
    /// `dedupd verify`. Returns how many entries there are.
    pub fn verify(&self) -> Result<u64, LedgerError> {
        let mut read = rocksdb::ReadOptions::default();
        read.set_verify_checksums(true);
        let mut n = 0;
        for item in self.db.iterator_opt(IteratorMode::Start, read) {
            let (k, v) = item.map_err(self.rocks())?;
            match k.first() {
                Some(b'H') => {
                    decode_hour_key(&k)?;
                    decode_rollup(&v)?;
                }
                Some(b'A') => {
                    decode_adjustment_partition(&k)?;
                    decode_adjustment(&v)?;
                }
                Some(b'W') => {
                    read_i64(&v, "watermark")?;
                }
                Some(b'C') => {
                    read_i64(&v, "checkpoint")?;
                }
                Some(b'S') => {
                    decode_segment_entry(&k, &v)?;
                }
                _ => return Err(LedgerError::Corrupt { what: "key", detail: format!("unknown key kind {k:?}") }),
            }
            n += 1;
        }
        Ok(n)
    }

    /// Writes what is pending and makes every write durable (at shutdown).
    pub fn flush(&self) -> Result<(), LedgerError> {
        self.write_pending()?;
        self.db.flush_wal(true).map_err(self.rocks())?;
        self.db.flush().map_err(self.rocks())
    }
}

// ---- keys ----

fn push_str(out: &mut Vec<u8>, s: &str) {
    // Fields are bounded by max_field_bytes (default 1 KiB) well below 64 KiB.
    let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&s.as_bytes()[..usize::from(len)]);
}

fn flip(v: i64) -> [u8; 8] {
    ((v as u64) ^ (1 << 63)).to_be_bytes()
}

fn flip32(v: i32) -> [u8; 4] {
    ((v as u32) ^ (1 << 31)).to_be_bytes()
}

fn push_counter(out: &mut Vec<u8>, c: &CounterKey) {
    push_str(out, &c.tenant_id);
    push_str(out, &c.customer_id);
    push_str(out, &c.meter);
}

/// Encodes into a buffer of its caller's (see [`Puts`]), or a new one.
fn encoded(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::new();
    f(&mut out);
    out
}

fn push_hour_key(out: &mut Vec<u8>, k: &HourKey, partition: i32) {
    out.push(b'H');
    push_counter(out, &k.counter);
    out.extend_from_slice(&flip(k.hour_ms));
    out.extend_from_slice(&flip32(partition));
}

fn hour_key(k: &HourKey, partition: i32) -> Vec<u8> {
    encoded(|out| push_hour_key(out, k, partition))
}

fn push_watermark_key(out: &mut Vec<u8>, partition: i32, c: &CounterKey) {
    out.push(b'W');
    out.extend_from_slice(&flip32(partition));
    push_counter(out, c);
}

fn watermark_key(partition: i32, c: &CounterKey) -> Vec<u8> {
    encoded(|out| push_watermark_key(out, partition, c))
}

fn push_adjustment_key(out: &mut Vec<u8>, a: &Adjustment, partition: i32) {
    push_adjustment_key_of(out, &a.counter.tenant_id, a.period, partition, a.output_offset);
}

fn push_adjustment_key_of(out: &mut Vec<u8>, tenant_id: &str, period: Period, partition: i32, output_offset: i64) {
    out.push(b'A');
    push_str(out, tenant_id);
    out.extend_from_slice(&flip32(period.year));
    out.push(period.month);
    out.extend_from_slice(&flip32(partition));
    out.extend_from_slice(&flip(output_offset));
}

fn push_checkpoint_key(out: &mut Vec<u8>, partition: i32) {
    out.push(b'C');
    out.extend_from_slice(&flip32(partition));
}

fn checkpoint_key(partition: i32) -> Vec<u8> {
    encoded(|out| push_checkpoint_key(out, partition))
}

fn push_segment_key(out: &mut Vec<u8>, partition: i32) {
    out.push(b'S');
    out.extend_from_slice(&flip32(partition));
}

/// A write's keys and values, encoded one after another into one buffer
/// (a write puts tens of thousands of small entries; two allocations each
/// were a fifth of its cost), put in key order.
#[derive(Default)]
struct Puts {
    bytes: Vec<u8>,
    /// Where each entry's key starts, where its value starts, where it ends.
    entries: Vec<(usize, usize, usize)>,
}

impl Puts {
    fn add(&mut self, key: impl FnOnce(&mut Vec<u8>), value: impl FnOnce(&mut Vec<u8>)) {
        let start = self.bytes.len();
        key(&mut self.bytes);
        let value_start = self.bytes.len();
        value(&mut self.bytes);
        self.entries.push((start, value_start, self.bytes.len()));
    }

    /// Key order: RocksDB's memtable inserts a sorted run far faster than
    /// scattered keys (each insert starts where the last one ended).
    fn into_batch(mut self) -> WriteBatch {
        let bytes = &self.bytes;
        self.entries.sort_unstable_by(|a, b| bytes[a.0..a.1].cmp(&bytes[b.0..b.1]));
        let mut batch = WriteBatch::default();
        for (k, v, end) in &self.entries {
            batch.put(&bytes[*k..*v], &bytes[*v..*end]);
        }
        batch
    }
}

/// Reads fields back out of a key or value, every read bounds-checked.
struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], LedgerError> {
        if self.bytes.len() < n {
            return Err(LedgerError::Corrupt { what: self.what, detail: format!("truncated: {n} bytes wanted") });
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, LedgerError> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, LedgerError> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn i64(&mut self) -> Result<i64, LedgerError> {
        Ok((self.u64()? ^ (1 << 63)) as i64)
    }
    fn i32(&mut self) -> Result<i32, LedgerError> {
        let raw = u32::from_be_bytes(self.take(4)?.try_into().unwrap_or_default());
        Ok((raw ^ (1 << 31)) as i32)
    }
    fn str(&mut self) -> Result<String, LedgerError> {
        let len = u16::from_be_bytes(self.take(2)?.try_into().unwrap_or_default());
        let b = self.take(usize::from(len))?;
        String::from_utf8(b.to_vec())
            .map_err(|_| LedgerError::Corrupt { what: self.what, detail: "a string is not UTF-8".into() })
    }
    fn decimal(&mut self) -> Result<Decimal, LedgerError> {
        let b: [u8; 16] = self.take(16)?.try_into().unwrap_or_default();
        Ok(Decimal::deserialize(b))
    }
    fn end(&self) -> Result<(), LedgerError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(LedgerError::Corrupt { what: self.what, detail: format!("{} trailing bytes", self.bytes.len()) })
        }
    }
}

/// An `S` entry: its partition and segment id.
fn decode_segment_entry(k: &[u8], v: &[u8]) -> Result<(i32, u64), LedgerError> {
    let mut key = Reader { bytes: k.get(1..).unwrap_or_default(), what: "segment id key" };
    let partition = key.i32()?;
    key.end()?;
    let mut value = Reader { bytes: v, what: "segment id" };
    let segment = value.u64()?;
    value.end()?;
    Ok((partition, segment))
}

fn read_i64(b: &[u8], what: &'static str) -> Result<i64, LedgerError> {
    let mut r = Reader { bytes: b, what };
    let v = r.i64()?;
    r.end()?;
    Ok(v)
}

fn decode_hour_key(k: &[u8]) -> Result<(HourKey, i32), LedgerError> {
    let mut r = Reader { bytes: k, what: "rollup key" };
    r.u8()?;
    let counter = CounterKey::new(r.str()?, r.str()?, r.str()?);
    let hour_ms = r.i64()?;
    let partition = r.i32()?;
    r.end()?;
    Ok((HourKey { counter: Arc::new(counter), hour_ms }, partition))
}

fn decode_adjustment_partition(k: &[u8]) -> Result<i32, LedgerError> {
    let mut r = Reader { bytes: k, what: "adjustment key" };
    r.u8()?;
    r.str()?;
    r.i32()?;
    r.u8()?;
    let partition = r.i32()?;
    r.i64()?;
    r.end()?;
    Ok(partition)
}

// ---- values ----

fn push_rollup(out: &mut Vec<u8>, r: &Rollup) {
    out.push(ROLLUP_VERSION);
    out.extend_from_slice(&r.sum.serialize());
    out.extend_from_slice(&r.count.to_be_bytes());
    out.extend_from_slice(&r.corrections.to_be_bytes());
    match r.max {
        Some(m) => {
            out.push(1);
            out.extend_from_slice(&m.serialize());
        }
        None => out.push(0),
    }
    match r.last {
        Some((t, q)) => {
            out.push(1);
            out.extend_from_slice(&flip(t));
            out.extend_from_slice(&q.serialize());
        }
        None => out.push(0),
    }
    out.extend_from_slice(&flip(r.latest_event_ms));
}

fn decode_rollup(b: &[u8]) -> Result<Rollup, LedgerError> {
    let mut r = Reader { bytes: b, what: "rollup" };
    let version = r.u8()?;
    if version != ROLLUP_VERSION {
        return Err(LedgerError::Corrupt { what: "rollup", detail: format!("unknown version {version}") });
    }
    let sum = r.decimal()?;
    let count = r.u64()?;
    let corrections = r.u64()?;
    let max = if r.u8()? == 1 { Some(r.decimal()?) } else { None };
    let last = if r.u8()? == 1 { Some((r.i64()?, r.decimal()?)) } else { None };
    let latest_event_ms = r.i64()?;
    r.end()?;
    Ok(Rollup { sum, count, corrections, max, last, latest_event_ms })
}

fn push_adjustment(out: &mut Vec<u8>, a: &Adjustment) {
    out.push(ADJUSTMENT_VERSION);
    push_counter(out, &a.counter);
    out.extend_from_slice(&flip32(a.period.year));
    out.push(a.period.month);
    push_str(out, &a.event_id);
    out.push(a.kind.code());
    out.extend_from_slice(&a.amount.serialize());
    out.extend_from_slice(&flip(a.event_ms));
    out.push(match a.reason {
        AdjustmentReason::Late => 0,
        AdjustmentReason::SumLimit => 1,
    });
    out.extend_from_slice(&flip(a.output_offset));
}

fn decode_adjustment(b: &[u8]) -> Result<Adjustment, LedgerError> {
    let corrupt = |detail: String| LedgerError::Corrupt { what: "adjustment", detail };
    let mut r = Reader { bytes: b, what: "adjustment" };
    let version = r.u8()?;
    if version != ADJUSTMENT_VERSION {
        return Err(corrupt(format!("unknown version {version}")));
    }
    let counter = CounterKey::new(r.str()?, r.str()?, r.str()?);
    let period = Period { year: r.i32()?, month: r.u8()? };
    let event_id = r.str()?;
    let kind = EventKind::from_code(r.u8()?).ok_or_else(|| corrupt("unknown event kind".into()))?;
    let amount = r.decimal()?;
    let event_ms = r.i64()?;
    let reason = match r.u8()? {
        0 => AdjustmentReason::Late,
        1 => AdjustmentReason::SumLimit,
        other => return Err(corrupt(format!("unknown reason {other}"))),
    };
    let output_offset = r.i64()?;
    r.end()?;
    Ok(Adjustment { counter, period, event_id, kind, amount, event_ms, reason, output_offset })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{LedgerMaps, HOUR_MS};
    use crate::storage::testutil::sample_event_at;

    /// Six events of partition 3, a second apart, at offsets 0 to 5.
    fn six_events() -> Vec<UsageEvent> {
        let t = 1_700_000_000_000;
        (0..6).map(|i| sample_event_at(i, 3, i as i64, t + i as i64 * 1000).event).collect()
    }

    /// The default lateness, and `events` folded by it: the model a store
    /// must end up holding.
    fn folded(events: &[(&UsageEvent, i64)]) -> (Lateness, LedgerMaps) {
        let lateness = Lateness::default();
        let mut model = LedgerMaps::default();
        model.fold(&lateness, events.iter().copied()).expect("fold");
        (lateness, model)
    }

    #[test]
    fn apply_is_idempotent_by_offset_and_a_crash_loses_nothing_applied() {
        let dir = tempfile::tempdir().expect("tempdir");
        let events = six_events();
        let with_offsets: Vec<(&UsageEvent, i64)> = events.iter().zip(0..).collect();
        let (lateness, model) = folded(&with_offsets);
        {
            let store = LedgerStore::open(dir.path()).expect("open");
            store.apply(3, &lateness, &with_offsets[..3]).expect("apply");
            store.write_pending().expect("write");
            store.apply(3, &lateness, &with_offsets[3..4]).expect("apply");
            assert_eq!(store.checkpoint(3).expect("checkpoint"), Some(3), "folded counts within the process");
            // Dropped without a flush: a crash.
        }
        {
            let store = LedgerStore::open(dir.path()).expect("reopen");
            // Local state folds the unwritten batch again from the usage
            // store; the store alone keeps exactly what it wrote.
            assert_eq!(store.checkpoint(3).expect("checkpoint"), Some(2), "what was written survives a crash");
            // Repair replays from before the checkpoint; a replay overlapping
            // what is held folds only the new offsets.
            store.apply(3, &lateness, &with_offsets).expect("apply again");
            assert_eq!(store.checkpoint(3).expect("checkpoint"), Some(5));
            store.write_pending().expect("write");
        }
        let store = LedgerStore::open(dir.path()).expect("reopen");
        let mut held = std::collections::BTreeMap::new();
        store.rollups(&events[0].tenant_id, None, |k, p, r| assert!(held.insert((k, p), r).is_none())).expect("scan");
        let want: std::collections::BTreeMap<_, _> = model
            .hours
            .into_iter()
            .filter(|(k, _)| k.counter.tenant_id == events[0].tenant_id)
            .map(|(k, r)| ((k, 3), r))
            .collect();
        assert!(want.len() >= 2, "the scan covers more than one customer of the tenant");
        assert_eq!(held, want);
    }

    #[test]
    fn a_failed_write_keeps_its_changes_pending_for_the_next_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Each event its own customer, so each batch touches hours no other
        // batch does: a batch dropped from the write would be missing whole.
        let events = six_events();
        let with_offsets: Vec<(&UsageEvent, i64)> = events.iter().zip(0..).collect();
        let (lateness, model) = folded(&with_offsets);
        {
            let store = LedgerStore::open(dir.path()).expect("open");
            store.apply(3, &lateness, &with_offsets[..2]).expect("apply");
            store.write_pending().expect("write");
            store.apply(3, &lateness, &with_offsets[2..4]).expect("apply");
            store.fail_next_write.store(true, Ordering::Relaxed);
            assert!(matches!(store.write_pending(), Err(LedgerError::InjectedWriteFailure)));
            store.apply(3, &lateness, &with_offsets[4..]).expect("apply");
            store.write_pending().expect("the disk has room again");
            // Dropped without a flush: a crash right after the write.
        }
        let store = LedgerStore::open(dir.path()).expect("reopen");
        assert_eq!(store.checkpoint(3).expect("checkpoint"), Some(5));
        let mut held = std::collections::BTreeMap::new();
        store.all_rollups(|k, p, r| assert!(held.insert((k, p), r).is_none())).expect("scan");
        let want: std::collections::BTreeMap<_, _> = model.hours.into_iter().map(|(k, r)| ((k, 3), r)).collect();
        assert_eq!(held, want, "the hours of the batch whose write failed were written by the next one");
    }

    /// Partitions fold side by side: a partition's preview and apply never
    /// wait for another partition's cache. Partition 1's is held (as a
    /// long fold would hold it) while partition 2 previews and applies on
    /// another thread. Both are then written.
    #[test]
    fn a_partition_folds_while_another_partition_holds_its_cache() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = LedgerStore::open(dir.path()).expect("open");
        let events = six_events();
        let with_offsets: Vec<(&UsageEvent, i64)> = events.iter().zip(0..).collect();
        let lateness = Lateness::default();
        store.apply(1, &lateness, &with_offsets[..3]).expect("apply");
        let one = store.cache(1);
        let held = lock(&one);
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let (store, with_offsets, lateness) = (&store, &with_offsets, &lateness);
            scope.spawn(move || {
                drop(store.preview(2, lateness, with_offsets, &[]).expect("preview"));
                store.apply(2, lateness, with_offsets).expect("apply");
                done.send(store.checkpoint(2).expect("checkpoint")).expect("send");
            });
            let checkpoint = finished.recv_timeout(std::time::Duration::from_secs(60));
            drop(held);
            assert_eq!(checkpoint, Ok(Some(5)), "partition 2 folded while partition 1's cache was held");
        });
        store.write_pending().expect("write");
        drop(store);
        let store = LedgerStore::open(dir.path()).expect("reopen");
        assert_eq!(store.checkpoint(1).expect("checkpoint"), Some(2));
        assert_eq!(store.checkpoint(2).expect("checkpoint"), Some(5));
    }

    /// A revoked partition's cache is written and forgotten: nothing of
    /// it stays in memory or in the bound's count, and what it folded is
    /// what a later fold (here, after a crash) starts from.
    #[test]
    fn a_released_partition_is_written_and_forgotten() {
        let dir = tempfile::tempdir().expect("tempdir");
        let events = six_events();
        let with_offsets: Vec<(&UsageEvent, i64)> = events.iter().zip(0..).collect();
        let lateness = Lateness::default();
        {
            let store = LedgerStore::open(dir.path()).expect("open");
            store.apply(3, &lateness, &with_offsets[..2]).expect("apply");
            store.write_pending().expect("write");
            store.apply(3, &lateness, &with_offsets[2..]).expect("apply");
            store.apply(4, &lateness, &with_offsets).expect("apply");
            store.release(3).expect("release");
            let held: Vec<i32> = store.caches().into_iter().map(|(p, _)| p).collect();
            assert_eq!(held, [4]);
            assert_eq!(store.cached_entries.load(Ordering::Relaxed), 0, "only partition 4's entries, not yet counted");
            // Dropped without a flush: a crash.
        }
        let store = LedgerStore::open(dir.path()).expect("reopen");
        assert_eq!(store.checkpoint(3).expect("checkpoint"), Some(5), "released, so written");
        assert_eq!(store.checkpoint(4).expect("checkpoint"), None, "never written");
    }

    /// Past the bound on cached entries, each partition drops its clean
    /// entries at its write, and its next folds read them back from the
    /// store: totals are those of a cache that never forgot.
    #[test]
    fn partitions_past_the_cache_bound_forget_and_reload_their_hours() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = LedgerStore::open(dir.path()).expect("open");
        store.cache_max_entries = 3;
        let t = 1_700_000_000_000;
        // Two partitions, the same two counters each (one tenant and meter,
        // two customers), over three hours that rounds 3 to 5 visit again:
        // each round's fold finds the hours and watermarks it touches
        // dropped by the last write and reads them back, and an hour read
        // back wrong would be written over with that round's events alone.
        let events: Vec<(i32, UsageEvent)> = (0..24u64)
            .map(|i| {
                let p = i32::try_from(i % 2).expect("partition");
                let mut e = sample_event_at(i, p, 0, t).event;
                e.tenant_id = "acme".into();
                e.meter = "api_calls".into();
                e.customer_id = format!("cus_{}", i % 4 / 2);
                e.timestamp_ms = t + ((i / 4) % 3) as i64 * HOUR_MS;
                (p, e)
            })
            .collect();
        let lateness = Lateness::default();
        let mut models: [LedgerMaps; 2] = Default::default();
        for (round, chunk) in events.chunks(4).enumerate() {
            for p in 0..2 {
                let mine: Vec<(&UsageEvent, i64)> = chunk
                    .iter()
                    .filter(|(q, _)| *q == p)
                    .enumerate()
                    .map(|(i, (_, e))| (e, (round * 2 + i) as i64))
                    .collect();
                store.apply(p, &lateness, &mine).expect("apply");
                models[p as usize].fold(&lateness, mine.iter().copied()).expect("fold");
            }
            store.write_pending().expect("write");
            assert_eq!(store.cached_entries.load(Ordering::Relaxed), 0, "round {round}: past the bound, dropped");
            for (p, cache) in store.caches() {
                assert!(lock(&cache).hours.is_empty(), "round {round}: partition {p} kept hours it had written");
            }
        }
        let mut held = std::collections::BTreeMap::new();
        store.all_rollups(|k, p, r| assert!(held.insert((k, p), r).is_none())).expect("scan");
        let want: std::collections::BTreeMap<_, _> =
            models.into_iter().zip(0..).flat_map(|(m, p)| m.hours.into_iter().map(move |(k, r)| ((k, p), r))).collect();
        assert_eq!(held, want);
    }

    /// An event of `tenant` with id `id` at `ts`.
    fn event(tenant: &str, id: &str, ts: i64) -> UsageEvent {
        let mut e = sample_event_at(0, 3, 0, ts).event;
        e.tenant_id = tenant.to_owned();
        e.event_id = id.to_owned();
        e.timestamp_ms = ts;
        e
    }

    /// Replays are found again whether their fold is still pending or
    /// written, and after a restart (an empty cache): the hours' current
    /// rollups, and each late one's adjustment by its own identity and
    /// output offset, never another tenant's of the same id.
    #[test]
    fn a_replay_brings_back_its_hours_rollup_and_its_adjustment_written_or_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = 1_700_000_000_000;
        let lateness = Lateness::default();
        let on_time = [event("acme", "evt_a", t), event("globex", "evt_b", t)];
        let late = [event("acme", "evt_x", t - 49 * HOUR_MS), event("globex", "evt_x", t - 49 * HOUR_MS)];
        let replays = [(&on_time[0], 0), (&late[1], 3)];
        let seen = |p: &Preview| {
            let hours: Vec<(String, i64, Decimal)> =
                p.rollups().map(|(k, r)| (k.counter.tenant_id.clone(), k.hour_ms, r.sum)).collect();
            let adjustments: Vec<(String, i64)> =
                p.republished.iter().map(|a| (a.counter.tenant_id.clone(), a.output_offset)).collect();
            (hours, adjustments, p.folded.hours.len(), p.folded.adjustments.len())
        };
        let want = (vec![("acme".to_owned(), hour_of(t), on_time[0].quantity)], vec![("globex".to_owned(), 3)], 0, 0);
        {
            let store = LedgerStore::open(dir.path()).expect("open");
            store.apply(3, &lateness, &[(&on_time[0], 0), (&on_time[1], 1)]).expect("apply");
            store.apply(3, &lateness, &[(&late[0], 2), (&late[1], 3)]).expect("apply");
            assert_eq!(seen(&store.preview(3, &lateness, &[], &replays).expect("preview")), want, "pending");
            store.write_pending().expect("write");
            assert_eq!(seen(&store.preview(3, &lateness, &[], &replays).expect("preview")), want, "written");
        }
        let store = LedgerStore::open(dir.path()).expect("reopen");
        assert_eq!(seen(&store.preview(3, &lateness, &[], &replays).expect("preview")), want, "reopened");
        // Replays fold nothing: the checkpoint and the totals are unchanged.
        assert_eq!(store.checkpoint(3).expect("checkpoint"), Some(3));
    }

    #[test]
    fn a_previewed_late_event_keeps_its_own_output_offset_when_two_tenants_share_its_id() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = LedgerStore::open(dir.path()).expect("open");
        let t = 1_700_000_000_000;
        let on_time = [event("acme", "evt_a", t), event("globex", "evt_b", t)];
        let lateness = Lateness::default();
        store.apply(3, &lateness, &[(&on_time[0], 0), (&on_time[1], 1)]).expect("apply");
        // The same id in two tenants: two identities, both later than L.
        let late = [event("acme", "evt_x", t - 49 * HOUR_MS), event("globex", "evt_x", t - 49 * HOUR_MS)];
        // As a worker does: previewed before the output offsets are known,
        // then applied with them.
        let preview = store.preview(3, &lateness, &[(&late[0], -1), (&late[1], -1)], &[]).expect("preview");
        assert_eq!(preview.folded.adjustments.len(), 2);
        let folded = store.apply(3, &lateness, &[(&late[0], 2), (&late[1], 3)]).expect("apply");
        let offsets: Vec<(&str, i64)> =
            folded.adjustments.iter().map(|a| (a.counter.tenant_id.as_str(), a.output_offset)).collect();
        assert_eq!(offsets, [("acme", 2), ("globex", 3)]);
        let stored: Vec<(String, i64)> = store
            .all_adjustments()
            .expect("adjustments")
            .into_iter()
            .map(|(_, a)| (a.counter.tenant_id, a.output_offset))
            .collect();
        assert_eq!(stored, [("acme".to_owned(), 2), ("globex".to_owned(), 3)]);
    }

    #[test]
    fn an_event_its_hour_cannot_sum_is_an_adjustment_previewed_and_applied_alike() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = LedgerStore::open(dir.path()).expect("open");
        let t = 1_700_000_000_000;
        let event = |customer: &str, qty: Decimal| {
            let mut e = sample_event_at(0, 3, 0, t).event;
            e.customer_id = customer.to_owned();
            e.kind = EventKind::Usage;
            e.quantity = qty;
            e
        };
        let small = event("c_small", Decimal::from(5));
        let huge = event("c_huge", Decimal::MAX);
        let lateness = Lateness::default();
        // The second huge event would take its hour past the largest exact
        // decimal. It is published already (the preview runs before the
        // publish, the apply after it), so neither may fail: both make it
        // an adjustment, and its hour keeps the first.
        let overflowing = [(&small, 0), (&huge, 1), (&huge, 2)];
        let preview = store.preview(3, &lateness, &overflowing, &[]).expect("preview");
        let previewed: Vec<(AdjustmentReason, i64)> =
            preview.folded.adjustments.iter().map(|a| (a.reason, a.output_offset)).collect();
        assert_eq!(previewed, [(AdjustmentReason::SumLimit, 2)]);
        store.apply(3, &lateness, &overflowing).expect("apply");
        assert_eq!(store.checkpoint(3).expect("checkpoint"), Some(2));
        let mut sums = Vec::new();
        store.all_rollups(|k, _, r| sums.push((k.counter.customer_id.clone(), r.sum, r.count))).expect("scan");
        sums.sort();
        assert_eq!(sums, [("c_huge".to_owned(), Decimal::MAX, 1), ("c_small".to_owned(), Decimal::from(5), 1)]);
        let kept: Vec<(AdjustmentReason, Decimal, i64)> = store
            .all_adjustments()
            .expect("scan")
            .into_iter()
            .map(|(_, a)| (a.reason, a.amount, a.output_offset))
            .collect();
        assert_eq!(kept, [(AdjustmentReason::SumLimit, Decimal::MAX, 2)], "stored as it was previewed");

        // A batch whose first event in an hour is set aside and whose next
        // fits: the hour changes, and is published and written. (The set
        // aside one used up the hour's first touch, and the one that fit
        // changed it unlisted: in the cache only, lost at the next start.)
        let mut retraction = event("c_huge", -Decimal::ONE);
        retraction.kind = EventKind::Retraction;
        let batch = [(&huge, 3), (&retraction, 4)];
        let preview = store.preview(3, &lateness, &batch, &[]).expect("preview");
        let published: Vec<(String, Decimal)> =
            preview.rollups().map(|(k, r)| (k.counter.customer_id.clone(), r.sum)).collect();
        assert_eq!(published, [("c_huge".to_owned(), Decimal::MAX - Decimal::ONE)]);
        store.apply(3, &lateness, &batch).expect("apply");
        store.write_pending().expect("write");
        drop(store);
        let store = LedgerStore::open(dir.path()).expect("reopen");
        let mut sums = Vec::new();
        store.all_rollups(|k, _, r| sums.push((k.counter.customer_id.clone(), r.sum))).expect("scan");
        sums.sort();
        assert_eq!(
            sums,
            [("c_huge".to_owned(), Decimal::MAX - Decimal::ONE), ("c_small".to_owned(), Decimal::from(5))]
        );
    }

    #[test]
    fn a_corrupt_rollup_is_an_error_not_a_zero() {
        let r = Rollup {
            sum: Decimal::new(125, 1),
            count: 2,
            corrections: 1,
            max: Some(Decimal::from(9)),
            last: Some((-5, Decimal::ONE)),
            latest_event_ms: 7,
        };
        let bytes = encoded(|out| push_rollup(out, &r));
        assert_eq!(decode_rollup(&bytes).expect("decode"), r);
        assert!(decode_rollup(&bytes[..bytes.len() - 1]).is_err());
        let mut wrong = bytes.clone();
        wrong[0] = 9;
        assert!(decode_rollup(&wrong).is_err());
    }
}
