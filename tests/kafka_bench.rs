//! `scripts/bench`: end-to-end throughput and latency of the worker through
//! a local Tansu broker, beside a plain consume→produce passthrough built
//! from the same client configurations, on the same broker, in the same run.
//!
//! Ignored by default (it measures, it does not check); `scripts/bench` runs
//! it with `--ignored --nocapture`. Two phases per pipeline, on fresh topics:
//!
//! - throughput: `BENCH_EVENTS` events are appended first, then the pipeline
//!   starts; events/s = events / (time until the last output record is read);
//! - latency: events appended at `BENCH_RATE`/s for `BENCH_SECONDS`; latency
//!   = time an output record is read − the wall time its input was appended
//!   (carried in the event's `timestamp`).
//!
//! Beside the throughput phase's rates, the CPU seconds this process (the
//! pipeline and the output's reader) and the broker used over it.
//!
//! Both pipelines use at-least-once delivery (Tansu has no EndTxn).

mod kafka_common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupd::config::EngineSettings;
use dedupd::kafka::clients::{input_consumer_config, producer_config};
use dedupd::kafka::demo::{produce_traffic, TrafficRecord};
use dedupd::kafka::router::{route, RouteSettings};
use dedupd::kafka::{run, DeliveryMode, RunSettings};
use futures::StreamExt;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};

use kafka_common::tansu::Tansu;
use kafka_common::*;

/// The worker runs in this process: allocate as the `dedupd` binary does
/// (see `src/main.rs`), or the figures measure glibc's malloc, which took
/// about a quarter of this process's CPU, not what ships.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const PARTITIONS: i32 = 4;

fn env_or(k: &str, default: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

fn events(n: usize, first: usize, stamp_ms: Option<i64>) -> Vec<TrafficRecord> {
    (first..first + n).map(|i| event("bench", &format!("b{i:09}"), "1.5", stamp_ms.unwrap_or_else(now_ms))).collect()
}

/// Events of the shape `scripts/bench ledger` ingests offline: 2,000
/// customers x 3 meters, event times spread over the two hours before
/// `now_ms`, so a batch touches about a thousand counter-hours (the seven
/// customers of [`event`] would touch seven and flatter the ledger).
fn ledger_shaped_events(n: usize, now_ms: i64) -> Vec<TrafficRecord> {
    const METERS: [&str; 3] = ["api_calls", "storage_gb", "egress_bytes"];
    (0..n)
        .map(|i| {
            let id = format!("evt_{i:08}");
            let value = format!(
                r#"{{"event_id":"{id}","tenant_id":"acme","customer_id":"cus_{}","meter":"{}","quantity":"{}","timestamp":{}}}"#,
                i % 2000,
                METERS[i % 3],
                i % 1000,
                now_ms - (i % 7200) as i64 * 1000
            );
            let mut key = b"acme\0".to_vec();
            key.extend_from_slice(id.as_bytes());
            TrafficRecord { key: Some(key), value: Some(value.into_bytes()) }
        })
        .collect()
}

/// Reads the output topic, recording (read time − event timestamp) per record,
/// until `expected` records were read.
/// Returns the latencies and when the first and the last record were read.
async fn read_output(settings: &RunSettings, expected: usize) -> (Vec<i64>, Instant, Instant) {
    let mut s = settings.clone();
    s.group = format!("{}-reader", settings.group);
    let mut cfg = input_consumer_config(&s);
    cfg.set("isolation.level", "read_uncommitted");
    let c: StreamConsumer = cfg.create().expect("reader");
    c.subscribe(&[&settings.topics.output]).expect("subscribe");
    let mut lat = Vec::with_capacity(expected);
    let mut stream = c.stream();
    let mut first = None;
    let mut last = Instant::now();
    while lat.len() < expected {
        let Some(Ok(m)) = stream.next().await else { continue };
        let read_at = now_ms();
        last = Instant::now();
        first.get_or_insert(last);
        let ts = m
            .payload()
            .and_then(|p| serde_json::from_slice::<serde_json::Value>(p).ok())
            .and_then(|v| {
                v["timestamp"].as_str().map(str::to_owned).or_else(|| v["timestamp"].as_i64().map(|n| n.to_string()))
            })
            .and_then(|t| {
                t.parse::<i64>().ok().or_else(|| {
                    time::OffsetDateTime::parse(&t, &time::format_description::well_known::Rfc3339)
                        .ok()
                        .map(|d| (d.unix_timestamp_nanos() / 1_000_000) as i64)
                })
            });
        lat.push(ts.map_or(0, |t| read_at - t));
    }
    (lat, first.unwrap_or(last), last)
}

/// Which pipeline a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pipeline {
    /// Consume, produce each value unchanged, commit after the acks.
    Passthrough,
    /// The same, with five headers of the sizes dedupd's output carries (no
    /// hashing, no state): what the broker charges for dedupd's record shape.
    PassthroughWithHeaders,
    Dedupd,
    /// The worker with the usage ledger off (`--ledger false`).
    DedupdLedgerOff,
    /// The worker publishing the ledger's rollups (`--rollups-topic`): each
    /// batch previewed, its changed rollups published with its events.
    DedupdRollups,
    /// `dedupd route`: identity read, key and partition by identity, the
    /// value and headers unchanged (raw = this run's input topic).
    Router,
}

/// The passthrough: consume input, produce each record's value unchanged to
/// output partition = input partition, commit after acks. Same client
/// configurations as the worker.
async fn passthrough(settings: RunSettings, stop: Arc<AtomicBool>, with_headers: bool) {
    let c: StreamConsumer = input_consumer_config(&settings).create().expect("consumer");
    c.subscribe(&[&settings.topics.input]).expect("subscribe");
    let p: FutureProducer = producer_config(&settings, None).create().expect("producer");
    let mut pending = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let m = match tokio::time::timeout(Duration::from_millis(20), c.recv()).await {
            Ok(Ok(m)) => m,
            _ => {
                for f in pending.drain(..) {
                    let _ = f.await;
                }
                let _ = c.commit_consumer_state(rdkafka::consumer::CommitMode::Async);
                continue;
            }
        };
        let mut r: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&settings.topics.output).partition(m.partition());
        if let Some(k) = m.key() {
            r = r.key(k);
        }
        if let Some(v) = m.payload() {
            r = r.payload(v);
        }
        let meta = with_headers.then(|| (m.partition().to_string(), m.offset().to_string(), now_ms().to_string()));
        if let Some((partition, offset, ingest)) = &meta {
            const HASH: &str = "00000000000000000000000000000000";
            r = r.headers(
                rdkafka::message::OwnedHeaders::new()
                    .insert(rdkafka::message::Header { key: "dedupd.source.partition", value: Some(partition) })
                    .insert(rdkafka::message::Header { key: "dedupd.source.offset", value: Some(offset) })
                    .insert(rdkafka::message::Header { key: "dedupd.ingest.ms", value: Some(ingest) })
                    .insert(rdkafka::message::Header { key: "dedupd.id.hash", value: Some(HASH) })
                    .insert(rdkafka::message::Header { key: "dedupd.payload.hash", value: Some(HASH) }),
            );
        }
        if let Ok(f) = p.send_result(r) {
            pending.push(f);
        }
        let _ = c.store_offset_from_message(&m);
        if pending.len() >= settings.batch.max_records {
            for f in pending.drain(..) {
                let _ = f.await;
            }
            let _ = c.commit_consumer_state(rdkafka::consumer::CommitMode::Async);
        }
    }
}

fn percentile(sorted: &[i64], q: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[derive(Debug, Clone, Copy)]
struct Figures {
    /// From the pipeline's start (group join, repair) to the last output.
    events_per_s: f64,
    /// From the first output record to the last: the steady rate.
    steady_per_s: f64,
    p50_ms: i64,
    p99_ms: i64,
    /// Dedupd only: a second worker with an empty state directory, started
    /// on the throughput phase's topics: output records applied per second
    /// by repair, from its start (group join included) to the last one.
    repair_per_s: f64,
    /// CPU seconds (user + system) over the throughput phase, from the
    /// pipeline's start to the last output record read: this process (the
    /// pipeline and the output's reader) and the broker's. Both share the
    /// machine's cores, so a slower pipeline may be short of CPU or of
    /// something else; these tell which, and whose.
    process_cpu_s: f64,
    broker_cpu_s: f64,
}

/// CPU seconds (user + system) the process `pid` has used so far, from
/// `/proc/<pid>/stat`; 0 where it cannot be read.
fn cpu_seconds(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after it.
    // SAFETY: sysconf reads a constant of the system; it has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / per_second
}

async fn measure(broker: &Tansu, name: &str, pipeline: Pipeline) -> Figures {
    // As `dedupd` does at start: the pipelines run in this process.
    // `BENCH_KEEP_THP=1` measures with the system's setting instead.
    if std::env::var_os("BENCH_KEEP_THP").is_none() {
        dedupd::process::disable_transparent_huge_pages();
    }
    let n = env_or("BENCH_EVENTS", 200_000) as usize;
    let rate = env_or("BENCH_RATE", 2_000);
    let secs = env_or("BENCH_SECONDS", 10);
    let mut figures = Figures {
        events_per_s: 0.0,
        steady_per_s: 0.0,
        p50_ms: 0,
        p99_ms: 0,
        repair_per_s: 0.0,
        process_cpu_s: 0.0,
        broker_cpu_s: 0.0,
    };
    let broker_pid = broker.pid().to_string();
    for phase in ["throughput", "latency"] {
        let mut topics = topics(&format!("bench-{name}-{phase}"));
        if pipeline == Pipeline::DedupdRollups {
            let rollups = format!("bench-{name}-{phase}-rollups");
            broker.create_topic(&rollups, PARTITIONS);
            topics.rollups = Some(rollups);
        }
        for (t, p) in
            [(&topics.input, PARTITIONS), (&topics.output, PARTITIONS), (&topics.conflicts, 1), (&topics.rejected, 1)]
        {
            broker.create_topic(t, p);
        }
        let mut settings =
            settings(&broker.brokers, &format!("bench-{name}-{phase}"), &topics, DeliveryMode::AtLeastOnce);
        settings.batch.max_records = 2000;
        settings.batch.max_wait = Duration::from_millis(5);
        if let Ok(ms) = std::env::var("BENCH_ROLLUPS_INTERVAL_MS") {
            settings.rollups_interval =
                Duration::from_millis(ms.parse().expect("BENCH_ROLLUPS_INTERVAL_MS: milliseconds"));
        }
        let producer = traffic_producer(&broker.brokers);
        let expected = if phase == "throughput" { n } else { (rate * secs) as usize };
        if phase == "throughput" {
            let backlog = match pipeline {
                Pipeline::DedupdLedgerOff | Pipeline::DedupdRollups => ledger_shaped_events(n, now_ms()),
                _ => events(n, 0, Some(now_ms())),
            };
            produce_traffic(&producer, &topics.input, PARTITIONS, &backlog).await.expect("produce");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let reader = {
            let s = settings.clone();
            tokio::spawn(async move { read_output(&s, expected).await })
        };
        let started = Instant::now();
        let cpu_at_start = (cpu_seconds("self"), cpu_seconds(&broker_pid));
        // The worker persists for real (usage store with fsync, key store),
        // as `dedupd run --state-dir` does.
        let state = tempfile::tempdir().expect("state dir");
        let mut metrics = None;
        let run_settings = settings.clone();
        let settings_for_commits = settings.clone();
        let task = match pipeline {
            Pipeline::Dedupd | Pipeline::DedupdLedgerOff | Pipeline::DedupdRollups => {
                let ledger = pipeline != Pipeline::DedupdLedgerOff;
                let (parts, m) = parts_with(state.path(), EngineSettings { ledger, ..EngineSettings::default() });
                metrics = Some(m);
                tokio::spawn(async move {
                    let _ = run(settings, parts, async move {
                        let _ = stop_rx.await;
                    })
                    .await;
                })
            }
            Pipeline::Router => {
                let m = Arc::new(dedupd::metrics::Metrics::new());
                tokio::spawn(async move {
                    let routed = route(RouteSettings { run: settings }, validator(), m, async move {
                        let _ = stop_rx.await;
                    })
                    .await;
                    routed.expect("router");
                })
            }
            _ => {
                let s = stop.clone();
                tokio::spawn(passthrough(settings, s, pipeline == Pipeline::PassthroughWithHeaders))
            }
        };
        if phase == "latency" {
            let per_tick = (rate / 100).max(1) as usize;
            let mut next = 0usize;
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while next < expected {
                tick.tick().await;
                let k = per_tick.min(expected - next);
                produce_traffic(&producer, &topics.input, PARTITIONS, &events(k, next, None)).await.expect("produce");
                next += k;
            }
        }
        let (mut lat, first, mut last) =
            tokio::time::timeout(Duration::from_secs(600), reader).await.expect("reader timed out").expect("reader");
        if phase == "throughput" && matches!(pipeline, Pipeline::DedupdLedgerOff | Pipeline::DedupdRollups) {
            // The ledger's bench counts an event ingested once its input
            // offset is committed: with rollups held back, that is once
            // they are published too, so their last publish is inside the
            // measured time and CPU, not after it.
            last = input_committed(&settings_for_commits, n as i64).await;
        }
        let cpu = (cpu_seconds("self") - cpu_at_start.0, cpu_seconds(&broker_pid) - cpu_at_start.1);
        stop.store(true, Ordering::Relaxed);
        let _ = stop_tx.send(());
        let _ = task.await;
        lat.sort_unstable();
        if let Some(m) = metrics {
            // Where the worker's time went, per pipeline stage (summed over
            // partitions, which run concurrently).
            let page = m.encode();
            let stages: Vec<&str> =
                page.lines().filter(|l| l.starts_with("dedupd_batch_duration_seconds_sum")).collect();
            eprintln!("{name} {phase}: {}", stages.join("; "));
        }
        if phase == "throughput" {
            figures.events_per_s = n as f64 / last.duration_since(started).as_secs_f64();
            figures.steady_per_s = (n - 1) as f64 / last.duration_since(first).as_secs_f64().max(1e-3);
            (figures.process_cpu_s, figures.broker_cpu_s) = cpu;
            if pipeline == Pipeline::Dedupd && broker.seeks() {
                figures.repair_per_s = measure_repair(run_settings, n as u64).await;
            }
            if pipeline == Pipeline::DedupdRollups {
                // What was measured did publish the ledger: its rollups sum
                // to the accepted events, hour by hour.
                let (brokers, topics) = (broker.brokers.clone(), topics.clone());
                let (rollups, output) = tokio::task::spawn_blocking(move || {
                    let rollups = read_topic(&brokers, topics.rollups.as_deref().expect("a rollups topic"));
                    (rollups, read_topic(&brokers, &topics.output))
                })
                .await
                .expect("read the rollups and output topics");
                eprintln!("{name}: {} rollup records beside {} output records", rollups.len(), output.len());
                let (totals, _) = rollup_totals(&rollups);
                assert!(!totals.is_empty(), "{name}: no rollups published");
                assert_eq!(totals, output_totals(&output), "{name}: rollups against the output's events");
            }
        } else {
            figures.p50_ms = percentile(&lat, 0.50);
            figures.p99_ms = percentile(&lat, 0.99);
        }
    }
    figures
}

/// When the worker's group had committed `records` input offsets in all,
/// polled every 10 ms through one consumer (a new client per poll would
/// cost the measured process its own threads).
async fn input_committed(settings: &RunSettings, records: i64) -> Instant {
    let (brokers, group, topic) = (settings.brokers.clone(), settings.group.clone(), settings.topics.input.clone());
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::BaseConsumer;
        use rdkafka::{ClientConfig, Offset, TopicPartitionList};
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition(&topic, p);
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let committed: i64 = c
                .committed_offsets(tpl.clone(), Duration::from_secs(10))
                .map(|got| {
                    got.elements()
                        .iter()
                        .map(|e| match e.offset() {
                            Offset::Offset(o) => o,
                            _ => 0,
                        })
                        .sum()
                })
                .unwrap_or(0);
            if committed >= records {
                return Instant::now();
            }
            assert!(Instant::now() < deadline, "the worker committed {committed} of {records} input offsets");
            std::thread::sleep(Duration::from_millis(10));
        }
    })
    .await
    .expect("commit poller")
}

/// Starts a worker with an empty state directory on topics whose output
/// holds `records` records, and times its repair until every record is
/// applied: records per second, group join included.
async fn measure_repair(settings: RunSettings, records: u64) -> f64 {
    let state = tempfile::tempdir().expect("state dir");
    let (parts, m) = parts_in(state.path());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let task = tokio::spawn(run(settings, parts, async move {
        let _ = stop_rx.await;
    }));
    let done = wait_until(Duration::from_secs(600), || m.repair_records() >= records).await;
    let took = started.elapsed();
    let _ = stop_tx.send(());
    let _ = task.await;
    assert!(done, "repair applied {} of {records} records", m.repair_records());
    eprintln!("repair: {records} records in {took:?}");
    records as f64 / took.as_secs_f64()
}

fn print_table(rows: &[(&str, Figures)]) {
    println!("pipeline      events/s (with start)   events/s (steady)   p50 ms   p99 ms   CPU-s: process   broker");
    for (name, f) in rows {
        println!(
            "{name:<12} {:>21.0} {:>19.0} {:>8} {:>8} {:>16.2} {:>8.2}",
            f.events_per_s, f.steady_per_s, f.p50_ms, f.p99_ms, f.process_cpu_s, f.broker_cpu_s
        );
    }
}

/// `scripts/bench router`: the router beside the plain passthrough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by scripts/bench router"]
async fn bench_router_against_passthrough_on_tansu() {
    let broker = Tansu::start();
    let pass = measure(&broker, "passthrough", Pipeline::Passthrough).await;
    let router = measure(&broker, "router", Pipeline::Router).await;
    print_table(&[("passthrough", pass), ("router", router)]);
    println!(
        "ratio router / passthrough: {:.2} with start, {:.2} steady",
        router.events_per_s / pass.events_per_s.max(1.0),
        router.steady_per_s / pass.steady_per_s.max(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by scripts/bench"]
async fn bench_worker_against_passthrough_on_tansu() {
    let broker = Tansu::start();
    let pass = measure(&broker, "passthrough", Pipeline::Passthrough).await;
    let headers = measure(&broker, "headers", Pipeline::PassthroughWithHeaders).await;
    let dedupd = measure(&broker, "dedupd", Pipeline::Dedupd).await;
    print_table(&[("passthrough", pass), ("+ headers", headers), ("dedupd", dedupd)]);
    if broker.seeks() {
        println!("repair from the output topic, empty state directory: {:.0} records/s", dedupd.repair_per_s);
    } else {
        println!("repair from the output topic: not measured, this broker's storage engine cannot seek (DESIGN §11)");
    }
    println!(
        "ratio dedupd / passthrough: {:.2} with start, {:.2} steady",
        dedupd.events_per_s / pass.events_per_s.max(1.0),
        dedupd.steady_per_s / pass.steady_per_s.max(1.0)
    );
    println!(
        "ratio dedupd / passthrough with dedupd's headers: {:.2} with start, {:.2} steady",
        dedupd.events_per_s / headers.events_per_s.max(1.0),
        dedupd.steady_per_s / headers.steady_per_s.max(1.0)
    );
}

/// `scripts/bench ledger-worker`: the worker with the usage ledger off and
/// with its rollups published (issue #12's ingest with rollups on against
/// off, in the mode billing runs), alternating on one broker, `BENCH_ROUNDS`
/// (default 2) of each. The throughput phase's backlog has the shape of
/// `scripts/bench ledger` ([`ledger_shaped_events`]); a run with rollups
/// checks that they sum to its output before its figures count. Both end
/// when the input offsets are committed to the end, not when the output is
/// read: a worker holding rollups back (`--rollups-interval`) commits only
/// once they are published, so their last publish is measured too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by scripts/bench ledger-worker"]
async fn bench_worker_with_and_without_the_ledger_on_tansu() {
    let broker = Tansu::start();
    let rounds = env_or("BENCH_ROUNDS", 2).max(1);
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        off.push(measure(&broker, &format!("ledger-off-{round}"), Pipeline::DedupdLedgerOff).await);
        on.push(measure(&broker, &format!("rollups-{round}"), Pipeline::DedupdRollups).await);
    }
    let rows: Vec<(&str, Figures)> =
        off.iter().map(|f| ("ledger off", *f)).chain(on.iter().map(|f| ("rollups", *f))).collect();
    print_table(&rows);
    println!(
        "ratio rollups / ledger off, medians of {rounds} rounds: {:.3} with start, {:.3} steady",
        median_of(&on, |f| f.events_per_s) / median_of(&off, |f| f.events_per_s).max(1.0),
        median_of(&on, |f| f.steady_per_s) / median_of(&off, |f| f.steady_per_s).max(1.0)
    );
}

/// The median of one figure over runs.
fn median_of(runs: &[Figures], figure: fn(&Figures) -> f64) -> f64 {
    let mut x: Vec<f64> = runs.iter().map(figure).collect();
    x.sort_by(f64::total_cmp);
    let n = x.len();
    if n % 2 == 1 {
        x[n / 2]
    } else {
        (x[n / 2 - 1] + x[n / 2]) / 2.0
    }
}
