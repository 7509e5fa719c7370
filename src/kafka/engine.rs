//! The seam between the Kafka worker and the dedupe engine.
//!
//! The worker needs a small, synchronous surface from local state: classify a
//! batch read-only, apply what was published, say where its checkpoint is,
//! find an original for a conflict diff. [`Engine`] is that surface; the
//! durable implementation is `crate::state::LocalState`, and [`MemoryEngine`]
//! keeps everything in memory (its checkpoint is always "nothing applied", so
//! every assignment rebuilds the partition from the output topic — correct,
//! just slower to start; used by tests and the demo).
//!
//! Every method may block (fsync, RocksDB): the worker calls them from
//! `spawn_blocking`, never on a runtime thread.

use hashbrown::HashMap;

use crate::classify::{
    Candidate, ClassifierSettings, FirstSeen, HorizonError, LongHorizon, NoLongHorizon, PartitionClassifier, SeenKey,
    Tier, Verdict,
};
use crate::event::{
    id_hash, payload_hash_with, IdHash, PayloadHash, Position, RejectReason, Rejection, UsageEvent, Validator,
};

/// One input record as the engine sees it.
#[derive(Clone, Copy, Debug)]
pub struct InputRecord<'a> {
    pub source: Position,
    /// `None` for a null value (a tombstone).
    pub payload: Option<&'a [u8]>,
}

/// The classification of one input record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Accepted { event: UsageEvent, id_hash: IdHash, payload_hash: PayloadHash },
    Duplicate { event: UsageEvent, id_hash: IdHash, tier: Tier, first: FirstSeen },
    Conflict { event: UsageEvent, id_hash: IdHash, payload_hash: PayloadHash, tier: Tier, first: FirstSeen },
    Replayed { event: UsageEvent, id_hash: IdHash, tier: Tier, first: FirstSeen },
    Rejected(Rejection),
}

/// An accepted event as published: what local state persists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredEvent {
    pub key: SeenKey,
    pub event: UsageEvent,
}

/// Sizes and windows of local state, for the metrics page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub hot_cache_entries: u64,
    pub keystore_bytes: u64,
    pub oldest_hot_first_seen_ms: Option<i64>,
    pub oldest_keystore_first_seen_ms: Option<i64>,
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
pub trait Engine: Send + 'static {
    /// Takes ownership of `partition`: loads what local state holds for it.
    fn assign(&mut self, partition: i32, now_ms: i64) -> Result<(), EngineError>;
    /// Releases `partition` (its memory; durable state stays on disk).
    fn revoke(&mut self, partition: i32);
    /// The last output offset of `partition` applied, `None` if none.
    fn checkpoint(&self, partition: i32) -> Option<i64>;
    /// Classifies a batch read-only. Nothing is remembered until
    /// [`Engine::apply_published`].
    fn classify(&self, partition: i32, records: &[InputRecord<'_>], now_ms: i64) -> Result<Vec<Outcome>, EngineError>;
    /// Remembers published events. Idempotent by output offset: events at or
    /// below the checkpoint are skipped.
    fn apply_published(&mut self, partition: i32, events: &[StoredEvent], now_ms: i64) -> Result<(), EngineError>;
    /// The accepted event with this id, if local state still holds it.
    fn original(&self, partition: i32, id: &IdHash) -> Option<UsageEvent>;
    fn stats(&self, now_ms: i64) -> EngineStats;
    /// Periodic upkeep (expiry, compaction).
    fn maintain(&mut self, now_ms: i64) -> Result<(), EngineError>;
    /// Flushes everything durable; called once at shutdown.
    fn close(&mut self) -> Result<(), EngineError>;
}

/// Validation, identity and classification of one batch, shared by engines:
/// decode → validate → hash → classify (DESIGN §6).
pub fn classify_batch(
    validator: &Validator,
    classifier: &PartitionClassifier,
    long: &dyn LongHorizon,
    records: &[InputRecord<'_>],
    now_ms: i64,
) -> Result<Vec<Outcome>, HorizonError> {
    let mut valid: Vec<(usize, UsageEvent, IdHash, PayloadHash)> = Vec::with_capacity(records.len());
    let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(records.len());
    let mut buf = Vec::with_capacity(256);
    for (i, r) in records.iter().enumerate() {
        let validated = match r.payload {
            None => Err(Rejection::new(RejectReason::MalformedJson, "null value (tombstone) is not an event")),
            Some(bytes) => validator.validate(bytes, now_ms),
        };
        match validated {
            Ok(event) => {
                let id = id_hash(&event.tenant_id, &event.event_id);
                let ph = payload_hash_with(&event, &mut buf);
                valid.push((i, event, id, ph));
                outcomes.push(None);
            }
            Err(rej) => outcomes.push(Some(Outcome::Rejected(rej))),
        }
    }
    let candidates: Vec<Candidate> = valid
        .iter()
        .map(|(i, _, id, ph)| Candidate { id_hash: *id, payload_hash: *ph, source: records[*i].source })
        .collect();
    let verdicts = classifier.classify(&candidates, long, now_ms)?;
    for ((i, event, id_hash, payload_hash), verdict) in valid.into_iter().zip(verdicts) {
        outcomes[i] = Some(match verdict {
            Verdict::Accepted => Outcome::Accepted { event, id_hash, payload_hash },
            Verdict::Duplicate { tier, first } => Outcome::Duplicate { event, id_hash, tier, first },
            Verdict::Conflict { tier, first } => Outcome::Conflict { event, id_hash, payload_hash, tier, first },
            Verdict::Replayed { tier, first } => Outcome::Replayed { event, id_hash, tier, first },
        });
    }
    // Every slot was filled: rejects in the first pass, the rest just now.
    Ok(outcomes.into_iter().flatten().collect())
}

/// Local state kept only in memory (see the module doc).
#[derive(Debug)]
pub struct MemoryEngine {
    validator: Validator,
    settings: ClassifierSettings,
    partitions: HashMap<i32, MemoryPartition>,
}

#[derive(Debug)]
struct MemoryPartition {
    classifier: PartitionClassifier,
    /// Accepted events by id, for conflict diffs; bounded like the hot cache.
    originals: HashMap<IdHash, UsageEvent>,
    checkpoint: Option<i64>,
}

impl MemoryEngine {
    pub fn new(validator: Validator, settings: ClassifierSettings) -> MemoryEngine {
        MemoryEngine { validator, settings, partitions: HashMap::new() }
    }

    fn part(&self, partition: i32, operation: &'static str) -> Result<&MemoryPartition, EngineError> {
        self.partitions.get(&partition).ok_or_else(|| not_assigned(operation, partition))
    }
}

fn not_assigned(operation: &'static str, partition: i32) -> EngineError {
    EngineError { operation, partition, source: "partition is not assigned to this engine".into() }
}

impl Engine for MemoryEngine {
    fn assign(&mut self, partition: i32, _now_ms: i64) -> Result<(), EngineError> {
        let settings = self.settings;
        self.partitions.entry(partition).or_insert_with(|| MemoryPartition {
            classifier: PartitionClassifier::new(partition, settings),
            originals: HashMap::new(),
            checkpoint: None,
        });
        Ok(())
    }

    fn revoke(&mut self, partition: i32) {
        self.partitions.remove(&partition);
    }

    fn checkpoint(&self, partition: i32) -> Option<i64> {
        self.partitions.get(&partition).and_then(|p| p.checkpoint)
    }

    fn classify(&self, partition: i32, records: &[InputRecord<'_>], now_ms: i64) -> Result<Vec<Outcome>, EngineError> {
        let p = self.part(partition, "classify")?;
        classify_batch(&self.validator, &p.classifier, &NoLongHorizon, records, now_ms).map_err(|e| EngineError {
            operation: "classify",
            partition,
            source: Box::new(e),
        })
    }

    fn apply_published(&mut self, partition: i32, events: &[StoredEvent], now_ms: i64) -> Result<(), EngineError> {
        let p = self.partitions.get_mut(&partition).ok_or_else(|| not_assigned("apply", partition))?;
        let fresh: Vec<&StoredEvent> =
            events.iter().filter(|e| p.checkpoint.is_none_or(|c| e.key.output.offset > c)).collect();
        p.classifier.commit(fresh.iter().map(|e| &e.key), now_ms);
        for e in &fresh {
            p.originals.insert(e.key.id_hash, e.event.clone());
            p.checkpoint = Some(p.checkpoint.map_or(e.key.output.offset, |c| c.max(e.key.output.offset)));
        }
        if p.originals.len() > p.classifier.hot_cache().len().saturating_mul(2).max(1024) {
            let hot = p.classifier.hot_cache();
            p.originals.retain(|id, _| hot.get(id, now_ms).is_some());
        }
        Ok(())
    }

    fn original(&self, partition: i32, id: &IdHash) -> Option<UsageEvent> {
        self.partitions.get(&partition).and_then(|p| p.originals.get(id).cloned())
    }

    fn stats(&self, _now_ms: i64) -> EngineStats {
        let mut s = EngineStats::default();
        for p in self.partitions.values() {
            let hot = p.classifier.hot_cache();
            s.hot_cache_entries += hot.len() as u64;
            if let Some(o) = hot.oldest_first_seen_ms() {
                s.oldest_hot_first_seen_ms = Some(s.oldest_hot_first_seen_ms.map_or(o, |x: i64| x.min(o)));
            }
        }
        s
    }

    fn maintain(&mut self, now_ms: i64) -> Result<(), EngineError> {
        for p in self.partitions.values_mut() {
            p.classifier.evict_expired(now_ms);
        }
        Ok(())
    }

    fn close(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Limits, DAY_MS};

    const NOW: i64 = 1_790_000_000_000;

    fn engine() -> MemoryEngine {
        let settings = ClassifierSettings {
            hot_ttl_ms: 7 * DAY_MS,
            hot_capacity: 10_000,
            horizon_ms: 35 * DAY_MS,
            detect_replays: true,
        };
        MemoryEngine::new(Validator::new(Limits::default(), vec![], "salt"), settings)
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
        let out = e.classify(0, &recs, NOW).expect("classify");
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
        let out = e.classify(0, &recs, NOW).expect("classify");
        assert!(matches!(out[0], Outcome::Replayed { .. }));
        assert!(matches!(out[1], Outcome::Duplicate { .. }));
        assert!(matches!(out[2], Outcome::Conflict { .. }));
        assert!(matches!(&out[3], Outcome::Rejected(r) if r.reason == RejectReason::MalformedJson));
        assert!(e.original(0, id_hash).is_some());
    }

    #[test]
    fn apply_at_or_below_the_checkpoint_changes_nothing() {
        let mut e = engine();
        e.assign(1, NOW).expect("assign");
        let a = ev("x", "1");
        let recs = [InputRecord { source: Position::new(1, 0), payload: Some(&a) }];
        let out = e.classify(1, &recs, NOW).expect("classify");
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
