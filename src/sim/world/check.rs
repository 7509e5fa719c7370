//! What must hold after (and during) every schedule, against a model of
//! the input built from what was produced, in partition order.

use std::collections::BTreeMap;

use rdkafka::message::{Header, OwnedHeaders};

use crate::event::Position;
use crate::kafka::records::{parse_output, H_SOURCE_OFFSET, H_SOURCE_PARTITION};
use crate::kafka::usage::{compare_topics, OutputEvents, RollupsTopic, TopicCheck};
use crate::pipeline::DeliveryMode;
use crate::sim::broker::log::{read_committed_records, Isolation, Record, TopicPartition};
use crate::sim::net::Network;
use crate::sim::world::{Planned, World, CONFLICTS, OUTPUT, REJECTED, ROLLUPS};
use crate::state::StoredEvent;

/// A broken guarantee.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("event {event_id} is on the output {} times (billed twice): at {offsets:?}", offsets.len())]
    BilledTwice { event_id: String, offsets: Vec<(i32, i64)> },
    #[error("event {event_id} was accepted by no one: missing from the output (revenue lost)")]
    Lost { event_id: String },
    #[error("event {event_id} is on the output with quantity {found}, but its first delivery said {expected}")]
    NotFirstPayload { event_id: String, expected: String, found: String },
    #[error(
        "input partition {partition} has its offset committed at {committed} while events below it are not on \
         the output: {missing:?}"
    )]
    CommittedAhead { partition: i32, committed: i64, missing: Vec<String> },
    #[error("worker {worker}'s local state of partition {partition} is not the fold of the output: {detail}")]
    StateDiffers { worker: usize, partition: i32, detail: String },
    #[error("side topic {topic}: {detail}")]
    SideTopic { topic: &'static str, detail: String },
    #[error("the rollups topic is not the ledger of the output (billing's totals are wrong): {detail}")]
    RollupsDiffer { detail: String },
    #[error("output record {partition}@{offset} does not read back: {detail}")]
    ForeignOutput { partition: i32, offset: i64, detail: String },
    #[error("input not processed by {deadline_ms} ms although faults stopped (a stall): {detail}")]
    Stalled { deadline_ms: i64, detail: String },
    #[error("worker {worker}'s local state does not open after the schedule and a last power loss: {detail}")]
    StateUnreadable { worker: usize, detail: String },
    #[error("the model broker broke one of its own invariants: {detail}")]
    BrokerInvariant { detail: String },
}

/// Records of `topic` a read_committed consumer sees, partition by
/// partition: (partition, offset, record).
pub fn output_records(net: &Network, topic: &str) -> Vec<(i32, i64, Record)> {
    let counts = net.broker().partition_counts();
    let n = counts.get(topic).copied().unwrap_or(0);
    let mut out = Vec::new();
    for p in 0..n {
        let Some(log) = net.broker().partition(&TopicPartition::new(topic, p)) else { continue };
        let Ok(fetch) = log.fetch(log.log_start_offset(), usize::MAX, Isolation::ReadCommitted) else { continue };
        for (offset, record) in read_committed_records(&fetch) {
            out.push((p, offset, record.clone()));
        }
    }
    out
}

fn headers_of(record: &Record) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new();
    for (k, v) in &record.headers {
        headers = headers.insert(Header { key: k, value: Some(v) });
    }
    headers
}

/// The output's events, read back as repair reads them.
pub fn output_events(net: &Network, topic: &str) -> Vec<(i32, i64, StoredEvent)> {
    let validator = crate::config::EngineSettings::default().validator();
    output_records(net, topic)
        .into_iter()
        .filter_map(|(p, o, r)| {
            let headers = headers_of(&r);
            parse_output(&validator, Position::new(p, o), Some(&headers), r.value.as_deref()).ok().map(|e| (p, o, e))
        })
        .collect()
}

/// What the input asks for, from what was produced in partition order.
struct Expected {
    /// event id → (partition, offset of its first delivery, variant).
    first: BTreeMap<String, (i32, i64, u32)>,
    /// Input positions whose event conflicts with its first delivery.
    conflicts: Vec<(i32, i64)>,
    rejected: Vec<(i32, i64)>,
}

fn expected(produced: &BTreeMap<(i32, i64), Planned>) -> Expected {
    let mut e = Expected { first: BTreeMap::new(), conflicts: Vec::new(), rejected: Vec::new() };
    for (&(p, o), planned) in produced {
        match planned {
            Planned::Event { id, variant } => {
                let first = e.first.entry(format!("e{id}")).or_insert((p, o, *variant));
                if first.2 != *variant {
                    e.conflicts.push((p, o));
                }
            }
            Planned::Malformed { .. } => e.rejected.push((p, o)),
        }
    }
    e
}

/// Committed input offsets never run ahead of the output: every event
/// whose first delivery lies below `committed` is on the output.
pub(crate) fn committed_not_ahead(w: &mut World, partition: i32, committed: i64) {
    let expect = expected(&w.produced);
    let on_output: std::collections::BTreeSet<String> =
        output_events(&w.net, OUTPUT).into_iter().map(|(_, _, e)| e.event.event_id).collect();
    let missing: Vec<String> = expect
        .first
        .iter()
        .filter(|(id, (p, o, _))| *p == partition && *o < committed && !on_output.contains(*id))
        .map(|(id, _)| id.clone())
        .collect();
    if !missing.is_empty() {
        w.violations.push(Violation::CommittedAhead { partition, committed, missing });
    }
}

fn side_positions(net: &Network, topic: &str) -> Vec<(i32, i64)> {
    let num = |r: &Record, name: &str| -> i64 {
        r.headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse().ok())
            .unwrap_or(-1)
    };
    let mut out: Vec<(i32, i64)> = output_records(net, topic)
        .iter()
        .map(|(_, _, r)| (num(r, H_SOURCE_PARTITION) as i32, num(r, H_SOURCE_OFFSET)))
        .collect();
    out.sort_unstable();
    out
}

/// The checks at the end of a schedule whose input was all processed.
pub fn final_checks(w: &World) -> Vec<Violation> {
    let mut v = Vec::new();
    let expect = expected(&w.produced);
    let mut seen: BTreeMap<String, Vec<(i32, i64, String)>> = BTreeMap::new();
    for (p, o, e) in output_events(&w.net, OUTPUT) {
        seen.entry(e.event.event_id.clone()).or_default().push((p, o, e.event.quantity.to_string()));
    }
    if output_records(&w.net, OUTPUT).len() != seen.values().map(Vec::len).sum::<usize>() {
        v.push(Violation::ForeignOutput {
            partition: -1,
            offset: -1,
            detail: "an output record does not parse".into(),
        });
    }
    for (id, (_, _, variant)) in &expect.first {
        match seen.get(id) {
            None => v.push(Violation::Lost { event_id: id.clone() }),
            Some(copies) => {
                if copies.len() > 1 {
                    v.push(Violation::BilledTwice {
                        event_id: id.clone(),
                        offsets: copies.iter().map(|(p, o, _)| (*p, *o)).collect(),
                    });
                }
                let expected = (variant + 1).to_string();
                if let Some((_, _, found)) = copies.iter().find(|(_, _, q)| *q != expected) {
                    v.push(Violation::NotFirstPayload { event_id: id.clone(), expected, found: found.clone() });
                }
            }
        }
    }
    // Side topics: exact in exactly-once mode; at least once otherwise (a
    // replay after a crash may report a conflict or reject again).
    for (topic, want) in [(CONFLICTS, &expect.conflicts), (REJECTED, &expect.rejected)] {
        let mut want = want.clone();
        want.sort_unstable();
        let got = side_positions(&w.net, topic);
        let ok = match w.config.delivery {
            DeliveryMode::ExactlyOnce => got == want,
            DeliveryMode::AtLeastOnce => {
                let mut dedup = got.clone();
                dedup.dedup();
                dedup == want
            }
        };
        if !ok {
            v.push(Violation::SideTopic { topic, detail: format!("expected sources {want:?}, found {got:?}") });
        }
    }
    if w.faults.rollups.published() {
        if let Err(detail) = rollups_topic(w, &Default::default()) {
            v.push(Violation::RollupsDiffer { detail });
        }
    }
    v
}

/// The rollups topic against the output, as `dedupd usage verify` checks
/// them: the latest record of each key (what compaction keeps) must be the
/// output's events refolded, partition by partition in offset order, with
/// dedupd's default lateness, and every late event must have its
/// adjustment. Exactly once, each adjustment is published once: the
/// records of an aborted transaction are never read, and nothing is
/// published again. The output records at `left_out` are not folded (an
/// at-least-once zombie's, see `World::excuse_zombie_publishes`). Ok: what
/// was compared.
pub fn rollups_topic(w: &World, left_out: &std::collections::BTreeSet<(i32, i64)>) -> Result<TopicCheck, String> {
    let mut events = OutputEvents::new();
    for (p, o, e) in output_events(&w.net, OUTPUT) {
        if !left_out.contains(&(p, o)) {
            events.entry(p).or_default().push((o, e.event));
        }
    }
    let mut latest: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut adjustment_copies: BTreeMap<Vec<u8>, usize> = BTreeMap::new();
    for (p, o, r) in output_records(&w.net, ROLLUPS) {
        let (Some(key), Some(value)) = (r.key, r.value) else {
            return Err(format!("record {p}@{o} has no key or no value"));
        };
        if key.starts_with(b"adjustment") {
            *adjustment_copies.entry(key.clone()).or_default() += 1;
        }
        latest.insert(key, value);
    }
    let topic = RollupsTopic::of_latest(latest.values().map(Vec::as_slice))?;
    let check = compare_topics(&events, topic, &crate::ledger::Lateness::default())?;
    if !check.drift.is_empty() {
        return Err(check.drift.join("; "));
    }
    if w.config.delivery == DeliveryMode::ExactlyOnce {
        let again: Vec<String> = adjustment_copies
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(k, n)| format!("{} ×{n}", String::from_utf8_lossy(k)))
            .collect();
        if !again.is_empty() {
            return Err(format!("adjustments published more than once: {again:?}"));
        }
    }
    Ok(check)
}
