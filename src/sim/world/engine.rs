//! Local state for simulated workers: the real classifier and local state
//! (in memory) over a modelled durable journal.
//!
//! What `apply_published` remembers goes to a journal per partition; only
//! its synced prefix survives a crash (the unsynced tail is lost, as
//! unsynced writes are). Assigning a partition rebuilds its state from the
//! journal, as recovery rebuilds it from the WAL and segments, so a
//! restarted worker starts from whatever its disk kept and repair must
//! bring it up to the output.

use std::collections::BTreeMap;

use crate::config::EngineSettings;
use crate::event::{IdHash, UsageEvent};
use crate::kafka::engine::{Engine, EngineError, EngineStats, InputRecord, Outcome, StateEngine, StoredEvent};
use crate::state::LocalState;

/// One worker's disk: what survives its crashes.
#[derive(Debug, Clone, Default)]
pub struct SimDisk {
    /// Applied events per partition, in apply order.
    pub journal: BTreeMap<i32, Vec<StoredEvent>>,
    /// How much of each journal is synced.
    pub synced: BTreeMap<i32, usize>,
}

impl SimDisk {
    /// A crash: every unsynced event is lost.
    pub fn crash(&mut self) {
        for (p, events) in &mut self.journal {
            events.truncate(self.synced.get(p).copied().unwrap_or(0));
        }
    }
}

/// The [`Engine`] of a simulated worker.
#[derive(Debug)]
pub struct SimEngine {
    settings: EngineSettings,
    states: BTreeMap<i32, StateEngine>,
    pub disk: SimDisk,
    /// Sync every this many applies (1: `--fsync always`).
    sync_every: u32,
    applies: u32,
}

impl SimEngine {
    pub fn new(settings: EngineSettings, disk: SimDisk, sync_every: u32) -> SimEngine {
        SimEngine { settings, states: BTreeMap::new(), disk, sync_every: sync_every.max(1), applies: 0 }
    }

    fn state(&self, operation: &'static str, partition: i32) -> Result<&StateEngine, EngineError> {
        self.states.get(&partition).ok_or_else(|| EngineError { operation, partition, source: "not assigned".into() })
    }
}

impl Engine for SimEngine {
    fn assign(&mut self, partition: i32, now_ms: i64) -> Result<(), EngineError> {
        if self.states.contains_key(&partition) {
            return Ok(());
        }
        let validator = self.settings.validator();
        let mut state = StateEngine::new(LocalState::in_memory(self.settings.clone(), true), validator);
        state.assign(partition, now_ms)?;
        if let Some(events) = self.disk.journal.get(&partition) {
            state.apply_published(partition, events, now_ms)?;
        }
        self.states.insert(partition, state);
        Ok(())
    }

    fn revoke(&mut self, partition: i32) {
        self.states.remove(&partition);
    }

    fn checkpoint(&self, partition: i32) -> Option<i64> {
        self.states.get(&partition).and_then(|s| s.checkpoint(partition))
    }

    fn horizon(&self) -> std::time::Duration {
        self.settings.horizon
    }

    fn classify(&self, partition: i32, records: &[InputRecord<'_>], now_ms: i64) -> Result<Vec<Outcome>, EngineError> {
        self.state("classify", partition)?.classify(partition, records, now_ms)
    }

    fn apply_published(&mut self, partition: i32, events: &[StoredEvent], now_ms: i64) -> Result<(), EngineError> {
        let checkpoint = self.checkpoint(partition);
        let state = self.states.get_mut(&partition).ok_or_else(|| EngineError {
            operation: "apply",
            partition,
            source: "not assigned".into(),
        })?;
        state.apply_published(partition, events, now_ms)?;
        let journal = self.disk.journal.entry(partition).or_default();
        journal.extend(events.iter().filter(|e| checkpoint.is_none_or(|c| e.key.output.offset > c)).cloned());
        self.applies += 1;
        if self.applies % self.sync_every == 0 {
            for (p, events) in &self.disk.journal {
                self.disk.synced.insert(*p, events.len());
            }
        }
        Ok(())
    }

    fn original(&self, partition: i32, id: &IdHash) -> Option<UsageEvent> {
        self.states.get(&partition).and_then(|s| s.original(partition, id))
    }

    fn stats(&self, _now_ms: i64) -> EngineStats {
        EngineStats::default()
    }

    fn maintain(&mut self, _now_ms: i64) -> Result<(), EngineError> {
        Ok(())
    }

    fn close(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
}
