//! The usage store's appends and fsyncs, made beside the run's next batch.
//!
//! A batch's apply puts it in the ledger, the key store and the hot cache
//! on the batch's own thread, and hands its usage-store part back
//! (`LocalState::apply_published_append_later`). A thread of its own then
//! appends it to the WAL and the memtable and, with `--fsync always`,
//! waits for (and, as the group commit's leader, runs) its WAL fsync,
//! while the batch's thread classifies, writes and syncs the output of the
//! next. Measured on 1M new events (perf, 2026-11-29): the append was a
//! fifth of the batch's thread's samples, and that thread, with the output
//! file's fsync, was what the run waited for. At most one batch waits to
//! be appended, so the usage store is never more than two batches behind.
//!
//! Order is kept where it matters:
//! - a batch's state changes only after its output is durable (the output
//!   fsync comes first, on the batch's thread);
//! - batches are appended in the order they were applied (one thread, one
//!   queue);
//! - whatever reads the usage store during the run (a conflict's original)
//!   first waits for the appends handed over that hold the ids it reads
//!   to be made ([`UsageWriter::settle`]; not for their fsyncs, which a
//!   read does not need);
//! - a run ends only after every append and fsync has ended
//!   ([`UsageWriter::finish`]).
//!
//! The state's upkeep between batches (`LocalState::maintain`: starting a
//! memtable's flush, a compaction, retention) runs here too, after each
//! batch's append: it takes the usage store's lock, and on the batch's
//! thread it would wait for the append it was meant to run beside.
//!
//! A failed append or fsync ends the thread (a failed fsync also poisons
//! the usage store); the next hand-over, `settle` or `finish` returns its
//! error, and the run stops. The key store and hot cache may then hold a
//! batch or two the usage store does not: their output is durable, and a
//! restart repairs the usage store from it.

use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::{Scope, ScopedJoinHandle};

use std::collections::{HashSet, VecDeque};

use crate::classify::IdBuildHasher;
use crate::event::IdHash;
use crate::state::{LocalState, StateError, UsageAppend};

use super::OfflineError;

/// A batch's append (when it has one for the usage store) and the time of
/// the state's upkeep after it.
type Work = (Option<UsageAppend>, i64);

type Writer<'scope> = Option<ScopedJoinHandle<'scope, Result<(), StateError>>>;

/// How far the thread has got, for [`UsageWriter::settle`].
#[derive(Default)]
struct Progress {
    /// Batches whose append is made (fsync and upkeep perhaps still to come).
    appended: u64,
    /// The thread has ended: every batch was done, or one failed.
    ended: bool,
}

#[derive(Default)]
pub(super) struct Shared {
    progress: Mutex<Progress>,
    moved: Condvar,
}

impl Shared {
    fn update(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.progress.lock().unwrap_or_else(PoisonError::into_inner));
        self.moved.notify_all();
    }
}

/// Marks the thread ended however it ends, a panic included, so that
/// `settle` never waits for it in vain.
struct EndsThread<'a>(&'a Shared);

impl Drop for EndsThread<'_> {
    fn drop(&mut self) {
        self.0.update(|p| p.ended = true);
    }
}

pub(super) enum UsageWriter<'scope> {
    /// A thread of its own appends.
    Beside {
        to_do: Option<SyncSender<Work>>,
        writer: Writer<'scope>,
        shared: Arc<Shared>,
        /// Batches handed over.
        handed: u64,
        /// The ids of the batches handed over whose append may not be made
        /// yet (at most two stay after a hand-over), by their count in
        /// `handed`: a read of an original waits only for the one holding
        /// it. `None` when the run reads no originals (no conflicts file):
        /// a set of a thousand ids a batch would be built for nothing, and
        /// a `settle` then waits for every batch handed over.
        in_flight: Option<VecDeque<(u64, HashSet<IdHash, IdBuildHasher>)>>,
    },
    /// No thread (no state directory, or none could be started): each
    /// append is made, and its fsync waited for, at once.
    Inline { state: &'scope LocalState },
}

impl<'scope> UsageWriter<'scope> {
    /// `reads_originals`: whether the run will `settle` for conflicts'
    /// originals, and so whether each batch's ids are kept until its append
    /// is made.
    pub(super) fn start<'env>(
        scope: &'scope Scope<'scope, 'env>,
        state: &'scope LocalState,
        reads_originals: bool,
    ) -> UsageWriter<'scope> {
        let (to_do, work) = sync_channel::<Work>(1);
        let shared = Arc::new(Shared::default());
        let progress = Arc::clone(&shared);
        let writer = std::thread::Builder::new().name("dedupd-usage".into()).spawn_scoped(scope, move || {
            let _ends = EndsThread(&progress);
            for (append, now_ms) in work {
                // Readable once appended: a conflict's original need not
                // wait for the fsync or the upkeep.
                make_append(state, append, now_ms, || progress.update(|p| p.appended += 1))?;
            }
            Ok(())
        });
        match writer {
            Ok(writer) => UsageWriter::Beside {
                to_do: Some(to_do),
                writer: Some(writer),
                shared,
                handed: 0,
                in_flight: reads_originals.then(VecDeque::new),
            },
            Err(e) => {
                tracing::warn!(error = %e, "no thread for the usage store's appends; each batch makes its own");
                UsageWriter::Inline { state }
            }
        }
    }

    /// Each append made at once, on the caller's thread.
    pub(super) fn inline(state: &'scope LocalState) -> UsageWriter<'scope> {
        UsageWriter::Inline { state }
    }

    /// Hands a batch's append over, with the state's upkeep after it
    /// (`LocalState::maintain`, which takes the usage store's lock too), and
    /// makes them here when there is no thread. An error is an append, an
    /// fsync or upkeep that failed before.
    pub(super) fn hand(&mut self, append: Option<UsageAppend>, now_ms: i64) -> Result<(), OfflineError> {
        match self {
            UsageWriter::Inline { state } => Ok(make_append(state, append, now_ms, || {})?),
            UsageWriter::Beside { to_do, writer, shared, handed, in_flight } => {
                let ids: Option<HashSet<IdHash, IdBuildHasher>> = in_flight
                    .is_some()
                    .then(|| append.iter().flat_map(|a| a.events().iter().map(|e| e.key.id_hash)).collect());
                match to_do.as_ref().map(|t| t.send((append, now_ms))) {
                    Some(Ok(())) => {
                        *handed += 1;
                        if let (Some(in_flight), Some(ids)) = (in_flight.as_mut(), ids) {
                            let appended = shared.progress.lock().unwrap_or_else(PoisonError::into_inner).appended;
                            in_flight.retain(|(n, _)| *n > appended);
                            if !ids.is_empty() {
                                in_flight.push_back((*handed, ids));
                            }
                        }
                        Ok(())
                    }
                    // The thread stopped: an append, fsync or upkeep failed
                    // (or it panicked).
                    _ => Err(ended_early(to_do, writer)),
                }
            }
        }
    }

    /// Returns once every append handed over that holds one of `ids` is
    /// in the usage store, so a read of their first copies sees them.
    /// Their fsyncs and upkeep may still be running. A writer started
    /// without `reads_originals` keeps no ids, and waits for every append
    /// handed over.
    pub(super) fn settle(&mut self, ids: impl Iterator<Item = IdHash>) -> Result<(), OfflineError> {
        let UsageWriter::Beside { to_do, writer, shared, handed, in_flight } = self else {
            return Ok(());
        };
        let needed = match in_flight {
            None => *handed,
            Some(in_flight) => ids
                .filter_map(|id| in_flight.iter().rev().find(|(_, held)| held.contains(&id)).map(|(n, _)| *n))
                .max()
                .unwrap_or(0),
        };
        let mut progress = shared.progress.lock().unwrap_or_else(PoisonError::into_inner);
        while progress.appended < needed && !progress.ended {
            progress = shared.moved.wait(progress).unwrap_or_else(PoisonError::into_inner);
        }
        let settled = progress.appended >= needed;
        drop(progress);
        if settled {
            Ok(())
        } else {
            // The thread ended before it got there: an append failed.
            Err(ended_early(to_do, writer))
        }
    }

    /// Waits for every append and fsync handed over: the run's usage store
    /// is durable when this returns `Ok`.
    pub(super) fn finish(self) -> Result<(), OfflineError> {
        match self {
            UsageWriter::Inline { .. } => Ok(()),
            UsageWriter::Beside { to_do, writer, .. } => {
                drop(to_do);
                join(writer)
            }
        }
    }

    /// After the run failed: lets the thread end and logs how it ended,
    /// keeping the run's own error (a panic there included).
    pub(super) fn abandon(self) {
        if let UsageWriter::Beside { to_do, writer, .. } = self {
            drop(to_do);
            match writer.map(ScopedJoinHandle::join) {
                None | Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => tracing::warn!(error = %e, "the usage store's append thread failed too"),
                Some(Err(_)) => tracing::error!("the usage store's append thread panicked after the run failed"),
            }
        }
    }
}

/// One batch's part, on whichever thread makes it: the append (`appended`
/// is told once it can be read), its fsync with `--fsync always`, then the
/// state's upkeep.
fn make_append(
    state: &LocalState,
    append: Option<UsageAppend>,
    now_ms: i64,
    appended: impl FnOnce(),
) -> Result<(), StateError> {
    let pending = append.map(|a| state.append_usage_later(a)).transpose()?.flatten();
    appended();
    if let Some(pending) = pending {
        pending.wait()?;
    }
    state.maintain(now_ms)
}

/// The error of a thread that ended before its work did.
fn ended_early(to_do: &mut Option<SyncSender<Work>>, writer: &mut Writer<'_>) -> OfflineError {
    to_do.take();
    join(writer.take()).err().unwrap_or_else(|| {
        StateError::from(crate::storage::StorageError::Poisoned {
            cause: "the usage store's append thread ended early".into(),
        })
        .into()
    })
}

fn join(writer: Writer<'_>) -> Result<(), OfflineError> {
    match writer.map(ScopedJoinHandle::join) {
        None => Ok(()),
        Some(Ok(written)) => Ok(written?),
        Some(Err(panic)) => std::panic::resume_unwind(panic),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::classify::{HorizonError, LongHorizon, SeenKey};
    use crate::config::EngineSettings;
    use crate::keystore::{KeyTier, KeystoreError};
    use crate::sim::disk::{DiskFaults, SimDisk, SimKeyStore};
    use crate::state::StoredEvent;
    use crate::storage::testutil::sample_event_at;

    const NOW: i64 = 1_700_000_100_000;

    /// Partition 0 of a state on the simulator's disk, `--fsync always`.
    /// Without the ledger, whose fold reads the usage store (so a batch's
    /// apply would wait for the append before it on a stalled disk).
    fn sim_state(disk: &SimDisk) -> LocalState {
        sim_state_with(disk, |keys| Box::new(keys))
    }

    fn sim_state_with(disk: &SimDisk, keys: impl FnOnce(SimKeyStore) -> Box<dyn KeyTier>) -> LocalState {
        let settings = EngineSettings { ledger: false, ..EngineSettings::default() };
        let keys = keys(SimKeyStore::new(settings.key_lifetime_ms(), 7));
        let store = crate::state::store_options(&settings);
        let mut state = LocalState::open_on(Arc::new(disk.clone()), Path::new("/sim/w0"), keys, settings, store, false)
            .expect("open");
        state.assign(0, NOW).expect("assign");
        state
    }

    /// Batch `b`: ten events at output offsets `10b..10b+9`.
    fn batch(b: u64) -> Vec<StoredEvent> {
        (0..10).map(|i| sample_event_at(b * 10 + i, 0, (b * 10 + i) as i64, NOW)).collect()
    }

    /// Every append and fsync handed over is made before `finish` returns,
    /// and one that fails is the run's error, from the next hand-over or
    /// from `finish`, never dropped.
    #[test]
    fn a_failed_wal_fsync_made_beside_the_run_is_the_runs_error() {
        // At 4, the last batch: the failure may be told only by `finish`
        // (or by the last hand-over, if batch 3's fsync meets the fault).
        for fail_at in [None, Some(1), Some(4)] {
            let disk = SimDisk::new(Path::new("/sim/w0"), 7);
            let state = sim_state(&disk);
            let outcome = std::thread::scope(|scope| -> Result<(), OfflineError> {
                let mut writer = UsageWriter::start(scope, &state, false);
                assert!(matches!(writer, UsageWriter::Beside { .. }));
                for b in 0..5u64 {
                    if Some(b) == fail_at {
                        disk.set_faults(DiskFaults { fsync_error_per_million: 1_000_000, ..DiskFaults::default() });
                    }
                    let (_, append) = state.apply_published_append_later(0, batch(b), NOW)?;
                    assert!(append.is_some(), "a state directory leaves the usage store's part to the caller");
                    writer.hand(append, NOW)?;
                }
                writer.finish()
            });
            match fail_at {
                None => {
                    outcome.expect("no fault");
                    assert_eq!(disk.counts().fsync_errors, 0);
                    assert_eq!(state.checkpoint(0), Some(49), "every batch is in the usage store");
                }
                Some(b) => {
                    let e = outcome.expect_err("a failed fsync must end the run");
                    assert!(e.to_string().contains("fsync") || e.to_string().contains("poison"), "batch {b}: {e}");
                    assert!(disk.counts().fsync_errors >= 1);
                }
            }
        }
    }

    /// What `settle` promises a conflict's original: once it returns, every
    /// batch handed over is in the usage store, and its events are read
    /// back. The disk stalls while two batches are handed over (the writer
    /// blocks in the first one's WAL write, the second waits its turn) and
    /// answers again only after `settle` was called, so without the wait
    /// the reads below would come before the appends. A writer that keeps
    /// no ids (the run reads no originals) waits for every append.
    #[test]
    fn settle_returns_once_every_append_handed_over_can_be_read() {
        for reads_originals in [true, false] {
            settle_after_stalled_appends(reads_originals);
        }
    }

    fn settle_after_stalled_appends(reads_originals: bool) {
        let disk = SimDisk::new(Path::new("/sim/w0"), 7);
        let state = sim_state(&disk);
        let answered = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let mut writer = UsageWriter::start(scope, &state, reads_originals);
            // A guard stays on the thread that took it: one of its own
            // stalls the disk, and lets it answer 300 ms after being told.
            let (stalled, is_stalled) = sync_channel(0);
            let (answer, to_answer) = sync_channel::<()>(0);
            let (disk, answered) = (&disk, &answered);
            let disk_thread = scope.spawn(move || {
                let held = disk.stall();
                stalled.send(()).expect("send");
                let _ = to_answer.recv();
                // Long enough that a `settle` that returns at once is seen
                // to, on a loaded machine too.
                std::thread::sleep(std::time::Duration::from_millis(300));
                answered.store(true, Ordering::SeqCst);
                drop(held);
            });
            is_stalled.recv_timeout(std::time::Duration::from_secs(60)).expect("stalled within a minute");
            for b in 0..2 {
                // The key store and the hot cache hold the batch at once
                // (neither is on this disk); the usage store holds it only
                // once its append is made.
                let (applied, append) = state.apply_published_append_later(0, batch(b), NOW).expect("apply");
                assert_eq!(applied, 10);
                assert!(append.is_some(), "a state directory leaves the usage store's part to the caller");
                writer.hand(append, NOW).expect("hand");
            }
            answer.send(()).expect("send");
            // Ids of neither batch: nothing to wait for, even stalled, when
            // the writer keeps each batch's ids.
            writer.settle(batch(7).iter().map(|e| e.key.id_hash)).expect("settle");
            if reads_originals {
                assert!(!answered.load(Ordering::SeqCst), "a read of other ids waited for the stalled appends");
            } else {
                assert!(answered.load(Ordering::SeqCst), "a writer keeping no ids returned before every append");
            }
            writer.settle(batch(1).iter().map(|e| e.key.id_hash)).expect("settle");
            // Told apart from a `settle` that did not wait without reading
            // the usage store, which waits for the writer's lock.
            assert!(answered.load(Ordering::SeqCst), "settle returned while the appends waited on the disk");
            assert_eq!(state.checkpoint(0), Some(19), "both batches handed over are appended");
            let wanted: Vec<_> = batch(1).iter().map(|e| (e.key.id_hash, e.key.first_seen_ms)).collect();
            let found = state.originals_seen_at(0, &wanted, crate::state::ReadCores::All).expect("read");
            assert!(found.iter().all(Option::is_some), "the last batch's events are read back");
            disk_thread.join().expect("join");
            writer.finish().expect("finish");
        });
    }

    /// The simulator's key store, but its ageing out (part of the upkeep
    /// the thread runs after each append) fails, or panics.
    struct UpkeepBreaks {
        keys: SimKeyStore,
        panics: bool,
    }

    impl LongHorizon for UpkeepBreaks {
        fn lookup_many(&self, p: i32, ids: &[IdHash], out: &mut Vec<Option<SeenKey>>) -> Result<(), HorizonError> {
            self.keys.lookup_many(p, ids, out)
        }
    }

    impl KeyTier for UpkeepBreaks {
        fn checkpoint(&self, partition: i32) -> Result<Option<i64>, KeystoreError> {
            self.keys.checkpoint(partition)
        }
        fn apply_batch(&self, partition: i32, keys: &[SeenKey], checkpoint: i64) -> Result<(), KeystoreError> {
            self.keys.apply_batch(partition, keys, checkpoint)
        }
        fn age_out(&self, _now_ms: i64) -> Result<(), KeystoreError> {
            assert!(!self.panics, "the key store's ageing out panicked (as the test asked)");
            Err(KeystoreError::Io {
                path: "/sim/w0/keystore".into(),
                source: std::io::Error::other("ageing out failed (as the test asked)"),
            })
        }
        fn drop_partition(&self, partition: i32) -> Result<(), KeystoreError> {
            self.keys.drop_partition(partition)
        }
        fn oldest_first_seen_ms(&self) -> Result<Option<i64>, KeystoreError> {
            self.keys.oldest_first_seen_ms()
        }
        fn window_below_floor(&self, now_ms: i64) -> Result<bool, KeystoreError> {
            self.keys.window_below_floor(now_ms)
        }
        fn disk_bytes(&self) -> u64 {
            self.keys.disk_bytes()
        }
        fn flush(&self) -> Result<(), KeystoreError> {
            self.keys.flush()
        }
    }

    /// Five batches applied and handed over to a usage thread, then its end.
    fn five_batches(state: &LocalState) -> Result<(), OfflineError> {
        std::thread::scope(|scope| {
            let mut writer = UsageWriter::start(scope, state, true);
            for b in 0..5u64 {
                let (_, append) = state.apply_published_append_later(0, batch(b), NOW)?;
                writer.hand(append, NOW)?;
            }
            writer.finish()
        })
    }

    /// Upkeep that fails on the thread ends the run with its error, after
    /// the append it followed was made; upkeep that panics ends the run
    /// with that panic, never with a run that looks complete; and after a
    /// run that failed on its own, the thread's panic is only logged, so
    /// the run's own error is what the caller sees.
    #[test]
    fn upkeep_that_fails_or_panics_beside_the_run_ends_the_run() {
        let disk = SimDisk::new(Path::new("/sim/w0"), 7);
        let state = sim_state_with(&disk, |keys| Box::new(UpkeepBreaks { keys, panics: false }));
        let e = five_batches(&state).expect_err("failed upkeep must end the run");
        assert!(e.to_string().contains("ageing out failed"), "{e}");
        assert!(state.checkpoint(0).is_some_and(|c| c >= 9), "the append before the upkeep was made");

        let disk = SimDisk::new(Path::new("/sim/w0"), 7);
        let state = sim_state_with(&disk, |keys| Box::new(UpkeepBreaks { keys, panics: true }));
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| five_batches(&state)));
        let panic = ran.expect_err("a panic on the usage thread must end the run as a panic");
        let told = panic.downcast_ref::<String>().map(String::as_str).or(panic.downcast_ref::<&str>().copied());
        assert!(told.is_some_and(|m| m.contains("ageing out panicked")), "another panic: {told:?}");

        let disk = SimDisk::new(Path::new("/sim/w0"), 7);
        let state = sim_state_with(&disk, |keys| Box::new(UpkeepBreaks { keys, panics: true }));
        std::thread::scope(|scope| {
            let mut writer = UsageWriter::start(scope, &state, true);
            let (_, append) = state.apply_published_append_later(0, batch(0), NOW).expect("apply");
            writer.hand(append, NOW).expect("the first hand-over meets no failure yet");
            // The run fails here for a reason of its own; the thread's
            // panic must not be raised over it.
            writer.abandon();
        });
    }
}
