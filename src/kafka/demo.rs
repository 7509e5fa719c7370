//! `dedupd demo`: librdkafka's in-process mock cluster, a realistic stream of
//! usage events with every kind of trouble, and the real worker on it.
//!
//! The traffic (time compressed: "minutes later" arrives a wave later):
//! several tenants; client retries of the same event one and two waves
//! later; a retry storm (one tenant re-sending a block of events many
//! times); conflicts (same id, different quantity); malformed and
//! out-of-policy records (bad JSON, non-UTF-8, unknown and missing fields,
//! negative quantity, future and too-old timestamps, a 1 MB record, a
//! tombstone) and unkeyed records.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::classify::Clock;
use crate::event::{crc32, id_hash, Partitioner, DAY_MS};
use crate::kafka::error::KafkaError;
use crate::kafka::settings::{DeliveryMode, RunSettings, Topics};
use crate::kafka::worker::{run, RunReport, WorkerParts};
use crate::metrics::Bucket;

/// Settings of the demo.
#[derive(Clone, Debug)]
pub struct DemoSettings {
    /// Distinct valid events (before retries, conflicts and bad records).
    pub events: usize,
    pub partitions: i32,
    pub delivery: DeliveryMode,
    /// Where to serve metrics; port 0 picks one.
    pub metrics_addr: Option<SocketAddr>,
    /// Pause between traffic waves (the "seconds to minutes" of retries).
    pub wave_pause: Duration,
}

impl Default for DemoSettings {
    fn default() -> DemoSettings {
        DemoSettings {
            events: 5_000,
            partitions: 4,
            delivery: DeliveryMode::ExactlyOnce,
            metrics_addr: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            wave_pause: Duration::from_millis(500),
        }
    }
}

/// One generated input record.
#[derive(Clone, Debug)]
pub struct TrafficRecord {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
}

/// Generated traffic, in waves, with the buckets it must produce.
#[derive(Clone, Debug, Default)]
pub struct Traffic {
    pub waves: Vec<Vec<TrafficRecord>>,
    pub expected: Expected,
}

/// Bucket counts the traffic must produce.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Expected {
    pub accepted: u64,
    pub duplicate: u64,
    pub conflict: u64,
    pub rejected: u64,
    pub unkeyed: u64,
}

impl Traffic {
    pub fn total(&self) -> u64 {
        self.waves.iter().map(|w| w.len() as u64).sum()
    }
}

fn event_json(tenant: &str, id: &str, customer: &str, qty: &str, ts_ms: i64) -> Vec<u8> {
    format!(
        r#"{{"event_id":"{id}","tenant_id":"{tenant}","customer_id":"{customer}","meter":"api_calls","quantity":"{qty}","timestamp":{ts_ms},"unit":"requests","dimensions":{{"region":"eu"}}}}"#
    )
    .into_bytes()
}

fn keyed(tenant: &str, id: &str, value: Vec<u8>) -> TrafficRecord {
    let mut key = tenant.as_bytes().to_vec();
    key.push(0);
    key.extend_from_slice(id.as_bytes());
    TrafficRecord { key: Some(key), value: Some(value) }
}

/// Generates the demo traffic for `events` distinct events at `now_ms`.
/// Deterministic for a given `now_ms`.
pub fn generate_traffic(events: usize, now_ms: i64) -> Traffic {
    const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];
    let mut t = Traffic { waves: vec![Vec::new(), Vec::new(), Vec::new()], expected: Expected::default() };
    let mut originals = Vec::with_capacity(events);
    for i in 0..events {
        let tenant = TENANTS[i % TENANTS.len()];
        let id = format!("evt-{i:07}");
        let ts = now_ms - (i as i64 % 3600) * 1000;
        let qty = format!("{}.{}", 1 + i % 50, i % 10);
        let value = event_json(tenant, &id, &format!("cus-{}", i % 97), &qty, ts);
        originals.push((tenant, id.clone(), value.clone(), ts));
        t.waves[0].push(keyed(tenant, &id, value));
        t.expected.accepted += 1;
    }
    // Client retries: ~3% again one wave later, ~1% two waves later.
    for (i, (tenant, id, value, _)) in originals.iter().enumerate() {
        if i % 33 == 0 {
            t.waves[1].push(keyed(tenant, id, value.clone()));
            t.expected.duplicate += 1;
        }
        if i % 97 == 5 {
            t.waves[2].push(keyed(tenant, id, value.clone()));
            t.expected.duplicate += 1;
        }
    }
    // A retry storm: globex re-sends a block of 50 events ten times.
    for round in 0..10 {
        for (tenant, id, value, _) in originals.iter().filter(|(t, ..)| *t == "globex").take(50) {
            let wave = 1 + round % 2;
            t.waves[wave].push(keyed(tenant, id, value.clone()));
            t.expected.duplicate += 1;
        }
    }
    // Conflicts: same id, a different quantity (0.2%).
    for (i, (tenant, id, _, ts)) in originals.iter().enumerate() {
        if i % 500 == 7 {
            let v = event_json(tenant, id, &format!("cus-{}", i % 97), "999.5", *ts);
            t.waves[1].push(keyed(tenant, id, v));
            t.expected.conflict += 1;
        }
    }
    // Bad records.
    let bad = |t: &mut Traffic, key: Option<&[u8]>, value: Option<Vec<u8>>| {
        t.waves[2].push(TrafficRecord { key: key.map(<[u8]>::to_vec), value });
        t.expected.rejected += 1;
        if key.is_none() {
            t.expected.unkeyed += 1;
        }
    };
    bad(&mut t, Some(b"acme\0broken"), Some(b"{\"event_id\": \"x\", ".to_vec()));
    bad(&mut t, Some(b"acme\0binary"), Some(vec![0xff, 0xfe, 0x00, 0x9f, 0x92, 0x96]));
    bad(&mut t, Some(b"acme\0unknown"), Some(br#"{"event_id":"u1","tenant_id":"acme","customer_id":"c","meter":"m","quantity":1,"timestamp":1,"colour":"red"}"#.to_vec()));
    bad(
        &mut t,
        Some(b"acme\0missing"),
        Some(br#"{"event_id":"m1","tenant_id":"acme","meter":"m","quantity":1}"#.to_vec()),
    );
    bad(&mut t, Some(b"initech\0neg"), Some(event_json("initech", "neg-1", "c", "-5", now_ms)));
    bad(&mut t, Some(b"initech\0future"), Some(event_json("initech", "fut-1", "c", "1", now_ms + 2 * 3_600_000)));
    bad(&mut t, Some(b"initech\0old"), Some(event_json("initech", "old-1", "c", "1", now_ms - 40 * DAY_MS)));
    bad(&mut t, Some(b"umbrella\0huge"), Some(vec![b'x'; 1 << 20]));
    bad(&mut t, Some(b"umbrella\0tombstone"), None);
    bad(&mut t, None, Some(b"not json at all".to_vec()));
    bad(&mut t, None, Some(event_json("umbrella", "qty-bad", "c", "1e999999", now_ms)));
    t
}

/// What the demo saw.
#[derive(Clone, Debug)]
pub struct DemoReport {
    pub expected: Expected,
    pub run: RunReport,
    pub produced: u64,
    pub metrics_addr: Option<SocketAddr>,
}

impl DemoReport {
    /// The bucket table the demo prints.
    pub fn table(&self) -> String {
        let e = &self.expected;
        let r = &self.run;
        let mut s = String::new();
        s.push_str("bucket       observed   expected\n");
        for (name, got, want) in [
            ("accepted", r.accepted, e.accepted),
            ("duplicate", r.duplicate, e.duplicate),
            ("conflict", r.conflict, e.conflict),
            ("rejected", r.rejected, e.rejected),
            ("replayed", r.replayed, 0),
        ] {
            s.push_str(&format!("{name:<12} {got:>8}   {want:>8}\n"));
        }
        s.push_str(&format!("input records produced: {}\n", self.produced));
        s
    }
}

/// Keeps the mock cluster on its own thread (it is not `Send`) until the
/// returned sender is dropped.
fn start_mock_cluster(partitions: i32, topics: &Topics) -> Result<(String, std::sync::mpsc::Sender<()>), KafkaError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let topics = topics.clone();
    std::thread::Builder::new()
        .name("dedupd-mock-cluster".into())
        .spawn(move || {
            let started = (|| {
                let mock = MockCluster::new(3)?;
                mock.create_topic(&topics.input, partitions, 1)?;
                mock.create_topic(&topics.output, partitions, 1)?;
                mock.create_topic(&topics.conflicts, 1, 1)?;
                mock.create_topic(&topics.rejected, 1, 1)?;
                if let Some(rollups) = &topics.rollups {
                    mock.create_topic(rollups, partitions, 1)?;
                }
                Ok::<_, rdkafka::error::KafkaError>(mock)
            })();
            match started {
                Ok(mock) => {
                    let _ = ready_tx.send(Ok(mock.bootstrap_servers()));
                    let _ = stop_rx.recv();
                    drop(mock);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| KafkaError::Task { detail: format!("cannot start the mock cluster thread: {e}") })?;
    let brokers = ready_rx
        .recv()
        .map_err(|_| KafkaError::Task { detail: "mock cluster thread died".into() })?
        .map_err(KafkaError::client("starting the mock cluster"))?;
    Ok((brokers, stop_tx))
}

/// The partition a producer following the keying contract gives a record
/// keyed `tenant_id \0 event_id`: the one the `dedupd` partitioner assigns
/// that identity. Other keys go by CRC-32 (librdkafka's default).
pub fn home_partition(key: &[u8], partitions: i32) -> i32 {
    let n = u32::try_from(partitions).unwrap_or(1);
    let text = std::str::from_utf8(key).ok();
    match text.and_then(|t| t.split_once('\0')) {
        Some((tenant, event)) => Partitioner::Dedupd.partition_of(&id_hash(tenant, event), tenant, event, n),
        None => (crc32(key) % n.max(1)) as i32,
    }
}

/// Produces `records` where the keying contract puts them
/// ([`home_partition`]; unkeyed ones spread), waiting for every ack.
pub async fn produce_traffic(
    producer: &FutureProducer,
    topic: &str,
    partitions: i32,
    records: &[TrafficRecord],
) -> Result<(), KafkaError> {
    let mut placed = Vec::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        let p = match &r.key {
            Some(k) => home_partition(k, partitions),
            None => (i % partitions.max(1) as usize) as i32,
        };
        placed.push((p, r));
    }
    produce_placed(producer, topic, &placed).await
}

/// Produces each record to the partition given with it, waiting for every
/// ack (tests place records on purpose, e.g. on the wrong partition).
pub async fn produce_placed(
    producer: &FutureProducer,
    topic: &str,
    records: &[(i32, &TrafficRecord)],
) -> Result<(), KafkaError> {
    let mut pending = Vec::new();
    for &(partition, r) in records {
        let mut fr: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).partition(partition);
        if let Some(k) = &r.key {
            fr = fr.key(k.as_slice());
        }
        if let Some(v) = &r.value {
            fr = fr.payload(v.as_slice());
        }
        // send_result enqueues now (an async `send` would only enqueue when
        // awaited, one record per linger interval).
        let f = loop {
            match producer.send_result(fr) {
                Ok(f) => break f,
                Err((
                    rdkafka::error::KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull),
                    back,
                )) => {
                    fr = back;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err((e, _)) => return Err(KafkaError::Client { operation: "producing demo traffic", source: e }),
            }
        };
        pending.push(f);
        if pending.len() >= 10_000 {
            for f in pending.drain(..) {
                await_delivery(f).await?;
            }
        }
    }
    for f in pending {
        await_delivery(f).await?;
    }
    Ok(())
}

async fn await_delivery(f: rdkafka::producer::DeliveryFuture) -> Result<(), KafkaError> {
    match f.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) => Err(KafkaError::Client { operation: "producing demo traffic", source: e }),
        Err(_) => Err(KafkaError::Client {
            operation: "producing demo traffic",
            source: rdkafka::error::KafkaError::Canceled,
        }),
    }
}

/// Runs the demo: mock cluster, traffic, the worker, until every input
/// record is in a bucket. Prints the metrics address when it is known.
pub async fn demo(settings: DemoSettings, parts: WorkerParts) -> Result<DemoReport, KafkaError> {
    let topics = Topics {
        input: "usage-events".into(),
        output: "usage-events-deduped".into(),
        conflicts: "usage-conflicts".into(),
        rejected: "usage-rejected".into(),
        rollups: Some("usage-rollups".into()),
        periods: None,
    };
    let (brokers, _mock_guard) = start_mock_cluster(settings.partitions, &topics)?;
    let clock: Arc<dyn Clock> = parts.clock.clone();
    let metrics = parts.metrics.clone();
    let traffic = generate_traffic(settings.events, clock.now_ms());
    let total = traffic.total();

    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("message.max.bytes", "2000000")
        .set("linger.ms", "5")
        .create()
        .map_err(KafkaError::client("creating the demo traffic producer"))?;

    let mut run_settings = RunSettings::new(&brokers, "dedupd-demo", topics.clone());
    run_settings.delivery = settings.delivery;
    run_settings.metrics_addr = settings.metrics_addr;
    run_settings.operation_timeout = Duration::from_secs(10);

    // Pick the metrics port now so it can be printed before traffic starts.
    let metrics_addr = match settings.metrics_addr {
        Some(a) if a.port() == 0 => {
            let l = std::net::TcpListener::bind(a)
                .map_err(|e| KafkaError::Task { detail: format!("cannot pick a metrics port: {e}") })?;
            let a = l.local_addr().map_err(|e| KafkaError::Task { detail: e.to_string() })?;
            drop(l);
            Some(a)
        }
        other => other,
    };
    run_settings.metrics_addr = metrics_addr;
    if let Some(a) = metrics_addr {
        println!("dedupd demo: metrics on http://{a}/metrics (readiness on /readyz)");
    }
    println!("dedupd demo: mock Kafka at {brokers}; producing {total} records in {} waves", traffic.waves.len());

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(run(run_settings, parts, async move {
        let _ = stop_rx.await;
    }));
    for (i, wave) in traffic.waves.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(settings.wave_pause).await;
        }
        produce_traffic(&producer, &topics.input, settings.partitions, wave).await?;
    }
    let seen = || Bucket::ALL.iter().map(|b| metrics.events(*b)).sum::<u64>();
    let mut waited = Duration::ZERO;
    while seen() < total && !worker.is_finished() && waited < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
    }
    // Then until the worker's own lag gauge has said every partition is
    // caught up across a whole statistics interval (librdkafka ticks every
    // second, and one tick can carry an end offset older than the last
    // record produced), so the demo's metrics page shows what an operator
    // would check, lag 0 everywhere, for at least that long before the
    // worker leaves and its partitions' gauges go with them.
    let caught_up = || (0..settings.partitions).all(|p| metrics.consumer_lag(p) == Some(0));
    let mut waited = Duration::ZERO;
    let mut held = Duration::ZERO;
    while held < Duration::from_millis(1200) && !worker.is_finished() && waited < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
        held = if caught_up() { held + Duration::from_millis(100) } else { Duration::ZERO };
    }
    let _ = stop_tx.send(());
    let run = worker.await.map_err(|e| KafkaError::Task { detail: e.to_string() })??;
    Ok(DemoReport { expected: traffic.expected, run, produced: total, metrics_addr })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traffic_expectations_add_up_to_what_is_produced() {
        let t = generate_traffic(2000, 1_790_000_000_000);
        let e = t.expected;
        assert_eq!(e.accepted + e.duplicate + e.conflict + e.rejected, t.total());
        assert!(e.conflict > 0 && e.rejected >= 10 && e.duplicate > 500 && e.unkeyed == 2);
    }
}
