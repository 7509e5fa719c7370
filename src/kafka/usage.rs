//! The usage ledger read from Kafka: the deployment-wide answers.
//!
//! A worker's state directory holds its partitions' share of the ledger; the
//! rollups topic holds every partition's. `dedupd usage --brokers
//! --rollups-topic` reads that topic as compaction leaves it (the latest
//! record of each key) and answers the same query as offline. `dedupd usage
//! verify --brokers --output-topic --rollups-topic` refolds the accepted
//! events of the output topic, partition by partition in offset order, and
//! compares every rollup and adjustment with the rollups topic.
//!
//! Blocking (whole-topic reads with a plain consumer): call from a blocking
//! context. Committed data only (`read_committed`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use rust_decimal::Decimal;

use crate::event::{EventKind, Position, Validator};
use crate::kafka::error::KafkaError;
use crate::kafka::records::parse_output;
use crate::ledger::{
    compare_rollups, unexplained_rollups, Adjustment, AdjustmentReason, CounterKey, HeldRollups, HourKey, Lateness,
    LedgerMaps, Period, Rollup, UsageAnswer, UsageQuery,
};

/// How to reach the brokers: bootstrap servers and extra librdkafka
/// properties (security settings; `consumer.`/`producer.` scoped as for
/// `dedupd run`).
#[derive(Clone, Debug)]
pub struct Brokers {
    pub servers: String,
    pub properties: Vec<(String, String)>,
    /// Longest wait for metadata and for reaching a topic's end.
    pub timeout: Duration,
}

impl Brokers {
    fn consumer(&self) -> Result<BaseConsumer, KafkaError> {
        let mut cfg = ClientConfig::new();
        cfg.set("bootstrap.servers", &self.servers)
            .set("client.id", "dedupd-usage")
            .set("group.id", "dedupd-usage-reader")
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", "5");
        crate::kafka::clients::apply_properties(
            &mut cfg,
            &self.properties,
            crate::kafka::clients::ClientKind::Consumer,
        );
        // Forced: only committed records count, and the read ends at each
        // partition's end.
        cfg.set("isolation.level", "read_committed").set("enable.partition.eof", "true");
        cfg.create().map_err(KafkaError::client("creating the usage reader"))
    }
}

/// Calls `f` on every committed record of `topic`, partition by partition
/// in offset order, up to the end each partition had when the read began.
pub(crate) fn read_topic(
    brokers: &Brokers,
    topic: &str,
    mut f: impl FnMut(i32, i64, Option<&[u8]>, &rdkafka::message::BorrowedMessage<'_>) -> Result<(), KafkaError>,
) -> Result<(), KafkaError> {
    let consumer = brokers.consumer()?;
    let mut ends = assign_from_beginning(&consumer, topic, &brokers.servers, brokers.timeout)?;
    let mut last_progress = Instant::now();
    while !ends.is_empty() {
        if last_progress.elapsed() > brokers.timeout {
            return Err(KafkaError::Task {
                detail: format!(
                    "reading {topic} made no progress for {:?}; partitions left: {ends:?}",
                    brokers.timeout
                ),
            });
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                last_progress = Instant::now();
                let (p, o) = (m.partition(), m.offset());
                if ends.get(&p).is_some_and(|end| o < *end) {
                    f(p, o, m.payload(), &m)?;
                }
                if ends.get(&p).is_some_and(|end| o + 1 >= *end) {
                    ends.remove(&p);
                }
            }
            Some(Err(RdError::PartitionEOF(p))) => {
                ends.remove(&p);
            }
            Some(Err(e)) => return Err(KafkaError::client("reading")(e)),
            None => {}
        }
    }
    Ok(())
}

/// Assigns every partition of `topic` to `consumer` from its beginning and
/// returns the end of each non-empty one: where a read of the whole topic
/// as it stands now stops.
pub(crate) fn assign_from_beginning(
    consumer: &BaseConsumer,
    topic: &str,
    servers: &str,
    timeout: Duration,
) -> Result<BTreeMap<i32, i64>, KafkaError> {
    let md = consumer.fetch_metadata(Some(topic), timeout).map_err(KafkaError::client("fetching metadata"))?;
    let partitions: Vec<i32> = md
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    if partitions.is_empty() {
        return Err(KafkaError::TopicMissing { topic: topic.to_owned(), brokers: servers.to_owned() });
    }
    let mut ends = BTreeMap::new();
    let mut tpl = TopicPartitionList::new();
    for p in partitions {
        let (low, high) =
            consumer.fetch_watermarks(topic, p, timeout).map_err(KafkaError::client("fetching watermarks"))?;
        if high > low {
            ends.insert(p, high);
        }
        tpl.add_partition_offset(topic, p, Offset::Beginning).map_err(KafkaError::client("assigning"))?;
    }
    consumer.assign(&tpl).map_err(KafkaError::client("assigning"))?;
    Ok(ends)
}

/// What the rollups topic holds: every rollup with its partition, and every
/// adjustment with its partition.
pub struct RollupsTopic {
    pub rollups: Vec<(HourKey, i32, Rollup)>,
    pub adjustments: Vec<(i32, Adjustment)>,
}

/// The rollups topic as compaction leaves it: the latest record of each key.
pub fn read_rollups(brokers: &Brokers, topic: &str) -> Result<RollupsTopic, KafkaError> {
    let mut latest: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    read_topic(brokers, topic, |_, _, value, m| {
        if let (Some(k), Some(v)) = (m.key(), value) {
            latest.insert(k.to_vec(), v.to_vec());
        }
        Ok(())
    })?;
    RollupsTopic::of_latest(latest.values().map(Vec::as_slice))
        .map_err(|why| KafkaError::Task { detail: format!("a record of {topic} is not a rollup: {why}") })
}

impl RollupsTopic {
    /// Reads back the latest value of each key of the rollups topic (as
    /// compaction leaves it); the first value that is not a rollup or an
    /// adjustment is the error.
    pub fn of_latest<'a>(values: impl Iterator<Item = &'a [u8]>) -> Result<RollupsTopic, String> {
        let mut rollups = Vec::new();
        let mut adjustments = Vec::new();
        for value in values {
            match parse_ledger_record(value)? {
                LedgerRecord::Rollup(k, p, r) => rollups.push((k, p, r)),
                LedgerRecord::Adjustment(p, a) => adjustments.push((p, a)),
            }
        }
        Ok(RollupsTopic { rollups, adjustments })
    }
}

/// Answers `query` from the rollups topic: every partition's share.
pub fn usage_from_topic(brokers: &Brokers, topic: &str, query: &UsageQuery) -> Result<UsageAnswer, KafkaError> {
    let RollupsTopic { rollups, adjustments } = read_rollups(brokers, topic)?;
    let selected: Vec<(HourKey, Rollup)> = rollups.into_iter().map(|(k, _, r)| (k, r)).collect();
    Ok(UsageAnswer::of(
        query,
        selected.iter().map(|(k, r)| (k, r)),
        adjustments.into_iter().map(|(_, a)| a).filter(|a| a.counter.tenant_id == query.tenant_id),
    )?)
}

/// Every partition's accepted events, in offset order, as the output topic
/// holds them now; and one line per record that does not read back.
pub type OutputEvents = BTreeMap<i32, Vec<(i64, crate::event::UsageEvent)>>;

fn read_output_events(
    brokers: &Brokers,
    output_topic: &str,
    validator: &Validator,
) -> Result<(OutputEvents, Vec<String>), KafkaError> {
    let mut by_partition = OutputEvents::new();
    let mut unreadable = Vec::new();
    read_topic(brokers, output_topic, |p, o, value, m| {
        match parse_output(validator, Position::new(p, o), m.headers(), value) {
            Ok(stored) => by_partition.entry(p).or_default().push((o, stored.event)),
            Err(why) => unreadable.push(format!("output partition {p} offset {o} does not read back: {why}")),
        }
        Ok(())
    })?;
    Ok((by_partition, unreadable))
}

/// Answers `query` from the output topic's accepted events (every
/// partition refolded with `lateness`, as the workers folded it): how a
/// grouping the rollups do not keep (`dimension:KEY`) is answered for the
/// whole deployment. Covers what output retention still holds.
pub fn usage_from_output(
    brokers: &Brokers,
    output_topic: &str,
    validator: &Validator,
    lateness: &Lateness,
    query: &UsageQuery,
) -> Result<UsageAnswer, KafkaError> {
    let (by_partition, unreadable) = read_output_events(brokers, output_topic, validator)?;
    if let Some(first) = unreadable.first() {
        // A total that skipped a record would misbill.
        return Err(KafkaError::Task {
            detail: format!("{} output records do not read back: {first}", unreadable.len()),
        });
    }
    UsageAnswer::of_events(query, lateness, by_partition.values().map(Vec::as_slice))
        .map_err(|e| KafkaError::Task { detail: e.to_string() })
}

/// What `dedupd usage verify` found between the output and rollups topics.
#[derive(Debug, Default)]
pub struct TopicCheck {
    pub events: u64,
    pub hours: usize,
    pub adjustments: usize,
    pub drift: Vec<String>,
}

/// Refolds the output topic's accepted events (per partition, in offset
/// order, with `lateness`) and compares every rollup and adjustment with
/// the rollups topic. Run it on a quiet deployment (or accept drift for the
/// hours of batches in flight); output retention must cover the hours it
/// compares, since rollups outlive the output records they summed.
pub fn verify_topics(
    brokers: &Brokers,
    output_topic: &str,
    rollups_topic: &str,
    validator: &Validator,
    lateness: &Lateness,
) -> Result<TopicCheck, KafkaError> {
    let (by_partition, unreadable) = read_output_events(brokers, output_topic, validator)?;
    let rollups = read_rollups(brokers, rollups_topic)?;
    let mut check = compare_topics(&by_partition, rollups, lateness).map_err(|detail| KafkaError::Task { detail })?;
    check.drift.splice(0..0, unreadable);
    Ok(check)
}

/// What [`verify_topics`] compares, once both topics are read (the
/// simulator's final check runs it on the model broker's topics): every
/// partition's accepted events refolded in offset order with `lateness`,
/// against every rollup and adjustment of the rollups topic, its reason
/// included (`late` or `sum_limit`). Err: the events do not fold.
pub fn compare_topics(
    by_partition: &OutputEvents,
    rollups: RollupsTopic,
    lateness: &Lateness,
) -> Result<TopicCheck, String> {
    const SIDES: (&str, &str) = ("rollups topic", "output topic's events");
    let RollupsTopic { rollups, adjustments } = rollups;
    let mut stored: HeldRollups = rollups.into_iter().map(|(k, p, r)| ((k, p), r)).collect();
    let mut stored_adjustments: BTreeMap<(i32, String, String), Adjustment> =
        adjustments.into_iter().map(|(p, a)| ((p, a.counter.tenant_id.clone(), a.event_id.clone()), a)).collect();
    let mut check = TopicCheck::default();
    for (&p, events) in by_partition {
        check.events += events.len() as u64;
        let mut maps = LedgerMaps::default();
        let folded = maps.fold(lateness, events.iter().map(|(o, e)| (e, *o))).map_err(|e| e.to_string())?;
        check.hours += compare_rollups(p, maps.hours, &mut stored, SIDES, &mut check.drift);
        for want in folded.adjustments {
            check.adjustments += 1;
            let key = (p, want.counter.tenant_id.clone(), want.event_id.clone());
            match stored_adjustments.remove(&key) {
                // Not the output offset: the topic's records do not carry it.
                Some(got) if got.amount == want.amount && got.period == want.period && got.reason == want.reason => {}
                Some(got) => check.drift.push(format!(
                    "partition {p} adjustment of {}: topic says {} in {} ({}), output says {} in {} ({})",
                    want.event_id,
                    got.amount,
                    got.period,
                    got.reason.as_str(),
                    want.amount,
                    want.period,
                    want.reason.as_str()
                )),
                None => check.drift.push(format!(
                    "partition {p} event {} ({}, {}) has no adjustment on the rollups topic",
                    want.event_id,
                    want.amount,
                    want.reason.as_str()
                )),
            }
        }
    }
    unexplained_rollups(stored, SIDES, &mut check.drift);
    for ((p, _, id), _) in stored_adjustments {
        check
            .drift
            .push(format!("partition {p} adjustment of {id} has no late or set-aside event behind it on the output"));
    }
    Ok(check)
}

/// One record of the rollups topic, read back.
enum LedgerRecord {
    Rollup(HourKey, i32, Rollup),
    Adjustment(i32, Adjustment),
}

fn parse_ledger_record(value: &[u8]) -> Result<LedgerRecord, String> {
    let v: serde_json::Value = serde_json::from_slice(value).map_err(|e| e.to_string())?;
    let text = |k: &str| v[k].as_str().map(str::to_owned).ok_or_else(|| format!("no {k}"));
    let opt_text = |k: &str| v[k].as_str().map(str::to_owned);
    let dec = |s: String| s.parse::<Decimal>().map_err(|e| format!("{s:?}: {e}"));
    let time = |s: String| crate::ledger::parse_bound(&s);
    let partition = v["partition"].as_i64().and_then(|p| i32::try_from(p).ok()).ok_or("no partition")?;
    let counter = CounterKey::new(text("tenant_id")?, text("customer_id")?, text("meter")?);
    match v["type"].as_str() {
        Some("rollup") => {
            let hour_ms = time(text("hour")?)?;
            let last = match (opt_text("last_event_time"), opt_text("last")) {
                (Some(t), Some(q)) => Some((time(t)?, dec(q)?)),
                _ => None,
            };
            let rollup = Rollup {
                sum: dec(text("sum")?)?,
                count: v["count"].as_u64().ok_or("no count")?,
                corrections: v["corrections"].as_u64().ok_or("no corrections")?,
                max: opt_text("max").map(dec).transpose()?,
                last,
                latest_event_ms: opt_text("latest_event_time").map(time).transpose()?.unwrap_or(i64::MIN),
            };
            Ok(LedgerRecord::Rollup(HourKey { counter: Arc::new(counter), hour_ms }, partition, rollup))
        }
        Some("adjustment") => {
            let kind = EventKind::parse(&text("kind")?).ok_or("unknown kind")?;
            let reason = AdjustmentReason::parse(&text("reason")?).ok_or("unknown reason")?;
            Ok(LedgerRecord::Adjustment(
                partition,
                Adjustment {
                    counter,
                    period: Period::parse(&text("period")?)?,
                    event_id: text("event_id")?,
                    kind,
                    amount: dec(text("amount")?)?,
                    event_ms: time(text("timestamp")?)?,
                    reason,
                    output_offset: -1,
                },
            ))
        }
        other => Err(format!("unknown record type {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kafka::records::{adjustment_record, rollup_record};

    #[test]
    fn an_adjustment_with_another_reason_on_the_topic_is_drift() {
        let t = 1_700_000_000_000 - 1_700_000_000_000 % 3_600_000;
        let event = |id: &str, ts: i64| {
            let mut e = crate::storage::testutil::sample_event_at(0, 0, 0, ts).event;
            e.event_id = id.into();
            e.timestamp_ms = ts;
            e.kind = EventKind::Usage;
            e.correction_ref = None;
            e.quantity = Decimal::ONE;
            e
        };
        // The second is three days behind the first: late.
        let events: OutputEvents = [(0, vec![(0, event("on_time", t)), (1, event("late", t - 72 * 3_600_000))])].into();
        let lateness = Lateness::default();
        let mut maps = LedgerMaps::default();
        let folded = maps.fold(&lateness, events[&0].iter().map(|(o, e)| (e, *o))).expect("fold");
        assert_eq!(folded.adjustments.len(), 1, "the late event is an adjustment");
        let topic = |reason| RollupsTopic {
            rollups: maps.hours.iter().map(|(k, r)| (k.clone(), 0, r.clone())).collect(),
            adjustments: folded.adjustments.iter().map(|a| (0, Adjustment { reason, ..a.clone() })).collect(),
        };
        let same = compare_topics(&events, topic(AdjustmentReason::Late), &lateness).expect("compare");
        assert!(same.drift.is_empty(), "{:?}", same.drift);
        let other = compare_topics(&events, topic(AdjustmentReason::SumLimit), &lateness).expect("compare");
        assert_eq!(other.drift.len(), 1, "{:?}", other.drift);
        assert!(other.drift[0].contains("(sum_limit), output says 1 in"), "{:?}", other.drift);
    }

    #[test]
    fn rollup_and_adjustment_records_read_back_to_what_was_published() {
        let key = HourKey {
            counter: Arc::new(CounterKey::new("t".into(), "c\"q".into(), "m".into())),
            hour_ms: 1_700_000_000_000 - 1_700_000_000_000 % 3_600_000,
        };
        let rollup = Rollup {
            sum: Decimal::new(-125, 2),
            count: 3,
            corrections: 1,
            max: Some(Decimal::new(7, 0)),
            last: Some((1_700_000_000_123, Decimal::new(5, 1))),
            latest_event_ms: 1_700_000_000_456,
        };
        let r = rollup_record(&key, &rollup, 2, 4, 0);
        match parse_ledger_record(r.value.as_deref().expect("value")) {
            Ok(LedgerRecord::Rollup(k, p, got)) => assert_eq!((k, p, got), (key.clone(), 2, rollup)),
            _ => panic!("not a rollup"),
        }
        let a = Adjustment {
            counter: (*key.counter).clone(),
            period: Period::parse("2023-11").expect("period"),
            event_id: "e".into(),
            kind: EventKind::Usage,
            amount: Decimal::new(42, 1),
            event_ms: 1_699_999_000_000,
            reason: AdjustmentReason::Late,
            output_offset: -1,
        };
        match parse_ledger_record(adjustment_record(&a, 1, 4, 0).value.as_deref().expect("value")) {
            Ok(LedgerRecord::Adjustment(p, got)) => assert_eq!((p, got), (1, a)),
            _ => panic!("not an adjustment"),
        }
    }
}
