//! Local state for simulated workers: dedupd's own [`LocalState`] (the
//! classifier, the WAL/segment usage store and its recovery, the key-store
//! tier, and the usage ledger in memory when the schedule publishes
//! rollups) over the simulated disk and the key-store model of
//! [`crate::sim::disk`].
//!
//! A worker's disk and key store outlive its process. A crash either kills
//! the process only (the page cache keeps everything) or loses power (only
//! what was synced survives, plus torn prefixes); the next start runs the
//! real recovery on what is left, and repair must bring it up to the output.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::EngineSettings;
use crate::kafka::engine::StateEngine;
use crate::pipeline::Mutations;
use crate::sim::disk::{DiskFaults, SimDisk, SimKeyStore};
use crate::sim::SimRng;
use crate::state::LocalState;
use crate::storage::{FsyncPolicy, StoreOptions};

/// One worker's durable side: its disk, its key store and how its usage
/// store is tuned (small, so flushes, WAL rotations and compactions happen
/// within a schedule).
#[derive(Debug, Clone)]
pub struct SimState {
    pub disk: SimDisk,
    pub keys: SimKeyStore,
    dir: PathBuf,
    settings: EngineSettings,
    store: StoreOptions,
}

impl SimState {
    /// `sync_every_apply`: `--fsync always`; otherwise the WAL is synced only
    /// when a file is sealed, the memtable is flushed or the store closes
    /// (an interval longer than the schedule). `ledger`: the usage ledger
    /// is kept (in memory, see [`LocalState::open_on`]).
    pub fn new(
        worker: usize,
        rng: &mut SimRng,
        sync_every_apply: bool,
        ledger: bool,
        mutations: Mutations,
    ) -> SimState {
        let dir = Path::new("/sim").join(format!("w{worker}"));
        let settings = EngineSettings {
            keep_revoked_partitions: false,
            ledger,
            fsync: if sync_every_apply {
                FsyncPolicy::Always
            } else {
                FsyncPolicy::Interval(std::time::Duration::from_secs(86_400))
            },
            ..EngineSettings::default()
        };
        let store = StoreOptions {
            wal_rotate_bytes: 512 + rng.below(4_096),
            memtable_max_events: 2 + rng.below(12) as usize,
            compaction_target_rows: 8 + rng.below(32),
            compaction_min_segments: 2 + rng.below(3) as usize,
            mutations,
            // Flushes and compactions as a state directory runs them (freeze
            // or plan under the lock, write without it, install under it),
            // but with no thread: the schedule says when each job is
            // written (`LocalState::run_store_jobs`), so a crash can come
            // while one waits and a seed replays the same way.
            write_in_background: true,
            ..crate::state::store_options(&settings)
        };
        let horizon_ms = settings.key_lifetime_ms();
        SimState {
            disk: SimDisk::new(&dir, rng.next_u64()),
            keys: SimKeyStore::new(horizon_ms, rng.next_u64()),
            dir,
            settings,
            store,
        }
    }

    /// Starts a process on this disk: recovery, then an engine.
    pub fn open(&self) -> Result<StateEngine, String> {
        let state = LocalState::open_on(
            Arc::new(self.disk.clone()),
            &self.dir,
            Box::new(self.keys.clone()),
            self.settings.clone(),
            self.store.clone(),
            true,
        )
        .map_err(|e| format!("local state does not open: {e}"))?;
        Ok(StateEngine::new(state, self.settings.validator()))
    }

    pub fn power_loss(&self) {
        self.disk.power_loss();
        self.keys.power_loss();
    }

    pub fn set_faults(&self, faults: DiskFaults) {
        self.disk.set_faults(faults);
    }
}

/// What a live worker's local state holds for `partition`: the event ids in
/// its usage store, and the ids of `expected` its key store cannot answer.
pub fn held_by_state(
    engine: &StateEngine,
    partition: i32,
    expected: &[crate::storage::StoredEvent],
) -> Result<(BTreeSet<String>, Vec<String>), String> {
    let state = engine.local_state().ok_or("local state is closed")?;
    let mut stored = BTreeSet::new();
    state
        .for_each_stored(partition, |e| {
            stored.insert(e.event.event_id.clone());
        })
        .map_err(|e| e.to_string())?;
    let ids: Vec<_> = expected.iter().map(|e| e.key.id_hash).collect();
    let answers = state.remembered_keys(partition, &ids).map_err(|e| e.to_string())?;
    let forgotten =
        expected.iter().zip(answers).filter(|(_, a)| a.is_none()).map(|(e, _)| e.event.event_id.clone()).collect();
    Ok((stored, forgotten))
}
