//! The seam between the Kafka worker and the dedupe engine.
//!
//! The worker needs a small, synchronous surface from local state: classify a
//! batch read-only, apply what was published, say where its checkpoint is,
//! find an original for a conflict diff. [`Engine`] is that surface;
//! [`StateEngine`] implements it over `crate::state::LocalState` (durable
//! with a state directory, in memory without: then every assignment rebuilds
//! the partition from the output topic, correct and just slower to start).
//!
//! Every method may block (fsync, RocksDB): the worker calls them from
//! `spawn_blocking`, never on a runtime thread.

use crate::event::{IdHash, UsageEvent, Validator};
use crate::state::{LocalState, StateError};

pub use crate::classify::{Classified, InputRecord, Outcome, Placement};
pub use crate::state::StoredEvent;

/// Sizes and windows of local state, for the metrics page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub hot_cache_entries: u64,
    pub keystore_bytes: u64,
    pub oldest_hot_first_seen_ms: Option<i64>,
    pub oldest_keystore_first_seen_ms: Option<i64>,
    pub window_below_floor: bool,
    pub hot_evictions: crate::classify::HotEvictions,
}

/// A failure of local state. The worker treats it as fatal for the process:
/// state that cannot persist must not keep classifying (a failed fsync poisons
/// the store; the process restarts and repairs from the output topic).
#[derive(Debug, thiserror::Error)]
#[error("local state failed during {operation} on partition {partition}: {source}")]
pub struct EngineError {
    pub operation: &'static str,
    pub partition: i32,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// What the worker needs from local state. See the module doc.
pub trait Engine: Send + Sync + 'static {
    /// Takes ownership of `partition`: loads what local state holds for it.
    fn assign(&mut self, partition: i32, now_ms: i64) -> Result<(), EngineError>;
    /// [`assign`](Self::assign) for several partitions; engines that can
    /// load them together (one pass over stored keys) override it.
    fn assign_all(&mut self, partitions: &[i32], now_ms: i64) -> Result<(), EngineError> {
        partitions.iter().try_for_each(|p| self.assign(*p, now_ms))
    }
    /// Releases `partition` (its memory; durable state stays on disk).
    fn revoke(&mut self, partition: i32);
    /// The last output offset of `partition` applied, `None` if none.
    fn checkpoint(&self, partition: i32) -> Option<i64>;
    /// The last output offset applied to *any* tier of `partition`: where
    /// the furthest tier got to. Repair checks it against the output's end,
    /// so a tier without a checkpoint cannot hide a recreated topic.
    fn furthest_checkpoint(&self, partition: i32) -> Option<i64> {
        self.checkpoint(partition)
    }
    /// How long a key is remembered: repair of a partition with no
    /// checkpoint reads only the output published within it.
    fn horizon(&self) -> std::time::Duration;
    /// Classifies a batch read-only, checking each record's partition
    /// against `placement` when given. Nothing is remembered until
    /// [`Engine::apply_published`]. Both halves in one call; the worker
    /// calls them apart (`crate::kafka::batch`).
    fn classify(
        &self,
        partition: i32,
        records: &[InputRecord<'_>],
        now_ms: i64,
        placement: Option<&Placement>,
    ) -> Result<Classified, EngineError> {
        let validated = crate::classify::validate_records(&self.validator(), records, now_ms, placement);
        self.classify_validated(partition, validated, now_ms)
    }
    /// The validator [`classify`](Self::classify) uses, for the stateless
    /// half of classifying ([`crate::classify::validate_records`]), which a
    /// worker does outside the engine's lock. A clone: closed periods are
    /// shared, so it stays current.
    fn validator(&self) -> Validator;
    /// [`classify`](Self::classify) of a batch already validated.
    fn classify_validated(
        &self,
        partition: i32,
        batch: crate::classify::Validated,
        now_ms: i64,
    ) -> Result<Classified, EngineError>;
    /// Remembers published events. Idempotent by output offset: events at or
    /// below the checkpoint are skipped. Takes `&self`: partitions apply side
    /// by side (and beside other partitions' classification); one
    /// partition's applies come from its one task, in output order.
    fn apply_published(&self, partition: i32, events: &[StoredEvent], now_ms: i64) -> Result<(), EngineError>;
    /// The accepted event with this id, first seen at `first_seen_ms`, if
    /// local state still holds it (one segment read, never a history scan).
    fn original(&self, partition: i32, id: &IdHash, first_seen_ms: i64) -> Option<UsageEvent>;
    /// [`original`](Self::original) for each of a batch's conflicts, in the
    /// order asked; engines that can read several at once override it.
    fn originals(&self, partition: i32, wanted: &[(IdHash, i64)]) -> Vec<Option<UsageEvent>> {
        wanted.iter().map(|(id, first_seen_ms)| self.original(partition, id, *first_seen_ms)).collect()
    }
    /// What applying `accepted` (in output order) would change in the
    /// usage ledger, read-only: the rollups and adjustments a batch
    /// publishes with its events, and those of its `replays` again (see
    /// [`Replays`](crate::ledger::Replays)). `None` when no ledger is kept.
    fn ledger_preview(
        &self,
        partition: i32,
        accepted: &[(&UsageEvent, i64)],
        replays: &crate::ledger::Replays<'_>,
    ) -> Result<Option<crate::ledger::Preview>, EngineError>;
    /// Answers a usage query from local state's ledger (this process's
    /// partitions); `None` when no ledger is kept.
    fn usage(&self, query: &crate::ledger::UsageQuery) -> Result<Option<crate::ledger::UsageAnswer>, EngineError>;
    fn stats(&self, now_ms: i64) -> EngineStats;
    /// Periodic upkeep (expiry, compaction).
    fn maintain(&mut self, now_ms: i64) -> Result<(), EngineError>;
    /// Flushes everything durable; called once at shutdown.
    fn close(&mut self) -> Result<(), EngineError>;
}

/// The engine as a worker's tasks share it. Calls that only read local
/// state (classification's lookups, conflicts' originals, the ledger
/// preview, checkpoints, queries) and applies take it shared, so partitions
/// classify and apply side by side (local state has finer locks of its
/// own); calls that change which partitions it holds or its files (assign,
/// revoke, upkeep, close) take it alone, and so do steps that must see a
/// partition's state unchanged between two calls (repair's load, a warm
/// standby's check-then-apply). Every call may block: callers hold it on blocking threads,
/// never across an await.
pub type SharedEngine = std::sync::Arc<std::sync::RwLock<Box<dyn Engine>>>;

/// The engine for a call that reads local state.
pub fn read_engine(engine: &std::sync::RwLock<Box<dyn Engine>>) -> std::sync::RwLockReadGuard<'_, Box<dyn Engine>> {
    // A panic while holding the lock leaves the engine as it was before the
    // panicking call's first write; engines apply idempotently by output
    // offset, so carrying on is safe.
    engine.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The engine for a call that changes local state.
pub fn write_engine(engine: &std::sync::RwLock<Box<dyn Engine>>) -> std::sync::RwLockWriteGuard<'_, Box<dyn Engine>> {
    // As in `read_engine`: applies are idempotent by output offset.
    engine.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// [`Engine`] over the engine's [`LocalState`].
#[derive(Debug)]
pub struct StateEngine {
    /// `None` once closed (closing consumes the state).
    state: Option<LocalState>,
    validator: Validator,
    horizon: std::time::Duration,
}

impl StateEngine {
    pub fn new(state: LocalState, validator: Validator) -> StateEngine {
        let horizon = state.settings().key_lifetime();
        StateEngine { state: Some(state), validator, horizon }
    }

    /// The local state, until closed.
    pub fn local_state(&self) -> Option<&LocalState> {
        self.state.as_ref()
    }

    fn state(&self, operation: &'static str, partition: i32) -> Result<&LocalState, EngineError> {
        self.state.as_ref().ok_or_else(|| closed(operation, partition))
    }

    fn state_mut(&mut self, operation: &'static str, partition: i32) -> Result<&mut LocalState, EngineError> {
        self.state.as_mut().ok_or_else(|| closed(operation, partition))
    }
}

fn closed(operation: &'static str, partition: i32) -> EngineError {
    EngineError { operation, partition, source: "local state is closed".into() }
}

fn state_error(operation: &'static str, partition: i32) -> impl FnOnce(StateError) -> EngineError {
    move |e| EngineError { operation, partition, source: Box::new(e) }
}

impl Engine for StateEngine {
    fn assign(&mut self, partition: i32, now_ms: i64) -> Result<(), EngineError> {
        self.state_mut("assign", partition)?.assign(partition, now_ms).map_err(state_error("assign", partition))
    }

    fn assign_all(&mut self, partitions: &[i32], now_ms: i64) -> Result<(), EngineError> {
        let first = partitions.first().copied().unwrap_or(-1);
        self.state_mut("assign", first)?.assign_all(partitions, now_ms).map_err(state_error("assign", first))
    }

    fn revoke(&mut self, partition: i32) {
        if let Some(s) = self.state.as_mut() {
            if let Err(e) = s.revoke(partition) {
                tracing::warn!(partition, error = %e, "releasing partition state failed");
            }
        }
    }

    fn checkpoint(&self, partition: i32) -> Option<i64> {
        self.state.as_ref().and_then(|s| s.checkpoint(partition))
    }

    fn furthest_checkpoint(&self, partition: i32) -> Option<i64> {
        self.state.as_ref().and_then(|s| s.furthest_checkpoint(partition))
    }

    fn horizon(&self) -> std::time::Duration {
        self.horizon
    }

    fn validator(&self) -> Validator {
        self.validator.clone()
    }

    fn classify_validated(
        &self,
        partition: i32,
        batch: crate::classify::Validated,
        now_ms: i64,
    ) -> Result<Classified, EngineError> {
        self.state("classify", partition)?
            .classify_validated(partition, batch, now_ms)
            .map_err(state_error("classify", partition))
    }

    fn ledger_preview(
        &self,
        partition: i32,
        accepted: &[(&UsageEvent, i64)],
        replays: &crate::ledger::Replays<'_>,
    ) -> Result<Option<crate::ledger::Preview>, EngineError> {
        self.state("ledger", partition)?
            .ledger_preview(partition, accepted, replays)
            .map_err(state_error("ledger", partition))
    }

    fn usage(&self, query: &crate::ledger::UsageQuery) -> Result<Option<crate::ledger::UsageAnswer>, EngineError> {
        match &self.state {
            Some(s) => s.usage(query).map_err(state_error("usage", -1)),
            None => Ok(None),
        }
    }

    fn apply_published(&self, partition: i32, events: &[StoredEvent], now_ms: i64) -> Result<(), EngineError> {
        self.state("apply", partition)?
            .apply_published(partition, events, now_ms)
            .map(|_| ())
            .map_err(state_error("apply", partition))
    }

    fn originals(&self, partition: i32, wanted: &[(IdHash, i64)]) -> Vec<Option<UsageEvent>> {
        match self.state.as_ref().map(|s| s.originals_seen_at(partition, wanted, crate::state::ReadCores::All)) {
            Some(Ok(found)) => found,
            Some(Err(e)) => {
                tracing::warn!(partition, error = %e, "reading conflicts' originals failed");
                vec![None; wanted.len()]
            }
            None => vec![None; wanted.len()],
        }
    }

    fn original(&self, partition: i32, id: &IdHash, first_seen_ms: i64) -> Option<UsageEvent> {
        match self.state.as_ref().map(|s| s.original_seen_at(partition, id, first_seen_ms)) {
            Some(Ok(e)) => e,
            Some(Err(e)) => {
                // The diff is a courtesy on the conflicts topic; the conflict
                // itself is still reported, without field names.
                tracing::warn!(partition, error = %e, "reading a conflict's original failed");
                None
            }
            None => None,
        }
    }

    fn stats(&self, now_ms: i64) -> EngineStats {
        let Some(s) = self.state.as_ref() else { return EngineStats::default() };
        let st = s.stats(now_ms);
        EngineStats {
            hot_cache_entries: st.hot_cache_entries as u64,
            keystore_bytes: st.keystore_bytes,
            oldest_hot_first_seen_ms: st.hot_oldest_first_seen_ms,
            oldest_keystore_first_seen_ms: st.keystore_oldest_first_seen_ms,
            window_below_floor: st.keystore_window_below_floor,
            hot_evictions: st.hot_evictions,
        }
    }

    fn maintain(&mut self, now_ms: i64) -> Result<(), EngineError> {
        match self.state.as_mut() {
            Some(s) => s.maintain(now_ms).map_err(state_error("maintain", -1)),
            None => Ok(()),
        }
    }

    fn close(&mut self) -> Result<(), EngineError> {
        match self.state.take() {
            Some(s) => s.close().map_err(state_error("close", -1)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::SeenKey;
    use crate::config::EngineSettings;
    use crate::event::{Position, RejectReason};

    const NOW: i64 = 1_790_000_000_000;

    fn engine() -> StateEngine {
        let settings = EngineSettings::default();
        StateEngine::new(LocalState::in_memory(settings.clone(), true), settings.validator())
    }

    fn ev(id: &str, qty: &str) -> Vec<u8> {
        format!(r#"{{"event_id":"{id}","tenant_id":"t","customer_id":"c","meter":"m","quantity":"{qty}","timestamp":{NOW}}}"#)
            .into_bytes()
    }

    #[test]
    fn published_then_redelivered_record_is_a_replay_and_a_retry_is_a_duplicate() {
        let mut e = engine();
        e.assign(0, NOW).expect("assign");
        let a = ev("a", "1");
        let recs = [InputRecord { source: Position::new(0, 10), payload: Some(&a) }];
        let out = e.classify(0, &recs, NOW, None).expect("classify").outcomes;
        let Outcome::Accepted { event, id_hash, payload_hash } = &out[0] else { panic!("{out:?}") };
        let key = SeenKey {
            id_hash: *id_hash,
            payload_hash: *payload_hash,
            first_seen_ms: NOW,
            source: Position::new(0, 10),
            output: Position::new(0, 0),
        };
        e.apply_published(0, &[StoredEvent { key, event: event.clone() }], NOW).expect("apply");
        assert_eq!(e.checkpoint(0), Some(0));
        let b = ev("a", "1.0");
        let c = ev("a", "2");
        let recs = [
            InputRecord { source: Position::new(0, 10), payload: Some(&a) },
            InputRecord { source: Position::new(0, 11), payload: Some(&b) },
            InputRecord { source: Position::new(0, 12), payload: Some(&c) },
            InputRecord { source: Position::new(0, 13), payload: None },
        ];
        let out = e.classify(0, &recs, NOW, None).expect("classify").outcomes;
        assert!(matches!(out[0], Outcome::Replayed { .. }));
        assert!(matches!(out[1], Outcome::Duplicate { .. }));
        assert!(matches!(out[2], Outcome::Conflict { .. }));
        assert!(matches!(&out[3], Outcome::Rejected(r) if r.reason == RejectReason::MalformedJson));
    }

    /// An engine on a state directory (real key store) that accepted, at
    /// `NOW` and output offset 0, event "a" stamped as far ahead as the
    /// skew lets in (so its retries pass the age check until the key's last
    /// millisecond); and that event's bytes.
    fn accepted_stamped_ahead(dir: &std::path::Path, settings: &EngineSettings) -> (StateEngine, Vec<u8>) {
        let state = LocalState::open(Some(dir), settings.clone(), true).expect("open");
        let mut e = StateEngine::new(state, settings.validator());
        e.assign(0, NOW).expect("assign");
        let stamp = NOW + settings.limits.max_future_skew_ms;
        let a = format!(
            r#"{{"event_id":"a","tenant_id":"t","customer_id":"c","meter":"m","quantity":"1","timestamp":{stamp}}}"#
        )
        .into_bytes();
        let out = e.classify(0, &at(&a, 0), NOW, None).expect("classify").outcomes;
        let Outcome::Accepted { event, id_hash, payload_hash } = &out[0] else { panic!("{out:?}") };
        let key = SeenKey {
            id_hash: *id_hash,
            payload_hash: *payload_hash,
            first_seen_ms: NOW,
            source: Position::new(0, 0),
            output: Position::new(0, 0),
        };
        e.apply_published(0, &[StoredEvent { key, event: event.clone() }], NOW).expect("apply");
        (e, a)
    }

    /// `payload` delivered at input offset `offset` of partition 0.
    fn at(payload: &[u8], offset: i64) -> [InputRecord<'_>; 1] {
        [InputRecord { source: Position::new(0, offset), payload: Some(payload) }]
    }

    fn found_in_key_store(out: &[Outcome]) -> bool {
        matches!(out[0], Outcome::Duplicate { tier: crate::classify::Tier::KeyStore, .. })
    }

    /// An event stamped up to the skew ahead of its first arrival passes the
    /// age check until `max_event_age` after its stamp. With the defaults
    /// (horizon = max age = 35d, skew 1h) its key must outlive the horizon
    /// by that hour: a retry half an hour past the horizon, and one on the
    /// last millisecond the age check accepts, are duplicates found in the
    /// key store, and a millisecond later the record is too old.
    #[test]
    fn a_key_outlives_every_retry_the_age_check_lets_in_even_when_stamped_ahead() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = EngineSettings::default();
        assert_eq!(settings.horizon_ms(), settings.limits.max_event_age_ms, "the defaults this test is about");
        let (horizon, skew) = (settings.horizon_ms(), settings.limits.max_future_skew_ms);
        let (mut e, a) = accepted_stamped_ahead(dir.path(), &settings);
        let last_accepted_by_age = NOW + skew + settings.limits.max_event_age_ms;
        for (offset, now) in [(1, NOW + horizon + skew / 2), (2, last_accepted_by_age)] {
            e.maintain(now).expect("age out what is due");
            let out = e.classify(0, &at(&a, offset), now, None).expect("classify").outcomes;
            assert!(found_in_key_store(&out), "retry {}ms past the horizon: {out:?}", now - NOW - horizon);
        }
        let out = e.classify(0, &at(&a, 3), last_accepted_by_age + 1, None).expect("classify").outcomes;
        assert!(matches!(&out[0], Outcome::Rejected(r) if r.reason == RejectReason::TimestampTooOld), "{out:?}");
        e.close().expect("close");
    }

    /// The key store ages out by the clock of the upkeep that runs it,
    /// which may be read after a batch read its own (the batch waited
    /// behind the upkeep): a key the batch still counts as remembered must
    /// not be hidden by an age-out made at that later time.
    #[test]
    fn a_batch_classifying_by_an_earlier_clock_than_the_last_age_out_still_finds_its_keys() {
        let dir = tempfile::tempdir().expect("tempdir");
        let settings = EngineSettings::default();
        let lifetime = settings.key_lifetime_ms();
        let (mut e, a) = accepted_stamped_ahead(dir.path(), &settings);
        // The upkeep runs a minute past the key's lifetime; a batch that read
        // the clock a minute before it classifies after.
        e.maintain(NOW + lifetime + 60_000).expect("age out");
        let batch_now = NOW + lifetime - 60_000;
        let out = e.classify(0, &at(&a, 1), batch_now, None).expect("classify").outcomes;
        assert!(found_in_key_store(&out), "{out:?}");
        e.close().expect("close");
    }

    #[test]
    fn apply_at_or_below_the_checkpoint_changes_nothing() {
        let mut e = engine();
        e.assign(1, NOW).expect("assign");
        let a = ev("x", "1");
        let recs = [InputRecord { source: Position::new(1, 0), payload: Some(&a) }];
        let out = e.classify(1, &recs, NOW, None).expect("classify").outcomes;
        let Outcome::Accepted { event, id_hash, payload_hash } = &out[0] else { panic!("{out:?}") };
        let key = |off| SeenKey {
            id_hash: *id_hash,
            payload_hash: *payload_hash,
            first_seen_ms: NOW,
            source: Position::new(1, 0),
            output: Position::new(1, off),
        };
        e.apply_published(1, &[StoredEvent { key: key(5), event: event.clone() }], NOW).expect("apply");
        e.apply_published(1, &[StoredEvent { key: key(3), event: event.clone() }], NOW).expect("apply");
        assert_eq!(e.checkpoint(1), Some(5));
    }
}
