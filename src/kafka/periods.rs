//! Billing periods on Kafka: the compacted periods topic.
//!
//! Every record is the latest word on one (tenant, period), keyed by it, and
//! carries the period's whole history and its snapshot (see
//! [`crate::ledger::PeriodRecord`]), so compaction loses nothing a reader
//! needs. `dedupd period close|reopen --brokers` reads the topic and the
//! rollups topic, decides ([`PeriodBook::act`]) and publishes one record;
//! every worker follows the topic ([`PeriodFollower`]) and rejects usage
//! into the periods it says are closed.
//!
//! A worker learns of a close within moments, not atomically: usage it
//! accepted into the month in between is in the output, in the rollups and
//! so in the month's total, and `period show` reports it as pending on top
//! of the snapshot. Nothing is lost or counted twice; it is a line on the
//! next invoice rather than a rejection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::consumer::BaseConsumer;
use rdkafka::error::KafkaError as RdError;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::event::ClosedPeriods;
use crate::kafka::clients::repair_consumer_config;
use crate::kafka::error::KafkaError;
use crate::kafka::settings::RunSettings;
use crate::kafka::usage::{assign_from_beginning, read_rollups, read_topic, Brokers, RollupsTopic};
use crate::ledger::{period_totals, Period, PeriodAction, PeriodBook, PeriodRecord, PeriodReport};
use crate::metrics::Metrics;

/// The book as the periods topic holds it: the latest record of each key
/// (a tombstone forgets its period).
pub fn read_book(brokers: &Brokers, topic: &str) -> Result<PeriodBook, KafkaError> {
    let mut book = PeriodBook::default();
    read_topic(brokers, topic, |p, o, value, m| {
        take_record(&mut book, m.key(), value)
            .map_err(|why| KafkaError::Task { detail: format!("{topic} record {p}@{o} is not a period: {why}") })
    })?;
    Ok(book)
}

/// Folds one periods-topic record into `book`.
fn take_record(book: &mut PeriodBook, key: Option<&[u8]>, value: Option<&[u8]>) -> Result<(), String> {
    match value {
        Some(v) => {
            let record = PeriodRecord::from_json(v)?;
            if key.is_some_and(|k| k != record.key().as_slice()) {
                return Err(format!("its key does not name {} of {:?}", record.period, record.tenant_id));
            }
            book.insert(record);
            Ok(())
        }
        None => {
            let key = key.ok_or("a tombstone without a key")?;
            let text = std::str::from_utf8(key).map_err(|_| "a key that is not UTF-8")?;
            let mut parts = text.split('\0');
            match (parts.next(), parts.next(), parts.next().map(Period::parse), parts.next()) {
                (Some("period"), Some(tenant), Some(Ok(period)), None) => {
                    book.remove(tenant, period);
                    Ok(())
                }
                _ => Err(format!("a tombstone with key {text:?}")),
            }
        }
    }
}

/// `dedupd period close|reopen|show --brokers`: the deployment's book and
/// the whole rollups topic (every partition's share) decide; a close or
/// reopen is published and acknowledged by every in-sync replica before
/// this returns. Two operators closing the same period at the same moment
/// both succeed and the later record stands: close a period from one place.
pub fn act_on_topics(
    brokers: &Brokers,
    periods_topic: &str,
    rollups_topic: &str,
    action: PeriodAction,
    tenant_id: &str,
    period: Period,
    now_ms: i64,
) -> Result<PeriodReport, KafkaError> {
    let book = read_book(brokers, periods_topic)?;
    let RollupsTopic { rollups, adjustments } = read_rollups(brokers, rollups_topic)?;
    let now =
        period_totals(tenant_id, period, rollups.iter().map(|(k, _, r)| (k, r)), adjustments.iter().map(|(_, a)| a))?;
    let (changed, report) = book.act(action, tenant_id, period, now_ms, &now).map_err(KafkaError::Config)?;
    if let Some(record) = changed {
        publish(brokers, periods_topic, &record)?;
    }
    Ok(report)
}

fn publish(brokers: &Brokers, topic: &str, record: &PeriodRecord) -> Result<(), KafkaError> {
    let mut cfg = rdkafka::config::ClientConfig::new();
    cfg.set("bootstrap.servers", &brokers.servers)
        .set("client.id", "dedupd-period")
        .set("message.timeout.ms", brokers.timeout.as_millis().to_string());
    crate::kafka::clients::apply_properties(&mut cfg, &brokers.properties, crate::kafka::clients::ClientKind::Producer);
    // Forced: a close is acknowledged by every in-sync replica, once.
    cfg.set("acks", "all").set("enable.idempotence", "true");
    let producer: FutureProducer = cfg.create().map_err(KafkaError::client("creating the periods producer"))?;
    let key = record.key();
    let value = record.to_json().to_string();
    let delivery = producer
        .send_result(FutureRecord::to(topic).key(&key).payload(&value))
        .map_err(|(e, _)| KafkaError::client("publishing the period")(e))?;
    match futures::executor::block_on(delivery) {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) => Err(KafkaError::client("publishing the period")(e)),
        Err(_) => Err(KafkaError::Task { detail: "the periods producer stopped before acknowledging".into() }),
    }
}

/// A worker's reader of the periods topic: keeps `closed` equal to the
/// periods the topic says are closed, from before the first batch until the
/// worker stops.
pub struct PeriodFollower {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PeriodFollower {
    /// Reads the topic to its end (so no usage is accepted into a period
    /// closed while the worker was down), then follows it on a thread of its
    /// own. Fails if the topic is missing, holds a record that is not a
    /// period, or cannot be read to its end within `timeout`.
    pub async fn start(
        settings: &RunSettings,
        topic: &str,
        closed: ClosedPeriods,
        metrics: Arc<Metrics>,
        timeout: Duration,
    ) -> Result<PeriodFollower, KafkaError> {
        let mut cfg = repair_consumer_config(settings);
        // Unlike repair, the reader follows the topic for the worker's life:
        // a position the log no longer holds (the topic recreated, records
        // deleted) starts it again from the earliest record kept (the topic
        // is compacted: it holds every period's latest state), rather than
        // stopping it for good.
        cfg.set("group.id", format!("{}-periods", settings.group)).set("auto.offset.reset", "earliest");
        let consumer: BaseConsumer = cfg.create().map_err(KafkaError::client("creating the periods reader"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let (topic, brokers, flag) = (topic.to_owned(), settings.brokers.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("dedupd-periods".into())
            .spawn(move || follow(consumer, &topic, &brokers, Known { closed, metrics }, &flag, timeout, ready_tx))
            .map_err(|e| KafkaError::Task { detail: format!("starting the periods reader: {e}") })?;
        let follower = PeriodFollower { stop, thread: Some(thread) };
        // The thread answers within its own deadlines (metadata, watermarks,
        // then `timeout` to read to the end); this wait only guards against
        // a thread that never answers.
        let ready = tokio::task::spawn_blocking(move || ready_rx.recv_timeout(timeout * 4))
            .await
            .map_err(|e| KafkaError::Task { detail: e.to_string() })?;
        match ready {
            Ok(Ok(())) => Ok(follower),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(KafkaError::Task {
                detail: format!("the periods reader did not finish reading its topic within {:?}", timeout * 4),
            }),
        }
    }
}

impl Drop for PeriodFollower {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where the follower keeps what it knows: the validators' closed set and
/// the `dedupd_closed_periods` gauge.
struct Known {
    closed: ClosedPeriods,
    metrics: Arc<Metrics>,
}

impl Known {
    fn set(&self, book: &PeriodBook) {
        let closed = book.closed();
        self.metrics.set_closed_periods(closed.len());
        self.closed.replace(closed);
    }
}

/// The follower's loop: catch up (reporting on `ready`), then keep
/// following until `stop`.
fn follow(
    consumer: BaseConsumer,
    topic: &str,
    brokers: &str,
    known: Known,
    stop: &AtomicBool,
    timeout: Duration,
    ready: mpsc::Sender<Result<(), KafkaError>>,
) {
    let mut ends = match assign_from_beginning(&consumer, topic, brokers, timeout) {
        Ok(ends) => ends,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut ready = Some(ready);
    let mut book = PeriodBook::default();
    let started = std::time::Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if ends.is_empty() {
            if let Some(r) = ready.take() {
                known.set(&book);
                tracing::info!(topic, closed = book.closed().len(), "periods read");
                let _ = r.send(Ok(()));
            }
        } else if started.elapsed() > timeout {
            if let Some(r) = ready.take() {
                let _ = r.send(Err(KafkaError::Task {
                    detail: format!("reading the periods topic {topic} to its end took over {timeout:?}"),
                }));
                return;
            }
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let (p, o) = (m.partition(), m.offset());
                match take_record(&mut book, m.key(), m.payload()) {
                    Ok(()) if ready.is_none() => {
                        known.set(&book);
                        tracing::info!(
                            topic,
                            partition = p,
                            offset = o,
                            closed = book.closed().len(),
                            "periods changed"
                        );
                    }
                    Ok(()) => {}
                    Err(why) => {
                        let detail = format!("{topic} record {p}@{o} is not a period: {why}");
                        match ready.take() {
                            Some(r) => {
                                let _ = r.send(Err(KafkaError::Task { detail }));
                                return;
                            }
                            // Later: keep what is known (a bad record
                            // closes or opens nothing) and say so loudly.
                            None => tracing::error!(%detail, "periods record skipped"),
                        }
                    }
                }
                if ends.get(&p).is_some_and(|end| o + 1 >= *end) {
                    ends.remove(&p);
                }
            }
            Some(Err(RdError::PartitionEOF(p))) => {
                ends.remove(&p);
            }
            Some(Err(e)) => tracing::warn!(topic, error = %e, "reading the periods topic"),
            None => {}
        }
    }
}
