//! The key store itself: open, apply, look up, age out, hand partitions off.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;

use rocksdb::{
    BottommostLevelCompaction, Cache, ColumnFamily, ColumnFamilyDescriptor, CompactOptions, FlushOptions,
    IngestExternalFileOptions, SstFileWriter, WriteBatch, WriteOptions, DB,
};

use crate::classify::{HorizonError, IdBuildHasher, LongHorizon, SeenKey};
use crate::event::IdHash;

use super::absent::{AbsentNotes, BumpOnDrop};
use super::codec::{
    checkpoint_key, decode_key, decode_value, encode_key, encode_value, partition_range, FORMAT_VERSION, KEY_LEN,
    MAX_VALUE_LEN, META_FLOOR, META_HISTOGRAM, META_LOGS_WRITTEN, META_VERSION,
};
use super::error::{hex, KeystoreError};
use super::histogram::{cell_key, parse_cell_key, BucketStats, Histogram};
use super::horizon::Floor;
use super::lookups::Lookups;
use super::options::{
    db_options, keys_cf_options, lookup, meta_cf_options, sst_writer_options, total_order, KeyStoreOptions, Tables,
    KEYS_CF, META_CF,
};
use super::recent::{encode_apply, encode_drop, list_logs, read_log, Frame, Layer, Layers, Log, Recent, RECENT_DIR};

/// Share of `max_bytes` the live keys may fill: the rest is headroom for
/// keys already below the floor that compaction has not rewritten yet
/// (about a tenth of the data with leveled compaction's 10x fan-out).
const SIZE_CAP_FILL: f64 = 0.9;

/// Keys per SST file written by [`KeyStore::bulk_load`] (~116 MB at ~58 B/key).
const BULK_FILE_KEYS: u64 = 2_000_000;

/// What one [`KeyStore::age_out`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgeOutReport {
    /// Keys whose `first_seen_ms` is at or below this are gone.
    pub floor_ms: i64,
    /// The floor the horizon alone asks for: `now - horizon`.
    pub horizon_floor_ms: i64,
    /// The floor the size cap asks for, when it binds.
    pub size_floor_ms: Option<i64>,
    /// Keys in the histogram buckets that fell wholly below the floor.
    pub keys_aged_out: u64,
    pub buckets_dropped: usize,
    pub oldest_first_seen_ms: Option<i64>,
    /// `now - oldest_first_seen_ms`: the value of `dedupd_dedupe_window_seconds{tier="keystore"}`.
    pub window_ms: Option<i64>,
    /// The floor lies above the horizon's (the size cap cut, now or before)
    /// and the window is below `window_floor_ms`: page someone.
    pub below_window_floor: bool,
    pub disk_bytes: u64,
}

/// Mutable bookkeeping behind the store's write lock.
struct WriteState {
    histogram: Histogram,
    /// Whether the last `age_out` found the size cap binding.
    size_limited: bool,
}

/// The long-horizon key store: RocksDB under `<state-dir>/keystore`.
///
/// `Send + Sync`, shared by the partition tasks. Reads (`get`,
/// `lookup_many`) take none of the write locks below (a large lookup's
/// parts pass through the lookup helpers' queue, whose lock is held only
/// to push or pop a part). A batch's apply is a read-check-write of
/// its partition's keys (the check is what makes the first delivery win and
/// replays idempotent), so it must not interleave with another write to the
/// same partition, or with a store-wide one: it holds its partition's lock
/// and the store-wide lock shared, so batches of different partitions apply
/// at the same time (RocksDB takes concurrent writers). Store-wide writes
/// (`age_out`, `drop_partition`, `bulk_load`) take the store-wide lock
/// alone. The in-memory histogram has a lock of its own, held only to read
/// or change the counts. So have the notes of what lookups found absent
/// (`absent.rs`): one mutex for every partition, taken twice by each lookup
/// and each apply, held only to read or swap a note, never across I/O, and
/// always the last lock taken. Locks are std locks, held across no I/O other than
/// the RocksDB reads and write batch of one call, never across an await.
pub struct KeyStore {
    db: Arc<DB>,
    /// Threads sharing a large lookup with its caller (see `lookups.rs`).
    /// After `db`, before `_cache`: dropping it joins the helpers, whose
    /// reader holds the last other handle on the database.
    lookups: Lookups,
    dir: PathBuf,
    opts: KeyStoreOptions,
    floor: Floor,
    write_opts: WriteOptions,
    /// Taken shared by a batch's apply, alone by store-wide writes.
    writes: RwLock<()>,
    /// Each partition's apply lock (created on its first apply).
    partition_writes: Mutex<hashbrown::HashMap<i32, Arc<Mutex<()>>>>,
    state: Mutex<WriteState>,
    /// What each partition's last lookup found absent, so the apply of the
    /// batch that lookup classified need not read those keys again (see
    /// `absent.rs` for why a note can be trusted).
    absent: AbsentNotes,
    /// Ids applies have looked up (those no note vouched for), since open.
    apply_reads: std::sync::atomic::AtomicU64,
    /// Keys applied and not yet in RocksDB's files (see `recent.rs`), and
    /// what writing a frozen layer out needs.
    recent: Arc<Recent>,
    spill: Arc<Spill>,
    /// The thread writing the frozen layer out, the last one started.
    spilling: Mutex<Option<JoinHandle<()>>>,
    /// Kept so the block cache outlives every table reader using it.
    _cache: Cache,
}

impl Drop for KeyStore {
    fn drop(&mut self) {
        // A layer being written out is finished (its log is deleted only
        // once it is in); the active layer stays in its log, as after a
        // crash, unless `flush` wrote it out.
        let running = self.spilling.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(thread) = running {
            if thread.join().is_err() {
                tracing::error!("the key store's layer writer panicked");
            }
        }
    }
}

/// Refuses a store directory that lost its `CURRENT` file but holds data
/// (see [`crate::storage::fsutil::rocksdb_data_without_current`]).
pub(crate) fn refuse_lost_current(dir: &Path) -> Result<(), KeystoreError> {
    match crate::storage::fsutil::rocksdb_data_without_current(dir) {
        Ok(None) => Ok(()),
        Ok(Some(found)) => Err(KeystoreError::LostCurrent { dir: dir.to_path_buf(), found }),
        Err(source) => Err(KeystoreError::Io { path: dir.to_path_buf(), source }),
    }
}

impl std::fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyStore").field("dir", &self.dir).field("floor_ms", &self.floor.get()).finish()
    }
}

impl KeyStore {
    /// Opens (creating if needed) the store in `dir`, which is `<state-dir>/keystore`.
    pub fn open(dir: &Path, opts: KeyStoreOptions) -> Result<KeyStore, KeystoreError> {
        opts.validate()?;
        std::fs::create_dir_all(dir).map_err(|source| KeystoreError::Io { path: dir.to_path_buf(), source })?;
        refuse_lost_current(dir)?;
        let floor = Floor::new(i64::MIN);
        let cache = Cache::new_lru_cache(opts.block_cache_bytes);
        let cfs = [
            ColumnFamilyDescriptor::new(KEYS_CF, keys_cf_options(&opts, &cache, floor.clone())),
            ColumnFamilyDescriptor::new(META_CF, meta_cf_options()),
        ];
        let db = DB::open_cf_descriptors(&db_options(&opts), dir, cfs)
            .map_err(|source| KeystoreError::Open { dir: dir.to_path_buf(), source })?;
        let db = Arc::new(db);
        let recent_dir = dir.join(RECENT_DIR);
        std::fs::create_dir_all(&recent_dir)
            .map_err(|source| KeystoreError::Io { path: recent_dir.clone(), source })?;
        let spill = Arc::new(Spill { db: Arc::clone(&db), dir: recent_dir, opts: opts.clone(), floor: floor.clone() });
        // The logs left by the last process: replayed below, once the meta
        // (checkpoints, floor) is loaded. The active layer's log comes after
        // every one of them.
        let logs = list_logs(&spill.dir)?;
        let next_log_seq = logs.last().map_or(1, |(seq, _)| seq + 1);
        let log = Log::create(&spill.dir, next_log_seq, opts.sync_writes)?;
        let recent = Arc::new(Recent::new(Layers {
            active: Layer::new(next_log_seq),
            log,
            frozen: None,
            failed: None,
            next_log_seq: next_log_seq + 1,
        }));
        let lookups = {
            let (db, floor, recent) = (Arc::clone(&db), floor.clone(), Arc::clone(&recent));
            Lookups::start(
                opts.lookup_helpers,
                Box::new(move |partition, ids, out| read_keys(&db, &recent, &floor, partition, ids, out)),
            )
            .map_err(|source| KeystoreError::Io { path: dir.to_path_buf(), source })?
        };
        let mut write_opts = WriteOptions::default();
        write_opts.set_sync(opts.sync_writes);
        let store = KeyStore {
            db,
            lookups,
            dir: dir.to_path_buf(),
            floor,
            write_opts,
            writes: RwLock::new(()),
            partition_writes: Mutex::new(hashbrown::HashMap::new()),
            state: Mutex::new(WriteState { histogram: Histogram::new(opts.histogram_bucket_ms), size_limited: false }),
            absent: AbsentNotes::default(),
            apply_reads: std::sync::atomic::AtomicU64::new(0),
            recent,
            spill,
            spilling: Mutex::new(None),
            opts,
            _cache: cache,
        };
        store.load_meta()?;
        store.replay_logs(&logs)?;
        Ok(store)
    }

    /// Replays the logs the last process left into one layer, writes it
    /// out, and deletes them (see `recent.rs`). Frames at or below their
    /// partition's stored checkpoint were written out before.
    fn replay_logs(&self, logs: &[(u64, PathBuf)]) -> Result<(), KeystoreError> {
        let written = self
            .db
            .get_pinned_cf(self.meta_cf()?, META_LOGS_WRITTEN)
            .map_err(KeystoreError::rocks("read logs written"))?
            .map(|v| be_i64(&v, "logs written", META_LOGS_WRITTEN).map(|s| s as u64))
            .transpose()?
            .unwrap_or(0);
        // The replayed layer is written out as the newest log's.
        let mut layer = Layer::new(logs.last().map_or(0, |(seq, _)| *seq));
        let mut stored: hashbrown::HashMap<i32, Option<i64>> = hashbrown::HashMap::new();
        for (_, path) in logs.iter().filter(|(seq, _)| *seq > written) {
            let (frames, used, damaged) = read_log(path)?;
            for frame in frames {
                match frame {
                    Frame::Apply { partition, checkpoint, keys } => {
                        let at = match stored.get(&partition) {
                            Some(c) => *c,
                            None => *stored.entry(partition).or_insert(self.stored_checkpoint(partition)?),
                        };
                        let replayed = layer.checkpoints.get(&partition).copied().or(at);
                        if replayed.is_none_or(|c| c < checkpoint) {
                            layer.apply(partition, checkpoint, &keys, self.opts.histogram_bucket_ms);
                        }
                    }
                    Frame::Drop { partition } => layer.drop_partition(partition),
                }
            }
            if damaged {
                // Everything after it was written after it: the frames read
                // are a prefix of the applies, and repair brings the rest.
                tracing::warn!(
                    log = %path.display(),
                    good_bytes = used,
                    "the key store's log ends in a torn or damaged frame; replayed up to it, later logs ignored"
                );
                break;
            }
        }
        if !layer.is_empty() {
            self.spill.write_out(&layer)?;
            let (mut st, floor) = (self.lock(), self.floor.get());
            for ((bucket, partition), s) in layer.cells.iter().filter(|(_, s)| s.max_ms > floor) {
                st.histogram.add(*bucket, *partition, s);
            }
        }
        for (_, path) in logs {
            std::fs::remove_file(path).map_err(|source| KeystoreError::Io { path: path.clone(), source })?;
        }
        // A layer's SST left by a write-out the last process did not finish
        // (ingested files are moved into RocksDB's directory): nothing uses
        // it, and its keys are in a log replayed above.
        let io = |path: PathBuf| move |source| KeystoreError::Io { path, source };
        for entry in std::fs::read_dir(&self.spill.dir).map_err(io(self.spill.dir.clone()))? {
            let path = entry.map_err(io(self.spill.dir.clone()))?.path();
            if path.extension().is_some_and(|e| e == "sst") {
                std::fs::remove_file(&path).map_err(io(path.clone()))?;
            }
        }
        Ok(())
    }

    /// The checkpoint RocksDB's meta holds for `partition` (the layers'
    /// are newer).
    fn stored_checkpoint(&self, partition: i32) -> Result<Option<i64>, KeystoreError> {
        let key = checkpoint_key(partition);
        self.db
            .get_pinned_cf(self.meta_cf()?, key)
            .map_err(KeystoreError::rocks("read checkpoint"))?
            .map(|v| be_i64(&v, "checkpoint", &key))
            .transpose()
    }

    fn keys_cf(&self) -> Result<&ColumnFamily, KeystoreError> {
        self.db.cf_handle(KEYS_CF).ok_or(KeystoreError::MissingColumnFamily { name: KEYS_CF })
    }

    fn meta_cf(&self) -> Result<&ColumnFamily, KeystoreError> {
        self.db.cf_handle(META_CF).ok_or(KeystoreError::MissingColumnFamily { name: META_CF })
    }

    fn lock(&self) -> MutexGuard<'_, WriteState> {
        // A panic while holding the lock leaves only in-memory counts that
        // the next open rebuilds from RocksDB; carrying on is safe.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The store-wide write lock, shared: a batch's apply. (The locks
    /// guard no data of their own: a panic under them leaves nothing half
    /// done that RocksDB's atomic write batches did not already settle.)
    fn apply_writes(&self) -> RwLockReadGuard<'_, ()> {
        self.writes.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The store-wide write lock, alone: age-out, dropping or bulk-loading
    /// a partition.
    fn store_writes(&self) -> RwLockWriteGuard<'_, ()> {
        self.writes.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// `partition`'s apply lock.
    fn partition_writes(&self, partition: i32) -> Arc<Mutex<()>> {
        let mut all = self.partition_writes.lock().unwrap_or_else(PoisonError::into_inner);
        all.entry(partition).or_default().clone()
    }

    fn load_meta(&self) -> Result<(), KeystoreError> {
        let meta = self.meta_cf()?;
        match self.db.get_cf(meta, META_VERSION).map_err(KeystoreError::rocks("read format version"))? {
            None => self
                .db
                .put_cf_opt(meta, META_VERSION, FORMAT_VERSION.to_be_bytes(), &self.write_opts)
                .map_err(KeystoreError::rocks("write format version"))?,
            Some(v) if v.as_slice() == FORMAT_VERSION.to_be_bytes() => {}
            Some(_) => {
                return Err(KeystoreError::Corrupt {
                    what: "format version",
                    key_hex: hex(META_VERSION),
                    detail: "unsupported key store format version",
                })
            }
        }
        if let Some(f) = self.db.get_cf(meta, META_FLOOR).map_err(KeystoreError::rocks("read floor"))? {
            self.floor.raise_to(be_i64(&f, "floor", META_FLOOR)?);
        }
        let mut st = self.lock();
        let mut it = self.db.raw_iterator_cf(meta);
        it.seek([META_HISTOGRAM]);
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            if k.first() != Some(&META_HISTOGRAM) {
                break;
            }
            let corrupt = |detail| KeystoreError::Corrupt { what: "histogram cell", key_hex: hex(k), detail };
            let (bucket, partition) = parse_cell_key(k).ok_or_else(|| corrupt("bad key"))?;
            let stats = BucketStats::decode(v).ok_or_else(|| corrupt("bad value"))?;
            st.histogram.add(bucket, partition, &stats);
            it.next();
        }
        it.status().map_err(KeystoreError::rocks("scan histogram"))?;
        Ok(())
    }

    /// The checkpoint of `partition`: the output offset of the last record
    /// applied, or `None` if nothing was ever applied (or it was dropped).
    pub fn checkpoint(&self, partition: i32) -> Result<Option<i64>, KeystoreError> {
        if let Some(c) = self.recent.lock().checkpoint(partition) {
            return Ok(Some(c));
        }
        self.stored_checkpoint(partition)
    }

    /// Remembers the keys of one published batch and the partition's new
    /// checkpoint (`checkpoint` = output offset of the batch's last record)
    /// in one atomic write batch.
    ///
    /// Idempotent: keys whose output offset is at or below the stored
    /// checkpoint are skipped (a replay), and an id already remembered keeps
    /// its first value. Keys already at or below the floor are not written.
    /// With `sync_writes` off the write is in the WAL (safe against a process
    /// crash) but not fsynced; call [`flush`](Self::flush) for a durable point.
    pub fn apply_batch(&self, partition: i32, keys: &[SeenKey], checkpoint: i64) -> Result<(), KeystoreError> {
        let _store_wide = self.apply_writes();
        let mine = self.partition_writes(partition);
        let _partition = mine.lock().unwrap_or_else(PoisonError::into_inner);
        // Declared after the locks, so dropped before them: the partition's
        // mark moves once this apply's write is visible (or it failed),
        // before another apply of the partition can take its note.
        let known_absent = self.absent.take(partition);
        let _bump = BumpOnDrop::partition(&self.absent, partition);
        let stored = self.checkpoint(partition)?;
        if stored.is_some_and(|c| c >= checkpoint) {
            // The whole batch is at or below the checkpoint: a replay.
            return Ok(());
        }
        let floor = self.floor.get();
        let lifetime_ms = self.opts.lifetime_ms.min(self.opts.horizon_ms);
        // One key per id, in output order: the first, unless a later copy
        // was first seen once the held one's lifetime was over (repair can
        // read an id's old acceptance and its re-acceptance into one
        // batch): the later replaces it, as across batches below.
        let mut held_at: hashbrown::HashMap<IdHash, usize, IdBuildHasher> =
            hashbrown::HashMap::with_capacity_and_hasher(keys.len(), IdBuildHasher);
        let mut fresh: Vec<&SeenKey> = Vec::with_capacity(keys.len());
        for k in keys.iter().filter(|k| stored.is_none_or(|c| k.output.offset > c)).filter(|k| k.first_seen_ms > floor)
        {
            match held_at.get(&k.id_hash) {
                None => {
                    held_at.insert(k.id_hash, fresh.len());
                    fresh.push(k);
                }
                Some(&at) if fresh[at].first_seen_ms.saturating_add(lifetime_ms) <= k.first_seen_ms => fresh[at] = k,
                Some(_) => {}
            }
        }
        // Key order: the write batch goes out in key order, and each part
        // of the lookup below reads neighbouring keys.
        fresh.sort_unstable_by_key(|k| k.id_hash);
        // Which of them are remembered above the floor already. The ids the
        // batch's own classification found absent, with nothing written to
        // the partition since, are known; the rest are read like a batch's
        // classification, in parts beside the helpers (the floor cannot
        // move under it: age-out waits for this apply).
        let known: Vec<bool> =
            fresh.iter().map(|k| known_absent.as_ref().is_some_and(|a| a.contains(&k.id_hash))).collect();
        let ids: Vec<IdHash> = fresh.iter().zip(&known).filter(|(_, &k)| !k).map(|(k, _)| k.id_hash).collect();
        let mut read = Vec::with_capacity(ids.len());
        if !ids.is_empty() {
            self.get_many(partition, &ids, &mut read)?;
            self.apply_reads.fetch_add(ids.len() as u64, Ordering::Relaxed);
        }
        // An answer missing would read as "not remembered" and overwrite
        // the key: refuse instead.
        if read.len() != ids.len() {
            return Err(KeystoreError::ShortLookup { asked: ids.len(), answered: read.len() });
        }
        let mut read = read.into_iter();
        let existing: Vec<Option<SeenKey>> =
            known.iter().map(|&known| if known { None } else { read.next().flatten() }).collect();

        let mut cells: Vec<(i64, BucketStats)> = Vec::new();
        let bucket_ms = self.opts.histogram_bucket_ms;
        let mut values: Vec<u8> = Vec::with_capacity(fresh.len() * 48);
        let mut spans = Vec::with_capacity(fresh.len());
        let mut added: Vec<SeenKey> = Vec::with_capacity(fresh.len());
        for (k, remembered) in fresh.iter().zip(existing) {
            // First delivery wins, unless it is already past the floor
            // (the lookup does not answer keys at or below it) or past its
            // lifetime when this one was first seen: then this id was
            // legitimately accepted again as new, and its new key replaces
            // the old one the store still keeps.
            if remembered.is_some_and(|r| r.first_seen_ms.saturating_add(lifetime_ms) > k.first_seen_ms) {
                continue;
            }
            let start = values.len();
            encode_value(partition, k, &mut values);
            spans.push((k.id_hash, start, values.len()));
            added.push(**k);
            let bucket = Histogram::bucket_of_ms(bucket_ms, k.first_seen_ms);
            match cells.iter_mut().find(|(b, _)| *b == bucket) {
                Some((_, s)) => s.absorb(&BucketStats::one(k.first_seen_ms)),
                None => cells.push((bucket, BucketStats::one(k.first_seen_ms))),
            }
        }
        let with_values: Vec<(IdHash, &[u8])> = spans.iter().map(|(id, s, e)| (*id, &values[*s..*e])).collect();
        let mut frame = Vec::with_capacity(values.len() + with_values.len() * 17 + 32);
        encode_apply(partition, checkpoint, &with_values, &mut frame);
        // In the log, then in the active layer, under one lock: a lookup
        // sees the keys once they would survive a process crash.
        // A layer is frozen before a batch would grow it past the write
        // buffer's bytes, so its tables stay within them (one batch's keys
        // aside, when a single batch is larger).
        let (frozen, appended) = {
            let layers = self.recent.lock();
            layers.refused()?;
            let full = layers.active.len > 0
                && layers.active.bytes_with(partition, added.len()) > self.opts.write_buffer_bytes;
            let (mut layers, frozen) = if full {
                let (layers, frozen) = self.freeze(layers)?;
                (layers, Some(frozen))
            } else {
                (layers, None)
            };
            let appended = layers.append(&frame);
            if appended.is_ok() {
                layers.active.apply(partition, checkpoint, &added, bucket_ms);
            }
            (frozen, appended)
        };
        // A layer frozen is written out whatever became of the append after
        // it: left frozen, it would hold every later freeze forever.
        if let Some(frozen) = frozen {
            self.start_write_out(frozen);
        }
        appended?;
        let mut st = self.lock();
        for (bucket, s) in &cells {
            st.histogram.add(*bucket, partition, s);
        }
        Ok(())
    }

    /// Makes the active layer the frozen one, with a new log for the next,
    /// once the frozen layer before it is written out (an apply waits here
    /// only when layers fill faster than they are written).
    fn freeze<'a>(
        &'a self,
        mut layers: MutexGuard<'a, Layers>,
    ) -> Result<(MutexGuard<'a, Layers>, Arc<Layer>), KeystoreError> {
        layers = self.recent.frozen_written(layers)?;
        // The log being closed is made durable before the next one gets a
        // frame: a power loss must not keep a later log's frames and lose
        // this one's tail, or replay would skip a gap (the checkpoint ahead
        // of the keys). One fsync per layer.
        if let Err(e) = layers.log.sync() {
            layers.failed.get_or_insert_with(|| e.to_string());
            return Err(e);
        }
        let seq = layers.next_log_seq;
        let log = Log::create(&self.spill.dir, seq, self.opts.sync_writes)?;
        layers.next_log_seq += 1;
        layers.log = log;
        let frozen = Arc::new(std::mem::replace(&mut layers.active, Layer::new(seq)));
        layers.frozen = Some(Arc::clone(&frozen));
        Ok((layers, frozen))
    }

    /// Writes a frozen layer out on a thread of its own (on this one if
    /// none can be started).
    fn start_write_out(&self, frozen: Arc<Layer>) {
        let mut running = self.spilling.lock().unwrap_or_else(PoisonError::into_inner);
        // The last one set its layer aside before this one was frozen: it
        // has ended or is ending.
        if let Some(done) = running.take() {
            if done.join().is_err() {
                tracing::error!("the key store's layer writer panicked");
            }
        }
        let (spill, recent) = (Arc::clone(&self.spill), Arc::clone(&self.recent));
        let layer = Arc::clone(&frozen);
        match std::thread::Builder::new()
            .name("keystore-layer".into())
            .spawn(move || spill.write_out_frozen(&recent, &layer))
        {
            Ok(thread) => *running = Some(thread),
            Err(e) => {
                tracing::warn!(error = %e, "no thread to write the key store's layer out; writing it here");
                self.spill.write_out_frozen(&self.recent, &frozen);
            }
        }
    }

    /// The remembered key of `id`, if it is above the floor.
    pub fn get(&self, partition: i32, id: &IdHash) -> Result<Option<SeenKey>, KeystoreError> {
        if let Some(held) = self.recent.lock().get(partition, id, self.floor.get()) {
            return Ok(held);
        }
        let v = self
            .db
            .get_pinned_cf_opt(self.keys_cf()?, encode_key(partition, id), &lookup())
            .map_err(KeystoreError::rocks("get"))?;
        let floor = self.floor.get();
        match v {
            None => Ok(None),
            Some(v) => Ok(Some(decode_value(partition, *id, &v)?).filter(|k| k.first_seen_ms > floor)),
        }
    }

    /// The remembered keys of `ids`, in one batched MultiGet, or in parts
    /// read side by side on the caller and the lookup helpers when there are
    /// many (`lookup_helpers`); `out` gets exactly one answer per id, in
    /// their order.
    pub fn get_many(
        &self,
        partition: i32,
        ids: &[IdHash],
        out: &mut Vec<Option<SeenKey>>,
    ) -> Result<(), KeystoreError> {
        self.lookups.read(partition, ids, out)
    }

    /// Ages keys out by the horizon and the size cap, oldest first.
    ///
    /// Cheap and scan-free: it raises the floor (reads hide older keys at
    /// once; compactions drop them as they rewrite files) and forgets the
    /// histogram buckets wholly below it. Call it periodically (every minute
    /// is plenty).
    pub fn age_out(&self, now_ms: i64) -> Result<AgeOutReport, KeystoreError> {
        let meta_cf = self.meta_cf()?;
        let _store_wide = self.store_writes();
        let mut st = self.lock();
        let horizon_floor_ms = now_ms.saturating_sub(self.opts.horizon_ms);
        let disk_bytes = self.disk_bytes();
        let size_floor_ms = match self.opts.max_bytes {
            None => None,
            Some(max) => {
                let keys_sst = self.int_property(KEYS_CF, rocksdb::properties::LIVE_SST_FILES_SIZE)?;
                let physical = self.int_property(KEYS_CF, rocksdb::properties::ESTIMATE_NUM_KEYS)?;
                // Bytes per key as compaction leaves them; the WAL, memtable
                // and meta are overhead the keys must leave room for.
                if keys_sst == 0 || physical == 0 {
                    None
                } else {
                    let per_key = keys_sst as f64 / physical as f64;
                    let overhead = disk_bytes.saturating_sub(keys_sst) as f64;
                    let budget = (max as f64 * SIZE_CAP_FILL - overhead).max(0.0);
                    // Never into the bucket now falls in: its last
                    // millisecond lies ahead, and a floor there would hide
                    // every key applied until then (they would not even be
                    // written). A cap that cannot hold one bucket keeps it,
                    // over the cap, with the alert on.
                    // (The bucket of `now` less the store's margin past a
                    // key's lifetime: a batch that classified by an earlier
                    // clock and applies after this round finds its keys
                    // written.)
                    let lag_ms = self.opts.horizon_ms.saturating_sub(self.opts.lifetime_ms).max(0);
                    let current_bucket_start =
                        Histogram::bucket_of_ms(self.opts.histogram_bucket_ms, now_ms.saturating_sub(lag_ms))
                            .saturating_mul(self.opts.histogram_bucket_ms);
                    st.histogram
                        .floor_for_capacity((budget / per_key) as u64)
                        .map(|f| f.min(current_bucket_start.saturating_sub(1)))
                }
            }
        };
        let old_floor = self.floor.get();
        let floor_ms = old_floor.max(horizon_floor_ms).max(size_floor_ms.unwrap_or(i64::MIN));
        let dropped = st.histogram.drop_at_or_below(floor_ms);
        if floor_ms != old_floor || !dropped.is_empty() {
            let mut batch = WriteBatch::default();
            for ((bucket, partition), _) in &dropped {
                batch.delete_cf(meta_cf, cell_key(*bucket, *partition));
            }
            batch.put_cf(meta_cf, META_FLOOR, floor_ms.to_be_bytes());
            // Persist first: a floor raised in memory but lost at a crash
            // would let keys reappear after a restart.
            self.db.write_opt(batch, &self.write_opts).map_err(KeystoreError::rocks("write floor"))?;
            self.floor.raise_to(floor_ms);
        }
        // Cut short for as long as the persisted floor lies above the
        // horizon's, whatever raised it, not only in the round that did:
        // once the cap cut, the histogram fits again and this round's size
        // floor is none while the window stays as short until the horizon
        // catches up; a cap cut and then removed, a horizon grown since a
        // restart, or a clock behind the floor leave the window as short
        // too, and retries older than it are accepted again all the same.
        st.size_limited = floor_ms > horizon_floor_ms;
        let oldest_first_seen_ms = st.histogram.oldest_above(floor_ms);
        let window_ms = oldest_first_seen_ms.map(|o| now_ms.saturating_sub(o));
        let below_window_floor = Self::below_floor(st.size_limited, window_ms, self.opts.window_floor_ms);
        if below_window_floor {
            tracing::error!(
                window_ms,
                window_floor_ms = self.opts.window_floor_ms,
                max_bytes = self.opts.max_bytes,
                disk_bytes,
                "the key store's dedupe window is below its floor: retries older than the window will be accepted \
                 again. The size cap cut it (raise --keystore-max-bytes), or did before it was raised or removed, \
                 or the horizon grew since a restart, or the clock is behind the store's floor; it heals as the \
                 horizon catches up"
            );
        }
        let buckets_dropped = dropped.len();
        let keys_aged_out = dropped.iter().map(|(_, s)| u64::try_from(s.count).unwrap_or(0)).sum();
        Ok(AgeOutReport {
            floor_ms,
            horizon_floor_ms,
            size_floor_ms,
            keys_aged_out,
            buckets_dropped,
            oldest_first_seen_ms,
            window_ms,
            below_window_floor,
            disk_bytes,
        })
    }

    fn below_floor(size_limited: bool, window_ms: Option<i64>, window_floor_ms: i64) -> bool {
        // Only the size cap raises the alert: a young store has a short
        // window because it has not seen more, not because it forgot.
        size_limited && window_ms.is_none_or(|w| w < window_floor_ms)
    }

    /// First-seen time of the oldest key kept (within one histogram bucket:
    /// exact unless the oldest bucket straddles the floor).
    pub fn oldest_first_seen_ms(&self) -> Result<Option<i64>, KeystoreError> {
        Ok(self.lock().histogram.oldest_above(self.floor.get()))
    }

    /// Whether, as of the last `age_out`, the size cap holds the window below
    /// `window_floor_ms`.
    pub fn window_below_floor(&self, now_ms: i64) -> Result<bool, KeystoreError> {
        let st = self.lock();
        let window = st.histogram.oldest_above(self.floor.get()).map(|o| now_ms.saturating_sub(o));
        Ok(Self::below_floor(st.size_limited, window, self.opts.window_floor_ms))
    }

    /// Forgets `partition` entirely: keys (one range tombstone, then the SST
    /// files wholly inside the range are deleted outright), counts and
    /// checkpoint. Used for a revoked partition when keys are not kept, and
    /// before rebuilding a partition from scratch.
    pub fn drop_partition(&self, partition: i32) -> Result<(), KeystoreError> {
        let keys_cf = self.keys_cf()?;
        let meta_cf = self.meta_cf()?;
        let _store_wide = self.store_writes();
        let _bump = BumpOnDrop::store_wide(&self.absent, Some(partition));
        // The layers first, the drop in the log before RocksDB's: a frozen
        // layer written out after the range delete would bring the keys
        // back, so it goes in first; and a restart that replays the log
        // must not either. (Applies wait on the store-wide lock, so no
        // layer freezes meanwhile.)
        {
            let mut layers = self.recent.frozen_written(self.recent.lock())?;
            let mut frame = Vec::new();
            encode_drop(partition, &mut frame);
            layers.append(&frame)?;
            if let Err(e) = layers.log.sync() {
                layers.failed.get_or_insert_with(|| e.to_string());
                return Err(e);
            }
            layers.active.drop_partition(partition);
        }
        let mut st = self.lock();
        let (start, end) = partition_range(partition);
        let cells = st.histogram.remove_partition(partition);
        let mut batch = WriteBatch::default();
        batch.delete_range_cf(keys_cf, start.as_slice(), end.as_slice());
        batch.delete_cf(meta_cf, checkpoint_key(partition));
        for (bucket, p) in cells {
            batch.delete_cf(meta_cf, cell_key(bucket, p));
        }
        self.db.write_opt(batch, &self.write_opts).map_err(KeystoreError::rocks("drop partition"))?;
        // No apply holds the partition's lock now (they hold the store's
        // shared): let it go with the partition, so the map of locks holds
        // only partitions this process still has.
        self.partition_writes.lock().unwrap_or_else(PoisonError::into_inner).remove(&partition);
        // The range tombstone already hides the keys; this frees the space
        // of files holding nothing else without waiting for compaction.
        self.db
            .delete_file_in_range_cf(keys_cf, start.as_slice(), end.as_slice())
            .map_err(KeystoreError::rocks("delete partition files"))?;
        Ok(())
    }

    /// Keys remembered for `partition`. An estimate at the edges: keys of
    /// the histogram bucket straddling the floor count until the whole bucket
    /// is below it.
    pub fn partition_key_count(&self, partition: i32) -> Result<u64, KeystoreError> {
        Ok(self.lock().histogram.partition_count(partition))
    }

    /// Keys remembered over all partitions (same estimate as [`partition_key_count`](Self::partition_key_count)).
    pub fn key_count(&self) -> u64 {
        self.lock().histogram.total_count()
    }

    /// Bytes the store's directory takes on disk (SSTs, WAL, manifest), for
    /// `dedupd_keystore_bytes`.
    pub fn disk_bytes(&self) -> u64 {
        let files = |dir: &Path| {
            std::fs::read_dir(dir).map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter_map(|e| e.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum::<u64>()
            })
        };
        match files(&self.dir) {
            // The logs (and a layer's SST being written) count too.
            Ok(bytes) => bytes + files(&self.spill.dir).unwrap_or(0),
            Err(_) => self.int_property(KEYS_CF, rocksdb::properties::LIVE_SST_FILES_SIZE).unwrap_or(0),
        }
    }

    /// Makes everything applied so far durable against a host crash (fsyncs
    /// the WAL). Not needed with `sync_writes`.
    pub fn flush(&self) -> Result<(), KeystoreError> {
        // Everything applied goes into RocksDB's files, so the next open
        // has no log to replay.
        let frozen = {
            let layers = self.recent.lock();
            if layers.active.is_empty() && layers.frozen.is_none() {
                None
            } else {
                let (layers, frozen) = self.freeze(layers)?;
                drop(layers);
                Some(frozen)
            }
        };
        if let Some(frozen) = frozen {
            self.spill.write_out_frozen(&self.recent, &frozen);
            self.recent.lock().refused()?;
        }
        self.db.flush_wal(true).map_err(KeystoreError::rocks("sync WAL"))
    }

    /// Flushes memtables and compacts every level down, applying the floor
    /// to every key. An operator/benchmark tool: production relies on
    /// automatic and periodic compaction instead.
    pub fn compact(&self) -> Result<(), KeystoreError> {
        self.flush()?;
        let keys_cf = self.keys_cf()?;
        let meta_cf = self.meta_cf()?;
        let mut fo = FlushOptions::default();
        fo.set_wait(true);
        self.db.flush_cfs_opt(&[keys_cf, meta_cf], &fo).map_err(KeystoreError::rocks("flush memtables"))?;
        let mut co = CompactOptions::default();
        co.set_bottommost_level_compaction(BottommostLevelCompaction::Force);
        co.set_exclusive_manual_compaction(false);
        self.db.compact_range_cf_opt(keys_cf, None::<&[u8]>, None::<&[u8]>, &co);
        self.db.compact_range_cf_opt(meta_cf, None::<&[u8]>, None::<&[u8]>, &co);
        Ok(())
    }

    /// Loads an empty partition from keys sorted by id, writing SST files
    /// and ingesting them straight into the bottommost level: the fast path
    /// to rebuild a partition from scratch (after `drop_partition`) or to
    /// seed a benchmark. Sets the checkpoint when given. Returns the number
    /// of keys loaded (keys at or below the floor are skipped).
    ///
    /// Not atomic as a whole: a crash midway leaves some files ingested and
    /// the checkpoint unset, so a repair replays the partition from the
    /// start, and `apply_batch` keeps the first copy of every id.
    pub fn bulk_load(
        &self,
        partition: i32,
        sorted_keys: impl IntoIterator<Item = SeenKey>,
        checkpoint: Option<i64>,
    ) -> Result<u64, KeystoreError> {
        let keys_cf = self.keys_cf()?;
        let meta_cf = self.meta_cf()?;
        let _store_wide = self.store_writes();
        let _bump = BumpOnDrop::store_wide(&self.absent, None);
        let mut st = self.lock();
        let (start, end) = partition_range(partition);
        if self.recent.lock().holds_keys_of(partition) {
            return Err(KeystoreError::PartitionNotEmpty { partition });
        }
        {
            let mut it = self.db.raw_iterator_cf_opt(keys_cf, total_order());
            it.seek(start);
            if it.key().is_some_and(|k| k < end.as_slice()) {
                return Err(KeystoreError::PartitionNotEmpty { partition });
            }
            it.status().map_err(KeystoreError::rocks("check partition empty"))?;
        }
        let staging = self.dir.join("bulk-load.tmp");
        std::fs::create_dir_all(&staging).map_err(|source| KeystoreError::Io { path: staging.clone(), source })?;
        let writer_opts =
            sst_writer_options(&self.opts, &Cache::new_lru_cache(1 << 20), self.floor.clone(), Tables::Lasting);
        let floor = self.floor.get();
        let mut files: Vec<PathBuf> = Vec::new();
        let mut writer: Option<SstFileWriter<'_>> = None;
        let mut in_file = 0u64;
        let mut loaded = 0u64;
        let mut last: Option<IdHash> = None;
        let mut cells: Vec<(i64, BucketStats)> = Vec::new();
        let mut value = Vec::with_capacity(MAX_VALUE_LEN);
        for k in sorted_keys {
            if last.is_some_and(|l| l >= k.id_hash) {
                return Err(KeystoreError::UnsortedBulkLoad { partition, id_hex: k.id_hash.to_hex() });
            }
            last = Some(k.id_hash);
            if k.first_seen_ms <= floor {
                continue;
            }
            let w = match &mut writer {
                Some(w) => w,
                None => {
                    let path = staging.join(format!("p{partition}-{}.sst", files.len()));
                    let w = SstFileWriter::create(&writer_opts);
                    w.open(&path).map_err(KeystoreError::rocks("create bulk SST"))?;
                    files.push(path);
                    writer.insert(w)
                }
            };
            value.clear();
            encode_value(partition, &k, &mut value);
            w.put(encode_key(partition, &k.id_hash), &value).map_err(KeystoreError::rocks("write bulk SST"))?;
            let bucket = st.histogram.bucket_of(k.first_seen_ms);
            match cells.binary_search_by_key(&bucket, |(b, _)| *b) {
                Ok(i) => cells[i].1.absorb(&BucketStats::one(k.first_seen_ms)),
                Err(i) => cells.insert(i, (bucket, BucketStats::one(k.first_seen_ms))),
            }
            loaded += 1;
            in_file += 1;
            if in_file == BULK_FILE_KEYS {
                if let Some(mut w) = writer.take() {
                    w.finish().map_err(KeystoreError::rocks("finish bulk SST"))?;
                }
                in_file = 0;
            }
        }
        if let Some(mut w) = writer.take() {
            w.finish().map_err(KeystoreError::rocks("finish bulk SST"))?;
        }
        if !files.is_empty() {
            let mut ingest = IngestExternalFileOptions::default();
            ingest.set_move_files(true);
            self.db
                .ingest_external_file_cf_opts(keys_cf, &ingest, files)
                .map_err(KeystoreError::rocks("ingest bulk SSTs"))?;
        }
        let mut batch = WriteBatch::default();
        for (bucket, s) in &cells {
            batch.merge_cf(meta_cf, cell_key(*bucket, partition), s.encode());
        }
        if let Some(c) = checkpoint {
            batch.put_cf(meta_cf, checkpoint_key(partition), c.to_be_bytes());
        }
        self.db.write_opt(batch, &self.write_opts).map_err(KeystoreError::rocks("record bulk load"))?;
        for (bucket, s) in &cells {
            st.histogram.add(*bucket, partition, s);
        }
        std::fs::remove_dir_all(&staging).map_err(|source| KeystoreError::Io { path: staging, source })?;
        Ok(loaded)
    }

    /// Ids applies have read from the store since open to check that they
    /// were not remembered already: those the batch's own lookup had not
    /// just found absent (see `absent.rs`).
    pub fn ids_read_by_applies(&self) -> u64 {
        self.apply_reads.load(Ordering::Relaxed)
    }

    /// Keys compactions have dropped below the floor since open.
    pub fn reclaimed_keys(&self) -> u64 {
        self.floor.reclaimed.load(Ordering::Relaxed)
    }

    /// RocksDB's estimate of the entries physically present (live or not yet reclaimed).
    pub fn estimated_physical_keys(&self) -> Result<u64, KeystoreError> {
        self.int_property(KEYS_CF, rocksdb::properties::ESTIMATE_NUM_KEYS)
    }

    /// The current floor: keys first seen at or before it are gone.
    pub fn floor_ms(&self) -> i64 {
        self.floor.get()
    }

    pub fn options(&self) -> &KeyStoreOptions {
        &self.opts
    }

    /// Memory the open tables' filters and indexes hold, outside the block
    /// cache (RocksDB's estimate for the keys family): with the store's
    /// size, what a key costs in memory whatever the traffic.
    pub fn filter_and_index_bytes(&self) -> Result<u64, KeystoreError> {
        self.int_property(KEYS_CF, rocksdb::properties::ESTIMATE_TABLE_READERS_MEM)
    }

    fn int_property(&self, cf: &'static str, name: &rocksdb::properties::PropName) -> Result<u64, KeystoreError> {
        let cf = self.db.cf_handle(cf).ok_or(KeystoreError::MissingColumnFamily { name: cf })?;
        Ok(self.db.property_int_value_cf(cf, name).map_err(KeystoreError::rocks("read property"))?.unwrap_or(0))
    }

    /// Every remembered key of `partition` above the floor, in id order.
    /// A full scan of the partition: for `inspect`, `verify` and tests only.
    pub fn scan_partition(&self, partition: i32) -> Result<Vec<SeenKey>, KeystoreError> {
        let (start, end) = partition_range(partition);
        let floor = self.floor.get();
        // The layers' keys first, newest layer last: a key written out
        // meanwhile is then in this copy or, after it, in RocksDB. An id a
        // layer holds replaces what RocksDB holds (an older copy below the
        // floor, or the same key being written out).
        let mut held: hashbrown::HashMap<IdHash, SeenKey> = hashbrown::HashMap::new();
        {
            let layers = self.recent.lock();
            for layer in layers.frozen.iter().map(|f| &**f).chain(std::iter::once(&layers.active)) {
                held.extend(layer.keys_of(partition).map(|k| (k.id_hash, *k)));
            }
        }
        let mut out = Vec::new();
        let mut it = self.db.raw_iterator_cf_opt(self.keys_cf()?, total_order());
        it.seek(start);
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            if k >= end.as_slice() {
                break;
            }
            let (p, id) = decode_key(k)?;
            if !held.contains_key(&id) {
                out.push(decode_value(p, id, v)?);
            }
            it.next();
        }
        it.status().map_err(KeystoreError::rocks("scan partition"))?;
        out.extend(held.into_values());
        out.retain(|k| k.first_seen_ms > floor);
        out.sort_unstable_by_key(|k| k.id_hash);
        Ok(out)
    }
}

impl LongHorizon for KeyStore {
    /// A classification's lookup: what it finds absent is noted for the
    /// batch's apply (see `absent.rs`).
    fn lookup_many(&self, partition: i32, ids: &[IdHash], out: &mut Vec<Option<SeenKey>>) -> Result<(), HorizonError> {
        let marks = self.absent.marks(partition);
        self.get_many(partition, ids, out).map_err(|e| HorizonError(Box::new(e)))?;
        self.absent.note(partition, marks, ids, out);
        Ok(())
    }
}

/// One batched MultiGet of `ids` into `out` (cleared first), answers above
/// the floor only: one part of a [`KeyStore::get_many`], on whichever thread
/// reads it.
fn read_keys(
    db: &DB,
    recent: &Recent,
    floor: &Floor,
    partition: i32,
    ids: &[IdHash],
    out: &mut Vec<Option<SeenKey>>,
) -> Result<(), KeystoreError> {
    let floor = floor.get();
    // The layers first: a key written out leaves its layer only once
    // RocksDB holds it, so an id the layers did not hold a moment ago is in
    // RocksDB now if it is anywhere.
    let misses = recent.lookup(partition, ids, floor, out);
    if misses.is_empty() {
        return Ok(());
    }
    let keys_cf = db.cf_handle(KEYS_CF).ok_or(KeystoreError::MissingColumnFamily { name: KEYS_CF })?;
    let keys: Vec<[u8; KEY_LEN]> = misses.iter().map(|&i| encode_key(partition, &ids[i])).collect();
    let answers = db.batched_multi_get_cf_opt(keys_cf, keys.iter(), false, &lookup());
    for (&i, a) in misses.iter().zip(answers) {
        out[i] = match a.map_err(KeystoreError::rocks("multi get"))? {
            None => None,
            Some(v) => Some(decode_value(partition, ids[i], &v)?).filter(|k| k.first_seen_ms > floor),
        };
    }
    Ok(())
}

/// What writing a layer out needs, shared with the thread that does it.
struct Spill {
    db: Arc<DB>,
    /// `<keystore>/recent`: the logs, and each layer's SST while it is written.
    dir: PathBuf,
    opts: KeyStoreOptions,
    floor: Floor,
}

impl Spill {
    /// Writes `layer` into RocksDB: its keys above the floor, sorted, as one
    /// SST file ingested into the keys column family, then its
    /// partitions' checkpoints and histogram counts in one synced meta
    /// write. A crash between the two leaves the keys in and the
    /// checkpoints behind: the log replays them (an id already held keeps
    /// its value), and only the histogram may miss those keys' counts.
    fn write_out(&self, layer: &Layer) -> Result<(), KeystoreError> {
        let keys_cf = self.db.cf_handle(KEYS_CF).ok_or(KeystoreError::MissingColumnFamily { name: KEYS_CF })?;
        let meta_cf = self.db.cf_handle(META_CF).ok_or(KeystoreError::MissingColumnFamily { name: META_CF })?;
        let floor = self.floor.get();
        let mut sorted: Vec<([u8; KEY_LEN], i32, &SeenKey)> = layer
            .all_keys()
            .filter(|(_, k)| k.first_seen_ms > floor)
            .map(|(p, k)| (encode_key(p, &k.id_hash), p, k))
            .collect();
        sorted.sort_unstable_by_key(|e| e.0);
        if !sorted.is_empty() {
            let path = self.dir.join(format!("{:020}.sst", layer.log_seq));
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(KeystoreError::Io { path, source: e });
                }
                _ => {}
            }
            let writer_opts =
                sst_writer_options(&self.opts, &Cache::new_lru_cache(1 << 20), self.floor.clone(), Tables::Layer);
            let mut writer = SstFileWriter::create(&writer_opts);
            writer.open(&path).map_err(KeystoreError::rocks("create layer SST"))?;
            let mut value = Vec::with_capacity(MAX_VALUE_LEN);
            for (key, partition, k) in &sorted {
                value.clear();
                encode_value(*partition, k, &mut value);
                writer.put(key, &value).map_err(KeystoreError::rocks("write layer SST"))?;
            }
            writer.finish().map_err(KeystoreError::rocks("finish layer SST"))?;
            let mut ingest = IngestExternalFileOptions::default();
            ingest.set_move_files(true);
            self.db
                .ingest_external_file_cf_opts(keys_cf, &ingest, vec![path])
                .map_err(KeystoreError::rocks("ingest layer SST"))?;
        }
        let mut batch = WriteBatch::default();
        // Counts wholly below the floor were dropped from the histogram by
        // the age-out that raised it; written now, they would come back at
        // the next open until the next age-out.
        for ((bucket, partition), s) in layer.cells.iter().filter(|(_, s)| s.max_ms > floor) {
            batch.merge_cf(meta_cf, cell_key(*bucket, *partition), s.encode());
        }
        for (partition, checkpoint) in &layer.checkpoints {
            batch.put_cf(meta_cf, checkpoint_key(*partition), checkpoint.to_be_bytes());
        }
        // With the checkpoints: a restart replays no log up to this one,
        // even one whose deletion failed or was lost.
        batch.put_cf(meta_cf, META_LOGS_WRITTEN, layer.log_seq.to_be_bytes());
        let mut synced = WriteOptions::default();
        synced.set_sync(true);
        self.db.write_opt(batch, &synced).map_err(KeystoreError::rocks("record layer"))?;
        Ok(())
    }

    /// [`write_out`](Self::write_out) for the frozen layer, then sets it
    /// aside and deletes its log; a failure is kept for every later apply.
    fn write_out_frozen(&self, recent: &Recent, layer: &Layer) {
        // A panic is a failure too: left frozen, the layer would hold every
        // later freeze (and `drop_partition`, under the store-wide lock)
        // forever.
        let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.write_out(layer)))
            .unwrap_or_else(|_| Err(KeystoreError::LayerWrite { cause: "the layer writer panicked".to_string() }));
        let mut layers = recent.lock();
        match written {
            Ok(()) => {
                layers.frozen = None;
                let log = super::recent::log_path(&self.dir, layer.log_seq);
                if let Err(e) = std::fs::remove_file(&log) {
                    // Not replayed at the next open: the meta records the
                    // newest log written out, and that open deletes it.
                    tracing::warn!(log = %log.display(), error = %e, "cannot delete a written-out key store log");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "writing the key store's layer out failed; applies stop");
                layers.failed.get_or_insert_with(|| e.to_string());
            }
        }
        drop(layers);
        recent.spilled.notify_all();
    }
}

fn be_i64(v: &[u8], what: &'static str, key: &[u8]) -> Result<i64, KeystoreError> {
    let b: [u8; 8] =
        v.try_into().map_err(|_| KeystoreError::Corrupt { what, key_hex: hex(key), detail: "not 8 bytes" })?;
    Ok(i64::from_be_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{PayloadHash, Position};

    const HOUR: i64 = 3_600_000;

    fn opts() -> KeyStoreOptions {
        KeyStoreOptions {
            horizon_ms: 10 * HOUR,
            histogram_bucket_ms: HOUR,
            block_cache_bytes: 4 << 20,
            write_buffer_bytes: 4 << 20,
            ..KeyStoreOptions::default()
        }
    }

    fn key(n: u64, first_seen_ms: i64, offset: i64) -> SeenKey {
        let h = blake3::hash(&n.to_le_bytes());
        let mut id = [0u8; 16];
        id.copy_from_slice(&h.as_bytes()[..16]);
        SeenKey {
            id_hash: IdHash(id),
            payload_hash: PayloadHash([n as u8; 16]),
            first_seen_ms,
            source: Position::new(0, offset + 1000),
            output: Position::new(0, offset),
        }
    }

    /// Layers of about 10,000 keys (the smallest write buffer), so tests
    /// write several out.
    fn small_layers() -> KeyStoreOptions {
        KeyStoreOptions { write_buffer_bytes: 1 << 20, ..opts() }
    }

    fn logs_in(dir: &Path) -> usize {
        list_logs(&dir.join(RECENT_DIR)).expect("list").len()
    }

    /// Applied keys are found while in the active layer, while frozen and
    /// after they are written out, by lookups racing the write-outs: a key
    /// leaves its layer only once RocksDB holds it. Then a reopen without a
    /// flush (a process crash: the active layer is only in its log) finds
    /// every key and checkpoint again, and leaves one log, the new one.
    #[test]
    fn keys_are_found_across_layer_write_outs_and_a_crash_replays_the_log() -> Result<(), KeystoreError> {
        const BATCH: u64 = 500;
        const BATCHES: u64 = 90;
        let dir = tempfile::tempdir().expect("tempdir");
        let now = 5 * HOUR;
        let seen = |n: u64| key(n, now, n as i64);
        {
            let ks = KeyStore::open(dir.path(), small_layers())?;
            let applied = std::sync::atomic::AtomicU64::new(0);
            let done = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|scope| -> Result<(), KeystoreError> {
                let (ks, applied, done) = (&ks, &applied, &done);
                let reader = scope.spawn(move || {
                    let mut answers = Vec::new();
                    let mut rounds = 0u64;
                    while !done.load(Ordering::Acquire) {
                        let upto = applied.load(Ordering::Acquire);
                        // Everything applied so far, newest first.
                        let ids: Vec<IdHash> = (0..upto).rev().take(4000).map(|n| seen(n).id_hash).collect();
                        ks.get_many(0, &ids, &mut answers).expect("lookup");
                        let missing = answers.iter().filter(|a| a.is_none()).count();
                        assert_eq!(missing, 0, "{missing} applied keys not found with {upto} applied");
                        rounds += 1;
                    }
                    rounds
                });
                let written = (0..BATCHES).try_for_each(|b| {
                    let keys: Vec<SeenKey> = (b * BATCH..(b + 1) * BATCH).map(seen).collect();
                    ks.apply_batch(0, &keys, ((b + 1) * BATCH - 1) as i64)?;
                    applied.store((b + 1) * BATCH, Ordering::Release);
                    Ok(())
                });
                done.store(true, Ordering::Release);
                assert!(reader.join().expect("reader") > 0);
                written
            })?;
            let files = ks.int_property(KEYS_CF, rocksdb::properties::LIVE_SST_FILES_SIZE)?;
            assert!(files > 0, "layers were written out");
            assert!(ks.recent.lock().active.len > 0, "the last keys are only in the active layer");
        }
        let ks = KeyStore::open(dir.path(), small_layers())?;
        assert_eq!(logs_in(dir.path()), 1, "the replayed logs are gone, the new one is there");
        assert_eq!(ks.checkpoint(0)?, Some((BATCH * BATCHES - 1) as i64));
        for n in 0..BATCH * BATCHES {
            assert_eq!(ks.get(0, &seen(n).id_hash)?, Some(seen(n)), "key {n}");
        }
        assert_eq!(ks.key_count(), BATCH * BATCHES, "each key counted once");
        Ok(())
    }

    /// Memory is bounded in bytes: the active layer's tables never pass the
    /// write buffer's size, over several partitions, and layers are
    /// written out as they fill.
    #[test]
    fn a_layer_is_frozen_before_its_tables_outgrow_the_write_buffer() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = small_layers();
        let ks = KeyStore::open(dir.path(), opts.clone())?;
        let mut most = 0;
        for b in 0..120u64 {
            let partition = (b % 3) as i32;
            let keys: Vec<SeenKey> = (b * 700..(b + 1) * 700)
                .map(|n| SeenKey { output: Position::new(partition, n as i64), ..key(n, 5 * HOUR, n as i64) })
                .collect();
            ks.apply_batch(partition, &keys, (b * 700 + 699) as i64)?;
            let bytes = ks.recent.lock().active.bytes_with(partition, 0);
            assert!(bytes <= opts.write_buffer_bytes, "batch {b}: the active layer holds {bytes} bytes");
            most = most.max(bytes);
        }
        assert!(most > opts.write_buffer_bytes / 4, "layers filled up to {most} bytes only");
        assert!(ks.int_property(KEYS_CF, rocksdb::properties::LIVE_SST_FILES_SIZE)? > 0, "layers were written out");
        ks.flush()?;
        assert_eq!(ks.key_count(), 120 * 700);
        Ok(())
    }

    /// A log cut inside a frame (a host crash mid-write) replays the frames
    /// before it: the checkpoint is the last whole apply's, and none of the
    /// cut apply's keys is there.
    #[test]
    fn a_torn_log_replays_whole_applies_and_their_checkpoint() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let now = 5 * HOUR;
        {
            let ks = KeyStore::open(dir.path(), opts())?;
            for b in 0..3u64 {
                let keys: Vec<SeenKey> = (b * 10..b * 10 + 10).map(|n| key(n, now, n as i64)).collect();
                ks.apply_batch(0, &keys, (b * 10 + 9) as i64)?;
            }
        }
        let logs = list_logs(&dir.path().join(RECENT_DIR))?;
        let (_, log) = logs.last().expect("a log");
        let bytes = std::fs::read(log).expect("read");
        std::fs::write(log, &bytes[..bytes.len() - 7]).expect("cut");
        let ks = KeyStore::open(dir.path(), opts())?;
        assert_eq!(ks.checkpoint(0)?, Some(19));
        for n in 0..30u64 {
            assert_eq!(ks.get(0, &key(n, now, 0).id_hash)?.is_some(), n < 20, "key {n}");
        }
        assert_eq!(ks.key_count(), 20);
        Ok(())
    }

    /// A log whose layer was written out is never replayed, even when its
    /// deletion failed: its frames would otherwise come back after a later
    /// drop of their partition, and their checkpoint would hide the applies
    /// logged since (the checkpoint ahead of the keys).
    #[test]
    fn a_written_out_log_left_behind_is_not_replayed() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let now = 5 * HOUR;
        let recent = dir.path().join(RECENT_DIR);
        let old: Vec<SeenKey> = (0..1000).map(|n| key(n, now, n as i64)).collect();
        let rebuilt: Vec<SeenKey> = (5000..5600u64).map(|n| key(n, now, n as i64 - 5000)).collect();
        {
            let ks = KeyStore::open(dir.path(), opts())?;
            ks.apply_batch(0, &old, 999)?;
            let (_, first_log) = list_logs(&recent)?.pop().expect("the active log");
            let left_behind = std::fs::read(&first_log).expect("read");
            ks.flush()?;
            assert!(!first_log.exists(), "written out, deleted");
            // As if its deletion had failed.
            std::fs::write(&first_log, left_behind).expect("write");
            ks.drop_partition(0)?;
            ks.apply_batch(0, &rebuilt[..500], 499)?;
            ks.flush()?;
            ks.apply_batch(0, &rebuilt[500..], 599)?;
        }
        let ks = KeyStore::open(dir.path(), opts())?;
        assert_eq!(ks.checkpoint(0)?, Some(599));
        assert!(rebuilt.iter().all(|k| ks.get(0, &k.id_hash).ok() == Some(Some(*k))), "a rebuilt key is missing");
        assert!(old.iter().all(|k| ks.get(0, &k.id_hash).ok() == Some(None)), "a dropped key came back");
        assert_eq!(logs_in(dir.path()), 1);
        Ok(())
    }

    /// A layer's SST that a crashed write-out left in `recent/` is deleted
    /// at the next open (its keys come back from the log).
    #[test]
    fn an_unfinished_layer_file_is_deleted_at_open() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let stray = dir.path().join(RECENT_DIR).join(format!("{:020}.sst", 3));
        {
            let ks = KeyStore::open(dir.path(), opts())?;
            ks.apply_batch(0, &[key(1, 5 * HOUR, 0)], 0)?;
            std::fs::write(&stray, b"half an SST").expect("write");
        }
        let ks = KeyStore::open(dir.path(), opts())?;
        assert!(!stray.exists(), "the unfinished layer file is still there");
        assert_eq!(ks.get(0, &key(1, 5 * HOUR, 0).id_hash)?, Some(key(1, 5 * HOUR, 0)));
        Ok(())
    }

    /// `dedupd verify` reads the logs: a torn tail on the newest is what a
    /// crash leaves (clean), damage in an older one is corruption.
    #[test]
    fn verify_tells_a_torn_newest_log_from_a_damaged_older_one() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let ks = KeyStore::open(dir.path(), opts())?;
            for b in 0..3u64 {
                let keys: Vec<SeenKey> = (b * 10..b * 10 + 10).map(|n| key(n, 5 * HOUR, n as i64)).collect();
                ks.apply_batch(0, &keys, (b * 10 + 9) as i64)?;
            }
        }
        let recent = dir.path().join(RECENT_DIR);
        let (seq, older) = list_logs(&recent)?.pop().expect("the crashed process's log");
        let whole = std::fs::read(&older).expect("read");
        let newer = super::super::recent::log_path(&recent, seq + 1);
        std::fs::write(&newer, &whole[..whole.len() - 3]).expect("write");
        let report = super::super::verify(dir.path())?;
        assert_eq!(
            report.logs.iter().map(|l| (l.frames, l.damaged_at.is_some())).collect::<Vec<_>>(),
            [(3, false), (2, true)]
        );
        assert!(report.is_clean(), "a torn newest log is a crash's, not corruption");
        let mut bad = whole.clone();
        bad[20] ^= 0x10;
        std::fs::write(&older, &bad).expect("write");
        let report = super::super::verify(dir.path())?;
        assert_eq!(report.logs[0].damaged_at, Some(0));
        assert!(!report.is_clean(), "damage in an older log is corruption");
        Ok(())
    }

    /// A dropped partition stays dropped across a crash: replaying the log
    /// does not bring back keys applied before the drop, in the active layer
    /// or written out; keys applied after it come back.
    #[test]
    fn a_partition_dropped_before_a_crash_stays_dropped() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let now = 5 * HOUR;
        let before: Vec<SeenKey> = (0..20_000).map(|n| key(n, now, n as i64)).collect();
        let after: Vec<SeenKey> = (50_000..50_010u64).map(|n| key(n, now, n as i64 - 50_000)).collect();
        {
            let ks = KeyStore::open(dir.path(), small_layers())?;
            for chunk in before.chunks(1000) {
                ks.apply_batch(0, chunk, chunk.last().expect("keys").output.offset)?;
            }
            ks.drop_partition(0)?;
            ks.apply_batch(0, &after, 9)?;
        }
        let ks = KeyStore::open(dir.path(), small_layers())?;
        assert_eq!(ks.checkpoint(0)?, Some(9));
        assert!(before.iter().step_by(97).all(|k| ks.get(0, &k.id_hash).ok() == Some(None)), "dropped keys came back");
        assert!(after.iter().all(|k| ks.get(0, &k.id_hash).ok() == Some(Some(*k))));
        assert_eq!(ks.scan_partition(0)?.len(), after.len());
        Ok(())
    }

    /// A lookup large enough to be read in parts (here by three helpers)
    /// answers every id as a lookup of that id alone does, in the order
    /// asked, known and unknown ids and ids below the floor mixed; so does
    /// a store with no helpers.
    #[test]
    fn a_lookup_read_in_parts_answers_as_single_lookups_do() -> Result<(), KeystoreError> {
        for helpers in [3, 0] {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = KeyStore::open(dir.path(), KeyStoreOptions { lookup_helpers: helpers, ..opts() })?;
            let now = 100 * HOUR;
            // Every third key is old enough to fall below the floor.
            let written: Vec<SeenKey> =
                (0..3000).map(|n| key(n, if n % 3 == 0 { now - 20 * HOUR } else { now }, n as i64)).collect();
            store.apply_batch(0, &written, 2999)?;
            store.age_out(now)?;
            // Known ids and never-written ones, shuffled together.
            let mut ids: Vec<IdHash> = (0..6000).map(|n| key(n, now, 0).id_hash).collect();
            ids.sort_unstable_by_key(|id| id.0[7]);
            let mut answers = Vec::new();
            store.get_many(0, &ids, &mut answers)?;
            assert_eq!(answers.len(), ids.len());
            for (id, answer) in ids.iter().zip(&answers) {
                assert_eq!(*answer, store.get(0, id)?, "{helpers} helpers");
            }
            let found = answers.iter().filter(|a| a.is_some()).count();
            assert_eq!(found, 2000, "{helpers} helpers: the keys above the floor, and only those");
        }
        Ok(())
    }

    /// Batches of different partitions apply at the same time, beside
    /// age-outs (which take the store alone), and each partition's batches
    /// come twice at once from two threads (the read-check-write of one
    /// partition must not interleave): afterwards every key is remembered
    /// once with its first value, every checkpoint is its partition's last,
    /// and the counts add up to the keys written, not twice that.
    #[test]
    fn partitions_applying_at_once_beside_age_outs_lose_and_double_nothing() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = KeyStore::open(dir.path(), opts())?;
        const PARTITIONS: i32 = 4;
        const BATCHES: i64 = 40;
        const PER_BATCH: i64 = 50;
        let now = 100 * HOUR;
        let key_of = |p: i32, offset: i64| {
            let mut k = key(u64::try_from(p).expect("p") * 1_000_000 + u64::try_from(offset).expect("o"), now, offset);
            k.output = Position::new(p, offset);
            k
        };
        std::thread::scope(|scope| {
            for p in (0..PARTITIONS).chain(0..PARTITIONS) {
                let store = &store;
                scope.spawn(move || {
                    for b in 0..BATCHES {
                        let keys: Vec<SeenKey> = (b * PER_BATCH..(b + 1) * PER_BATCH).map(|o| key_of(p, o)).collect();
                        store.apply_batch(p, &keys, (b + 1) * PER_BATCH - 1).expect("apply");
                    }
                });
            }
            let store = &store;
            scope.spawn(move || {
                for _ in 0..20 {
                    store.age_out(now).expect("age out");
                }
            });
        });
        for p in 0..PARTITIONS {
            assert_eq!(store.checkpoint(p)?, Some(BATCHES * PER_BATCH - 1), "partition {p}");
            assert_eq!(store.partition_key_count(p)?, u64::try_from(BATCHES * PER_BATCH).expect("n"));
            for o in [0, BATCHES * PER_BATCH / 2, BATCHES * PER_BATCH - 1] {
                let want = key_of(p, o);
                assert_eq!(store.get(p, &want.id_hash)?, Some(want), "partition {p} offset {o}");
            }
        }
        assert_eq!(store.key_count(), u64::try_from(i64::from(PARTITIONS) * BATCHES * PER_BATCH).expect("n"));
        Ok(())
    }

    #[test]
    fn the_first_delivery_of_an_id_wins_within_and_across_batches() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), opts())?;
        let a = key(1, 100 * HOUR, 1);
        let mut a_again = key(1, 100 * HOUR + 5, 2);
        a_again.payload_hash = PayloadHash([9; 16]);
        ks.apply_batch(0, &[a, a_again], 2)?;
        ks.apply_batch(0, &[SeenKey { output: Position::new(0, 3), ..a_again }], 3)?;
        assert_eq!(ks.get(0, &a.id_hash)?, Some(a));
        assert_eq!(ks.partition_key_count(0)?, 1);
        assert_eq!(ks.checkpoint(0)?, Some(3));
        Ok(())
    }

    /// The batch's classification looked its keys up and found them
    /// absent: its apply reads none of them again, only the one it did not
    /// look up, and still writes them all.
    #[test]
    fn an_apply_reads_only_the_ids_its_batchs_lookup_did_not_find_absent() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), opts())?;
        let (a, b, c, known) = (key(1, HOUR, 1), key(2, HOUR, 2), key(3, HOUR, 3), key(4, HOUR, 0));
        ks.apply_batch(0, &[known], 0)?;
        let before = ks.ids_read_by_applies();
        let mut answers = Vec::new();
        ks.lookup_many(0, &[a.id_hash, b.id_hash, known.id_hash], &mut answers).expect("lookup");
        assert_eq!(answers, [None, None, Some(known)]);
        ks.apply_batch(0, &[a, b, c], 3)?;
        assert_eq!(ks.ids_read_by_applies() - before, 1, "only c was read again");
        for k in [a, b, c, known] {
            assert_eq!(ks.get(0, &k.id_hash)?, Some(k));
        }
        // The note served that apply: the next one reads its ids.
        let a_again = SeenKey { output: Position::new(0, 4), first_seen_ms: 2 * HOUR, ..a };
        ks.apply_batch(0, &[a_again], 4)?;
        assert_eq!(ks.ids_read_by_applies() - before, 2);
        assert_eq!(ks.get(0, &a.id_hash)?, Some(a), "the first delivery wins");
        Ok(())
    }

    /// A lookup found an id absent; then a bulk load (a store-wide write)
    /// remembered it. The next apply may not take the lookup's word: the
    /// id keeps the value the load gave it.
    #[test]
    fn a_store_wide_write_after_a_lookup_makes_its_note_stale() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), opts())?;
        let loaded = key(1, HOUR, 1);
        let mut answers = Vec::new();
        ks.lookup_many(0, &[loaded.id_hash], &mut answers).expect("lookup");
        assert_eq!(answers, [None]);
        ks.bulk_load(0, [loaded], Some(1))?;
        let again = SeenKey { output: Position::new(0, 2), first_seen_ms: 2 * HOUR, ..loaded };
        ks.apply_batch(0, &[again], 2)?;
        assert_eq!(ks.get(0, &loaded.id_hash)?, Some(loaded));
        assert_eq!(ks.partition_key_count(0)?, 1);
        Ok(())
    }

    /// Lookups of a partition's ids on one thread, over and over, while
    /// another applies each batch twice: first delivered, then delivered
    /// again later with a later first-seen time. A lookup that found a
    /// batch's ids absent before its first apply must not vouch for them at
    /// the second: every id keeps its first value, and is counted once.
    #[test]
    fn lookups_racing_applies_of_their_partition_never_let_a_later_delivery_win() -> Result<(), KeystoreError> {
        const BATCHES: u64 = 150;
        const PER_BATCH: u64 = 20;
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), KeyStoreOptions { lookup_helpers: 1, ..opts() })?;
        let span = 2 * PER_BATCH as i64;
        let first = |n: u64| key(n, HOUR, (n / PER_BATCH) as i64 * span + (n % PER_BATCH) as i64);
        let again = |n: u64| {
            let f = first(n);
            SeenKey { first_seen_ms: 2 * HOUR, output: Position::new(0, f.output.offset + PER_BATCH as i64), ..f }
        };
        let batch_ids = |b: u64| b * PER_BATCH..(b + 1) * PER_BATCH;
        let applying = std::sync::atomic::AtomicU64::new(0);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| -> Result<(), KeystoreError> {
            let (ks, applying, done) = (&ks, &applying, &done);
            scope.spawn(move || {
                let mut answers = Vec::new();
                while !done.load(Ordering::Acquire) {
                    let b = applying.load(Ordering::Acquire);
                    let ids: Vec<IdHash> = batch_ids(b).map(|n| first(n).id_hash).collect();
                    ks.lookup_many(0, &ids, &mut answers).expect("lookup");
                }
            });
            let applied = (0..BATCHES).try_for_each(|b| {
                applying.store(b, Ordering::Release);
                let firsts: Vec<SeenKey> = batch_ids(b).map(first).collect();
                let agains: Vec<SeenKey> = batch_ids(b).map(again).collect();
                ks.apply_batch(0, &firsts, firsts.last().expect("keys").output.offset)?;
                ks.apply_batch(0, &agains, agains.last().expect("keys").output.offset)
            });
            // Whatever the applies did, so the lookups end and the scope
            // can join them.
            done.store(true, Ordering::Release);
            applied
        })?;
        for n in 0..BATCHES * PER_BATCH {
            assert_eq!(ks.get(0, &first(n).id_hash)?, Some(first(n)), "key {n}");
        }
        assert_eq!(ks.partition_key_count(0)?, BATCHES * PER_BATCH);
        assert_eq!(ks.key_count(), BATCHES * PER_BATCH, "each key counted once");
        Ok(())
    }

    #[test]
    fn a_replayed_batch_at_or_below_the_checkpoint_changes_nothing() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), opts())?;
        ks.apply_batch(0, &[key(1, HOUR, 10), key(2, HOUR, 11)], 11)?;
        ks.apply_batch(0, &[key(3, HOUR, 9)], 11)?;
        ks.apply_batch(0, &[key(4, HOUR, 11), key(5, HOUR, 12)], 12)?;
        assert!(ks.get(0, &key(3, 0, 0).id_hash)?.is_none());
        assert!(ks.get(0, &key(4, 0, 0).id_hash)?.is_none());
        assert!(ks.get(0, &key(5, 0, 0).id_hash)?.is_some());
        assert_eq!(ks.partition_key_count(0)?, 3);
        Ok(())
    }

    #[test]
    fn an_id_past_the_floor_is_remembered_again_with_its_new_value() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), opts())?;
        let old = key(1, HOUR, 1);
        ks.apply_batch(0, &[old], 1)?;
        ks.age_out(12 * HOUR)?;
        assert!(ks.get(0, &old.id_hash)?.is_none());
        let new = key(1, 12 * HOUR, 2);
        ks.apply_batch(0, &[new], 2)?;
        assert_eq!(ks.get(0, &old.id_hash)?, Some(new));
        Ok(())
    }

    #[test]
    fn dropping_a_partition_forgets_its_keys_counts_and_checkpoint_only() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), opts())?;
        let mut k7 = key(1, HOUR, 5);
        k7.source.partition = 7;
        k7.output.partition = 7;
        ks.apply_batch(7, &[k7], 5)?;
        ks.apply_batch(8, &[key(2, HOUR, 6)], 6)?;
        let locks = |ks: &KeyStore| {
            let mut held: Vec<i32> =
                ks.partition_writes.lock().unwrap_or_else(PoisonError::into_inner).keys().copied().collect();
            held.sort_unstable();
            held
        };
        assert_eq!(locks(&ks), [7, 8]);
        ks.drop_partition(7)?;
        assert_eq!(locks(&ks), [8], "the dropped partition's apply lock goes with it");
        assert!(ks.get(7, &k7.id_hash)?.is_none());
        assert_eq!(ks.checkpoint(7)?, None);
        assert_eq!(ks.partition_key_count(7)?, 0);
        assert_eq!(ks.partition_key_count(8)?, 1);
        assert_eq!(ks.get(8, &key(2, 0, 0).id_hash)?.map(|k| k.output.offset), Some(6));
        // Rebuilt from scratch: the partition takes keys again.
        ks.apply_batch(7, &[k7], 5)?;
        assert_eq!(ks.get(7, &k7.id_hash)?, Some(k7));
        Ok(())
    }

    /// The memtable is hashed by key (see `keys_cf_options`): a scan must
    /// still see every unflushed key of its partition, in id order, and
    /// none of a neighbour's, and bulk loading must see a partition whose
    /// keys are all unflushed as full.
    #[test]
    fn a_partition_scan_sees_its_unflushed_keys_in_id_order_and_no_neighbours() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), opts())?;
        let in_partition = |p: i32, n: u64| {
            let mut k = key(n, HOUR + n as i64, n as i64);
            k.source.partition = p;
            k.output.partition = p;
            k
        };
        let mut ones: Vec<SeenKey> = (0..300).map(|n| in_partition(1, n)).collect();
        ks.apply_batch(0, &(300..400).map(|n| in_partition(0, n)).collect::<Vec<_>>(), 399)?;
        ks.apply_batch(1, &ones[..150], 149)?;
        ks.apply_batch(1, &ones[150..], 299)?;
        ks.apply_batch(2, &(400..500).map(|n| in_partition(2, n)).collect::<Vec<_>>(), 499)?;
        ones.sort_by_key(|k| k.id_hash);
        assert_eq!(ks.scan_partition(1)?, ones);
        assert!(matches!(ks.bulk_load(1, ones.clone(), None), Err(KeystoreError::PartitionNotEmpty { partition: 1 })));
        Ok(())
    }

    #[test]
    fn bulk_load_fills_an_empty_partition_and_refuses_a_full_one() -> Result<(), KeystoreError> {
        let dir = tempfile::tempdir().map_err(|source| KeystoreError::Io { path: "tmp".into(), source })?;
        let ks = KeyStore::open(dir.path(), opts())?;
        let mut keys: Vec<SeenKey> = (0..1000).map(|n| key(n, HOUR + n as i64, n as i64)).collect();
        keys.sort_by_key(|k| k.id_hash);
        assert_eq!(ks.bulk_load(0, keys.clone(), Some(999))?, 1000);
        assert_eq!(ks.partition_key_count(0)?, 1000);
        assert_eq!(ks.checkpoint(0)?, Some(999));
        assert_eq!(ks.scan_partition(0)?, keys);
        assert!(matches!(ks.bulk_load(0, keys.clone(), None), Err(KeystoreError::PartitionNotEmpty { partition: 0 })));
        let unsorted = vec![keys[1], keys[0]];
        assert!(matches!(ks.bulk_load(1, unsorted, None), Err(KeystoreError::UnsortedBulkLoad { .. })));
        Ok(())
    }
}
