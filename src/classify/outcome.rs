//! From raw records to one outcome each: decode, validate, identify, classify.
//!
//! This is the whole pure part of the pipeline for one batch of one
//! partition. The offline mode and the Kafka worker both call it, so the two
//! can never disagree about a record.

use crate::classify::{Candidate, FirstSeen, HorizonError, LongHorizon, PartitionClassifier, Tier, Verdict};
use crate::event::{
    id_hash, payload_hash_with, IdHash, PayloadHash, Position, RejectReason, Rejection, UsageEvent, Validator,
};

/// One input record: where it came from and its value bytes. `None` is a
/// Kafka tombstone (null value).
#[derive(Clone, Copy, Debug)]
pub struct InputRecord<'a> {
    pub source: Position,
    pub payload: Option<&'a [u8]>,
}

/// The bucket of one record, with what the next stage needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// New: to be published, then remembered.
    Accepted { event: UsageEvent, id_hash: IdHash, payload_hash: PayloadHash },
    /// A retry of an accepted event: dropped, counted.
    Duplicate { event: UsageEvent, id_hash: IdHash, tier: Tier, first: FirstSeen },
    /// Same id, different payload: reported on the conflicts topic, counted.
    Conflict { event: UsageEvent, id_hash: IdHash, payload_hash: PayloadHash, tier: Tier, first: FirstSeen },
    /// The accepted record itself, delivered again: dropped, counted apart.
    Replayed { event: UsageEvent, id_hash: IdHash, tier: Tier, first: FirstSeen },
    /// Invalid: reported on the rejected topic with its reason.
    Rejected(Rejection),
}

impl Outcome {
    /// The bucket name used by `dedupd_events_total{bucket}`.
    pub fn bucket(&self) -> &'static str {
        match self {
            Outcome::Accepted { .. } => "accepted",
            Outcome::Duplicate { .. } => "duplicate",
            Outcome::Conflict { .. } => "conflict",
            Outcome::Replayed { .. } => "replayed",
            Outcome::Rejected(_) => "rejected",
        }
    }
}

/// Classifies one batch of one partition. Read-only: the caller publishes the
/// accepted events and then applies them to local state.
pub fn classify_records(
    validator: &Validator,
    classifier: &PartitionClassifier,
    long: &dyn LongHorizon,
    records: &[InputRecord<'_>],
    now_ms: i64,
) -> Result<Vec<Outcome>, HorizonError> {
    let mut scratch = Vec::with_capacity(256);
    let mut validated: Vec<Result<(UsageEvent, IdHash, PayloadHash), Rejection>> = Vec::with_capacity(records.len());
    let mut candidates = Vec::with_capacity(records.len());
    for r in records {
        let v = match r.payload {
            None => {
                Err(Rejection::new(RejectReason::MalformedJson, "null value (tombstone); an event is a JSON object"))
            }
            Some(bytes) => validator.validate(bytes, now_ms),
        };
        let v = v.map(|event| {
            let id = id_hash(&event.tenant_id, &event.event_id);
            let payload = payload_hash_with(&event, &mut scratch);
            candidates.push(Candidate { id_hash: id, payload_hash: payload, source: r.source });
            (event, id, payload)
        });
        validated.push(v);
    }
    let mut verdicts = classifier.classify(&candidates, long, now_ms)?.into_iter();
    let mut out = Vec::with_capacity(records.len());
    for v in validated {
        let outcome = match v {
            Err(rejection) => Outcome::Rejected(rejection),
            Ok((event, id_hash, payload_hash)) => match verdicts.next() {
                Some(Verdict::Accepted) => Outcome::Accepted { event, id_hash, payload_hash },
                Some(Verdict::Duplicate { tier, first }) => Outcome::Duplicate { event, id_hash, tier, first },
                Some(Verdict::Conflict { tier, first }) => {
                    Outcome::Conflict { event, id_hash, payload_hash, tier, first }
                }
                Some(Verdict::Replayed { tier, first }) => Outcome::Replayed { event, id_hash, tier, first },
                None => {
                    return Err(HorizonError("classifier returned fewer verdicts than candidates".into()));
                }
            },
        };
        out.push(outcome);
    }
    Ok(out)
}
