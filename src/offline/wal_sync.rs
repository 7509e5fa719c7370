//! The usage store's fsyncs, waited for beside the run's next batch.
//!
//! With `--fsync always` a batch's apply leaves the usage store's WAL fsync
//! pending (`LocalState::apply_published_sync_later`). Waited for on the
//! batch's own thread, it ran in series with that thread's other fsync,
//! the output file's: measured on 1M events (strace, 2026-11-29), the
//! batch's thread spent 2.4 s of an 8 s run in the two. Here a thread of
//! its own waits for (and, as the group commit's leader, runs) each batch's
//! WAL fsync while the batch's thread classifies, writes and syncs the
//! output of the next. At most one batch's fsync waits to be started, so
//! the WAL is never more than two batches ahead of its fsyncs.
//!
//! Order is kept where it matters: a batch's state changes only after its
//! output is durable (the output fsync comes first, on the batch's thread),
//! and a run ends only after every batch's WAL fsync has ended. A failed
//! fsync poisons the usage store, so the next batch's apply fails too, and
//! the run reports the fsync's own error.

use std::sync::mpsc::{sync_channel, SyncSender};
use std::thread::{Scope, ScopedJoinHandle};

use crate::state::StateError;
use crate::storage::PendingSync;

use super::OfflineError;

pub(super) enum WalSync<'scope> {
    /// A thread of its own waits.
    Beside {
        to_wait: Option<SyncSender<PendingSync>>,
        waiter: Option<ScopedJoinHandle<'scope, Result<(), StateError>>>,
    },
    /// No thread could be started: each fsync is waited for at once.
    Inline,
}

impl<'scope> WalSync<'scope> {
    pub(super) fn start<'env>(scope: &'scope Scope<'scope, 'env>) -> WalSync<'scope> {
        let (to_wait, waiting) = sync_channel::<PendingSync>(1);
        let waiter = std::thread::Builder::new().name("dedupd-wal-sync".into()).spawn_scoped(scope, move || {
            for pending in waiting {
                pending.wait()?;
            }
            Ok(())
        });
        match waiter {
            Ok(waiter) => WalSync::Beside { to_wait: Some(to_wait), waiter: Some(waiter) },
            Err(e) => {
                tracing::warn!(error = %e, "no thread for the WAL's fsyncs; each batch waits for its own");
                WalSync::Inline
            }
        }
    }

    /// Hands a batch's pending fsync over (waiting for it here when there
    /// is no thread). An error is an fsync that failed before.
    pub(super) fn hand(&mut self, pending: PendingSync) -> Result<(), OfflineError> {
        match self {
            WalSync::Inline => Ok(pending.wait().map_err(StateError::from)?),
            WalSync::Beside { to_wait, waiter } => {
                let sent = to_wait.as_ref().map(|t| t.send(pending));
                match sent {
                    Some(Ok(())) => Ok(()),
                    // The waiter stopped: an fsync failed (or it panicked).
                    _ => {
                        to_wait.take();
                        Err(join(waiter.take()).err().unwrap_or_else(|| {
                            StateError::from(crate::storage::StorageError::Poisoned {
                                cause: "the WAL's fsync thread ended early".into(),
                            })
                            .into()
                        }))
                    }
                }
            }
        }
    }

    /// Waits for every fsync handed over: the run's WAL is durable when this
    /// returns `Ok`.
    pub(super) fn finish(self) -> Result<(), OfflineError> {
        match self {
            WalSync::Inline => Ok(()),
            WalSync::Beside { to_wait, waiter } => {
                drop(to_wait);
                join(waiter)
            }
        }
    }
}

fn join(waiter: Option<ScopedJoinHandle<'_, Result<(), StateError>>>) -> Result<(), OfflineError> {
    match waiter.map(ScopedJoinHandle::join) {
        None => Ok(()),
        Some(Ok(waited)) => Ok(waited?),
        Some(Err(panic)) => std::panic::resume_unwind(panic),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::sim::disk::{DiskFaults, SimDisk};
    use crate::storage::testutil::sample_event_at;
    use crate::storage::{NoopObserver, StoreOptions, UsageStore};

    const NOW: i64 = 1_700_000_100_000;

    /// Every fsync handed over is waited for before `finish` returns, and
    /// one that fails is the run's error, from the next hand-over or from
    /// `finish`, never dropped.
    #[test]
    fn a_failed_wal_fsync_waited_beside_the_run_is_the_runs_error() {
        // At 4, the last batch: only `finish` can tell.
        for fail_at in [None, Some(1), Some(4)] {
            let disk = SimDisk::new(Path::new("/sim/w0"), 7);
            let (mut store, _) = UsageStore::open_on(
                Arc::new(disk.clone()),
                Path::new("/sim/w0/usage"),
                StoreOptions::default(),
                Arc::new(NoopObserver),
            )
            .expect("open");
            let outcome = std::thread::scope(|scope| -> Result<(), OfflineError> {
                let mut sync = WalSync::start(scope);
                assert!(matches!(sync, WalSync::Beside { .. }));
                for b in 0..5u64 {
                    if Some(b) == fail_at {
                        disk.set_faults(DiskFaults { fsync_error_per_million: 1_000_000, ..DiskFaults::default() });
                    }
                    let batch: Vec<_> =
                        (0..10).map(|i| sample_event_at(b * 10 + i, 0, (b * 10 + i) as i64, NOW)).collect();
                    let pending = match store.append_deferred(batch) {
                        Ok((_, pending)) => pending.expect("--fsync always hands the fsync back"),
                        // The store knows of the failure already.
                        Err(e) => return Err(StateError::from(e).into()),
                    };
                    sync.hand(pending)?;
                }
                sync.finish()
            });
            match fail_at {
                None => {
                    outcome.expect("no fault");
                    assert_eq!(disk.counts().fsync_errors, 0);
                }
                Some(b) => {
                    let e = outcome.expect_err("a failed fsync must end the run");
                    assert!(e.to_string().contains("fsync") || e.to_string().contains("poison"), "batch {b}: {e}");
                    assert!(disk.counts().fsync_errors >= 1);
                }
            }
        }
    }
}
