//! Usage ledger benchmarks.
//!
//! - `ingest/*`: local state applying batches of 1,000 accepted events with
//!   the ledger on and off (the target: on ≥ 0.9× off), under both
//!   fsync policies; "on" includes the read-only preview a worker computes
//!   to publish each batch's rollups.
//! - `ingest_paired`: the same work, on and off in one run, batch by batch
//!   in turn (see [`ingest_paired`]); prints both rates and their ratio.
//!   `DEDUPD_BENCH_PAIRED_BATCHES` batches each (default 2,000).
//! - `ledger_alone/rollup_records`: the rollups-topic records of a
//!   batch's previewed hours, built as a worker publishes them (about one
//!   for every five events in the worker bench).
//! - `month_total`: one customer's month answered from a ledger holding
//!   rollups for `DEDUPD_BENCH_LEDGER_EVENTS` events (default 100,000,000:
//!   1,736 customers × 5 meters × 720 hours × 4 partitions, about four
//!   events per rollup), written
//!   directly as rollups (folding 100M events first would take an hour of a
//!   2-core machine and measure nothing more).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dedupd::config::EngineSettings;
use dedupd::event::UsageEvent;
use dedupd::ledger::{GroupBy, LedgerStore, UsageAnswer, UsageQuery, HOUR_MS};
use dedupd::state::{LocalState, StoredEvent};
use dedupd::storage::testutil::sample_event_at;
use dedupd::storage::FsyncPolicy;

const BATCH: usize = 1000;
const NOW: i64 = 1_700_000_000_000;

fn batch(base: u64, offset: i64) -> Vec<StoredEvent> {
    (0..BATCH as u64)
        .map(|i| {
            let mut s = sample_event_at(base + i, 0, offset + i as i64, NOW);
            // A realistic spread: 2,000 customers of one tenant, events of
            // the last hours.
            s.event.tenant_id = "acme".into();
            s.event.customer_id = format!("cus_{}", (base + i) % 2000);
            s.event.timestamp_ms = NOW - ((base + i) % 7200) as i64 * 1000;
            s.key.id_hash = dedupd::event::id_hash(&s.event.tenant_id, &s.event.event_id);
            s
        })
        .collect()
}

/// The fsync policies `ingest` and `ingest_paired` run under.
fn fsync_policies() -> [(&'static str, FsyncPolicy); 2] {
    [("fsync_always", FsyncPolicy::Always), ("fsync_interval_250ms", FsyncPolicy::Interval(Duration::from_millis(250)))]
}

/// Local state in `dir` with partition 0 assigned, the ledger on or off.
fn open_state(dir: &tempfile::TempDir, ledger: bool, fsync: &FsyncPolicy) -> LocalState {
    let settings = EngineSettings { ledger, fsync: fsync.clone(), ..EngineSettings::default() };
    let mut state = LocalState::open(Some(dir.path()), settings, true).expect("open");
    state.assign(0, NOW).expect("assign");
    state
}

/// One batch the way a worker handles it, timed: previewed (its records
/// built, dropped), then applied.
fn previewed_apply(state: &LocalState, ledger: bool, events: &[StoredEvent]) -> Duration {
    let started = Instant::now();
    let accepted: Vec<(&UsageEvent, i64)> = events.iter().map(|e| (&e.event, e.key.output.offset)).collect();
    let preview = state.ledger_preview(0, &accepted, &[]).expect("preview");
    assert_eq!(preview.is_some(), ledger);
    drop(preview);
    state.apply_published(0, events, NOW).expect("apply");
    started.elapsed()
}

/// Whether a benchmark whose setup is long should be skipped: the command
/// line names benchmarks, and `name` is not among them.
fn not_asked_for(name: &str) -> bool {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str()))
}

fn ingest(c: &mut Criterion) {
    let mut group = c.benchmark_group("ingest");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Elements(BATCH as u64));
    for (fsync_name, fsync) in fsync_policies() {
        for ledger in [false, true] {
            let dir = tempfile::tempdir().expect("tempdir");
            let state = open_state(&dir, ledger, &fsync);
            let mut next = 0u64;
            let name = format!("{fsync_name}/ledger_{}", if ledger { "on" } else { "off" });
            group.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let events = batch(next, next as i64);
                        next += BATCH as u64;
                        total += previewed_apply(&state, ledger, &events);
                    }
                    total
                })
            });
            state.close().expect("close");
        }
    }
    group.finish();
}

fn month_total(c: &mut Criterion) {
    // Its setup writes 25M rollups (about three minutes): skipped when the
    // command line names other benchmarks only.
    if not_asked_for("query/one_customer_month_by_meter") {
        return;
    }
    let events: u64 =
        std::env::var("DEDUPD_BENCH_LEDGER_EVENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000_000);
    let (meters, partitions, hours) = (5u64, 4i32, 30 * 24i64);
    // About four events per rollup, as a customer with a few calls an hour.
    let customers = (events / (meters * partitions as u64 * hours as u64 * 4)).clamp(1, 100_000);
    let rollups = customers * meters * partitions as u64 * hours as u64;
    let per_rollup = (events / rollups).max(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = LedgerStore::open(dir.path()).expect("open");
    let start = dedupd::ledger::Period::parse("2026-11").expect("period").start_ms();
    let built = Instant::now();
    // One hour of every counter per write: what a busy partition's batches
    // write, in the order time passes.
    for h in 0..hours {
        if h % 72 == 0 {
            eprintln!("month_total: hour {h} of {hours}, {:.0} s", built.elapsed().as_secs_f64());
        }
        for p in 0..partitions {
            let mut evs: Vec<UsageEvent> = Vec::with_capacity((customers * meters) as usize);
            for cu in 0..customers {
                for m in 0..meters {
                    let mut e = sample_event_at(cu * meters + m, p, 0, NOW).event;
                    e.tenant_id = "acme".into();
                    e.customer_id = format!("cus_{cu:05}");
                    e.meter = format!("meter_{m}");
                    e.kind = dedupd::event::EventKind::Usage;
                    e.quantity = rust_decimal::Decimal::from(per_rollup);
                    e.timestamp_ms = start + h * HOUR_MS + 1;
                    evs.push(e);
                }
            }
            let offset0 = h * (customers * meters) as i64;
            let with_offsets: Vec<(&UsageEvent, i64)> = evs.iter().zip(offset0..).collect();
            store.apply(p, &dedupd::ledger::Lateness::default(), &with_offsets).expect("apply");
        }
    }
    store.flush().expect("flush");
    eprintln!(
        "month_total: {rollups} rollups standing for {} events written in {:.1} s",
        rollups * per_rollup,
        built.elapsed().as_secs_f64()
    );
    let query = UsageQuery {
        tenant_id: "acme".into(),
        customer_id: Some(format!("cus_{:05}", customers / 2)),
        meter: None,
        from_ms: start,
        to_ms: start + hours * HOUR_MS,
        group_by: Some(GroupBy::Meter),
    };
    let mut group = c.benchmark_group("query");
    group.sample_size(20);
    group.bench_function("one_customer_month_by_meter", |b| {
        b.iter(|| {
            let mut rows = Vec::new();
            store.rollups(&query.tenant_id, query.customer_id.as_deref(), |k, _, r| rows.push((k, r))).expect("scan");
            let answer = UsageAnswer::of(&query, rows.iter().map(|(k, r)| (k, r)), Vec::new()).expect("answer");
            let counts: BTreeMap<&String, u64> = answer.rows.iter().map(|(g, r)| (g, r.count)).collect();
            assert_eq!(counts.len(), meters as usize);
            answer
        })
    });
    group.finish();
}

/// The ledger alone, on the batches of `ingest`: preview, apply, and the
/// write behind as local state makes it (when due). Its time per event is
/// what the ledger adds to `ingest`.
fn ledger_alone(c: &mut Criterion) {
    let mut group = c.benchmark_group("ledger_alone");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Elements(BATCH as u64));
    let dir = tempfile::tempdir().expect("tempdir");
    let store = LedgerStore::open(dir.path()).expect("open");
    let lateness = dedupd::ledger::Lateness::default();
    let mut next = 0u64;
    group.bench_function("preview_apply_write", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let events = batch(next, next as i64);
                next += BATCH as u64;
                let started = Instant::now();
                let unknown: Vec<(&UsageEvent, i64)> = events.iter().map(|e| (&e.event, -1)).collect();
                drop(store.preview(0, &lateness, &unknown, &[]).expect("preview"));
                let accepted: Vec<(&UsageEvent, i64)> =
                    events.iter().map(|e| (&e.event, e.key.output.offset)).collect();
                store.apply(0, &lateness, &accepted).expect("apply");
                if store.write_due() {
                    store.write_pending().expect("write");
                }
                total += started.elapsed();
            }
            total
        })
    });
    // The records a worker publishes for one batch's rollups: the hours a
    // batch of the shape above touches, each with its folded total.
    let events = batch(next, next as i64);
    let unknown: Vec<(&UsageEvent, i64)> = events.iter().map(|e| (&e.event, -1)).collect();
    let preview = store.preview(1, &lateness, &unknown, &[]).expect("preview");
    group.throughput(Throughput::Elements(preview.rollups.len() as u64));
    group.bench_function("rollup_records", |b| {
        b.iter(|| {
            let records: Vec<_> =
                preview.rollups().map(|(k, r)| dedupd::kafka::records::rollup_record(k, r, 1, 4, NOW)).collect();
            criterion::black_box(records)
        })
    });
    group.finish();
}

/// `ingest` with the ledger on and off in one run: two state directories,
/// each batch applied to both, the order alternating. Two separate runs
/// of `ingest` differ by ±10% on this machine (the disk's fsync times, the
/// usage store's flushes and the key store's compactions land on one run
/// and not the other), far more than the ledger's share; side by side,
/// whatever slows the disk or the CPU for a while slows both. Prints each
/// side's events per second and the ratio; not a criterion measurement.
fn ingest_paired(_: &mut Criterion) {
    if not_asked_for("ingest_paired") {
        return;
    }
    let batches: u64 = std::env::var("DEDUPD_BENCH_PAIRED_BATCHES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    for (fsync_name, fsync) in fsync_policies() {
        let (dir_on, dir_off) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
        let (on, off) = (open_state(&dir_on, true, &fsync), open_state(&dir_off, false, &fsync));
        let (mut on_time, mut off_time) = (Duration::ZERO, Duration::ZERO);
        for k in 0..batches {
            let events = batch(k * BATCH as u64, (k * BATCH as u64) as i64);
            if k % 2 == 0 {
                on_time += previewed_apply(&on, true, &events);
                off_time += previewed_apply(&off, false, &events);
            } else {
                off_time += previewed_apply(&off, false, &events);
                on_time += previewed_apply(&on, true, &events);
            }
        }
        on.close().expect("close");
        off.close().expect("close");
        let events = (batches * BATCH as u64) as f64;
        let (on_rate, off_rate) = (events / on_time.as_secs_f64(), events / off_time.as_secs_f64());
        eprintln!(
            "ingest_paired/{fsync_name}: {batches} batches of {BATCH}: ledger on {on_rate:.0} events/s, \
             off {off_rate:.0} events/s, on/off {:.3}",
            on_rate / off_rate
        );
    }
}

criterion_group!(benches, ingest, ingest_paired, ledger_alone, month_total);
criterion_main!(benches);
