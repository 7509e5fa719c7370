//! One input batch classified into the records to publish: decode →
//! validate → classify → accepted, conflict and rejected records.
//!
//! Free of rdkafka and of any I/O but local state's reads, so the worker and
//! the simulator classify a batch with the same code.
//!
//! Local state is reached through a [`WithEngine`] for each of its few
//! calls (classify the validated batch, find conflicts' originals, preview
//! the ledger), so a worker holds its engine lock for those alone: decoding,
//! validating and hashing the records, and building the records to publish,
//! run unlocked, beside other partitions' state work.

use hashbrown::HashMap;

use crate::classify::{SeenKey, Tier};
use crate::event::{IdHash, Position, RejectReason, UsageEvent};
use crate::kafka::engine::{Engine, EngineError, InputRecord, Outcome, Placement, StoredEvent};
use crate::kafka::records::{
    accepted_record, adjustment_record, conflict_record, rejected_record, rollup_record, OutRecord,
};
use crate::metrics::BatchClassified;

/// How [`classify_batch`] reaches local state: it calls this with what it
/// wants done, and this runs it on the engine, once (the worker under its
/// engine lock, taken for that call alone; the simulator directly).
pub type WithEngine<'a> = &'a dyn Fn(&mut dyn FnMut(&dyn Engine));

/// `f` run on the engine through `with`.
fn using<T>(with: WithEngine<'_>, f: impl FnOnce(&dyn Engine) -> T) -> T {
    let mut f = Some(f);
    let mut out = None;
    with(&mut |e| {
        if let Some(f) = f.take() {
            out = Some(f(e));
        }
    });
    out.expect("a WithEngine runs what it is given exactly once")
}

/// One input record of a batch.
#[derive(Clone, Copy, Debug)]
pub struct BatchInput<'a> {
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    pub payload: Option<&'a [u8]>,
}

/// What a batch needs to know of its topics: which input partition each
/// identity belongs on (`None`: not checked), where side-topic records go
/// and how much of a rejected record they keep.
#[derive(Clone, Copy, Debug)]
pub struct BatchLayout {
    pub placement: Option<Placement>,
    pub conflicts_partitions: usize,
    pub rejected_partitions: usize,
    pub max_rejected_raw_bytes: usize,
    /// Partitions of the rollups topic; `None`: the ledger's changes are
    /// not published.
    pub rollups_partitions: Option<usize>,
}

/// A classified batch, ready to publish.
#[derive(Debug)]
pub struct Prepared {
    pub records: Vec<OutRecord>,
    /// For each accepted event: its index in `records` and the key and event
    /// to apply once the output offset is known.
    pub accepted: Vec<(usize, StoredEvent)>,
    pub summary: BatchClassified,
}

/// Classifies `inputs` of `partition` read-only against `engine` and builds
/// the records to publish. Input headers are ignored by design: the payload
/// alone is the event, so unknown or hostile headers cannot change a
/// record's bucket.
pub fn classify_batch(
    with: WithEngine<'_>,
    partition: i32,
    inputs: &[BatchInput<'_>],
    now_ms: i64,
    layout: &BatchLayout,
) -> Result<Prepared, EngineError> {
    let records_in: Vec<InputRecord<'_>> =
        inputs.iter().map(|m| InputRecord { source: Position::new(partition, m.offset), payload: m.payload }).collect();
    let validator = using(with, |e| e.validator());
    let validated = crate::classify::validate_records(&validator, &records_in, now_ms, layout.placement.as_ref());
    let classified = using(with, |e| e.classify_validated(partition, validated, now_ms))?;
    let outcomes = classified.outcomes;
    // The originals of conflicts with earlier batches, read together: a
    // storm of them against one segment reads it once.
    let wanted: Vec<(IdHash, i64)> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Conflict { id_hash, tier, first, .. } if *tier != Tier::Batch => {
                Some((*id_hash, first.first_seen_ms))
            }
            _ => None,
        })
        .collect();
    let mut originals =
        if wanted.is_empty() { Vec::new() } else { using(with, |e| e.originals(partition, &wanted)) }.into_iter();
    let mut summary = BatchClassified { partition, misrouted: classified.misrouted, ..Default::default() };
    let mut records = Vec::with_capacity(inputs.len());
    let mut accepted = Vec::new();
    let mut in_batch: HashMap<IdHash, UsageEvent> = HashMap::new();
    let mut reasons: HashMap<RejectReason, u64> = HashMap::new();
    let mut tenants: HashMap<String, u64> = HashMap::new();
    for ((m, input), outcome) in inputs.iter().zip(&records_in).zip(outcomes) {
        if m.key.is_none() {
            summary.unkeyed += 1;
        }
        match outcome {
            Outcome::Accepted { event, id_hash, payload_hash } => {
                summary.accepted += 1;
                records.push(accepted_record(&event, id_hash, payload_hash, input.source, now_ms));
                let key = SeenKey {
                    id_hash,
                    payload_hash,
                    first_seen_ms: now_ms,
                    source: input.source,
                    // Filled in with the offset the broker assigns.
                    output: Position::new(partition, -1),
                };
                in_batch.insert(id_hash, event.clone());
                accepted.push((records.len() - 1, StoredEvent { key, event }));
            }
            Outcome::Duplicate { .. } => summary.duplicate += 1,
            Outcome::Replayed { .. } => summary.replayed += 1,
            Outcome::Conflict { event, id_hash, payload_hash, tier, first } => {
                summary.conflict += 1;
                *tenants.entry(event.tenant_id.clone()).or_default() += 1;
                let original =
                    if tier == Tier::Batch { in_batch.get(&id_hash).cloned() } else { originals.next().flatten() };
                records.push(conflict_record(
                    &event,
                    id_hash,
                    payload_hash,
                    tier,
                    &first,
                    original.as_ref(),
                    input.source,
                    now_ms,
                    layout.conflicts_partitions,
                ));
            }
            Outcome::Rejected(rejection) => {
                summary.rejected += 1;
                *reasons.entry(rejection.reason).or_default() += 1;
                records.push(rejected_record(
                    &rejection,
                    m.key,
                    m.payload,
                    input.source,
                    now_ms,
                    layout.max_rejected_raw_bytes,
                    layout.rejected_partitions,
                ));
            }
        }
    }
    // The ledger's new totals for the hours this batch touches, and its
    // late events as adjustments, go out in the same unit as the events (one
    // transaction in exactly-once mode): billing never sees a total that
    // disagrees with the output. Offsets are not known yet and the records
    // do not need them.
    let events: Vec<(&UsageEvent, i64)> = accepted.iter().map(|(_, s)| (&s.event, -1)).collect();
    if let Some(preview) = using(with, |e| e.ledger_preview(partition, &events))? {
        summary.late = preview.folded.adjustments.len() as u64;
        if let Some(rollups_partitions) = layout.rollups_partitions {
            for (key, rollup) in preview.rollups() {
                records.push(rollup_record(key, rollup, partition, rollups_partitions, now_ms));
            }
            for a in &preview.folded.adjustments {
                records.push(adjustment_record(a, partition, rollups_partitions, now_ms));
            }
        }
    }
    summary.rejected_by_reason = reasons.into_iter().collect();
    summary.conflicts_by_tenant = tenants.into_iter().collect();
    Ok(Prepared { records, accepted, summary })
}
