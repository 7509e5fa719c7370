//! From raw records to one outcome each: decode, validate, identify, classify.
//!
//! This is the whole pure part of the pipeline for one batch of one
//! partition. The offline mode and the Kafka worker both call it, so the two
//! can never disagree about a record.

use crate::classify::{Candidate, FirstSeen, HorizonError, LongHorizon, PartitionClassifier, Tier, Verdict};
use hashbrown::HashSet;

use crate::event::{
    id_hash, payload_hash_with, EventKind, IdHash, Partitioner, PayloadHash, Position, RejectReason, Rejection,
    UsageEvent, Validator,
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

    /// For a conflict with an event of an earlier batch: its id and the
    /// time that event was first seen, which is how local state finds the
    /// original a conflict report compares against. `None` for anything
    /// else, a conflict within the batch included (its original is the
    /// batch's own accepted event).
    pub fn original_to_read(&self) -> Option<(IdHash, i64)> {
        match self {
            Outcome::Conflict { id_hash, tier, first, .. } if *tier != Tier::Batch => {
                Some((*id_hash, first.first_seen_ms))
            }
            _ => None,
        }
    }
}

/// What to do with a record on an input partition other than the one its
/// identity belongs on (`--on-misrouted`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnMisrouted {
    /// Classify it where it is and count it (`dedupd_misrouted_records_total`).
    #[default]
    Count,
    /// Reject it (`misrouted`) and count it: its retries may reach another
    /// partition, whose state could never recognise them.
    Reject,
}

impl OnMisrouted {
    /// The flag spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            OnMisrouted::Count => "count",
            OnMisrouted::Reject => "reject",
        }
    }

    pub fn parse(s: &str) -> Option<OnMisrouted> {
        match s {
            "count" => Some(OnMisrouted::Count),
            "reject" => Some(OnMisrouted::Reject),
            _ => None,
        }
    }
}

/// Which partition of the input topic each identity belongs on, checked
/// for every valid record (issue #13).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub partitioner: Partitioner,
    /// The input topic's partition count.
    pub partitions: u32,
    pub on_misrouted: OnMisrouted,
}

impl Placement {
    /// `Some(expected partition)` when `event` does not belong on
    /// `partition`: the partition of its placement identity, its own id
    /// (`id`, already hashed) or, for a correction, its original's.
    pub fn misplaced(&self, event: &UsageEvent, id: &IdHash, partition: i32) -> Option<i32> {
        let placed_by = event.placement_id();
        let placement_hash;
        let hash = if placed_by == event.event_id {
            id
        } else {
            placement_hash = id_hash(&event.tenant_id, placed_by);
            &placement_hash
        };
        let expected = self.partitioner.partition_of(hash, &event.tenant_id, placed_by, self.partitions);
        (expected != partition).then_some(expected)
    }
}

/// The outcomes of one batch, in input order, and how many of its records
/// were on the wrong partition (rejected or not).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Classified {
    pub outcomes: Vec<Outcome>,
    pub misrouted: u64,
}

/// Classifies one batch of one partition. Read-only: the caller publishes the
/// accepted events and then applies them to local state. With a
/// `placement`, a misrouted record is counted, and with
/// [`OnMisrouted::Reject`] rejected before classification, so it can never
/// stand as the first delivery of an identity (not even within its batch).
pub fn classify_records(
    validator: &Validator,
    classifier: &PartitionClassifier,
    long: &dyn LongHorizon,
    records: &[InputRecord<'_>],
    now_ms: i64,
    placement: Option<&Placement>,
) -> Result<Classified, HorizonError> {
    classify_validated(classifier, long, validate_records(validator, records, now_ms, placement), now_ms)
}

/// A batch decoded, validated, placed and hashed: the part of classifying
/// it that reads no local state, so a worker does it outside the engine's
/// lock ([`validate_records`]; the rest is [`classify_validated`]).
///
/// Held as the outcomes to be: a valid record is [`Outcome::Accepted`]
/// until classified, an invalid one already [`Outcome::Rejected`].
/// Classifying then rewrites only the records that are not new, and an
/// event (272 bytes) is not moved from one vector into another on its way
/// (copying events was 11-14% of `dedupd dedupe`'s CPU).
#[derive(Debug)]
pub struct Validated {
    outcomes: Vec<Outcome>,
    sources: Vec<crate::event::Position>,
    misrouted: u64,
}

/// The stateless half of [`classify_records`]: every record decoded,
/// validated, checked against `placement` and hashed. Pure.
pub fn validate_records(
    validator: &Validator,
    records: &[InputRecord<'_>],
    now_ms: i64,
    placement: Option<&Placement>,
) -> Validated {
    let mut misrouted = 0u64;
    let mut scratch = Vec::with_capacity(256);
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(records.len());
    for r in records {
        let v = match r.payload {
            None => {
                Err(Rejection::new(RejectReason::MalformedJson, "null value (tombstone); an event is a JSON object"))
            }
            Some(bytes) => validator.validate(bytes, now_ms),
        };
        let event = match v {
            Ok(event) => event,
            Err(rejection) => {
                outcomes.push(Outcome::Rejected(rejection));
                continue;
            }
        };
        let id = id_hash(&event.tenant_id, &event.event_id);
        if let Some(p) = placement {
            if let Some(expected) = p.misplaced(&event, &id, r.source.partition) {
                misrouted += 1;
                if p.on_misrouted == OnMisrouted::Reject {
                    outcomes.push(Outcome::Rejected(Rejection::new(
                        RejectReason::Misrouted,
                        format!(
                            "the identity belongs on partition {expected} ({} partitioner), not {}",
                            p.partitioner, r.source.partition
                        ),
                    )));
                    continue;
                }
            }
        }
        let payload_hash = payload_hash_with(&event, &mut scratch);
        outcomes.push(Outcome::Accepted { event, id_hash: id, payload_hash });
    }
    Validated { outcomes, sources: records.iter().map(|r| r.source).collect(), misrouted }
}

/// The stateful half of [`classify_records`]: a validated batch against
/// what `classifier` (the hot cache) and `long` (the key store) remember.
/// Read-only.
pub fn classify_validated(
    classifier: &PartitionClassifier,
    long: &dyn LongHorizon,
    batch: Validated,
    now_ms: i64,
) -> Result<Classified, HorizonError> {
    let Validated { mut outcomes, sources, misrouted } = batch;
    // A correction or retraction must refer to an event this partition
    // knows (placement puts it beside its original): remembered by the hot
    // cache or the key store, or a valid event earlier in the batch. One
    // that does not is rejected before classification, so neither it nor a
    // retry of it can stand as a first delivery.
    let originals: Vec<IdHash> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Accepted { event, .. } => original_of(event),
            _ => None,
        })
        .collect();
    if !originals.is_empty() {
        let hot = classifier.hot_cache();
        let mut known: HashSet<IdHash> = originals.iter().filter(|id| hot.get(id, now_ms).is_some()).copied().collect();
        let cold: Vec<IdHash> = originals.iter().filter(|id| !known.contains(*id)).copied().collect();
        let mut answers = Vec::with_capacity(cold.len());
        long.lookup_many(classifier.partition(), &cold, &mut answers)?;
        known.extend(cold.iter().zip(&answers).filter(|(_, a)| a.is_some()).map(|(id, _)| *id));
        for o in &mut outcomes {
            let Outcome::Accepted { event, id_hash, .. } = o else { continue };
            match original_of(event) {
                Some(original) if !known.contains(&original) => *o = Outcome::Rejected(unknown_original(event)),
                _ => {
                    known.insert(*id_hash);
                }
            }
        }
    }
    let candidates: Vec<Candidate> = outcomes
        .iter()
        .zip(&sources)
        .filter_map(|(o, source)| match o {
            Outcome::Accepted { id_hash, payload_hash, .. } => {
                Some(Candidate { id_hash: *id_hash, payload_hash: *payload_hash, source: *source })
            }
            _ => None,
        })
        .collect();
    let mut verdicts = classifier.classify(&candidates, long, now_ms)?.into_iter();
    // The classifier names an earlier record of the batch by its place
    // among the candidates; an outcome names it by its place among all the
    // batch's records (rejects included), which is what readers index.
    let mut record_of_candidate = Vec::with_capacity(candidates.len());
    for (i, o) in outcomes.iter_mut().enumerate() {
        if !matches!(o, Outcome::Accepted { .. }) {
            continue;
        }
        record_of_candidate.push(i);
        let mut verdict =
            verdicts.next().ok_or_else(|| HorizonError("classifier returned fewer verdicts than candidates".into()))?;
        if verdict == Verdict::Accepted {
            // Already what it is: the common case moves nothing.
            continue;
        }
        if let Verdict::Duplicate { first, .. } | Verdict::Conflict { first, .. } | Verdict::Replayed { first, .. } =
            &mut verdict
        {
            if let Some(j) = first.batch_index {
                first.batch_index = Some(*record_of_candidate.get(j).ok_or_else(|| {
                    HorizonError(format!("the classifier named candidate {j} as earlier than candidate {i}").into())
                })?);
            }
        }
        // The stand-in allocates nothing; it holds the place for the
        // moment the event moves into its bucket.
        let placeholder = Outcome::Rejected(Rejection { reason: RejectReason::MalformedJson, detail: String::new() });
        *o = reclassified(std::mem::replace(o, placeholder), verdict);
    }
    Ok(Classified { outcomes, misrouted })
}

/// A valid record's outcome once its verdict is known. Anything but a
/// provisionally accepted record, and an accepted verdict, leave it as is.
fn reclassified(outcome: Outcome, verdict: Verdict) -> Outcome {
    match (outcome, verdict) {
        (Outcome::Accepted { event, id_hash, .. }, Verdict::Duplicate { tier, first }) => {
            Outcome::Duplicate { event, id_hash, tier, first }
        }
        (Outcome::Accepted { event, id_hash, payload_hash }, Verdict::Conflict { tier, first }) => {
            Outcome::Conflict { event, id_hash, payload_hash, tier, first }
        }
        (Outcome::Accepted { event, id_hash, .. }, Verdict::Replayed { tier, first }) => {
            Outcome::Replayed { event, id_hash, tier, first }
        }
        (unchanged, _) => unchanged,
    }
}

/// The identity of the event a correction or retraction refers to.
fn original_of(event: &UsageEvent) -> Option<IdHash> {
    let r = event.correction_ref.as_ref().filter(|_| event.kind != EventKind::Usage)?;
    Some(id_hash(&event.tenant_id, &r.original_event_id))
}

/// Why a correction or retraction of an unknown event is not billed.
fn unknown_original(event: &UsageEvent) -> Rejection {
    let original = event.correction_ref.as_ref().map_or("", |r| r.original_event_id.as_str());
    Rejection::new(
        RejectReason::UnknownOriginal,
        format!(
            "this {} refers to event {original:?}, which this partition has not accepted within its horizon \
             (a correction is placed by its original's identity: key it tenant_id \\0 original_event_id)",
            event.kind.as_str()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::{ClassifierSettings, NoLongHorizon, SeenKey};
    use crate::event::Limits;

    const NOW: i64 = 1_790_000_000_000;

    fn event(id: &str) -> Vec<u8> {
        format!(
            r#"{{"event_id":"{id}","tenant_id":"acme","customer_id":"c","meter":"m","quantity":"1","timestamp":{NOW}}}"#
        )
        .into_bytes()
    }

    /// Four partitions; `home` is where `evt-{i}` belongs.
    fn home(i: usize) -> i32 {
        Partitioner::Dedupd.partition_of(&id_hash("acme", &format!("evt-{i}")), "", "", 4)
    }

    fn run(partition: i32, ids: &[usize], on_misrouted: OnMisrouted) -> Classified {
        let validator = Validator::new(Limits::default(), Vec::new(), "salt");
        let settings =
            ClassifierSettings { hot_ttl_ms: 1 << 40, hot_capacity: 100, horizon_ms: 1 << 40, detect_replays: true };
        let classifier = PartitionClassifier::new(partition, settings);
        let bytes: Vec<Vec<u8>> = ids.iter().map(|i| event(&format!("evt-{i}"))).collect();
        let records: Vec<InputRecord<'_>> = bytes
            .iter()
            .enumerate()
            .map(|(o, b)| InputRecord { source: Position::new(partition, o as i64), payload: Some(b) })
            .collect();
        let placement = Placement { partitioner: Partitioner::Dedupd, partitions: 4, on_misrouted };
        classify_records(&validator, &classifier, &NoLongHorizon, &records, NOW, Some(&placement)).expect("classify")
    }

    #[test]
    fn a_record_on_another_partition_than_its_identitys_is_counted_and_still_classified() {
        let here: Vec<usize> = (0..40).filter(|&i| home(i) == 2).take(3).collect();
        let elsewhere: Vec<usize> = (0..40).filter(|&i| home(i) != 2).take(2).collect();
        let ids = [here[0], elsewhere[0], here[1], elsewhere[1], elsewhere[1], here[2]];
        let c = run(2, &ids, OnMisrouted::Count);
        assert_eq!(c.misrouted, 3);
        let buckets: Vec<&str> = c.outcomes.iter().map(Outcome::bucket).collect();
        assert_eq!(buckets, ["accepted", "accepted", "accepted", "accepted", "duplicate", "accepted"]);
    }

    #[test]
    fn with_reject_a_misrouted_record_is_rejected_before_it_can_be_a_first_delivery() {
        let here = (0..40).find(|&i| home(i) == 1).expect("an id of partition 1");
        let elsewhere = (0..40).find(|&i| home(i) == 3).expect("an id of partition 3");
        let c = run(1, &[elsewhere, here, elsewhere], OnMisrouted::Reject);
        assert_eq!(c.misrouted, 2);
        for i in [0, 2] {
            let Outcome::Rejected(r) = &c.outcomes[i] else { panic!("{:?}", c.outcomes[i]) };
            assert_eq!(r.reason, RejectReason::Misrouted);
            assert!(r.detail.contains("belongs on partition 3"), "{}", r.detail);
        }
        assert_eq!(c.outcomes[1].bucket(), "accepted");
    }

    #[test]
    fn invalid_records_are_not_judged_for_placement() {
        let validator = Validator::new(Limits::default(), Vec::new(), "salt");
        let settings = ClassifierSettings { hot_ttl_ms: 1, hot_capacity: 1, horizon_ms: 1, detect_replays: true };
        let classifier = PartitionClassifier::new(0, settings);
        let bad = br#"{"event_id":"x","tenant_id":"acme"}"#;
        let records = [InputRecord { source: Position::new(0, 0), payload: Some(bad) }];
        let placement =
            Placement { partitioner: Partitioner::Crc32, partitions: 64, on_misrouted: OnMisrouted::Reject };
        let c = classify_records(&validator, &classifier, &NoLongHorizon, &records, NOW, Some(&placement)).expect("ok");
        assert_eq!(c.misrouted, 0);
        assert!(matches!(&c.outcomes[0], Outcome::Rejected(r) if r.reason == RejectReason::MissingField));
    }

    fn correction(id: &str, of: &str) -> Vec<u8> {
        format!(
            r#"{{"event_id":"{id}","tenant_id":"acme","customer_id":"c","meter":"m","quantity":"-1","timestamp":{NOW},"kind":"correction","correction_ref":{{"original_event_id":"{of}"}}}}"#
        )
        .into_bytes()
    }

    /// A key store that remembers the listed ids.
    struct Remembers(Vec<IdHash>);

    impl LongHorizon for Remembers {
        fn lookup_many(&self, _: i32, ids: &[IdHash], out: &mut Vec<Option<SeenKey>>) -> Result<(), HorizonError> {
            out.clear();
            out.extend(ids.iter().map(|id| {
                self.0.contains(id).then(|| SeenKey {
                    id_hash: *id,
                    payload_hash: crate::event::PayloadHash([0; 16]),
                    first_seen_ms: NOW,
                    source: Position::new(0, 0),
                    output: Position::new(0, 0),
                })
            }));
            Ok(())
        }
    }

    #[test]
    fn a_correction_is_accepted_only_when_its_partition_knows_the_original() {
        let validator = Validator::new(Limits::default(), Vec::new(), "salt");
        let settings =
            ClassifierSettings { hot_ttl_ms: 1 << 40, hot_capacity: 100, horizon_ms: 1 << 40, detect_replays: true };
        let mut classifier = PartitionClassifier::new(0, settings);
        // In the hot cache: evt-hot. In the key store: evt-cold.
        let hot = SeenKey {
            id_hash: id_hash("acme", "evt-hot"),
            payload_hash: crate::event::PayloadHash([1; 16]),
            first_seen_ms: NOW,
            source: Position::new(0, 0),
            output: Position::new(0, 0),
        };
        classifier.commit([&hot], NOW);
        let cold = Remembers(vec![id_hash("acme", "evt-cold")]);
        let batch = [
            correction("fix-1", "evt-hot"),
            correction("fix-2", "evt-cold"),
            correction("fix-3", "evt-nowhere"),
            event("evt-new"),
            correction("fix-4", "evt-new"),
            correction("fix-3", "evt-nowhere"),
        ];
        let records: Vec<InputRecord<'_>> = batch
            .iter()
            .enumerate()
            .map(|(o, b)| InputRecord { source: Position::new(0, o as i64 + 10), payload: Some(b) })
            .collect();
        let c = classify_records(&validator, &classifier, &cold, &records, NOW, None).expect("classify");
        let buckets: Vec<&str> = c.outcomes.iter().map(Outcome::bucket).collect();
        // The retry of the unknown correction is rejected too, not taken for
        // a duplicate of something billed.
        assert_eq!(buckets, ["accepted", "accepted", "rejected", "accepted", "accepted", "rejected"]);
        let Outcome::Rejected(r) = &c.outcomes[2] else { unreachable!() };
        assert_eq!(r.reason, RejectReason::UnknownOriginal);
        assert!(r.detail.contains("evt-nowhere"), "{}", r.detail);
    }

    #[test]
    fn a_correction_belongs_on_its_originals_partition() {
        let original = (0..40).find(|&i| home(i) == 1).expect("an id at home on 1");
        let fix = (0..40)
            .map(|i| format!("fix-{i}"))
            .find(|f| Partitioner::Dedupd.partition_of(&id_hash("acme", f), "", "", 4) != 1);
        let fix = fix.expect("a correction id whose own home is elsewhere");
        let validator = Validator::new(Limits::default(), Vec::new(), "salt");
        let event = validator.validate(&correction(&fix, &format!("evt-{original}")), NOW).expect("valid");
        let placement =
            Placement { partitioner: Partitioner::Dedupd, partitions: 4, on_misrouted: OnMisrouted::Reject };
        let own = id_hash("acme", &fix);
        assert_eq!(placement.misplaced(&event, &own, 1), None, "placed by the original's identity");
        assert_eq!(
            validator.placement_of(&correction(&fix, &format!("evt-{original}"))),
            Ok(("acme".to_owned(), format!("evt-{original}")))
        );
    }
}
