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
    /// A batch of new accepted events on a partition: (customer, meter, hours back, quantity, correction),
    /// applied as it is, or previewed first as a worker does, or previewed and then abandoned (its
    /// transaction aborted: it is not published and not applied).
    Batch(i32, Vec<(u8, u8, i64, i64, bool)>, Preview),
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

#[derive(Clone, Copy, Debug)]
enum Preview {
    None,
    ThenApply,
    Abandoned,
}

fn step() -> impl Strategy<Value = Step> {
    let event = (0u8..3, 0u8..2, 0i64..30, -5i64..50, any::<bool>());
    let preview = prop_oneof![Just(Preview::None), Just(Preview::ThenApply), Just(Preview::Abandoned)];
    prop_oneof![
        6 => (0..PARTITIONS, prop::collection::vec(event, 1..12), preview)
            .prop_map(|(p, e, preview)| Step::Batch(p, e, preview)),
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
        // Small, so the usage store flushes its memtable within a case and
        // the ledger's writes behind have to keep up with it.
        memtable_events: 16,
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

/// Gives `s` its identity hashes and publishes it: the partition's output
/// log and the batch being applied.
fn publish_into(log: &mut Vec<StoredEvent>, batch: &mut Vec<StoredEvent>, mut s: StoredEvent) {
    s.key.id_hash = id_hash(&s.event.tenant_id, &s.event.event_id);
    s.key.payload_hash = payload_hash(&s.event);
    log.push(s.clone());
    batch.push(s);
}

/// The last published batch of partition `p` applied again (repair overlap).
fn replay(state: &mut LocalState, last_batch: &BTreeMap<i32, Vec<StoredEvent>>, p: i32) {
    if let Some(batch) = last_batch.get(&p) {
        state.apply_published(p, batch, NOW).expect("replay");
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
                Step::Batch(p, events, preview) => {
                    let published = model.output.entry(p).or_default();
                    // An abandoned batch is built like any other but never
                    // reaches the output.
                    let mut aborted = published.clone();
                    let log = if matches!(preview, Preview::Abandoned) { &mut aborted } else { published };
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
                        publish_into(log, &mut batch, s);
                    }
                    if matches!(preview, Preview::None) {
                        state.apply_published(p, &batch, NOW).expect("apply");
                        last_batch.insert(p, batch);
                        continue;
                    }
                    // As a worker previews: before the output offsets are known.
                    let accepted: Vec<(&UsageEvent, i64)> = batch.iter().map(|s| (&s.event, -1)).collect();
                    let previewed = state.ledger_preview(p, &accepted, &[]).expect("preview").expect("ledger on");
                    if matches!(preview, Preview::Abandoned) {
                        continue;
                    }
                    state.apply_published(p, &batch, NOW).expect("apply");
                    last_batch.insert(p, batch);
                    // What the batch published is what the ledger now holds.
                    let mut held = BTreeMap::new();
                    state
                        .ledger()
                        .expect("ledger")
                        .rollups("acme", None, |k, held_p, r| {
                            if held_p == p {
                                held.insert(k, r);
                            }
                        })
                        .expect("rollups");
                    for (k, r) in previewed.rollups() {
                        prop_assert_eq!(held.get(k), Some(r), "previewed rollup of {:?}", k);
                    }
                }
                Step::Replay(p) => replay(&mut state, &last_batch, p),
                Step::Restart => {
                    state.close().expect("close");
                    state = open(dir.path());
                    repair(&mut state, &model);
                }
                Step::Crash => {
                    drop(state);
                    state = open(dir.path());
                    // The ledger writes behind, but a process crash costs no
                    // repair: what it had not written is folded again from
                    // the usage store's memtable at open.
                    for (p, events) in &model.output {
                        let last = events.last().map(|e| e.key.output.offset);
                        prop_assert_eq!(state.checkpoint(*p), last, "partition {} needs repair after a crash", p);
                    }
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

// ---- periods: close, reopen, snapshots and pending ----

/// October and November 2023 around `NOW` (2023-11-14T22:13Z): an event is
/// `hours_back` before the end of the chosen month's slice.
const MONTHS: [i64; 2] = [NOW - 20 * 24 * HOUR_MS, NOW];

#[derive(Clone, Debug)]
enum PeriodStep {
    /// New events through validation (`month`, customer, meter, hours back, quantity, correction).
    Batch(i32, Vec<(usize, u8, u8, i64, i64, bool)>),
    Replay(i32),
    Close(usize),
    Reopen(usize),
    Restart,
    Repair,
}

fn period_step() -> impl Strategy<Value = PeriodStep> {
    let event = (0usize..2, 0u8..3, 0u8..2, 0i64..30, -5i64..50, any::<bool>());
    prop_oneof![
        6 => (0..PARTITIONS, prop::collection::vec(event, 1..10)).prop_map(|(p, e)| PeriodStep::Batch(p, e)),
        1 => (0..PARTITIONS).prop_map(PeriodStep::Replay),
        2 => (0usize..2).prop_map(PeriodStep::Close),
        1 => (0usize..2).prop_map(PeriodStep::Reopen),
        1 => Just(PeriodStep::Restart),
        1 => Just(PeriodStep::Repair),
    ]
}

type CounterTotals = BTreeMap<super::CounterOfTenant, super::CounterTotal>;

impl Model {
    /// What `period` holds now per (customer, meter): its on-time events
    /// and its late ones, with each counter's watermark.
    fn period_totals(&self, period: super::Period) -> CounterTotals {
        let (on_time, late) = self.on_time_and_late();
        let mut watermarks: BTreeMap<(String, String), i64> = BTreeMap::new();
        for e in &on_time {
            let w = watermarks.entry((e.customer_id.clone(), e.meter.clone())).or_insert(e.timestamp_ms);
            *w = (*w).max(e.timestamp_ms);
        }
        let mut totals = CounterTotals::new();
        for e in on_time.into_iter().chain(late).filter(|e| super::Period::of_ms(e.timestamp_ms) == period) {
            let t = totals.entry((e.customer_id.clone(), e.meter.clone())).or_default();
            t.quantity += e.quantity;
            if e.kind == EventKind::Usage {
                t.events += 1;
            } else {
                t.corrections += 1;
            }
        }
        for (c, t) in &mut totals {
            t.watermark_ms = watermarks.get(c).copied();
        }
        totals
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Periods against the model: usage into a closed month is rejected by
    /// validation and corrections are not; a close freezes exactly what the
    /// model holds for the month at that moment, whatever restarts and
    /// repairs come after; reopen discards it; `period show` gives the
    /// snapshot, pending (the month now minus the snapshot) and net (the
    /// month now).
    #[test]
    fn snapshots_pending_and_net_equal_the_model(steps in prop::collection::vec(period_step(), 1..30)) {
        use super::{Period, PeriodAction, PeriodBook, PeriodStatus};
        use crate::event::{to_canonical_json, CorrectionRef, RejectReason};

        let dir = tempfile::tempdir().expect("tempdir");
        let periods = MONTHS.map(Period::of_ms);
        let mut model = Model { output: BTreeMap::new() };
        let mut frozen: BTreeMap<Period, CounterTotals> = BTreeMap::new();
        let validator = settings().validator();
        let mut state = open(dir.path());
        let mut n = 0u64;
        let mut last_batch: BTreeMap<i32, Vec<StoredEvent>> = BTreeMap::new();
        for step in steps {
            match step {
                PeriodStep::Batch(p, events) => {
                    let log = model.output.entry(p).or_default();
                    let mut batch = Vec::new();
                    for (month, customer, meter, hours_back, qty, correction) in events {
                        n += 1;
                        let mut s = sample_event_at(n, p, log.len() as i64, NOW);
                        let e = &mut s.event;
                        e.tenant_id = "acme".into();
                        e.event_id_derived = false;
                        e.customer_id = format!("cus_{customer}");
                        e.meter = format!("m{meter}");
                        e.timestamp_ms = MONTHS[month] - hours_back * HOUR_MS - (n as i64 % 1000);
                        let is_correction = correction && qty < 0;
                        e.kind = if is_correction { EventKind::Correction } else { EventKind::Usage };
                        e.correction_ref = is_correction
                            .then(|| CorrectionRef { original_event_id: "evt_00000001".into(), reason: None });
                        e.quantity = Decimal::from(if is_correction { qty } else { qty.abs() });
                        let closed = frozen.contains_key(&Period::of_ms(e.timestamp_ms));
                        match validator.validate(to_canonical_json(e).as_bytes(), NOW) {
                            Err(r) => {
                                prop_assert_eq!(r.reason, RejectReason::ClosedPeriod, "{}", r);
                                prop_assert!(closed && !is_correction, "rejected into an open month, or a correction");
                                continue;
                            }
                            Ok(_) => prop_assert!(!closed || is_correction, "usage accepted into a closed month"),
                        }
                        publish_into(log, &mut batch, s);
                    }
                    state.apply_published(p, &batch, NOW).expect("apply");
                    last_batch.insert(p, batch);
                }
                PeriodStep::Replay(p) => replay(&mut state, &last_batch, p),
                PeriodStep::Close(m) | PeriodStep::Reopen(m) => {
                    let action = if matches!(step, PeriodStep::Close(_)) { PeriodAction::Close } else { PeriodAction::Reopen };
                    let period = periods[m];
                    let mut book = PeriodBook::load(dir.path()).expect("book");
                    let now = state.ledger().expect("ledger").period_totals("acme", period).expect("totals");
                    match book.act(action, "acme", period, NOW, &now) {
                        Ok((Some(record), _)) => {
                            book.insert(record);
                            book.save(dir.path()).expect("save");
                            if action == PeriodAction::Close {
                                prop_assert_eq!(&now, &model.period_totals(period), "snapshot of {}", period);
                                frozen.insert(period, now);
                            } else {
                                frozen.remove(&period);
                            }
                        }
                        Ok((None, _)) => prop_assert!(false, "close and reopen always change the book"),
                        // Closing a closed month or reopening an open one is
                        // refused and changes nothing.
                        Err(_) => prop_assert_eq!(frozen.contains_key(&period), action == PeriodAction::Close),
                    }
                    validator.closed_periods().replace(book.closed());
                }
                PeriodStep::Restart => {
                    state.close().expect("close");
                    state = open(dir.path());
                    repair(&mut state, &model);
                    validator.closed_periods().replace(PeriodBook::load(dir.path()).expect("book").closed());
                }
                PeriodStep::Repair => {
                    state.close().expect("close");
                    std::fs::remove_dir_all(dir.path().join("ledger")).expect("lose the ledger");
                    state = open(dir.path());
                    repair(&mut state, &model);
                }
            }
        }
        state.close().expect("close");
        for period in periods {
            let report = crate::state::period(dir.path(), PeriodAction::Show, "acme", period, NOW).expect("show");
            let want_status = if frozen.contains_key(&period) { PeriodStatus::Closed } else { PeriodStatus::Open };
            prop_assert_eq!(report.status, want_status);
            let now = model.period_totals(period);
            let snapshot = frozen.get(&period).cloned().unwrap_or_default();
            let zero = super::CounterTotal::default();
            for line in &report.lines {
                let c = (line.customer_id.clone(), line.meter.clone());
                let (cur, snap) = (now.get(&c).unwrap_or(&zero), snapshot.get(&c));
                prop_assert_eq!(line.net, cur.quantity, "net of {:?} in {}", c, period);
                prop_assert_eq!(line.frozen.as_ref(), snap, "frozen of {:?} in {}", c, period);
                let base = snap.map_or(Decimal::ZERO, |s| s.quantity);
                let want_pending = if want_status == PeriodStatus::Closed { cur.quantity - base } else { Decimal::ZERO };
                prop_assert_eq!(line.pending_quantity, want_pending, "pending of {:?} in {}", c, period);
            }
            let listed: usize = report.lines.len();
            let mut want: Vec<_> = now.keys().chain(snapshot.keys()).collect();
            want.sort();
            want.dedup();
            prop_assert_eq!(listed, want.len(), "every counter of {} is listed", period);
        }
    }
}
