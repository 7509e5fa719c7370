//! The ledger against a reference model, through local state on a real
//! state directory: any interleaving of batches, replays, late events,
//! corrections, restarts and repairs answers every query like the model.

use std::collections::BTreeMap;

use proptest::prelude::*;
use rust_decimal::Decimal;

use super::{GroupBy, Lateness, UsageAnswer, UsageQuery, HOUR_MS};
use crate::config::EngineSettings;
use crate::event::{id_hash, payload_hash, EventKind, UsageEvent};
use crate::state::{LocalState, StoredEvent};
use crate::storage::testutil::sample_event_at;

const NOW: i64 = 1_700_000_000_000;
const PARTITIONS: i32 = 2;
const LATENESS_MS: i64 = 6 * HOUR_MS;

#[derive(Clone, Debug)]
enum Step {
    /// A batch of new accepted events on a partition: (customer, meter, hours back, quantity, correction).
    Batch(i32, Vec<(u8, u8, i64, i64, bool)>),
    /// The last published batch of a partition applied again (repair overlap).
    Replay(i32),
    /// Close and reopen the state directory.
    Restart,
    /// Drop the state without closing it (a process crash: nothing applied
    /// may be lost), reopen, repair.
    Crash,
    /// Lose the ledger (a replaced disk) and rebuild it from the output.
    Repair,
}

fn step() -> impl Strategy<Value = Step> {
    let event = (0u8..3, 0u8..2, 0i64..30, -5i64..50, any::<bool>());
    prop_oneof![
        6 => (0..PARTITIONS, prop::collection::vec(event, 1..12)).prop_map(|(p, e)| Step::Batch(p, e)),
        1 => (0..PARTITIONS).prop_map(Step::Replay),
        1 => Just(Step::Restart),
        1 => Just(Step::Crash),
        1 => Just(Step::Repair),
    ]
}

/// A customer's expected row: sum, usage count, largest usage.
type Row = (Decimal, u64, Option<Decimal>);

/// The model: the accepted events of each partition in output order. An
/// event is late when it is more than L behind the latest on-time event of
/// its counter before it in its partition; late events are adjustments,
/// everything else adds to its hour.
struct Model {
    output: BTreeMap<i32, Vec<StoredEvent>>,
}

impl Model {
    fn on_time_and_late(&self) -> (Vec<&UsageEvent>, Vec<&UsageEvent>) {
        let (mut on_time, mut late) = (Vec::new(), Vec::new());
        for events in self.output.values() {
            let mut latest: BTreeMap<(&str, &str), i64> = BTreeMap::new();
            for e in events.iter().map(|s| &s.event) {
                let counter = (e.customer_id.as_str(), e.meter.as_str());
                match latest.get(&counter) {
                    Some(w) if e.timestamp_ms < w - LATENESS_MS => late.push(e),
                    w => {
                        let w = w.copied().unwrap_or(i64::MIN).max(e.timestamp_ms);
                        latest.insert(counter, w);
                        on_time.push(e);
                    }
                }
            }
        }
        (on_time, late)
    }

    /// Per customer: (sum, usage count, largest usage), and the late ids.
    fn expect(&self) -> (BTreeMap<String, Row>, Vec<String>) {
        let (on_time, late) = self.on_time_and_late();
        let mut rows: BTreeMap<String, Row> = BTreeMap::new();
        for e in on_time {
            let row = rows.entry(e.customer_id.clone()).or_insert((Decimal::ZERO, 0, None));
            row.0 += e.quantity;
            if e.kind == EventKind::Usage {
                row.1 += 1;
                row.2 = Some(row.2.map_or(e.quantity, |m| m.max(e.quantity)));
            }
        }
        let mut late: Vec<String> = late.into_iter().map(|e| e.event_id.clone()).collect();
        late.sort();
        (rows, late)
    }
}

fn settings() -> EngineSettings {
    EngineSettings {
        lateness: Lateness { default_ms: LATENESS_MS, per_meter: BTreeMap::new() },
        ..EngineSettings::default()
    }
}

fn open(dir: &std::path::Path) -> LocalState {
    let mut state = LocalState::open(Some(dir), settings(), true).expect("open");
    for p in 0..PARTITIONS {
        state.assign(p, NOW).expect("assign");
    }
    state
}

/// Repair as the worker does it: every output record after the checkpoint.
fn repair(state: &mut LocalState, model: &Model) {
    for (p, events) in &model.output {
        let from = state.checkpoint(*p);
        let missing: Vec<StoredEvent> =
            events.iter().filter(|e| from.is_none_or(|c| e.key.output.offset > c)).cloned().collect();
        state.apply_published(*p, &missing, NOW).expect("repair");
    }
}

fn query(dir: &std::path::Path) -> UsageAnswer {
    let q = UsageQuery {
        tenant_id: "acme".into(),
        customer_id: None,
        meter: None,
        from_ms: NOW - 40 * HOUR_MS,
        to_ms: NOW + HOUR_MS,
        group_by: Some(GroupBy::Customer),
    };
    crate::state::usage(dir, &q).expect("query")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn queried_totals_and_adjustments_equal_the_model(steps in prop::collection::vec(step(), 1..25)) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut model = Model { output: BTreeMap::new() };
        let mut state = open(dir.path());
        let mut n = 0u64;
        let mut last_batch: BTreeMap<i32, Vec<StoredEvent>> = BTreeMap::new();
        for step in steps {
            match step {
                Step::Batch(p, events) => {
                    let log = model.output.entry(p).or_default();
                    let mut batch = Vec::new();
                    for (customer, meter, hours_back, qty, correction) in events {
                        n += 1;
                        let offset = log.len() as i64;
                        let mut s = sample_event_at(n, p, offset, NOW);
                        let e = &mut s.event;
                        e.tenant_id = "acme".into();
                        e.customer_id = format!("cus_{customer}");
                        e.meter = format!("m{meter}");
                        e.timestamp_ms = NOW - hours_back * HOUR_MS - (n as i64 % 1000);
                        e.kind = if correction && qty < 0 { EventKind::Correction } else { EventKind::Usage };
                        e.quantity = Decimal::from(if e.kind == EventKind::Usage { qty.abs() } else { qty });
                        s.key.id_hash = id_hash(&e.tenant_id, &e.event_id);
                        s.key.payload_hash = payload_hash(e);
                        log.push(s.clone());
                        batch.push(s);
                    }
                    state.apply_published(p, &batch, NOW).expect("apply");
                    last_batch.insert(p, batch);
                }
                Step::Replay(p) => {
                    if let Some(batch) = last_batch.get(&p) {
                        state.apply_published(p, batch, NOW).expect("replay");
                    }
                }
                Step::Restart => {
                    state.close().expect("close");
                    state = open(dir.path());
                    repair(&mut state, &model);
                }
                Step::Crash => {
                    drop(state);
                    state = open(dir.path());
                    repair(&mut state, &model);
                }
                Step::Repair => {
                    state.close().expect("close");
                    std::fs::remove_dir_all(dir.path().join("ledger")).expect("lose the ledger");
                    state = open(dir.path());
                    prop_assert_eq!(state.checkpoint(0), None, "a lost ledger sends repair back to the start");
                    repair(&mut state, &model);
                }
            }
        }
        state.close().expect("close");
        let answer = query(dir.path());
        let (rows, late) = model.expect();
        let got: BTreeMap<String, Row> =
            answer.rows.iter().map(|(k, r)| (k.clone(), (r.sum, r.count, r.max))).collect();
        prop_assert_eq!(got, rows);
        let mut got_late: Vec<String> = answer.adjustments.iter().map(|a| a.event_id.clone()).collect();
        got_late.sort();
        prop_assert_eq!(got_late, late);
    }
}
