//! Helpers shared by the Kafka integration tests: settings, traffic, and
//! reading topics back to check the guarantees of DESIGN §1.
#![allow(dead_code)]

pub mod tansu;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupd::classify::{Clock, SystemClock};
use dedupd::config::EngineSettings;
use dedupd::event::{payload_hash, Validator};
use dedupd::kafka::demo::TrafficRecord;
use dedupd::kafka::records::{H_PAYLOAD_HASH, H_REASON};
use dedupd::kafka::{DeliveryMode, RunSettings, StateEngine, Topics, WorkerParts};
use dedupd::metrics::Metrics;
use dedupd::state::LocalState;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

/// Logs to the test's captured output; `RUST_LOG=dedupd=debug` to see more.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("dedupd=info")),
        )
        .with_test_writer()
        .try_init();
}

pub fn topics(prefix: &str) -> Topics {
    Topics {
        input: format!("{prefix}-in"),
        output: format!("{prefix}-out"),
        conflicts: format!("{prefix}-conflicts"),
        rejected: format!("{prefix}-rejected"),
        rollups: None,
        periods: None,
    }
}

pub fn validator() -> Validator {
    EngineSettings::default().validator()
}

pub fn parts() -> (WorkerParts, Arc<Metrics>) {
    init_tracing();
    let metrics = Arc::new(Metrics::new());
    let parts = WorkerParts {
        validator: validator(),
        // In-memory local state: every (re)start rebuilds from the output topic.
        engine: Box::new(StateEngine::new(LocalState::in_memory(EngineSettings::default(), true), validator())),
        clock: Arc::new(SystemClock),
        metrics: metrics.clone(),
    };
    (parts, metrics)
}

/// Parts over a real state directory (usage store and key store, as
/// `dedupd run --state-dir` opens them): a restart repairs from its
/// checkpoint instead of from the start of the output topic.
pub fn parts_in(state_dir: &std::path::Path) -> (WorkerParts, Arc<Metrics>) {
    parts_with(state_dir, EngineSettings::default())
}

/// [`parts_in`] with engine settings of the caller's (the ledger off, say).
pub fn parts_with(state_dir: &std::path::Path, settings: EngineSettings) -> (WorkerParts, Arc<Metrics>) {
    init_tracing();
    let metrics = Arc::new(Metrics::new());
    let state = LocalState::open_observed(Some(state_dir), settings.clone(), true, metrics.clone())
        .unwrap_or_else(|e| panic!("opening state dir {}: {e}", state_dir.display()));
    let parts = WorkerParts {
        validator: settings.validator(),
        engine: Box::new(StateEngine::new(state, settings.validator())),
        clock: Arc::new(SystemClock),
        metrics: metrics.clone(),
    };
    (parts, metrics)
}

pub fn settings(brokers: &str, group: &str, topics: &Topics, delivery: DeliveryMode) -> RunSettings {
    let mut s = RunSettings::new(brokers, group, topics.clone());
    s.delivery = delivery;
    s.operation_timeout = Duration::from_secs(20);
    s.revoke_timeout = Duration::from_secs(30);
    s.batch.max_records = 500;
    s.batch.max_wait = Duration::from_millis(10);
    s
}

/// One valid event as a producer would send it. Seven customers share the
/// events, so their hourly totals gather many events from many batches.
pub fn event(tenant: &str, id: &str, qty: &str, ts_ms: i64) -> TrafficRecord {
    let customer = id.bytes().map(u64::from).sum::<u64>() % 7;
    let value = format!(
        r#"{{"event_id":"{id}","tenant_id":"{tenant}","customer_id":"cus-{customer}","meter":"api_calls","quantity":"{qty}","timestamp":{ts_ms}}}"#
    );
    let mut key = tenant.as_bytes().to_vec();
    key.push(0);
    key.extend_from_slice(id.as_bytes());
    TrafficRecord { key: Some(key), value: Some(value.into_bytes()) }
}

/// Traffic with a known answer: `n` distinct events, then retries,
/// conflicts and invalid records mixed in at the given rates (per mille).
#[derive(Clone, Debug, Default)]
pub struct Scenario {
    pub records: Vec<TrafficRecord>,
    /// For every valid id, the payload hash of its first delivery.
    pub first_payload: HashMap<Vec<u8>, String>,
    pub conflicts: u64,
    pub invalid: u64,
    pub retries: u64,
}

pub fn scenario(n: usize, retry_per_mille: usize, conflict_per_mille: usize, invalid_per_mille: usize) -> Scenario {
    let now = SystemClock.now_ms();
    let v = validator();
    let mut s = Scenario::default();
    let mut recent: Vec<usize> = Vec::new();
    for i in 0..n {
        let tenant = ["acme", "globex", "initech", "umbrella", "hooli"][i % 5];
        let id = format!("e{i:08}");
        let r = event(tenant, &id, &format!("{}.{}", i % 100, i % 7), now - (i as i64 % 600) * 1000);
        let ev = v.validate(r.value.as_deref().unwrap_or_default(), now).expect("generated events are valid");
        let key = r.key.clone().unwrap_or_default();
        s.first_payload.insert(key, payload_hash(&ev).to_hex());
        s.records.push(r);
        recent.push(s.records.len() - 1);
        // Deterministic spread: a retry/conflict of an event ~some records back.
        if retry_per_mille > 0 && i % (1000 / retry_per_mille) == 3 {
            let back = recent[recent.len().saturating_sub(1 + (i * 7) % 200).min(recent.len() - 1)];
            let again = s.records[back].clone();
            s.records.push(again);
            s.retries += 1;
        }
        if conflict_per_mille > 0 && i % (1000 / conflict_per_mille) == 11 {
            let back = recent[recent.len().saturating_sub(1 + (i * 13) % 300).min(recent.len() - 1)];
            let orig = s.records[back].clone();
            let key = orig.key.clone().unwrap_or_default();
            let text = String::from_utf8(orig.value.unwrap_or_default()).unwrap_or_default();
            // Same id, different quantity.
            let changed = text.replacen("\"quantity\":\"", "\"quantity\":\"1000", 1);
            s.records.push(TrafficRecord { key: Some(key), value: Some(changed.into_bytes()) });
            s.conflicts += 1;
        }
        if invalid_per_mille > 0 && i % (1000 / invalid_per_mille) == 17 {
            let bad: Vec<u8> = match (i / 7) % 4 {
                0 => b"{not json".to_vec(),
                1 => vec![0xff, 0x00, 0xc3],
                2 => format!(r#"{{"event_id":"bad{i}","tenant_id":"acme","meter":"m","quantity":"1","timestamp":{now}}}"#)
                    .into_bytes(),
                _ => format!(r#"{{"event_id":"neg{i}","tenant_id":"acme","customer_id":"c","meter":"m","quantity":"-1","timestamp":{now}}}"#)
                    .into_bytes(),
            };
            s.records.push(TrafficRecord { key: Some(format!("acme\0bad{i}").into_bytes()), value: Some(bad) });
            s.invalid += 1;
        }
    }
    s
}

/// Adds `n` events three days old to the end of `s`, for the first
/// customers of each tenant: behind their counters' watermarks by more than
/// the default lateness (48 h) on whatever partition they land, so the
/// ledger makes them adjustments. Returns their event ids.
pub fn add_late_events(s: &mut Scenario, n: usize) -> Vec<String> {
    let now = SystemClock.now_ms();
    let v = validator();
    let mut ids = Vec::new();
    for i in 0..n {
        let tenant = ["acme", "globex", "initech", "umbrella", "hooli"][i % 5];
        let id = format!("late{i:04}");
        let r = event(tenant, &id, "7.5", now - 3 * 86_400_000);
        let ev = v.validate(r.value.as_deref().unwrap_or_default(), now).expect("a late event is valid");
        s.first_payload.insert(r.key.clone().unwrap_or_default(), payload_hash(&ev).to_hex());
        s.records.push(r);
        ids.push(id);
    }
    ids
}

pub fn traffic_producer(brokers: &str) -> rdkafka::producer::FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("message.max.bytes", "2000000")
        .set("linger.ms", "5")
        .create()
        .expect("traffic producer")
}

fn reader(brokers: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "dedupd-test-reader")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("fetch.wait.max.ms", "5")
        .create()
        .expect("reader consumer")
}

/// A record read back from a topic.
#[derive(Clone, Debug)]
pub struct ReadRecord {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl ReadRecord {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
    }
}

/// Reads every committed record of `topic` (all partitions) to its end.
pub fn read_topic(brokers: &str, topic: &str) -> Vec<ReadRecord> {
    let c = reader(brokers);
    let md = c.fetch_metadata(Some(topic), Duration::from_secs(10)).expect("metadata");
    let parts: Vec<i32> =
        md.topics().iter().find(|t| t.name() == topic).expect("topic").partitions().iter().map(|p| p.id()).collect();
    let mut tpl = TopicPartitionList::new();
    let mut open = std::collections::HashSet::new();
    for p in &parts {
        let (low, high) = c.fetch_watermarks(topic, *p, Duration::from_secs(10)).expect("watermarks");
        if high > low {
            tpl.add_partition_offset(topic, *p, Offset::Beginning).expect("tpl");
            open.insert(*p);
        }
    }
    let mut out = Vec::new();
    if open.is_empty() {
        return out;
    }
    c.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !open.is_empty() {
        assert!(Instant::now() < deadline, "reading {topic} did not reach its end");
        match c.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => out.push(ReadRecord {
                partition: m.partition(),
                offset: m.offset(),
                key: m.key().map(<[u8]>::to_vec),
                value: m.payload().map(<[u8]>::to_vec),
                headers: m
                    .headers()
                    .map(|h| h.iter().map(|x| (x.key.to_owned(), x.value.unwrap_or_default().to_vec())).collect())
                    .unwrap_or_default(),
            }),
            Some(Err(RdError::PartitionEOF(p))) => {
                open.remove(&p);
            }
            Some(Err(e)) => eprintln!("reader: {e}"),
            None => {}
        }
    }
    out
}

/// Committed offsets of `group` on `topic`, per partition (-1 when none).
pub fn committed(brokers: &str, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    try_committed(brokers, group, topic, partitions).expect("committed offsets")
}

/// The group's committed offsets (-1 where none), or `None` when the broker
/// did not answer in time.
pub fn try_committed(brokers: &str, group: &str, topic: &str, partitions: i32) -> Option<Vec<i64>> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let got = c.committed_offsets(tpl, Duration::from_secs(10)).ok()?;
    Some(
        (0..partitions)
            .map(|p| match got.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            })
            .collect(),
    )
}

pub fn high_watermarks(brokers: &str, topic: &str, partitions: i32) -> Vec<i64> {
    try_high_watermarks(brokers, topic, partitions).expect("watermarks")
}

/// High watermarks, or `None` when the broker did not answer in time.
pub fn try_high_watermarks(brokers: &str, topic: &str, partitions: i32) -> Option<Vec<i64>> {
    let c = reader(brokers);
    (0..partitions).map(|p| c.fetch_watermarks(topic, p, Duration::from_secs(10)).ok().map(|w| w.1)).collect()
}

/// Asserts DESIGN §1 on the output topic: every valid id of `s` exactly
/// once, with its first payload, and on the partition its input came from.
pub fn assert_exactly_once(output: &[ReadRecord], s: &Scenario) {
    let mut seen: HashMap<&[u8], usize> = HashMap::new();
    for r in output {
        let key = r.key.as_deref().expect("output records are keyed");
        *seen.entry(key).or_default() += 1;
        let want = s
            .first_payload
            .get(key)
            .unwrap_or_else(|| panic!("unexpected output key {:?}", String::from_utf8_lossy(key)));
        let got = std::str::from_utf8(r.header(H_PAYLOAD_HASH).expect("payload hash header")).expect("hex");
        assert_eq!(got, want, "output of {:?} is not its first payload", String::from_utf8_lossy(key));
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).map(|(k, n)| (String::from_utf8_lossy(k), *n)).collect();
    assert!(twice.is_empty(), "published more than once: {:?}", &twice[..twice.len().min(10)]);
    let missing: Vec<_> = s
        .first_payload
        .keys()
        .filter(|k| !seen.contains_key(k.as_slice()))
        .map(|k| String::from_utf8_lossy(k))
        .collect();
    assert!(
        missing.is_empty(),
        "{} valid ids never published, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
}

/// Counts records with a reason header.
pub fn rejected_count(records: &[ReadRecord]) -> usize {
    records.iter().filter(|r| r.header(H_REASON).is_some()).count()
}

/// Polls `cond` every 50 ms until it holds or `timeout` passes.
pub async fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cond()
}

/// Records with the partition each is produced to.
pub type Placed = Vec<(i32, TrafficRecord)>;

/// Produces every record of `wave` to its partition of `topic`.
pub async fn produce_wave(producer: &rdkafka::producer::FutureProducer, topic: &str, wave: &[(i32, TrafficRecord)]) {
    let placed: Vec<(i32, &TrafficRecord)> = wave.iter().map(|(p, r)| (*p, r)).collect();
    dedupd::kafka::demo::produce_placed(producer, topic, &placed).await.expect("produce");
}

/// `s` as producers that ignore the keying contract would write it to a raw
/// topic of `raw_partitions`: one record in three with a random key placed
/// by murmur2 (the Java client), one with no key on a random partition, one
/// keyed by identity but placed by CRC-32 (librdkafka). Retries of one event
/// therefore land on different raw partitions. Split in two waves: every
/// first delivery, then every later one (retries and conflicts), so the
/// first payload of an id is well defined although the router reads raw
/// partitions in no particular order across each other.
pub fn raw_waves(s: &Scenario, raw_partitions: i32) -> (Placed, Placed) {
    use dedupd::event::{crc32, murmur2};
    let n = raw_partitions as u32;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut seen = std::collections::HashSet::new();
    let (mut first, mut later) = (Vec::new(), Vec::new());
    for (i, r) in s.records.iter().enumerate() {
        let identity = r.key.clone().unwrap_or_default();
        let placed = match i % 3 {
            0 => {
                let key = next().to_le_bytes().to_vec();
                ((murmur2(&key) & 0x7fff_ffff) % n, TrafficRecord { key: Some(key), value: r.value.clone() })
            }
            1 => ((next() % u64::from(n)) as u32, TrafficRecord { key: None, value: r.value.clone() }),
            _ => (crc32(&identity) % n, r.clone()),
        };
        let placed = (placed.0 as i32, placed.1);
        if seen.insert(identity) {
            first.push(placed);
        } else {
            later.push(placed);
        }
    }
    (first, later)
}

/// Totals per (tenant, customer, meter, hour as RFC 3339).
pub type HourTotals = std::collections::BTreeMap<(String, String, String, String), rust_decimal::Decimal>;

/// The rollups topic read as a compacted topic is: the latest record of
/// each key. Returns each counter-hour's total summed over partitions, as
/// `(tenant, customer, meter, hour) -> sum`, and the adjustments' event ids.
pub fn rollup_totals(records: &[ReadRecord]) -> (HourTotals, Vec<String>) {
    let mut latest: std::collections::BTreeMap<Vec<u8>, &ReadRecord> = std::collections::BTreeMap::new();
    let mut ordered: Vec<&ReadRecord> = records.iter().collect();
    ordered.sort_by_key(|r| (r.partition, r.offset));
    for r in ordered {
        latest.insert(r.key.clone().expect("rollup records are keyed"), r);
    }
    let mut totals = std::collections::BTreeMap::new();
    let mut adjustments = Vec::new();
    for r in latest.values() {
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().expect("value")).expect("rollup JSON");
        let s = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
        match v["type"].as_str() {
            Some("rollup") => {
                let sum: rust_decimal::Decimal = s("sum").parse().expect("sum");
                *totals.entry((s("tenant_id"), s("customer_id"), s("meter"), s("hour"))).or_default() += sum;
            }
            Some("adjustment") => adjustments.push(s("event_id")),
            other => panic!("unknown rollups record type {other:?}"),
        }
    }
    (totals, adjustments)
}

/// The same totals computed from the accepted events of the output topic.
pub fn output_totals(output: &[ReadRecord]) -> HourTotals {
    let mut totals = std::collections::BTreeMap::new();
    for r in output {
        let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().expect("value")).expect("output JSON");
        let s = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
        let ms = dedupd::ledger::parse_bound(&s("timestamp")).expect("timestamp");
        let hour = dedupd::event::format_timestamp_ms(dedupd::ledger::hour_of(ms));
        let qty: rust_decimal::Decimal = s("quantity").parse().expect("quantity");
        *totals.entry((s("tenant_id"), s("customer_id"), s("meter"), hour)).or_default() += qty;
    }
    totals
}
