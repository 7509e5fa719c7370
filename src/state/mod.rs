//! Local state: the materialised view of the output topic (DESIGN §1.4).
//!
//! One `LocalState` per process ties together, per partition, the classifier
//! with its hot cache, the durable usage store and the long-horizon key
//! store. Everything here changes only through
//! [`LocalState::apply_published`], called with events that are already
//! durably published, in output-offset order; applying an offset at or below
//! a partition's checkpoint is a no-op, so repair can replay freely.
//!
//! Sync: no tokio, no rdkafka. Methods may block on fsync.

use std::collections::BTreeMap;

use crate::classify::{
    classify_records, HorizonError, InputRecord, LongHorizon, NoLongHorizon, Outcome, PartitionClassifier, SeenKey,
};
use crate::config::EngineSettings;
use crate::event::{IdHash, UsageEvent, Validator};

/// What is persisted and remembered for one accepted, published event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredEvent {
    pub key: SeenKey,
    pub event: UsageEvent,
}

/// Failure of a state tier. Any of these stops the batch: guessing would
/// risk a double count or a lost event.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Horizon(#[from] HorizonError),
    #[error("state directory {dir}: this build has no durable tiers yet")]
    NoDurableTiers { dir: String },
    #[error("partition {partition} is not assigned to this process")]
    NotAssigned { partition: i32 },
    #[error("output offsets must increase within a batch: {previous} then {next} on partition {partition}")]
    OffsetsOutOfOrder { partition: i32, previous: i64, next: i64 },
}

/// Gauges for the metrics layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateStats {
    pub hot_cache_entries: usize,
    pub hot_cache_bytes: usize,
    /// First-seen time of the oldest key the hot caches still hold.
    pub hot_oldest_first_seen_ms: Option<i64>,
}

/// The local state of every partition this process owns.
#[derive(Debug)]
pub struct LocalState {
    settings: EngineSettings,
    detect_replays: bool,
    partitions: BTreeMap<i32, PartitionClassifier>,
    /// Last output offset applied, per partition.
    checkpoints: BTreeMap<i32, i64>,
}

impl LocalState {
    /// State kept in memory only: lost at exit, rebuilt by repair.
    pub fn in_memory(settings: EngineSettings, detect_replays: bool) -> LocalState {
        LocalState { settings, detect_replays, partitions: BTreeMap::new(), checkpoints: BTreeMap::new() }
    }

    /// Opens the state of a state directory, or in-memory state when `None`.
    pub fn open(
        state_dir: Option<&std::path::Path>,
        settings: EngineSettings,
        detect_replays: bool,
    ) -> Result<LocalState, StateError> {
        match state_dir {
            None => Ok(LocalState::in_memory(settings, detect_replays)),
            Some(dir) => Err(StateError::NoDurableTiers { dir: dir.display().to_string() }),
        }
    }

    pub fn settings(&self) -> &EngineSettings {
        &self.settings
    }

    /// Takes ownership of `partition`: creates its classifier. Idempotent.
    pub fn assign(&mut self, partition: i32, _now_ms: i64) -> Result<(), StateError> {
        let settings = self.settings.classifier(self.detect_replays);
        self.partitions.entry(partition).or_insert_with(|| PartitionClassifier::new(partition, settings));
        Ok(())
    }

    /// Releases `partition`: its hot cache is dropped.
    pub fn revoke(&mut self, partition: i32) -> Result<(), StateError> {
        self.partitions.remove(&partition);
        Ok(())
    }

    pub fn assigned(&self) -> impl Iterator<Item = i32> + '_ {
        self.partitions.keys().copied()
    }

    /// Last output offset applied to every tier of `partition`; repair reads
    /// the output partition from the next offset.
    pub fn checkpoint(&self, partition: i32) -> Option<i64> {
        self.checkpoints.get(&partition).copied()
    }

    fn long_horizon(&self) -> &dyn LongHorizon {
        &NoLongHorizon
    }

    /// Classifies a batch of `partition`. Read-only.
    pub fn classify(
        &self,
        partition: i32,
        validator: &Validator,
        records: &[InputRecord<'_>],
        now_ms: i64,
    ) -> Result<Vec<Outcome>, StateError> {
        let classifier = self.partitions.get(&partition).ok_or(StateError::NotAssigned { partition })?;
        Ok(classify_records(validator, classifier, self.long_horizon(), records, now_ms)?)
    }

    /// Applies published events of `partition`, in output-offset order.
    /// Events at or below the checkpoint are skipped. Returns how many were
    /// new.
    pub fn apply_published(&mut self, partition: i32, batch: &[StoredEvent], now_ms: i64) -> Result<usize, StateError> {
        let checkpoint = self.checkpoint(partition);
        let classifier = self.partitions.get_mut(&partition).ok_or(StateError::NotAssigned { partition })?;
        let mut previous = checkpoint.unwrap_or(-1);
        let mut applied = 0;
        for e in batch {
            let offset = e.key.output.offset;
            if checkpoint.is_some_and(|c| offset <= c) {
                continue;
            }
            if offset <= previous {
                return Err(StateError::OffsetsOutOfOrder { partition, previous, next: offset });
            }
            previous = offset;
            classifier.commit(std::iter::once(&e.key), now_ms);
            applied += 1;
        }
        if applied > 0 {
            self.checkpoints.insert(partition, previous);
        }
        Ok(applied)
    }

    /// The first accepted payload of an id, when a durable tier still has it
    /// (to name the fields that differ in a conflict).
    pub fn original(&self, _partition: i32, _id: &IdHash) -> Result<Option<UsageEvent>, StateError> {
        Ok(None)
    }

    /// Periodic upkeep between batches: expire hot keys.
    pub fn maintain(&mut self, now_ms: i64) -> Result<(), StateError> {
        for c in self.partitions.values_mut() {
            c.evict_expired(now_ms);
        }
        Ok(())
    }

    pub fn stats(&self) -> StateStats {
        let mut s = StateStats::default();
        for c in self.partitions.values() {
            let hot = c.hot_cache();
            s.hot_cache_entries += hot.len();
            s.hot_cache_bytes += hot.heap_bytes();
            if let Some(t) = hot.oldest_first_seen_ms() {
                s.hot_oldest_first_seen_ms = Some(s.hot_oldest_first_seen_ms.map_or(t, |o: i64| o.min(t)));
            }
        }
        s
    }

    /// Flushes and closes every tier.
    pub fn close(self) -> Result<(), StateError> {
        Ok(())
    }
}
