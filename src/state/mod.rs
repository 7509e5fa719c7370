//! Local state: the materialised view of the output topic (DESIGN §1.4).
//!
//! One `LocalState` per process ties together, per partition, the classifier
//! with its hot cache, the durable usage store (`<state-dir>/usage`) and the
//! long-horizon key store (`<state-dir>/keystore`). Everything here changes
//! only through [`LocalState::apply_published`], called with events that are
//! already durably published, in output-offset order. Each tier keeps its own
//! checkpoint (the last output offset it applied) and skips offsets at or
//! below it, so repair can replay the output freely and a crash between two
//! tiers' writes heals on the next apply.
//!
//! Order of apply: the ledger folds the batch, then the usage store
//! appends it (its WAL fsync is the durability point), then the key store
//! and the hot cache. Applies take `&self`, so partitions apply side by
//! side, each tier behind its own locks: the usage store takes one batch
//! at a time, the ledger and the key store lock per partition (RocksDB
//! takes concurrent writers), and each partition's hot cache is its own.
//! With `--fsync always` the usage store leaves a batch's fsync to a group
//! commit, waited for without its lock, so one fsync covers every batch
//! written when it starts.
//!
//! The ledger writes behind (see [`LedgerStore`]), every few seconds:
//! what it folded but had not written when a process died is folded again
//! at open from the usage store (`catch_up_ledger`), which holds it in its
//! memtable (rebuilt from its WAL) or in a segment written since the
//! ledger's last write. Each write records the usage store's next segment
//! id, told to the ledger before the folds it covers, and each batch is
//! folded before the usage store holds it: so an event a write misses is
//! in a segment with that id or a later one, and the restart reads only
//! those. (Not while the ledger is repaired behind the usage store, whose
//! older segments then hold part of the gap: such a write records no id,
//! and its gap is left to the memtable or to repair.) The ledger used to write before every memtable flush instead,
//! under the usage store's lock: with a busy ledger that was the largest
//! part of its cost (tens of thousands of hours written every 100,000
//! events) and a stall for every partition. A batch the usage store
//! already partly holds (the ledger being repaired behind it) is written
//! at once, and so is one with an event the usage store's retention may
//! drop before the next write (`NEAR_RETENTION_MS`). The state directory
//! is locked for one process.
//!
//! The usage store's long writes run on threads of their own, off every
//! partition's batch (`storage` says how): the batch that fills the
//! memtable freezes it and starts its flush, and upkeep (`maintain`)
//! starts compactions. Each thread
//! installs its job under the usage store's lock. Close and drop join them.
//!
//! Sync: no tokio, no rdkafka. Methods may block on fsync.

mod tools;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::classify::{
    classify_records, Classified, HorizonError, InputRecord, LongHorizon, NoLongHorizon, PartitionClassifier,
    Placement, SeenKey,
};
use crate::config::EngineSettings;
use crate::event::{IdHash, UsageEvent, Validator};
use crate::keystore::{KeyStore, KeyStoreOptions, KeyTier, KeystoreError};
use crate::ledger::{Ledger, LedgerError, LedgerStore, Preview};
use crate::storage::{
    CompactionJob, FileSystem, FlushJob, NoopObserver, PendingSync, RecoveryReport, StateDirLock, StorageError,
    StorageObserver, StoreOptions, UsageMarks, UsageStore,
};

pub use crate::storage::{ReadCores, StoredEvent};
pub use tools::{inspect, period, usage, usage_from_events, verify_ledger, verify_state_dir, LedgerCheck};

/// Failure of a state tier. Any of these stops the batch: guessing would
/// risk a double count or a lost event.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Horizon(#[from] HorizonError),
    #[error("usage store: {0}")]
    Storage(#[from] StorageError),
    #[error("key store: {0}")]
    Keystore(#[from] KeystoreError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("periods: {0}")]
    Period(String),
    #[error("cannot create state directory {dir}: {source}")]
    CreateDir { dir: PathBuf, source: std::io::Error },
    #[error("{dir} is not a dedupd state directory ({why}); check the path")]
    NotAStateDir { dir: PathBuf, why: String },
    #[error("partition {partition} is not assigned to this process")]
    NotAssigned { partition: i32 },
    #[error("output offsets must increase within a batch: {previous} then {next} on partition {partition}")]
    OffsetsOutOfOrder { partition: i32, previous: i64, next: i64 },
}

/// That `dir` is a state directory a run of dedupd made: it exists and
/// holds the usage store and the key store (the ledger is optional).
pub fn check_state_dir(dir: &Path) -> Result<(), StateError> {
    let not = |why: String| Err(StateError::NotAStateDir { dir: dir.to_owned(), why });
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return not("not a directory".into()),
        Err(e) => return not(e.to_string()),
    }
    for part in ["usage", "keystore"] {
        if !dir.join(part).is_dir() {
            return not(format!("it holds no {part}/"));
        }
    }
    Ok(())
}

/// Gauges for the metrics layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateStats {
    pub hot_cache_entries: usize,
    pub hot_cache_bytes: usize,
    /// First-seen time of the oldest key the hot caches still hold.
    pub hot_oldest_first_seen_ms: Option<i64>,
    /// First-seen time of the oldest key the key store still holds.
    pub keystore_oldest_first_seen_ms: Option<i64>,
    pub keystore_bytes: u64,
    /// The size cap has pushed the key store's window below its floor.
    pub keystore_window_below_floor: bool,
    /// Hot-cache evictions since the process started, every partition's.
    pub hot_evictions: crate::classify::HotEvictions,
}

/// The durable tiers of a state directory.
struct Durable {
    dir: PathBuf,
    /// Behind its own lock: partitions apply beside each other, and take
    /// the usage store one batch at a time (see `apply_published`).
    /// Shared with the thread that writes a frozen memtable's segment.
    usage: Arc<Mutex<UsageStore>>,
    /// The usage store's checkpoints and next segment id, read by the
    /// ledger's fold without the lock above (see `UsageMarks`).
    usage_marks: Arc<UsageMarks>,
    /// The thread writing a frozen memtable's segment (`start_flush`),
    /// and the one merging segments (`start_compaction`).
    flusher: JobThread,
    compactor: JobThread,
    /// Signalled when the flush thread has installed its segment (or
    /// failed to): appends waiting for the memtable's room wake on it.
    flush_ended: Arc<std::sync::Condvar>,
    keys: Box<dyn KeyTier>,
    recovery: RecoveryReport,
    /// Held for the life of the state: one process per directory. `None`
    /// only on the simulator's disk, where no other process exists.
    _lock: Option<StateDirLock>,
}

/// Where a usage store job (a frozen memtable's segment, or a compaction's
/// merged segment) is written, without the store's lock.
enum JobPlacement {
    /// On a thread of its own: what a state directory uses.
    Thread(Option<std::thread::JoinHandle<()>>),
    /// Held until the owner runs it (`LocalState::run_store_jobs`,
    /// `write_store_jobs`), or an append that needs the memtable's room
    /// does: the simulator's, whose schedule then decides when each job is
    /// written and when installed (a thread would leave it to the host's
    /// scheduler, and a schedule could not be replayed from its seed). A
    /// crash drops the job unrun, or written and not installed.
    Deferred {
        job: Option<Held>,
        /// Taken out and being run: until it is installed the job is still
        /// under way, though the slot is empty.
        running: bool,
    },
}

/// A held job's next step.
enum Held {
    /// Writes the job's segment (without the store's lock), then gives its
    /// install; `None` when the write panicked (the job is abandoned).
    Unwritten(Box<dyn FnOnce() -> Option<Install> + Send>),
    Written(Install),
}

/// Installs a written job under the store's lock.
type Install = Box<dyn FnOnce() + Send>;

/// One slot for a usage store job, written without the store's lock.
/// Joined when the state is closed or dropped: a state dropped without
/// `close` (a crash in a test) lets the write it started on a thread finish
/// before the directory's lock is let go, so no thread of a dead state
/// writes beside the next one.
struct JobThread(Mutex<JobPlacement>);

impl Default for JobThread {
    fn default() -> Self {
        JobThread(Mutex::new(JobPlacement::Thread(None)))
    }
}

impl JobThread {
    fn deferred() -> Self {
        JobThread(Mutex::new(JobPlacement::Deferred { job: None, running: false }))
    }

    /// Waits for the thread's job to end; a deferred job runs to its end
    /// now, on this thread (close finishes the job it started).
    fn join(&self) {
        let handle = match &mut *locked(&self.0) {
            JobPlacement::Thread(handle) => handle.take(),
            JobPlacement::Deferred { .. } => None,
        };
        if let Some(handle) = handle {
            // A job that panicked has poisoned the store (`run`).
            let _ = handle.join();
        }
        while self.step_deferred(true) {}
    }

    /// Runs a deferred job's next step now, on this thread: its write, or
    /// its install. With `install`, a job not yet written is written and,
    /// on the next call, installed; without, only an unwritten job's write
    /// runs. Whether a step ran.
    fn step_deferred(&self, install: bool) -> bool {
        let held = match &mut *locked(&self.0) {
            JobPlacement::Deferred { job, running } => {
                let next = match job.take() {
                    Some(Held::Written(i)) if !install => {
                        *job = Some(Held::Written(i));
                        None
                    }
                    next => next,
                };
                // Only the caller that takes the job says it is being run,
                // and only it says when it is done (below).
                if next.is_some() {
                    *running = true;
                }
                next
            }
            JobPlacement::Thread(_) => None,
        };
        let Some(held) = held else {
            return false;
        };
        // Run without the slot's lock: the job takes the store's, and the
        // store's holder takes the slot's (`run`).
        let written = match held {
            Held::Unwritten(write) => write().map(Held::Written),
            Held::Written(install) => {
                install();
                None
            }
        };
        if let JobPlacement::Deferred { job, running } = &mut *locked(&self.0) {
            // A written job goes back for its install. An installed one
            // leaves the slot as it is: once the install let go of the
            // store's lock, another append may have started the next job.
            if let Some(written) = written {
                debug_assert!(job.is_none(), "a job started while the last one was being written");
                *job = Some(written);
            }
            *running = false;
        }
        true
    }

    /// Runs a deferred job to its end now; whether there was one.
    fn run_deferred(&self) -> bool {
        let ran = self.step_deferred(true);
        while self.step_deferred(true) {}
        ran
    }

    /// Whether a deferred job waits to run (written or not).
    fn waiting(&self) -> bool {
        matches!(&*locked(&self.0), JobPlacement::Deferred { job: Some(_), .. })
    }

    /// Whether a deferred job is written and waits for its install.
    fn written(&self) -> bool {
        matches!(&*locked(&self.0), JobPlacement::Deferred { job: Some(Held::Written(_)), .. })
    }

    /// Whether no job is under way: none started, its thread ended, or (the
    /// deferred) none waiting and none being run.
    fn idle(&self) -> bool {
        match &*locked(&self.0) {
            JobPlacement::Thread(handle) => handle.as_ref().is_none_or(std::thread::JoinHandle::is_finished),
            JobPlacement::Deferred { job, running } => job.is_none() && !running,
        }
    }

    /// Writes a job (`write`, without the store's lock) and installs it
    /// (`install`, which takes the lock), on a new thread named `name`, or
    /// holds it to be run later (deferred). Called with the usage store's
    /// lock held, just after the store started the job: the job before it
    /// on this slot has been installed (the store starts one at a time). A
    /// thread is joined only if it has ended: one that panicked after its
    /// install may still be waiting for the lock held here, to poison the
    /// store, and is left to finish on its own. A job no thread can be
    /// started for is abandoned, which poisons the store: it could never be
    /// installed. A job that panics is abandoned, which poisons the store
    /// at once: otherwise a flush would stay frozen (and the next never
    /// start) and a compaction would stay out, with nothing said until
    /// appends wait.
    fn run<J: Send + 'static>(
        &self,
        store: &Arc<Mutex<UsageStore>>,
        usage: &mut UsageStore,
        name: &'static str,
        job: J,
        write: impl FnOnce(&mut J) + Send + 'static,
        install: impl FnOnce(J, &Mutex<UsageStore>) + Send + 'static,
    ) -> Result<(), StateError> {
        let store = Arc::clone(store);
        let abandon = move |store: &Mutex<UsageStore>| {
            locked(store).abandon_job(&format!("the {name} thread panicked before installing its segment"));
        };
        let write_step = move || -> Option<Install> {
            let mut job = job;
            let wrote = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| write(&mut job)));
            if wrote.is_err() {
                abandon(&store);
                return None;
            }
            Some(Box::new(move || {
                let installed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| install(job, &store)));
                if installed.is_err() {
                    abandon(&store);
                }
            }))
        };
        let mut placement = locked(&self.0);
        let previous = match &mut *placement {
            JobPlacement::Deferred { job, .. } => {
                // The store starts a job only once the one before it is
                // installed, so the slot is empty.
                debug_assert!(job.is_none(), "a {name} job started before the last one ran");
                *job = Some(Held::Unwritten(Box::new(write_step)));
                return Ok(());
            }
            JobPlacement::Thread(previous) => previous,
        };
        if let Some(ended) = previous.take_if(|h| h.is_finished()) {
            let _ = ended.join();
        }
        let body = move || {
            if let Some(install) = write_step() {
                install();
            }
        };
        match std::thread::Builder::new().name(name.to_owned()).spawn(body) {
            Ok(handle) => {
                *previous = Some(handle);
                Ok(())
            }
            Err(e) => {
                let cause = format!("cannot start the {name} thread: {e}");
                usage.abandon_job(&cause);
                Err(StateError::Storage(crate::storage::StorageError::Poisoned { cause }))
            }
        }
    }
}

impl Drop for JobThread {
    fn drop(&mut self) {
        // A deferred job is dropped unrun: the process it belonged to died.
        if let JobPlacement::Thread(handle) = self.0.get_mut().unwrap_or_else(PoisonError::into_inner) {
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}

impl Durable {
    /// The tiers of `dir`, their store jobs placed by `jobs` (on threads,
    /// or held for the simulator's schedule).
    fn new(
        dir: &Path,
        usage: UsageStore,
        keys: Box<dyn KeyTier>,
        recovery: RecoveryReport,
        lock: Option<StateDirLock>,
        jobs: fn() -> JobThread,
    ) -> Durable {
        Durable {
            dir: dir.to_owned(),
            usage_marks: usage.marks(),
            usage: Arc::new(Mutex::new(usage)),
            flusher: jobs(),
            compactor: jobs(),
            flush_ended: Arc::default(),
            keys,
            recovery,
            _lock: lock,
        }
    }

    /// The usage store's lock, once the memtable has room: while a flush
    /// is being written and the frozen and the live memtable together
    /// reach three times the bound, an append waits (without the lock) for
    /// that flush, so a disk slower than the input bounds memory instead
    /// of exhausting it.
    fn usage_with_room(&self) -> MutexGuard<'_, UsageStore> {
        let mut usage = locked(&self.usage);
        loop {
            if !usage.must_wait_for_flush() {
                return usage;
            }
            if self.flusher.idle() {
                // Its thread ended without installing the flush (it
                // panicked): the store cannot move on, and says why.
                usage.abandon_job("the flush thread ended before its segment was installed");
                return usage;
            }
            if self.flusher.waiting() {
                // A deferred flush is written now, by the append that
                // needs its room.
                drop(usage);
                self.flusher.run_deferred();
                usage = locked(&self.usage);
                continue;
            }
            // Woken when the flush's thread is done with the store. The
            // timeout is for a thread that panicked, which is noticed
            // above once it has ended.
            usage = self
                .flush_ended
                .wait_timeout(usage, std::time::Duration::from_millis(50))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Freezes the memtable and writes its segment on the flush thread,
    /// which then installs it under the usage store's lock. A failure
    /// there poisons the store: the next append reports it, and the
    /// frozen events are still in the WAL.
    fn start_flush(&self, usage: &mut UsageStore) -> Result<(), StateError> {
        let Some(job) = usage.start_flush()? else {
            return Ok(());
        };
        let ended = Arc::clone(&self.flush_ended);
        self.flusher.run(&self.usage, usage, "dedupd-flush", job, FlushJob::write, move |job, store| {
            // A failure poisons the store; the next append reports it.
            let _ = locked(store).finish_flush(job);
            ended.notify_all();
        })
    }

    /// Plans a compaction (retention, small segments merged) and runs it
    /// on the compaction thread; the store installs it under its lock.
    /// Every partition appends, and the memtable flushes, meanwhile.
    fn start_compaction(&self, usage: &mut UsageStore, now_ms: i64) -> Result<(), StateError> {
        let Some(job) = usage.start_compaction(now_ms)? else {
            return Ok(());
        };
        self.compactor.run(&self.usage, usage, "dedupd-compact", job, CompactionJob::run, |job, store| {
            // A failure poisons the store; the next append reports it. A
            // corrupt input is left in place, and said.
            if let Ok(report) = locked(store).finish_compaction(job) {
                for path in report.corrupt_segments {
                    tracing::warn!(path = %path.display(), "compaction left a corrupt segment in place; run dedupd verify");
                }
            }
        })
    }
}

/// How often the key store's horizon is enforced: it walks a histogram and
/// may drop whole files, cheap but not free per batch.
const AGE_OUT_EVERY_MS: i64 = 60_000;

/// The local state of every partition this process owns.
pub struct LocalState {
    settings: EngineSettings,
    detect_replays: bool,
    /// Each partition's classifier behind a lock of its own: its one task
    /// classifies and applies, so only the metrics' `stats` and upkeep
    /// (`maintain`) ever wait on it; it is there so other partitions can apply at the same time
    /// (`&self`).
    partitions: BTreeMap<i32, Mutex<PartitionClassifier>>,
    durable: Option<Durable>,
    /// In-memory mode only: last output offset applied, per partition.
    memory_checkpoints: Mutex<BTreeMap<i32, i64>>,
    /// The usage ledger tier; `None` when the ledger is off (and on the
    /// simulator's disk, which models the usage store and key store only).
    /// Where a call takes both, the usage store's lock comes before a
    /// ledger partition's (`maintain`, `catch_up_ledger`; the read-only tools, which hold
    /// the state alone, are the exception and cannot meet another thread).
    /// The durable ledger locks each partition alone (see [`LedgerStore`]).
    ledger: Option<Ledger>,
    /// When the key store last aged out (only `maintain` reads or moves it).
    last_age_out_ms: AtomicI64,
    /// Evictions of hot caches already dropped (revoked partitions), so the
    /// process-wide count never goes back.
    revoked_evictions: crate::classify::HotEvictions,
}

impl std::fmt::Debug for LocalState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalState")
            .field("state_dir", &self.durable.as_ref().map(|d| d.dir.clone()))
            .field("partitions", &self.partitions.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A tier's lock. A panic inside a tier call leaves the tier as its own
/// failure rules leave it (a failed write poisons the usage store), and
/// every tier applies idempotently by output offset: carrying on is safe.
fn locked<T>(tier: &Mutex<T>) -> MutexGuard<'_, T> {
    tier.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A tier held alone (`&mut self`): no lock to take.
fn owned<T>(tier: &mut Mutex<T>) -> &mut T {
    tier.get_mut().unwrap_or_else(PoisonError::into_inner)
}

/// The usage store's options from the engine settings.
pub fn store_options(settings: &EngineSettings) -> StoreOptions {
    StoreOptions {
        fsync: settings.fsync.clone(),
        wal_rotate_bytes: settings.wal_rotate_bytes,
        memtable_max_events: settings.memtable_events,
        // A memtable's segment is written on a thread of its own, off
        // every partition's batches (`Durable::start_flush`).
        write_in_background: true,
        retention_ms: settings.retention_ms(),
        hot_ttl_ms: settings.hot_ttl_ms(),
        hot_capacity: settings.hot_capacity,
        ..StoreOptions::default()
    }
}

/// How much longer the key store keeps a key than the classifier answers
/// from it. The store ages out by the clock of the upkeep that runs it,
/// while a batch classifies by the clock read when it started, which may
/// be earlier (the batch can wait behind that upkeep): a store aged to the
/// exact lifetime would hide keys that batch still counts as remembered,
/// and their retries would be billed twice. The classifier enforces the
/// exact lifetime; an hour more costs 0.12% of a 35-day store.
pub const KEY_STORE_AGE_OUT_SLACK_MS: i64 = 3_600_000;

/// The key store's options from the engine settings.
pub fn keystore_options(settings: &EngineSettings) -> KeyStoreOptions {
    KeyStoreOptions {
        horizon_ms: settings.key_lifetime_ms().saturating_add(KEY_STORE_AGE_OUT_SLACK_MS),
        lifetime_ms: settings.key_lifetime_ms(),
        max_bytes: settings.keystore_max_bytes,
        window_floor_ms: i64::try_from(settings.keystore_window_floor.as_millis()).unwrap_or(i64::MAX),
        block_cache_bytes: usize::try_from(settings.keystore_block_cache_bytes).unwrap_or(usize::MAX),
        write_buffer_bytes: usize::try_from(settings.keystore_write_buffer_bytes).unwrap_or(usize::MAX),
        background_jobs: i32::try_from(settings.keystore_background_jobs).unwrap_or(i32::MAX),
        lookup_helpers: usize::try_from(settings.keystore_lookup_threads).unwrap_or(usize::MAX),
        keep_revoked_partitions: settings.keep_revoked_partitions,
        ..KeyStoreOptions::default()
    }
}

/// Says what opening the usage store repaired, so an operator sees it in
/// the log of the run that did it: a newer manifest that did not read (the
/// generation before it was used), and a torn WAL tail cut away (the
/// events in it were never applied; the output repairs them). Both are
/// what recovery is for, and both can also be the first sign of a failing
/// disk.
fn log_recovery(report: &crate::storage::RecoveryReport) {
    for (file, why) in &report.skipped_manifests {
        tracing::warn!(
            file = %file.display(),
            why = %why,
            "a newer usage-store manifest did not read; recovered from the generation before it"
        );
    }
    if let Some(torn) = &report.torn_tail {
        tracing::warn!(
            file = %torn.file.display(),
            offset = torn.offset,
            dropped_bytes = torn.dropped_bytes,
            detail = %torn.detail,
            "cut a torn tail from the usage store's WAL (a write the last process did not finish)"
        );
    }
}

/// The most stored events a restart reads to catch the ledger up (see
/// `LocalState::catch_up_ledger`); past it, repair folds the gap from the
/// output, which reads only the gap's records. A gap is normally a few
/// seconds of batches, but a merged segment is read whole, and a partition
/// idle for long keeps the segment id of its last write.
const CATCH_UP_MAX_ROWS: u64 = 5_000_000;

/// How close to the usage store's retention cutoff (first seen more than
/// `--retention` ago) a folded event may be before the ledger writes at
/// once. Catching the ledger up at a restart reads its gap from the usage
/// store and checks only that the gap ends at the store's checkpoint: a
/// compaction that dropped the gap's oldest events (a repair of output
/// near the end of retention, folded, then dropped before the write behind
/// came) would leave them folded by no one. Written at once, they are
/// behind the ledger's checkpoint before any compaction can see them past
/// retention. An hour is far more than the write behind's seconds and any
/// step of the clock between an apply and the next compaction; such events
/// are rare (only repairs meet them), so the extra writes cost nothing.
const NEAR_RETENTION_MS: i64 = 3_600_000;

/// A batch's events for the usage store, applied to every other tier
/// already (see [`LocalState::apply_published_append_later`]).
#[derive(Debug)]
pub struct UsageAppend {
    events: Vec<StoredEvent>,
}

impl UsageAppend {
    /// The events to append.
    pub fn events(&self) -> &[StoredEvent] {
        &self.events
    }
}

/// A batch in every tier but the hot cache, its usage-store fsync perhaps
/// still to come.
struct AppliedTiers {
    keys: Vec<SeenKey>,
    pending: Option<PendingSync>,
}

impl LocalState {
    /// State kept in memory only: lost at exit, rebuilt by repair.
    pub fn in_memory(settings: EngineSettings, detect_replays: bool) -> LocalState {
        LocalState {
            ledger: settings.ledger.then(Ledger::in_memory),
            settings,
            detect_replays,
            partitions: BTreeMap::new(),
            durable: None,
            memory_checkpoints: Mutex::new(BTreeMap::new()),
            last_age_out_ms: AtomicI64::new(i64::MIN),
            revoked_evictions: crate::classify::HotEvictions::default(),
        }
    }

    /// Opens the state of a state directory (locking it, recovering the
    /// usage store, opening the key store), or in-memory state when `None`.
    pub fn open(
        state_dir: Option<&Path>,
        settings: EngineSettings,
        detect_replays: bool,
    ) -> Result<LocalState, StateError> {
        LocalState::open_observed(state_dir, settings, detect_replays, Arc::new(NoopObserver))
    }

    /// [`open`](Self::open), reporting storage events (fsync latency,
    /// recovery paths) to `observer`.
    pub fn open_observed(
        state_dir: Option<&Path>,
        settings: EngineSettings,
        detect_replays: bool,
        observer: Arc<dyn StorageObserver>,
    ) -> Result<LocalState, StateError> {
        let mut state = LocalState::open_uncaught(state_dir, settings, detect_replays, observer)?;
        state.catch_up_ledger()?;
        Ok(state)
    }

    /// Opens a state directory for a tool that reads it (`inspect`, `usage
    /// verify`, a dimension query), leaving the ledger as written. Catching
    /// the ledger up folds the unwritten batches with the opener's
    /// `--lateness`, which is only right for the worker that will go on
    /// from there: a tool run with other settings would write its own
    /// on-time/late verdicts for good. So a tool answers as of the ledger's
    /// last written checkpoint, and the worker's next start catches up.
    ///
    /// A tool makes no state directory and no ledger: a mistyped path is an
    /// error, not a new empty state directory that answers "unknown" and
    /// "no drift", and a directory used with `--ledger false` gets no empty
    /// ledger (which `usage` and `period close` would then read as zero
    /// usage).
    pub fn open_for_reading(state_dir: &Path, settings: EngineSettings) -> Result<LocalState, StateError> {
        check_state_dir(state_dir)?;
        let ledger = settings.ledger && state_dir.join("ledger").is_dir();
        LocalState::open_uncaught(Some(state_dir), EngineSettings { ledger, ..settings }, false, Arc::new(NoopObserver))
    }

    fn open_uncaught(
        state_dir: Option<&Path>,
        settings: EngineSettings,
        detect_replays: bool,
        observer: Arc<dyn StorageObserver>,
    ) -> Result<LocalState, StateError> {
        let Some(dir) = state_dir else {
            return Ok(LocalState::in_memory(settings, detect_replays));
        };
        crate::storage::create_dir_durable(dir).map_err(|e| match e {
            StorageError::Io { source, .. } => StateError::CreateDir { dir: dir.to_owned(), source },
            other => StateError::Storage(other),
        })?;
        let lock = StateDirLock::acquire(dir)?;
        let (usage, recovery) = UsageStore::open(&dir.join("usage"), store_options(&settings), observer)?;
        log_recovery(&recovery);
        let keys = KeyStore::open(&dir.join("keystore"), keystore_options(&settings))?;
        let ledger = if settings.ledger {
            Some(Ledger::Durable(Box::new(LedgerStore::open(&dir.join("ledger"))?)))
        } else {
            None
        };
        let mut state = LocalState::in_memory(settings, detect_replays);
        state.ledger = ledger;
        state.durable = Some(Durable::new(dir, usage, Box::new(keys), recovery, Some(lock), JobThread::default));
        Ok(state)
    }

    /// Folds into the ledger what the usage store holds past the ledger's
    /// checkpoint: the batches the ledger had folded but not written when
    /// the process stopped. They are in the usage store's memtable (rebuilt
    /// from its WAL) or in the segments written since the ledger's last
    /// write, whose first id that write recorded; each of those segments is
    /// read once. A partition written without that record (never written,
    /// written by an older version, or written while the ledger was being
    /// repaired behind the usage store) catches up from the memtable alone,
    /// when it holds the whole gap. Any other gap is left to repair from
    /// the output topic, and so is one whose segments would take more than
    /// [`CATCH_UP_MAX_ROWS`] rows to read, or fail to read: repair reads
    /// only the gap's output records. Returns how many events were folded.
    fn catch_up_ledger(&mut self) -> Result<usize, StateError> {
        let (Some(ledger), Some(d)) = (&self.ledger, &self.durable) else {
            return Ok(0);
        };
        let usage = &mut *locked(&d.usage);
        let written_segments = ledger.written_usage_segments()?;
        // Ids taken after the last manifest died with the process; one the
        // ledger recorded must still be the floor of what comes next.
        if let Some(highest) = written_segments.values().max() {
            usage.skip_segment_ids_to(*highest);
        }
        ledger.note_usage_segment(usage.next_segment_id());
        let mut gaps = BTreeMap::new();
        let mut from_memtable = Vec::new();
        for p in usage.partitions() {
            let written = ledger.checkpoint(p)?;
            if written >= usage.checkpoint(p) {
                continue;
            }
            match written_segments.get(&p) {
                Some(_) => {
                    gaps.insert(p, written);
                }
                None => from_memtable.push((p, written)),
            }
        }
        let mut folded = 0;
        let mut fold = |p: i32, events: &[&StoredEvent]| -> Result<(), StateError> {
            let accepted: Vec<(&UsageEvent, i64)> = events.iter().map(|e| (&e.event, e.key.output.offset)).collect();
            ledger.apply(p, &self.settings.lateness, &accepted)?;
            folded += accepted.len();
            Ok(())
        };
        if let Some(first) = gaps.keys().filter_map(|p| written_segments.get(p)).min().copied() {
            let rows: u64 = usage.segments().iter().filter(|s| s.id >= first).map(|s| s.rows).sum::<u64>()
                + usage.memtable_len() as u64;
            let found = if rows > CATCH_UP_MAX_ROWS {
                Err(format!("{rows} stored events to read, more than {CATCH_UP_MAX_ROWS}"))
            } else {
                usage.stored_after(first, &gaps).map_err(|e| e.to_string())
            };
            match found {
                Ok(found) => {
                    for (p, events) in found {
                        // The segment id says where the gap is, and the
                        // usage store holds it up to its checkpoint: if the
                        // last event found is not that, something else
                        // happened, and repair decides.
                        if events.last().map(|e| e.key.output.offset) == usage.checkpoint(p) {
                            fold(p, &events.iter().collect::<Vec<_>>())?;
                        } else {
                            tracing::warn!(partition = p, "the ledger's gap is not where it recorded; repair folds it");
                            ledger.unanchor_written(p)?;
                        }
                    }
                }
                Err(why) => {
                    // Partitions whose gap is all in the memtable still
                    // catch up from it (one partition's old segment id
                    // must not send every partition to repair).
                    for (p, written) in &gaps {
                        match usage.unflushed_after(*p, *written) {
                            Some(events) => fold(*p, &events)?,
                            None => {
                                tracing::warn!(%why, partition = *p, "the ledger's gap is left to repair");
                                ledger.unanchor_written(*p)?;
                            }
                        }
                    }
                }
            }
        }
        for (p, written) in from_memtable {
            match usage.unflushed_after(p, written) {
                Some(events) => fold(p, &events)?,
                None => {
                    ledger.set_anchored(p, false);
                }
            }
        }
        ledger.write_pending()?;
        Ok(folded)
    }

    /// Durable state on another filesystem and key store than the real
    /// ones: the simulator's faulty disk and key-store model. Recovery is
    /// the same code as [`open`](Self::open)'s. The usage store's flush and
    /// compaction jobs (with `write_in_background`) wait for
    /// [`run_store_jobs`](Self::run_store_jobs) instead of running on
    /// threads, so the simulator's schedule places them. The usage ledger,
    /// when `settings.ledger` is on, is kept in memory (the simulated disk
    /// does not model RocksDB): it has no checkpoint at start, so each
    /// process's repair refolds it from the start of the output, which is
    /// what the rollups it publishes must agree with.
    pub fn open_on(
        fs: Arc<dyn FileSystem>,
        dir: &Path,
        keys: Box<dyn KeyTier>,
        settings: EngineSettings,
        store: StoreOptions,
        detect_replays: bool,
    ) -> Result<LocalState, StateError> {
        let (usage, recovery) = UsageStore::open_on(fs, &dir.join("usage"), store, Arc::new(NoopObserver))?;
        let mut state = LocalState::in_memory(settings, detect_replays);
        state.durable = Some(Durable::new(dir, usage, keys, recovery, None, JobThread::deferred));
        Ok(state)
    }

    /// Writes and installs the usage store's flush and compaction held for
    /// later ([`open_on`](Self::open_on)'s), on this thread, the flush
    /// first. Returns how many ran; none on a state directory, whose jobs
    /// run on threads of their own.
    pub fn run_store_jobs(&self) -> usize {
        self.durable
            .as_ref()
            .map_or(0, |d| usize::from(d.flusher.run_deferred()) + usize::from(d.compactor.run_deferred()))
    }

    /// Writes the segments of the held jobs not yet written, leaving their
    /// installs held: a crash now finds a segment written and not in the
    /// manifest. Returns how many were written.
    pub fn write_store_jobs(&self) -> usize {
        self.durable.as_ref().map_or(0, |d| {
            let write = |job: &JobThread| usize::from(job.step_deferred(false));
            write(&d.flusher) + write(&d.compactor)
        })
    }

    /// How many held jobs have their segment written and wait for their
    /// install.
    pub fn store_jobs_written(&self) -> usize {
        self.durable.as_ref().map_or(0, |d| usize::from(d.flusher.written()) + usize::from(d.compactor.written()))
    }

    /// How many usage store jobs wait for [`run_store_jobs`](Self::run_store_jobs).
    pub fn store_jobs_waiting(&self) -> usize {
        self.durable.as_ref().map_or(0, |d| usize::from(d.flusher.waiting()) + usize::from(d.compactor.waiting()))
    }

    /// Calls `f` on every event the usage store holds for `partition`
    /// (none without a state directory).
    pub fn for_each_stored(&self, partition: i32, mut f: impl FnMut(&StoredEvent)) -> Result<(), StateError> {
        if let Some(d) = &self.durable {
            locked(&d.usage).for_each_event(|e| {
                if e.key.output.partition == partition {
                    f(e);
                }
            })?;
        }
        Ok(())
    }

    /// The key store's answers for `ids` of `partition` (all `None` without
    /// a state directory).
    pub fn remembered_keys(&self, partition: i32, ids: &[IdHash]) -> Result<Vec<Option<SeenKey>>, StateError> {
        let mut out = Vec::new();
        self.long_horizon().lookup_many(partition, ids, &mut out)?;
        Ok(out)
    }

    pub fn settings(&self) -> &EngineSettings {
        &self.settings
    }

    /// What the usage store found when it opened (torn tails, fallbacks).
    pub fn recovery_report(&self) -> Option<&RecoveryReport> {
        self.durable.as_ref().map(|d| &d.recovery)
    }

    /// The state directory, when there is one.
    pub fn state_dir(&self) -> Option<&Path> {
        self.durable.as_ref().map(|d| d.dir.as_path())
    }

    /// Takes ownership of `partition`: creates its classifier and seeds its
    /// hot cache from the usage store's recent keys. Idempotent.
    pub fn assign(&mut self, partition: i32, now_ms: i64) -> Result<(), StateError> {
        self.assign_all(&[partition], now_ms)
    }

    /// [`assign`](Self::assign) for several partitions at once, their hot
    /// caches seeded from one pass over the usage store's sidecars rather
    /// than one pass each (a rebalance or a start that brings many
    /// partitions; warm standbys starting to follow several).
    pub fn assign_all(&mut self, partitions: &[i32], now_ms: i64) -> Result<(), StateError> {
        let new: std::collections::BTreeSet<i32> =
            partitions.iter().copied().filter(|p| !self.partitions.contains_key(p)).collect();
        if new.is_empty() {
            return Ok(());
        }
        let mut keys = match &mut self.durable {
            Some(d) => locked(&d.usage).recovery_hot_keys_of(&new, now_ms)?,
            None => Default::default(),
        };
        for p in new {
            let mut classifier = PartitionClassifier::new(p, self.settings.classifier(self.detect_replays));
            classifier.commit(keys.remove(&p).unwrap_or_default().iter(), now_ms);
            self.partitions.insert(p, Mutex::new(classifier));
        }
        Ok(())
    }

    /// Releases `partition`: its hot cache is dropped, and its keys too unless
    /// `keep_revoked_partitions` is set (they often come back).
    pub fn revoke(&mut self, partition: i32) -> Result<(), StateError> {
        if let Some(c) = self.partitions.remove(&partition) {
            let c = c.into_inner().unwrap_or_else(PoisonError::into_inner);
            self.revoked_evictions = self.revoked_evictions + c.hot_cache().evictions();
        }
        match &self.durable {
            // Without a state directory the hot cache was all this process
            // knew of the partition, and it is gone: so is the checkpoint.
            // Kept, it would start the repair of a later assignment past
            // every event the cache held, and a retry of one of them would
            // be accepted and billed again.
            None => {
                owned(&mut self.memory_checkpoints).remove(&partition);
            }
            Some(d) => {
                if !self.settings.keep_revoked_partitions {
                    d.keys.drop_partition(partition)?;
                }
                if let Some(ledger) = &self.ledger {
                    ledger.release(partition)?;
                }
            }
        }
        Ok(())
    }

    pub fn assigned(&self) -> impl Iterator<Item = i32> + '_ {
        self.partitions.keys().copied()
    }

    /// The last output offset applied to *every* tier of `partition`: repair
    /// reads the output partition from the next offset. `None`: read it all.
    pub fn checkpoint(&self, partition: i32) -> Option<i64> {
        match &self.durable {
            None => locked(&self.memory_checkpoints).get(&partition).copied(),
            Some(d) => {
                let usage = locked(&d.usage).checkpoint(partition)?;
                // A key store that cannot answer is treated as empty: repair
                // then replays everything, which is always safe.
                let keys = d.keys.checkpoint(partition).ok().flatten()?;
                self.checkpoint_with(partition, Some(usage.min(keys)))
            }
        }
    }

    /// The lower of `tiers` (the durable tiers' checkpoint, `None` when one
    /// has none) and the ledger's, when kept.
    fn checkpoint_with(&self, partition: i32, tiers: Option<i64>) -> Option<i64> {
        let tiers = tiers?;
        match &self.ledger {
            None => Some(tiers),
            Some(ledger) => Some(tiers.min(ledger.checkpoint(partition).ok().flatten()?)),
        }
    }

    /// The last output offset applied to *any* tier of `partition`. Differs
    /// from [`checkpoint`](Self::checkpoint) when one tier has none (its
    /// partition dropped, a moved key store) or lags the other after a crash.
    pub fn furthest_checkpoint(&self, partition: i32) -> Option<i64> {
        match &self.durable {
            // The in-memory ledger outlives a revoke (it skips what it has
            // folded by its own checkpoint), so its progress still counts.
            None => {
                let ledger = self.ledger.as_ref().and_then(|l| l.checkpoint(partition).ok().flatten());
                locked(&self.memory_checkpoints).get(&partition).copied().max(ledger)
            }
            Some(d) => {
                let usage = locked(&d.usage).checkpoint(partition);
                let keys = d.keys.checkpoint(partition).ok().flatten();
                let ledger = self.ledger.as_ref().and_then(|l| l.checkpoint(partition).ok().flatten());
                usage.max(keys).max(ledger)
            }
        }
    }

    /// Each durable part's checkpoint of `partition`, by the directory
    /// that holds it (`usage`, `keystore`, `ledger` when kept): what an
    /// operator removes to have that part rebuilt from the output.
    pub fn checkpoints_by_part(&self, partition: i32) -> Vec<(&'static str, Option<i64>)> {
        let Some(d) = &self.durable else { return Vec::new() };
        let mut parts = vec![
            ("usage", locked(&d.usage).checkpoint(partition)),
            ("keystore", d.keys.checkpoint(partition).ok().flatten()),
        ];
        if let Some(ledger) = &self.ledger {
            parts.push(("ledger", ledger.checkpoint(partition).ok().flatten()));
        }
        parts
    }

    fn long_horizon(&self) -> &dyn LongHorizon {
        match &self.durable {
            Some(d) => d.keys.as_ref(),
            None => &NoLongHorizon,
        }
    }

    /// Classifies a batch of `partition`. Read-only.
    pub fn classify(
        &self,
        partition: i32,
        validator: &Validator,
        records: &[InputRecord<'_>],
        now_ms: i64,
        placement: Option<&Placement>,
    ) -> Result<Classified, StateError> {
        let classifier = locked(self.partitions.get(&partition).ok_or(StateError::NotAssigned { partition })?);
        Ok(classify_records(validator, &classifier, self.long_horizon(), records, now_ms, placement)?)
    }

    /// [`classify`](Self::classify) of a batch already validated
    /// ([`crate::classify::validate_records`], which needs no state).
    pub fn classify_validated(
        &self,
        partition: i32,
        batch: crate::classify::Validated,
        now_ms: i64,
    ) -> Result<Classified, StateError> {
        let classifier = locked(self.partitions.get(&partition).ok_or(StateError::NotAssigned { partition })?);
        Ok(crate::classify::classify_validated(&classifier, self.long_horizon(), batch, now_ms)?)
    }

    /// Applies published events of `partition`, in output-offset order.
    /// Events at or below the checkpoint are skipped. Returns how many were
    /// new to the state as a whole, once the fsync that covers them has.
    pub fn apply_published(&self, partition: i32, batch: &[StoredEvent], now_ms: i64) -> Result<usize, StateError> {
        let Some(applied) = self.apply_durable_tiers(partition, batch, now_ms)? else {
            return Ok(0);
        };
        if let Some(pending) = applied.pending {
            pending.wait()?;
        }
        self.commit_hot(partition, &applied.keys, now_ms)?;
        Ok(applied.keys.len())
    }

    /// [`apply_published`](Self::apply_published) with the usage store's
    /// part left to the caller: the batch is in the ledger, the key store
    /// and the hot cache when this returns, and the returned
    /// [`UsageAppend`] (with a state directory) is to be given to
    /// [`append_usage_later`](Self::append_usage_later), on another thread
    /// while this one goes on with the next batch, as `dedupd dedupe` does.
    /// Batches of one partition must be appended in the order they were
    /// applied.
    ///
    /// Safe because state is a view of the output, and the batch's output
    /// is durable before this is called: the next batch is classified
    /// against the hot cache and the key store, which hold these keys, and
    /// never against the usage store. Until the append is made, the usage
    /// store's checkpoint lags the key store's, which a restart reads as a
    /// crash between the two tiers: repair applies the gap from the output
    /// again, and each tier skips what it holds. What does read the usage
    /// store (a conflict's original) must wait for the appends handed out.
    pub fn apply_published_append_later(
        &self,
        partition: i32,
        batch: Vec<StoredEvent>,
        now_ms: i64,
    ) -> Result<(usize, Option<UsageAppend>), StateError> {
        // Against the checkpoint of the tiers written here, not the usage
        // store's: reading that takes its lock, which the thread making
        // the previous batch's append holds (the ledger's fold reads what
        // it needs of the usage store without it: `UsageMarks`). A usage
        // store behind the others (after a crash between the tiers) is
        // handed the whole batch and skips what it holds by its own
        // checkpoint.
        let checkpoint = match &self.durable {
            None => self.checkpoint(partition),
            Some(d) => self.checkpoint_with(partition, d.keys.checkpoint(partition).ok().flatten()),
        };
        let fresh = self.fresh_in_batch(partition, &batch, checkpoint)?;
        let keys: Vec<SeenKey> = fresh.iter().map(|e| e.key).collect();
        if let (Some(first), Some(last)) = (fresh.first(), fresh.last()) {
            let (first, last) = (first.key.output.offset, last.key.output.offset);
            // As in `apply_durable_tiers`: the ledger folds first.
            self.fold_into_ledger(partition, &fresh, first, now_ms)?;
            match &self.durable {
                None => {
                    locked(&self.memory_checkpoints).insert(partition, last);
                }
                Some(d) => d.keys.apply_batch(partition, &keys, last)?,
            }
            self.commit_hot(partition, &keys, now_ms)?;
        }
        let append = match &self.durable {
            Some(_) if !batch.is_empty() => Some(UsageAppend { events: batch }),
            _ => None,
        };
        Ok((keys.len(), append))
    }

    /// A batch's usage-store part, handed back by
    /// [`apply_published_append_later`](Self::apply_published_append_later).
    /// With `--fsync always`, returns the pending fsync to wait on.
    pub fn append_usage_later(&self, append: UsageAppend) -> Result<Option<PendingSync>, StateError> {
        let Some(d) = &self.durable else {
            return Ok(None);
        };
        // Moved in whole: no copy of the events is made for the memtable.
        self.append_to_usage_store(d, append.events)
    }

    fn commit_hot(&self, partition: i32, keys: &[SeenKey], now_ms: i64) -> Result<(), StateError> {
        let classifier = self.partitions.get(&partition).ok_or(StateError::NotAssigned { partition })?;
        locked(classifier).commit(keys.iter(), now_ms);
        Ok(())
    }

    /// Every tier's part of an apply but the hot cache's and the wait for
    /// the usage store's fsync. `None`: nothing in the batch was new.
    fn apply_durable_tiers(
        &self,
        partition: i32,
        batch: &[StoredEvent],
        now_ms: i64,
    ) -> Result<Option<AppliedTiers>, StateError> {
        // By reference: every tier reads them; the usage store's memtable
        // keeps one copy.
        let checkpoint = self.checkpoint(partition);
        let fresh = self.fresh_in_batch(partition, batch, checkpoint)?;
        let (Some(first), Some(last)) = (fresh.first(), fresh.last()) else {
            return Ok(None);
        };
        let (first, last) = (first.key.output.offset, last.key.output.offset);
        let fresh = &fresh[..];
        // The ledger folds the batch before the usage store holds it: see
        // `fold_into_ledger` for why.
        self.fold_into_ledger(partition, fresh, first, now_ms)?;
        // The keys the other tiers remember.
        let keys: Vec<SeenKey> = fresh.iter().map(|e| e.key).collect();
        // With `--fsync always` the usage store's append leaves the fsync to
        // a group commit, waited for by the caller without its lock: other
        // partitions' batches append meanwhile, and an fsync covers every
        // batch written when it starts. The key store (locked per
        // partition) is written before the wait, so another partition's
        // fsync may cover this batch while it is. Each tier skips what it
        // already holds, so one that got ahead of another before a crash is
        // not written twice.
        let pending = self.append_usage(partition, fresh, last)?;
        if let Some(d) = &self.durable {
            d.keys.apply_batch(partition, &keys, last)?;
        }
        Ok(Some(AppliedTiers { keys, pending }))
    }

    /// The events of `batch` past `checkpoint`, in order: the ones an
    /// apply adds. Their output offsets must rise.
    fn fresh_in_batch<'b>(
        &self,
        partition: i32,
        batch: &'b [StoredEvent],
        checkpoint: Option<i64>,
    ) -> Result<Vec<&'b StoredEvent>, StateError> {
        if !self.partitions.contains_key(&partition) {
            return Err(StateError::NotAssigned { partition });
        }
        let mut previous = checkpoint.unwrap_or(i64::MIN);
        let mut fresh = Vec::with_capacity(batch.len());
        for e in batch {
            let offset = e.key.output.offset;
            if checkpoint.is_some_and(|c| offset <= c) {
                continue;
            }
            if offset <= previous {
                return Err(StateError::OffsetsOutOfOrder { partition, previous, next: offset });
            }
            previous = offset;
            fresh.push(e);
        }
        Ok(fresh)
    }

    /// The ledger's part of an apply, before the usage store's.
    ///
    /// The ledger folds and writes behind, every [`WRITE_BEHIND`]. A
    /// restart catches it up from the usage store (`catch_up_ledger`): from
    /// its memtable and the segments from the id its last write recorded,
    /// the largest of the usage store's next segment ids told so far (here,
    /// before each fold). Each batch is folded before the usage store holds
    /// it, so an event a write misses goes to a segment at or past that id,
    /// as long as the partition is anchored (not behind). One case writes
    /// now: the usage store already holds some of the batch
    /// (the ledger is being repaired behind it), so those events may be in
    /// older segments. So does a partition's first fold in this process,
    /// so that a restart finds a segment id for it (see
    /// [`Ledger::set_anchored`]). And so does a batch holding an event the
    /// usage store's retention may drop before the next write (see
    /// [`NEAR_RETENTION_MS`]).
    ///
    /// [`WRITE_BEHIND`]: crate::ledger::WRITE_BEHIND
    fn fold_into_ledger(
        &self,
        partition: i32,
        fresh: &[&StoredEvent],
        first: i64,
        now_ms: i64,
    ) -> Result<(), StateError> {
        let Some(ledger) = &self.ledger else {
            return Ok(());
        };
        // Only this partition's applies move its checkpoint in the usage
        // store (an append made beside the next batch is of a batch handed
        // over before this one's), so the answer holds. Read without the
        // usage store's lock, which an append or upkeep in progress holds.
        let behind = self.durable.as_ref().is_some_and(|d| {
            ledger.note_usage_segment(d.usage_marks.next_segment_id());
            d.usage_marks.checkpoint(partition).is_some_and(|u| u >= first)
        });
        // Not behind: nothing the usage store holds of the partition is past
        // what the ledger has folded (each batch is folded before it is
        // appended), so the id just told is a floor for what comes next.
        let first_fold = !ledger.set_anchored(partition, !behind);
        let accepted: Vec<(&UsageEvent, i64)> = fresh.iter().map(|e| (&e.event, e.key.output.offset)).collect();
        ledger.apply(partition, &self.settings.lateness, &accepted)?;
        // Asked last: a scan of the batch, needed only when nothing else
        // writes now.
        let near_retention = || {
            let cutoff_soon = now_ms.saturating_sub(self.settings.retention_ms()).saturating_add(NEAR_RETENTION_MS);
            self.durable.is_some() && fresh.iter().any(|e| e.key.first_seen_ms <= cutoff_soon)
        };
        if behind || first_fold || ledger.write_due() || near_retention() {
            ledger.write_pending()?;
        }
        Ok(())
    }

    /// The usage store's part of an apply (or, without a state directory,
    /// the partition's checkpoint in memory, moved only after the ledger's
    /// fold succeeded). With `--fsync always`, returns the batch's pending
    /// fsync, for the caller to wait on without the lock.
    fn append_usage(
        &self,
        partition: i32,
        fresh: &[&StoredEvent],
        last: i64,
    ) -> Result<Option<PendingSync>, StateError> {
        let Some(d) = &self.durable else {
            locked(&self.memory_checkpoints).insert(partition, last);
            return Ok(None);
        };
        // The copies the usage store's memtable keeps, made before taking
        // its lock, and only when there is a usage store to keep them:
        // without a state directory, copying each event to drop it was 7%
        // of the offline path's instructions.
        let copies: Vec<StoredEvent> = fresh.iter().map(|e| (*e).clone()).collect();
        self.append_to_usage_store(d, copies)
    }

    /// Appends `events` to the usage store (it skips what it holds by its
    /// own checkpoint) and starts a flush when the memtable is full; with
    /// `--fsync always`, returns the pending fsync to wait on without the
    /// lock.
    fn append_to_usage_store(&self, d: &Durable, events: Vec<StoredEvent>) -> Result<Option<PendingSync>, StateError> {
        let mut usage = d.usage_with_room();
        let pending = usage.append_deferred(events)?.1;
        self.start_flush_if_wanted(d, &mut usage)?;
        Ok(pending)
    }

    /// Starts moving a full memtable into a segment on the flush thread.
    /// Called with the usage store's lock held. The ledger need not write
    /// first: a restart finds what it had not written in the segment (see
    /// `catch_up_ledger`).
    fn start_flush_if_wanted(&self, d: &Durable, usage: &mut UsageStore) -> Result<(), StateError> {
        if !usage.flush_wanted() {
            return Ok(());
        }
        d.start_flush(usage)
    }

    /// The accepted event with this id, first seen at `first_seen_ms` (as
    /// the classifier's tiers remember it): one segment read, never a scan
    /// of the history. A conflict's original on the hot path.
    pub fn original_seen_at(
        &self,
        partition: i32,
        id: &IdHash,
        first_seen_ms: i64,
    ) -> Result<Option<UsageEvent>, StateError> {
        match &self.durable {
            None => Ok(None),
            Some(d) => Ok(locked(&d.usage).get_first_seen(partition, id, first_seen_ms)?.map(|s| s.event)),
        }
    }

    /// [`original_seen_at`](Self::original_seen_at) for a batch's
    /// conflicts at once: a segment holding several originals is read once.
    pub fn originals_seen_at(
        &self,
        partition: i32,
        wanted: &[(IdHash, i64)],
        cores: ReadCores,
    ) -> Result<Vec<Option<UsageEvent>>, StateError> {
        match &self.durable {
            None => Ok(vec![None; wanted.len()]),
            Some(d) => {
                // The store's lock is held to plan and to finish, not for
                // the group reads between: this partition's apply and other
                // partitions' appends go on while a storm's originals are
                // read.
                let mut lookup = locked(&d.usage).plan_first_seen_many(partition, wanted)?;
                lookup.read(cores)?;
                let found = locked(&d.usage).finish_first_seen_many(lookup)?;
                Ok(found.into_iter().map(|s| s.map(|s| s.event)).collect())
            }
        }
    }

    /// The ledger's changes if `accepted` (in output order, with the output
    /// offsets they will have) were applied now: the rollups and adjustments
    /// a batch publishes in its own transaction, with those of its `replays`
    /// published again (see [`Replays`](crate::ledger::Replays)). `None`
    /// with the ledger off.
    pub fn ledger_preview(
        &self,
        partition: i32,
        accepted: &[(&UsageEvent, i64)],
        replays: &crate::ledger::Replays<'_>,
    ) -> Result<Option<Preview>, StateError> {
        match &self.ledger {
            None => Ok(None),
            Some(l) => Ok(Some(l.preview(partition, &self.settings.lateness, accepted, replays)?)),
        }
    }

    /// Answers `query` from this process's ledger (its partitions' share);
    /// `None` with the ledger off.
    pub fn usage(&self, query: &crate::ledger::UsageQuery) -> Result<Option<crate::ledger::UsageAnswer>, StateError> {
        match &self.ledger {
            None => Ok(None),
            Some(ledger) => Ok(Some(ledger.answer(query)?)),
        }
    }

    /// The ledger tier, when kept.
    pub fn ledger(&self) -> Option<&Ledger> {
        self.ledger.as_ref()
    }

    /// Periodic upkeep between batches: expire hot keys, flush and compact
    /// the usage store, age out the key store.
    /// Takes the state shared: `dedupd dedupe` keeps a batch's conflict
    /// originals reading on another thread meanwhile.
    pub fn maintain(&self, now_ms: i64) -> Result<(), StateError> {
        for c in self.partitions.values() {
            locked(c).evict_expired(now_ms);
        }
        if let Some(d) = &self.durable {
            let mut usage = locked(&d.usage);
            if let Some(ledger) = &self.ledger {
                if ledger.write_due() {
                    ledger.note_usage_segment(usage.next_segment_id());
                    ledger.write_pending()?;
                }
            }
            self.start_flush_if_wanted(d, &mut usage)?;
            usage.maintain(now_ms)?;
            d.start_compaction(&mut usage, now_ms)?;
            drop(usage);
            if now_ms.saturating_sub(self.last_age_out_ms.load(Ordering::Relaxed)) >= AGE_OUT_EVERY_MS {
                d.keys.age_out(now_ms)?;
                self.last_age_out_ms.store(now_ms, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    pub fn stats(&self, now_ms: i64) -> StateStats {
        let mut s = StateStats { hot_evictions: self.revoked_evictions, ..StateStats::default() };
        for c in self.partitions.values() {
            let c = locked(c);
            let hot = c.hot_cache();
            s.hot_evictions = s.hot_evictions + hot.evictions();
            s.hot_cache_entries += hot.len();
            s.hot_cache_bytes += hot.heap_bytes();
            if let Some(t) = hot.oldest_first_seen_ms() {
                s.hot_oldest_first_seen_ms = Some(s.hot_oldest_first_seen_ms.map_or(t, |o: i64| o.min(t)));
            }
        }
        if let Some(d) = &self.durable {
            s.keystore_bytes = d.keys.disk_bytes();
            s.keystore_oldest_first_seen_ms = d.keys.oldest_first_seen_ms().ok().flatten();
            s.keystore_window_below_floor = d.keys.window_below_floor(now_ms).unwrap_or(false);
        }
        s
    }

    /// Flushes and closes every tier.
    pub fn close(self) -> Result<(), StateError> {
        if let Some(l) = self.ledger {
            l.flush()?;
        }
        if let Some(d) = self.durable {
            d.keys.flush()?;
            // A flush being written finishes first (its segment is as good
            // as close's own), then close's flush moves the rest.
            d.flusher.join();
            d.compactor.join();
            locked(&d.usage).flush()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::testutil::sample_event_at;

    const NOW: i64 = 1_700_000_100_000;

    #[test]
    fn a_tier_without_a_checkpoint_does_not_hide_how_far_the_other_got() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = EngineSettings { keep_revoked_partitions: false, ..EngineSettings::default() };
        let mut state = LocalState::open(Some(dir.path()), settings, true).expect("open");
        state.assign(4, NOW).expect("assign");
        let batch: Vec<StoredEvent> = (0..3).map(|i| sample_event_at(i, 4, 10 + i as i64, NOW)).collect();
        state.apply_published(4, &batch, NOW).expect("apply");
        assert_eq!((state.checkpoint(4), state.furthest_checkpoint(4)), (Some(12), Some(12)));

        // The revoke drops the key store's copy of the partition; the usage
        // store still holds offsets up to 12.
        state.revoke(4).expect("revoke");
        state.assign(4, NOW).expect("assign again");
        assert_eq!(state.checkpoint(4), None, "repair must start from scratch for the key store");
        assert_eq!(state.furthest_checkpoint(4), Some(12), "but the usage store's progress stays visible");
    }

    /// Counts the usage-store segments read through their sidecars.
    #[derive(Default)]
    struct SidecarReads(std::sync::atomic::AtomicUsize);

    impl crate::storage::StorageObserver for SidecarReads {
        fn recovery_segment(&self, path: crate::storage::RecoveryPath) {
            if path == crate::storage::RecoveryPath::Sidecar {
                self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Several partitions assigned together get the hot caches they would
    /// get one by one (the same keys: the TTL window and the capacity cut
    /// the same way), from one read of each segment instead of one per
    /// partition (issue #14: no per-assignment scans of every sidecar).
    #[test]
    fn assigning_partitions_together_seeds_the_same_hot_caches_from_one_pass_over_the_segments() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = EngineSettings {
            memtable_events: 50,
            hot_capacity: 50,
            hot_ttl: std::time::Duration::from_secs(3600),
            ..EngineSettings::default()
        };
        let partitions = [0, 1, 2];
        {
            let mut state = LocalState::open(Some(dir.path()), settings.clone(), true).expect("open");
            state.assign_all(&partitions, NOW).expect("assign");
            for round in 0..4u64 {
                for &p in &partitions {
                    // Each round a second later: at reopen the first two
                    // rounds are past the hot TTL.
                    let seen = NOW + round as i64 * 1000;
                    let batch: Vec<StoredEvent> = (0..40)
                        .map(|i| sample_event_at(round * 1000 + i + 100 * p as u64, p, (round * 40 + i) as i64, seen))
                        .collect();
                    state.apply_published(p, &batch, seen).expect("apply");
                }
            }
            state.close().expect("close");
        }
        let reopened_at = NOW + 3_600_000 + 1500;
        let seeded = |together: bool| {
            let reads = Arc::new(SidecarReads::default());
            let mut state =
                LocalState::open_observed(Some(dir.path()), settings.clone(), true, reads.clone()).expect("reopen");
            let before = reads.0.load(std::sync::atomic::Ordering::Relaxed);
            if together {
                state.assign_all(&partitions, reopened_at).expect("assign together");
            } else {
                for &p in &partitions {
                    state.assign(p, reopened_at).expect("assign one");
                }
            }
            let read = reads.0.load(std::sync::atomic::Ordering::Relaxed) - before;
            let caches: Vec<Vec<crate::classify::SeenKey>> = partitions
                .iter()
                .map(|p| {
                    let mut keys: Vec<crate::classify::SeenKey> =
                        locked(&state.partitions[p]).hot_cache().iter().collect();
                    keys.sort_by_key(|k| k.output.offset);
                    keys
                })
                .collect();
            state.close().expect("close");
            (read, caches)
        };
        let (read_one_by_one, one_by_one) = seeded(false);
        let (read_together, together) = seeded(true);
        assert_eq!(together, one_by_one, "the same keys, partition by partition");
        for (p, keys) in partitions.iter().zip(&together) {
            // 80 keys within the TTL, the newest 50 kept: offsets 110..=159.
            let offsets: Vec<i64> = keys.iter().map(|k| k.output.offset).collect();
            assert_eq!(offsets, (110..160).collect::<Vec<i64>>(), "partition {p}");
            assert!(keys.iter().all(|k| k.output.partition == *p));
        }
        assert!(read_together > 0, "the keys came from segments");
        assert_eq!(read_one_by_one, 3 * read_together, "one read of each segment, not one per partition");
    }

    #[test]
    fn without_a_state_directory_a_revoked_partition_is_repaired_from_the_start_when_it_comes_back() {
        let mut state = LocalState::in_memory(EngineSettings::default(), true);
        state.assign(3, NOW).expect("assign");
        let batch: Vec<StoredEvent> = (0..3).map(|i| sample_event_at(i, 3, i as i64, NOW)).collect();
        state.apply_published(3, &batch, NOW).expect("apply");
        assert_eq!(state.checkpoint(3), Some(2));
        state.revoke(3).expect("revoke");
        state.assign(3, NOW).expect("assign again");
        // The hot cache of the first assignment is gone: a repair from
        // offset 3 would leave events 0..=2 unknown, and their retries new.
        assert_eq!(state.checkpoint(3), None, "repair must read the whole output partition again");
        state.apply_published(3, &batch, NOW).expect("repair");
        assert_eq!(state.checkpoint(3), Some(2));
    }

    #[test]
    fn inspecting_a_crashed_state_directory_leaves_its_unwritten_ledger_batches_to_the_worker() {
        let dir = tempfile::tempdir().expect("tempdir");
        let batch: Vec<StoredEvent> = (0..4).map(|i| sample_event_at(i * 7, 2, i as i64, NOW)).collect();
        {
            let mut state = LocalState::open(Some(dir.path()), EngineSettings::default(), true).expect("open");
            state.assign(2, NOW).expect("assign");
            // The first apply after an open writes the ledger at once; the
            // second waits (written behind), and the process dies first.
            state.apply_published(2, &batch[..2], NOW).expect("apply");
            state.apply_published(2, &batch[2..], NOW).expect("apply");
        }
        let e = &batch[0].event;
        let answer = inspect(dir.path(), &e.tenant_id, &e.event_id, EngineSettings::default()).expect("inspect");
        assert_eq!(answer["known"], true);
        // The worker starts again: the batch the ledger had not written is
        // still in the usage store's memtable, and is folded again there.
        let state = LocalState::open(Some(dir.path()), EngineSettings::default(), true).expect("reopen");
        assert_eq!(state.checkpoint(2), Some(3), "every tier, the ledger too, holds the whole output");
    }

    #[test]
    fn a_published_event_its_hour_cannot_sum_is_kept_as_an_adjustment_and_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut state = LocalState::open(Some(dir.path()), EngineSettings::default(), true).expect("open");
        state.assign(2, NOW).expect("assign");
        let event = |n: u64, offset: i64, qty: rust_decimal::Decimal| {
            let mut s = sample_event_at(n, 2, offset, NOW);
            s.event.tenant_id = "acme".into();
            s.event.customer_id = "cus_one".into();
            s.event.meter = "api_calls".into();
            s.event.timestamp_ms = NOW;
            s.event.kind = crate::event::EventKind::Usage;
            s.event.quantity = qty;
            s
        };
        let fine = [event(1, 0, 1.into()), event(2, 1, 1.into())];
        state.apply_published(2, &fine, NOW).expect("apply");
        // Two events no exact decimal holds on top of the hour's 2,
        // published already. The ledger's fold failed the batch, and the
        // batch, coming again (or repaired from the output after a
        // restart), failed the same way forever. Each is now an adjustment
        // of its own, and the hour keeps its 2.
        let huge = rust_decimal::Decimal::MAX;
        let overflowing = [event(3, 2, huge), event(4, 3, huge)];
        state.apply_published(2, &overflowing, NOW).expect("an event past the sum limit is applied");
        assert_eq!(state.checkpoint(2), Some(3));
        let adjustments = |state: &LocalState| -> Vec<(crate::ledger::AdjustmentReason, i64)> {
            match state.ledger() {
                Some(crate::ledger::Ledger::Durable(store)) => store
                    .all_adjustments()
                    .expect("scan")
                    .into_iter()
                    .map(|(_, a)| (a.reason, a.output_offset))
                    .collect(),
                _ => panic!("a durable ledger"),
            }
        };
        state.close().expect("close");
        let mut state = LocalState::open(Some(dir.path()), EngineSettings::default(), true).expect("reopen");
        state.assign(2, NOW).expect("assign");
        assert_eq!(state.checkpoint(2), Some(3));
        let sum_limit = crate::ledger::AdjustmentReason::SumLimit;
        assert_eq!(adjustments(&state), [(sum_limit, 2), (sum_limit, 3)]);
    }

    /// A ledger repaired behind the usage store (which holds the events
    /// already, in segments and in its memtable) records no segment id
    /// with its writes: a crash in the middle of that repair leaves the
    /// rest of the gap to repair, rather than folding only the part in the
    /// memtable and skipping the events in between.
    #[test]
    fn a_crash_while_the_ledger_is_repaired_behind_the_usage_store_folds_no_partial_gap() {
        let settings = EngineSettings { memtable_events: 40, ..EngineSettings::default() };
        let dir = tempfile::tempdir().expect("tempdir");
        let events: Vec<StoredEvent> = (1..=100u64).map(|n| sample_event_at(n, 0, n as i64, NOW)).collect();
        let open = || {
            let mut state = LocalState::open(Some(dir.path()), settings.clone(), true).expect("open");
            state.assign_all(&[0], NOW).expect("assign");
            state
        };
        {
            let state = open();
            for batch in events.chunks(10) {
                state.apply_published(0, batch, NOW).expect("apply");
            }
            // The process dies: the last events are in the memtable (the
            // WAL keeps them), the others in segments.
        }
        std::fs::remove_dir_all(dir.path().join("ledger")).expect("lose the ledger");
        {
            let state = open();
            assert_eq!(state.checkpoint(0), None, "a lost ledger is repaired from the start");
            state.apply_published(0, &events[..10], NOW).expect("the repair's first batch");
            assert_eq!(state.checkpoint(0), Some(10));
            // The process dies in the middle of the repair.
        }
        let state = open();
        assert_eq!(state.checkpoint(0), Some(10), "the rest of the gap is left to repair, not skipped");
    }

    /// A repair's batch holds events first seen just inside the usage
    /// store's retention; a compaction a minute later drops them, and the
    /// process dies before the ledger's write behind came. The ledger wrote
    /// them at their fold, so the next start's catch-up (which reads the
    /// gap from the usage store) does not skip them: the ledger still
    /// counts every event it folded.
    #[test]
    fn events_folded_near_the_retention_cutoff_are_written_before_a_compaction_drops_them() {
        let settings = EngineSettings { memtable_events: 4, ..EngineSettings::default() };
        let retention_ms = settings.retention_ms();
        let dir = tempfile::tempdir().expect("tempdir");
        let open = || {
            let mut state = LocalState::open(Some(dir.path()), settings.clone(), true).expect("open");
            state.assign_all(&[0], NOW).expect("assign");
            state
        };
        let settle = |state: &LocalState| {
            let d = state.durable.as_ref().expect("durable");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !(d.flusher.idle() && d.compactor.idle()) {
                assert!(std::time::Instant::now() < deadline, "the usage store's jobs did not end within 60 s");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        let fresh = |n: u64| sample_event_at(n, 0, n as i64, NOW);
        let old = |n: u64| sample_event_at(n, 0, n as i64, NOW - retention_ms + 60_000);
        {
            let state = open();
            // The first fold writes at once; four events fill the memtable.
            state.apply_published(0, &[fresh(1), fresh(2), fresh(3), fresh(4)], NOW).expect("apply");
            settle(&state);
            // The repair's batch: a segment of its own.
            state.apply_published(0, &[old(5), old(6), old(7), old(8)], NOW).expect("apply");
            settle(&state);
            state.apply_published(0, &[fresh(9)], NOW).expect("apply");
            // Two minutes on, those four are past retention: their segment
            // goes.
            state.maintain(NOW + 120_000).expect("upkeep");
            settle(&state);
            let mut stored = 0;
            state.for_each_stored(0, |_| stored += 1).expect("stored");
            assert_eq!(stored, 5, "the compaction dropped the four events past retention");
            // The process dies: no close.
        }
        let state = open();
        let mut folded = 0;
        let ledger = state.ledger().expect("ledger");
        for tenant in 0..5 {
            ledger
                .rollups(&format!("tenant_{tenant}"), None, |_, _, r| folded += r.count + r.corrections)
                .expect("rollups");
        }
        assert_eq!(folded, 9, "every event folded before the crash is still counted");
    }

    /// Partitions apply side by side (`&self`), and the usage store moves
    /// its memtable into segments on its flush thread, started by
    /// whichever partition's batch fills it, while the ledger writes
    /// behind: a crash leaves folded batches the ledger had not written in
    /// the memtable and in segments, and the restart must find them all
    /// (from the segment id the ledger's last write recorded). Six
    /// partitions apply at once on threads, with a memtable of 40 events
    /// (a move every few batches) and compactions merging segments on
    /// their own thread, until the process dies without closing.
    /// Reopened, every tier holds every partition's whole output, and the
    /// ledger holds exactly what the usage store's events fold to.
    #[test]
    fn partitions_applying_at_once_leave_every_tier_whole_after_a_crash() {
        use rand::{Rng, SeedableRng};

        const PARTITIONS: i32 = 6;
        // No fsync per batch: the applies' steps are then short and of
        // similar length, which lets them interleave in many orders.
        let settings = EngineSettings {
            memtable_events: 40,
            fsync: crate::storage::FsyncPolicy::Interval(std::time::Duration::from_secs(3600)),
            ..EngineSettings::default()
        };
        for round in 0..20u8 {
            let dir = tempfile::tempdir().expect("tempdir");
            let mut rng = rand::rngs::StdRng::seed_from_u64(u64::from(round));
            // Each partition's batches: 1 to 12 events, so the memtable
            // fills in the middle of some batches and at the end of others.
            let mut batches: Vec<Vec<Vec<StoredEvent>>> = Vec::new();
            let mut n = 0u64;
            for p in 0..PARTITIONS {
                let mut offset = 0i64;
                let mut mine = Vec::new();
                for _ in 0..30 {
                    let len = rng.random_range(1..=12);
                    mine.push(
                        (0..len)
                            .map(|_| {
                                n += 1;
                                offset += 1;
                                sample_event_at(n, p, offset, NOW)
                            })
                            .collect(),
                    );
                }
                batches.push(mine);
            }
            {
                let mut state = LocalState::open(Some(dir.path()), settings.clone(), true).expect("open");
                state.assign_all(&(0..PARTITIONS).collect::<Vec<_>>(), NOW).expect("assign");
                // Three rounds of ten batches per partition, with upkeep
                // between them (as the worker's, under the engine's lock
                // alone): the compaction it starts merges segments on its
                // thread while the next round applies and flushes.
                for round_batches in 0..3 {
                    let shared = &state;
                    std::thread::scope(|scope| {
                        for (p, mine) in batches.iter().enumerate() {
                            scope.spawn(move || {
                                let p = i32::try_from(p).expect("partition");
                                for batch in &mine[round_batches * 10..(round_batches + 1) * 10] {
                                    shared.apply_published(p, batch, NOW).expect("apply");
                                }
                            });
                        }
                    });
                    state.maintain(NOW).expect("upkeep");
                }
                // The process dies here: no close, the ledger's last
                // batches unwritten.
            }
            let state = LocalState::open(Some(dir.path()), settings.clone(), true).expect("reopen");
            for (p, mine) in batches.iter().enumerate() {
                let p = i32::try_from(p).expect("partition");
                let last = mine.last().and_then(|b| b.last()).map(|e| e.key.output.offset);
                assert_eq!(state.checkpoint(p), last, "round {round}: partition {p}'s tiers");
                let mut stored = 0;
                state.for_each_stored(p, |_| stored += 1).expect("stored");
                assert_eq!(stored, mine.iter().map(Vec::len).sum::<usize>(), "round {round}: partition {p}'s events");
            }
            drop(state);
            let (usage, _) =
                UsageStore::open(&dir.path().join("usage"), store_options(&settings), Arc::new(NoopObserver))
                    .expect("usage store");
            assert!(
                usage.segments().iter().any(|m| m.rows > 100),
                "round {round}: upkeep merged flushed segments (of about 40 rows each): {:?}",
                usage.segments()
            );
            drop(usage);
            let check = verify_ledger(dir.path(), settings.clone()).expect("verify");
            assert!(check.drift.is_empty(), "round {round}: the ledger drifted: {:?}", check.drift);
            assert_eq!(check.events, n, "round {round}");
        }
    }

    /// The real filesystem, but a segment's write waits until the test
    /// opens the gate: a disk slower than the input.
    #[derive(Debug, Default)]
    struct GatedFs {
        open: Mutex<bool>,
        opened: std::sync::Condvar,
        /// Segment writes that reached the gate.
        arrived: std::sync::atomic::AtomicUsize,
    }

    impl GatedFs {
        fn open_gate(&self) {
            *locked(&self.open) = true;
            self.opened.notify_all();
        }

        fn pass(&self, path: &Path) {
            if path.file_name().is_some_and(|n| n.to_string_lossy().contains(".seg")) {
                self.arrived.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut open = locked(&self.open);
                while !*open {
                    open = self.opened.wait(open).unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    impl FileSystem for GatedFs {
        fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
            crate::storage::RealFs.create_dir_all(dir)
        }
        fn is_dir(&self, path: &Path) -> bool {
            crate::storage::RealFs.is_dir(path)
        }
        fn is_file(&self, path: &Path) -> bool {
            crate::storage::RealFs.is_file(path)
        }
        fn list_dir(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
            crate::storage::RealFs.list_dir(dir)
        }
        fn file_len(&self, path: &Path) -> std::io::Result<u64> {
            crate::storage::RealFs.file_len(path)
        }
        fn read(&self, path: &Path) -> std::io::Result<Vec<u8>> {
            crate::storage::RealFs.read(path)
        }
        fn write_file(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
            self.pass(path);
            crate::storage::RealFs.write_file(path, bytes)
        }
        fn write_file_synced(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
            self.pass(path);
            crate::storage::RealFs.write_file_synced(path, bytes)
        }
        fn create_append(&self, path: &Path) -> std::io::Result<Box<dyn crate::storage::AppendFile>> {
            crate::storage::RealFs.create_append(path)
        }
        fn truncate(&self, path: &Path, len: u64) -> std::io::Result<()> {
            crate::storage::RealFs.truncate(path, len)
        }
        fn sync_file(&self, path: &Path) -> std::io::Result<()> {
            crate::storage::RealFs.sync_file(path)
        }
        fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
            crate::storage::RealFs.sync_dir(dir)
        }
        fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
            crate::storage::RealFs.rename(from, to)
        }
        fn remove_file(&self, path: &Path) -> std::io::Result<()> {
            crate::storage::RealFs.remove_file(path)
        }
    }

    /// A disk slower than the input: while the flush thread's segment write
    /// waits, appends go on into the next memtable until the frozen and
    /// the live one hold three memtables' worth, then wait for the flush
    /// without the store's lock (reads go on), and go on once it is
    /// installed. Nothing is lost or doubled.
    #[test]
    fn appends_wait_for_a_slow_flush_once_three_memtables_are_held() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs = Arc::new(GatedFs::default());
        let settings = EngineSettings::default();
        let store = StoreOptions { memtable_max_events: 10, write_in_background: true, ..store_options(&settings) };
        let keys = crate::sim::disk::SimKeyStore::new(settings.key_lifetime_ms(), 7);
        let mut state =
            LocalState::open_on(fs.clone(), dir.path(), Box::new(keys), settings, store, true).expect("open");
        // Flushes on a thread, as on a state directory.
        if let Some(d) = state.durable.as_mut() {
            d.flusher = JobThread::default();
        }
        state.assign(0, NOW).expect("assign");
        let batch = |b: u64| -> Vec<StoredEvent> {
            (0..10).map(|i| sample_event_at(b * 10 + i, 0, (b * 10 + i) as i64, NOW)).collect()
        };
        // The first batch fills the memtable: frozen, its segment's write
        // held at the gate.
        state.apply_published(0, &batch(0), NOW).expect("apply");
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let state = &state;
            scope.spawn(move || {
                for b in 1..=3 {
                    state.apply_published(0, &batch(b), NOW).expect("apply");
                    done.send(b).expect("send");
                }
            });
            // Two more batches fit beside the frozen one; the third waits.
            assert_eq!(finished.recv_timeout(std::time::Duration::from_secs(60)), Ok(1));
            assert_eq!(finished.recv_timeout(std::time::Duration::from_secs(60)), Ok(2));
            assert!(finished.recv_timeout(std::time::Duration::from_millis(300)).is_err(), "the third batch waits");
            assert_eq!(fs.arrived.load(std::sync::atomic::Ordering::SeqCst), 1, "one segment write, held");
            // Reads go on meanwhile: the waiting append does not hold the lock.
            let mut stored = 0;
            state.for_each_stored(0, |_| stored += 1).expect("read while an append waits");
            assert_eq!(stored, 30);
            fs.open_gate();
            assert_eq!(finished.recv_timeout(std::time::Duration::from_secs(60)), Ok(3), "the flush made room");
        });
        let mut ids = Vec::new();
        state.for_each_stored(0, |e| ids.push(e.key.output.offset)).expect("read");
        ids.sort_unstable();
        assert_eq!(ids, (0..40).collect::<Vec<i64>>());
        state.close().expect("close");
    }

    /// A storm's originals are read without the usage store's lock while
    /// the partition goes on applying: flushes and compactions on their own
    /// threads replace the segments a lookup planned to read, and each
    /// install collects the files it replaced. Every lookup, made over and
    /// over beside the applies, finds every original it asks for, whole.
    #[test]
    fn originals_are_found_whole_while_batches_flush_compact_and_collect_beside_the_reads() {
        const BATCHES: u64 = 80;
        const PER_BATCH: u64 = 25;
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = EngineSettings::default();
        let store = StoreOptions {
            memtable_max_events: 50,
            compaction_min_segments: 2,
            compaction_target_rows: 400,
            ..store_options(&settings)
        };
        let keys = crate::sim::disk::SimKeyStore::new(settings.key_lifetime_ms(), 7);
        let mut state =
            LocalState::open_on(Arc::new(crate::storage::RealFs), dir.path(), Box::new(keys), settings, store, true)
                .expect("open");
        // Flushes and compactions on threads, as on a state directory.
        if let Some(d) = state.durable.as_mut() {
            d.flusher = JobThread::default();
            d.compactor = JobThread::default();
        }
        state.assign(0, NOW).expect("assign");
        let event = |n: u64| sample_event_at(n, 0, n as i64, NOW);
        let applied = std::sync::atomic::AtomicU64::new(0);
        let mut lookups = 0u64;
        std::thread::scope(|scope| {
            let (state, applied) = (&state, &applied);
            let writer = scope.spawn(move || {
                for b in 0..BATCHES {
                    let batch: Vec<StoredEvent> = (b * PER_BATCH..(b + 1) * PER_BATCH).map(event).collect();
                    state.apply_published(0, &batch, NOW).expect("apply");
                    state.maintain(NOW).expect("maintain");
                    applied.store((b + 1) * PER_BATCH, Ordering::Release);
                }
            });
            let mut look = |round: u64| {
                let n = applied.load(Ordering::Acquire);
                if n == 0 {
                    return;
                }
                // Spread over everything applied so far: old originals in
                // merged segments, new ones in the memtable.
                let asked: Vec<u64> = (0..50).map(|i| (round * 7 + i * 13) % n).collect();
                let wanted: Vec<(IdHash, i64)> =
                    asked.iter().map(|&k| (event(k).key.id_hash, event(k).key.first_seen_ms)).collect();
                let found = state.originals_seen_at(0, &wanted, ReadCores::All).expect("originals");
                for (k, f) in asked.iter().zip(found) {
                    assert_eq!(f.as_ref(), Some(&event(*k).event), "round {round}: event {k} of {n} applied");
                }
                lookups += 1;
            };
            let mut round = 0;
            while !writer.is_finished() {
                look(round);
                round += 1;
            }
            writer.join().expect("writer");
            look(round);
        });
        assert!(lookups > 0);
        let d = state.durable.as_ref().expect("durable");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !(d.flusher.idle() && d.compactor.idle()) {
            assert!(std::time::Instant::now() < deadline, "the usage store's jobs did not end within 60 s");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let (segments, next) = {
            let usage = locked(&d.usage);
            (usage.segments().len() as u64, usage.next_segment_id())
        };
        assert!(segments + 2 < next, "compactions merged segments: {segments} left of {next} ids");
        state.close().expect("close");
    }

    /// `dedupd dedupe` makes a batch's usage-store append beside the next
    /// batch: the apply puts the batch in the key store and the hot cache
    /// (the next batch is classified against them) and hands the append
    /// back undone. The usage store, and so the checkpoint, move only when
    /// it is made; its fsync comes back to wait on, and one that fails
    /// stops every later append instead of being forgotten.
    #[test]
    fn a_batch_applied_with_its_append_to_come_is_in_the_key_store_and_hot_cache_and_a_failed_fsync_stops_the_next_append(
    ) {
        let settings = EngineSettings::default();
        let disk = crate::sim::disk::SimDisk::new(Path::new("/sim/w0"), 1);
        let keys = crate::sim::disk::SimKeyStore::new(settings.key_lifetime_ms(), 1);
        let store = store_options(&settings);
        let mut state = LocalState::open_on(
            Arc::new(disk.clone()),
            Path::new("/sim/w0"),
            Box::new(keys.clone()),
            settings,
            store,
            true,
        )
        .expect("open");
        state.assign(0, NOW).expect("assign");
        let batch = |b: u64| -> Vec<StoredEvent> {
            (0..10).map(|i| sample_event_at(b * 10 + i, 0, (b * 10 + i) as i64, NOW)).collect()
        };

        let (applied, append) = state.apply_published_append_later(0, batch(0), NOW).expect("apply");
        let append = append.expect("with a state directory the usage store's part is handed back");
        assert_eq!(applied, 10);
        assert_eq!(state.stats(NOW).hot_cache_entries, 10, "the hot cache holds the batch before its append");
        assert_eq!(keys.checkpoint(0).expect("checkpoint"), Some(9), "the key store holds it before its append");
        assert_eq!(state.checkpoint(0), None, "the usage store has nothing yet");

        let pending = state.append_usage_later(append).expect("append").expect("--fsync always hands the fsync back");
        assert_eq!(state.checkpoint(0), Some(9));
        disk.set_faults(crate::sim::disk::DiskFaults { fsync_error_per_million: 1_000_000, ..Default::default() });
        assert!(pending.wait().is_err(), "the fsync failed");
        let (_, next) = state.apply_published_append_later(0, batch(1), NOW).expect("the key store is not on the disk");
        let next = state.append_usage_later(next.expect("append"));
        assert!(next.is_err(), "an append after a failed fsync must fail, not pile up unsyncable batches");
        assert_eq!(state.checkpoint(0), Some(9), "the refused batch is not in the usage store");
    }

    /// On the simulator's disk a flush waits to be run: close runs it (the
    /// segment is installed), an append that needs the memtable's room runs
    /// it, and a crash drops it unrun or written and not installed (the WAL
    /// still holds its events). Every way, reopening finds each event once.
    #[test]
    fn a_held_flush_runs_at_close_or_for_room_and_a_crash_drops_it() {
        let settings = EngineSettings::default();
        let store = StoreOptions { memtable_max_events: 10, write_in_background: true, ..store_options(&settings) };
        let batch = |b: u64| -> Vec<StoredEvent> {
            (0..10).map(|i| sample_event_at(b * 10 + i, 0, (b * 10 + i) as i64, NOW)).collect()
        };
        for ending in ["close", "room", "crash", "crash after the write"] {
            let disk = crate::sim::disk::SimDisk::new(Path::new("/sim/w0"), 1);
            let keys = crate::sim::disk::SimKeyStore::new(settings.key_lifetime_ms(), 1);
            let open = || {
                LocalState::open_on(
                    Arc::new(disk.clone()),
                    Path::new("/sim/w0"),
                    Box::new(keys.clone()),
                    settings.clone(),
                    store.clone(),
                    true,
                )
                .expect("open")
            };
            let mut state = open();
            state.assign(0, NOW).expect("assign");
            state.apply_published(0, &batch(0), NOW).expect("apply");
            assert_eq!(state.store_jobs_waiting(), 1, "{ending}: the full memtable's flush waits");
            let segments = |state: &LocalState| state.durable.as_ref().map_or(0, |d| locked(&d.usage).segments().len());
            let segment_files = || {
                let listed = disk.list_dir(Path::new("/sim/w0/usage/segments")).unwrap_or_default();
                listed.iter().filter(|p| p.extension().is_some_and(|e| e == "seg")).count()
            };
            let written = match ending {
                "close" => {
                    state.close().expect("close");
                    10
                }
                "room" => {
                    // Two more memtables beside the frozen one; the next
                    // append runs the flush itself.
                    state.apply_published(0, &batch(1), NOW).expect("apply");
                    state.apply_published(0, &batch(2), NOW).expect("apply");
                    assert_eq!(segments(&state), 0);
                    state.apply_published(0, &batch(3), NOW).expect("apply");
                    assert!(segments(&state) >= 1, "the append that needed room wrote the held flush");
                    drop(state);
                    40
                }
                "crash" => {
                    drop(state);
                    10
                }
                _ => {
                    assert_eq!(state.write_store_jobs(), 1);
                    assert_eq!(state.store_jobs_written(), 1, "written, its install held");
                    assert_eq!(segments(&state), 0, "not in the manifest until installed");
                    assert_eq!(segment_files(), 1, "the held job's segment is on the disk");
                    drop(state);
                    10
                }
            };
            let state = open();
            let mut offsets = Vec::new();
            state.for_each_stored(0, |e| offsets.push(e.key.output.offset)).expect("read");
            offsets.sort_unstable();
            let want: Vec<i64> = (0..written).collect();
            assert_eq!(offsets, want, "{ending}");
            if ending == "close" {
                assert_eq!(segments(&state), 1, "close installed the held flush");
            }
            if ending.starts_with("crash") {
                assert_eq!(segments(&state), 0, "{ending}: the crash dropped the held flush uninstalled");
                assert_eq!(segment_files(), 0, "{ending}: recovery leaves no segment the manifest does not name");
            }
        }
    }

    /// A flush or compaction job that panics, in its write or its install,
    /// on a thread or held, poisons the usage store at once, so the next
    /// append says why instead of the store waiting forever on a job
    /// nobody will install.
    #[test]
    fn a_store_job_that_panics_poisons_the_usage_store() {
        for (placement, in_write) in [("thread", true), ("thread", false), ("held", true), ("held", false)] {
            let dir = tempfile::tempdir().expect("tempdir");
            let (store, _) =
                UsageStore::open(dir.path(), StoreOptions::default(), Arc::new(NoopObserver)).expect("usage store");
            let store = Arc::new(Mutex::new(store));
            let thread = if placement == "thread" { JobThread::default() } else { JobThread::deferred() };
            {
                let mut usage = locked(&store);
                thread
                    .run(
                        &store,
                        &mut usage,
                        "dedupd-test",
                        in_write,
                        |in_write| assert!(!*in_write, "a bug in the job's write"),
                        // Panics only when the write did not: a write's
                        // panic must poison the store by itself.
                        |in_write, _| assert!(in_write, "a bug in the job's install"),
                    )
                    .expect("started");
            }
            thread.join();
            assert!(thread.idle(), "{placement}, write {in_write}");
            let err = locked(&store).append(&[sample_event_at(1, 0, 1, NOW)]).expect_err("poisoned");
            assert!(
                err.to_string().contains("the dedupd-test thread panicked"),
                "{placement}, write {in_write}: {err}"
            );
        }
    }

    #[test]
    fn hot_cache_evictions_survive_a_revoke_in_the_process_count() {
        // Capacity 2: applying 5 keys to partition 1 pushes 3 out.
        let settings = EngineSettings { hot_capacity: 2, ..EngineSettings::default() };
        let mut state = LocalState::in_memory(settings, true);
        state.assign(1, NOW).expect("assign");
        let batch: Vec<StoredEvent> = (0..5).map(|i| sample_event_at(i, 1, i as i64, NOW)).collect();
        state.apply_published(1, &batch, NOW).expect("apply");
        assert_eq!(state.stats(NOW).hot_evictions.at_capacity, 3);
        // Dropping the partition's cache must not make the count go back.
        state.revoke(1).expect("revoke");
        assert_eq!(state.stats(NOW).hot_evictions.at_capacity, 3);
        state.assign(2, NOW).expect("assign");
        let batch: Vec<StoredEvent> = (10..13).map(|i| sample_event_at(i, 2, i as i64, NOW)).collect();
        state.apply_published(2, &batch, NOW).expect("apply");
        assert_eq!(state.stats(NOW).hot_evictions.at_capacity, 4);
    }
}
